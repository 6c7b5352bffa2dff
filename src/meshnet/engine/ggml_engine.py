"""The real engine: a GGUF layer range computed with ggml's CPU kernels, behind the shard-engine contract.

``GgmlEngine`` wraps :class:`~meshnet.engine.ggml_stage.GgmlStage` (the compute core: weights, KV pool,
graphs) in the contract: sessions, statuses, batched iterations, sampling on the tail.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from meshnet.backends.cpu_features import ggml_cpu_features
from meshnet.engine.numerics import numerics_key
from meshnet.contract import ArtifactId, Capabilities, NamedTensor, SampledToken, StepRequest, StepResult, Status
from meshnet.load_spec import LoadSpec
from meshnet.engine.base import RETRY_AFTER_S, EngineError, ShardEngine
from meshnet.engine.session import Session
from meshnet.engine.ggml_backend import registry_devices
from meshnet.engine.ggml_mtp import mtp_step
from meshnet.engine.ggml_stage import BatchItem, GgmlStage
from meshnet.engine.kv_pool import PoolFull, PoolTooSmall
from meshnet.engine.prefix_cache import row_keys
from meshnet.engine.scheduler import Chunk
from meshnet.engine.stage_sessions import SessionKV
from meshnet.grammar import GrammarCompiler
from meshnet.layer_split import layer_costs, pipeline_depth
from meshnet.model.gguf_file import GGUFError, open_gguf
from meshnet.model.manifest import model_id
from meshnet.sampling import sample
from meshnet.speculative import accepted_prefix
from meshnet.tokenizer import GGUFTokenizer


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
                              mtp=spec.mtp.enabled, repack=spec.repack, huge_pages=spec.huge_pages)
        except (GGUFError, FileNotFoundError) as e:
            raise EngineError(Status.INVALID_ARGUMENT, str(e)) from None
        if self.stage is not None:
            self.stage.close()
        self.stage, self._grammars = stage, None
        cfg = stage.cfg
        return Capabilities(engine="ggml", backend="cpu", architecture=cfg.architecture,
                            artifact=ArtifactId(sha, spec.artifact.layers), n_layer=cfg.n_layer,
                            n_embd=cfg.n_embd, n_vocab=cfg.n_vocab, n_ctx=stage.session_tokens,
                            is_head=stage.is_head, is_tail=stage.is_tail, fixture=False,
                            max_sessions=spec.max_sessions,
                            residual_dims=() if cfg.dsv4 is None else cfg.residual_shape,
                            needs_token_ids=cfg.needs_token_ids(spec.artifact.layers),
                            numerics=numerics_key("cpu", "", spec.n_threads, spec.repack, spec.n_ubatch))

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
        except PoolTooSmall as e:  # no back-off helps: the request itself must ask for less
            raise EngineError(Status.INVALID_ARGUMENT, f"KV pool: {e}") from None

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
            if stage.needs_tokens:  # the head, or a stage with hash-routed blocks (DeepSeek-V4)
                tokens = np.asarray(c.req.token_ids[c.start:c.end], dtype=np.int32)
            if not stage.is_head:
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
