"""The compute core of the real engine: a GGUF layer range on ggml's CPU kernels.

``GgmlStage`` holds the range's weights, the KV pool of every open session, and the step graphs (reused
by shape); it can be used directly to read logits (the parity tests do). ``GgmlEngine``
(:mod:`meshnet.engine.ggml_engine`) wraps it in the shard-engine contract.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import ggml
import numpy as np

from meshnet.contract import LayerRange
from meshnet.engine.batch_layout import SPLIT_KV_MIN_CELLS, BatchShape, Segment, kv_length
from meshnet.engine.cpu_repack import repack_weights
from meshnet.engine.ggml_backend import StageWeights, cpu_backend, release_cpu_backend
from meshnet.engine.ggml_dsv4_attn import aux_caches
from meshnet.engine.ggml_graph import StepGraph
from meshnet.engine.ggml_mtp import MtpGraph, mtp_shape
from meshnet.engine.huge_pages import copy_into_huge_pages, copy_turn, worth_copying
from meshnet.engine.kv_pool import KVPool
from meshnet.engine.prefix_cache import PrefixCache
from meshnet.engine.stage_sessions import SessionKV, StageSessions
from meshnet.model.gguf_file import GGUFError, drop_pages, open_gguf, stage_tensor_names
from meshnet.model.hparams import ModelConfig

log = logging.getLogger("meshnet.engine")

# Weights only ever multiplied whole, as 2-D matrices (``ggml_mul_mat``) or expert stacks
# (``ggml_mul_mat_id``), which may be repacked; embeddings (read by get_rows, also as a tied output) and
# weights the graphs view or reshape stay as stored.
REPACKABLE = frozenset({"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                        "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "output",
                        "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})

# Context per session when the caller does not choose one: the model's own, capped so that a default
# session's KV cache stays small on ordinary machines.
DEFAULT_MAX_CTX = 4096


@dataclass
class BatchItem:
    """One session's part of an iteration: tokens at ``position ..`` of the session in pool ``slot``.

    ``token_ids`` int32 ``[n]`` on the head, ``hidden`` float32 ``[n, n_embd]`` elsewhere; on the tail
    the last ``n_out`` rows give logits. ``rows_alone``: every row is attended in a call of its own, the
    call it would get as a one-token decode (a verification step: its rows then give the bits that
    decoding them one by one gives, see :meth:`GgmlStage.forward_batch`), and on the tail every row gives
    logits."""

    slot: int
    position: int
    token_ids: np.ndarray | None = None
    hidden: np.ndarray | None = None
    n_out: int = 1
    rows_alone: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else len(self.hidden)


class GgmlStage:
    """Layers ``[start, end)`` of a GGUF model, loaded as stored into a ggml CPU backend, with one KV pool
    for all its sessions.

    ``backend`` replaces the CPU backend (an accelerator's, from ``accelerator_backend``); a device
    cannot compute on the host's memory map, so it goes with ``use_mmap=False``. ``n_slots`` sessions of
    ``n_ctx`` tokens fit in the pool, of which ``kv_tokens`` cells may be reserved at once; 0 derives it
    from ``kv_budget_bytes``, or when that is 0 too from half the memory available now (never more than
    ``n_slots * n_ctx``). ``repack`` and ``huge_pages``: see :class:`meshnet.load_spec.LoadSpec`.

    Raises (constructor):
        FileNotFoundError: no such file.
        GGUFError: not GGUF, truncated, unsupported architecture or tensor type, or a layer range
            outside the model.
    """

    # Graphs kept for reuse (least recently used dropped first); decode graphs come back every step.
    MAX_GRAPHS = 24
    # Decode-only graphs that keep a compute buffer of their own (least recently used first to give theirs
    # up): decode groups take turns at a stage, each with its own graph, and placing a graph again in the
    # shared buffer after another ran there cost 0.3-0.8 ms of a 10 ms iteration (a middle stage of
    # SmolLM2, 1 thread, groups of 3 and 2). A decode graph's buffer is small (rows x the widest tensor).
    OWN_BUFFERS = 4

    def __init__(self, path: str, layers: LayerRange, n_threads: int = 2, n_ctx: int = 0,
                 n_ubatch: int = 512, use_mmap: bool = True, backend=None, n_slots: int = 16,
                 kv_tokens: int = 0, kv_budget_bytes: int = 0, prefix_cache: int = 0, mtp: bool = True,
                 repack: bool = True, huge_pages: bool = True) -> None:
        reader = open_gguf(path)
        self.cfg = ModelConfig.from_reader(reader)
        if self.cfg.manifest.not_run:
            raise GGUFError(self.cfg.manifest.not_run)
        if layers.end > self.cfg.n_layer:
            raise GGUFError(f"layer range [{layers.start}, {layers.end}) is outside the model, which has "
                            f"{self.cfg.n_layer} layers [0, {self.cfg.n_layer})")
        self.layers = layers
        self.is_head = layers.is_head()
        self.is_tail = layers.is_tail(self.cfg.n_layer)
        self.n_ctx = n_ctx or min(self.cfg.n_ctx_train, DEFAULT_MAX_CTX)
        if self.n_ctx > self.cfg.n_ctx_train and self.is_head:  # once a model, not once a stage
            # As llama.cpp's llama_context warns: positions past the trained context run, and may degrade.
            log.warning("n_ctx %d is past the %d tokens of context the model was trained on: positions past "
                        "them may give worse text", self.n_ctx, self.cfg.n_ctx_train)
        self.n_ubatch = max(1, n_ubatch)
        on_host = backend is None
        self.backend = backend if backend is not None else cpu_backend(n_threads)
        self._cpu_user = on_host  # counted as a user of the shared CPU backend until close
        # the tail runs the file's next-token-prediction block (``mtp``): its weights, and its KV cells
        # as layer n_layer of the pool
        self.has_mtp = bool(mtp and self.is_tail and self.cfg.n_nextn)
        nextn = self.cfg.n_nextn if self.has_mtp else 0
        selection = stage_tensor_names(reader, layers, self.cfg.n_layer, nextn)
        # copies of weights on one machine one stage at a time, each judged after those before it
        with copy_turn() if on_host and huge_pages else contextlib.nullcontext():
            huge = on_host and huge_pages and worth_copying(reader, selection.names)
            self.weights = StageWeights(reader, selection.names, self.backend, use_mmap=use_mmap or huge)
            # On the CPU, mat-mul weights of the types whose repacked kernels keep each row's bits whatever
            # shares its batch move into the backend's repacked layout, as llama.cpp's do (cpu_repack).
            self.repacked = repack_weights(self.weights, reader, REPACKABLE, huge) if on_host and repack else []
            # The rest move into memory backed by huge pages (huge_pages), but for an embedding the stage
            # only looks rows up in (mapped, only the rows read are resident), unless every weight is to
            # be copied.
            lookup_only = frozenset() if not use_mmap or (self.is_tail and "output.weight" not in selection.names) \
                else frozenset({"token_embd.weight"})
            self.huge_paged = copy_into_huge_pages(self.weights, reader, self.backend, lookup_only) if huge else []
        if not use_mmap or self.repacked or self.huge_paged:
            drop_pages(reader)  # the copies are what stays resident, not the file pages read to make them
        # DeepSeek-V4's compressor cells and compressed rows live in the pool beside the KV cells
        aux = aux_caches(self.cfg, layers) if self.cfg.dsv4 is not None else None
        self.pool = KVPool(LayerRange(layers.start, layers.end + nextn), self.cfg.n_embd_k_cache, self.cfg.n_embd_v_cache, self.n_ctx, n_slots,
                           kv_tokens, self.backend, host=on_host, budget_bytes=kv_budget_bytes, aux=aux)
        self.needs_tokens = self.is_head or self.cfg.needs_token_ids(layers)
        self.sessions = StageSessions(self.pool, prefix_cache, self.n_ubatch, self.n_ctx, self.is_tail)
        self._graphs: OrderedDict[BatchShape, StepGraph] = OrderedDict()
        # ggml-python's binding of ggml_backend_cpu_buffer_type() truncates the pointer; ask the backend.
        self._galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self.backend))
        self._placed: StepGraph | None = None  # the graph whose tensors hold the allocator's buffer now
        self._own: OrderedDict[StepGraph, object] = OrderedDict()  # decode graph -> its own allocator
        # on a tail with the MTP block: every given item's normed states of the last forward_batch
        self.last_states: list[np.ndarray] = []

    def new_session(self, reserve_tokens: int = 0, prompt: list[int] | None = None) -> SessionKV:
        """Open a session (see :meth:`StageSessions.open`). Raises PoolFull."""
        return self.sessions.open(reserve_tokens, prompt)

    @property
    def session_tokens(self) -> int:
        """The most tokens one session can hold: ``n_ctx``, or the whole KV pool where that is smaller
        (``--kv-tokens``): what the stage reports as its context, so routes, failovers and the API's
        budgets pass over a pool too small rather than be refused at the first prefill."""
        return min(self.n_ctx, self.pool.kv_tokens)

    @property
    def prefix_cache(self) -> PrefixCache:
        """The finished sessions this stage keeps for their prefixes."""
        return self.sessions.kept

    def shape_of(self, items: list[BatchItem]) -> tuple[BatchShape, list[int], list[int]]:
        """The graph shape of an iteration; also the indices of its decode items and its segment items
        (rows go decodes first, sorted by slot, then segments in the given order). A decode reading
        :data:`SPLIT_KV_MIN_CELLS` cells or more is a segment of one row: attended alone, as alone."""
        # DeepSeek-V4 attends every item as a segment (its compressed caches have no multi-stream view)
        dec = [i for i, it in enumerate(items) if it.n_tokens == 1 and (not self.is_tail or it.n_out == 1)
               and not it.rows_alone and kv_length(it.position + 1, self.n_ctx) < SPLIT_KV_MIN_CELLS
               and self.cfg.dsv4 is None]
        dec.sort(key=lambda i: items[i].slot)  # slots are distinct: see BatchShape.dec_in_order
        decodes = set(dec)
        seg = [i for i in range(len(items)) if i not in decodes]
        streams = n_kv_dec = 0
        if dec:
            top = max(items[i].slot for i in dec) + 1
            streams = min(self.pool.n_slots, 1 << (top - 1).bit_length())
            n_kv_dec = max(kv_length(items[i].position + 1, self.n_ctx) for i in dec)
        segments = tuple((items[i].slot, items[i].n_tokens, kv_length(items[i].position + items[i].n_tokens,
                                                                        self.n_ctx),
                          items[i].n_out if self.is_tail else items[i].n_tokens) for i in seg)
        return BatchShape(len(dec), streams, n_kv_dec, segments), dec, seg

    def _graph(self, shape, make=None) -> StepGraph:
        g = self._graphs.get(shape)
        if g is not None:
            self._graphs.move_to_end(shape)
            return g
        g = make() if make is not None else StepGraph(self.cfg, self.weights, self.pool, self.layers, shape)
        self._graphs[shape] = g
        while len(self._graphs) > self.MAX_GRAPHS:
            old = self._graphs.popitem(last=False)[1]
            if old is self._placed:
                self._placed = None
            old.free()
            if (own := self._own.pop(old, None)) is not None:
                ggml.ggml_gallocr_free(own)
        return g

    def _place(self, g, decode_only: bool) -> None:
        """Give ``g`` its places before it runs: in a buffer of its own for a decode-only graph (placed
        once, while it keeps it), else in the shared one unless ``g`` is what holds it now."""
        if g in self._own:
            self._own.move_to_end(g)
            return
        if decode_only and self.OWN_BUFFERS > 0:
            if len(self._own) >= self.OWN_BUFFERS:
                ggml.ggml_gallocr_free(self._own.popitem(last=False)[1])  # its graph is placed again when next run
            own = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self.backend))
            try:
                g.place(own)
            except MemoryError:
                ggml.ggml_gallocr_free(own)
                raise
            self._own[g] = own
            if g is self._placed:
                self._placed = None
            return
        if self._placed is not g:
            g.place(self._galloc)
            self._placed = g

    def forward_batch(self, items: list[BatchItem]) -> list[np.ndarray]:
        """Run one iteration: every item's tokens through the range in one graph.

        Items must belong to distinct sessions. Returns, per item in the given order, float32
        ``[n, n_embd]`` hidden states or, on the tail, ``[n_out, n_vocab]`` logits (``[n, n_vocab]`` for
        an item with ``rows_alone``).

        An item with ``rows_alone`` becomes one segment of one row per token (their K and V rows are all
        written before any attention reads the cache, so row ``i`` sees rows ``< i`` of its step). That is
        what makes a verification step exact: ggml's CPU flash attention rounds a call of several query
        rows (row by row) differently from one row over :data:`SPLIT_KV_MIN_CELLS` cells or more (split
        across threads), the call a deep decode makes alone; attended one by one, each row takes the
        path, and gives the bits, of the decode it stands for.
        """
        given = items
        items = [one for it in items for one in self._one_row_items(it)]
        shape, dec, seg = self.shape_of(items)
        order = dec + seg
        g = self._graph(shape)
        tokens = hidden = None
        if self.needs_tokens:
            if any(items[i].token_ids is None for i in order):
                raise ValueError(f"stage {self.layers} picks experts by token id and needs every row's token id")
            tokens = np.concatenate([np.asarray(items[i].token_ids, dtype=np.int32) for i in order])
        if not self.is_head:  # [n, n_embd], or [n, n_hc, n_embd] with hyper-connections: rows flat
            hidden = np.concatenate([np.asarray(items[i].hidden, dtype=np.float32).reshape(items[i].n_tokens, -1)
                                     for i in order])
        segments = [Segment(items[i].slot, items[i].position, items[i].n_tokens, shape.segments[k][2],
                            shape.segments[k][3]) for k, i in enumerate(seg)]
        self._place(g, not seg)
        out = g.run(self.backend, [(items[i].slot, items[i].position) for i in dec], segments,
                    tokens, hidden)
        results: list[np.ndarray | None] = [None] * len(items)
        row = 0
        for k, i in enumerate(order):
            n = (1 if k < shape.n_dec else items[i].n_out) if self.is_tail else items[i].n_tokens
            results[i] = out[row:row + n]
            if not self.is_tail and self.cfg.dsv4 is not None:
                results[i] = results[i].reshape(n, *self.cfg.residual_shape)
            row += n
        states = g.states()
        if states is not None:
            per_item: list[np.ndarray | None] = [None] * len(items)
            row = 0
            for i in order:
                per_item[i] = states[row:row + items[i].n_tokens]
                row += items[i].n_tokens
            self.last_states = self._joined(given, per_item)
        return self._joined(given, results)

    @staticmethod
    def _joined(given: list[BatchItem], rows: list) -> list:
        """Per-row-item arrays back as one array per given item (an item with ``rows_alone`` was split)."""
        if len(rows) == len(given):
            return rows
        joined, at = [], 0
        for it in given:  # the rows of a split item back in one array
            n = it.n_tokens if it.rows_alone else 1
            joined.append(rows[at] if n == 1 else np.concatenate(rows[at:at + n], axis=0))
            at += n
        return joined

    def mtp_rows(self, kv: SessionKV, position: int, token_ids: list[int], states: np.ndarray,
                 prev_state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Run the MTP block (:mod:`meshnet.engine.ggml_mtp`) over rows at ``position ..``: token ``i``
        paired with the trunk state of the row before it (``prev_state`` float32 ``[n_embd]`` for the
        first, zeros when None; ``states`` float32 ``[n - 1 or more, n_embd]`` for the others), in
        micro-batches of ``n_ubatch``. Returns the last row's logits float32 ``[n_vocab]`` and block
        state ``[n_embd]``. The cells up to ``position + n`` must be reserved."""
        n = len(token_ids)
        first = np.zeros(self.cfg.n_embd, np.float32) if prev_state is None else prev_state
        h_in = np.concatenate([first[None, :], np.asarray(states[:n - 1], np.float32)], axis=0)
        for start in range(0, n, self.n_ubatch):
            end = min(n, start + self.n_ubatch)
            key = ("mtp",) + mtp_shape(kv.slot, position + start, end - start, self.n_ctx)
            g = self._graph(key, lambda: MtpGraph(self.cfg, self.weights, self.pool, *key[1:]))
            if self._placed is not g:
                g.place(self._galloc)
                self._placed = g
            logits, h = g.run_rows(self.backend, kv.slot, position + start,
                                   np.asarray(token_ids[start:end], np.int32), h_in[start:end])
        return logits[-1], h[-1]

    @staticmethod
    def _one_row_items(it: BatchItem) -> list[BatchItem]:
        """An item with ``rows_alone`` as one-row items (still marked, so none joins the decode rows)."""
        if not it.rows_alone or it.n_tokens == 1:
            return [it]
        return [BatchItem(it.slot, it.position + r, None if it.token_ids is None else it.token_ids[r:r + 1],
                          None if it.hidden is None else it.hidden[r:r + 1], 1, rows_alone=True)
                for r in range(it.n_tokens)]

    def forward(self, kv: SessionKV, position: int, token_ids: np.ndarray | None = None,
                hidden: np.ndarray | None = None, all_logits: bool = False,
                should_stop: Callable[[], bool] = lambda: False) -> np.ndarray | None:
        """Run one session's tokens at ``position ..`` through the range alone, in micro-batches of
        ``n_ubatch`` tokens.

        Args:
            token_ids: int ``[n]`` on the head; hidden: float32 ``[n, n_embd]`` elsewhere.
            all_logits: on the tail, return logits for every token instead of the last only.
            should_stop: checked between micro-batches; True aborts and returns None.
        Returns:
            ``[n, n_embd]`` float32 hidden states, or on the tail float32 logits ``[n, n_vocab]``
            (all_logits) or ``[1, n_vocab]``.
        """
        n = len(token_ids) if token_ids is not None else len(hidden)
        outs = []
        for start in range(0, n, self.n_ubatch):
            if should_stop():
                return None
            end = min(n, start + self.n_ubatch)
            item = BatchItem(kv.slot, position + start,
                             None if token_ids is None else np.asarray(token_ids[start:end], dtype=np.int32),
                             None if hidden is None else hidden[start:end],
                             n_out=(end - start) if all_logits else 1)
            out = self.forward_batch([item])[0]
            if not self.is_tail or all_logits or end == n:
                outs.append(out)
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)

    def close(self) -> None:
        """Free the weights', graphs' and pool's ggml handles (the shared backend stays for other stages)."""
        for g in self._graphs.values():
            g.free()
        self._graphs.clear()
        for own in self._own.values():
            ggml.ggml_gallocr_free(own)
        self._own.clear()
        self.sessions.close()
        if self._galloc:
            ggml.ggml_gallocr_free(self._galloc)
            self._galloc = None
        self.pool.free()
        self.weights.free()
        if self._cpu_user:
            release_cpu_backend()
            self._cpu_user = False
