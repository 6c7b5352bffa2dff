"""DeepSeek-V4 (deepseek4): the tiny golden model's configuration and tensor table load, the engine's pool
holds its compressed-cache state, hash routing, the declared token-id need and the hyper-connection
boundary shape."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import moe_model_path
from meshnet.contract import ArtifactId, LayerRange, NamedTensor, Status, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine
from meshnet.engine.ggml_engine import GgmlEngine
from meshnet.model.arch_manifest import check_tensors
from meshnet.model.gguf_file import GGUFError, open_gguf
from meshnet.model.hparams import ModelConfig

DEEPSEEK4 = "tiny-deepseek4"


@pytest.fixture(scope="module")
def v4_path():
    return moe_model_path(DEEPSEEK4)


@pytest.fixture(scope="module")
def v4_cfg(v4_path) -> ModelConfig:
    return ModelConfig.from_reader(open_gguf(v4_path))


def _tensors(path) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(d) for d in t.shape) for t in open_gguf(path).tensors}


def test_config_of_the_tiny_model(v4_cfg):
    """The values the golden README lists for tiny-deepseek4."""
    v4 = v4_cfg.dsv4
    assert (v4_cfg.n_layer, v4_cfg.n_embd, v4_cfg.n_head, v4_cfg.n_head_kv, v4_cfg.head_dim) == (4, 64, 4, 1, 128)
    assert (v4_cfg.n_rot, v4_cfg.n_swa, v4_cfg.n_lora_q, v4_cfg.expert_gating_func) == (16, 32, 32, 4)
    assert (v4_cfg.n_expert, v4_cfg.n_expert_used, v4_cfg.n_expert_shared) == (16, 4, 1)
    assert (v4_cfg.expert_weights_scale, v4_cfg.expert_weights_norm) == (1.5, True)
    assert (v4.n_hc, v4.sinkhorn_iters, v4.n_hash_layers, v4.compress_ratios) == (4, 20, 3, (0, 0, 4, 128))
    assert (v4.o_groups, v4.o_lora_rank, v4.indexer_n_head, v4.indexer_head_dim, v4.indexer_top_k) == \
        (2, 32, 16, 64, 8)
    assert v4.swiglu_clamp_exp == v4.swiglu_clamp_shexp == (1.5,) * 4
    # what crosses a stage boundary: 4 streams of n_embd per token
    assert v4_cfg.residual_shape == (4, 64) and v4_cfg.manifest.residual == "dsv4.hc_dim" and v4.hc_dim == 256


def test_stages_with_hash_routed_blocks_need_token_ids(v4_cfg):
    """Blocks 0-2 pick experts by token id: a stage starting at 0, 1 or 2 needs them, one starting at 3
    only the hidden states."""
    assert [v4_cfg.needs_token_ids(LayerRange(s, 4)) for s in range(4)] == [True, True, True, False]


def test_manifest_tensors_by_block(v4_path, v4_cfg):
    tensors = _tensors(v4_path)
    check_tensors(v4_cfg.manifest, v4_cfg, tensors.items())
    # hash-routed blocks hold ffn_gate_tid2eid [n_expert_used, n_vocab], the others exp_probs_b
    assert tensors["blk.2.ffn_gate_tid2eid.weight"] == (4, 49152) and "blk.3.exp_probs_b.bias" in tensors
    for drop in ("blk.1.ffn_gate_tid2eid.weight", "blk.3.exp_probs_b.bias", "blk.2.indexer.proj.weight",
                 "blk.3.attn_compressor_ape.weight", "output_hc_fn.weight", "blk.0.hc_ffn_scale.weight"):
        with pytest.raises(GGUFError, match=f"deepseek4 GGUF is missing tensor '{drop}'"):
            check_tensors(v4_cfg.manifest, v4_cfg, [(n, d) for n, d in tensors.items() if n != drop])
    # a ratio-128 block has no indexer; a ratio-0 block no compressor
    for extra in ("blk.3.indexer.proj.weight", "blk.0.attn_compressor_kv.weight"):
        with pytest.raises(GGUFError, match=f"deepseek4 GGUF has unexpected tensor '{extra}'"):
            check_tensors(v4_cfg.manifest, v4_cfg, list(tensors.items()) + [(extra, (64, 16))])
    # the ratio-4 compressor is two heads wide, the ratio-128 one a head
    with pytest.raises(GGUFError, match=r"'blk.2.attn_compressor_kv.weight' has shape \[64, 128\], expected "
                                        r"\[64, 256\] \(n_embd, dsv4.comp_csa\)"):
        check_tensors(v4_cfg.manifest, v4_cfg, dict(tensors, **{"blk.2.attn_compressor_kv.weight": (64, 128)}).items())


def test_engine_loads_it_and_its_pool_holds_the_v4_state(v4_path):
    """The engine runs deepseek4: one K=V cell per token and block (no V tensor), and beside it on the
    compressed blocks the compressor's F32 cells per token and its F16 compressed rows per block (ratio 4
    also the indexer's), reserved and released with the session's cells."""
    eng = GgmlEngine()
    out = eng.load(LoadSpec(str(v4_path), ArtifactId("", LayerRange(0, 4))))
    assert out.status is Status.OK, out.message
    pool = eng.stage.pool
    assert pool.v == {} and sorted(pool.k) == [0, 1, 2, 3]
    assert sorted(pool.aux) == [(2, "comp"), (2, "lid"), (2, "lid_state_kv"), (2, "lid_state_score"),
                                (2, "state_kv"), (2, "state_score"), (3, "comp"), (3, "state_kv"),
                                (3, "state_score")]
    n_ctx = eng.stage.n_ctx
    # compressed rows: one per 4 (128) positions of each slot, plus the scratch row
    assert int(pool.aux[2, "comp"].contents.ne[1]) == pool.n_slots * n_ctx // 4 + 1
    assert int(pool.aux[3, "comp"].contents.ne[1]) == pool.n_slots * -(-n_ctx // 128) + 1
    # per token: 4 F16 K cells of 128, compressor cells of 2 x 256 + 2 x 128 (block 2) and 2 x 128
    # (block 3) F32, and the compressed rows' share
    assert pool.bytes_per_token == 4 * 2 * 128 + 4 * (512 + 256 + 256) + 2 * 128 // 4 + 2 * 64 // 4 + 2 * 128 // 128
    eng.stage.close()


def _host_graph(tensors: dict, inputs: dict, build):
    """Run ``build(ctx, gf, t)`` on a host ggml context holding ``tensors`` (GGUF ReaderTensors, their
    stored bytes) and ``inputs`` (name -> (ggml type, numpy array in ggml order reversed)); returns the
    float32 result ``(ne1, ne0)``."""
    import ctypes

    import ggml
    import numpy as np

    from meshnet.engine.ggml_backend import new_tensor

    nbytes = sum(int(t.n_bytes) for t in tensors.values()) + sum(a.nbytes for _, a in inputs.values())
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=nbytes + (64 << 20), mem_buffer=None, no_alloc=False))
    try:
        held = {}
        for name, t in tensors.items():
            shape = tuple(int(d) for d in t.shape)
            held[name] = new_tensor(ctx, int(t.tensor_type), shape)
            raw = np.ascontiguousarray(t.data).view(np.uint8)
            ctypes.memmove(held[name].contents.data, raw.ctypes.data, raw.nbytes)
        for name, (gtype, a) in inputs.items():
            a = np.ascontiguousarray(a)
            held[name] = new_tensor(ctx, gtype, tuple(reversed(a.shape)))
            ctypes.memmove(held[name].contents.data, a.ctypes.data, a.nbytes)
        gf = ggml.ggml_new_graph_custom(ctx, 1024, False)
        out = build(ctx, gf, held)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, 1)
        res = np.empty((int(out.contents.ne[1]), int(out.contents.ne[0])), np.float32)
        ctypes.memmove(res.ctypes.data, out.contents.data, res.nbytes)
        return res
    finally:
        ggml.ggml_free(ctx)


def _reference_moe(t: dict, x: np.ndarray, experts: np.ndarray, cfg: ModelConfig, limit: float) -> np.ndarray:
    """float64 routed experts of one V4 block (make_moe_goldens.py's deepseek4 FFN without the shared
    expert): sqrt(softplus(router)) of the given experts, renormalised, times expert_weights_scale, each
    expert's clamped SwiGLU."""
    from gguf.quants import dequantize

    def w(name):
        r = t[name]
        return dequantize(r.data, r.tensor_type).astype(np.float64)

    router = w("ffn_gate_inp")                                   # (n_expert, n_embd)
    gate, up, down = w("ffn_gate_exps"), w("ffn_up_exps"), w("ffn_down_exps")   # (n_expert, out, in)
    out = np.zeros_like(x, dtype=np.float64)
    for i, row in enumerate(x.astype(np.float64)):
        logits = router @ row
        probs = np.sqrt(np.logaddexp(0.0, logits))
        wts = probs[experts[i]]
        wts = wts / wts.sum() * cfg.expert_weights_scale
        for e, we in zip(experts[i], wts):
            g, u = np.minimum(gate[e] @ row, limit), np.clip(up[e] @ row, -limit, limit)
            out[i] += we * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_hash_routed_experts_follow_the_token_ids(v4_path, v4_cfg):
    """Block 0's routed experts on ggml (build_moe_ffn with the tokens' ffn_gate_tid2eid rows as the
    selection) against a float64 pass with the same experts: within MXFP4/Q8 activation rounding; and
    far from the result of routing every token as token 0 (what a stage without token ids would do)."""
    import ggml
    import numpy as np

    from meshnet.engine.ggml_moe import build_moe_ffn

    reader = open_gguf(v4_path)
    names = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_tid2eid")
    t = {n: next(r for r in reader.tensors if r.name == f"blk.0.{n}.weight") for n in names}
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, v4_cfg.n_embd)).astype(np.float32)
    tokens = np.array([504, 3, 17000, 42, 49151], np.int32)
    tid2eid = np.asarray(t["ffn_gate_tid2eid"].data).reshape(v4_cfg.n_vocab, v4_cfg.n_expert_used)
    limit = v4_cfg.dsv4.swiglu_clamp_exp[0]

    def build(ctx, gf, h):
        selected = ggml.ggml_get_rows(ctx, h["ffn_gate_tid2eid"], h["tokens"])   # I32 [k, n_tokens]
        return build_moe_ffn(ctx, gf, h["x"], h["ffn_gate_inp"], h["ffn_up_exps"], h["ffn_gate_exps"],
                             h["ffn_down_exps"], v4_cfg.n_expert_used, v4_cfg.expert_weights_norm,
                             v4_cfg.expert_weights_scale, v4_cfg.expert_gating_func, selected=selected,
                             swiglu_limit=limit)

    got = _host_graph(t, {"x": (ggml.GGML_TYPE_F32, x), "tokens": (ggml.GGML_TYPE_I32, tokens)}, build)
    want = _reference_moe(t, x, tid2eid[tokens], v4_cfg, limit)
    as_token0 = _reference_moe(t, x, tid2eid[np.zeros(5, np.int64)], v4_cfg, limit)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.025 * scale  # measured 0.0067 of 0.42
    assert np.abs(as_token0 - want).max() > 0.2 * scale


