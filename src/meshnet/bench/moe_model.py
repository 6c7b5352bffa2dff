"""A qwen3moe GGUF with Qwen3-30B-A3B's layer shapes and random weights, for speed benchmarks.

Per layer as in Qwen3-30B-A3B: n_embd 2048, 32 query heads and 4 KV heads of 128, per-head q/k RMSNorm,
an F32 router over 128 experts of n_ff 768, 8 used per token (softmax, renormalised). Only the layer
count (``n_layer``, default 4) and the vocabulary (SmolLM2's, 49152, copied with its tokenizer from the
bundled model so that ``meshnet bench engine`` can tokenize its prompt) differ.

Tensor types follow llama.cpp's Q4_K_M mix for this model (``--ftype q4_k_m``, the file most people run):
Q4_K for attn_q/k/output, token_embd and the gate/up experts, Q6_K for attn_v, the down experts and the
output head; or every matrix Q4_0 or Q8_0 (``--ftype q4_0|q8_0``).

Speed depends on shapes and types, not on values, so the weights are written as random quantized blocks
(uniform quants, a fixed scale per block chosen so that a matrix has RMS ``1/sqrt(n_in)``, as the golden
tiny models' random weights have) instead of drawing and quantizing 2.5 billion Gaussians: the 1.4 GB
file takes seconds to write, byte-for-byte the same for a seed. Norm weights are 1, the router Gaussian.

usage: python -m meshnet.bench.moe_model [--out DIR] [--layers N] [--ftype q4_k_m|q4_0|q8_0]
       (prints the path; the default folder is ``$MESHNET_CACHE_DIR`` or ``~/.cache/meshnet``)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from meshnet.model.bundled import resolve_model


@dataclass(frozen=True)
class MoeShapes:
    """Qwen3-30B-A3B's per-layer hyperparameters (its ``config.json``), ``n_layer`` of them."""

    n_layer: int = 4
    n_embd: int = 2048
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    n_expert: int = 128
    n_expert_used: int = 8
    n_ff_exp: int = 768
    n_ctx: int = 4096
    rope_base: float = 1_000_000.0
    eps: float = 1e-6


# Tensor role -> type, per --ftype; llama.cpp's Q4_K_M picks (llama_tensor_get_type) for qwen3moe.
FTYPES: dict[str, tuple[int, dict[str, Q]]] = {
    "q4_k_m": (gguf.LlamaFileType.MOSTLY_Q4_K_M, dict(token_embd=Q.Q4_K, output=Q.Q6_K, attn_q=Q.Q4_K,
                                                      attn_k=Q.Q4_K, attn_v=Q.Q6_K, attn_output=Q.Q4_K,
                                                      gate_exps=Q.Q4_K, up_exps=Q.Q4_K, down_exps=Q.Q6_K)),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, dict.fromkeys(
        ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "gate_exps", "up_exps",
         "down_exps"), Q.Q4_0)),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, dict.fromkeys(
        ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "gate_exps", "up_exps",
         "down_exps"), Q.Q8_0)),
}

# Per type: (offsets of the F16 block scales, the RMS of a block's values in units of its scale with
# uniformly random quant bytes). Q4_K: x = d*sc*q - dmin*m with 6-bit sc, m and 4-bit q, dmin = 7.5 d
# (zero mean over blocks); Q6_K: x = d*sc*(q-32), int8 sc and 6-bit q; Q4_0: d*(q-8); Q8_0: d*q.
_SCALE_RMS = {Q.Q4_K: 257.0, Q.Q6_K: 73.9 * 18.5, Q.Q4_0: 4.6, Q.Q8_0: 73.9}


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q, rms: float) -> np.ndarray:
    """Random quantized rows of ``shape`` (numpy order, last dim = ggml's ne0) in ``qtype``.

    Returns:
        uint8 ``[*shape[:-1], bytes_per_row]`` as ``GGUFWriter.add_tensor(raw_dtype=qtype)`` takes it,
        every block's scale(s) set so that the values' RMS is about ``rms``.
    Raises:
        ValueError: ``shape[-1]`` is not a multiple of the type's block size, or an unsupported type.
    """
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block}, not {shape[-1]}")
    if qtype not in _SCALE_RMS:
        raise ValueError(f"no random block layout for {qtype.name}")
    n_blocks = shape[-1] // block
    raw = rng.integers(0, 256, size=(*shape[:-1], n_blocks, size), dtype=np.uint8)
    d = np.float16(rms / _SCALE_RMS[qtype])
    if qtype == Q.Q4_K:
        raw[..., 0:4] = np.frombuffer(np.array([d, np.float16(7.5 * float(d))], np.float16).tobytes(), np.uint8)
    elif qtype == Q.Q6_K:
        raw[..., 208:210] = np.frombuffer(d.tobytes(), np.uint8)
    else:
        raw[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    return raw.reshape(*shape[:-1], n_blocks * size)


def _copy_tokenizer(w: gguf.GGUFWriter, src: str) -> int:
    """Copy every ``tokenizer.*`` field of GGUF ``src`` into ``w``; returns the vocabulary size."""
    reader = gguf.GGUFReader(src)
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=field.types[-1])
            if key == gguf.Keys.Tokenizer.LIST:
                n_vocab = len(value)
        else:
            w.add_key_value(key, value, field.types[0])
    return n_vocab


