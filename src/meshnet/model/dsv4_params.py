"""DeepSeek-V4 (``deepseek4``) hyper-parameters beyond the common ones, read from GGUF metadata.

Follows ``llama_model_deepseek4::load_arch_hparams`` (llama.cpp src/models/deepseek4.cpp): every key it
reads with ``get_key`` is required here too, and the same values are refused (a gating function other
than sqrt-softplus, compression ratios other than 0 / 4 / 128, a ``compress_ratios`` array shorter than
``block_count``). gguf 0.19.0's ``Keys`` has none of these, so the key names are llama-arch.cpp's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from meshnet.model.gguf_file import GGUFError

# llama.cpp's compression ratios: 4 (CSA: compressed cache read through the lightning indexer) and 128
# (HCA: heavily compressed, no indexer); 0 is a sliding-window-only layer.
CSA_RATIO, HCA_RATIO = 4, 128
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the only scoring V4's loader accepts.
GATING_SQRT_SOFTPLUS = 4


@dataclass(frozen=True)
class Dsv4Params:
    """What a DeepSeek-V4 graph needs besides :class:`~meshnet.model.hparams.ModelConfig`'s common fields.

    Sizes are element counts; per-layer tuples have one entry per block (``block_count``).

    Attributes:
        n_hc: hyper-connection streams: the residual is ``n_hc`` rows of n_embd per token.
        sinkhorn_iters / hc_eps: rounds and epsilon of the stream-mixing matrix's Sinkhorn normalisation.
        n_hash_layers: the first blocks route by ``ffn_gate_tid2eid[token id]`` (they need token ids).
        compress_ratios: per block 0, CSA_RATIO or HCA_RATIO.
        compress_rope_base: rope base of the compressed layers (which also use YaRN).
        n_swa: sliding window of the raw KV cache, in tokens.
        o_groups / o_lora_rank: the grouped low-rank output projection (``attn_output_a`` / ``_b``).
        indexer_n_head / indexer_head_dim / indexer_top_k: the lightning indexer of CSA layers.
        swiglu_clamp_exp / swiglu_clamp_shexp: per block, the SwiGLU clamp of routed / shared experts.
        n_embd, head_dim, n_head, n_expert_used: copies of the common sizes the tensor shapes name.
    """

    n_hc: int
    sinkhorn_iters: int
    hc_eps: float
    n_hash_layers: int
    compress_ratios: tuple[int, ...]
    compress_rope_base: float
    n_swa: int
    o_groups: int
    o_lora_rank: int
    indexer_n_head: int
    indexer_head_dim: int
    indexer_top_k: int
    swiglu_clamp_exp: tuple[float, ...]
    swiglu_clamp_shexp: tuple[float, ...]
    n_embd: int
    head_dim: int
    n_head: int
    n_expert_used: int

    # Tensor sizes the manifest's shapes name (``dsv4.<name>``).
    @property
    def hc_dim(self) -> int:
        """One token's residual: all streams side by side."""
        return self.n_hc * self.n_embd

    @property
    def hc_mix(self) -> int:
        """Mixes per token: n_hc pre-weights, n_hc post-weights, n_hc² stream-mixing entries."""
        return (2 + self.n_hc) * self.n_hc

    @property
    def wo_a_in(self) -> int:
        return self.n_head * self.head_dim // self.o_groups

    @property
    def wo_a_out(self) -> int:
        return self.o_lora_rank * self.o_groups

    @property
    def comp_csa(self) -> int:
        """A CSA compressor's width: two overlapping halves of a head."""
        return 2 * self.head_dim

    @property
    def indexer_q(self) -> int:
        return self.indexer_n_head * self.indexer_head_dim

    @property
    def indexer_comp(self) -> int:
        return 2 * self.indexer_head_dim

    @property
    def one(self) -> int:
        return 1

    @property
    def three(self) -> int:
        """A hyper-connection's scales: pre, post and the mixing matrix."""
        return 3

    @property
    def csa_ratio(self) -> int:
        return CSA_RATIO

    @property
    def hca_ratio(self) -> int:
        return HCA_RATIO

    def is_hash(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]


