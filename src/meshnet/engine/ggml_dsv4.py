"""DeepSeek-V4 (``deepseek4``) blocks on ggml's own ops: hyper-connections and the block around attention.

Mirrors ``llama_model_deepseek4::graph`` (llama.cpp src/models/deepseek4.cpp) in its unfused form
(``build_hc_pre`` / ``build_hc_sinkhorn`` / ``build_hc_post`` / ``build_hc_head``): ggml-python 0.0.45 has
no ``ggml_dsv4_hc_pre`` / ``_comb`` / ``_post``, so the same arithmetic is composed from ``mul_mat``,
``sigmoid``, ``soft_max``, ``sum_rows`` and ``div`` (the fused kernels may round the last bit
differently).

The residual of a token is ``n_hc`` streams of n_embd (ggml ``[n_embd, n_hc, n_tokens]``). Before attention
and before the FFN a learned mix collapses them into one input: per token, ``mixes = hc_fn ·
rms_norm(all streams)`` gives ``n_hc`` pre-weights (sigmoid, + eps), ``n_hc`` post-weights (2 · sigmoid)
and an ``n_hc × n_hc`` stream-mixing matrix (softmax, then Sinkhorn-normalised for
``sinkhorn_iters`` rounds). The block output is written back into every stream: ``out[d] = post[d] · y +
Σ_s comb[d, s] · residual[s]``. The tail collapses the streams once more (``output_hc_*``) before
``output_norm``.

Shapes are in ggml order.
"""

from __future__ import annotations

import ggml
import gguf

from meshnet.engine.ggml_dsv4_attn import dsv4_attention
from meshnet.engine.ggml_moe import build_moe_ffn, swiglu

T = gguf.MODEL_TENSOR


def _affine(ctx, x, scale, base):
    """dsv4_hc_affine: ``x · scale + base`` (scale broadcast, base per column)."""
    return ggml.ggml_add(ctx, ggml.ggml_mul(ctx, x, scale), base)


def _view_1d(ctx, t, n: int, i0: int):
    return ggml.ggml_view_1d(ctx, t, n, i0 * 4)


def _view_cols(ctx, t, n: int, nt: int, i0: int):
    """``t`` ``[*, nt]``: columns ``[i0, i0 + n)`` of every row (a view)."""
    return ggml.ggml_view_2d(ctx, t, n, nt, t.contents.nb[1], i0 * 4)


def hc_weighted_sum(ctx, x, weights, n_hc: int):
    """``Σ_h weights[h] · x[:, h]``: ``x`` ``[n_embd, n_hc, nt]``, ``weights`` ``[n_hc, nt]`` ->
    ``[n_embd, nt]`` (build_hc_pre's sum, streams added in order)."""
    n_embd, nt = int(x.contents.ne[0]), int(x.contents.ne[2])
    out = None
    for h in range(n_hc):
        xh = ggml.ggml_view_2d(ctx, x, n_embd, nt, x.contents.nb[2], h * x.contents.nb[1])
        wh = ggml.ggml_view_2d(ctx, weights, 1, nt, weights.contents.nb[1], h * weights.contents.nb[0])
        cur = ggml.ggml_mul(ctx, xh, wh)
        out = cur if out is None else ggml.ggml_add(ctx, out, cur)
    return out


def _mixes(g, x, fn):
    """``fn · rms_norm(flat streams)``: ``x`` ``[n_embd, n_hc, nt]`` -> ``[fn rows, nt]``."""
    ctx = g.ctx
    nt = int(x.contents.ne[2])
    flat = ggml.ggml_reshape_2d(ctx, x, int(x.contents.ne[0]) * int(x.contents.ne[1]), nt)
    return ggml.ggml_mul_mat(ctx, fn, ggml.ggml_rms_norm(ctx, flat, g.cfg.rms_eps))


