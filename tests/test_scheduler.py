"""The stage scheduler's packing, on plain data: which steps go into which iteration."""

from __future__ import annotations

import threading
import time

import pytest

from meshnet.contract import Status, StepRequest, StepResult
from meshnet.engine.scheduler import Chunk, StepScheduler


class Recorder:
    """A batch hook that records each iteration's chunks as (session, start, end) and holds the first
    iteration until ``release`` is set, so the steps submitted meanwhile queue up together."""

    def __init__(self) -> None:
        self.iterations: list[list[tuple[str, int, int]]] = []
        self.release = threading.Event()

    def __call__(self, chunks: list[Chunk]) -> list[StepResult]:
        if not self.iterations:
            self.release.wait(10)
        self.iterations.append([(c.session, c.start, c.end) for c in chunks])
        return [StepResult(Status.OK, n_past=c.end) for c in chunks]


def run_queued(decode_groups: int, n_open: int, decodes: list[str], prefills: list[tuple[str, int]] = (),
               chunk_tokens: int = 0) -> list[list[tuple[str, int, int]]]:
    """Queue ``decodes`` (one-token steps of those sessions), then prefills of ``(session, n_tokens)``,
    in that order behind a first step that holds the worker, then let them all run; returns the
    iterations after the first."""
    rec = Recorder()
    sched = StepScheduler(rec, lambda job: job.parts[-1], chunk_tokens, lambda s: False, lambda: n_open)
    sched.decode_groups = decode_groups
    threads = [threading.Thread(target=sched.submit, args=("first", StepRequest("first", 1, 0, (1, 2))))]
    threads[0].start()
    time.sleep(0.05)  # the worker holds "first"
    steps = [(s, StepRequest(s, 1, 5, (7,))) for s in decodes]
    steps += [(sid, StepRequest(sid, 1, 0, tuple(range(n)))) for sid, n in prefills]
    for s, req in steps:
        t = threading.Thread(target=sched.submit, args=(s, req))
        t.start()
        threads.append(t)
        time.sleep(0.005)  # arrival order is submission order
    deadline = time.monotonic() + 5
    while sched.waiting() < len(steps) + 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    rec.release.set()
    for t in threads:
        t.join(10)
    return rec.iterations[1:]


def test_one_group_takes_every_waiting_decode():
    its = run_queued(decode_groups=1, n_open=9, decodes=[f"s{i}" for i in range(9)])
    assert [len(it) for it in its] == [9]


@pytest.mark.parametrize("groups,sizes", [(3, [3, 3, 3]), (2, [5, 4]), (9, [1] * 9), (20, [1] * 9)])
def test_decode_groups_split_the_open_sessions_in_arrival_order(groups, sizes):
    names = [f"s{i}" for i in range(9)]
    its = run_queued(decode_groups=groups, n_open=9, decodes=names)
    assert [len(it) for it in its] == sizes
    assert [name for it in its for name, _, _ in it] == names


def test_a_group_is_sized_by_the_decoding_sessions_not_the_prefilling_ones():
    # 7 open sessions, one of them in a 40-token prefill: 6 decode in 3 groups of 2; the prefill rides
    # in the first iteration, in chunks of 16 tokens, while the decodes take turns
    its = run_queued(decode_groups=3, n_open=7, decodes=[f"s{i}" for i in range(6)], prefills=[("p", 40)],
                     chunk_tokens=16)
    assert its == [[("s0", 0, 1), ("s1", 0, 1), ("p", 0, 16)], [("s2", 0, 1), ("s3", 0, 1), ("p", 16, 32)],
                   [("s4", 0, 1), ("s5", 0, 1), ("p", 32, 40)]]


def test_a_short_prompt_behind_a_long_prefill_waits_one_chunk_and_the_long_one_every_other_iteration():
    """Prefills in arrival order made a 30-token question wait out a 3000-token document's whole
    prefill. Now the fewest tokens left go first, and a prefill passed over goes first in the next
    iteration: here a 40-token prefill (chunks of 16) and, queued behind it, two 4-token ones."""
    assert run_queued(1, 3, [], [("long", 40), ("q1", 4), ("q2", 4)], chunk_tokens=16) == [
        [("q1", 0, 4), ("q2", 0, 4)], [("long", 0, 16)], [("long", 16, 32)], [("long", 32, 40)]]


