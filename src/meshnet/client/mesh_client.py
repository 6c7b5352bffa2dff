"""The mesh client: route sessions through remote nodes and survive a node dying mid-generation.

Data path (client-orchestrated): for each step the client sends the request to hop 0, takes the
hidden states it returns and sends them to hop 1, and so on; the tail returns a sampled token. The
client therefore sees every stage's input and records it per session. When a node fails, the client
asks the tracker for a new route (epoch + 1, excluding the dead node), keeps the hops before the first
changed one and after the last one (their KV caches are intact), and replays the recorded steps on those
between: the
prompt as the same prefill batch, then each generated token as its own decode step. Where the new
route serves the same layer ranges, every replayed hop takes the inputs recorded for it, so the hops
replay at the same time. Same inputs, same kernels, same batch shapes: the rebuilt KV cache is
bit-identical, so greedy output equals an uninterrupted run token for token (the replay:
:mod:`meshnet.client.replay`).

With ``forwarding`` on, a step whose route allows it is forwarded instead (:mod:`meshnet.client.forwarded`):
the client sends token ids to the head and gets the token from the tail, and records no hidden states,
so a failover replays such steps on every hop of the new route up to its last changed one, from the token
ids; the step retried after it says ``rollback``, since a hop kept may have run it already.

Implements the generation loop's client interface (``step`` / ``cancel`` / ``release``), like the
in-process :class:`~meshnet.chain.LocalChain`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from meshnet.client.accounting import StepAccounting
from meshnet.client.deadline import DeadlinePolicy, HopClocks
from meshnet.client.forwarded import BlockedLinks, LinkFailure, forwardable, run_forwarded
from meshnet.client.node_failures import NodeFailures
from meshnet.client.orphans import RELEASE_WAIT_S, OrphanReleaser
from meshnet.client.replay import (SessionLost, first_changed_hop, free_old_copies, replay, replay_end,
                                   warn_if_unlike)
from meshnet.client.session_log import RecordedStep, SessionLog
from meshnet.client.remote import RemoteStage, StageFailure, check_reply
from meshnet.client.router import MeshUnavailable, Router, context_length
from meshnet.ledger.reporting import new_client_id
from meshnet.contract import NamedTensor, Status, StepRequest, StepResult

log = logging.getLogger("meshnet.client")

# Steps in a row that may find one node had lost the session (each rebuilt there by a replay of the
# whole history) before the session is given up: a restarted engine worker loses it once.
MAX_LOSSES_IN_A_ROW = 4
# Seconds between failovers of one step through a node that failed it before (and answers Health again).
REPEAT_FAILURE_PAUSE_S = 0.25


class MeshClient:
    """Client for a gRPC mesh found through a tracker.

    Args:
        tracker: ``HOST:PORT`` of the tracker.
        model_sha256: which model to route for ("" = the only one served).
        step_timeout_s: the longest any one hop's step may take, seconds; a hop not yet measured gets
            this much. Once measured, a hop's deadline follows its own step times (see
            :mod:`meshnet.client.deadline`), so a hung node is failed over in seconds.
        step_deadline: how measured step times become deadlines (default: 1.5 s floor, 10x the expected
            time, ``step_timeout_s`` ceiling).
        failover_deadline_s: how long to keep looking for a replacement route before giving up with
            :class:`MeshUnavailable`.
        client_id: who the tracker's ledger charges for delivered tokens; default a random id per client.
        report_deliveries: report each delivered token to the tracker's ledger, in the background
            (what counts as delivered: :mod:`meshnet.client.accounting`).
        forwarding: forward steps node to node where the route allows (every hop on a data plane);
            client-orchestrated steps otherwise.
        report_activity: report open sessions, their routes, tokens and time to first token to the
            tracker for its dashboard (:mod:`meshnet.client.activity`), in the background.
    """

    def __init__(self, tracker: str, model_sha256: str = "", join_token: str | None = None,
                 tls_ca: str | None = None, step_timeout_s: float = 60.0, failover_deadline_s: float = 8.0,
                 client_id: str | None = None, report_deliveries: bool = True,
                 step_deadline: DeadlinePolicy | None = None, forwarding: bool = True,
                 report_activity: bool = True) -> None:
        self.failover_deadline_s = failover_deadline_s
        self.forwarding = forwarding
        self.blocked_links = BlockedLinks()
        self.clocks = HopClocks(step_deadline or DeadlinePolicy(floor_s=min(1.5, step_timeout_s),
                                                                 ceiling_s=step_timeout_s))
        self.router = Router(tracker, model_sha256, join_token, tls_ca, step_timeout_s, self.clocks.policy.probe_s)
        self._sessions: dict[str, SessionLog] = {}
        self.failovers = 0
        self.unlike_failovers = 0  # of them, onto a node computing otherwise (within tolerance, not bit for bit)
        # The route a session last took: where it opened, or where its last failover moved it.
        self.last_hops: list[RemoteStage] = []
        # Sessions left on nodes this client failed over away from, freed once those nodes answer.
        self.orphans = OrphanReleaser()
        # Nodes its steps found down: another session's step waiting on one stops at once.
        self.node_failures = NodeFailures()
        self.client_id = client_id or new_client_id()
        self.accounting = StepAccounting(self.router.tracker, self.client_id, model_sha256, self._routes,
                                         report_deliveries, report_activity, shared_id=client_id is not None)

    # ---- routing -----------------------------------------------------------------------------
    def route(self, exclude: set[str] = frozenset(), previous_epoch: int = 0, min_n_ctx: int = 0,
              like: list[RemoteStage] = (), opens_session: bool = False) -> tuple[int, list[RemoteStage]]:
        """A route from the tracker (see :meth:`Router.route`; ``opens_session``: a session opens on it,
        which the tracker counts on its nodes). Raises MeshUnavailable."""
        return self.router.route(exclude, previous_epoch, min_n_ctx, like, opens_session)

    def route_with_context(self) -> tuple[int, list[RemoteStage], int]:
        """A route and its context length in tokens (the smallest ``n_ctx`` along it: every stage must
        hold the whole session), read from each hop (through the tracker for a relayed one).

        A hop that does not answer (dead, though the tracker has not noticed yet) is excluded and the
        route asked for again, until ``failover_deadline_s`` has passed; an excluded node is let back in
        once it has recovered (see :meth:`Router.route_around`: restarted under its id, or
        answering again), so a mesh without a spare serves as soon as the node is back. One found down is
        recorded (:attr:`node_failures`): new sessions route around it too, rather than fail over from it.

        Raises:
            MeshUnavailable: no route whose every hop answers; the message names the hops left out, and why.
        """
        deadline = time.monotonic() + self.failover_deadline_s
        failures: dict[str, StageFailure] = {}  # node id -> how it failed this client (its address with it)
        while True:
            try:
                epoch, hops = self.router.route_around({node_id: f.address for node_id, f in failures.items()})
            except MeshUnavailable as e:
                refusals = [str(f) for f in failures.values() if f.code in ("UNAUTHENTICATED", "PERMISSION_DENIED")]
                if refusals and len(refusals) == len(failures):  # its join token, its CA: waiting changes nothing
                    raise MeshUnavailable(f"{e}; {'; '.join(refusals)}") from None
                if not failures:
                    raise
                if time.monotonic() >= deadline:  # which nodes were excluded, and why: the tracker lists them
                    raise MeshUnavailable(f"{e}; {'; '.join(map(str, failures.values()))}") from None
                log.info("%s; asking again", e)
                time.sleep(0.25)
                continue
            try:
                return epoch, hops, context_length(hops)
            except StageFailure as f:
                if time.monotonic() >= deadline:
                    raise MeshUnavailable(f"no route whose nodes all answer: {f}") from None
                log.warning("%s; routing around it", f)
                failures[f.node_id] = f
                self.node_failures.record_if_down(hops, f, time.monotonic())

    def new_route(self, opens_session: bool = True, wait_s: float = 0.0) -> tuple[int, list[RemoteStage]]:
        """A new session's route: around the nodes found down lately (:meth:`NodeFailures.recent`) where
        the mesh has another way, else the plain one (they may be back). ``opens_session`` False: only
        look (the API's check before it takes a request). ``wait_s``: where the tracker gave this client a
        route before, one missing now is a node between death and restart (``meshnet up`` drops a dead
        node at once and restarts it in seconds): asked again for up to this long, as a failover waits
        for a replacement. Raises MeshUnavailable."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if down := self.node_failures.recent(time.monotonic()):
                    with contextlib.suppress(MeshUnavailable):
                        return self.route(down, opens_session=opens_session)
                return self.route(opens_session=opens_session)
            except MeshUnavailable as e:
                if not self.router.had_route or time.monotonic() >= deadline:
                    raise
                log.info("%s; asking again", e)
                time.sleep(0.25)

    # ---- the client interface ----------------------------------------------------------------
    def step(self, req: StepRequest, decode: bool) -> StepResult:
        """Run one step through the session's route, failing over as needed.

        Raises:
            MeshUnavailable: a node died and no replacement route appeared before the deadline (the
                session is released on the surviving nodes first).
        """
        log_ = self._sessions.get(req.session_id)
        if log_ is None:
            if decode or req.position != 0:
                return StepResult(Status.NOT_FOUND, f"session {req.session_id!r} is not open on this client")
            self.accounting.opened(req.session_id)
            try:
                epoch, hops = self.new_route(wait_s=self.failover_deadline_s)
            except BaseException:
                self.accounting.ended(req.session_id)
                raise
            log_ = self._sessions[req.session_id] = SessionLog(req.session_id, epoch, hops)
            self.last_hops = hops
        began = time.monotonic()
        deadline: float | None = None
        forward = False  # whether the last attempt was forwarded (which hops ran it is then unknown)
        failed_at: dict[str, str] = {}  # node id -> the address it failed at: routes exclude these
        lost: set[str] = set()  # nodes that answered NOT_FOUND for this session: replayed, not excluded
        lost_this_step: set[str] = set()
        # What each hop received for this step, kept across attempts: after a failover the step resumes
        # at the first changed hop, because the hops before it already ran this step.
        step_inputs: list[NamedTensor | None] = [None] * len(log_.hops)
        start = 0
        while True:
            try:
                if deadline is not None:
                    start = self._failover(log_, failed_at, deadline, lost, from_head=forward)
                    lost.clear()
                    # A hop the replay kept may have run the failed attempt (a forwarded step reaches hops
                    # past the one that failed): the retry cuts such a hop back to where it starts.
                    req = replace(req, rollback=True) if forward else req
                    step_inputs = (step_inputs + [None] * len(log_.hops))[:len(log_.hops)]
                    # Not past a hop this step has not reached in any attempt (its input unknown): when a
                    # node fails during a replay, the first changed hop can lie beyond where the step got.
                    while start > 0 and step_inputs[start] is None:
                        start -= 1
                forward = self.forwarding and start == 0 and forwardable(log_.hops, self.blocked_links)
                if forward:
                    result = self._run_forwarded(log_, req, decode)
                else:
                    result = self._run(log_, req, decode, start, step_inputs)
                if result.ok:
                    log_.lost_in_a_row = {n: log_.lost_in_a_row.get(n, 0) + 1 for n in lost_this_step}
                    log_.steps.append(RecordedStep(replace(req, hidden=None), decode, list(step_inputs),
                                                   through=1 if forward else len(log_.hops)))
                    self.accounting.stepped(req, result)
                else:
                    self._abandon(log_)
                return result
            except SessionLost as f:
                # The node serves, but no longer holds the session (its engine restarted, or it freed the
                # session as idle): rebuild it there by replaying, like a changed hop.
                if log_.lost_in_a_row.get(f.node_id, 0) + 1 >= MAX_LOSSES_IN_A_ROW:
                    # Each replay costs the whole history: a node that frees the session again at once
                    # (an idle timeout shorter than a step, memory it keeps running out of) is given up.
                    self.release(req.session_id, fence=True)  # steps of it may still be on their way
                    raise MeshUnavailable(
                        f"session {req.session_id}: node {f.node_id} lost it {MAX_LOSSES_IN_A_ROW} steps in a row, "
                        f"each time rebuilt by a replay (it frees sessions at once: its --idle-timeout is "
                        f"shorter than a step, or its memory runs out); last: {f}")
                log.warning("session %s: %s; replaying it", req.session_id, f)
                deadline = deadline or time.monotonic() + self.failover_deadline_s
                lost.add(f.node_id)
                lost_this_step.add(f.node_id)
            except StageFailure as f:
                now, log_.last_failure = time.monotonic(), str(f)
                deadline = deadline or now + self.failover_deadline_s
                if isinstance(f, LinkFailure) and self.blocked_links.link_only(log_.session_id, log_.hops, f):
                    continue  # replayed from the head (the head ran the step), then stepped by this client
                again = f.node_id in failed_at  # it failed this step before, then answered Health again
                failed_at[f.node_id] = next((h.address for h in log_.hops if h.node_id == f.node_id), f.address)
                self.node_failures.record_if_down(log_.hops, f, now)
                if again and now >= deadline:
                    # A node that answers Health but fails every step (one that refuses this client's
                    # data-plane connections) was let back in at once, over and over, without end.
                    self._abandon(log_, {f.node_id})
                    raise MeshUnavailable(f"session {req.session_id}: still failing after "
                                          f"{self.failover_deadline_s:g} s of failovers ({now - began:.0f} s "
                                          f"into the step): {f}") from None
                log.warning("session %s: %s; failing over (up to %.0f s)", req.session_id, f, max(deadline - now, 0))
                if again:
                    time.sleep(REPEAT_FAILURE_PAUSE_S)

    def charged_by_consumer(self, session_id: str) -> None:
        """``session_id``'s consumer reports each token it gets (:meth:`delivered`): its steps charge
        nothing themselves (until the session is released)."""
        self.accounting.charged_by_consumer(session_id)

    def delivered(self, session_id: str, position: int) -> None:
        """The consumer of ``session_id``'s generation got the token at ``position``: charged to this
        client (once per position; replays deliver nothing)."""
        self.accounting.delivered(session_id, position)

    def cancel(self, session_id: str) -> None:
        log_ = self._sessions.get(session_id)
        if log_ is not None:
            log_.cancelled = True
            for hop in log_.hops:
                hop.cancel(session_id)

    def release(self, session_id: str, fence: bool = False) -> None:
        """Free the session on every hop. A hop that does not answer within :data:`RELEASE_WAIT_S` (a
        stopped or cut-off node) is left to the orphan releaser, which retries until it answers, so the
        node frees the session when it comes back instead of at its idle sweep minutes later.

        ``fence``: the session failed and steps of it may still be on their way (queued at a stalled
        node, or forwarded between nodes): each hop also refuses its steps from now on, so a late
        prefill cannot recreate it."""
        log_ = self._sessions.pop(session_id, None)
        if log_ is not None:
            for hop in log_.hops:
                self.orphans.release(hop, session_id, log_.epoch + 1, unconditional=not fence)
        self.accounting.ended(session_id)

    def close(self) -> None:
        for sid in list(self._sessions):
            self.release(sid)
        self.orphans.close()
        self.accounting.close()
        self.router.close()

    def figures(self) -> dict[str, int]:
        """This client's failovers and the like, by name (the API's ``meshnet_mesh_*`` metrics)."""
        return {"failovers": self.failovers, "unlike_failovers": self.unlike_failovers,
                "orphan_releases_pending": self.orphans.pending(), "blocked_links": self.blocked_links.blocked_now()}

    # ---- internals ---------------------------------------------------------------------------
    def _routes(self) -> dict:
        """``{session_id: (epoch, hops)}`` of the sessions open now (what the activity report lists)."""
        return {sid: (log_.epoch, list(log_.hops)) for sid, log_ in list(self._sessions.items())}

    def _run(self, log_: SessionLog, req: StepRequest, decode: bool, start: int,
             inputs: list[NamedTensor | None]) -> StepResult:
        """Run ``req`` through hops ``start..`` feeding hop ``start`` with ``inputs[start]``; fills in
        ``inputs[i]`` for the later hops as their inputs are produced. Raises StageFailure."""
        result = StepResult(Status.OK)
        x, reused = inputs[start], None
        for i in range(start, len(log_.hops)):
            inputs[i] = x
            hop = log_.hops[i]
            result = self.clocks.timed_step(hop, replace(req, epoch=log_.epoch, hidden=x), decode)
            if result.status is Status.NOT_FOUND and log_.steps:
                raise SessionLost(hop.node_id, hop.address, "NOT_FOUND", result.message)
            if not result.ok:
                return result
            result = result if reused is None else result.reused_after(reused)  # the least of the hops'
            x, reused = result.hidden, result.reused
            check_reply(hop, result, last=i == len(log_.hops) - 1)
        return result

    def _run_forwarded(self, log_: SessionLog, req: StepRequest, decode: bool) -> StepResult:
        """Run ``req`` through the route by forwarding (see :mod:`meshnet.client.forwarded`).
        Raises StageFailure."""
        result, hop = run_forwarded(log_.hops, replace(req, epoch=log_.epoch), decode, self.clocks,
                                    self.node_failures)
        if result.status is Status.NOT_FOUND and log_.steps and hop is not None:
            raise SessionLost(hop.node_id, hop.address, "NOT_FOUND", result.message)
        if result.ok:
            check_reply(log_.hops[-1], result, last=True)
        return result

    def _abandon(self, log_: SessionLog, failed: set[str] = frozenset()) -> None:
        """A refused step may have advanced earlier hops: the session cannot continue consistently.
        Hops in ``failed`` did not answer: they are released in the background, not waited for, and
        then every hop is fenced too (see :meth:`release`): a failed node may still pass on a step it
        held, e.g. a stalled head that resumes and forwards a prefill to the tail. A session refused
        with every hop answering is released without a fence: its id may be retried from position 0
        (admission retries after RESOURCE_EXHAUSTED)."""
        for hop in log_.hops:
            if hop.node_id in failed:
                self.orphans.add(hop, log_.session_id, log_.epoch + 1)
        log_.hops = [h for h in log_.hops if h.node_id not in failed]
        self.release(log_.session_id, fence=bool(failed))

    def _failover(self, log_: SessionLog, failed_at: dict[str, str], deadline: float,
                  lost: set[str] = frozenset(), from_head: bool = False) -> int:
        """Re-route (epoch + 1) around the nodes in ``failed_at`` (node id -> the address it failed at)
        and rebuild the session's KV on the changed hops by replaying the recorded steps; returns the
        index of the first changed hop. Raises StageFailure when a node fails during the replay (the
        caller fails over again) and MeshUnavailable past the deadline.

        A failed node is let back in once it has registered again at another address (a new process
        under the same id: ``meshnet up`` restarts its nodes, an operator restarts one with
        ``--node-id``) or answers healthy again at its own (a partition healed, a stopped process
        resumed, its engine worker restarted), so a mesh without a spare recovers once the node is back.
        A node back at its own address may still hold the session as it was: it is told to free that
        copy before the replay rebuilds it. Nodes in ``lost`` still serve but lost the session: they may
        stay in the route, and the replay starts at them. ``from_head``: the failed step was forwarded
        (any hop may have run it; only the head's inputs are recorded), so the replay starts at the head;
        it ends at the last changed hop either way."""
        exclude = set(failed_at)
        needed = log_.tokens_needed  # a replacement holding fewer would refuse the replay
        while True:
            try:
                # A failover opens the session on its new hops: the sessions of a dead node spread too.
                epoch, hops = self.router.route_around(failed_at, log_.epoch, needed, like=log_.hops,
                                                       opens_session=True)
                break
            except MeshUnavailable as e:
                if time.monotonic() >= deadline:
                    self._abandon(log_, exclude)
                    how = f" ({log_.last_failure})" if log_.last_failure else ""
                    raise MeshUnavailable(f"session {log_.session_id}: a node failed{how} and no replacement "
                                          f"route exists ({e})") from None
                time.sleep(0.25)
        old = log_.hops
        first, recorded = first_changed_hop(log_, hops, exclude, lost, from_head)
        stop = replay_end(log_, hops, first, exclude, lost)
        self.unlike_failovers += warn_if_unlike(log_.session_id, old, hops[first:stop])
        # Hops before `first` keep their caches; the replay starts at hop `first`'s input boundary.
        # Tiling guarantees the new hop `first` starts where the old one did, whose inputs we recorded.
        free_old_copies(hops[first:stop], log_.session_id, epoch, RELEASE_WAIT_S)
        in_route = {(h.node_id, h.address) for h in hops[first:]}
        for hop in old[first:]:
            if (hop.node_id, hop.address) in in_route:
                continue
            if hop.node_id in exclude:
                # It failed, but may only be stalled and come back holding the session's KV cache.
                self.orphans.add(hop, log_.session_id, epoch)
            else:
                # Fenced too: a late unconditional release could free a copy rebuilt there since.
                self.orphans.release(hop, log_.session_id, epoch)
        self.failovers += 1
        log_.epoch, log_.hops, log_.intact, log_.kept_from = epoch, hops, first, stop
        self.last_hops = hops
        log.info("session %s: epoch %d, replaying %d steps on hops %d..%d", log_.session_id, epoch,
                 len(log_.steps), first, stop - 1)
        replay(log_, old, first, recorded, self._abandon, stop)
        log_.intact, log_.kept_from = len(hops), 1 << 30
        return first
