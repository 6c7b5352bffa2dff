"""A stage's side of its sessions: each session's place in the KV pool (:class:`SessionKV`) and the finished
sessions kept for their prefixes (:class:`StageSessions`), with one owner for their lifecycle: open
(taking what it can from a kept session), grow, record what was computed, retire (keep or free).

Kept sessions are looked up and copied from (caller threads) and dropped for room (the scheduler's thread
too): one lock keeps those apart, so a copy never reads cells being handed back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from meshnet.engine.kv_pool import KVPool, PoolFull
from meshnet.engine.prefix_cache import Cached, PrefixCache, alone_paths, path_code, usable_prefix


@dataclass
class SessionKV:
    """A session's place in a stage's KV pool: its slot, the key and attention path of each row it holds
    (``keys``, ``paths``; see :mod:`meshnet.engine.prefix_cache`), on a stage that passes hidden states on
    its first step's output rows (``hidden``), and ``reused``: rows of its first step taken from a
    finished session, not yet handed to the scheduler. ``free`` hands the slot back (idempotent)."""

    slot: int
    pool: KVPool
    paths: bytearray = field(default_factory=bytearray)
    keys: list[int] = field(default_factory=list)
    hidden: list[np.ndarray] = field(default_factory=list)
    reused: int = 0
    # on a tail with the MTP block: (position, trunk state) of the step's last kept row, which the
    # block pairs with the next step's first token; and the states of the step's chunks so far
    mtp_state: tuple[int, np.ndarray] | None = None
    mtp_chunks: list[np.ndarray] = field(default_factory=list)

    def free(self) -> None:
        self.pool.release(self.slot)


class StageSessions:
    """The sessions of one stage's pool ``pool`` and up to ``capacity`` finished ones kept for their
    prefixes (``kept``; host pools only: reuse copies cells in host memory). ``chunk`` and ``n_ctx`` are the
    stage's prefill micro-batch and context (they decide the attention path of a row); ``is_tail``: the
    stage passes no hidden states on, so kept sessions need no output rows."""

    def __init__(self, pool: KVPool, capacity: int, chunk: int, n_ctx: int, is_tail: bool) -> None:
        self.pool, self.chunk, self.n_ctx, self.is_tail = pool, chunk, n_ctx, is_tail
        self.kept = PrefixCache(capacity if pool.host else 0)
        self._lock = threading.Lock()

    @property
    def keeps(self) -> bool:
        """Whether finished sessions are kept at all (else no row keys are worth computing)."""
        return self.kept.capacity > 0

    def open(self, reserve_tokens: int = 0, prompt: list[int] | None = None) -> SessionKV:
        """Open a session in the pool with ``reserve_tokens`` cells promised (0: n_ctx), dropping kept
        finished sessions (oldest first) while the pool has no room. Given its first step's row keys
        ``prompt`` (:func:`row_keys`, at position 0), the session starts with the rows it can take from a kept
        session (``reused``; their cells copied into its slot). Raises PoolFull when no slot or too few
        cells are free even with nothing kept."""
        with self._lock:
            return self._open(reserve_tokens, prompt)

    def _open(self, reserve_tokens: int, prompt: list[int] | None) -> SessionKV:
        while True:
            try:
                kv = SessionKV(self.pool.acquire(reserve_tokens), self.pool)
                break
            except PoolFull:
                slot = self.kept.pop_oldest()
                if slot is None:
                    raise
                self.pool.release(slot)
        if prompt is not None and len(self.kept):
            paths = alone_paths(len(prompt), self.chunk, self.n_ctx)
            entry, common = self.kept.best(np.asarray(prompt, dtype=np.int64), paths)
            n = usable_prefix(common, paths, self.chunk, self.n_ctx)
            if entry is not None and n > 0:
                self.pool.copy_cells(entry.slot, kv.slot, n)
                kv.paths += entry.paths[:n]
                kv.keys += [int(k) for k in entry.keys[:n]]
                if entry.hidden is not None:
                    kv.hidden.append(entry.hidden[:n])
                kv.reused = n
        return kv

    def ensure(self, kv: SessionKV, n_cells: int) -> bool:
        """Grow the session's reservation to ``n_cells``, dropping kept finished sessions while the pool
        has too few cells; False when it still cannot."""
        if self.pool.ensure(kv.slot, n_cells):
            return True
        with self._lock:
            while not self.pool.ensure(kv.slot, n_cells):
                slot = self.kept.pop_oldest()
                if slot is None:
                    return False
                self.pool.release(slot)
        return True

    def record(self, kv: SessionKV, position: int, keys: list[int],
               first_step_out: np.ndarray | None = None, rows_alone: bool = False) -> None:
        """Note the keys and paths of rows computed in one call from ``position`` (replacing what a failed
        try of the same step left), and on a stage that passes hidden states on, the output rows of its
        first step (``first_step_out``, float32 ``[n_rows, n_embd]``). ``rows_alone``: each row was
        attended in a call of its own (a verification step). Only worth calling when :attr:`keeps`:
        nothing else reads them."""
        n_rows = len(keys)
        del kv.paths[position:], kv.keys[position:]
        if rows_alone:
            kv.paths += b"".join(path_code(1, position + r, self.n_ctx) for r in range(n_rows))
        else:
            kv.paths += path_code(n_rows, position, self.n_ctx) * n_rows
        kv.keys += keys
        if first_step_out is not None and not self.is_tail:
            kept = np.concatenate(kv.hidden)[:position] if kv.hidden else first_step_out[:0]
            kv.hidden = [kept, first_step_out] if len(kept) == position else []

    def cut(self, kv: SessionKV, n_keep: int) -> None:
        """Cut the session back to its first ``n_keep`` rows (a rollback): their keys, paths and first-step
        output rows stay, the rest are forgotten, so a kept copy of it is never matched by rows it no
        longer holds. The cells after them keep their bytes until a later step overwrites them: nothing
        reads them meanwhile (attention masks every cell past a row's position, and a kept session's
        copy takes only its first ``len(keys)`` cells)."""
        del kv.paths[n_keep:], kv.keys[n_keep:]
        if kv.hidden and sum(len(h) for h in kv.hidden) > n_keep:
            kv.hidden = [np.concatenate(kv.hidden)[:n_keep]]

    def retire(self, kv: SessionKV, token_ids: list[int]) -> None:
        """A session ended holding the cells of ``token_ids``: keep it for its prefix (pushing out the
        oldest kept session beyond the cache's capacity), or free its slot."""
        n = min(len(token_ids), len(kv.paths), len(kv.keys))
        hidden = None
        if not self.is_tail and kv.hidden:
            hidden = np.concatenate(kv.hidden)[:n]
            n = min(n, len(hidden))
        if not self.keeps or n < 2 or (not self.is_tail and hidden is None):
            kv.free()
            return
        with self._lock:
            self._keep(kv, n, hidden)

    def kept_tokens(self) -> int:
        """Cells the kept sessions hold (read under the lock: the scheduler's thread may drop some)."""
        with self._lock:
            return self.kept.tokens

    def _keep(self, kv: SessionKV, n: int, hidden: np.ndarray | None) -> None:
        """Move the session's first ``n`` cells to the highest free slot and keep them there: open sessions
        stay in the lowest slots, which the decode rows' multi-stream attention spans (a session alone in
        slot 4 would make it span 8 streams, and leave its 9 real rows to one of the threads)."""
        self.pool.shrink(kv.slot, 1)  # its cells move: the new slot reserves them
        while True:
            try:
                slot = self.pool.acquire(n, high=True)
                break
            except PoolFull:
                old = self.kept.pop_oldest()
                if old is None:
                    kv.free()
                    return
                self.pool.release(old)
        self.pool.copy_cells(kv.slot, slot, n)
        kv.free()
        for old in self.kept.put(Cached(slot, np.asarray(kv.keys[:n], dtype=np.int64), bytes(kv.paths[:n]),
                                        hidden)):
            self.pool.release(old)

    def close(self) -> None:
        """Free every kept session's slot."""
        with self._lock:
            for slot in self.kept.clear():
                self.pool.release(slot)
