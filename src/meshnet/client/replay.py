"""Rebuilding a session's KV caches on a changed route: where the replay starts and ends, and the replay.

After a failover the hops before the first changed one keep their caches (:func:`first_changed_hop`), and so
do the hops after the last one (:func:`replay_end`); the recorded steps are replayed on the hops between
(:func:`replay`): the prompt as the same prefill batch,
then each generated token as its own decode step. Where the new route serves the same layer ranges,
every replayed hop takes the inputs recorded for it, so the hops replay at the same time; otherwise hop
by hop, each one's answers the next one's inputs. Same inputs, same kernels, same batch shapes: the
rebuilt cache is bit-identical where the new hop computes as the old one did (:func:`warn_if_unlike` says
so where it does not). The routing around failed nodes is :class:`~meshnet.client.mesh_client.MeshClient`'s.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable

from meshnet.client.remote import RemoteStage, StageFailure, check_reply
from meshnet.client.router import MeshUnavailable
from meshnet.client.session_log import SessionLog, same_ranges
from meshnet.contract import Status, StepResult
from meshnet.engine.numerics import differences

log = logging.getLogger("meshnet.client")

# How long a replay waits for room on a replacement at its session or memory limit (RESOURCE_EXHAUSTED on
# the step that opens the session there): as long as a new session waits in line for room (the API's
# ADMISSION_WAIT_S). The spare's own sessions end meanwhile; failing the session at once lost its user's
# answer mid-way. Meanwhile only the opening step is tried again, at most every ROOM_PAUSE_MAX_S.
ROOM_WAIT_S = 30.0
ROOM_PAUSE_MAX_S = 4.0


class SessionLost(StageFailure):
    """A node answered NOT_FOUND for a session this client has run steps of: it serves, but lost the
    session's KV cache (its engine worker restarted, or it freed the session as idle)."""


def first_changed_hop(log_: SessionLog, hops: list[RemoteStage], exclude: set[str], lost: set[str],
                      from_head: bool) -> tuple[int, int]:
    """Where the replay on the new route ``hops`` starts: ``(first, recorded)``.

    ``first`` is the index of the first hop that changed from ``log_.hops`` (a node in ``exclude`` or
    ``lost``, restarted or not, counts as changed), no later than the intact hops (``log_.intact``) nor
    than the last hop whose inputs were recorded (of a forwarded step: the head's), nor than the head
    when the failed step was forwarded (``from_head``: any hop before the failure may have run it).
    ``recorded`` is how many leading hops have every recorded step's inputs.
    """
    old = log_.hops
    first = 0
    recorded = 1 if from_head else min((rec.through for rec in log_.steps), default=len(old))
    last = len(old) if recorded >= len(old) else recorded - 1
    while (first < min(last, len(hops), log_.intact) and old[first].node_id == hops[first].node_id
           and old[first].node_id not in exclude and old[first].node_id not in lost):
        first += 1
    return first, recorded


def replay_end(log_: SessionLog, hops: list[RemoteStage], first: int, exclude: set[str], lost: set[str]) -> int:
    """One past the last hop of the new route ``hops`` the replay rebuilds (at least ``first + 1``): the hops
    after it keep their caches. They are the old route's hops (``log_.hops``: the same node at the same
    address over the same layers), neither failed (``exclude``) nor ``lost``, nor left part-way by an earlier
    replay that failed (``log_.intact`` .. ``log_.kept_from``), so they hold every recorded step, and perhaps
    the failed one, which its retry rolls back. (A head killed under forwarding had every stage replayed
    from the token ids, one after the other: a stream of a 1000-token prompt on a 3-stage ``meshnet up``
    stopped 8.2-8.6 s, now 6.7-6.8 s, most of it the head's restart; the other stages do none of that work.)"""
    old, stop = log_.hops, first + 1
    for i in range(first, len(hops)):
        kept = (i < len(old) and (old[i].node_id, old[i].address) == (hops[i].node_id, hops[i].address)
                and getattr(old[i], "layers", None) == getattr(hops[i], "layers", None)
                and not _restarted(old[i], hops[i]))
        if (not kept or hops[i].node_id in exclude or hops[i].node_id in lost
                or log_.intact <= i < log_.kept_from):
            stop = i + 1
    return stop


