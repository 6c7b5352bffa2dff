"""A llama GGUF with a 7B-class model's shapes and random weights, for the scale benchmark.

Shapes as Llama 2 7B: 32 layers, n_embd 4096, n_ff 11008, 32 query heads of 128 and 32 KV heads (8 with
``--kv-heads 8``, as Llama 3 8B), NORM rope; SmolLM2's vocabulary and tokenizer (49152 ids, copied from the
bundled model) so that meshnet's tokenizer and llama.cpp's both read it. ``--layers 8`` writes the small
variant the tests use (the same layer shapes, a quarter of the layers).

Stored types (``--ftype``): ``q4_1`` (the default; every matrix Q4_1, about 4.2 GB), ``q4_0`` (the file
most people run, about 3.7 GB; output Q8_0) or ``q8_0``. Parity with llama.cpp is checked on Q4_1:
llama.cpp's CPU backend repacks Q4_0, Q4_K, IQ4_NL and MXFP4 weights into interleaved layouts on x86 with
AVX2 (``ggml_repack_get_optimal_repack_type`` in ggml-cpu/repack.cpp), which sums in another order than
the plain kernels ggml-python runs, while Q4_1, Q8_0, Q5_* and Q6_K are never repacked there.

Layer weights are random quantized blocks (:func:`meshnet.bench.random_gguf.random_blocks`: seconds per
GB, byte for byte the same for a seed) with RMS ``gain / sqrt(n_in)``; norm weights are 1. Random weights
alone leave the top two logits about 0.2 sigma apart, close enough for rounding to flip greedy ids, so
the output projection carries a next-token table as the golden tiny models' does: row ``succ[i]`` is
token i's embedding (scaled to RMS ``table``) plus Gaussian noise (RMS ``out_noise``), ``succ`` one random
cycle through the vocabulary. Only the output projection is drawn as floats and quantized (gguf-py).

usage: python -m meshnet.bench.dense_model [--out PATH] [--layers N] [--kv-heads N] [--ftype q4_1|q4_0|q8_0]
       (prints the path; the default folder is :func:`meshnet.bench.random_gguf.bench_models_dir`)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from meshnet.bench.random_gguf import bench_models_dir, copy_tokenizer, random_blocks
from meshnet.model.bundled import resolve_model

DEFAULT_SEED = 7
_OUT_ROWS_PER_CHUNK = 2048  # output rows drawn and quantized at a time (4096 wide: 32 MB of f32)


@dataclass(frozen=True)
class LlamaShapes:
    """Llama 2 7B's hyperparameters (its ``config.json``), ``n_layer`` of its layers."""

    n_layer: int = 32
    n_embd: int = 4096
    n_ff: int = 11008
    n_head: int = 32
    n_head_kv: int = 32
    n_ctx: int = 4096
    rope_base: float = 10000.0
    eps: float = 1e-5


@dataclass(frozen=True)
class Init:
    """How the random values are scaled (RMS of each part, unit-free: activations are unit RMS)."""

    embd: float = 1.0  # token_embd entries
    gain: float = 1.0  # layer matrices have RMS gain / sqrt(n_in)
    table: float = 0.05  # the next-token table's part of an output row
    out_noise: float = 0.015  # the Gaussian noise part of an output row


# --ftype -> (file type, token_embd type, layer matrices' type, output type).
FTYPES: dict[str, tuple[int, Q, Q, Q]] = {
    "q4_1": (gguf.LlamaFileType.MOSTLY_Q4_1, Q.Q4_1, Q.Q4_1, Q.Q4_1),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_0, Q.Q4_0, Q.Q8_0),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q8_0, Q.Q8_0, Q.Q8_0),
    "q4_k": (gguf.LlamaFileType.MOSTLY_Q4_K_S, Q.Q4_K, Q.Q4_K, Q.Q8_0),
}


def next_token_table(rng: np.random.Generator, n_vocab: int) -> np.ndarray:
    """``succ`` (int64 ``[n_vocab]``): one random cycle through the vocabulary, ``succ[i]`` following i."""
    order = rng.permutation(n_vocab)
    succ = np.empty(n_vocab, dtype=np.int64)
    succ[order] = np.roll(order, -1)
    return succ


def output_rows(rng: np.random.Generator, embd_raw: np.ndarray, embd_type: Q, pred: np.ndarray, init: Init,
                 out_type: Q) -> np.ndarray:
    """The quantized output projection (uint8 rows of ``out_type``): row j = token ``pred[j]``'s
    embedding scaled to RMS ``init.table``, plus noise of RMS ``init.out_noise``; drawn in chunks of rows."""
    n_vocab = embd_raw.shape[0]
    chunks = []
    for r0 in range(0, n_vocab, _OUT_ROWS_PER_CHUNK):
        rows = pred[r0:r0 + _OUT_ROWS_PER_CHUNK]
        emb = gguf.quants.dequantize(embd_raw[rows], embd_type)  # f32 [rows, n_embd]
        noise = rng.standard_normal(emb.shape, dtype=np.float32) * np.float32(init.out_noise)
        chunks.append(gguf.quants.quantize(emb * np.float32(init.table / init.embd) + noise, out_type))
    return np.concatenate(chunks)


