"""What a mesh client tells the tracker about its sessions: tokens delivered (the ledger) and activity
(the dashboard), kept apart from routing and failover.

The ledger's rule: a client is charged each token it delivers, once per position, the end-of-generation
token it stops at included; a step replayed during failover delivers nothing. Who says a token was
delivered depends on who drives the session:

- a caller stepping :class:`~meshnet.client.mesh_client.MeshClient` directly is charged what each
  step samples, a verification step's kept drafts too (:meth:`StepAccounting.stepped`);
- a session whose consumer reports what it got (a :class:`~meshnet.generation.Generation`, the API's
  reader, both through :meth:`StepAccounting.charged_by_consumer`) is charged as the consumer reports
  (:meth:`StepAccounting.delivered`): a step run ahead of a reader who found a stop sequence delivers
  nothing.
"""

from __future__ import annotations

import secrets
from typing import Callable

from meshnet.client.activity import ActivityReporter
from meshnet.arg_types import CLIENT_ID_MAX_CHARS
from meshnet.contract import StepRequest, StepResult
from meshnet.ledger.reporting import DeliveryReporter
from meshnet.speculative import accepted_prefix


class StepAccounting:
    """One client's ledger and activity reports, both sent in the background.

    Args:
        tracker: the tracker's gRPC stub.
        client_id: who the ledger charges.
        model_sha256: the model routed for.
        routes: ``() -> {session_id: (epoch, hops)}``, the sessions open now (the activity report lists
            them).
        report_deliveries / report_activity: whether to report to the ledger / the dashboard at all.
        shared_id: ``client_id`` was given by the user, so other processes may report under it too: the
            dashboard's reports then carry a suffix of this process's own (the tracker keeps one activity
            report per id, and two processes under one id replaced each other's and inflated tokens/s).
    """

    def __init__(self, tracker, client_id: str, model_sha256: str, routes: Callable[[], dict],
                 report_deliveries: bool = True, report_activity: bool = True, shared_id: bool = False) -> None:
        self.deliveries = DeliveryReporter(tracker, client_id, model_sha256) if report_deliveries else None
        suffix = f" ({secrets.token_hex(3)})"  # cut to the length the tracker takes
        shown = client_id[:CLIENT_ID_MAX_CHARS - len(suffix)] + suffix if shared_id else client_id
        self.activity = ActivityReporter(tracker, shown, model_sha256, routes) if report_activity else None
        self._consumer_charged: set[str] = set()  # sessions whose consumer reports what it got

    def opened(self, session_id: str) -> None:
        if self.activity is not None:
            self.activity.opened(session_id)

    def stepped(self, req: StepRequest, result: StepResult) -> None:
        """A step of ``req`` returned ``result`` (OK) to its caller, not as part of a replay."""
        if result.token is None:
            return
        # The position of the token this step samples (after its last row, or a verification step's first),
        # then the drafts the tail kept.
        at = req.position + (1 if req.verify else len(req.token_ids))
        if self.deliveries is not None and req.session_id not in self._consumer_charged:
            kept = accepted_prefix(req.token_ids[1:], result.tokens) if req.verify else 0
            for position in range(at, at + kept + 1):
                self.deliveries.delivered(req.session_id, position)
        if self.activity is not None:
            self.activity.delivered(req.session_id, at)

    def charged_by_consumer(self, session_id: str) -> None:
        """``session_id``'s consumer reports each token it gets (:meth:`delivered`): its steps charge
        nothing themselves (until the session ends)."""
        self._consumer_charged.add(session_id)

    def delivered(self, session_id: str, position: int) -> None:
        """The consumer of ``session_id`` got the token at ``position`` (charged once per position)."""
        if self.deliveries is not None:
            self.deliveries.delivered(session_id, position)

    def ended(self, session_id: str) -> None:
        self._consumer_charged.discard(session_id)
        if self.deliveries is not None:
            self.deliveries.session_ended(session_id)
        if self.activity is not None:
            self.activity.ended(session_id)

    def close(self) -> None:
        """Send what is pending (a bounded wait) and stop the reporting threads."""
        if self.deliveries is not None:
            self.deliveries.close()
        if self.activity is not None:
            self.activity.close()
