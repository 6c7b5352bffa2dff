"""Free the sessions a client left behind on nodes it failed over away from.

A node that was failed over because it stopped answering (a hung process, a stalled VM, a network
partition) may come back and keep the session's KV cache until its idle sweep, minutes later. The client
is the one party that knows the session moved, so it tells the old node, in the background and without
delaying the generation: release the session *if it is older than the new route epoch*. The epoch
condition makes a late release harmless even if the session was routed back to that node meanwhile,
and the node then refuses the session's older steps, so a step still queued there from before the
failover cannot recreate it. A node that is really dead never answers; the attempts stop after
``horizon_s`` (by then the node's own idle sweep would have freed the session anyway).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Protocol

from meshnet.contract import Outcome

log = logging.getLogger("meshnet.client")

# How long a release at a session's end, or of a failover's old hop, waits for the node (seconds) before
# the orphan releaser takes it over: the generation's caller should not wait on a stopped node.
RELEASE_WAIT_S = 1.0


class Releasable(Protocol):
    node_id: str

    def release(self, session_id: str, superseded_by: int = 0, timeout_s: float = 5.0) -> Outcome: ...


class OrphanReleaser:
    """A background thread retrying fenced releases until each node answers or ``horizon_s`` passes.

    Args:
        horizon_s: seconds after which a node that never answered is given up on.
        attempt_timeout_s: how long one release call may wait for the node.
        retry_s: pause between attempts, seconds, for the first ``patient_s`` seconds; ``slow_retry_s``
            after that (a node gone for long is probably dead).
    """

    def __init__(self, horizon_s: float = 300.0, attempt_timeout_s: float = 1.0, retry_s: float = 1.0,
                 patient_s: float = 30.0, slow_retry_s: float = 5.0) -> None:
        self.horizon_s, self.attempt_timeout_s = horizon_s, attempt_timeout_s
        self.retry_s, self.patient_s, self.slow_retry_s = retry_s, patient_s, slow_retry_s
        # (next attempt at, tie-break, stage, session id, epoch, added at); monotonic seconds.
        self._queue: list[tuple[float, int, Releasable, str, int, float]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._attempting = 0  # orphans popped for an attempt now running
        self.released = 0  # orphans the node confirmed freed (or never had)

    def add(self, stage: Releasable, session_id: str, epoch: int) -> None:
        """Release ``session_id`` on ``stage`` if older than route ``epoch``; returns at once."""
        now = time.monotonic()
        with self._cv:
            if self._closed:
                return
            heapq.heappush(self._queue, (now, next(self._order), stage, session_id, epoch, now))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="meshnet-orphans")
                self._thread.start()
            self._cv.notify()

    def release(self, stage: Releasable, session_id: str, epoch: int, unconditional: bool = False) -> None:
        """Release ``session_id`` on ``stage`` now: a copy older than route ``epoch``, or any copy when
        ``unconditional`` (the session is over). A node that does not answer within
        :data:`RELEASE_WAIT_S` is left to the background thread (:meth:`add`), which frees copies older
        than ``epoch``."""
        if not stage.release(session_id, 0 if unconditional else epoch, timeout_s=RELEASE_WAIT_S).ok:
            self.add(stage, session_id, epoch)

    def pending(self) -> int:
        """Orphans not yet confirmed released (nor given up on)."""
        with self._cv:
            return len(self._queue) + self._attempting

    def close(self, last_try_s: float = 1.0) -> None:
        """Stop retrying: each pending release is tried once more, all at once, for at most ``last_try_s``
        seconds (a client exiting right after its failover, as ``meshnet generate`` does, left a resumed
        node holding the session until its idle sweep, minutes later); what still fails is dropped."""
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify()
        if not pending or last_try_s <= 0:
            return
        tries = [threading.Thread(target=self._last_try, args=(stage, sid, epoch, last_try_s), daemon=True)
                 for _, _, stage, sid, epoch, _ in pending]
        for t in tries:
            t.start()
        deadline = time.monotonic() + last_try_s
        for t in tries:
            t.join(max(0.0, deadline - time.monotonic()))

    def _last_try(self, stage: Releasable, sid: str, epoch: int, timeout_s: float) -> None:
        if stage.release(sid, superseded_by=epoch, timeout_s=timeout_s).ok:
            log.info("released orphan session %s on node %s", sid, stage.node_id)
            with self._cv:
                self.released += 1

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._queue or self._queue[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._queue else self._queue[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, stage, sid, epoch, added = heapq.heappop(self._queue)
                self._attempting += 1
            outcome = stage.release(sid, superseded_by=epoch, timeout_s=self.attempt_timeout_s)
            now = time.monotonic()
            with self._cv:
                self._attempting -= 1
                if outcome.ok:
                    log.info("released orphan session %s on node %s", sid, stage.node_id)
                    self.released += 1
                elif now - added >= self.horizon_s:
                    log.info("gave up releasing session %s on node %s: %s", sid, stage.node_id, outcome.message)
                elif not self._closed:
                    pause = self.retry_s if now - added < self.patient_s else self.slow_retry_s
                    heapq.heappush(self._queue, (now + pause, next(self._order), stage, sid, epoch, added))
