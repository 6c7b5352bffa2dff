"""One table per architecture: which tensors its GGUF holds, and which layer function builds its graph.

Pure data plus one check. The tensor lists follow llama.cpp's loaders (``load_arch_tensors`` in
src/models/<arch>.cpp: a tensor loaded without ``TENSOR_NOT_REQUIRED`` is required here), restricted to
what this engine's graph reads; gguf-py's ``MODEL_TENSORS`` table lists every tensor an architecture
may have, and each kind here is one of those (a test checks it). A file is checked against its manifest
when its :class:`~meshnet.model.hparams.ModelConfig` is read, so a missing, unexpected or misshaped
tensor is refused at load with its name, before any stage hands ggml a tensor that is not there.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Iterable

import gguf

from meshnet.model.gguf_file import GGUFError, tensor_name

T = gguf.MODEL_TENSOR

# RoPE styles (llama.cpp ``llama_model_rope_type``): NORM rotates adjacent pairs, NEOX the two halves.
ROPE_NORM, ROPE_NEOX = 0, 2


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a layer (``blk.{i}.<name>.<suffix>``) or of the whole model.

    Attributes:
        kind: gguf's name for it (its GGUF name comes from ``gguf.TENSOR_NAMES``), or for a tensor gguf
            does not know (deepseek4's) its GGUF name pattern from llama-arch.cpp, ``blk.{bid}.<name>``.
        suffix: ``weight`` or ``bias``.
        required: refuse a file without it; an optional one is used when present.
        shape: expected dims in ggml order (ne0 first), each the name of a ``ModelConfig`` attribute
            (dotted: ``dsv4.hc_dim``); None: not checked (fused tensors whose size is a sum).
        when: the name of a boolean ``ModelConfig`` attribute; the tensor belongs to the file only when
            it is true (``has_q_lora``: q-LoRA instead of a plain ``attn_q``). None: always.
        blocks: which blocks hold it: ``all``, ``lead`` (the first ``n_layer_dense_lead``, whose FFN is
            dense) or ``moe`` (the others); DeepSeek-V4's ``hash`` / ``routed`` (hash-routed blocks or
            not), ``csa`` / ``hca`` (compression ratio 4 / 128).
    """

    kind: T | str
    suffix: str = "weight"
    required: bool = True
    shape: tuple[str, ...] | None = None
    when: str | None = None
    blocks: str = "all"

    def name(self, layer: int | None = None) -> str:
        if isinstance(self.kind, str):
            return (self.kind.format(bid=layer) if layer is not None else self.kind) + "." + self.suffix
        return tensor_name(self.kind, layer, self.suffix)

    def applies(self, cfg, layer: int | None = None) -> bool:
        """Whether a file of ``cfg`` has this tensor (in block ``layer``)."""
        if self.when is not None and not getattr(cfg, self.when):
            return False
        if layer is None or self.blocks == "all":
            return True
        return _BLOCKS[self.blocks](cfg, layer)


# Which blocks a TensorSpec's ``blocks`` selects (cfg, layer) -> bool.
_BLOCKS = {
    "lead": lambda cfg, il: il < getattr(cfg, "n_layer_dense_lead", 0),
    "moe": lambda cfg, il: il >= getattr(cfg, "n_layer_dense_lead", 0),
    "hash": lambda cfg, il: cfg.dsv4.is_hash(il),
    "routed": lambda cfg, il: not cfg.dsv4.is_hash(il),
    "csa": lambda cfg, il: cfg.dsv4.ratio(il) == 4,
    "hca": lambda cfg, il: cfg.dsv4.ratio(il) == 128,
}


def _w(kind: T, *shape: str) -> TensorSpec:
    return TensorSpec(kind, "weight", True, shape or None)


def _opt_b(kind: T, *shape: str) -> TensorSpec:
    return TensorSpec(kind, "bias", False, shape or None)


