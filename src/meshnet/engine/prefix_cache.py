"""Exact prefix reuse: the KV cells of finished sessions, kept so that a new prompt that starts the same way
skips computing the rows it shares with them (llama-server reuses a slot's cached prompt the same way).

What makes it exact. On the CPU every op of a layer computes a row from that row alone, except flash
attention, whose result for a row depends on the path ggml's kernel takes for the call that holds it
(``ggml_compute_forward_flash_attn_ext_f16`` in ggml-cpu's ops.cpp): a call with at least
:data:`~meshnet.engine.batch_layout.FA_TILE_ROWS` query rows is tiled, one row of one stream over at least
:data:`~meshnet.engine.batch_layout.SPLIT_KV_MIN_CELLS` cells splits its cells across threads, anything
else runs row by row. Within a path a row's result does not depend on the other rows of its call (measured:
a 340-token prompt prefilled whole or split at 17, 64, 70, 80, 100 or 256 gives the same bits wherever
both parts take the same path; 0.9-1.5 apart in the logits where they do not). So a stage records, per
cached row, the path that computed it (:func:`path_code`), and a new prompt reuses a cached row only when
its token and every token before it match and the path the row would take in the new prompt alone
(:func:`alone_paths`) is the one it was computed with; the rows it computes must keep their alone paths too
(:func:`keeps_paths`). A row's "token" is what the stage computed it from: its token id on the head, a
hash of its input hidden row elsewhere (:func:`row_keys`; replicas of the stage before may differ in the
last bits, on other CPU features or an accelerator). The result is the same bits as the prompt computed
from scratch.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from meshnet.engine.batch_layout import FA_TILE_ROWS, SPLIT_KV_MIN_CELLS, kv_length

TILED, SPLIT, ROWWISE = b"T", b"S", b"O"


def row_keys(token_ids, hidden: np.ndarray | None) -> list[int]:
    """What each row of a step was computed from, as one int per row: the token ids on the head
    (``hidden`` None), else a 64-bit hash of each input hidden row (float32 ``[n, n_embd]``)."""
    if hidden is None:
        return [int(t) for t in token_ids]
    rows = np.ascontiguousarray(hidden, dtype=np.float32)
    return [int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little", signed=True)
            for r in rows]


def path_code(n_rows: int, position: int, n_ctx: int) -> bytes:
    """The attention path of rows computed in one call of ``n_rows`` query rows of one session whose first
    row is at ``position``: :data:`TILED`, :data:`SPLIT` or :data:`ROWWISE` (one byte)."""
    if n_rows >= FA_TILE_ROWS:
        return TILED
    if n_rows == 1 and kv_length(position + 1, n_ctx) >= SPLIT_KV_MIN_CELLS:
        return SPLIT
    return ROWWISE


def alone_paths(n_tokens: int, chunk: int, n_ctx: int) -> bytes:
    """Path per row of a prompt of ``n_tokens`` at position 0 computed alone, in micro-batches of ``chunk``
    tokens (0: whole) as the stage's scheduler cuts it."""
    chunk = chunk or n_tokens
    out = bytearray()
    for start in range(0, n_tokens, chunk):
        n = min(chunk, n_tokens - start)
        out += path_code(n, start, n_ctx) * n
    return bytes(out)


def keeps_paths(reuse: int, paths: bytes, chunk: int, n_ctx: int) -> bool:
    """Whether computing rows ``[reuse, n)`` of a prompt whose alone paths are ``paths`` (micro-batches cut
    at multiples of ``chunk`` from position 0) gives the first computed micro-batch its rows' alone path;
    the later ones are the alone micro-batches themselves."""
    n = len(paths)
    chunk = chunk or n
    end = min(n, (reuse // chunk + 1) * chunk)
    return path_code(end - reuse, reuse, n_ctx) == paths[reuse:reuse + 1]


def usable_prefix(common: int, paths: bytes, chunk: int, n_ctx: int) -> int:
    """The most rows of a prompt (alone paths ``paths``) that may be reused when its first ``common`` rows
    match a cached session's tokens and paths: at most all but the last row (whose output is wanted), and
    few enough that the rows left to compute keep their alone paths."""
    reuse = min(common, len(paths) - 1)
    while reuse > 0 and not keeps_paths(reuse, paths, chunk, n_ctx):
        reuse -= 1
    return reuse


@dataclass
class Cached:
    """A finished session's cells kept in pool ``slot``: one row per entry of ``keys`` (int64 ``[n]``, see
    :func:`row_keys`), ``paths`` its rows' attention paths, ``hidden`` float32 ``[m, n_embd]`` the stage's
    output rows of the first ``m`` of them (not kept on the tail, which passes no hidden states on)."""

    slot: int
    keys: np.ndarray
    paths: bytes
    hidden: np.ndarray | None = None

    def common(self, keys: np.ndarray, paths: bytes) -> int:
        """Rows shared with a prompt: equal keys and equal paths from the first row on."""
        n = min(len(self.keys), len(keys), len(self.paths))
        if self.hidden is not None:
            n = min(n, len(self.hidden))
        if n == 0:
            return 0
        same = (self.keys[:n] == keys[:n]) & (
            np.frombuffer(self.paths[:n], np.uint8) == np.frombuffer(paths[:n], np.uint8))
        return n if same.all() else int(np.argmin(same))


class PrefixCache:
    """At most ``capacity`` finished sessions, least recently used dropped first. Changes need the
    caller's lock (:class:`~meshnet.engine.stage_sessions.StageSessions` holds one); the figures
    (``len``, ``slots``, ``tokens``) read a snapshot and are safe from any thread."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, Cached] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def slots(self) -> list[int]:
        """The pool slots the kept sessions hold, least recently used first."""
        return list(self._entries)

    @property
    def tokens(self) -> int:
        """Cells the kept sessions hold."""
        return sum(len(e.keys) for e in list(self._entries.values()))  # a snapshot: safe beside a drop

    def put(self, entry: Cached) -> list[int]:
        """Keep ``entry``; returns the slots of the entries it pushed out (the caller frees them)."""
        self._entries[entry.slot] = entry
        dropped = []
        while len(self._entries) > self.capacity:
            dropped.append(self._entries.popitem(last=False)[0])
        return dropped

    def best(self, keys: np.ndarray, paths: bytes) -> tuple[Cached | None, int]:
        """The kept session sharing the most rows with a prompt, and how many (0: none); marks it used."""
        best, n = None, 0
        for e in self._entries.values():
            c = e.common(keys, paths)
            if c > n:
                best, n = e, c
        if best is not None:
            self._entries.move_to_end(best.slot)
        return best, n

    def pop_oldest(self) -> int | None:
        """Forget the least recently used entry; returns its slot (None when empty)."""
        return self._entries.popitem(last=False)[0] if self._entries else None

    def clear(self) -> list[int]:
        slots = list(self._entries)
        self._entries.clear()
        return slots
