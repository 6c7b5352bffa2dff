"""The tracker's relay hub: calls for nodes that accept no inbound connections.

A relayed node keeps one outbound ``Relay`` stream open to the tracker. :class:`RelayHub` holds one
:class:`RelayLink` per attached node: calls from clients (``RelayStep`` / ``RelayControl``) become
``RelayDown`` messages pushed down that stream, and the node's ``RelayUp`` answers are matched back by
``call_id``. When a stream ends every call waiting on it is answered UNAVAILABLE at once, so a client
fails over as fast as it would for a direct node whose connection dropped.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from dataclasses import dataclass

import grpc

from meshnet.proto import meshnet_pb2 as pb
from meshnet.tracker.refusals import bounded
from meshnet.wire.call_problems import abort_call
from meshnet.wire.data_plane_server import MAX_REQUEST_BYTES
from meshnet.wire.read_deadlines import ReadDeadlines
from meshnet.wire.request_budget import RequestBudget, RequestRefused, read_request

# Header of a RelayStep call naming the node to forward to.
RELAY_NODE_METADATA = "meshnet-relay-node"
# The tracker's gRPC worker threads. Each relay stream holds one while it lasts: a relayed node's Relay
# stream for the node's whole life, a RelayStep until the node has answered. Each kind has its own budget
# (MAX_RELAYED_NODES, MAX_RELAY_STEPS), and the rest of the threads stay for registrations, heartbeats and
# routes: 64 streams that never sent a message held every thread, and the tracker answered nothing.
MAX_RELAYED_NODES = 64
MAX_RELAY_STEPS = 224
# RelayControl calls (health probes, cancels, releases) have a budget of their own: under a flood of steps
# a probe refused made the client record a live node as down, and releases were dropped.
MAX_RELAY_CONTROLS = 32
TRACKER_WORKERS = MAX_RELAYED_NODES + MAX_RELAY_STEPS + MAX_RELAY_CONTROLS + 32
# Step frames buffered for relayed nodes at once, bytes (each step's own at most MAX_REQUEST_BYTES, as on
# the data plane): a stream that sent 15 MiB frames and never ended grew the tracker without bound.
MAX_RELAY_BYTES = 512 << 20
# How long a relay stream may take to send what it must before anything is forwarded (a node's hello, a
# step's frames), seconds: a client's step deadline is 60 s at most, so no step it still waits for takes
# longer. Past it the call is cancelled and its thread goes back.
RELAY_READ_S = 60.0
# How long the tracker waits for a relayed node to answer a call that has no deadline of its own, seconds
# (the client's step deadline at most, as above): a node that never answered held a tracker thread for good.
RELAY_ANSWER_S = 60.0


@dataclass
class RelayAnswer:
    """A node's answer to one relayed call; ``code`` is a gRPC status code name."""

    code: str
    message: str = ""
    up: pb.RelayUp | None = None

    @property
    def retry_after_s(self) -> float | None:
        return self.up.retry_after_s if self.up is not None and self.up.has_retry_after else None


class _Pending:
    __slots__ = ("event", "answer")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.answer: RelayAnswer | None = None


class RelayLink:
    """One node's open Relay stream: an outgoing queue and the calls waiting for answers (thread-safe)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.outgoing: queue.Queue[pb.RelayDown | None] = queue.Queue()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.closed = False

    def call(self, down: pb.RelayDown, timeout_s: float | None) -> RelayAnswer:
        """Send ``down`` to the node and wait for its answer.

        Returns UNAVAILABLE when the stream is closed or closes while waiting, DEADLINE_EXCEEDED when
        the node does not answer within ``timeout_s`` seconds (None: wait as long as the stream lives).
        """
        p = _Pending()
        with self._lock:
            if self.closed:
                return RelayAnswer("UNAVAILABLE", f"node {self.node_id} has no relay stream open")
            call_id = next(self._ids)
            self._pending[call_id] = p
        down.call_id = call_id
        self.outgoing.put(down)
        if not p.event.wait(timeout_s):
            with self._lock:
                self._pending.pop(call_id, None)
            return RelayAnswer("DEADLINE_EXCEEDED", f"node {self.node_id} did not answer through the relay "
                                                    f"within {timeout_s:.1f}s")
        return p.answer

    def answer(self, up: pb.RelayUp) -> None:
        """Deliver the node's answer ``up`` to the call waiting on ``up.call_id`` (late answers are dropped)."""
        with self._lock:
            p = self._pending.pop(up.call_id, None)
        if p is not None:
            p.answer = RelayAnswer(up.code or "OK", up.message, up)
            p.event.set()

    def close(self, reason: str) -> None:
        """End the stream: every waiting call is answered UNAVAILABLE with ``reason``."""
        with self._lock:
            self.closed = True
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.answer = RelayAnswer("UNAVAILABLE", f"node {self.node_id}: {reason}")
            p.event.set()
        self.outgoing.put(None)


