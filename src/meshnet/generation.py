"""The generation loop: prefill the prompt, decode token by token, stop, detokenize as a stream.

It drives any :class:`StepClient` — an object with ``step(req, decode) -> StepResult``,
``cancel(session_id)`` and ``release(session_id)`` — so the same loop runs over an in-process :class:`~meshnet.chain.LocalChain`
or a remote mesh. Every exit path (finish, error, the caller closing the stream) releases the session.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Generator, Iterator, Protocol, Sequence

from meshnet.contract import SampledToken, SamplingParams, StepRequest, StepResult, Status
from meshnet.speculative import DraftBudget, DraftCosts, Speculation, accepted_prefix, ngram_draft
from meshnet.tokenizer import GGUFTokenizer


class StepClient(Protocol):
    """The client interface the loop drives: :class:`~meshnet.chain.LocalChain` (in process) and
    :class:`~meshnet.client.mesh_client.MeshClient` (over a mesh) both provide it. A client may also
    offer ``step_async(req, decode, on_done) -> bool``, which starts a step without blocking (see
    :meth:`LocalChain.step_async <meshnet.chain.LocalChain.step_async>`); the API's driver uses it. A
    client charging a ledger for what it delivers (:class:`~meshnet.client.mesh_client.MeshClient`) offers
    ``charged_by_consumer(session_id)``, which a generation calls before its first step, and then
    ``delivered(session_id, position)``: the consumer got the token at ``position``."""

    def step(self, req: StepRequest, decode: bool) -> StepResult: ...

    def cancel(self, session_id: str) -> None: ...

    def release(self, session_id: str) -> None: ...


@dataclass(frozen=True)
class StepCall:
    """A step :meth:`Generation.steps` asks its driver to run: ``client.step(req, decode)``, whose result
    (or the exception it raised) the driver sends back."""

    req: StepRequest
    decode: bool


class GenerationError(RuntimeError):
    """A step failed with a non-OK status; ``status`` and the stage's message are kept."""

    def __init__(self, status: Status, message: str):
        super().__init__(f"{status.value}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it completes (may be "" while a UTF-8 character is split).

    Every event carries a token of its own; a character left incomplete by the last token is never
    emitted (there is no closing event with a replacement character)."""

    token: SampledToken
    text: str


@dataclass
class GenerationResult:
    """Outcome of one generation. Times in seconds; ``finish_reason`` is "stop" (end-of-generation
    token) or "length" (max_tokens reached). ``text`` is the generated ids' UTF-8 text without an
    incomplete trailing character (bytes of one the generation stopped inside are left out)."""

    prompt_token_ids: list[int]
    generated_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    ttft_s: float = 0.0
    decode_s: float = 0.0
    tokens: list[SampledToken] = field(default_factory=list)
    verify_steps: int = 0  # speculative verification steps run
    drafted: int = 0  # draft tokens they carried
    accepted: int = 0  # drafts the tail agreed with
    cached_tokens: int = 0  # prompt tokens every stage took from its prefix cache (StepResult.reused)

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_token_ids) / self.ttft_s if self.ttft_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.generated_token_ids) - 1  # the first token comes from the prefill
        return n / self.decode_s if n > 0 and self.decode_s else 0.0

    def timings(self) -> dict:
        out = {"ttft_s": round(self.ttft_s, 6), "decode_s": round(self.decode_s, 6),
               "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
               "decode_tokens_per_s": round(self.decode_tokens_per_s, 2)}
        if self.verify_steps:
            out.update(verify_steps=self.verify_steps, drafted=self.drafted, accepted=self.accepted)
        return out


class Generation:
    """Iterate over :class:`TokenEvent` for one prompt; ``result`` is complete once iteration ends.

    Args:
        client: the mesh client.
        tokenizer: for stop tokens and streaming text.
        prompt_ids: token ids ``[n_prompt]`` (BOS already applied).
        max_tokens: upper bound on generated tokens (>= 1).
        sampling: the tail's sampling; its grammar (if any) is made to start after the prompt.
        stop_at_eog: stop after any end-of-generation token (not included in the text).
        speculation: draft tokens by n-gram lookup and verify them a round at a time (see
            :mod:`meshnet.speculative`); None decodes one token a step.
        draft_costs: the step costs ``client``'s earlier generations measured, which this one starts
            from and updates (None: measured afresh).
        charges: tell ``client`` of each token as it is handed on (its ``delivered``, if it has one), and
            of the end-of-generation token it stopped at: the ledger's charge. False for a consumer that
            reads behind the generation and tells the client itself what it took (the API, whose
            generation runs ahead of its reader).
    Raises:
        ValueError: ``max_tokens`` < 1, an empty prompt or a bad ``speculation``.
        GenerationError (during iteration): a stage answered with a non-OK status.
    """

    def __init__(self, client: StepClient, tokenizer: GGUFTokenizer, prompt_ids: Sequence[int],
                 max_tokens: int, sampling: SamplingParams = SamplingParams(), stop_at_eog: bool = True,
                 session_id: str | None = None, speculation: Speculation | None = None,
                 draft_costs: DraftCosts | None = None, charges: bool = True) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        if speculation is not None and (problem := speculation.validate()) is not None:
            raise ValueError(problem)
        self.client, self.tokenizer = client, tokenizer
        self._charge = getattr(client, "delivered", None) if charges else None
        # Whoever consumes a generation says what it got; its steps run ahead and charge nothing themselves.
        self._consumer_charged = getattr(client, "charged_by_consumer", None)
        if sampling.grammar is not None:  # the grammar constrains what follows the prompt
            sampling = replace(sampling, grammar=replace(sampling.grammar, start=len(prompt_ids)))
        self.sampling, self.max_tokens, self.stop_at_eog = sampling, max_tokens, stop_at_eog
        self.speculation = speculation
        self._budget = DraftBudget(speculation.draft_tokens, draft_costs) if speculation is not None else None
        # The budget picks drafts from measured times; a seeded sampled token at a drafted position spends
        # its draw on the acceptance test, so a seeded run drafts all it finds, whatever the machine's
        # speed, and stays reproducible.
        self._adaptive = (speculation is not None and speculation.adaptive
                          and not (sampling.temperature > 0 and sampling.seed is not None))
        self._mtp_drafts: tuple[int, ...] = ()  # the tail's MTP drafts after the last step's token
        self.session_id = session_id or uuid.uuid4().hex
        self.result = GenerationResult(prompt_token_ids=[int(t) for t in prompt_ids])

    def _request(self, position: int, tokens: list[int], step_id: int, verify: bool = False,
                 rollback: bool = False) -> StepRequest:
        """The request of one step (prefill at position 0, else a decode or verification step)."""
        # The first step reserves the session's KV cells for its whole run: the prompt and every generated
        # token but the last, which is never fed back (a verification step's drafts stay within that too:
        # see _drafts).
        reserve = 0 if position else len(self.result.prompt_token_ids) + self.max_tokens - 1
        spec = self.speculation
        mtp = 0
        if spec is not None and spec.mtp:  # the tail drafts the next step's tokens after this one's
            mtp = self._budget.choose(spec.draft_tokens) if self._adaptive else spec.draft_tokens
        return StepRequest(self.session_id, epoch=0, position=position, token_ids=tuple(tokens),
                           sampling=self.sampling, step_id=step_id, reserve_tokens=reserve, verify=verify,
                           rollback=rollback, mtp_drafts=mtp)

    def _tokens(self, req: StepRequest, res: StepResult) -> tuple[SampledToken, ...]:
        """The tail's token after the step's last row, or after each row of a verification step.
        Raises GenerationError for a failed step."""
        if not res.ok:
            raise GenerationError(res.status, res.message)
        self._mtp_drafts = res.drafts
        if res.token is None:  # a client that checks its route's replies never passes this on
            raise GenerationError(Status.FAILED_PRECONDITION, "the step's reply carried no sampled token")
        if req.verify and len(res.tokens) != len(req.token_ids):
            raise GenerationError(Status.FAILED_PRECONDITION, f"a verification step of {len(req.token_ids)} "
                                  f"rows came back with {len(res.tokens)} tokens")
        return res.tokens if req.verify else (res.token,)

    def _drafts(self) -> list[int]:
        """Draft tokens for the next step: none without speculation, and never more than the tokens the
        budget still allows after the one the step samples anyway (so no cell past the session's
        reservation is written)."""
        spec, r = self.speculation, self.result
        if spec is None:
            return []
        room = min(spec.draft_tokens, self.max_tokens - len(r.generated_token_ids) - 1)
        if spec.mtp:
            return list(self._mtp_drafts[:max(room, 0)])
        tokens = r.prompt_token_ids + r.generated_token_ids
        if spec.drafter is not None:
            k = self._budget.choose(room) if self._adaptive else room
            return spec.drafter.draft(self.session_id, tokens, k) if k > 0 else []
        found = ngram_draft(tokens, room, spec.ngram_max, spec.ngram_min)
        return found[:self._budget.choose(len(found))] if self._adaptive else found

    def __iter__(self) -> Iterator[TokenEvent]:
        """Run the generation on the calling thread, blocking in ``client.step``; yields each token."""
        core = self.steps()
        try:
            item = next(core)
            while True:
                if isinstance(item, StepCall):
                    try:
                        res = self.client.step(item.req, item.decode)
                    except BaseException as e:  # noqa: BLE001 - raised inside the loop, which releases
                        item = core.throw(e)
                    else:
                        item = core.send(res)
                else:
                    yield item
                    item = next(core)
        except StopIteration:
            return
        finally:
            core.close()  # the caller stopped early: GeneratorExit releases the session

    def steps(self) -> Generator[StepCall | TokenEvent, StepResult | None, None]:
        """The generation as a coroutine that runs no step itself: it yields a :class:`StepCall`, to be
        answered with ``send(result)`` (or ``throw(exception)``), or a :class:`TokenEvent`, to be resumed
        with ``next()``. :meth:`__iter__` drives it blocking; the API drives it from the engines'
        completion callbacks, so a decode step starts on the thread that finished the one before it.
        Closing it releases the session, as every other exit does."""
        r = self.result
        stream = self.tokenizer.stream_decoder()
        parts: list[str] = []
        t0 = t1 = time.perf_counter()
        if self._consumer_charged is not None:
            self._consumer_charged(self.session_id)
        try:
            req = self._request(0, r.prompt_token_ids, step_id=0)
            res = yield StepCall(req, False)
            pending = list(self._tokens(req, res))
            r.cached_tokens = res.reused
            r.ttft_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            position = cached = len(r.prompt_token_ids)  # the next step's first position; cells held
            while True:
                tok = pending.pop(0)
                if self._charge is not None:  # handed on now (an end-of-generation token is charged too)
                    self._charge(self.session_id, len(r.prompt_token_ids) + len(r.generated_token_ids))
                if self.stop_at_eog and self.tokenizer.is_eog(tok.token_id):
                    r.finish_reason = "stop"
                    break
                r.generated_token_ids.append(tok.token_id)
                r.tokens.append(tok)
                piece = stream.feed(tok.token_id)
                parts.append(piece)
                yield TokenEvent(tok, piece)
                if len(r.generated_token_ids) >= self.max_tokens:
                    r.finish_reason = "length"
                    break
                if pending:  # accepted drafts still to emit
                    continue
                t_step = time.perf_counter()  # a round: drafting (a draft model's decodes) and verifying
                drafts = self._drafts()
                req = self._request(position, [tok.token_id] + drafts, step_id=len(r.generated_token_ids),
                                    verify=bool(drafts), rollback=position < cached)
                out = self._tokens(req, (yield StepCall(req, True)))
                t_step = time.perf_counter() - t_step
                cached = position + 1 + len(drafts)
                # Row i's token is the one after row i: drafts up to the first disagreement are kept,
                # then the tail's own token there; the stages drop the rest at the next step.
                kept = accepted_prefix(drafts, out)
                pending = list(out[:kept + 1])
                position += kept + 1
                if self._budget is not None:
                    self._budget.observe(len(drafts), kept, t_step)
                if drafts:
                    r.verify_steps, r.drafted, r.accepted = r.verify_steps + 1, r.drafted + len(drafts), \
                        r.accepted + kept
            r.decode_s = time.perf_counter() - t1
            # What the decoder still holds is the start of a character the model did not finish (the
            # budget ran out mid-character): it stays out of the text rather than becoming U+FFFD.
            r.text = "".join(parts)
        finally:
            if r.generated_token_ids and not r.decode_s:  # ended early (a failure): the time until then
                r.decode_s = time.perf_counter() - t1
            self.client.release(self.session_id)
            if self.speculation is not None and self.speculation.drafter is not None:
                self.speculation.drafter.end(self.session_id)


def generate(client: StepClient, tokenizer: GGUFTokenizer, prompt_ids: Sequence[int], max_tokens: int,
             sampling: SamplingParams = SamplingParams(), stop_at_eog: bool = True,
             speculation: Speculation | None = None) -> GenerationResult:
    """Run a whole generation and return its result (see :class:`Generation`)."""
    gen = Generation(client, tokenizer, prompt_ids, max_tokens, sampling, stop_at_eog, speculation=speculation)
    for _ in gen:
        pass
    return gen.result
