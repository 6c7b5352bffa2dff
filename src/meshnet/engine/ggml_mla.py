"""Multi-head latent attention (DeepSeek-V2/V3) on ggml's own ops, in llama.cpp's absorbed form.

Mirrors the MLA branch of ``llama_model_deepseek2::graph`` (src/models/deepseek2.cpp) and the ``v_mla``
step of ``llm_graph_context::build_attn_mha`` (src/llama-graph.cpp). The keys and values of all heads
come from one compressed latent per token (``kv_lora_rank`` values, RMS-normed) plus one rope part shared
by the heads (``n_rot`` values). The queries are multiplied into the latent space by ``attn_k_b`` instead
of decompressing the keys, so attention is multi-query with a single KV head of ``kv_lora_rank + n_rot``
values: that latent + rope row is all the KV cache holds per token and layer, and V is its first
``kv_lora_rank`` values (a view, not a second tensor). The attention output, still in latent space, is
decompressed per head by ``attn_v_b`` before ``attn_output``.

Shapes are in ggml order: ``[n_embd, n_tokens]`` is n_tokens rows of n_embd floats.
"""

from __future__ import annotations

import ggml
import gguf

T = gguf.MODEL_TENSOR
F32_BYTES = 4


def mla_qkv(g, il: int, cur):
    """The queries, keys and values of one MLA layer, ready for the cache and flash attention.

    Args:
        g: the :class:`~meshnet.engine.ggml_graph.StepGraph` being built (its context, weights, norm,
            mat-mul and rope helpers).
        cur: F32 ``[n_embd, n]``, the layer input after ``attn_norm``.
    Returns:
        ``(q, k, v)``: q F32 ``[kv_lora_rank + n_rot, n_head, n]`` (the absorbed nope part, then the
        roped part), k F32 ``[kv_lora_rank + n_rot, 1, n]`` (the normed latent, then the roped shared
        part: what the cache stores), v ``[kv_lora_rank, 1, n]`` (the latent; stored as part of k).
    """
    cfg, ctx, n = g.cfg, g.ctx, g.n_tokens
    kvl, n_rot, n_head = cfg.n_lora_kv, cfg.n_rot, cfg.n_head
    nope, head_k = cfg.n_embd_head_qk_nope, cfg.n_embd_head_k_mla
    if cfg.has_q_lora:
        q = ggml.ggml_mul_mat(ctx, g._wt(T.ATTN_Q_A, il), cur)                 # [n_lora_q, n]
        q = g._norm(q, T.ATTN_Q_A_NORM, il)
        q = ggml.ggml_mul_mat(ctx, g._wt(T.ATTN_Q_B, il), q)                   # [head_k * n_head, n]
    else:
        q = g._mm(T.ATTN_Q, il, cur)
    q = ggml.ggml_reshape_3d(ctx, q, head_k, n_head, n)                        # [head_k, n_head, n]

    kv_cmpr_pe = ggml.ggml_mul_mat(ctx, g._wt(T.ATTN_KV_A_MQA, il), cur)       # [kvl + n_rot, n]
    row = kv_cmpr_pe.contents.nb[1]
    kv_cmpr = ggml.ggml_view_2d(ctx, kv_cmpr_pe, kvl, n, row, 0)               # [kvl, n]
    k_pe = ggml.ggml_view_3d(ctx, kv_cmpr_pe, n_rot, 1, n, row, row, kvl * F32_BYTES)  # [n_rot, 1, n]
    k_pe = g._rope(k_pe, il)
    kv_cmpr = g._norm(kv_cmpr, T.ATTN_KV_A_NORM, il)

    q_nope = ggml.ggml_view_3d(ctx, q, nope, n_head, n, q.contents.nb[1], q.contents.nb[2], 0)
    q_pe = ggml.ggml_view_3d(ctx, q, n_rot, n_head, n, q.contents.nb[1], q.contents.nb[2], nope * F32_BYTES)
    q_pe = g._rope(q_pe, il)                                                   # [n_rot, n_head, n]
    q_nope = ggml.ggml_permute(ctx, q_nope, 0, 2, 1, 3)                        # [nope, n, n_head]
    # attn_k_b [nope, kvl, n_head] x [nope, n, n_head] -> [kvl, n, n_head]
    q_absorbed = ggml.ggml_mul_mat(ctx, g._wt(T.ATTN_K_B, il), q_nope)
    q_absorbed = ggml.ggml_permute(ctx, q_absorbed, 0, 2, 1, 3)                # [kvl, n_head, n]
    q_cur = ggml.ggml_concat(ctx, q_absorbed, q_pe, 0)                         # [kvl + n_rot, n_head, n]

    kv_cmpr = ggml.ggml_reshape_3d(ctx, kv_cmpr, kvl, 1, n)
    k_cur = ggml.ggml_concat(ctx, kv_cmpr, k_pe, 0)                            # [kvl + n_rot, 1, n]
    return q_cur, k_cur, kv_cmpr


def mla_decompress(ctx, attn, v_b, n_head: int):
    """Attention output from latent space to the heads' values (build_attn_mha's ``v_mla`` step).

    Args:
        attn: F32 ``[kv_lora_rank * n_head, n]``, flash attention's output over the latent V.
        v_b: ``attn_v_b``, ``[kv_lora_rank, n_embd_head_v_mla, n_head]`` in its stored type.
    Returns:
        F32 ``[n_embd_head_v_mla * n_head, n]``, the input of ``attn_output``.
    """
    kvl, n = int(v_b.contents.ne[0]), int(attn.contents.ne[1])
    cur = ggml.ggml_reshape_3d(ctx, attn, kvl, n_head, n)
    cur = ggml.ggml_permute(ctx, cur, 0, 2, 1, 3)                              # [kvl, n, n_head]
    cur = ggml.ggml_mul_mat(ctx, v_b, cur)                                     # [head_v, n, n_head]
    cur = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, cur, 0, 2, 1, 3))         # [head_v, n_head, n]
    return ggml.ggml_reshape_2d(ctx, cur, int(cur.contents.ne[0]) * n_head, n)