class _HashRoutedFake(FakeEngine):
    """The fake engine declaring what a non-head stage of a V4 model declares: a residual of 4 streams
    and hash-routed blocks (the ggml engine fills both from the model's configuration)."""

    def _load(self, spec):
        return replace(super()._load(spec), residual_dims=(4, 8), needs_token_ids=True)


def test_a_hash_routed_stage_refuses_steps_without_token_ids_or_of_the_wrong_width():
    eng = _HashRoutedFake()
    assert eng.load(LoadSpec("fake", ArtifactId("", LayerRange(1, 4)))).ok
    assert eng.capabilities().hidden_row_shape == (4, 8)
    rows = NamedTensor.from_numpy("hidden", np.zeros((3, 4, 8), np.float32))
    out = eng.prefill(StepRequest("s", 0, 0, (), hidden=rows))
    assert out.status is Status.INVALID_ARGUMENT
    assert out.message == ("stage 1:4 picks experts by token id (hash-routed blocks) and the step carries "
                           "hidden states of shape (3, 4, 8) without their token ids")
    out = eng.prefill(StepRequest("s", 0, 0, (5, 6), hidden=rows))
    assert out.status is Status.INVALID_ARGUMENT
    assert out.message == ("hidden states have shape (3, 4, 8), expected (2, 4, 8) for 2 tokens: this stage "
                           "picks experts by token id (hash-routed blocks) and needs one token id per row")
    flat = NamedTensor.from_numpy("hidden", np.zeros((3, 8), np.float32))  # one stream: not V4's residual
    out = eng.prefill(StepRequest("s", 0, 0, (5, 6, 7), hidden=flat))
    assert out.status is Status.INVALID_ARGUMENT and "expected (3, 4, 8) for 3 tokens" in out.message


