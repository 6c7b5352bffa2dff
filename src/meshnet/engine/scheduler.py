"""Continuous batching for one stage: the steps of every session that are waiting go into one iteration.

Callers (gRPC / data-plane worker threads, in-process clients) hand a validated step to
:meth:`StepScheduler.submit` and block until it is done. One worker thread loops: it takes every waiting
decode token and chunks of waiting prefills, under a budget of ``chunk_tokens`` prefill tokens per
iteration, runs them through the engine's batch hook as one iteration, and hands each result back to its
own caller. Sessions join and leave between iterations; a long prompt holds the decodes of others back by
at most one chunk (llama.cpp's ``llama-server`` schedules its slots the same way: ``update_slots`` packs
one token of every generating slot plus prompt chunks into each ``llama_decode``).

Prefill chunks start at multiples of ``chunk_tokens`` from the step's first token, exactly the micro-
batches the step would get alone, so a session's output does not depend on what it was batched with.

A stage that is one of several in a pipeline splits its decoding sessions into ``decode_groups`` groups
that take turns: while one group computes here, the others are at the other stages, so every stage of
the pipeline is busy at once. Batched all together, the sessions would travel as one convoy that keeps
only one stage busy at a time (vLLM's pipeline parallelism likewise keeps one batch in flight per stage).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from meshnet.contract import StepRequest, StepResult, Status

log = logging.getLogger("meshnet.engine")

# How long an iteration may wait for the sessions the previous one served: a fraction of that
# iteration's time, and never more than MAX_GATHER_S.
GATHER_FRACTION = 0.25
MAX_GATHER_S = 0.02
# With decode groups, the fraction for the companions of the decodes that wait (see _gather): they are
# known to be coming, and a group that starts without one of them splits in two for good.
GROUP_GATHER_FRACTION = 0.5


@dataclass
class Chunk:
    """One session's part of an iteration: the tokens ``[start, end)`` of its step ``req``."""

    session: Any
    req: StepRequest
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.req.token_ids)


@dataclass
class Job:
    """A submitted step and what its chunks produced so far."""

    session: Any
    req: StepRequest
    enqueued: float = field(default_factory=time.perf_counter)
    done_tokens: int = 0
    reused: int = 0  # leading tokens the session already held when the step came (its prefix cache's)
    parts: list[StepResult] = field(default_factory=list)
    started: bool = False  # picked for an iteration
    passed_over_at: int = -1  # the iteration a prefill was first left out of for the budget (-1: it was not)
    result: StepResult | None = None
    error: BaseException | None = None  # raised in the caller's thread, as if the step ran there
    event: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[["Job"], None] | None = None  # a caller that does not wait: called once it is done

    @property
    def remaining(self) -> int:
        return len(self.req.token_ids) - self.done_tokens

    @property
    def one_token(self) -> bool:
        """A step of one token not yet started (a decode): it rides in every iteration's decode rows."""
        return not self.started and len(self.req.token_ids) == 1


@dataclass
class SchedulerStats:
    """Figures since start: iterations run, rows they held (in all, at most), and seconds steps waited
    before their first iteration, summed over ``queued_steps``."""

    iterations: int = 0
    rows: int = 0
    max_rows: int = 0
    queue_seconds: float = 0.0
    queued_steps: int = 0


