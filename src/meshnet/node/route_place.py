"""Where a node sits on a route, checked against what a step or an await assumes.

A route names each node for a layer range; a step can reach a node that no longer serves it (another
process answers at the address after a restart with another range while the tracker was away), name next
hops that cannot follow this node, or await an outcome from a node that is not the route's tail. Each is
refused with a message naming the node and its range, before the engine sees anything.
"""

from __future__ import annotations

from meshnet.node.forwarding import next_hops_error
from meshnet.proto import meshnet_pb2 as pb


class RoutePlace:
    """Checks of one node (``node_id``, serving ``engine``'s layer range) against the route a request
    names. ``engine.capabilities()`` is asked lazily and raises RuntimeError while nothing is loaded."""

    def __init__(self, engine, node_id: str) -> None:
        self.engine = engine
        self.node_id = node_id
        self._layers_after: int | None = None  # the model's layers after this node's range (known once asked)

    def layers_after(self) -> int:
        """The model's layers after this node's range: 0 on a tail. RuntimeError while not loaded."""
        if self._layers_after is None:
            c = self.engine.capabilities()
            self._layers_after = c.n_layer - c.artifact.layers.end
        return self._layers_after

    def range_error(self, head: pb.Envelope) -> str | None:
        """Why this node does not run a step routed to it for another layer range (``head.layers``):
        its layers in place of the route's would yield wrong tokens without an error. None: the range is
        this node's, or the step names none."""
        if not head.HasField("layers"):
            return None
        own = self.engine.capabilities().artifact.layers
        if (head.layers.start, head.layers.end) == (own.start, own.end):
            return None
        return (f"node {self.node_id} serves layers {own.start}:{own.end}, but the step was routed to "
                f"it for layers {head.layers.start}:{head.layers.end}; get a new route")

    def hops_error(self, hops) -> str | None:
        """:func:`next_hops_error` for this node: its id, and the model's layers after its range."""
        if not hops:  # a client-orchestrated step (most): nothing to check
            return None
        return next_hops_error(hops, self.node_id, self.layers_after())

    def await_error(self) -> str | None:
        """Why this node answers no await: it is not a tail, so no forwarded step ends here (the await would
        wait out its expiry). None on a tail, and while nothing is loaded (it waits, as on a tail
        restarting)."""
        try:
            after = self.layers_after()
        except RuntimeError:
            return None
        if after == 0:
            return None
        return (f"node {self.node_id} is not a tail ({after} of the model's layers come after its range): "
                "only a route's tail answers an await")
