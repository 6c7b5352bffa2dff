"""A relayed stage: a node that accepts no connections, reached through the tracker's relay.

:class:`RelayedStage` has the interface of :class:`~meshnet.client.remote.RemoteStage` (``prefill`` /
``decode`` / ``cancel`` / ``release`` / ``health``), but every call goes to the tracker's ``RelayStep``
/ ``RelayControl``, which forward it over the node's own outbound Relay stream. The node's status
codes come back unchanged, so contract statuses are results and anything else (the tracker or the
node's relay stream gone: UNAVAILABLE) raises :class:`~meshnet.client.remote.StageFailure`, which
triggers failover exactly as for a direct node.
"""

from __future__ import annotations

import grpc

from meshnet.client.remote import RemoteStage, StageFailure, _control_failure
from meshnet.contract import Outcome, Status, StepRequest, StepResult
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.relay import RELAY_NODE_METADATA
from meshnet.wire.envelope import MAX_FRAME_BYTES, WireError, replies_to_result, request_to_frames


class RelayedStage(RemoteStage):
    """One relayed node of a route.

    Args:
        node_id: the node's id (the tracker forwards by it).
        tracker_channel: a channel to the tracker the node's Relay stream is attached to.
        timeout_s: bound on each step, seconds (a node silent that long counts as failed).
    """

    def __init__(self, node_id: str, tracker_channel: grpc.Channel, timeout_s: float = 60.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        super().__init__(node_id, f"relay:{node_id}", tracker_channel, timeout_s, max_frame_bytes)
        # The tracker serves no Node service: every call must go through RelayStep / RelayControl, so a
        # direct stub would only answer UNIMPLEMENTED.
        self.stub = None
        self.tracker = pb_grpc.TrackerStub(tracker_channel)
        self._metadata = ((RELAY_NODE_METADATA, node_id),)

    def asks_health(self, decode: bool) -> bool:
        """No: a relayed step's deadline is final (see :meth:`RemoteStage.asks_health`)."""
        return False

    def _step(self, req: StepRequest, decode: bool, timeout_s: float) -> StepResult:
        # probe_s is not used: nothing is probed (see asks_health).
        frames = request_to_frames(req, decode, self.max_frame_bytes, receiver=self.forward_hop())
        try:
            # The tracker waits for the node only as long as this call's deadline leaves it.
            replies = self.tracker.RelayStep(iter(frames), timeout=timeout_s, metadata=self._metadata)
            return replies_to_result(replies)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # gRPC's "Deadline Exceeded" named no wait
                raise StageFailure(self.node_id, self.address, "DEADLINE_EXCEEDED", f"no answer through the "
                                   f"tracker's relay within {timeout_s:.1f} s") from None
            return self._fail(e)  # StageFailure unless the code is a contract status
        except WireError as e:
            raise StageFailure(self.node_id, self.address, "DATA_LOSS", e.message) from None

    def _relay_control(self, kind: int, session_id: str = "", epoch: int = 0,
                       timeout_s: float = 5.0) -> pb.RelayControlReply:
        return self.tracker.RelayControl(pb.RelayControlRequest(node_id=self.node_id, kind=kind,
                                                                session_id=session_id, epoch=epoch),
                                         timeout=timeout_s)

    def _control_kind(self, kind: int, session_id: str, epoch: int = 0, timeout_s: float = 5.0) -> Outcome:
        try:
            self._relay_control(kind, session_id, epoch, timeout_s)
            return Outcome(Status.OK)
        except grpc.RpcError as e:
            return _control_failure(e)

    def cancel(self, session_id: str) -> Outcome:
        return self._control_kind(pb.RelayDown.CANCEL, session_id)

    def release(self, session_id: str, superseded_by: int = 0, timeout_s: float = 5.0) -> Outcome:
        """As :meth:`RemoteStage.release`, through the relay."""
        return self._control_kind(pb.RelayDown.RELEASE, session_id, superseded_by, timeout_s)

    def health(self, timeout_s: float = 5.0) -> pb.HealthReply:
        """The node's health. Raises grpc.RpcError (UNAVAILABLE when the node has no relay stream)."""
        return self._relay_control(pb.RelayDown.HEALTH, timeout_s=timeout_s).health

    def capabilities(self, timeout_s: float = 5.0) -> pb.Capabilities:
        """The node's capabilities, through the relay. Raises StageFailure when it does not answer."""
        try:
            return self._relay_control(pb.RelayDown.CAPABILITIES, timeout_s=timeout_s).capabilities
        except grpc.RpcError as e:
            raise self._unanswered(e) from None
