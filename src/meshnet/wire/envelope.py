"""The activation envelope: a step's request or hidden states as versioned, checksummed wire frames.

A :class:`~meshnet.contract.StepRequest` becomes one or more ``Envelope`` frames (payload split at
``MAX_FRAME_BYTES``, well under gRPC's 4 MiB default message limit); frames are reassembled and
validated before anything reaches an engine, so a malformed frame changes no session state.

Validation outcomes (a :class:`WireError` carries the status):
  * newer major version -> FAILED_PRECONDITION naming both versions;
  * unknown dtype, a zero or negative dimension, shape disagreeing with the byte count, bad CRC-32,
    unknown byte order, frames out of order -> INVALID_ARGUMENT.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Iterator

from meshnet.contract import (
    TENSOR_DTYPES,
    NamedTensor,
    SampledToken,
    Status,
    StepRequest,
    StepResult,
    TokenLogprob,
    tensor_bytes,
)
from meshnet.proto import meshnet_pb2 as pb
from meshnet.sampling_params import MAX_LOGIT_BIAS, Grammar, SamplingParams

PROTOCOL_MAJOR = 1
# Minor versions add fields a node of an older minor ignores (protobuf drops unknown fields), so a client
# must not rely on them there. 1: forwarding (Envelope.next_hops, AWAIT), speculative verify/rollback,
# logit_bias, grammar (Sampling 12, 13), MTP drafts (Envelope 26, StepReply 13), manifests, NodeInfo.version.
# 2: the range a step was routed for (Envelope.layers, ForwardHop.layers).
PROTOCOL_MINOR = 2
# Payload bytes per frame: large prompts stream in frames of 1 MiB (gRPC's default limit is 4 MiB).
MAX_FRAME_BYTES = 1 << 20
# A session id is a client's uuid (32 hex digits); a far longer one is refused before any stage echoes it
# in an error, whose details gRPC drops past 16 KiB (the caller then sees RESOURCE_EXHAUSTED, not why).
MAX_SESSION_ID_CHARS = 256
# The text a HopFailure's fields keep: a failure note a tail holds for an await (up to MAX_PENDING of them,
# for minutes) carried an 8 MB message each, and 200 such notes grew a node by 1.4 GB.
MAX_FAILURE_CHARS = 4096


def session_id_problem(session_id: str) -> str | None:
    """Why ``session_id`` is no session id a node keys anything by (empty, or over
    :data:`MAX_SESSION_ID_CHARS`), or None. Every way a session id reaches a node checks it: a step's
    frames, an await, a failure note, Cancel and Release (the fences Release sets are kept for good)."""
    if not session_id:
        return "session_id is empty"
    if len(session_id) > MAX_SESSION_ID_CHARS:
        return f"session_id of {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS}"
    return None


def bounded_failure(failure: pb.HopFailure) -> pb.HopFailure:
    """``failure`` with its text fields cut to :data:`MAX_FAILURE_CHARS` (a peer's word, kept by the tail)."""
    return pb.HopFailure(node_id=failure.node_id[:MAX_SESSION_ID_CHARS], code=failure.code[:64],
                         message=failure.message[:MAX_FAILURE_CHARS], retry_after_s=failure.retry_after_s,
                         unreachable=failure.unreachable)


class WireError(Exception):
    """A frame that must be refused; ``status`` says how (INVALID_ARGUMENT / FAILED_PRECONDITION)."""

    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def sampling_to_pb(s: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                       repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                       frequency_penalty=s.frequency_penalty, penalty_last_n=s.penalty_last_n,
                       has_seed=s.seed is not None, seed=(s.seed or 0) % (1 << 64),
                       n_top_logprobs=s.n_top_logprobs, logit_bias=dict(s.logit_bias),
                       grammar=None if s.grammar is None else pb.Grammar(json_schema=s.grammar.json_schema,
                                                                         start=s.grammar.start),
                       skip_logprob=not s.logprobs)


def sampling_from_pb(m: pb.Sampling) -> SamplingParams:
    """The step's sampling parameters. Raises WireError (INVALID_ARGUMENT) for a ``logit_bias`` map over
    :data:`MAX_LOGIT_BIAS` entries, before it is converted and sorted (a 6 MB map costs a node a second),
    or a grammar's schema over :data:`~meshnet.sampling_params.MAX_GRAMMAR_BYTES`."""
    if len(m.logit_bias) > MAX_LOGIT_BIAS:
        raise WireError(Status.INVALID_ARGUMENT, f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, "
                                                 f"got {len(m.logit_bias)}")
    grammar = None
    if m.HasField("grammar"):
        grammar = Grammar(m.grammar.json_schema, int(m.grammar.start))
        if (problem := grammar.validate()) is not None:
            raise WireError(Status.INVALID_ARGUMENT, problem)
    return SamplingParams(temperature=m.temperature, top_k=m.top_k, top_p=m.top_p, min_p=m.min_p,
                          repetition_penalty=m.repetition_penalty, presence_penalty=m.presence_penalty,
                          frequency_penalty=m.frequency_penalty, penalty_last_n=m.penalty_last_n,
                          seed=_signed64(m.seed) if m.has_seed else None, n_top_logprobs=m.n_top_logprobs,
                          logit_bias=tuple(sorted(m.logit_bias.items())), grammar=grammar,
                          logprobs=not m.skip_logprob)


def _signed64(seed: int) -> int:
    """The int64 seed the wire's uint64 carries (sent modulo 2**64): a negative seed, OpenAI's int64, arrived
    as 2**64 - 1 and was refused by the tail as outside int64."""
    return seed - (1 << 64) if seed >= 1 << 63 else int(seed)


def tensor_frames(header: pb.Envelope, tensor: NamedTensor | None,
                  max_frame: int = MAX_FRAME_BYTES) -> list[pb.Envelope]:
    """Frames carrying ``header``'s fields plus ``tensor`` (or none) split into payload chunks.

    Args:
        header: the step's fields (session, epoch, position, ...); copied into every frame.
        tensor: the payload (raw little-endian bytes of ``tensor.shape`` x ``tensor.dtype``) or None.
        max_frame: payload bytes per frame (>= 1); a payload of ``n`` bytes takes ``ceil(n / max_frame)``
            frames (one, with an empty payload, when there is nothing to carry).
    Raises:
        ValueError: ``max_frame`` < 1.
    """
    if max_frame < 1:
        raise ValueError(f"max_frame must be >= 1 byte, got {max_frame}")
    payload = tensor.data if tensor is not None else b""
    # One checksum and one memoryview for the whole payload: every frame carries the same CRC-32, and
    # slicing a view copies each chunk once (into its frame), not once more into an intermediate bytes.
    view = memoryview(payload).cast("B")
    n_chunks = max(1, -(-len(view) // max_frame))
    template = pb.Envelope()
    template.CopyFrom(header)
    template.major, template.minor = PROTOCOL_MAJOR, PROTOCOL_MINOR
    template.byte_order = "little"
    template.n_chunks = n_chunks
    if tensor is not None:
        template.dtype = tensor.dtype
        template.shape[:] = list(tensor.shape)
        template.crc32 = zlib.crc32(view)
        template.total_bytes = len(view)
    frames = []
    for i in range(n_chunks):
        f = pb.Envelope()
        f.CopyFrom(template)
        f.chunk_index = i
        f.payload = bytes(view[i * max_frame:(i + 1) * max_frame])
        frames.append(f)
    return frames


def request_to_frames(req: StepRequest, decode: bool, max_frame: int = MAX_FRAME_BYTES,
                      next_hops: Iterable[pb.ForwardHop] = (),
                      receiver: pb.ForwardHop | None = None) -> list[pb.Envelope]:
    """Encode a step request as envelope frames (one frame unless the hidden states are large);
    ``next_hops``: the hops the receiver forwards its output to (see :mod:`meshnet.node.forwarding`);
    ``receiver``: the receiver as the route names it: its layers, which it refuses the step for when it
    serves another range, and its id (without layers, or None: not checked)."""
    header = pb.Envelope(session_id=req.session_id, epoch=req.epoch, position=req.position, step_id=req.step_id,
                         decode=decode, token_ids=list(req.token_ids), sampling=sampling_to_pb(req.sampling),
                         reserve_tokens=req.reserve_tokens, verify=req.verify, rollback=req.rollback,
                         mtp_drafts=req.mtp_drafts, next_hops=list(next_hops))
    if receiver is not None and receiver.HasField("layers"):
        header.layers.CopyFrom(receiver.layers)
        header.routed_node_id = receiver.node_id
    return tensor_frames(header, req.hidden, max_frame)


def _check_header(f: pb.Envelope) -> None:
    if f.major > PROTOCOL_MAJOR:
        raise WireError(Status.FAILED_PRECONDITION,
                        f"envelope version {f.major}.{f.minor} is newer than this node's "
                        f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}; upgrade the node")
    if f.major < PROTOCOL_MAJOR:
        raise WireError(Status.FAILED_PRECONDITION,
                        f"envelope version {f.major}.{f.minor} is older than this node's "
                        f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}; upgrade the sender")
    if f.byte_order not in ("little", ""):
        raise WireError(Status.INVALID_ARGUMENT, f"unsupported byte order {f.byte_order!r} (only 'little')")


def assemble(frames: Iterable[pb.Envelope]) -> tuple[pb.Envelope, bytes]:
    """Join an envelope's frames; returns the first frame (the header) and the whole payload.

    Raises:
        WireError: version skew, a session id empty or over :data:`MAX_SESSION_ID_CHARS`, frames out of order or
            from different steps, a bad checksum, an unknown dtype, a zero dimension or a shape that
            disagrees with the byte count.
    """
    header: pb.Envelope | None = None
    parts: list[bytes] = []
    for f in frames:
        _check_header(f)
        if header is None:
            header = f
            if f.n_chunks < 1:
                raise WireError(Status.INVALID_ARGUMENT, "envelope declares 0 frames")
            # every node would key its cache, the tail its await, by it
            if (problem := session_id_problem(f.session_id)) is not None:
                raise WireError(Status.INVALID_ARGUMENT, problem)
        elif (f.session_id, f.step_id) != (header.session_id, header.step_id):
            raise WireError(Status.INVALID_ARGUMENT, "frames of different steps were interleaved")
        if f.chunk_index != len(parts) or f.n_chunks != header.n_chunks:
            raise WireError(Status.INVALID_ARGUMENT,
                            f"frame {f.chunk_index} of {f.n_chunks} arrived where frame {len(parts)} of "
                            f"{header.n_chunks} was expected")
        parts.append(f.payload)
        if len(parts) == header.n_chunks:
            break
    if header is None:
        raise WireError(Status.INVALID_ARGUMENT, "empty envelope stream")
    if len(parts) != header.n_chunks:
        raise WireError(Status.INVALID_ARGUMENT, f"envelope ended after {len(parts)} of {header.n_chunks} frames")
    payload = b"".join(parts)
    if header.dtype or header.shape or payload:
        if header.dtype not in TENSOR_DTYPES:
            raise WireError(Status.INVALID_ARGUMENT,
                            f"unknown dtype {header.dtype!r} (supported: {', '.join(sorted(TENSOR_DTYPES))})")
        shape = list(header.shape)
        if not shape or any(d <= 0 for d in shape):
            raise WireError(Status.INVALID_ARGUMENT, f"shape {shape} has a zero or negative dimension")
        want = tensor_bytes(shape, header.dtype)
        if want != len(payload) or header.total_bytes != len(payload):
            raise WireError(Status.INVALID_ARGUMENT,
                            f"shape {shape} of {header.dtype} needs {want} bytes, the envelope carries "
                            f"{len(payload)} (declared {header.total_bytes})")
        if zlib.crc32(payload) != header.crc32:
            raise WireError(Status.INVALID_ARGUMENT,
                            f"checksum mismatch: payload CRC-32 is {zlib.crc32(payload):#010x}, the envelope "
                            f"says {header.crc32:#010x}")
    return header, payload


def frames_to_request(frames: Iterable[pb.Envelope]) -> tuple[StepRequest, bool]:
    """Validate and decode frames into ``(StepRequest, decode)``. Raises WireError."""
    h, payload = assemble(frames)
    hidden = NamedTensor("hidden", tuple(int(d) for d in h.shape), h.dtype, payload) if h.dtype else None
    req = StepRequest(session_id=h.session_id, epoch=int(h.epoch), position=int(h.position),
                      token_ids=tuple(int(t) for t in h.token_ids), hidden=hidden,
                      sampling=sampling_from_pb(h.sampling), step_id=int(h.step_id),
                      reserve_tokens=int(h.reserve_tokens), verify=bool(h.verify), rollback=bool(h.rollback),
                      mtp_drafts=int(h.mtp_drafts))
    return req, bool(h.decode)


def _top_to_pb(t: SampledToken) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=x.token_id, logprob=x.logprob) for x in t.top]


def _token_from_pb(m: pb.StepReply | pb.SampledToken) -> SampledToken:
    """A sampled token from a reply (its ``token_id``, ``logprob``, ``top``) or one of its ``tokens``."""
    return SampledToken(m.token_id, m.logprob, tuple(TokenLogprob(x.token_id, x.logprob) for x in m.top))


def result_to_replies(req: StepRequest, res: StepResult, max_frame: int = MAX_FRAME_BYTES) -> list[pb.StepReply]:
    """An OK step result as reply messages: one per hidden-state frame, or one with the token."""
    if res.token is not None:
        t = res.token
        return [pb.StepReply(n_past=res.n_past, has_token=True, token_id=t.token_id, logprob=t.logprob,
                             top=_top_to_pb(t), tokens=[pb.SampledToken(token_id=x.token_id, logprob=x.logprob,
                                                                         top=_top_to_pb(x)) for x in res.tokens],
                             drafts=list(res.drafts), reused=res.reused)]
    header = pb.Envelope(session_id=req.session_id, epoch=req.epoch, position=req.position, step_id=req.step_id)
    return [pb.StepReply(n_past=res.n_past, hidden=f, reused=res.reused)
            for f in tensor_frames(header, res.hidden, max_frame)]


def replies_to_result(replies: Iterable[pb.StepReply]) -> StepResult:
    """Decode reply messages into an OK StepResult. Raises WireError for malformed hidden frames."""
    it: Iterator[pb.StepReply] = iter(replies)
    first = next(it)
    if first.has_token:
        return StepResult(Status.OK, token=_token_from_pb(first), n_past=int(first.n_past),
                          tokens=tuple(_token_from_pb(t) for t in first.tokens),
                          drafts=tuple(int(d) for d in first.drafts), reused=int(first.reused))

    def frames() -> Iterator[pb.Envelope]:
        yield first.hidden
        for r in it:
            yield r.hidden

    h, payload = assemble(frames())
    hidden = NamedTensor("hidden", tuple(int(d) for d in h.shape), h.dtype, payload)
    return StepResult(Status.OK, hidden=hidden, n_past=int(first.n_past), reused=int(first.reused))
