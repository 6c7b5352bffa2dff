"""Starting a tracker: its gRPC server in background threads, serving :class:`TrackerService`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.registry import Registry
from meshnet.tracker.relay import TRACKER_WORKERS
from meshnet.tracker.service import TrackerService
from meshnet.wire.addresses import format_address, is_loopback_host
from meshnet.wire.security import TlsConfig, add_port, make_server

if TYPE_CHECKING:  # the ledger pulls in SQLAlchemy: imported when a tracker starts, not with the CLI
    from meshnet.ledger.store import Ledger


def serve_tracker(host: str = "127.0.0.1", port: int = 0, heartbeat_interval_s: float = 2.0,
                  join_token: str | None = None, tls: TlsConfig | None = None,
                  registry: Registry | None = None, ledger: "Ledger | str | None" = None,
                  require_signatures: bool = False) -> tuple[grpc.Server, int]:
    """Start a tracker server in background threads; as :func:`start_tracker`, without the service."""
    server, bound, _ = start_tracker(host, port, heartbeat_interval_s, join_token, tls, registry, ledger,
                                     require_signatures)
    return server, bound


def start_tracker(host: str = "127.0.0.1", port: int = 0, heartbeat_interval_s: float = 2.0,
                  join_token: str | None = None, tls: TlsConfig | None = None,
                  registry: Registry | None = None, ledger: "Ledger | str | None" = None,
                  require_signatures: bool = False) -> tuple[grpc.Server, int, TrackerService]:
    """Start a tracker server in background threads.

    Args:
        host, port: where to listen; port 0 picks a free port.
        heartbeat_interval_s: told to nodes at registration; nodes silent for 3 intervals leave routing.
        join_token: when set, calls without it are refused UNAUTHENTICATED.
        tls: serve TLS with this certificate and key instead of plaintext.
        registry: use this registry (e.g. one with a fake clock) instead of a new one; its own heartbeat
            interval then applies.
        ledger: a :class:`~meshnet.ledger.store.Ledger`, or the SQLAlchemy URL of one to open (migrated to
            the newest schema); default an in-memory ledger that ends with the server. The caller closes a
            Ledger it passed; one opened from a URL is closed when the process exits.
        require_signatures: refuse unsigned node messages even for ids no key is bound to.

    Returns:
        ``(server, bound_port, service)``; stop it with ``server.stop(grace)``. ``service`` is what the
        dashboard (:func:`meshnet.dashboard.server.start_dashboard`) reads.

    Raises:
        RuntimeError: the address cannot be bound; ValueError: bad interval or unreadable TLS files;
        LedgerError (a RuntimeError): the ledger URL cannot be opened or migrated.
    """
    registry = registry if registry is not None else Registry(heartbeat_interval_s)
    if isinstance(ledger, str):
        from meshnet.ledger.store import Ledger

        ledger = Ledger(ledger)
    service = TrackerService(registry, ledger)
    service.auth.require_signatures = require_signatures
    service.listens_beyond_loopback = not is_loopback_host(host)
    service.open_to_all = not join_token
    # Each attached relay stream and each relayed step in flight holds a worker thread (see RelayLimits).
    server = make_server(join_token, max_workers=TRACKER_WORKERS)
    pb_grpc.add_TrackerServicer_to_server(service, server)
    try:
        bound = add_port(server, format_address(host, port), tls)
    except BaseException:
        server.stop(None)
        raise
    server.start()
    return server, bound, service
