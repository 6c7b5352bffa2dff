"""A relayed node's one connection: a ``Relay`` stream to the tracker, over which the tracker forwards
the node's steps and control calls (``meshnet node --relay``: the node opens no port at all).

Steps run on a pool so that cancel and release, answered on the stream's reader, never wait behind
one. After the stream breaks (tracker restart, network) the link waits for the node to be registered
again and opens a new one.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from meshnet.membership.identity import NodeIdentity
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.envelope import session_id_problem

log = logging.getLogger("meshnet.node")


class RelayLink:
    """Serves ``service`` over a Relay stream to ``tracker`` while ``registered`` is set.

    ``attached`` is set while the tracker has attached the stream (the node is reachable)."""

    def __init__(self, tracker: pb_grpc.TrackerStub, identity: NodeIdentity, node_id: str, service: NodeService,
                 registered: threading.Event, max_sessions: int) -> None:
        self.tracker, self.identity, self.node_id, self.service = tracker, identity, node_id, service
        self._registered = registered
        self.attached = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max_sessions + 2, thread_name_prefix="relay-step")
        self._call = None

    def run(self, stop: threading.Event) -> None:
        """Keep a stream open until ``stop``."""
        while not stop.is_set():
            if not self._registered.wait(0.2):
                continue
            out: queue.Queue[pb.RelayUp | None] = queue.Queue()

            def ups():
                yield pb.RelayUp(hello=self.identity.sign(pb.NodeRef(node_id=self.node_id)))
                while True:
                    up = out.get()
                    if up is None:
                        return
                    yield up

            call = self.tracker.Relay(ups())
            self._call = call
            try:
                for down in call:
                    self._dispatch(down, out)
            except grpc.RpcError as e:
                if not stop.is_set():
                    log.warning("relay stream ended: %s %s", e.code().name, e.details())
                    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        self._registered.clear()  # the tracker forgot us: membership registers again
            finally:
                self.attached.clear()
                out.put(None)
            stop.wait(0.2)

    def close(self) -> None:
        """End the current stream (call after setting the ``stop`` given to :meth:`run`)."""
        if self._call is not None:
            self._call.cancel()

    def _dispatch(self, down: pb.RelayDown, out: queue.Queue) -> None:
        kind = down.kind
        if kind == pb.RelayDown.ATTACHED:
            self.attached.set()
            log.info("relay stream attached to the tracker")
        elif kind == pb.RelayDown.STEP:
            self._pool.submit(self._step, down, out)
        else:
            out.put(self._control(down))

    def _step(self, down: pb.RelayDown, out: queue.Queue) -> None:
        try:
            res = self.service.run_step(list(down.frames))
        except Exception as e:  # noqa: BLE001 - answer the caller rather than leave it waiting
            log.exception("relayed step failed")
            out.put(pb.RelayUp(call_id=down.call_id, code="INTERNAL", message=f"node error: {e}"))
            return
        up = pb.RelayUp(call_id=down.call_id, code=res.code, message=res.message, replies=res.replies)
        if res.retry_after_s is not None:
            up.has_retry_after, up.retry_after_s = True, res.retry_after_s
        out.put(up)

    def _control(self, down: pb.RelayDown) -> pb.RelayUp:
        up = pb.RelayUp(call_id=down.call_id, code="OK")
        kind = down.kind
        if kind in (pb.RelayDown.CANCEL, pb.RelayDown.RELEASE) and (problem := session_id_problem(down.session_id)):
            up.code, up.message = "INVALID_ARGUMENT", problem  # as Cancel and Release over gRPC refuse it
        elif kind == pb.RelayDown.CANCEL:
            self.service.engine.cancel(down.session_id)
        elif kind == pb.RelayDown.RELEASE:
            self.service.release(down.session_id, down.epoch)
        elif kind == pb.RelayDown.HEALTH:
            up.health.CopyFrom(self.service.Health(pb.Empty(), None))
        elif kind == pb.RelayDown.CAPABILITIES:
            up.capabilities.CopyFrom(self.service.GetCapabilities(pb.Empty(), None))
        else:
            up.code, up.message = "INVALID_ARGUMENT", f"unknown relay call kind {kind}"
        return up
