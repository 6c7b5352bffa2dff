"""Speculative decoding with n-gram drafts taken from the session's own tokens (no draft model).

A round: propose up to ``k`` draft tokens by prompt lookup (:func:`ngram_draft`), send the last sampled
token and the drafts through the stages as one verification step (``StepRequest.verify``), and keep the
longest prefix of drafts the tail agreed with (:func:`accepted_prefix`) plus the tail's own token after
it. The next step starts right after what was kept and says ``rollback``, so every stage drops the cells
of the rejected drafts before it runs. One step then yields between 1 and ``k + 1`` tokens.

Greedy output is the same token for token as decoding one token a step: the tail's token after row ``i``
is the argmax given the tokens before it, which are the accepted ones, and the engine computes each row of
a verification step with the bits a one-token decode of it gives (see
:meth:`meshnet.engine.ggml_engine.GgmlStage.forward_batch`). Sampled requests speculate with the
rejection rule of speculative sampling (:func:`meshnet.sampling.sample`): the same distribution, not
the same tokens as without drafts (the random draws are spent differently).

The draft source mirrors llama.cpp's ``ngram-simple`` speculative type (``llama-server --spec-type
ngram-simple``: the last earlier occurrence of the current n-gram, and the tokens that followed it),
itself prompt lookup decoding (github.com/apoorvumang/prompt-lookup-decoding; llama.cpp's
``examples/lookup``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from meshnet.contract import MAX_DRAFT_TOKENS, SampledToken

SPECULATIVE_KINDS = ("none", "ngram")


@dataclass(frozen=True)
class Speculation:
    """How a generation drafts: ``draft_tokens`` (k, 1..:data:`MAX_DRAFT_TOKENS`) tokens a round, looked
    up by the longest n-gram of ``ngram_max`` down to ``ngram_min`` tokens that ends the session's tokens
    and occurred before."""

    draft_tokens: int = 6
    ngram_max: int = 3
    ngram_min: int = 1

    def validate(self) -> str | None:
        """None when usable, else a message naming the bad field."""
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            return f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.draft_tokens}"
        if not 1 <= self.ngram_min <= self.ngram_max:
            return f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
        return None


def ngram_draft(tokens: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens`` (prompt + generated so far, oldest first).

    For ``n`` from ``ngram_max`` down to ``ngram_min``: find the last ``n`` tokens earlier in ``tokens``
    (the most recent occurrence that has a token after it) and propose the up to ``k`` tokens that
    followed it. Returns ``[]`` when no n-gram recurs or ``k < 1``. Cost: O(len(tokens) * n) per ``n``.
    """
    if k < 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    for n in range(ngram_max, ngram_min - 1, -1):
        if total < n + 1:
            continue
        # windows that start at 0 .. total - n - 1: each has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(seq[:total - 1], n)
        hits = np.flatnonzero((windows == seq[total - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in seq[start:start + k]]
    return []


def accepted_prefix(drafts: Sequence[int], tokens: Sequence[SampledToken]) -> int:
    """How many leading drafts the tail kept: ``tokens[i]`` is its token after row ``i`` of the
    verification step, whose row ``i + 1`` is ``drafts[i]``."""
    a = 0
    while a < len(drafts) and tokens[a].token_id == drafts[a]:
        a += 1
    return a


@dataclass
class SpeculationStats:
    """Figures of speculative generations: verification steps run, draft tokens sent in them and
    accepted. Thread-safe adds (the API runs generations in threads)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, steps: int, drafted: int, accepted: int) -> None:
        with self._lock:
            self.steps += steps
            self.drafted += drafted
            self.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0
