"""``meshnet node`` processes for the benchmarks: start a group of them behind an in-process tracker, wait
for their route, read their ``Metrics``, drive concurrent sessions through them, and stop every process on
every exit path (SIGTERM, then SIGKILL).

Used by ``meshnet bench mesh``, ``worker``, ``hostile`` and ``scale``. Speed is only measured here, never
asserted.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

from meshnet.client.mesh_client import MeshClient
from meshnet.contract import GREEDY, LayerRange, StepRequest
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.supervisor import signals_deferred
from meshnet.wire.security import JOIN_TOKEN_ENV, open_channel

NODE_START_TIMEOUT_S = 180.0  # import + load + speed probe; generous because the machine may be busy
ROUTE_TIMEOUT_S = 60.0


@dataclass
class NodeSpec:
    node_id: str
    layers: LayerRange
    threads: int
    cpu: int | None = None
    extra_args: tuple[str, ...] = ()  # more ``meshnet node`` arguments (e.g. ``--in-process-engine``)


@dataclass
class StartedNode:
    spec: NodeSpec
    proc: subprocess.Popen
    address: str
    log: object  # the temporary file holding the node's stderr
    ready_s: float = 0.0  # seconds from starting the process to its MESHNET_NODE_READY line


def _env_without_token() -> dict[str, str]:
    """This process's environment but ``$MESHNET_JOIN_TOKEN``: the bench's tracker and clients run in this
    process without a token, and nodes that took the bench's variable refused them (UNAUTHENTICATED)."""
    return {k: v for k, v in os.environ.items() if k != JOIN_TOKEN_ENV}


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM (a node drains and deregisters), then SIGKILL if it is still there after ``timeout_s``."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass


def _tail(log) -> str:
    try:
        log.seek(0)
        return " | ".join(log.read().decode(errors="replace").strip().splitlines()[-5:])
    except (OSError, ValueError):
        return ""


class NodeGroup:
    """``meshnet node`` processes started in parallel; ``close()`` stops every one of them."""

    def __init__(self, tracker: str, model_path: str, n_ctx: int) -> None:
        self.tracker, self.model_path, self.n_ctx = tracker, model_path, n_ctx
        self.nodes: list[StartedNode] = []
        self._pending: list[tuple[NodeSpec, subprocess.Popen, object]] = []

    def start(self, specs: list[NodeSpec]) -> list[StartedNode]:
        """Start one node per spec and wait for each ``MESHNET_NODE_READY`` line.

        Raises:
            RuntimeError: a node exited or did not become ready in time (the message has its stderr tail).
        """
        lines: queue.Queue = queue.Queue()
        t0 = time.monotonic()
        for spec in specs:
            cmd = [sys.executable, "-m", "meshnet.cli", "node", "--tracker", self.tracker, "--model",
                   self.model_path, "--layers", str(spec.layers), "--node-id", spec.node_id, "--threads",
                   str(spec.threads), "--n-ctx", str(self.n_ctx), "--drain-timeout", "2",
                   "--prefix-cache", "0"]  # every run prefills its whole prompt, as llama.cpp's benches do
            if spec.cpu is not None:
                cmd += ["--cpu", str(spec.cpu)]
            cmd += list(spec.extra_args)
            log = tempfile.TemporaryFile()
            with signals_deferred():  # a signal inside Popen left the node with nothing to stop it
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                        text=True, env=_env_without_token())
                self._pending.append((spec, proc, log))
            # readline() blocks; a reader thread per node lets the wait below have a deadline.
            threading.Thread(target=lambda p=proc, s=spec: lines.put((s.node_id, p.stdout.readline())),
                             daemon=True).start()
        ready: dict[str, str] = {}
        took: dict[str, float] = {}
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while len(ready) < len(specs):
            try:
                nid, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                late = [s.node_id for s, _, _ in self._pending if s.node_id not in ready]
                raise RuntimeError(f"nodes {late} not ready after {NODE_START_TIMEOUT_S:.0f}s") from None
            if not line.startswith("MESHNET_NODE_READY"):
                spec, proc, log = next(x for x in self._pending if x[0].node_id == nid)
                proc.wait(timeout=10)
                raise RuntimeError(f"node {nid} ({spec.layers}) did not start (exit {proc.returncode}): "
                                   f"{_tail(log)}")
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            ready[nid] = fields["address"]
            took[nid] = time.monotonic() - t0
        started = [StartedNode(s, p, ready[s.node_id], log, round(took[s.node_id], 3)) for s, p, log in self._pending]
        self.nodes += started
        self._pending = []
        return started

    def close(self) -> None:
        procs = [n.proc for n in self.nodes] + [p for _, p, _ in self._pending]
        for p in procs:  # signal all first so they drain in parallel
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            stop_process(p)
        for n in self.nodes:
            n.log.close()
        for _, _, log in self._pending:
            log.close()
        self.nodes, self._pending = [], []


