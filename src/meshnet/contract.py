"""The shard-engine contract's data types: what crosses the boundary of one layer range.

Every engine (the real ggml engine, the fake fixture engine, later a gRPC stub) speaks only these frozen
types. Expected outcomes are :class:`Status` codes on the result, never exceptions; an exception out of an
engine means a bug or a crash (the fake engine's crash knob raises on purpose).

Layer ranges are half-open ``[start, end)`` everywhere. How the tail picks tokens (:class:`SamplingParams`,
:class:`~meshnet.sampling_params.Grammar` and their limits) is :mod:`meshnet.sampling_params`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

import numpy as np

from meshnet.sampling_params import GREEDY, SamplingParams


class Status(enum.Enum):
    """Outcome of an engine call, named after the gRPC status codes the mesh maps them to."""

    OK = "OK"
    NOT_FOUND = "NOT_FOUND"  # no cached session: a KV-cache miss; the caller replays the session
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # not loaded, stale route epoch, wrong position
    CANCELLED = "CANCELLED"  # the session was cancelled before or during the step
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # retryable: session limit or memory budget
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the request itself is wrong; retrying cannot help


@dataclass(frozen=True)
class LayerRange:
    """Half-open range of transformer layers ``[start, end)`` owned by one stage.

    Raises:
        ValueError: ``start < 0`` or ``end <= start``.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"layer range [{self.start}, {self.end}) is empty or negative; "
                             "expected 0 <= start < end")

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def is_head(self) -> bool:
        """True when the range starts at layer 0 (the stage owns the token embedding)."""
        return self.start == 0

    def is_tail(self, n_layer: int) -> bool:
        """True when the range ends at ``n_layer`` (the stage owns output norm, projection, sampling)."""
        return self.end == n_layer

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"

    @classmethod
    def parse(cls, text: str) -> "LayerRange":
        """Parse ``"start:end"`` (half-open). Raises ValueError naming the bad text."""
        try:
            a, b = map(int, text.split(":"))  # ValueError: not two parts, or not integers
        except ValueError:
            raise ValueError(f"bad layer range {text!r}: expected START:END, two integers with START < END") from None
        try:
            return cls(a, b)
        except ValueError as e:
            raise ValueError(f"bad layer range {text!r}: {e}") from None


def split_layers(n_layer: int, n_stages: int) -> list[LayerRange]:
    """Split ``[0, n_layer)`` into ``n_stages`` contiguous ranges whose sizes differ by at most one.

    Raises:
        ValueError: ``n_stages`` is not in ``[1, n_layer]``.
    """
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {n_stages} stages (need 1..{n_layer})")
    base, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        out.append(LayerRange(start, end))
        start = end
    return out


@dataclass(frozen=True)
class ArtifactId:
    """Exact identity of what a stage serves: the model id (hex sha256 of its manifest, see
    :mod:`meshnet.model.manifest`) and its layer range."""

    sha256: str
    layers: LayerRange


# dtype names a NamedTensor may carry, with their numpy equivalents.
TENSOR_DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
}


