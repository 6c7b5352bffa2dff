"""``logit_bias`` on its own: the sampler's bias step (greedy, sampled, drafts under verification), the
parameter checks of the contract and of the API, and the step header that carries it to the tail."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.api.errors import ApiError
from meshnet.api.validation import logit_bias
from meshnet.contract import SamplingParams, StepRequest
from meshnet.sampling import sample
from meshnet.wire.envelope import frames_to_request, request_to_frames, sampling_from_pb, sampling_to_pb

# token 2 is the argmax, token 3 a close second, token 0 far behind
LOGITS = np.asarray([0.1, -2.0, 3.5, 3.25, 0.0, 1.0], dtype=np.float32)


def test_greedy_ban_moves_to_the_next_best_and_small_biases_add():
    assert sample(LOGITS, SamplingParams(), [], 0).token_id == 2
    assert sample(LOGITS, SamplingParams(logit_bias=((2, -100.0),)), [], 0).token_id == 3
    assert sample(LOGITS, SamplingParams(logit_bias=((2, -100.0), (3, -100.0))), [], 0).token_id == 5
    assert sample(LOGITS, SamplingParams(logit_bias=((0, 3.5),)), [], 0).token_id == 0  # 0.1 + 3.5 > 3.5
    assert sample(LOGITS, SamplingParams(logit_bias=((0, 3.0),)), [], 0).token_id == 2
    # +100 selects the token exclusively, even when its logit is the lowest
    assert sample(LOGITS, SamplingParams(logit_bias=((1, 100.0),)), [], 0).token_id == 1


def test_sampled_never_draws_a_banned_token_and_forced_tokens_win():
    ban = ((2, -100.0), (3, -100.0))
    picks = {sample(LOGITS, SamplingParams(temperature=2.0, seed=s, logit_bias=ban), [], 0).token_id
             for s in range(300)}
    assert picks and not picks & {2, 3}
    assert len(picks) > 1  # still a draw among the rest
    forced = SamplingParams(temperature=2.0, seed=5, logit_bias=((1, 100.0), (4, 100.0)))
    assert {sample(LOGITS, forced, [], p).token_id for p in range(200)} == {1, 4}
    # with every filter on, the ban holds too
    filt = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                          seed=3, logit_bias=((2, -100.0),))
    assert all(sample(LOGITS, filt, [2, 3], p).token_id != 2 for p in range(200))


def test_a_banned_draft_is_never_kept():
    ban = ((2, -100.0),)
    for seed in range(200):
        sp = SamplingParams(temperature=1.5, seed=seed, logit_bias=ban)
        assert sample(LOGITS, sp, [], 7, draft=2).token_id != 2
    assert sample(LOGITS, SamplingParams(logit_bias=ban), [], 7, draft=2).token_id == 3  # greedy: the argmax
    # a forced token as the draft is always kept, whatever the draw
    kept = {sample(LOGITS, SamplingParams(temperature=1.0, seed=s, logit_bias=((5, 100.0),)), [], 3, draft=5).token_id
            for s in range(50)}
    assert kept == {5}


def test_logprobs_stay_the_models_own():
    plain = sample(LOGITS, SamplingParams(n_top_logprobs=3), [], 0)
    biased = sample(LOGITS, SamplingParams(n_top_logprobs=3, logit_bias=((2, -100.0),)), [], 0)
    assert biased.top == plain.top
    assert biased.token_id == 3 and biased.logprob == plain.top[1].logprob


@pytest.mark.parametrize("bias, problem", [
    (((7, 1.0), (7, 2.0)), "names token 7 twice"),
    (((-1, 1.0),), "negative"),
    (((3, 100.5),), "must be in [-100, 100]"),
    (((3, float("nan")),), "must be in [-100, 100]"),
])
def test_contract_refuses_bad_biases(bias, problem):
    assert problem in SamplingParams(logit_bias=bias).validate()


def test_contract_keeps_pairs_sorted_by_id():
    assert SamplingParams(logit_bias=((9, 1.0), (3, -2))).logit_bias == ((3, -2.0), (9, 1.0))
    assert SamplingParams(logit_bias={9: 1, 3: -2}) == SamplingParams(logit_bias=((3, -2.0), (9, 1.0)))


def test_contract_checks_ids_against_the_vocabulary():
    sp = SamplingParams(logit_bias=((6, 1.0),))
    assert sp.validate() is None
    assert "outside the vocabulary [0, 6)" in sp.validate(n_vocab=6)
    assert "bans every token" in SamplingParams(logit_bias=((0, -100.0), (1, -100.0))).validate(n_vocab=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(LOGITS, sp, [], 0)


def test_api_parses_openai_maps():
    assert logit_bias(None, 10) == ()
    assert logit_bias({}, 10) == ()
    assert logit_bias({"9": 1, "2": -100, "05": 0.5}, 10) == ((2, -100.0), (5, 0.5), (9, 1.0))


@pytest.mark.parametrize("raw, words", [
    ({"abc": 1}, "not a token id"),
    ({"-1": 1}, "not a token id"),
    ({" 5": 1}, "not a token id"),
    ({"10": 1}, "[0, 10)"),
    ({"5": 100.5}, "must be a number in [-100, 100]"),
    ({"5": float("inf")}, "must be a number in [-100, 100]"),
    ({"5": 1, "005": 2}, "twice"),
    ({str(i): -100 for i in range(10)}, "bans every token"),
])
def test_api_refuses_bad_maps_naming_the_field(raw, words):
    with pytest.raises(ApiError) as e:
        logit_bias(raw, 10)
    assert e.value.status == 400 and e.value.param == "logit_bias" and words in e.value.message


def test_the_step_header_carries_the_bias_to_the_tail():
    sp = SamplingParams(temperature=0.5, seed=3, logit_bias=((2, -100.0), (5, 0.5), (49151, 100.0)))
    assert sampling_from_pb(sampling_to_pb(sp)) == sp
    assert sampling_from_pb(sampling_to_pb(SamplingParams())).logit_bias == ()
    assert sampling_from_pb(sampling_to_pb(SamplingParams(logprobs=False))).logprobs is False
    assert sampling_from_pb(sampling_to_pb(SamplingParams())).logprobs is True
    req = StepRequest("s", epoch=0, position=0, token_ids=(1, 2, 3), sampling=sp)
    back, decode = frames_to_request(request_to_frames(req, decode=False))
    assert back.sampling == sp and not decode