def _restarted(was: RemoteStage, now: RemoteStage) -> bool:
    """Whether ``now`` is another process than ``was`` at the same address (a node restarted at a pinned
    port, ``meshnet up --node-ports`` or an operator's fixed ``--port``): it holds none of the session."""
    a, b = getattr(was, "instance", ""), getattr(now, "instance", "")
    return bool(a and b and a != b)


def free_old_copies(hops: list[RemoteStage], session_id: str, epoch: int, timeout_s: float) -> None:
    """Have each of ``hops`` (those a replay rebuilds) free its copy of the session older than ``epoch``,
    waiting ``timeout_s`` seconds for each, or its step timeout where it answers Health meanwhile. Raises
    StageFailure for a hop that did not.

    Every hop the replay reaches may hold an older copy (a node back at its old address, a release of an
    earlier failover that never landed), which would refuse the replay's first step. Fenced, these releases
    are harmless wherever no such copy exists. A node that does not answer fails the replay: it may hold a
    copy (forwarded steps reach a node the client itself has been cut off from), and the next failover
    routes around it, or through it once it answers again."""
    for hop in hops:
        out = hop.release(session_id, superseded_by=epoch, timeout_s=timeout_s)
        if not out.ok and hop.answers():
            # Alive and busy (a long prefill chunk ahead of the release in its engine): waited for as a step
            # is, up to the hop's step timeout; taken for dead, a healthy head was replaced with the rest.
            out = hop.release(session_id, superseded_by=epoch, timeout_s=hop.timeout_s)
        if not out.ok:
            raise StageFailure(hop.node_id, hop.address, "UNAVAILABLE",
                               f"could not free its old copy of the session: {out.message}")


def replay(log_: SessionLog, old: list[RemoteStage], first: int, recorded: int,
           abandon: Callable[[SessionLog], None], stop: int | None = None) -> None:
    """Replay ``log_``'s recorded steps on its (new) hops ``first`` .. ``stop`` - 1 (default: the last): all
    hops at once when they serve the ranges of ``old`` (the route before) and every step's inputs were
    recorded for them (``recorded``), else hop by hop, recording each hop's inputs as the hop before
    produces them.

    Raises:
        StageFailure: a hop failed (:class:`SessionLost` when its engine restarted meanwhile).
        MeshUnavailable: a node refused a replayed step; ``abandon(log_)`` has ended the session first.
    """
    hops = log_.hops
    stop = len(hops) if stop is None else stop
    if same_ranges(old[first:], hops[first:]) and recorded >= len(old):
        _replay_in_parallel(log_, first, stop, abandon)
        return
    # Hop by hop: what one hop answers is the next one's input.
    inputs = [rec.inputs[first] if first < len(rec.inputs) else None for rec in log_.steps]
    for i in range(first, stop):
        for rec, x in zip(log_.steps, inputs):
            rec.inputs = (rec.inputs + [None] * len(hops))[:len(hops)]
            rec.inputs[i] = x
        inputs = [res.hidden for res in _replay_hop(log_, i, abandon)]
    # A kept hop's inputs stay what it was given: the replayed hop before it may compute otherwise (a
    # replacement of other numerics), and a later replay of the kept hop must start from what it computed.
    for rec in log_.steps:
        rec.through = max(rec.through, stop)


def _replay_in_parallel(log_: SessionLog, first: int, stop: int, abandon: Callable[[SessionLog], None]) -> None:
    """Replay the recorded steps on hops ``first`` .. ``stop`` - 1 all at once, each hop from the inputs
    recorded for it (what the hop before it produced, bit for bit the same on any node with the same
    kernels), so a replay costs the slowest hop's time rather than the sum of every hop's. Raises
    StageFailure (the first hop that failed) or MeshUnavailable (a refused step)."""

    n = stop - first
    if n == 1:
        _replay_hop(log_, first, abandon)
        return
    with ThreadPoolExecutor(n, thread_name_prefix="meshnet-replay") as pool:
        futures = [pool.submit(_replay_hop, log_, i, abandon) for i in range(first, stop)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if isinstance(e, StageFailure)), errors[0])


