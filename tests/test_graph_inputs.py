"""A decode graph's inputs: the masks' rows, and inputs written in place in host memory (real model)."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.contract import LayerRange
from meshnet.engine.batch_layout import MASK_ROW_PAD, decode_mask, write_decode_rows
from meshnet.engine.ggml_stage import BatchItem, GgmlStage


def test_decode_mask_rows_see_their_positions_and_window():
    mask = decode_mask([(2, 5), (0, 9)], n_streams=4, n_kv=16, n_swa=4)
    assert mask.shape == (4, 1, MASK_ROW_PAD, 16) and mask.dtype == np.float16
    visible = {s: np.flatnonzero(mask[s, 0, 0] == 0).tolist() for s in range(4)}
    assert visible == {0: [6, 7, 8, 9], 1: [], 2: [2, 3, 4, 5], 3: []}
    assert np.isneginf(mask[:, 0, 1:]).all()  # padding rows see nothing
    # rewriting in place leaves no trace of the rows before
    write_decode_rows(mask, [(1, 3)])
    assert [np.flatnonzero(mask[s, 0, 0] == 0).tolist() for s in range(4)] == [[], [0, 1, 2, 3], [], []]


def test_inputs_are_written_in_place_and_give_the_same_logits(smollm2_path):
    """On the CPU a placed decode graph writes its inputs through views of the compute buffer; the logits
    are the bits a graph fed through ggml gives, and a wrong-sized input is refused, naming the sizes."""
    stage = GgmlStage(str(smollm2_path), LayerRange(0, 30), n_threads=2, n_ctx=256, n_slots=2)
    kv = stage.new_session(reserve_tokens=40)
    stage.forward(kv, 0, token_ids=np.arange(100, 112, dtype=np.int32))
    item = BatchItem(kv.slot, 12, np.asarray([700], dtype=np.int32))
    in_place = stage.forward_batch([item])[0]
    shape, _, _ = stage.shape_of([item])
    g = stage._graph(shape)
    assert set(g._views) >= {"tokens", "pos", "kv_idx", "dec_mask"}
    assert (int(g._views["pos"][0]), int(g._views["kv_idx"][0])) == (12, kv.slot * 256 + 12)
    views, g._views = g._views, {}  # the same graph, its inputs set through ggml
    try:
        through_ggml = g.run(stage.backend, [(kv.slot, 12)], [], np.asarray([700], dtype=np.int32), None)
    finally:
        g._views = views
    np.testing.assert_array_equal(in_place, through_ggml)
    with pytest.raises(ValueError, match="ggml wants 1 values, got 2"):
        g.run(stage.backend, [(kv.slot, 12)], [], np.asarray([700, 701], dtype=np.int32), None)
    with pytest.raises(ValueError, match="ggml wants 1 decode rows, got 2"):
        g.run(stage.backend, [(kv.slot, 12), (kv.slot, 13)], [], np.asarray([700], dtype=np.int32), None)
    kv.free()
    stage.close()
