"""``meshnet nodes --tracker HOST:PORT``: the nodes a tracker routes through, one line each."""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.service import device_dict
from meshnet.wire.security import JOIN_TOKEN_ENV, open_channel


def add_nodes_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``nodes`` subcommand to ``sub`` (``set_defaults(func=run_nodes)``)."""
    p = sub.add_parser("nodes", help="list the nodes registered with a tracker",
                       description="List the live nodes of a tracker: layer range, backend, load (active/max "
                                   "sessions), decode speed, relay status, last heartbeat age, whether "
                                   "the node signs its messages with a registered key, its gRPC and "
                                   "data-plane addresses, and the device it computes on (free/total memory).")
    p.add_argument("--tracker", required=True, help="HOST:PORT of the tracker")
    p.add_argument("--join-token", default=os.environ.get(JOIN_TOKEN_ENV), help=f"default ${JOIN_TOKEN_ENV}")
    p.add_argument("--tls-ca", default=None, help="CA/cert to verify a TLS tracker")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run_nodes)
    return p


def _relay(status: pb.NodeStatus) -> str:
    return "relayed" if status.info.relayed else "direct"


def _device_cell(info: pb.NodeInfo) -> str:
    """``description (free/total GiB)``; ``-`` for a node that registered no device (e.g. the fake)."""
    if not info.HasField("device"):
        return "-"
    d = info.device
    gib = 1 << 30
    kernels = f" [{_kernels(d.cpu_features)}]" if d.cpu_features else ""
    return (f"{d.description or d.name}{kernels} "
            f"({info.free_memory_bytes / gib:.1f}/{d.memory_total_bytes / gib:.1f} GiB free)")


def _kernels(features) -> str:
    """The CPU kernels' features without those AVX2 implies (``AVX2``, ``AVX2 AVX512 AVX512_VNNI ...``)."""
    implied = {"SSE3", "SSSE3", "AVX", "F16C", "FMA", "BMI2"} if "AVX2" in features else set()
    return " ".join(f for f in features if f not in implied)


def nodes_dict(reply: pb.NodeList) -> dict:
    """The reply as plain data: ``{"nodes": [...]}`` (what ``--json`` prints); speed in tokens/s,
    heartbeat age in seconds; ``address`` is the node's gRPC HOST:PORT, ``data_address`` its step data
    plane's ("" when it has none: relayed, TLS or ``--no-data-plane``)."""
    return {"nodes": [{"node_id": s.info.node_id, "address": s.info.address, "data_address": s.info.data_address,
                       "layers": [s.info.layers.start, s.info.layers.end], "n_layer": s.info.model.n_layer,
                       "model_sha256": s.info.model.sha256, "backend": s.info.backend,
                       "active_sessions": s.active_sessions, "max_sessions": s.info.max_sessions,
                       "decode_tokens_per_s": s.info.decode_tokens_per_s, "relay": _relay(s),
                       "device": device_dict(s.info) if s.info.HasField("device") else None,
                       "free_memory_bytes": s.info.free_memory_bytes,
                       "last_heartbeat_age_s": s.last_heartbeat_age_s, "signed": s.signed}
                      for s in reply.nodes]}


def format_nodes(reply: pb.NodeList) -> str:
    """An aligned table, one row per node, or a line saying none is registered."""
    if not reply.nodes:
        return "no nodes registered"
    rows = [("NODE", "LAYERS", "BACKEND", "LOAD", "SPEED", "RELAY", "HEARTBEAT", "SIGNED", "ADDRESS", "DATA", "DEVICE")]
    for s in reply.nodes:
        i = s.info
        rows.append((i.node_id, f"[{i.layers.start}, {i.layers.end})/{i.model.n_layer}", i.backend or "cpu",
                     f"{s.active_sessions}/{i.max_sessions}", f"{i.decode_tokens_per_s:.1f} tok/s", _relay(s),
                     f"{s.last_heartbeat_age_s:.1f}s ago", "yes" if s.signed else "no", i.address,
                     i.data_address or "-", _device_cell(i)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run_nodes(args: argparse.Namespace) -> int:
    """CLI entry: 0 on success, 1 when the tracker cannot be asked (the reason goes to stderr)."""
    with open_channel(args.tracker, args.join_token, args.tls_ca) as channel:
        try:
            reply = pb_grpc.TrackerStub(channel).ListNodes(pb.Empty(), timeout=10)
        except grpc.RpcError as e:
            print(f"error: tracker {args.tracker}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(json.dumps(nodes_dict(reply)) if args.json else format_nodes(reply))
    return 0
