"""The fake engine's tail sampler: llama.cpp's sampler chain over the fake logits, written out plainly.

Penalties over the recent tokens, then greedy argmax when ``temperature == 0``; otherwise top-k, top-p,
min-p, temperature and one draw, whose uniform number is a function of ``(seed, position)`` when a seed
is set. A verification step's draft is kept with the speculative rejection rule (kept with its
probability, else drawn from the rest). Used by :class:`~meshnet.engine.fake.FakeEngine` only.
"""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np

from meshnet.contract import SampledToken, TokenLogprob
from meshnet.sampling_params import SamplingParams


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / np.sum(e)


def sample_fake(logits: np.ndarray, position: int, history: list[int], sp: SamplingParams,
                draft: int | None = None) -> SampledToken:
    """Pick the token for ``position`` (the index of the token being predicted) from ``logits``
    ``[n_vocab]`` (f64); ``draft`` is the drafted token a verification step checks at this position.

    The chain follows llama.cpp's order: penalties over the last ``penalty_last_n`` tokens of
    ``history``, then greedy argmax when ``temperature == 0``; otherwise top-k, top-p, min-p,
    temperature and one draw. The draw's uniform number depends only on ``(seed, position)`` when
    ``seed`` is set, else it is not reproducible. The returned log-prob and top log-probs are of the
    model's distribution before penalties and filters, sorted descending (lowest id first on ties).
    """
    logprobs = _log_softmax(logits)
    work = _penalize(logits.copy(), history, sp)
    if sp.temperature == 0:
        token = int(np.argmax(work))
    else:
        ids = np.lexsort((np.arange(work.size), -work))  # descending logit, then ascending id
        vals = work[ids]
        if 0 < sp.top_k < ids.size:
            ids, vals = ids[:sp.top_k], vals[:sp.top_k]
        if sp.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(_softmax(vals)), sp.top_p)) + 1
            ids, vals = ids[:keep], vals[:keep]
        if sp.min_p > 0.0:
            p = _softmax(vals)
            keep = max(1, int(np.count_nonzero(p >= sp.min_p * p[0])))
            ids, vals = ids[:keep], vals[:keep]
        p = _softmax(vals / sp.temperature)
        hit = np.flatnonzero(ids == draft) if draft is not None else ()
        if len(hit) and _uniform(sp.seed, position, "draft") < p[hit[0]]:
            return _picked(draft, logprobs, sp)  # the draft kept: the rejection rule of sample()
        if len(hit):
            p[hit[0]] = 0.0  # rejected: draw from the rest
        cum = np.cumsum(p)
        u = _uniform(sp.seed, position)
        idx = min(int(np.searchsorted(cum, u * cum[-1], side="right")), ids.size - 1)
        token = int(ids[idx])
    return _picked(token, logprobs, sp)


def _picked(token: int, logprobs: np.ndarray, sp: SamplingParams) -> SampledToken:
    top: tuple[TokenLogprob, ...] = ()
    if sp.n_top_logprobs:
        best = np.lexsort((np.arange(logprobs.size), -logprobs))[:sp.n_top_logprobs]
        top = tuple(TokenLogprob(int(i), float(logprobs[i])) for i in best)
    return SampledToken(token, float(logprobs[token]) if sp.wants_logprobs else math.nan, top)


def _penalize(logits: np.ndarray, history: list[int], sp: SamplingParams) -> np.ndarray:
    """llama.cpp's repetition/presence/frequency penalties over the recent tokens, in place."""
    if sp.repetition_penalty == 1.0 and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0:
        return logits
    if sp.penalty_last_n == 0 or not history:
        return logits
    window = history if sp.penalty_last_n < 0 else history[-sp.penalty_last_n:]
    counts = np.bincount(np.asarray(window, dtype=np.int64), minlength=logits.size)
    seen = counts > 0
    rep = sp.repetition_penalty
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
    logits -= counts * sp.frequency_penalty + seen * sp.presence_penalty
    return logits


def _uniform(seed: int | None, position: int, salt: str = "") -> float:
    """A uniform draw in ``[0, 1)``: a function of ``(seed, position, salt)``, or fresh randomness
    without seed."""
    if seed is None:
        return random.random()
    d = hashlib.blake2b(f"{seed}:{position}{salt}".encode(), digest_size=8).digest()
    return (int.from_bytes(d, "little") >> 11) * 2.0 ** -53
