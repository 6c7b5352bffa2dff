"""The node's gRPC service: where bytes from the wire meet a shard engine.

Each call is decoded and validated as envelope frames first (:mod:`meshnet.wire.envelope`); only a
well-formed request reaches the engine, so a malformed frame never changes a session. Engine statuses
become gRPC status codes of the same name, with the engine's message; RESOURCE_EXHAUSTED carries a
``retry-after-s`` trailing metadata entry. A step the engine worker could not answer (it died, or is
being restarted) is UNAVAILABLE; any other exception out of the engine is INTERNAL.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import ssl
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import grpc

from meshnet.contract import MAX_DRAFT_TOKENS, StepRequest, StepResult
from meshnet.engine.base import ShardEngine
from meshnet.node.tensor_source import TensorRequestError, TensorSource
from meshnet.node.grpc_step_limits import StepStreamReads, unary_output_problem
from meshnet.node.forwarding import AwaitedOutcomes, Forwarder, WouldWait, await_key
from meshnet.node.route_place import RoutePlace
from meshnet.node.worker_wire import EngineUnavailable

if TYPE_CHECKING:
    from meshnet.node.worker_engine import WorkerEngine
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.envelope import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    WireError,
    bounded_failure,
    frames_to_request,
    request_to_frames,
    result_to_replies,
    session_id_problem,
)
from meshnet.wire.data_plane_conn import FRAME_CHARGE
from meshnet.wire.data_plane_server import MAX_REQUEST_BYTES
from meshnet.wire.request_budget import RequestBudget, RequestRefused, read_request
from meshnet.wire.call_problems import abort_call

log = logging.getLogger("meshnet.node")

# Steps of at most this many tokens (a decode step, or a verification step: its token and up to 16
# drafts) are carried on by the engine worker's answer itself (NodeService._start); larger ones hold a
# thread of the data plane's pool.
ASYNC_STEP_TOKENS = 1 + MAX_DRAFT_TOKENS


@dataclass
class StepOutcome:
    """What a node answers to one step: ``code`` is a gRPC status code name ("OK", "INVALID_ARGUMENT",
    "UNAVAILABLE", ...), ``replies`` the reply frames when OK."""

    code: str
    message: str = ""
    retry_after_s: float | None = None
    replies: list[pb.StepReply] = field(default_factory=list)


class NodeService(pb_grpc.NodeServicer):
    """Serves one loaded engine. ``draining`` refuses new sessions (UNAVAILABLE) while existing ones
    finish; ``node_id`` and ``model`` fill in capabilities."""

    def __init__(self, engine: ShardEngine | WorkerEngine, node_id: str, model: pb.ModelIdentity,
                 join_token: str | None = None, peer_tls: ssl.SSLContext | None = None) -> None:
        self.engine = engine
        self.node_id = node_id
        self.model = model
        # This process among all that serve under node_id at this address (NodeInfo.instance, Health).
        self.instance = secrets.token_hex(8)
        self.draining = False
        # Called as on_step(req, decode) after each step that completed (the node's ledger reporter).
        self.on_step = None
        self._in_flight = 0
        self._cv = threading.Condition()
        # Node-to-node forwarding (data plane only): where this node sends forwarded steps on, and, as a
        # tail, the outcomes its clients await.
        self.forwarder = Forwarder(join_token, tls=peer_tls)
        self.awaited = AwaitedOutcomes(StepOutcome)
        # The model's stored tensors, for peers that fetch their layers (None: a model without a file).
        self.tensors: TensorSource | None = None
        # Step requests still arriving, on gRPC and the data plane together.
        self.budget = RequestBudget()
        self._stream_reads = StepStreamReads()
        self.place = RoutePlace(engine, node_id)

    # ---- steps -------------------------------------------------------------------------------
    def run_step(self, frames) -> StepOutcome:
        """Validate frames, run the step, and say what to answer; shared by gRPC and the TCP data plane.

        A step that names ``next_hops`` (from a client, on the data plane) is forwarded once it has run
        here; the answer is then only ``n_past``, with the ``failure`` of the next hop if it could not be
        reached (the client learns the token from the tail)."""
        frames = list(frames)
        hops = frames[0].next_hops if frames else ()
        # First: a node of another range would judge the route by its own range.
        if frames and (wrong := self.place.range_error(frames[0])) is not None:
            return StepOutcome("UNAVAILABLE", wrong)  # for the client a node gone from its route: fail over
        refused = self.place.hops_error(hops)
        if refused is not None:
            return StepOutcome("INVALID_ARGUMENT", refused)
        out, req, decode, res = self._execute(frames)
        return self._reply(hops, out, req, decode, res)

    def _reply(self, hops, out: StepOutcome, req: StepRequest | None, decode: bool,
               res: StepResult | None, connect: bool = True) -> StepOutcome:
        """What to answer a client's step that ran here with ``out``, once it is forwarded to ``hops``
        (``connect``: as Forwarder.send)."""
        if not hops or out.code != "OK":
            return self._answer(out, req, res)
        reply = pb.StepReply(n_past=res.n_past)
        failure = self._forward(req, decode, res, hops, connect)
        if failure is not None:
            reply.failure.CopyFrom(failure)
        return StepOutcome("OK", replies=[reply])

    def run_forward(self, frames: list[pb.Envelope]) -> None:
        """Run a step another node forwarded (see :mod:`meshnet.node.forwarding`): pass the output on,
        or, on the tail, keep the outcome for the client's await. A refusal, or a next hop that cannot be
        reached, goes to the tail as a ``HopFailure`` (a failure note for the tail is one frame)."""
        head = frames[0]
        if head.HasField("failure"):
            # Kept for the await, up to MAX_PENDING notes for minutes: only as much of it as a note needs.
            if (problem := session_id_problem(head.session_id)) is not None:
                log.warning("dropped a failure note of a forwarded step: %s", problem)
                return
            self.awaited.deliver(await_key(head),
                                 StepOutcome("OK", replies=[pb.StepReply(failure=bounded_failure(head.failure))]))
            return
        hops = head.next_hops
        if (wrong := self.place.range_error(head)) is not None:  # the tail tells the client, which fails over
            self._pass_on(head, StepOutcome("UNAVAILABLE", wrong), None, False, None)
            return
        refused = self.place.hops_error(hops)
        if refused is not None:  # the head refuses such a route: only a misbehaving node sends it on
            log.warning("dropped a forwarded step of session %s: %s", head.session_id, refused)
            return
        out, req, decode, res = self._execute(frames)
        self._pass_on(head, out, req, decode, res)

    def start_step(self, frames: list[pb.Envelope], answer: Callable[[StepOutcome], None]) -> bool:
        """:meth:`run_step` without a thread waiting while the engine worker runs the step: ``answer``
        gets what to answer, once, on the worker channel's reading thread (see :meth:`_start`). Returns
        False, having started nothing, when the step is to run on a thread of its own."""
        def reply(head, out, req, decode, res, connect) -> None:
            try:
                outcome = self._reply(head.next_hops, out, req, decode, res, connect)
            except WouldWait:
                raise
            except Exception as e:  # noqa: BLE001 - the connection waits for an answer: it gets one
                log.exception("step of session %s failed after it ran", head.session_id)
                outcome = StepOutcome("INTERNAL", f"node {self.node_id}: {type(e).__name__}: {e}")
            answer(outcome)

        return self._start(frames, reply)

    def start_forward(self, frames: list[pb.Envelope], done: Callable[[], None]) -> bool:
        """:meth:`run_forward` without a thread waiting while the engine worker runs the step; ``done()``
        is called once the output has gone on (see :meth:`_start`). Returns False, having started
        nothing, when the step is to run on a thread of its own."""
        if frames[0].HasField("failure"):
            return False

        def carry_on(head, out, req, decode, res, connect) -> None:
            try:
                self._pass_on(head, out, req, decode, res, connect)
            except WouldWait:
                raise  # carried on again on a thread of its own, which says done
            except Exception:  # noqa: BLE001 - as run_forward's pool thread does: logged, the step dropped
                log.exception("forwarded step of session %s failed after it ran", head.session_id)
            done()

        return self._start(frames, carry_on)

    def _start(self, frames: list[pb.Envelope], then: Callable) -> bool:
        """Start a step whose engine worker's answer carries it on: ``then(head, out, req, decode, res,
        connect)`` runs on the worker channel's reading thread, so a decode step's hop costs no thread
        hand-off in this process (measured on a 3-node loopback mesh: 0.1 to 0.25 ms less CPU a token per
        node). Only small steps go this way, at most ``ASYNC_STEP_TOKENS`` tokens (a decode or verification
        step: a prefill's output, up to many MB, must not hold up the answers of other steps while it is
        sent on), and only over a pooled connection: where sending on takes a new one (``then`` raised
        WouldWait), ``then`` runs again on a thread of its own, since connecting to a node that accepts
        and then hangs takes the forwarder's timeout.

        Returns False, having started nothing, for an engine in this process (its answer would come on its
        scheduler's thread), a route to refuse, a draining node, frames that do not decode, or a larger
        step: the caller runs it on a thread of its own."""
        start = getattr(self.engine, "start_step", None)
        if start is None or self.draining or len(frames) != 1:
            return False
        head = frames[0]
        n_tokens = head.shape[0] if head.shape else len(head.token_ids)
        if (n_tokens > ASYNC_STEP_TOKENS or self.place.range_error(head) is not None
                or self.place.hops_error(head.next_hops) is not None):
            return False
        try:
            req, decode = frames_to_request(frames)
        except WireError:
            return False
        self._enter()

        def finished(res: StepResult | BaseException) -> None:
            out, res = self._settle(req, decode, res)
            try:
                then(head, out, req, decode, res, False)
            except WouldWait:
                threading.Thread(target=then, args=(head, out, req, decode, res, True), daemon=True,
                                 name="forward-connect").start()

        try:
            start(req, decode, finished)
        except EngineUnavailable as e:
            finished(e)
        return True

    def _pass_on(self, head: pb.Envelope, out: StepOutcome, req: StepRequest | None, decode: bool,
                 res: StepResult | None, connect: bool = True) -> None:
        """What follows a forwarded step (``head``, its first frame) that ran here with ``out``: its output
        goes to the next hop, or, on the tail, its outcome waits for the client's await; a refusal, or a
        next hop that cannot be reached, goes to the tail as a ``HopFailure`` (``connect``: as
        Forwarder.send). A refusal names this hop as the route does (``routed_node_id``): another process
        at its address has another id, which the client would not find in its route."""
        hops = head.next_hops
        if res is not None and head.HasField("reused_before"):
            res = res.reused_after(head.reused_before)
        if not hops:
            self.awaited.deliver(await_key(head), self._answer(out, req, res))
            return
        failure = (self._forward(req, decode, res, hops, connect) if out.code == "OK" else
                   pb.HopFailure(node_id=head.routed_node_id or self.node_id, code=out.code, message=out.message,
                                 retry_after_s=-1.0 if out.retry_after_s is None else out.retry_after_s))
        if failure is not None and (failure.node_id != hops[-1].node_id or out.code != "OK"):
            self.forwarder.report(hops[-1], head, failure, connect)

    def run_await(self, awaited: pb.AwaitStep, answer):
        """Answer ``answer(StepOutcome)`` with the outcome of the forwarded step ``awaited`` names;
        returns the function that withdraws the await (see AwaitedOutcomes.await_). A node that is not a
        tail answers at once: no forwarded step ends here (it would wait out the await's expiry)."""
        if (refused := self.place.await_error()) is not None:
            answer(StepOutcome("UNAVAILABLE", refused))
            return lambda: None
        return self.awaited.await_(await_key(awaited), answer)

    def _forward(self, req: StepRequest, decode: bool, res: StepResult, hops,
                 connect: bool = True) -> pb.HopFailure | None:
        """Send this stage's output for ``req`` to ``hops[0]`` with the rest of the route (``connect``:
        as Forwarder.send)."""
        frames = request_to_frames(replace(req, hidden=res.hidden), decode, next_hops=hops[1:], receiver=hops[0])
        if req.position == 0:  # a first step: what this stage and those before it took from prefix caches
            frames[0].reused_before = res.reused
        return self.forwarder.send(hops[0], frames, connect)

    @staticmethod
    def _answer(out: StepOutcome, req: StepRequest | None, res: StepResult | None) -> StepOutcome:
        """``out`` with the result's reply messages, when it is OK (built only for steps answered)."""
        if res is not None:
            out.replies = result_to_replies(req, res)
        return out

    def _execute(self, frames) -> tuple[StepOutcome, StepRequest | None, bool, StepResult | None]:
        """Validate and run one step: (what to answer, the request, decode, the engine's OK result).
        The request is None when the frames were refused, the result None when the step was."""
        try:
            req, decode = frames_to_request(frames)
        except WireError as e:
            return StepOutcome(e.status.value, e.message), None, False, None
        out, res = self._run(req, decode)
        return out, req, decode, res

    def _run(self, req: StepRequest, decode: bool) -> tuple[StepOutcome, StepResult | None]:
        if self.draining and req.session_id not in self.engine.session_ids():
            return StepOutcome("UNAVAILABLE", f"node {self.node_id} is draining; use another route"), None
        self._enter()
        try:
            res = self.engine.decode(req) if decode else self.engine.prefill(req)
        except Exception as e:  # noqa: BLE001 - _settle says what to answer
            res = e
        return self._settle(req, decode, res)

    def _enter(self) -> None:
        with self._cv:
            self._in_flight += 1

    def _settle(self, req: StepRequest, decode: bool,
                res: StepResult | BaseException) -> tuple[StepOutcome, StepResult | None]:
        """What to answer for a step the engine ran (``res``, or what it raised); the step has left."""
        with self._cv:
            self._in_flight -= 1
            self._cv.notify_all()
        if isinstance(res, EngineUnavailable):
            # The engine worker died during the step or is being restarted: the client fails over (or
            # comes back once the node is healthy again and replays the session here).
            return StepOutcome("UNAVAILABLE", f"node {self.node_id}: {res}"), None
        if isinstance(res, BaseException):  # an engine bug or crash must not take the server down
            log.error("engine failed on session %s", req.session_id, exc_info=res)
            return StepOutcome("INTERNAL", f"engine error: {res}"), None
        if not res.ok:
            return StepOutcome(res.status.value, res.message, res.retry_after_s), None
        if self.on_step is not None:
            self.on_step(req, decode)
        return StepOutcome("OK"), res

    def _grpc_step(self, frames, context) -> list[pb.StepReply]:
        out = self.run_step(frames)
        if out.code != "OK":
            abort_call(context, grpc.StatusCode[out.code], out.message, out.retry_after_s)
        return out.replies

    def _loaded_capabilities(self):
        """The engine's capabilities, or None while nothing is loaded (the step itself then says so)."""
        try:
            return self.engine.capabilities()
        except RuntimeError:
            return None

    def Step(self, request, context):
        caps = self._loaded_capabilities()
        if caps is not None and (problem := unary_output_problem(caps, len(request.token_ids))) is not None:
            abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        replies = self._grpc_step([request], context)
        if len(replies) > 1:
            # The step already ran (its output took more than the estimate's frames)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the step's output needs {len(replies)} frames; send it with StepStream")
        return replies[0]

    def StepStream(self, request_iterator, context):
        caps = self._loaded_capabilities()
        limit = 1 if caps is None else max(1, caps.max_sessions)
        # bounded as on the data plane: its frames were all buffered, however many came
        with self._stream_reads.reading(request_iterator, context, limit) as frames_in:
            try:
                frames, _ = read_request(frames_in, self.budget, MAX_REQUEST_BYTES, FRAME_CHARGE)
            except RequestRefused as e:
                abort_call(context, grpc.StatusCode[e.code], e.message, e.retry_after_s)
        yield from self._grpc_step(frames, context)

    # ---- session control ---------------------------------------------------------------------
    def Cancel(self, request, context):
        if problem := session_id_problem(request.session_id):  # an id no step could have opened
            abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.engine.cancel(request.session_id)
        return pb.Empty()

    def Release(self, request, context):
        # The fence a release sets is kept under the id: 4096 of 16 MB ids held 64 GB of the engine worker.
        if problem := session_id_problem(request.session_id):
            abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.release(request.session_id, request.epoch)
        return pb.Empty()

    def release(self, session_id: str, epoch: int = 0) -> None:
        """Free ``session_id``: unconditionally when ``epoch`` is 0, else only if its route epoch is
        older than ``epoch`` (its client moved it there; see ShardEngine.release_superseded)."""
        if epoch:
            self.engine.release_superseded(session_id, epoch)
        else:
            self.engine.release(session_id)

    # ---- introspection -----------------------------------------------------------------------
    def GetCapabilities(self, request, context):
        c = self.engine.capabilities()
        return pb.Capabilities(node_id=self.node_id, model=self.model,
                               layers=pb.LayerRange(start=c.artifact.layers.start, end=c.artifact.layers.end),
                               engine=c.engine, backend=c.backend, n_embd=c.n_embd, n_vocab=c.n_vocab,
                               n_ctx=c.n_ctx, is_head=c.is_head, is_tail=c.is_tail, fixture=c.fixture,
                               max_sessions=c.max_sessions, protocol_major=PROTOCOL_MAJOR,
                               protocol_minor=PROTOCOL_MINOR, residual_dims=list(c.residual_dims),
                               needs_token_ids=c.needs_token_ids)

    def Health(self, request, context):
        h = self.engine.health()
        unreachable = [pb.ForwardHop(node_id=n, data_address=a) for n, a in self.forwarder.unreachable_next()]
        return pb.HealthReply(healthy=h.healthy, active_sessions=h.active_sessions, draining=self.draining,
                              message=h.message, instance=self.instance, unreachable_next_hops=unreachable)

    def Metrics(self, request, context):
        m = self.engine.metrics()
        fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        return pb.MetricsReply(**fields)

    def FetchTensors(self, request, context):
        if self.tensors is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node serves no model file to fetch from")
        try:
            yield from self.tensors.chunks(request)
        except TensorRequestError as e:
            context.abort(grpc.StatusCode[e.code], f"FetchTensors: {e}")

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no step is running (for draining); True if idle before the timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)
