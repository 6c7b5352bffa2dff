"""Tests for meshnet.sampling: llama.cpp's sampler chain (penalties, top-k, top-p, min-p, temp, dist)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from meshnet.contract import SamplingParams
from meshnet.sampling import _apply_penalties, _filter, _inverse_cdf, sample


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


def logits_for_probs(probs) -> np.ndarray:
    return f32(np.log(np.asarray(probs, dtype=np.float64)))


def draws(logits, params, positions) -> list[int]:
    return [sample(logits, params, [], pos).token_id for pos in positions]


# ---------------------------------------------------------------- greedy


def test_greedy_picks_argmax():
    logits = f32([0.1, -2.0, 3.5, 3.25, 0.0])
    out = sample(logits, SamplingParams(), [], 0)
    assert out.token_id == 2


def test_greedy_ties_pick_lowest_id():
    logits = f32([1.0, 7.0, 3.0, 7.0, 7.0])
    assert sample(logits, SamplingParams(), [], 0).token_id == 1


def test_greedy_large_vocab_matches_argmax_and_ignores_seed():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(49152).astype(np.float32)
    want = int(np.argmax(logits))
    for seed in (None, 0, 5):
        assert sample(logits, SamplingParams(seed=seed), [], 17).token_id == want


def test_input_logits_not_modified():
    logits = f32([2.0, 1.0, -1.0, 0.5])
    before = logits.copy()
    logits.setflags(write=False)  # NamedTensor.to_numpy() views are read-only
    sample(logits, SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.01, repetition_penalty=1.3,
                                  presence_penalty=0.5, frequency_penalty=0.2, seed=1, n_top_logprobs=3),
           [0, 1, 1, 2], 4)
    np.testing.assert_array_equal(logits, before)


def test_minus_inf_logits_are_never_drawn():
    logits = f32([-np.inf, 0.0, -np.inf, 0.5, -np.inf])
    params = SamplingParams(temperature=2.0, seed=3, repetition_penalty=1.2)
    got = {sample(logits, params, [0, 1], pos).token_id for pos in range(200)}
    assert got == {1, 3}
    out = sample(logits, SamplingParams(n_top_logprobs=5), [], 0)
    assert out.token_id == 3 and math.isfinite(out.logprob)
    assert [t.token_id for t in out.top[:2]] == [3, 1] and out.top[2].logprob == -math.inf


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_exact_values_and_argmax():
    logits = f32([2.0, 1.8, -0.5, 0.1])
    params = SamplingParams(repetition_penalty=1.5)
    # token 0 (positive) is divided, token 2 (negative) multiplied; token 3 is not in the history
    pen = _apply_penalties(logits, params, [0, 2, 0], 4)
    np.testing.assert_array_equal(pen, f32([np.float32(2.0) / np.float32(1.5), 1.8,
                                            np.float32(-0.5) * np.float32(1.5), 0.1]))
    assert sample(logits, params, [], 0).token_id == 0  # no history, no penalty
    assert sample(logits, params, [0, 2, 0], 3).token_id == 1  # 2.0 / 1.5 = 1.333 < 1.8


def test_repetition_penalty_pushes_negative_logits_down():
    logits = f32([-1.0, -1.2, -3.0])
    params = SamplingParams(repetition_penalty=1.5)
    assert sample(logits, params, [1], 1).token_id == 0
    assert sample(logits, params, [0], 1).token_id == 1  # -1.0 * 1.5 = -1.5 < -1.2


def test_presence_and_frequency_penalties_exact():
    logits = f32([3.0, 2.5, 2.0])
    params = SamplingParams(frequency_penalty=0.4, presence_penalty=0.3)
    history = [0, 0, 0, 1]
    pen = _apply_penalties(logits, params, history, 3)
    # token 0: 3.0 - 3*0.4 - 0.3 = 1.5; token 1: 2.5 - 0.4 - 0.3 = 1.8; token 2 untouched
    np.testing.assert_allclose(pen, [1.5, 1.8, 2.0], rtol=0, atol=1e-6)
    assert sample(logits, params, history, 4).token_id == 2
    # presence alone: subtracted once however often the token occurred
    pen = _apply_penalties(logits, SamplingParams(presence_penalty=0.75), history, 3)
    np.testing.assert_allclose(pen, [2.25, 1.75, 2.0], rtol=0, atol=1e-6)
    assert sample(logits, SamplingParams(presence_penalty=0.75), history, 4).token_id == 0
    # frequency alone: count * penalty
    pen = _apply_penalties(logits, SamplingParams(frequency_penalty=0.5), history, 3)
    np.testing.assert_allclose(pen, [1.5, 2.0, 2.0], rtol=0, atol=1e-6)
    assert sample(logits, SamplingParams(frequency_penalty=0.5), history, 4).token_id == 1  # tie 1,2 -> 1


def test_penalties_combine_in_llama_cpp_order():
    # repeat penalty first (divide), then subtract count*freq + presence
    logits = f32([4.0, 0.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    pen = _apply_penalties(logits, params, [0, 0], 2)
    np.testing.assert_allclose(pen, [4.0 / 2.0 - 2 * 0.25 - 0.5, 0.0], rtol=0, atol=1e-6)


def test_penalty_last_n_window():
    logits = f32([2.0, 1.8, 0.0])
    params = dict(repetition_penalty=2.0)
    history = [0, 2, 2]
    # the last 2 tokens are [2, 2]: token 0 is outside the window and keeps its logit
    assert sample(logits, SamplingParams(penalty_last_n=2, **params), history, 3).token_id == 0
    assert sample(logits, SamplingParams(penalty_last_n=3, **params), history, 3).token_id == 1
    assert sample(logits, SamplingParams(penalty_last_n=-1, **params), history, 3).token_id == 1
    assert sample(logits, SamplingParams(penalty_last_n=0, **params), history, 3).token_id == 0
    # -1 = the whole history, however long
    long_history = [0] + [2] * 500
    assert sample(logits, SamplingParams(penalty_last_n=-1, **params), long_history, 501).token_id == 1
    assert sample(logits, SamplingParams(penalty_last_n=64, **params), long_history, 501).token_id == 0


def test_penalty_history_out_of_vocab_raises():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(f32([1.0, 2.0]), SamplingParams(repetition_penalty=1.1), [0, 5], 2)


# ---------------------------------------------------------------- filters


def test_top_k_1_always_returns_argmax():
    rng = np.random.default_rng(11)
    logits = rng.standard_normal(1000).astype(np.float32)
    want = int(np.argmax(logits))
    params = SamplingParams(temperature=1.5, top_k=1, seed=42)
    assert set(draws(logits, params, range(100))) == {want}
    unseeded = SamplingParams(temperature=1.5, top_k=1)
    assert {sample(logits, unseeded, [], 0).token_id for _ in range(20)} == {want}


def test_top_k_keeps_exactly_k_best():
    logits = f32([0.0, 5.0, 1.0, 4.0, 3.0, 2.0])
    got = set(draws(logits, SamplingParams(temperature=5.0, top_k=3, seed=7), range(400)))
    assert got == {1, 3, 4}


def test_top_p_tiny_returns_argmax():
    rng = np.random.default_rng(12)
    logits = rng.standard_normal(5000).astype(np.float32)
    want = int(np.argmax(logits))
    params = SamplingParams(temperature=2.0, top_p=1e-6, seed=3)
    assert set(draws(logits, params, range(100))) == {want}


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = logits_for_probs([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    # 0.5 < 0.75 <= 0.8 -> {1, 3}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=1), range(300))) == {1, 3}
    # 0.8 < 0.85 <= 0.95 -> {1, 3, 2}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=1), range(300))) == {1, 3, 2}
    # p below the best token's mass keeps just that one
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.4, seed=1), range(50))) == {1}


def test_min_p_filters_low_probability_token():
    # token 2 has p = 0.04 * p_max; min_p = 0.05 removes it (the filter uses temperature-1 probabilities)
    logits = logits_for_probs([0.5, 0.25, 0.02, 0.23])
    params = SamplingParams(temperature=3.0, min_p=0.05, seed=9)
    got = Counter(draws(logits, params, range(200)))
    assert got[2] == 0
    assert set(got) == {0, 1, 3}
    # control: without min-p the hot temperature draws token 2 often
    control = Counter(draws(logits, SamplingParams(temperature=3.0, seed=9), range(200)))
    assert control[2] > 10


def reference_filter(pen: np.ndarray, params: SamplingParams) -> set[int]:
    """Brute force: full sort by (-logit, id), then llama.cpp's top-k, top-p, min-p on float64 probs."""
    order = sorted(range(pen.shape[0]), key=lambda i: (-float(pen[i]), i))
    if params.top_k > 0:
        order = order[: params.top_k]
    if params.top_p < 1.0:
        x = np.array([float(pen[i]) for i in order])
        p = np.exp(x - x.max())
        p /= p.sum()
        cum = np.cumsum(p)
        hits = np.flatnonzero(cum >= params.top_p)
        order = order[: int(hits[0]) + 1] if hits.size else order
    if params.min_p > 0.0:
        mx = max(float(pen[i]) for i in order)
        order = [i for i in order if float(pen[i]) >= mx + math.log(params.min_p)]
    return set(order)


