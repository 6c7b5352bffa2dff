"""One stage's KV cache pool: the F16 K and V cells of every open session, counted in tokens.

Layout, per layer of the range: K ``[n_embd_k, n_slots * n_ctx]`` and V ``[n_embd_v, n_slots * n_ctx]``
(ggml order), the widths the architecture's cache holds per token (``ModelConfig.n_embd_k_cache`` /
``n_embd_v_cache``: K and V of every KV head; for multi-head latent attention a K cell of latent + rope
part and no V tensor, V being a view of the K cells). A session holds one slot and keeps position ``p`` in cell ``slot * n_ctx + p``, so
its attention reads the same cells in the same order as it would alone: that is what keeps a batched
session's output equal to its solo output bit for bit (flash attention's online softmax depends on the
order of the cells it visits).

On the CPU the pool is one anonymous memory map, reserved but not committed: a page becomes resident when
a step first writes a cell in it, so memory follows the tokens actually held (the idea of vAttention,
Prabhu et al. 2024: virtually contiguous KV, physical memory on demand, instead of paging the attention
kernel). Releasing a session hands its pages back (``madvise(MADV_DONTNEED)``) so the next session's
cells start zeroed: masked cells are skipped by attention, but a NaN in one could still poison a sum.
On an accelerator the pool is one device buffer allocated (and zeroed) up front.

Admission is counted in tokens (``kv_tokens``): each session reserves the cells it may use (its prompt
plus its new tokens, at most ``n_ctx``) when it opens; a reservation is never taken back while the
session lives, so a running session never fails for lack of the cells it was promised.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading
from dataclasses import dataclass

import ggml

from meshnet.contract import LayerRange
from meshnet.engine.ggml_backend import cpu_buffer_from_ptr, new_meta_context, new_tensor

PAGE = mmap.PAGESIZE
# Python's mmap module names MAP_NORESERVE only from 3.12; before it, Linux's value where the kernel's
# generic one holds. Without it a pool of n_slots * n_ctx cells counts whole against the commit limit:
# with 20 slots of 100k tokens (46 GB of address space) the map failed with ENOMEM on a 24 GiB machine,
# though a pool's pages are only touched as cells are handed out.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in (
    "x86_64", "aarch64", "arm64", "riscv64", "s390x", "i686") else 0)
# This process's C library, with the prototypes of the memory calls meshnet makes through it (the KV pool
# here; huge_pages' madvise).
libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def available_memory_bytes() -> int:
    """Memory the system could give a process now, in bytes: ``MemAvailable`` of /proc/meminfo, or the
    free pages where that file does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _smaps_rss(start: int, size: int) -> int | None:
    """``Rss`` in bytes of this process's mapping ``[start, start + size)``; None when /proc/self/smaps
    cannot be read or has no mapping of exactly that extent (the kernel merged it with a neighbour, whose
    pages its Rss would count)."""
    head = f"{start:x}-{start + size:x} "
    try:
        with open("/proc/self/smaps") as f:
            found = False
            for line in f:
                if not found:
                    found = line.startswith(head)
                elif line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PoolFull(Exception):
    """No free slot, or not enough unreserved cells, for a new reservation."""