def start_mesh(stack: ExitStack, model_path: str, n_ctx: int, specs: list[NodeSpec],
          one_at_a_time: bool = False) -> tuple[str, list[StartedNode]]:
    """A tracker in this process plus node processes for ``specs`` (started together, or each once the
    one before is ready: then each node's ``ready_s`` is its load alone), all stopped when ``stack``
    closes; returns the tracker address and the nodes once the tracker has a route through all of them."""
    from meshnet.tracker.server import serve_tracker
    from meshnet.up import wait_for_route

    server, port = serve_tracker("127.0.0.1", 0, heartbeat_interval_s=1.0)
    stack.callback(lambda: server.stop(grace=0).wait())
    tracker = f"127.0.0.1:{port}"
    group = NodeGroup(tracker, model_path, n_ctx)
    stack.callback(group.close)
    nodes = [n for spec in specs for n in group.start([spec])] if one_at_a_time else group.start(specs)
    route = wait_for_route(tracker, ROUTE_TIMEOUT_S, expected_hops=len(specs), progress=False)
    got = [h.node_id for h in route.hops]
    if got != [s.node_id for s in specs]:
        raise RuntimeError(f"tracker routed {got}, expected {[s.node_id for s in specs]}")
    return tracker, nodes


def node_metrics(stub: pb_grpc.NodeStub) -> pb.MetricsReply:
    return stub.Metrics(pb.Empty(), timeout=5)


def decode_compute_s(before: pb.MetricsReply, after: pb.MetricsReply) -> float:
    """Mean engine compute per decode step (seconds) between two Metrics readings of one node."""
    steps = after.decode_tokens - before.decode_tokens
    return (after.decode_seconds - before.decode_seconds) / steps if steps else 0.0


def node_stubs(stack: ExitStack, nodes: list[StartedNode]) -> list[pb_grpc.NodeStub]:
    """A stub per node on its own channel (for Metrics), closed with ``stack``."""
    stubs = []
    for n in nodes:
        ch = open_channel(n.address)
        stack.callback(ch.close)
        stubs.append(pb_grpc.NodeStub(ch))
    return stubs


def decode_concurrently(clients: list[MeshClient], prompt_ids: list[int], n_decode: int) -> tuple[float, float]:
    """Prefill one session per client, then run every session's decode loop at once, one thread each.

    Returns:
        Aggregate decode tokens/s over the span from the first start to the last finish, and this
        process's CPU seconds per decode token over that span (the client's cost).
    """
    sids = [f"bench-{uuid.uuid4().hex}" for _ in clients]
    try:
        first = []
        for c, sid in zip(clients, sids):
            res = c.step(StepRequest(sid, 0, 0, tuple(prompt_ids), sampling=GREEDY), decode=False)
            if not res.ok:
                raise RuntimeError(f"prefill failed: {res.status.value} {res.message}")
            first.append(res.token.token_id)
        go = threading.Barrier(len(clients))

        def loop(i: int) -> tuple[float, float]:
            c, sid, tok, pos = clients[i], sids[i], first[i], len(prompt_ids)
            go.wait(timeout=30)
            t0 = time.perf_counter()
            for _ in range(n_decode):
                res = c.step(StepRequest(sid, 0, pos, (tok,), sampling=GREEDY), decode=True)
                if not res.ok:
                    raise RuntimeError(f"decode failed: {res.status.value} {res.message}")
                pos, tok = pos + 1, res.token.token_id
            return t0, time.perf_counter()

        c0 = time.process_time()
        with ThreadPoolExecutor(len(clients)) as pool:
            spans = list(pool.map(loop, range(len(clients))))
        cpu = time.process_time() - c0
        n = len(clients) * n_decode
        return n / (max(e for _, e in spans) - min(s for s, _ in spans)), cpu / n
    finally:
        for c, sid in zip(clients, sids):
            c.release(sid)
