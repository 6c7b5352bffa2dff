"""A remote stage: the shard-engine contract spoken over gRPC to one node.

``RemoteStage`` has the same ``prefill`` / ``decode`` / ``cancel`` / ``release`` methods as an engine,
so the in-process chain driver works unchanged over the network. Expected engine outcomes come back as
statuses; a node that cannot be reached (dead, restarting, timed out) raises :class:`StageFailure`,
which is what triggers failover.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from meshnet.contract import Outcome, Status, StepRequest, StepResult
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.data_plane import AWAIT, ConnectionPool, DataPlaneConnection, DataPlaneError, Unanswered
from meshnet.wire.envelope import MAX_FRAME_BYTES, WireError, replies_to_result, request_to_frames
from meshnet.wire.call_problems import retry_after_s

log = logging.getLogger("meshnet.client")

# How long a node gets to answer Health when its step is overdue: one that answers is busy, not hung,
# and its step is waited for up to the stage's timeout_s; one that does not is failed over.
LIVENESS_PROBE_S = 0.5
# gRPC codes that are one of our contract statuses; everything else means the node is unusable.
_CONTRACT_CODES = {grpc.StatusCode[s.value]: s for s in Status if s is not Status.OK}


class StageFailure(Exception):
    """The node at ``address`` did not answer (``code`` is the gRPC code, e.g. UNAVAILABLE)."""

    def __init__(self, node_id: str, address: str, code: str, message: str):
        super().__init__(f"node {node_id} at {address}: {code}: {message}")
        self.node_id, self.address, self.code, self.message = node_id, address, code, message


def check_reply(hop: "RemoteStage", result: StepResult, last: bool) -> None:
    """Raise StageFailure (FAILED_PRECONDITION) when ``hop``'s successful reply is not what its place in the
    route calls for: the last hop's a sampled token, any other's hidden states. A node registered for
    layers it does not serve (or at another node's address) answers otherwise, and is failed over."""
    if last and result.token is None:
        raise StageFailure(hop.node_id, hop.address, "FAILED_PRECONDITION", "answered without a sampled token "
                           "as the route's tail: the node there does not serve the layers the route says")
    if not last and result.hidden is None:
        raise StageFailure(hop.node_id, hop.address, "FAILED_PRECONDITION", "answered without hidden states "
                           "before the route's tail: the node there does not serve the layers the route says")


class RemoteStage:
    """One node of a route. ``timeout_s`` bounds each step, seconds, unless the caller passes its own
    to :meth:`step` (a node silent that long counts as failed). A step waited on past its own timeout,
    or ``probe_s`` seconds if fewer (None: its timeout), asks the node's Health that often (see
    :meth:`step`): the client's :class:`~meshnet.client.deadline.DeadlinePolicy` gives it."""

    def __init__(self, node_id: str, address: str, channel: grpc.Channel, timeout_s: float = 60.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, data_pool: ConnectionPool | None = None,
                 probe_s: float | None = None) -> None:
        self.node_id, self.address = node_id, address
        self.probe_s = probe_s
        self.layers: tuple[int, int] | None = None  # [start, end) as routed; None when not known
        self.stub = pb_grpc.NodeStub(channel)
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.data_pool = data_pool  # steps go over the TCP data plane when the node offers one
        # The node process routed to (Hop.instance; "" = not known): another one at the same address is a
        # restart that lost every session this one held.
        self.instance = ""
        self.numerics = ""  # Hop.numerics: what decides the bits it computes ("" = not known)
        # Its last answer to :meth:`answers`: which next nodes it lately failed to forward to, as (node id,
        # data address) (see :meth:`cannot_reach`).
        self.unreachable_next: frozenset[tuple[str, str]] = frozenset()

    def _fail(self, e: grpc.RpcError) -> StepResult:
        code = e.code()
        status = _CONTRACT_CODES.get(code)
        if status is None:
            raise self._unanswered(e) from None
        return StepResult(status, message=f"{self.node_id}: {e.details()}", retry_after_s=retry_after_s(e))

    def _step_tcp(self, frames, timeout_s: float) -> StepResult:
        answer = self._call_tcp(frames, timeout_s)
        return answer if isinstance(answer, StepResult) else self._decode(answer)

    def _call_tcp(self, frames, timeout_s: float,
                  still_alive: Callable[[], bool] | None = None) -> list[pb.StepReply] | StepResult:
        """One request on the data plane: the node's reply messages, or its refusal as a StepResult.
        An answer overdue past ``timeout_s`` (or ``probe_s`` seconds, if fewer) is waited for on while
        ``still_alive()`` (default: this node answers Health), asked as often. Raises StageFailure."""
        try:
            conn = self.data_pool.acquire(timeout_s)
        except (OSError, DataPlaneError) as e:
            raise self.data_failure(*_socket_failure(e, timeout_s)) from None
        try:
            replies, error = conn.call(frames, timeout_s, still_alive or self.answers, self.timeout_s,
                                      self.probe_s)
        except (OSError, DataPlaneError) as e:
            conn.close()  # a late reply would otherwise answer the next step on this connection
            raise self.data_failure(*_socket_failure(e, timeout_s)) from None
        self.data_pool.release(conn)
        return self._refusal(error) if error is not None else replies

    def _refusal(self, error: tuple[str, float | None, str]) -> StepResult:
        """A data-plane ERROR as the contract status it names. Raises StageFailure for other codes."""
        code, retry, message = error
        status = _CONTRACT_CODES.get(grpc.StatusCode[code]) if code in grpc.StatusCode.__members__ else None
        if status is None:
            raise self.data_failure(code, message)
        return StepResult(status, message=f"{self.node_id}: {message}", retry_after_s=retry)

    def data_failure(self, code: str, message: str) -> StageFailure:
        """A failure on the node's data plane, at the node's address as its route gives it (the one ``meshnet
        nodes`` and ``--json``'s layers show), with the data plane's own in the message."""
        return StageFailure(self.node_id, self.address, code, f"data plane {self.data_pool.address}: {message}")

    def _decode(self, replies: list[pb.StepReply]) -> StepResult:
        try:
            return replies_to_result(replies)
        except WireError as e:
            raise StageFailure(self.node_id, self.address, "DATA_LOSS", e.message) from None

    def replay(self, steps: list[tuple[StepRequest, bool]], timeout_s: float | None = None) -> list[StepResult]:
        """Run ``steps`` (request, decode) in order, as a failover's replay: on the data plane all in one
        round trip (:meth:`DataPlaneConnection.call_many`), else one call each. Returns their results up
        to and including the first that is not OK. ``timeout_s`` (default the stage's) bounds each answer.
        Raises StageFailure."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self.data_pool is None:
            results = []
            for req, decode in steps:
                results.append(self.step(req, decode, timeout_s))
                if not results[-1].ok:
                    break
            return results
        receiver = self.forward_hop()
        requests = [request_to_frames(req, decode, self.max_frame_bytes, receiver=receiver) for req, decode in steps]
        try:
            conn = self.data_pool.acquire(timeout_s)
        except (OSError, DataPlaneError) as e:
            raise self.data_failure(*_socket_failure(e, timeout_s)) from None
        try:
            answers = conn.call_many(requests, timeout_s)
        except (OSError, DataPlaneError) as e:
            conn.close()
            raise self.data_failure(*_socket_failure(e, timeout_s)) from None
        results = [self._refusal(error) if error is not None else self._decode(replies) for replies, error in answers]
        if len(answers) < len(requests):
            conn.close()  # the node answers the requests after the refused one too
        else:
            self.data_pool.release(conn)
        return results

    # ---- node-to-node forwarding (see meshnet.node.forwarding) ---------------------------------
    @property
    def forwards(self) -> bool:
        """Whether steps can be forwarded to and from this node (it has a data plane this client uses)."""
        return self.data_pool is not None

    def forward_hop(self) -> pb.ForwardHop:
        """This node as a route's hop: its id, data address ("" without one) and layers (where known)."""
        hop = pb.ForwardHop(node_id=self.node_id, data_address=self.data_pool.address if self.data_pool else "")
        if self.layers is not None:
            hop.layers.start, hop.layers.end = self.layers
        return hop

    def step_forwarded(self, req: StepRequest, decode: bool, next_hops: list[pb.ForwardHop], timeout_s: float,
                       still_alive: Callable[[], bool] | None = None) -> tuple[StepResult, pb.HopFailure | None]:
        """Run ``req`` here and have this node forward its output along ``next_hops``: (this node's
        result, which holds only ``n_past``, and the failure of the next hop if it could not be reached).
        ``still_alive``: as :meth:`_call_tcp` (this node answers only once it has sent the
        output on, so a next hop that hangs holds its answer). Raises StageFailure."""
        frames = request_to_frames(req, decode, self.max_frame_bytes, next_hops, self.forward_hop())
        answer = self._call_tcp(frames, timeout_s, still_alive)
        if isinstance(answer, StepResult):
            return answer, None
        first = answer[0]
        return StepResult(Status.OK, n_past=int(first.n_past)), (first.failure if first.HasField("failure") else None)

    def await_step(self, req: StepRequest, timeout_s: float) -> "PendingStep":
        """Ask this node (the tail) for the outcome of forwarded step ``req`` before sending it to the
        head, so the answer can come as soon as the tail has it. Raises StageFailure."""
        try:
            conn = self.data_pool.acquire(timeout_s)
        except (OSError, DataPlaneError) as e:
            raise self.data_failure(*_socket_failure(e, timeout_s)) from None
        try:
            conn.send(AWAIT, [pb.AwaitStep(session_id=req.session_id, step_id=req.step_id,
                                           epoch=req.epoch).SerializeToString()], timeout_s)
        except OSError as e:
            conn.close()
            raise self.data_failure(*_socket_failure(e, timeout_s)) from None
        return PendingStep(self, conn)

    def step(self, req: StepRequest, decode: bool, timeout_s: float | None = None) -> StepResult:
        """Run one prefill (``decode`` False) or decode step, waiting at most ``timeout_s`` seconds
        (default the stage's ``timeout_s``) for the node's answer.

        A step still unanswered after ``timeout_s`` (or ``probe_s`` seconds, if fewer) is waited for
        on (up to the stage's ``timeout_s``) while the node answers a Health probe, asked as often: it
        is busy with other sessions' work, not hung. Returns the node's result (contract statuses
        included). Raises StageFailure when the node cannot be reached or does not answer in time
        (code DEADLINE_EXCEEDED)."""
        return self._step(req, decode, self.timeout_s if timeout_s is None else timeout_s)

    def _step(self, req: StepRequest, decode: bool, timeout_s: float) -> StepResult:
        frames = request_to_frames(req, decode, self.max_frame_bytes, receiver=self.forward_hop())
        if self.data_pool is not None:
            return self._step_tcp(frames, timeout_s)
        try:
            # Decode steps (one token in, one row out) fit one frame each way: unary, the cheapest call.
            # A prefill's output can exceed a frame even when its input (token ids) does not: stream.
            if decode and len(frames) == 1:
                replies = [self._unary(frames[0], timeout_s)]
            else:
                replies = self.stub.StepStream(iter(frames), timeout=timeout_s)
            return replies_to_result(replies)
        except grpc.RpcError as e:
            return self._fail(e)
        except WireError as e:  # the node answered with malformed hidden states
            raise StageFailure(self.node_id, self.address, "DATA_LOSS", e.message) from None

    def _unary(self, frame: pb.Envelope, timeout_s: float) -> pb.StepReply:
        """One unary Step that is waited for past ``timeout_s`` (up to the stage's ``timeout_s``) while
        the node still answers Health, asked every ``timeout_s`` (or ``probe_s``, if fewer) seconds.
        Raises grpc.RpcError, or StageFailure DEADLINE_EXCEEDED."""
        call = self.stub.Step.future(frame, timeout=max(timeout_s, self.timeout_s))
        every_s = timeout_s if self.probe_s is None else min(timeout_s, self.probe_s)
        start = time.monotonic()
        while True:
            try:
                return call.result(timeout=every_s)
            except grpc.FutureTimeoutError:
                waited = time.monotonic() - start
                if waited >= self.timeout_s or not self.answers():
                    call.cancel()
                    raise StageFailure(self.node_id, self.address, "DEADLINE_EXCEEDED",
                                       f"no answer within {waited:.2f}s") from None

    def asks_health(self, decode: bool) -> bool:
        """Whether a step's wait past its deadline asks this node's Health (and waits on while it answers)
        rather than giving up: on the data plane, and for a unary decode over gRPC; not for a gRPC
        stream (a prefill without a data plane)."""
        return self.data_pool is not None or decode

    def answers(self) -> bool:
        """Whether the node answers :meth:`health` within :data:`LIVENESS_PROBE_S`, healthy (alive, if
        perhaps busy; a node whose engine worker hangs or restarts answers, but not healthy), and is the
        process the route named: one restarted under the same id at the same address has lost the steps
        it was running, which nobody will answer."""
        try:
            h = self.health(LIVENESS_PROBE_S)
        except grpc.RpcError:
            return False
        if self.instance and h.instance and h.instance != self.instance:
            log.info("node %s at %s restarted since it was routed to (another process answers)", self.node_id,
                     self.address)
            return False
        self.unreachable_next = frozenset((hop.node_id, hop.data_address) for hop in h.unreachable_next_hops)
        return h.healthy

    def cannot_reach(self, hop: "RemoteStage") -> bool:
        """Whether this node's last Health answer (:meth:`answers`) says it lately failed to forward to
        ``hop`` at the data address this client's route names for it (:meth:`forward_hop`). Not where it
        failed at another address: anyone with the join token can send a step naming ``hop``'s id at a
        dead address, and that says nothing of the link this client's steps cross."""
        return (hop.node_id, hop.forward_hop().data_address) in self.unreachable_next

    def prefill(self, req: StepRequest) -> StepResult:
        return self.step(req, decode=False)

    def decode(self, req: StepRequest) -> StepResult:
        return self.step(req, decode=True)

    def cancel(self, session_id: str) -> Outcome:
        return self._control(self.stub.Cancel, pb.SessionRequest(session_id=session_id), 5.0)

    def release(self, session_id: str, superseded_by: int = 0, timeout_s: float = 5.0) -> Outcome:
        """Free the session's KV cache on the node, waiting at most ``timeout_s`` seconds.

        ``superseded_by``: 0 releases unconditionally; a route epoch releases only a session older than
        it and fences off its older steps (the client moved the session to that epoch elsewhere).
        Returns OK, or the failure (UNAVAILABLE, DEADLINE_EXCEEDED, ...) when the node did not answer."""
        return self._control(self.stub.Release, pb.SessionRequest(session_id=session_id, epoch=superseded_by),
                             timeout_s)

    @staticmethod
    def _control(rpc, request: pb.SessionRequest, timeout_s: float) -> Outcome:
        try:
            rpc(request, timeout=timeout_s)
            return Outcome(Status.OK)
        except grpc.RpcError as e:
            return _control_failure(e)

    def health(self, timeout_s: float = 5.0) -> pb.HealthReply:
        """The node's health. Raises grpc.RpcError when it does not answer within ``timeout_s``."""
        return self.stub.Health(pb.Empty(), timeout=timeout_s)

    def capabilities(self, timeout_s: float = 5.0) -> pb.Capabilities:
        """The node's capabilities (layers, n_ctx, ...). Raises StageFailure when it does not answer."""
        try:
            return self.stub.GetCapabilities(pb.Empty(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise self._unanswered(e) from None

    def _unanswered(self, e: grpc.RpcError) -> StageFailure:
        """The StageFailure for a call the node did not answer (its gRPC code and details)."""
        return StageFailure(self.node_id, self.address, e.code().name, e.details() or "")


class PendingStep:
    """A forwarded step's outcome awaited at the tail (:meth:`RemoteStage.await_step`)."""

    def __init__(self, tail: RemoteStage, conn: DataPlaneConnection) -> None:
        self.tail, self.conn = tail, conn

    def result(self, timeout_s: float, still_alive, patience_s: float,
               watch=None) -> tuple[StepResult, pb.HopFailure | None]:
        """(the tail's result, None), or (None, the failure of the hop the step stopped at).

        Waits ``timeout_s`` seconds (or the tail's ``probe_s``, if fewer), then on as long as ``still_alive()``,
        asked as often, and at most ``patience_s`` in all; ``watch`` as
        :meth:`DataPlaneConnection.receive`'s. Raises StageFailure naming the tail when the connection
        breaks or the wait runs out, or the one ``watch`` raises."""
        tail = self.tail
        try:
            replies, error = self.conn.receive(timeout_s, still_alive, patience_s, watch, tail.probe_s)
        except (OSError, DataPlaneError) as e:
            self.conn.close()
            raise tail.data_failure(*_socket_failure(e, timeout_s)) from None
        except BaseException:
            self.conn.close()  # the answer may still come: this connection cannot be reused
            raise
        tail.data_pool.release(self.conn)
        if error is not None:
            return tail._refusal(error), None
        if replies[0].HasField("failure"):
            return None, replies[0].failure
        return tail._decode(replies), None

    def abandon(self) -> None:
        """Give up on the answer (the step failed before the tail): the connection cannot be reused."""
        self.conn.close()


def _control_failure(e: grpc.RpcError) -> Outcome:
    """A control call that got no OK: the node's answer when it is a contract status, else
    FAILED_PRECONDITION naming the transport code (a dead node holds no session any more)."""
    status = _CONTRACT_CODES.get(e.code())
    if status is not None:
        return Outcome(status, e.details() or "")
    return Outcome(Status.FAILED_PRECONDITION, f"{e.code().name}: {e.details() or ''}")


def _socket_failure(e: Exception, timeout_s: float) -> tuple[str, str]:
    """(code, message) of a data-plane failure: DEADLINE_EXCEEDED when the node stayed silent."""
    if isinstance(e, Unanswered):  # given up on after a Health probe, perhaps well before timeout_s
        return "DEADLINE_EXCEEDED", str(e)
    if isinstance(e, TimeoutError):
        return "DEADLINE_EXCEEDED", f"no answer within {timeout_s:.2f}s"
    return "UNAVAILABLE", str(e)
