"""The forward graph of one layer range, built with ggml the way llama.cpp builds it.

Mirrors llama.cpp's graphs (src/models/*.cpp, ``llm_build_llama``, ``llm_build_qwen2``,
``llm_build_qwen3``, ``llm_build_phi3``, ``llm_build_gemma3_iswa``) and its ``llm_graph_context``
helpers: ``build_norm`` (RMS norm then gain), ``build_ffn`` (fused SwiGLU / GeGLU), and ``build_attn``
with a KV cache written by ``ggml_set_rows`` and read through ``ggml_flash_attn_ext`` (F16 cache, F32
precision). Using the same ggml ops in the same order on weights in their stored types is what makes
the logits equal llama.cpp's bit for bit.

Shapes are written in ggml order: ``[n_embd, n_tokens]`` is n_tokens rows of n_embd floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import ggml
import gguf
import numpy as np

from meshnet.contract import LayerRange
from meshnet.engine.ggml_backend import (
    KVCache,
    StageWeights,
    compute,
    get_tensor,
    new_meta_context,
    new_tensor,
    set_tensor,
)
from meshnet.model.gguf_file import tensor_name as _tn
from meshnet.model.hparams import ModelConfig

T = gguf.MODEL_TENSOR
GRAPH_SIZE = 8192
# llama.cpp pads the KV length the attention reads to 256 cells (llama_kv_cache::get_padding) and the
# mask's rows to GGML_KQ_MASK_PAD; we do the same so the kernels see the same shapes.
KV_PAD = 256
MASK_ROW_PAD = int(ggml.GGML_KQ_MASK_PAD)
# llama.cpp's defaults when no YaRN scaling is configured.
ROPE_EXT_FACTOR, ROPE_ATTN_FACTOR, ROPE_BETA_FAST, ROPE_BETA_SLOW = 0.0, 1.0, 32.0, 1.0


def pad_to(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def kv_length(n_past_after: int, n_ctx: int) -> int:
    """Cells attention reads after a step that ends with ``n_past_after`` cached tokens."""
    return min(n_ctx, pad_to(n_past_after, KV_PAD))


def build_mask(positions: np.ndarray, n_kv: int, n_swa: int = 0) -> np.ndarray:
    """Causal mask ``[pad(n_tokens), n_kv]`` (numpy order) of 0 / -inf in float16.

    Query at position p sees cell j iff j <= p, and with a sliding window also p - j < n_swa
    (llama.cpp ``is_masked_swa``, LLAMA_SWA_TYPE_STANDARD). Padding rows are fully masked.
    """
    n = len(positions)
    rows = pad_to(n, MASK_ROW_PAD)
    j = np.arange(n_kv)[None, :]
    p = positions[:, None]
    visible = j <= p
    if n_swa:
        visible &= (p - j) < n_swa
    mask = np.full((rows, n_kv), -np.inf, dtype=np.float16)
    mask[:n] = np.where(visible, 0.0, -np.inf).astype(np.float16)
    return mask


@dataclass
class _Inputs:
    tokens: object | None
    hidden: object | None
    pos: object
    kv_idx: object
    mask: object | None
    mask_swa: object | None
    out_ids: object | None


class StepGraph:
    """A built, allocated ggml graph for ``n_tokens`` tokens reading ``n_kv`` KV cells.

    Reusable across steps of the same session with the same (n_tokens, n_kv): only inputs change.
    ``run`` returns ``[n_tokens, n_embd]`` hidden states (non-tail) or ``[n_out, n_vocab]`` logits (tail).
    """

    def __init__(self, cfg: ModelConfig, weights: StageWeights, kv: KVCache, layers: LayerRange,
                 n_tokens: int, n_kv: int, n_out: int, backend) -> None:
        self.cfg, self.layers, self.n_tokens, self.n_kv = cfg, layers, n_tokens, n_kv
        self.is_head = layers.is_head()
        self.is_tail = layers.is_tail(cfg.n_layer)
        self.n_out = n_out if self.is_tail else n_tokens
        self.ctx = new_meta_context(GRAPH_SIZE, GRAPH_SIZE)
        self.gf = ggml.ggml_new_graph_custom(self.ctx, GRAPH_SIZE, False)
        self._w = weights
        self._kv = kv
        self.out = self._build()
        ggml.ggml_set_output(self.out)
        ggml.ggml_build_forward_expand(self.gf, self.out)
        # ggml-python's binding of ggml_backend_cpu_buffer_type() truncates the pointer; ask the backend.
        self.galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(backend))
        if not ggml.ggml_gallocr_alloc_graph(self.galloc, self.gf):
            raise MemoryError("could not allocate the compute buffer")

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
        y = ggml.ggml_mul_mat(self.ctx, self._wt(kind, il), x)
        b = self._wt(kind, il, "bias")
        return y if b is None else ggml.ggml_add(self.ctx, y, b)

    def _rope(self, x, il: int):
        cfg = self.cfg
        swa = cfg.is_swa(il)
        base = cfg.rope_freq_base_swa if swa else cfg.rope_freq_base
        scale = 1.0 if swa else cfg.rope_freq_scale
        return ggml.ggml_rope_ext(self.ctx, x, self.inp.pos, None, cfg.n_rot, cfg.rope_type, cfg.n_ctx_train,
                                  base, scale, ROPE_EXT_FACTOR, ROPE_ATTN_FACTOR, ROPE_BETA_FAST, ROPE_BETA_SLOW)

    def _attn(self, il: int, q, k, v, kq_scale: float):
        """KV write then flash attention. q ``[head_dim, n_head, n]``, k/v ``[head_dim, n_head_kv, n]``;
        returns ``[head_dim_v * n_head, n]`` before the output projection."""
        cfg, ctx, n = self.cfg, self.ctx, self.n_tokens
        kc, vc = self._kv.k[il], self._kv.v[il]
        k2 = ggml.ggml_reshape_2d(ctx, ggml.ggml_cont(ctx, k), cfg.n_embd_k_gqa, n)
        v2 = ggml.ggml_reshape_2d(ctx, ggml.ggml_cont(ctx, v), cfg.n_embd_v_gqa, n)
        # The cache writes must be in the graph before the attention that reads the cache views.
        ggml.ggml_build_forward_expand(self.gf, ggml.ggml_set_rows(ctx, kc, k2, self.inp.kv_idx))
        ggml.ggml_build_forward_expand(self.gf, ggml.ggml_set_rows(ctx, vc, v2, self.inp.kv_idx))
        f16 = ggml.GGML_TYPE_F16
        kview = ggml.ggml_view_4d(ctx, kc, cfg.head_dim, cfg.n_head_kv, self.n_kv, 1,
                                  ggml.ggml_row_size(f16, cfg.head_dim), ggml.ggml_row_size(f16, cfg.n_embd_k_gqa),
                                  ggml.ggml_row_size(f16, cfg.n_embd_k_gqa * self.n_kv), 0)
        vview = ggml.ggml_view_4d(ctx, vc, cfg.head_dim_v, cfg.n_head_kv, self.n_kv, 1,
                                  ggml.ggml_row_size(f16, cfg.head_dim_v), ggml.ggml_row_size(f16, cfg.n_embd_v_gqa),
                                  ggml.ggml_row_size(f16, cfg.n_embd_v_gqa * self.n_kv), 0)
        qp = ggml.ggml_permute(ctx, q, 0, 2, 1, 3)
        kp = ggml.ggml_permute(ctx, kview, 0, 2, 1, 3)
        vp = ggml.ggml_permute(ctx, vview, 0, 2, 1, 3)
        mask = self.inp.mask_swa if cfg.is_swa(il) else self.inp.mask
        cur = ggml.ggml_flash_attn_ext(ctx, qp, kp, vp, mask, kq_scale, 0.0, 0.0)
        ggml.ggml_flash_attn_ext_set_prec(cur, ggml.GGML_PREC_F32)
        return ggml.ggml_reshape_2d(ctx, cur, cfg.head_dim_v * cfg.n_head, n)

    def _select_out_rows(self, il: int, *xs):
        """On the model's last layer keep only the rows whose logits are wanted (llama.cpp inp_out_ids)."""
        if il == self.cfg.n_layer - 1 and self.inp.out_ids is not None:
            return tuple(ggml.ggml_get_rows(self.ctx, x, self.inp.out_ids) for x in xs)
        return xs

    def _layer_llama(self, il: int, x):
        """llama / qwen2 (q/k/v biases) / qwen3 (per-head q/k RMS norm)."""
        cfg, ctx, n = self.cfg, self.ctx, self.n_tokens
        cur = self._norm(x, T.ATTN_NORM, il)                                     # [n_embd, n]
        q = ggml.ggml_reshape_3d(ctx, self._mm(T.ATTN_Q, il, cur), cfg.head_dim, cfg.n_head, n)
        k = ggml.ggml_reshape_3d(ctx, self._mm(T.ATTN_K, il, cur), cfg.head_dim, cfg.n_head_kv, n)
        v = ggml.ggml_reshape_3d(ctx, self._mm(T.ATTN_V, il, cur), cfg.head_dim_v, cfg.n_head_kv, n)
        if self._wt(T.ATTN_Q_NORM, il) is not None:
            q = self._norm(q, T.ATTN_Q_NORM, il)
            k = self._norm(k, T.ATTN_K_NORM, il)
        q, k = self._rope(q, il), self._rope(k, il)
        cur = self._mm(T.ATTN_OUT, il, self._attn(il, q, k, v, cfg.attn_scale))  # [n_embd, n]
        cur, x = self._select_out_rows(il, cur, x)
        ffn_inp = ggml.ggml_add(ctx, cur, x)
        cur = self._norm(ffn_inp, T.FFN_NORM, il)
        up = self._mm(T.FFN_UP, il, cur)                                         # [n_ff, n]
        gate = self._mm(T.FFN_GATE, il, cur)
        cur = self._mm(T.FFN_DOWN, il, ggml.ggml_swiglu_split(ctx, gate, up))
        return ggml.ggml_add(ctx, cur, ffn_inp)

    def _layer_phi3(self, il: int, x):
        """phi3: fused attn_qkv rows [Q; K; V], Q pre-scaled, fused ffn_up rows [gate; up]."""
        cfg, ctx, n = self.cfg, self.ctx, self.n_tokens
        cur = self._norm(x, T.ATTN_NORM, il)
        qkv = self._mm(T.ATTN_QKV, il, cur)                                      # [n_embd + 2*n_embd_gqa, n]
        f4 = 4  # sizeof(float)
        nb1 = qkv.contents.nb[1]
        q = ggml.ggml_view_3d(ctx, qkv, cfg.head_dim, cfg.n_head, n, cfg.head_dim * f4, nb1, 0)
        k = ggml.ggml_view_3d(ctx, qkv, cfg.head_dim, cfg.n_head_kv, n, cfg.head_dim * f4, nb1,
                              f4 * cfg.head_dim * cfg.n_head)
        v = ggml.ggml_view_3d(ctx, qkv, cfg.head_dim, cfg.n_head_kv, n, cfg.head_dim * f4, nb1,
                              f4 * (cfg.head_dim * cfg.n_head + cfg.n_embd_k_gqa))
        q, k = self._rope(q, il), self._rope(k, il)
        q = ggml.ggml_scale(ctx, q, cfg.attn_scale)
        cur = self._mm(T.ATTN_OUT, il, self._attn(il, q, k, v, 1.0))
        cur, x = self._select_out_rows(il, cur, x)
        residual = ggml.ggml_add(ctx, cur, x)
        cur = self._norm(residual, T.FFN_NORM, il)
        cur = ggml.ggml_swiglu(ctx, self._mm(T.FFN_UP, il, cur))                 # [n_ff, n]
        cur = self._mm(T.FFN_DOWN, il, cur)
        return ggml.ggml_add(ctx, residual, cur)

    def _layer_gemma3(self, il: int, x):
        """gemma3: q/k RMS norm, Q pre-scaled, post-attention and post-FFN norms, GeGLU(tanh)."""
        cfg, ctx, n = self.cfg, self.ctx, self.n_tokens
        cur = self._norm(x, T.ATTN_NORM, il)
        q = ggml.ggml_reshape_3d(ctx, self._mm(T.ATTN_Q, il, cur), cfg.head_dim, cfg.n_head, n)
        k = ggml.ggml_reshape_3d(ctx, self._mm(T.ATTN_K, il, cur), cfg.head_dim, cfg.n_head_kv, n)
        v = ggml.ggml_reshape_3d(ctx, self._mm(T.ATTN_V, il, cur), cfg.head_dim_v, cfg.n_head_kv, n)
        q = self._rope(self._norm(q, T.ATTN_Q_NORM, il), il)
        k = self._rope(self._norm(k, T.ATTN_K_NORM, il), il)
        q = ggml.ggml_scale(ctx, q, cfg.attn_scale)
        cur = self._mm(T.ATTN_OUT, il, self._attn(il, q, k, v, 1.0))
        cur, x = self._select_out_rows(il, cur, x)
        cur = self._norm(cur, T.ATTN_POST_NORM, il)
        sa_out = ggml.ggml_add(ctx, cur, x)
        cur = self._norm(sa_out, T.FFN_NORM, il)
        up = self._mm(T.FFN_UP, il, cur)
        gate = self._mm(T.FFN_GATE, il, cur)
        cur = self._mm(T.FFN_DOWN, il, ggml.ggml_geglu_split(ctx, gate, up))
        cur = self._norm(cur, T.FFN_POST_NORM, il)
        return ggml.ggml_add(ctx, cur, sa_out)

    def _build(self):
        cfg, ctx, n = self.cfg, self.ctx, self.n_tokens
        rows = pad_to(n, MASK_ROW_PAD)
        swa = [cfg.is_swa(il) for il in range(self.layers.start, self.layers.end)]
        want_rows = self.is_tail and self.n_out < n
        self.inp = _Inputs(
            tokens=self._input(ggml.GGML_TYPE_I32, (n,)) if self.is_head else None,
            hidden=None if self.is_head else self._input(ggml.GGML_TYPE_F32, (cfg.n_embd, n)),
            pos=self._input(ggml.GGML_TYPE_I32, (n,)),
            kv_idx=self._input(ggml.GGML_TYPE_I64, (n,)),
            # An input no node reads gets no buffer, so each mask exists only if some layer uses it.
            mask=self._input(ggml.GGML_TYPE_F16, (self.n_kv, rows)) if not all(swa) else None,
            mask_swa=self._input(ggml.GGML_TYPE_F16, (self.n_kv, rows)) if any(swa) else None,
            out_ids=self._input(ggml.GGML_TYPE_I32, (self.n_out,)) if want_rows else None,
        )
        if self.is_head:
            x = ggml.ggml_get_rows(ctx, self._wt(T.TOKEN_EMBD), self.inp.tokens)  # [n_embd, n]
            if cfg.embd_scale != 1.0:
                x = ggml.ggml_scale(ctx, x, cfg.embd_scale)
        else:
            x = self.inp.hidden
        layer = {"phi3": self._layer_phi3, "gemma3": self._layer_gemma3}.get(cfg.architecture, self._layer_llama)
        for il in range(self.layers.start, self.layers.end):
            x = layer(il, x)
        if self.is_tail:
            x = self._norm(x, T.OUTPUT_NORM)
            out_w = self._wt(T.OUTPUT) if self._wt(T.OUTPUT) is not None else self._wt(T.TOKEN_EMBD)
            x = ggml.ggml_mul_mat(ctx, out_w, x)                                  # [n_vocab, n_out]
        return x

    # ---- execution ---------------------------------------------------------------------------
    def run(self, backend, position: int, token_ids: np.ndarray | None, hidden: np.ndarray | None) -> np.ndarray:
        """Set inputs for tokens at ``position .. position+n-1`` and compute.

        Args:
            token_ids: int32 ``[n]`` (head only).
            hidden: float32 ``[n, n_embd]`` (non-head only).
        Returns:
            float32 ``[n, n_embd]`` hidden states, or ``[n_out, n_vocab]`` logits on the tail (the last
            ``n_out`` tokens).
        """
        n, inp = self.n_tokens, self.inp
        positions = np.arange(position, position + n, dtype=np.int32)
        if inp.tokens is not None:
            set_tensor(inp.tokens, np.asarray(token_ids, dtype=np.int32))
        if inp.hidden is not None:
            set_tensor(inp.hidden, np.asarray(hidden, dtype=np.float32))
        set_tensor(inp.pos, positions)
        set_tensor(inp.kv_idx, positions.astype(np.int64))
        if inp.mask is not None:
            set_tensor(inp.mask, build_mask(positions, self.n_kv))
        if inp.mask_swa is not None:
            set_tensor(inp.mask_swa, build_mask(positions, self.n_kv, self.cfg.n_swa))
        if inp.out_ids is not None:
            set_tensor(inp.out_ids, np.arange(n - self.n_out, n, dtype=np.int32))
        compute(backend, self.gf)
        return get_tensor(self.out)

    def free(self) -> None:
        if self.galloc:
            ggml.ggml_gallocr_free(self.galloc)
            self.galloc = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None

