"""The engine worker process and its supervisor, without a node around them: calls forwarded
concurrently and answered as in one process, real deaths (segfault, abort, exit, SIGKILL) and a hang
detected and restarted, a crash loop given up with its reason."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mesh_util import greedy_steps, wait_for
from meshnet.contract import ArtifactId, LayerRange, Status, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.engine.fake_faults import parse_fault_spec
from meshnet.node.config import NodeConfig
from meshnet.node.worker_channel import EngineCallFailed
from meshnet.node.worker_engine import WorkerEngine
from meshnet.node.worker_supervisor import WorkerSupervisor
from meshnet.node.worker_wire import EngineUnavailable
from meshnet.restart_policy import RestartPolicy

FAST = RestartPolicy(initial_delay_s=0.1, max_delay_s=0.2)


def _worker(layers: str = "0:30", fault: str = "", restarts: int = 5, hang_s: float = 5.0,
            on_give_up=None) -> WorkerEngine:
    cfg = NodeConfig(model="", layers=LayerRange.parse(layers), engine="fake", fault=fault,
                     worker_restarts=restarts, worker_hang_timeout_s=hang_s)
    sup = WorkerSupervisor(cfg, policy=FAST, on_give_up=on_give_up, ping_interval_s=0.2)
    sup.start()
    return WorkerEngine(sup)


def _local(layers: str) -> FakeEngine:
    eng = FakeEngine(FakeModel())
    r = LayerRange.parse(layers)
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(FakeModel().sha256, r))).ok
    return eng


def _greedy(engine, sid: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return greedy_steps(engine.prefill, engine.decode, sid, prompt, n)


def test_concurrent_sessions_through_the_worker_equal_the_engine_in_process():
    worker, local = _worker(), _local("0:30")
    try:
        prompts = [tuple(range(1 + i, 9 + 3 * i)) for i in range(8)]
        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _greedy(worker, f"s{i}", prompts[i], 12)))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [got[i] for i in range(8)] == [_greedy(local, f"s{i}", prompts[i], 12) for i in range(8)]
        assert worker.health().active_sessions == 8
        assert sorted(worker.session_ids()) == sorted(f"s{i}" for i in range(8))
        assert worker.metrics().decode_tokens == 8 * 11 + 8  # and the load's speed probe: 8 decode steps
        for i in range(8):
            assert worker.release(f"s{i}").ok
        assert worker.health().active_sessions == 0
    finally:
        worker.supervisor.stop()


def test_the_speed_probe_runs_through_the_worker_and_leaves_no_session():
    """The node's idle re-probe goes through its engine worker: its release took no ``keep_prefix`` there,
    so the probe raised and left its session open (a session slot and cells held for the idle timeout)."""
    from meshnet.node.engine_loader import measure_decode_speed

    worker = _worker("10:20")
    try:
        assert measure_decode_speed(worker, steps=4) > 0
        assert worker.health().active_sessions == 0 and worker.session_ids() == []
    finally:
        worker.supervisor.stop()


def test_hidden_states_cross_the_pipe_bit_for_bit():
    worker, local = _worker("0:10"), _local("0:10")
    try:
        prompt = tuple(range(3, 300))  # a 297-row prefill: hidden states of several KB
        a, b = worker.prefill(StepRequest("h", 0, 0, prompt)), local.prefill(StepRequest("h", 0, 0, prompt))
        assert a.hidden.shape == (297, 8) and a.hidden.data == b.hidden.data
        a, b = worker.decode(StepRequest("h", 0, 297, (5,))), local.decode(StepRequest("h", 0, 297, (5,)))
        assert np.array_equal(a.hidden.to_numpy(), b.hidden.to_numpy())
        # Statuses cross unchanged: a decode at the wrong position.
        bad = worker.decode(StepRequest("h", 0, 7, (5,)))
        assert bad.status is Status.FAILED_PRECONDITION and "298 tokens cached" in bad.message
    finally:
        worker.supervisor.stop()


def test_a_calls_hidden_states_cross_as_the_payload_not_inside_the_pickle():
    """A later stage's prefill sends the worker [n_tokens, n_embd] hidden states: they leave as the message's
    payload, the bytes given, where nested in the call's argument tuple they were pickled into its meta
    (copied twice more, and held twice in each process meanwhile)."""
    from meshnet.contract import NamedTensor
    from meshnet.node import worker_wire as ww

    hidden = NamedTensor.from_numpy("h", np.arange(1000 * 576, dtype=np.float32).reshape(1000, 576))
    req = StepRequest("s", 2, 0, tuple(range(1000)), hidden=hidden)
    meta, payload = ww.encode_call("prefill", (req,))
    assert payload is hidden.data and len(payload) == 1000 * 576 * 4
    assert len(meta) < 8192  # the method, the request's fields and 1000 token ids
    method, args = ww.decode_call(meta, payload)
    assert method == "prefill" and len(args) == 1 and args[0] == req
    assert ww.decode_call(*ww.encode_call("release", ("s", False))) == ("release", ("s", False))
    assert ww.decode_call(*ww.encode_call("session_ids", ())) == ("session_ids", ())


def test_an_exception_in_the_engine_is_reported_and_the_worker_lives_on():
    worker = _worker(fault="crash=raise,after=1")
    try:
        assert worker.prefill(StepRequest("r", 0, 0, (1, 2))).ok
        with pytest.raises(EngineCallFailed, match="FakeCrash: fake engine crashed on call 2"):
            worker.decode(StepRequest("r", 0, 2, (3,)))
        assert worker.supervisor.restarts == 0 and worker.supervisor.status == ""
    finally:
        worker.supervisor.stop()


@pytest.mark.parametrize("kind, reason", [("segfault", "killed by SIGSEGV"), ("abort", "killed by SIGABRT"),
                                          ("exit", "exited with status 70"), ("sigkill", "killed by SIGKILL")])
def test_a_dead_worker_fails_its_call_restarts_and_has_lost_its_sessions(kind, reason):
    worker = _worker(fault=f"crash={kind},after=2")
    sup = worker.supervisor
    try:
        first_pid = sup.pid
        assert worker.prefill(StepRequest("a", 0, 0, (1, 2))).ok
        assert worker.decode(StepRequest("a", 0, 2, (3,))).ok
        with pytest.raises(EngineUnavailable, match=f"died during decode \\({reason}\\)"):
            worker.decode(StepRequest("a", 0, 3, (4,)))
        assert wait_for(lambda: sup.status == "", 30.0) is not None
        assert sup.restarts == 1 and sup.pid not in (None, first_pid)
        lost = worker.decode(StepRequest("a", 0, 3, (4,)))
        assert lost.status is Status.NOT_FOUND
        # The fault hit the first worker only: the second serves on.
        assert _greedy(worker, "b", (1, 2), 6) == _greedy(_local("0:30"), "b", (1, 2), 6)
        assert worker.health().healthy and sup.restarts == 1
    finally:
        sup.stop()


def test_a_hung_worker_is_killed_and_restarted_while_health_answers():
    worker = _worker(fault="crash=hang,after=1", hang_s=1.0)
    sup = worker.supervisor
    try:
        assert worker.prefill(StepRequest("a", 0, 0, (1, 2))).ok
        errors: list[Exception] = []

        def hung_call():
            try:
                worker.decode(StepRequest("a", 0, 2, (3,)))
            except EngineUnavailable as e:
                errors.append(e)

        t = threading.Thread(target=hung_call)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        h = worker.health()  # answered by the node side within its own timeout, not the worker's
        assert time.monotonic() - t0 < 3.0
        assert not h.healthy
        t.join(30)
        assert len(errors) == 1 and "hung: no answer to a ping within 1 s, killed" in str(errors[0])
        assert wait_for(lambda: sup.status == "", 30.0) is not None
        assert sup.restarts == 1 and worker.health().healthy
    finally:
        sup.stop()


def test_a_crash_loop_backs_off_then_gives_up_with_the_reason():
    reasons: list[str] = []
    worker = _worker(fault="crash=exit,after=0,workers=0", restarts=2, on_give_up=reasons.append)
    sup = worker.supervisor
    try:
        deadline = time.monotonic() + 60
        while not reasons and time.monotonic() < deadline:
            try:
                worker.prefill(StepRequest("x", 0, 0, (1,)))
            except EngineUnavailable:
                pass
            time.sleep(0.05)
        assert reasons == ["engine worker died 3 times in a row, each within 30 s of its start "
                           "(last: exited with status 70)"]
        assert sup.restarts == 2
        assert sup.status.startswith("engine worker gave up: engine worker died 3 times")
        with pytest.raises(EngineUnavailable, match="gave up"):
            worker.prefill(StepRequest("x", 0, 0, (1,)))
    finally:
        sup.stop()


@pytest.mark.parametrize("script,reason", [("exit 1", "exited with status 1"),
                                           ("kill -SEGV $$", "killed by SIGSEGV")])
def test_a_worker_dying_while_it_loads_is_one_error_naming_how(tmp_path, monkeypatch, script, reason):
    """A crash in native code (or the OOM killer) before READY is the node's load error, not an EOFError."""
    from meshnet.node import worker_supervisor

    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\n{script}\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(worker_supervisor.sys, "executable", str(fake_python))
    cfg = NodeConfig(model="smollm2", layers=LayerRange.parse("0:12"), engine="fake")
    sup = WorkerSupervisor(cfg, policy=FAST)
    with pytest.raises(ValueError) as e:
        sup.start()
    assert str(e.value) == f"the engine worker {reason} while loading layers 0:12 of smollm2 (its messages are above)"
    assert sup._proc.poll() is not None


