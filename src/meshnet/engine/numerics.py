"""What decides the bits a stage computes, as one comparable string: ``Capabilities.numerics``.

A failover replays a session's steps onto a replacement node, and the rebuilt KV cache equals the lost
one bit for bit only where the replacement computes exactly as the node it replaces: the same ggml build
(``ggml-python``'s version), engine and backend (an accelerator's kernels round otherwise than the CPU's),
the same device model, the same SIMD features of ggml's CPU kernels (AVX-512 kernels sum in another
order than AVX2 ones: the llama.cpp goldens differ between them), the same thread count (ggml's flash
attention splits a decode row over 512 or more KV cells across the threads, ``ggml_compute_forward_
flash_attn_ext``) and the same weight layout (repacked or as stored). Nodes register the key; routing
prefers a replacement whose key equals the replaced node's (:func:`meshnet.tracker.routing.plan_route`).
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version


@functools.lru_cache(maxsize=1)
def _ggml_version() -> str:
    try:
        return version("ggml-python")
    except PackageNotFoundError:
        return "unknown"


def numerics_key(backend: str, device: str, n_threads: int, repack: bool) -> str:
    """The key of a ggml stage: space-separated ``name=value`` words, e.g. ``"ggml-python=0.0.37
    backend=cpu simd=SSE3+SSSE3+AVX+AVX2+F16C+FMA+BMI2 threads=2 weights=repacked"`` (see :func:`differences`).

    Args:
        backend: ``"cpu"`` or an accelerator lane (``"cuda"``, ...).
        device: the accelerator's name as ggml reports it (``""`` on the CPU).
        n_threads: CPU threads computing the stage's graphs.
        repack: whether mat-mul weights take ggml's repacked CPU layouts.
    """
    from meshnet.backends.cpu_features import ggml_cpu_features

    where = backend if not device else f"{backend}:{'_'.join(device.split())}"
    return (f"ggml-python={_ggml_version()} backend={where} simd={'+'.join(ggml_cpu_features()) or 'none'} "
            f"threads={n_threads} weights={'repacked' if repack else 'stored'}")


def differences(a: str, b: str) -> str:
    """What sets two keys apart, word by word: ``"threads=2 vs threads=1"`` (the whole keys when they do
    not share a word)."""
    wa, wb = a.split(), b.split()
    only_a, only_b = [w for w in wa if w not in wb], [w for w in wb if w not in wa]
    return f"{' '.join(only_a) or 'nothing'} vs {' '.join(only_b) or 'nothing'}"
