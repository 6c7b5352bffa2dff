"""Mixture-of-experts models on the ggml engine: tiny-qwen3moe, tiny-deepseek2 and tiny-deepseek4 against
llama.cpp's goldens, split at every layer boundary, batched, and refused when their tensors do not fit the
architecture's manifest."""

from __future__ import annotations

import itertools
import math

import gguf
import numpy as np
import pytest

from conftest import golden_exact, load_golden, moe_model_path
from golden_check import N_GEN, assert_greedy_matches, check_against_golden, cpu_stage, forward
from meshnet.contract import GREEDY, LayerRange
from meshnet.engine.ggml_stage import BatchItem
from meshnet.generation import generate
from meshnet.layer_split import layer_costs
from meshnet.local_mesh import load_local_chain, plan_ranges
from meshnet.model.gguf_file import GGUFError, open_gguf
from meshnet.model.hparams import GATING_SIGMOID, ModelConfig
from meshnet.tokenizer import GGUFTokenizer

QWEN3MOE = "tiny-qwen3moe"
DEEPSEEK2 = "tiny-deepseek2"
DEEPSEEK4 = "tiny-deepseek4"
MOE_MODELS = [QWEN3MOE, DEEPSEEK2, DEEPSEEK4]
N_LAYER = 4
N_DECODE = 16


def _every_split(n_layer: int, n_stages: int) -> list[list[LayerRange]]:
    """Every way to cut ``[0, n_layer)`` into ``n_stages`` non-empty contiguous ranges."""
    out = []
    for cuts in itertools.combinations(range(1, n_layer), n_stages - 1):
        ends = list(cuts) + [n_layer]
        out.append([LayerRange(a, b) for a, b in zip([0] + list(cuts), ends)])
    return out


