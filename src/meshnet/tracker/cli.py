"""``meshnet tracker``: serve the tracker (:mod:`meshnet.tracker.server`) and its web dashboard
(:mod:`meshnet.dashboard`) until SIGINT/SIGTERM.

``meshnet tracker [--host H] [--port 7700] [--heartbeat S] [--join-token T] [--tls-cert C --tls-key K]
[--ledger URL] [--require-signatures] [--dashboard-port 7780] [--dashboard-host 127.0.0.1]``
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from meshnet.arg_types import TRACKER_PORT, heartbeat_seconds, listen_host, port_number
from meshnet.secret_args import join_token
from meshnet.dashboard.cli import add_dashboard_args, dashboard_from_args, dashboard_port_problem, dashboard_port_taken
from meshnet.supervisor import on_stop_signals, wait_for_stop
from meshnet.tracker.server import start_tracker
from meshnet.wire.addresses import (WILDCARD_HOSTS, bind_problem, format_address, is_loopback_host,
                                    this_machine_address)
from meshnet.wire.security import JOIN_TOKEN_ENV, TlsConfig


def add_tracker_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``tracker`` subcommand to ``subparsers`` (``set_defaults(func=run_tracker)``)."""
    p = subparsers.add_parser("tracker", help="run the tracker: node registry and route planner",
                              description="Run the tracker: nodes register and heartbeat here, clients ask it "
                                          "for a route (a chain of nodes covering every layer).")
    p.add_argument("--host", type=listen_host, default="127.0.0.1", help="address to listen on (default %(default)s; "
                                                       "0.0.0.0 for every interface)")
    p.add_argument("--port", type=port_number, default=TRACKER_PORT, help="port (default %(default)s; 0 = any free port)")
    p.add_argument("--heartbeat", type=heartbeat_seconds, default=2.0, metavar="SECONDS",
                   help="heartbeat interval nodes are told to use; a node silent for 3 intervals leaves "
                        "routing (default %(default)s)")
    p.add_argument("--join-token", type=join_token, default=os.environ.get(JOIN_TOKEN_ENV),
                   help=f"refuse callers without this shared secret (default: ${JOIN_TOKEN_ENV}, if set)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS (needs --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--ledger", default=None, metavar="URL",
                   help="SQLAlchemy URL of the ledger database (work credited to nodes, tokens charged to "
                        "clients, node keys): sqlite:////ABSOLUTE/PATH (four slashes; with three the path is "
                        "relative) or postgresql+psycopg://USER:PASS@HOST/DB; "
                        "default sqlite:///$XDG_DATA_HOME/meshnet/ledger.db (~/.local/share/meshnet/ledger.db); "
                        "sqlite:// keeps it in memory")
    p.add_argument("--require-signatures", action="store_true",
                   help="refuse nodes that do not sign their messages (older nodes); by default an unsigned "
                        "node is accepted unless its id belongs to a key")
    add_dashboard_args(p)
    p.set_defaults(func=run_tracker)
    return p


def _sweep_until(registry, stop: threading.Event) -> None:
    while not stop.wait(registry.heartbeat_interval_s):
        registry.alive()


def reached_at(host: str, port: int) -> str | None:
    """The line saying where other machines reach a tracker listening on every interface (``host`` a
    wildcard) at ``port``: this machine's address, or that it cannot be told here. None for another host."""
    if host not in WILDCARD_HOSTS:
        return None
    if (here := this_machine_address(host)) not in WILDCARD_HOSTS:
        return f"tracker: other machines reach it at {format_address(here, port)}"
    # It serves, but nothing here says what others should dial (and its dashboard line names no address).
    return (f"tracker: this machine has no default route, so its address on the network other machines share "
            f"is not known here: they reach the tracker at that address, port {port}")


def run_tracker(args: argparse.Namespace) -> int:
    """CLI entry: serve until SIGINT/SIGTERM, then stop cleanly. Returns the exit code (0, or 2 for bad
    arguments / an address that cannot be bound)."""
    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    problem = dashboard_port_problem(args.dashboard_port)
    if not problem and args.port > 0 and args.port == args.dashboard_port:
        # The tracker took the port and the dashboard went without one, with a notice, where a dashboard port
        # taken by another process is refused (and `meshnet up` refuses the same port twice).
        problem = (f"--port and --dashboard-port are both {args.port}: the tracker and the dashboard each need a "
                   "port of their own")
    problem = problem or dashboard_port_taken(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    token = args.join_token or None  # the flag's default is $MESHNET_JOIN_TOKEN
    tls = TlsConfig(args.tls_cert, args.tls_key) if args.tls_cert else None
    from meshnet.ledger.database import default_ledger_url
    from meshnet.ledger.store import Ledger, LedgerError

    ledger_url = getattr(args, "ledger", None) or default_ledger_url()
    # The port first: a second tracker started on a taken port was told of the first one's ledger lock,
    # after waiting 5 s for it.
    if args.port and (why := bind_problem(args.host, args.port)) is not None:
        print(f"error: the tracker cannot listen on {format_address(args.host, args.port)}: {why}; pass another "
              f"--port (0 = any free port) or --host", file=sys.stderr)
        return 2
    try:
        ledger = Ledger(ledger_url)
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        server, port, service = start_tracker(args.host, args.port, args.heartbeat, join_token=token, tls=tls,
                                              ledger=ledger, require_signatures=getattr(args, "require_signatures", False))
    except (RuntimeError, ValueError) as e:
        ledger.close()
        print(f"error: {e}", file=sys.stderr)
        return 2

    stop = threading.Event()
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        previous = on_stop_signals(stop.set)
    print(f"tracker listening on {format_address(args.host, port)}", file=sys.stderr, flush=True)
    if (where := reached_at(args.host, port)) is not None:
        print(where, file=sys.stderr, flush=True)
    if not token and not is_loopback_host(args.host):
        print(f"tracker: no join token: anyone who reaches port {port} can join nodes to this mesh and use it "
              f"(pass --join-token, or set ${JOIN_TOKEN_ENV}, on every machine)", file=sys.stderr, flush=True)
    # Nodes joining and leaving, a line each, and warnings (callers refused for their join token, nodes
    # refused at registration), all timestamped: warnings went out bare through logging's last resort.
    meshnet_log = logging.getLogger("meshnet")
    if not meshnet_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s tracker: %(message)s"))
        meshnet_log.addHandler(handler)
        meshnet_log.setLevel(logging.WARNING)
        logging.getLogger("meshnet.tracker.members").setLevel(logging.INFO)
    # Expired entries are dropped when routes or lists are read: with nobody asking, a dead node was never
    # said to have left. A sweep each heartbeat interval says it within one.
    threading.Thread(target=_sweep_until, args=(service.registry, stop), daemon=True, name="tracker-sweep").start()
    dashboard = dashboard_from_args(service, args, "tracker:")
    print(f"tracker: ledger {ledger.display_url}", file=sys.stderr, flush=True)
    extras = [x for x in ("TLS" if tls else "", "join token required" if token else "",
                          "signatures required" if getattr(args, "require_signatures", False) else "") if x]
    if extras:
        print(f"tracker: {', '.join(extras)}", file=sys.stderr, flush=True)
    try:
        wait_for_stop(stop)
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if dashboard is not None:
            dashboard.stop()
        server.stop(grace=1.0).wait()
        ledger.close()
    print("tracker stopped", file=sys.stderr, flush=True)
    return 0