@dataclass(frozen=True)
class ArchManifest:
    """How one GGUF architecture maps onto this engine.

    Attributes:
        name: ``general.architecture``.
        gguf_arch: the architecture in gguf-py's tables (``MODEL_TENSORS``).
        rope_type: ROPE_NORM or ROPE_NEOX.
        layer: the function that builds a block (``engine.ggml_layers.LAYERS``: ``layer_<layer>``).
        ffn: ``dense`` (SwiGLU / GeGLU on ffn_gate/up/down) or ``moe`` (routed experts,
            ``engine.ggml_moe``).
        layer_tensors: the tensors of the blocks (each spec says which blocks, and under which
            hyper-parameters, it applies to).
        global_tensors: the tensors outside the blocks; the head reads ``token_embd``, the tail
            ``output_norm`` and ``output`` (``token_embd`` again when ``output`` is absent: tied).
        moe_norm_weights: MoE only: renormalise the k routing weights to sum to 1 (llama.cpp's
            ``norm_w`` argument of ``build_moe_ffn``) where the architecture's graph fixes it (deepseek2
            reads it from the file: ``ModelConfig.expert_weights_norm``).
        token_id_blocks: the ``blocks`` selector of the blocks that need the step's token ids besides
            the head's embedding (deepseek4: ``hash``); None: none do.
        residual: how wide the residual stream, the activation between stages, is per token: ``n_embd``
            or ``dsv4.hc_dim`` (``ModelConfig.residual_shape`` gives its dims).
        not_run: why this engine loads the file's configuration but cannot run its graph yet (one
            line); empty: it runs.
    """

    name: str
    gguf_arch: gguf.MODEL_ARCH | None
    rope_type: int
    layer: str
    ffn: str
    layer_tensors: tuple[TensorSpec, ...]
    global_tensors: tuple[TensorSpec, ...]
    moe_norm_weights: bool = False
    token_id_blocks: str | None = None
    residual: str = "n_embd"
    not_run: str = ""

    @property
    def is_moe(self) -> bool:
        return self.ffn == "moe"


_GLOBAL = (
    _w(T.TOKEN_EMBD),  # [n_embd, n_vocab]; not shape-checked: some files pad the vocabulary
    _w(T.OUTPUT_NORM, "n_embd"),
    TensorSpec(T.OUTPUT, required=False),
)
_ATTN = (
    _w(T.ATTN_NORM, "n_embd"),
    _w(T.ATTN_Q, "n_embd", "n_embd_q"),
    _w(T.ATTN_K, "n_embd", "n_embd_k_gqa"),
    _w(T.ATTN_V, "n_embd", "n_embd_v_gqa"),
    _w(T.ATTN_OUT, "n_embd_o", "n_embd"),
    # llama.cpp's create_tensor_qkv loads these biases for every architecture when present.
    _opt_b(T.ATTN_Q, "n_embd_q"),
    _opt_b(T.ATTN_K, "n_embd_k_gqa"),
    _opt_b(T.ATTN_V, "n_embd_v_gqa"),
)
_QK_NORM = (_w(T.ATTN_Q_NORM, "head_dim"), _w(T.ATTN_K_NORM, "head_dim"))
_FFN_MATS = (
    _w(T.FFN_GATE, "n_embd", "n_ff"),
    _w(T.FFN_UP, "n_embd", "n_ff"),
    _w(T.FFN_DOWN, "n_ff", "n_embd"),
)
_FFN = (_w(T.FFN_NORM, "n_embd"),) + _FFN_MATS
_MOE = (
    _w(T.FFN_NORM, "n_embd"),
    _w(T.FFN_GATE_INP, "n_embd", "n_expert"),
    _w(T.FFN_GATE_EXP, "n_embd", "n_ff_exp", "n_expert"),
    _w(T.FFN_UP_EXP, "n_embd", "n_ff_exp", "n_expert"),
    _w(T.FFN_DOWN_EXP, "n_ff_exp", "n_embd", "n_expert"),
)


def _ds(kind: T | str, *shape: str, when: str | None = None, blocks: str = "all", suffix: str = "weight",
        required: bool = True) -> TensorSpec:
    return TensorSpec(kind, suffix, required, shape, when, blocks)