def tensor_bytes(shape, dtype: str) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` (a :data:`TENSOR_DTYPES` key) holds: the product in
    Python ints, which cannot wrap as numpy's int64 product does (a shape of (2**62 + 1, n_embd) would
    otherwise need one row's bytes)."""
    return math.prod(shape) * TENSOR_DTYPES[dtype].itemsize


@dataclass(frozen=True)
class NamedTensor:
    """A tensor as it crosses a stage boundary: name, shape, dtype name and little-endian bytes.

    Hidden states are ``name="hidden"``, shape ``(n_tokens, n_embd)``, dtype ``"f32"``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    data: bytes

    def validate(self) -> str | None:
        """Return None when well-formed, else a message naming what is wrong."""
        if self.dtype not in TENSOR_DTYPES:
            return f"tensor {self.name!r}: unknown dtype {self.dtype!r} (supported: {sorted(TENSOR_DTYPES)})"
        if any(d <= 0 for d in self.shape):
            return f"tensor {self.name!r}: shape {self.shape} has a zero or negative dimension"
        want = tensor_bytes(self.shape, self.dtype)
        if want != len(self.data):
            return (f"tensor {self.name!r}: shape {self.shape} of {self.dtype} needs {want} bytes, "
                    f"got {len(self.data)}")
        return None

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the data with this tensor's shape and dtype (no copy)."""
        return np.frombuffer(self.data, dtype=TENSOR_DTYPES[self.dtype]).reshape(self.shape)

    @classmethod
    def from_numpy(cls, name: str, array: np.ndarray) -> "NamedTensor":
        """Wrap a float32/float16 array (copied to little-endian contiguous bytes)."""
        for dname, dt in TENSOR_DTYPES.items():
            if array.dtype == dt or array.dtype == dt.newbyteorder("="):
                arr = np.ascontiguousarray(array, dtype=dt)
                return cls(name, tuple(int(d) for d in arr.shape), dname, arr.tobytes())
        raise ValueError(f"unsupported array dtype {array.dtype} for tensor {name!r}")


# Draft tokens one verification step may carry (its rows stay far below ggml's flash-attention tile of
# 64 query rows, and a step's cells stay within one prefill micro-batch).
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class StepRequest:
    """One forward step of a session on one stage: prefill (many tokens) or decode (one token).

    Attributes:
        session_id: caller-chosen id; each session has its own KV cache and epoch on every stage.
        epoch: route epoch; a request older than the session's epoch is refused (FAILED_PRECONDITION).
        position: index of the first token of this step in the session (equals the tokens already cached).
        token_ids: the step's token ids ``[n_tokens]``. The head embeds them; every stage keeps them so
            the tail can apply repetition penalties.
        hidden: ``[n_tokens, n_embd]`` f32 hidden states from the previous stage (``[n_tokens, *dims]``
            for a residual of other dims: ``Capabilities.hidden_row_shape``); None on the head.
        sampling: used by the tail only.
        step_id: caller's monotonically increasing step counter (for logs and the ledger).
        reserve_tokens: on the step that opens a session, the KV cells it will need at most (its prompt
            plus its new tokens); the stage reserves them or refuses the session (RESOURCE_EXHAUSTED).
            0 reserves the whole context length.
        verify: a verification step of speculative decoding: ``token_ids`` are the last sampled token
            followed by up to :data:`MAX_DRAFT_TOKENS` draft tokens, and the tail samples a token after
            every row (``StepResult.tokens``), treating ``token_ids[i + 1]`` as the draft for row ``i``.
        rollback: ``position`` may lie below the tokens the stage holds for the session: the stage first
            drops the session's cells at ``position`` and after (the rejected rows of a verification
            step), then runs the step. Without it a position other than the session's length is refused
            (FAILED_PRECONDITION), so a client that lost count is never silently cut back.
        mtp_drafts: on a tail that runs the model's next-token-prediction block, how many draft tokens
            to propose after the step's token (``StepResult.drafts``; 0..:data:`MAX_DRAFT_TOKENS`). Other
            stages and engines ignore it.
    """

    session_id: str
    epoch: int
    position: int
    token_ids: tuple[int, ...]
    hidden: NamedTensor | None = None
    sampling: SamplingParams = GREEDY
    step_id: int = 0
    reserve_tokens: int = 0
    verify: bool = False
    rollback: bool = False
    mtp_drafts: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class SampledToken:
    """What the tail returns instead of logits: the chosen token, its log-prob and optional top log-probs."""

    token_id: int
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """Result of prefill/decode on one stage.

    Exactly one of ``hidden`` (non-tail stages, ``[n_tokens, n_embd]`` f32) or ``token`` (tail) is set
    when ``status`` is OK; neither otherwise. ``message`` explains any non-OK status.
    ``retry_after_s`` is set with RESOURCE_EXHAUSTED. On the tail, a verification step
    (``StepRequest.verify``) also sets ``tokens``: the token sampled after each of its rows, in row
    order (``token`` is the last of them). ``drafts``: the tail's next-token-prediction drafts of the
    tokens after ``token`` (``StepRequest.mtp_drafts``), for the next step to verify. ``reused``: rows
    of the step its stage did not compute, having them in its prefix cache.
    """

    status: Status
    message: str = ""
    hidden: NamedTensor | None = None
    token: SampledToken | None = None
    n_past: int = 0  # tokens cached for the session after this step
    retry_after_s: float | None = None
    tokens: tuple[SampledToken, ...] = ()
    drafts: tuple[int, ...] = ()
    # Leading rows of a session's first step whose cells the stage took from its prefix cache instead of
    # computing them (a finished session's prompt began the same way); 0 for every later step.
    reused: int = 0

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def reused_after(self, upstream: int) -> "StepResult":
        """This result with ``reused`` at most ``upstream``, the rows every stage before this one on the route
        took from its prefix cache: a prompt's rows count as reused only where every stage reused them (a
        restarted head, its cache empty, computes them all whatever the tail kept)."""
        return self if self.reused <= upstream else replace(self, reused=upstream)


@dataclass(frozen=True)
class Capabilities:
    """What a loaded stage serves."""

    engine: str  # "ggml" or "fake"
    backend: str  # "cpu", ...
    architecture: str
    artifact: ArtifactId
    n_layer: int  # layers in the whole model
    n_embd: int
    n_vocab: int
    n_ctx: int
    is_head: bool
    is_tail: bool
    fixture: bool = False  # True for test fixtures that are not a real model
    max_sessions: int = 16
    # One token's activation at this stage's input boundary (dims after n_tokens); () is (n_embd,).
    # DeepSeek-V4's hyper-connections make it (n_hc, n_embd).
    residual_dims: tuple[int, ...] = ()
    # The stage computes with its step's token ids besides embedding them (hash-routed MoE blocks):
    # a step whose hidden states come without them is refused.
    needs_token_ids: bool = False
    # What decides the bits the stage computes (see :func:`meshnet.engine.numerics.numerics_key`): stages with
    # equal keys compute identical outputs from identical inputs. "" = not known.
    numerics: str = ""

    @property
    def hidden_row_shape(self) -> tuple[int, ...]:
        """Dims of one token's hidden states as this stage takes and passes them on."""
        return self.residual_dims or (self.n_embd,)


@dataclass(frozen=True)
class Health:
    loaded: bool
    healthy: bool
    active_sessions: int
    message: str = ""


@dataclass(frozen=True)
class Metrics:
    """Counters since load. Times in seconds, memory in bytes (``kv_bytes``: the KV pool's resident
    bytes). KV figures in tokens: held by open sessions (and by finished ones a stage keeps for their
    prefixes: ``kv_tokens_kept`` of them), reserved for them, reservable at all. Batching:
    iterations run, rows they held (in all, at most), steps waiting now, and seconds steps waited
    before their first iteration (summed over ``queued_steps``)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    active_sessions: int = 0
    kv_bytes: int = 0
    weight_bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    kv_tokens_held: int = 0
    kv_tokens_reserved: int = 0
    kv_tokens_capacity: int = 0
    kv_tokens_kept: int = 0
    iterations: int = 0
    batch_rows: int = 0
    max_batch_rows: int = 0
    waiting_steps: int = 0
    queue_seconds: float = 0.0
    queued_steps: int = 0


@dataclass(frozen=True)
class Outcome:
    """Result of load, cancel and release: a status and, when not OK, why."""

    status: Status
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.OK
