"""``meshnet nodes --tracker HOST:PORT``: the nodes a tracker routes through, one line each."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from meshnet.arg_types import add_tracker_query_arg
from meshnet.secret_args import add_join_token_arg
from meshnet.engine.numerics import distinct_words
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.node_info import device_dict, record_from_info
from meshnet.tracker.routing import missing_layers
from meshnet.wire.call_problems import tracker_hint
from meshnet.wire.security import open_channel


def add_nodes_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``nodes`` subcommand to ``sub`` (``set_defaults(func=run_nodes)``)."""
    p = sub.add_parser("nodes", help="list the nodes registered with a tracker",
                       description="List the live nodes of a tracker: model (its id's first 12 hex digits), layer range, "
                                   "context (tokens a session may hold), "
                                   "load (active/max sessions), decode speed, relay status, last heartbeat "
                                   "age, gRPC address and, asked of each directly reachable node, its KV pool "
                                   "(cells held / reserved / capacity), mean rows per batched iteration and "
                                   "steps waiting with their mean time in queue. --wide adds the backend, the "
                                   "bytes of weights the node's range holds, whether it signs its messages "
                                   "with a registered key, its data-plane address and the device it computes "
                                   "on (free/total memory).")
    add_tracker_query_arg(p)
    add_join_token_arg(p)
    p.add_argument("--tls-ca", default=None, help="CA/cert to verify a TLS tracker")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-load", action="store_true", help="do not ask the nodes for their KV and batch figures")
    p.add_argument("--wide", action="store_true",
                   help="every column: also each node's backend, weights, whether it signs, its data-plane "
                        "address and its device (the table then takes about 270 columns)")
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


def node_load(address: str, join_token: str | None, tls_ca: str | None, timeout_s: float = 2.0) -> dict | None:
    """A node's KV pool, batching figures and weights from its Metrics RPC: ``{"kv_tokens_held",
    "kv_tokens_reserved", "kv_tokens_capacity", "kv_bytes", "mean_batch_rows", "max_batch_rows",
    "waiting_steps", "mean_queue_ms", "weight_bytes"}`` (``weight_bytes``: the tensors of the node's layer
    range, plus the embedding on a head and the output head on a tail); ``{"error": "CODE: details"}`` when it
    does not answer in ``timeout_s`` seconds; None when it has no address."""
    if not address:
        return None
    try:
        with open_channel(address, join_token, tls_ca) as channel:
            m = pb_grpc.NodeStub(channel).Metrics(pb.Empty(), timeout=timeout_s)
    except grpc.RpcError as e:
        return {"error": f"{e.code().name}: {e.details() or ''}".rstrip(": ")}
    return {"kv_tokens_held": m.kv_tokens_held, "kv_tokens_reserved": m.kv_tokens_reserved,
            "kv_tokens_capacity": m.kv_tokens_capacity, "kv_bytes": m.kv_bytes,
            "mean_batch_rows": round(m.batch_rows / m.iterations, 2) if m.iterations else 0.0,
            "max_batch_rows": m.max_batch_rows, "waiting_steps": m.waiting_steps,
            "mean_queue_ms": round(1000 * m.queue_seconds / m.queued_steps, 2) if m.queued_steps else 0.0,
            "weight_bytes": m.weight_bytes}


