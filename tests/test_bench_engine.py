"""The engine benchmark's pieces without timing anything: the random-weight qwen3moe writer (blocks that
dequantize to the intended RMS, a file the engine loads), llama-bench's command lines and JSON, the table."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from meshnet.bench.engine_bench import format_table
from meshnet.bench.llama_bench import llama_bench_argvs, summarize
from meshnet.bench.moe_model import MoeShapes, write_moe_model
from meshnet.bench.random_gguf import random_blocks
from meshnet.contract import LayerRange
from meshnet.engine.ggml_stage import GgmlStage
from meshnet.model.gguf_file import open_gguf
from meshnet.model.hparams import ModelConfig


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_random_blocks_dequantize_to_the_requested_rms(qtype):
    rng = np.random.default_rng(0)
    raw = random_blocks(rng, (4, 64, 768), qtype, rms=0.02)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (4, 64, 768 // block * size)
    values = gguf.quants.dequantize(raw, qtype)
    assert values.shape == (4, 64, 768) and np.isfinite(values).all()
    assert 0.015 < float(np.sqrt(np.mean(values ** 2))) < 0.025
    assert abs(float(values.mean())) < 0.003  # Q4_0: q - 8 has mean -0.5 quant steps
    with pytest.raises(ValueError, match="multiple of"):
        random_blocks(rng, (2, 100), qtype, rms=1.0)


def test_written_moe_model_has_the_shapes_and_runs(tmp_path, smollm2_path):
    shapes = MoeShapes(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=2,
                       n_ff_exp=256)
    path = write_moe_model(tmp_path / "m.gguf", shapes, "q4_k_m", seed=1)
    cfg = ModelConfig.from_reader(open_gguf(path))
    assert (cfg.architecture, cfg.n_layer, cfg.n_embd, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == (
        "qwen3moe", 2, 256, 8, 2, 256)
    types = {t.name: t.tensor_type for t in open_gguf(path).tensors}
    assert (types["blk.1.ffn_gate_exps.weight"], types["blk.1.ffn_down_exps.weight"], types["output.weight"],
            types["blk.0.ffn_gate_inp.weight"]) == (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F32)
    stage = GgmlStage(str(path), LayerRange(0, 2), n_threads=1, n_ctx=64)
    kv = stage.new_session()
    logits = stage.forward(kv, 0, token_ids=np.arange(100, 108, dtype=np.int32), all_logits=True)
    assert logits.shape == (8, 49152) and np.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 3.0  # unit-scale weights keep the activations in range
    stage.close()
    # Same seed, same bytes.
    again = write_moe_model(tmp_path / "again.gguf", shapes, "q4_k_m", seed=1)
    assert again.read_bytes() == path.read_bytes()


def test_llama_bench_argvs_and_summary():
    argvs = llama_bench_argvs("/bin/llama-bench", "m.gguf", n_prompt=128, n_gen=64, threads=2, repeats=3)
    common = ["/bin/llama-bench", "-m", "m.gguf", "-t", "2", "-fa", "on", "-r", "3", "-o", "json"]
    assert argvs == [[*common, "-p", "128", "-n", "0"], [*common, "-p", "0", "-n", "64", "-d", "128"]]
    plain = llama_bench_argvs("/bin/llama-bench", "m.gguf", 128, 64, 2, 3, repack=False)
    assert [a[len(common):len(common) + 2] for a in plain] == [["--repack", "0"]] * 2
    tests = [{"n_prompt": 128, "n_gen": 0, "n_depth": 0, "avg_ts": 101.234, "samples_ts": [100.0, 102.5]},
             {"n_prompt": 0, "n_gen": 64, "n_depth": 128, "avg_ts": 20.5, "samples_ts": [20.0, 21.0],
              "build_commit": "abc"}]
    got = summarize(tests, 128, 64)
    assert (got["prefill_tokens_per_s"], got["decode_tokens_per_s"], got["decode_runs"], got["decode_depth"]) == (
        101.23, 20.5, [20.0, 21.0], 128)
    with pytest.raises(ValueError, match="no generation test"):
        summarize(tests[:1], 128, 64)


def test_table_gives_each_row_its_ratio_to_llama_bench():
    result = {"meshnet": {"1_stage": {"layers": ["0:4"], "prefill_tokens_per_s": 50.0, "decode_tokens_per_s": 18.0},
                          "3_stages": {"layers": ["0:1", "1:3", "3:4"], "prefill_tokens_per_s": 40.0,
                                       "decode_tokens_per_s": 16.0}},
              "llama_cpp": {"prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 20.0}}
    rows = format_table(result).splitlines()
    assert rows[1].split()[-4:] == ["50.00", "18.00", "0.500", "0.900"]
    assert rows[2].split()[-4:] == ["40.00", "16.00", "0.400", "0.800"]
    assert rows[3].split() == ["llama-bench", "100.00", "20.00", "1.000", "1.000"]
    skipped = format_table({"meshnet": result["meshnet"], "llama_cpp": {"skipped": "--no-llama-cpp"}})
    assert skipped.splitlines()[-1] == "llama-bench skipped: --no-llama-cpp"


def test_a_rounds_ratios_against_both_llama_bench_runs():
    from meshnet.bench.engine_bench import _llama_ratios

    one = {"prefill_tokens_per_s": 300.0, "decode_tokens_per_s": 90.0}
    result = {"llama_cpp": {"prefill_tokens_per_s": 400.0, "decode_tokens_per_s": 100.0},
              "llama_cpp_no_repack": {"prefill_tokens_per_s": 500.0, "decode_tokens_per_s": 90.0}}
    assert _llama_ratios(one, result) == {
        "1_stage_vs_llama_cpp_decode": 0.9, "1_stage_vs_llama_cpp_prefill": 0.75,
        "1_stage_vs_llama_cpp_no_repack_decode": 1.0, "1_stage_vs_llama_cpp_no_repack_prefill": 0.6}
    assert _llama_ratios(one, {"llama_cpp": {"skipped": "x"}, "llama_cpp_no_repack": {"skipped": "x"}}) == {}
    table = format_table({"meshnet": {"1_stage": {"layers": ["0:4"], **one}}, "llama_cpp": result["llama_cpp"],
                          "rounds": [{}, {}, {}], "ratios": {"1_stage_vs_llama_cpp_decode": 0.88,
                                                             "1_stage_vs_llama_cpp_prefill": 0.7}})
    assert table.splitlines()[-1] == ("(figures of the last of 3 rounds; median of the rounds' ratios: "
                                      "prefill 0.7x, decode 0.88x)")


@pytest.mark.parametrize("stages, last_line", [
    ("31", "error: --stages 31: the model has 30 layers, so give 1 to 30 stages"),
    ("0", "meshnet bench engine: error: argument --stages: must be >= 1, got 0"),
])
def test_a_stage_count_the_model_cannot_split_into_is_refused_before_any_part_runs(tmp_path, smollm2_path, stages,
                                                                                   last_line):
    """``--stages 31`` measured the single stage first and failed only when it came to split SmolLM2's 30
    layers, with a message that named no flag."""
    import subprocess
    import sys

    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, "-m", "meshnet.cli", "bench", "engine", "--stages", stages, "--decode-tokens",
                        "4", "--prompt-tokens", "8", "--repeats", "1", "--no-llama-cpp", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == last_line
    assert "[bench]" not in r.stderr and not out.exists()
