"""Forwarded steps, the client's side: token ids to the head, the sampled token from the tail.

The client asks the tail for the step's outcome (AWAIT) first, then sends the step to the head with
the rest of the route; the stages pass hidden states among themselves (:mod:`meshnet.node.forwarding`).
A token thus crosses S + 1 links instead of 2S, and the client never holds a hop's hidden states.

What the client cannot see, it learns from the answers: the head's reply names the next hop when it
could not be reached; the tail answers the await with the ``HopFailure`` of whichever hop refused or
could not pass the step on; a tail that breaks the connection, or a step unanswered past its deadline
while some node of the route no longer answers Health, fails that node.
"""

from __future__ import annotations

import logging
import time

import grpc

from meshnet.client.deadline import HopClocks
from meshnet.client.node_failures import WATCH_S, FoundDown, NodeFailures
from meshnet.client.remote import _CONTRACT_CODES, RemoteStage, StageFailure
from meshnet.contract import StepRequest, StepResult
from meshnet.proto import meshnet_pb2 as pb


log = logging.getLogger("meshnet.client")

# How long a client steps routes through a link that failed (see BlockedLinks) itself, seconds: each retry
# that fails again costs the sessions on it a replay, and a firewall is seldom fixed within minutes.
LINK_RETRY_S = 300.0


class BlockedLinks:
    """Links between two nodes that failed while the client reached both nodes (:class:`LinkFailure`):
    steps of a route through one are client-orchestrated until :data:`LINK_RETRY_S` has passed.
    Thread-safe enough for the client's step threads: one dict, replaced entries only."""

    def __init__(self, retry_s: float = LINK_RETRY_S) -> None:
        self.retry_s = retry_s
        self._until: dict[tuple[str, str], float] = {}  # (node before, node) -> monotonic time

    def block(self, after: str, node_id: str) -> None:
        now = time.monotonic()
        if len(self._until) >= 1024:  # node ids come and go: expired entries are not kept for good
            self._until = {k: t for k, t in self._until.items() if t > now}
        self._until[(after, node_id)] = now + self.retry_s

    def link_only(self, session_id: str, hops: list[RemoteStage], f: "LinkFailure") -> bool:
        """Whether ``f`` (a step of ``session_id`` on route ``hops``) failed only the link to its node,
        which answers this client's Health: then the link is blocked, and the caller replays the session
        and steps it itself instead of failing the node over."""
        hop = next((h for h in hops if h.node_id == f.node_id), None)
        if hop is None or not hop.answers():
            return False
        self.block(f.after, f.node_id)
        log.warning("session %s: node %s cannot reach node %s, which answers this client's health checks "
                    "(%s); this client steps routes through that link itself for %g s (open the data port of "
                    "%s to %s for node-to-node forwarding)", session_id, f.after, f.node_id, f.message,
                    self.retry_s, f.node_id, f.after)
        return True

    def blocked_now(self) -> int:
        """How many links are blocked now."""
        now = time.monotonic()
        return sum(until > now for until in list(self._until.values()))

    def blocks(self, hops: list[RemoteStage]) -> bool:
        """Whether a link between consecutive ``hops`` is blocked now."""
        if not self._until:
            return False
        now = time.monotonic()
        return any(self._until.get((a.node_id, b.node_id), 0.0) > now for a, b in zip(hops, hops[1:]))


def forwardable(hops: list[RemoteStage], blocked: BlockedLinks | None = None) -> bool:
    """Whether a step can be forwarded along ``hops``: two hops or more, each on a data plane this client
    uses (a relayed node takes client-orchestrated steps), and no link between them in ``blocked``."""
    return (len(hops) > 1 and all(getattr(h, "forwards", False) for h in hops)
            and not (blocked is not None and blocked.blocks(hops)))


