"""Speculative decoding: drafts by n-gram lookup in the session's own tokens, or from a draft model.

A round: propose up to ``k`` draft tokens by prompt lookup (:func:`ngram_draft`), send the last sampled
token and the drafts through the stages as one verification step (``StepRequest.verify``), and keep the
longest prefix of drafts the tail agreed with (:func:`accepted_prefix`) plus the tail's own token after
it. The next step starts right after what was kept and says ``rollback``, so every stage drops the cells
of the rejected drafts before it runs. One step then yields between 1 and ``k + 1`` tokens.

Greedy output is the same token for token as decoding one token a step: the tail's token after row ``i``
is the argmax given the tokens before it, which are the accepted ones, and the engine computes each row of
a verification step with the bits a one-token decode of it gives (see
:meth:`meshnet.engine.ggml_stage.GgmlStage.forward_batch`). Sampled requests speculate with the
rejection rule of speculative sampling (:func:`meshnet.sampling.sample`): the same distribution, not
the same tokens as without drafts (the random draws are spent differently). A seeded sampled run drafts
all the lookup finds, since its tokens would otherwise depend on timings (the draft budget's).

The draft source follows llama.cpp's ``ngram-simple`` speculative type (``llama-server --spec-type
ngram-simple``: an earlier occurrence of the current n-gram, and the tokens that followed it; of several
occurrences ours takes the one whose context matches furthest back), itself prompt lookup decoding
(github.com/apoorvumang/prompt-lookup-decoding; llama.cpp's ``examples/lookup``). A draft model
(:mod:`meshnet.draft_model`) is another source; the model's own next-token-prediction block (``mtp``,
:mod:`meshnet.engine.ggml_mtp`) the third: the tail returns its drafts with each step's token, and the
next step verifies them.
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from meshnet.contract import MAX_DRAFT_TOKENS, SampledToken

SPECULATIVE_KINDS = ("none", "ngram", "model", "mtp")


@dataclass(frozen=True)
class Speculation:
    """How a generation drafts: ``draft_tokens`` (k, 1..:data:`MAX_DRAFT_TOKENS`) tokens a round, looked
    up by the longest n-gram of ``ngram_max`` down to ``ngram_min`` tokens that ends the session's tokens
    and occurred before, or, with a ``drafter`` (a :class:`meshnet.draft_model.ModelDrafter`), decoded by
    a draft model."""

    draft_tokens: int = 10  # at most: the budget picks fewer where drafts do not pay
    ngram_max: int = 3
    ngram_min: int = 2  # a lone recurring token predicts little (in prose, nearly nothing)
    adaptive: bool = True  # False: every round drafts all it finds (protocol tests; seeded sampled runs)
    drafter: object = field(default=None, compare=False)  # a ModelDrafter, shared by the generations
    mtp: bool = False  # drafts from the model's next-token-prediction block, which the tail runs

    def validate(self) -> str | None:
        """None when usable, else a message naming the bad field."""
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            return f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.draft_tokens}"
        if not 1 <= self.ngram_min <= self.ngram_max:
            return f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
        return None


# How far back a match's context is compared when choosing among an n-gram's earlier occurrences (tokens).
MATCH_CONTEXT_MAX = 32


def ngram_draft(tokens: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens`` (prompt + generated so far, oldest first).

    For ``n`` from ``ngram_max`` down to ``ngram_min``: find the earlier occurrences of the last ``n``
    tokens that have a token after them, choose the one whose context agrees with the current one
    furthest back (up to :data:`MATCH_CONTEXT_MAX` tokens; the most recent among equals), and propose the
    up to ``k`` tokens that followed it. Returns ``[]`` when no n-gram recurs or ``k < 1``.

    Why the longest context: in a text that copies a passage with edits (code, JSON, a document revised),
    a short n-gram recurs in many places, and the occurrence whose context matches longest is the one
    being copied (the first of its drafts was kept 94% of the time where 12 or more tokens matched, 35%
    where only the 2-gram did, measured on SmolLM2's answers); the last occurrence alone, as llama.cpp's
    ``ngram-simple`` takes it, is often another line of the same shape. Cost: O(len(tokens) * n) per
    ``n``, plus O(occurrences) per token of context compared.
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
        for back in range(1, MATCH_CONTEXT_MAX - n + 1):  # keep the occurrences matching one token further back
            if hits.size < 2 or total - n - back < 0:
                break
            agree = hits[(hits >= back) & (seq[np.maximum(hits - back, 0)] == seq[total - n - back])]
            if not agree.size:
                break
            hits = agree
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in seq[start:start + k]]
    return []


@dataclass
class DraftCosts:
    """What steps cost on one client's routes, learnt by every generation that drafts through it: ``t0``
    seconds of a plain decode step, ``c`` seconds a draft row adds to a step (None until measured; moving
    averages). They are properties of the route and its links, not of the text, so a new generation
    starts from them instead of spending its first rounds measuring (one round without drafts, one
    probe): across a 25 ms link those rounds are a sizeable share of a short answer. Shared by the
    generations of an API server or a benchmark client; plain float assignments, so threads may update
    it without a lock (a lost update costs one sample of a moving average)."""

    t0: float | None = None
    c: float | None = None


class DraftBudget:
    """How many draft tokens a round carries: the count with the most expected tokens per second, from
    the generation's own acceptance and the client's step costs (one budget per generation).

    Drafts are right in runs (a copied passage goes on until the text departs from it), so the model
    has two chances: ``p1`` that a round's first draft is kept, ``q`` that a draft after a kept one is.
    A round with ``k`` drafts then gives ``E(k) = 1 + p1 * (1 - q^k) / (1 - q)`` tokens (the kept prefix
    plus the tail's own token) and takes ``t(k) = t0 + k * c``: ``t0`` a plain decode step's time, ``c``
    what a draft row adds. ``k`` maximises ``E(k) / t(k)`` over ``0 .. min(k_max, drafts found)``, each
    larger ``k`` taken only for :data:`MARGIN` more tokens a second than the best smaller one. The
    chances are counts of this generation's rounds, decaying by :data:`DECAY` a round, with a prior of
    one in two; ``t0`` and ``c`` are moving averages of the measured steps, kept in a :class:`DraftCosts`
    that the generations of one client share (until they are known, the first round measures ``t0`` and
    the first round with drafts found carries :data:`PROBE` of them, to measure ``c``). A budget that
    stopped drafting stays stopped until a probe's drafts come right: it probes after :data:`REPROBE` rounds
    that could have drafted, then after twice as many each time it still does not pay: one slow step
    measured in a probe does not stop drafting for good, and where drafts never pay the probes cost ever
    less. (Stopped by misses alone, the decaying counts drift back to the prior and a miss is retried every
    round or two: where no draft is ever right, 46 and 63 of 64 rounds drafted across 25 and 50 ms links.)

    Why a cost model: a draft row is not free on a CPU (for SmolLM2 on two cores, about half a decode
    step, the batch being compute-bound), so in one process drafts pay only where most are right;
    across a wide-area link a round is mostly the links' delay, and long drafts pay even at modest
    acceptance. The same model picks both, and never drafts where a draft costs more than it brings."""

    DECAY = 0.95  # per round: old rounds fade (a text moves between passages that repeat and ones that do not)
    PROBE = 2  # drafts of the first verification step, which measures a draft row's cost
    REPROBE = 8  # rounds declining drafts before another probe (doubling while drafts do not pay, to 256)
    # A draft count must promise this much more than the next smaller one: where the chance of a first
    # draft is as low as a row's share of a round (prose across slow links), a 0.3% gain is estimation noise.
    MARGIN = 1.02

    def __init__(self, k: int, costs: DraftCosts | None = None) -> None:
        self.k = k
        # [kept, tried] of first drafts and of drafts after a kept one
        self.first, self.then = [0.0, 0.0], [0.0, 0.0]
        self.costs = costs if costs is not None else DraftCosts()
        self._declined, self._reprobe_after = 0, self.REPROBE  # rounds that drafted nothing though they could
        self._probing = False  # the round chosen last is a probe: its draft row's cost replaces c
        self._stopped = False  # drafting stopped: only a probe whose drafts come right starts it again

    @property
    def t0(self) -> float | None:
        """Seconds of a plain decode step (the shared :class:`DraftCosts`')."""
        return self.costs.t0

    @property
    def c(self) -> float | None:
        """Seconds a draft row adds to a step (the shared :class:`DraftCosts`')."""
        return self.costs.c

    @property
    def chances(self) -> tuple[float, float]:
        """(p1, q): the estimated chances that a first draft is kept, and a draft after a kept one."""
        # One in two before any evidence, and again as old evidence fades.
        return (self.first[0] + 1) / (self.first[1] + 2), (self.then[0] + 1) / (self.then[1] + 2)

    def expected_tokens(self, k: int) -> float:
        """Tokens a round with ``k`` drafts is expected to give."""
        p1, q = self.chances
        q = min(q, 0.999)
        return 1.0 + p1 * (1.0 - q ** k) / (1.0 - q)

    def choose(self, available: int) -> int:
        """Draft tokens for the next round, at most ``available`` (what the lookup found) and ``k``."""
        limit = min(self.k, available)
        if limit < 1 or self.t0 is None:
            return 0  # the first decode step measures t0
        if self.c is None:
            self._probing = True
            return min(limit, self.PROBE)  # the first drafts measure what a draft row costs here
        best, best_rate = 0, 1.0 / self.t0
        for k in range(1, limit + 1):
            rate = self.expected_tokens(k) / (self.t0 + k * self.c)
            if rate > best_rate * self.MARGIN:
                best, best_rate = k, rate
        if best and not self._stopped:
            self._declined, self._reprobe_after = 0, self.REPROBE
            return best
        self._stopped = True
        self._declined += 1
        if self._declined < self._reprobe_after:
            return 0
        self._declined, self._reprobe_after = 0, min(2 * self._reprobe_after, 256)
        self._probing = True
        return min(limit, self.PROBE)

    def observe(self, drafted: int, kept: int, seconds: float) -> None:
        """A round ran with ``drafted`` drafts, ``kept`` of them right, in ``seconds`` (client-side)."""
        for counts in (self.first, self.then):
            counts[0] *= self.DECAY
            counts[1] *= self.DECAY
        if drafted and kept:
            self._stopped = False
        if drafted:
            self.first[0] += kept > 0
            self.first[1] += 1
            if kept:  # after each kept draft but the last, one more was tried (and kept unless it ended)
                self.then[0] += kept - 1
                self.then[1] += kept if kept < drafted else kept - 1
        costs, t0, c = self.costs, self.costs.t0, self.costs.c
        if drafted == 0:
            costs.t0 = seconds if t0 is None else 0.8 * t0 + 0.2 * seconds
        elif t0 is not None:
            row = max(0.0, (seconds - t0) / drafted)
            costs.c = row if c is None or self._probing else 0.7 * c + 0.3 * row
            self._probing = False


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


def speculation_from(kind: str | None, draft_tokens: int | None, default: Speculation | None = None,
                     drafter: object = None, mtp_problem: str | None = "") -> Speculation | None:
    """The speculation a request or command line asks for: ``kind`` "ngram", "model" (drafts from
    ``drafter``, else ``default``'s), "mtp" (the model's next-token-prediction block) or "none" (None:
    ``default``), with ``draft_tokens`` (None: ``default``'s, else 10). ``mtp_problem``: why the model
    cannot draft by MTP (see :func:`mtp_problem`), None when it can. Raises ValueError naming a bad kind
    or count, "model" without a drafter, or "mtp" for a model without the block."""
    if draft_tokens is not None and not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:  # even where nothing drafts
        raise ValueError(f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens}")
    if kind is None:
        if default is None or draft_tokens is None:
            return default
        kind = ("model" if default.drafter is not None else  # the default's kind, another count
                "mtp" if default.mtp else "ngram")
    if kind not in SPECULATIVE_KINDS:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_KINDS)}, got {kind!r}")
    if kind == "none":
        return None
    k = draft_tokens if draft_tokens is not None else (default.draft_tokens if default else Speculation().draft_tokens)
    if kind == "model":
        drafter = drafter if drafter is not None else (default.drafter if default else None)
        if drafter is None:
            raise ValueError("speculative 'model' needs a draft model (meshnet api, up or generate "
                             "--speculative model --draft-model GGUF)")
    if kind == "mtp" and mtp_problem is not None:
        raise ValueError(f"speculative 'mtp' {mtp_problem or 'needs a model with next-token-prediction layers'}")
    spec = Speculation(k, drafter=drafter if kind == "model" else None, mtp=kind == "mtp")
    problem = spec.validate()
    if problem is not None:
        raise ValueError(problem)
    return spec