def sinkhorn(ctx, comb, eps: float, iters: int):
    """build_hc_sinkhorn: ``comb`` ``[n_hc (dst), n_hc (src), nt]`` -> softmax over dst, + eps, one column
    normalisation, then ``iters - 1`` rounds of row and column normalisation (each sum + eps)."""
    comb = ggml.ggml_scale_bias(ctx, ggml.ggml_soft_max(ctx, comb), 1.0, eps)

    def norm_cols(c):
        col = ggml.ggml_sum_rows(ctx, ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, c, 1, 0, 2, 3)))
        col = ggml.ggml_permute(ctx, ggml.ggml_scale_bias(ctx, col, 1.0, eps), 1, 0, 2, 3)
        return ggml.ggml_div(ctx, c, col)

    def norm_rows(c):
        return ggml.ggml_div(ctx, c, ggml.ggml_scale_bias(ctx, ggml.ggml_sum_rows(ctx, c), 1.0, eps))

    comb = norm_cols(comb)
    for _ in range(1, iters):
        comb = norm_cols(norm_rows(comb))
    return comb


def hc_pre(g, x, prefix: str, il: int):
    """build_hc_pre: the streams ``x`` ``[n_embd, n_hc, nt]`` -> (block input ``[n_embd, nt]``, post
    weights ``[n_hc, nt]``, mixing matrix ``[n_hc, n_hc, nt]``), with block ``il``'s ``{prefix}_fn /
    _scale / _base`` (prefix ``hc_attn`` or ``hc_ffn``)."""
    ctx, v4 = g.ctx, g.cfg.dsv4
    hc, nt = v4.n_hc, int(x.contents.ne[2])
    w = g._w.get
    fn, scale, base = (w(f"blk.{il}.{prefix}_{part}.weight") for part in ("fn", "scale", "base"))
    mixes = _mixes(g, x, fn)                                                     # [(2 + hc) * hc, nt]
    pre = _affine(ctx, _view_cols(ctx, mixes, hc, nt, 0), _view_1d(ctx, scale, 1, 0), _view_1d(ctx, base, hc, 0))
    pre = ggml.ggml_scale_bias(ctx, ggml.ggml_sigmoid(ctx, pre), 1.0, v4.hc_eps)
    post = _affine(ctx, _view_cols(ctx, mixes, hc, nt, hc), _view_1d(ctx, scale, 1, 1), _view_1d(ctx, base, hc, hc))
    post = ggml.ggml_scale(ctx, ggml.ggml_sigmoid(ctx, post), 2.0)
    comb = _affine(ctx, _view_cols(ctx, mixes, hc * hc, nt, 2 * hc), _view_1d(ctx, scale, 1, 2),
                   _view_1d(ctx, base, hc * hc, 2 * hc))
    comb = sinkhorn(ctx, ggml.ggml_reshape_3d(ctx, comb, hc, hc, nt), v4.hc_eps, v4.sinkhorn_iters)
    return hc_weighted_sum(ctx, x, pre, hc), post, comb


def hc_post(ctx, y, residual, post, comb):
    """build_hc_post: ``out[d] = y · post[d] + Σ_s residual[s] · comb[d, s]`` -> ``[n_embd, n_hc, nt]``
    (``y`` ``[n_embd, nt]``, ``residual`` ``[n_embd, n_hc, nt]``)."""
    n_embd, hc, nt = int(residual.contents.ne[0]), int(residual.contents.ne[1]), int(residual.contents.ne[2])
    rnb, cnb, pnb = residual.contents.nb, comb.contents.nb, post.contents.nb
    out = None
    for dst in range(hc):
        cur = ggml.ggml_mul(ctx, y, ggml.ggml_view_2d(ctx, post, 1, nt, pnb[1], dst * pnb[0]))
        for src in range(hc):
            res = ggml.ggml_view_2d(ctx, residual, n_embd, nt, rnb[2], src * rnb[1])
            c = ggml.ggml_view_2d(ctx, comb, 1, nt, cnb[2], dst * cnb[0] + src * cnb[1])
            cur = ggml.ggml_add(ctx, cur, ggml.ggml_mul(ctx, res, c))
        cur = ggml.ggml_reshape_3d(ctx, cur, n_embd, 1, nt)
        out = cur if out is None else ggml.ggml_concat(ctx, out, cur, 1)
    return out


