"""The real engine: a GGUF layer range computed with ggml's CPU kernels.

``GgmlStage`` is the compute core (weights, per-session KV caches, graphs) and can be used directly to
read logits (the parity tests do). ``GgmlEngine`` wraps it in the shard-engine contract: sessions,
statuses, sampling on the tail.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

import ggml
import numpy as np

from meshnet.backends.cpu_features import ggml_cpu_features
from meshnet.contract import (
    ArtifactId,
    Capabilities,
    LayerRange,
    LoadSpec,
    NamedTensor,
    SampledToken,
    StepRequest,
    StepResult,
    Status,
)
from meshnet.engine.base import RETRY_AFTER_S, EngineError, Session, ShardEngine
from meshnet.engine.scheduler import Chunk
from meshnet.engine.ggml_backend import StageWeights, cpu_backend, release_cpu_backend, registry_devices
from meshnet.engine.batch_layout import SPLIT_KV_MIN_CELLS, BatchShape, Segment, kv_length
from meshnet.engine.ggml_graph import StepGraph
from meshnet.engine.ggml_mtp import MtpGraph, mtp_shape, mtp_step
from meshnet.speculative import accepted_prefix
from meshnet.engine.kv_pool import KVPool, PoolFull
from meshnet.engine.prefix_cache import PrefixCache, row_keys
from meshnet.engine.stage_sessions import SessionKV, StageSessions
from meshnet.layer_split import layer_costs, pipeline_depth
from meshnet.grammar import GrammarCompiler
from meshnet.model.gguf_file import GGUFError, drop_pages, open_gguf, stage_tensor_names
from meshnet.model.hparams import ModelConfig
from meshnet.model.manifest import model_id
from meshnet.sampling import sample
from meshnet.tokenizer import GGUFTokenizer

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
    ``n_slots * n_ctx``).

    Raises (constructor):
        FileNotFoundError: no such file.
        GGUFError: not GGUF, truncated, unsupported architecture or tensor type, or a layer range
            outside the model.
    """

    # Graphs kept for reuse (least recently used dropped first); decode graphs come back every step.
    MAX_GRAPHS = 24

    def __init__(self, path: str, layers: LayerRange, n_threads: int = 2, n_ctx: int = 0,
                 n_ubatch: int = 512, use_mmap: bool = True, backend=None, n_slots: int = 16,
                 kv_tokens: int = 0, kv_budget_bytes: int = 0, prefix_cache: int = 0, mtp: bool = True) -> None:
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
        self.n_ubatch = max(1, n_ubatch)
        on_host = backend is None
        self.backend = backend if backend is not None else cpu_backend(n_threads)
        self._cpu_user = on_host  # counted as a user of the shared CPU backend until close
        # the tail runs the file's next-token-prediction block (``mtp``): its weights, and its KV cells
        # as layer n_layer of the pool
        self.has_mtp = bool(mtp and self.is_tail and self.cfg.n_nextn)
        nextn = self.cfg.n_nextn if self.has_mtp else 0
        selection = stage_tensor_names(reader, layers, self.cfg.n_layer, nextn)
        # Weights stay in plain buffers: the CPU backend's repacked layouts (CPU_REPACK) make a row's result
        # depend on how many rows share its mat-mul, which would make batched output differ from solo.
        self.weights = StageWeights(reader, selection.names, self.backend, use_mmap=use_mmap)
        if not use_mmap:
            drop_pages(reader)  # the copies are what stays resident, not the file pages read to make them
        self.pool = KVPool(LayerRange(layers.start, layers.end + nextn), self.cfg.n_embd_k_cache, self.cfg.n_embd_v_cache, self.n_ctx, n_slots,
                           kv_tokens, self.backend, host=on_host, budget_bytes=kv_budget_bytes)
        self.sessions = StageSessions(self.pool, prefix_cache, self.n_ubatch, self.n_ctx, self.is_tail)
        self._graphs: OrderedDict[BatchShape, StepGraph] = OrderedDict()
        # ggml-python's binding of ggml_backend_cpu_buffer_type() truncates the pointer; ask the backend.
        self._galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self.backend))
        self._placed: StepGraph | None = None  # the graph whose tensors hold the allocator's buffer now
        # on a tail with the MTP block: every given item's normed states of the last forward_batch
        self.last_states: list[np.ndarray] = []

    def new_session(self, reserve_tokens: int = 0, prompt: list[int] | None = None) -> SessionKV:
        """Open a session (see :meth:`StageSessions.open`). Raises PoolFull."""
        return self.sessions.open(reserve_tokens, prompt)

    @property
    def prefix_cache(self) -> PrefixCache:
        """The finished sessions this stage keeps for their prefixes."""
        return self.sessions.kept

    def shape_of(self, items: list[BatchItem]) -> tuple[BatchShape, list[int], list[int]]:
        """The graph shape of an iteration; also the indices of its decode items and its segment items
        (rows go decodes first, then segments, each group in the given order). A decode reading
        :data:`SPLIT_KV_MIN_CELLS` cells or more is a segment of one row: attended alone, as alone."""
        dec = [i for i, it in enumerate(items) if it.n_tokens == 1 and (not self.is_tail or it.n_out == 1)
               and not it.rows_alone and kv_length(it.position + 1, self.n_ctx) < SPLIT_KV_MIN_CELLS]
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
        return g

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
        if self.is_head:
            tokens = np.concatenate([np.asarray(items[i].token_ids, dtype=np.int32) for i in order])
        else:
            hidden = np.concatenate([np.asarray(items[i].hidden, dtype=np.float32) for i in order])
        segments = [Segment(items[i].slot, items[i].position, items[i].n_tokens, shape.segments[k][2],
                            shape.segments[k][3]) for k, i in enumerate(seg)]
        if self._placed is not g:
            g.place(self._galloc)
            self._placed = g
        out = g.run(self.backend, [(items[i].slot, items[i].position) for i in dec], segments,
                    tokens, hidden)
        results: list[np.ndarray | None] = [None] * len(items)
        row = 0
        for k, i in enumerate(order):
            n = (1 if k < shape.n_dec else items[i].n_out) if self.is_tail else items[i].n_tokens
            results[i] = out[row:row + n]
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
        self.sessions.close()
        if self._galloc:
            ggml.ggml_gallocr_free(self._galloc)
            self._galloc = None
        self.pool.free()
        self.weights.free()
        if self._cpu_user:
            release_cpu_backend()
            self._cpu_user = False


