"""The ggml engine against llama.cpp's goldens (../shared/golden/README.md, "What a consumer should assert").

Checks per model and prompt: tokenizer ids, logits at the recorded positions (prompt batch then one
decode per generated token, the way llama.cpp produced them) within the stated tolerance, top-1 at every
prompt position with a clear margin, and 64 free-running greedy ids.

The goldens come from the set made with this ggml's CPU features (``conftest.GOLDEN_SET``). With such a
set the tests demand every greedy id (and SmolLM2's logits to 1e-4), Gemma's excepted (see its test); with
none, the README's rule 3.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_MODELS, golden_exact, load_golden
from golden_check import N_GEN, assert_greedy_matches, check_against_golden, cpu_stage, forward
from meshnet.contract import LayerRange, split_layers
from meshnet.engine.ggml_stage import GgmlStage


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_matches_llama_cpp(golden_dir, name):
    golden = load_golden(name)
    report = check_against_golden(golden_dir / "models" / f"{name}.gguf", golden, n_stages=2)
    if name != "tiny-llama-tied-f16":
        # Untied tiny models have no near-ties: every greedy id must match.
        assert report["greedy_equal"] == [N_GEN] * 4


def test_smollm2_matches_llama_cpp_bit_for_bit(smollm2_path, golden_dir):
    report = check_against_golden(smollm2_path, load_golden("SmolLM2-135M-Instruct.Q4_1"), n_stages=3)
    if not golden_exact():
        return  # rule 3, asserted above: no golden was made with this ggml's CPU features
    # Q4_1 runs the same ggml kernels as llama.cpp: all 64 greedy ids of all prompts, logits to the
    # golden's printed precision.
    assert report["greedy_equal"] == [N_GEN] * 4
    assert report["max_dev"] < 1e-4


def test_solo_reference_matches_llama_cpp(solo, golden_dir):
    """The single-process run every mesh test compares with (the generation loop over one in-process
    stage) is llama.cpp's greedy output for the running CPU features: so mesh == solo == llama.cpp."""
    golden = load_golden("SmolLM2-135M-Instruct.Q4_1")
    for i, p in enumerate(golden["prompts"]):
        assert solo.prompt_ids(i) == p["prompt_ids"]
        assert_greedy_matches(golden, i, solo.greedy(i), golden_exact())


@pytest.mark.gemma
def test_gemma3_270m_matches_llama_cpp(gemma_path, golden_dir):
    """Rule 3 of the golden README (asserted inside check_against_golden), on every machine: the ids equal
    llama.cpp's up to each prompt's first golden near-tie (prompt 3 has none, so all its 64), and any later
    divergence starts at a near-tie.

    Exactness beyond that is not demanded, even with goldens made on these CPU features: llama.cpp runs
    Q4_K/Q6_K/Q5_K prefill batches through kernels ggml-python 0.0.45's ggml lacks or that meshnet keeps
    out of batched rows (repacked Q4_K GEMM, ggml 0.25's tiled K-quant mat-mul), so which prompts go on
    to match all 64 ids is chance. Measured on one AVX-512 machine: 64, 41, 18, 64 ids with Q4_K repacked
    as cpu_repack does there, 4, 64, 60, 64 without; on AVX2 prompts 0 and 3 matched all the way."""
    report = check_against_golden(gemma_path, load_golden("gemma-3-270m-q4_k_m"), n_stages=2)
    assert report["greedy_equal"][3] == N_GEN


def test_one_two_three_stages_bit_identical(smollm2_path, solo):
    """Splitting the 30 layers into 1, 2 or 3 ranges changes no bit of the logits or tokens."""
    ids = solo.prompt_ids(1)
    results = []
    for n_stages in (1, 2, 3):
        stages = [cpu_stage(smollm2_path, r) for r in split_layers(30, n_stages)]
        sessions = [st.new_session() for st in stages]
        logits = [forward(stages, sessions, 0, ids, all_logits=True)]
        toks = []
        for k in range(16):
            t = int(np.argmax(logits[-1][-1]))
            toks.append(t)
            logits.append(forward(stages, sessions, len(ids) + k, [t]))
        results.append((np.concatenate(logits), toks))
        for st in stages:
            st.close()
    for logits, toks in results[1:]:
        assert toks == results[0][1]
        assert np.array_equal(logits, results[0][0])
    assert results[0][1] == solo.greedy(1, 16)


def test_layer_range_selects_only_its_tensors(smollm2_path):
    """A middle stage holds only blk.10..19 tensors; head adds token_embd; tail output_norm + token_embd
    (SmolLM2 is tied)."""
    mid = GgmlStage(str(smollm2_path), LayerRange(10, 20))
    head = GgmlStage(str(smollm2_path), LayerRange(0, 10))
    tail = GgmlStage(str(smollm2_path), LayerRange(20, 30))
    assert sorted({n.split(".")[1] for n in mid.weights.tensors}) == [str(i) for i in range(10, 20)]
    assert "token_embd.weight" in head.weights.tensors and "output_norm.weight" not in head.weights.tensors
    assert {"token_embd.weight", "output_norm.weight"} <= set(tail.weights.tensors)
    assert len(mid.weights.tensors) == 10 * 9
    # Q4_1 layers stay Q4_1: a middle third is a third of the layer bytes, far from the fp32 size.
    assert mid.weights.nbytes < 30_000_000
    for st in (mid, head, tail):
        st.close()
