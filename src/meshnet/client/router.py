"""Routes for a mesh client: asked of the tracker (or, while it cannot be reached, its last answer), and
the connections to their nodes, shared by every session of the client."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from meshnet.client.relayed import RelayedStage
from meshnet.client.remote import LIVENESS_PROBE_S, RemoteStage, StageFailure
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.data_plane import ConnectionPool
from meshnet.wire.call_problems import no_tracker_at, tracker_hint
from meshnet.wire.security import client_ssl_context, open_channel

# How long a health probe of the last route's node is trusted while the tracker is unreachable, seconds
# (the API asks for a route twice a request: its check, then the session's own).
PROBE_KEPT_S = 1.0

log = logging.getLogger("meshnet.client")

# Tracker answers that mean it cannot be reached (rather than that it refused): the last route serves.
_TRACKER_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# How long the tracker has to answer GetRoute, seconds: a tracker under load across a WAN answers well within it.
ROUTE_TIMEOUT_S = 5.0
# The same for ROUTE_RETRY_FULL_S after the tracker did not answer within ROUTE_TIMEOUT_S, where the last
# route can serve meanwhile: a tracker that drops packets would otherwise cost each new session (and each
# API request, which asks twice) the whole timeout before the last route serves. Then a request gets the
# whole timeout again, so a tracker slower than the short one is not given up on for good.
ROUTE_TIMEOUT_UNREACHABLE_S = 1.0
ROUTE_RETRY_FULL_S = 10.0


# How long a route's hop may take to answer for its capabilities, seconds: a small call any reachable node
# answers at once, where one behind a firewall that drops packets (NAT without --relay, a wrong
# --advertise) held every new client for the 5 s default before it routed around the node.
CAPABILITIES_TIMEOUT_S = 2.0


def context_length(hops: list[RemoteStage]) -> int:
    """The smallest ``n_ctx`` (tokens) along a route: every stage must hold the whole session.
    Raises StageFailure when a hop does not answer within :data:`CAPABILITIES_TIMEOUT_S` (one that let
    the time run out is said to be perhaps unreachable from here, with what to do about it)."""
    n_ctx = []
    for h in hops:
        try:
            n_ctx.append(h.capabilities(CAPABILITIES_TIMEOUT_S).n_ctx)
        except StageFailure as f:
            if f.code != "DEADLINE_EXCEEDED":
                raise
            raise StageFailure(f.node_id, f.address, f.code,
                               f"no answer within {CAPABILITIES_TIMEOUT_S:g} s: is its port open to this machine? (a "
                               "node behind NAT or a firewall joins with --relay; one with a wrong --advertise "
                               "address registers one nobody reaches)") from None
    return min(n_ctx)


class MeshUnavailable(RuntimeError):
    """No complete route could be had (the message names the missing layers) within the deadline."""


class Router:
    """Asks the tracker for routes and connects to their nodes: one gRPC channel per node address and one
    data-plane connection pool per data address, reused by every route through that node.

    Args:
        tracker: ``HOST:PORT`` of the tracker.
        model_sha256: which model to route for ("" = the only one served).
        step_timeout_s: the longest any one step may take on a hop, seconds.

    Attributes:
        on_stage: applied to each stage object before it is handed out (benchmarks wrap its calls).
    """

    def __init__(self, tracker: str, model_sha256: str = "", join_token: str | None = None,
                 tls_ca: str | None = None, step_timeout_s: float = 60.0, probe_s: float | None = None) -> None:
        self.tracker_address, self.model_sha256 = tracker, model_sha256
        self.join_token, self.tls_ca, self.step_timeout_s = join_token, tls_ca, step_timeout_s
        self.probe_s = probe_s  # each stage's Health probe interval while a step is overdue (RemoteStage)
        self.tracker_channel = open_channel(tracker, join_token, tls_ca)
        self.tracker = pb_grpc.TrackerStub(self.tracker_channel)
        self.on_stage: Callable[[RemoteStage], RemoteStage] | None = None
        self._last_route: list[pb.Hop] | None = None  # the tracker's last route, while it is unreachable
        # When a GetRoute with the whole timeout last went unanswered (see ROUTE_TIMEOUT_UNREACHABLE_S).
        self._unreachable_at: float | None = None
        self._clock = time.monotonic
        # (id, address) -> (when, problem, the instance that answered)
        self._probed: dict[tuple[str, str], tuple[float, str | None, str]] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._pools: dict[str, ConnectionPool] = {}
        self._lock = threading.Lock()

    def stage(self, hop: pb.Hop) -> RemoteStage:
        """The stage object for one hop of a route (its connections shared with other routes)."""
        stage = self._connect(hop)
        # Which recorded inputs it takes in a replay, and the range each step names (a node serving
        # another range refuses it); a tracker's hops always give it.
        stage.layers = (hop.layers.start, hop.layers.end) if hop.HasField("layers") else None
        stage.instance = hop.instance
        stage.numerics = hop.numerics
        return self.on_stage(stage) if self.on_stage is not None else stage

    def _connect(self, hop: pb.Hop) -> RemoteStage:
        if hop.relayed:
            # The node accepts no connections: its traffic goes through the tracker it is attached to.
            return RelayedStage(hop.node_id, self.tracker_channel, self.step_timeout_s)
        with self._lock:
            ch = self._channels.get(hop.address)
            if ch is None:
                ch = self._channels[hop.address] = open_channel(hop.address, self.join_token, self.tls_ca)
            pool = None
            if hop.data_address:  # over TLS (verified with the same CA) when the mesh is
                pool = self._pools.get(hop.data_address)
                if pool is None:
                    tls = client_ssl_context(self.tls_ca) if self.tls_ca else None
                    pool = self._pools[hop.data_address] = ConnectionPool(hop.data_address, self.join_token,
                                                                          self.step_timeout_s, tls)
        return RemoteStage(hop.node_id, hop.address, ch, self.step_timeout_s, data_pool=pool, probe_s=self.probe_s)

    def route(self, exclude: set[str] = frozenset(), previous_epoch: int = 0, min_n_ctx: int = 0,
              like: list[RemoteStage] = (), opens_session: bool = False) -> tuple[int, list[RemoteStage]]:
        """A route from the tracker, numbered with an epoch above ``previous_epoch``, through nodes that
        hold sessions of ``min_n_ctx`` tokens (0: any), preferring over each hop of ``like`` (the route a
        failover replaces) nodes that compute as that hop did (see :mod:`meshnet.engine.numerics`).
        ``opens_session``: a session opens on the route (the tracker counts it on the route's nodes until
        they next heartbeat, so that sessions opening together spread over replicas).

        While the tracker cannot be reached (down, restarting, cut off from this client), the last route
        it gave serves instead, unless it goes through a node in ``exclude`` or one that does not answer a
        health probe: the nodes keep serving without the tracker, so new sessions need not fail with it.
        Its epoch is then ``previous_epoch + 1``: epochs only have to grow per session, and the tracker,
        once back, numbers above what the client sends.
        The tracker has :data:`ROUTE_TIMEOUT_S` to answer; once it has not, and for
        :data:`ROUTE_RETRY_FULL_S`, :data:`ROUTE_TIMEOUT_UNREACHABLE_S` where the last route can serve.

        Raises:
            MeshUnavailable: the tracker's reason, or why the last route cannot serve.
        """
        now, last = self._clock(), self._last_route
        short = (self._unreachable_at is not None and now - self._unreachable_at < ROUTE_RETRY_FULL_S
                 and last is not None and not exclude & {h.node_id for h in last})
        try:
            r = self.tracker.GetRoute(pb.RouteRequest(model_sha256=self.model_sha256,
                                                       exclude_node_ids=sorted(exclude),
                                                       previous_epoch=previous_epoch, min_n_ctx=min_n_ctx,
                                                       prefer_like=[_hop_like(h) for h in like if h.layers],
                                                       opens_session=opens_session),
                                   timeout=ROUTE_TIMEOUT_UNREACHABLE_S if short else ROUTE_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() not in _TRACKER_UNREACHABLE:
                self._unreachable_at = None  # it answered, if with a refusal
            elif not short:
                self._unreachable_at = now
            if e.code() not in _TRACKER_UNREACHABLE or last is None:
                unanswered = (f" (the tracker at {self.tracker_address} did not answer within "
                              f"{ROUTE_TIMEOUT_S:g} s)" if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED else
                              f" ({no_tracker_at(self.tracker_address)})" if e.code() is grpc.StatusCode.UNAVAILABLE
                              else "")
                # A refused join token is not a routing problem: "no route: missing join token" sent users
                # looking at the mesh's nodes.
                what = ("the tracker refused this client" if e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                                                          grpc.StatusCode.PERMISSION_DENIED)
                        else "no route")
                raise MeshUnavailable(f"{what}: {e.details() or e.code().name}{unanswered}"
                                      f"{tracker_hint(e, self.tls_ca)}") from None
            if exclude & {h.node_id for h in last}:
                raise MeshUnavailable(f"no route: the tracker is unreachable ({e.code().name}) and its last "
                                      f"route goes through a failed node") from None
            # Nobody drops a dead node from that route meanwhile: ask each (a health probe), so a new
            # session, and the API's /health, learn it at once rather than through a failover's deadline.
            stages = [self.stage(h) for h in last]
            for st in stages:
                problem, instance = self._probe(st)
                if problem is not None:
                    raise MeshUnavailable(f"no route: the tracker is unreachable ({e.code().name}) and node "
                                          f"{st.node_id} of its last route {problem}") from None
                # The process that answered is the route's node now (one restarted meanwhile serves its
                # layers): a step it fails must not be taken for "another process answers" (RemoteStage.answers).
                st.instance = instance or st.instance
            log.warning("tracker %s unreachable (%s): using the last route it gave", self.tracker_address,
                        e.code().name)
            return previous_epoch + 1, stages
        if self._unreachable_at is not None:  # its outage was warned of with every route it could not give
            log.info("tracker %s answers again", self.tracker_address)
        self._last_route, self._unreachable_at = list(r.hops), None
        return int(r.epoch), [self.stage(h) for h in r.hops]

    @property
    def had_route(self) -> bool:
        """Whether the tracker has given this client a route."""
        return self._last_route is not None

    def _probe(self, stage: RemoteStage) -> tuple[str | None, str]:
        """(why ``stage`` cannot take a new session now, or None; the instance of the process that answered,
        or ""). Why not: it does not answer Health, answers unhealthy, or serves another layer range or
        model than the route says. A probe's answer is kept :data:`PROBE_KEPT_S`. Another process
        answering at the node's address is fine here if it serves the same layers of the same model (a
        node restarted while the tracker was away): a new session starts there."""
        key, now = (stage.node_id, stage.address), time.monotonic()
        with self._lock:
            kept = self._probed.get(key)
        if kept is not None and now - kept[0] < PROBE_KEPT_S:
            return kept[1], kept[2]
        instance = ""
        try:
            h = stage.health(LIVENESS_PROBE_S)
            problem = None if h.healthy else f"answers unhealthy at {stage.address}: {h.message}"
            if problem is None:
                problem, instance = self._serves_other(stage, stage.capabilities(LIVENESS_PROBE_S)), h.instance
        except grpc.RpcError as err:
            problem = f"does not answer at {stage.address} ({err.code().name})"
        except StageFailure as f:
            problem = f"does not answer at {stage.address} ({f.code})"
        with self._lock:
            self._probed[key] = (now, problem, instance)
        return problem, instance

    def _serves_other(self, stage: RemoteStage, caps: pb.Capabilities) -> str | None:
        """Why the node answering at ``stage``'s address is not the route's (another layer range, another
        model), or None."""
        if stage.layers is not None and (caps.layers.start, caps.layers.end) != tuple(stage.layers):
            return (f"is now a node serving layers {caps.layers.start}:{caps.layers.end} at {stage.address}, "
                    f"not {stage.layers[0]}:{stage.layers[1]}")
        if self.model_sha256 and caps.model.sha256 and caps.model.sha256 != self.model_sha256:
            return f"is now a node serving another model ({caps.model.sha256[:12]}) at {stage.address}"
        return None

    def route_around(self, failed_at: dict[str, str], previous_epoch: int = 0, min_n_ctx: int = 0,
                     like: list[RemoteStage] = (), opens_session: bool = False) -> tuple[int, list[RemoteStage]]:
        """A route without the nodes in ``failed_at`` (node id -> the address each failed at), or else
        one through them once every one has recovered (:meth:`route_through_recovered`): a mesh without a
        spare serves again as soon as its failed node is back. Other arguments as :meth:`route`. Raises
        MeshUnavailable (the tracker's reason for the route without them)."""
        try:
            return self.route(set(failed_at), previous_epoch, min_n_ctx, like, opens_session)
        except MeshUnavailable:
            recovered = (self.route_through_recovered(failed_at, previous_epoch, min_n_ctx, like)
                         if failed_at else None)
            if recovered is None:
                raise
            return recovered

    def route_through_recovered(self, failed_at: dict[str, str], previous_epoch: int, min_n_ctx: int = 0,
                                like: list[RemoteStage] = ()) -> tuple[int, list[RemoteStage]] | None:
        """A route in which every node that failed for this session has recovered: it is a new process
        (its address changed since it failed), or it answers Health again at its address (a partition
        healed, a stalled process resumed). None: no such route, or the tracker has none at all."""
        try:
            epoch, hops = self.route(frozenset(), previous_epoch, min_n_ctx, like)
        except MeshUnavailable:
            return None
        for h in hops:
            if failed_at.get(h.node_id) == h.address and not h.answers():
                return None  # the same process that failed: still dead, stalled, cut off, or reloading
        return epoch, hops

    def close(self) -> None:
        """Close every channel and pooled connection (the tracker's stays, for late reports)."""
        for ch in self._channels.values():
            ch.close()
        for pool in self._pools.values():
            pool.close()


def _hop_like(stage: RemoteStage) -> pb.Hop:
    """What ``RouteRequest.prefer_like`` needs of a hop: its layer range and numerics key."""
    start, end = stage.layers
    return pb.Hop(node_id=stage.node_id, layers=pb.LayerRange(start=start, end=end), numerics=stage.numerics)
