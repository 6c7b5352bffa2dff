"""Weights in the CPU backend's repacked layouts, for the types whose repacked kernels keep a row's bits.

ggml's CPU backend offers an extra buffer type, ``CPU_REPACK`` (``ggml-cpu/repack.cpp``): a weight set
into it is rearranged into interleaved blocks (Q4_0 as ``q4_0_8x8`` on AVX2 and AVX512) that its GEMM
kernels multiply against several activation rows at once. llama.cpp puts every weight the buffer type
supports there by default (``llama_model_loader`` with the device's extra buffer types; ``--no-repack``
turns it off); on a 7B-shaped Q4_0 model llama-bench runs prefill 2.3x and decode 1.4x faster with it.

Meshnet needs more than speed from a kernel: a session's row must come out with the same bits whatever
shares its mat-mul (other sessions' rows, a prefill chunk, verification rows, a replay's prefill), or
batched and failed-over output would drift from the solo run. Repacked kernels differ there: measured on
AVX512, Q4_0 and IQ4_NL give every row of batches of 1-128 rows the bits it gets alone; Q4_K does not
from 4 rows on (its GEMM path rounds differently from its GEMV path). Kernels differ by CPU, so
:func:`invariant_types` checks each candidate on this machine, once per process, with a small probe, and only the types that pass are repacked. Only 2-D mat-mul weights move (the token
embedding is read by ``get_rows``, which repacked buffers do not serve).
"""

from __future__ import annotations

import ctypes
import threading

import ggml
import numpy as np

from meshnet.engine.ggml_backend import get_tensor, new_meta_context, new_tensor, set_tensor

# Types with repacked kernels here that may keep rows' bits; the probe decides per machine. Q4_K is left
# out: its repacked GEMM gives rows other bits than its GEMV (measured from 4 rows on).
CANDIDATE_TYPES = (ggml.GGML_TYPE_Q4_0, ggml.GGML_TYPE_IQ4_NL)
PROBE_BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33)  # GEMM tiles of 4 and 8 rows, and their remainders

_lock = threading.Lock()
_verdicts: dict[int, bool] = {}  # ggml type -> rows keep their bits


def repack_buffer_type():
    """``(device, buffer type)`` of the CPU backend's ``CPU_REPACK``, or None when this ggml has none."""
    reg = ggml.ggml_backend_cpu_reg()
    proc = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not proc:
        return None
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(proc)
    dev = ggml.ggml_backend_reg_dev_get(reg, 0)
    bufts = get_extra(dev)
    i = 0
    while bufts and bufts[i]:
        if ggml.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return dev, bufts[i]
        i += 1
    return None


def supports(dev, buft, weight) -> bool:
    """Whether ``dev`` runs ``mul_mat(weight, x)`` with ``weight`` in ``buft``: the check llama.cpp's
    ``weight_buft_supported`` makes (the weight on a dummy buffer of the type, then ``supports_op``)."""
    ne = weight.contents.ne
    ctx = new_meta_context(4)
    dummy = ggml.ggml_backend_buft_alloc_buffer(buft, 0)
    old = weight.contents.buffer
    try:
        weight.contents.buffer = dummy
        x = new_tensor(ctx, ggml.GGML_TYPE_F32, (int(ne[0]), 1))
        return bool(ggml.ggml_backend_dev_supports_op(dev, ggml.ggml_mul_mat(ctx, weight, x)))
    finally:
        weight.contents.buffer = old
        ggml.ggml_backend_buffer_free(dummy)
        ggml.ggml_free(ctx)


def _quantized(gtype: int, w: np.ndarray) -> np.ndarray:
    """float32 ``[rows, k]`` quantized to ``gtype`` by ggml (bytes of ``rows`` rows)."""
    rows, k = w.shape
    out = np.empty(int(ggml.ggml_row_size(gtype, k)) * rows, dtype=np.uint8)
    ggml.ggml_quantize_chunk(gtype, w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                             out.ctypes.data_as(ctypes.c_void_p), 0, rows, k, None)
    return out


def _mul_mat(backend, weight, x: np.ndarray) -> np.ndarray:
    """``weight @ x.T``: float32 ``[n, rows]`` for ``x`` float32 ``[n, k]``, one graph on ``backend``
    (computed on the calling thread)."""
    ctx = new_meta_context(4, 16)
    try:
        xt = new_tensor(ctx, ggml.GGML_TYPE_F32, (x.shape[1], x.shape[0]))
        y = ggml.ggml_mul_mat(ctx, weight, xt)
        graph = ggml.ggml_new_graph_custom(ctx, 16, False)
        ggml.ggml_build_forward_expand(graph, y)
        buf = ggml.ggml_backend_alloc_ctx_tensors(ctx, backend)
        try:
            set_tensor(xt, x)
            if ggml.ggml_backend_graph_compute(backend, graph) != ggml.GGML_STATUS_SUCCESS:
                raise RuntimeError("ggml failed to compute the repack probe")
            return get_tensor(y)
        finally:
            ggml.ggml_backend_buffer_free(buf)
    finally:
        ggml.ggml_free(ctx)


