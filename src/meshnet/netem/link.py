"""The link model, pure: what one emulated network link does to the bytes that cross it.

No sockets and no clocks here: every method takes ``now`` (seconds, any monotonic origin) and says when
bytes are due, so the model is tested with plain numbers and driven by the asyncio proxy in
:mod:`meshnet.netem.proxy`.

A link joins two hosts and has one :class:`LinkSpec` for both directions (full duplex: each direction
has its own :class:`TokenBucket`, shared by every connection that crosses the link that way). A
connection gets one :class:`Pipe` per direction: a FIFO of chunks that leave when the direction's bucket
allows (bandwidth) and arrive ``delay_s`` later (latency). A blackholed link passes nothing: chunks sent
meanwhile, and those still in flight when it went dark, are held and leave when it heals, as TCP's
retransmissions would deliver them (the model does not reproduce retransmission backoff: held bytes
leave the moment the link heals).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    """What a link does. ``delay_s``: one-way latency, seconds (an RTT is twice it); ``rate_bps``:
    bandwidth cap per direction, bytes per second (None: unlimited); ``burst_bytes``: what the bucket
    holds when idle (None: 10 ms at ``rate_bps``, at least 16 KiB); ``blackhole``: pass nothing.

    Raises ValueError for a negative delay or a non-positive rate or burst."""

    delay_s: float = 0.0
    rate_bps: float | None = None
    burst_bytes: int | None = None
    blackhole: bool = False

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, not {self.delay_s}")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be > 0 or None, not {self.rate_bps}")
        if self.burst_bytes is not None and self.burst_bytes <= 0:
            raise ValueError(f"burst_bytes must be > 0 or None, not {self.burst_bytes}")

    @property
    def burst(self) -> float:
        """Bucket depth in bytes (meaningful only with a rate)."""
        if self.burst_bytes is not None:
            return float(self.burst_bytes)
        return max(16 * 1024.0, (self.rate_bps or 0.0) * 0.010)


class TokenBucket:
    """Bandwidth as a token bucket of ``rate`` bytes/s holding at most ``burst`` bytes.

    :meth:`reserve` hands out departure times in call order, so the bytes of one direction leave in
    the order they were offered; a chunk larger than the bucket leaves once the bucket has refilled
    as far as it can and the rest has accrued (it runs the bucket into debt, never waits forever)."""

    def __init__(self, rate: float | None, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._tokens, self._t = burst, float("-inf")

    def reserve(self, nbytes: int, now: float) -> float:
        """When ``nbytes`` may leave (seconds, >= ``now``), taking them from the bucket."""
        if self.rate is None:
            return now
        t0 = max(now, self._t)
        avail = self.burst if self._t == float("-inf") else min(self.burst, self._tokens + self.rate * (t0 - self._t))
        depart = t0 + max(0.0, nbytes - avail) / self.rate
        self._tokens = avail + self.rate * (depart - t0) - nbytes
        self._t = depart
        return depart


class Pipe:
    """One direction of one connection across a link: a FIFO of chunks (``bytes``; ``b""`` stands for
    the sender's end of stream and travels like data).

    ``send`` queues a chunk; ``pop_due`` returns those that have arrived by ``now``; ``next_due`` says
    when the next one will (None: nothing is on its way, or the link is dark)."""

    def __init__(self, link: "Link", forward: bool) -> None:
        self.link, self.forward = link, forward
        self._held: deque[bytes] = deque()  # offered while the link is dark, not yet scheduled
        self._flight: deque[tuple[float, bytes]] = deque()  # (arrival time, chunk), arrivals non-decreasing
        self._last_arrival = float("-inf")
        self.queued_bytes = 0  # offered and not yet delivered (for the sender's backpressure)
        self.delivered_bytes = 0

    def send(self, chunk: bytes, now: float) -> None:
        self.queued_bytes += len(chunk)
        if self.link.spec.blackhole:
            self._held.append(chunk)
        else:
            self._schedule(chunk, now)

    def _schedule(self, chunk: bytes, now: float) -> None:
        depart = self.link.bucket(self.forward).reserve(len(chunk), now)
        # A delay lowered mid-stream must not let later bytes overtake earlier ones.
        arrival = max(depart + self.link.spec.delay_s, self._last_arrival)
        self._last_arrival = arrival
        self._flight.append((arrival, chunk))

    def next_due(self) -> float | None:
        """Arrival time of the next chunk, or None when none is on its way."""
        return self._flight[0][0] if self._flight else None

    def pop_due(self, now: float) -> list[bytes]:
        """The chunks that have arrived by ``now``, in order."""
        out = []
        while self._flight and self._flight[0][0] <= now:
            chunk = self._flight.popleft()[1]
            self.queued_bytes -= len(chunk)
            self.delivered_bytes += len(chunk)
            self.link.delivered[0 if self.forward else 1] += len(chunk)
            out.append(chunk)
        return out

    def darken(self) -> None:
        """The link went dark: what is in flight is held again, ahead of what was held already."""
        self._held.extendleft(chunk for _, chunk in reversed(self._flight))
        self._flight.clear()
        self._last_arrival = float("-inf")

    def heal(self, now: float) -> None:
        """The link is back: held chunks leave from ``now`` on, in order, through the bucket."""
        while self._held:
            self._schedule(self._held.popleft(), now)


class Link:
    """A link between hosts ``a`` and ``b`` (the direction a -> b is "forward") and the pipes of the
    connections that cross it."""

    def __init__(self, a: str, b: str, spec: LinkSpec = LinkSpec()) -> None:
        self.a, self.b = a, b
        self.spec = spec
        self._buckets = (TokenBucket(spec.rate_bps, spec.burst), TokenBucket(spec.rate_bps, spec.burst))
        self._pipes: list[Pipe] = []
        self.delivered = [0, 0]  # bytes delivered a -> b and b -> a over the link's life

    def bucket(self, forward: bool) -> TokenBucket:
        return self._buckets[0 if forward else 1]

    def pipe(self, forward: bool) -> Pipe:
        """A new pipe for one direction of a connection across this link (forward: from ``a`` to ``b``)."""
        p = Pipe(self, forward)
        self._pipes.append(p)
        return p

    def drop(self, pipe: Pipe) -> None:
        """Forget a closed connection's pipe."""
        if pipe in self._pipes:
            self._pipes.remove(pipe)

    def update(self, spec: LinkSpec, now: float) -> None:
        """Change what the link does from ``now`` on. Going dark holds what is in flight; healing sends
        what was held. A new rate or burst starts with a full bucket."""
        was_dark, old = self.spec.blackhole, self.spec
        self.spec = spec
        if (spec.rate_bps, spec.burst) != (old.rate_bps, old.burst):
            self._buckets = (TokenBucket(spec.rate_bps, spec.burst), TokenBucket(spec.rate_bps, spec.burst))
        for p in self._pipes:
            if spec.blackhole and not was_dark:
                p.darken()
            elif was_dark and not spec.blackhole:
                p.heal(now)

    @property
    def pipes(self) -> tuple[Pipe, ...]:
        """The pipes of the connections open across the link."""
        return tuple(self._pipes)

    @property
    def open_connections(self) -> int:
        return len(self._pipes) // 2
