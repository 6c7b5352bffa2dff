"""Bytes of step requests a node holds while they are still arriving, over all its connections.

A request is buffered whole before its step runs, and each one is bounded (``MAX_REQUEST_BYTES``), but many
connections each sending most of a request slowly held that much each: 6 data-plane connections that sent
31 frames of 8 MiB and then a byte every 20 s grew a node by 1.5 GB for as long as they kept at it, and a
gRPC StepStream had no bound at all (+2.6 GB in 9 s). The data plane and gRPC of one node share one
:class:`RequestBudget`; a request that would pass it is refused RESOURCE_EXHAUSTED with a retry-after.
"""

from __future__ import annotations

import threading

# Requests still arriving that a node buffers at once, bytes: four of the largest (a 16k-token prefill
# of a 4096-wide model's hidden states, 256 MiB).
MAX_BUFFERED_BYTES = 1 << 30
# Seconds after which a refused sender may try again: requests finish arriving within seconds.
RETRY_AFTER_S = 1.0


class RequestBudget:
    """The bytes of incomplete requests a node may hold (thread-safe: the data plane's selector thread and
    gRPC's threads share it)."""

    def __init__(self, max_bytes: int = MAX_BUFFERED_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes; False (holding nothing more) when that would pass ``max_bytes``."""
        with self._lock:
            if self._held + n > self.max_bytes:
                return False
            self._held += n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self._held -= n

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def refusal(self) -> str:
        """What a refused sender is told."""
        return (f"the node holds {self.held} bytes of step requests still arriving, near its limit of "
                f"{self.max_bytes}; try again shortly")


class RequestRefused(Exception):
    """A request refused while it arrived: ``code`` (a gRPC status name), ``message``, ``retry_after_s``."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


def read_request(frames, budget: RequestBudget, max_request_bytes: int, frame_charge: int = 0,
                 keep: bool = False) -> tuple[list, int]:
    """All of a streamed request's frames (``pb.Envelope`` s, e.g. a gRPC StepStream's) and the bytes they
    held against ``budget`` while they arrived (each frame counting ``frame_charge`` at least, as on the data
    plane), given back once read, or with ``keep`` by the caller (``budget.give_back(held)``) once done with
    them; a refused request's are always given back.

    Raises:
        RequestRefused: INVALID_ARGUMENT past ``max_request_bytes``, RESOURCE_EXHAUSTED (with a retry-after)
            past the budget.
    """
    out: list = []
    held = 0
    try:
        for frame in frames:
            n = max(frame.ByteSize(), frame_charge)
            if held + n > max_request_bytes:
                least = f" (each frame counting at least {frame_charge})" if frame_charge else ""
                raise RequestRefused("INVALID_ARGUMENT", f"the request reaches {held + n} bytes{least}, over the "
                                     f"limit of {max_request_bytes} bytes a request")
            if not budget.take(n):
                raise RequestRefused("RESOURCE_EXHAUSTED", budget.refusal(), RETRY_AFTER_S)
            held += n
            out.append(frame)
    except BaseException:
        budget.give_back(held)
        raise
    if not keep:
        budget.give_back(held)
    return out, held