def speculation_from_args(args: argparse.Namespace, target_path: str, shown: str | None = None) -> Speculation | None:
    """The speculation ``--speculative``, ``--draft-model`` and ``--draft-tokens`` ask for; a draft model
    is loaded and checked against the target model at ``target_path`` (named ``shown`` in messages, when
    given: a model fetched from a mesh lives in a cache file the user never named).

    Raises:
        ValueError: a bad kind or count, "model" without ``--draft-model``, or a draft model whose
            vocabulary differs from the target's.
    """
    # --draft-model alone turns drafting by that model on, as llama-server's --model-draft does; with any
    # other kind it would be loaded and never used. --draft-tokens alone drafts by n-gram (it was ignored).
    kind = args.speculative or ("model" if args.draft_model else "ngram" if args.draft_tokens is not None else "none")
    if args.draft_model and kind != "model":
        raise ValueError(f"--draft-model drafts only with --speculative model, not --speculative {kind}: drop one")
    if kind == "none" and args.draft_tokens is not None:
        raise ValueError("--draft-tokens sets how many tokens speculative decoding drafts, and --speculative none "
                         "drafts none: drop one")
    drafter = None
    if kind == "model":
        if not args.draft_model:
            raise ValueError("--speculative model needs --draft-model GGUF (a model with the same vocabulary)")
        from meshnet.draft_model import ModelDrafter

        drafter = ModelDrafter(args.draft_model, target_path)
    return speculation_from(kind, args.draft_tokens, drafter=drafter,
                            mtp_problem=mtp_problem(target_path, shown) if kind == "mtp" else None)


