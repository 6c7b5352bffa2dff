"""Weights in transparent huge pages, so that streaming them costs fewer TLB misses.

A decode step reads every mat-mul weight of a stage once (92 MiB a token for SmolLM2-135M Q4_1), far more
than the caches hold: the kernels stream the weights from memory, and with 4 KiB pages that walk crosses
a page every 4 KiB, each a TLB miss (in a virtual machine a two-level walk). llama.cpp maps the GGUF file
(4 KiB page-cache pages) or, with ``--no-mmap``, copies it into ``malloc``'d memory that Linux backs with
huge pages only when THP is ``always``. Measured on a 2-core AMD EPYC VM (AVX512, THP ``madvise``),
greedy decoding of SmolLM2 at 2 threads: the same kernel (``ggml_vec_dot_q4_1_q8_1``, identical code)
took about 10% more time a token in meshnet's mapped weights than in llama-bench's (``perf``), and two
engines in one process, one mapped and one copied into memory advised ``MADV_HUGEPAGE``, decoding 64
tokens in turn, gave 1.053x (30 pairs, 26 above 1; the API served 1.058x, see the README).

:func:`copy_into_huge_pages` copies a stage's mapped weights into one CPU buffer advised so before the
bytes are written; the bytes and the kernels are the same, so every result keeps its bits. Where the
kernel offers no THP (``never``, or not Linux), or the weights would take more than half the memory
available, the stage does not copy and the weights stay mapped. The token embedding of a stage that only
looks rows up in it (``get_rows``: the head, unless it is also the tied output) stays mapped too: its rows
are read a token at a time, and mapped only the rows read are resident.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import tempfile
from pathlib import Path

import ggml

from meshnet.engine.ggml_backend import new_meta_context, new_tensor, set_tensor
from meshnet.engine.kv_pool import available_memory_bytes, libc

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
# Weights are copied only while they take at most this share of the memory available: mapped, their pages
# are the file's and the kernel can evict them, so a stage that barely fits still loads; copied, they
# could only be swapped, or the process killed.
COPY_SHARE = 0.5
# Stages loading on one machine take turns to judge and copy (an flock on this file), so that each judges
# the memory the copies before it left: nodes that ``meshnet up`` starts at once would otherwise each see
# the same memory available and all copy.
TURN_LOCK = Path(tempfile.gettempdir()) / "meshnet-weight-copies.lock"


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent-huge-page setting (``always``, ``madvise`` or ``never``: the bracketed
    word of ``path``), or ``""`` where there is none (not Linux, or a kernel without THP)."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def huge_pages_available() -> bool:
    """Whether memory advised ``MADV_HUGEPAGE`` gets huge pages here (THP ``always`` or ``madvise``)."""
    return sys.platform.startswith("linux") and thp_mode() in ("always", "madvise")


def worth_copying(reader, names) -> bool:
    """Whether the tensors ``names`` of ``reader`` should move into huge pages here: THP is offered and
    their bytes take at most :data:`COPY_SHARE` of the memory available now."""
    wanted = set(names)
    nbytes = sum(int(t.n_bytes) for t in reader.tensors if t.name in wanted)
    return huge_pages_available() and nbytes <= COPY_SHARE * available_memory_bytes()


@contextlib.contextmanager
def copy_turn(path: Path = TURN_LOCK):
    """Hold this machine's turn to judge and copy weights (blocks while another process or stage holds
    it). Where the lock file cannot be opened (another user's, a read-only temp folder), or there is no
    ``fcntl`` (Windows), it goes on alone."""
    try:
        import fcntl

        f = open(path, "a")  # noqa: SIM115 - held for the block below
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def advise_huge_pages(base: int, size: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on the whole huge pages inside ``[base, base + size)`` (addresses in
    bytes): pages of it touched later are backed by 2 MiB pages where the kernel can. Returns whether the
    kernel took the advice (False off Linux, for a range holding no whole huge page, or on an error)."""
    if not sys.platform.startswith("linux"):
        return False
    start = -(-base // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    length = (base + size - start) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if length <= 0:
        return False
    return libc.madvise(start, length, MADV_HUGEPAGE) == 0


def advise_buffer(buffer) -> bool:
    """:func:`advise_huge_pages` on a ggml backend buffer's memory (call it before the data is set)."""
    base = ggml.ggml_backend_buffer_get_base(buffer)
    return bool(base) and advise_huge_pages(int(base), int(ggml.ggml_backend_buffer_get_size(buffer)))


def copy_into_huge_pages(weights, reader, backend, keep_mapped: frozenset[str] = frozenset()) -> list[str]:
    """Copy the tensors of ``weights`` (a :class:`~meshnet.engine.ggml_backend.StageWeights` whose
    tensors point into ``reader``'s memory map) other than ``keep_mapped`` and those already moved (by
    :func:`meshnet.engine.cpu_repack.repack_weights`) into one buffer of ``backend`` (the CPU's) advised
    for huge pages, and serve them from there. Returns the names copied. Call it where
    :func:`worth_copying`; a kernel that refuses the advice still gets the copy, on small pages.

    Raises:
        MemoryError: the buffer could not be allocated.
    """
    by_name = {t.name: t for t in reader.tensors}
    names = [n for n in weights.mapped_names() if n not in keep_mapped]
    if not names:
        return []
    ctx = new_meta_context(len(names) + 1)
    copies = {}
    for name in names:
        t = new_tensor(ctx, int(by_name[name].tensor_type), tuple(int(d) for d in by_name[name].shape))
        ggml.ggml_set_name(t, name.encode())
        copies[name] = t
    buf = ggml.ggml_backend_alloc_ctx_tensors(ctx, backend)
    if not buf:
        ggml.ggml_free(ctx)
        raise MemoryError("could not allocate the huge-page weight buffer")
    advise_buffer(buf)
    for name, t in copies.items():
        set_tensor(t, by_name[name].data)
    weights.adopt(ctx, buf, copies)
    return names
