"""The API's view of a mesh: is there a complete route now, and how long a context does it give."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("meshnet.api")


class RouteWatch:
    """The API's view of the mesh: the route a request would take, checked before each one (no route:
    MeshUnavailable, a 503), and that route's context length, read from its hops when the route changes.

    The route is a new session's (:meth:`MeshClient.new_route`): around the nodes this client found down
    lately, as its sessions route. A hop that does not answer the context query is recorded as found down
    when a health probe agrees, so the next request looks elsewhere (a node the tracker lists until its
    heartbeats lapse, seconds after it died, was queried again and warned of by every request); the
    last length read stays in use.

    Args:
        client: the API's MeshClient.
        n_ctx: the context length (tokens) to assume until a route has been read.
    """

    def __init__(self, client, n_ctx: int) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._n_ctx, self._hops = n_ctx, ()
        self._lost = False  # the last check found no route, after one had been found

    def check(self, probe_found_down: bool = False) -> list[str]:
        """The route's hops as ``id@address``. Raises MeshUnavailable. The route's loss and return are
        logged once each (the API said nothing while its requests got 503s).

        ``probe_found_down`` (``/health``): a hop this client found down lately must answer a health
        probe, or there is no route. The tracker lists a dead node until its heartbeats lapse (6 s), and
        a request meanwhile waits out the failover deadline for a 503 where the node had no spare; a load
        balancer learns it from the first request that found the node down. Requests do not probe: a
        node restarting at its address (``meshnet up``) is waited for by their failover."""
        from meshnet.client.remote import StageFailure
        from meshnet.client.router import MeshUnavailable, context_length

        try:
            _, hops = self.client.new_route(opens_session=False)
            if probe_found_down and (down := self.client.node_failures.recent(time.monotonic())):
                for h in hops:
                    if h.node_id in down and not h.answers():
                        raise MeshUnavailable(f"no route: node {h.node_id} at {h.address} was found down and "
                                              "does not answer a health probe from this machine (if it runs: "
                                              "is its port open to this machine? a node behind NAT or a "
                                              "firewall joins with --relay)")
        except MeshUnavailable as e:
            with self._lock:
                lost, self._lost = not self._lost and bool(self._hops), bool(self._hops)
            if lost:
                log.warning("the mesh has no complete route now (requests get 503 until it has): %s",
                            str(e).removeprefix("no route: "))
            raise
        key = tuple((h.node_id, h.address) for h in hops)
        with self._lock:
            known, back, self._lost = self._hops == key, self._lost, False
        if back:
            log.info("the mesh has a complete route again: %s", " -> ".join(f"{h.node_id}@{h.address}" for h in hops))
        if not known:
            try:
                n_ctx = context_length(hops)
                with self._lock:
                    first, (self._n_ctx, self._hops) = not self._hops, (n_ctx, key)
                if first:  # said once: "no complete route yet" was, at start, where the mesh came up later
                    log.info("the mesh has a complete route: %s (%d tokens of context)",
                             " -> ".join(f"{h.node_id}@{h.address}" for h in hops), n_ctx)
            except Exception as e:  # noqa: BLE001 - the request still runs; the generation finds the route
                log.warning("could not read the route's context length: %s", e)
                if isinstance(e, StageFailure):  # a node died since the tracker last heard of it
                    self.client.node_failures.record_if_down(hops, e, time.monotonic())
        return [f"{h.node_id}@{h.address}" for h in hops]

    def n_ctx(self) -> int:
        with self._lock:
            return self._n_ctx