class StepScheduler:
    """Packs waiting steps into iterations and runs them on one worker thread.

    Args:
        run_batch: the engine's batch hook: takes the iteration's chunks (distinct sessions), returns a
            :class:`StepResult` per chunk in order (for a chunk that is not its step's last, an OK result,
            whose ``hidden`` holds that chunk's rows on a stage that passes hidden states on). Raising fails
            the iteration, which is then rerun a chunk at a time so one bad step fails alone.
        join: merges the results of a step's chunks into the step's result.
        chunk_tokens: prefill micro-batch size; 0 runs every step whole.
        cancelled: tells whether a session was cancelled (checked before each of its chunks).
        open_sessions: how many sessions the stage holds open (for the size of a decode group).

    Attributes:
        decode_groups: how many groups the open sessions' decodes are split into (1: every waiting
            decode in each iteration; the stage's share of a pipeline's stages otherwise).
    """

    def __init__(self, run_batch: Callable[[list[Chunk]], list[StepResult]],
                 join: Callable[[Job], StepResult], chunk_tokens: int,
                 cancelled: Callable[[Any], bool], open_sessions: Callable[[], int] = lambda: 0) -> None:
        self._run_batch, self._join, self._cancelled = run_batch, join, cancelled
        self._open_sessions = open_sessions
        self.chunk_tokens = chunk_tokens
        self.decode_groups = 1
        self._cv = threading.Condition()
        self._queue: list[Job] = []
        self._thread: threading.Thread | None = None
        self.stats = SchedulerStats()
        self._expected: set[int] = set()  # ids of sessions whose step the last iteration finished
        # With decode groups: each session's companions, the other sessions whose steps ended in the same
        # iteration here as its last one did (ids). A group travels the pipeline together, so they are
        # the ones to wait for when it comes back.
        self._companions: dict[int, frozenset[int]] = {}
        self._callbacks: list[Job] = []  # finished jobs whose on_done has not been called yet
        self._last_iteration_s = 0.0

    def submit(self, session: Any, req: StepRequest, done_tokens: int = 0,
               done_part: StepResult | None = None) -> StepResult:
        """Queue one validated step of ``session`` and wait for its result. At most one step per session
        may be queued at a time (the engine ensures it). ``done_tokens``: leading tokens of the step whose
        cells the session already holds (``done_part``: their result part), which are not run."""
        job = self._enqueue(session, req, done_tokens, done_part)
        job.event.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def submit_nowait(self, session: Any, req: StepRequest, done_tokens: int = 0,
                      done_part: StepResult | None = None, *, on_done: Callable[[Job], None]) -> None:
        """As :meth:`submit`, without waiting: ``on_done(job)`` is called on the scheduler's thread, outside
        its lock, once ``job.result`` (or ``job.error``) is set. It runs before the next iteration starts,
        so it should be quick: send a reply, or start the session's next step (``ShardEngine.step_async``
        from here queues it in time for that iteration)."""
        self._enqueue(session, req, done_tokens, done_part, on_done)

    def _enqueue(self, session: Any, req: StepRequest, done_tokens: int, done_part: StepResult | None,
                 on_done: Callable[[Job], None] | None = None) -> Job:
        job = Job(session, req, done_tokens=done_tokens, reused=done_tokens,
                  parts=[done_part] if done_part is not None else [], on_done=on_done)
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="stage-scheduler", daemon=True)
                self._thread.start()
            self._queue.append(job)
            self._expected.discard(id(session))
            self._cv.notify_all()
        return job

    def waiting(self) -> int:
        with self._cv:
            return len(self._queue)

    # ---- worker ------------------------------------------------------------------------------
    def _group_size(self) -> int:
        """Decode rows an iteration takes: all that wait, or with ``decode_groups`` > 1 the open
        sessions' share of one group (sessions in a prefill step do not count). Called with the lock held."""
        waiting = sum(1 for job in self._queue if job.one_token)
        if self.decode_groups <= 1:
            return waiting
        decoding = self._open_sessions() - sum(1 for job in self._queue if not job.one_token)
        return max(1, math.ceil(max(decoding, waiting) / self.decode_groups))

    def _next_iteration(self) -> list[tuple[Job, Chunk]]:
        """The waiting steps with one token left (in arrival order, one decode group's worth), then
        prefill chunks while the prefill tokens stay within the budget (always at least one chunk).

        Prefills take turns: those left out of earlier iterations first, the longest left out first (in
        arrival order), then the fewest tokens left first (arrival order among equals). A short prompt
        arriving behind a long one's prefill so waits one chunk, not the whole prefill (in arrival order,
        as ``llama-server``'s slots fill a batch, a 30-token question waited 24 s behind a 3000-token
        document on one thread), and no prefill is passed over for good: the one left out longest is
        the first, which always runs."""
        picked, budget = [], self.chunk_tokens or float("inf")
        used = 0
        group = self._group_size()
        for job in self._queue:
            if job.one_token and len(picked) < group:
                picked.append((job, Chunk(job.session, job.req, 0, 1)))
        prefills = sorted((job for job in self._queue if not job.one_token),
                          key=lambda job: (job.passed_over_at < 0, job.passed_over_at,
                                           job.enqueued if job.passed_over_at >= 0 else job.remaining))
        for job in prefills:
            start = job.done_tokens
            # chunks end where the step's micro-batches alone would, also after leading tokens it skipped
            size = job.remaining if not self.chunk_tokens else \
                min(job.remaining, self.chunk_tokens - start % self.chunk_tokens)
            if used and used + size > budget:
                if job.passed_over_at < 0:
                    job.passed_over_at = self.stats.iterations
                continue
            job.passed_over_at = -1
            picked.append((job, Chunk(job.session, job.req, start, start + size)))
            used += size
        return picked

    def _gather(self) -> None:
        """Hold the next iteration back briefly for the sessions whose decode the last iteration ran:
        their callers are turning the result into the next step (sampling the token, streaming it,
        crossing the other stages), and an iteration that starts without them runs nearly empty while
        they queue up behind it. Waits at most :data:`GATHER_FRACTION` of the last iteration's time.
        Called with the lock held.

        With ``decode_groups`` > 1 the sessions just served are at the next stages, not on their way
        back: the iteration waits instead for the companions of the decodes that wait (the sessions that
        ended their last step here in the same iteration: a group comes back together, a few ms apart),
        for up to :data:`GROUP_GATHER_FRACTION` of the last iteration's time, and never for more than a
        group's worth. A group smaller than the others (7 sessions in groups of 4 and 3) so does not wait
        the whole allowance for a fourth that is not coming. Decodes without known companions (a group
        forming) wait as briefly as above for a group's worth."""
        if self.decode_groups > 1:
            self._gather_group()
            return
        deadline = time.perf_counter() + min(MAX_GATHER_S, GATHER_FRACTION * self._last_iteration_s)
        if not self._expected:
            return
        while self._expected:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._cv.wait(left)
        self._expected.clear()

    def forget(self, session: Any) -> None:
        """The session is gone (released): do not wait for its next step."""
        with self._cv:
            self._expected.discard(id(session))
            self._companions.pop(id(session), None)
            self._cv.notify_all()

    def _gather_group(self) -> None:
        """:meth:`_gather` for decode groups. Called with the lock held."""
        now = time.perf_counter()
        deadline = now + min(MAX_GATHER_S, GATHER_FRACTION * self._last_iteration_s)
        group_deadline = now + min(MAX_GATHER_S, GROUP_GATHER_FRACTION * self._last_iteration_s)
        while True:
            decodes = [job for job in self._queue if job.one_token]
            if not decodes or len(decodes) >= self._group_size():
                return
            queued = {id(job.session) for job in self._queue}
            known = [self._companions[id(job.session)] for job in decodes if id(job.session) in self._companions]
            if known:
                # companions that left (released) are no longer in _companions: not waited for
                missing = any(c not in queued and c in self._companions for cs in known for c in cs)
                if not missing:
                    return
                left = group_deadline - time.perf_counter()
            else:
                left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._cv.wait(left)

    def _loop(self) -> None:
        while True:
            self._call_back()
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                self._gather()
                for job in list(self._queue):
                    if self._cancelled(job.session):
                        self._finish(job, StepResult(Status.CANCELLED,
                                                     f"session {job.req.session_id!r} was cancelled"))
                if not self._queue:
                    continue
                picked = self._next_iteration()
                now = time.perf_counter()
                for job, _ in picked:
                    if not job.started:  # its first iteration: every pick advances or ends a job
                        job.started = True
                        self.stats.queue_seconds += now - job.enqueued
                        self.stats.queued_steps += 1
            t0 = time.perf_counter()
            results = self._run(picked)
            with self._cv:
                self._last_iteration_s = time.perf_counter() - t0
                rows = sum(c.end - c.start for _, c in picked)
                self.stats.iterations += 1
                self.stats.rows += rows
                self.stats.max_rows = max(self.stats.max_rows, rows)
                ended: list[int] = []
                for (job, chunk), res in zip(picked, results):
                    if isinstance(res, BaseException):
                        job.error = res
                        self._finish(job, StepResult(Status.CANCELLED, "failed"))
                        continue
                    if not res.ok:
                        self._finish(job, res)
                        continue
                    job.parts.append(res)
                    job.done_tokens = chunk.end
                    if chunk.last:
                        self._finish(job, self._joined(job))
                        ended.append(id(job.session))
                        if self.decode_groups <= 1:  # a group gathers by its companions instead
                            self._expected.add(id(job.session))
                if self.decode_groups > 1:
                    for sid in ended:
                        self._companions[sid] = frozenset(ended) - {sid}

    def _joined(self, job: Job) -> StepResult:
        """The result of a job whose last chunk ran: its chunks' joined (``join``), with the leading rows the
        session held when it came (``Job.reused``: its prefix cache's)."""
        res = self._join(job)
        return replace(res, reused=job.reused) if job.reused else res

    def _run(self, picked: list[tuple[Job, Chunk]]) -> list[StepResult | BaseException]:
        """The iteration's results; when it raises, each chunk is rerun alone so that only the chunk that
        breaks gets the exception (handed to its caller)."""
        chunks = [c for _, c in picked]
        try:
            return list(self._run_batch(chunks))
        except Exception as e:  # noqa: BLE001 - isolate the step that broke the iteration
            if len(chunks) == 1:
                return [e]
            log.warning("an iteration of %d steps failed (%s); running them one by one", len(chunks), e)
            out: list[StepResult | BaseException] = []
            for pair in picked:
                out.extend(self._run([pair]))
            return out

    def _finish(self, job: Job, result: StepResult) -> None:
        """Called with the lock held."""
        if job in self._queue:
            self._queue.remove(job)
        job.result = result
        if job.on_done is not None:
            self._callbacks.append(job)
        else:
            job.event.set()

    def _call_back(self) -> None:
        """Hand finished jobs of callers that did not wait to their ``on_done``, outside the lock (they
        take the engine's lock and send replies)."""
        with self._cv:
            jobs, self._callbacks = self._callbacks, []
        for job in jobs:
            try:
                job.on_done(job)
            except Exception:  # noqa: BLE001 - a failing callback must not stop the stage
                log.exception("a step's completion callback failed (session %s)", job.req.session_id)
