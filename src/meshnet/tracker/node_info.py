"""A node's registration (``pb.NodeInfo``) as the tracker's frozen :class:`NodeRecord` and back: the one
protobuf mapper for node records, with the checks a registration must pass."""

from __future__ import annotations

import math
import re

from meshnet.contract import LayerRange
from meshnet.membership.identity import NODE_ID_CHARS, NODE_ID_MAX_CHARS
from meshnet.wire.addresses import MAX_ADDRESS_CHARS, check_address
from meshnet.proto import meshnet_pb2 as pb
from meshnet.tracker.registry import RegisteredNode
from meshnet.tracker.routing import NodeRecord

_DEFAULT_MAX_SESSIONS = NodeRecord.__dataclass_fields__["max_sessions"].default
_MAX_NUMERICS_CHARS = 512
# The longest text each field of a registration may hold, characters, with what the refusal calls it:
# every route and node list repeats these fields, so one registration with megabytes in them made every
# route larger than gRPC's message limit and no client got a route.
_MAX_CHARS = (
    (lambda i: i.node_id, NODE_ID_MAX_CHARS, "a node id"),
    (lambda i: i.address, MAX_ADDRESS_CHARS, "an address"),
    (lambda i: i.data_address, MAX_ADDRESS_CHARS, "a data address"),
    (lambda i: i.model.sha256, 64, "a model sha256"),
    (lambda i: i.model.architecture, 64, "an architecture name"),
    (lambda i: i.engine, 64, "an engine name"),
    (lambda i: i.backend, 64, "a backend name"),
    (lambda i: i.instance, 64, "an instance id"),
    (lambda i: i.numerics, _MAX_NUMERICS_CHARS, "a numerics key"),
    (lambda i: i.version, 64, "a version string"),
    (lambda i: i.device.name, 256, "a device name"),
    (lambda i: i.device.description, 256, "a device description"),
    (lambda i: i.device.type, 64, "a device type"),
    (lambda i: ",".join(i.device.cpu_features), 2048, "a CPU feature list"),
)
_MAX_LIKE_HOPS = 1024  # a route has a hop per node at most; a model has far fewer layers than this


def record_from_info(info: pb.NodeInfo) -> NodeRecord:
    """The NodeRecord a NodeInfo describes.

    Raises:
        ValueError: naming the bad field (empty id/address/model, bad layer range, speed, a text field
            longer than its bound); the tracker answers it INVALID_ARGUMENT.
    """
    who = f"node {info.node_id[:40]!r}" if info.node_id else "node"
    if not info.node_id.strip():
        raise ValueError("Register: node_id is empty")
    if not info.address.strip():
        raise ValueError(f"Register: {who} has an empty address (expected host:port)")
    if not info.model.sha256.strip():
        raise ValueError(f"Register: {who} has an empty model sha256")
    n_layer, start, end = info.model.n_layer, info.layers.start, info.layers.end
    if n_layer == 0 or start >= end or end > n_layer:
        raise ValueError(f"Register: {who} has bad layer range [{start}, {end}) for a model of {n_layer} layers; "
                       "expected 0 <= start < end <= n_layer")
    speed = info.decode_tokens_per_s
    if not (speed >= 0 and math.isfinite(speed)):
        raise ValueError(f"Register: {who} has decode_tokens_per_s={speed}; expected a finite number >= 0")
    for field, most, what in _MAX_CHARS:
        if len(text := field(info)) > most:
            raise ValueError(f"Register: {who} has {what} of {len(text)} characters (at most {most})")
    # Ids and addresses go into logs, routes and every client's dial: a newline in an id forged lines of
    # the tracker's log, and an address nobody can dial ("not an address") was routed to.
    if not re.fullmatch(f"[{NODE_ID_CHARS}]+", info.node_id):
        raise ValueError(f"Register: node id {info.node_id[:40]!r} holds characters other than letters, digits, "
                         f"'.', '_' and '-'")
    addresses = [("data address", info.data_address)] if info.data_address else []
    if info.relayed:  # never dialled (reached through the tracker's relay under its id), only shown
        if not info.address.isprintable() or any(c.isspace() for c in info.address):
            raise ValueError(f"Register: relayed {who} has address {info.address[:80]!r}; expected "
                             f"'relay:{info.node_id}'")
    else:
        addresses.insert(0, ("address", info.address))
    for what, address in addresses:
        try:
            check_address(address)
        except ValueError as e:
            raise ValueError(f"Register: {who} has a bad {what}: {e}") from None
    return NodeRecord(node_id=info.node_id, address=info.address, model_sha256=info.model.sha256,
                      architecture=info.model.architecture, n_layer=n_layer, layers=LayerRange(start, end),
                      engine=info.engine or "ggml", backend=info.backend or "cpu", decode_tokens_per_s=speed,
                      # 0 = the node did not say: assume the engines' default limit
                      max_sessions=info.max_sessions or _DEFAULT_MAX_SESSIONS, data_address=info.data_address,
                      relayed=info.relayed, instance=info.instance, n_ctx=info.n_ctx, numerics=info.numerics)


def info_from_status(s: RegisteredNode) -> pb.NodeInfo:
    r = s.record
    return pb.NodeInfo(node_id=r.node_id, address=r.address,
                       model=pb.ModelIdentity(sha256=r.model_sha256, architecture=r.architecture, n_layer=r.n_layer),
                       layers=pb.LayerRange(start=r.layers.start, end=r.layers.end), engine=r.engine,
                       backend=r.backend, protocol_major=s.protocol_major, protocol_minor=s.protocol_minor,
                       free_memory_bytes=s.free_memory_bytes, decode_tokens_per_s=r.decode_tokens_per_s,
                       max_sessions=max(r.max_sessions, 0), data_address=r.data_address, relayed=r.relayed,
                       device=pb.DeviceInfo(**s.device) if s.device else None, version=s.version,
                       instance=r.instance, n_ctx=r.n_ctx, numerics=r.numerics)


def like_from_hops(hops) -> tuple[tuple[LayerRange, str], ...]:
    """``RouteRequest.prefer_like`` as :func:`meshnet.tracker.routing.plan_route`'s ``like``: each hop's layer
    range and numerics key.

    Raises:
        ValueError: more hops than :data:`_MAX_LIKE_HOPS`, a hop with an empty or reversed range, or a key
            over :data:`_MAX_NUMERICS_CHARS` characters (naming which).
    """
    if len(hops) > _MAX_LIKE_HOPS:
        raise ValueError(f"prefer_like has {len(hops)} hops (at most {_MAX_LIKE_HOPS})")
    out = []
    for i, h in enumerate(hops):
        if h.layers.start >= h.layers.end:
            raise ValueError(f"prefer_like[{i}] has layer range [{h.layers.start}, {h.layers.end}); "
                             "expected start < end")
        if len(h.numerics) > _MAX_NUMERICS_CHARS:
            raise ValueError(f"prefer_like[{i}] has a numerics key of {len(h.numerics)} characters "
                             f"(at most {_MAX_NUMERICS_CHARS})")
        out.append((LayerRange(h.layers.start, h.layers.end), h.numerics))
    return tuple(out)


def device_dict(info: pb.NodeInfo) -> dict:
    """``info.device`` as plain data: ``{"name", "description", "type", "memory_total_bytes", "index",
    "cpu_features"}``."""
    d = info.device
    return {"name": d.name, "description": d.description, "type": d.type,
            "memory_total_bytes": d.memory_total_bytes, "index": d.index, "cpu_features": list(d.cpu_features)}
