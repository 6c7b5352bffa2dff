"""The greedy side of the llama.cpp comparison (meshnet.bench.greedy_parity.stages_greedy) on MoE chains:
token ids for hash-routed stages past the head, and ids that never win (llama-server's ignore_eos)."""

from __future__ import annotations

import pytest

from conftest import load_golden, moe_model_path
from golden_check import cpu_stage
from meshnet.bench.greedy_parity import aligned_top_logprobs, stages_greedy
from meshnet.contract import LayerRange

N_TOKENS = 4


def test_a_stage_holding_hash_routed_blocks_gets_the_token_ids():
    """tiny-deepseek4 routes blocks 0-2 by token id: a chain whose second stage holds blocks 1-3 must be
    handed each step's ids (it refused the step before) and then gives the one-stage run bit for bit."""
    path = moe_model_path("tiny-deepseek4")
    prompt = load_golden("tiny-deepseek4")["prompts"][0]["prompt_ids"]
    solo = [cpu_stage(path, LayerRange(0, 4))]
    split = [cpu_stage(path, LayerRange(0, 1)), cpu_stage(path, LayerRange(1, 4))]
    assert split[1].needs_tokens and not split[1].is_head
    try:
        one, two = stages_greedy(solo, prompt, N_TOKENS), stages_greedy(split, prompt, N_TOKENS)
    finally:
        for st in solo + split:
            st.close()
    assert two == one
    assert one["tokens"] == load_golden("tiny-deepseek4")["prompts"][0]["greedy_ids"][:N_TOKENS]


def test_ids_left_out_never_win_but_keep_their_log_probabilities():
    """``never`` mirrors llama-server's ignore_eos: the step's winner is the best other id, while the
    reported top log-probabilities (raw logits, as the server reports them) still list the left-out id."""
    path = moe_model_path("tiny-qwen3moe")
    prompt = load_golden("tiny-qwen3moe")["prompts"][0]["prompt_ids"]
    stage = cpu_stage(path, LayerRange(0, 4))
    try:
        free = stages_greedy([stage], prompt, 1)
        banned = free["tokens"][0]
        held = stages_greedy([stage], prompt, 1, never=[banned])
    finally:
        stage.close()
    runner_up, third = free["top_logprobs"][0][1][0], free["top_logprobs"][0][2]
    assert held["tokens"] == [runner_up] != [banned]
    assert held["top_logprobs"] == free["top_logprobs"] and held["top_logprobs"][0][0][0] == banned
    # the margin is the runner-up's lead over the third (logit differences equal log-probability ones)
    assert held["margins"][0] == pytest.approx(free["top_logprobs"][0][1][1] - third[1], abs=1e-6)


def test_llama_servers_probabilities_are_placed_by_the_token_they_are_for():
    """An entry short (the server listed 2 entries for 3 tokens, the first one missing): the entries go to
    the tokens they name, and the first token has nothing to compare."""
    probs = [{"id": 7, "top_logprobs": [{"id": 7, "logprob": -0.1}]},
             {"id": 9, "top_logprobs": [{"id": 9, "logprob": -0.2}, {"id": 3, "logprob": -2.0}]}]
    assert aligned_top_logprobs([5, 7, 9], probs) == [[], [[7, -0.1]], [[9, -0.2], [3, -2.0]]]
    assert aligned_top_logprobs([7, 9], probs) == [[[7, -0.1]], [[9, -0.2], [3, -2.0]]]
