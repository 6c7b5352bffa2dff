"""Route planning: pick the cheapest chain of nodes whose layer ranges tile a whole model.

Pure functions over plain data: no I/O, no clocks. The tracker's registry supplies the live
:class:`NodeRecord` entries; :func:`plan_route` returns the hops in layer order or raises
:class:`NoRoute` naming what is missing.

Cost model
----------
A route is a path over layer *boundaries* ``0 -> b1 -> ... -> n_layer``: each node serving ``[s, e)`` is
an edge from boundary ``s`` to boundary ``e`` (a node always runs its whole range, so edges never
start or end inside one). The cheapest path is found by dynamic programming over the boundaries in
increasing order (the graph only goes forward, so this is Dijkstra's result without the heap). This is
the scheme of Petals' ``RemoteSequenceManager._build_inference_graph`` ("min latency" routing), adapted
to whole-range nodes. The estimated seconds one decode token spends on a hop are::

    hop_s = HOP_OVERHEAD_S (+ RELAY_OVERHEAD_S if relayed) + compute_s * (1 + active_sessions / max_sessions)

* ``HOP_OVERHEAD_S``: per-hop network and (de)serialisation time. Petals measured 18 ms of
  serialisation overhead per hop and adds half the RTT; meshnet's tracker does not measure RTTs, so a
  LAN-scale 2 ms is added to Petals' 18 ms. Its effect: an extra hop must save at least this much
  compute to be worth taking.
* ``compute_s``: ``n_layers / layer_rate``. A node reports ``decode_tokens_per_s`` measured over its
  own range, so its layer rate is ``decode_tokens_per_s * n_layers`` and ``compute_s`` is simply
  ``1 / decode_tokens_per_s``. A node that has not measured (0, negative or not finite) gets Petals'
  neutral default of ``DEFAULT_LAYERS_PER_S = 300`` layers per second.
* Load: a node shared by ``active_sessions`` others serves each session more slowly; the factor
  ``1 + active/max`` doubles the compute estimate of a node at its limit.
* Saturation: a node with ``active_sessions >= max_sessions`` would answer RESOURCE_EXHAUSTED, so routes
  are compared first by how many such hops they use (fewest wins) and only then by time; a saturated
  node is taken only when no chain avoids it. (Petals adds a 10 s penalty for servers short of cache;
  a lexicographic key says the same without a magic number.)
* Relayed hops pay ``RELAY_OVERHEAD_S`` more: traffic crosses an extra network leg whose latency is
  unknown, for which Petals assumes 150 ms.
* Numerics: a failover asks for a route like the one it replaces (``like``: the replaced hops' layer
  ranges and numerics keys, :mod:`meshnet.engine.numerics`). Only a replacement that computes exactly as
  the node it replaces rebuilds the session's KV cache bit for bit, so after saturation routes are
  compared by how many hops compute otherwise than the hops they replace over some of their layers, and
  only then by time: a slower spare with the same kernels and threads beats a faster one without.
* Avoided nodes: a node some client's route request excluded lately (it found it down, or could not reach
  it: a node behind NAT without a relay) is taken, after saturation and numerics, only where no chain of
  as few avoided hops serves; the tracker keeps the list (``avoid``).
* Ties (equal saturation, numerics, avoided hops and time) go to the route whose node ids sort first, so
  the answer never depends on the order of the input.

Context: a route holds sessions of its smallest node context (``n_ctx``), so before any of the above, a
route offers the largest context some chain offers: a node holding less is a spare for when no chain
of larger ones is left (otherwise an idle small spare would take new sessions and shrink what the API
serves), and a client that needs ``min_n_ctx`` tokens (a session failing over) never gets a node
holding fewer. A node that did not say its context (0) fits any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Sequence

from meshnet.contract import LayerRange

# Seconds added to every hop: Petals' measured 18 ms serialisation overhead plus ~2 ms of LAN latency.
HOP_OVERHEAD_S = 0.020
# Extra seconds for a hop reached through a relay: Petals' assumed one-way delay of an unmeasured link.
RELAY_OVERHEAD_S = 0.150
# Layers per second assumed for a node that has not reported a speed (Petals' default_inference_rps).
DEFAULT_LAYERS_PER_S = 300.0


@dataclass(frozen=True)
class NodeRecord:
    """What the tracker knows about one registered node.

    Attributes:
        node_id: unique id chosen by the node.
        address: ``host:port`` of the node's gRPC service.
        model_sha256: id of the model the node serves a part of (hex sha256 of its manifest).
        architecture: e.g. ``"llama"``.
        n_layer: layers in the whole model.
        layers: the half-open range ``[start, end)`` the node serves.
        engine, backend: e.g. ``"ggml"``, ``"cpu"``.
        decode_tokens_per_s: decode speed the node measured over its own range; 0 = unknown.
        active_sessions: sessions the node holds now (from its last heartbeat).
        max_sessions: sessions the node accepts before RESOURCE_EXHAUSTED; 0 or less = unknown (no limit).
        relayed: reserved for relays: the node is reached through one, so its hop costs more.
    """

    node_id: str
    address: str
    model_sha256: str
    architecture: str
    n_layer: int
    layers: LayerRange
    engine: str = "ggml"
    backend: str = "cpu"
    decode_tokens_per_s: float = 0.0
    active_sessions: int = 0
    max_sessions: int = 16
    relayed: bool = False
    data_address: str = ""          # raw-TCP step data plane ("" = steps over gRPC)
    instance: str = ""              # the node process (NodeInfo.instance; "" = the node did not say)
    n_ctx: int = 0                  # tokens a session may hold on the node (0 = the node did not say)
    numerics: str = ""              # what decides the bits it computes (NodeInfo.numerics; "" = not said)

    @property
    def saturated(self) -> bool:
        """True when the node is at (or over) its session limit."""
        return self.max_sessions > 0 and self.active_sessions >= self.max_sessions


class NoRoute(Exception):
    """No chain of nodes covers every layer of the model.

    Attributes:
        model_sha256: the model asked for.
        missing: maximal layer spans no usable node serves, in order; empty when every layer is served
            but the ranges do not chain, or when the model is unknown (no node to learn n_layer from).
        message: human-readable, names the missing spans.
    """

    def __init__(self, model_sha256: str, missing: tuple[LayerRange, ...], message: str):
        super().__init__(message)
        self.model_sha256 = model_sha256
        self.missing = missing
        self.message = message


def format_range(r: LayerRange) -> str:
    """``[start, end)``, the notation messages use for layer ranges."""
    return f"[{r.start}, {r.end})"


def _short(sha: str) -> str:
    return sha[:12] + "…" if len(sha) > 12 else sha


def hop_cost(node: NodeRecord) -> float:
    """Estimated seconds one decode token spends on ``node``'s hop (see the module docstring)."""
    speed = node.decode_tokens_per_s
    if speed > 0 and math.isfinite(speed):
        compute_s = 1.0 / speed
    else:
        compute_s = node.layers.n_layers / DEFAULT_LAYERS_PER_S
    load = 1.0
    if node.max_sessions > 0:
        # Clamp: a node over its limit should not look arbitrarily worse than one at its limit; the
        # saturation count already ranks both behind every unsaturated alternative.
        load += min(max(node.active_sessions, 0), node.max_sessions) / node.max_sessions
    overhead = HOP_OVERHEAD_S + (RELAY_OVERHEAD_S if node.relayed else 0.0)
    return overhead + compute_s * load