@pytest.mark.parametrize("case", range(40))
def test_filters_match_brute_force_reference(case):
    rng = np.random.default_rng(100 + case)
    n = int(rng.choice([7, 300, 3000]))
    scale = float(rng.choice([0.05, 1.0, 4.0]))
    logits = (rng.standard_normal(n) * scale).astype(np.float32)
    if case % 4 == 0:  # exact ties, also across the cut points
        logits = np.round(logits * 2) / 2
    params = SamplingParams(
        temperature=1.0,
        top_k=int(rng.choice([0, 1, 5, 50, n + 3])),
        top_p=float(rng.choice([1.0, 0.3, 0.9, 0.99])),
        min_p=float(rng.choice([0.0, 0.05, 0.5])),
    )
    ids, vals, w = _filter(logits, params, None)
    got = set(range(n)) if ids is None else set(ids.tolist())
    want = reference_filter(logits, params)
    # floating-point cumulative sums may disagree exactly at a top-p boundary; allow none here
    assert got == want
    if ids is not None:
        assert np.all(np.diff(ids) > 0)
        np.testing.assert_array_equal(vals, logits[ids])
    if w is not None:
        np.testing.assert_allclose(w, np.exp(vals.astype(np.float64) - vals.max()), rtol=1e-5)


def test_top_p_widens_past_first_batch_on_flat_distribution():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(20000) * 0.01).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.5)
    ids, _, _ = _filter(logits, params, None)
    assert ids is not None and abs(ids.shape[0] - 10000) < 100
    assert set(ids.tolist()) == reference_filter(logits, params)


