"""DeepSeek-V4 attention on ggml's own ops: one shared K=V head, sinks, partial rope, sliding window, and
the compressed caches of ratio-4 (CSA, read through the lightning indexer) and ratio-128 (HCA) blocks.

Mirrors ``llama_model_deepseek4::graph::build_attention_impl`` and its helpers (llama.cpp
src/models/deepseek4.cpp): q = rms_norm(``attn_q_b``(norm(``attn_q_a`` x))) per head, kv =
norm(``attn_kv`` x), both roped on their last ``n_rot`` dims only (``ggml_rope_set_offset``, which
ggml-python 0.0.45 lacks: here the rope runs on a view of those dims and is concatenated back); the raw
cache holds kv (F16) per token and serves as K and V; flash attention with ``attn_sinks`` in the softmax
over the window (``sliding_window`` tokens) plus, on compressed blocks, the compressed rows; the output is
de-roped (``ggml_rope_ext_back``) and projected by the grouped low-rank ``attn_output_a`` /
``attn_output_b``.

Compressed blocks (``build_*_compressed_kv_from_state``): every token stores its compressor state (kv and
gate-score rows, the score plus ``ape[pos % ratio]``) in per-token F32 cells; the token that completes a
block of ``ratio`` tokens pools it (softmax of the scores over the block's rows, per dim; CSA blocks
overlap: the previous block's first half and this block's second half), RMS-norms and ropes it (at the
block's first position, with ``compress_rope_freq_base`` and YaRN), and writes one F16 row of the
compressed cache. Every row of a step computes the pooled row of the block it is in; rows that complete no
block write to a scratch row past the slots, so the graph's shape does not depend on positions. CSA
blocks run the same for the indexer's keys; the indexer scores each visible compressed row per query
(Σ_h w_h · relu(q_h · k)), and attention sees the top ``indexer_top_k`` of them.

All this state lives in the stage's :class:`~meshnet.engine.kv_pool.KVPool` beside the KV cells (cells
by position, compressed rows by block), so it follows a session's cells through open, prefix reuse,
rollback, release and replay. Decode rows are attended as one-row segments (no multi-stream group).

Shapes are in ggml order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import ggml
import gguf
import numpy as np

from meshnet.engine.batch_layout import MASK_ROW_PAD, build_mask, pad_to
from meshnet.engine.ggml_backend import new_tensor, set_tensor
from meshnet.engine.kv_pool import AuxCache, rows_per_slot
from meshnet.model.dsv4_params import CSA_RATIO
from meshnet.model.rope_scaling import YARN_BETA_FAST, YARN_BETA_SLOW

T = gguf.MODEL_TENSOR
F32 = 4


def aux_caches(cfg, layers) -> dict[int, tuple[AuxCache, ...]]:
    """The V4 state a stage's pool holds beside the KV cells, per compressed block of ``layers``: the
    compressor's per-token kv and score cells (F32, 2 heads wide on CSA blocks), its compressed rows
    (F16, one per ``ratio`` tokens), and on CSA blocks the same for the indexer."""
    v4 = cfg.dsv4
    out = {}
    for il in range(layers.start, layers.end):
        r = v4.ratio(il) if il < cfg.n_layer else 0
        if not r:
            continue
        coff = 2 if r == CSA_RATIO else 1
        caches = [AuxCache("state_kv", ggml.GGML_TYPE_F32, coff * cfg.head_dim, 1),
                  AuxCache("state_score", ggml.GGML_TYPE_F32, coff * cfg.head_dim, 1),
                  AuxCache("comp", ggml.GGML_TYPE_F16, cfg.head_dim, r)]
        if r == CSA_RATIO:
            d = v4.indexer_head_dim
            caches += [AuxCache("lid_state_kv", ggml.GGML_TYPE_F32, 2 * d, 1),
                       AuxCache("lid_state_score", ggml.GGML_TYPE_F32, 2 * d, 1),
                       AuxCache("lid", ggml.GGML_TYPE_F16, d, r)]
        out[il] = tuple(caches)
    return out


@dataclass
class RatioInputs:
    """Per-row inputs of the compressors of one ratio (shared by CSA's attention and indexer)."""

    ape: object       # I32 [n]: pos % ratio
    read: object      # I32 [coff * ratio * n]: the state cells each row's block pools
    mask: object      # F32 [2 * ratio, 1, n] (CSA): -inf on the previous block's rows of block 0
    write: object     # I64 [n]: the compressed row each row completes, else the scratch row
    pos: object       # I32 [n]: the block's first position (its rope position)
    vis: list = field(default_factory=list)  # per segment F32 [n_blocks, n_seg]: 0 visible, -inf not


@dataclass
class Dsv4Inputs:
    raw: list                      # per segment F32 [n_kv, n_seg]: window mask
    ratios: dict[int, RatioInputs]

    def tensors(self) -> list:
        out = list(self.raw)
        for r in self.ratios.values():
            out += [t for t in (r.ape, r.read, r.mask, r.write, r.pos) if t is not None] + r.vis
        return out


def n_blocks(n_kv: int, ratio: int, n_ctx: int) -> int:
    """Compressed rows a segment reading ``n_kv`` raw cells attends over (masked past the visible)."""
    return max(1, min(rows_per_slot(n_ctx, ratio), -(-n_kv // ratio)))


def make_inputs(g) -> Dsv4Inputs:
    """The V4 inputs of a step graph ``g`` (its shape's segments; no decode group)."""
    n, cfg = g.n_tokens, g.cfg

    def inp(gtype, shape):
        t = new_tensor(g.ctx, gtype, shape)
        ggml.ggml_set_input(t)
        return t

    raw = [inp(ggml.GGML_TYPE_F32, (n_kv, n_seg)) for _, n_seg, n_kv, _ in g.shape.segments]
    ratios = {}
    for il in range(g.layers.start, g.layers.end):
        r = cfg.dsv4.ratio(il)
        if r and r not in ratios:
            coff = 2 if r == CSA_RATIO else 1
            ratios[r] = RatioInputs(
                inp(ggml.GGML_TYPE_I32, (n,)), inp(ggml.GGML_TYPE_I32, (coff * r * n,)),
                inp(ggml.GGML_TYPE_F32, (2 * r, 1, n)) if coff == 2 else None,
                inp(ggml.GGML_TYPE_I64, (n,)), inp(ggml.GGML_TYPE_I32, (n,)),
                [inp(ggml.GGML_TYPE_F32, (n_blocks(n_kv, r, g._pool.n_ctx), n_seg))
                 for _, n_seg, n_kv, _ in g.shape.segments])
    return Dsv4Inputs(raw, ratios)


def set_inputs(inputs: Dsv4Inputs, segments, n_swa: int, n_ctx: int, n_slots: int) -> None:
    """Fill the V4 inputs for ``segments`` (rows in segment order) over a pool of ``n_slots`` slots of
    ``n_ctx`` cells."""
    for t, seg in zip(inputs.raw, segments):
        pos = np.arange(seg.position, seg.position + seg.n_tokens, dtype=np.int32)
        set_tensor(t, build_mask(pos, seg.n_kv, n_swa)[:seg.n_tokens].astype(np.float32))
    for r, ri in inputs.ratios.items():
        bps = rows_per_slot(n_ctx, r)
        ape, prev, cur, mask, write, bpos = [], [], [], [], [], []
        for seg in segments:
            pos = np.arange(seg.position, seg.position + seg.n_tokens)
            b = pos // r
            base = seg.slot * n_ctx
            ape.append(pos % r)
            starts = b * r
            cur.append(base + np.minimum(starts[:, None] + np.arange(r)[None, :], n_ctx - 1))
            # block 0 has no previous block: its rows point at this block's and are masked out
            prev.append(np.where(b[:, None] > 0, base + starts[:, None] - r + np.arange(r)[None, :], cur[-1]))
            m = np.zeros((len(pos), 2 * r), np.float32)
            m[b == 0, :r] = -np.inf
            mask.append(m)
            done = (pos + 1) % r == 0
            write.append(np.where(done, seg.slot * bps + b, n_slots * bps))  # else the scratch row
            bpos.append(starts)
        set_tensor(ri.ape, np.concatenate(ape).astype(np.int32))
        cur_all = np.concatenate(cur).reshape(-1)
        read = np.concatenate([np.concatenate(prev).reshape(-1), cur_all]) if ri.mask is not None else cur_all
        set_tensor(ri.read, read.astype(np.int32))
        if ri.mask is not None:
            set_tensor(ri.mask, np.concatenate(mask).reshape(-1, 1, 2 * r))
        set_tensor(ri.write, np.concatenate(write).astype(np.int64))
        set_tensor(ri.pos, np.concatenate(bpos).astype(np.int32))
        for t, seg in zip(ri.vis, segments):
            pos = np.arange(seg.position, seg.position + seg.n_tokens)
            nb = int(t.contents.ne[0])
            vis = np.arange(nb)[None, :] < ((pos + 1) // r)[:, None]
            set_tensor(t, np.where(vis, 0.0, -np.inf).astype(np.float32))


# ---- graph -------------------------------------------------------------------------------------
def rope_params(cfg, compressed: bool) -> tuple:
    """``(n_ctx_orig, base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow)`` of a V4 rope:
    compressed blocks (and every compressor and the indexer) use ``compress_rope_freq_base`` with the
    file's YaRN, the others the plain base without scaling (build_attention_impl's ``*_l`` values)."""
    if not compressed:
        return 0, cfg.rope_freq_base, 1.0, 0.0, 1.0, 0.0, 0.0
    scale, ext = cfg.rope_freq_scale, cfg.rope_ext_factor
    # dsv4_rope_attn_factor, in float32: cancels ggml's own YaRN magnitude factor
    attn = float(np.float32(1.0) / (np.float32(1.0) + np.float32(0.1) * np.log(np.float32(1.0) / np.float32(scale)))) \
        if ext != 0.0 else 1.0
    return (cfg.n_ctx_orig_yarn or cfg.n_ctx_train, cfg.dsv4.compress_rope_base, scale, ext, attn,
            YARN_BETA_FAST, YARN_BETA_SLOW)


def rope_tail(g, x, pos, params: tuple, back: bool = False):
    """Rope (or with ``back`` un-rope) the last ``n_rot`` dims of every row of ``x`` ``[d, h, n]`` (NORM
    rope, adjacent pairs) at positions ``pos`` I32 ``[n]``; the first ``d - n_rot`` dims pass unchanged."""
    ctx, n_rot = g.ctx, g.cfg.n_rot
    d, h, n = (int(x.contents.ne[i]) for i in range(3))
    nb1, nb2 = x.contents.nb[1], x.contents.nb[2]
    nope = ggml.ggml_view_3d(ctx, x, d - n_rot, h, n, nb1, nb2, 0)
    pe = ggml.ggml_view_3d(ctx, x, n_rot, h, n, nb1, nb2, (d - n_rot) * F32)
    n_orig, base, scale, ext, attn, bf, bs = params
    op = ggml.ggml_rope_ext_back if back else ggml.ggml_rope_ext
    pe = op(ctx, pe, pos, None, n_rot, g.cfg.rope_type, n_orig, base, scale, ext, attn, bf, bs)
    return ggml.ggml_concat(ctx, nope, pe, 0)


def _compress(g, il: int, cur, pre: str, ri: RatioInputs, ratio: int, d: int, norm, cache):
    """One compressor (``{pre}_kv / _gate / _ape``) on ``cur`` ``[n_embd, n]``: store every row's state
    cells, pool the block each row is in (build_{overlap,hca}_compressed_kv_from_state), write the rows
    that complete a block into ``cache`` (F16 ``[d, rows]``). Returns the written cache (a view of it)."""
    ctx, w, pool = g.ctx, g._w.get, g._pool
    n = g.n_tokens
    kv = ggml.ggml_mul_mat(ctx, w(f"blk.{il}.{pre}_kv.weight"), cur)               # [coff * d, n]
    score = ggml.ggml_mul_mat(ctx, w(f"blk.{il}.{pre}_gate.weight"), cur)
    score = ggml.ggml_add(ctx, score, ggml.ggml_get_rows(ctx, w(f"blk.{il}.{pre}_ape.weight"), ri.ape))
    name = "lid_" if pre.startswith("indexer") else ""
    kv_cells = ggml.ggml_set_rows(ctx, pool.aux[il, name + "state_kv"], kv, g.inp.kv_idx)
    sc_cells = ggml.ggml_set_rows(ctx, pool.aux[il, name + "state_score"], score, g.inp.kv_idx)
    kv_rows = ggml.ggml_get_rows(ctx, kv_cells, ri.read)                            # [coff * d, coff * r * n]
    sc_rows = ggml.ggml_get_rows(ctx, sc_cells, ri.read)
    if ri.mask is not None:  # overlapping blocks: previous block's first half, then this block's second
        n_read = ratio * n

        def halves(rows):
            nb1 = rows.contents.nb[1]
            prev = ggml.ggml_cont(ctx, ggml.ggml_view_2d(ctx, rows, d, n_read, nb1, 0))
            this = ggml.ggml_cont(ctx, ggml.ggml_view_2d(ctx, rows, d, n_read, nb1, n_read * nb1 + d * F32))
            return ggml.ggml_concat(ctx, ggml.ggml_reshape_3d(ctx, prev, d, ratio, n),
                                    ggml.ggml_reshape_3d(ctx, this, d, ratio, n), 1)    # [d, 2r, n]
        values, scores = halves(kv_rows), halves(sc_rows)
    else:
        values = ggml.ggml_reshape_3d(ctx, kv_rows, d, ratio, n)
        scores = ggml.ggml_reshape_3d(ctx, sc_rows, d, ratio, n)
    values = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, values, 1, 0, 2, 3))       # [window, d, n]
    scores = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, scores, 1, 0, 2, 3))
    if ri.mask is not None:
        scores = ggml.ggml_add(ctx, scores, ri.mask)
    comp = ggml.ggml_sum_rows(ctx, ggml.ggml_mul(ctx, values, ggml.ggml_soft_max(ctx, scores)))  # [1, d, n]
    comp = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, comp, 1, 0, 2, 3))           # [d, 1, n]
    comp = ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, comp, g.cfg.rms_eps), norm)
    comp = rope_tail(g, comp, ri.pos, rope_params(g.cfg, True))
    comp = ggml.ggml_reshape_2d(ctx, comp, d, n)
    return ggml.ggml_set_rows(ctx, cache, comp, ri.write)