def test_two_long_prefills_take_turns_chunk_by_chunk():
    # b has fewer tokens left, a was passed over: they alternate, each chunk where it would fall alone
    assert run_queued(1, 2, [], [("a", 48), ("b", 40)], chunk_tokens=16) == [
        [("b", 0, 16)], [("a", 0, 16)], [("b", 16, 32)], [("a", 16, 32)], [("b", 32, 40)], [("a", 32, 48)]]


def test_a_long_prefill_is_not_passed_over_for_good_by_a_stream_of_short_ones():
    """Three 4-token prompts arrive every iteration (budget 16) beside a 48-token one. Had those left out
    gone first by the fewest tokens left, the shorts left out would always precede the long prefill,
    whose chunk then never fitted; those left out longest go first, so it runs within a few iterations."""
    from meshnet.engine.scheduler import Job

    sched = StepScheduler(lambda chunks: [], lambda job: None, 16, lambda s: False)
    sched._queue.append(Job("long", StepRequest("long", 1, 0, tuple(range(48)))))
    served = []
    for it in range(8):
        for k in range(3):
            sid = f"q{it}.{k}"
            sched._queue.append(Job(sid, StepRequest(sid, 1, 0, (1, 2, 3, 4))))
        picked = sched._next_iteration()
        sched.stats.iterations += 1
        assert sum(c.end - c.start for _, c in picked) <= 16
        for job, chunk in picked:
            job.done_tokens = chunk.end
            if chunk.last:
                sched._queue.remove(job)
        served.append([(job.session, chunk.start, chunk.end) for job, chunk in picked if job.session == "long"])
    # every chunk within two iterations of the last (the cohort left out before it goes first)
    assert [(i, chunk) for i, chunks in enumerate(served) for chunk in chunks] == [
        (1, ("long", 0, 16)), (3, ("long", 16, 32)), (6, ("long", 32, 48))]


def test_a_decode_group_waits_for_its_companions_and_not_for_a_count():
    """7 sessions in 2 groups (4 and 3). Waiting for a group's worth by count held the group of 3 back
    the whole allowance at every iteration for a fourth that never came; now a group waits for the
    sessions it last ran with here, and only while one of them is still to come."""
    from meshnet.engine.scheduler import Job

    rec = Recorder()
    names = [f"s{i}" for i in range(7)]
    sched = StepScheduler(rec, lambda job: job.parts[-1], 0, lambda s: False, lambda: 7)
    sched.decode_groups = 2
    threads = [threading.Thread(target=sched.submit, args=("first", StepRequest("first", 1, 0, (1, 2))))]
    threads[0].start()
    time.sleep(0.05)
    for s in names:
        threads.append(threading.Thread(target=sched.submit, args=(s, StepRequest(s, 1, 5, (7,)))))
        threads[-1].start()
        time.sleep(0.005)
    while sched.waiting() < 8:
        time.sleep(0.001)
    rec.release.set()
    for t in threads:
        t.join(10)
    assert [[s for s, _, _ in it] for it in rec.iterations[1:]] == [names[:4], names[4:]]

    timed_waits: list[float] = []
    wait = sched._cv.wait

    def recording_wait(timeout=None):
        if timeout is not None:
            timed_waits.append(timeout)
        return wait(timeout)

    sched._cv.wait = recording_wait
    sched._last_iteration_s = 10.0  # allowances at their cap, MAX_GATHER_S

    def gather(queued: list[str]) -> int:
        """Queue decodes of ``queued`` (the worker is idle and not told), gather; timed waits it made."""
        timed_waits.clear()
        with sched._cv:
            sched._queue[:] = [Job(s, StepRequest(s, 1, 6, (8,))) for s in queued]
            sched._gather()
            sched._queue.clear()
        return len(timed_waits)

    assert gather(names[4:]) == 0  # the group of 3 is whole: it goes at once
    assert gather(names[:3]) >= 1  # s3 is still to come: the group waits for it (the allowance)
    assert gather(["new0", "new1"]) >= 1  # no companions known yet: a group's worth, as briefly
    sched.forget(names[3])  # s3 was released
    assert gather(names[:3]) == 0
