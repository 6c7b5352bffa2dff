"""Nodes a client's steps found down, shared by all its sessions.

A node that dies takes the steps queued on it with it. The session whose step meets the dead node first
(its forward was refused, or its deadline ran out and Health went unanswered) fails over at once; the
others, whose steps were already inside the node, would each wait out their own deadline, which grows
with the steps queued there (4-8 s at 8 concurrent streams against 1.5 s alone). With the failure
recorded here, a forwarded step whose route names that node stops waiting for it within
:data:`WATCH_S` (raising :class:`FoundDown`) and fails over too. The client records a node only when it
also fails a health probe: a node that refused a step but answers (draining, a bad request) still
finishes the steps it holds.

Only a failure recorded after a step was sent dooms it: a step sent later through the same node means
its session has found the node back (restarted at its address, resumed), and it is waited for as usual.

New sessions steer around the nodes found down in the last :data:`AVOID_S` where the mesh has another
way (:meth:`NodeFailures.recent`): a node the tracker still lists but this client cannot reach (an
``--advertise`` address only its own network resolves, a one-way partition) costs one session's failover
per window, not every session's.

Pure bookkeeping: callers pass the clock.
"""

from __future__ import annotations

import threading
from typing import Sequence

from meshnet.client.remote import StageFailure

# How often a step waiting for its outcome looks here, seconds.
WATCH_S = 0.2
# How long a failure is kept, seconds: far longer than a step is waited for.
KEEP_S = 120.0
# How long new sessions route around a node found down, seconds: long against a step's failover (about
# 1-2 s each), short enough that a node back at its address soon serves new sessions again.
AVOID_S = 30.0


class FoundDown(StageFailure):
    """A step gave up on a node that another step of the same client found down."""


class NodeFailures:
    """When each node (by id and address) was last found down (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[tuple[str, str], tuple[float, str]] = {}  # (node id, address) -> (time, why)

    def record(self, node_id: str, address: str, why: str, now: float) -> None:
        """``node_id`` at ``address`` (its gRPC address, as routes name it) was found down at ``now``."""
        with self._lock:
            self._at[(node_id, address)] = (now, why)
            for key in [k for k, (t, _) in self._at.items() if now - t > KEEP_S]:
                del self._at[key]

    def record_if_down(self, hops: Sequence, f: StageFailure, now: float) -> None:
        """Record ``f``'s node (one of ``hops``) as down if a health probe agrees: a node that refused a
        step but answers (draining, a request it will not run) finishes the steps it holds."""
        if isinstance(f, FoundDown):
            return  # recorded at its first finding
        hop = next((h for h in hops if h.node_id == f.node_id), None)
        if hop is not None and not hop.answers():
            self.record(hop.node_id, hop.address, f"{f.code}: {f.message}", now)

    def since(self, sent_at: float, hops: Sequence) -> tuple[object, str] | None:
        """The first of ``hops`` (objects with ``node_id`` and ``address``) found down after ``sent_at``,
        with why, or None."""
        with self._lock:
            if not self._at:
                return None
            for hop in hops:
                found = self._at.get((hop.node_id, hop.address))
                if found is not None and found[0] > sent_at:
                    return hop, found[1]
        return None

    def recent(self, now: float, within_s: float = AVOID_S) -> set[str]:
        """The ids of the nodes found down in the ``within_s`` seconds before ``now``."""
        with self._lock:
            return {node_id for (node_id, _), (t, _) in self._at.items() if now - t <= within_s}
