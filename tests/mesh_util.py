"""Start real tracker and node processes on loopback for mesh tests, and clean them up."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from meshnet.client.mesh_client import MeshClient
from meshnet.contract import StepRequest
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.dashboard.server import start_dashboard
from meshnet.tracker.server import start_tracker
from meshnet.wire.security import TlsConfig, open_channel

HEARTBEAT_S = 0.3


@dataclass
class NodeProc:
    proc: subprocess.Popen
    node_id: str
    address: str
    log_path: Path | None = None  # the node's stderr
    tls_ca: str | None = None  # the CA its gRPC port is verified with (a mesh under TLS)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the node's log (its stderr), for a failing test to say what the node did."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log kept)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stub(self, token: str | None = None) -> pb_grpc.NodeStub:
        return pb_grpc.NodeStub(open_channel(self.address, token, self.tls_ca))

    def active_sessions(self) -> int:
        return self.stub().Health(pb.Empty(), timeout=5).active_sessions

    def worker_pid(self) -> int | None:
        """The pid of the node's engine worker process (None between workers, or in-process)."""
        pid = self.proc.pid
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    children = f.read().split()
            except OSError:
                continue
            for child in children:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"meshnet.node.engine_worker" in f.read():
                        return int(child)
        return None

    def health(self) -> pb.HealthReply:
        """The node's Health reply. Raises AssertionError with the end of the node's log when it does not
        answer (exit status included when it has exited)."""
        try:
            return self.stub().Health(pb.Empty(), timeout=5)
        except grpc.RpcError as e:
            raise AssertionError(f"node {self.node_id} did not answer Health ({e.code().name}; process "
                                 f"{'running' if self.proc.poll() is None else f'exited {self.proc.returncode}'});"
                                 f" its log ends:\n{self.log_tail()}") from None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


