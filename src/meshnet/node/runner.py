"""``meshnet node``: load a layer range, serve it over gRPC, register with the tracker and keep
heart-beating; free idle sessions; on SIGTERM drain and deregister.

Prints ``MESHNET_NODE_READY node_id=... address=HOST:PORT`` on stdout once serving, so a parent process
(``meshnet up``, tests) can learn a port chosen by the OS; the log (stderr) names its gRPC and data-plane
addresses. A node the tracker refuses for good (wrong key or protocol, or an id that a live node at
another address holds) exits with status 1 and the tracker's message on stderr.

With ``--relay`` the node opens no port at all: it registers as relayed (address ``relay:<node_id>``)
and keeps one outbound ``Relay`` stream to the tracker, over which the tracker forwards steps and
control calls; it prints the ready line once that stream is attached.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from meshnet.contract import ArtifactId, LayerRange, LoadSpec, StepRequest, split_layers
from meshnet.engine.base import ShardEngine
from meshnet.engine.kv_pool import available_memory_bytes
from meshnet.ledger.reporting import WorkReporter
from meshnet.membership.identity import node_identity
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.data_plane_server import DataPlaneServer
from meshnet.wire.envelope import PROTOCOL_MAJOR, PROTOCOL_MINOR
from meshnet.wire.security import TlsConfig, add_port, make_server, open_channel

log = logging.getLogger("meshnet.node")

# Tracker answers after which a node stops instead of retrying its registration.
_FATAL_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
                   grpc.StatusCode.ALREADY_EXISTS)


@dataclass
class NodeConfig:
    """Everything a node needs to start (see ``meshnet node --help`` for each field)."""

    model: str
    layers: LayerRange | None
    tracker: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None  # address other processes dial; default host:port
    node_id: str | None = None
    engine: str = "ggml"  # "ggml" or "fake" (protocol tests)
    threads: int = 2
    n_ctx: int = 0
    max_sessions: int = 16
    kv_tokens: int = 0
    idle_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    join_token: str | None = None
    tls: TlsConfig | None = None
    tls_ca: str | None = None
    data_plane: bool = True  # serve steps over raw TCP as well as gRPC
    data_port: int = 0
    stages_hint: int = 0  # with layers None: split into this many stages and take the index below
    stage_index: int = 0
    cpu: int | None = None  # pin the process to this CPU (benchmarks: one core per node)
    backend: str = "cpu"  # ggml engine lane; anything but cpu must be certified on this machine
    device_index: int = 0  # which of the lane's devices (accelerator lanes only)
    identity: str | None = None  # Ed25519 key file; default <config>/meshnet/node-<node_id>.key, or a fresh key
    relay: bool = False  # accept no connections: serve through a Relay stream to the tracker (needs tracker)


def pin_to_cpu(cpu: int) -> None:
    """Run this process on CPU ``cpu`` only; threads started later (ggml's workers, gRPC's) inherit it.

    Raises:
        ValueError: ``cpu`` is not one this process may run on (the message lists those), or the
            platform cannot pin processes.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"--cpu {cpu}: pinning to a CPU is not supported on this platform")
    allowed = sorted(os.sched_getaffinity(0))
    if cpu not in allowed:
        raise ValueError(f"--cpu {cpu}: no such CPU available to this process (available: "
                         f"{', '.join(map(str, allowed))})")
    os.sched_setaffinity(0, {cpu})


def build_engine(cfg: NodeConfig) -> tuple[ShardEngine, pb.ModelIdentity]:
    """Load the engine for ``cfg``. Raises ValueError with the engine's message on a bad model/range."""
    if cfg.engine == "fake":
        from meshnet.engine.fake import FakeEngine, FakeModel

        model = FakeModel()
        layers = cfg.layers or LayerRange(0, model.n_layer)
        eng = FakeEngine(model)
        out = eng.load(LoadSpec(path="", artifact=ArtifactId(model.sha256, layers), max_sessions=cfg.max_sessions))
        if not out.ok:
            raise ValueError(out.message)
        return eng, pb.ModelIdentity(sha256=model.sha256, architecture="fake", n_layer=model.n_layer)
    from meshnet.engine.ggml_engine import GgmlEngine
    from meshnet.model.bundled import resolve_model
    from meshnet.model.gguf_file import open_gguf, sha256_file
    from meshnet.model.hparams import ModelConfig

    path = str(resolve_model(cfg.model))
    mcfg = ModelConfig.from_reader(open_gguf(path))
    layers = cfg.layers or split_layers(mcfg.n_layer, max(1, cfg.stages_hint))[cfg.stage_index]
    sha = sha256_file(path)
    if cfg.backend != "cpu":
        from meshnet.backends.lanes import require_certified
        from meshnet.backends.placement import AcceleratorEngine

        # BackendUnavailable (a ValueError) with the probe's exact reason
        require_certified(cfg.backend, cfg.device_index)
        eng = AcceleratorEngine(cfg.backend, cfg.device_index)
    else:
        eng = GgmlEngine()
    out = eng.load(LoadSpec(path=path, artifact=ArtifactId(sha, layers), n_threads=cfg.threads, n_ctx=cfg.n_ctx,
                            max_sessions=cfg.max_sessions, kv_tokens=cfg.kv_tokens))
    if not out.ok:
        raise ValueError(out.message)
    return eng, pb.ModelIdentity(sha256=sha, architecture=mcfg.architecture, n_layer=mcfg.n_layer)


