"""The transformer block of each architecture, built on a :class:`~meshnet.engine.ggml_graph.StepGraph`.

Mirrors llama.cpp's per-model graphs (src/models/*.cpp, ``llm_build_llama``, ``llm_build_qwen2``,
``llm_build_qwen3``, ``llm_build_qwen3moe``, ``llm_build_phi3``, ``llm_build_gemma3_iswa``,
``llama_model_deepseek2::graph``) and its ``build_ffn`` (fused SwiGLU / GeGLU) and ``build_moe_ffn``
(routed experts, in ``ggml_moe``). Each ``layer_<name>(g, il, x)`` adds block ``il`` to the graph ``g`` is
building, from ``x`` ``[n_embd, n]`` (DeepSeek-V4: its streams), through the graph's shared pieces (its
norm, projections, RoPE and KV-cache attention); :data:`LAYERS` picks one by the architecture manifest's
``layer``.
"""

from __future__ import annotations

from typing import Callable

import ggml
import gguf

from meshnet.engine.ggml_dsv4 import dsv4_layer
from meshnet.engine.ggml_mla import mla_decompress, mla_qkv
from meshnet.engine.ggml_moe import build_moe_ffn

T = gguf.MODEL_TENSOR


def attn_llama(g, il: int, x):
    """The attention block of llama / qwen2 (q/k/v biases) / qwen3 and qwen3moe (per-head q/k RMS
    norm): ``x`` ``[n_embd, n]`` -> (attention output, residual), both ``[n_embd, n_out]`` (fewer rows
    on the model's last layer, see
    :meth:`~meshnet.engine.ggml_graph.StepGraph._select_out_rows`)."""
    cfg, ctx, n = g.cfg, g.ctx, g.n_tokens
    cur = g._norm(x, T.ATTN_NORM, il)                                     # [n_embd, n]
    q = ggml.ggml_reshape_3d(ctx, g._mm(T.ATTN_Q, il, cur), cfg.head_dim, cfg.n_head, n)
    k = ggml.ggml_reshape_3d(ctx, g._mm(T.ATTN_K, il, cur), cfg.head_dim, cfg.n_head_kv, n)
    v = ggml.ggml_reshape_3d(ctx, g._mm(T.ATTN_V, il, cur), cfg.head_dim_v, cfg.n_head_kv, n)
    if g._wt(T.ATTN_Q_NORM, il) is not None:
        q = g._norm(q, T.ATTN_Q_NORM, il)
        k = g._norm(k, T.ATTN_K_NORM, il)
    q, k = g._rope(q, il), g._rope(k, il)
    cur = g._mm(T.ATTN_OUT, il, g._attn(il, q, k, v, cfg.attn_scale))  # [n_embd, n]
    return g._select_out_rows(il, cur, x)


def ffn(g, il: int, cur):
    """The FFN of the architecture's manifest on ``cur`` ``[n_embd, n]`` (after ``ffn_norm``):
    llama.cpp's build_ffn (SwiGLU on ffn_gate/up/down; also deepseek2's leading dense blocks) or
    build_moe_ffn (routed experts), plus the shared experts' SwiGLU FFN where the file has them."""
    cfg, ctx = g.cfg, g.ctx
    if cfg.manifest.is_moe and il >= cfg.n_layer_dense_lead:
        out = build_moe_ffn(ctx, g.gf, cur, g._wt(T.FFN_GATE_INP, il), g._wt(T.FFN_UP_EXP, il),
                            g._wt(T.FFN_GATE_EXP, il), g._wt(T.FFN_DOWN_EXP, il), cfg.n_expert_used,
                            cfg.expert_weights_norm, cfg.expert_weights_scale, cfg.expert_gating_func,
                            g._wt(T.FFN_EXP_PROBS_B, il, "bias"), cfg.n_expert_groups, cfg.n_group_used)
        if cfg.n_expert_shared:
            out = ggml.ggml_add(ctx, out, swiglu_ffn(g, il, cur, T.FFN_UP_SHEXP, T.FFN_GATE_SHEXP,
                                                     T.FFN_DOWN_SHEXP))
        return out
    return swiglu_ffn(g, il, cur, T.FFN_UP, T.FFN_GATE, T.FFN_DOWN)


def swiglu_ffn(g, il: int, cur, up_kind: T, gate_kind: T, down_kind: T):
    """build_ffn(LLM_FFN_SILU, LLM_FFN_PAR): down(SiLU(gate(x)) * up(x)), ``[n_embd, n]``."""
    up = g._mm(up_kind, il, cur)                                          # [n_ff, n]
    gate = g._mm(gate_kind, il, cur)
    return g._mm(down_kind, il, ggml.ggml_swiglu_split(g.ctx, gate, up))


def layer_llama(g, il: int, x):
    """llama / qwen2 / qwen3 / qwen3moe: attention (:func:`attn_llama`), then the dense or MoE
    FFN (:func:`ffn`), each added to the residual."""
    cur, x = attn_llama(g, il, x)
    ffn_inp = ggml.ggml_add(g.ctx, cur, x)
    cur = ffn(g, il, g._norm(ffn_inp, T.FFN_NORM, il))
    return ggml.ggml_add(g.ctx, cur, ffn_inp)


