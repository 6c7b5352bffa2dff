"""A client's activity, reported to the tracker for its dashboard: the sessions it has open and their
routes, the tokens it has received, and each session's time to first token.

The tracker cannot see these itself (a route request carries no session; only the client sees when a
token arrives). :class:`ActivityReporter` sends a :class:`pb.ActivityReport` from a background thread
about once a second while sessions are open, and once more soon after the last one ends. Reports are
display only: one that fails is dropped (the next carries the same open sessions and the cumulative
token count; only the TTFT samples of a failed report are kept and resent).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Callable

import grpc

from meshnet import __version__
from meshnet.proto import meshnet_pb2 as pb

log = logging.getLogger("meshnet.client")

MAX_PENDING_TTFT = 1024  # first-token samples kept while the tracker does not answer


def session_label(session_id: str) -> str:
    """A session's name in activity reports and on the dashboard: 16 hex digits of its id's SHA-256. The id
    itself is a bearer secret: whoever knows it can cancel, release or fence the session on its nodes, and
    the dashboard answers anyone who reaches it."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:16]


def hop_message(stage) -> pb.Hop:
    """The :class:`pb.Hop` of a route's stage (a :class:`~meshnet.client.remote.RemoteStage`), as the
    tracker handed it out: id, address, layer range (0:0 when unknown) and whether it is relayed."""
    start, end = stage.layers or (0, 0)
    return pb.Hop(node_id=stage.node_id, address=stage.address, layers=pb.LayerRange(start=start, end=end),
                  relayed=stage.address.startswith("relay:"))


class _Session:
    __slots__ = ("opened", "high", "tokens")

    def __init__(self, opened: float) -> None:
        self.opened, self.high, self.tokens = opened, -1, 0


class ActivityReporter:
    """Counts a client's tokens and first-token times and reports them with its open sessions
    (thread-safe).

    Args:
        tracker: a TrackerStub.
        client_id: the client's id (the same the ledger charges).
        model_sha256: the model routed for ("" = not known).
        routes: returns ``{session_id: (epoch, stages)}`` for every session open now (``stages`` objects
            with ``node_id``, ``address`` and ``layers``).
        interval_s: seconds between reports while sessions are open.
    """

    def __init__(self, tracker, client_id: str, model_sha256: str, routes: Callable[[], dict],
                 interval_s: float = 1.0, timeout_s: float = 2.0) -> None:
        self.tracker, self.client_id, self.model_sha256 = tracker, client_id, model_sha256
        self._routes, self.interval_s, self.timeout_s = routes, interval_s, timeout_s
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._ttft: list[float] = []
        self._generated = 0
        self._wake = threading.Event()
        self._closed = False
        self._dirty = False  # something to tell since the last report (a session opened, ended, a token)
        self._thread: threading.Thread | None = None
        self.disabled = False  # the tracker does not know ReportActivity (an older version)

    def opened(self, session_id: str) -> None:
        """A session's first step is about to run (its time to first token counts from now)."""
        with self._lock:
            self._sessions.setdefault(session_id, _Session(time.monotonic()))
            self._dirty = True
            if self._thread is None and not self._closed and not self.disabled:
                self._thread = threading.Thread(target=self._loop, name="meshnet-activity", daemon=True)
                self._thread.start()
        self._wake.set()  # the dashboard shows a session as it opens, not a second later

    def delivered(self, session_id: str, position: int) -> None:
        """The token for ``position`` of ``session_id`` arrived (and every one before it: a verification
        step's accepted drafts). The session's first token also gives its time to first token."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or position <= s.high:
                return  # not opened here, or a replayed position
            new = 1 if s.high < 0 else position - s.high
            if s.high < 0 and len(self._ttft) < MAX_PENDING_TTFT:
                self._ttft.append(time.monotonic() - s.opened)
            s.high, s.tokens = position, s.tokens + new
            self._generated += new
            self._dirty = True

    def ended(self, session_id: str) -> None:
        """The session is over: report soon, without it."""
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                return
            self._dirty = True
        self._wake.set()

    def report(self) -> bool:
        """Send one report now. Returns False when the tracker did not take it."""
        routes = self._routes()
        with self._lock:
            now = time.monotonic()
            ttft, self._dirty = list(self._ttft), False
            sessions = [pb.SessionActivity(session_id=session_label(sid), epoch=epoch, hops=[hop_message(h) for h in hops],
                                           tokens=s.tokens, age_s=now - s.opened)
                        for sid, (epoch, hops) in routes.items()
                        if (s := self._sessions.get(sid)) is not None]
            report = pb.ActivityReport(client_id=self.client_id, model_sha256=self.model_sha256, sessions=sessions,
                                       generated_tokens=self._generated, ttft_s=ttft, version=__version__)
        try:
            self.tracker.ReportActivity(report, timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                self.disabled = True  # an older tracker: it has no dashboard to feed
            log.debug("activity report failed: %s", e.code().name)
            with self._lock:
                self._dirty = True
            return False
        with self._lock:
            del self._ttft[:len(ttft)]
        return True

    def close(self) -> None:
        """Stop the background thread after a last report of what changed."""
        self._closed = True
        self._wake.set()
        with self._lock:
            dirty = self._dirty and self._thread is not None
        if dirty and not self.disabled:
            self.report()

    def _loop(self) -> None:
        while not self._closed and not self.disabled:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            with self._lock:
                due = self._dirty or bool(self._sessions)
            if due and not self._closed:
                self.report()
