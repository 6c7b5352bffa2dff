"""A node: load a layer range, serve it over gRPC, register with the tracker and keep
heart-beating; free idle sessions; drain and deregister when stopped.

A node is put together from parts that each have one job: the engine, in a supervised worker process
(:mod:`meshnet.node.worker_supervisor`; ``--in-process-engine`` runs it here instead), the session
service that checks frames and maps statuses (:mod:`meshnet.node.service`), its transports (gRPC and the
raw-TCP data plane, or with ``--relay`` one stream to the tracker: :mod:`meshnet.node.relay_link`), and
its membership in the tracker (:mod:`meshnet.node.membership`).

Its command line, ``meshnet node``, is :mod:`meshnet.node.cli`.

With ``--relay`` the node opens no port at all: it registers as relayed (address ``relay:<node_id>``)
and keeps one outbound ``Relay`` stream to the tracker, over which the tracker forwards steps and
control calls; the ready line waits until that stream is attached.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from meshnet import __version__
from meshnet.engine.kv_pool import available_memory_bytes
from meshnet.ledger.reporting import WorkReporter
from meshnet.membership.identity import node_identity
from meshnet.node.advertised_check import check_advertised_address
from meshnet.node.config import NodeConfig
from meshnet.node.engine_loader import load_engine, load_failure, measure_decode_speed
from meshnet.node.membership import Membership
from meshnet.node.registered_peers import LIST_TIMEOUT_S, RegisteredPeers
from meshnet.node.relay_link import RelayLink
from meshnet.node.service import NodeService
from meshnet.node.speed_probe import REPROBE_EVERY_S, IdleSpeed
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.data_plane_server import DataPlaneServer
from meshnet.wire.envelope import PROTOCOL_MAJOR, PROTOCOL_MINOR
from meshnet.wire.addresses import WILDCARD_HOSTS, dialable_host, format_address, os_reason
from meshnet.wire.security import (add_port, client_ssl_context, make_server, open_channel, server_ssl_context,
                                   unnamed_host_problem)

log = logging.getLogger("meshnet.node")

# While draining, a session unused for DRAIN_IDLE_S and for DRAIN_GAP_FACTOR times its longest wait between
# two steps so far is released: a client that exited (killed, cut off) never ends its session, which would
# otherwise hold the node up for the whole --drain-timeout, while a live one comes back within its usual
# gap (a session of one step, whose gap is not known yet, is waited for). A live client that does come back
# later replays the session elsewhere.
DRAIN_IDLE_S = 5.0
DRAIN_GAP_FACTOR = 10.0
# A node at its session limit, or with its KV pool 90% reserved, releases the sessions unused for a tenth of
# --idle-timeout, and at most PRESSURE_IDLE_MAX_S, rather than the whole of it: a client that died (an API
# killed with -9) left its sessions holding the node's room for 300 s, and two such deaths filled a
# 16-session head. The cap keeps it, with a sweep's period, inside the 30 s a new client waits for room
# (a tenth of 300 s was exactly those 30 s: the client right after a crash gave up a second before the
# room was freed). A live client whose session this frees replays it on its next step.
PRESSURE_IDLE_FRACTION = 0.1
PRESSURE_IDLE_MAX_S = 15.0
PRESSURE_KV_FRACTION = 0.9


def pressure_idle_s(idle_timeout_s: float) -> float:
    """Seconds unused after which a node at its limit frees a session (see PRESSURE_IDLE_FRACTION)."""
    return min(idle_timeout_s * PRESSURE_IDLE_FRACTION, PRESSURE_IDLE_MAX_S)


def sweep_period_s(idle_timeout_s: float) -> float:
    """Seconds between the node's sweeps for idle sessions."""
    return max(0.05, min(5.0, idle_timeout_s / 2))


