"""Step deadlines that tell a hung node from a slow one.

A fixed step timeout has to allow for the slowest legitimate step (a long prefill on a loaded CPU), so
a node that stops answering (SIGSTOP, a frozen VM, a dead link that still holds the TCP connection)
costs that whole timeout before failover. Instead each hop gets a deadline from what the client has
measured there: ``max(floor, factor x expected)``, where ``expected`` is the hop's recent time for this
kind of step scaled to the work in it (a prefill of N tokens costs N times the per-token prefill time)
plus the work this client already has in flight on the same hop (a node runs one step at a time, so a
step queued behind another session's waits for it). A node ``factor / 2`` times slower than measured
still finishes well inside its deadline: it is slow, not hung. Before a hop has been measured at all
(its first steps may include one-off setup, and take any time) the deadline is a few seconds, after
which its Health is asked: a step past its deadline is not given up at once: the stage probes the node's
Health (``RemoteStage.answers``), and a node that answers is busy (another client's long prefill ahead
of this step, or its own first graphs), so the step is waited for on, a deadline at a time, up to the
ceiling; only a node that answers nothing is failed over. (With the ceiling as an unmeasured hop's
deadline, a node hung in a client's first step with it held the step for the whole ceiling, 60 s, with a
spare ready.) A verification step of speculative decoding (a decode of several rows) is expected to
cost at most a decode step a row.

The work in flight lengthens how long a step is waited for, not how long a dead node goes unnoticed:
Health is asked every ``probe_s`` seconds (or the deadline, if shorter) from the step's start. Steps
batched behind a long prefill get the ceiling as their deadline: were Health first asked only then, a
node killed meanwhile would go unnoticed that long, each of its sessions waiting on the healthy tail.

Pure bookkeeping: no clocks or I/O here; callers pass the measured durations in.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DeadlinePolicy:
    """How step deadlines are derived; all times in seconds.

    Attributes:
        floor_s: no deadline is shorter (covers jitter, GC pauses and scheduling on a shared CPU).
        factor: deadline = factor x the expected duration; 10 leaves a node 5x slower than measured a
            2x margin.
        ceiling_s: no deadline is longer.
        smoothing: weight of the newest measurement in the running average (0 < smoothing <= 1).
        unmeasured_s: the deadline of a step on a hop not yet measured (then within floor and ceiling),
            where the wait past it asks the node's Health; where it cannot (a relayed node, a gRPC
            stream), such a step gets the ceiling.
        probe_s: a step waited on this long, or its deadline if shorter, asks its hops' Health, and
            again as often while it waits: a dead hop is found within about this long whatever work
            runs ahead of the step, while hops that all answer keep it waited for (up to the stage's
            timeout). Only where the wait asks Health at all (see ``unmeasured_s``).
    """

    floor_s: float = 1.5
    factor: float = 10.0
    ceiling_s: float = 60.0
    smoothing: float = 0.3
    unmeasured_s: float = 5.0
    probe_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError(f"need 0 < floor_s <= ceiling_s, got {self.floor_s} and {self.ceiling_s}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if not self.unmeasured_s > 0:
            raise ValueError(f"unmeasured_s must be > 0, got {self.unmeasured_s}")
        if not self.probe_s > 0:
            raise ValueError(f"probe_s must be > 0, got {self.probe_s}")


class HopClock:
    """One hop's measured step times and the steps this client has in flight there (thread-safe).

    Use: ``ticket, deadline_s = clock.begin(decode, n_tokens)``, run the step with that timeout, then
    ``clock.end(ticket, elapsed_s)`` when it answered or ``clock.end(ticket)`` when it did not.
    """

    def __init__(self, policy: DeadlinePolicy) -> None:
        self.policy = policy
        self.decode_s: float | None = None  # running average of a decode step, seconds
        self.prefill_token_s: float | None = None  # running average of prefill seconds per token
        self.prefill_step_s: float | None = None  # running average of a whole prefill step, seconds
        self._in_flight: dict[int, tuple[bool, int]] = {}
        self._next = 0
        self._lock = threading.Lock()

    def expected_s(self, decode: bool, n_tokens: int) -> float | None:
        """Expected duration in seconds of one step of ``n_tokens`` tokens; None before any measurement.

        A decode step not yet measured is bounded by a whole prefill (one token is less work than
        several); a prefill not yet measured by ``n_tokens`` decode steps (batching only helps); a
        verification step (a decode of ``n_tokens`` rows) by a decode step a row."""
        if decode:
            if n_tokens > 1 and self.decode_s is not None:
                return self.decode_s * n_tokens
            return self.decode_s if self.decode_s is not None else self.prefill_step_s
        if self.prefill_token_s is not None:
            return self.prefill_token_s * n_tokens
        return None if self.decode_s is None else self.decode_s * n_tokens

    def deadline_s(self, decode: bool, n_tokens: int, asks_health: bool = True) -> float:
        """The timeout in seconds for a step of ``n_tokens`` tokens started now, counting the work
        already in flight on this hop; ``asks_health``: the wait past it asks the node's Health (else the
        deadline is final, and an unmeasured hop's is the ceiling)."""
        p = self.policy
        with self._lock:
            queued = list(self._in_flight.values())
            mine = self.expected_s(decode, n_tokens)
            ahead = [self.expected_s(d, n) for d, n in queued]
        if mine is None or any(e is None for e in ahead):
            return min(p.ceiling_s, max(p.floor_s, p.unmeasured_s)) if asks_health else p.ceiling_s
        return min(p.ceiling_s, max(p.floor_s, p.factor * (mine + sum(ahead))))

    def begin(self, decode: bool, n_tokens: int, asks_health: bool = True) -> tuple[int, float]:
        """Register a step about to be sent; returns (ticket for :meth:`end`, deadline in seconds; see
        :meth:`deadline_s`)."""
        deadline = self.deadline_s(decode, n_tokens, asks_health)
        with self._lock:
            ticket = self._next
            self._next += 1
            self._in_flight[ticket] = (decode, max(1, n_tokens))
        return ticket, deadline

    def end(self, ticket: int, elapsed_s: float | None = None) -> None:
        """The step of ``ticket`` finished; ``elapsed_s`` is its duration when the hop answered (None
        when it failed: a failed step says nothing about the hop's speed)."""
        with self._lock:
            decode, n = self._in_flight.pop(ticket, (True, 1))
            if elapsed_s is None:
                return
            a = self.policy.smoothing
            if decode and n > 1:
                return  # a verification step: its rows say little of one decode step's time
            if decode:
                self.decode_s = _blend(self.decode_s, elapsed_s, a)
            else:
                self.prefill_token_s = _blend(self.prefill_token_s, elapsed_s / n, a)
                self.prefill_step_s = _blend(self.prefill_step_s, elapsed_s, a)


def _blend(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class HopClocks:
    """A :class:`HopClock` per node id, shared by every route and session of one client."""

    def __init__(self, policy: DeadlinePolicy) -> None:
        self.policy = policy
        self._clocks: dict[str, HopClock] = {}
        self._lock = threading.Lock()

    def __getitem__(self, node_id: str) -> HopClock:
        with self._lock:
            clock = self._clocks.get(node_id)
            if clock is None:
                clock = self._clocks[node_id] = HopClock(self.policy)
            return clock

    def timed_step(self, hop, req, decode: bool):
        """``hop.step(req, decode, timeout_s)`` (a :class:`~meshnet.client.remote.RemoteStage`)
        within the hop's step deadline, its Health asked every stage ``probe_s`` past that; the time it
        took, when answered, goes to the hop's clock. Returns its StepResult; raises StageFailure."""
        clock = self[hop.node_id]
        asks = getattr(hop, "asks_health", None)
        ticket, timeout_s = clock.begin(decode, len(req.token_ids), asks(decode) if asks is not None else True)
        t0, elapsed = time.monotonic(), None
        try:
            result = hop.step(req, decode, timeout_s)
            if result.ok:
                elapsed = time.monotonic() - t0
        finally:
            clock.end(ticket, elapsed)
        return result
