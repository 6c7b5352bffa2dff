"""``meshnet ledger --tracker HOST:PORT``: the tracker's ledger, balances per node and per client."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from meshnet.arg_types import add_tracker_query_arg
from meshnet.secret_args import add_join_token_arg
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.call_problems import tracker_hint
from meshnet.wire.security import open_channel


def add_ledger_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``ledger`` subcommand to ``sub`` (``set_defaults(func=run_ledger)``)."""
    p = sub.add_parser("ledger", help="show the tracker's ledger: work credited per node, tokens per client",
                       description="Show the tracker's ledger. Nodes are credited in token-layers (one token "
                                   "through one layer; a step replayed after a failover or resent counts "
                                   "once); TOKENS is that divided by the model's layer count. Clients are "
                                   "charged one unit per token delivered to them.")
    add_tracker_query_arg(p)
    add_join_token_arg(p)
    p.add_argument("--tls-ca", default=None, help="CA/cert to verify a TLS tracker")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run_ledger)
    return p


def ledger_dict(reply: pb.LedgerReply) -> dict:
    """The reply as plain data: ``{"nodes": [...], "clients": [...]}`` (what ``--json`` prints)."""
    return {
        "nodes": [{"node_id": n.node_id, "model_sha256": n.model_sha256, "n_layer": n.n_layer,
                   "prefill_token_layers": n.prefill_token_layers, "decode_token_layers": n.decode_token_layers,
                   "tokens": n.tokens, "steps": n.steps, "uncredited_steps": n.uncredited_steps}
                  for n in reply.nodes],
        "clients": [{"client_id": c.client_id, "delivered_tokens": c.delivered_tokens, "sessions": c.sessions}
                    for c in reply.clients],
    }


def format_ledger(reply: pb.LedgerReply) -> str:
    """Two aligned tables (nodes, then clients), or a line saying the ledger is empty."""
    lines = []
    if reply.nodes:
        rows = [("NODE", "MODEL", "PREFILL_TL", "DECODE_TL", "TOKENS", "STEPS")]
        rows += [(n.node_id, n.model_sha256[:12], str(n.prefill_token_layers), str(n.decode_token_layers),
                  f"{n.tokens:.2f}", str(n.steps)) for n in reply.nodes]
        lines += _table(rows)
    else:
        lines.append("no node work recorded")
    lines.append("")
    if reply.clients:
        rows = [("CLIENT", "DELIVERED_TOKENS", "SESSIONS")]
        rows += [(c.client_id, str(c.delivered_tokens), str(c.sessions)) for c in reply.clients]
        lines += _table(rows)
    else:
        lines.append("no deliveries recorded")
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 or i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def run_ledger(args: argparse.Namespace) -> int:
    """CLI entry: 0 on success, 1 when the tracker cannot be asked (the reason goes to stderr)."""
    with open_channel(args.tracker, args.join_token, args.tls_ca) as channel:
        try:
            reply = pb_grpc.TrackerStub(channel).GetLedger(pb.Empty(), timeout=10)
        except grpc.RpcError as e:
            print(f"error: tracker {args.tracker}: {e.code().name}: {e.details()}"
                  f"{tracker_hint(e, args.tls_ca, args.tracker)}", file=sys.stderr)
            return 1
    print(json.dumps(ledger_dict(reply)) if args.json else format_ledger(reply))
    return 0
