"""A meshnet mesh across network namespaces: the tracker, each node and the client on a host of its own
(see :mod:`meshnet.netem.namespaces`), every link through one link-emulator process, nothing on
loopback. Used by the netns tests and by ``meshnet bench wan``.

The client host runs an *agent*: a process, given as an argv (the tracker's address is appended), that
speaks JSON lines over its stdin and stdout (see :class:`Agent`) and answers at least ``{"op": "nodes"}``
with ``{"nodes": {node id: active sessions}}`` as the tracker lists them (:func:`listed_nodes`).

``NetMesh.close()`` stops every process it started and deletes its namespaces; it runs even when
start-up failed half-way.
"""

from __future__ import annotations

import itertools
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from meshnet.netem.control import NetemProcess
from meshnet.netem.namespaces import Topology
from meshnet.supervisor import signals_deferred

TRACKER_PORT, GRPC_PORT, DATA_PORT = 7700, 7701, 7702


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[4:7]} did not start: {path.read_text()[-2000:]}")
        time.sleep(0.05)


def listed_nodes(tracker_stub) -> dict[str, int]:
    """Node id -> active sessions, as the tracker behind ``tracker_stub`` (a TrackerStub) lists them."""
    from meshnet.proto import meshnet_pb2 as pb

    return {n.info.node_id: n.active_sessions for n in tracker_stub.ListNodes(pb.Empty(), timeout=5).nodes}


class Agent:
    """The client host's process: ``ask`` a command, read ``events``.

    Each command line carries an ``id`` and gets one reply line with the same ``id`` (``"error"`` set
    when it failed); lines without an ``id`` are events. The agent's first event must be
    ``{"event": "ready"}``. Raises RuntimeError when it is not."""

    def __init__(self, argv: list[str], stderr) -> None:
        self.events: queue.Queue[dict] = queue.Queue()
        self._replies: dict[int, queue.Queue] = {}
        self._next = 0
        self._lock = threading.Lock()  # asked from more than one thread
        self.proc: subprocess.Popen | None = None
        try:  # the caller holds no agent to stop until this returns
            with signals_deferred():  # a signal inside Popen left the agent with nothing to stop it
                self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                             text=True)
            threading.Thread(target=self._read, daemon=True).start()
            first = self.next_event(60)
            if first.get("event") != "ready":
                raise RuntimeError(f"client agent did not start: {first}")
        except BaseException:
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "id" in msg:
                self._replies.pop(msg["id"]).put(msg)
            else:
                self.events.put(msg)
        self.events.put({"event": "exited", "rc": self.proc.wait()})

    def ask(self, op: str, timeout_s: float = 30, **kw) -> dict:
        """The reply to one command. Raises RuntimeError when it failed, TimeoutError when none came."""
        with self._lock:
            self._next += 1
            box = self._replies[self._next] = queue.Queue()
            self.proc.stdin.write(json.dumps({"id": self._next, "op": op, **kw}) + "\n")
            self.proc.stdin.flush()
        try:
            reply = box.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no reply to {op} within {timeout_s} s") from None
        if reply.get("error"):
            raise RuntimeError(f"{op}: {reply['error']}")
        return reply

    def next_event(self, timeout_s: float = 120) -> dict:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no event from the client within {timeout_s} s") from None


