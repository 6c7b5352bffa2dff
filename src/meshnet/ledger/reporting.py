"""Reporting to the ledger: nodes report the steps they completed, clients the tokens they received.

Both sides keep what the tracker has not acknowledged and send it again later, so a tracker outage or
restart loses nothing; the tracker keys every record (a step by model, session, layer range, position
and token count; a token by client, session and position), so sending twice never counts twice.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
import weakref
from collections import deque

import grpc

from meshnet.contract import LayerRange, StepRequest
from meshnet.proto import meshnet_pb2 as pb

log = logging.getLogger("meshnet.ledger")

# Records kept while the tracker is unreachable; past this the oldest are dropped (with a warning), so
# a node cut off for days does not grow without bound. ~100 bytes each.
MAX_PENDING = 200_000
BATCH = 2048  # records per report: a few tens of KB, far below gRPC's message limit
# How long a client's delivery reporter keeps trying at its close (the process's exit) while the tracker
# does not answer, seconds: a tracker restarted on the same machine is back within it.
CLOSE_WAIT_S = 5.0
# Report failures that asking again may cure: the tracker (or its ledger database) does not answer yet.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class WorkReporter:
    """A node's completed steps, waiting to be reported (thread-safe).

    Args:
        node_id: the reporting node.
        model_sha256: the model it serves.
        layers: its layer range.
        sign: signs a :class:`pb.WorkReport` in place (the node's identity); None sends it unsigned.
        max_pending: records kept at most while unacknowledged.
    """

    def __init__(self, node_id: str, model_sha256: str, layers: LayerRange, sign=None,
                 max_pending: int = MAX_PENDING) -> None:
        self.node_id, self.model_sha256, self.layers = node_id, model_sha256, layers
        self._sign = sign
        self._pending: deque[tuple[int, pb.WorkItem]] = deque()  # (sequence number, record)
        self._seq = 0
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one report in flight at a time
        self.dropped = 0
        self.disabled = False  # the tracker has no ledger (an older version): nothing to report to

    def record(self, req: StepRequest, decode: bool) -> None:
        """Note that the node completed ``req`` (called after every successful step)."""
        item = pb.WorkItem(session_id=req.session_id, position=req.position, n_tokens=len(req.token_ids),
                           decode=decode, model_sha256=self.model_sha256,
                           layers=pb.LayerRange(start=self.layers.start, end=self.layers.end))
        with self._lock:
            if self.disabled:
                return
            self._seq += 1
            self._pending.append((self._seq, item))
            if len(self._pending) > self._max_pending:
                self._pending.popleft()
                self.dropped += 1
                if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                    log.warning("tracker unreachable: dropped %d unreported steps", self.dropped)

    @property
    def pending(self) -> int:
        """Records not acknowledged yet."""
        with self._lock:
            return len(self._pending)

    def flush(self, tracker, timeout_s: float = 5.0, max_batches: int | None = None) -> bool:
        """Send pending records to ``tracker`` (a TrackerStub) in batches: all of them, or at most
        ``max_batches`` batches (a node sends a few after each heartbeat, so that a backlog after a long
        outage is paced rather than sent in one burst).

        Returns:
            False when the tracker does not know this node (it must register first; the records stay
            pending), True otherwise.

        Raises:
            grpc.RpcError: the tracker is unreachable (records stay pending) or refused the node
                (UNAUTHENTICATED). A batch refused as INVALID_ARGUMENT is dropped and logged instead: it
                would be refused forever.
        """
        with self._send_lock:
            sent = 0
            while max_batches is None or sent < max_batches:
                sent += 1
                with self._lock:
                    batch = [self._pending[i] for i in range(min(BATCH, len(self._pending)))]
                if not batch:
                    return True
                report = pb.WorkReport(node_id=self.node_id, items=[item for _, item in batch])
                if self._sign is not None:
                    self._sign(report)
                try:
                    reply = tracker.ReportWork(report, timeout=timeout_s)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                        log.warning("the tracker keeps no ledger (%s); not reporting work", e.details())
                        with self._lock:
                            self.disabled = True
                            self._pending.clear()
                        return True
                    if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                    log.error("tracker refused %d work records: %s; dropping them", len(batch), e.details())
                    reply = None
                if reply is not None and not reply.known:
                    return False
                _pop_through(self._pending, self._lock, batch[-1][0])
            return True


class DeliveryReporter:
    """A client's delivered tokens, reported to the tracker from a background thread (thread-safe).

    Only the first token at each position of a session counts (a step repeated at an old position is
    not a new delivery). Pending tokens are sent every ``interval_s``, when a session ends, and at
    :meth:`flush` / :meth:`close`; at interpreter exit the rest get one last attempt.

    Args:
        tracker: a TrackerStub.
        client_id: who is charged.
        model_sha256: the model, when known ("" otherwise).
        interval_s: seconds between background reports.
    """

    def __init__(self, tracker, client_id: str, model_sha256: str = "", interval_s: float = 1.0,
                 timeout_s: float = 5.0) -> None:
        self.tracker, self.client_id, self.model_sha256 = tracker, client_id, model_sha256
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._pending: deque[tuple[int, pb.DeliveredToken]] = deque()  # (sequence number, token)
        self._seq = 0
        self._high: dict[str, int] = {}  # session -> highest position delivered
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_failure: grpc.StatusCode | None = None  # the code of the last report that failed
        # monotonic time of the first report in a row the tracker did not answer (None: the last one landed)
        self._unanswered_since: float | None = None
        _live.add(self)

    def delivered(self, session_id: str, position: int) -> None:
        """The client accepted the token sampled for ``position`` of ``session_id``."""
        with self._lock:
            if position <= self._high.get(session_id, -1):
                return
            self._high[session_id] = position
            if len(self._pending) >= MAX_PENDING:
                self._pending.popleft()
            self._seq += 1
            self._pending.append((self._seq, pb.DeliveredToken(session_id=session_id, position=position)))
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="meshnet-deliveries", daemon=True)
                self._thread.start()

    def session_ended(self, session_id: str) -> None:
        """Forget the session's high-water mark and report its tokens soon."""
        with self._lock:
            self._high.pop(session_id, None)
        self._wake.set()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self, timeout_s: float | None = None, wait_for_ready: bool = False) -> bool:
        """Send every pending token now. Returns True when none is left (False: the tracker is down).
        ``wait_for_ready``: each call waits for the tracker's channel to connect, within ``timeout_s``
        (a tracker restarting), rather than failing while it does not."""
        with self._send_lock:
            while True:
                with self._lock:
                    batch = [self._pending[i] for i in range(min(BATCH, len(self._pending)))]
                if not batch:
                    return True
                try:
                    self.tracker.ReportDelivery(pb.DeliveryReport(client_id=self.client_id,
                                                                  tokens=[t for _, t in batch],
                                                                  model_sha256=self.model_sha256),
                                                timeout=timeout_s or self.timeout_s, wait_for_ready=wait_for_ready)
                except grpc.RpcError as e:
                    if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED):
                        # Refused for good (or a tracker without a ledger): resending cannot help.
                        log.error("tracker refused %d delivery records: %s; dropping them", len(batch),
                                  e.details())
                    else:
                        log.debug("delivery report failed (%s); will retry", e.code().name)
                        self._last_failure = e.code()
                        if e.code() in _TRANSIENT and self._unanswered_since is None:
                            self._unanswered_since = time.monotonic()
                        return False
                self._unanswered_since = None
                _pop_through(self._pending, self._lock, batch[-1][0])

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Stop the background thread after a last :meth:`flush`, tried for up to ``timeout_s`` seconds
        while the tracker does not answer (a tracker being restarted); True when nothing was left unsent.
        The wait counts from when the tracker stopped answering this client's reports: one already silent
        for ``timeout_s`` is not being restarted, and gets one attempt (``meshnet generate`` whose mesh and
        tracker were gone waited 5 s more after its failover had waited for them). What is left is lost
        with this client, and said so in the log: the nodes, which live on and report again, are credited
        for the work all the same. Returns at once when nothing is pending."""
        self._closed = True
        self._wake.set()
        deadline = (self._unanswered_since or time.monotonic()) + timeout_s
        while not (ok := self.flush(max(0.05, deadline - time.monotonic()), wait_for_ready=True)):
            # Only a tracker that does not answer (yet) is waited for; a refusal (its join token) is final.
            if time.monotonic() >= deadline or self._last_failure not in _TRANSIENT:
                break
            time.sleep(0.1)
        _live.discard(self)
        if not ok and (left := self.pending):
            log.warning("the tracker's ledger is unreachable: %d delivered tokens of client %s go unreported "
                        "(uncharged)", left, self.client_id)
        return ok

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._closed:
                self.flush()


def _pop_through(pending: deque, lock: threading.Lock, last_seq: int) -> None:
    """Drop acknowledged records: those numbered up to ``last_seq`` (records dropped for space while the
    report was in flight are already gone, so counting would pop unsent ones)."""
    with lock:
        while pending and pending[0][0] <= last_seq:
            pending.popleft()


def new_client_id() -> str:
    """A random client id (``client-`` and 12 hex digits), for clients that do not name themselves."""
    return f"client-{uuid.uuid4().hex[:12]}"


_live: "weakref.WeakSet[DeliveryReporter]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    # A CLI generation ends the process right after its last token: those tokens still get their tries,
    # within one CLOSE_WAIT_S for all the process's reporters.
    deadline = time.monotonic() + CLOSE_WAIT_S
    for reporter in list(_live):
        try:
            reporter.close(timeout_s=max(0.0, deadline - time.monotonic()))
        except BaseException:  # noqa: BLE001 - never fail interpreter exit over a report (a Ctrl-C included)
            pass