class Node:
    """A running node: engine, session service, transports, tracker membership, idle sweeper.
    ``start()`` then ``stop()``.

    Raises:
        ValueError: the engine could not load (bad model, range or fault spec), or --relay without a tracker.
    """

    def __init__(self, cfg: NodeConfig) -> None:
        if cfg.relay and not cfg.tracker:
            raise ValueError("--relay needs --tracker: a relayed node is reached only through its tracker")
        if cfg.tls is not None and not cfg.relay:  # a relayed node is never dialled at its own address
            # The host both ports are registered at (below), checked before the model loads.
            host = cfg.advertise.rpartition(":")[0] if cfg.advertise else dialable_host(cfg.host, cfg.tracker)
            if host not in WILDCARD_HOSTS and (problem := unnamed_host_problem(cfg.tls.cert, host)):
                raise ValueError(problem)
        self.cfg = cfg
        # The key signs every tracker message; without --node-id the id is the key's, so it cannot be
        # claimed by anyone else. Loaded before the model so a bad key file fails fast.
        self.identity = node_identity(cfg.node_id, cfg.identity)
        self.node_id = cfg.node_id or self.identity.node_id
        # Why the node must exit non-zero (the tracker refused it, its engine kept dying), or None.
        self.failure: str | None = None
        self.supervisor = None
        if cfg.in_process_engine:
            try:
                self.engine, self.loaded = load_engine(cfg)
            except Exception as e:  # noqa: BLE001 - whatever stops the load is the node's one-line error
                raise ValueError(load_failure(e, cfg)) from None
        else:
            from meshnet.node.worker_engine import WorkerEngine
            from meshnet.node.worker_supervisor import WorkerSupervisor

            self.supervisor = WorkerSupervisor(cfg, on_give_up=self._give_up)
            self.supervisor.start()
            self.engine = WorkerEngine(self.supervisor)
            self.loaded = self.supervisor.info
        self.model = self.loaded.model
        self.decode_tokens_per_s = self.loaded.decode_tokens_per_s
        # Measured again while idle (not under injected faults, whose step counts a probe would shift).
        self.speed = IdleSpeed(self.decode_tokens_per_s, lambda: measure_decode_speed(self.engine),
                               every_s=REPROBE_EVERY_S if not cfg.fault else float("inf"))
        # Under TLS the node forwards steps over TLS, verifying its peers as clients verify it.
        peer_tls = client_ssl_context(cfg.tls_ca) if cfg.tls is not None else None
        self.service = NodeService(self.engine, self.node_id, self.model, cfg.join_token, peer_tls)
        if self.loaded.manifest:
            from meshnet.model.bundled import resolve_model
            from meshnet.node.tensor_source import TensorSource

            self.service.tensors = TensorSource(str(resolve_model(cfg.model)), self.model.sha256)
        # Completed steps wait here until membership reports them to the tracker's ledger (after a heartbeat).
        self.work = WorkReporter(self.node_id, self.model.sha256, self.loaded.caps.artifact.layers,
                                 sign=self.identity.sign)
        self.membership: Membership | None = None
        self.relay: RelayLink | None = None
        if cfg.tracker:
            self.service.on_step = self.work.record
            tracker = pb_grpc.TrackerStub(open_channel(cfg.tracker, cfg.join_token, cfg.tls_ca))
            # A node with a key file keeps its peers' list beside it (see RegisteredPeers): restarted during
            # a tracker outage, it forwards to the nodes listed before.
            key = self.identity.path
            kept = (Path(key).with_suffix(".peers.json"), cfg.tracker) if key else None
            self.service.forwarder.peers = RegisteredPeers(lambda: [n.info.data_address for n in tracker.ListNodes(
                pb.Empty(), timeout=LIST_TIMEOUT_S).nodes], kept=kept)
            manifest = pb.ModelManifest(model_id=self.model.sha256, manifest=self.loaded.manifest) \
                if self.loaded.manifest else None
            self.membership = Membership(tracker, self.identity, self.node_id, self.info, self._load, self.work,
                                         self._refused, manifest)
            self.membership.on_registered = self._registered
            if cfg.relay:
                self.relay = RelayLink(tracker, self.identity, self.node_id, self.service,
                                       self.membership.registered, cfg.max_sessions)
        self.server = None
        self.port = 0
        self.data_plane = None
        self.data_address = ""
        if cfg.relay:
            # No listening socket at all: everything arrives over the outbound relay stream.
            self.address = f"relay:{self.node_id}"
        else:
            # Workers beyond the session limit answer refusals and control calls while steps run; calls
            # beyond twice that are refused (RESOURCE_EXHAUSTED) rather than queued without bound.
            self.server = make_server(cfg.join_token, max_workers=cfg.max_sessions + 8,
                                      maximum_concurrent_rpcs=2 * (cfg.max_sessions + 8))
            pb_grpc.add_NodeServicer_to_server(self.service, self.server)
            try:
                self.port = add_port(self.server, format_address(cfg.host, cfg.port), cfg.tls)
            except RuntimeError as e:  # the port is taken, or the host is not this machine's
                raise ValueError(f"{e}; pass another --port or --host") from None
            # Bound to every interface (0.0.0.0, ::), the node is dialled at the one it reaches the tracker by.
            host = dialable_host(cfg.host, cfg.tracker)
            self.address = cfg.advertise or format_address(host, self.port)
        # Steps also get a TCP data plane (far cheaper per hop than gRPC), over TLS when gRPC is.
        if cfg.data_plane and not cfg.relay:
            tls = server_ssl_context(cfg.tls) if cfg.tls is not None else None
            try:
                self.data_plane = DataPlaneServer(cfg.host, cfg.data_port, self.service.run_step, cfg.join_token,
                                                  tls=tls, run_forward=self.service.run_forward,
                                                  start_step=self.service.start_step,
                                                  start_forward=self.service.start_forward,
                                                  run_await=self.service.run_await, budget=self.service.budget,
                                                  workers=cfg.max_sessions + 2)
            except OSError as e:
                raise ValueError(f"cannot listen on {format_address(cfg.host, cfg.data_port)} (the data plane): "
                                 f"{os_reason(e)}; pass another --data-port") from None
            adv_host = cfg.advertise.rsplit(":", 1)[0] if cfg.advertise else dialable_host(cfg.host, cfg.tracker)
            self.data_address = format_address(adv_host, self.data_plane.port)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._said_open = False  # the tracker-without-a-token warning, once

    @property
    def relay_attached(self) -> threading.Event:
        """Set while the relay stream is open (relay mode; never set otherwise)."""
        return self.relay.attached if self.relay is not None else threading.Event()

    def info(self) -> pb.NodeInfo:
        c = self.loaded.caps
        # An accelerator node registers its device's free memory; a CPU node the host's.
        free = self.engine.device_free_bytes() if self.cfg.backend != "cpu" else available_memory_bytes()
        return pb.NodeInfo(node_id=self.node_id, address=self.address, model=self.model,
                           layers=pb.LayerRange(start=c.artifact.layers.start, end=c.artifact.layers.end),
                           engine=c.engine, backend=c.backend, protocol_major=PROTOCOL_MAJOR,
                           protocol_minor=PROTOCOL_MINOR, free_memory_bytes=free,
                           decode_tokens_per_s=self.decode_tokens_per_s, max_sessions=c.max_sessions,
                           data_address=self.data_address, relayed=self.cfg.relay, device=self._device_info(),
                           version=__version__, instance=self.service.instance, n_ctx=c.n_ctx,
                           numerics=c.numerics)

    def _device_info(self) -> pb.DeviceInfo | None:
        """The engine's device as registered (None for an engine without one, e.g. the fake)."""
        dev = self.loaded.device
        if not dev:
            return None
        return pb.DeviceInfo(name=dev["name"], description=dev["description"], type=dev["type"],
                             memory_total_bytes=dev["memory_total_bytes"], index=self.loaded.device_index,
                             cpu_features=dev.get("cpu_features", ()))

    def _load(self) -> tuple[int, float]:
        active = self.engine.health().active_sessions
        self.decode_tokens_per_s = self.speed.report(active)
        return active, self.decode_tokens_per_s

    def _registered(self, reply: pb.RegisterReply) -> None:
        """After each registration: the tracker's node list, and a warning where this node asks for a join
        token its tracker does not (the clients it routes here come without one, and are refused)."""
        if self.cfg.join_token and reply.open_to_all and not self._said_open:
            self._said_open = True
            log.warning("--join-token: the tracker at %s takes callers without a join token, so the clients it "
                        "routes to this node come without one, and this node refuses them; give the tracker the "
                        "same --join-token (or this node none)", self.cfg.tracker)
        self.service.forwarder.peers.refresh()

    def _refused(self, refusal: str) -> None:
        # Retrying cannot help (wrong key, wrong protocol, an id another live node holds): stop, and
        # let run_node exit non-zero with the tracker's words.
        self.failure = f"tracker refused this node: {refusal}"
        print(f"error: {self.failure}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    def _give_up(self, reason: str) -> None:
        """The engine worker keeps dying: leave the tracker now (routes stop naming this node) and exit."""
        self.failure = reason
        print(f"error: {reason}; deregistering and exiting", file=sys.stderr, flush=True)
        if self.membership is not None:
            self.membership.deregister()
        os.kill(os.getpid(), signal.SIGTERM)

    def start(self) -> None:
        if self.server is not None:
            self.server.start()
        if self.data_plane is not None:
            self.data_plane.start()
        if self.membership is not None:
            self._spawn(self.membership.run)
        if self.relay is not None:
            self._spawn(self.relay.run)
        self._spawn(self._idle_loop)
        # A TLS node without --tls-ca has nothing to verify its own certificate with (the host it names was
        # checked at start): not checked, rather than warned about a failed handshake.
        if self.cfg.advertise and self.server is not None and (self.cfg.tls is None or self.cfg.tls_ca):
            threading.Thread(target=check_advertised_address, name="advertised-check", daemon=True,
                             args=(self.address, self.service.instance, self.cfg.join_token, self.cfg.tls_ca)).start()

    def _spawn(self, fn) -> None:
        t = threading.Thread(target=fn, args=(self._stop,), daemon=True)
        t.start()
        self._threads.append(t)

    def _idle_loop(self, stop: threading.Event) -> None:
        under_pressure_s = pressure_idle_s(self.cfg.idle_timeout_s)
        while not stop.wait(sweep_period_s(self.cfg.idle_timeout_s)):
            self.service.awaited.sweep()  # awaits of forwarded steps that never came
            for sid in self.engine.release_idle(self.cfg.idle_timeout_s):
                log.info("released idle session %s", sid)
            if self._at_its_limit():
                for sid in self.engine.release_idle(under_pressure_s):
                    log.info("at its session or KV limit: released session %s, unused for %.0f s (its client "
                             "may be gone; a live one replays it)", sid, under_pressure_s)

    def _at_its_limit(self) -> bool:
        """Whether the node holds as many sessions as it may, or has most of its KV pool reserved."""
        caps, m = self.loaded.caps, self.engine.metrics()
        if caps.max_sessions and m.active_sessions >= caps.max_sessions:
            return True
        return bool(m.kv_tokens_capacity) and m.kv_tokens_reserved >= PRESSURE_KV_FRACTION * m.kv_tokens_capacity

    def stop(self, drain: bool = True) -> None:
        """Drain (refuse new sessions, let running ones finish up to drain_timeout_s), deregister, stop."""
        self.service.draining = True
        if self.membership is not None:
            self.membership.deregister()
        if drain:
            deadline = time.monotonic() + self.cfg.drain_timeout_s
            if open_sessions := self.engine.health().active_sessions:
                log.info("draining: waiting up to %.0f s for %d open session(s) to end; one without a step for "
                         "%.0f s and %.0fx its longest gap between steps is released (its client is gone)",
                         self.cfg.drain_timeout_s, open_sessions, DRAIN_IDLE_S, DRAIN_GAP_FACTOR)
            while self.engine.health().active_sessions and time.monotonic() < deadline:
                for sid in self.engine.release_idle(DRAIN_IDLE_S, DRAIN_GAP_FACTOR):
                    log.info("draining: released session %s, which had no step for over %.0f s and %.0fx its "
                             "longest gap", sid, DRAIN_IDLE_S, DRAIN_GAP_FACTOR)
                time.sleep(0.05)
            if left := self.engine.health().active_sessions:
                log.warning("draining: %d session(s) still open after --drain-timeout %.0f s; stopping",
                            left, self.cfg.drain_timeout_s)
            self.service.wait_idle(max(0.0, deadline - time.monotonic()))
        if self.membership is not None:
            self.membership.flush()  # steps finished while draining
        self._stop.set()
        if self.data_plane is not None:
            self.data_plane.stop()
        self.service.forwarder.close()
        if self.server is not None:
            self.server.stop(grace=1.0).wait()
        if self.relay is not None:
            self.relay.close()
        if self.supervisor is not None:
            self.supervisor.stop()
