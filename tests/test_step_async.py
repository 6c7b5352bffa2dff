"""Steps started without a waiting thread (``ShardEngine.step_async`` over ``StepScheduler.submit_nowait``):
the same results, statuses and session bookkeeping as a blocking step, the outcome handed over on the
scheduler's thread, and the cases that must fall back to a blocking call; and the session checks both
paths share, as plain functions."""

from __future__ import annotations

import threading
import time

import pytest

from mesh_util import greedy_steps
from meshnet.contract import ArtifactId, LayerRange, SamplingParams, Status, StepRequest, StepResult
from meshnet.load_spec import LoadSpec
from meshnet.engine.session import Session
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.engine.fake_faults import FakeCrash, FakeFaults
from meshnet.engine.scheduler import StepScheduler
from meshnet.engine.step_validation import new_session_problem, session_problem
from meshnet.sampling_params import Grammar

PROMPT = (11, 22, 33, 44, 55)


def _engine(layers: LayerRange = LayerRange(0, 30), faults: FakeFaults | None = None) -> FakeEngine:
    engine = FakeEngine(FakeModel(), faults)
    assert engine.load(LoadSpec(path="", artifact=ArtifactId("", layers))).ok
    return engine


class Outcome:
    """What one ``on_done`` received, and on which thread."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: StepResult | BaseException | None = None
        self.thread = ""
        self.calls = 0

    def __call__(self, value) -> None:
        self.value, self.thread = value, threading.current_thread().name
        self.calls += 1
        self.done.set()

    def wait(self) -> StepResult | BaseException:
        assert self.done.wait(10), "on_done was never called"
        return self.value


def _async_step(engine: FakeEngine, req: StepRequest, decode: bool) -> Outcome:
    out = Outcome()
    assert engine.step_async(req, decode, out) is True
    out.wait()
    return out


def test_async_steps_equal_blocking_steps_and_keep_the_books():
    alone = _engine()
    blocking = greedy_steps(alone.prefill, alone.decode, "s", PROMPT, 6)
    engine = _engine()
    got = greedy_steps(lambda r: _async_step(engine, r, False).value, lambda r: _async_step(engine, r, True).value,
                       "s", PROMPT, 6)
    assert got == blocking
    out = _async_step(engine, StepRequest("s", 0, len(PROMPT) + 5, (got[-1],)), True)
    assert out.thread == "stage-scheduler" and out.calls == 1
    assert out.value.ok and out.value.n_past == len(PROMPT) + 6
    m = engine.metrics()
    assert (m.prefill_tokens, m.decode_tokens) == (len(PROMPT), 6)
    assert engine.health().active_sessions == 1


def test_a_refused_step_is_answered_at_once_on_the_calling_thread():
    engine = _engine()
    out = Outcome()
    assert engine.step_async(StepRequest("nobody", 0, 3, (7,)), True, out) is True
    assert out.done.is_set() and out.thread == threading.current_thread().name  # answered before returning
    assert out.value.status is Status.NOT_FOUND and "'nobody'" in out.value.message
    # a first prefill refused at its position leaves no session behind
    assert _async_step(engine, StepRequest("s", 0, 4, PROMPT), False).value.status is Status.NOT_FOUND
    assert engine.health().active_sessions == 0


def test_a_step_behind_its_sessions_running_step_falls_back_to_blocking():
    engine = _engine(faults=FakeFaults(delay_s=0.4))
    first = Outcome()
    assert engine.step_async(StepRequest("s", 0, 0, PROMPT), False, first) is True
    time.sleep(0.05)  # the prefill is running
    later = Outcome()
    assert engine.step_async(StepRequest("s", 0, len(PROMPT), (5,)), True, later) is False
    assert not later.done.is_set()
    assert first.wait().ok
    # nothing was started by the refused call: the blocking path runs the step as usual
    assert engine.decode(StepRequest("s", 0, len(PROMPT), (5,))).n_past == len(PROMPT) + 1
    # another session is not held up by it
    assert _async_step(engine, StepRequest("t", 0, 0, PROMPT), False).value.ok


def test_a_tail_step_with_a_grammar_falls_back_to_blocking():
    engine = _engine()
    req = StepRequest("g", 0, 0, PROMPT, sampling=SamplingParams(grammar=Grammar('{"type": "object"}')))
    out = Outcome()
    assert engine.step_async(req, False, out) is False and not out.done.is_set()
    assert engine.health().active_sessions == 0
    # not the tail: the grammar is not its business, the step starts
    mid = _engine(LayerRange(0, 10))
    assert _async_step(mid, req, False).value.ok


def test_crash_injection_counts_async_steps_and_leaves_no_busy_session():
    engine = _engine(faults=FakeFaults(crash_after_calls=1))
    assert _async_step(engine, StepRequest("s", 0, 0, PROMPT), False).value.ok  # call 1
    with pytest.raises(FakeCrash):  # call 2 crashes before it starts
        engine.step_async(StepRequest("s", 0, len(PROMPT), (5,)), True, Outcome())
    engine.set_faults(FakeFaults())
    assert engine.step_async(StepRequest("s", 0, len(PROMPT), (5,)), True, Outcome()) is True


def test_submit_nowait_hands_a_failed_iteration_to_its_callback_and_goes_on():
    def run_batch(chunks):
        if any(c.req.token_ids == (666,) for c in chunks):
            raise RuntimeError("bad row")
        return [StepResult(Status.OK, n_past=c.end) for c in chunks]

    sched = StepScheduler(run_batch, lambda job: job.parts[-1], 0, lambda s: False)
    jobs: dict[str, object] = {}
    done = threading.Event()

    def record(job) -> None:
        jobs[job.session] = job
        if len(jobs) == 3:
            done.set()
        if job.session == "boom":
            raise ValueError("a callback that fails")  # logged; the stage goes on

    for sid, ids in (("boom", (666,)), ("a", (1, 2)), ("b", (3,))):
        sched.submit_nowait(sid, StepRequest(sid, 1, 0, ids), on_done=record)
    assert done.wait(10)
    assert isinstance(jobs["boom"].error, RuntimeError) and str(jobs["boom"].error) == "bad row"
    assert (jobs["a"].error, jobs["a"].result.n_past, jobs["b"].result.n_past) == (None, 2, 1)
    assert sched.submit("c", StepRequest("c", 1, 0, (4, 5, 6))).n_past == 3  # the loop still runs


# ---- the session checks every step passes, as plain functions --------------------------------------
def test_session_checks_name_what_is_wrong():
    first = StepRequest("s", 4, 0, PROMPT)
    assert new_session_problem(first, False, fence=0, n_sessions=1, max_sessions=2) is None
    assert new_session_problem(first, False, fence=5, n_sessions=1, max_sessions=2) == (
        Status.FAILED_PRECONDITION, "stale route epoch 4 for session 's' (it moved to epoch 5)")
    assert new_session_problem(first, True, 0, 1, 2)[0] is Status.NOT_FOUND
    assert new_session_problem(StepRequest("s", 4, 3, PROMPT), False, 0, 1, 2)[0] is Status.NOT_FOUND
    assert new_session_problem(first, False, 0, 2, 2) == (Status.RESOURCE_EXHAUSTED,
                                                          "stage is at its limit of 2 sessions")
    s = Session("s", epoch=4, state=None, n_past=5)
    assert session_problem(s, StepRequest("s", 4, 5, (7,))) is None
    assert session_problem(s, StepRequest("s", 3, 5, (7,)))[1].endswith("(session is at epoch 4)")
    assert "has 5 tokens cached" in session_problem(s, StepRequest("s", 4, 4, (7,)))[1]
    assert session_problem(s, StepRequest("s", 4, 3, (7,), rollback=True)) is None
    assert "has only 5 tokens cached" in session_problem(s, StepRequest("s", 4, 6, (7,), rollback=True))[1]
    s.cancelled = True
    assert session_problem(s, StepRequest("s", 4, 5, (7,))) == (Status.CANCELLED, "session 's' was cancelled")
