"""Mat-mul weights in the CPU backend's repacked layout (as llama.cpp keeps them): 2-D Q4_0 weights and
expert stacks (Q4_0, MXFP4, Q4_K), only where this machine's repacked kernels give each row the bits it
gets alone, so batched, chunked and replayed rows keep their values."""

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


@pytest.fixture(scope="module")
def moe_dir(golden_dir):
    return golden_dir / "models-moe"


def _stage(path: str, repack: bool) -> GgmlStage:
    return GgmlStage(path, LayerRange(0, 4), n_threads=2, n_ctx=256, n_slots=6, repack=repack)


def test_the_probe_tells_expert_stacks_from_matrices(repack_here):
    """Q4_K is never a candidate for 2-D weights (its repacked GEMM rounds rows otherwise than its GEMV);
    for expert stacks the repacked mul_mat_id multiplies row by row, and the probe finds each candidate
    that passes keeping rows' bits on this machine."""
    buft = repack_here[1]
    assert ggml.GGML_TYPE_Q4_K not in cpu_repack.invariant_types(buft, "mul_mat")
    experts = cpu_repack.invariant_types(buft, "mul_mat_id")
    assert experts <= set(cpu_repack.CANDIDATE_TYPES["mul_mat_id"])
    backend = ggml.ggml_backend_cpu_init()
    try:
        ggml.ggml_backend_cpu_set_n_threads(backend, 2)
        for t in experts:  # the verdict holds at another size and thread count too: 64 rows, k = 512
            assert cpu_repack.rows_keep_their_bits(t, backend, buft, "mul_mat_id", k=512, rows=64)
    finally:
        ggml.ggml_backend_free(backend)


@pytest.mark.parametrize("name, moved", [("tiny-qwen3moe", {"ffn_down_exps"}),
                                         ("tiny-deepseek4", {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})])
def test_expert_stacks_are_repacked(repack_here, moe_dir, name, moved):
    """The golden MoE models' Q4_0 (qwen3moe's down experts) and MXFP4 (deepseek4's) expert stacks move;
    Q8_0 ones, with no repacked kernel here, stay."""
    stage = _stage(str(moe_dir / f"{name}.gguf"), True)
    try:
        experts = {n.split(".")[2] for n in stage.repacked if "_exps" in n}
        passing = cpu_repack.invariant_types(repack_here[1], "mul_mat_id")
        want = moved if {ggml.GGML_TYPE_Q4_0, ggml.GGML_TYPE_MXFP4} <= passing else experts
        assert experts == want
        assert len([n for n in stage.repacked if "_exps" in n]) == 4 * len(want)
    finally:
        stage.close()


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


@pytest.mark.parametrize("model", ["tiny-qwen2-q4_0", "models-moe/tiny-qwen3moe", "models-moe/tiny-deepseek4"])
def test_repacked_rows_are_batch_invariant_in_a_stage(repack_here, golden_dir, model):
    """Three sessions decoded together give each one the logits of its decode alone, bit for bit, and a
    chunked prefill the logits of the whole prompt at once (repacked matrices, and repacked experts)."""
    path = golden_dir / (model + ".gguf") if "/" in model else golden_dir / "models" / f"{model}.gguf"
    stage = _stage(str(path), True)
    try:
        if not stage.repacked:
            pytest.skip("nothing repacked on this CPU (see the test above)")
        _assert_batch_invariant(stage)
    finally:
        stage.close()


def _assert_batch_invariant(stage: GgmlStage) -> None:
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


@pytest.fixture(scope="module")
def q4_k_path(tmp_path_factory) -> str:
    """A 2-block llama of Q4_K matrices (256 wide: Q4_K's 256-value blocks), random weights with a
    planted next-token table (meshnet.bench.dense_model), Q8_0 output."""
    from meshnet.bench.dense_model import LlamaShapes, write_llama_model

    shapes = LlamaShapes(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_ctx=512)
    return str(write_llama_model(tmp_path_factory.mktemp("q4k") / "tiny-llama-q4_k.gguf", shapes, "q4_k"))


@pytest.fixture(scope="module")
def q4_k_deep_path(tmp_path_factory) -> str:
    """The same with 32 blocks: 224 products over row halves in one graph."""
    from meshnet.bench.dense_model import LlamaShapes, write_llama_model

    shapes = LlamaShapes(n_layer=32, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_ctx=512)
    return str(write_llama_model(tmp_path_factory.mktemp("q4k32") / "tiny-llama-32-q4_k.gguf", shapes, "q4_k"))


def _q4_k_stage(path: str, repack: bool, n_layer: int = 2) -> GgmlStage:
    return GgmlStage(path, LayerRange(0, n_layer), n_threads=2, n_ctx=256, n_slots=6, repack=repack)


def test_q4_k_matrices_become_stacks_of_their_row_halves(repack_here, q4_k_path):
    """Q4_K matrices, whose repacked mul_mat rounds batched rows otherwise, are kept as two-expert stacks
    of their halves of rows and multiplied row by row: batched and chunked rows keep their bits, and the
    greedy ids equal the plain layout's."""
    if ggml.GGML_TYPE_Q4_K not in cpu_repack.invariant_types(repack_here[1], "mul_mat_id"):
        pytest.skip("this CPU's repacked Q4_K mul_mat_id gives rows other bits in a batch")
    stage, plain = _q4_k_stage(q4_k_path, True), _q4_k_stage(q4_k_path, False)
    try:
        assert len(stage.repacked) == 14  # 7 matrices a block; the Q4_K embedding and Q8_0 output stay
        for name in stage.repacked:
            t = stage.weights.tensors[name]
            assert getattr(t, "row_halves", False)
            assert int(t.contents.ne[2]) == 2 and int(t.contents.ne[0]) in (256, 512)
        _assert_batch_invariant(stage)
        ids, logits = [], []
        for st in (stage, plain):
            kv = st.new_session(reserve_tokens=64)
            out = st.forward(kv, 0, token_ids=np.asarray(PROMPTS[0], np.int32))
            seq, rows = [int(np.argmax(out[-1]))], [out[-1]]
            for i in range(12):
                out = st.forward(kv, len(PROMPTS[0]) + i, token_ids=np.asarray(seq[-1:], np.int32))
                seq.append(int(np.argmax(out[-1])))
                rows.append(out[-1])
            ids.append(seq)
            logits.append(np.stack(rows))
        assert ids[0] == ids[1]
        # the same products summed in another order: measured 0.045 at most here
        assert float(np.abs(logits[0] - logits[1]).max()) < 0.25
    finally:
        stage.close()
        plain.close()


def test_loading_a_repacked_stage_keeps_ggml_debug_lines_off_stderr(repack_here, q4_0_path, capfd):
    stage = _stage(q4_0_path, True)
    stage.close()
    assert "repack tensor" not in capfd.readouterr().err


def test_a_deep_graph_has_room_for_its_row_halves_products(repack_here, q4_k_deep_path):
    """Each product over row halves adds tensors to its graph (a 32-block Q4_K model overflowed the graph's
    context before graphs counted them): all 224 matrices repacked, and batched decodes still equal alone."""
    if ggml.GGML_TYPE_Q4_K not in cpu_repack.invariant_types(repack_here[1], "mul_mat_id"):
        pytest.skip("this CPU's repacked Q4_K mul_mat_id gives rows other bits in a batch")
    stage = _q4_k_stage(q4_k_deep_path, True, n_layer=32)
    try:
        assert len(stage.repacked) == 224
        _assert_batch_invariant(stage)
    finally:
        stage.close()