def _bytes_cell(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps a number >= 1 (``1.6 GiB``, ``512 B``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _load_cells(load: dict | None) -> tuple[str, str, str, str]:
    if load is None:
        return "-", "-", "-", "-"
    if "error" in load:
        return "unreachable", "-", "-", "-"
    return (f"{load['kv_tokens_held']}/{load['kv_tokens_reserved']}/{load['kv_tokens_capacity']}",
            f"{load['mean_batch_rows']:.1f} (max {load['max_batch_rows']})",
            f"{load['waiting_steps']} ({load['mean_queue_ms']:.1f} ms)",
            _bytes_cell(load.get("weight_bytes", 0)))


def unserved_layers(reply: pb.NodeList) -> dict[str, list[tuple[int, int]]]:
    """Model id -> the half-open spans of its layers no listed node serves, for each model with any: no
    route can exist for it until a node serves them."""
    records = [record_from_info(s.info) for s in reply.nodes]
    out = {}
    for sha in dict.fromkeys(r.model_sha256 for r in records):
        n_layer = max(r.n_layer for r in records if r.model_sha256 == sha)
        spans = missing_layers(records, sha, n_layer)
        if spans:
            out[sha] = [(r.start, r.end) for r in spans]
    return out


def unlike_replicas(reply: pb.NodeList) -> list[str]:
    """A line for each run of layers of a model that nodes computing otherwise (their numerics keys differ,
    :mod:`meshnet.engine.numerics`) both serve: a failover from one to another continues within tolerance,
    not bit for bit. Nodes that did not say their key are left out; one line per run of layers with the
    same nodes, however many replicas."""
    lines = []
    infos = [s.info for s in reply.nodes if s.info.numerics]
    for sha in dict.fromkeys(i.model.sha256 for i in infos):
        mine = [i for i in infos if i.model.sha256 == sha]
        bounds = sorted({b for i in mine for b in (i.layers.start, i.layers.end)})
        runs: list[list] = []  # [start, end, the nodes serving it]
        for a, b in zip(bounds, bounds[1:]):
            serving = tuple(i for i in mine if i.layers.start <= a and b <= i.layers.end)
            if len({i.numerics for i in serving}) < 2:
                continue
            if runs and runs[-1][1] == a and runs[-1][2] == serving:
                runs[-1][1] = b
            else:
                runs.append([a, b, serving])
        for a, b, serving in runs:
            keys = list(dict.fromkeys(i.numerics for i in serving))
            words = distinct_words(keys)
            groups = "; ".join(f"{', '.join(i.node_id for i in serving if i.numerics == k)}: {words[k]}" for k in keys)
            lines.append(f"model {sha[:12]}: layers [{a}, {b}) are served by nodes that compute otherwise "
                         f"({groups}): a failover between them continues within tolerance, not bit for bit")
    return lines


def nodes_dict(reply: pb.NodeList, loads: dict[str, dict | None] | None = None) -> dict:
    """The reply as plain data: ``{"nodes": [...]}`` (what ``--json`` prints); speed in tokens/s,
    heartbeat age in seconds; ``address`` is the node's gRPC HOST:PORT, ``data_address`` its step data
    plane's ("" when it has none: relayed, TLS or ``--no-data-plane``); ``n_ctx`` the tokens a session may
    hold there (0: an older node that does not say; routes prefer the largest a chain offers); ``version`` the node's meshnet
    release ("" from an older node), ``protocol`` its wire protocol ``MAJOR.MINOR``; ``numerics`` what decides
    the bits it computes ("" from an older node; :mod:`meshnet.engine.numerics`); ``unserved_layers``:
    :func:`unserved_layers`; ``unlike_replicas``: :func:`unlike_replicas`; ``load``: :func:`node_load`'s answer
    (``{"error": ...}`` from a node that did not answer here), null for a relayed node (not asked)."""
    return {"unserved_layers": {sha: [list(span) for span in spans] for sha, spans in unserved_layers(reply).items()},
            "unlike_replicas": unlike_replicas(reply),
            "nodes": [{"node_id": s.info.node_id, "address": s.info.address, "data_address": s.info.data_address,
                       "layers": [s.info.layers.start, s.info.layers.end], "n_layer": s.info.model.n_layer,
                       "n_ctx": s.info.n_ctx,
                       "model_sha256": s.info.model.sha256, "backend": s.info.backend,
                       "active_sessions": s.active_sessions, "max_sessions": s.info.max_sessions,
                       "decode_tokens_per_s": s.info.decode_tokens_per_s, "relay": _relay(s),
                       "device": device_dict(s.info) if s.info.HasField("device") else None,
                       "free_memory_bytes": s.info.free_memory_bytes,
                       "last_heartbeat_age_s": s.last_heartbeat_age_s, "signed": s.signed,
                       "version": s.info.version, "protocol": f"{s.info.protocol_major}.{s.info.protocol_minor}",
                       "numerics": s.info.numerics,
                       "load": (loads or {}).get(s.info.node_id)}
                      for s in reply.nodes]}


# The columns only --wide prints: what a node is, rather than how it is doing.
WIDE_ONLY = ("BACKEND", "WEIGHTS", "SIGNED", "DATA", "DEVICE")


def format_nodes(reply: pb.NodeList, loads: dict[str, dict | None] | None = None, wide: bool = False) -> str:
    """An aligned table, one row per node in layer order (its model's id shortened to 12 hex digits, as ``meshnet ledger``
    prints it), or a line saying none is registered. ``loads`` (node id ->
    :func:`node_load`) adds the KV, BATCH_ROWS, QUEUE and WEIGHTS columns ("-" for a relayed node, not asked;
    "unreachable" for one that did not answer, with a line below the table saying so).
    Without ``wide`` the :data:`WIDE_ONLY` columns are left out (the device alone takes about 80 characters).
    Below the table, a line for each model whose layers are not all served (:func:`unserved_layers`) and
    for each run of layers served by replicas that compute otherwise (:func:`unlike_replicas`)."""
    if not reply.nodes:
        return "no nodes registered"
    load_head = ("KV_HELD/RSVD/CAP", "BATCH_ROWS", "QUEUE", "WEIGHTS") if loads is not None else ()
    rows = [("NODE", "MODEL", "LAYERS", "CTX", "BACKEND", "LOAD", "SPEED", *load_head, "RELAY", "HEARTBEAT",
             "SIGNED", "ADDRESS", "DATA", "DEVICE")]
    # in route order, a model's head first: node ids (random unless given) put a tail above its head
    for s in sorted(reply.nodes, key=lambda s: (s.info.model.sha256, s.info.layers.start, s.info.layers.end,
                                                s.info.node_id)):
        i = s.info
        load = _load_cells(loads.get(i.node_id)) if loads is not None else ()
        # The model's id as the ledger prints it: a tracker may serve nodes of several models.
        rows.append((i.node_id, i.model.sha256[:12] or "-", f"[{i.layers.start}, {i.layers.end})/{i.model.n_layer}",
                     str(i.n_ctx or "-"), i.backend or "cpu",
                     f"{s.active_sessions}/{i.max_sessions}", f"{i.decode_tokens_per_s:.1f} tok/s", *load,
                     _relay(s), f"{s.last_heartbeat_age_s:.1f}s ago", "yes" if s.signed else "no", i.address,
                     i.data_address or "-", _device_cell(i)))
    if not wide:
        kept = [c for c, name in enumerate(rows[0]) if name not in WIDE_ONLY]
        rows = [tuple(r[c] for c in kept) for r in rows]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    # A node this machine cannot reach (where the tracker can: it registered) is one its clients cannot either.
    unreached = [f"node {s.info.node_id} at {s.info.address} does not answer from here ({load['error']}): clients on "
                 "this machine cannot reach it either (a node behind NAT or a firewall joins with --relay)"
                 for s in reply.nodes if "error" in (load := (loads or {}).get(s.info.node_id) or {})]
    gaps = [f"model {sha[:12]}: no node serves layers {', '.join(f'[{a}, {b})' for a, b in spans)}: no route "
            f"until one does" for sha, spans in unserved_layers(reply).items()]
    return "\n".join(["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows] + gaps
                     + unlike_replicas(reply) + unreached)


def run_nodes(args: argparse.Namespace) -> int:
    """CLI entry: 0 on success, 1 when the tracker cannot be asked (the reason goes to stderr)."""
    with open_channel(args.tracker, args.join_token, args.tls_ca) as channel:
        try:
            reply = pb_grpc.TrackerStub(channel).ListNodes(pb.Empty(), timeout=10)
        except grpc.RpcError as e:
            print(f"error: tracker {args.tracker}: {e.code().name}: {e.details()}"
                  f"{tracker_hint(e, args.tls_ca, args.tracker)}", file=sys.stderr)
            return 1
    loads = None
    if not getattr(args, "no_load", False):  # relayed nodes are reached only through the tracker: not asked
        from concurrent.futures import ThreadPoolExecutor

        direct = [s.info for s in reply.nodes if not s.info.relayed]
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(direct)))) as pool:
            answers = pool.map(lambda i: node_load(i.address, args.join_token, args.tls_ca), direct)
            loads = {s.info.node_id: None for s in reply.nodes}
            loads.update({i.node_id: a for i, a in zip(direct, answers)})
    print(json.dumps(nodes_dict(reply, loads)) if args.json else format_nodes(reply, loads, args.wide))
    return 0