def _holds(node: NodeRecord, n_ctx: int) -> bool:
    """Whether ``node`` holds sessions of ``n_ctx`` tokens (a node that did not say is assumed to)."""
    return node.n_ctx == 0 or node.n_ctx >= n_ctx


def _candidates(nodes: Sequence[NodeRecord], model_sha256: str,
                exclude: Collection[str], min_n_ctx: int = 0) -> tuple[list[NodeRecord], int]:
    """The model's usable nodes (not excluded, range inside the model, holding ``min_n_ctx`` tokens) and
    the model's n_layer.

    n_layer comes from every node of the model, excluded or not, so missing spans can be named even
    when exclusion removed the only node. 0 when no node serves the model.
    """
    of_model = [n for n in nodes if n.model_sha256 == model_sha256]
    n_layer = max((n.n_layer for n in of_model), default=0)
    excluded = set(exclude)
    usable = [n for n in of_model
              if n.node_id not in excluded and n.layers.end <= n.n_layer == n_layer and _holds(n, min_n_ctx)]
    return usable, n_layer


def _uncovered(usable: Sequence[NodeRecord], n_layer: int) -> tuple[LayerRange, ...]:
    covered = [False] * n_layer
    for n in usable:
        for i in range(n.layers.start, min(n.layers.end, n_layer)):
            covered[i] = True
    spans: list[LayerRange] = []
    i = 0
    while i < n_layer:
        if covered[i]:
            i += 1
            continue
        j = i
        while j < n_layer and not covered[j]:
            j += 1
        spans.append(LayerRange(i, j))
        i = j
    return tuple(spans)


def missing_layers(nodes: Sequence[NodeRecord], model_sha256: str, n_layer: int,
                   exclude: Collection[str] = ()) -> tuple[LayerRange, ...]:
    """Maximal spans of ``[0, n_layer)`` that no node of ``model_sha256`` (outside ``exclude``) serves.

    Returns:
        The uncovered spans in layer order; empty when every layer is served by some node (which does
        not by itself mean the ranges chain into a route).
    """
    if n_layer <= 0:
        return ()
    excluded = set(exclude)
    usable = [n for n in nodes
              if n.model_sha256 == model_sha256 and n.node_id not in excluded]
    return _uncovered(usable, n_layer)


def computes_unlike(node: NodeRecord, like: Sequence[tuple[LayerRange, str]]) -> bool:
    """Whether ``node`` computes otherwise than a hop of ``like`` (``(layer range, numerics key)`` of the
    route being replaced) over some of the layers they share. A hop whose key is unknown ("") asks for
    nothing; a node that did not say its key computes unlike any known key."""
    return any(key and key != node.numerics and r.start < node.layers.end and node.layers.start < r.end
               for r, key in like)