# DeepSeek-V2/V3 (llama_model_deepseek2::load_arch_tensors, absorbed MLA): attention with an optional
# q-LoRA, the KV latent projection, and the per-head absorbed K and V decompressions; dense FFNs in the
# leading blocks, routed experts with a selection bias and shared experts in the others.
_DEEPSEEK2 = (
    _ds(T.ATTN_NORM, "n_embd"),
    _ds(T.ATTN_Q_A, "n_embd", "n_lora_q", when="has_q_lora"),
    _ds(T.ATTN_Q_A_NORM, "n_lora_q", when="has_q_lora"),
    _ds(T.ATTN_Q_B, "n_lora_q", "n_embd_q_mla", when="has_q_lora"),
    _ds(T.ATTN_Q, "n_embd", "n_embd_q_mla", when="no_q_lora"),
    _ds(T.ATTN_KV_A_MQA, "n_embd", "n_embd_k_cache"),
    _ds(T.ATTN_KV_A_NORM, "n_lora_kv"),
    _ds(T.ATTN_K_B, "n_embd_head_qk_nope", "n_lora_kv", "n_head"),
    _ds(T.ATTN_V_B, "n_lora_kv", "n_embd_head_v_mla", "n_head"),
    _ds(T.ATTN_OUT, "n_embd_o_mla", "n_embd"),
    _ds(T.FFN_NORM, "n_embd"),
    _ds(T.FFN_GATE, "n_embd", "n_ff", blocks="lead"),
    _ds(T.FFN_UP, "n_embd", "n_ff", blocks="lead"),
    _ds(T.FFN_DOWN, "n_ff", "n_embd", blocks="lead"),
    _ds(T.FFN_GATE_INP, "n_embd", "n_expert", blocks="moe"),
    _ds(T.FFN_EXP_PROBS_B, "n_expert", blocks="moe", suffix="bias", required=False),
    _ds(T.FFN_GATE_EXP, "n_embd", "n_ff_exp", "n_expert", blocks="moe"),
    _ds(T.FFN_UP_EXP, "n_embd", "n_ff_exp", "n_expert", blocks="moe"),
    _ds(T.FFN_DOWN_EXP, "n_ff_exp", "n_embd", "n_expert", blocks="moe"),
    _ds(T.FFN_GATE_SHEXP, "n_embd", "n_ff_shexp", blocks="moe"),
    _ds(T.FFN_UP_SHEXP, "n_embd", "n_ff_shexp", blocks="moe"),
    _ds(T.FFN_DOWN_SHEXP, "n_ff_shexp", "n_embd", blocks="moe"),
)

# The next-token-prediction block after the trunk (llama.cpp's ``layer.nextn`` of deepseek2): a whole
# block of the trunk's kind plus these. Without embed_tokens / shared_head_* it reads token_embd, output
# and output_norm.
_NEXTN = (
    _w(T.NEXTN_EH_PROJ, "n_embd_2", "n_embd"),
    _w(T.NEXTN_ENORM, "n_embd"),
    _w(T.NEXTN_HNORM, "n_embd"),
    TensorSpec(T.NEXTN_EMBED_TOKENS, required=False, shape=("n_embd", "n_vocab")),
    TensorSpec(T.NEXTN_SHARED_HEAD_HEAD, required=False, shape=("n_embd", "n_vocab")),
    TensorSpec(T.NEXTN_SHARED_HEAD_NORM, required=False, shape=("n_embd",)),
)

# DeepSeek-V4 (llama_model_deepseek4::load_arch_tensors in llama.cpp src/models/deepseek4.cpp, names from
# src/llama-arch.cpp; gguf 0.19.0 has no deepseek4). Hyper-connection mixes before attention and FFN,
# q-LoRA attention with one shared K=V head, sinks and a grouped low-rank output; compressors on the
# compressed blocks (the lightning indexer's on ratio-4 blocks); routed experts, hash-routed by token id in
# the first ``hash_layer_count`` blocks, plus a shared expert.
_V4_HC = tuple(_ds(f"blk.{{bid}}.hc_{part}_{what}", *shape) for part in ("attn", "ffn") for what, shape in (
    ("fn", ("dsv4.hc_dim", "dsv4.hc_mix")), ("base", ("dsv4.hc_mix",)), ("scale", ("dsv4.three",))))