def _index_scores(g, il: int, qr, cur, lid, ri: RatioInputs):
    """Lightning-indexer scores per segment: ``Σ_h w_h · relu(q_h · k_b)`` over each segment's compressed
    indexer rows, masked to the visible ones; a list of F32 ``[n_blocks, n_seg]``."""
    ctx, cfg, v4 = g.ctx, g.cfg, g.cfg.dsv4
    n, d, nh = g.n_tokens, v4.indexer_head_dim, v4.indexer_n_head
    q = ggml.ggml_mul_mat(ctx, g._wt(T.INDEXER_ATTN_Q_B, il), qr)
    q = rope_tail(g, ggml.ggml_reshape_3d(ctx, q, d, nh, n), g.inp.pos, rope_params(cfg, True))
    wts = ggml.ggml_scale(ctx, ggml.ggml_mul_mat(ctx, g._wt(T.INDEXER_PROJ, il), cur), 1.0 / math.sqrt(d * nh))
    bps = rows_per_slot(g._pool.n_ctx, CSA_RATIO)
    out, row = [], 0
    for (slot, n_seg, _, _), vis in zip(g.shape.segments, ri.vis):
        nb = int(vis.contents.ne[0])
        k = ggml.ggml_view_2d(ctx, lid, d, nb, lid.contents.nb[1], slot * bps * lid.contents.nb[1])
        qs = ggml.ggml_view_2d(ctx, q, d, nh * n_seg, q.contents.nb[1], row * q.contents.nb[2])
        kq = ggml.ggml_relu(ctx, ggml.ggml_mul_mat(ctx, k, qs))                     # [nb, nh * n_seg]
        ws = ggml.ggml_view_3d(ctx, wts, 1, nh, n_seg, F32, wts.contents.nb[1], row * wts.contents.nb[1])
        s = ggml.ggml_mul(ctx, ggml.ggml_reshape_3d(ctx, kq, nb, nh, n_seg), ws)     # [nb, nh, n_seg]
        s = ggml.ggml_sum_rows(ctx, ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, s, 1, 0, 2, 3)))  # [1, nb, n_seg]
        out.append(ggml.ggml_add(ctx, ggml.ggml_reshape_2d(ctx, s, nb, n_seg), vis))
        row += n_seg
    return out