def layer_deepseek2(g, il: int, x):
    """deepseek2 (DeepSeek-V2/V3): multi-head latent attention in the absorbed form (``ggml_mla``;
    the cache holds the latent + rope row, V is a view of it), then a dense FFN in the leading
    blocks, routed plus shared experts in the others, each added to the residual."""
    cfg, ctx = g.cfg, g.ctx
    cur = g._norm(x, T.ATTN_NORM, il)                                     # [n_embd, n]
    q, k, v = mla_qkv(g, il, cur)
    cur = g._attn(il, q, k, v, cfg.attn_scale, v_in_k=True)               # [kv_lora_rank * n_head, n]
    cur = mla_decompress(ctx, cur, g._wt(T.ATTN_V_B, il), cfg.n_head)     # [head_v * n_head, n]
    cur = g._mm(T.ATTN_OUT, il, cur)                                      # [n_embd, n]
    cur, x = g._select_out_rows(il, cur, x)
    ffn_inp = ggml.ggml_add(ctx, cur, x)
    cur = ffn(g, il, g._norm(ffn_inp, T.FFN_NORM, il))
    return ggml.ggml_add(ctx, cur, ffn_inp)


def layer_deepseek4(g, il: int, x):
    """deepseek4 (DeepSeek-V4): hyper-connection streams around V4 attention and the routed FFN
    (:mod:`meshnet.engine.ggml_dsv4`); the streams ``[n_embd, n_hc, n]`` in and out."""
    return dsv4_layer(g, il, x)


def layer_phi3(g, il: int, x):
    """phi3: fused attn_qkv rows [Q; K; V], Q pre-scaled, fused ffn_up rows [gate; up]."""
    cfg, ctx, n = g.cfg, g.ctx, g.n_tokens
    cur = g._norm(x, T.ATTN_NORM, il)
    qkv = g._mm(T.ATTN_QKV, il, cur)                                      # [n_embd + 2*n_embd_gqa, n]
    f4 = 4  # sizeof(float)
    nb1 = qkv.contents.nb[1]
    q = ggml.ggml_view_3d(ctx, qkv, cfg.head_dim, cfg.n_head, n, cfg.head_dim * f4, nb1, 0)
    k = ggml.ggml_view_3d(ctx, qkv, cfg.head_dim, cfg.n_head_kv, n, cfg.head_dim * f4, nb1,
                          f4 * cfg.head_dim * cfg.n_head)
    v = ggml.ggml_view_3d(ctx, qkv, cfg.head_dim, cfg.n_head_kv, n, cfg.head_dim * f4, nb1,
                          f4 * (cfg.head_dim * cfg.n_head + cfg.n_embd_k_gqa))
    q, k = g._rope(q, il), g._rope(k, il)
    q = ggml.ggml_scale(ctx, q, cfg.attn_scale)
    cur = g._mm(T.ATTN_OUT, il, g._attn(il, q, k, v, 1.0))
    cur, x = g._select_out_rows(il, cur, x)
    residual = ggml.ggml_add(ctx, cur, x)
    cur = g._norm(residual, T.FFN_NORM, il)
    cur = ggml.ggml_swiglu(ctx, g._mm(T.FFN_UP, il, cur))                 # [n_ff, n]
    cur = g._mm(T.FFN_DOWN, il, cur)
    return ggml.ggml_add(ctx, residual, cur)


def layer_gemma3(g, il: int, x):
    """gemma3: q/k RMS norm, Q pre-scaled, post-attention and post-FFN norms, GeGLU(tanh)."""
    cfg, ctx, n = g.cfg, g.ctx, g.n_tokens
    cur = g._norm(x, T.ATTN_NORM, il)
    q = ggml.ggml_reshape_3d(ctx, g._mm(T.ATTN_Q, il, cur), cfg.head_dim, cfg.n_head, n)
    k = ggml.ggml_reshape_3d(ctx, g._mm(T.ATTN_K, il, cur), cfg.head_dim, cfg.n_head_kv, n)
    v = ggml.ggml_reshape_3d(ctx, g._mm(T.ATTN_V, il, cur), cfg.head_dim_v, cfg.n_head_kv, n)
    q = g._rope(g._norm(q, T.ATTN_Q_NORM, il), il)
    k = g._rope(g._norm(k, T.ATTN_K_NORM, il), il)
    q = ggml.ggml_scale(ctx, q, cfg.attn_scale)
    cur = g._mm(T.ATTN_OUT, il, g._attn(il, q, k, v, 1.0))
    cur, x = g._select_out_rows(il, cur, x)
    cur = g._norm(cur, T.ATTN_POST_NORM, il)
    sa_out = ggml.ggml_add(ctx, cur, x)
    cur = g._norm(sa_out, T.FFN_NORM, il)
    up = g._mm(T.FFN_UP, il, cur)
    gate = g._mm(T.FFN_GATE, il, cur)
    cur = g._mm(T.FFN_DOWN, il, ggml.ggml_geglu_split(ctx, gate, up))
    cur = g._norm(cur, T.FFN_POST_NORM, il)
    return ggml.ggml_add(ctx, cur, sa_out)


# ``ArchManifest.layer`` -> the function that builds one block of that architecture.
LAYERS: dict[str, Callable] = {
    "llama": layer_llama,
    "deepseek2": layer_deepseek2,
    "deepseek4": layer_deepseek4,
    "phi3": layer_phi3,
    "gemma3": layer_gemma3,
}
