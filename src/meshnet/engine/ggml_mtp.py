"""The next-token-prediction (MTP) block of deepseek2 files (GLM-4.5, DeepSeek-V3) on ggml's own ops.

Mirrors ``llama_model_deepseek2::graph_mtp`` (llama.cpp src/models/deepseek2.cpp) and the draft schedule of
``common_speculative_impl_draft_mtp`` (common/speculative.cpp). The block at position ``p`` reads the
trunk's state after ``output_norm`` at position ``p - 1`` (``h_nextn``; zeros before the first token)
and the token at ``p``: ``eh_proj(concat(enorm(embed(x_p)), hnorm(h_{p-1})))`` goes through one MLA + MoE
block, ``shared_head_norm`` (else ``output_norm``) and ``shared_head_head`` (else ``output``); its argmax
is the draft for ``p + 1``. Further drafts feed the block its own normed state and its last draft.

The block keeps KV cells of its own: layer ``n_layer`` of the tail's pool, at the session's positions, so
release, rollback and replay treat them as the trunk's. Each step the tail runs the block over the rows it
kept (``[position, position + kept]``: every row of a plain step, the accepted prefix of a verification
step) and, when drafts are asked for, one row more for the token it just sampled; drafts after the first
write cells past it, which the next step overwrites (it starts there).
"""

from __future__ import annotations

import ggml
import gguf
import numpy as np

from meshnet.contract import LayerRange
from meshnet.engine.batch_layout import MASK_ROW_PAD, BatchShape, build_mask, kv_length, pad_to
from meshnet.engine.cpu_repack import mul_mat
from meshnet.engine.ggml_backend import compute, get_tensor, set_tensor
from meshnet.engine.ggml_graph import StepGraph, _Inputs
from meshnet.engine.ggml_layers import layer_deepseek2
from meshnet.engine.kv_pool import KVPool
from meshnet.model.hparams import ModelConfig

T = gguf.MODEL_TENSOR


