"""How one iteration's tokens are laid out for the graph: its shape (which graphs can be reused), the
sessions' segments, and the attention masks (pure numpy; nothing here touches ggml memory).

Rows go decode rows first, then each segment's rows. Masks are in numpy order (ggml's reversed) and
float16 0 / -inf, as llama.cpp builds them (``llm_graph_input_attn_kv::set_input``).
"""

from __future__ import annotations

from dataclasses import dataclass

import ggml
import numpy as np

# llama.cpp pads the KV length the attention reads to 256 cells (llama_kv_cache::get_padding) and the
# mask's rows to GGML_KQ_MASK_PAD; we do the same so the kernels see the same shapes.
KV_PAD = 256
MASK_ROW_PAD = int(ggml.GGML_KQ_MASK_PAD)
# ggml's CPU flash attention takes another path for one query row of one stream over at least this many
# cells (``use_split_kv_path`` in ops.cpp: the cells are split across threads and the partial softmaxes
# merged), which rounds differently from the path rows of a multi-stream call take. llama.cpp decoding a
# session alone takes it, so a decode row that reads this many cells is attended on its own, as it
# would be alone, never inside the multi-stream decode call.
SPLIT_KV_MIN_CELLS = 512
# ... and tiles the query rows of a call that has at least this many (GGML_FA_TILE_Q), again rounding
# differently from the row-by-row path that calls with fewer rows take.
FA_TILE_ROWS = 64


def pad_to(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def kv_length(n_past_after: int, n_ctx: int) -> int:
    """Cells attention reads after a step that ends with ``n_past_after`` cached tokens."""
    return min(n_ctx, pad_to(n_past_after, KV_PAD))


def decode_mask(decodes: list[tuple[int, int]], n_streams: int, n_kv: int, n_swa: int = 0) -> np.ndarray:
    """Mask ``[n_streams, 1, MASK_ROW_PAD, n_kv]`` (numpy order) of 0 / -inf in float16 for decode rows
    attended a stream per slot: stream ``slot``'s first row sees cells ``j <= position`` (within the
    window if ``n_swa``); every other row, and every stream without a decode row, sees nothing."""
    mask = np.full((n_streams, 1, MASK_ROW_PAD, n_kv), -np.inf, dtype=np.float16)
    write_decode_rows(mask, decodes, n_swa)
    return mask


def write_decode_rows(mask: np.ndarray, decodes: list[tuple[int, int]], n_swa: int = 0) -> None:
    """Write the first row of every stream of a decode ``mask`` (float16 ``[n_streams, 1, rows, n_kv]``,
    numpy order) in place, as :func:`decode_mask` has it; the other rows are left as they are (a stream's
    one query reads only its first)."""
    first = mask[:, 0, 0, :]
    first.fill(-np.inf)
    for slot, p in decodes:
        first[slot, max(0, p - n_swa + 1) if n_swa else 0:p + 1] = 0.0


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


@dataclass(frozen=True)
class Segment:
    """One session's tokens in an iteration, attended on their own: rows ``[row, row + n_tokens)`` of the
    batch, at positions ``position ..`` of the session in pool slot ``slot``, reading ``n_kv`` cells;
    on the tail the last ``n_out`` rows give logits."""

    slot: int
    position: int
    n_tokens: int
    n_kv: int
    n_out: int = 1


@dataclass(frozen=True)
class BatchShape:
    """What a graph is built for: ``n_dec`` decode rows first (one token each, of sessions in slots below
    ``dec_streams``, attended together over ``n_kv_dec`` cells per slot), then the segments' rows.

    Graphs with the same shape are the same graph: only their inputs differ, so decode graphs are reused
    across iterations whatever sessions fill them (llama.cpp reuses graphs the same way when the ubatch's
    shape has not changed)."""

    n_dec: int = 0
    dec_streams: int = 0
    n_kv_dec: int = 0
    segments: tuple[tuple[int, int, int, int], ...] = ()  # (slot, n_tokens, n_kv, n_out) per segment

    @property
    def dec_in_order(self) -> bool:
        """Whether the decode rows are the streams in order (row ``i`` in slot ``i``): true when every
        stream has a row, the rows being sorted by slot (:meth:`GgmlStage.shape_of` sorts them). Then
        the graph reads the rows as the streams directly, without gathering them into stream order and
        scattering the results back (two ``get_rows`` nodes a layer)."""
        return self.n_dec == self.dec_streams

    @property
    def n_tokens(self) -> int:
        return self.n_dec + sum(seg[1] for seg in self.segments)

    @property
    def n_out(self) -> int:
        return self.n_dec + sum(seg[3] for seg in self.segments)
