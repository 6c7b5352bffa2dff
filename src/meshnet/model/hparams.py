"""Model hyper-parameters read from GGUF metadata with gguf's ``Keys`` tables.

Defaults follow llama.cpp's ``llama_model::load_hparams`` (src/llama-model.cpp) where a key is optional.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf
import numpy as np

from meshnet.model.arch_manifest import ArchManifest, check_tensors, manifest_for
from meshnet.model.dsv4_params import GATING_SQRT_SOFTPLUS, Dsv4Params, read_dsv4  # noqa: F401 (re-exported)
from meshnet.model.gguf_file import GGUFError, array_length, model_tensors, tensor_name
from meshnet.model.rope_scaling import mla_kq_scale, read_rope_scaling

# llama.cpp hard-codes Gemma 3's sliding-window layer pattern (5 local : 1 global) and local RoPE base.
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_FREQ_BASE_SWA = 10000.0

# llama.cpp's llama_expert_gating_func_type (src/llama-hparams.h): how router logits become scores.
GATING_NONE, GATING_SOFTMAX, GATING_SIGMOID = 0, 1, 2

# Blocks a model may have: far beyond any real one, small enough that checking them is instant.
MAX_LAYERS = 4096


def _scalar(key: str, v):
    """``v`` when it is one number or string; GGUFError naming ``key`` for an array (a per-layer value
    this engine does not support) or anything else."""
    if not isinstance(v, (bool, int, float, str, np.integer, np.floating, np.bool_)):
        raise GGUFError(f"GGUF key {key!r} holds {type(v).__name__} {str(v)[:60]}, expected one value "
                        f"(per-layer values are not supported)")
    return v


def _check_ranges(cfg: "ModelConfig") -> None:
    """GGUFError naming the first hyperparameter ggml's ops cannot run with (they would abort or hang at
    the first step: ``ggml_rope_ext`` wants an even ``n_dims <= ne0``, ``ggml_rms_norm`` ``eps >= 0``)."""
    a = cfg.architecture
    if not 1 <= cfg.n_layer <= MAX_LAYERS:
        raise GGUFError(f"{a} GGUF has block_count {cfg.n_layer}, expected 1..{MAX_LAYERS}")
    if cfg.head_dim < 1 or cfg.head_dim_v < 1 and cfg.n_lora_kv == 0:
        raise GGUFError(f"{a} GGUF has attention.key_length {cfg.head_dim} / value_length {cfg.head_dim_v}: "
                        f"both must be >= 1")
    rot_limit = cfg.head_dim
    if cfg.n_rot < 0 or cfg.n_rot % 2 or cfg.n_rot > rot_limit:
        raise GGUFError(f"{a} GGUF has rope.dimension_count {cfg.n_rot}: must be even and at most the head "
                        f"size {rot_limit}")
    if not (math.isfinite(cfg.rms_eps) and cfg.rms_eps >= 0):
        raise GGUFError(f"{a} GGUF has attention.layer_norm_rms_epsilon {cfg.rms_eps}: must be a finite "
                        f"number >= 0")
    if cfg.n_ctx_train < 1:
        raise GGUFError(f"{a} GGUF has context_length {cfg.n_ctx_train}: must be >= 1")


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _array(reader: gguf.GGUFReader, key: str) -> list | None:
    """A per-layer key as a list (one value: a one-element list); None when absent."""
    v = _field(reader, key)
    return None if v is None else list(v) if isinstance(v, (list, tuple)) else [v]


@dataclass(frozen=True)
class ModelConfig:
    """What the forward graph needs to know about the whole model.

    Attributes:
        n_layer: transformer blocks in the model (not in one stage).
        head_dim: per-head size of Q and K (``attention.key_length`` or n_embd / n_head).
        rope_type: ROPE_NORM or ROPE_NEOX.
        n_swa: sliding-window size in tokens (0: none); ``swa_pattern`` gives which layers slide.
        attn_scale: factor applied to Q·K (1/sqrt(head_dim) unless the architecture says otherwise).
        embd_scale: factor on the token embeddings (sqrt(n_embd) for Gemma, else 1).
        tied_output: no ``output.weight``; the tail projects with ``token_embd``.
        n_expert / n_expert_used: routed experts per MoE layer and how many each token uses (0: dense).
        n_ff_exp: hidden size of one expert (``expert_feed_forward_length``).
        expert_weights_scale: factor on the routing weights (0 or 1: none), as llama.cpp's ``w_scale``.
        expert_weights_norm: renormalise the k routing weights to sum to 1 (``norm_w``).
        expert_gating_func: GATING_SOFTMAX or GATING_SIGMOID (router logits to scores).
        n_expert_groups / n_group_used: experts come in groups; only the best ``n_group_used`` groups
            (by the sum of each group's top-2 scores) compete (0: no groups).
        n_expert_shared: shared experts (always on) beside the routed ones; their FFN is
            ``n_ff_exp * n_expert_shared`` wide.
        n_layer_dense_lead: the first blocks have a dense FFN instead of experts (deepseek2).
        n_lora_q: rank of the q-LoRA (``attn_q_a``/``attn_q_b``); 0: a plain ``attn_q`` (MLA only).
        n_lora_kv: rank of MLA's compressed KV latent (0: not MLA).
        n_embd_head_k_mla / n_embd_head_v_mla: MLA's per-head Q·K size (nope + rope) and value size as
            the heads see them after decompression; in the absorbed form the cache instead holds
            ``head_dim`` = n_lora_kv + n_rot per token and ``head_dim_v`` = n_lora_kv of it is V.
        rope_ext_factor / rope_attn_factor: YaRN's extrapolation mix and magnitude factor as
            llama.cpp passes them to ``ggml_rope_ext`` (0 and 1 without YaRN).
        n_ctx_orig_yarn: the context YaRN scales from (``rope.scaling.original_context_length``).
    """

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_type: int
    n_rot: int
    rope_freq_base: float
    rope_freq_scale: float
    rope_freq_base_swa: float
    n_swa: int
    swa_pattern: int
    attn_scale: float
    embd_scale: float
    tied_output: bool
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    expert_gating_func: int = GATING_SOFTMAX
    n_expert_groups: int = 0
    n_group_used: int = 0
    n_expert_shared: int = 0
    n_layer_dense_lead: int = 0
    n_lora_q: int = 0
    n_lora_kv: int = 0
    n_embd_head_k_mla: int = 0
    n_embd_head_v_mla: int = 0
    rope_ext_factor: float = 0.0
    rope_attn_factor: float = 1.0
    n_ctx_orig_yarn: int = 0
    # next-token-prediction (MTP) blocks stored after the trunk: ``blk.{n_layer}`` ..; ``block_count``
    # counts them, ``n_layer`` does not (llama.cpp's ``n_layer_all`` and ``n_layer()``)
    n_nextn: int = 0
    # DeepSeek-V4's own hyper-parameters (hyper-connections, compressed attention, hash routing)
    dsv4: Dsv4Params | None = None

    @property
    def manifest(self) -> ArchManifest:
        """The architecture's tensor table and graph builder."""
        return manifest_for(self.architecture)

    @property
    def n_embd_q(self) -> int:
        return self.head_dim * self.n_head

    @property
    def n_embd_o(self) -> int:
        """Width of the attention output before ``attn_output`` (all heads' values)."""
        return self.head_dim_v * self.n_head

    @property
    def n_embd_k_gqa(self) -> int:
        return self.head_dim * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.head_dim_v * self.n_head_kv

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention in llama.cpp's absorbed form (``attn_k_b``/``attn_v_b``)."""
        return self.n_lora_kv > 0

    @property
    def has_q_lora(self) -> bool:
        return self.n_lora_q > 0

    @property
    def no_q_lora(self) -> bool:
        return self.n_lora_q == 0

    @property
    def n_embd_head_qk_nope(self) -> int:
        """MLA: the per-head Q·K dims without rope."""
        return self.n_embd_head_k_mla - self.n_rot

    @property
    def n_embd_q_mla(self) -> int:
        return self.n_embd_head_k_mla * self.n_head

    @property
    def n_embd_o_mla(self) -> int:
        return self.n_embd_head_v_mla * self.n_head

    @property
    def n_ff_shexp(self) -> int:
        return self.n_ff_exp * self.n_expert_shared

    @property
    def n_embd_2(self) -> int:
        """Width of the MTP block's input before ``nextn.eh_proj``: token embedding and trunk state."""
        return 2 * self.n_embd

    @property
    def n_embd_k_cache(self) -> int:
        """F16 values a token's K cell holds per layer: K of every KV head, or for MLA the normed
        latent then the roped part (llama.cpp's KV cache for MLA: k of kv_lora_rank + n_rot)."""
        return self.n_embd_k_gqa

    @property
    def n_embd_v_cache(self) -> int:
        """F16 values a token's V cell holds per layer; 0 for MLA, whose V is the latent at the start
        of the K cell (llama.cpp's cache has no V tensor then), and for DeepSeek-V4, whose one KV head
        serves as K and V."""
        return 0 if self.is_mla or self.dsv4 is not None else self.n_embd_v_gqa

    @property
    def residual_shape(self) -> tuple[int, ...]:
        """One token's residual stream, the activation that crosses a stage boundary: ``(n_embd,)``, or
        ``(n_hc, n_embd)`` with DeepSeek-V4's hyper-connections (``n_hc`` streams of n_embd)."""
        return (self.n_embd,) if self.dsv4 is None else (self.dsv4.n_hc, self.n_embd)

    def needs_token_ids(self, layers) -> bool:
        """Whether a stage holding ``layers`` (a LayerRange) computes with its step's token ids besides
        embedding them on the head: it holds a hash-routed block (DeepSeek-V4's first
        ``hash_layer_count`` blocks pick their experts by token id)."""
        return self.dsv4 is not None and layers.start < self.dsv4.n_hash_layers

    def is_swa(self, layer: int) -> bool:
        """True for sliding-window layers (llama.cpp ``hparams.is_swa``: ``il % pattern < pattern - 1``)."""
        return self.n_swa > 0 and self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1

    @classmethod
    def from_reader(cls, reader: gguf.GGUFReader) -> "ModelConfig":
        """Raises GGUFError for an unsupported architecture (naming it and the supported ones), a
        missing required key, or tensors that do not fit the architecture's manifest (naming the
        missing, unexpected or misshaped tensor; see :func:`meshnet.model.arch_manifest.check_tensors`)."""
        arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
        manifest = manifest_for(arch)

        def req(key_fmt: str):
            v = _field(reader, key_fmt.format(arch=arch))
            if v is None:
                raise GGUFError(f"GGUF is missing required key {key_fmt.format(arch=arch)!r}")
            return _scalar(key_fmt.format(arch=arch), v)

        def opt(key_fmt: str, default):
            v = _field(reader, key_fmt.format(arch=arch))
            return default if v is None else _scalar(key_fmt.format(arch=arch), v)

        n_embd = int(req(gguf.Keys.LLM.EMBEDDING_LENGTH))
        n_head = int(req(gguf.Keys.Attention.HEAD_COUNT))
        if n_embd < 1 or n_head < 1:
            raise GGUFError(f"{arch} GGUF has embedding_length {n_embd} and attention.head_count {n_head}: "
                            f"both must be >= 1")
        n_head_kv = int(opt(gguf.Keys.Attention.HEAD_COUNT_KV, n_head))
        head_dim = int(opt(gguf.Keys.Attention.KEY_LENGTH, n_embd // n_head))
        head_dim_v = int(opt(gguf.Keys.Attention.VALUE_LENGTH, head_dim))
        if head_dim < 1:
            raise GGUFError(f"{arch} GGUF has attention.key_length {head_dim}: must be >= 1")
        n_tokens = array_length(reader, gguf.Keys.Tokenizer.LIST) or 0
        n_vocab = int(opt(gguf.Keys.LLM.VOCAB_SIZE, n_tokens))
        if n_vocab < n_tokens:  # else a token the tokenizer emits fails the first step that holds it
            raise GGUFError(f"{arch} GGUF has vocab_size {n_vocab} but its tokenizer lists {n_tokens} tokens: "
                            "token ids would run past the vocabulary")
        tensors = model_tensors(reader)  # a range-only file: the whole model's list it carries
        names = {t.name for t in tensors}
        tied = tensor_name(gguf.MODEL_TENSOR.OUTPUT) not in names
        if n_vocab == 0:
            embd = next((t for t in tensors if t.name == tensor_name(gguf.MODEL_TENSOR.TOKEN_EMBD)), None)
            n_vocab = int(embd.shape[1]) if embd is not None else 0  # no token_embd: check_tensors names it
        rope = read_rope_scaling(arch, opt)
        mla, dsv4 = arch == "deepseek2", arch == "deepseek4"
        n_rot = int(opt(gguf.Keys.Rope.DIMENSION_COUNT, head_dim))
        n_lora_kv = n_embd_head_k_mla = n_embd_head_v_mla = n_lora_q = 0
        if mla:
            n_embd_head_k_mla = int(opt(gguf.Keys.Attention.KEY_LENGTH_MLA, 0))
            n_embd_head_v_mla = int(opt(gguf.Keys.Attention.VALUE_LENGTH_MLA, 0))
            if not (n_embd_head_k_mla and n_embd_head_v_mla):
                raise GGUFError(f"{arch} GGUF has no attention.key_length_mla / value_length_mla: the legacy "
                                f"attn_kv_b layout is not supported, only llama.cpp's absorbed MLA "
                                f"(attn_k_b / attn_v_b; reconvert with a current convert_hf_to_gguf.py)")
            n_lora_kv = int(req(gguf.Keys.Attention.KV_LORA_RANK))
            n_lora_q = int(opt(gguf.Keys.Attention.Q_LORA_RANK, 0))
            if n_embd_head_k_mla <= n_rot or head_dim != n_lora_kv + n_rot or head_dim_v != n_lora_kv:
                raise GGUFError(f"{arch} GGUF has inconsistent MLA sizes: key_length {head_dim}, value_length "
                                f"{head_dim_v}, kv_lora_rank {n_lora_kv}, rope dims {n_rot}, key_length_mla "
                                f"{n_embd_head_k_mla}")
        gemma = arch == "gemma3"
        n_swa = int(opt(gguf.Keys.Attention.SLIDING_WINDOW, 0)) if gemma or dsv4 else 0
        # An MoE file may omit the dense feed_forward_length (llama.cpp does not require it).
        ff_key = gguf.Keys.LLM.FEED_FORWARD_LENGTH
        n_ff = int(opt(ff_key, 0) if manifest.is_moe else req(ff_key))
        n_expert = int(req(gguf.Keys.LLM.EXPERT_COUNT)) if manifest.is_moe else 0
        n_expert_used = int(req(gguf.Keys.LLM.EXPERT_USED_COUNT)) if manifest.is_moe else 0
        if manifest.is_moe and not 0 < n_expert_used <= n_expert:
            raise GGUFError(f"{arch} GGUF has expert_used_count {n_expert_used} for expert_count {n_expert}")
        n_groups = int(opt(gguf.Keys.LLM.EXPERT_GROUP_COUNT, 0)) if manifest.is_moe else 0
        n_group_used = int(opt(gguf.Keys.LLM.EXPERT_GROUP_USED_COUNT, 0)) if manifest.is_moe else 0
        if n_groups > 1 and not (n_expert % n_groups == 0 and 0 < n_group_used < n_groups
                                 and n_expert // n_groups >= 2):
            raise GGUFError(f"{arch} GGUF has expert_group_count {n_groups} with expert_group_used_count "
                            f"{n_group_used} for expert_count {n_expert}")
        # qwen3moe's graph always uses softmax and renormalises; deepseek2 reads both (softmax and no
        # renormalisation when absent, as llama.cpp's loader defaults them)
        gating = int(opt(gguf.Keys.LLM.EXPERT_GATING_FUNC, GATING_NONE)) if mla else GATING_SOFTMAX
        gating = gating or GATING_SOFTMAX
        v4 = None
        if dsv4:  # its own keys, checked by read_dsv4 (sqrt-softplus gating among them)
            n_lora_q = int(req(gguf.Keys.Attention.Q_LORA_RANK))
            v4 = read_dsv4(arch, int(req(gguf.Keys.LLM.BLOCK_COUNT)),
                           dict(n_embd=n_embd, head_dim=head_dim, n_head=n_head, n_expert_used=n_expert_used),
                           req, opt, lambda key: _array(reader, key.format(arch=arch)))
            gating = GATING_SQRT_SOFTPLUS
        elif gating not in (GATING_SOFTMAX, GATING_SIGMOID):
            raise GGUFError(f"{arch} GGUF has expert_gating_func {gating}; supported: {GATING_SOFTMAX} (softmax), "
                            f"{GATING_SIGMOID} (sigmoid)")
        norm_w = bool(opt(gguf.Keys.LLM.EXPERT_WEIGHTS_NORM, False)) if mla or dsv4 else manifest.moe_norm_weights
        n_nextn = int(opt(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS, 0))
        if n_nextn and not (mla and n_nextn == 1):
            # llama.cpp's graph_mtp runs one MTP block, of deepseek2 (GLM-4.5 / DeepSeek-V3) files only
            raise GGUFError(f"{arch} GGUF has nextn_predict_layers {n_nextn}; this engine runs 1 "
                            f"next-token-prediction block, in deepseek2 files only")
        cfg = cls(
            architecture=arch,
            n_layer=int(req(gguf.Keys.LLM.BLOCK_COUNT)) - n_nextn,
            n_nextn=n_nextn,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_ff=n_ff,
            n_vocab=n_vocab,
            n_ctx_train=int(req(gguf.Keys.LLM.CONTEXT_LENGTH)),
            rms_eps=float(req(gguf.Keys.Attention.LAYERNORM_RMS_EPS)),
            rope_type=manifest.rope_type,
            n_rot=n_rot,
            rope_freq_base=float(opt(gguf.Keys.Rope.FREQ_BASE, 10000.0)),
            rope_freq_scale=rope.freq_scale,
            rope_freq_base_swa=float(opt(gguf.Keys.Rope.FREQ_BASE_SWA, GEMMA3_ROPE_FREQ_BASE_SWA)),
            n_swa=n_swa,
            swa_pattern=int(opt(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN, GEMMA3_SWA_PATTERN)) if gemma else 0,
            attn_scale=(mla_kq_scale(rope.attn_factor, rope.freq_scale, rope.yarn_log_mul, n_embd_head_k_mla)
                        if mla else float(opt(gguf.Keys.Attention.SCALE, 0.0) or 0.0) or 1.0 / math.sqrt(head_dim)),
            embd_scale=math.sqrt(n_embd) if gemma else 1.0,
            tied_output=tied,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            # llama.cpp: n_ff_exp, else n_ff / n_expert_used (llama_model_qwen3moe::load_arch_tensors)
            n_ff_exp=int(opt(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, n_ff // n_expert_used)) if n_expert else 0,
            expert_weights_scale=float(opt(gguf.Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)),
            expert_weights_norm=norm_w,
            expert_gating_func=gating,
            n_expert_groups=n_groups,
            n_group_used=n_group_used,
            n_expert_shared=int(opt(gguf.Keys.LLM.EXPERT_SHARED_COUNT, 0)) if manifest.is_moe else 0,
            n_layer_dense_lead=int(opt(gguf.Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)) if mla else 0,
            n_lora_q=n_lora_q,
            n_lora_kv=n_lora_kv,
            n_embd_head_k_mla=n_embd_head_k_mla,
            n_embd_head_v_mla=n_embd_head_v_mla,
            rope_ext_factor=rope.ext_factor,
            rope_attn_factor=rope.attn_factor,
            n_ctx_orig_yarn=int(opt(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN, 0)),
            dsv4=v4,
        )
        _check_ranges(cfg)
        for t in tensors:
            # ggml multiplies F32 activations by norm weights only in F32 (binary ops abort otherwise)
            if t.name.endswith("norm.weight") and int(t.tensor_type) != int(gguf.GGMLQuantizationType.F32):
                raise GGUFError(f"{arch} GGUF tensor {t.name!r} is {t.tensor_type.name}, expected F32")
        check_tensors(manifest, cfg, ((t.name, tuple(int(d) for d in t.shape)) for t in tensors))
        return cfg
