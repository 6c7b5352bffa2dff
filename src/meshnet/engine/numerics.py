"""What decides the bits a stage computes, as one comparable string: ``Capabilities.numerics``.

A failover replays a session's steps onto a replacement node, and the rebuilt KV cache equals the lost
one bit for bit only where the replacement computes exactly as the node it replaces: the same meshnet
release (its graphs) and ggml build (``ggml-python``'s version), engine and backend (an accelerator's
kernels round otherwise than the CPU's), the same device model, the same prefill micro-batch
(``n_ubatch``: a prompt's rows are computed in chunks of it), and on the CPU the same SIMD features of
ggml's kernels (AVX512 kernels sum in another order than AVX2 ones: the llama.cpp goldens differ between
them), the same thread count (ggml's flash attention splits a decode row over 512 or more KV cells across
the threads, ``ggml_compute_forward_flash_attn_ext``) and the same weight layout (repacked or as stored).
Nodes register the key; routing prefers a replacement whose key equals the replaced node's
(:func:`meshnet.tracker.routing.plan_route`).
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version


@functools.lru_cache(maxsize=None)
def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def numerics_key(backend: str, device: str, n_threads: int, repack: bool, n_ubatch: int) -> str:
    """The key of a ggml stage: space-separated ``name=value`` words, e.g. ``"meshnet=0.1.0
    ggml-python=0.0.37 backend=cpu ubatch=512 simd=SSE3+SSSE3+AVX+AVX2+F16C+FMA+BMI2 threads=2
    weights=repacked"`` (see :func:`differences`). An accelerator's key names its device instead of the
    CPU's kernels, threads and weight layout, which it does not compute with.

    Args:
        backend: ``"cpu"`` or an accelerator lane (``"cuda"``, ...).
        device: the accelerator's name as ggml reports it (``""`` on the CPU).
        n_threads: CPU threads computing the stage's graphs.
        repack: whether mat-mul weights take ggml's repacked CPU layouts.
        n_ubatch: prefill micro-batch size, tokens.
    """
    from meshnet import __version__
    from meshnet.backends.cpu_features import ggml_cpu_features

    common = f"meshnet={__version__} ggml-python={_version('ggml-python')} backend={backend} ubatch={n_ubatch}"
    if device:
        return f"{common} device={'_'.join(device.split())}"
    return (f"{common} simd={'+'.join(ggml_cpu_features()) or 'none'} threads={n_threads} "
            f"weights={'repacked' if repack else 'stored'}")


def differences(a: str, b: str) -> str:
    """What sets two keys apart, word by word: ``"threads=2 vs threads=1"`` (the whole keys when they do
    not share a word)."""
    words = distinct_words([a, b], none="nothing")
    return f"{words[a]} vs {words[b]}"


def distinct_words(keys: list[str], none: str = "the same words") -> dict[str, str]:
    """Each key's words that not every key holds: ``{"...threads=1...": "threads=1", ...}`` (``none`` for a
    key all of whose words the others hold)."""
    shared = set.intersection(*(set(k.split()) for k in keys)) if keys else set()
    return {k: " ".join(w for w in k.split() if w not in shared) or none for k in keys}
