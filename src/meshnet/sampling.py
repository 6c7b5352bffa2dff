"""Next-token sampling on the tail stage: llama.cpp's default sampler chain over one row of logits.

A grammar's mask (``allowed``, from :class:`meshnet.grammar.SessionGrammar`) comes first: a token it does
not allow gets a ``-inf`` logit, so the chain below works on the allowed tokens only (llama.cpp's
``common_sampler`` applies its grammar before the chain too, in effect). When the logit bias would leave no
allowed token (it bans or forces only tokens the grammar refuses), the grammar wins: the chain then runs on
the allowed tokens without the bias.

The chain, in order, mirrors llama.cpp (``common/sampling.cpp`` defaults, samplers from
``src/llama-sampling.cpp``):

0. ``logit_bias`` (``llama_sampler_logit_bias``): each ``(token, bias)`` of ``params.logit_bias`` adds
   ``float32(bias)`` to that token's logit. As OpenAI documents, a bias of ``-100`` bans the token (its
   logit becomes ``-inf``) and ``+100`` selects it exclusively: when any token has ``+100``, every token
   without it is banned. A banned token is never returned, greedy or sampled, nor kept as a draft.
1. ``penalties`` (``llama_sampler_penalties``): over the last ``penalty_last_n`` tokens of the session
   (``-1`` = all of them, ``0`` = none), every token present gets its logit divided by
   ``repetition_penalty`` when positive, multiplied when ``<= 0``; then ``count * frequency_penalty``
   and ``presence_penalty`` (once) are subtracted. Done in float32, as llama.cpp does.
2. ``top-k`` (``llama_sampler_top_k``): keep the ``top_k`` highest logits (``0`` = off).
3. ``top-p`` (``llama_sampler_top_p``): softmax of the remaining logits (no temperature yet), then keep
   the smallest highest-probability prefix whose cumulative probability is ``>= top_p`` (at least one
   token; ``1.0`` = off).
4. ``min-p`` (``llama_sampler_min_p``): keep tokens with ``p >= min_p * p_max``, i.e.
   ``logit >= max_logit + log(min_p)`` (``0.0`` = off).
5. ``temp`` (``llama_sampler_temp``): divide the logits by ``temperature``.
6. ``dist`` (``llama_sampler_dist``): softmax and draw one token by inverse CDF.

``temperature == 0`` replaces steps 2-6 with ``greedy``: the argmax of the penalised logits, lowest id on
exact ties (the filters could never remove that token anyway). No random numbers are drawn.

Exact ties at a top-k / top-p cut are resolved in favour of the lower token id, and the inverse-CDF draw
walks the surviving tokens in ascending id order, so the result is a pure function of its inputs (and
of ``(seed, position)`` for the random draw) that does not depend on any sort algorithm's tie order.

The reported log-probs (the chosen token's and the ``n_top_logprobs`` best) are the model's own:
log-softmax of the *raw* logits, before penalties, filters and temperature, as OpenAI's API reports them.

Numerics: logits stay float32 (as in llama.cpp); exponentials are float32 ``exp(x - max)`` (llama.cpp's
``expf``), every sum / cumulative sum / log is float64. ``logprob = float64(x) - lse`` is accurate to about
1e-7 absolute, far below the precision of the float32 logits, and float32 ``exp`` is 3-8x faster than
float64 ``exp`` on large vocabularies.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np

from meshnet.contract import SampledToken, TokenLogprob
from meshnet.sampling_params import F32_MAX, LOGIT_BIAS_LIMIT, SamplingParams

__all__ = ["sample"]

_U64 = (1 << 64) - 1
# top-p first sorts only this many best candidates and widens (x8) when their mass falls short of top_p,
# the same adaptive idea as llama.cpp's top-p (which starts at 256).
_TOP_P_FIRST = 256
# block size of the two-level inverse CDF used by the final draw
_CDF_BLOCK = 512

# A vocabulary-sized float32 buffer per thread, reused by every call: allocating it afresh costs more
# than the exponentials it holds (0.6 MB for a 152k vocabulary is an mmap and ~150 page faults a token).
_scratch = threading.local()


def _scratch_buffer(n: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape[0] < n:
        buf = _scratch.buf = np.empty(n, np.float32)
    return buf[:n]


def sample(logits: np.ndarray, params: SamplingParams, history: Sequence[int], position: int,
           draft: int | None = None, allowed: np.ndarray | None = None) -> SampledToken:
    """Pick the token at ``position`` from one row of raw logits; a pure function, no global state.

    With ``draft`` (a speculative draft token proposed for ``position``), a sampled pick follows the
    rejection rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for a draft that
    proposes one token with certainty: the draft is kept with probability ``p(draft)`` under the filtered
    distribution, otherwise the token is drawn from that distribution with the draft removed and the rest
    renormalised, so the token's distribution is exactly ``p`` whatever the draft. Greedy picks ignore it
    (the argmax is what a draft must equal). The kept draft is then the returned token.

    Args:
        logits: ``[n_vocab]`` float32 raw logits from the tail for the token at ``position`` (other float
            dtypes are converted to float32). Must be finite or ``-inf`` (at least one finite); not modified.
        params: sampling parameters (see :class:`SamplingParams` and the module docstring for the
            llama.cpp sampler each field mirrors).
        history: every token id of the session so far (prompt + generated), oldest first; the
            penalties look at its last ``params.penalty_last_n`` entries (``-1`` = all, ``0`` = none).
        position: 0-based index in the session of the token being produced. With ``params.seed`` set,
            the random draw uses ``np.random.default_rng([seed, position])`` (negative seeds are taken
            modulo 2**64), so a step replayed after a failover draws the same token; with ``seed=None``
            it uses fresh OS entropy.
        allowed: bool ``[n_vocab]``, the tokens a grammar allows here (at least one); None = all.

    Returns:
        :class:`SampledToken`: the chosen id, its log-prob under ``log_softmax(logits)`` of the raw logits
        (NaN when ``params.wants_logprobs`` is false), and the ``params.n_top_logprobs`` highest raw
        log-probs, best first, ties by lower id.

    Raises:
        ValueError: ``logits`` is not a non-empty 1-D array, ``params.validate()`` fails, ``position`` is
            negative, a penalised history id or a biased token id is outside ``[0, n_vocab)``,
            ``params.logit_bias`` leaves no token with a finite logit, ``allowed`` is not ``[n_vocab]`` or
            leaves none.
    """
    raw = np.asarray(logits, dtype=np.float32)
    if raw.ndim != 1 or raw.shape[0] == 0:
        raise ValueError(f"logits must be a non-empty 1-D [n_vocab] array, got shape {raw.shape}")
    problem = params.validate()
    if problem is not None:
        raise ValueError(f"bad sampling params: {problem}")
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    n_vocab = raw.shape[0]

    # Model log-probs: log_softmax of the raw logits (float32 exp, float64 sum and log). A greedy step
    # that reports no log-prob needs none of it (NaN stands for the log-prob it did not compute).
    lse = math.nan
    e_raw = _scratch_buffer(n_vocab)
    if params.temperature != 0 or params.wants_logprobs:
        mx = raw.max()
        np.subtract(raw, mx, out=e_raw)
        np.exp(e_raw, out=e_raw)
        if params.wants_logprobs:
            lse = float(mx) + math.log(float(e_raw.sum(dtype=np.float64)))

    pen = _apply_penalties(_constrained(raw, params, n_vocab, allowed), params, history, n_vocab)
    if params.temperature == 0:
        token = int(np.argmax(pen))  # greedy; first (lowest id) maximum on exact ties
    else:
        # e_raw is exp(raw - max): reusable as top-p's weights when nothing was penalised, and as
        # scratch space afterwards (saves a vocabulary-sized allocation per call)
        token = _draw(pen, params, position, e_raw if pen is raw else None, scratch=e_raw, draft=draft)

    # Log-probs leave as float32, the precision a step's reply carries them in: the same request answered
    # -2.195002565404721 in one process and -2.195002555847168 through a mesh.
    top: tuple[TokenLogprob, ...] = ()
    if params.n_top_logprobs > 0:
        ids = _top_ids(raw, params.n_top_logprobs)
        top = tuple(TokenLogprob(int(i), float(np.float32(float(raw[i]) - lse))) for i in ids)
    return SampledToken(token_id=token, logprob=float(np.float32(float(raw[token]) - lse)), top=top)


def _constrained(raw: np.ndarray, params: SamplingParams, n_vocab: int,
                 allowed: np.ndarray | None) -> np.ndarray:
    """The logits the penalties start from: ``raw`` biased, then masked by ``allowed`` (the grammar's
    tokens); a copy, or ``raw`` itself when there is neither a bias nor a mask."""
    if allowed is None:
        return _apply_logit_bias(raw, params, n_vocab)
    if allowed.shape != (n_vocab,):
        raise ValueError(f"the grammar's mask has shape {allowed.shape}, expected ({n_vocab},)")
    try:
        biased = _apply_logit_bias(raw, params, n_vocab)
    except ValueError:
        biased = raw  # the bias bans every token; the grammar's mask decides below
    out = np.where(allowed, biased, np.float32(-np.inf))
    if not np.isfinite(out.max()):  # the bias left no allowed token: the grammar wins over it
        out = np.where(allowed, raw, np.float32(-np.inf))
        if not np.isfinite(out.max()):
            raise ValueError("the grammar allows no token with a finite logit")
    return out


def _apply_logit_bias(logits: np.ndarray, params: SamplingParams, n_vocab: int) -> np.ndarray:
    """``llama_sampler_logit_bias`` with OpenAI's +-100 rule: a biased float32 copy of ``logits``
    ``[n_vocab]``, or ``logits`` itself when ``params.logit_bias`` is empty."""
    if not params.logit_bias:
        return logits
    ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64, count=len(params.logit_bias))
    bias = np.fromiter((b for _, b in params.logit_bias), dtype=np.float32, count=len(params.logit_bias))
    if ids[-1] >= n_vocab:  # ids are ascending (validated)
        raise ValueError(f"logit_bias token id {int(ids[-1])} is outside the vocabulary [0, {n_vocab})")
    out = logits.copy()
    out[ids] += bias
    out[ids[bias <= -LOGIT_BIAS_LIMIT]] = -np.inf
    forced = ids[bias >= LOGIT_BIAS_LIMIT]
    if forced.shape[0]:
        keep = out[forced]
        out.fill(-np.inf)
        out[forced] = keep
    if not np.isfinite(out.max()):
        raise ValueError("logit_bias leaves no token with a finite logit to sample")
    return out


def _apply_penalties(logits: np.ndarray, params: SamplingParams, history: Sequence[int],
                     n_vocab: int) -> np.ndarray:
    """``llama_sampler_penalties`` in float32: a penalised copy, or ``logits`` itself when inactive."""
    last_n = params.penalty_last_n
    inactive = (params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
                and params.presence_penalty == 0.0)
    if last_n == 0 or inactive or len(history) == 0:
        return logits
    window = history if last_n < 0 else history[-last_n:]
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    if ids[0] < 0 or ids[-1] >= n_vocab:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise ValueError(f"history token id {int(bad)} is outside the vocabulary [0, {n_vocab})")
    pen = logits.copy()
    vals = pen[ids]
    rp = np.float32(params.repetition_penalty)
    vals = np.where(vals <= 0, vals * rp, vals / rp)
    vals -= (counts.astype(np.float32) * np.float32(params.frequency_penalty)
             + np.float32(params.presence_penalty))
    pen[ids] = vals
    return pen


def _top_ids(vals: np.ndarray, m: int) -> np.ndarray:
    """Indices of the ``m`` largest values, sorted by value descending, ties by lower index.

    A partition finds the m-th largest value (no full sort unless ``m >= len(vals)``); exact ties at the
    cut keep the lowest indices.
    """
    n = vals.shape[0]
    if m >= n:
        return np.argsort(-vals, kind="stable")
    thr = np.partition(vals, n - m)[n - m]  # the m-th largest value
    above = np.flatnonzero(vals > thr)
    at = np.flatnonzero(vals == thr)[: m - above.shape[0]]
    sel = np.sort(np.concatenate([above, at]))
    return sel[np.argsort(-vals[sel], kind="stable")]


def _draw(pen: np.ndarray, params: SamplingParams, position: int, w_full: np.ndarray | None,
          scratch: np.ndarray, draft: int | None = None) -> int:
    """top-k -> top-p -> min-p -> temperature -> dist over the penalised float32 logits; returns a token id.

    ``scratch`` is a float32 buffer shaped like ``pen`` that may be overwritten (it may be ``w_full``).
    ``draft``: see :func:`sample`; its acceptance draw comes first from the same generator.
    """
    ids, vals, w = _filter(pen, params, w_full, scratch)
    if vals.shape[0] == 1:
        return int(ids[0]) if ids is not None else 0

    # temp, then dist: inverse CDF over the candidates in ascending id order
    t = np.float32(params.temperature)
    mx = vals.max() if t < 1 else None  # below 1 a division can overflow: see whether the best one does
    if mx is not None and (t == 0 or abs(float(mx)) > F32_MAX * float(t)):
        # So cold that dividing the best logit by the temperature leaves float32's range (a temperature
        # of 1e-38 is one; one of 1e-46 is 0 as float32): llama_sampler_temp would divide anyway and
        # sample from NaNs. The limit of softmax(logits / t) as t -> 0+ is the argmax: greedy.
        best = int(np.argmax(vals))
        return int(ids[best]) if ids is not None else best
    if params.temperature == 1.0 and w is not None:
        weights = w
    else:
        out = scratch if ids is None else None  # full vocabulary: w (if any) is not needed any more
        # below 1 a logit far under the best may leave float32's range: -inf, weight 0, as it should be
        with np.errstate(over="ignore"):
            weights = np.divide(vals, t, out=out)
            # the divided maximum is the maximum divided (float32 division rounds monotonically)
            np.subtract(weights, weights.max() if mx is None else mx / t, out=weights)
        np.exp(weights, out=weights)
    if params.seed is None:
        rng = np.random.default_rng()
    else:
        rng = np.random.default_rng([params.seed & _U64, position])
    if draft is not None:
        at = draft if ids is None else int(np.searchsorted(ids, draft))
        if ids is None or (at < ids.shape[0] and ids[at] == draft):  # the draft survived the filters
            if weights is w:
                weights = weights.copy()  # w may be the caller's buffer or a view of it
            p = float(weights[at]) / float(weights.sum(dtype=np.float64))
            if rng.random() < p:
                return draft
            weights[at] = 0.0  # rejected: draw from the rest, renormalised by the inverse CDF
    i = _inverse_cdf(weights, rng.random())
    return int(ids[i]) if ids is not None else i


def _filter(pen: np.ndarray, params: SamplingParams, w_full: np.ndarray | None,
            scratch: np.ndarray | None = None) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """top-k -> top-p -> min-p over the penalised float32 logits ``pen``.

    Returns the candidates ``(ids, vals, w)``: ascending token ids (``None`` = the whole vocabulary), their
    logits and, when computed, ``w = exp(vals - max(vals))`` (else ``None``). Every filter keeps the
    maximum, so ``w`` stays valid as rows are dropped. ``w_full`` is ``w`` for all of ``pen`` if known;
    ``scratch`` (optional, shaped like ``pen``) is used to compute it otherwise.
    """
    vals = pen
    ids: np.ndarray | None = None
    w = w_full

    # top-k
    k = params.top_k
    if 0 < k < vals.shape[0]:
        keep = np.sort(_top_ids(vals, k))
        ids, vals = keep, vals[keep]
        w = None if w is None else w[keep]

    # top-p: softmax at temperature 1 over the current candidates, smallest best prefix with mass >= top_p
    if params.top_p < 1.0 and vals.shape[0] > 1:
        if w is None:
            w = np.subtract(vals, vals.max(), out=scratch if ids is None else None)
            np.exp(w, out=w)
        target = params.top_p * float(w.sum(dtype=np.float64))
        n = vals.shape[0]
        m = min(_TOP_P_FIRST, n)
        while True:
            order = _top_ids(vals, m)
            cum = np.cumsum(w[order], dtype=np.float64)
            cut = int(np.searchsorted(cum, target, side="left"))  # first i with cum[i] >= target
            if cut < m:
                keep = np.sort(order[: cut + 1])
                break
            if m == n:  # rounding left the total just short of top_p: keep everything
                keep = None
                break
            m = min(m * 8, n)
        if keep is not None:
            ids = keep if ids is None else ids[keep]
            vals, w = vals[keep], w[keep]

    # min-p: p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
    if params.min_p > 0.0 and vals.shape[0] > 1:
        keep = np.flatnonzero(vals >= vals.max() + np.float32(math.log(params.min_p)))
        ids = keep if ids is None else ids[keep]
        vals = vals[keep]
        w = None if w is None else w[keep]
    return ids, vals, w


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """Index ``i`` of the first weight whose running (float64) sum reaches ``(1 - u) * total``.

    ``u`` is uniform in ``[0, 1)``, so the target lies in ``(0, total]`` and a zero-weight entry is never
    picked. Two levels (block sums, then one block) avoid a float64 cumulative sum over the whole
    vocabulary, which costs milliseconds at 262144 entries.
    """
    n = weights.shape[0]
    starts = np.arange(0, n, _CDF_BLOCK)
    block_cum = np.cumsum(np.add.reduceat(weights, starts, dtype=np.float64))
    target = (1.0 - u) * float(block_cum[-1])
    b = min(int(np.searchsorted(block_cum, target, side="left")), block_cum.shape[0] - 1)
    below = float(block_cum[b - 1]) if b > 0 else 0.0
    block = weights[starts[b]: starts[b] + _CDF_BLOCK]
    j = int(np.searchsorted(np.cumsum(block, dtype=np.float64), target - below, side="left"))
    if j >= block.shape[0]:  # rounding between the two summation orders: last positive weight
        j = int(np.flatnonzero(block > 0)[-1])
    return int(starts[b]) + j