# ---------------------------------------------------------------- reproducibility and distribution


def test_same_seed_and_position_same_token():
    logits = np.zeros(1000, dtype=np.float32)  # uniform: any drift shows up
    params = SamplingParams(temperature=1.0, seed=1234)
    first = draws(logits, params, range(50))
    again = draws(logits, params, range(50))
    assert first == again
    assert sample(logits, params, [1, 2, 3], 17).token_id == first[17]  # history has no effect here
    assert len(set(first)) >= 40  # positions give a varying sequence
    other_seed = draws(logits, SamplingParams(temperature=1.0, seed=1235), range(50))
    assert other_seed != first


def test_seeded_draw_matches_documented_rng_recipe():
    # the draw is rng = default_rng([seed, position]); u = rng.random(); inverse CDF at (1 - u) * total
    logits = logits_for_probs([0.2, 0.3, 0.5])
    for pos in range(30):
        u = np.random.default_rng([77, pos]).random()
        cdf = np.cumsum([0.2, 0.3, 0.5])
        want = int(np.searchsorted(cdf, (1.0 - u) * cdf[-1], side="left"))
        got = sample(logits, SamplingParams(temperature=1.0, seed=77), [], pos).token_id
        if not np.isclose((1.0 - u) * cdf[-1], cdf[:2]).any():  # skip draws on a float boundary
            assert got == want


def test_negative_seed_is_deterministic():
    logits = np.zeros(100, dtype=np.float32)
    params = SamplingParams(temperature=1.0, seed=-1)
    assert draws(logits, params, range(20)) == draws(logits, params, range(20))


def test_unseeded_draws_vary():
    logits = np.zeros(1000, dtype=np.float32)
    got = {sample(logits, SamplingParams(temperature=1.0), [], 0).token_id for _ in range(30)}
    assert len(got) > 20


def test_frequencies_match_probabilities():
    probs = [0.5, 0.3, 0.2]
    logits = logits_for_probs(probs)
    got = Counter(draws(logits, SamplingParams(temperature=1.0, seed=2024), range(2000)))
    for tok, p in enumerate(probs):
        assert abs(got[tok] / 2000 - p) < 0.05, (tok, got)


