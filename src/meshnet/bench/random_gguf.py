"""Pieces the random-weight benchmark models share (:mod:`meshnet.bench.moe_model`,
:mod:`meshnet.bench.dense_model`): quantized blocks drawn at random instead of quantizing Gaussians, the
bundled SmolLM2 tokenizer copied into a new GGUF, and the folder the models are written to.

Speed depends on shapes and types, not on values, so a matrix is written as random quantized blocks
(uniform quants, one fixed scale per block chosen so that the matrix has RMS ``rms``): a multi-GB file
takes seconds to write, byte for byte the same for a seed.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# Per type: the RMS of a block's values in units of its scale ``d`` with uniformly random quant bytes.
# Q4_K: x = d*sc*q - dmin*m with 6-bit sc, m and 4-bit q, dmin = 7.5 d (zero mean over blocks);
# Q6_K: x = d*sc*(q-32), int8 sc and 6-bit q; Q4_0: d*(q-8); Q4_1: d*q + m with m = -7.5 d; Q8_0: d*q.
_SCALE_RMS = {Q.Q4_K: 257.0, Q.Q6_K: 73.9 * 18.5, Q.Q4_0: 4.6, Q.Q4_1: 4.61, Q.Q8_0: 73.9}


def _f16_bytes(*values: float) -> np.ndarray:
    return np.frombuffer(np.array(values, np.float16).tobytes(), np.uint8)


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q, rms: float) -> np.ndarray:
    """Random quantized rows of ``shape`` (numpy order, last dim = ggml's ne0) in ``qtype``.

    Returns:
        uint8 ``[*shape[:-1], bytes_per_row]`` as ``GGUFWriter.add_tensor(raw_dtype=qtype)`` takes it,
        every block's scale(s) set so that the values' RMS is about ``rms`` (and their mean about 0).
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
    d = float(np.float16(rms / _SCALE_RMS[qtype]))
    if qtype == Q.Q4_K:
        raw[..., 0:4] = _f16_bytes(d, 7.5 * d)
    elif qtype == Q.Q6_K:
        raw[..., 208:210] = _f16_bytes(d)
    elif qtype == Q.Q4_1:
        raw[..., 0:4] = _f16_bytes(d, -7.5 * d)
    else:
        raw[..., 0:2] = _f16_bytes(d)
    return raw.reshape(*shape[:-1], n_blocks * size)


def copy_tokenizer(w: gguf.GGUFWriter, src: str) -> int:
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


def bench_models_dir() -> Path:
    """``<cache>/bench-models``; the cache is ``$MESHNET_CACHE_DIR``, else ``$XDG_CACHE_HOME/meshnet``
    (``~/.cache/meshnet``)."""
    cache = os.environ.get("MESHNET_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshnet"
    return Path(cache) / "bench-models"
