"""The API's admission line: first prefills refused for lack of room retry in arrival order, a newcomer
queues behind the waiters, the latest give up at the deadline, and a cancelled waiter leaves at once."""

from __future__ import annotations

import threading
import time

from meshnet.api.backend import AdmissionLine, AdmissionRetry
from meshnet.contract import Status, StepRequest, StepResult


class Room:
    """A stand-in client: a first prefill is admitted while ``free`` > 0 (taking one), else refused with
    RESOURCE_EXHAUSTED and a 10 ms back-off; records the order of admissions and how many tries each
    session made."""

    def __init__(self, free: int = 0) -> None:
        self.free, self.admitted, self.tries = free, [], {}
        self._lock = threading.Lock()

    def step(self, req: StepRequest, decode: bool) -> StepResult:
        with self._lock:
            self.tries[req.session_id] = self.tries.get(req.session_id, 0) + 1
            if self.free > 0:
                self.free -= 1
                self.admitted.append(req.session_id)
                return StepResult(Status.OK, n_past=1)
        return StepResult(Status.RESOURCE_EXHAUSTED, "KV pool: no room", retry_after_s=0.01)

    def release(self, session_id: str) -> None:
        pass

    def cancel(self, session_id: str) -> None:
        pass


def _start(line: AdmissionLine, room: Room, sid: str, results: dict, wait_s: float = 10.0,
           since: float | None = None) -> AdmissionRetry:
    client = AdmissionRetry(room, wait_s=wait_s, line=line, since=since)
    t = threading.Thread(target=lambda: results.__setitem__(sid, client.step(StepRequest(sid, 0, 0, (1,)), False)))
    t.start()
    results.setdefault("_threads", []).append(t)
    return client


def _join(results: dict) -> None:
    for t in results.pop("_threads"):
        t.join(15)


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_room_goes_to_the_longest_waiter():
    line, room, results = AdmissionLine(), Room(), {}
    for i, sid in enumerate("abcde"):
        _start(line, room, sid, results)
        _wait_for(lambda: line.waiting() == i + 1)  # arrival order is the order they were started
    time.sleep(0.05)
    assert set(room.tries) == {"a"} and room.tries["a"] > 1  # only the first in line retries
    for _ in range(5):  # room frees one session at a time
        room.free += 1
        time.sleep(0.05)
    _join(results)
    assert room.admitted == list("abcde")
    assert all(results[s].ok for s in "abcde") and line.waiting() == 0


def test_a_newcomer_queues_behind_the_waiters_and_the_latest_give_up():
    line, room, results = AdmissionLine(), Room(), {}
    _start(line, room, "first", results, wait_s=0.6)
    _wait_for(lambda: line.waiting() == 1)
    # it waited 29.7 s for a generation slot before (the API's 30 s in all): the refusal says 30 s, where
    # it said "waited 0.3 s", the budget left to the line
    _start(line, room, "second", results, wait_s=0.3, since=time.monotonic() - 29.7)
    _wait_for(lambda: line.waiting() == 2)
    _join(results)
    assert room.tries.get("second") is None  # never reached the front: never tried
    late = results["second"]
    assert late.status is Status.RESOURCE_EXHAUSTED and late.retry_after_s > 0
    waited = float(late.message.split("waited ")[1].split(" s,")[0])
    assert 30.0 <= waited < 32.0 and "for a generation slot and in line behind other requests" in late.message
    assert results["first"].status is Status.RESOURCE_EXHAUSTED and "KV pool" in results["first"].message


def test_a_request_alone_tries_at_once_and_decodes_pass_by():
    line, room = AdmissionLine(), Room(free=1)
    client = AdmissionRetry(room, line=line)
    assert client.step(StepRequest("solo", 0, 0, (1,)), False).ok and room.tries == {"solo": 1}
    assert client.step(StepRequest("solo", 0, 1, (2,)), True).status is Status.RESOURCE_EXHAUSTED  # no retry
    assert room.tries == {"solo": 2} and line.waiting() == 0


def test_a_cancelled_waiter_leaves_the_line_at_once():
    line, room, results = AdmissionLine(), Room(), {}
    _start(line, room, "head", results, wait_s=0.5)
    _wait_for(lambda: line.waiting() == 1)
    behind = _start(line, room, "behind", results, wait_s=30.0)
    _wait_for(lambda: line.waiting() == 2)
    t0 = time.monotonic()
    behind.cancel("behind")
    _wait_for(lambda: "behind" in results)
    assert time.monotonic() - t0 < 1.0 and results["behind"].status is Status.CANCELLED
    assert "cancelled while it waited in line" in results["behind"].message
    _join(results)
    assert line.waiting() == 0


def test_a_long_first_prefill_does_not_hold_up_the_next_request():
    """A 4000-token prompt's prefill held the front of the line all through: a request arriving meanwhile
    waited for it to end, with room for both (30 s, then a 503). With nobody waiting for room, first
    prefills go to the stages side by side."""
    started, finish_long = set(), threading.Event()

    class SlowLong(Room):
        def step(self, req: StepRequest, decode: bool) -> StepResult:
            started.add(req.session_id)
            if req.session_id == "long":
                finish_long.wait(10)
            return super().step(req, decode)

    line, room, results = AdmissionLine(), SlowLong(free=2), {}
    _start(line, room, "long", results)
    _wait_for(lambda: "long" in started)
    _start(line, room, "short", results)
    _wait_for(lambda: "short" in results, timeout_s=2.0)
    assert results["short"].ok and "long" not in results
    finish_long.set()
    _join(results)
    assert results["long"].ok and room.admitted == ["short", "long"] and line.waiting() == 0
