"""The per-architecture tensor tables, as plain data and on the golden models."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import pytest

from conftest import GOLDEN_DIR
from meshnet.model.arch_manifest import MANIFESTS, check_tensors, manifest_for
from meshnet.model.gguf_file import GGUFError, open_gguf
from meshnet.model.hparams import ModelConfig

# A two-layer qwen3moe: 4 query heads of 8, 2 KV heads, 4 experts of 16, 2 used, 10 tokens.
CFG = SimpleNamespace(n_layer=2, n_embd=32, n_embd_q=32, n_embd_o=32, n_embd_k_gqa=16, n_embd_v_gqa=16,
                      head_dim=8, n_ff=0, n_expert=4, n_ff_exp=16, n_vocab=10)


def _qwen3moe_tensors() -> dict[str, tuple[int, ...]]:
    m = manifest_for("qwen3moe")
    out = {s.name(): tuple(getattr(CFG, d) for d in s.shape) if s.shape else (CFG.n_embd, CFG.n_vocab)
           for s in m.global_tensors}
    for il in range(CFG.n_layer):
        out.update({s.name(il): tuple(getattr(CFG, d) for d in s.shape)
                    for s in m.layer_tensors if s.required})
    return out


def test_every_manifest_tensor_is_one_gguf_lists_for_the_architecture():
    for m in MANIFESTS.values():
        if m.gguf_arch is None:
            continue  # deepseek4: gguf 0.19.0 has no table; its names are llama-arch.cpp's (tested below)
        assert gguf.MODEL_ARCH_NAMES[m.gguf_arch] == m.name
        allowed = set(gguf.MODEL_TENSORS[m.gguf_arch])
        for s in m.layer_tensors + m.global_tensors:
            assert s.kind in allowed, f"{m.name}: {s.kind.name}"


def test_a_fitting_file_passes_and_optional_tensors_may_be_absent():
    tensors = _qwen3moe_tensors()
    assert "blk.0.attn_q.bias" not in tensors and "output.weight" in tensors
    check_tensors(manifest_for("qwen3moe"), CFG, tensors.items())
    del tensors["output.weight"]  # tied: the tail projects with token_embd
    check_tensors(manifest_for("qwen3moe"), CFG, tensors.items())


def test_missing_unexpected_and_misshaped_tensors_are_named():
    m = manifest_for("qwen3moe")
    tensors = _qwen3moe_tensors()
    with pytest.raises(GGUFError, match="qwen3moe GGUF is missing tensor 'blk.1.ffn_down_exps.weight'"):
        check_tensors(m, CFG, [(n, d) for n, d in tensors.items() if n != "blk.1.ffn_down_exps.weight"])
    # A dense FFN in an MoE file, or a layer past block_count, is not silently ignored.
    for extra in ("blk.0.ffn_gate.weight", "blk.2.attn_norm.weight", "rope_freqs.weight"):
        with pytest.raises(GGUFError, match=f"qwen3moe GGUF has unexpected tensor '{extra}'"):
            check_tensors(m, CFG, list(tensors.items()) + [(extra, (32,))])
    bad = dict(tensors, **{"blk.0.ffn_up_exps.weight": (32, 16, 3)})
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_up_exps.weight' has shape \[32, 16, 3\], expected "
                                        r"\[32, 16, 4\] \(n_embd, n_ff_exp, n_expert\)"):
        check_tensors(m, CFG, bad.items())


# A two-layer deepseek2 with one leading dense block: 2 heads, MLA latent 16 + rope 4, nope 8, v 8.
DS2 = SimpleNamespace(n_layer=2, n_embd=32, n_lora_q=0, n_lora_kv=16, n_embd_k_cache=20, n_head=2,
                      n_embd_head_qk_nope=8, n_embd_head_v_mla=8, n_embd_q_mla=24, n_embd_o_mla=16, n_ff=48,
                      n_expert=4, n_ff_exp=8, n_ff_shexp=8, n_vocab=10, n_layer_dense_lead=1,
                      has_q_lora=False, no_q_lora=True)


def _deepseek2_tensors(cfg) -> dict[str, tuple[int, ...]]:
    m = manifest_for("deepseek2")
    out = {s.name(): (cfg.n_embd, cfg.n_vocab) if s.shape is None else tuple(getattr(cfg, d) for d in s.shape)
           for s in m.global_tensors}
    for il in range(cfg.n_layer):
        out.update({s.name(il): tuple(getattr(cfg, d) for d in s.shape)
                    for s in m.layer_tensors if s.required and s.applies(cfg, il)})
    return out


def test_deepseek2_blocks_and_q_lora_choose_their_tensors():
    m = manifest_for("deepseek2")
    plain = _deepseek2_tensors(DS2)
    # without q-LoRA a plain attn_q; the leading block a dense FFN, the next experts and a shared expert
    assert "blk.0.attn_q.weight" in plain and "blk.0.attn_q_a.weight" not in plain
    assert "blk.0.ffn_up.weight" in plain and "blk.0.ffn_up_exps.weight" not in plain
    assert "blk.1.ffn_up_exps.weight" in plain and "blk.1.ffn_up_shexp.weight" in plain
    assert "blk.1.ffn_up.weight" not in plain
    check_tensors(m, DS2, plain.items())
    check_tensors(m, DS2, list(plain.items()) + [("blk.1.exp_probs_b.bias", (4,))])  # optional
    lora = SimpleNamespace(**{**vars(DS2), "n_lora_q": 12, "has_q_lora": True, "no_q_lora": False})
    tensors = _deepseek2_tensors(lora)
    assert tensors["blk.1.attn_q_b.weight"] == (12, 24) and "blk.1.attn_q.weight" not in tensors
    check_tensors(m, lora, tensors.items())
    with pytest.raises(GGUFError, match="deepseek2 GGUF has unexpected tensor 'blk.0.attn_q.weight'"):
        check_tensors(m, lora, list(tensors.items()) + [("blk.0.attn_q.weight", (32, 24))])
    # the legacy unsplit attn_kv_b is not read by the absorbed graph
    with pytest.raises(GGUFError, match="deepseek2 GGUF has unexpected tensor 'blk.0.attn_kv_b.weight'"):
        check_tensors(m, DS2, list(plain.items()) + [("blk.0.attn_kv_b.weight", (16, 32))])
    with pytest.raises(GGUFError, match=r"'blk.1.attn_k_b.weight' has shape \[8, 16, 3\], expected \[8, 16, 2\] "
                                        r"\(n_embd_head_qk_nope, n_lora_kv, n_head\)"):
        check_tensors(m, DS2, dict(plain, **{"blk.1.attn_k_b.weight": (8, 16, 3)}).items())


def test_unknown_architectures_are_refused_with_the_supported_list():
    with pytest.raises(GGUFError, match="unsupported architecture 'mamba'; supported: deepseek2, deepseek4, "
                                        "gemma3, llama, phi3, qwen2, qwen3, qwen3moe"):
        manifest_for("mamba")


@pytest.mark.parametrize("folder", ["models", "models-moe"])
def test_the_golden_models_fit_their_manifests(folder):
    paths = sorted((GOLDEN_DIR / folder).glob("*.gguf"))
    if not paths:
        pytest.skip(f"no models in {GOLDEN_DIR / folder}")
    for path in paths:
        arch = open_gguf(path).get_field(gguf.Keys.General.ARCHITECTURE).contents()
        cfg = ModelConfig.from_reader(open_gguf(path))  # runs check_tensors
        assert cfg.manifest.name == arch


def test_deepseek2_nextn_block_is_declared_after_the_trunk():
    """A file with one MTP block: blk.{n_layer} is a whole MoE block plus nextn.eh_proj/enorm/hnorm (the
    embed_tokens and shared_head tensors optional); without nextn_predict_layers it is unexpected."""
    m = manifest_for("deepseek2")
    mtp = SimpleNamespace(**{**vars(DS2), "n_nextn": 1, "n_embd_2": 64})
    trunk = _deepseek2_tensors(DS2)
    block = {k.replace("blk.1.", "blk.2."): v for k, v in trunk.items() if k.startswith("blk.1.")}
    nextn = {"blk.2.nextn.eh_proj.weight": (64, 32), "blk.2.nextn.enorm.weight": (32,),
             "blk.2.nextn.hnorm.weight": (32,)}
    check_tensors(m, mtp, {**trunk, **block, **nextn}.items())
    check_tensors(m, mtp, {**trunk, **block, **nextn, "blk.2.nextn.shared_head_norm.weight": (32,)}.items())
    with pytest.raises(GGUFError, match="deepseek2 GGUF is missing tensor 'blk.2.nextn.hnorm.weight'"):
        check_tensors(m, mtp, {**trunk, **block, **dict(list(nextn.items())[:2])}.items())
    with pytest.raises(GGUFError, match="deepseek2 GGUF has unexpected tensor 'blk.2."):
        check_tensors(m, DS2, {**trunk, **block, **nextn}.items())
