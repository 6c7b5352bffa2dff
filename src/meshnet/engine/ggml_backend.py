"""ggml memory for one stage: the CPU backend and the range's weights as stored (KV cells: ``kv_pool``).

Everything here talks to ggml through ``ggml-python``'s ctypes bindings; nothing opens a socket.
Weights are copied once from the memory-mapped GGUF into one backend buffer in their stored type
(Q4_1 stays Q4_1), so a stage's resident memory follows its layer range.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import ggml
import ggml.utils  # noqa: F401  (ggml-python needs this import for its type helpers)
import numpy as np

from meshnet.backends.errors import BackendUnavailable
from meshnet.model.gguf_split import shard_groups

_init_lock = threading.Lock()
_cpu_ready = False
_backends: dict[int, object] = {}
_compute_locks: dict[int, threading.Lock] = {}
# Stages using the CPU backend now, and the thread that runs their graphs while they are several (see compute).
_cpu_stages = 0
_cpu_compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ggml-cpu-compute")


def foreign_ggml_libraries(mapped: Iterable[str], own: Iterable[str]) -> list[str]:
    """The ggml shared libraries among ``mapped`` that are not ggml-python's own.

    Args:
        mapped: paths of the files mapped into the process (as ``/proc/self/maps`` lists them: real paths).
        own: real paths of the files in ggml-python's ``lib`` folder.
    Returns:
        Sorted, distinct paths whose file name starts with ``libggml`` and contains ``.so`` (so
        ``libggml-cpu.so`` and ``libggml-base.so.0`` count) but that are not in ``own``.
    """
    own_set = set(own)
    return sorted({p for p in mapped
                   if os.path.basename(p).startswith("libggml") and ".so" in os.path.basename(p)
                   and p not in own_set})


def _mapped_files(maps_text: str) -> list[str]:
    """File paths in the text of ``/proc/PID/maps`` (the sixth field of a line, when it is a path)."""
    out = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            out.append(fields[5])
    return out


def check_ggml_libraries() -> None:
    """Refuse to run on a ggml other than ggml-python's own.

    The bindings load their libraries from their own folder, but the dynamic linker still honours
    ``LD_LIBRARY_PATH``/``LD_PRELOAD`` for the libraries' dependencies: a llama.cpp build's folder there
    brings in its own ``libggml-cpu.so``, whose symbols then mix with the bindings' build and abort the
    process on the first graph (``ggml_get_n_tasks: op not implemented``). Checking what is mapped turns
    that abort into an error at start-up. Does nothing where ``/proc/self/maps`` does not exist.

    Raises:
        BackendUnavailable: a ggml library from another folder is loaded; the message names it, the
            bindings' folder and ``LD_LIBRARY_PATH``.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return
    lib_dir = Path(ggml.__file__).resolve().parent / "lib"
    own = [str(f.resolve()) for f in lib_dir.iterdir()] if lib_dir.is_dir() else []
    foreign = foreign_ggml_libraries(_mapped_files(maps), own)
    if foreign:
        raise BackendUnavailable(
            "cpu", f"this process loaded ggml libraries from outside ggml-python's {lib_dir}: "
                   f"{', '.join(foreign)} (LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')!r}, "
                   f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}); a different ggml build aborts on the "
                   f"first step. Remove that folder from LD_LIBRARY_PATH / LD_PRELOAD")


_log = logging.getLogger("meshnet.ggml")
_last_level = [ggml.GGML_LOG_LEVEL_NONE]  # what a GGML_LOG_LEVEL_CONT message continues


@ggml.ggml_log_callback
def _ggml_log(level: int, text: bytes, user_data) -> None:
    """ggml's messages into Python's logging: warnings and errors at their level, the rest (debug
    chatter such as one line per repacked tensor) at DEBUG, instead of ggml's default of all on stderr."""
    if level == ggml.GGML_LOG_LEVEL_CONT:
        level = _last_level[0]
    _last_level[0] = level
    msg = (text or b"").decode(errors="replace").rstrip("\n")
    if msg:
        _log.log(logging.ERROR if level == ggml.GGML_LOG_LEVEL_ERROR else
                 logging.WARNING if level == ggml.GGML_LOG_LEVEL_WARN else logging.DEBUG, "%s", msg)


