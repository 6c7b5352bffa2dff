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
from 4 rows on (its GEMM path rounds differently from its GEMV path). Expert weights are another matter:
the repacked ``mul_mat_id`` (``forward_mul_mat_id`` in ``repack.cpp``) multiplies each row by GEMV alone,
so Q4_K and MXFP4 experts keep rows' bits too (measured the same way, at 1 and 2 threads). A matrix of
such a type (Q4_K) is therefore kept as a stack of two experts, its first and second half of rows (the same
bytes), and multiplied by ``mul_mat_id`` with every row choosing both (:func:`mul_mat`): row by row, as
llama.cpp's repacked GEMV does a decode row, and 1.1-1.4x faster than the plain Q4_K kernel at 1-128 rows
(a 4096 x 2048 matrix, 2 threads). Two, because the repacked ``mul_mat_id`` takes 3-D stacks only (a
stack of one is 2-D to ggml). Kernels differ by CPU, so :func:`invariant_types` checks each candidate on
this machine, once per process and op, with a small probe, and only the types that pass are repacked. Only
mat-mul weights move: 2-D ones and 3-D expert stacks (the token embedding is read by ``get_rows``, which
repacked buffers do not serve).
"""

from __future__ import annotations

import ctypes
import threading

import ggml
import numpy as np

from meshnet.engine.ggml_backend import new_meta_context, new_tensor, set_tensor
from meshnet.engine.huge_pages import advise_buffer

# Types with repacked kernels here that may keep rows' bits, per op; the probe decides per machine. Q4_K
# is left out of mul_mat: its repacked GEMM gives rows other bits than its GEMV (measured from 4 rows on).
CANDIDATE_TYPES = {
    "mul_mat": (ggml.GGML_TYPE_Q4_0, ggml.GGML_TYPE_IQ4_NL),
    "mul_mat_id": (ggml.GGML_TYPE_Q4_0, ggml.GGML_TYPE_IQ4_NL, ggml.GGML_TYPE_Q4_K, ggml.GGML_TYPE_MXFP4),
}
PROBE_BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33)  # GEMM tiles of 4 and 8 rows, and their remainders
# The mul_mat_id probe: experts in the stack, and experts each row uses (every expert gets several rows
# in the larger batches, which is where a GEMM path would show).
PROBE_EXPERTS, PROBE_USED = 8, 2

_lock = threading.Lock()
_verdicts: dict[tuple[str, int], bool] = {}  # (op, ggml type) -> rows keep their bits


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


def _product(ctx, weight, x, ids=None):
    """``mul_mat(weight, x)``, or ``mul_mat_id(weight, x, ids)`` with ``ids`` for an expert stack."""
    return ggml.ggml_mul_mat(ctx, weight, x) if ids is None else ggml.ggml_mul_mat_id(ctx, weight, x, ids)


# Tensors a product over a weight kept as row halves may add to a graph beyond the one ``ggml_mul_mat``
# makes (see mul_mat: cont, reshape, mul_mat_id, reshape, and the expert ids' view, arange, repeat, argsort);
# a graph sizes its context with it.
HALVES_TENSORS = 8


def mul_mat(ctx, w, x, pair_ids: dict | None = None):
    """``ggml_mul_mat(ctx, w, x)`` for a weight ``w`` ``[k, rows]``, also when :func:`repack_weights` keeps
    ``w`` as a stack of its two halves of rows (``w.row_halves``): then ``mul_mat_id`` with every row of
    ``x`` choosing experts 0 and 1, so that each row is multiplied on its own, and the two halves of the
    result, in order, are the rows of the product. ``x`` float32 ``[k, n, ...]``; returns float32
    ``[rows, n, ...]`` either way. The expert ids are made in the graph (no input tensor): ``(0, 1)`` for
    every row, by sorting ``arange(2)`` repeated to ``[2, n]``; ``pair_ids`` (the graph's own dict, keyed
    by ``n``) keeps them, so that a graph computes them once per row count rather than once a product."""
    if not getattr(w, "row_halves", False):
        return ggml.ggml_mul_mat(ctx, w, x)
    ne = [int(x.contents.ne[i]) for i in range(4)]
    n = ne[1] * ne[2] * ne[3]
    if not ggml.ggml_is_contiguous(x):
        x = ggml.ggml_cont(ctx, x)
    x3 = ggml.ggml_reshape_3d(ctx, x, ne[0], 1, n)
    ids = None if pair_ids is None else pair_ids.get(n)
    if ids is None:
        shape = ggml.ggml_view_2d(ctx, x3, 2, n, x3.contents.nb[2], 0)              # any [2, n]
        ids = ggml.ggml_argsort(ctx, ggml.ggml_repeat(ctx, ggml.ggml_arange(ctx, 0.0, 2.0, 1.0), shape),
                                ggml.GGML_SORT_ORDER_ASC)                            # int32 [2, n]: 0, 1
        if pair_ids is not None:
            pair_ids[n] = ids
    y = ggml.ggml_mul_mat_id(ctx, w, x3, ids)                                       # [rows / 2, 2, n]
    return ggml.ggml_reshape_4d(ctx, y, 2 * int(w.contents.ne[1]), ne[1], ne[2], ne[3])


def supports(dev, buft, weight, op: str = "mul_mat") -> bool:
    """Whether ``dev`` runs ``weight``'s product ``op`` (``mul_mat``, or ``mul_mat_id`` for an expert
    stack) with ``weight`` in ``buft``: the check llama.cpp's ``weight_buft_supported`` makes (the weight
    on a dummy buffer of the type, then ``supports_op``)."""
    ne = weight.contents.ne
    ctx = new_meta_context(4)
    dummy = ggml.ggml_backend_buft_alloc_buffer(buft, 0)
    old = weight.contents.buffer
    try:
        weight.contents.buffer = dummy
        if op == "mul_mat":
            x, ids = new_tensor(ctx, ggml.GGML_TYPE_F32, (int(ne[0]), 1)), None
        else:
            x = new_tensor(ctx, ggml.GGML_TYPE_F32, (int(ne[0]), 1, 1))
            ids = new_tensor(ctx, ggml.GGML_TYPE_I32, (1, 1))
        return bool(ggml.ggml_backend_dev_supports_op(dev, _product(ctx, weight, x, ids)))
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


def _mul_mat(backend, weight, x: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """``weight @ x.T``: float32 ``[n, rows]`` for ``x`` float32 ``[n, k]``; for an expert stack ``weight``
    ``[k, rows, n_expert]`` with ``ids`` int32 ``[n, n_used]``, each row times its experts: float32
    ``[n, n_used * rows]``. One graph on ``backend`` (computed on the calling thread)."""
    ctx = new_meta_context(4, 16)
    try:
        n, k = x.shape
        xt = new_tensor(ctx, ggml.GGML_TYPE_F32, (k, n) if ids is None else (k, 1, n))
        it = None if ids is None else new_tensor(ctx, ggml.GGML_TYPE_I32, (ids.shape[1], n))
        y = _product(ctx, weight, xt, it)
        graph = ggml.ggml_new_graph_custom(ctx, 16, False)
        ggml.ggml_build_forward_expand(graph, y)
        buf = ggml.ggml_backend_alloc_ctx_tensors(ctx, backend)
        try:
            set_tensor(xt, x)
            if it is not None:
                set_tensor(it, ids)
            if ggml.ggml_backend_graph_compute(backend, graph) != ggml.GGML_STATUS_SUCCESS:
                raise RuntimeError("ggml failed to compute the repack probe")
            out = np.empty(int(ggml.ggml_nbytes(y)) // 4, np.float32)
            ggml.ggml_backend_tensor_get(y, out.ctypes.data_as(ctypes.c_void_p), 0, out.nbytes)
            return out.reshape(n, -1)
        finally:
            ggml.ggml_backend_buffer_free(buf)
    finally:
        ggml.ggml_free(ctx)


def rows_keep_their_bits(gtype: int, backend, buft, op: str = "mul_mat", k: int = 256, rows: int = 32) -> bool:
    """Probe: a ``[rows, k]`` weight of ``gtype`` in ``buft`` (for ``op`` ``mul_mat_id`` a stack of
    :data:`PROBE_EXPERTS` such experts, each row using :data:`PROBE_USED` of them), multiplied by batches
    of :data:`PROBE_BATCHES` activation rows on ``backend``; True when every row of every batch has the
    bits it has alone. False when the type cannot be placed there.

    Raises:
        RuntimeError: ggml failed to compute a probe graph."""
    rng = np.random.default_rng(7)
    n_exp = PROBE_EXPERTS if op == "mul_mat_id" else 1
    data = _quantized(gtype, (rng.standard_normal((rows * n_exp, k)) * 0.05).astype(np.float32))
    ctx = new_meta_context(2)
    buf = None
    try:
        weight = new_tensor(ctx, gtype, (k, rows) if op == "mul_mat" else (k, rows, n_exp))
        buf = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
        if not buf or ggml.ggml_nbytes(weight) != data.nbytes:
            return False
        set_tensor(weight, data)
        x = rng.standard_normal((max(PROBE_BATCHES), k)).astype(np.float32)
        ids = None if op == "mul_mat" else np.stack(
            [rng.choice(n_exp, PROBE_USED, replace=False) for _ in range(len(x))]).astype(np.int32)

        def product(lo: int, hi: int) -> np.ndarray:
            return _mul_mat(backend, weight, x[lo:hi], None if ids is None else ids[lo:hi])

        alone = [product(i, i + 1)[0] for i in range(len(x))]
        for n in PROBE_BATCHES:
            out = product(0, n)
            if any(out[i].tobytes() != alone[i].tobytes() for i in range(n)):
                return False
        return True
    finally:
        if buf:
            ggml.ggml_backend_buffer_free(buf)
        ggml.ggml_free(ctx)


def invariant_types(buft, op: str = "mul_mat") -> set[int]:
    """The :data:`CANDIDATE_TYPES` of ``op`` (``mul_mat`` or ``mul_mat_id``) whose repacked products keep
    every row's bits on this machine; probed once per process on a CPU backend of its own with one thread.
    One thread, because ggml's CPU backend parallelises a graph with an OpenMP team that belongs to the
    thread starting it: a probe run on the stages' shared backend from the loading thread would leave a
    second team beside the scheduler's, and decoding then ran at half speed (SmolLM2, 2 threads: 65
    instead of 130 tokens/s). The thread count does not change the verdict: the repacked kernels split a
    mat-mul between threads by weight rows, each result computed whole by one thread (measured the same at
    1 and 2 threads)."""
    with _lock:
        todo = [t for t in CANDIDATE_TYPES[op] if (op, t) not in _verdicts]
        if todo:
            backend = ggml.ggml_backend_cpu_init()
            if not backend:
                raise RuntimeError("ggml_backend_cpu_init failed")
            try:
                ggml.ggml_backend_cpu_set_n_threads(backend, 1)
                for t in todo:
                    _verdicts[op, t] = rows_keep_their_bits(t, backend, buft, op)
            finally:
                ggml.ggml_backend_free(backend)
        return {t for t in CANDIDATE_TYPES[op] if _verdicts[op, t]}


def _supports_halves(dev, buft, weight) -> bool:
    """Whether ``dev`` runs ``mul_mat_id`` over the 2-D ``weight`` kept in ``buft`` as a stack of its two
    halves of rows (an even number of them)."""
    ne = weight.contents.ne
    if int(ne[1]) % 2:
        return False
    ctx = new_meta_context(1)
    try:
        halves = new_tensor(ctx, int(weight.contents.type), (int(ne[0]), int(ne[1]) // 2, 2))
        return supports(dev, buft, halves, "mul_mat_id")
    finally:
        ggml.ggml_free(ctx)


def repack_weights(weights, reader, kinds: frozenset[str], huge_pages: bool = False) -> list[str]:
    """Move the mat-mul weights of ``weights`` (a :class:`~meshnet.engine.ggml_backend.StageWeights`) of
    the ``kinds`` (``blk.N.<kind>.weight`` or ``<kind>.weight``: 2-D ones, and 3-D expert stacks) whose
    type :func:`invariant_types` passes for their op (a 2-D weight whose type passes for ``mul_mat_id``
    only becomes a stack of its two halves of rows, which the graphs multiply with :func:`mul_mat`) and
    whose product the CPU backend supports repacked into one ``CPU_REPACK`` buffer (the data is copied and
    rearranged from ``reader``'s tensors; with ``huge_pages`` into memory advised for huge pages, see
    :mod:`meshnet.engine.huge_pages`). Returns the names moved (none without ``CPU_REPACK``).

    Raises:
        MemoryError: the repacked buffer could not be allocated.
    """
    found = repack_buffer_type()
    if found is None:
        return []
    dev, buft = found
    by_name = {t.name: t for t in reader.tensors}
    matrix_types, expert_types = invariant_types(buft, "mul_mat"), invariant_types(buft, "mul_mat_id")
    shapes = {}  # name -> the repacked tensor's shape (ggml order)
    for n, t in weights.tensors.items():
        if n.removesuffix(".weight").rsplit(".", 1)[-1] not in kinds:
            continue
        shape, gtype = tuple(int(d) for d in by_name[n].shape), int(t.contents.type)
        if len(shape) == 3 and gtype in expert_types and supports(dev, buft, t, "mul_mat_id"):
            shapes[n] = shape
        elif len(shape) == 2 and gtype in matrix_types and supports(dev, buft, t):
            shapes[n] = shape
        elif len(shape) == 2 and gtype in expert_types and _supports_halves(dev, buft, t):
            shapes[n] = (shape[0], shape[1] // 2, 2)  # its halves of rows as two experts (see mul_mat)
    names = list(shapes)
    if not names:
        return []
    ctx = new_meta_context(len(names) + 1)
    moved = {}
    for name in names:
        t = new_tensor(ctx, int(by_name[name].tensor_type), shapes[name])
        ggml.ggml_set_name(t, name.encode())
        if len(by_name[name].shape) == 2 and len(shapes[name]) == 3:
            t.row_halves = True  # read by mul_mat: this ctypes object is what the graphs get
        moved[name] = t
    buf = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    if not buf:
        ggml.ggml_free(ctx)
        raise MemoryError("could not allocate the repacked weight buffer")
    if huge_pages:
        advise_buffer(buf)
    for name, t in moved.items():
        set_tensor(t, by_name[name].data)  # the buffer type rearranges the blocks as they are set
    weights.adopt(ctx, buf, moved)
    return names