def hc_expand(ctx, x, n_hc: int):
    """The head's residual: the embedding ``[n_embd, nt]`` copied into ``n_hc`` streams."""
    n_embd, nt = int(x.contents.ne[0]), int(x.contents.ne[1])
    return ggml.ggml_repeat_4d(ctx, ggml.ggml_reshape_3d(ctx, x, n_embd, 1, nt), n_embd, n_hc, nt, 1)


def hc_head(g, x):
    """build_hc_head: the streams ``[n_embd, n_hc, nt]`` -> ``[n_embd, nt]`` weighted by
    ``sigmoid(output_hc_fn · rms_norm(streams) · scale + base) + eps``."""
    ctx, v4, w = g.ctx, g.cfg.dsv4, g._w.get
    mixes = _mixes(g, x, w("output_hc_fn.weight"))                               # [n_hc, nt]
    pre = _affine(ctx, mixes, w("output_hc_scale.weight"), w("output_hc_base.weight"))
    pre = ggml.ggml_scale_bias(ctx, ggml.ggml_sigmoid(ctx, pre), 1.0, v4.hc_eps)
    return hc_weighted_sum(ctx, x, pre, v4.n_hc)


def dsv4_ffn(g, il: int, cur):
    """Routed experts (sqrt-softplus scores; hash-routed by token id in the first ``hash_layer_count``
    blocks, else top-k of scores + ``exp_probs_b``), clamped SwiGLU, plus the shared expert (its own clamp):
    ``cur`` ``[n_embd, nt]`` after ``ffn_norm`` -> ``[n_embd, nt]``."""
    cfg, ctx, v4 = g.cfg, g.ctx, g.cfg.dsv4
    selected = None
    if v4.is_hash(il):
        selected = ggml.ggml_get_rows(ctx, g._w.get(f"blk.{il}.ffn_gate_tid2eid.weight"), g.inp.tokens)
    moe = build_moe_ffn(ctx, g.gf, cur, g._wt(T.FFN_GATE_INP, il), g._wt(T.FFN_UP_EXP, il),
                        g._wt(T.FFN_GATE_EXP, il), g._wt(T.FFN_DOWN_EXP, il), cfg.n_expert_used,
                        cfg.expert_weights_norm, cfg.expert_weights_scale, cfg.expert_gating_func,
                        None if selected is not None else g._wt(T.FFN_EXP_PROBS_B, il, "bias"),
                        selected=selected, swiglu_limit=v4.swiglu_clamp_exp[il])
    up = g._mm(T.FFN_UP_SHEXP, il, cur)
    gate = g._mm(T.FFN_GATE_SHEXP, il, cur)
    shexp = g._mm(T.FFN_DOWN_SHEXP, il, swiglu(ctx, gate, up, v4.swiglu_clamp_shexp[il]))
    return ggml.ggml_add(ctx, moe, shexp)


def dsv4_layer(g, il: int, x):
    """One V4 block on the streams ``x`` ``[n_embd, n_hc, nt]`` -> the same shape: hyper-connection mix,
    ``attn_norm``, V4 attention (:mod:`meshnet.engine.ggml_dsv4_attn`), written back into the streams;
    then the same around ``ffn_norm`` and the FFN (:func:`dsv4_ffn`)."""
    ctx = g.ctx
    cur, post, comb = hc_pre(g, x, "hc_attn", il)
    cur = g._norm(cur, T.ATTN_NORM, il)
    x = hc_post(ctx, dsv4_attention(g, il, cur), x, post, comb)
    cur, post, comb = hc_pre(g, x, "hc_ffn", il)
    cur = g._norm(cur, T.FFN_NORM, il)
    return hc_post(ctx, dsv4_ffn(g, il, cur), x, post, comb)


def dsv4_graph_nodes(n_hc: int, sinkhorn_iters: int) -> int:
    """Graph nodes one V4 block adds, with room to spare: two mixes (Sinkhorn ~10 per round, the
    weighted sum and write-back ~4 per stream pair), attention with its compressor and indexer (~200)."""
    per_mix = 40 + 10 * sinkhorn_iters + 6 * n_hc * (n_hc + 2)
    return 2 * per_mix + 320