def write_llama_model(path: Path, shapes: LlamaShapes = LlamaShapes(), ftype: str = "q4_1",
                      seed: int = DEFAULT_SEED, init: Init = Init()) -> Path:
    """Write the llama GGUF (see the module doc) to ``path`` through a ``.partial`` file; returns ``path``.

    Tensors are declared first and then generated and written one at a time, so memory stays at one
    layer matrix plus the embedding, whatever the file's size.

    Raises:
        KeyError: unknown ``ftype``. ModelNotFound: the bundled SmolLM2 (the tokenizer) is not installed.
    """
    file_type, embd_type, layer_type, out_type = FTYPES[ftype]
    s = shapes
    head_dim = s.n_embd // s.n_head
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"llama-7b-shapes-{s.n_layer}L-{ftype}")
    w.add_description(f"random-weight benchmark model, Llama 2 7B layer shapes (seed {seed})")
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.eps)
    n_vocab = copy_tokenizer(w, str(resolve_model("smollm2")))
    w.add_vocab_size(n_vocab)

    # (name, type, numpy shape [..., n_out, n_in], maker) in file order; makers run in this order only.
    plan: list[tuple[str, Q, tuple[int, ...], Callable[[], np.ndarray]]] = []
    made: dict[str, np.ndarray] = {}

    def mat(name: str, qtype: Q, n_out: int, n_in: int) -> None:
        plan.append((name, qtype, (n_out, n_in), lambda: random_blocks(rng, (n_out, n_in), qtype,
                                                                       init.gain / np.sqrt(n_in))))

    def ones(name: str, n: int) -> None:
        plan.append((name, Q.F32, (n,), lambda: np.ones(n, np.float32)))

    def embd() -> np.ndarray:
        made["embd"] = random_blocks(rng, (n_vocab, s.n_embd), embd_type, init.embd)
        return made["embd"]

    def output() -> np.ndarray:
        succ = next_token_table(rng, n_vocab)
        pred = np.empty_like(succ)
        pred[succ] = np.arange(n_vocab)
        return output_rows(rng, made.pop("embd"), embd_type, pred, init, out_type)

    E, F, kv = s.n_embd, s.n_ff, s.n_head_kv * head_dim
    plan.append(("token_embd.weight", embd_type, (n_vocab, E), embd))
    ones("output_norm.weight", E)
    plan.append(("output.weight", out_type, (n_vocab, E), output))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", E)
        mat(p + "attn_q.weight", layer_type, E, E)
        mat(p + "attn_k.weight", layer_type, kv, E)
        mat(p + "attn_v.weight", layer_type, kv, E)
        mat(p + "attn_output.weight", layer_type, E, E)
        ones(p + "ffn_norm.weight", E)
        mat(p + "ffn_gate.weight", layer_type, F, E)
        mat(p + "ffn_up.weight", layer_type, F, E)
        mat(p + "ffn_down.weight", layer_type, E, F)

    for name, qtype, shape, _ in plan:
        if qtype == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, make in plan:
        w.write_tensor_data(make())
    w.close()
    os.replace(tmp, path)
    return path


def default_path(shapes: LlamaShapes = LlamaShapes(), ftype: str = "q4_1", seed: int = DEFAULT_SEED) -> Path:
    """``<bench models>/llama-7b-shapes-<n_layer>L-kv<n_head_kv>-<ftype>-seed<seed>.gguf``."""
    return bench_models_dir() / f"llama-7b-shapes-{shapes.n_layer}L-kv{shapes.n_head_kv}-{ftype}-seed{seed}.gguf"


def ensure_llama_model(shapes: LlamaShapes = LlamaShapes(), ftype: str = "q4_1", seed: int = DEFAULT_SEED) -> Path:
    """:func:`default_path`, written first when it is not there yet."""
    path = default_path(shapes, ftype, seed)
    return path if path.exists() else write_llama_model(path, shapes, ftype, seed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="the GGUF's path (default: in the bench models folder)")
    ap.add_argument("--layers", type=int, default=LlamaShapes.n_layer)
    ap.add_argument("--kv-heads", type=int, default=LlamaShapes.n_head_kv, choices=(8, 32))
    ap.add_argument("--ftype", choices=sorted(FTYPES), default="q4_1")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = ap.parse_args(argv)
    shapes = LlamaShapes(n_layer=args.layers, n_head_kv=args.kv_heads)
    if args.out:
        print(args.out if args.out.exists() else write_llama_model(args.out, shapes, args.ftype, args.seed))
    else:
        print(ensure_llama_model(shapes, args.ftype, args.seed))


if __name__ == "__main__":
    main()
