"""Q4_0 mat-mul weights in the CPU backend's repacked layout (as llama.cpp keeps them): only where this
machine's repacked kernels give each row the bits it gets alone, so batched, chunked and replayed rows
keep their values; the golden Q4_0 model still gives llama.cpp's ids."""

from __future__ import annotations

import ggml
import numpy as np
import pytest

from meshnet.contract import LayerRange
from meshnet.engine import cpu_repack
from meshnet.engine.ggml_stage import BatchItem, GgmlStage

QWEN2_Q4_0 = "tiny-qwen2-q4_0"
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42], [100, 7, 100, 7, 100, 7, 100, 7, 100, 7, 9])


@pytest.fixture(scope="module")
def repack_here():
    found = cpu_repack.repack_buffer_type()
    if found is None:
        pytest.skip("this ggml's CPU backend has no CPU_REPACK buffer type")
    return found


@pytest.fixture(scope="module")
def q4_0_path(golden_dir) -> str:
    return str(golden_dir / "models" / f"{QWEN2_Q4_0}.gguf")


def _stage(path: str, repack: bool) -> GgmlStage:
    return GgmlStage(path, LayerRange(0, 4), n_threads=2, n_ctx=256, n_slots=6, repack=repack)


def test_q4_0_weights_are_repacked_where_rows_keep_their_bits(repack_here, q4_0_path):
    stage = _stage(q4_0_path, True)
    try:
        if ggml.GGML_TYPE_Q4_0 not in cpu_repack.invariant_types(repack_here[1]):
            assert stage.repacked == []  # this CPU's repacked kernels change rows' bits: none moved
            pytest.skip("this CPU's repacked Q4_0 kernels give rows other bits in a batch: not repacked")
        # every 2-D Q4_0 mat-mul weight of the 4 blocks; the token embedding (get_rows) and the tied or
        # Q8_0 output stay as stored
        assert len(stage.repacked) == 28
        assert {n.split(".")[2] for n in stage.repacked} == {"attn_q", "attn_k", "attn_v", "attn_output",
                                                             "ffn_gate", "ffn_up", "ffn_down"}
        assert "token_embd.weight" not in stage.repacked
    finally:
        stage.close()
    plain = _stage(q4_0_path, False)
    try:
        assert plain.repacked == []
    finally:
        plain.close()


def test_repacked_rows_are_batch_invariant_in_a_stage(repack_here, q4_0_path):
    """Three sessions decoded together give each one the logits of its decode alone, bit for bit, and a
    chunked prefill the logits of the whole prompt at once."""
    stage = _stage(q4_0_path, True)
    try:
        if not stage.repacked:
            pytest.skip("nothing repacked on this CPU (see the test above)")
        kvs, last = [], []
        for p in PROMPTS:
            kv = stage.new_session(reserve_tokens=64)
            out = stage.forward(kv, 0, token_ids=np.asarray(p, np.int32))
            kvs.append(kv)
            last.append(int(np.argmax(out[-1])))
        alone = [stage.forward_batch([BatchItem(kv.slot, len(p), np.asarray([t], np.int32))])[0]
                 for kv, p, t in zip(kvs, PROMPTS, last)]
        # the same cells again, now in one batch (each decode rewrites its own position)
        together = stage.forward_batch([BatchItem(kv.slot, len(p), np.asarray([t], np.int32))
                                        for kv, p, t in zip(kvs, PROMPTS, last)])
        for a, b in zip(alone, together):
            assert a.tobytes() == b.tobytes()
        whole = stage.new_session(reserve_tokens=64)
        chunked = stage.new_session(reserve_tokens=64)
        p = np.asarray(PROMPTS[2], np.int32)
        at_once = stage.forward(whole, 0, token_ids=p)
        stage.forward(chunked, 0, token_ids=p[:5])
        rest = stage.forward(chunked, 5, token_ids=p[5:])
        assert rest[-1].tobytes() == at_once[-1].tobytes()
    finally:
        stage.close()


def test_loading_a_repacked_stage_keeps_ggml_debug_lines_off_stderr(repack_here, q4_0_path, capfd):
    stage = _stage(q4_0_path, True)
    stage.close()
    assert "repack tensor" not in capfd.readouterr().err