def cpu_backend(n_threads: int):
    """The process's ggml CPU backend for ``n_threads`` threads, shared by every stage in the process.

    Stages run one after another, so one backend (one thread pool) serves them all; a backend per
    stage would keep several pools of spinning threads competing for the same cores. Lives until exit.
    Each call counts a stage using it until :func:`release_cpu_backend`.

    Raises:
        BackendUnavailable: another ggml build is loaded (see :func:`check_ggml_libraries`).
    """
    global _cpu_ready, _cpu_stages
    with _init_lock:
        _cpu_stages += 1
        if not _cpu_ready:
            check_ggml_libraries()
            ggml.ggml_log_set(_ggml_log, None)
            ggml.ggml_cpu_init()
            _cpu_ready = True
        backend = _backends.get(n_threads)
        if backend is None:
            backend = ggml.ggml_backend_cpu_init()
            if not backend:
                raise RuntimeError("ggml_backend_cpu_init failed")
            ggml.ggml_backend_cpu_set_n_threads(backend, int(n_threads))
            _backends[n_threads] = backend
            _compute_locks[id(backend)] = threading.Lock()
        return backend


def release_cpu_backend() -> None:
    """A stage that took the CPU backend from :func:`cpu_backend` no longer computes on it."""
    global _cpu_stages
    with _init_lock:
        _cpu_stages = max(0, _cpu_stages - 1)


def compute(backend, graph) -> None:
    """Run a graph on a shared backend, one graph at a time (the CPU backend keeps one work buffer).

    While several stages of the process use the CPU backend, their graphs all run on one shared
    compute thread: ggml's CPU backend parallelises a graph with OpenMP, whose thread team belongs to
    the thread that starts it, and graphs started by several threads in turn (one scheduler thread per
    stage) keep several teams on the same cores. Measured with three stages in one process, 2 threads:
    6.4 ms of compute per decoded token from one thread, 15.4 ms from three. A process with one stage
    (a node's worker, an API over the whole model) computes on its scheduler thread: the hand-off costs
    about 0.17 ms a graph.

    Raises:
        RuntimeError: ggml reported a failure status.
    """
    if _cpu_stages > 1 and backend in _backends.values():
        status = _cpu_compute.submit(_compute_locked, backend, graph).result()
    else:
        status = _compute_locked(backend, graph)
    if status != ggml.GGML_STATUS_SUCCESS:
        raise RuntimeError(f"ggml graph compute failed with status {status}")


def _compute_locked(backend, graph) -> int:
    with _compute_locks[id(backend)]:
        return ggml.ggml_backend_graph_compute(backend, graph)


def new_meta_context(n_tensors: int, graph_size: int = 0) -> ggml.ggml_context_p:
    """A ggml context that holds tensor metadata only (``no_alloc``): data lives in backend buffers."""
    mem = ggml.ggml_tensor_overhead() * n_tensors
    if graph_size:
        mem += ggml.ggml_graph_overhead_custom(graph_size, False)
    params = ggml.ggml_init_params(mem_size=mem + 1024, mem_buffer=None, no_alloc=True)
    ctx = ggml.ggml_init(params)
    if not ctx:
        raise MemoryError("ggml_init failed")
    return ctx


def new_tensor(ctx, gtype: int, shape: tuple[int, ...]):
    """``shape`` in ggml order (ne0 first)."""
    ne = (ctypes.c_int64 * len(shape))(*shape)
    return ggml.ggml_new_tensor(ctx, gtype, len(shape), ne)


def set_tensor(t, array: np.ndarray) -> None:
    """Copy a contiguous numpy array's bytes into a backend tensor (sizes must match exactly)."""
    a = np.ascontiguousarray(array)
    n = ggml.ggml_nbytes(t)
    if a.nbytes != n:
        raise ValueError(f"tensor size mismatch: ggml wants {n} bytes, got {a.nbytes}")
    ggml.ggml_backend_tensor_set(t, a.ctypes.data_as(ctypes.c_void_p), 0, n)


def get_tensor(t, dtype=np.float32) -> np.ndarray:
    """Read a 2-D backend tensor ``[ne0, ne1]`` into a new numpy array ``(ne1, ne0)`` of ``dtype``
    (a trailing ne1 of 1 is kept, unlike ggml_n_dims)."""
    n = ggml.ggml_nbytes(t)
    shape = (int(t.contents.ne[1]), int(t.contents.ne[0]))
    out = np.empty(shape, dtype=dtype)
    if out.nbytes != n:
        raise ValueError(f"tensor read size mismatch: {out.nbytes} != {n}")
    ggml.ggml_backend_tensor_get(t, out.ctypes.data_as(ctypes.c_void_p), 0, n)
    return out


# ggml-python declares this function's result as a plain int, which truncates the pointer; fix the
# ctypes signature once.
cpu_buffer_from_ptr = ggml.lib.ggml_backend_cpu_buffer_from_ptr
cpu_buffer_from_ptr.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
cpu_buffer_from_ptr.restype = ctypes.c_void_p


