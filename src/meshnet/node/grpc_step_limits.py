"""What a node's gRPC step calls may hold of it: the data plane's limits, on gRPC.

A ``StepStream`` holds one of the node's gRPC worker threads while it sends its frames: streams that sent
one frame of two and went quiet held one each for as long as their client kept them open, and with
``max_sessions + 8`` of them (every worker) the node answered nothing else: Health, capabilities and unary
steps timed out and new clients routed around it. So at most ``max_sessions`` streams read their frames at
once, and each frame (and the stream's end) must come within :data:`STREAM_READ_S` of the one before, as
on the raw-TCP data plane (``read_timeout_s``).

A unary ``Step`` answers in one message: a step whose output would need several frames is refused before
it runs (refused after, the session kept its tokens and the StepStream the refusal advised was refused in
turn, the step no longer starting where the session ended).
"""

from __future__ import annotations

import contextlib
import math
import threading

import grpc

from meshnet.engine.base import Capabilities
from meshnet.wire.call_problems import abort_call
from meshnet.wire.envelope import MAX_FRAME_BYTES
from meshnet.wire.read_deadlines import ReadDeadlines
from meshnet.wire.request_budget import RETRY_AFTER_S

# Seconds a StepStream's next frame (or its end) may take before the call is cancelled.
STREAM_READ_S = 30.0


class StepStreamReads:
    """The StepStreams reading their frames now (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reading = 0
        self._deadlines = ReadDeadlines("step-stream-deadlines")

    @contextlib.contextmanager
    def reading(self, request_iterator, context, limit: int):
        """Yield the call's frames, each due within :data:`STREAM_READ_S` (the call is cancelled past
        it), while the call holds one of ``limit`` places; aborts the call with RESOURCE_EXHAUSTED (and
        a retry-after) when ``limit`` streams read already."""
        with self._lock:
            full = self._reading >= limit
            self._reading += 0 if full else 1
        if full:
            abort_call(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{limit} StepStreams are sending their frames already (the node's limit); try again "
                       f"later", RETRY_AFTER_S)
        try:
            yield self._deadlines.watch(request_iterator, context, STREAM_READ_S)
        finally:
            with self._lock:
                self._reading -= 1


def unary_output_problem(caps: Capabilities, n_tokens: int) -> str | None:
    """Why a unary Step of ``n_tokens`` tokens cannot carry its output (f32 hidden states ``[n_tokens,
    *hidden_row_shape]`` over one frame of :data:`MAX_FRAME_BYTES`), or None (a tail answers a token)."""
    if caps.is_tail:
        return None
    n_frames = -(-n_tokens * 4 * math.prod(caps.hidden_row_shape) // MAX_FRAME_BYTES)
    if n_frames <= 1:
        return None
    return f"the step's output needs {n_frames} frames; send it with StepStream"
