"""Between the ledger's dataclasses and the tracker's protobuf messages."""

from __future__ import annotations

from meshnet.contract import MAX_DRAFT_TOKENS
from meshnet.ledger.store import Ledger, WorkRecord
from meshnet.proto import meshnet_pb2 as pb
from meshnet.tracker.routing import NodeRecord, format_range


def work_records(report: pb.WorkReport, node: NodeRecord) -> list[WorkRecord]:
    """The ledger records of ``report``, from the registered ``node`` (whose model and range they must
    name: a node is credited only for the layers it serves).

    Raises:
        ValueError: an item names another model or range (the message says which and what was expected).
    """
    out = []
    for item in report.items:
        if item.model_sha256 != node.model_sha256 or (item.layers.start, item.layers.end) != \
                (node.layers.start, node.layers.end):
            raise ValueError(f"node {node.node_id!r} is registered for layers {format_range(node.layers)} of model "
                             f"{node.model_sha256[:12]}, but reports a step of session {item.session_id[:64]!r} "
                             f"through [{item.layers.start}, {item.layers.end}) of model {item.model_sha256[:12]}")
        if problem := _step_problem(item, node):
            raise ValueError(f"node {node.node_id!r} reports a step of session {item.session_id[:64]!r} {problem}")
        out.append(WorkRecord(node_id=node.node_id, model_sha256=node.model_sha256, n_layer=node.n_layer,
                              session_id=item.session_id, layer_start=item.layers.start, layer_end=item.layers.end,
                              position=item.position, n_tokens=item.n_tokens, decode=item.decode))
    return out


# The context assumed for a node that registered none (an older node): more tokens than any GGUF's
# context holds. Without a bound, one report of 1000 invented prefills of 2^32-1 tokens credited such a
# node 4.3e12 tokens.
UNSAID_CONTEXT = 1 << 24


def _step_problem(item: pb.WorkItem, node: NodeRecord) -> str | None:
    """Why ``item`` cannot be a step ``node`` ran, or None: no tokens, a decode step of more tokens than a
    verification step holds, or tokens past the context the node registered (:data:`UNSAID_CONTEXT` when
    it registered none)."""
    if item.n_tokens == 0:
        return "of 0 tokens"
    if item.decode and item.n_tokens > MAX_DRAFT_TOKENS + 1:
        return f"as a decode step of {item.n_tokens} tokens (at most {MAX_DRAFT_TOKENS + 1}: one and its drafts)"
    if item.position + item.n_tokens > (n_ctx := node.n_ctx or UNSAID_CONTEXT):
        said = "it registered" if node.n_ctx else "a node that registered none is taken to hold at most"
        return (f"through positions [{item.position}, {item.position + item.n_tokens}), past the {n_ctx} "
                f"tokens of context {said}")
    return None


def ledger_reply(ledger: Ledger) -> pb.LedgerReply:
    """Every balance in ``ledger`` as a :class:`pb.LedgerReply`."""
    return pb.LedgerReply(
        nodes=[pb.NodeBalance(node_id=b.node_id, model_sha256=b.model_sha256, n_layer=b.n_layer,
                              prefill_token_layers=b.prefill_token_layers, decode_token_layers=b.decode_token_layers,
                              tokens=b.tokens, steps=b.steps, uncredited_steps=b.uncredited_steps)
               for b in ledger.node_balances()],
        clients=[pb.ClientBalance(client_id=c.client_id, delivered_tokens=c.delivered_tokens, sessions=c.sessions)
                 for c in ledger.client_balances()])