def test_capabilities_over_grpc_declare_the_residual_shape_and_the_token_id_need():
    from meshnet.node.service import NodeService
    from meshnet.proto import meshnet_pb2 as pb

    eng = _HashRoutedFake()
    assert eng.load(LoadSpec("fake", ArtifactId("", LayerRange(1, 4)))).ok
    caps = NodeService(eng, "mid", pb.ModelIdentity(sha256="x")).GetCapabilities(pb.Empty(), None)
    assert list(caps.residual_dims) == [4, 8] and caps.needs_token_ids


def test_the_envelope_carries_the_hyper_connection_residual_and_token_ids_across_frames():
    """A V4 boundary activation [n_tokens, 4, n_embd] (tiny-deepseek4's widths, split over several
    frames) comes back with its shape, bytes and the step's token ids: what a forwarding node re-sends
    (``replace(req, hidden=...)``) and a relay passes on as frames."""
    from meshnet.wire.envelope import frames_to_request, request_to_frames

    rows = np.arange(3 * 4 * 64, dtype=np.float32).reshape(3, 4, 64)
    req = StepRequest("s", 2, 5, (11, 12, 13), hidden=NamedTensor.from_numpy("hidden", rows))
    frames = request_to_frames(req, False, max_frame=1000)
    assert len(frames) == 4  # 3072 bytes in frames of 1000
    back, decode = frames_to_request(frames)
    assert not decode and back.token_ids == (11, 12, 13) and back.hidden.shape == (3, 4, 64)
    assert np.array_equal(back.hidden.to_numpy(), rows)