def read_dsv4(arch: str, n_layer: int, common: dict, req: Callable[[str], object],
              opt: Callable[[str, object], object], arr: Callable[[str], list | None]) -> Dsv4Params:
    """The V4 keys of a ``deepseek4`` file.

    Args:
        n_layer: ``block_count``.
        common: ``n_embd``, ``head_dim``, ``n_head``, ``n_expert_used`` as read already.
        req / opt: read one value of ``{arch}.<key>`` (required: GGUFError naming a missing key).
        arr: read an array key (None when absent); a single value comes back as a one-element list.
    Raises:
        GGUFError: a missing key, a gating function other than sqrt-softplus, a compression ratio other
            than 0 / 4 / 128, or a per-layer array shorter than block_count, each naming the key.
    """
    gating = int(req("{arch}.expert_gating_func"))
    if gating != GATING_SQRT_SOFTPLUS:
        raise GGUFError(f"{arch} GGUF has expert_gating_func {gating}; DeepSeek-V4 scores experts with "
                        f"sqrt-softplus ({GATING_SQRT_SOFTPLUS})")

    def per_layer(key: str, default=None) -> tuple:
        v = arr(key)
        if v is None:
            if default is None:
                raise GGUFError(f"GGUF is missing required key {key.format(arch=arch)!r}")
            return default
        if len(v) == 1:
            v = list(v) * n_layer  # llama.cpp's get_key_or_arr: one value for every layer
        if len(v) < n_layer:
            raise GGUFError(f"{arch} GGUF key {key.format(arch=arch)!r} has {len(v)} values for "
                            f"block_count {n_layer}")
        return tuple(v[:n_layer])

    ratios = tuple(int(r) for r in per_layer("{arch}.attention.compress_ratios"))
    bad = [r for r in ratios if r not in (0, CSA_RATIO, HCA_RATIO)]
    if bad:
        raise GGUFError(f"{arch} GGUF has attention.compress_ratios {list(ratios)}: only 0, {CSA_RATIO} "
                        f"and {HCA_RATIO} are supported (as llama.cpp's loader)")
    clamp_exp = tuple(float(x) for x in per_layer("{arch}.swiglu_clamp_exp"))
    p = Dsv4Params(
        n_hc=int(req("{arch}.hyper_connection.count")),
        sinkhorn_iters=int(req("{arch}.hyper_connection.sinkhorn_iterations")),
        hc_eps=float(req("{arch}.hyper_connection.epsilon")),
        n_hash_layers=int(req("{arch}.hash_layer_count")),
        compress_ratios=ratios,
        compress_rope_base=float(req("{arch}.attention.compress_rope_freq_base")),
        n_swa=int(req("{arch}.attention.sliding_window")),
        o_groups=int(req("{arch}.attention.output_group_count")),
        o_lora_rank=int(req("{arch}.attention.output_lora_rank")),
        indexer_n_head=int(req("{arch}.attention.indexer.head_count")),
        indexer_head_dim=int(req("{arch}.attention.indexer.key_length")),
        indexer_top_k=int(req("{arch}.attention.indexer.top_k")),
        swiglu_clamp_exp=clamp_exp,
        # llama.cpp: the shared experts' clamp defaults to the routed experts'
        swiglu_clamp_shexp=tuple(float(x) for x in per_layer("{arch}.swiglu_clamp_shexp", clamp_exp)),
        **common,
    )
    if p.n_hc < 1 or p.o_groups < 1 or p.n_head % p.o_groups or not 0 <= p.n_hash_layers <= n_layer:
        raise GGUFError(f"{arch} GGUF has hyper_connection.count {p.n_hc}, output_group_count {p.o_groups} "
                        f"for {p.n_head} heads, hash_layer_count {p.n_hash_layers} for {n_layer} blocks")
    return p
