"""Steps a node carries on from its engine worker's answer, without a thread waiting (NodeService.start_step
and start_forward, WorkerChannel.call_async): answered once with what the threaded path answers, failures
included; larger steps, failure notes and a draining node take the threaded path."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from meshnet.contract import LayerRange, SampledToken, Status, StepRequest, StepResult
from meshnet.node.config import NodeConfig
from meshnet.node.service import ASYNC_STEP_TOKENS, NodeService, StepOutcome
from meshnet.node.worker_channel import EngineCallFailed
from meshnet.node.worker_supervisor import WorkerSupervisor
from meshnet.node.worker_wire import EngineUnavailable
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.envelope import request_to_frames, result_to_replies


class StubWorkerEngine:
    """Records the steps started; the test answers them."""

    def __init__(self, refuse: Exception | None = None, layers: tuple[int, int] = (10, 20)) -> None:
        self.started: list[tuple[StepRequest, bool, object]] = []
        self.refuse = refuse
        self.layers = layers

    def start_step(self, req, decode, on_done) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.started.append((req, decode, on_done))

    def session_ids(self) -> list[str]:
        return []

    def capabilities(self):
        """What a forwarded step's next hops are checked against: a stage of 30 layers (a middle one unless
        the test gave other ``layers``)."""
        from types import SimpleNamespace

        from meshnet.contract import LayerRange

        return SimpleNamespace(n_layer=30, artifact=SimpleNamespace(layers=LayerRange(*self.layers)))


def _service(engine) -> NodeService:
    return NodeService(engine, "tail-node", pb.ModelIdentity())


def _decode_step(n_tokens: int = 1) -> tuple[StepRequest, list[pb.Envelope]]:
    req = StepRequest("s1", 3, 40, tuple(range(100, 100 + n_tokens)), step_id=41)
    return req, request_to_frames(req, True)


def test_a_client_step_is_answered_once_from_the_engines_answer_as_the_threaded_path_would():
    engine = StubWorkerEngine()
    svc = _service(engine)
    req, frames = _decode_step()
    answers: list[StepOutcome] = []
    assert svc.start_step(frames, answers.append) is True
    assert answers == [] and len(engine.started) == 1  # nothing answered before the engine has
    started_req, decode, on_done = engine.started[0]
    assert started_req == req and decode is True
    res = StepResult(Status.OK, token=SampledToken(7, -0.25), n_past=41)
    on_done(res)
    assert [(a.code, a.replies) for a in answers] == [("OK", result_to_replies(req, res))]
    assert svc.wait_idle(0)  # the step has left


def test_engine_failures_are_answered_with_their_status():
    svc = _service(StubWorkerEngine(refuse=EngineUnavailable("engine worker is gone (restarting)")))
    answers: list[StepOutcome] = []
    assert svc.start_step(_decode_step()[1], answers.append) is True
    assert [(a.code, a.message) for a in answers] == [
        ("UNAVAILABLE", "node tail-node: engine worker is gone (restarting)")]
    assert svc.wait_idle(0)

    engine = StubWorkerEngine()
    svc = _service(engine)
    answers.clear()
    assert svc.start_step(_decode_step()[1], answers.append)
    engine.started[0][2](EngineCallFailed("KeyError: 'x'"))
    assert [(a.code, a.message) for a in answers] == [("INTERNAL", "engine error: KeyError: 'x'")]
    engine.started.clear()
    answers.clear()
    assert svc.start_step(_decode_step()[1], answers.append)
    engine.started[0][2](StepResult(Status.RESOURCE_EXHAUSTED, "pool full", retry_after_s=0.5))
    assert [(a.code, a.message, a.retry_after_s) for a in answers] == [("RESOURCE_EXHAUSTED", "pool full", 0.5)]


def test_prefills_failure_notes_and_a_draining_node_take_the_threaded_path():
    engine = StubWorkerEngine()
    svc = _service(engine)
    assert svc.start_step(_decode_step(ASYNC_STEP_TOKENS + 1)[1], print) is False  # a prefill's output may be MBs
    assert svc.start_step(_decode_step(ASYNC_STEP_TOKENS)[1], lambda out: None) is True  # 16 drafts verified
    note = pb.Envelope(session_id="s1", epoch=3, step_id=41, n_chunks=1, failure=pb.HopFailure(node_id="mid"))
    assert svc.start_forward([note], lambda: None) is False
    svc.draining = True
    assert svc.start_step(_decode_step()[1], print) is False
    assert len(engine.started) == 1


def test_a_forwarded_step_at_the_tail_reaches_the_clients_await_and_says_done_once():
    engine = StubWorkerEngine(layers=(20, 30))  # the tail
    svc = _service(engine)
    req, frames = _decode_step()
    done: list[bool] = []
    assert svc.start_forward(frames, lambda: done.append(True)) is True
    awaited: list[StepOutcome] = []
    svc.run_await(pb.AwaitStep(session_id="s1", step_id=41, epoch=3), awaited.append)
    assert awaited == [] and done == []
    res = StepResult(Status.OK, token=SampledToken(9, -1.5), n_past=41)
    engine.started[0][2](res)
    assert done == [True]
    assert [(a.code, a.replies) for a in awaited] == [("OK", result_to_replies(req, res))]


def test_an_async_call_gets_the_workers_answer_or_its_death():
    cfg = NodeConfig(model="", layers=LayerRange.parse("0:30"), engine="fake", fault="delay=2")
    sup = WorkerSupervisor(cfg, ping_interval_s=0.2)
    sup.start()
    try:
        got: list[object] = []
        arrived = threading.Event()

        def on_done(out) -> None:
            got.append(out)
            arrived.set()

        sup.channel().call_async("session_ids", on_done=on_done)
        assert arrived.wait(30) and got == [[]]
        got.clear()
        arrived.clear()
        sup.channel().call_async("prefill", StepRequest("s", 1, 0, (1, 2, 3)), on_done=on_done)
        sup._proc.kill()  # the step sleeps 2 s in the worker: it dies with the step in flight
        assert arrived.wait(30)
        assert len(got) == 1 and isinstance(got[0], EngineUnavailable)
        assert "engine worker died during prefill (killed by SIGKILL)" in str(got[0])
    finally:
        sup.stop()


class StubForwarder:
    """Has no pooled connection until it has connected once."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bool, str]] = []  # (hop, connect, thread)
        self.connected = False

    def send(self, hop, frames, connect=True):
        from meshnet.node.forwarding import WouldWait

        if not connect and not self.connected:
            raise WouldWait(hop.data_address)
        self.connected = True
        self.sent.append((hop.node_id, connect, threading.current_thread().name))
        return None