def measure_decode_speed(engine: ShardEngine, steps: int = 8) -> float:
    """Tokens/s of single-token decode steps on a scratch session (what routing compares nodes by).

    The first step (a one-token prefill) is not timed: it builds graphs and, on an accelerator, loads
    kernels, which a serving node pays once."""
    import numpy as np

    from meshnet.contract import NamedTensor

    caps = engine.capabilities()
    sid = f"speed-probe-{uuid.uuid4().hex}"
    hidden = None if caps.is_head else NamedTensor.from_numpy("hidden", np.zeros((1, caps.n_embd), np.float32))
    if not engine.prefill(StepRequest(sid, 0, 0, (1,), hidden=hidden)).ok:
        engine.release(sid)
        return 0.0
    t0 = time.perf_counter()
    n = 0
    for i in range(1, steps + 1):
        if not engine.decode(StepRequest(sid, 0, i, (1,), hidden=hidden)).ok:
            break
        n += 1
    dt = time.perf_counter() - t0
    engine.release(sid)
    return n / dt if dt > 0 and n else 0.0


class Node:
    """A running node: server, tracker membership, idle sweeper. ``start()`` then ``stop()``."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        # The key signs every tracker message; without --node-id the id is the key's, so it cannot be
        # claimed by anyone else. Loaded before the model so a bad key file fails fast.
        self.identity = node_identity(cfg.node_id, cfg.identity)
        self.node_id = cfg.node_id or self.identity.node_id
        self.engine, self.model = build_engine(cfg)
        self.decode_tokens_per_s = measure_decode_speed(self.engine)
        self.service = NodeService(self.engine, self.node_id, self.model)
        # Completed steps wait here until the heartbeat loop reports them to the tracker's ledger.
        self.work = WorkReporter(self.node_id, self.model.sha256, self.engine.capabilities().artifact.layers,
                                 sign=self.identity.sign)
        if cfg.tracker:
            self.service.on_step = self.work.record
        self.server = None
        self.port = 0
        self.data_plane = None
        self.data_address = ""
        self._registered = threading.Event()  # set while the tracker knows this node
        self.relay_attached = threading.Event()  # set while the relay stream is open (relay mode)
        if cfg.relay:
            if not cfg.tracker:
                raise ValueError("--relay needs --tracker: a relayed node is reached only through its tracker")
            # No listening socket at all: everything arrives over the outbound relay stream.
            self.address = f"relay:{self.node_id}"
            # Steps run here so that cancel/release (answered on the stream's reader) never wait behind one.
            from concurrent.futures import ThreadPoolExecutor

            self._relay_pool = ThreadPoolExecutor(max_workers=cfg.max_sessions + 2, thread_name_prefix="relay-step")
        else:
            # Workers beyond the session limit answer refusals and control calls while steps run; calls
            # beyond twice that are refused (RESOURCE_EXHAUSTED) rather than queued without bound.
            self.server = make_server(cfg.join_token, max_workers=cfg.max_sessions + 8,
                                      maximum_concurrent_rpcs=2 * (cfg.max_sessions + 8))
            pb_grpc.add_NodeServicer_to_server(self.service, self.server)
            self.port = add_port(self.server, f"{cfg.host}:{cfg.port}", cfg.tls)
            self.address = cfg.advertise or f"{cfg.host}:{self.port}"
        # Steps also get a raw-TCP data plane (far cheaper per hop than gRPC); it has no TLS, so a node
        # serving TLS keeps steps on gRPC.
        if cfg.tls is None and cfg.data_plane and not cfg.relay:
            self.data_plane = DataPlaneServer(cfg.host, cfg.data_port, self.service.run_step, cfg.join_token,
                                              workers=cfg.max_sessions + 2)
            adv_host = (cfg.advertise or cfg.host).rsplit(":", 1)[0] if cfg.advertise else cfg.host
            self.data_address = f"{adv_host}:{self.data_plane.port}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._tracker = None
        # Why the tracker refused this node for good ("CODE: details"), or None.
        self.refusal: str | None = None

    def info(self) -> pb.NodeInfo:
        c = self.engine.capabilities()
        # An accelerator node registers its device's free memory; a CPU node the host's.
        free = self.engine.device_free_bytes() if hasattr(self.engine, "device_free_bytes") else available_memory_bytes()
        return pb.NodeInfo(node_id=self.node_id, address=self.address, model=self.model,
                           layers=pb.LayerRange(start=c.artifact.layers.start, end=c.artifact.layers.end),
                           engine=c.engine, backend=c.backend, protocol_major=PROTOCOL_MAJOR,
                           protocol_minor=PROTOCOL_MINOR, free_memory_bytes=free,
                           decode_tokens_per_s=self.decode_tokens_per_s, max_sessions=c.max_sessions,
                           data_address=self.data_address, relayed=self.cfg.relay, device=self._device_info())

    def _device_info(self) -> pb.DeviceInfo | None:
        """The engine's device as registered (None for an engine without one, e.g. the fake)."""
        dev = getattr(self.engine, "device", None)
        if not dev:
            return None
        return pb.DeviceInfo(name=dev["name"], description=dev["description"], type=dev["type"],
                             memory_total_bytes=dev["memory_total_bytes"],
                             index=getattr(self.engine, "device_index", 0),
                             cpu_features=dev.get("cpu_features", ()))

    def start(self) -> None:
        if self.server is not None:
            self.server.start()
        if self.data_plane is not None:
            self.data_plane.start()
        if self.cfg.tracker:
            channel = open_channel(self.cfg.tracker, self.cfg.join_token, self.cfg.tls_ca)
            self._tracker = pb_grpc.TrackerStub(channel)
            self._spawn(self._membership_loop)
            if self.cfg.relay:
                self._spawn(self._relay_loop)
        self._spawn(self._idle_loop)

    def _spawn(self, fn) -> None:
        t = threading.Thread(target=fn, daemon=True)
        t.start()
        self._threads.append(t)

    def _membership_loop(self) -> None:
        """Register, then heartbeat; re-register whenever the tracker forgot us (e.g. it restarted)."""
        interval, registered, warned = 1.0, False, False
        # A draining node has deregistered: it must not register again (stop() reports its last work).
        while not self._stop.is_set() and not self.service.draining:
            try:
                if not registered:
                    reply = self._tracker.Register(self.identity.sign(self.info()), timeout=5)
                    interval, registered, warned = max(0.05, reply.heartbeat_interval_s), True, False
                    self._registered.set()
                    log.info("registered with tracker %s (heartbeat %.2fs)", self.cfg.tracker, interval)
                else:
                    hb = self._tracker.Heartbeat(self.identity.sign(pb.HeartbeatRequest(
                        node_id=self.node_id, active_sessions=self.engine.health().active_sessions,
                        decode_tokens_per_s=self.decode_tokens_per_s)), timeout=5)
                    # Unacknowledged work is kept and resent after an outage (the tracker counts it once).
                    registered = hb.known and self.work.flush(self._tracker, max_batches=4)
            except grpc.RpcError as e:
                if e.code() in _FATAL_REFUSALS:
                    # Retrying cannot help (wrong key, wrong protocol, an id another live node holds):
                    # stop, and let run_node exit non-zero with the tracker's words.
                    self.refusal = f"{e.code().name}: {e.details()}"
                    print(f"error: tracker refused this node: {self.refusal}", file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                if registered or not warned:
                    log.warning("tracker %s unreachable (%s); retrying", self.cfg.tracker,
                                e.details() or e.code().name)
                    warned = True
                registered = False  # tracker down or restarting: keep trying
            if not registered:
                self._registered.clear()
            self._stop.wait(interval)

    # ---- relay mode ------------------------------------------------------------------------------
    def _relay_loop(self) -> None:
        """Keep a Relay stream open to the tracker and answer what comes down it; after the stream
        breaks (tracker restart, network), wait for re-registration and open a new one."""
        while not self._stop.is_set():
            if not self._registered.wait(0.2):
                continue
            out: queue.Queue[pb.RelayUp | None] = queue.Queue()

            def ups():
                yield pb.RelayUp(hello=self.identity.sign(pb.NodeRef(node_id=self.node_id)))
                while True:
                    up = out.get()
                    if up is None:
                        return
                    yield up

            call = self._tracker.Relay(ups())
            self._relay_call = call
            try:
                for down in call:
                    self._relay_dispatch(down, out)
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    log.warning("relay stream ended: %s %s", e.code().name, e.details())
                    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        self._registered.clear()  # the tracker forgot us: the membership loop re-registers
            finally:
                self.relay_attached.clear()
                out.put(None)
            self._stop.wait(0.2)

    def _relay_dispatch(self, down: pb.RelayDown, out: queue.Queue) -> None:
        kind = down.kind
        if kind == pb.RelayDown.ATTACHED:
            self.relay_attached.set()
            log.info("relay stream attached to tracker %s", self.cfg.tracker)
        elif kind == pb.RelayDown.STEP:
            self._relay_pool.submit(self._relay_step, down, out)
        else:
            out.put(self._relay_control(down))

    def _relay_step(self, down: pb.RelayDown, out: queue.Queue) -> None:
        try:
            res = self.service.run_step(list(down.frames))
        except Exception as e:  # noqa: BLE001 - answer the caller rather than leave it waiting
            log.exception("relayed step failed")
            out.put(pb.RelayUp(call_id=down.call_id, code="INTERNAL", message=f"node error: {e}"))
            return
        up = pb.RelayUp(call_id=down.call_id, code=res.code, message=res.message, replies=res.replies)
        if res.retry_after_s is not None:
            up.has_retry_after, up.retry_after_s = True, res.retry_after_s
        out.put(up)

    def _relay_control(self, down: pb.RelayDown) -> pb.RelayUp:
        up = pb.RelayUp(call_id=down.call_id, code="OK")
        kind = down.kind
        if kind == pb.RelayDown.CANCEL:
            self.engine.cancel(down.session_id)
        elif kind == pb.RelayDown.RELEASE:
            self.service.release(down.session_id, down.epoch)
        elif kind == pb.RelayDown.HEALTH:
            up.health.CopyFrom(self.service.Health(pb.Empty(), None))
        elif kind == pb.RelayDown.CAPABILITIES:
            up.capabilities.CopyFrom(self.service.GetCapabilities(pb.Empty(), None))
        else:
            up.code, up.message = "INVALID_ARGUMENT", f"unknown relay call kind {kind}"
        return up

    def _idle_loop(self) -> None:
        period = max(0.05, min(5.0, self.cfg.idle_timeout_s / 2))
        while not self._stop.wait(period):
            for sid in self.engine.release_idle(self.cfg.idle_timeout_s):
                log.info("released idle session %s", sid)

    def stop(self, drain: bool = True) -> None:
        """Drain (refuse new sessions, let running ones finish up to drain_timeout_s), deregister, stop."""
        self.service.draining = True
        # A refused node never held its id: deregistering would remove the live node that does.
        if self._tracker is not None and self.refusal is None:
            try:
                self.work.flush(self._tracker, timeout_s=2)
                self._tracker.Deregister(self.identity.sign(pb.NodeRef(node_id=self.node_id)), timeout=2)
            except grpc.RpcError:
                pass
        if drain:
            deadline = time.monotonic() + self.cfg.drain_timeout_s
            while self.engine.health().active_sessions and time.monotonic() < deadline:
                time.sleep(0.05)
            self.service.wait_idle(max(0.0, deadline - time.monotonic()))
        if self._tracker is not None:
            try:
                self.work.flush(self._tracker, timeout_s=2)  # steps finished while draining
            except grpc.RpcError:
                pass
        self._stop.set()
        if self.data_plane is not None:
            self.data_plane.stop()
        if self.server is not None:
            self.server.stop(grace=1.0).wait()
        call = getattr(self, "_relay_call", None)
        if call is not None:
            call.cancel()


def add_node_parser(sub) -> None:
    p = sub.add_parser("node", help="serve a layer range of a model and join a tracker")
    p.add_argument("--tracker", default=None, help="HOST:PORT of the tracker")
    p.add_argument("--model", default="smollm2", help="GGUF path or bundled name")
    p.add_argument("--layers", default=None, help="half-open range START:END, e.g. 0:15")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port")
    p.add_argument("--advertise", default=None, help="address others dial (default HOST:PORT)")
    p.add_argument("--node-id", default=None,
                   help="id to register under (default: derived from the identity's public key); the tracker "
                        "binds it to the first key that registers it")
    p.add_argument("--identity", default=None, metavar="PATH",
                   help="Ed25519 key file, created (mode 0600) on first start; default with --node-id "
                        "$XDG_CONFIG_HOME/meshnet/node-<node-id>.key (~/.config/meshnet/...), without it a fresh "
                        "key for this process (a new id each start)")
    p.add_argument("--engine", choices=["ggml", "fake"], default="ggml")
    p.add_argument("--backend", choices=["cpu", "cuda", "rocm", "vulkan", "metal"], default="cpu",
                   help="where the ggml engine computes; anything but cpu must be certified here first "
                        "(meshnet backends --certify)")
    p.add_argument("--device", type=int, default=0, metavar="N",
                   help="with an accelerator --backend: which of its devices, in ggml's order (default 0)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu", type=int, default=None, help="pin the node to this CPU (e.g. 0)")
    p.add_argument("--n-ctx", type=int, default=0)
    p.add_argument("--max-sessions", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=0,
                   help="KV cells sessions may reserve at once (0 = half the memory available)")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="seconds before an unused session is freed")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--data-port", type=int, default=0, help="TCP port of the step data plane (0 = any)")
    p.add_argument("--no-data-plane", action="store_true", help="serve steps over gRPC only")
    p.add_argument("--relay", action="store_true",
                   help="open no port: keep one outbound connection to the tracker (--tracker) and take all "
                        "traffic over it (for nodes behind NAT or a firewall; each hop costs more)")
    p.add_argument("--join-token", default=os.environ.get("MESHNET_JOIN_TOKEN"))
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-ca", default=None, help="CA/cert to verify a TLS tracker")
    p.set_defaults(func=run_node)