def _cheapest_chain(usable: Sequence[NodeRecord], n_layer: int, like: Sequence[tuple[LayerRange, str]] = (),
                    avoid: Collection[str] = ()):
    """``(hops, best, by_start)``: the cheapest chain of ``usable`` from layer 0 to ``n_layer`` (None when
    none reaches it), the cheapest chain found to each boundary (``best[b] = (saturated hops, hops
    computing unlike ``like``, hops in ``avoid``, seconds, node ids, hops)``) and the nodes by first layer."""
    by_start: dict[int, list[NodeRecord]] = {}
    for n in usable:
        by_start.setdefault(n.layers.start, []).append(n)
    best: dict[int, tuple[int, int, int, float, tuple[str, ...], tuple[NodeRecord, ...]]] = {
        0: (0, 0, 0, 0.0, (), ())}
    for boundary in sorted({0, *(n.layers.start for n in usable), *(n.layers.end for n in usable)}):
        if boundary not in best or boundary == n_layer:
            continue
        sat, unlike, avoided, cost, ids, hops = best[boundary]
        for n in by_start.get(boundary, ()):
            cand = (sat + int(n.saturated), unlike + int(computes_unlike(n, like)), avoided + int(n.node_id in avoid),
                    cost + hop_cost(n), ids + (n.node_id,), hops + (n,))
            cur = best.get(n.layers.end)
            if cur is None or cand[:5] < cur[:5]:
                best[n.layers.end] = cand
    return (best[n_layer][5] if n_layer in best else None), best, by_start


def plan_route(nodes: Sequence[NodeRecord], model_sha256: str, exclude: Collection[str] = (), min_n_ctx: int = 0,
               like: Sequence[tuple[LayerRange, str]] = (), avoid: Collection[str] = ()) -> tuple[NodeRecord, ...]:
    """The cheapest chain of nodes whose ranges tile ``[0, n_layer)`` of ``model_sha256`` exactly, among
    those holding the largest context a chain offers (see the module docstring).

    Args:
        nodes: candidate nodes (any models; others are ignored).
        model_sha256: the model to route.
        exclude: node ids never to use (e.g. nodes a client just saw fail).
        min_n_ctx: tokens a session must be able to hold on every hop (0: any).
        like: ``(layer range, numerics key)`` of each hop of the route being replaced (a failover): nodes
            computing as those hops did are preferred over their layers (see the module docstring).
        avoid: node ids taken only where no chain with fewer of them serves (clients excluded them lately).

    Returns:
        The hops in layer order: hop 0 starts at layer 0, each hop ends where the next starts and the
        last ends at ``n_layer``.

    Raises:
        NoRoute: no node serves the model, some layers are served by no usable node (``missing`` names
            the spans), or every layer is served but no chain of ranges tiles the model.
    """
    usable, n_layer = _candidates(nodes, model_sha256, exclude, min_n_ctx)
    prefix = f"no complete route for model {_short(model_sha256)}"
    if n_layer <= 0:
        raise NoRoute(model_sha256, (), f"{prefix}: no registered node serves this model")
    excluded = set(exclude)
    excluded_here = sorted({n.node_id for n in nodes if n.model_sha256 == model_sha256 and n.node_id in excluded})
    note = f" (excluded: {', '.join(excluded_here)})" if excluded_here else ""
    too_small = sorted(f"{n.node_id} ({n.n_ctx})" for n in nodes if n.model_sha256 == model_sha256
                       and n.node_id not in excluded and not _holds(n, min_n_ctx))
    if too_small:
        note += f" (holding fewer than {min_n_ctx} tokens a session: {', '.join(too_small)})"

    missing = _uncovered(usable, n_layer)
    if missing:
        spans = ", ".join(format_range(r) for r in missing)
        raise NoRoute(model_sha256, missing, f"{prefix}: no node serves layers {spans}{note}")

    # The widest context first: each node context, largest first, that some chain of nodes holding it
    # offers (the smallest admits every node; nodes that did not say fit any).
    for width in sorted({n.n_ctx for n in usable if n.n_ctx > 0}, reverse=True)[:-1]:
        chain = _cheapest_chain([n for n in usable if _holds(n, width)], n_layer, like, avoid)[0]
        if chain is not None:
            return chain
    chain, best, by_start = _cheapest_chain(usable, n_layer, like, avoid)
    if chain is not None:
        return chain

    # Every layer is served, yet no chain reaches the end: name where the chains from layer 0 stop.
    dead_ends = sorted(b for b in best if b != n_layer and b not in by_start)
    ranges = ", ".join(f"{format_range(n.layers)} {n.node_id}"
                       for n in sorted(usable, key=lambda n: (n.layers.start, n.layers.end, n.node_id)))
    raise NoRoute(model_sha256, (),
                  f"{prefix}: every layer of [0, {n_layer}) is served but the node ranges do not chain "
                  f"(chains from layer 0 stop at layer(s) {', '.join(map(str, dead_ends))}, where no node "
                  f"starts); ranges: {ranges}{note}")