class GgmlEngine(ShardEngine):
    """The shard-engine contract on top of :class:`GgmlStage` (CPU backend)."""

    def __init__(self) -> None:
        super().__init__()
        self.stage: GgmlStage | None = None
        self._grammars: GrammarCompiler | None = None  # built on the first step with a grammar

    def _load(self, spec: LoadSpec) -> Capabilities:
        problem = spec.validate()
        if problem is not None:
            raise EngineError(Status.INVALID_ARGUMENT, problem)
        try:
            sha = model_id(spec.path)  # a range-only file's held tensors are verified here
        except (GGUFError, FileNotFoundError) as e:
            raise EngineError(Status.INVALID_ARGUMENT, str(e)) from None
        if spec.artifact.sha256 and spec.artifact.sha256 != sha:
            raise EngineError(Status.INVALID_ARGUMENT,
                              f"{spec.path} holds model {sha}, expected {spec.artifact.sha256}")
        try:
            stage = GgmlStage(spec.path, spec.artifact.layers, spec.n_threads, spec.n_ctx, spec.n_ubatch,
                              # slots for kept sessions too: a full stage still keeps its prefixes
                              spec.use_mmap, n_slots=spec.max_sessions + spec.prefix_cache,
                              kv_tokens=spec.kv_tokens,
                              kv_budget_bytes=spec.memory_budget_bytes, prefix_cache=spec.prefix_cache,
                              mtp=spec.mtp.enabled)
        except (GGUFError, FileNotFoundError) as e:
            raise EngineError(Status.INVALID_ARGUMENT, str(e)) from None
        if self.stage is not None:
            self.stage.close()
        self.stage, self._grammars = stage, None
        cfg = stage.cfg
        return Capabilities(engine="ggml", backend="cpu", architecture=cfg.architecture,
                            artifact=ArtifactId(sha, spec.artifact.layers), n_layer=cfg.n_layer,
                            n_embd=cfg.n_embd, n_vocab=cfg.n_vocab, n_ctx=stage.n_ctx,
                            is_head=stage.is_head, is_tail=stage.is_tail, fixture=False,
                            max_sessions=spec.max_sessions,
                            residual_dims=() if cfg.dsv4 is None else cfg.residual_shape,
                            needs_token_ids=cfg.needs_token_ids(spec.artifact.layers))

    @property
    def device(self) -> dict | None:
        """The device the stage computes on: ggml's CPU device (``{"index", "backend", "name",
        "description", "type", "memory_free_bytes", "memory_total_bytes", "cpu_features"}``, memory in
        bytes, ``cpu_features`` the SIMD features its kernels were compiled with); None before load."""
        if self.stage is None:
            return None
        dev = next((d for d in registry_devices() if d["backend"] == "CPU"), None)
        return None if dev is None else {**dev, "cpu_features": list(ggml_cpu_features())}

    def _new_state(self, req: StepRequest) -> SessionKV:
        stage = self.stage
        assert stage is not None
        try:
            # the prompt's row keys only matter when there is a kept session to match them against
            keys = row_keys(req.token_ids, None if stage.is_head else req.hidden.to_numpy()) \
                if len(stage.prefix_cache) else None
            return stage.new_session(req.reserve_tokens, keys)
        except PoolFull as e:
            raise EngineError(Status.RESOURCE_EXHAUSTED, f"KV pool: {e}") from None

    def _truncate(self, state: SessionKV, n_keep: int) -> None:
        assert self.stage is not None
        self.stage.sessions.cut(state, n_keep)

    def _free_state(self, state: SessionKV, token_ids: list[int] = ()) -> None:
        if token_ids and self.stage is not None:
            self.stage.sessions.retire(state, list(token_ids))
        else:
            state.free()

    def _reused(self, session: Session, req: StepRequest) -> tuple[int, StepResult | None]:
        kv: SessionKV = session.state
        n, kv.reused = kv.reused, 0
        if n == 0 or session.n_past != 0:
            return 0, None
        if self.stage is not None and self.stage.is_tail:
            return n, None
        return n, StepResult(Status.OK, hidden=NamedTensor.from_numpy("hidden", kv.hidden[0][:n]))

    def _pipeline_depth(self, caps: Capabilities) -> int:
        # By the planner's costs: the tail also multiplies the output projection (SmolLM2 splits
        # 12/13/5 into three equal stages, which a layer count would call 2.5, 2.3 and 6).
        costs, tail = layer_costs(open_gguf(self._spec.path), caps.n_layer)
        return pipeline_depth(costs, tail, caps.artifact.layers)

    def _chunk_tokens(self) -> int:
        stage = getattr(self, "stage", None)  # the base constructor asks before ours has run
        return stage.n_ubatch if stage is not None else 0

    def _kv_bytes(self) -> int:
        return self.stage.pool.resident_bytes() if self.stage else 0

    def _kept_tokens(self) -> int:
        return self.stage.sessions.kept_tokens() if self.stage else 0

    def _kv_tokens(self) -> tuple[int, int]:
        return (self.stage.pool.tokens_reserved, self.stage.pool.kv_tokens) if self.stage else (0, 0)

    def _weight_bytes(self) -> int:
        return self.stage.weights.nbytes if self.stage else 0

    def _forward(self, session: Session, req: StepRequest) -> StepResult:
        return self._forward_batch([Chunk(session, req, 0, len(req.token_ids))])[0]

    def _forward_batch(self, chunks: list[Chunk]) -> list[StepResult]:
        """One iteration of the scheduler as one graph: each chunk becomes a :class:`BatchItem`; the
        tail samples each step's token once its last chunk is through."""
        stage = self.stage
        assert stage is not None
        results: list[StepResult | None] = [None] * len(chunks)
        items, run = [], []
        for i, c in enumerate(chunks):
            need = c.req.position + c.end
            if not stage.sessions.ensure(c.session.state, need):
                # Beyond what the session reserved when it opened, and the pool has no cells to spare.
                results[i] = self._fail(Status.RESOURCE_EXHAUSTED,
                                        f"session {c.req.session_id!r} needs {need} KV cells, more than it "
                                        f"reserved, and the pool has none to spare", retry_after_s=RETRY_AFTER_S)
                continue
            run.append(i)
            tokens = hidden = None
            if stage.is_head:
                tokens = np.asarray(c.req.token_ids[c.start:c.end], dtype=np.int32)
            else:
                hidden = c.req.hidden.to_numpy()[c.start:c.end]
            # a verification step's rows are attended one by one, as the decodes they stand for
            items.append(BatchItem(c.session.state.slot, c.req.position + c.start, tokens, hidden,
                                   rows_alone=c.req.verify))
        outs = stage.forward_batch(items) if items else []
        for j, (i, item, out) in enumerate(zip(run, items, outs)):
            c = chunks[i]
            if stage.has_mtp:  # the trunk states of the step's rows, for the MTP block once it is through
                kv = c.session.state
                if c.start == 0 or not kv.mtp_chunks:
                    kv.mtp_chunks = [item.position]
                kv.mtp_chunks.append(stage.last_states[j])
            if stage.sessions.keeps:  # what a kept session is matched by; nothing else reads it
                stage.sessions.record(c.session.state, item.position, row_keys(item.token_ids, item.hidden),
                                      out if c.req.position == 0 else None, item.rows_alone)
            if not stage.is_tail:
                results[i] = StepResult(Status.OK, hidden=NamedTensor.from_numpy("hidden", out))
            elif not c.last:
                results[i] = StepResult(Status.OK)
            else:
                results[i] = self._sampled(c, out)
                if stage.has_mtp:
                    results[i] = self._with_mtp(c, results[i])
        return results

    def _with_mtp(self, c: Chunk, res: StepResult) -> StepResult:
        """The tail's step result with the MTP block run over the step's kept rows (all of them, or a
        verification step's accepted prefix: the rows up to the first draft it did not sample) and its
        ``c.req.mtp_drafts`` drafts after the sampled token."""
        kv, req = c.session.state, c.req
        first, *chunks = kv.mtp_chunks
        kv.mtp_chunks = []
        states = np.concatenate(chunks, axis=0)
        ids = [int(t) for t in req.token_ids]
        kept = accepted_prefix(ids[1:], res.tokens) if req.verify else len(ids) - 1
        last = first + len(states)  # the step's rows end here; a first step may start after reused rows
        end = req.position + kept + 1
        accepted = ids[first - req.position:end - req.position]
        if not accepted or last < end:
            return res
        sampled = res.tokens[kept] if req.verify else res.token  # the tail's token after the kept rows
        drafts = mtp_step(self.stage, kv, first, accepted, states[:len(accepted)], sampled.token_id,
                          req.mtp_drafts)
        return replace(res, drafts=drafts)

    def _grammar_compiler(self) -> GrammarCompiler | None:
        with self._lock:
            if self._grammars is None and self.stage is not None and self.stage.is_tail:
                self._grammars = GrammarCompiler(GGUFTokenizer.from_gguf(self._spec.path), self.stage.cfg.n_vocab)
            return self._grammars

    @staticmethod
    def _sampled(c: Chunk, logits: np.ndarray) -> StepResult:
        """The tail's result of a step whose last chunk gave ``logits`` (float32 ``[n_out, n_vocab]``): the
        token after its last row, or in a verification step after each row (row ``i``'s draft being
        token ``i + 1``; :func:`meshnet.sampling.sample` applies the rejection rule to it), each among the
        tokens the session's grammar allows after that row when the step carries one."""
        req, done, grammar = c.req, c.session.token_ids, c.session.grammar
        ids = [int(t) for t in req.token_ids]
        n = len(ids)
        tokens: list[SampledToken] = []
        for r in range(0 if req.verify else n - 1, n):
            history = done + ids[:r + 1]
            allowed = None
            if grammar is not None:
                if grammar.grammar.start + grammar.follow(history) < len(history):
                    # draft ids[r] breaks the grammar, so row r - 1 (masked) rejected it: the rows from
                    # here are never read, and get row r - 1's token
                    tokens += tokens[-1:] * (n - r)
                    break
                allowed = grammar.allowed()
            tokens.append(sample(logits[r - n], req.sampling, history, req.position + r + 1,
                                 ids[r + 1] if r + 1 < n else None, allowed))
        return StepResult(Status.OK, token=tokens[-1], tokens=tuple(tokens) if req.verify else ())