class PoolTooSmall(ValueError):
    """A reservation larger than the whole pool: it would not fit even with every other session gone."""


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def rows_per_slot(n_ctx: int, ratio: int) -> int:
    """Rows a slot of ``n_ctx`` cells has in a tensor with one row per ``ratio`` positions (K and V: 1;
    a compressed cache: one per block); slot ``s``'s rows start at row ``s * rows_per_slot``."""
    return -(-n_ctx // ratio)


@dataclass(frozen=True)
class AuxCache:
    """Per-session state a layer keeps beside its KV cells (DeepSeek-V4's compressor cells and compressed
    rows): ``width`` values of ggml type ``gtype`` per row, one row per ``ratio`` positions of a slot
    (``ceil(n_ctx / ratio)`` rows a slot), plus one scratch row after the last slot's that writes of no
    row go to. Row ``i`` of slot ``s`` covers positions ``[i * ratio, (i + 1) * ratio)``."""

    name: str
    gtype: int
    width: int
    ratio: int = 1

    def row_bytes(self) -> int:
        return int(ggml.ggml_row_size(self.gtype, self.width))


class KVPool:
    """K and V cells of ``n_slots`` sessions of up to ``n_ctx`` tokens each, of which at most ``kv_tokens``
    cells are reserved at once.

    Args:
        layers: the stage's layer range; ``k[il]``/``v[il]`` exist for each ``il`` in it.
        n_embd_k, n_embd_v: K and V row widths (``n_embd_k_cache``, ``n_embd_v_cache``); ``n_embd_v``
            0: no V tensors (``v`` is empty; attention reads V from the K cells).
        n_ctx: cells per slot (a session's context length).
        n_slots: sessions the pool can hold at once (on a device, at most as many as ``kv_tokens`` fill:
            a device pool is allocated up front).
        kv_tokens: cells that may be reserved at once; 0 derives it from ``budget_bytes``, or when that
            is 0 too from half the memory available now. Never more than ``n_slots * n_ctx``.
        backend: the ggml backend; ``host=True`` (the CPU) maps the pool lazily, otherwise it is one
            backend buffer.
        aux: per layer, the :class:`AuxCache` tensors it keeps beside its cells (``aux[il, name]``); they
            are reserved, copied, released and zeroed with the slot's cells.
    Raises:
        MemoryError: the map or buffer could not be made.
    """

    def __init__(self, layers: LayerRange, n_embd_k: int, n_embd_v: int, n_ctx: int, n_slots: int,
                 kv_tokens: int, backend, host: bool = True, budget_bytes: int = 0,
                 aux: dict[int, tuple[AuxCache, ...]] | None = None) -> None:
        if n_slots < 1 or n_ctx < 1:
            raise ValueError(f"a KV pool needs n_slots >= 1 and n_ctx >= 1, got {n_slots} and {n_ctx}")
        aux = aux or {}
        self.row_k, self.row_v = 2 * n_embd_k, 2 * n_embd_v  # F16 bytes per cell
        self.bytes_per_token = self.token_bytes(layers.n_layers, n_embd_k, n_embd_v) + sum(
            -(-c.row_bytes() // c.ratio) for caches in aux.values() for c in caches)
        if not kv_tokens:
            kv_tokens = max(1, (budget_bytes or available_memory_bytes() // 2) // self.bytes_per_token)
        if not host:
            n_slots = max(1, min(n_slots, -(-kv_tokens // n_ctx)))
        self.layers, self.n_ctx, self.n_slots = layers, n_ctx, n_slots
        self.kv_tokens = min(kv_tokens, n_slots * n_ctx)
        self.ctx = new_meta_context(2 * layers.n_layers + 1 + sum(len(c) for c in aux.values()))
        self.k: dict[int, object] = {}
        self.v: dict[int, object] = {}
        self.aux: dict[tuple[int, str], object] = {}
        self._aux_specs: dict[tuple[int, str], AuxCache] = {}
        for il in range(layers.start, layers.end):
            self.k[il] = new_tensor(self.ctx, ggml.GGML_TYPE_F16, (n_embd_k, n_slots * n_ctx))
            if n_embd_v:
                self.v[il] = new_tensor(self.ctx, ggml.GGML_TYPE_F16, (n_embd_v, n_slots * n_ctx))
            for c in aux.get(il, ()):
                rows = n_slots * rows_per_slot(n_ctx, c.ratio) + (1 if c.ratio > 1 else 0)
                self.aux[il, c.name] = new_tensor(self.ctx, c.gtype, (c.width, rows))
                self._aux_specs[il, c.name] = c
        self._lock = threading.Lock()
        self._free_slots = list(range(n_slots))  # lowest first: the decode group spans the lowest slots
        self._reserved: dict[int, int] = {}  # slot -> cells reserved
        self._map: mmap.mmap | None = None
        # (offset in the map, bytes per slot, bytes per row, positions per row) per K / V / aux tensor
        self._regions: list[tuple[int, int, int, int]] = []
        if host:
            self._map_pool()
        else:
            self.buffer = ggml.ggml_backend_alloc_ctx_tensors(self.ctx, backend)
            if not self.buffer:
                raise MemoryError(f"could not allocate a {self.bytes_per_token * n_slots * n_ctx}-byte KV pool")
            ggml.ggml_backend_buffer_clear(self.buffer, 0)
        self.nbytes_virtual = self.bytes_per_token * n_slots * n_ctx

    @staticmethod
    def token_bytes(n_layers: int, n_embd_k: int, n_embd_v: int) -> int:
        """F16 K and V bytes one token takes over ``n_layers`` layers."""
        return n_layers * 2 * (n_embd_k + n_embd_v)

    def _map_pool(self) -> None:
        offsets, size = [], 0
        for il in range(self.layers.start, self.layers.end):
            tensors = [(self.k[il], self.row_k, 1), (self.v.get(il), self.row_v, 1)]
            tensors += [(self.aux[key], c.row_bytes(), c.ratio) for key, c in self._aux_specs.items() if key[0] == il]
            for t, row, ratio in tensors:
                if t is None:
                    continue
                per_slot = row * rows_per_slot(self.n_ctx, ratio)
                offsets.append((t, size, per_slot, row, ratio))
                size = _align_up(size + ggml.ggml_nbytes(t), PAGE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        # One inaccessible page on each side: the kernel merges adjacent anonymous mappings of the same
        # kind (another stage's pool, say) into one, whose Rss in /proc/self/smaps would count both.
        self._map = mmap.mmap(-1, size + 2 * PAGE, flags=flags)
        start = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        for guard in (start, start + PAGE + size):
            libc.mprotect(ctypes.c_void_p(guard), ctypes.c_size_t(PAGE), 0)  # PROT_NONE
        self._base = start + PAGE
        self._size = size
        self.buffer = cpu_buffer_from_ptr(self._base, size)
        if not self.buffer:
            raise MemoryError("could not wrap the KV pool's memory map in a ggml buffer")
        for t, off, per_slot, row, ratio in offsets:
            ggml.ggml_backend_tensor_alloc(self.buffer, t, ctypes.c_void_p(self._base + off))
            self._regions.append((off, per_slot, row, ratio))

    # ---- reservations ------------------------------------------------------------------------
    def acquire(self, reserve_tokens: int, high: bool = False) -> int:
        """Open a slot with ``reserve_tokens`` cells reserved (clamped to ``[1, n_ctx]``); returns the slot:
        the lowest free one (decodes are attended over the lowest slots), or with ``high`` the highest.

        Raises:
            PoolFull: every slot is taken, or fewer than ``reserve_tokens`` cells are unreserved; the
                message gives the figures.
            PoolTooSmall: ``reserve_tokens`` (clamped) is more than the pool's ``kv_tokens``: waiting
                for other sessions to end would not help.
        """
        want = max(1, min(self.n_ctx, reserve_tokens or self.n_ctx))
        if want > self.kv_tokens:
            raise PoolTooSmall(f"a session needs {want} KV cells, more than the {self.kv_tokens} the stage's pool "
                               f"holds (--kv-tokens): ask for fewer tokens (max_tokens)")
        with self._lock:
            if not self._free_slots:
                raise PoolFull(f"all {self.n_slots} KV slots are in use")
            free = self.kv_tokens - sum(self._reserved.values())
            if want > free:
                raise PoolFull(f"a new session needs {want} KV cells; {free} of {self.kv_tokens} are unreserved")
            slot = self._free_slots.pop(-1 if high else 0)
            self._reserved[slot] = want
            return slot

    def ensure(self, slot: int, n_cells: int) -> bool:
        """Make sure ``slot`` has ``n_cells`` cells reserved, growing its reservation from the unreserved
        cells if needed; False (nothing changed) when there are not enough."""
        with self._lock:
            have = self._reserved[slot]
            if n_cells <= have:
                return True
            free = self.kv_tokens - sum(self._reserved.values())
            if n_cells - have > free or n_cells > self.n_ctx:
                return False
            self._reserved[slot] = n_cells
            return True

    def shrink(self, slot: int, n_cells: int) -> None:
        """Lower ``slot``'s reservation to the ``n_cells`` it holds (a finished session kept for its
        prefix), handing the rest back to the pool."""
        with self._lock:
            if slot in self._reserved:
                self._reserved[slot] = max(1, min(self._reserved[slot], n_cells))

    @property
    def host(self) -> bool:
        """Whether the cells are in host memory (their bytes can be copied from Python)."""
        return self._map is not None

    def copy_cells(self, src: int, dst: int, n_cells: int) -> None:
        """Copy the first ``n_cells`` cells (positions ``[0, n_cells)``) of every layer's K and V from slot
        ``src`` to slot ``dst``, and of its auxiliary state the rows whose positions all lie among them.
        Host pools only."""
        assert self._map is not None, "copy_cells needs a host pool"
        for off, per_slot, row, ratio in self._regions:
            ctypes.memmove(self._base + off + dst * per_slot, self._base + off + src * per_slot,
                           n_cells // ratio * row)

    def release(self, slot: int) -> None:
        """Close ``slot``: its reservation returns to the pool and its cells to zero (pages handed back to
        the kernel on the CPU). Idempotent."""
        with self._lock:
            if self._reserved.pop(slot, None) is None:
                return
        self._zero_slot(slot)
        with self._lock:
            self._free_slots.append(slot)
            self._free_slots.sort()

    def _zero_slot(self, slot: int) -> None:
        if self._map is None:
            return  # device pools: cells are overwritten before any unmasked read
        for off, per_slot, _, _ in self._regions:
            start, end = off + slot * per_slot, off + (slot + 1) * per_slot
            a, b = _align_up(start, PAGE), end // PAGE * PAGE
            if a >= b:
                ctypes.memset(self._base + start, 0, end - start)
                continue
            # Partial pages at the edges are shared with the neighbouring slots: zero them in place.
            ctypes.memset(self._base + start, 0, a - start)
            ctypes.memset(self._base + b, 0, end - b)
            self._map.madvise(mmap.MADV_DONTNEED, PAGE + a, b - a)  # past the guard page

    # ---- figures -----------------------------------------------------------------------------
    @property
    def tokens_reserved(self) -> int:
        with self._lock:
            return sum(self._reserved.values())

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return len(self._reserved)

    def cell_index(self, slot: int, position: int) -> int:
        """The pool cell that holds ``position`` of the session in ``slot``."""
        return slot * self.n_ctx + position

    def resident_bytes(self) -> int:
        """Bytes of the pool backed by memory of its own now: the map's ``Rss`` in /proc/self/smaps, which
        leaves out pages only ever read (they all map the kernel's one zero page); where that file is not
        readable, pages in core by ``mincore`` (which counts those too). The whole buffer on a device."""
        if self._map is None:
            return self.nbytes_virtual
        rss = _smaps_rss(self._base, self._size)
        if rss is not None:
            return rss
        n_pages = self._size // PAGE
        vec = (ctypes.c_ubyte * n_pages)()
        if libc.mincore(ctypes.c_void_p(self._base), ctypes.c_size_t(self._size), vec) != 0:
            return self._size
        return sum(b & 1 for b in bytes(vec)) * PAGE

    def free(self) -> None:
        if self.buffer:
            ggml.ggml_backend_buffer_free(self.buffer)  # a mapped buffer: frees only ggml's handle
            self.buffer = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None
        if self._map is not None:
            self._map = None  # the ctypes view keeps the map exported; it goes with the last reference