_V4_COMPRESSOR = tuple(
    _ds(f"blk.{{bid}}.{pre}_{what}", *shape, blocks=blocks)
    for pre, blocks, width, ratio, norm in (
        ("attn_compressor", "csa", "dsv4.comp_csa", "dsv4.csa_ratio", "head_dim"),
        ("attn_compressor", "hca", "head_dim", "dsv4.hca_ratio", "head_dim"),
        ("indexer_compressor", "csa", "dsv4.indexer_comp", "dsv4.csa_ratio", "dsv4.indexer_head_dim"))
    for what, shape in (("kv", ("n_embd", width)), ("gate", ("n_embd", width)), ("ape", (width, ratio)),
                        ("norm", (norm,))))
_DEEPSEEK4 = (
    _ds(T.ATTN_NORM, "n_embd"),
    _ds(T.ATTN_SINKS, "n_head"),
    _ds(T.ATTN_Q_A, "n_embd", "n_lora_q"),
    _ds(T.ATTN_Q_A_NORM, "n_lora_q"),
    _ds(T.ATTN_Q_B, "n_lora_q", "n_embd_q"),
    _ds("blk.{bid}.attn_kv", "n_embd", "head_dim"),
    _ds(T.ATTN_KV_A_NORM, "head_dim"),
    _ds("blk.{bid}.attn_output_a", "dsv4.wo_a_in", "dsv4.wo_a_out"),
    _ds("blk.{bid}.attn_output_b", "dsv4.wo_a_out", "n_embd"),
    *_V4_HC,
    *_V4_COMPRESSOR,
    _ds(T.INDEXER_PROJ, "n_embd", "dsv4.indexer_n_head", blocks="csa"),
    _ds(T.INDEXER_ATTN_Q_B, "n_lora_q", "dsv4.indexer_q", blocks="csa"),
    _ds(T.FFN_NORM, "n_embd"),
    _ds(T.FFN_GATE_INP, "n_embd", "n_expert"),
    _ds("blk.{bid}.ffn_gate_tid2eid", "n_expert_used", "n_vocab", blocks="hash"),
    _ds(T.FFN_EXP_PROBS_B, "n_expert", blocks="routed", suffix="bias"),
    _ds(T.FFN_GATE_EXP, "n_embd", "n_ff_exp", "n_expert"),
    _ds(T.FFN_UP_EXP, "n_embd", "n_ff_exp", "n_expert"),
    _ds(T.FFN_DOWN_EXP, "n_ff_exp", "n_embd", "n_expert"),
    _ds(T.FFN_GATE_SHEXP, "n_embd", "n_ff_shexp"),
    _ds(T.FFN_UP_SHEXP, "n_embd", "n_ff_shexp"),
    _ds(T.FFN_DOWN_SHEXP, "n_ff_shexp", "n_embd"),
)
_DEEPSEEK4_GLOBAL = (
    _w(T.TOKEN_EMBD),
    _w(T.OUTPUT_NORM, "n_embd"),
    _w(T.OUTPUT),  # never tied (llama.cpp loads it without TENSOR_NOT_REQUIRED)
    _ds("output_hc_fn", "dsv4.hc_dim", "dsv4.n_hc"),
    _ds("output_hc_base", "dsv4.n_hc"),
    _ds("output_hc_scale", "dsv4.one"),
)