def test_a_load_that_runs_out_of_memory_names_the_settings_that_size_it():
    """The worker's load fails in one line, not a traceback, whatever it raises."""
    import errno

    from meshnet.node.engine_loader import load_failure

    cfg = NodeConfig(model="smollm2", layers=None, n_ctx=10**12, engine="ggml")
    assert load_failure(OSError(errno.ENOMEM, "Cannot allocate memory"), cfg) == (
        "not enough memory to load every layer of smollm2 with n_ctx=1000000000000, kv_tokens=0, max_sessions=16 "
        "([Errno 12] Cannot allocate memory); lower them")
    assert load_failure(MemoryError(), cfg).startswith("not enough memory to load every layer of smollm2")
    assert load_failure(FileNotFoundError("model '/tmp' is neither a file nor a bundled model"), cfg) == (
        "model '/tmp' is neither a file nor a bundled model")
    assert load_failure(KeyError("x"), cfg) == "KeyError: 'x'"


def test_fault_spec_parses_and_refuses_bad_text():
    faults, workers = parse_fault_spec("crash=segfault,after=5")
    assert (faults.crash_kind, faults.crash_after_calls, workers) == ("segfault", 5, 1)
    faults, workers = parse_fault_spec("delay=0.5,workers=0")
    assert (faults.delay_s, faults.crash_after_calls, workers) == (0.5, None, 0)
    with pytest.raises(ValueError, match="crash_kind must be one of"):
        parse_fault_spec("crash=melt")
    with pytest.raises(ValueError, match="after=N needs crash=KIND"):
        parse_fault_spec("after=3")
    with pytest.raises(ValueError, match="got 'speed=3'"):
        parse_fault_spec("speed=3")