class Mesh:
    """A tracker in this process plus node subprocesses; ``close()`` stops everything.

    ``heartbeat_s``: the nodes' heartbeat interval; the tracker drops a node silent for three of them
    (a long one keeps a dead node listed, as on a real mesh in the seconds after it died). ``tls``: the
    tracker and every node serve TLS with this certificate, which is also the CA everyone verifies with.
    ``dashboard``: also serve the tracker's web dashboard (its address in ``self.dashboard.url``)."""

    def __init__(self, join_token: str | None = None, heartbeat_s: float = HEARTBEAT_S, ledger=None,
                 tls: TlsConfig | None = None, dashboard: bool = False) -> None:
        self.join_token, self.tls = join_token, tls
        self.tls_ca = tls.cert if tls is not None else None
        self.server, self.port, self.service = start_tracker("127.0.0.1", 0, heartbeat_interval_s=heartbeat_s,
                                                             join_token=join_token, ledger=ledger, tls=tls)
        self.dashboard = start_dashboard(self.service) if dashboard else None
        self.tracker = f"127.0.0.1:{self.port}"
        self.nodes: list[NodeProc] = []
        self.clients: list[MeshClient] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="meshnet-test-nodes-"))  # each node's stderr

    def spawn_node(self, layers: str, node_id: str | None, model: str | None = "smollm2", *extra: str,
                   stderr=None) -> subprocess.Popen:
        """Start ``meshnet node`` for this tracker (stdout piped, text); node_id None: no ``--node-id``;
        model None: no ``--model`` (a node that fetches its layers).
        ``stderr`` None: to ``<log_dir>/<node_id>.log`` (:meth:`NodeProc.log_tail`)."""
        env = dict(os.environ)
        log_path = None
        if stderr is None:
            log_path = self.log_dir / f"{node_id or 'node'}-{len(list(self.log_dir.iterdir()))}.log"
            stderr = open(log_path, "w")
        if self.join_token:
            env["MESHNET_JOIN_TOKEN"] = self.join_token
        named = ["--node-id", node_id] if node_id is not None else []
        if self.tls is not None:
            named += ["--tls-cert", self.tls.cert, "--tls-key", self.tls.key, "--tls-ca", self.tls.cert]
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", "node", "--tracker", self.tracker,
             *(["--model", model] if model is not None else []), "--layers", layers, *named, "--threads", "1",
             *extra],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        if log_path is not None:
            stderr.close()  # the child has its own descriptor
        proc.meshnet_log = log_path  # type: ignore[attr-defined]
        return proc

    def start_nodes(self, specs: list[tuple], model: str = "smollm2", *extra: str) -> list[NodeProc]:
        """Start one node per ``(node_id, layers)`` or ``(node_id, layers, more_args)`` in parallel and wait
        until each is serving (node_id None: the node picks its own id; ``more_args`` follow ``extra``)."""
        procs = [(nid, self.spawn_node(layers, nid, model, *extra, *(more[0] if more else ())))
                 for nid, layers, *more in specs]
        started = []
        for nid, proc in procs:
            line = proc.stdout.readline()
            log_path = getattr(proc, "meshnet_log", None)
            if not line.startswith("MESHNET_NODE_READY"):
                proc.kill()
                proc.wait(timeout=10)
                tail = NodeProc(proc, str(nid), "", log_path).log_tail()
                raise RuntimeError(f"node {nid} did not start: {line!r}; its log ends:\n{tail}")
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            started.append(NodeProc(proc, fields["node_id"], fields["address"], log_path, self.tls_ca))
        self.nodes += started
        self.wait_registered({n.node_id for n in started})
        return started

    def client(self, **kwargs) -> MeshClient:
        """A :class:`MeshClient` of this mesh's tracker (``kwargs`` as MeshClient's), closed by :meth:`close`
        before the tracker stops unless the test closed it: a client left open resends the tokens it has
        not reported to whichever tracker takes the port next (see reporter_leaks.py)."""
        client = MeshClient(self.tracker, **kwargs)
        self.clients.append(client)
        return client

    def tracker_stub(self) -> pb_grpc.TrackerStub:
        return pb_grpc.TrackerStub(open_channel(self.tracker, self.join_token, self.tls_ca))

    def registered(self) -> set[str]:
        return {n.info.node_id for n in self.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes}

    def wait_registered(self, ids: set[str], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not ids <= self.registered():
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {ids - self.registered()} never registered")
            time.sleep(0.05)

    def close(self) -> None:
        try:
            for c in self.clients:  # first: their last reports reach the tracker, their releases the nodes
                c.close()
        finally:
            self._stop()

    def _stop(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait(timeout=10)
        if self.dashboard is not None:
            self.dashboard.stop()
        self.server.stop(grace=0).wait()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def run_generate(tracker: str, prompt: str, *args: str) -> subprocess.CompletedProcess:
    """``meshnet generate --tracker TRACKER --temperature 0 --json ARGS PROMPT`` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "meshnet.cli", "generate", "--tracker", tracker,
                           "--temperature", "0", "--json", *args, prompt],
                          capture_output=True, text=True, timeout=120)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float) -> float | None:
    """Seconds until ``predicate()`` held, polling every 50 ms; None if it never did within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def greedy_steps(prefill, decode, sid: str, prompt, n: int, reserve_tokens: int = 0, after=None) -> list[int]:
    """Greedy ids of session ``sid`` from ``prefill``/``decode`` callables (an engine's, or a client's
    ``step`` wrapped): the prompt in one step reserving ``reserve_tokens`` cells, then ``n - 1`` decodes;
    ``after(i)`` runs after the i-th token (1-based). Every step must answer OK."""
    prompt = tuple(int(t) for t in prompt)
    res = prefill(StepRequest(sid, 0, 0, prompt, reserve_tokens=reserve_tokens))
    assert res.ok, res.message
    out = [res.token.token_id]
    for i in range(n - 1):
        if after is not None:
            after(len(out))
        res = decode(StepRequest(sid, 0, len(prompt) + i, (out[-1],)))
        assert res.ok, res.message
        out.append(res.token.token_id)
    return out


class RpcFailure(grpc.RpcError):
    """A gRPC call's failure as a fake stub raises it: ``code()`` and ``details()`` (default: the code's name)."""

    def __init__(self, code: grpc.StatusCode, details: str | None = None) -> None:
        super().__init__(details or code.name)
        self._code, self._details = code, details or code.name

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def rpc_code(fn, *args, **kw) -> grpc.StatusCode:
    try:
        fn(*args, **kw)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def process_tree(pid: int) -> dict[int, list[str]]:
    """Every live process below ``pid`` (children, theirs, ...; not ``pid``, not zombies): pid -> argv."""
    parent, argv = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            parent[int(entry)], argv[int(entry)] = int(fields[1]), args
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for child in (c for c, pp in parent.items() if pp == p):
            found[child] = argv[child]
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (killed, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def left_running(tree: dict[int, list[str]], grace_s: float = 0.0) -> list[list[str]]:
    """The argv of each process of ``tree`` (see :func:`process_tree`) still running after up to ``grace_s``
    seconds; those are then killed, so that a test that finds them leaves nothing behind either."""
    wait_for(lambda: not any(alive(pid) for pid in tree), grace_s)
    left = [argv for pid, argv in tree.items() if alive(pid)]
    for pid in tree:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    return left


def sigterm_bench(argv: list[str], started, timeout_s: float = 180) -> tuple[subprocess.Popen, str, dict]:
    """Run ``meshnet bench ARGV``, and once ``started(tree)`` holds for its :func:`process_tree`, send the bench
    alone SIGTERM (as ``kill`` does: nothing else tells its children). Returns the bench's process (ended),
    its stderr and the tree it had then. Fails when the bench ends, or ``started`` never holds, within
    ``timeout_s``."""
    return signal_once_started(["bench", *argv], started, signal.SIGTERM, timeout_s)


def signal_once_started(argv: list[str], started, sig: int, timeout_s: float = 180, poll_s: float = 0.1,
                        **popen) -> tuple[subprocess.Popen, str, dict]:
    """Run ``meshnet ARGV`` (``popen``: more of Popen's arguments), and once ``started(tree)`` holds for its
    :func:`process_tree` (asked every ``poll_s`` seconds), send it alone ``sig``. Returns the process (ended),
    its stderr and the tree it had then. Fails when it ends, or ``started`` never holds, within ``timeout_s``."""
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **popen)
    try:
        deadline = time.monotonic() + timeout_s
        while not started(tree := process_tree(proc.pid)):
            assert proc.poll() is None, f"it ended first ({proc.returncode}): {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, f"not started after {timeout_s} s: {tree}"
            time.sleep(poll_s)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, err, tree
