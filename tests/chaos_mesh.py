"""A mesh of real processes for the chaos soak: ``meshnet tracker`` (SQLite ledger, fixed port, so it can
be killed and started again where the nodes and the API look for it), two ``meshnet node`` processes
per layer range (each under its own ``--node-id``, so a restart comes back under the same id), and
``meshnet api`` in front of them.

Every process writes its stderr to a log file in the work folder; a failing soak names them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from mesh_util import free_port
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.security import open_channel


@dataclass
class NodeSlot:
    """One node of the mesh across its restarts: its id and range are fixed, its process and address
    change. ``state``: "starting", "up", "stopped" (SIGSTOP) or "dead"."""

    node_id: str
    layers: str
    proc: subprocess.Popen | None = None
    address: str = ""
    state: str = "dead"
    starts: int = 0
    log: Path | None = None
    history: list[str] = field(default_factory=list)

    def stub(self) -> pb_grpc.NodeStub:
        return pb_grpc.NodeStub(open_channel(self.address))


class ChaosMesh:
    """The processes of one soak. ``ranges``: layer ranges (``"0:15"``), each served by ``replicas``
    nodes named ``r{i}-{k}``. ``heartbeat_s``: the tracker's heartbeat interval (a node silent for three
    of them is dropped)."""

    def __init__(self, workdir: Path, ranges: list[str], replicas: int = 2, heartbeat_s: float = 1.0) -> None:
        self.workdir, self.heartbeat_s = workdir, heartbeat_s
        self.tracker_port, self.api_port = free_port(), free_port()
        self.tracker = f"127.0.0.1:{self.tracker_port}"
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.ledger_url = f"sqlite:///{workdir / 'ledger.db'}"
        self.nodes = [NodeSlot(f"r{i}-{k}", layers) for i, layers in enumerate(ranges) for k in range(replicas)]
        self.tracker_proc: subprocess.Popen | None = None
        self.tracker_starts = 0
        self.api_proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self._env = dict(os.environ)

    def _spawn(self, name: str, *args: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "a")
        try:
            return subprocess.Popen([sys.executable, "-m", "meshnet.cli", *args], stdout=stdout, stderr=log,
                                    text=True, env=self._env)
        finally:
            log.close()

    # ---- tracker ------------------------------------------------------------------------------
    def start_tracker(self) -> None:
        """Start ``meshnet tracker`` on the mesh's port and wait until it answers (30 s at most)."""
        self.tracker_starts += 1
        self.tracker_proc = self._spawn("tracker", "tracker", "--port", str(self.tracker_port),
                                        "--heartbeat", str(self.heartbeat_s), "--ledger", self.ledger_url)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.tracker_stub().ListNodes(pb.Empty(), timeout=1)
                return
            except grpc.RpcError:
                if self.tracker_proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the tracker did not start; see {self.workdir / 'tracker.log'}")
                time.sleep(0.1)

    def kill_tracker(self) -> None:
        self.tracker_proc.send_signal(signal.SIGKILL)
        self.tracker_proc.wait(10)

    def tracker_stub(self) -> pb_grpc.TrackerStub:
        return pb_grpc.TrackerStub(open_channel(self.tracker))

    def registered(self) -> set[str]:
        return {n.info.node_id for n in self.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes}

    def delivered_tokens(self) -> int:
        """Tokens the tracker's ledger charges, all clients together."""
        return sum(c.delivered_tokens for c in self.tracker_stub().GetLedger(pb.Empty(), timeout=5).clients)

    # ---- nodes --------------------------------------------------------------------------------
    def start_node(self, slot: NodeSlot, attempts: int = 20) -> bool:
        """Start the slot's node and wait for its READY line. A restart under the same id is refused by
        the tracker until the dead process's registration expires (three heartbeats): try again, up to
        ``attempts`` times. Returns whether the node runs."""
        for _ in range(attempts):
            with self.lock:
                slot.state, slot.starts = "starting", slot.starts + 1
                slot.proc = self._spawn(slot.node_id, "node", "--tracker", self.tracker, "--layers", slot.layers,
                                        "--node-id", slot.node_id, "--threads", "1", stdout=subprocess.PIPE)
            line = slot.proc.stdout.readline()
            if line.startswith("MESHNET_NODE_READY"):
                address = dict(kv.split("=", 1) for kv in line.split()[1:])["address"]
                # Ready to serve is not yet registered: the tracker may still refuse the id while the
                # dead process's registration lasts, and the node then exits.
                if self._wait_listed(slot, address):
                    with self.lock:
                        slot.address, slot.state = address, "up"
                    return True
            slot.proc.wait(10)
            time.sleep(1.0)
        with self.lock:
            slot.state = "dead"
        return False

    def _wait_listed(self, slot: NodeSlot, address: str, timeout_s: float = 30.0) -> bool:
        """Whether the tracker lists ``slot``'s node at ``address`` before its process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and slot.proc.poll() is None:
            try:
                nodes = self.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes
                if any(n.info.node_id == slot.node_id and n.info.address == address for n in nodes):
                    return True
            except grpc.RpcError:
                pass  # the tracker is being restarted
            time.sleep(0.1)
        return False

    def start_nodes(self) -> None:
        """Start every node in parallel and wait until the tracker lists them all (60 s at most)."""
        threads = [threading.Thread(target=self.start_node, args=(s,)) for s in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        want = {s.node_id for s in self.nodes}
        deadline = time.monotonic() + 60
        while not want <= self.registered():
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes {want - self.registered()} never registered")
            time.sleep(0.1)

    def sessions(self, slot: NodeSlot) -> tuple[int, int]:
        """(sessions open, KV cells held other than those of finished sessions kept for their prefixes)
        on a running node, from its Metrics RPC."""
        m = slot.stub().Metrics(pb.Empty(), timeout=5)
        return m.active_sessions, m.kv_tokens_held - m.kv_tokens_kept

    # ---- API ----------------------------------------------------------------------------------
    def start_api(self, max_concurrency: int = 8) -> None:
        """Start ``meshnet api`` over the tracker and wait until /health answers 200 (90 s at most)."""
        self.api_proc = self._spawn("api", "api", "--tracker", self.tracker, "--port", str(self.api_port),
                                    "--max-concurrency", str(max_concurrency))
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.api_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.api_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start; see {self.workdir / 'api.log'}")
            time.sleep(0.2)

    def close(self) -> None:
        """SIGCONT and kill every process still running."""
        procs = [s.proc for s in self.nodes] + [self.tracker_proc, self.api_proc]
        for p in procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(10)
