"""DeepSeek-V4 (deepseek4): the tiny golden model's configuration and tensor table load; the engine refuses
to run it with a one-line reason naming what it does not build yet; hash routing, the declared token-id
need and the hyper-connection boundary shape."""

from __future__ import annotations

import pytest

from conftest import moe_model_path
from meshnet.contract import ArtifactId, LayerRange, LoadSpec, Status
from meshnet.engine.ggml_engine import GgmlEngine
from meshnet.model.arch_manifest import check_tensors
from meshnet.model.gguf_file import GGUFError, open_gguf
from meshnet.model.hparams import ModelConfig

DEEPSEEK4 = "tiny-deepseek4"


@pytest.fixture(scope="module")
def v4_path():
    return moe_model_path(DEEPSEEK4)


@pytest.fixture(scope="module")
def v4_cfg(v4_path) -> ModelConfig:
    return ModelConfig.from_reader(open_gguf(v4_path))


def _tensors(path) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(d) for d in t.shape) for t in open_gguf(path).tensors}


def test_config_of_the_tiny_model(v4_cfg):
    """The values the golden README lists for tiny-deepseek4."""
    v4 = v4_cfg.dsv4
    assert (v4_cfg.n_layer, v4_cfg.n_embd, v4_cfg.n_head, v4_cfg.n_head_kv, v4_cfg.head_dim) == (4, 64, 4, 1, 128)
    assert (v4_cfg.n_rot, v4_cfg.n_swa, v4_cfg.n_lora_q, v4_cfg.expert_gating_func) == (16, 32, 32, 4)
    assert (v4_cfg.n_expert, v4_cfg.n_expert_used, v4_cfg.n_expert_shared) == (16, 4, 1)
    assert (v4_cfg.expert_weights_scale, v4_cfg.expert_weights_norm) == (1.5, True)
    assert (v4.n_hc, v4.sinkhorn_iters, v4.n_hash_layers, v4.compress_ratios) == (4, 20, 3, (0, 0, 4, 128))
    assert (v4.o_groups, v4.o_lora_rank, v4.indexer_n_head, v4.indexer_head_dim, v4.indexer_top_k) == \
        (2, 32, 16, 64, 8)
    assert v4.swiglu_clamp_exp == v4.swiglu_clamp_shexp == (1.5,) * 4
    # what crosses a stage boundary: 4 streams of n_embd per token
    assert v4_cfg.residual_shape == (4, 64) and v4_cfg.manifest.residual == "dsv4.hc_dim" and v4.hc_dim == 256


def test_stages_with_hash_routed_blocks_need_token_ids(v4_cfg):
    """Blocks 0-2 pick experts by token id: a stage starting at 1 or 2 needs them, one starting at 3
    only the hidden states (the head always embeds token ids)."""
    assert [v4_cfg.needs_token_ids(LayerRange(s, 4)) for s in range(4)] == [True, True, True, False]


def test_manifest_tensors_by_block(v4_path, v4_cfg):
    tensors = _tensors(v4_path)
    check_tensors(v4_cfg.manifest, v4_cfg, tensors.items())
    # hash-routed blocks hold ffn_gate_tid2eid [n_expert_used, n_vocab], the others exp_probs_b
    assert tensors["blk.2.ffn_gate_tid2eid.weight"] == (4, 49152) and "blk.3.exp_probs_b.bias" in tensors
    for drop in ("blk.1.ffn_gate_tid2eid.weight", "blk.3.exp_probs_b.bias", "blk.2.indexer.proj.weight",
                 "blk.3.attn_compressor_ape.weight", "output_hc_fn.weight", "blk.0.hc_ffn_scale.weight"):
        with pytest.raises(GGUFError, match=f"deepseek4 GGUF is missing tensor '{drop}'"):
            check_tensors(v4_cfg.manifest, v4_cfg, [(n, d) for n, d in tensors.items() if n != drop])
    # a ratio-128 block has no indexer; a ratio-0 block no compressor
    for extra in ("blk.3.indexer.proj.weight", "blk.0.attn_compressor_kv.weight"):
        with pytest.raises(GGUFError, match=f"deepseek4 GGUF has unexpected tensor '{extra}'"):
            check_tensors(v4_cfg.manifest, v4_cfg, list(tensors.items()) + [(extra, (64, 16))])
    # the ratio-4 compressor is two heads wide, the ratio-128 one a head
    with pytest.raises(GGUFError, match=r"'blk.2.attn_compressor_kv.weight' has shape \[64, 128\], expected "
                                        r"\[64, 256\] \(n_embd, dsv4.comp_csa\)"):
        check_tensors(v4_cfg.manifest, v4_cfg, dict(tensors, **{"blk.2.attn_compressor_kv.weight": (64, 128)}).items())


def test_engine_refuses_to_run_it_naming_what_is_missing(v4_path):
    eng = GgmlEngine()
    out = eng.load(LoadSpec(str(v4_path), ArtifactId("", LayerRange(0, 4))))
    assert out.status is Status.INVALID_ARGUMENT
    assert out.message.startswith("deepseek4 is not run by this engine yet") and "\n" not in out.message
    assert "compressed KV caches" in out.message