MANIFESTS: dict[str, ArchManifest] = {m.name: m for m in (
    ArchManifest("llama", gguf.MODEL_ARCH.LLAMA, ROPE_NORM, "llama", "dense",
                 _ATTN + (_opt_b(T.ATTN_OUT, "n_embd"),) + _FFN
                 + (_opt_b(T.FFN_GATE, "n_ff"), _opt_b(T.FFN_UP, "n_ff"), _opt_b(T.FFN_DOWN, "n_embd")),
                 _GLOBAL),
    ArchManifest("qwen2", gguf.MODEL_ARCH.QWEN2, ROPE_NEOX, "llama", "dense", _ATTN + _FFN, _GLOBAL),
    ArchManifest("qwen3", gguf.MODEL_ARCH.QWEN3, ROPE_NEOX, "llama", "dense", _ATTN + _QK_NORM + _FFN, _GLOBAL),
    ArchManifest("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE, ROPE_NEOX, "llama", "moe", _ATTN + _QK_NORM + _MOE,
                 _GLOBAL, moe_norm_weights=True),
    ArchManifest("phi3", gguf.MODEL_ARCH.PHI3, ROPE_NEOX, "phi3", "dense",
                 (_w(T.ATTN_NORM, "n_embd"), TensorSpec(T.ATTN_QKV), _w(T.ATTN_OUT, "n_embd_o", "n_embd"),
                  _w(T.FFN_NORM, "n_embd"), TensorSpec(T.FFN_UP), _w(T.FFN_DOWN, "n_ff", "n_embd")),
                 _GLOBAL),
    ArchManifest("gemma3", gguf.MODEL_ARCH.GEMMA3, ROPE_NEOX, "gemma3", "dense",
                 # gguf calls gemma's ffn_norm FFN_PRE_NORM (the same GGUF name): it precedes the FFN
                 _ATTN + _QK_NORM + (_w(T.ATTN_POST_NORM, "n_embd"), _w(T.FFN_PRE_NORM, "n_embd")) + _FFN_MATS
                 + (_w(T.FFN_POST_NORM, "n_embd"),),
                 _GLOBAL),
    ArchManifest("deepseek2", gguf.MODEL_ARCH.DEEPSEEK2, ROPE_NORM, "deepseek2", "moe", _DEEPSEEK2, _GLOBAL),
    ArchManifest("deepseek4", None, ROPE_NORM, "deepseek4", "moe", _DEEPSEEK4, _DEEPSEEK4_GLOBAL,
                 token_id_blocks="hash", residual="dsv4.hc_dim"),
)}


def manifest_for(arch: str | None) -> ArchManifest:
    """Raises GGUFError naming ``arch`` and the supported architectures."""
    m = MANIFESTS.get(arch or "")
    if m is None:
        raise GGUFError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(MANIFESTS))}")
    return m


def check_tensors(manifest: ArchManifest, cfg, tensors: Iterable[tuple[str, tuple[int, ...]]]) -> None:
    """Refuse a file whose tensors do not fit ``manifest``.

    Args:
        cfg: the model's ``ModelConfig`` (n_layer and the sizes the shapes name).
        tensors: ``(name, dims ne0-first)`` of every tensor in the file.
    Raises:
        GGUFError: the first missing required tensor, unexpected tensor or misshaped tensor, each
            message naming the architecture and the tensor.
    """
    arch = manifest.name
    found = dict(tensors)
    expected: dict[str, TensorSpec] = {s.name(): s for s in manifest.global_tensors if s.applies(cfg)}
    n_nextn = getattr(cfg, "n_nextn", 0)  # MTP blocks after the trunk: a block each, plus their nextn tensors
    for il in range(cfg.n_layer + n_nextn):
        expected.update({s.name(il): s for s in manifest.layer_tensors if s.applies(cfg, il)})
    for il in range(cfg.n_layer, cfg.n_layer + n_nextn):
        expected.update({s.name(il): s for s in _NEXTN})
    for name, spec in expected.items():
        if spec.required and name not in found:
            raise GGUFError(f"{arch} GGUF is missing tensor {name!r}")
    for name, dims in found.items():
        spec = expected.get(name)
        if spec is None:
            raise GGUFError(f"{arch} GGUF has unexpected tensor {name!r}, which this engine's {arch} graph "
                            f"does not use")
        if name in ("token_embd.weight", "output.weight") and (not dims or int(dims[0]) != cfg.n_embd):
            raise GGUFError(f"{arch} GGUF tensor {name!r} has shape {list(dims)}, expected rows of n_embd "
                            f"{cfg.n_embd}")
        if spec.shape is not None:
            want = tuple(int(attrgetter(d)(cfg)) for d in spec.shape)
            if tuple(dims) != want:
                raise GGUFError(f"{arch} GGUF tensor {name!r} has shape {list(dims)}, expected {list(want)} "
                                f"({', '.join(spec.shape)})")