class StageWeights:
    """The tensors of one layer range, in their stored GGUF types, on the CPU backend.

    With ``use_mmap`` (the default, as in llama.cpp) the tensors point straight into the read-only
    memory map of the file: loading copies nothing, and only pages a stage actually reads become
    resident — the head reads just the embedding rows of its tokens. A split set gets one mapped buffer
    per shard that holds some of the stage's tensors (llama.cpp maps each split file into its own
    buffer in ``llama_model_loader::init_mappings`` / ``load_all_data``); shards it does not read are
    never wrapped. Without ``use_mmap`` the tensors are copied into one backend buffer. ``get(name)``
    returns the ggml tensor for a GGUF tensor name, or None.

    ``reader`` is a ``gguf.GGUFReader`` or a :class:`meshnet.model.gguf_split.SplitGGUF`.
    """

    def __init__(self, reader, names: tuple[str, ...], backend, use_mmap: bool = True) -> None:
        by_name = {t.name: t for t in reader.tensors}
        self.ctx = new_meta_context(len(names) + 1)
        self.tensors: dict[str, object] = {}
        self.owns_buffer = not use_mmap
        self._reader = reader  # keeps the memory maps alive while tensors point into them
        for name in names:
            rt = by_name[name]
            shape = tuple(int(d) for d in rt.shape)  # gguf lists dims ne0-first, as ggml does
            t = new_tensor(self.ctx, int(rt.tensor_type), shape)
            ggml.ggml_set_name(t, name.encode())
            self.tensors[name] = t
        self.nbytes = sum(int(by_name[n].n_bytes) for n in names)
        self._mapped = set(names) if use_mmap else set()  # names whose data is still the file's map
        self.buffers: list = []
        self._more_ctx: list = []  # contexts of tensors moved into other buffers (``adopt``)
        if use_mmap:
            for shard, held in shard_groups(reader, names):
                buffer = cpu_buffer_from_ptr(shard.data.ctypes.data, len(shard.data))
                if not buffer:
                    self.free()
                    raise MemoryError("could not wrap the model's memory map in a ggml buffer")
                self.buffers.append(buffer)
                for name in held:
                    addr = by_name[name].data.ctypes.data
                    ggml.ggml_backend_tensor_alloc(buffer, self.tensors[name], ctypes.c_void_p(addr))
        else:
            buffer = ggml.ggml_backend_alloc_ctx_tensors(self.ctx, backend)
            if not buffer:
                raise MemoryError("could not allocate the weight buffer")
            self.buffers.append(buffer)
            for name in names:
                set_tensor(self.tensors[name], by_name[name].data)

    @property
    def buffer(self):
        """The first backend buffer of the weights (the only one, unless they are mapped from several
        shards of a split set); None once freed."""
        return self.buffers[0] if self.buffers else None

    def get(self, name: str):
        return self.tensors.get(name)

    def adopt(self, ctx, buffer, tensors: dict[str, object]) -> None:
        """Serve ``tensors`` (made in ``ctx``, their data in ``buffer``: copies of some of the stage's
        weights in another layout, see :mod:`meshnet.engine.cpu_repack`, or in other memory, see
        :mod:`meshnet.engine.huge_pages`) instead of the ones of the same names; ``ctx`` and ``buffer`` are
        freed with the rest."""
        self._more_ctx.append(ctx)
        self.buffers.append(buffer)
        self.tensors.update(tensors)
        self._mapped -= tensors.keys()

    def mapped_names(self) -> list[str]:
        """The names whose tensors still point into the file's memory map, in load order."""
        return [n for n in self.tensors if n in self._mapped]

    def free(self) -> None:
        for buffer in self.buffers:
            ggml.ggml_backend_buffer_free(buffer)  # for a mapped buffer this frees only ggml's handle
        self.buffers = []
        for ctx in [self.ctx, *self._more_ctx]:
            if ctx:
                ggml.ggml_free(ctx)
        self.ctx, self._more_ctx = None, []


# ---- accelerator devices (CUDA, ROCm, Vulkan, Metal) ----------------------------------------------
# Nothing below is used by the CPU path above; it only reads ggml's backend registry, which lists a
# backend only when the installed ggml-python was built with it (scripts/build_ggml_lane.sh).