def _run(path, ranges: list[LayerRange], ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """Logits of the prompt batch (every row) then of ``N_DECODE`` greedy decode steps, and the greedy
    ids, through a chain of stages over ``ranges``."""
    stages = [cpu_stage(path, r) for r in ranges]
    sessions = [st.new_session() for st in stages]
    logits = [forward(stages, sessions, 0, ids, all_logits=True)]
    toks = []
    for k in range(N_DECODE):
        toks.append(int(np.argmax(logits[-1][-1])))
        logits.append(forward(stages, sessions, len(ids) + k, [toks[-1]]))
    for st in stages:
        st.close()
    return np.concatenate(logits), toks


def test_qwen3moe_matches_llama_cpp(qwen3moe_path):
    """Tokenizer ids, logits at the recorded positions within the golden's tolerance, top-1 where the
    margin is clear, and 64 free-running greedy ids per prompt: equal to llama.cpp's up to the first
    golden near-tie at least (rule 3, asserted inside check_against_golden)."""
    golden = load_golden(QWEN3MOE)
    report = check_against_golden(qwen3moe_path, golden, n_stages=1)
    # Prompts 0 and 2 have no near-tie in 64 steps, so rule 3 already demands all their ids.
    assert [report["greedy_equal"][i] for i in (0, 2)] == [N_GEN, N_GEN]
    if golden_exact():
        # The router, experts and attention run llama.cpp's ggml kernels in its op order: with goldens
        # made on these CPU features every id holds, and the logits to the golden's printed precision.
        assert report["greedy_equal"] == [N_GEN] * 4
        assert report["max_dev"] < 1e-4


def test_deepseek2_matches_llama_cpp(deepseek2_path):
    """MLA attention, YaRN rope, the leading dense block and grouped sigmoid routing against llama.cpp:
    logits within the golden's tolerance and free-running greedy ids by rule 3 (whose first near-tie is
    step 0 on every prompt: grouped routing has near-ties of 2e-5, so that rule alone demands little)."""
    golden = load_golden(DEEPSEEK2)
    report = check_against_golden(deepseek2_path, golden, n_stages=1)
    if golden_exact():
        # llama.cpp's kernels in its op order: every id, and the logits to the golden's printed precision
        # at most recorded positions. Not at all of them: ggml-python's ggml (0.15) and llama.cpp's (0.25)
        # differ in the last bit somewhere on the MLA path on AVX-512, and a routing near-tie turns that
        # into another expert. Measured there: llama-server built here gives the golden's log-probabilities
        # to 1e-5 at all 36 recorded positions; meshnet matches them to 1e-5 at 29 and is 0.07-0.2 off at 7,
        # all on the 157-token prompt, with every greedy id equal. A real error in the math (rope, mscale,
        # routing groups) moves the logits by units, not tenths.
        devs = sorted(report["record_devs"])
        assert report["greedy_equal"] == [N_GEN] * 4
        assert devs[len(devs) // 2] < 1e-4, devs
        assert report["max_dev"] < 0.5, devs


def test_deepseek4_matches_llama_cpp():
    """Hyper-connections, V4 attention (sinks, partial rope, window, grouped output), the compressed caches
    of blocks 2 (ratio 4, lightning indexer) and 3 (ratio 128) and hash routing against llama.cpp: logits
    within the golden's tolerance, top-1 where the margin is clear, and the first 16 free-running greedy
    ids by rule 3. The hyper-connection mixes and the indexer are composed from plain ggml ops (llama.cpp
    runs fused kernels), so the bits are not llama.cpp's: rule 3 holds, not exactness."""
    golden = load_golden(DEEPSEEK4)
    report = check_against_golden(moe_model_path(DEEPSEEK4), golden, n_stages=1, n_gen=16)
    assert report["greedy_equal"] == [16] * 4
    assert report["max_dev"] < golden["tolerance"]["logit_atol"] / 4


@pytest.mark.long
def test_deepseek4_all_greedy_ids():
    """All 64 greedy ids of every golden prompt (rule 3: prompt 0 may part at step 29, a golden near-tie
    of 0.05; the others hold all 64)."""
    golden = load_golden(DEEPSEEK4)
    report = check_against_golden(moe_model_path(DEEPSEEK4), golden, n_stages=1)
    assert report["greedy_equal"][1:] == [N_GEN] * 3 and report["greedy_equal"][0] >= 29


@pytest.mark.parametrize("n_stages", [2, 3, 4])
@pytest.mark.parametrize("model", MOE_MODELS)
def test_moe_split_at_every_boundary_is_bit_identical(model, n_stages):
    """Every cut of the 4 layers into 2, 3 or 4 stages gives the one-stage run's logits bit for bit (the
    prompt batch and 16 decode steps), hence its greedy ids; for deepseek2 the cuts put the dense block
    and each MoE block on either side, and each stage's pool holds only its layers' latent cells."""
    path = moe_model_path(model)
    ids = load_golden(model)["prompts"][1]["prompt_ids"]
    solo_logits, solo_toks = _run(path, [LayerRange(0, N_LAYER)], ids)
    splits = _every_split(N_LAYER, n_stages)
    assert len(splits) == {2: 3, 3: 3, 4: 1}[n_stages]
    for ranges in splits:
        logits, toks = _run(path, ranges, ids)
        assert toks == solo_toks, f"split {[str(r) for r in ranges]}"
        np.testing.assert_array_equal(logits, solo_logits, err_msg=f"split {[str(r) for r in ranges]}")


@pytest.mark.parametrize("model", [QWEN3MOE, DEEPSEEK2, pytest.param(DEEPSEEK4, marks=pytest.mark.long)])
def test_moe_generation_through_chained_engines(model):
    """The generation loop over in-process engine chains (load_local_chain, the route `meshnet generate`
    takes): 64 greedy ids per golden prompt, the same from 1, 2, 3 and 4 balanced stages, and llama.cpp's
    (every id with goldens made on these CPU features, else rule 3)."""
    golden = load_golden(model)
    path = str(moe_model_path(model))
    tok = GGUFTokenizer.from_gguf(path)
    results = {}
    for n_stages in (1, 2, 3, 4):
        chain = load_local_chain(path, plan_ranges(path, n_stages), n_ctx=512, progress=False)
        results[n_stages] = [generate(chain, tok, p["prompt_ids"], N_GEN, GREEDY, stop_at_eog=False)
                             .generated_token_ids for p in golden["prompts"]]
    for n_stages in (2, 3, 4):
        assert results[n_stages] == results[1], f"{n_stages} stages"
    for i, ids in enumerate(results[1]):
        assert_greedy_matches(golden, i, ids, golden_exact())


@pytest.mark.parametrize("model", MOE_MODELS)
def test_moe_batched_rows_equal_each_alone(model):
    """Four sessions decoding in one iteration beside a prefill segment (tokens routed to different
    experts share each ``ggml_mul_mat_id``; for deepseek2 the queries of all rows share MLA's absorption
    and decompression mat-muls) give the logits each gives alone, bit for bit."""
    golden = load_golden(model)
    prompts = [np.asarray(p["prompt_ids"], dtype=np.int32) for p in golden["prompts"]]
    nxt = [np.asarray([p["greedy_ids"][0]], dtype=np.int32) for p in golden["prompts"]]
    stage = cpu_stage(moe_model_path(model), LayerRange(0, N_LAYER))

    alone = []
    for p, t in zip(prompts, nxt):
        kv = stage.new_session()
        stage.forward(kv, 0, token_ids=p)
        alone.append(stage.forward(kv, len(p), token_ids=t)[-1])
        kv.free()
    kv_seg = stage.new_session()
    seg_alone = stage.forward(kv_seg, 0, token_ids=prompts[1][:40])[-1]
    kv_seg.free()

    kvs = [stage.new_session() for _ in prompts]
    for kv, p in zip(kvs, prompts):
        stage.forward(kv, 0, token_ids=p)
    kv_seg = stage.new_session()
    items = [BatchItem(kv.slot, len(p), t) for kv, p, t in zip(kvs, prompts, nxt)]
    items.append(BatchItem(kv_seg.slot, 0, prompts[1][:40]))
    out = stage.forward_batch(items)
    assert len(out) == 5
    for i in range(4):
        np.testing.assert_array_equal(out[i][-1], alone[i], err_msg=f"session {i}")
    np.testing.assert_array_equal(out[4][-1], seg_alone)
    stage.close()


def test_qwen3moe_config_and_plan(qwen3moe_path):
    cfg = ModelConfig.from_reader(open_gguf(qwen3moe_path))
    assert (cfg.architecture, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == ("qwen3moe", 8, 2, 64)
    assert cfg.manifest.is_moe and cfg.manifest.moe_norm_weights
    # The planner weighs a layer by all its experts (what a stage holds), not the 2 a token uses:
    # norms, q 64x128, k/v 64x64, o 128x64, q/k norms 32, router 64x8, 3 x 8 experts of 64x64.
    costs, _ = layer_costs(open_gguf(qwen3moe_path), N_LAYER)
    assert costs == [2 * 64 + 64 * 128 * 2 + 64 * 64 * 2 + 2 * 32 + 64 * 8 + 3 * 8 * 64 * 64] * N_LAYER
    assert [str(r) for r in plan_ranges(str(qwen3moe_path), 4)] == ["0:1", "1:2", "2:3", "3:4"]


def test_deepseek2_config_and_latent_kv_cache(deepseek2_path):
    """The hyper-parameters llama.cpp reads, and a KV pool of one latent + rope row per token and layer
    (F16 ``kv_lora_rank + n_rot`` = 80 values, V a view of it) instead of full K and V."""
    cfg = ModelConfig.from_reader(open_gguf(deepseek2_path))
    assert (cfg.n_lora_q, cfg.n_lora_kv, cfg.n_embd_head_k_mla, cfg.n_embd_head_v_mla, cfg.n_rot) == (32, 64, 48, 32, 16)
    assert (cfg.n_layer_dense_lead, cfg.n_expert, cfg.n_expert_used, cfg.n_expert_shared) == (1, 16, 4, 1)
    assert (cfg.n_expert_groups, cfg.n_group_used, cfg.expert_gating_func) == (4, 2, GATING_SIGMOID)
    assert cfg.expert_weights_norm and cfg.expert_weights_scale == 2.5
    # YaRN, factor 40 on 4096: the rope's attn_factor cancels ggml's own magnitude factor, and the kq
    # scale carries mscale² (1 + 0.1 ln 40)² / sqrt(48), in float32 as llama.cpp computes them.
    assert (cfg.rope_ext_factor, cfg.n_ctx_orig_yarn) == (1.0, 4096)
    assert cfg.rope_attn_factor == pytest.approx(1 / (1 + 0.1 * math.log(40)), rel=1e-6)
    assert cfg.attn_scale == pytest.approx((1 + 0.1 * math.log(40)) ** 2 / math.sqrt(48), rel=1e-6)
    stage = cpu_stage(deepseek2_path, LayerRange(1, 3))
    assert stage.pool.v == {} and sorted(stage.pool.k) == [1, 2]
    assert stage.pool.bytes_per_token == 2 * 2 * (64 + 16)
    full_kv = 2 * 2 * cfg.n_head * (cfg.n_embd_head_k_mla + cfg.n_embd_head_v_mla)  # decompressed K and V
    assert full_kv == 4 * stage.pool.bytes_per_token
    stage.close()
    # The planner weighs the leading dense block by its own (smaller) bytes.
    costs, _ = layer_costs(open_gguf(deepseek2_path), N_LAYER)
    assert costs[0] < costs[1] == costs[2] == costs[3]


def _copy_gguf(src, dst, drop: str) -> None:
    """Write ``src``'s scalar metadata and every tensor but the tensor or key ``drop`` to ``dst`` (no
    tokenizer arrays: loading a stage does not read them)."""
    reader = open_gguf(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        vtype = field.types[0] if field.types else None
        if (key.startswith("GGUF.") or key in (gguf.Keys.General.ARCHITECTURE, drop)
                or vtype == gguf.GGUFValueType.ARRAY):
            continue
        w.add_key_value(key, field.contents(), vtype)
    for t in reader.tensors:
        if t.name != drop:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # data: rows of bytes when quantized
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_missing_expert_tensor_is_refused_at_load(qwen3moe_path, tmp_path):
    missing = "blk.2.ffn_up_exps.weight"
    broken = tmp_path / "no-up-exps.gguf"
    _copy_gguf(qwen3moe_path, broken, drop=missing)
    message = f"qwen3moe GGUF is missing tensor '{missing}'"
    with pytest.raises(GGUFError, match=message):
        plan_ranges(str(broken), 2)
    # A stage that does not hold layer 2 refuses the file too, through the engine's load result.
    with pytest.raises(ValueError, match=message):
        load_local_chain(str(broken), [LayerRange(0, 2)], progress=False)


@pytest.mark.parametrize("missing", ["blk.2.attn_k_b.weight", "blk.0.attn_kv_a_mqa.weight", "blk.1.attn_q_a_norm.weight"])
def test_a_missing_mla_tensor_is_refused_at_load(deepseek2_path, tmp_path, missing):
    broken = tmp_path / "no-mla-tensor.gguf"
    _copy_gguf(deepseek2_path, broken, drop=missing)
    with pytest.raises(ValueError, match=f"deepseek2 GGUF is missing tensor '{missing}'"):
        load_local_chain(str(broken), [LayerRange(3, 4)], progress=False)


def test_a_legacy_deepseek2_without_absorbed_mla_is_refused(deepseek2_path, tmp_path):
    broken = tmp_path / "legacy-mla.gguf"
    _copy_gguf(deepseek2_path, broken, drop="deepseek2.attention.key_length_mla")
    with pytest.raises(ValueError, match="deepseek2 GGUF has no attention.key_length_mla / value_length_mla: "
                                         "the legacy attn_kv_b layout is not supported"):
        load_local_chain(str(broken), [LayerRange(0, 4)], progress=False)


def test_a_misshaped_router_is_refused_at_load(qwen3moe_path, tmp_path):
    # Rewrite blk.1.ffn_gate_inp.weight's dims in the header from [64, 8] (F32) to [64, 4]: a smaller
    # tensor, so the file still parses; the load must name the tensor and the shape it expected.
    name = b"blk.1.ffn_gate_inp.weight"
    data = bytearray(qwen3moe_path.read_bytes())
    i = data.index(name) + len(name)
    assert int.from_bytes(data[i:i + 4], "little") == 2
    ne1 = i + 4 + 8
    assert int.from_bytes(data[ne1:ne1 + 8], "little") == 8
    data[ne1:ne1 + 8] = (4).to_bytes(8, "little")
    path = tmp_path / "router-4.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"qwen3moe GGUF tensor 'blk.1.ffn_gate_inp.weight' has shape "
                                         r"\[64, 4\], expected \[64, 8\] \(n_embd, n_expert\)"):
        load_local_chain(str(path), [LayerRange(2, 4)], progress=False)