def test_temperature_sharpens_distribution():
    probs = np.array([0.5, 0.3, 0.2])
    logits = logits_for_probs(probs)
    want = probs ** 2 / (probs ** 2).sum()  # temperature 0.5 squares the probabilities
    got = Counter(draws(logits, SamplingParams(temperature=0.5, seed=99), range(2000)))
    for tok, p in enumerate(want):
        assert abs(got[tok] / 2000 - p) < 0.05, (tok, got)


@pytest.mark.parametrize("temperature", [1e-30, 1e-37, 1e-38, 1e-39, 1e-45, 1e-46])
def test_temperatures_too_cold_for_float32_are_greedy(temperature):
    """Dividing by a temperature of 1e-38 overflows float32 (and 1e-46 is 0 as float32): the sampler
    takes the limit, the argmax, without a NaN or a warning, with or without a filter and a draft."""
    logits = np.random.default_rng(3).standard_normal(2000).astype(np.float32) * 8
    best = int(np.argmax(logits))
    with np.errstate(divide="raise", over="raise", invalid="raise"):  # 0-division, overflow, NaN raise
        for params in (SamplingParams(temperature=temperature, seed=7),
                       SamplingParams(temperature=temperature, top_k=40, seed=7)):
            assert sample(logits, params, [], 11).token_id == best
            assert sample(logits, params, [], 11, draft=best).token_id == best
            assert sample(logits, params, [], 11, draft=(best + 1) % 2000).token_id == best


@pytest.mark.parametrize("field,value,message", [
    ("top_p", 1e-46, "top_p 1e-46 is out of the 32-bit float range"),
    ("repetition_penalty", 1e-300, "repetition_penalty 1e-300 is out of the 32-bit float range"),
    ("repetition_penalty", 1e300, "repetition_penalty 1e+300 is out of the 32-bit float range"),
    ("presence_penalty", -1e39, "presence_penalty -1e+39 is out of the 32-bit float range"),
    ("temperature", 1e39, "temperature 1e+39 is out of the 32-bit float range"),
    ("temperature", math.inf, "temperature must be finite and >= 0"),
    ("repetition_penalty", math.inf, "repetition_penalty must be finite and > 0"),
    ("repetition_penalty", 1e-38, "repetition_penalty must be in [0.1, 10], got 1e-38"),
    ("repetition_penalty", 10.5, "repetition_penalty must be in [0.1, 10], got 10.5"),
    ("frequency_penalty", math.nan, "frequency_penalty must be finite"),
])
def test_values_the_wire_cannot_carry_are_refused(field, value, message):
    """Steps carry these as 32-bit floats: what rounds to 0 or infinity there is refused up front."""
    problem = SamplingParams(**{field: value}).validate()
    assert problem is not None and problem.startswith(message)


def test_smallest_float32_values_still_pass():
    assert SamplingParams(top_p=1e-44, presence_penalty=1e-44).validate() is None
    assert SamplingParams(temperature=1e-46).validate() is None  # 0 as float32: greedy


def test_inverse_cdf_across_blocks_never_picks_zero_weight():
    weights = np.zeros(5000, dtype=np.float32)
    weights[[3, 1500, 4999]] = [1.0, 2.0, 1.0]
    picks = Counter(_inverse_cdf(weights, u) for u in np.linspace(0.0, 0.999999, 400))
    assert set(picks) == {3, 1500, 4999}
    # u = 0 -> target = total -> the last positive weight; u -> 1 -> the first positive weight
    assert _inverse_cdf(weights, 0.0) == 4999
    assert _inverse_cdf(weights, 0.999999) == 3


# ---------------------------------------------------------------- log-probs


def test_logprob_is_log_softmax_of_raw_logits():
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal(49152) * 4).astype(np.float32)
    ref = log_softmax64(logits)
    out = sample(logits, SamplingParams(), [], 0)
    assert out.logprob == pytest.approx(ref[out.token_id], abs=1e-6)
    out = sample(logits, SamplingParams(temperature=0.9, top_k=40, seed=5), [], 3)
    assert out.logprob == pytest.approx(ref[out.token_id], abs=1e-6)