def _replay_hop(log_: SessionLog, i: int, abandon: Callable[[SessionLog], None]) -> list[StepResult]:
    """Replay every recorded step on hop ``i`` from the inputs recorded for it, in one round trip
    (:meth:`RemoteStage.replay`); returns the hop's results. Raises StageFailure (SessionLost when
    its engine restarted meanwhile) or MeshUnavailable (a refused step)."""
    hop = log_.hops[i]
    steps = [(replace(rec.req, epoch=log_.epoch, hidden=rec.inputs[i]), rec.decode) for rec in log_.steps]
    results = hop.replay(steps)
    if results and _no_room(results[0]):
        results = _replay_once_there_is_room(log_, hop, steps, results[0])
    for res in results:
        if res.status is Status.NOT_FOUND:  # its engine restarted during the replay
            raise SessionLost(hop.node_id, hop.address, "NOT_FOUND", res.message)
        _check_replayed(log_, res, abandon)
        check_reply(hop, res, last=i == len(log_.hops) - 1)
    return results


def _replay_once_there_is_room(log_: SessionLog, hop: RemoteStage, steps: list, refused: StepResult
                               ) -> list[StepResult]:
    """``steps`` replayed on ``hop``, whose first step (the one opening the session there) was ``refused``
    for lack of room: that step alone is tried again, backing off (at least the node's retry-after), until
    it is taken, then the rest; for up to :data:`ROOM_WAIT_S`, or until the session is cancelled. Returns
    the results as :meth:`RemoteStage.replay` does (the last refusal when no room came)."""
    deadline, pause = time.monotonic() + ROOM_WAIT_S, 0.5
    while True:
        wait = max(refused.retry_after_s or 0.0, pause)
        if log_.cancelled or time.monotonic() + wait >= deadline:
            return [refused]
        log.info("session %s: %s has no room for it yet (%s); trying again in %.1f s", log_.session_id,
                 hop.node_id, refused.message, wait)
        time.sleep(wait)
        pause = min(2 * pause, ROOM_PAUSE_MAX_S)
        first = hop.replay(steps[:1])  # refused before it opened the session there: nothing to undo
        if not first or not _no_room(first[0]):
            break
        refused = first[0]
    if not first or not first[0].ok or len(steps) == 1:
        return first
    return first + hop.replay(steps[1:])


def _no_room(res: StepResult) -> bool:
    """Whether ``res`` is a refusal for lack of room (a node at its session or KV limit)."""
    return res.status is Status.RESOURCE_EXHAUSTED


def _check_replayed(log_: SessionLog, res: StepResult, abandon: Callable[[SessionLog], None]) -> None:
    """A replayed step a node refused ends the session (its hops may disagree now)."""
    if not res.ok:
        abandon(log_)
        raise MeshUnavailable(f"session {log_.session_id}: replay refused: {res.status.value} {res.message}")


def warn_if_unlike(session_id: str, old: list[RemoteStage], new: list[RemoteStage]) -> bool:
    """Say so when a replayed hop computes otherwise than the hop it replaces over the same layers (no
    spare with the same kernels, threads and weight layout was left): its rebuilt KV cache then differs in
    the last bits, and the output continues within tolerance of an uninterrupted run, not identically.
    Returns whether it said so."""
    warned = False
    for hop in new:
        for was in old:
            if (was.numerics and hop.numerics != was.numerics and was.layers and hop.layers
                    and was.layers[0] < hop.layers[1] and hop.layers[0] < was.layers[1]):
                log.warning("session %s: node %s replaces %s on layers [%d, %d) but computes otherwise (%s): "
                            "the output continues within tolerance of an uninterrupted run, not bit for bit",
                            session_id, hop.node_id, was.node_id, max(was.layers[0], hop.layers[0]),
                            min(was.layers[1], hop.layers[1]), differences(hop.numerics, was.numerics))
                warned = True
    return warned
