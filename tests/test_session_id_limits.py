"""Session ids and failure notes that reach a node outside a step's frames are bounded too: a failure note
(FORWARD), an await (AWAIT), Cancel and Release. Each once let a peer grow a node by gigabytes: the tail kept
failure notes of 8 MB messages and awaits of 8 MB session ids, and the engine worker kept a Release's fence
under a 16 MB session id for good."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from meshnet.contract import ArtifactId, LayerRange
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.load_spec import LoadSpec
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import AUTH, AWAIT, ERROR, HEADER, decode_error, encode_messages, recv_message
from meshnet.wire.data_plane_server import DataPlaneServer
from meshnet.wire.envelope import MAX_SESSION_ID_CHARS


def _service(layers: LayerRange = LayerRange(20, 30)) -> NodeService:
    """A node of the fake model's 30 layers, by default a tail: the node that keeps failure notes and answers
    awaits."""
    engine = FakeEngine(FakeModel())
    assert engine.load(LoadSpec(path="", artifact=ArtifactId("", layers))).ok
    return NodeService(engine, "t", pb.ModelIdentity())


def _note(session_id: str, message: str) -> pb.Envelope:
    return pb.Envelope(major=1, minor=2, session_id=session_id, epoch=1, step_id=3, n_chunks=1, byte_order="little",
                       failure=pb.HopFailure(node_id="x", code="UNAVAILABLE", message=message))


def test_a_failure_note_is_kept_cut_and_one_with_an_overlong_session_id_is_dropped():
    service = _service()
    service.run_forward([_note("s", "m" * (2 << 20))])
    got = []
    service.run_await(pb.AwaitStep(session_id="s", step_id=3, epoch=1), got.append)
    assert len(got) == 1 and 0 < len(got[0].replies[0].failure.message) <= 4096
    assert got[0].replies[0].failure.code == "UNAVAILABLE"
    service.run_forward([_note("s" * (MAX_SESSION_ID_CHARS + 1), "m")])
    assert service.awaited.pending == (0, 0)


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


@pytest.mark.parametrize("call", ["Cancel", "Release"])
def test_cancel_and_release_refuse_a_session_id_no_step_could_open(call):
    service = _service()
    context = _Context()
    with pytest.raises(_Aborted):
        getattr(service, call)(pb.SessionRequest(session_id="s" * (1 << 20), epoch=5), context)
    assert context.code is grpc.StatusCode.INVALID_ARGUMENT and "session_id of" in context.details
    assert service.engine._fences == {}
    longest = pb.SessionRequest(session_id="s" * MAX_SESSION_ID_CHARS, epoch=5)
    assert getattr(service, call)(longest, context) == pb.Empty()


@pytest.mark.parametrize("kind", [pb.RelayDown.CANCEL, pb.RelayDown.RELEASE])
def test_a_relayed_node_refuses_the_same_session_ids_from_its_relay(kind):
    """A relayed node takes cancel and release from the tracker's relay stream, which passed any id on."""
    from meshnet.membership.identity import NodeIdentity
    from meshnet.node.relay_link import RelayLink

    service = _service()
    link = RelayLink(None, NodeIdentity.generate(), "r", service, threading.Event(), max_sessions=1)
    up = link._control(pb.RelayDown(call_id=7, kind=kind, session_id="s" * (1 << 20), epoch=5))
    assert (up.call_id, up.code) == (7, "INVALID_ARGUMENT") and "session_id of 1048576 characters" in up.message
    assert service.engine._fences == {}
    assert link._control(pb.RelayDown(call_id=8, kind=kind, session_id="s", epoch=5)).code == "OK"


def _refusal(port: int, payload: bytes, header_only: bool = False) -> tuple[str, float | None, str]:
    """The refusal of an AWAIT of ``payload`` (``header_only``: only its header is sent, announcing it)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(encode_messages(AUTH, (b"",)))
        assert recv_message(s) == (AUTH, b"")
        s.sendall(HEADER.pack(len(payload), AWAIT) if header_only else encode_messages(AWAIT, (payload,)))
        kind, body = recv_message(s)
        assert kind == ERROR
        return decode_error(body)
    finally:
        s.close()


def test_an_await_of_an_overlong_session_id_is_refused_before_it_is_buffered():
    service = _service()
    server = DataPlaneServer("127.0.0.1", 0, service.run_step, run_forward=service.run_forward,
                             run_await=service.run_await)
    server.start()
    try:
        big = pb.AwaitStep(session_id="s" * (1 << 20), step_id=1, epoch=1).SerializeToString()
        code, _, message = _refusal(server.port, big, header_only=True)
        assert code == "INVALID_ARGUMENT" and "an await of" in message and server.stats["too_large"] == 1
        long = pb.AwaitStep(session_id="s" * (MAX_SESSION_ID_CHARS + 1), step_id=1, epoch=1).SerializeToString()
        code, _, message = _refusal(server.port, long)
        assert code == "INVALID_ARGUMENT" and "session_id of" in message
        assert service.awaited.pending == (0, 0)
    finally:
        server.stop()


def test_an_await_sent_to_a_node_that_is_not_a_tail_is_refused_at_once():
    """No forwarded step ends at a middle node: its await was answered only at its expiry (40 s), and the
    refusal now comes before the socket's 5 s timeout."""
    service = _service(LayerRange(10, 20))
    server = DataPlaneServer("127.0.0.1", 0, service.run_step, run_forward=service.run_forward,
                             run_await=service.run_await)
    server.start()
    try:
        code, _, message = _refusal(server.port, pb.AwaitStep(session_id="s", step_id=1, epoch=1).SerializeToString())
        assert code == "UNAVAILABLE" and "node t is not a tail (10 of the model's layers" in message
        assert service.awaited.pending == (0, 0)
    finally:
        server.stop()
