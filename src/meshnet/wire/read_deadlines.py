"""Read deadlines of gRPC calls: a call whose client stops sending is cancelled, and its worker freed.

gRPC's server threads each serve one call for as long as it lasts; a client that opens a stream and goes
quiet holds its thread without end (a call's own deadline is the client's to set). Servers here give each
stream a deadline for what it must send next and cancel it when that passes, with one thread checking
every call's deadline (not a timer per call), started while any is pending: the tracker's relay calls and
the node's StepStreams. The raw-TCP data plane has socket read timeouts for the same purpose.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

# How often the pending deadlines are checked, seconds: a late call is cancelled at most this late.
WATCH_TICK_S = 0.25


class ReadDeadlines:
    """The calls waiting for their client's next message, each with a deadline (thread-safe).

    Args:
        name: the checking thread's name (what it watches, for a stack dump).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._deadlines: dict[int, tuple[float, object]] = {}  # id(context) -> (deadline, context)
        self._lock = threading.Lock()
        self._watching = False  # a checking thread runs (while any deadline is pending)

    def expect(self, context, within_s: float) -> None:
        """The call of gRPC ``context`` must send its next message within ``within_s`` seconds, or be
        cancelled (a later :meth:`expect` or :meth:`arrived` replaces this deadline)."""
        with self._lock:
            self._deadlines[id(context)] = (time.monotonic() + within_s, context)
            start, self._watching = not self._watching, True
        if start:
            threading.Thread(target=self._cancel_late, daemon=True, name=self.name).start()

    def arrived(self, context) -> None:
        """What the call of ``context`` had to send has come: it has no deadline now."""
        with self._lock:
            self._deadlines.pop(id(context), None)

    def watch(self, messages: Iterable[T], context, within_s: float) -> Iterator[T]:
        """``messages`` (a streaming call's request iterator), each, and the stream's end, due within
        ``within_s`` seconds of the one before (the first of the call's start)."""
        try:
            self.expect(context, within_s)
            for m in messages:
                yield m
                self.expect(context, within_s)
        finally:
            self.arrived(context)

    def _cancel_late(self) -> None:
        """Cancel the calls past their deadline, every :data:`WATCH_TICK_S`, until none is pending."""
        while True:
            time.sleep(WATCH_TICK_S)
            now = time.monotonic()
            with self._lock:
                late = [(key, ctx) for key, (deadline, ctx) in self._deadlines.items() if deadline < now]
                for key, _ in late:
                    del self._deadlines[key]
                done = not self._deadlines
                if done:
                    self._watching = False
            for _, ctx in late:
                ctx.cancel()
            if done:
                return