def _v4_stage(v4_path, layers=LayerRange(0, 4)):
    from golden_check import cpu_stage

    return cpu_stage(v4_path, layers)


def test_rollback_rewrites_the_compressed_state(v4_path):
    """Rows past a rollback point leave compressor cells and compressed rows behind (here garbage tokens
    at 120..139 complete block 0 of the ratio-128 cache and five ratio-4 blocks); re-running the real
    tokens from 120 rewrites them, and the logits equal a fresh session's bit for bit."""
    from conftest import load_golden

    ids = np.asarray(load_golden(DEEPSEEK4)["prompts"][1]["prompt_ids"], np.int32)  # 157 tokens
    st = _v4_stage(v4_path)
    fresh = st.new_session()  # the same calls without the detour
    st.forward(fresh, 0, token_ids=ids[:120])
    want = st.forward(fresh, 120, token_ids=ids[120:], all_logits=True)
    fresh.free()
    kv = st.new_session()
    st.forward(kv, 0, token_ids=ids[:120])
    st.forward(kv, 120, token_ids=np.arange(1000, 1020, dtype=np.int32))
    got = st.forward(kv, 120, token_ids=ids[120:], all_logits=True)
    np.testing.assert_array_equal(got, want)
    st.close()


def test_two_layers_match_the_float64_reference_per_stream(v4_path, golden_dir):
    """Blocks 0-1 (hash-routed, uncompressed: window attention with sinks) on the 157-token prompt against
    make_moe_goldens.py's float64 pass: every stream of every row within 1% of the residual's largest
    value (the MXFP4/Q8_0 experts quantize their activations to 8 bits, the reference does not)."""
    import sys
    import types

    from conftest import load_golden

    sys.modules.setdefault("llama_cpp", types.SimpleNamespace(Llama=None))  # only its runs need llama.cpp
    sys.path.insert(0, str(golden_dir))
    try:
        import make_moe_goldens as mmg
    finally:
        sys.path.pop(0)
    ids = np.asarray(load_golden(DEEPSEEK4)["prompts"][1]["prompt_ids"], np.int32)
    ref = mmg.MoERef(str(v4_path))
    ref.L = 2
    streams = []
    post = ref.hc_post
    ref.hc_post = lambda *a: streams.append(post(*a)) or streams[-1]
    ref.forward_deepseek4(ids)
    st = _v4_stage(v4_path, LayerRange(0, 2))
    out = st.forward(st.new_session(), 0, token_ids=ids)
    st.close()
    assert out.shape == streams[-1].shape == (157, 4, 64)
    dev = np.abs(out - streams[-1]).max(axis=(0, 2)) / np.abs(streams[-1]).max()
    assert (dev < 0.01).all(), dev
