"""How the tail picks the next token: the sampling parameters a step carries, and their limits.

Part of the shard-engine contract (:mod:`meshnet.contract`): a :class:`~meshnet.contract.StepRequest`
carries a :class:`SamplingParams`, which may carry a :class:`Grammar`. The sampler that applies them is
:mod:`meshnet.sampling`; the grammar matcher is :mod:`meshnet.grammar`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

# OpenAI's range for a logit bias: -100 bans a token, +100 selects it exclusively.
LOGIT_BIAS_LIMIT = 100.0
# Tokens one request may bias (each travels in every frame of every step's header).
MAX_LOGIT_BIAS = 1024

# UTF-8 bytes of a grammar's JSON schema: it travels in the header of every frame of every step, and the
# tail compiles it; 32 KiB holds a schema with dozens of tools' parameters.
MAX_GRAMMAR_BYTES = 32 * 1024

# Largest ``top_k`` / ``penalty_last_n``: the step header carries them as int32 (any ``top_k`` at or over the
# vocabulary's size keeps every token anyway).
MAX_INT32 = 2**31 - 1


# A repetition penalty divides a seen token's positive logit and multiplies a negative one: beyond 10x
# either way it bans or forces rather than penalises, and a tiny one overflows the 32-bit logits (1e-38
# turned every answer into one repeated token).
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.1, 10.0

@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated tokens: their text must be a JSON document valid under
    ``json_schema`` (the schema as JSON text, at most :data:`MAX_GRAMMAR_BYTES` UTF-8 bytes), enforced by
    the tail with :mod:`meshnet.grammar`. ``start`` is the session position of the first constrained token
    (the prompt's length): tokens before it are the prompt, the ones from it on are matched, so a tail
    given a session's tokens again (a failover replay, a rollback) rebuilds the matcher's state from them."""

    json_schema: str
    start: int = 0

    def validate(self) -> str | None:
        """None when usable, else a message naming the bad field (the schema itself is checked by
        :mod:`meshnet.grammar`, which needs the vocabulary)."""
        size = len(self.json_schema.encode("utf-8"))
        if size == 0:
            return "grammar json_schema is empty"
        if size > MAX_GRAMMAR_BYTES:
            return f"grammar json_schema is {size} bytes, more than the limit of {MAX_GRAMMAR_BYTES}"
        if self.start < 0:
            return f"grammar start must be >= 0, got {self.start}"
        return None


@dataclass(frozen=True)
class SamplingParams:
    """How the tail picks the next token. ``temperature == 0`` is greedy (argmax, lowest id on ties).

    The filters apply in llama.cpp's sampler-chain order: logit bias, penalties, top-k, top-p, min-p,
    temperature. With ``seed`` set, a draw depends only on ``(seed, position)``, so a replayed step samples
    the same token.

    ``logit_bias`` holds ``(token_id, bias)`` pairs (given in any order, or as a dict; kept sorted by id),
    each id once, biases in
    ``[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]``: each bias is added to its token's logit; ``-100`` bans the
    token and ``+100`` selects it exclusively (among the tokens biased ``+100``), as OpenAI documents.

    ``grammar``: when set, only tokens the grammar allows are candidates (before the logit bias and the
    rest of the chain); None = unconstrained.

    ``logprobs``: whether the tail reports the sampled token's log-prob. False (what the API asks for when
    a request wants no log-probs) lets a greedy tail skip the log-softmax over the whole vocabulary, a
    quarter of a millisecond a token for a 49k vocabulary; the token's ``logprob`` is then NaN.
    ``n_top_logprobs`` > 0 implies it.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; llama.cpp's repeat_penalty
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # how many recent tokens the penalties look at; -1 = all
    seed: int | None = None
    n_top_logprobs: int = 0  # how many top log-probs to return with each sampled token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending; () = none
    grammar: Grammar | None = None
    logprobs: bool = True

    @property
    def wants_logprobs(self) -> bool:
        """Whether the sampled token's log-prob (and log-softmax) must be computed."""
        return self.logprobs or self.n_top_logprobs > 0

    def __post_init__(self) -> None:
        # canonical form, whatever order (or mapping) the caller gave: pairs sorted by token id
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))

    def validate(self, n_vocab: int | None = None) -> str | None:
        """Return None when the values are usable, else a message naming the bad field; with ``n_vocab``,
        a ``logit_bias`` token id outside ``[0, n_vocab)`` is one too."""
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            return f"temperature must be finite and >= 0, got {self.temperature}"
        if not 0 <= self.top_k <= MAX_INT32:
            return f"top_k must be in [0, {MAX_INT32}], got {self.top_k}"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not 0 <= self.min_p <= 1:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            return f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                return f"{name} must be finite, got {getattr(self, name)}"
        # The wire and the sampler hold these as 32-bit floats: a value that rounds to 0 or to infinity
        # there would reach the sampler as a value this check refuses (a division by 0, NaN logits). A
        # temperature may round to 0: that is greedy, the limit of ever colder sampling.
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            tiny = value != 0 and as_float32(value) == 0 and name != "temperature"
            if tiny or not math.isfinite(as_float32(value)):
                return (f"{name} {value} is out of the 32-bit float range that steps carry "
                        f"(magnitudes {F32_TINY:g} to {F32_MAX:g})")
        if not REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX:
            return (f"repetition_penalty must be in [{REPETITION_PENALTY_MIN:g}, {REPETITION_PENALTY_MAX:g}], got "
                    f"{self.repetition_penalty}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 63:
            # the wire holds it modulo 2**64: outside int64 (OpenAI's seed) one seed would draw another's
            return f"seed must be a 64-bit signed integer, in [-2**63, 2**63), got {self.seed}"
        if self.n_top_logprobs < 0 or self.n_top_logprobs > 20:
            return f"n_top_logprobs must be in [0, 20], got {self.n_top_logprobs}"
        if not -1 <= self.penalty_last_n <= MAX_INT32:
            return f"penalty_last_n must be in [-1, {MAX_INT32}], got {self.penalty_last_n}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            return f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
        ids = [t for t, _ in self.logit_bias]
        if ids and ids[0] < 0:
            return f"logit_bias token id {ids[0]} is negative"
        if (dup := next((b for a, b in zip(ids, ids[1:]) if a == b), None)) is not None:
            return f"logit_bias names token {dup} twice"
        if n_vocab is not None and ids and ids[-1] >= n_vocab:
            return f"logit_bias token id {ids[-1]} is outside the vocabulary [0, {n_vocab})"
        if n_vocab is not None and sum(b <= -LOGIT_BIAS_LIMIT for _, b in self.logit_bias) >= n_vocab:
            return "logit_bias bans every token of the vocabulary"
        bad = [(t, b) for t, b in self.logit_bias if not (math.isfinite(b) and abs(b) <= LOGIT_BIAS_LIMIT)]
        if bad:
            lim = f"{LOGIT_BIAS_LIMIT:g}"
            return f"logit_bias of token {bad[0][0]} must be in [-{lim}, {lim}], got {bad[0][1]}"
        return self.grammar.validate() if self.grammar is not None else None


GREEDY = SamplingParams()

# The least positive (subnormal) and the largest finite 32-bit float.
F32_TINY = struct.unpack("<f", struct.pack("<I", 1))[0]
F32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest 32-bit float (to +-inf beyond its range, to 0 below its least)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # struct refuses to round a finite value to infinity
        return math.copysign(math.inf, value)
