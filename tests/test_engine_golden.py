"""The ggml engine against llama.cpp's goldens (../shared/golden/README.md, "What a consumer should assert").

Checks per model and prompt: tokenizer ids, logits at the recorded positions (prompt batch then one
decode per generated token, the way llama.cpp produced them) within the stated tolerance, top-1 at every
prompt position with a clear margin, and 64 free-running greedy ids.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_MODELS, load_golden
from meshnet.contract import LayerRange, split_layers
from meshnet.engine.ggml_engine import GgmlStage
from meshnet.tokenizer import GGUFTokenizer

N_GEN = 64


def _stages(path, n_layer: int, n_stages: int) -> list[GgmlStage]:
    return [GgmlStage(str(path), r, n_threads=2, n_ctx=512) for r in split_layers(n_layer, n_stages)]


def _forward(stages, sessions, position, ids, all_logits=False):
    x = None
    for st, kv in zip(stages, sessions):
        if st.is_head:
            x = st.forward(kv, position, token_ids=np.asarray(ids, dtype=np.int32), all_logits=all_logits)
        else:
            x = st.forward(kv, position, hidden=x, all_logits=all_logits)
    return x


def check_against_golden(path, golden: dict, n_stages: int = 1) -> dict:
    tol = golden["tolerance"]
    stages = _stages(path, golden["gguf"]["n_layer"], n_stages)
    tok = GGUFTokenizer.from_gguf(str(path))
    report = {"greedy_equal": [], "max_dev": 0.0}
    devs = []
    for pi, p in enumerate(golden["prompts"]):
        assert tok.encode(p["prompt"]) == p["prompt_ids"], f"prompt {pi}: token ids differ"
        ids, n = p["prompt_ids"], len(p["prompt_ids"])

        # Teacher-forced along llama.cpp's own path: prompt batch, then one decode per golden token.
        sessions = [st.new_session() for st in stages]
        rows = dict(enumerate(_forward(stages, sessions, 0, ids, all_logits=True)))
        for k in range(8):
            rows[n + k] = _forward(stages, sessions, n + k, [p["greedy_ids"][k]])[-1]
        for s in sessions:
            s.free()
        for rec in p["top10"]:
            got = rows[rec["position"]]
            for tid, logit in rec["top10"]:
                d = abs(float(got[tid]) - logit)
                devs.append(d)
                assert d <= tol["logit_atol"], (
                    f"prompt {pi} pos {rec['position']} id {tid}: {got[tid]} vs golden {logit}")
            margin = rec["top10"][0][1] - rec["top10"][1][1]
            if margin >= tol["margin_threshold"]:
                assert int(np.argmax(got)) == rec["top10"][0][0]
        for pos in range(n):
            if p["prompt_top1_margins"][pos] >= tol["margin_threshold"]:
                assert int(np.argmax(rows[pos])) == p["prompt_top1_ids"][pos], f"prompt {pi} pos {pos}"

        # Free-running greedy: equal until the first golden near-tie at least; a divergence may only
        # start at a step whose golden margin is below the threshold.
        sessions = [st.new_session() for st in stages]
        logits = _forward(stages, sessions, 0, ids)[-1]
        out = []
        for k in range(N_GEN):
            t = int(np.argmax(logits))
            out.append(t)
            if k + 1 < N_GEN:
                logits = _forward(stages, sessions, n + k, [t])[-1]
        for s in sessions:
            s.free()
        k = next((i for i, (a, b) in enumerate(zip(out, p["greedy_ids"])) if a != b), N_GEN)
        report["greedy_equal"].append(k)
        assert k >= p["greedy_steps_before_first_near_tie"], f"prompt {pi}: diverged at step {k}"
        if k < N_GEN:
            assert p["greedy_margins"][k] < tol["margin_threshold"], (
                f"prompt {pi}: diverged at step {k} where the golden margin is {p['greedy_margins'][k]}")
    assert np.mean(devs) <= tol["logit_mean_atol"]
    report["max_dev"] = max(devs)
    for st in stages:
        st.close()
    return report


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_matches_llama_cpp(golden_dir, name):
    golden = load_golden(name)
    report = check_against_golden(golden_dir / "models" / f"{name}.gguf", golden, n_stages=2)
    if name != "tiny-llama-tied-f16":
        # Untied tiny models have no near-ties: every greedy id must match.
        assert report["greedy_equal"] == [N_GEN] * 4


def test_smollm2_matches_llama_cpp_bit_for_bit(smollm2_path, golden_dir):
    report = check_against_golden(smollm2_path, load_golden("SmolLM2-135M-Instruct.Q4_1"), n_stages=3)
    # Q4_1 runs the same ggml kernels as llama.cpp: all 64 greedy ids of all prompts, logits to the
    # golden's printed precision.
    assert report["greedy_equal"] == [N_GEN] * 4
    assert report["max_dev"] < 1e-4


@pytest.mark.gemma
def test_gemma3_270m_matches_llama_cpp(gemma_path, golden_dir):
    report = check_against_golden(gemma_path, load_golden("gemma-3-270m-q4_k_m"), n_stages=2)
    # llama.cpp repacks Q4_K weights for AVX2 and so runs a differently ordered kernel than the plain
    # ggml CPU kernels here; prompts 1 and 2 part ways at golden near-ties (checked above), which the
    # golden README's rule 4 allows. Prompts 0 and 3 match all the way.
    assert report["greedy_equal"][0] == N_GEN and report["greedy_equal"][3] == N_GEN


def test_one_two_three_stages_bit_identical(smollm2_path):
    """Splitting the 30 layers into 1, 2 or 3 ranges changes no bit of the logits or tokens."""
    golden = load_golden("SmolLM2-135M-Instruct.Q4_1")
    ids = golden["prompts"][1]["prompt_ids"]
    results = []
    for n_stages in (1, 2, 3):
        stages = _stages(smollm2_path, 30, n_stages)
        sessions = [st.new_session() for st in stages]
        logits = [_forward(stages, sessions, 0, ids, all_logits=True)]
        toks = []
        for k in range(16):
            t = int(np.argmax(logits[-1][-1]))
            toks.append(t)
            logits.append(_forward(stages, sessions, len(ids) + k, [t]))
        results.append((np.concatenate(logits), toks))
        for st in stages:
            st.close()
    for logits, toks in results[1:]:
        assert toks == results[0][1]
        assert np.array_equal(logits, results[0][0])
    assert results[0][1] == golden["prompts"][1]["greedy_ids"][:16]


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