def run_forwarded(hops: list[RemoteStage], req: StepRequest, decode: bool, clocks: HopClocks,
                  failures: NodeFailures | None = None) -> tuple[StepResult, RemoteStage | None]:
    """Run ``req`` (its epoch set) through ``hops`` by forwarding: (the result, the hop whose contract
    status it is, or None when OK).

    The route's deadline comes from its own clock in ``clocks`` (key ``forward:<node ids>``): the time of
    a whole forwarded step, measured like a hop's (:mod:`meshnet.client.deadline`); past it, or past
    the hops' ``probe_s`` (the client's policy) if sooner, every hop's Health is asked that often. A
    node of the route that ``failures`` records as found down after the step was sent (by another
    session's step) fails the step at once, rather than at its deadline.

    Raises:
        StageFailure: a node could not be reached, or the step went unanswered (the failure names the
            node that stopped answering Health, else the tail).
    """
    head, tail = hops[0], hops[-1]
    clock = clocks["forward:" + ">".join(h.node_id for h in hops)]
    ticket, timeout_s = clock.begin(decode, len(req.token_ids))
    t0, elapsed = time.monotonic(), None
    silent: list[RemoteStage] = []
    cut: list[tuple[RemoteStage, RemoteStage]] = []  # a hop that says it could not reach the next one

    def all_answer() -> bool:
        silent.extend(h for h in hops if not h.answers())
        if not silent:
            # A stage in the middle that could not forward tells only the tail, which it may not reach
            # either: nobody would answer the await, and every hop answering, the wait ran to the end.
            cut.extend((a, b) for a, b in zip(hops, hops[1:]) if a.cannot_reach(b))
        return not silent and not cut

    try:
        pending = tail.await_step(req, timeout_s)
        try:
            # The head answers once it has sent its output on: a next hop that hung holds it (its connect
            # and handshake time out only after the forwarder's 10 s), so every hop's Health is asked.
            res, failure = head.step_forwarded(req, decode, [h.forward_hop() for h in hops[1:]], timeout_s,
                                               all_answer)
        except StageFailure as f:
            pending.abandon()
            raise _unanswered(silent, cut, head, f) from None
        except BaseException:
            pending.abandon()
            raise
        if not res.ok or failure is not None:
            pending.abandon()
            return _stopped_at(hops, failure) if failure is not None else (res, head)

        def watch() -> None:
            found = failures.since(t0, hops) if failures is not None else None
            if found is not None:
                hop, why = found
                raise FoundDown(hop.node_id, hop.address, "UNAVAILABLE", f"found down by another step ({why})")

        try:
            # Health is asked every probe_s, not first at the deadline: steps queued behind a long prefill
            # get the ceiling as theirs, and a hop that died meanwhile would go unnoticed that long.
            res, failure = pending.result(timeout_s, all_answer, tail.timeout_s,
                                          (WATCH_S, watch) if failures is not None else None)
        except StageFailure as f:
            raise _unanswered(silent, cut, tail, f) from None
        if failure is not None:
            return _stopped_at(hops, failure)
        if res.ok:
            elapsed = time.monotonic() - t0
        return res, (None if res.ok else tail)
    finally:
        clock.end(ticket, elapsed)


def _unanswered(silent: list[RemoteStage], cut: list[tuple[RemoteStage, RemoteStage]], waited_on: RemoteStage,
                f: StageFailure) -> StageFailure:
    """The failure to report for a step ``waited_on`` left unanswered (``f``): the first hop that left
    its Health probe unanswered (``silent``), if another one; else, every hop answering, the first link a
    hop's Health says it could not forward across (``cut``; the head waited on too, which answers only
    once it has sent its output on), as a LinkFailure; else ``f``."""
    if cut and not silent:
        a, b = cut[0]
        return LinkFailure(a.node_id, b.node_id, b.address, "UNAVAILABLE",
                           f"node {a.node_id} could not forward the step to it (its Health says so), while this "
                           f"client waited on node {waited_on.node_id}: {f.message}")
    if silent and silent[0] is not waited_on:
        return StageFailure(silent[0].node_id, silent[0].address, f.code, "does not answer Health (or another "
                            f"process does: it restarted), while this client waited on node {waited_on.node_id}: "
                            + f.message)
    return f


class LinkFailure(StageFailure):
    """The hop before the node this names (``after``, a node id) could not reach its data plane: the link
    between two nodes failed, which says nothing of the node itself (a firewall that lets the client
    reach both nodes, but not one node the other)."""

    def __init__(self, after: str, node_id: str, address: str, code: str, message: str) -> None:
        super().__init__(node_id, address, code, message)
        self.after = after


def _stopped_at(hops: list[RemoteStage], failure: pb.HopFailure) -> tuple[StepResult, RemoteStage]:
    """The step stopped at the node ``failure`` names: its contract status, or StageFailure (LinkFailure
    where the hop before it could not reach it)."""
    at = next((i for i, h in enumerate(hops) if h.node_id == failure.node_id), len(hops) - 1)
    hop = hops[at]
    if failure.unreachable and at > 0:
        raise LinkFailure(hops[at - 1].node_id, hop.node_id, hop.address, failure.code, failure.message)
    code = failure.code
    status = _CONTRACT_CODES.get(grpc.StatusCode[code]) if code in grpc.StatusCode.__members__ else None
    if status is None:
        raise StageFailure(hop.node_id, hop.address, code, failure.message)
    retry = failure.retry_after_s if failure.retry_after_s >= 0 else None
    return StepResult(status, message=f"{hop.node_id}: {failure.message}", retry_after_s=retry), hop
