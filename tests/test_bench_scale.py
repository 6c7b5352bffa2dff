"""The scale benchmark's pieces: the 7B-class random llama writer (deterministic, readable by gguf-py with
the intended shapes and types), greedy parity of its small variant (1 vs 3 in-process stages, and
llama.cpp's llama-server where it is built), and ``meshnet bench scale``'s JSON on a tiny model."""

from __future__ import annotations

import argparse
import hashlib
import json

import gguf
import pytest
from gguf import GGMLQuantizationType as Q

from meshnet.bench.dense_model import LlamaShapes, ensure_llama_model, write_llama_model
from meshnet.bench.greedy_parity import compare_greedy, llama_cpp_greedy, stages_greedy
from meshnet.bench.llama_server import find_tool
from meshnet.contract import LayerRange
from meshnet.engine.ggml_stage import GgmlStage
from meshnet.model.gguf_file import open_gguf
from meshnet.model.hparams import ModelConfig

TINY = LlamaShapes(n_layer=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=2)
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
PARITY_TOKENS = 32


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.long  # four writes of a 49152-token vocabulary: 18 s; the bench's own test below writes one
def test_llama_writer_is_deterministic_and_gguf_py_reads_the_shapes(tmp_path, smollm2_path):
    a = write_llama_model(tmp_path / "a.gguf", TINY, "q4_1", seed=3)
    b = write_llama_model(tmp_path / "b.gguf", TINY, "q4_1", seed=3)
    c = write_llama_model(tmp_path / "c.gguf", TINY, "q4_1", seed=4)
    assert _sha256(a) == _sha256(b) != _sha256(c)
    reader = gguf.GGUFReader(str(a))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 9 * TINY.n_layer
    # gguf-py lists dims as ggml's ne (n_in first)
    assert list(tensors["token_embd.weight"].shape) == [256, 49152]
    assert list(tensors["output.weight"].shape) == [256, 49152]
    assert list(tensors["blk.2.attn_k.weight"].shape) == [256, 128]  # 2 KV heads of 64
    assert list(tensors["blk.2.ffn_down.weight"].shape) == [512, 256]
    assert {t.tensor_type for n, t in tensors.items() if not n.endswith("norm.weight")} == {Q.Q4_1}
    assert tensors["blk.0.attn_norm.weight"].tensor_type == Q.F32
    cfg = ModelConfig.from_reader(open_gguf(a))
    assert (cfg.architecture, cfg.n_layer, cfg.n_embd, cfg.n_vocab) == ("llama", 3, 256, 49152)
    q4_0 = gguf.GGUFReader(str(write_llama_model(tmp_path / "d.gguf", TINY, "q4_0", seed=3)))
    types = {t.name: t.tensor_type for t in q4_0.tensors}
    assert (types["blk.0.attn_q.weight"], types["output.weight"]) == (Q.Q4_0, Q.Q8_0)


@pytest.mark.long  # writes a 1.3 GB model on a fresh machine, then 25 s of compute
def test_small_variant_greedy_ids_match_across_stages_and_llama_cpp(smollm2_path):
    """The 8-layer variant of the real shapes (1.3 GB, written once into the bench models folder): 32
    greedy ids with clear margins, bit-equal in 1 and 3 stages, and equal to llama.cpp's."""
    path = str(ensure_llama_model(LlamaShapes(n_layer=8)))
    one = GgmlStage(path, LayerRange(0, 8), n_threads=2, n_ctx=512)
    try:
        ours = stages_greedy([one], PROMPT, PARITY_TOKENS)
    finally:
        one.close()
    # The next-token table keeps every step far from a tie: the runner-up is tens of logits behind.
    assert min(ours["margins"]) > 20.0
    assert len(set(ours["tokens"])) == PARITY_TOKENS
    three = [GgmlStage(path, r, n_threads=2, n_ctx=512) for r in (LayerRange(0, 3), LayerRange(3, 6), LayerRange(6, 8))]
    try:
        split = stages_greedy(three, PROMPT, PARITY_TOKENS)
    finally:
        for st in three:
            st.close()
    assert split == ours  # ids, log-probabilities and margins, bit for bit
    if find_tool("llama-server") is None:
        pytest.skip("llama-server is not built here (python -m meshnet.bench.llama_server builds it)")
    ref = llama_cpp_greedy(path, PROMPT, PARITY_TOKENS, threads=2)
    if "skipped" in ref:
        pytest.skip(ref["skipped"])
    got = compare_greedy(ours, ref)
    assert (got["equal_ids"], got["first_divergence"]) == (PARITY_TOKENS, None)
    assert got["max_abs_logprob_diff"] < 1e-3  # Q4_1 is not repacked: the same kernels, float32 noise only


