"""Which CPU kernels the loaded ggml runs: its SIMD features, named as llama.cpp's ``system_info`` names them.

ggml compiles its CPU kernels for the features of the build (``-march=native`` by default, or the
``GGML_AVX512=OFF``-style switches of a portable build), and kernels for different features sum in
different orders, so exact token ids hold only between builds with the same SIMD features. The
answer comes from ggml's own ``ggml_cpu_has_*`` queries, which report what the build compiled in,
not what the processor could do (``/proc/cpuinfo``): an AVX512 machine running a build with
``GGML_AVX512=OFF`` reports no AVX512.

Build options that llama.cpp prints beside the features (``LLAMAFILE``, ``OPENMP``, ``REPACK``, ...)
are not CPU features and are left out of every comparison here.
"""

from __future__ import annotations

import functools
import re

# llama.cpp's names (ggml-cpu.cpp, ggml_backend_cpu_get_features) in its order; each is the upper-case
# suffix of a ggml_cpu_has_* query.
SIMD_FEATURES = ("SSE3", "SSSE3", "AVX", "AVX_VNNI", "AVX2", "F16C", "FMA", "BMI2", "AVX512",
                 "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8", "NEON", "ARM_FMA", "FP16_VA",
                 "MATMUL_INT8", "SVE", "DOTPROD", "SME", "RISCV_V", "VSX", "VXE", "WASM_SIMD")
# What system_info lists that is a build option, not a feature of the CPU kernels' arithmetic.
BUILD_OPTIONS = frozenset({"LLAMAFILE", "ACCELERATE", "OPENMP", "KLEIDIAI", "REPACK", "SVE_CNT"})

_ENTRY = re.compile(r"([A-Z0-9_]+)\s*=\s*(\d+)")


@functools.lru_cache(maxsize=1)
def ggml_cpu_features() -> tuple[str, ...]:
    """The SIMD features the loaded ggml's CPU backend was compiled with, in llama.cpp's order, e.g.
    ``("SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2")`` for an AVX2 build.

    Imports ggml (the C library loads on first call). A query the bindings declare but this build
    lacks counts as absent.
    """
    import ggml

    ggml.ggml_cpu_init()
    found = []
    for name in SIMD_FEATURES:
        query = getattr(ggml, f"ggml_cpu_has_{name.lower()}", None)
        if query is None:
            continue
        try:
            if query():
                found.append(name)
        except RuntimeError:  # declared by ggml-python, absent from this shared library
            continue
    return tuple(found)


def parse_system_info(system_info: str) -> frozenset[str]:
    """The SIMD features set to 1 in a llama.cpp ``system_info`` string (as in the goldens'
    ``llama_cpp.system_info``: ``"CPU : SSE3 = 1 | ... | AVX2 = 1 | ... | REPACK = 1 |"``), build
    options left out.

    Raises:
        ValueError: the string names no feature at all (not a system_info line).
    """
    entries = {name: value for name, value in _ENTRY.findall(system_info)}
    if not entries:
        raise ValueError(f"not a llama.cpp system_info string: {system_info!r}")
    return frozenset(n for n, v in entries.items() if v != "0" and n not in BUILD_OPTIONS)


def describe(features) -> str:
    """``"AVX2 FMA F16C ..."`` in llama.cpp's order (unknown names last, sorted); ``"none"`` if empty."""
    order = {n: i for i, n in enumerate(SIMD_FEATURES)}
    names = sorted(set(features), key=lambda n: (order.get(n, len(order)), n))
    return " ".join(names) or "none"
