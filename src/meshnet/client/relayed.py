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

from meshnet.client.remote import _CONTRACT_CODES, RemoteStage, StageFailure
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
        self.tracker = pb_grpc.TrackerStub(tracker_channel)
        self._metadata = ((RELAY_NODE_METADATA, node_id),)

    def _step(self, req: StepRequest, decode: bool) -> StepResult:
        frames = request_to_frames(req, decode, self.max_frame_bytes)
        try:
            replies = self.tracker.RelayStep(iter(frames), timeout=self.timeout_s, metadata=self._metadata)
            return replies_to_result(replies)
        except grpc.RpcError as e:
            return self._fail(e)  # StageFailure unless the code is a contract status
        except WireError as e:
            raise StageFailure(self.node_id, self.address, "DATA_LOSS", e.message) from None

    def _relay_control(self, kind: int, session_id: str = "") -> pb.RelayControlReply:
        return self.tracker.RelayControl(pb.RelayControlRequest(node_id=self.node_id, kind=kind,
                                                                session_id=session_id), timeout=5)

    def _control_kind(self, kind: int, session_id: str) -> Outcome:
        try:
            self._relay_control(kind, session_id)
            return Outcome(Status.OK)
        except grpc.RpcError as e:
            # A node gone from the relay holds no session any more; releasing there has nothing to do.
            return Outcome(_CONTRACT_CODES.get(e.code(), Status.FAILED_PRECONDITION), e.details() or "")

    def cancel(self, session_id: str) -> Outcome:
        return self._control_kind(pb.RelayDown.CANCEL, session_id)

    def release(self, session_id: str) -> Outcome:
        return self._control_kind(pb.RelayDown.RELEASE, session_id)

    def health(self) -> pb.HealthReply:
        """The node's health. Raises grpc.RpcError (UNAVAILABLE when the node has no relay stream)."""
        return self._relay_control(pb.RelayDown.HEALTH).health

    def capabilities(self) -> pb.Capabilities:
        """The node's capabilities. Raises grpc.RpcError like :meth:`health`."""
        return self._relay_control(pb.RelayDown.CAPABILITIES).capabilities
