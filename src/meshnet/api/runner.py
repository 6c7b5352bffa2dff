"""One choice of a completion, driven token by token off the event loop.

:class:`ChoiceText` is the pure text logic: stop sequences (hold back any text that could still turn
into a stop match, cut the match out), and which tokens' log-probs belong to the text released so far.
:class:`ChoiceRun` runs a :class:`~meshnet.generation.Generation` ahead of the event loop (through a
:class:`~meshnet.api.driver.GenerationDriver`) and turns its token events into :class:`Piece` objects the
endpoints format.
Streaming and non-streaming answers are built from the same pieces, so their texts are equal by
construction.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import anyio.to_thread

from meshnet.api.driver import GenerationDriver
from meshnet.api.errors import ApiError
from meshnet.api.metrics import ApiMetrics
from meshnet.contract import SampledToken, SamplingParams, Status
from meshnet.generation import Generation, GenerationError, TokenEvent
from meshnet.speculative import Speculation
from meshnet.tokenizer import GGUFTokenizer


@dataclass
class Piece:
    """Text released to the client at once, the tokens whose log-probs go with it (each with its
    character offset in the choice's text), and the finish reason on the last piece."""

    text: str
    tokens: list[tuple[SampledToken, int]] = field(default_factory=list)
    finish_reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens or self.finish_reason)


class ChoiceText:
    """Accumulates a generation's text and decides what may be released.

    Text that ends in a proper prefix of a stop sequence is held back until it either completes the stop
    (then the text is cut at the match's start, finish reason "stop") or stops being a prefix. A token's
    log-prob is released with the text it produced: once its text has been released in full while
    streaming; at the end, every token whose text starts before the cut.

    Args:
        stops: stop sequences (empty strings are ignored).
    """

    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.stops = [s for s in stops if s]
        self._max = max((len(s) for s in self.stops), default=0)
        self.raw = ""  # everything generated
        self.emitted = 0  # characters of raw released
        self._scanned = 0  # raw[:_scanned] is known to hold no stop match
        self._toks: list[list] = []  # [token, start, end] offsets in raw
        self._released = 0
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        """The text released so far."""
        return self.raw[:self.emitted]

    def add_token(self, token: SampledToken, text: str) -> Piece:
        """A new token that produced ``text`` (possibly "" while a UTF-8 character is incomplete)."""
        start = len(self.raw)
        self.raw += text
        self._toks.append([token, start, len(self.raw)])
        return self._advance()

    def finish(self, reason: str) -> Piece:
        """The generation ended (``"stop"`` or ``"length"``): release everything held back."""
        return self._release(len(self.raw), "all", reason)

    def _advance(self) -> Piece:
        if self.finish_reason is not None:
            return Piece("")
        if self.stops:
            # A new match must end after the part already scanned, so it starts at most _max - 1 earlier.
            frm = max(0, self._scanned - self._max + 1)
            hits = [i for i in (self.raw.find(s, frm) for s in self.stops) if i >= 0]
            self._scanned = len(self.raw)
            if hits:
                return self._release(min(hits), "cut", "stop")
            return self._release(len(self.raw) - self._holdback(), "partial", None)
        return self._release(len(self.raw), "partial", None)

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop sequence."""
        raw = self.raw
        for k in range(min(self._max - 1, len(raw) - self.emitted), 0, -1):
            tail = raw[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, upto: int, mode: str, reason: str | None) -> Piece:
        upto = max(upto, self.emitted)
        text = self.raw[self.emitted:upto]
        self.emitted = upto
        out: list[tuple[SampledToken, int]] = []
        while self._released < len(self._toks):
            tok, start, end = self._toks[self._released]
            if mode == "partial" and not (start < upto and end <= upto):
                break
            if mode == "cut" and start >= upto:
                break
            out.append((tok, min(start, upto)))
            self._released += 1
        if mode != "partial":
            self.finish_reason = reason
            self._released = len(self._toks)  # what was not released belongs to the cut-off text
        return Piece(text, out, reason if mode != "partial" else None)


@dataclass(frozen=True)
class GenJob:
    """One generation: prompt ids, token budget (>= 1), sampling, stop sequences, and whether any control
    token (a chat turn marker such as ``<|im_start|>``) ends it, as end-of-generation tokens do unless
    ``ignore_eos`` (then they are generated like any token and the run ends at its budget or a stop)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...] = ()
    stop_at_control: bool = False
    speculation: Speculation | None = None  # n-gram drafts verified a round at a time; None: none
    ignore_eos: bool = False
    # Its prompt's tokens go to the prompt-token metric once it holds a slot: one choice of each prompt
    # says so (a prompt is processed once however many choices it has; a request refused never is).
    counts_prompt: bool = True
    # A test of the answer's text so far, after each token: True ends it there ("stop"); None: none.
    ends_early: Callable[[str], bool] | None = None


