"""Model hyper-parameters read from GGUF metadata with gguf's ``Keys`` tables.

Defaults follow llama.cpp's ``llama_model::load_hparams`` (src/llama-model.cpp) where a key is optional.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf

from meshnet.model.arch_manifest import ArchManifest, check_tensors, manifest_for
from meshnet.model.gguf_file import GGUFError, array_length, tensor_name

# llama.cpp hard-codes Gemma 3's sliding-window layer pattern (5 local : 1 global) and local RoPE base.
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_FREQ_BASE_SWA = 10000.0


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


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
            return v

        def opt(key_fmt: str, default):
            v = _field(reader, key_fmt.format(arch=arch))
            return default if v is None else v

        n_embd = int(req(gguf.Keys.LLM.EMBEDDING_LENGTH))
        n_head = int(req(gguf.Keys.Attention.HEAD_COUNT))
        n_head_kv = int(opt(gguf.Keys.Attention.HEAD_COUNT_KV, n_head))
        head_dim = int(opt(gguf.Keys.Attention.KEY_LENGTH, n_embd // n_head))
        head_dim_v = int(opt(gguf.Keys.Attention.VALUE_LENGTH, head_dim))
        n_vocab = int(opt(gguf.Keys.LLM.VOCAB_SIZE, array_length(reader, gguf.Keys.Tokenizer.LIST) or 0))
        names = {t.name for t in reader.tensors}
        tied = tensor_name(gguf.MODEL_TENSOR.OUTPUT) not in names
        if n_vocab == 0:
            embd = next((t for t in reader.tensors if t.name == tensor_name(gguf.MODEL_TENSOR.TOKEN_EMBD)), None)
            n_vocab = int(embd.shape[1]) if embd is not None else 0  # no token_embd: check_tensors names it
        scaling_factor = float(opt(gguf.Keys.Rope.SCALING_FACTOR, 0.0) or 0.0)
        freq_scale = 1.0 / scaling_factor if scaling_factor > 0 else 1.0
        gemma = arch == "gemma3"
        n_swa = int(opt(gguf.Keys.Attention.SLIDING_WINDOW, 0)) if gemma else 0
        # An MoE file may omit the dense feed_forward_length (llama.cpp does not require it).
        ff_key = gguf.Keys.LLM.FEED_FORWARD_LENGTH
        n_ff = int(opt(ff_key, 0) if manifest.is_moe else req(ff_key))
        n_expert = int(req(gguf.Keys.LLM.EXPERT_COUNT)) if manifest.is_moe else 0
        n_expert_used = int(req(gguf.Keys.LLM.EXPERT_USED_COUNT)) if manifest.is_moe else 0
        if manifest.is_moe and not 0 < n_expert_used <= n_expert:
            raise GGUFError(f"{arch} GGUF has expert_used_count {n_expert_used} for expert_count {n_expert}")
        cfg = cls(
            architecture=arch,
            n_layer=int(req(gguf.Keys.LLM.BLOCK_COUNT)),
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
            n_rot=int(opt(gguf.Keys.Rope.DIMENSION_COUNT, head_dim)),
            rope_freq_base=float(opt(gguf.Keys.Rope.FREQ_BASE, 10000.0)),
            rope_freq_scale=freq_scale,
            rope_freq_base_swa=float(opt(gguf.Keys.Rope.FREQ_BASE_SWA, GEMMA3_ROPE_FREQ_BASE_SWA)),
            n_swa=n_swa,
            swa_pattern=int(opt(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN, GEMMA3_SWA_PATTERN)) if gemma else 0,
            attn_scale=float(opt(gguf.Keys.Attention.SCALE, 0.0) or 0.0) or 1.0 / math.sqrt(head_dim),
            embd_scale=math.sqrt(n_embd) if gemma else 1.0,
            tied_output=tied,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            # llama.cpp: n_ff_exp, else n_ff / n_expert_used (llama_model_qwen3moe::load_arch_tensors)
            n_ff_exp=int(opt(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, n_ff // n_expert_used)) if n_expert else 0,
            expert_weights_scale=float(opt(gguf.Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)),
        )
        check_tensors(manifest, cfg, ((t.name, tuple(int(d) for d in t.shape)) for t in reader.tensors))
        return cfg