class RelayHub:
    """Attached relayed nodes by id; a node that reattaches replaces (and closes) its old link."""

    def __init__(self) -> None:
        self._links: dict[str, RelayLink] = {}
        self._lock = threading.Lock()

    def attach(self, node_id: str) -> RelayLink:
        link = RelayLink(node_id)
        with self._lock:
            old, self._links[node_id] = self._links.get(node_id), link
        if old is not None:
            old.close("relay stream replaced by a newer one")
        return link

    def detach(self, link: RelayLink, reason: str) -> None:
        with self._lock:
            if self._links.get(link.node_id) is link:
                del self._links[link.node_id]
        link.close(reason)

    def get(self, node_id: str) -> RelayLink | None:
        with self._lock:
            return self._links.get(node_id)

    def attached(self, node_id: str) -> bool:
        return self.get(node_id) is not None

    def call(self, node_id: str, down: pb.RelayDown, timeout_s: float | None) -> RelayAnswer:
        """Forward ``down`` to ``node_id``; UNAVAILABLE when the node has no relay stream open."""
        link = self.get(node_id)
        if link is None:
            return RelayAnswer("UNAVAILABLE", f"node {node_id} has no relay stream open")
        return link.call(down, timeout_s)


class RelayLimits:
    """What relayed traffic may hold of the tracker at once (thread-safe): :data:`MAX_RELAYED_NODES`
    Relay streams, :data:`MAX_RELAY_STEPS` RelaySteps and :data:`MAX_RELAY_CONTROLS` RelayControls (each call
    waiting :data:`RELAY_ANSWER_S` at most for the node's answer) and :data:`MAX_RELAY_BYTES` of buffered
    step frames.

    Refusals are UNAVAILABLE (with a retry-after), as for a relayed node the tracker cannot reach: the
    client fails over, or waits for the node, rather than taking it for the node's own answer."""

    def __init__(self, max_nodes: int = MAX_RELAYED_NODES, max_steps: int = MAX_RELAY_STEPS,
                 max_bytes: int = MAX_RELAY_BYTES, read_s: float = RELAY_READ_S,
                 answer_s: float = RELAY_ANSWER_S, max_controls: int = MAX_RELAY_CONTROLS) -> None:
        self.max_bytes, self.read_s, self.answer_s = max_bytes, read_s, answer_s
        self._slots = {"Relay": (threading.BoundedSemaphore(max_nodes), max_nodes, "relays for {} nodes"),
                       "RelayStep": (threading.BoundedSemaphore(max_steps), max_steps,
                                     "has {} steps for relayed nodes in flight"),
                       "RelayControl": (threading.BoundedSemaphore(max_controls), max_controls,
                                        "has {} control calls for relayed nodes in flight")}
        self.budget = RequestBudget(max_bytes)  # step frames buffered
        self._reads = ReadDeadlines("relay-read-deadlines")

    @contextlib.contextmanager
    def stream(self, context, method: str):
        """Hold one of ``method``'s slots ("Relay", "RelayStep" or "RelayControl") for the ``with`` block;
        the call is cancelled unless the block calls the yielded function (what it had to
        read has arrived) within ``read_s``. Aborts the call with UNAVAILABLE when every slot is taken."""
        slots, most, what = self._slots[method]
        if not slots.acquire(blocking=False):
            _refuse(context, f"{method}: the tracker {what.format(most)} already; try again later")
        try:
            self._reads.expect(context, self.read_s)
            yield lambda: self._reads.arrived(context)
        finally:
            self._reads.arrived(context)
            slots.release()

    def answer_timeout(self, context) -> float:
        """Seconds to wait for a relayed node's answer: the call's own deadline, :attr:`answer_s` at most."""
        remaining = context.time_remaining()
        return self.answer_s if remaining is None else min(remaining, self.answer_s)

    def read_step(self, request_iterator, context) -> tuple[list[pb.Envelope], int]:
        """A RelayStep's frames, read whole within the limits, and the bytes they hold, which the caller
        gives back with :meth:`give_back` once the node has answered. Aborts the call with INVALID_ARGUMENT
        for a step over MAX_REQUEST_BYTES, UNAVAILABLE when the buffered steps of all streams are at
        :data:`MAX_RELAY_BYTES`; raises grpc.RpcError when the call was cancelled or broke."""
        try:
            return read_request(request_iterator, self.budget, MAX_REQUEST_BYTES, keep=True)
        except RequestRefused as e:
            if e.code == "INVALID_ARGUMENT":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"RelayStep: {e.message}")
            _refuse(context, f"RelayStep: the tracker buffers {self.max_bytes} bytes of relayed steps already; "
                             "try again later")

    def give_back(self, n_bytes: int) -> None:
        self.budget.give_back(n_bytes)

    @property
    def buffered_bytes(self) -> int:
        return self.budget.held


def _refuse(context, message: str) -> None:
    """End the call UNAVAILABLE with a retry-after of a second (see :class:`RelayLimits`)."""
    abort_call(context, grpc.StatusCode.UNAVAILABLE, bounded(message), 1.0)