def mtp_problem(path: str, shown: str | None = None) -> str | None:
    """Why the GGUF at ``path`` cannot draft by next-token prediction (a message naming the model, as
    ``shown`` when given, else by its path, and what it lacks), or None when it carries an MTP block the
    engine runs. The API passes its served name: its clients need not learn the server's paths. Raises
    what :func:`meshnet.model.gguf_file.open_gguf` raises for an unreadable file."""
    from meshnet.model.gguf_file import open_gguf
    from meshnet.model.hparams import ModelConfig

    cfg = ModelConfig.from_reader(open_gguf(path))
    if cfg.n_nextn:
        return None
    return (f"needs a model with next-token-prediction layers: {shown or path} ({cfg.architecture}) has no "
            f"nextn tensors ({cfg.architecture}.nextn_predict_layers is absent or 0)")


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """``--speculative {none,ngram,model}``, ``--draft-model GGUF`` and ``--draft-tokens K`` (read back with :func:`speculation_from`)."""
    from meshnet.arg_types import draft_token_count  # gRPC's weight: only where a command line is parsed

    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", choices=SPECULATIVE_KINDS, default=None,
                   help="ngram: draft tokens by prompt lookup in the session's own text; model: decode them "
                        "with --draft-model; mtp: the model's own next-token-prediction layers (GGUFs with "
                        "nextn tensors) draft them on the tail; any way verified in one step (greedy output "
                        "unchanged). Default: none, or model with --draft-model")
    g.add_argument("--draft-model", default=None,
                   help="GGUF (path or bundled name) with the model's vocabulary, run here to draft tokens "
                        "(implies --speculative model)")
    g.add_argument("--draft-tokens", type=draft_token_count, default=None,
                   help=f"draft tokens per verification step, 1..{MAX_DRAFT_TOKENS} (default 10; fewer where drafts do "
                        f"not pay; alone, implies --speculative ngram)")
