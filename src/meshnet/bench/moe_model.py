"""A qwen3moe GGUF with Qwen3-30B-A3B's layer shapes and random weights, for speed benchmarks.

Per layer as in Qwen3-30B-A3B: n_embd 2048, 32 query heads and 4 KV heads of 128, per-head q/k RMSNorm,
an F32 router over 128 experts of n_ff 768, 8 used per token (softmax, renormalised). Only the layer
count (``n_layer``, default 4) and the vocabulary (SmolLM2's, 49152, copied with its tokenizer from the
bundled model so that ``meshnet bench engine`` can tokenize its prompt) differ.

Tensor types follow llama.cpp's Q4_K_M mix for this model (``--ftype q4_k_m``, the file most people run):
Q4_K for attn_q/k/output, token_embd and the gate/up experts, Q6_K for attn_v and the down experts; or every
matrix Q4_0 or Q8_0 (``--ftype q4_0|q8_0``). The output head is Q8_0 in every mix: it carries a next-token
table (below), drawn as floats, and gguf-py quantizes Q8_0 but not Q6_K.

Speed depends on shapes and types, not on values, so the weights are written as random quantized blocks
(:func:`meshnet.bench.random_gguf.random_blocks`, RMS ``1/sqrt(n_in)`` as the golden tiny models' random
weights have) instead of drawing and quantizing 2.5 billion Gaussians: the 1.4 GB file takes seconds to
write, byte-for-byte the same for a seed. Norm weights are 1, the router Gaussian. As in the 7B-class
dense file (:mod:`meshnet.bench.dense_model`), the output projection carries a next-token table, so that
greedy ids have clear margins and can be compared with llama.cpp's token for token.

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

from meshnet.bench.dense_model import Init, next_token_table, output_rows
from meshnet.bench.random_gguf import bench_models_dir, copy_tokenizer, random_blocks
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
    "q4_k_m": (gguf.LlamaFileType.MOSTLY_Q4_K_M, dict(token_embd=Q.Q4_K, output=Q.Q8_0, attn_q=Q.Q4_K,
                                                      attn_k=Q.Q4_K, attn_v=Q.Q6_K, attn_output=Q.Q4_K,
                                                      gate_exps=Q.Q4_K, up_exps=Q.Q4_K, down_exps=Q.Q6_K)),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, dict.fromkeys(
        ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "gate_exps", "up_exps", "down_exps"),
        Q.Q4_0) | {"output": Q.Q8_0}),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, dict.fromkeys(
        ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "gate_exps", "up_exps",
         "down_exps"), Q.Q8_0)),
}

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
    n_vocab = copy_tokenizer(w, str(resolve_model("smollm2")))

    def mat(name: str, role: str, *shape: int) -> None:  # numpy order: [..., n_out, n_in]
        w.add_tensor(name, random_blocks(rng, shape, types[role], 1.0 / np.sqrt(shape[-1])), raw_dtype=types[role])

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    E, HD, NE, FF = s.n_embd, s.head_dim, s.n_expert, s.n_ff_exp
    embd = random_blocks(rng, (n_vocab, E), types["token_embd"], Init.embd)
    w.add_tensor("token_embd.weight", embd, raw_dtype=types["token_embd"])
    ones("output_norm.weight", E)
    succ = next_token_table(rng, n_vocab)
    pred = np.empty_like(succ)
    pred[succ] = np.arange(n_vocab)
    w.add_tensor("output.weight", output_rows(rng, embd, types["token_embd"], pred, Init(), types["output"]),
                 raw_dtype=types["output"])
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
    """``<cache>/bench-models/qwen3moe-30b-a3b-shapes-<n_layer>L-<ftype>.gguf`` (:func:`bench_models_dir`)."""
    return bench_models_dir() / f"qwen3moe-30b-a3b-shapes-{shapes.n_layer}L-{ftype}-nt.gguf"


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
