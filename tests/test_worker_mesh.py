"""Node processes whose engine worker dies, hangs or keeps dying, in a mesh: the node stays registered
and is used again once its worker reloads; sessions it lost are replayed with the same tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from meshnet.client.mesh_client import MeshClient
from meshnet.client.remote import StageFailure
from meshnet.contract import GREEDY, ArtifactId, LayerRange, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.generation import Generation
from mesh_util import NodeProc, greedy_steps


def _fake_greedy(prompt: tuple[int, ...], n: int) -> list[int]:
    eng = FakeEngine(FakeModel())
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(FakeModel().sha256, LayerRange(0, 30)))).ok
    return greedy_steps(eng.prefill, eng.decode, "ref", prompt, n)


def _client(mesh) -> MeshClient:
    # A generous failover deadline: a worker reloading on a loaded 2-core machine takes seconds.
    return mesh.client(failover_deadline_s=30.0)


def _wait_healthy(node: NodeProc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not node.health().healthy:
        assert time.monotonic() < deadline, "the node's engine worker never came back"
        time.sleep(0.05)


@pytest.mark.parametrize("kind, reason", [("segfault", "killed by SIGSEGV"), ("exit", "exited with status 70"),
                                          ("sigkill", "killed by SIGKILL")])
def test_worker_death_mid_generation_replays_on_the_same_node(mesh, kind, reason):
    (head,) = mesh.start_nodes([("w-head", "0:15")], "smollm2", "--engine", "fake")
    # The only tail's worker dies on its 8th step; the node itself lives on, and the session comes back to it.
    victim = mesh.spawn_node("15:30", "w-victim", "smollm2", "--engine", "fake", "--fault", f"crash={kind},after=7",
                             stderr=subprocess.PIPE)
    ready = victim.stdout.readline()
    assert ready.startswith("MESHNET_NODE_READY")
    victim_node = NodeProc(victim, "w-victim", dict(kv.split("=", 1) for kv in ready.split()[1:])["address"])
    mesh.nodes.append(victim_node)
    mesh.wait_registered({"w-victim"})
    client = _client(mesh)
    first_pid = victim_node.worker_pid()
    # A second session, opened before the crash and idle during it, finds its cache gone (NOT_FOUND).
    idle = greedy_steps(lambda r: client.step(r, False), lambda r: client.step(r, True), "idle", (9, 8, 7), 2)
    out = greedy_steps(lambda r: client.step(r, False), lambda r: client.step(r, True), "busy", (1, 2, 3, 4), 20)
    assert out == _fake_greedy((1, 2, 3, 4), 20)
    idle += [client.step(StepRequest("idle", 0, 4, (idle[-1],)), True).token.token_id]
    assert idle == _fake_greedy((9, 8, 7), 3)
    assert client.failovers == 2  # the busy session (its step failed) and the idle one (NOT_FOUND)
    assert victim.poll() is None and victim_node.worker_pid() not in (None, first_pid)
    assert "w-victim" in mesh.registered()
    assert victim_node.active_sessions() == 2 and head.active_sessions() == 2
    client.close()
    assert victim_node.active_sessions() == 0
    victim.send_signal(signal.SIGTERM)
    assert victim.wait(30) == 0
    assert reason in victim.stderr.read()


def test_hung_worker_is_replaced_while_the_node_answers_health(mesh):
    (node,) = mesh.start_nodes([("h-all", "0:30")], "smollm2", "--engine", "fake", "--fault", "crash=hang,after=4",
                               "--worker-hang-timeout", "2")
    client = _client(mesh)
    health: list = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                health.append(node.health())
            except Exception as e:  # noqa: BLE001 - a Health that does not answer is the failure asserted
                health.append(e)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out = greedy_steps(lambda r: client.step(r, False), lambda r: client.step(r, True), "s", (5, 6), 12)
    finally:
        done.set()
        watcher.join(10)
    assert out == _fake_greedy((5, 6), 12)
    assert client.failovers == 1
    # Health answered throughout, saying when the engine did not, and says healthy again (the supervisor
    # may see the new worker answer its ping a moment after the replay ran on it).
    assert all(not isinstance(h, Exception) for h in health)
    assert any(not h.healthy for h in health)
    _wait_healthy(node, 10)
    assert "h-all" in mesh.registered()


def test_crash_loop_deregisters_with_the_reason_and_exits_non_zero(mesh):
    proc = mesh.spawn_node("0:30", "loop", "smollm2", "--engine", "fake", "--fault", "crash=exit,after=0,workers=0",
                           "--worker-restarts", "2", stderr=subprocess.PIPE)
    ready = proc.stdout.readline()
    node = NodeProc(proc, "loop", dict(kv.split("=", 1) for kv in ready.split()[1:])["address"])
    mesh.nodes.append(node)
    mesh.wait_registered({"loop"})
    from meshnet.client.remote import RemoteStage
    from meshnet.wire.security import open_channel

    stage = RemoteStage("loop", node.address, open_channel(node.address, None), timeout_s=10)
    codes = set()
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            stage.step(StepRequest("x", 0, 0, (1,)), False)
        except StageFailure as f:
            codes.add(f.code)
        time.sleep(0.1)
    assert proc.wait(30) == 1
    err = proc.stderr.read()
    assert ("error: engine worker died 3 times in a row, each within 30 s of its start (last: exited with status "
            "70); deregistering and exiting") in err
    assert "UNAVAILABLE" in codes
    assert "loop" not in mesh.registered()


def test_real_model_worker_killed_twice_generation_equals_solo(mesh, tok, solo):
    head, tail = mesh.start_nodes([("r-head", "0:15"), ("r-tail", "15:30")])
    client = _client(mesh)
    pids = {n.node_id: n.worker_pid() for n in (head, tail)}

    def kill(i: int) -> None:
        if i == 10:  # between steps, and back before the next: the tail answers NOT_FOUND, the client replays
            os.kill(tail.worker_pid(), signal.SIGKILL)
            time.sleep(0.5)
            _wait_healthy(tail)
        elif i == 30:  # the head is still reloading when the next step comes: UNAVAILABLE, then a replay
            os.kill(head.worker_pid(), signal.SIGKILL)

    gen = Generation(client, tok, solo.prompt_ids(0), 64, GREEDY, stop_at_eog=False)
    for i, _ in enumerate(gen):
        kill(i + 1)
    assert gen.result.generated_token_ids == solo.greedy(0)
    assert client.failovers == 2
    assert {n.node_id: n.proc.poll() for n in (head, tail)} == {"r-head": None, "r-tail": None}
    assert all(n.worker_pid() not in (None, pids[n.node_id]) for n in (head, tail))
    assert {"r-head", "r-tail"} <= mesh.registered()
    assert [head.active_sessions(), tail.active_sessions()] == [0, 0]