def run_node(args: argparse.Namespace) -> int:
    backend = getattr(args, "backend", "cpu")
    device = getattr(args, "device", 0)
    if device < 0:
        print(f"error: --device must be 0 or more, got {device}", file=sys.stderr)
        return 2
    if backend != "cpu":
        # Refuse before loading anything: an accelerator that has not proved itself here stays dark.
        from meshnet.backends.errors import BackendUnavailable
        from meshnet.backends.lanes import require_certified

        try:
            require_certified(backend, device)
        except BackendUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    cpu = getattr(args, "cpu", None)
    if cpu is not None:
        pin_to_cpu(cpu)  # before loading, so the engine's threads start pinned
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    tls = TlsConfig(args.tls_cert, args.tls_key) if args.tls_cert else None
    cfg = NodeConfig(model=args.model, layers=LayerRange.parse(args.layers) if args.layers else None,
                     tracker=args.tracker, host=args.host, port=args.port, advertise=args.advertise,
                     node_id=args.node_id, engine=args.engine, threads=args.threads, n_ctx=args.n_ctx,
                     max_sessions=args.max_sessions, kv_tokens=args.kv_tokens, idle_timeout_s=args.idle_timeout,
                     drain_timeout_s=args.drain_timeout, join_token=args.join_token, tls=tls, tls_ca=args.tls_ca,
                     data_plane=not args.no_data_plane, data_port=args.data_port,
                     cpu=cpu, backend=backend, device_index=device, identity=getattr(args, "identity", None),
                     relay=getattr(args, "relay", False))
    if cfg.relay and not cfg.tracker:
        print("error: --relay needs --tracker (a relayed node is reached only through its tracker)", file=sys.stderr)
        return 2
    node = Node(cfg)
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    node.start()
    if cfg.relay:
        # Ready means reachable: wait (bounded) until the tracker has attached the relay stream.
        if not node.relay_attached.wait(30):
            log.warning("relay stream not attached yet; the node stays out of routes until it is")
    layers = node.engine.capabilities().artifact.layers
    print(f"MESHNET_NODE_READY node_id={node.node_id} address={node.address} layers={layers}", flush=True)
    dev = getattr(node.engine, "device", None) or {}
    # Both addresses: clients dial the data plane for steps, so a firewall must pass it too.
    log.info("node %s serving layers %s: gRPC %s, data plane %s; %s on %s (%.1f tok/s decode probe)",
             node.node_id, layers, node.address, node.data_address or "off (steps over gRPC)",
             node.engine.capabilities().backend, dev.get("description") or dev.get("name", "?"),
             node.decode_tokens_per_s)
    done.wait()
    log.info("draining node %s", node.node_id)
    node.stop(drain=True)
    return 1 if node.refusal else 0
