"""The forward graph of one layer range, built with ggml the way llama.cpp builds it.

Mirrors llama.cpp's graphs (src/models/*.cpp): the inputs, the embedding, the blocks (each
architecture's in :mod:`meshnet.engine.ggml_layers`) and the tail's output norm and head, with the
``llm_graph_context`` helpers the blocks share: ``build_norm`` (RMS norm then gain) and ``build_attn``
with a KV cache written by ``ggml_set_rows`` and read through ``ggml_flash_attn_ext`` (F16 cache, F32
precision). Using the same ggml ops in the same order on weights in their stored types is what makes
the logits equal llama.cpp's bit for bit.

Shapes are written in ggml order: ``[n_embd, n_tokens]`` is n_tokens rows of n_embd floats.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import ggml
import gguf
import numpy as np

from meshnet.contract import LayerRange
from meshnet.engine.batch_layout import (
    MASK_ROW_PAD,
    BatchShape,
    Segment,
    build_mask,
    decode_mask,
    pad_to,
    write_decode_rows,
)
from meshnet.engine.cpu_repack import HALVES_TENSORS, mul_mat
from meshnet.engine.ggml_backend import (
    StageWeights,
    compute,
    get_tensor,
    new_meta_context,
    new_tensor,
    set_tensor,
)
from meshnet.engine.ggml_dsv4 import dsv4_graph_nodes, hc_expand, hc_head
from meshnet.engine.ggml_dsv4_attn import make_inputs as dsv4_make_inputs
from meshnet.engine.ggml_dsv4_attn import set_inputs as dsv4_set_inputs
from meshnet.engine.ggml_layers import LAYERS
from meshnet.engine.ggml_moe import moe_graph_nodes
from meshnet.engine.host_inputs import host_view, put
from meshnet.engine.kv_pool import KVPool
from meshnet.model.gguf_file import tensor_name as _tn
from meshnet.model.hparams import ModelConfig
from meshnet.model.rope_scaling import YARN_BETA_FAST, YARN_BETA_SLOW

T = gguf.MODEL_TENSOR


@dataclass
class _Inputs:
    tokens: object | None
    hidden: object | None
    pos: object
    kv_idx: object
    # [dec_streams]: the decode row of each slot's stream (0 where none); [n_dec]: the stream (slot) of each
    # decode row. Neither when the rows are the streams in order (:meth:`BatchShape.dec_in_order`).
    dec_gather: object | None
    dec_scatter: object | None
    dec_mask: object | None
    dec_mask_swa: object | None
    seg_masks: list
    seg_masks_swa: list
    out_ids: object | None
    extra: list = field(default_factory=list)  # DeepSeek-V4's masks and compressor indices


# The inputs :meth:`StepGraph.run` writes through views of their memory when it is the host's: these
# through flat views, the decode masks (plain, then windowed) through views of their shape.
_VIEWED = ("tokens", "hidden", "pos", "kv_idx", "dec_gather", "dec_scatter", "out_ids")
_DEC_MASKS = ("dec_mask", "dec_mask_swa")


def _contiguous(ctx, x):
    """``x`` itself when its data is contiguous, else a ``ggml_cont`` copy: a copy is one more node, and
    every node of a decode graph costs a barrier between the compute threads."""
    return x if ggml.ggml_is_contiguous(x) else ggml.ggml_cont(ctx, x)


class StepGraph:
    """A built ggml graph for one iteration's :class:`BatchShape` over a stage's :class:`KVPool`.

    Reusable across iterations of the same shape: only inputs change. ``run`` returns ``[n_tokens,
    n_embd]`` hidden states (non-tail) or ``[n_out, n_vocab]`` logits (tail), rows in batch order.
    Compute memory comes from the stage's one graph allocator: ``place`` it before a run whenever
    another graph ran since.
    """

    def __init__(self, cfg: ModelConfig, weights: StageWeights, pool: KVPool, layers: LayerRange,
                 shape: BatchShape) -> None:
        self.cfg, self.layers, self.shape = cfg, layers, shape
        self.n_tokens = shape.n_tokens
        self.is_head = layers.is_head()
        self.is_tail = layers.is_tail(cfg.n_layer)
        self.n_out = shape.n_out if self.is_tail else self.n_tokens
        # a tail that runs the MTP block (its cells are layer n_layer of the pool) also returns the
        # normed state of every row, which the block reads
        self.keeps_state = self.is_tail and cfg.n_layer in pool.k
        self.state_out = None
        per_layer = 48 + 16 * (len(shape.segments) + (1 if shape.n_dec else 0))
        if cfg.manifest.is_moe:
            per_layer += moe_graph_nodes(cfg.n_expert_used)
        if cfg.is_mla:
            per_layer += 32
        if cfg.dsv4 is not None:
            per_layer += dsv4_graph_nodes(cfg.dsv4.n_hc, cfg.dsv4.sinkhorn_iters) + 64 * len(shape.segments)
        self.needs_tokens = self.is_head or cfg.needs_token_ids(layers)
        self.dsv4_inp = None
        size = 256 + layers.n_layers * per_layer
        size += HALVES_TENSORS * sum(1 for t in weights.tensors.values() if getattr(t, "row_halves", False))
        self.ctx = new_meta_context(size, size)
        self.gf = ggml.ggml_new_graph_custom(self.ctx, size, False)
        self._w = weights
        self._pool = pool
        self._views: dict[str, np.ndarray] = {}  # host views of the inputs, made by place
        self._pair_ids: dict = {}  # expert ids of products over row halves, by row count (cpu_repack.mul_mat)
        self.out = self._build()
        ggml.ggml_set_output(self.out)
        ggml.ggml_build_forward_expand(self.gf, self.out)

    # ---- graph construction ------------------------------------------------------------------
    def _input(self, gtype: int, shape: tuple[int, ...]):
        t = new_tensor(self.ctx, gtype, shape)
        ggml.ggml_set_input(t)
        return t

    def _wt(self, kind: T, il: int | None = None, suffix: str = "weight"):
        return self._w.get(_tn(kind, il, suffix))

    def _norm(self, x, kind: T, il: int | None = None):
        """llama.cpp build_norm(LLM_NORM_RMS): rms_norm over ne0, times the gain."""
        return ggml.ggml_mul(self.ctx, ggml.ggml_rms_norm(self.ctx, x, self.cfg.rms_eps), self._wt(kind, il))

    def _mm(self, kind: T, il: int | None, x):
        y = mul_mat(self.ctx, self._wt(kind, il), x, self._pair_ids)
        b = self._wt(kind, il, "bias")
        return y if b is None else ggml.ggml_add(self.ctx, y, b)

    def _rope(self, x, il: int):
        cfg = self.cfg
        swa = cfg.is_swa(il)
        base = cfg.rope_freq_base_swa if swa else cfg.rope_freq_base
        scale = 1.0 if swa else cfg.rope_freq_scale
        return ggml.ggml_rope_ext(self.ctx, x, self.inp.pos, None, cfg.n_rot, cfg.rope_type,
                                  cfg.n_ctx_orig_yarn or cfg.n_ctx_train, base, scale, cfg.rope_ext_factor,
                                  cfg.rope_attn_factor, YARN_BETA_FAST, YARN_BETA_SLOW)

    def _attn(self, il: int, q, k, v, kq_scale: float, v_in_k: bool = False):
        """KV write then flash attention. q ``[head_dim, n_head, n]``, k ``[head_dim, n_head_kv, n]``, v
        ``[head_dim_v, n_head_kv, n]``; returns ``[head_dim_v * n_head, n]`` before the output projection.

        Every row's K and V go to its cell in one ``ggml_set_rows``; with ``v_in_k`` (MLA's latent
        cache) V is not stored: it is the first ``head_dim_v`` values of each K cell, read through a
        view of the K cells (llama.cpp's ``build_attn`` for ``llm_graph_input_attn_k``). The decode
        rows are attended as one call over the lowest ``dec_streams`` slots, a stream per slot
        (llama.cpp's multi-stream KV cache layout: K viewed ``[head_dim, n_head_kv, n_kv, n_stream]``);
        each segment gets its own call over its slot's cells, the same call a session alone makes."""
        ctx, n, pool, shape = self.ctx, self.n_tokens, self._pool, self.shape
        hd, n_head = int(q.contents.ne[0]), int(q.contents.ne[1])
        n_head_kv, hd_v = int(k.contents.ne[1]), int(v.contents.ne[0])
        kc = pool.k[il]
        vc = kc if v_in_k else pool.v[il]
        k2 = ggml.ggml_reshape_2d(ctx, _contiguous(ctx, k), hd * n_head_kv, n)
        # The cache writes must be in the graph before the attention that reads the cache views.
        ggml.ggml_build_forward_expand(self.gf, ggml.ggml_set_rows(ctx, kc, k2, self.inp.kv_idx))
        if not v_in_k:
            v2 = ggml.ggml_reshape_2d(ctx, _contiguous(ctx, v), hd_v * n_head_kv, n)
            ggml.ggml_build_forward_expand(self.gf, ggml.ggml_set_rows(ctx, vc, v2, self.inp.kv_idx))
        f16 = ggml.GGML_TYPE_F16
        row_k, row_v = kc.contents.nb[1], vc.contents.nb[1]
        hk = ggml.ggml_row_size(f16, hd)
        hv = hk if v_in_k else ggml.ggml_row_size(f16, hd_v)  # V in K: heads step as K's do
        swa = self.cfg.is_swa(il)
        q2 = ggml.ggml_reshape_2d(ctx, q, hd * n_head, n)
        width = hd_v * n_head
        parts = []
        if shape.n_dec:
            m, n_kv = shape.dec_streams, shape.n_kv_dec
            qd = ggml.ggml_view_2d(ctx, q2, q2.contents.ne[0], shape.n_dec, q2.contents.nb[1], 0)
            if self.inp.dec_gather is not None:
                qd = ggml.ggml_get_rows(ctx, qd, self.inp.dec_gather)             # [hd * n_head, m]
            qp = ggml.ggml_permute(ctx, ggml.ggml_reshape_4d(ctx, qd, hd, n_head, 1, m), 0, 2, 1, 3)
            kv_stride_k, kv_stride_v = row_k * pool.n_ctx, row_v * pool.n_ctx
            kp = ggml.ggml_permute(ctx, ggml.ggml_view_4d(ctx, kc, hd, n_head_kv, n_kv, m,
                                                         hk, row_k, kv_stride_k, 0), 0, 2, 1, 3)
            vp = ggml.ggml_permute(ctx, ggml.ggml_view_4d(ctx, vc, hd_v, n_head_kv, n_kv, m,
                                                         hv, row_v, kv_stride_v, 0), 0, 2, 1, 3)
            mask = self.inp.dec_mask_swa if swa else self.inp.dec_mask
            cur = ggml.ggml_flash_attn_ext(ctx, qp, kp, vp, mask, kq_scale, 0.0, 0.0)
            ggml.ggml_flash_attn_ext_set_prec(cur, ggml.GGML_PREC_F32)
            cur = ggml.ggml_reshape_2d(ctx, cur, width, m)
            parts.append(cur if self.inp.dec_scatter is None else ggml.ggml_get_rows(ctx, cur, self.inp.dec_scatter))
        row = shape.n_dec
        for i, (slot, n_seg, n_kv, _) in enumerate(shape.segments):
            qv = ggml.ggml_view_3d(ctx, q, hd, n_head, n_seg, q.contents.nb[1], q.contents.nb[2],
                                   row * q.contents.nb[2])
            kview = ggml.ggml_view_4d(ctx, kc, hd, n_head_kv, n_kv, 1, hk, row_k, row_k * n_kv,
                                      slot * pool.n_ctx * row_k)
            vview = ggml.ggml_view_4d(ctx, vc, hd_v, n_head_kv, n_kv, 1, hv, row_v, row_v * n_kv,
                                      slot * pool.n_ctx * row_v)
            qp = ggml.ggml_permute(ctx, qv, 0, 2, 1, 3)
            kp = ggml.ggml_permute(ctx, kview, 0, 2, 1, 3)
            vp = ggml.ggml_permute(ctx, vview, 0, 2, 1, 3)
            mask = (self.inp.seg_masks_swa if swa else self.inp.seg_masks)[i]
            cur = ggml.ggml_flash_attn_ext(ctx, qp, kp, vp, mask, kq_scale, 0.0, 0.0)
            ggml.ggml_flash_attn_ext_set_prec(cur, ggml.GGML_PREC_F32)
            parts.append(ggml.ggml_reshape_2d(ctx, cur, width, n_seg))
            row += n_seg
        out = parts[0]
        for p in parts[1:]:
            out = ggml.ggml_concat(ctx, out, p, 1)
        return out

    def _select_out_rows(self, il: int, *xs):
        """On the model's last layer keep only the rows whose logits are wanted (llama.cpp inp_out_ids)."""
        if il == self.cfg.n_layer - 1 and self.inp.out_ids is not None and not self.keeps_state:
            return tuple(ggml.ggml_get_rows(self.ctx, x, self.inp.out_ids) for x in xs)
        return xs

    def _build(self):
        cfg, ctx, n, shape = self.cfg, self.ctx, self.n_tokens, self.shape
        swa = [cfg.is_swa(il) for il in range(self.layers.start, self.layers.end)]
        # DeepSeek-V4 builds its own masks (window plus compressed rows; ggml_dsv4_attn)
        plain, windowed = (not all(swa), any(swa)) if cfg.dsv4 is None else (False, False)
        want_rows = self.is_tail and self.n_out < n
        permuted = shape.n_dec and not shape.dec_in_order
        dec_mask_shape = (shape.n_kv_dec, MASK_ROW_PAD, 1, shape.dec_streams)
        seg_shapes = [(n_kv, pad_to(n_seg, MASK_ROW_PAD)) for _, n_seg, n_kv, _ in shape.segments]
        # An input no node reads gets no buffer, so each mask exists only if some layer uses it.
        width = cfg.n_embd * (cfg.dsv4.n_hc if cfg.dsv4 is not None else 1)
        self.inp = _Inputs(
            tokens=self._input(ggml.GGML_TYPE_I32, (n,)) if self.needs_tokens else None,
            hidden=None if self.is_head else self._input(ggml.GGML_TYPE_F32, (width, n)),
            pos=self._input(ggml.GGML_TYPE_I32, (n,)),
            kv_idx=self._input(ggml.GGML_TYPE_I64, (n,)),
            dec_gather=self._input(ggml.GGML_TYPE_I32, (shape.dec_streams,)) if permuted else None,
            dec_scatter=self._input(ggml.GGML_TYPE_I32, (shape.n_dec,)) if permuted else None,
            dec_mask=self._input(ggml.GGML_TYPE_F16, dec_mask_shape) if shape.n_dec and plain else None,
            dec_mask_swa=self._input(ggml.GGML_TYPE_F16, dec_mask_shape) if shape.n_dec and windowed else None,
            seg_masks=[self._input(ggml.GGML_TYPE_F16, s) if plain else None for s in seg_shapes],
            seg_masks_swa=[self._input(ggml.GGML_TYPE_F16, s) if windowed else None for s in seg_shapes],
            out_ids=self._input(ggml.GGML_TYPE_I32, (self.n_out,)) if want_rows else None,
        )
        for t in (self.inp.dec_mask, self.inp.dec_mask_swa):
            if t is not None:  # kept from run to run by the allocator: a run rewrites its first rows only
                ggml.ggml_set_output(t)
        if cfg.dsv4 is not None:
            self.dsv4_inp = dsv4_make_inputs(self)
            self.inp.extra = self.dsv4_inp.tensors()
        if self.is_head:
            x = ggml.ggml_get_rows(ctx, self._wt(T.TOKEN_EMBD), self.inp.tokens)  # [n_embd, n]
            if cfg.embd_scale != 1.0:
                x = ggml.ggml_scale(ctx, x, cfg.embd_scale)
            if cfg.dsv4 is not None:
                x = hc_expand(ctx, x, cfg.dsv4.n_hc)                                # [n_embd, n_hc, n]
        else:
            x = self.inp.hidden
            if cfg.dsv4 is not None:
                x = ggml.ggml_reshape_3d(ctx, x, cfg.n_embd, cfg.dsv4.n_hc, n)
        layer = LAYERS[cfg.manifest.layer]
        for il in range(self.layers.start, self.layers.end):
            x = layer(self, il, x)
        if cfg.dsv4 is not None:  # the streams flat: what crosses a boundary, or the tail's head mix
            if self.is_tail:
                if self.inp.out_ids is not None:
                    flat = ggml.ggml_reshape_2d(ctx, x, cfg.n_embd * cfg.dsv4.n_hc, n)
                    x = ggml.ggml_reshape_3d(ctx, ggml.ggml_get_rows(ctx, flat, self.inp.out_ids),
                                             cfg.n_embd, cfg.dsv4.n_hc, self.n_out)
                x = hc_head(self, x)
            else:
                x = ggml.ggml_reshape_2d(ctx, x, cfg.n_embd * cfg.dsv4.n_hc, n)
        if self.is_tail:
            x = self._norm(x, T.OUTPUT_NORM)
            if self.keeps_state:  # every row normed, then the logits rows (row by row the same values)
                self.state_out = x
                ggml.ggml_set_output(x)
                ggml.ggml_build_forward_expand(self.gf, x)
                if self.inp.out_ids is not None:
                    x = ggml.ggml_get_rows(ctx, x, self.inp.out_ids)
            out_w = self._wt(T.OUTPUT) if self._wt(T.OUTPUT) is not None else self._wt(T.TOKEN_EMBD)
            x = mul_mat(ctx, out_w, x, self._pair_ids)                            # [n_vocab, n_out]
        return x

    # ---- execution ---------------------------------------------------------------------------
    def place(self, galloc) -> None:
        """Give the graph's intermediate tensors and inputs their places in ``galloc``'s buffer.

        The allocator leaves a tensor that already has data where it is, so a graph placed before (whose
        places another graph may have taken since, or that lie in a buffer the allocator has since
        replaced) is first cleared: every node and input forgets its data, views included, and views are
        then re-derived from their sources. Weights and pool cells are leaves outside the graph's nodes.

        Raises:
            MemoryError: the compute buffer could not be allocated.
        """
        tensors = [ggml.ggml_graph_node(self.gf, i) for i in range(ggml.ggml_graph_n_nodes(self.gf))]
        for f in fields(self.inp):
            value = getattr(self.inp, f.name)
            tensors += [t for t in (value if isinstance(value, list) else [value]) if t is not None]
        for t in tensors:
            t.contents.data = None
            t.contents.buffer = None
        if not ggml.ggml_gallocr_alloc_graph(galloc, self.gf):
            raise MemoryError("could not allocate the compute buffer")
        self._views = {name: v for name in _VIEWED if (v := host_view(getattr(self.inp, name))) is not None}
        for name in _DEC_MASKS:
            if (v := host_view(getattr(self.inp, name), flat=False)) is not None:
                v.fill(-np.inf)  # its padding rows; a run rewrites only each stream's first row
                self._views[name] = v

    def run(self, backend, decodes: list[tuple[int, int]], segments: list[Segment],
            token_ids: np.ndarray | None, hidden: np.ndarray | None) -> np.ndarray:
        """Set the inputs of one iteration and compute.

        Args:
            decodes: ``(slot, position)`` of each decode row, in row order.
            segments: the segments, in row order, matching the shape's.
            token_ids: int32 ``[n_tokens]`` (head only), rows in batch order.
            hidden: float32 ``[n_tokens, n_embd]`` (non-head only).
        Returns:
            float32 ``[n_tokens, n_embd]`` hidden states, or ``[n_out, n_vocab]`` logits on the tail
            (each decode row, then the last ``n_out`` rows of each segment).
        """
        cfg, inp, shape, pool, views = self.cfg, self.inp, self.shape, self._pool, self._views
        # Inputs in host memory are written through views (host_inputs), and a decode-only step builds
        # no arrays for them: after a graph has run, every numpy call runs cold, at 5-30 us each.
        if inp.tokens is not None:
            put(views, "tokens", inp.tokens, np.asarray(token_ids, dtype=np.int32))
        if inp.hidden is not None:
            put(views, "hidden", inp.hidden, np.asarray(hidden, dtype=np.float32))
        if views and not segments:
            pos, kv_idx = views["pos"], views["kv_idx"]
            if len(decodes) != len(pos):
                raise ValueError(f"tensor size mismatch: ggml wants {len(pos)} decode rows, got {len(decodes)}")
            for k, (slot, p) in enumerate(decodes):
                pos[k], kv_idx[k] = p, slot * pool.n_ctx + p
        else:
            positions = np.concatenate([np.asarray([p for _, p in decodes], dtype=np.int32)]
                                       + [np.arange(s.position, s.position + s.n_tokens, dtype=np.int32)
                                          for s in segments])
            slots = np.concatenate([np.asarray([sl for sl, _ in decodes], dtype=np.int64)]
                                   + [np.full(s.n_tokens, s.slot, dtype=np.int64) for s in segments])
            put(views, "pos", inp.pos, positions)
            put(views, "kv_idx", inp.kv_idx, slots * pool.n_ctx + positions)
        if shape.n_dec:
            if inp.dec_gather is not None:
                gather = np.zeros(shape.dec_streams, dtype=np.int32)
                for row, (slot, _) in enumerate(decodes):
                    gather[slot] = row
                put(views, "dec_gather", inp.dec_gather, gather)
                put(views, "dec_scatter", inp.dec_scatter, np.asarray([sl for sl, _ in decodes], dtype=np.int32))
            elif any(slot != row for row, (slot, _) in enumerate(decodes)):
                raise ValueError(f"decode rows in slots {[sl for sl, _ in decodes]} are not their streams in order")
            for name, n_swa in zip(_DEC_MASKS, (0, cfg.n_swa)):
                t = getattr(inp, name)
                if name in views:
                    write_decode_rows(views[name], decodes, n_swa)
                elif t is not None:
                    set_tensor(t, decode_mask(decodes, shape.dec_streams, shape.n_kv_dec, n_swa))
        for i, seg in enumerate(segments):
            seg_pos = np.arange(seg.position, seg.position + seg.n_tokens, dtype=np.int32)
            for t, n_swa in ((inp.seg_masks[i], 0), (inp.seg_masks_swa[i], cfg.n_swa)):
                if t is not None:
                    set_tensor(t, build_mask(seg_pos, seg.n_kv, n_swa))
        if self.dsv4_inp is not None:
            dsv4_set_inputs(self.dsv4_inp, segments, cfg.n_swa, pool.n_ctx, pool.n_slots)
        if inp.out_ids is not None:
            rows, row = list(range(shape.n_dec)), shape.n_dec
            for seg in segments:
                row += seg.n_tokens
                rows.extend(range(row - seg.n_out, row))
            put(views, "out_ids", inp.out_ids, np.asarray(rows, dtype=np.int32))
        compute(backend, self.gf)
        return get_tensor(self.out)

    def states(self) -> np.ndarray | None:
        """After :meth:`run` on a tail that keeps them: float32 ``[n_tokens, n_embd]``, every row's state
        after ``output_norm`` in batch order (llama.cpp's ``h_nextn``); None otherwise."""
        return None if self.state_out is None else get_tensor(self.state_out)

    def free(self) -> None:
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None