def write_moe_model(path: Path, shapes: MoeShapes = MoeShapes(), ftype: str = "q4_k_m", seed: int = 30) -> Path:
    """Write the qwen3moe GGUF to ``path`` (see the module doc); returns ``path``.

    Raises:
        KeyError: unknown ``ftype``. ModelNotFound: the bundled SmolLM2 (the tokenizer) is not installed.
    """
    file_type, types = FTYPES[ftype]
    s = shapes
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "qwen3moe")
    w.add_name(f"qwen3moe-30b-a3b-shapes-{s.n_layer}L-{ftype}")
    w.add_description(f"random-weight benchmark model, Qwen3-30B-A3B layer shapes (seed {seed})")
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(6144)  # Qwen3-30B-A3B's dense n_ff, unused by its MoE layers
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    n_vocab = _copy_tokenizer(w, str(resolve_model("smollm2")))

    def mat(name: str, role: str, *shape: int) -> None:  # numpy order: [..., n_out, n_in]
        w.add_tensor(name, random_blocks(rng, shape, types[role], 1.0 / np.sqrt(shape[-1])), raw_dtype=types[role])

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    E, HD, NE, FF = s.n_embd, s.head_dim, s.n_expert, s.n_ff_exp
    mat("token_embd.weight", "token_embd", n_vocab, E)
    ones("output_norm.weight", E)
    mat("output.weight", "output", n_vocab, E)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", E)
        mat(p + "attn_q.weight", "attn_q", s.n_head * HD, E)
        mat(p + "attn_k.weight", "attn_k", s.n_head_kv * HD, E)
        mat(p + "attn_v.weight", "attn_v", s.n_head_kv * HD, E)
        ones(p + "attn_q_norm.weight", HD)
        ones(p + "attn_k_norm.weight", HD)
        mat(p + "attn_output.weight", "attn_output", E, s.n_head * HD)
        ones(p + "ffn_norm.weight", E)
        w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((NE, E)) / np.sqrt(E)).astype(np.float32))
        mat(p + "ffn_gate_exps.weight", "gate_exps", NE, FF, E)
        mat(p + "ffn_up_exps.weight", "up_exps", NE, FF, E)
        mat(p + "ffn_down_exps.weight", "down_exps", NE, E, FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def default_path(shapes: MoeShapes = MoeShapes(), ftype: str = "q4_k_m") -> Path:
    """``<cache>/bench-models/qwen3moe-30b-a3b-shapes-<n_layer>L-<ftype>.gguf``; the cache is
    ``$MESHNET_CACHE_DIR``, else ``$XDG_CACHE_HOME/meshnet`` (``~/.cache/meshnet``)."""
    cache = os.environ.get("MESHNET_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshnet"
    return Path(cache) / "bench-models" / f"qwen3moe-30b-a3b-shapes-{shapes.n_layer}L-{ftype}.gguf"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="the GGUF's path (default: in the cache folder)")
    ap.add_argument("--layers", type=int, default=MoeShapes.n_layer)
    ap.add_argument("--ftype", choices=sorted(FTYPES), default="q4_k_m")
    ap.add_argument("--seed", type=int, default=30)
    args = ap.parse_args(argv)
    shapes = MoeShapes(n_layer=args.layers)
    path = args.out or default_path(shapes, args.ftype)
    if not path.exists():
        write_moe_model(path, shapes, args.ftype, args.seed)
    print(path)


if __name__ == "__main__":
    main()