def test_compare_greedy_reports_the_first_divergence():
    a = {"tokens": [1, 2, 3], "top_logprobs": [[[1, 0.0], [5, -9.0]], [[2, 0.0]], [[3, 0.0]]]}
    b = {"tokens": [1, 2, 4], "top_logprobs": [[[1, 0.0], [5, -9.5]], [[2, 0.0]], [[4, 0.0]]]}
    assert compare_greedy(a, b) == {"equal_ids": 2, "of": 3, "first_divergence": 2, "max_abs_logprob_diff": 0.5}
    assert compare_greedy(a, a)["first_divergence"] is None


@pytest.mark.slow
def test_scale_bench_json_on_a_tiny_model(tmp_path, smollm2_path):
    from meshnet.bench.scale_bench import format_table, run_scale_bench

    model = write_llama_model(tmp_path / "tiny.gguf", TINY, "q4_1", seed=1)
    out = tmp_path / "scale.json"
    args = argparse.Namespace(model=str(model), stages=3, threads=1, prompt_tokens=16, decode_tokens=4,
                              parity_tokens=4, repeats=1, no_llama_cpp=True, reference_repack=False, out=str(out))
    assert run_scale_bench(args) == 0
    result = json.loads(out.read_text())
    one, mesh = result["single_process"], result["mesh"]
    assert (result["n_layer"], result["stages"], result["prompt_tokens"]) == (3, 3, 16)
    assert one["layers"] == ["0:3"] and len(one["tokens"]) == 5
    assert one["load_s"] > 0 and one["memory"]["VmRSS"] > one["memory"]["before_load"]["VmRSS"] > 0
    assert one["prefill_tokens_per_s"] > 0 and one["decode_tokens_per_s"] > 0
    assert [n["layers"] for n in mesh["nodes"]] == mesh["layers"] and len(mesh["nodes"]) == 3
    for node in mesh["nodes"]:
        mem = node["memory"]
        assert node["load_s"] > 0 and mem["VmRSS"] >= mem["RssFile"] > 0
        assert len(mem["processes"]) == 2  # the node and its engine worker
        assert mem["weight_bytes"] > 0
    ratios = result["ratios"]
    assert ratios["mesh_tokens_equal_single"] is True
    assert len(ratios["node_rss_vs_single"]) == 3 and ratios["mesh_vs_single_decode"] > 0
    assert result["llama_bench"] == result["greedy_parity"] == {"skipped": "--no-llama-cpp"}
    assert "llama-bench skipped" in format_table(result)


@pytest.mark.slow  # about 4 s
def test_sigterm_stops_the_nodes(tmp_path, smollm2_path):
    """SIGTERM (`kill`) ended the bench on the spot; its node processes, which nothing else signals, ran on.
    Now it takes Ctrl-C's way out: the nodes are stopped, exit 143, one line."""
    import signal

    from mesh_util import left_running, sigterm_bench

    def nodes_up(tree):
        return sum("--node-id" in argv for argv in tree.values()) == 2

    proc, err, tree = sigterm_bench(["scale", "--model", "smollm2", "--stages", "2", "--prompt-tokens", "8",
                                     "--decode-tokens", "4", "--parity-tokens", "4", "--repeats", "1",
                                     "--no-llama-cpp", "--out", str(tmp_path / "scale.json")], nodes_up)
    assert left_running(tree) == []
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "meshnet bench scale: stopped by SIGTERM" and "Traceback" not in err