# ggml's registry names for each accelerator lane: GGML_CUDA_NAME ("CUDA", or "ROCm" in a HIP build),
# GGML_VK_NAME ("Vulkan") and GGML_METAL_NAME ("MTL"; some builds spell it "Metal").
ACCELERATOR_REGISTRY_NAMES: dict[str, tuple[str, ...]] = {
    "cuda": ("CUDA",),
    "rocm": ("ROCm",),
    "vulkan": ("Vulkan",),
    "metal": ("MTL", "Metal"),
}
_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
_accel_backends: dict[tuple[str, int], object] = {}


def registry_backends() -> list[str]:
    """Names of the backends ggml registered in this process (e.g. ``["CPU"]`` or ``["CUDA", "CPU"]``)."""
    return [ggml.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)).decode()
            for i in range(ggml.ggml_backend_reg_count())]


def registry_devices() -> list[dict]:
    """Every device in ggml's registry: ``{"index", "backend", "name", "description", "type",
    "memory_free_bytes", "memory_total_bytes"}`` (memory in bytes, as the backend reports it; the CPU
    backend reports host memory)."""
    out = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        props = ggml.ggml_backend_dev_props()
        ggml.ggml_backend_dev_get_props(dev, ctypes.byref(props))
        reg = ggml.ggml_backend_dev_backend_reg(dev)
        out.append({
            "index": i,
            "backend": ggml.ggml_backend_reg_name(reg).decode() if reg else "",
            "name": (props.name or b"").decode(errors="replace"),
            "description": (props.description or b"").decode(errors="replace"),
            "type": _DEVICE_TYPES.get(int(props.type), str(int(props.type))),
            "memory_free_bytes": int(props.memory_free),
            "memory_total_bytes": int(props.memory_total),
        })
    return out


def accelerator_devices(lane: str) -> list[dict]:
    """The registry's devices that belong to ``lane``'s backend (see :func:`registry_devices`); empty
    when ggml-python was not built with it or the backend found no device.

    Raises:
        ValueError: ``lane`` is not one of cuda, rocm, vulkan, metal.
    """
    names = ACCELERATOR_REGISTRY_NAMES.get(lane)
    if names is None:
        raise ValueError(f"unknown accelerator lane {lane!r}; expected one of {', '.join(ACCELERATOR_REGISTRY_NAMES)}")
    return [d for d in registry_devices() if d["backend"] in names]


def device_memory(lane: str, device_index: int = 0) -> tuple[int, int]:
    """(free, total) bytes of the lane's ``device_index``-th device, as ggml reports them now.

    Raises:
        BackendUnavailable: no such device.
    """
    devs = accelerator_devices(lane)
    if device_index >= len(devs):
        raise BackendUnavailable(lane, f"ggml lists {len(devs)} {lane} device(s), no device {device_index}")
    dev = ggml.ggml_backend_dev_get(devs[device_index]["index"])
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


def accelerator_backend(lane: str, device_index: int = 0):
    """The process's ggml backend on the ``device_index``-th device of ``lane`` (cuda, rocm, vulkan or
    metal), created once and shared like :func:`cpu_backend`; lives until exit.

    Tensors allocated with it (weights copied with ``use_mmap=False``, KV caches, graph buffers) live in
    that device's memory, and :func:`compute` runs graphs on it.

    Raises:
        ValueError: unknown lane.
        BackendUnavailable: the installed ggml-python was not built with the lane's backend, the
            backend lists no such device, the device failed to initialise, or another ggml build is
            loaded (:func:`check_ggml_libraries`); ``reason`` says which.
    """
    names = ACCELERATOR_REGISTRY_NAMES.get(lane)
    if names is None:
        raise ValueError(f"unknown accelerator lane {lane!r}; expected one of {', '.join(ACCELERATOR_REGISTRY_NAMES)}")
    with _init_lock:
        backend = _accel_backends.get((lane, device_index))
        if backend is not None:
            return backend
        check_ggml_libraries()
        if not any(n in registry_backends() for n in names):
            raise BackendUnavailable(lane, f"the installed ggml-python has no {names[0]} backend "
                                           f"(registered: {', '.join(registry_backends()) or 'none'})")
        devs = accelerator_devices(lane)
        if device_index >= len(devs):
            raise BackendUnavailable(lane, f"ggml's {names[0]} backend lists {len(devs)} device(s), "
                                           f"no device {device_index}")
        backend = ggml.ggml_backend_dev_init(ggml.ggml_backend_dev_get(devs[device_index]["index"]), None)
        if not backend:
            raise BackendUnavailable(lane, f"ggml could not initialise {devs[device_index]['name']}")
        _accel_backends[(lane, device_index)] = backend
        _compute_locks[id(backend)] = threading.Lock()
        return backend
