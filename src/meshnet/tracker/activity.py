"""What clients report of their work, kept by the tracker for its dashboard: the sessions open now and
the routes they run on, tokens per second, and time to first token.

Clients (``meshnet api``, ``meshnet generate``: :class:`meshnet.client.activity.ActivityReporter`) send an
:class:`pb.ActivityReport` about once a second while they have sessions open. A report replaces the
client's previous list of sessions; a client silent for :data:`CLIENT_TTL_S` is forgotten (its sessions
with it). Tokens are counted into one-second buckets by when their report arrived, so the rate has the
reports' granularity (about a second). Display only: nothing here is used for routing or credit.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable

from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.addresses import MAX_ADDRESS_CHARS

# A client that has not reported for this long has gone (it reports every second while it works).
CLIENT_TTL_S = 10.0
# Seconds of tokens/s and TTFT history kept (the dashboard's charts span this).
HISTORY_S = 120
# The current tokens/s is the mean over this many whole seconds (a client reports once a second, so a
# shorter window would flicker between 0 and twice the rate).
RATE_WINDOW_S = 3
MAX_CLIENTS = 1024
MAX_SESSIONS_PER_REPORT = 4096
MAX_TTFT_PER_REPORT = 4096
MAX_ID_CHARS = 256
MAX_HOPS = 256
# TTFTs kept for the chart, newest last: without a bound one client reporting many times a second could
# grow the history (and every /api/state) without limit within HISTORY_S.
MAX_TTFT_HISTORY = 10_000
# Bytes (serialized) of one report, and of all clients' latest reports together: the counts above allow
# a report of megabytes, and 40 clients' reports of 12 MB grew the tracker by 700 MB (and each
# /api/state to 565 MB). A client with 1000 sessions on 3-hop routes reports about 250 KB.
MAX_REPORT_BYTES = 1 << 20
MAX_BOARD_BYTES = 16 << 20


def check_report(report: pb.ActivityReport) -> str | None:
    """None when ``report`` can be recorded, else a message naming what is wrong with it."""
    if not report.client_id.strip():
        return "client_id is empty"
    if (size := report.ByteSize()) > MAX_REPORT_BYTES:
        return f"the report has {size} bytes (at most {MAX_REPORT_BYTES})"
    if len(report.client_id) > MAX_ID_CHARS:
        return f"client_id has {len(report.client_id)} characters (at most {MAX_ID_CHARS})"
    if len(report.sessions) > MAX_SESSIONS_PER_REPORT:
        return f"{len(report.sessions)} sessions in one report (at most {MAX_SESSIONS_PER_REPORT})"
    if len(report.ttft_s) > MAX_TTFT_PER_REPORT:
        return f"{len(report.ttft_s)} ttft_s values in one report (at most {MAX_TTFT_PER_REPORT})"
    bad = next((t for t in report.ttft_s if not (t >= 0 and math.isfinite(t))), None)
    if bad is not None:
        return f"ttft_s holds {bad}; expected finite seconds >= 0"
    for s in report.sessions:
        if not s.session_id or len(s.session_id) > MAX_ID_CHARS:
            return f"a session id is empty or over {MAX_ID_CHARS} characters"
        if not (s.age_s >= 0 and math.isfinite(s.age_s)):
            return f"session {s.session_id!r} has age_s={s.age_s}; expected finite seconds >= 0"
        if len(s.hops) > MAX_HOPS:
            return f"session {s.session_id!r} has {len(s.hops)} hops (at most {MAX_HOPS})"
        if any(len(h.node_id) > MAX_ID_CHARS or len(h.address) > MAX_ADDRESS_CHARS for h in s.hops):
            return (f"session {s.session_id!r} has a hop whose node_id is over {MAX_ID_CHARS} characters or "
                    f"address over {MAX_ADDRESS_CHARS}")
    return None


class ActivityBoard:
    """The clients' latest reports and the token and TTFT history (thread-safe).

    Args:
        clock: Unix seconds (the dashboard's charts are in wall-clock time); tests pass a fake one.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[float, pb.ActivityReport]] = {}  # id -> (time heard, last report)
        self._bytes = 0  # of the reports in _clients (see MAX_BOARD_BYTES)
        self._buckets: deque[list] = deque()  # [whole second, tokens], oldest first
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_TTFT_HISTORY)  # (time, seconds), oldest first

    def record(self, report: pb.ActivityReport) -> None:
        """Take ``report`` (checked with :func:`check_report` first). Raises ValueError naming the problem."""
        problem = check_report(report)
        if problem:
            raise ValueError(problem)
        with self._lock:
            now = self._clock()
            self._expire(now)
            previous = self._forget(report.client_id)
            # Cumulative counts: a client that restarted (its count went down) starts again from 0.
            before = previous[1].generated_tokens if previous else 0
            new = report.generated_tokens - before if report.generated_tokens >= before else report.generated_tokens
            size = report.ByteSize()
            while self._clients and (len(self._clients) >= MAX_CLIENTS or self._bytes + size > MAX_BOARD_BYTES):
                self._forget(next(iter(self._clients)))  # the longest silent
            self._clients[report.client_id] = (now, report)
            self._bytes += size
            if new:
                second = math.floor(now)
                if self._buckets and self._buckets[-1][0] == second:
                    self._buckets[-1][1] += new
                else:
                    self._buckets.append([second, new])
            self._ttft.extend((now, t) for t in report.ttft_s)

    def snapshot(self) -> dict:
        """Plain data for the dashboard, times in Unix seconds::

            {"sessions": [{"client_id", "session_id", "epoch", "tokens", "age_s",
                           "route": [{"node_id", "address", "layers": [start, end], "relayed"}]}],
             "clients": [{"client_id", "version", "sessions", "generated_tokens", "last_report_age_s"}],
             "tokens_per_s": float, "tokens_series": [[second, tokens], ...],
             "ttft_series": [[time, seconds], ...]}

        ``tokens_per_s`` is the mean of the last :data:`RATE_WINDOW_S` whole seconds; ``tokens_series``
        has one point per second of the last :data:`HISTORY_S` (zeros included).
        """
        with self._lock:
            now = self._clock()
            self._expire(now)
            clients = sorted(self._clients.items())
            buckets = {int(s): n for s, n in self._buckets}
            ttft = [[round(t, 3), round(v, 6)] for t, v in self._ttft]
        sessions = [{"client_id": cid, "session_id": s.session_id, "epoch": s.epoch, "tokens": s.tokens,
                     "age_s": round(s.age_s + (now - heard), 3),
                     "route": [{"node_id": h.node_id, "address": h.address,
                                "layers": [h.layers.start, h.layers.end], "relayed": h.relayed} for h in s.hops]}
                    for cid, (heard, r) in clients for s in r.sessions]
        this_second = math.floor(now)
        series = [[s, buckets.get(s, 0)] for s in range(this_second - HISTORY_S + 1, this_second + 1)]
        # Whole seconds only: the current one is still filling.
        recent = sum(n for s, n in series[-RATE_WINDOW_S - 1:-1])
        return {"sessions": sessions,
                "clients": [{"client_id": cid, "version": r.version, "sessions": len(r.sessions),
                             "generated_tokens": r.generated_tokens, "last_report_age_s": round(now - heard, 3)}
                            for cid, (heard, r) in clients],
                "tokens_per_s": recent / RATE_WINDOW_S, "tokens_series": series, "ttft_series": ttft}

    def _expire(self, now: float) -> None:
        """Forget silent clients and history older than :data:`HISTORY_S` (lock held)."""
        for cid in [c for c, (heard, _) in self._clients.items() if now - heard > CLIENT_TTL_S]:
            self._forget(cid)
        while self._buckets and self._buckets[0][0] <= now - HISTORY_S:
            self._buckets.popleft()
        while self._ttft and self._ttft[0][0] <= now - HISTORY_S:
            self._ttft.popleft()

    def _forget(self, client_id: str) -> tuple[float, pb.ActivityReport] | None:
        """Drop ``client_id``'s report (lock held); returns it (time heard, report), or None."""
        dropped = self._clients.pop(client_id, None)
        if dropped is not None:
            self._bytes -= dropped[1].ByteSize()
        return dropped
