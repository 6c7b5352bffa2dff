"""The decode speed a node reports for routing, kept up to date while it is idle.

The tracker ranks replicas of a range by the speed each reports (:func:`meshnet.tracker.routing.hop_cost`).
A node measures it once at start-up (:func:`meshnet.node.engine_loader.measure_decode_speed`), and a
measurement taken while the machine was busy (a node joining a mesh under load, beside a busy replica)
stayed low for good: the node was then passed over for every session, so nothing showed it otherwise. It
is now measured again every ``every_s`` seconds while the node holds no session, and the best of the
last ``keep`` measurements is reported (contention only ever slows a measurement down).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("meshnet.node")

REPROBE_EVERY_S = 60.0  # between measurements while idle
KEEP_PROBES = 5  # the best of this many recent measurements is reported


class IdleSpeed:
    """Decode tokens/s for the heartbeat: the best recent probe, probed again while idle.

    Args:
        first: the start-up measurement, tokens/s (0: it failed).
        probe: measures tokens/s (blocking, a fraction of a second; 0 when it failed).
        every_s: seconds between probes, counted from the last one's start.
        keep: how many recent measurements the reported best is taken from.
        clock: monotonic seconds.
        start: runs a probe off the caller's thread (the heartbeat's, which must not wait on it: on a busy
            machine a probe can outlast the tracker's patience); tests run it inline.
    """

    def __init__(self, first: float, probe: Callable[[], float], every_s: float = REPROBE_EVERY_S,
                 keep: int = KEEP_PROBES, clock: Callable[[], float] = time.monotonic,
                 start: Callable[[Callable[[], None]], None] | None = None) -> None:
        self._probe, self.every_s, self._clock = probe, every_s, clock
        self._start = start or (lambda f: threading.Thread(target=f, name="speed-probe", daemon=True).start())
        self._recent: collections.deque[float] = collections.deque([first] if first > 0 else [], maxlen=keep)
        self._last = clock()
        self._running = False
        self._lock = threading.Lock()

    @property
    def tokens_per_s(self) -> float:
        """The best recent measurement (0: none succeeded)."""
        with self._lock:
            return max(self._recent, default=0.0)

    def report(self, active_sessions: int) -> float:
        """The speed to report now; starts a probe when the node is idle and one is due."""
        with self._lock:
            due = (active_sessions == 0 and not self._running and self._clock() - self._last >= self.every_s)
            if due:
                self._running, self._last = True, self._clock()
        if due:
            self._start(self._measure)
        return self.tokens_per_s

    def _measure(self) -> None:
        try:
            speed = self._probe()
        except Exception as e:  # noqa: BLE001 - a failed probe (its engine worker restarting) keeps the last figures
            log.info("decode speed probe failed: %s", e)
            speed = 0.0
        with self._lock:
            if speed > 0:
                self._recent.append(speed)
            self._running = False
