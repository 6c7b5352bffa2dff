"""A fake shard engine: deterministic hash arithmetic behind the real contract, for protocol and fault tests.

It serves any layer range of a :class:`FakeModel` without a file. Its outputs are pure functions of the
session's token history (never of the session id, epoch or step id), so a session replayed on fresh engines
— split into other ranges, its prefill cut into other chunks — yields the same tokens, which is what
failover tests rely on. It declares itself a fixture (``Capabilities.fixture = True``): nothing it produces
is evidence about a real model.

How it computes, per session and per stage (all arithmetic in f32 with only ``*`` and ``+``, which are
exactly rounded element by element, so a row's value does not depend on how many rows share a batch):

* head embedding: ``e[p] = blake2b(e[p-1] || token[p])``; row ``p`` of the hidden states is ``e[p]``
  mapped to ``n_embd`` floats in ``[-1, 1)``. Row ``p`` thus depends on ``tokens[0..p]`` exactly.
* layer ``L`` (each owned layer in order): ``s[L,p] = blake2b(s[L,p-1] || x[p])`` and
  ``x'[p] = 0.75 * x[p] + 0.25 * floats(s[L,p])``. The chain ``s[L, .]`` is the layer's "KV cache": it
  depends on every earlier row that reached that layer, so a stage that lost its state computes
  different outputs. Applying ``[a, b)`` then ``[b, c)`` equals applying ``[a, c)``.
* tail: logits ``[n_vocab]`` are a PRNG stream seeded by ``blake2b(last hidden row || position)``; greedy
  takes their argmax (lowest id on ties). See :mod:`meshnet.engine.fake_sampler` for the sampling chain.

Fault injection (:class:`~meshnet.engine.fake_faults.FakeFaults`) is opt-in and can change at run time with
:meth:`FakeEngine.set_faults`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshnet.contract import ArtifactId, Capabilities, Health, NamedTensor, SampledToken, SamplingParams, Status, StepRequest, StepResult

from meshnet.load_spec import LoadSpec
from meshnet.engine.base import EngineError, ShardEngine
from meshnet.engine.session import Session
from meshnet.engine.fake_faults import FakeCrash, FakeFaults, crash
from meshnet.engine.fake_sampler import sample_fake

_DIGEST = 64  # blake2b digest size used for every chain state: 16 floats' worth of bits
_CANCEL_POLL_S = 0.002  # how often a delayed step looks at its session's cancel flag


@dataclass(frozen=True)
class FakeModel:
    """Shape and identity of the model the fake engine pretends to serve.

    Attributes:
        n_layer: transformer layers in the whole model.
        n_embd: hidden size; hidden states are ``[n_tokens, n_embd]`` f32.
        n_vocab: vocabulary size; token ids are in ``[0, n_vocab)``.
        n_ctx: trained context length in tokens.
        sha256: the artifact identity a LoadSpec may pin; empty derives ``"fake-<n_layer>x<n_embd>x<n_vocab>"``.
            It also seeds every hash, so two fake models with different ids give different outputs.
        architecture: reported in the capabilities.

    Raises:
        ValueError: a non-positive dimension.
    """

    n_layer: int = 30
    n_embd: int = 8
    n_vocab: int = 1000
    n_ctx: int = 4096
    sha256: str = ""
    architecture: str = "fake"

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_vocab", "n_ctx"):
            if getattr(self, name) < 1:
                raise ValueError(f"FakeModel.{name} must be >= 1, got {getattr(self, name)}")
        if not self.sha256:
            object.__setattr__(self, "sha256", f"fake-{self.n_layer}x{self.n_embd}x{self.n_vocab}")


@dataclass
class _FakeState:
    """One session's chain digests on this stage: the head's embedding chain and one per owned layer,
    as they are now (``embed``, ``layers``), at the start (``start``) and after each cached token
    (``rows[p]``), so that a rollback can cut the chains back to any length."""

    embed: bytes
    layers: list[bytes] = field(default_factory=list)
    start: tuple[bytes, tuple[bytes, ...]] = (b"", ())
    rows: list[tuple[bytes, tuple[bytes, ...]]] = field(default_factory=list)

    def cut(self, n_keep: int) -> None:
        """Keep the chains of the first ``n_keep`` tokens."""
        del self.rows[n_keep:]
        embed, layers = self.rows[-1] if self.rows else self.start
        self.embed, self.layers = embed, list(layers)


def _blake(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for p in parts:
        h.update(p)
    return h.digest()


class FakeEngine(ShardEngine):
    """Deterministic fake of one layer range; see the module docstring for what it computes.

    Args:
        model: the model shape and identity to pretend to serve.
        faults: faults to inject from the first call on.
    """

    def __init__(self, model: FakeModel | None = None, faults: FakeFaults | None = None) -> None:
        super().__init__()
        self.model = model if model is not None else FakeModel()
        self._faults = faults if faults is not None else FakeFaults()
        self._calls = 0  # prefill/decode calls since construction or the last set_faults
        self._crashed = False
        self._model_id = self.model.sha256.encode()
        self._init_layers: list[bytes] = []

    # ---- faults ------------------------------------------------------------------------------
    @property
    def faults(self) -> FakeFaults:
        return self._faults

    def set_faults(self, faults: FakeFaults) -> None:
        """Replace the injected faults; restarts the crash call counter and revives a crashed engine.

        A step already running keeps the faults it started with.
        """
        with self._lock:
            self._faults = faults
            self._calls = 0
            self._crashed = False

    def _on_step_call(self) -> None:
        """Every step (prefill or decode, blocking or not) counts a call: crashes as ``crash_kind`` says
        once ``crash_after_calls`` is used up."""
        with self._lock:
            limit = self._faults.crash_after_calls
            self._calls += 1
            if self._crashed or (limit is not None and self._calls > limit):
                self._crashed = True
                crash(self._faults.crash_kind,
                       f"fake engine crashed on call {self._calls} (crash_after_calls={limit})")

    def health(self) -> Health:
        h = super().health()
        if self._crashed:
            return Health(loaded=h.loaded, healthy=False, active_sessions=h.active_sessions,
                          message="crashed (fault injection)")
        return h

    # ---- hooks -------------------------------------------------------------------------------
    def _load(self, spec: LoadSpec) -> Capabilities:
        m = self.model
        layers = spec.artifact.layers
        if layers.end > m.n_layer:
            raise EngineError(Status.INVALID_ARGUMENT,
                              f"layer range {layers} is outside the model: it has n_layer={m.n_layer} "
                              f"layers [0, {m.n_layer})")
        if spec.artifact.sha256 and spec.artifact.sha256 != m.sha256:
            raise EngineError(Status.INVALID_ARGUMENT,
                              f"artifact sha256 mismatch: expected {spec.artifact.sha256!r}, "
                              f"the fake model is {m.sha256!r}")
        if spec.n_ctx > m.n_ctx:
            raise EngineError(Status.INVALID_ARGUMENT,
                              f"n_ctx={spec.n_ctx} exceeds the model's trained length {m.n_ctx}")
        problem = spec.validate()
        if problem is not None:
            raise EngineError(Status.INVALID_ARGUMENT, problem)
        self._init_layers = [_blake(self._model_id, b"layer", i.to_bytes(4, "little"))
                             for i in range(layers.start, layers.end)]
        return Capabilities(
            engine="fake", backend="cpu", architecture=m.architecture,
            artifact=ArtifactId(m.sha256, layers), n_layer=m.n_layer, n_embd=m.n_embd,
            n_vocab=m.n_vocab, n_ctx=spec.n_ctx or min(m.n_ctx, 4096),
            is_head=layers.is_head(), is_tail=layers.is_tail(m.n_layer), fixture=True,
            max_sessions=spec.max_sessions, numerics="fake")

    def _new_state(self, req: StepRequest) -> _FakeState:
        # Every step carries at least one token, so a session that cannot cache one is refused up front.
        self._check_budget(self._faults, 1)
        embed = _blake(self._model_id, b"embed")
        return _FakeState(embed=embed, layers=list(self._init_layers), start=(embed, tuple(self._init_layers)))

    def _truncate(self, state: _FakeState, n_keep: int) -> None:
        state.cut(n_keep)

    def _free_state(self, state: Any, token_ids: list[int] = ()) -> None:
        pass  # plain Python objects: dropping the reference frees them

    def _cached_tokens(self) -> int:
        with self._lock:
            return sum(s.n_past for s in self._sessions.values())

    def _kv_bytes(self) -> int:
        return self._cached_tokens() * self._faults.bytes_per_token

    def _forward(self, session: Session, req: StepRequest) -> StepResult:
        """Embed (head), run the owned layers, sample (tail); commit the chains only when it all succeeds.

        Returns hidden ``[n_tokens, n_embd]`` f32 on a non-tail stage, else the sampled token.

        Raises:
            EngineError: RESOURCE_EXHAUSTED over the memory budget (before any work); CANCELLED when the
                session is cancelled during the delay or between micro-batches.
        """
        faults = self._faults  # one consistent snapshot for the whole call
        caps, spec = self._caps, self._spec
        assert caps is not None and spec is not None
        n = len(req.token_ids)
        self._check_budget(faults, n)
        self._sleep(session, faults.delay_s)

        state: _FakeState = session.state
        # Work on copies and commit at the end, so a cancelled or refused step leaves the state unchanged.
        embed, layer_states = state.embed, list(state.layers)
        outs, rows = [], []
        for lo in range(0, n, spec.n_ubatch):  # micro-batches: cancellation takes effect between them
            if session.cancelled:
                raise EngineError(Status.CANCELLED, f"session {session.session_id!r} was cancelled")
            ids = req.token_ids[lo:lo + spec.n_ubatch]
            if caps.is_head:
                x, embeds = self._embed(embed, ids)  # [n_ub, n_embd]
            else:
                x = np.array(req.hidden.to_numpy()[lo:lo + spec.n_ubatch], dtype="<f4")  # type: ignore[union-attr]
                embeds = [embed] * len(x)
            per_layer = []
            for i, digest in enumerate(layer_states):
                x, digests = self._layer(digest, x)
                layer_states[i] = digests[-1]
                per_layer.append(digests)
            rows += [(embeds[r], tuple(d[r] for d in per_layer)) for r in range(len(x))]
            embed = embeds[-1]
            outs.append(x)
        hidden = np.concatenate(outs)  # [n, n_embd]

        if caps.is_tail:
            history = session.token_ids + [int(t) for t in req.token_ids]
            # a verification step samples after every row (row i's draft is token i + 1), else after the last
            first = 0 if req.verify else n - 1
            tokens = tuple(self._sample(hidden[r], req.position + r + 1, history[:len(session.token_ids) + r + 1],
                                        req.sampling, int(req.token_ids[r + 1]) if r + 1 < n else None)
                           for r in range(first, n))
            if faults.malformed_output:
                tokens = tokens[:-1] + (SampledToken(caps.n_vocab, float("nan"), tokens[-1].top),)
            result = StepResult(Status.OK, token=tokens[-1], tokens=tokens if req.verify else ())
        else:
            if faults.malformed_output:
                hidden = np.full_like(hidden, np.nan)
            result = StepResult(Status.OK, hidden=NamedTensor.from_numpy("hidden", hidden))
        state.embed, state.layers = embed, layer_states
        state.rows += rows
        return result

    # ---- faults in the step ------------------------------------------------------------------
    def _check_budget(self, faults: FakeFaults, n_new: int) -> None:
        """Raise RESOURCE_EXHAUSTED when caching ``n_new`` more tokens would exceed the budget."""
        budgets = [b for b in (faults.memory_budget_bytes, self._spec.memory_budget_bytes if self._spec else 0)
                   if b > 0]
        if not budgets:
            return
        budget = min(budgets)
        cached = self._cached_tokens() * faults.bytes_per_token
        need = cached + n_new * faults.bytes_per_token
        if need > budget:
            raise EngineError(Status.RESOURCE_EXHAUSTED,
                              f"KV memory budget exceeded: {cached} bytes cached + {n_new} tokens x "
                              f"{faults.bytes_per_token} bytes = {need} > budget {budget} bytes")

    @staticmethod
    def _sleep(session: Session, delay_s: float) -> None:
        """Sleep ``delay_s``, returning CANCELLED as soon as the session is cancelled."""
        if delay_s <= 0:
            return
        deadline = time.monotonic() + delay_s
        while True:
            if session.cancelled:
                raise EngineError(Status.CANCELLED,
                                  f"session {session.session_id!r} was cancelled during the step")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, _CANCEL_POLL_S))

    # ---- the fake forward pass ---------------------------------------------------------------
    def _unit_floats(self, digests: list[bytes]) -> np.ndarray:
        """Map each digest to ``n_embd`` f32 values in ``[-1, 1)``: ``[len(digests), n_embd]``."""
        d = self.model.n_embd
        need = 4 * d
        bufs = []
        for dg in digests:
            buf = dg
            k = 0
            while len(buf) < need:  # n_embd > 16: stretch the digest with counter blocks
                buf += _blake(dg, k.to_bytes(4, "little"))
                k += 1
            bufs.append(buf[:need])
        words = np.frombuffer(b"".join(bufs), dtype="<u4").reshape(len(digests), d)
        # The top 24 bits are exact in f32, so the mapping is exact and portable.
        return (words >> 8).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)

    def _embed(self, digest: bytes, token_ids: tuple[int, ...]) -> tuple[np.ndarray, list[bytes]]:
        """Head embedding: one chained digest per token. Returns ``[n, n_embd]`` f32 and the digests."""
        digests = []
        for t in token_ids:
            digest = _blake(digest, int(t).to_bytes(4, "little"))
            digests.append(digest)
        return self._unit_floats(digests), digests

    def _layer(self, digest: bytes, x: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
        """One fake layer on ``x`` ``[n, n_embd]`` f32, chaining the layer's digest through the rows;
        returns the output and the digest after each row."""
        digests = []
        for row in x:
            digest = _blake(digest, row.tobytes())
            digests.append(digest)
        u = self._unit_floats(digests)
        return x * np.float32(0.75) + u * np.float32(0.25), digests

    def _logits(self, last_row: np.ndarray, position: int) -> np.ndarray:
        """Fake logits ``[n_vocab]`` (f64 in ``[0, 8)``), a function of the last hidden row and the position."""
        seed = _blake(self._model_id, b"logits", np.ascontiguousarray(last_row, dtype="<f4").tobytes(),
                      position.to_bytes(8, "little"))
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(seed[:16], "little")))
        return rng.random(self.model.n_vocab) * 8.0

    def _sample(self, last_row: np.ndarray, position: int, history: list[int],
                sp: SamplingParams, draft: int | None = None) -> SampledToken:
        """Pick the token for ``position`` (the index of the token being predicted) from the fake logits
        of ``last_row`` with :func:`~meshnet.engine.fake_sampler.sample_fake`."""
        return sample_fake(self._logits(last_row, position), position, history, sp, draft)


__all__ = ["FakeCrash", "FakeEngine", "FakeFaults", "FakeModel"]
