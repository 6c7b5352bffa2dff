"""A node's membership in its tracker: register, heartbeat (load, speed, readiness, finished work),
register again when the tracker forgot the node, and deregister when it leaves.

Runs on one thread (:meth:`Membership.run`), which starts a second that reports finished work after each
heartbeat: a ledger slow to write (a busy database) must not delay the heartbeats that keep the node
routable. A tracker that refuses the node for good (wrong key or protocol, an id a live node at another
address holds) ends the loop: ``refusal`` says why and ``on_refused`` is called, so the node can exit
non-zero with the tracker's words.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from meshnet.arg_types import MAX_HEARTBEAT_S, MIN_HEARTBEAT_S
from meshnet.ledger.reporting import WorkReporter
from meshnet.membership.identity import NodeIdentity
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.call_problems import retry_after_s

log = logging.getLogger("meshnet.node")

# Tracker answers after which a node stops instead of retrying its registration (INVALID_ARGUMENT: what
# the node says of itself, e.g. a loopback address registered from another machine, is the same next time).
FATAL_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
                  grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.INVALID_ARGUMENT)
# A node that has not registered yet asks again for an id the tracker holds for a live-looking entry at
# another address until that entry would expire (the tracker says when), plus this margin, seconds: that
# entry is usually this node's own, killed and restarted on another port (``--port`` defaults to any free
# one) before the tracker's TTL (3 heartbeats) ran out; one heartbeat from a live node keeps it.
ID_WAIT_MARGIN_S = 1.0
# While the tracker does not answer, the node says so again this often, seconds (after the first warning).
REMIND_S = 60.0


class Membership:
    """Keeps ``node_id`` registered with ``tracker``.

    Args:
        tracker: the tracker's stub.
        identity: signs every message.
        node_id: the id registered.
        info: the NodeInfo to register (asked again at each registration).
        load: ``(active_sessions, decode_tokens_per_s)`` for a heartbeat (0 tokens/s = unchanged).
        work: completed steps, flushed to the tracker's ledger after each heartbeat (on its own thread).
        on_refused: called with ``"CODE: details"`` when the tracker refuses the node for good.
        manifest: the model's manifest, published before every registration (a restarted tracker has
            lost it; the tracker keeps the first copy of an id), None for a model without one (the fake).
    """

    def __init__(self, tracker: pb_grpc.TrackerStub, identity: NodeIdentity, node_id: str,
                 info: Callable[[], pb.NodeInfo], load: Callable[[], tuple[int, float]], work: WorkReporter,
                 on_refused: Callable[[str], None], manifest: pb.ModelManifest | None = None) -> None:
        self.tracker, self.identity, self.node_id = tracker, identity, node_id
        self._info, self._load, self.work, self._on_refused = info, load, work, on_refused
        self.registered = threading.Event()  # set while the tracker knows this node
        # Called with the tracker's RegisterReply (on a thread of its own) after each registration: the node
        # asks for the tracker's node list.
        self.on_registered: Callable[[pb.RegisterReply], None] | None = None
        self.refusal: str | None = None  # why the tracker refused this node for good, or None
        self.leaving = False  # set by deregister: the loop must not register again
        self.waiting_for_id = False  # the tracker holds our id for an entry elsewhere, which may expire
        self.unreachable_tries = 0  # registrations that found no tracker (UNAVAILABLE) before the first took
        self.manifest = manifest
        self._work_due = threading.Event()  # set by a heartbeat the tracker answered: report work now
        self._beats_ended = False  # the beat loop returned (stopped, left, or refused for good)

    def run(self, stop: threading.Event) -> None:
        """Register, then heartbeat until ``stop`` or :meth:`deregister`; re-register whenever the
        tracker forgot us (e.g. it restarted). Beats are ``interval`` apart from start to start, however
        long the tracker took to answer the last one (within its 3 intervals of patience)."""
        reports = threading.Thread(target=self._report_work, name="work-reports", daemon=True)
        reports.start()
        try:
            self._beat(stop)
        finally:
            self._beats_ended = True
            self._work_due.set()  # wakes the report thread to see that the loop ended

    def _beat(self, stop: threading.Event) -> None:
        interval, registered, warned = 1.0, False, False
        failing_since = reminded_at = 0.0  # when this outage's first warning and its last reminder came
        ever_registered, id_deadline = False, 0.0
        while not stop.is_set() and not self.leaving:
            began = time.monotonic()
            try:
                if not registered:
                    self._publish()
                    reply = self.tracker.Register(self.identity.sign(self._info()), timeout=5)
                    interval = min(max(MIN_HEARTBEAT_S, reply.heartbeat_interval_s), MAX_HEARTBEAT_S)
                    registered = ever_registered = True
                    warned = self.waiting_for_id = False
                    self.registered.set()
                    log.info("registered with the tracker (heartbeat %.2fs)", interval)
                    if self.on_registered is not None:
                        threading.Thread(target=self.on_registered, args=(reply,), name="list-peers",
                                         daemon=True).start()
                else:
                    sessions, speed = self._load()
                    hb = self.tracker.Heartbeat(self.identity.sign(pb.HeartbeatRequest(
                        node_id=self.node_id, active_sessions=sessions, decode_tokens_per_s=speed)), timeout=5)
                    registered = hb.known
                    if registered:
                        self._work_due.set()
            except grpc.RpcError as e:
                expires_in = retry_after_s(e)
                if e.code() is grpc.StatusCode.ALREADY_EXISTS and not ever_registered and expires_in is not None:
                    id_deadline = id_deadline or time.monotonic() + expires_in + ID_WAIT_MARGIN_S
                    if time.monotonic() < id_deadline:
                        if not self.waiting_for_id:
                            log.warning("%s; asking again until then", e.details())
                        self.waiting_for_id = True
                        stop.wait(0.25)
                        continue
                if e.code() in FATAL_REFUSALS:  # (refusal set before waiting_for_id clears: never "ready")
                    self.refusal = f"{e.code().name}: {e.details()}"
                    self.waiting_for_id = False
                    self._on_refused(self.refusal)
                    return
                if e.code() is grpc.StatusCode.UNAVAILABLE and not ever_registered:
                    self.unreachable_tries += 1
                if registered or not warned:
                    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        log.warning("tracker unreachable (%s); retrying", e.details() or e.code().name)
                    else:  # it answered, with an error of its own (a ledger it cannot write)
                        log.warning("the tracker answered %s: %s; retrying", e.code().name, e.details())
                    warned, failing_since = True, time.monotonic()
                    reminded_at = failing_since
                elif time.monotonic() - reminded_at >= REMIND_S:
                    # A mistyped --tracker otherwise left the node serving, silent, and never part of a mesh.
                    reminded_at = time.monotonic()
                    log.warning("still no answer from the tracker after %.0f s (%s); retrying: is --tracker its "
                                "address, and is it running?", reminded_at - failing_since,
                                e.details() or e.code().name)
                registered = False  # tracker down or restarting: keep trying
            if not registered:
                self.registered.clear()
            stop.wait(max(interval - (time.monotonic() - began), MIN_HEARTBEAT_S))

    def _report_work(self) -> None:
        """Report finished work (a few batches) after each answered heartbeat, until the beat loop ends.
        Unacknowledged work is kept and resent after an outage (the tracker counts it once); a tracker
        that no longer knows this node (the records stay pending) or is down is found by the heartbeats."""
        warned = False
        while True:
            self._work_due.wait()
            self._work_due.clear()
            if self._beats_ended:
                return
            try:
                self.work.flush(self.tracker, max_batches=4)
                warned = False
            except grpc.RpcError as e:
                (log.info if warned else log.warning)("could not report finished work to the tracker (%s: %s); "
                                                      "it is kept and sent again", e.code().name, e.details())
                warned = True

    def _publish(self) -> None:
        """Publish the manifest; a tracker without manifests (UNIMPLEMENTED) still routes by id."""
        if self.manifest is None:
            return
        try:
            self.tracker.PublishManifest(self.manifest, timeout=10)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.warning("the tracker keeps no manifests (%s); nodes and clients without the file cannot "
                        "fetch this model through it", e.details())
            self.manifest = None

    def deregister(self) -> None:
        """Report finished work and leave the tracker (best effort, a few seconds at most). A refused
        node never held its id: it leaves without deregistering, which would remove the node that does."""
        self.leaving = True
        if self.refusal is not None:
            return
        try:
            self.work.flush(self.tracker, timeout_s=2)
            self.tracker.Deregister(self.identity.sign(pb.NodeRef(node_id=self.node_id)), timeout=2)
        except grpc.RpcError:
            pass

    def flush(self) -> None:
        """Report work finished since (steps that completed while draining); best effort."""
        try:
            self.work.flush(self.tracker, timeout_s=2)
        except grpc.RpcError:
            pass