# How often a request waiting for a generation slot looks whether the server is stopping, seconds.
_STOP_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP client disconnected while its answer was being generated."""


def map_generation_error(e: BaseException, retry_after_s: float) -> ApiError:
    """An ApiError for a failure of the mesh during a generation."""
    from meshnet.client.mesh_client import MeshUnavailable

    if isinstance(e, MeshUnavailable):
        return ApiError(503, f"the mesh is unavailable: {e}", code="mesh_unavailable",
                        retry_after_s=retry_after_s)
    if isinstance(e, GenerationError):
        if e.status is Status.INVALID_ARGUMENT:
            return ApiError(400, f"the mesh refused the request: {e.message}", code="invalid_request")
        return ApiError(503, f"the mesh failed the request ({e.status.value}): {e.message}",
                        code="mesh_error", retry_after_s=retry_after_s)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


def queue_full(max_queued: int, retry_after_s: float) -> ApiError:
    """The 503 for a request that finds ``max_queued`` others waiting for a generation slot."""
    return ApiError(503, f"the server is busy ({max_queued} requests waiting); retry later", code="server_busy",
                    retry_after_s=retry_after_s)


class ChoiceRun:
    """Runs one :class:`GenJob` and hands out :class:`Piece` objects; always :meth:`aclose` it.

    Args:
        backend: an :class:`~meshnet.api.backend.ApiBackend`.
        job: what to generate.
        limiter: admission: the run holds one slot of it while it holds a mesh session.
        max_queued: runs allowed to wait for a slot (``metrics.n_queued``) when none is free; one more is
            refused 503 ``server_busy`` as it would join them (None: no bound).
        wait_bound: whether the wait for a slot is bounded by ADMISSION_WAIT_S (503 ``server_busy``
            after it). False for a request's later choice, whose first choice holds a slot already: it
            waits its turn however long (a slot frees at the latest when one of its request's ends),
            where its 503 would fail the request that holds the slot.
        metrics: updated with active sessions, TTFT (from ``t_request``, a ``time.perf_counter()``
            value) and generated tokens.
        is_disconnected: awaited between tokens; when it returns True the run stops with
            :class:`ClientGone` (non-streaming answers; streams are cancelled by the server instead). Such a
            run charges the ledger for its tokens only at :meth:`charge_read` (a client gone before its
            answer got none of them).
    Raises (from :meth:`next_piece`):
        ApiError: 503 for mesh failures, 400 for a request the mesh refused as invalid.
        ClientGone: see ``is_disconnected``.
    """

    def __init__(self, backend, job: GenJob, limiter: asyncio.Semaphore, metrics: ApiMetrics,
                 t_request: float, is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                 observe_ttft: bool = True, max_queued: int | None = None, wait_bound: bool = True) -> None:
        self.backend, self.job, self.limiter, self.metrics = backend, job, limiter, metrics
        self.max_queued, self.wait_bound = max_queued, wait_bound
        self.t_request, self.is_disconnected, self.observe_ttft = t_request, is_disconnected, observe_ttft
        self.tokenizer: GGUFTokenizer = backend.tokenizer
        self.text = ChoiceText(job.stops)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._driver: GenerationDriver | None = None
        self._holding = False
        self._pending: list[Piece] = []
        self._done = False
        self._drafts_seen = (0, 0, 0)  # verification steps, drafted and accepted tokens reported so far
        self._read = 0  # token events read: the ledger is charged for these (the generation runs ahead)
        self._charge: Callable[[str, int], None] | None = None
        # (session, position) charges held until charge_read: a whole answer is sent, or nothing.
        self._held: list[tuple[str, int]] | None = [] if is_disconnected is not None else None

    async def start(self) -> None:
        """Wait for a free slot and open the generation (no step runs until :meth:`next_piece`). The wait
        for a slot and then for room on the stages (:class:`~meshnet.api.backend.AdmissionRetry`) share one
        :data:`~meshnet.api.backend.ADMISSION_WAIT_S`.

        Raises:
            ApiError: 503 ``server_busy`` with Retry-After when no slot freed within that time, or when
                ``max_queued`` runs wait already."""
        from meshnet.api.backend import ADMISSION_WAIT_S

        t0 = time.monotonic()
        # Checked and counted with no await between (the request's early check has awaits after it, so
        # a burst of requests all passed it and then queued past the bound).
        if self.max_queued is not None and self.limiter.locked() and self.metrics.n_queued >= self.max_queued:
            raise queue_full(self.max_queued, self.backend.retry_after_s)
        # A request's later choice is no request waiting (its first choice holds a slot): not counted.
        queued = 1 if self.wait_bound else 0
        self.metrics.add_queued(queued)
        # One acquire, kept in the semaphore's line however long it waits (slots go first come, first
        # served), looked at in slices: a server that begins to stop lets its waiting requests go.
        acquiring = asyncio.ensure_future(self.limiter.acquire())
        try:
            while not acquiring.done():
                self._check_stopping()
                left = ADMISSION_WAIT_S - (time.monotonic() - t0) if self.wait_bound else _STOP_POLL_S
                if left <= 0:
                    raise ApiError(503, f"the server is busy: waited {ADMISSION_WAIT_S:g} s for one of its "
                                        f"{self.backend.max_concurrency} generation slots; retry later",
                                   code="server_busy", retry_after_s=self.backend.retry_after_s)
                await asyncio.wait({acquiring}, timeout=min(_STOP_POLL_S, left))
            acquiring.result()
        except BaseException:
            if acquiring.done() and not acquiring.cancelled() and acquiring.exception() is None:
                self.limiter.release()  # it got the slot as we gave up: hand it on
            else:
                acquiring.cancel()
            raise
        finally:
            self.metrics.add_queued(-queued)
        if not self.wait_bound:
            t0 = time.monotonic()  # the wait for room on the stages starts with the slot
        self._holding = True
        self.metrics.add_active(1)
        if self.job.counts_prompt:
            self.metrics.prompt_tokens.inc(len(self.job.prompt_ids))
        client = self.backend.new_client(max(0.0, ADMISSION_WAIT_S - (time.monotonic() - t0)), since=t0)
        # The ledger is charged here, for the tokens read: a stop sequence found in one leaves the
        # RUN_AHEAD steps the generation took beyond it, and their kept drafts, undelivered.
        gen = Generation(client, self.tokenizer, self.job.prompt_ids, self.job.max_tokens, self.job.sampling,
                         stop_at_eog=not self.job.ignore_eos, speculation=self.job.speculation,
                         draft_costs=self.backend.draft_costs, charges=False)
        self._charge = getattr(client, "delivered", None)
        self._driver = GenerationDriver(gen, client, asyncio.get_running_loop())

    async def next_piece(self) -> Piece | None:
        """The next non-empty piece, or None after the last one (which carries the finish reason)."""
        assert self._driver is not None, "start() first"
        while True:
            if self._pending:
                return self._pending.pop(0)
            if self._done:
                return None
            if self.is_disconnected is not None and await self.is_disconnected():
                raise ClientGone()
            self._check_stopping()
            try:
                ev = await self._driver.next_event()
            except (GenerationError, RuntimeError) as e:
                raise map_generation_error(e, self.backend.retry_after_s) from e
            self._on_event(ev)

    def _check_stopping(self) -> None:
        """Raises ApiError 503 ``server_shutdown`` once the server has begun to stop."""
        if self.backend.stopping.is_set():
            raise ApiError(503, "the server is shutting down; retry the request", code="server_shutdown",
                           retry_after_s=self.backend.retry_after_s)

    def _on_event(self, ev: TokenEvent | None) -> None:
        assert self._driver is not None
        result = self._driver.gen.result
        # the generation's draft figures grow a verification step at a time: report what is new
        seen = self._drafts_seen
        self._drafts_seen = (result.verify_steps, result.drafted, result.accepted)
        if self._drafts_seen != seen:
            self.metrics.add_speculation(*(now - before for now, before in zip(self._drafts_seen, seen)))
        if ev is None:  # the generation ended by itself: end-of-generation token or max_tokens
            if result.finish_reason == "stop":  # the end-of-generation token after the last one read
                self._charged(len(self.job.prompt_ids) + self._read)
            self._finish(self.text.finish(result.finish_reason))
            return
        self._read += 1
        self._charged(len(self.job.prompt_ids) + self._read - 1)  # a control token ending the turn too
        if self._read == 1 and self.observe_ttft:  # (the generation may be a token or two further already)
            self.metrics.ttft.observe(time.perf_counter() - self.t_request)
        if self.job.stop_at_control and self.tokenizer.is_control(ev.token.token_id):
            self._finish(self.text.finish("stop"))
            return
        self.completion_tokens += 1
        self.metrics.generated_tokens.inc()
        piece = self.text.add_token(ev.token, ev.text)
        if piece.finish_reason is not None:
            self._finish(piece)
            return
        if piece:
            self._pending.append(piece)
        if self.job.ends_early is not None and self.job.ends_early(self.text.raw):
            self._finish(self.text.finish("stop"))

    def _charged(self, position: int) -> None:
        if self._charge is not None and self._driver is not None:
            if self._held is not None:
                self._held.append((self._driver.gen.session_id, position))
            else:
                self._charge(self._driver.gen.session_id, position)

    def charge_read(self) -> None:
        """Charge the tokens a non-streaming run has read (its answer is complete, to be sent)."""
        held, self._held = self._held or [], []
        for session_id, position in held:
            self._charge(session_id, position)

    def _finish(self, piece: Piece) -> None:
        self._done = True
        self.finish_reason = piece.finish_reason
        self._pending.append(piece)

    @property
    def cached_tokens(self) -> int:
        """Of its prompt's tokens, those every stage took from its prefix cache; 0 for a choice whose prompt
        another choice of the request counts (``GenJob.counts_prompt``)."""
        if not self.job.counts_prompt or self._driver is None:
            return 0
        return self._driver.gen.result.cached_tokens

    async def collect(self) -> list[Piece]:
        """Run to the end; every piece in order."""
        out = []
        while (p := await self.next_piece()) is not None:
            out.append(p)
        return out

    async def aclose(self) -> None:
        """Cancel and release the session unless the generation already did, and free the slot.

        Safe under cancellation (a client that went away): the release then finishes in a thread of its
        own, so the nodes never keep the session.
        """
        driver = self._driver
        try:
            if driver is not None and not driver.finished:
                try:
                    await anyio.to_thread.run_sync(driver.close)
                except BaseException:
                    threading.Thread(target=driver.close, name="meshnet-api-release", daemon=True).start()
                    raise
        finally:
            if self._holding:
                self._holding = False
                self.metrics.add_active(-1)
                self.limiter.release()
