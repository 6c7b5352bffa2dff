"""A remote stage: the shard-engine contract spoken over gRPC to one node.

``RemoteStage`` has the same ``prefill`` / ``decode`` / ``cancel`` / ``release`` methods as an engine,
so the in-process chain driver works unchanged over the network. Expected engine outcomes come back as
statuses; a node that cannot be reached (dead, restarting, timed out) raises :class:`StageFailure`,
which is what triggers failover.
"""

from __future__ import annotations

import grpc

from meshnet.contract import Outcome, Status, StepRequest, StepResult
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.data_plane import ConnectionPool, DataPlaneError
from meshnet.wire.envelope import MAX_FRAME_BYTES, WireError, replies_to_result, request_to_frames

# gRPC codes that are one of our contract statuses; everything else means the node is unusable.
_CONTRACT_CODES = {grpc.StatusCode[s.value]: s for s in Status if s is not Status.OK}


class StageFailure(Exception):
    """The node at ``address`` did not answer (``code`` is the gRPC code, e.g. UNAVAILABLE)."""

    def __init__(self, node_id: str, address: str, code: str, message: str):
        super().__init__(f"node {node_id} at {address}: {code}: {message}")
        self.node_id, self.address, self.code, self.message = node_id, address, code, message


class RemoteStage:
    """One node of a route. ``timeout_s`` bounds each step (a hung node counts as failed)."""

    def __init__(self, node_id: str, address: str, channel: grpc.Channel, timeout_s: float = 60.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, data_pool: ConnectionPool | None = None) -> None:
        self.node_id, self.address = node_id, address
        self.stub = pb_grpc.NodeStub(channel)
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.data_pool = data_pool  # steps go over the TCP data plane when the node offers one

    def _fail(self, e: grpc.RpcError) -> StepResult:
        code = e.code()
        status = _CONTRACT_CODES.get(code)
        if status is None:
            raise StageFailure(self.node_id, self.address, code.name, e.details() or "") from None
        retry = None
        for key, value in e.trailing_metadata() or ():
            if key == "retry-after-s":
                retry = float(value)
        return StepResult(status, message=f"{self.node_id}: {e.details()}", retry_after_s=retry)

    def _step_tcp(self, frames) -> StepResult:
        try:
            conn = self.data_pool.acquire()
        except (OSError, DataPlaneError) as e:
            raise StageFailure(self.node_id, self.data_pool.address, "UNAVAILABLE", str(e)) from None
        try:
            replies, error = conn.call(frames)
        except (OSError, DataPlaneError) as e:
            conn.close()
            raise StageFailure(self.node_id, self.data_pool.address, "UNAVAILABLE", str(e)) from None
        self.data_pool.release(conn)
        if error is not None:
            code, retry, message = error
            status = _CONTRACT_CODES.get(grpc.StatusCode[code]) if code in grpc.StatusCode.__members__ else None
            if status is None:
                raise StageFailure(self.node_id, self.data_pool.address, code, message)
            return StepResult(status, message=f"{self.node_id}: {message}", retry_after_s=retry)
        try:
            return replies_to_result(replies)
        except WireError as e:
            raise StageFailure(self.node_id, self.address, "DATA_LOSS", e.message) from None

    def _step(self, req: StepRequest, decode: bool) -> StepResult:
        frames = request_to_frames(req, decode, self.max_frame_bytes)
        if self.data_pool is not None:
            return self._step_tcp(frames)
        try:
            # Decode steps (one token in, one row out) fit one frame each way: unary, the cheapest call.
            # A prefill's output can exceed a frame even when its input (token ids) does not: stream.
            if decode and len(frames) == 1:
                replies = [self.stub.Step(frames[0], timeout=self.timeout_s)]
            else:
                replies = self.stub.StepStream(iter(frames), timeout=self.timeout_s)
            return replies_to_result(replies)
        except grpc.RpcError as e:
            return self._fail(e)
        except WireError as e:  # the node answered with malformed hidden states
            raise StageFailure(self.node_id, self.address, "DATA_LOSS", e.message) from None

    def prefill(self, req: StepRequest) -> StepResult:
        return self._step(req, decode=False)

    def decode(self, req: StepRequest) -> StepResult:
        return self._step(req, decode=True)

    def cancel(self, session_id: str) -> Outcome:
        return self._control(self.stub.Cancel, session_id)

    def release(self, session_id: str) -> Outcome:
        return self._control(self.stub.Release, session_id)

    def _control(self, rpc, session_id: str) -> Outcome:
        try:
            rpc(pb.SessionRequest(session_id=session_id), timeout=5)
            return Outcome(Status.OK)
        except grpc.RpcError as e:
            # A dead node holds no session any more; releasing there has nothing left to do.
            return Outcome(_CONTRACT_CODES.get(e.code(), Status.FAILED_PRECONDITION), e.details() or "")

    def health(self) -> pb.HealthReply:
        return self.stub.Health(pb.Empty(), timeout=5)
