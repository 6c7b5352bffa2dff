"""The abstract shard engine: session bookkeeping, request validation and batching shared by every engine.

A concrete engine implements four hooks: ``_load`` (read weights for the range), ``_new_state`` (open
one session's KV cells), ``_forward`` (run the owned layers for one step) and ``_free_state``; an engine
that computes several sessions at once also overrides ``_forward_batch`` (one iteration of the
:class:`~meshnet.engine.scheduler.StepScheduler`). Everything the contract promises about statuses —
cache misses, stale epochs, positions, cancellation, session limits, malformed input — is decided here
(the checks of the request itself and of its grammar in :mod:`meshnet.engine.step_validation`), once,
before any state changes and before a step joins a batch, so every engine behaves alike and one
session's bad step never reaches the others' iteration.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from meshnet.contract import Capabilities, NamedTensor, Health, Metrics, Outcome, StepRequest, StepResult, Status

from meshnet.load_spec import LoadSpec
from meshnet.engine.scheduler import Chunk, Job, StepScheduler
from meshnet.engine.session import Session
from meshnet.engine.step_validation import (
    follow_grammar,
    grammar_problem,
    new_session_problem,
    request_problem,
    session_problem,
)

# Suggested client back-off when the stage is at its session or memory limit.
RETRY_AFTER_S = 0.5
# Epoch fences kept for sessions released as superseded (oldest dropped first): they only need to
# outlive the few steps a client sent before it moved the session, so a small bound is plenty.
MAX_FENCES = 4096


class EngineError(Exception):
    """An expected failure inside an engine hook, carried out as a status (never past the engine)."""

    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ShardEngine(ABC):
    """One layer range ``[start, end)`` of one model, serving many sessions.

    Thread-safe: calls may come from several threads. Validated steps go to one
    :class:`~meshnet.engine.scheduler.StepScheduler`, which runs the waiting steps of all sessions
    together (continuous batching); ``cancel`` takes effect between iterations.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # a session stopped being busy
        self._scheduler = StepScheduler(self._forward_batch, self._join, self._chunk_tokens(),
                                        lambda s: s.cancelled, lambda: len(self._sessions))
        self._sessions: dict[str, Session] = {}
        self._spec: LoadSpec | None = None
        self._caps: Capabilities | None = None
        self._counts = {True: [0, 0.0], False: [0, 0.0]}  # decode?: [tokens, seconds] of settled steps
        self._errors: dict[str, int] = {}
        # session id -> route epoch it moved to: steps of older epochs may no longer (re)create it.
        self._fences: OrderedDict[str, int] = OrderedDict()

    # ---- hooks -------------------------------------------------------------------------------
    @abstractmethod
    def _load(self, spec: LoadSpec) -> Capabilities:
        """Load the range's weights. Raises EngineError (INVALID_ARGUMENT for a bad file or range)."""

    @abstractmethod
    def _new_state(self, req: StepRequest) -> Any:
        """Allocate the state of the session ``req`` opens, with ``req.reserve_tokens`` KV cells promised
        to it (0: its whole context). Raises EngineError(RESOURCE_EXHAUSTED) over budget."""

    @abstractmethod
    def _forward(self, session: Session, req: StepRequest) -> StepResult:
        """Run the owned layers on a validated request, writing its KV cells at ``req.position``.

        The base class advances ``session.n_past`` and ``session.token_ids`` after an OK result, so
        during the call they still describe the tokens cached before this step."""

    def _forward_batch(self, chunks: list[Chunk]) -> list[StepResult]:
        """Run one iteration: a chunk of each of several sessions' steps (see :class:`Chunk`).

        The default runs each chunk's step through :meth:`_forward` in turn; engines that compute a
        batch at once override it. An EngineError becomes that chunk's status; any other exception
        fails the iteration (the scheduler then reruns its chunks one at a time)."""
        out = []
        for c in chunks:
            try:
                out.append(self._forward(c.session, c.req))
            except EngineError as e:
                out.append(self._fail(e.status, e.message, retry_after_s=RETRY_AFTER_S
                                      if e.status is Status.RESOURCE_EXHAUSTED else None))
        return out

    def _chunk_tokens(self) -> int:
        """Prefill micro-batch the scheduler cuts steps into (0: steps run whole, as for the fake)."""
        return 0

    def _join(self, job: Job) -> StepResult:
        """A step's result from its chunks' results: the last chunk's, with every chunk's hidden rows."""
        last = job.parts[-1]
        hiddens = [p.hidden for p in job.parts if p.hidden is not None]
        if len(hiddens) > 1:
            rows = np.concatenate([h.to_numpy() for h in hiddens], axis=0)
            return replace(last, hidden=NamedTensor.from_numpy(hiddens[0].name, rows))
        return last

    @abstractmethod
    def _truncate(self, state: Any, n_keep: int) -> None:
        """Cut a session's state back to its first ``n_keep`` tokens (a rollback step: the rows after them
        were rejected drafts). Called with no step of the session queued or running; the base class cuts
        ``Session.n_past`` and ``Session.token_ids`` itself."""

    @abstractmethod
    def _free_state(self, state: Any, token_ids: list[int] = ()) -> None:
        """Release one session's state (idempotent). ``token_ids``: the tokens whose cells it holds, when
        it ended in good order (the engine may keep its cells for prompts that start the same way)."""

    def _reused(self, session: Session, req: StepRequest) -> tuple[int, StepResult | None]:
        """Rows of a session's first step that its state already holds (taken from a finished session
        when it opened), and their result part (their hidden rows, on a stage that passes them on)."""
        return 0, None

    def _pipeline_depth(self, caps: Capabilities) -> int:
        """Stages in a pipeline of ranges like this one (for ``decode_groups`` 0): the model's layers over
        the range's; engines that know the layers' costs weigh them instead."""
        return math.ceil(caps.n_layer / caps.artifact.layers.n_layers)

    def _grammar_compiler(self) -> Any:
        """The :class:`~meshnet.grammar.GrammarCompiler` for the model's vocabulary (on a tail), or None
        when this engine has no vocabulary to compile grammars for (its steps with one are refused)."""
        return None

    def _kv_bytes(self) -> int:
        return 0

    def _weight_bytes(self) -> int:
        return 0

    # ---- contract ----------------------------------------------------------------------------
    def load(self, spec: LoadSpec) -> Outcome:
        """Load ``spec``; INVALID_ARGUMENT names what is wrong with the file, range or identity."""
        with self._lock:
            try:
                caps = self._load(spec)
            except EngineError as e:
                return Outcome(e.status, e.message)
            self._spec, self._caps = spec, caps
            self._scheduler.chunk_tokens = self._chunk_tokens()
            self._scheduler.decode_groups = spec.decode_groups or self._pipeline_depth(caps)
            return Outcome(Status.OK)

    def capabilities(self) -> Capabilities:
        """Raises RuntimeError when nothing is loaded."""
        if self._caps is None:
            raise RuntimeError("engine not loaded")
        return self._caps

    @property
    def loaded(self) -> bool:
        return self._caps is not None

    def prefill(self, req: StepRequest) -> StepResult:
        """Run ``len(req.token_ids)`` tokens; creates the session at position 0 or extends it."""
        return self._step(req, decode=False)

    def decode(self, req: StepRequest) -> StepResult:
        """Run exactly one token on an existing session; NOT_FOUND on a cache miss."""
        return self._step(req, decode=True)

    def cancel(self, session_id: str) -> Outcome:
        """Stop the session's running and future steps (CANCELLED). Idempotent; unknown ids are OK."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None:
                s.cancelled = True
        return Outcome(Status.OK)

    def release(self, session_id: str, keep_prefix: bool = True) -> Outcome:
        """Free the session's KV cache; ``keep_prefix`` False also refuses it to the prefix cache (a
        scratch session, such as the start-up speed probe's). Idempotent; unknown ids are OK."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None:
                self._retire(s, keep_prefix)
        return Outcome(Status.OK)

    def release_superseded(self, session_id: str, epoch: int) -> Outcome:
        """The session's client moved it to route ``epoch`` elsewhere: free it here if it is at an older
        epoch, and from now on refuse its steps of older epochs (FAILED_PRECONDITION), so a step that was
        in flight to this node before the move cannot recreate it. A session already at ``epoch`` or
        later was routed back here and is kept. Idempotent; unknown ids are OK (the fence is still set).
        """
        with self._lock:
            if self._fences.get(session_id, 0) < epoch:
                self._fences[session_id] = epoch
                self._fences.move_to_end(session_id)
                while len(self._fences) > MAX_FENCES:
                    self._fences.popitem(last=False)
            s = self._sessions.get(session_id)
            if s is not None and s.epoch < epoch:
                self._retire(s)
        return Outcome(Status.OK)

    def _retire(self, s: Session, keep_prefix: bool = True) -> None:
        """Cancel ``s``, wait for a step of it already queued or running, then free it unless a newer
        session replaced it meanwhile (kept for its prefix when ``keep_prefix``). Called with the lock
        held (released while waiting)."""
        s.cancelled = True  # a step still queued on it stops at the next iteration
        while s.busy:
            self._idle.wait()
        if self._sessions.get(s.session_id) is s:
            del self._sessions[s.session_id]
            self._free_state(s.state, s.token_ids if keep_prefix else [])
        self._scheduler.forget(s)

    def release_idle(self, idle_s: float, gap_factor: float = 0.0) -> list[str]:
        """Release sessions unused for more than ``idle_s`` seconds (a session whose step is running is in
        use, however long ago its last one ended); returns their ids. ``gap_factor`` > 0: only sessions
        that ran 2 steps or more, unused for ``gap_factor`` times their longest wait between steps too (a
        client stepping through a slow pipeline comes back after a longer gap than one over a fast one)."""
        now = time.monotonic()
        with self._lock:  # checked and freed under one hold: a step starting meanwhile keeps its session
            stale = [s for s in self._sessions.values() if s.idle_past(now, idle_s, gap_factor)]
            for s in stale:
                self._retire(s)
        return [s.session_id for s in stale]

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def health(self) -> Health:
        with self._lock:
            n = len(self._sessions)
        if self._caps is None:
            return Health(loaded=False, healthy=False, active_sessions=n, message="not loaded")
        return Health(loaded=True, healthy=True, active_sessions=n)

    def metrics(self) -> Metrics:
        with self._lock:
            n = len(self._sessions)
            kept = self._kept_tokens()
            held = sum(s.n_past for s in self._sessions.values()) + kept
            (decoded, decode_s), (prefilled, prefill_s) = self._counts[True], self._counts[False]
        st = self._scheduler.stats
        reserved, capacity = self._kv_tokens()
        return Metrics(prefill_tokens=prefilled, decode_tokens=decoded, prefill_seconds=prefill_s,
                       decode_seconds=decode_s, active_sessions=n, kv_bytes=self._kv_bytes(),
                       weight_bytes=self._weight_bytes(), errors=dict(self._errors), kv_tokens_held=held,
                       kv_tokens_reserved=reserved, kv_tokens_capacity=capacity, kv_tokens_kept=kept,
                       iterations=st.iterations, batch_rows=st.rows, max_batch_rows=st.max_rows,
                       waiting_steps=self._scheduler.waiting(), queue_seconds=st.queue_seconds,
                       queued_steps=st.queued_steps)

    def _kv_tokens(self) -> tuple[int, int]:
        """(reserved, reservable) KV cells; (0, 0) for engines without a pool."""
        return 0, 0

    def _kept_tokens(self) -> int:
        """Cells held by finished sessions kept for their prefixes (counted as held)."""
        return 0

    # ---- shared validation -------------------------------------------------------------------
    def _fail(self, status: Status, message: str, **kw: Any) -> StepResult:
        self._errors[status.value] = self._errors.get(status.value, 0) + 1
        return StepResult(status=status, message=message, **kw)

    def _session_for(self, req: StepRequest, decode: bool) -> Session | StepResult:
        """Find or create the session; every refusal happens before any state changes."""
        assert self._caps is not None and self._spec is not None
        s = self._sessions.get(req.session_id)
        if s is not None:
            problem = session_problem(s, req)
            return s if problem is None else self._fail(*problem)
        problem = new_session_problem(req, decode, self._fences.get(req.session_id, 0), len(self._sessions),
                                      self._caps.max_sessions)
        if problem is None:
            try:
                state = self._new_state(req)
            except EngineError as e:
                problem = e.status, e.message
        if problem is not None:
            return self._fail(*problem, retry_after_s=RETRY_AFTER_S if problem[0] is Status.RESOURCE_EXHAUSTED
                              else None)
        s = self._sessions[req.session_id] = Session(req.session_id, req.epoch, state)
        return s

    def step_async(self, req: StepRequest, decode: bool,
                   on_done: Callable[[StepResult | BaseException], None]) -> bool:
        """Start a step without blocking the calling thread (an engine worker's reading thread): ``on_done``
        gets its result, or the exception :meth:`decode` would raise, once, on the scheduler's thread (on
        this one when the step is refused before it joins an iteration). Returns False, having started
        nothing, when the step would wait here: a step of its session is under way, or on the tail it
        carries a grammar (compiled and followed first); the caller then blocks in prefill / decode."""
        with self._lock:
            waiting = self._sessions.get(req.session_id)
            if waiting is not None and waiting.busy:
                return False
        if req.sampling.grammar is not None and self._caps is not None and self._caps.is_tail:
            return False
        admitted = self._admit(req, decode)  # waits only if a step of the session started just now
        if isinstance(admitted, StepResult):
            on_done(admitted)
            return True
        session, t0 = admitted, time.perf_counter()

        def finished(job: Job) -> None:
            if job.error is not None:
                self._settle(session, req, decode, None, 0.0)
                on_done(job.error)
            else:
                on_done(self._settle(session, req, decode, job.result, time.perf_counter() - t0))

        try:
            follow_grammar(session, req, self._caps.is_tail, self._grammar_compiler)  # none to follow here
            self._scheduler.submit_nowait(session, req, *self._reused(session, req), on_done=finished)
        except BaseException:
            self._settle(session, req, decode, None, 0.0)
            raise
        return True

    def _on_step_call(self) -> None:
        """Called as each step arrives, before anything else (the fake engine's crash injection)."""

    def _admit(self, req: StepRequest, decode: bool) -> Session | StepResult:
        """Check ``req`` and mark its session busy (creating it for a first prefill); the refusal as a
        StepResult instead, before any state changed. Waits for a step of the same session that is
        under way: one step per session at a time, each checked against the position the last left."""
        self._on_step_call()
        problem = grammar_problem(req, self._caps, self._grammar_compiler)
        if problem is not None:
            return self._fail(*problem)
        with self._lock:
            while (waiting := self._sessions.get(req.session_id)) is not None and waiting.busy:
                self._idle.wait()
            problem = request_problem(req, self._caps, decode, self._scheduler.chunk_tokens)
            if problem is not None:
                return self._fail(*problem)
            found = self._session_for(req, decode)
            if isinstance(found, StepResult):
                return found
            session = found
            session.epoch = max(session.epoch, req.epoch)
            if req.position < session.n_past:  # a rollback step: drop the rejected rows first
                self._truncate(session.state, req.position)
                session.n_past = req.position
                del session.token_ids[req.position:]
            session.busy = True
        return session

    def _step(self, req: StepRequest, decode: bool) -> StepResult:
        admitted = self._admit(req, decode)
        if isinstance(admitted, StepResult):
            return admitted
        session, t0 = admitted, time.perf_counter()
        try:
            problem = follow_grammar(session, req, self._caps.is_tail, self._grammar_compiler)
            result = self._fail(*problem) if problem is not None else \
                self._scheduler.submit(session, req, *self._reused(session, req))
        except BaseException:
            self._settle(session, req, decode, None, 0.0)
            raise
        return self._settle(session, req, decode, result, time.perf_counter() - t0)

    def _settle(self, session: Session, req: StepRequest, decode: bool, result: StepResult | None,
                dt: float) -> StepResult | None:
        """The step of ``session`` is over after ``dt`` seconds: the session is no longer busy and, when
        ``result`` is OK, holds the step's tokens (``result`` comes back with ``n_past``); a first
        prefill that failed leaves no session. ``result`` None: the step raised."""
        with self._lock:
            session.busy = False
            self._idle.notify_all()
            session.stepped(time.monotonic(), result is not None and result.ok)
            if result is None:
                return None
            if result.ok:
                session.n_past += len(req.token_ids)
                session.token_ids.extend(int(t) for t in req.token_ids)
                result = replace(result, n_past=session.n_past)
                counts = self._counts[decode]  # plain counters: metrics() makes the frozen record
                counts[0] += len(req.token_ids)
                counts[1] += dt
            elif session.n_past == 0 and self._sessions.get(session.session_id) is session:
                # A first prefill that failed leaves nothing worth keeping.
                self._sessions.pop(session.session_id)
                self._free_state(session.state)
        return result