def rows_keep_their_bits(gtype: int, backend, buft, k: int = 256, rows: int = 32) -> bool:
    """Probe: a ``[rows, k]`` weight of ``gtype`` in ``buft``, multiplied by batches of
    :data:`PROBE_BATCHES` activation rows on ``backend``; True when every row of every batch has the bits
    it has alone. False when the type cannot be placed there.

    Raises:
        RuntimeError: ggml failed to compute a probe graph."""
    rng = np.random.default_rng(7)
    data = _quantized(gtype, (rng.standard_normal((rows, k)) * 0.05).astype(np.float32))
    ctx = new_meta_context(2)
    buf = None
    try:
        weight = new_tensor(ctx, gtype, (k, rows))
        buf = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
        if not buf or ggml.ggml_nbytes(weight) != data.nbytes:
            return False
        set_tensor(weight, data)
        x = rng.standard_normal((max(PROBE_BATCHES), k)).astype(np.float32)
        alone = [_mul_mat(backend, weight, x[i:i + 1])[0] for i in range(len(x))]
        for n in PROBE_BATCHES:
            out = _mul_mat(backend, weight, x[:n])
            if any(out[i].tobytes() != alone[i].tobytes() for i in range(n)):
                return False
        return True
    finally:
        if buf:
            ggml.ggml_backend_buffer_free(buf)
        ggml.ggml_free(ctx)


def invariant_types(buft) -> set[int]:
    """The :data:`CANDIDATE_TYPES` whose repacked mat-muls keep every row's bits on this machine; probed
    once per process on a CPU backend of its own with one thread. One thread, because ggml's CPU backend
    parallelises a graph with an OpenMP team that belongs to the thread starting it: a probe run on the
    stages' shared backend from the loading thread would leave a second team beside the scheduler's, and
    decoding then ran at half speed (SmolLM2, 2 threads: 65 instead of 130 tokens/s). The thread count
    does not change the verdict: the repacked kernels split a mat-mul between threads by weight rows, each
    result computed whole by one thread (measured the same at 1 and 2 threads)."""
    with _lock:
        todo = [t for t in CANDIDATE_TYPES if t not in _verdicts]
        if todo:
            backend = ggml.ggml_backend_cpu_init()
            if not backend:
                raise RuntimeError("ggml_backend_cpu_init failed")
            try:
                ggml.ggml_backend_cpu_set_n_threads(backend, 1)
                for t in todo:
                    _verdicts[t] = rows_keep_their_bits(t, backend, buft)
            finally:
                ggml.ggml_backend_free(backend)
        return {t for t in CANDIDATE_TYPES if _verdicts[t]}


def repack_weights(weights, reader, kinds: frozenset[str]) -> list[str]:
    """Move the 2-D weights of ``weights`` (a :class:`~meshnet.engine.ggml_backend.StageWeights`) of the
    ``kinds`` (``blk.N.<kind>.weight`` or ``<kind>.weight``) whose type :func:`invariant_types` passes and
    whose mat-mul the CPU backend supports repacked into one ``CPU_REPACK`` buffer (the data is copied
    and rearranged from ``reader``'s tensors). Returns the names moved (none without ``CPU_REPACK``).

    Raises:
        MemoryError: the repacked buffer could not be allocated.
    """
    found = repack_buffer_type()
    if found is None:
        return []
    dev, buft = found
    types = invariant_types(buft)
    by_name = {t.name: t for t in reader.tensors}
    names = [n for n, t in weights.tensors.items()
             if n.removesuffix(".weight").rsplit(".", 1)[-1] in kinds and int(t.contents.type) in types
             and ggml.ggml_n_dims(t) == 2 and supports(dev, buft, t)]
    if not names:
        return []
    ctx = new_meta_context(len(names) + 1)
    moved = {}
    for name in names:
        rt = by_name[name]
        t = new_tensor(ctx, int(rt.tensor_type), tuple(int(d) for d in rt.shape))
        ggml.ggml_set_name(t, name.encode())
        moved[name] = t
    buf = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    if not buf:
        ggml.ggml_free(ctx)
        raise MemoryError("could not allocate the repacked weight buffer")
    for name, t in moved.items():
        set_tensor(t, by_name[name].data)  # the buffer type rearranges the blocks as they are set
    weights.adopt(ctx, buf, moved)
    return names