def test_a_step_that_needs_a_new_connection_is_sent_on_from_a_thread_of_its_own():
    """Connecting to a node that accepts and then hangs takes the forwarder's timeout: never on the thread
    that hands out every other step's answer."""
    engine = StubWorkerEngine()
    svc = _service(engine)
    svc.forwarder = StubForwarder()
    hops = [pb.ForwardHop(node_id="tail", data_address="127.0.0.1:9")]
    req = StepRequest("s1", 3, 40, (5,), step_id=41)
    done = threading.Event()
    assert svc.start_forward(request_to_frames(req, True, next_hops=hops), done.set)
    hidden = StepResult(Status.OK, hidden=_hidden(), n_past=41)
    engine.started[0][2](hidden)
    assert done.wait(10)
    assert svc.forwarder.sent == [("tail", True, "forward-connect")]
    done.clear()
    assert svc.start_forward(request_to_frames(replace(req, position=41, step_id=42), True, next_hops=hops), done.set)
    engine.started[1][2](hidden)  # pooled now: sent on by the thread that handed out the answer
    assert done.is_set() and svc.forwarder.sent[1] == ("tail", False, threading.current_thread().name)


def _hidden():
    import numpy as np

    from meshnet.contract import NamedTensor

    return NamedTensor("hidden", (1, 8), "f32", np.arange(8, dtype=np.float32).tobytes())


def test_the_forwarder_refuses_to_connect_when_asked_not_to_and_reuses_its_connection():
    from meshnet.node.forwarding import Forwarder, WouldWait
    from meshnet.wire.data_plane_server import DataPlaneServer

    got: list[list[pb.Envelope]] = []
    arrived = threading.Semaphore(0)

    def run_forward(frames) -> None:
        got.append(frames)
        arrived.release()

    server = DataPlaneServer("127.0.0.1", 0, lambda frames: None, "tok", run_forward=run_forward)
    server.start()
    fwd = Forwarder("tok")
    try:
        hop = pb.ForwardHop(node_id="n", data_address=f"127.0.0.1:{server.port}")
        frames = request_to_frames(StepRequest("s", 1, 0, (1,), step_id=1), True)
        with pytest.raises(WouldWait):
            fwd.send(hop, frames, connect=False)
        assert fwd.send(hop, frames) is None and arrived.acquire(timeout=10)
        assert fwd.send(hop, frames, connect=False) is None and arrived.acquire(timeout=10)
        assert [f[0].session_id for f in got] == ["s", "s"] and server.stats["accepted"] == 1
    finally:
        fwd.close()
        server.stop()
