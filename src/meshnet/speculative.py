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

import argparse
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
    ngram_min: int = 2  # a lone recurring token predicts little (in prose, nearly nothing)

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


class DraftBudget:
    """How many tokens the next round may draft, from how the session's last rounds went (one per
    generation). A round that kept every draft doubles the budget (up to ``k``); one that kept ``a`` of
    them drafts ``a + 1`` next. A round that kept none at a budget of 1 pauses drafting for ``pause``
    tokens, doubling (up to :data:`MAX_PAUSE`) while probes keep failing and reset by any kept draft.

    Why: on a CPU a verification row costs about what a prefill row costs, a third of a decode step here,
    so rejected drafts are not free; on prose, where few drafts are right, the pauses keep the speed at
    plain decoding's while the probes still find the passages that repeat."""

    MAX_PAUSE = 32

    def __init__(self, k: int) -> None:
        self.k, self.budget, self.pause, self.wait = k, k, 1, 0

    def next(self) -> int:
        """Draft tokens allowed for the next step (0: decode it plainly); one call per step."""
        if self.wait > 0:
            self.wait -= 1
            return 0
        return self.budget

    def update(self, drafted: int, kept: int) -> None:
        """The round drafted ``drafted`` tokens and kept ``kept`` of them."""
        if drafted == 0:
            return
        if kept == drafted:
            self.budget, self.pause = min(self.k, 2 * self.budget), 1
        elif kept:
            self.budget, self.pause = kept + 1, 1
        elif self.budget > 1:
            self.budget = 1
        else:
            self.wait, self.pause = self.pause, min(self.MAX_PAUSE, 2 * self.pause)


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


def speculation_from(kind: str | None, draft_tokens: int | None,
                     default: Speculation | None = None) -> Speculation | None:
    """The speculation a request or command line asks for: ``kind`` "ngram" or "none" (None: ``default``),
    with ``draft_tokens`` (None: ``default``'s, else 6). Raises ValueError naming a bad kind or count."""
    if kind is None:
        if default is None or draft_tokens is None:
            return default
        kind = "ngram"
    if kind not in SPECULATIVE_KINDS:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_KINDS)}, got {kind!r}")
    if kind == "none":
        return None
    k = draft_tokens if draft_tokens is not None else (default.draft_tokens if default else Speculation().draft_tokens)
    spec = Speculation(k)
    problem = spec.validate()
    if problem is not None:
        raise ValueError(problem)
    return spec


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """``--speculative {none,ngram}`` and ``--draft-tokens K`` (read back with :func:`speculation_from`)."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", choices=SPECULATIVE_KINDS, default="none",
                   help="ngram: draft tokens by prompt lookup in the session's own text and verify them "
                        "in one step (greedy output unchanged)")
    g.add_argument("--draft-tokens", type=int, default=None,
                   help=f"draft tokens per verification step, 1..{MAX_DRAFT_TOKENS} (default 6)")
