"""The real engine: a GGUF layer range computed with ggml's CPU kernels.

``GgmlStage`` is the compute core (weights, per-session KV caches, graphs) and can be used directly to
read logits (the parity tests do). ``GgmlEngine`` wraps it in the shard-engine contract: sessions,
statuses, sampling on the tail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from meshnet.backends.cpu_features import ggml_cpu_features
from meshnet.contract import (
    ArtifactId,
    Capabilities,
    LayerRange,
    LoadSpec,
    NamedTensor,
    StepRequest,
    StepResult,
    Status,
)
from meshnet.engine.base import EngineError, Session, ShardEngine
from meshnet.engine.ggml_backend import KVCache, StageWeights, cpu_backend, registry_devices
from meshnet.engine.ggml_graph import StepGraph, kv_length
from meshnet.model.gguf_file import GGUFError, drop_pages, open_gguf, sha256_file, stage_tensor_names
from meshnet.model.hparams import ModelConfig
from meshnet.sampling import sample

# Context per session when the caller does not choose one: the model's own, capped so that a default
# session's KV cache stays small on ordinary machines.
DEFAULT_MAX_CTX = 4096


@dataclass
class SessionKV:
    """One session's KV cache plus the decode graphs built for it, keyed by (n_tokens, n_kv, n_out)."""

    cache: KVCache
    graphs: dict[tuple[int, int, int], StepGraph] = field(default_factory=dict)

    def free(self) -> None:
        for g in self.graphs.values():
            g.free()
        self.graphs.clear()
        self.cache.free()


class GgmlStage:
    """Layers ``[start, end)`` of a GGUF model, loaded as stored into a ggml CPU backend.

    ``backend`` replaces the CPU backend (an accelerator's, from ``accelerator_backend``); a device
    cannot compute on the host's memory map, so it goes with ``use_mmap=False``.

    Raises (constructor):
        FileNotFoundError: no such file.
        GGUFError: not GGUF, truncated, unsupported architecture or tensor type, or a layer range
            outside the model.
    """

    def __init__(self, path: str, layers: LayerRange, n_threads: int = 2, n_ctx: int = 0,
                 n_ubatch: int = 512, use_mmap: bool = True, backend=None) -> None:
        reader = open_gguf(path)
        self.cfg = ModelConfig.from_reader(reader)
        if layers.end > self.cfg.n_layer:
            raise GGUFError(f"layer range [{layers.start}, {layers.end}) is outside the model, which has "
                            f"{self.cfg.n_layer} layers [0, {self.cfg.n_layer})")
        self.layers = layers
        self.is_head = layers.is_head()
        self.is_tail = layers.is_tail(self.cfg.n_layer)
        self.n_ctx = n_ctx or min(self.cfg.n_ctx_train, DEFAULT_MAX_CTX)
        self.n_ubatch = max(1, n_ubatch)
        self.backend = backend if backend is not None else cpu_backend(n_threads)
        selection = stage_tensor_names(reader, layers, self.cfg.n_layer)
        self.weights = StageWeights(reader, selection.names, self.backend, use_mmap=use_mmap)
        if not use_mmap:
            drop_pages(reader)  # the copies are what stays resident, not the file pages read to make them

    def kv_bytes_per_session(self) -> int:
        return KVCache.bytes_needed(self.layers, self.cfg.n_embd_k_gqa, self.cfg.n_embd_v_gqa, self.n_ctx)

    def new_session(self) -> SessionKV:
        return SessionKV(KVCache(self.layers, self.cfg.n_embd_k_gqa, self.cfg.n_embd_v_gqa, self.n_ctx,
                                 self.backend))

    def _graph(self, kv: SessionKV, n_tokens: int, n_kv: int, n_out: int) -> tuple[StepGraph, bool]:
        key = (n_tokens, n_kv, n_out)
        g = kv.graphs.get(key)
        if g is not None:
            return g, True
        g = StepGraph(self.cfg, self.weights, kv.cache, self.layers, n_tokens, n_kv, n_out, self.backend)
        if n_tokens == 1:
            # Decode graphs are reused every step; those for a shorter KV length never come back.
            for old in [k for k in kv.graphs if k[0] == 1 and k[1] < n_kv]:
                kv.graphs.pop(old).free()
            kv.graphs[key] = g
            return g, True
        return g, False

    def forward(self, kv: SessionKV, position: int, token_ids: np.ndarray | None = None,
                hidden: np.ndarray | None = None, all_logits: bool = False,
                should_stop: Callable[[], bool] = lambda: False) -> np.ndarray | None:
        """Run tokens at ``position ..`` through the range in micro-batches of ``n_ubatch`` tokens.

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
            m = end - start
            last = end == n
            n_out = m if (all_logits or not self.is_tail) else 1
            g, cached = self._graph(kv, m, kv_length(position + end, self.n_ctx), n_out)
            try:
                out = g.run(self.backend, position + start,
                            None if token_ids is None else token_ids[start:end],
                            None if hidden is None else hidden[start:end])
            finally:
                if not cached:
                    g.free()
            if not self.is_tail or all_logits or last:
                outs.append(out)
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)

    def close(self) -> None:
        """Free the weights' ggml handles (the shared backend stays for other stages)."""
        self.weights.free()