class MtpGraph(StepGraph):
    """The MTP block over ``n`` rows of one session (pool slot ``slot``), reading ``n_kv`` cells; logits
    for the last ``n_out`` rows. ``run`` returns ``(logits [n_out, n_vocab], state [n, n_embd])`` float32,
    the state being the block's ``h_nextn`` (after the head norm), the next draft's input."""

    def __init__(self, cfg: ModelConfig, weights, pool: KVPool, slot: int, n: int, n_kv: int, n_out: int):
        self.h_out = None
        super().__init__(cfg, weights, pool, LayerRange(cfg.n_layer, cfg.n_layer + 1),
                         BatchShape(0, 0, 0, ((slot, n, n_kv, n_out),)))

    def _build(self):
        cfg, ctx, n = self.cfg, self.ctx, self.n_tokens
        il = cfg.n_layer
        _, _, n_kv, n_out = self.shape.segments[0]
        self.inp = _Inputs(
            tokens=self._input(ggml.GGML_TYPE_I32, (n,)), hidden=self._input(ggml.GGML_TYPE_F32, (cfg.n_embd, n)),
            pos=self._input(ggml.GGML_TYPE_I32, (n,)), kv_idx=self._input(ggml.GGML_TYPE_I64, (n,)),
            dec_gather=None, dec_scatter=None, dec_mask=None, dec_mask_swa=None,
            seg_masks=[self._input(ggml.GGML_TYPE_F16, (n_kv, pad_to(n, MASK_ROW_PAD)))], seg_masks_swa=[None],
            out_ids=self._input(ggml.GGML_TYPE_I32, (n_out,)) if n_out < n else None)
        embd = self._wt(T.NEXTN_EMBED_TOKENS, il)
        e = ggml.ggml_get_rows(ctx, embd if embd is not None else self._wt(T.TOKEN_EMBD), self.inp.tokens)
        e = self._norm(e, T.NEXTN_ENORM, il)                                      # [n_embd, n]
        h = self._norm(self.inp.hidden, T.NEXTN_HNORM, il)
        cur = ggml.ggml_mul_mat(ctx, self._wt(T.NEXTN_EH_PROJ, il), ggml.ggml_concat(ctx, e, h, 0))
        cur = layer_deepseek2(self, il, cur)                                      # [n_embd, n]
        if self._wt(T.NEXTN_SHARED_HEAD_NORM, il) is not None:
            cur = self._norm(cur, T.NEXTN_SHARED_HEAD_NORM, il)
        else:
            cur = self._norm(cur, T.OUTPUT_NORM)
        self.h_out = cur
        ggml.ggml_set_output(cur)
        ggml.ggml_build_forward_expand(self.gf, cur)
        if self.inp.out_ids is not None:
            cur = ggml.ggml_get_rows(ctx, cur, self.inp.out_ids)
        head = self._wt(T.NEXTN_SHARED_HEAD_HEAD, il)
        if head is None:
            head = self._wt(T.OUTPUT) if self._wt(T.OUTPUT) is not None else self._wt(T.TOKEN_EMBD)
        return mul_mat(ctx, head, cur, self._pair_ids)                           # [n_vocab, n_out]

    def run_rows(self, backend, slot: int, position: int, token_ids: np.ndarray,
                 hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Compute rows at ``position ..`` for tokens int32 ``[n]`` and trunk states float32 ``[n, n_embd]``."""
        inp, pool = self.inp, self._pool
        _, n, n_kv, n_out = self.shape.segments[0]
        positions = np.arange(position, position + n, dtype=np.int32)
        set_tensor(inp.tokens, np.asarray(token_ids, dtype=np.int32))
        set_tensor(inp.hidden, np.asarray(hidden, dtype=np.float32))
        set_tensor(inp.pos, positions)
        set_tensor(inp.kv_idx, slot * pool.n_ctx + positions.astype(np.int64))
        set_tensor(inp.seg_masks[0], build_mask(positions, n_kv))
        if inp.out_ids is not None:
            set_tensor(inp.out_ids, np.arange(n - n_out, n, dtype=np.int32))
        compute(backend, self.gf)
        return get_tensor(self.out), get_tensor(self.h_out)


def mtp_shape(slot: int, position: int, n: int, n_ctx: int) -> tuple[int, int, int, int]:
    """The key of an :class:`MtpGraph`: ``(slot, n, n_kv, n_out=1)`` for ``n`` rows at ``position``."""
    return slot, n, kv_length(position + n, n_ctx), 1


def mtp_step(stage, kv, position: int, accepted: list[int], states: np.ndarray, new_token: int,
             k: int) -> tuple[int, ...]:
    """The MTP block's part of one tail step (see the module's docstring): its cells for the kept rows
    ``accepted`` (token ids at ``position ..``, with their trunk states float32 ``[len(accepted), n_embd]``)
    and, with ``k`` > 0, up to ``k`` greedy drafts after ``new_token`` (the token sampled after them).

    The first row pairs with the state the session's previous step kept for ``position - 1`` (zeros at 0
    or when it has none: a session reopened from kept cells). Fewer drafts come back where the session
    cannot reserve the cells they write. Returns the draft token ids.
    """
    prev = kv.mtp_state[1] if kv.mtp_state is not None and kv.mtp_state[0] == position - 1 else None
    n_acc = len(accepted)
    if k and not stage.sessions.ensure(kv, position + n_acc + 1):
        k = 0
    tokens = list(accepted) + ([new_token] if k else [])
    logits, h = stage.mtp_rows(kv, position, tokens, states, prev)
    kv.mtp_state = (position + n_acc - 1, np.array(states[n_acc - 1], np.float32))
    if not k:
        return ()
    drafts = [int(np.argmax(logits))]
    pos = position + len(tokens)
    while len(drafts) < k and stage.sessions.ensure(kv, pos + 1):
        logits, h = stage.mtp_rows(kv, pos, [drafts[-1]], h[None][:0], h)
        drafts.append(int(np.argmax(logits)))
        pos += 1
    return tuple(drafts)