def _top_k_mask(g, scores, vis, top_k: int):
    """build_top_k_mask: 0 on the top ``top_k`` scores of each row (visible ones only), -inf elsewhere."""
    ctx = g.ctx
    nb, n_seg = int(scores.contents.ne[0]), int(scores.contents.ne[1])
    k = min(nb, top_k)
    top = ggml.ggml_cont(ctx, ggml.ggml_top_k(ctx, scores, k))                      # I32 [k, n_seg]
    allm = ggml.ggml_reshape_3d(ctx, ggml.ggml_fill(ctx, scores, float("-inf")), 1, nb, n_seg)
    zeros = ggml.ggml_fill(ctx, scores, 0.0)
    zeros = ggml.ggml_cont(ctx, ggml.ggml_view_3d(ctx, zeros, 1, k, n_seg, F32, zeros.contents.nb[1], 0))
    sel = ggml.ggml_set_rows(ctx, allm, zeros, top)
    return ggml.ggml_add(ctx, ggml.ggml_reshape_2d(ctx, sel, nb, n_seg), vis)


def dsv4_attention(g, il: int, cur):
    """The V4 attention of block ``il`` on ``cur`` ``[n_embd, n]`` (after ``attn_norm``) -> ``[n_embd, n]``."""
    ctx, cfg, v4, pool = g.ctx, g.cfg, g.cfg.dsv4, g._pool
    n, hd, nh = g.n_tokens, cfg.head_dim, cfg.n_head
    ratio = v4.ratio(il)
    params = rope_params(cfg, ratio != 0)
    qr = g._norm(ggml.ggml_mul_mat(ctx, g._wt(T.ATTN_Q_A, il), cur), T.ATTN_Q_A_NORM, il)   # [n_lora_q, n]
    q = ggml.ggml_reshape_3d(ctx, ggml.ggml_mul_mat(ctx, g._wt(T.ATTN_Q_B, il), qr), hd, nh, n)
    q = rope_tail(g, ggml.ggml_rms_norm(ctx, q, cfg.rms_eps), g.inp.pos, params)     # [hd, nh, n]
    kv = g._norm(ggml.ggml_mul_mat(ctx, g._w.get(f"blk.{il}.attn_kv.weight"), cur), T.ATTN_KV_A_NORM, il)
    kv = rope_tail(g, ggml.ggml_reshape_3d(ctx, kv, hd, 1, n), g.inp.pos, params)
    kc = ggml.ggml_set_rows(ctx, pool.k[il], ggml.ggml_reshape_2d(ctx, kv, hd, n), g.inp.kv_idx)
    comp = sel_masks = None
    if ratio:
        ri = g.dsv4_inp.ratios[ratio]
        comp = _compress(g, il, cur, "attn_compressor", ri, ratio, hd, g._w.get(f"blk.{il}.attn_compressor_norm.weight"),
                         pool.aux[il, "comp"])
        if ratio == CSA_RATIO:
            lid = _compress(g, il, cur, "indexer_compressor", ri, ratio, v4.indexer_head_dim,
                            g._w.get(f"blk.{il}.indexer_compressor_norm.weight"), pool.aux[il, "lid"])
            sel_masks = [_top_k_mask(g, s, vis, v4.indexer_top_k)
                         for s, vis in zip(_index_scores(g, il, qr, cur, lid, ri), ri.vis)]
        else:
            sel_masks = ri.vis
    sinks = g._wt(T.ATTN_SINKS, il)
    row_k = kc.contents.nb[1]
    parts, row = [], 0
    for i, (slot, n_seg, n_kv, _) in enumerate(g.shape.segments):
        k_all = ggml.ggml_view_3d(ctx, kc, hd, n_kv, 1, row_k, row_k * n_kv, slot * pool.n_ctx * row_k)
        mask = g.dsv4_inp.raw[i]                                                     # F32 [n_kv, n_seg]
        if comp is not None:
            nb = int(sel_masks[i].contents.ne[0])
            bps = rows_per_slot(pool.n_ctx, ratio)
            rows = ggml.ggml_view_3d(ctx, comp, hd, nb, 1, comp.contents.nb[1], comp.contents.nb[1] * nb,
                                     slot * bps * comp.contents.nb[1])
            k_all = ggml.ggml_concat(ctx, k_all, rows, 1)                           # raw window, then compressed
            mask = ggml.ggml_concat(ctx, mask, sel_masks[i], 0)
        # flash attention's mask: F16, rows padded (ggml_pad is F32-only; 0 and -inf cast exactly)
        mask = ggml.ggml_pad(ctx, mask, 0, pad_to(n_seg, MASK_ROW_PAD) - n_seg, 0, 0)
        mask = ggml.ggml_cast(ctx, mask, ggml.GGML_TYPE_F16)
        k4 = ggml.ggml_reshape_4d(ctx, k_all, hd, int(k_all.contents.ne[1]), 1, 1)
        qs = ggml.ggml_view_3d(ctx, q, hd, nh, n_seg, q.contents.nb[1], q.contents.nb[2], row * q.contents.nb[2])
        out = ggml.ggml_flash_attn_ext(ctx, ggml.ggml_permute(ctx, qs, 0, 2, 1, 3), k4, k4, mask,
                                       1.0 / math.sqrt(hd), 0.0, 0.0)
        ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
        ggml.ggml_flash_attn_ext_add_sinks(out, sinks)
        parts.append(ggml.ggml_reshape_3d(ctx, out, hd, nh, n_seg))
        row += n_seg
    out = parts[0]
    for p in parts[1:]:
        out = ggml.ggml_concat(ctx, out, p, 2)
    out = rope_tail(g, out, g.inp.pos, params, back=True)                          # [hd, nh, n]
    return _grouped_output(g, il, out)


def _grouped_output(g, il: int, out):
    """``attn_output_b``(per group ``attn_output_a``(heads of the group)): ``[hd, nh, n]`` -> ``[n_embd, n]``."""
    ctx, v4 = g.ctx, g.cfg.dsv4
    n = int(out.contents.ne[2])
    og, ol = v4.o_groups, v4.o_lora_rank
    gdim = v4.wo_a_in
    out = ggml.ggml_permute(ctx, ggml.ggml_reshape_3d(ctx, ggml.ggml_cont(ctx, out), gdim, og, n), 0, 2, 1, 3)
    wo_a = ggml.ggml_reshape_3d(ctx, g._w.get(f"blk.{il}.attn_output_a.weight"), gdim, ol, og)
    oa = ggml.ggml_permute(ctx, ggml.ggml_mul_mat(ctx, wo_a, out), 0, 2, 1, 3)      # [ol, og, n]
    oa = ggml.ggml_cont_2d(ctx, oa, ol * og, n)
    return ggml.ggml_mul_mat(ctx, g._w.get(f"blk.{il}.attn_output_b.weight"), oa)