def test_a_ping_behind_a_message_stuck_in_the_pipe_of_a_worker_that_stopped_reading_is_not_answered():
    """A prefill's megabytes sent to a stopped worker (SIGSTOP) filled the pipe, and its sender held the
    channel's send lock: the watchdog's ping waited on that lock for good, and the hung worker was never
    killed. A ping that cannot be sent within its timeout now counts as unanswered."""
    import socket

    from meshnet.node.worker_channel import WorkerChannel

    ours, worker = socket.socketpair()  # the worker end is never read: a stopped worker
    channel = WorkerChannel(ours)
    results: list = []
    sender = threading.Thread(target=lambda: results.append(
        _outcome(lambda: channel.call("prefill", b"x" * (64 << 20), timeout_s=30))), daemon=True)
    sender.start()
    assert wait_for(lambda: channel._send_lock.locked(), 5.0) is not None  # 64 MB fill the pipe, the lock held
    pings: list[bool] = []
    pinger = threading.Thread(target=lambda: pings.append(channel.ping(0.3)), daemon=True)
    pinger.start()
    pinger.join(5.0)
    try:
        assert pings == [False]
    finally:
        worker.close()  # as the watchdog's kill does: the stuck send fails, the call with it
        channel.close("killed")
        sender.join(5.0)
    assert len(results) == 1 and isinstance(results[0], EngineUnavailable)


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test looks at what was raised
        return e
