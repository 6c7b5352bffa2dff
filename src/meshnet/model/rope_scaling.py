"""RoPE frequency scaling and YaRN: the ``rope.scaling.*`` keys of a GGUF file turned into the factors
llama.cpp hands ``ggml_rope_ext``, and deepseek2's YaRN-scaled attention scale.

Every value is computed in float32 as llama.cpp's C++ computes it, so graphs match it bit for bit.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import gguf
import numpy as np

from meshnet.model.gguf_file import GGUFError

# llama.cpp's YaRN defaults (llama_hparams): these are not read from the file.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def _logf(x: np.float32) -> np.float32:
    """C's ``logf``: the float32 nearest the exact logarithm."""
    return np.float32(math.log(float(x)))


def _get_mscale(scale: np.float32, mscale: np.float32) -> np.float32:
    """llama.cpp's ``get_mscale`` in llama_context's constructor, in float32 as C computes it."""
    f = np.float32
    return f(1.0) if scale <= 1 else f(0.1) * mscale * _logf(scale) + f(1.0)


def yarn_rope_params(arch: str, scaling_type: str, freq_scale: float, yarn_log_mul: float,
                     rope_attn_factor: float) -> tuple[float, float]:
    """The ``ext_factor`` and ``attn_factor`` llama.cpp hands ``ggml_rope_ext`` (llama_context's
    constructor: ``cparams.yarn_ext_factor`` / ``cparams.yarn_attn_factor``), in float32.

    Args:
        scaling_type: ``rope.scaling.type`` ("yarn" turns YaRN's extrapolation mix on).
        freq_scale: 1 / ``rope.scaling.factor`` as float32.
        yarn_log_mul: ``rope.scaling.yarn_log_multiplier`` after llama.cpp's load-time division by 0.1
            (deepseek2), else 0.
        rope_attn_factor: ``rope.scaling.attn_factor`` (default 1).
    """
    f = np.float32
    ext_factor, attn_factor = f(1.0 if scaling_type == "yarn" else 0.0), f(1.0)
    if ext_factor != 0:
        factor = f(1.0) / f(freq_scale)
        if yarn_log_mul != 0:
            mscale_all_dims = f(yarn_log_mul)
            mscale = mscale_all_dims if arch == "deepseek2" and mscale_all_dims != 1 else f(1.0)
            attn_factor = _get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dims)
        else:
            attn_factor = _get_mscale(factor, f(1.0))
        # cancels the magnitude factor ggml's rope applies itself when ext_factor != 0
        attn_factor = attn_factor * (f(1.0) / (f(1.0) + f(0.1) * _logf(factor)))
    attn_factor = attn_factor * f(rope_attn_factor)
    return float(ext_factor), float(attn_factor)


def mla_kq_scale(attn_factor: float, freq_scale: float, yarn_log_mul: float, n_embd_head_k_mla: int) -> float:
    """deepseek2's attention scale, pre-multiplied by YaRN's mscale² (llama_model_deepseek2::graph):
    ``mscale = attn_factor_org * (1 + 0.1 * yarn_log_mul * ln(1/freq_scale))``, ``kq_scale = mscale² /
    sqrt(n_embd_head_k_mla)``, where ``attn_factor_org`` undoes the rope's cancelling factor; float32."""
    f = np.float32
    lg = _logf(f(1.0) / f(freq_scale))
    attn_factor_org = f(attn_factor) * (f(1.0) + f(0.1) * lg)
    mscale = attn_factor_org * (f(1.0) + f(0.1) * f(yarn_log_mul) * lg)
    return float(f(1.0) * mscale * mscale / np.sqrt(f(n_embd_head_k_mla)))


class RopeScaling(NamedTuple):
    """A model's RoPE scaling as llama.cpp applies it.

    Attributes:
        freq_scale: 1 / ``rope.scaling.factor`` in float32 (1: not scaled).
        yarn_log_mul: deepseek2's ``rope.scaling.yarn_log_multiplier`` / 0.1, else 0.
        ext_factor / attn_factor: what :func:`yarn_rope_params` gives (0 and 1 without YaRN).
    """

    freq_scale: float
    yarn_log_mul: float
    ext_factor: float
    attn_factor: float


def read_rope_scaling(arch: str, opt: Callable) -> RopeScaling:
    """The ``rope.scaling.*`` keys of an ``arch`` file, read with ``opt(key_fmt, default)`` (a key's one
    value, or ``default`` when absent).

    Raises:
        GGUFError: ``rope.scaling.factor`` is neither 0 (none) nor a finite factor in [1e-6, 1e6].
    """
    scaling_factor = float(opt(gguf.Keys.Rope.SCALING_FACTOR, 0.0) or 0.0)
    scaling_type = str(opt(gguf.Keys.Rope.SCALING_TYPE, "linear"))
    # llama.cpp: float32 1/factor, and never scaled when the scaling type is "none"
    if not (math.isfinite(scaling_factor) and (scaling_factor == 0 or 1e-6 <= scaling_factor <= 1e6)):
        raise GGUFError(f"{arch} GGUF has rope.scaling.factor {scaling_factor}: expected 0 (none) or a "
                        f"finite factor in [1e-6, 1e6]")
    freq_scale = float(np.float32(1.0) / np.float32(scaling_factor)) if scaling_factor > 0 else 1.0
    if scaling_type == "none":
        freq_scale = 1.0
    # llama.cpp divides the converter's yarn_log_multiplier by 0.1 (deepseek2's load_arch_hparams)
    yarn_log_mul = (float(np.float32(opt(gguf.Keys.Rope.SCALING_YARN_LOG_MUL, 0.0)) / np.float32(0.1))
                    if arch == "deepseek2" else 0.0)
    ext_factor, attn_factor = yarn_rope_params(arch, scaling_type, freq_scale, yarn_log_mul,
                                               float(opt(gguf.Keys.Rope.SCALING_ATTN_FACTOR, 1.0)))
    return RopeScaling(freq_scale, yarn_log_mul, ext_factor, attn_factor)