class GgmlEngine(ShardEngine):
    """The shard-engine contract on top of :class:`GgmlStage` (CPU backend)."""

    def __init__(self) -> None:
        super().__init__()
        self.stage: GgmlStage | None = None
        self._kv_total = 0

    def _load(self, spec: LoadSpec) -> Capabilities:
        try:
            sha = sha256_file(spec.path)
        except FileNotFoundError as e:
            raise EngineError(Status.INVALID_ARGUMENT, str(e)) from None
        if spec.artifact.sha256 and spec.artifact.sha256 != sha:
            raise EngineError(Status.INVALID_ARGUMENT,
                              f"{spec.path} has sha256 {sha}, expected {spec.artifact.sha256}")
        try:
            stage = GgmlStage(spec.path, spec.artifact.layers, spec.n_threads, spec.n_ctx, spec.n_ubatch,
                              spec.use_mmap)
        except (GGUFError, FileNotFoundError) as e:
            raise EngineError(Status.INVALID_ARGUMENT, str(e)) from None
        if self.stage is not None:
            self.stage.close()
        self.stage = stage
        cfg = stage.cfg
        return Capabilities(engine="ggml", backend="cpu", architecture=cfg.architecture,
                            artifact=ArtifactId(sha, spec.artifact.layers), n_layer=cfg.n_layer,
                            n_embd=cfg.n_embd, n_vocab=cfg.n_vocab, n_ctx=stage.n_ctx,
                            is_head=stage.is_head, is_tail=stage.is_tail, fixture=False,
                            max_sessions=spec.max_sessions)

    @property
    def device(self) -> dict | None:
        """The device the stage computes on: ggml's CPU device (``{"index", "backend", "name",
        "description", "type", "memory_free_bytes", "memory_total_bytes", "cpu_features"}``, memory in
        bytes, ``cpu_features`` the SIMD features its kernels were compiled with); None before load."""
        if self.stage is None:
            return None
        dev = next((d for d in registry_devices() if d["backend"] == "CPU"), None)
        return None if dev is None else {**dev, "cpu_features": list(ggml_cpu_features())}

    def _new_state(self, session_id: str) -> SessionKV:
        assert self.stage is not None and self._spec is not None
        need = self.stage.kv_bytes_per_session()
        budget = self._spec.memory_budget_bytes
        if budget and self._kv_total + need > budget:
            raise EngineError(Status.RESOURCE_EXHAUSTED,
                              f"a new session needs {need} KV bytes; {self._kv_total} of the "
                              f"{budget}-byte budget are in use")
        state = self.stage.new_session()
        self._kv_total += state.cache.nbytes
        return state

    def _free_state(self, state: SessionKV) -> None:
        if state.cache.buffer:
            self._kv_total -= state.cache.nbytes
        state.free()

    def _kv_bytes(self) -> int:
        return self._kv_total

    def _weight_bytes(self) -> int:
        return self.stage.weights.nbytes if self.stage else 0

    def _forward(self, session: Session, req: StepRequest) -> StepResult:
        stage = self.stage
        assert stage is not None
        tokens = np.asarray(req.token_ids, dtype=np.int32) if stage.is_head else None
        hidden = req.hidden.to_numpy() if req.hidden is not None else None
        out = stage.forward(session.state, req.position, tokens, hidden,
                            should_stop=lambda: session.cancelled)
        if out is None:
            return StepResult(Status.CANCELLED, f"session {session.session_id!r} was cancelled")
        if not stage.is_tail:
            return StepResult(Status.OK, hidden=NamedTensor.from_numpy("hidden", out))
        history = session.token_ids + [int(t) for t in req.token_ids]
        token = sample(out[-1], req.sampling, history, req.position + len(req.token_ids))
        return StepResult(Status.OK, token=token)