class NetMesh:
    """``hosts``: host names, one of them "tracker" and one "client"; the others may run nodes (their
    node id is the host name). ``agent_argv``: the client host's agent (see :class:`Agent`), the
    tracker's ``HOST:PORT`` appended. ``heartbeat_s``: the tracker's heartbeat interval, seconds;
    ``link``: every link's LinkSpec fields (default: a plain wire); ``extra_ports``: host -> more ports
    that the others reach it on through the emulator (for servers started with :meth:`spawn`).

    Raises NetnsUnavailable (namespaces cannot be made) or RuntimeError (a process did not start)."""

    def __init__(self, hosts: list[str], workdir: Path, agent_argv: list[str], heartbeat_s: float = 0.3,
                 link: dict | None = None, extra_ports: dict[str, list[int]] | None = None) -> None:
        self.topo = Topology(hosts)
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []
        self._files = []
        self.netem = None
        self.agent = None
        try:
            self.topo.create()
            config = {**self._netem_config(extra_ports or {}), "default": link or {}}
            self.netem = NetemProcess(config, workdir, self.topo.argv(None, []))
            t = self.topo.hosts["tracker"]
            self.tracker = f"{t.public_ip}:{TRACKER_PORT}"
            proc, log = self._spawn("tracker", ["tracker", "--host", t.private_ip, "--port", str(TRACKER_PORT),
                                                "--heartbeat", str(heartbeat_s),
                                                "--ledger", f"sqlite:///{workdir}/ledger.db"])
            _wait_for_text(log, "tracker listening", proc, 60)
            self.agent = Agent(self.topo.argv("client", [*agent_argv, self.tracker]), self._log("client"))
        except BaseException:
            self.close()
            raise

    def _netem_config(self, extra_ports: dict[str, list[int]]) -> dict:
        listeners = []
        for h in self.topo.hosts.values():
            ports = [] if h.name == "client" else [TRACKER_PORT] if h.name == "tracker" else [GRPC_PORT, DATA_PORT]
            ports = ports + list(extra_ports.get(h.name, []))
            listeners += [{"owner": h.name, "listen": [h.public_ip, p], "target": [h.private_ip, p]} for p in ports]
        return {"hosts": self.topo.address_map(), "listeners": listeners}

    def _log(self, name: str):
        f = open(self.workdir / f"{name}.stderr", "a")
        self._files.append(f)
        return f

    def spawn(self, host: str, argv: list[str], stdout=subprocess.DEVNULL, env: dict | None = None,
              log: str | None = None) -> tuple[subprocess.Popen, Path]:
        """Run ``argv`` in ``host``'s namespace, its stderr appended to ``WORKDIR/LOG.stderr`` (``log``:
        the host's name by default); :meth:`close` kills it. Returns the process and the log's path."""
        name = log or host
        with signals_deferred():  # a signal inside Popen left the process with nothing to stop it
            proc = subprocess.Popen(self.topo.argv(host, argv), stdout=stdout, stderr=self._log(name), text=True,
                                    env=env)
            self.procs.append(proc)
        return proc, self.workdir / f"{name}.stderr"

    def _spawn(self, host: str, args: list[str], stdout=subprocess.DEVNULL) -> tuple[subprocess.Popen, Path]:
        return self.spawn(host, [sys.executable, "-m", "meshnet.cli", *args], stdout)

    def address(self, host: str) -> str:
        """The node's gRPC address as the others dial it."""
        return f"{self.topo.hosts[host].public_ip}:{GRPC_PORT}"

    def set_all_links(self, **spec) -> None:
        """Give every link between two hosts the LinkSpec fields ``spec`` (open connections too)."""
        for a, b in itertools.combinations(self.topo.hosts, 2):
            self.netem.set_link(a, b, **spec)

    def start_nodes(self, specs: list[tuple[str, str]], threads: int = 1, node_args: list[str] = ()) -> None:
        """Start ``meshnet node`` on each (host, layers), ``threads`` compute threads each, ``node_args``
        appended, in parallel; wait until the tracker lists all. Raises RuntimeError (a node did not
        start) or TimeoutError."""
        procs = []
        for host, layers in specs:
            h = self.topo.hosts[host]
            proc, _ = self._spawn(host, ["node", "--tracker", self.tracker, "--model", "smollm2", "--layers", layers,
                                         "--node-id", host, "--threads", str(threads), "--host", h.private_ip,
                                         "--port", str(GRPC_PORT), "--data-port", str(DATA_PORT),
                                         "--advertise", f"{h.public_ip}:{GRPC_PORT}", *node_args],
                                  stdout=subprocess.PIPE)
            procs.append((host, proc))
        for host, proc in procs:
            line = proc.stdout.readline()
            if not line.startswith("MESHNET_NODE_READY"):
                raise RuntimeError(f"node {host} did not start: {line!r}: "
                                   f"{(self.workdir / f'{host}.stderr').read_text()[-2000:]}")
        self.wait_listed({host for host, _ in specs}, 60)

    def listed(self) -> dict[str, int]:
        """Node id -> active sessions, as the tracker lists them (asked by the client)."""
        return self.agent.ask("nodes")["nodes"]

    def wait_listed(self, ids: set[str], timeout_s: float) -> float:
        """Seconds until the tracker lists every node in ``ids``. Raises TimeoutError."""
        t0 = time.monotonic()
        while not ids <= set(self.listed()):
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"nodes {ids - set(self.listed())} not listed after {timeout_s} s")
            time.sleep(0.05)
        return time.monotonic() - t0

    def close(self) -> None:
        try:
            procs = ([self.agent.proc] if self.agent else []) + self.procs
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait(timeout=10)
            if self.netem is not None:
                self.netem.close()
        finally:
            for f in self._files:
                f.close()
            self.topo.destroy()
