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
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from meshnet.contract import Status, StepResult
from meshnet.engine.base import ShardEngine
from meshnet.node.worker_wire import EngineUnavailable

if TYPE_CHECKING:
    from meshnet.node.worker_engine import WorkerEngine
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.envelope import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    WireError,
    frames_to_request,
    result_to_replies,
)

log = logging.getLogger("meshnet.node")


def grpc_code(status: Status) -> grpc.StatusCode:
    """Our statuses are named after gRPC's codes."""
    return grpc.StatusCode[status.value]


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

    def __init__(self, engine: ShardEngine | WorkerEngine, node_id: str, model: pb.ModelIdentity) -> None:
        self.engine = engine
        self.node_id = node_id
        self.model = model
        self.draining = False
        # Called as on_step(req, decode) after each step that completed (the node's ledger reporter).
        self.on_step = None
        self._in_flight = 0
        self._cv = threading.Condition()

    # ---- steps -------------------------------------------------------------------------------
    def run_step(self, frames) -> StepOutcome:
        """Validate frames, run the step, and say what to answer; shared by gRPC and the TCP data plane."""
        try:
            req, decode = frames_to_request(frames)
        except WireError as e:
            return StepOutcome(e.status.value, e.message)
        if self.draining and req.session_id not in self.engine.session_ids():
            return StepOutcome("UNAVAILABLE", f"node {self.node_id} is draining; use another route")
        with self._cv:
            self._in_flight += 1
        try:
            res: StepResult = self.engine.decode(req) if decode else self.engine.prefill(req)
        except EngineUnavailable as e:
            # The engine worker died during the step or is being restarted: the client fails over (or
            # comes back once the node is healthy again and replays the session here).
            return StepOutcome("UNAVAILABLE", f"node {self.node_id}: {e}")
        except Exception as e:  # an engine bug or crash must not take the server down
            log.exception("engine failed on session %s", req.session_id)
            return StepOutcome("INTERNAL", f"engine error: {e}")
        finally:
            with self._cv:
                self._in_flight -= 1
                self._cv.notify_all()
        if not res.ok:
            return StepOutcome(res.status.value, res.message, res.retry_after_s)
        if self.on_step is not None:
            self.on_step(req, decode)
        return StepOutcome("OK", replies=result_to_replies(req, res))

    def _run(self, frames, context) -> list[pb.StepReply]:
        out = self.run_step(frames)
        if out.code != "OK":
            if out.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after-s", f"{out.retry_after_s:.3f}"),))
            context.abort(grpc.StatusCode[out.code], out.message)
        return out.replies

    def Step(self, request, context):
        replies = self._run([request], context)
        if len(replies) > 1:
            # The step already ran; the caller must use StepStream for outputs this large.
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the step's output needs {len(replies)} frames; send it with StepStream")
        return replies[0]

    def StepStream(self, request_iterator, context):
        yield from self._run(request_iterator, context)

    # ---- session control ---------------------------------------------------------------------
    def Cancel(self, request, context):
        self.engine.cancel(request.session_id)
        return pb.Empty()

    def Release(self, request, context):
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
                               protocol_minor=PROTOCOL_MINOR)

    def Health(self, request, context):
        h = self.engine.health()
        return pb.HealthReply(healthy=h.healthy, active_sessions=h.active_sessions, draining=self.draining,
                              message=h.message)

    def Metrics(self, request, context):
        m = self.engine.metrics()
        fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        return pb.MetricsReply(**fields)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no step is running (for draining); True if idle before the timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)