def test_a_step_that_wants_no_logprob_gets_the_same_token_and_nan():
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal(49152) * 4).astype(np.float32)
    ref = log_softmax64(logits)
    full = sample(logits, SamplingParams(), [], 0)
    bare = sample(logits, SamplingParams(logprobs=False), [], 0)
    assert bare.token_id == full.token_id == int(np.argmax(logits)) and math.isnan(bare.logprob)
    # a sampled step draws the same token either way; top log-probs imply the token's own
    for sp in (SamplingParams(temperature=0.8, top_p=0.9, seed=4, logprobs=False),
               SamplingParams(n_top_logprobs=2, logprobs=False)):
        out = sample(logits, sp, [], 7)
        assert out.token_id == sample(logits, SamplingParams(**{**sp.__dict__, "logprobs": True}), [], 7).token_id
        if sp.n_top_logprobs:
            assert out.logprob == pytest.approx(ref[out.token_id], abs=1e-6) and len(out.top) == 2
        else:
            assert math.isnan(out.logprob)


def test_logprob_ignores_penalties_and_temperature():
    logits = f32([2.0, 1.8, 0.0])
    ref = log_softmax64(logits)
    out = sample(logits, SamplingParams(repetition_penalty=2.0), [0], 1)
    assert out.token_id == 1
    assert out.logprob == pytest.approx(ref[1], abs=1e-7)
    out = sample(logits, SamplingParams(temperature=0.1, top_k=1, seed=1), [], 1)
    assert out.logprob == pytest.approx(ref[0], abs=1e-7)


def test_top_logprobs_sorted_with_ties_by_lower_id():
    logits = f32([1.0, 3.0, 2.0, 3.0, -1.0, 2.0, 0.5])
    ref = log_softmax64(logits)
    out = sample(logits, SamplingParams(n_top_logprobs=4), [], 0)
    assert [t.token_id for t in out.top] == [1, 3, 2, 5]
    for t in out.top:
        assert t.logprob == pytest.approx(ref[t.token_id], abs=1e-7)
    assert out.top[0].token_id == out.token_id and out.top[0].logprob == out.logprob


def test_top_logprobs_count_and_order_large_vocab():
    rng = np.random.default_rng(21)
    logits = rng.standard_normal(262144).astype(np.float32)
    ref = log_softmax64(logits)
    out = sample(logits, SamplingParams(temperature=0.8, seed=4, n_top_logprobs=20), [], 9)
    assert len(out.top) == 20
    assert [t.token_id for t in out.top] == np.argsort(-ref, kind="stable")[:20].tolist()
    lps = [t.logprob for t in out.top]
    assert lps == sorted(lps, reverse=True)
    np.testing.assert_allclose(lps, ref[[t.token_id for t in out.top]], rtol=0, atol=1e-6)


def test_top_logprobs_capped_by_vocab_and_off_by_default():
    logits = f32([0.0, 1.0, 2.0])
    assert sample(logits, SamplingParams(), [], 0).top == ()
    out = sample(logits, SamplingParams(n_top_logprobs=5), [], 0)
    assert [t.token_id for t in out.top] == [2, 1, 0]
    # float32 exp with float64 sums: log-probs are exact to ~1e-7 (see the module docstring)
    assert math.fsum(math.exp(t.logprob) for t in out.top) == pytest.approx(1.0, abs=1e-7)


# ---------------------------------------------------------------- argument checks


@pytest.mark.parametrize("bad", [np.zeros((2, 3), np.float32), np.zeros(0, np.float32)])
def test_bad_logits_shape_raises(bad):
    with pytest.raises(ValueError, match="1-D"):
        sample(bad, SamplingParams(), [], 0)


def test_bad_params_and_position_raise():
    with pytest.raises(ValueError, match="top_p"):
        sample(f32([1.0]), SamplingParams(top_p=0.0), [], 0)
    with pytest.raises(ValueError, match="temperature"):
        sample(f32([1.0]), SamplingParams(temperature=-1.0), [], 0)
    with pytest.raises(ValueError, match="position"):
        sample(f32([1.0]), SamplingParams(), [], -1)


def test_logprobs_are_the_float32_values_a_steps_reply_carries():
    """In one process the log-probs were float64 and through a mesh float32: the same request answered
    -2.195002565404721 and -2.195002555847168. Now a reply's protobuf round trip changes none of them."""
    from meshnet.contract import StepRequest, StepResult, Status
    from meshnet.wire.envelope import replies_to_result, result_to_replies

    out = sample(f32([0.3, 1.7, -2.2, 0.9]), SamplingParams(n_top_logprobs=3), [], 0)
    replies = result_to_replies(StepRequest("s", 1, 0, (1,)), StepResult(Status.OK, token=out, n_past=1))
    again = replies_to_result(replies).token
    assert again == out and out.logprob == float(np.float32(out.logprob)) and len(out.top) == 3
