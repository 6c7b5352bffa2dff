"""What relayed traffic may hold of a tracker: streams that never send, steps for nodes that are not
attached, and steps larger than the tracker buffers, against a real tracker server over gRPC."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.relay import RELAY_NODE_METADATA, RelayLimits
from meshnet.tracker.server import start_tracker
from meshnet.wire.data_plane_server import MAX_REQUEST_BYTES
from meshnet.wire.security import open_channel


@pytest.fixture
def tracker():
    server, port, service = start_tracker("127.0.0.1", 0)
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.TrackerStub(channel), service
    finally:
        channel.close()
        server.stop(None)


def _silent(stop: threading.Event):
    """A request stream that sends nothing until ``stop`` is set."""
    stop.wait()
    return
    yield


def test_streams_that_never_send_cannot_take_every_thread_and_are_cancelled(tracker):
    """64 Relay / RelayStep streams that never sent a message held all of the tracker's threads: nothing,
    not even ListNodes, was answered until they ended."""
    stub, service = tracker
    service.relay_limits = RelayLimits(max_nodes=2, max_steps=1, read_s=1.0)
    stop = threading.Event()
    try:
        held = [stub.Relay(_silent(stop)) for _ in range(2)]
        time.sleep(0.3)  # both are open on the tracker
        with pytest.raises(grpc.RpcError) as ei:
            next(stub.Relay(_silent(stop), timeout=5))
        # As for a relayed node the tracker cannot reach: the client fails over or waits, with a retry-after.
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
        assert ei.value.details() == "Relay: the tracker relays for 2 nodes already; try again later"
        assert dict(ei.value.trailing_metadata())["retry-after-s"] == "1.000"
        assert stub.ListNodes(pb.Empty(), timeout=2).nodes == []
        # Past read_s without a hello, each is cancelled and its thread goes back.
        for call in held:
            with pytest.raises(grpc.RpcError) as ei:
                next(call)
            assert ei.value.code() is grpc.StatusCode.CANCELLED
        # A slot is free again: the next stream gets as far as its hello. (The cancelled handlers give their
        # slots back as their threads return, a moment after the client sees CANCELLED.)
        deadline = time.monotonic() + 5
        while True:
            with pytest.raises(grpc.RpcError) as ei:
                next(stub.Relay(iter([pb.RelayUp(hello=pb.NodeRef(node_id="x"))]), timeout=5))
            if ei.value.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert ei.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert ei.value.details() == "Relay: node 'x' sent an unsigned hello"
    finally:
        stop.set()


def test_a_step_for_a_node_that_is_not_attached_is_refused_before_its_frames_are_read(tracker):
    """Frames for a node with no relay stream were all buffered (60 x 15 MiB: the tracker grew by 1 GB)
    before the refusal."""
    stub, service = tracker
    stop = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.RelayStep(_silent(stop), metadata=((RELAY_NODE_METADATA, "nobody"),), timeout=10))
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
        assert ei.value.details() == "node nobody has no relay stream open"
        assert time.monotonic() - started < 5  # it did not wait for the stream to end (10 s deadline)
    finally:
        stop.set()
    assert service.relay_limits.buffered_bytes == 0


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self):
        self.status = None

    def set_trailing_metadata(self, metadata):
        self.trailing = metadata

    def abort(self, code, details):
        self.status = (code, details)
        raise _Aborted(details)


def test_buffered_step_frames_are_bounded_per_step_and_in_all():
    limits = RelayLimits(max_bytes=3 << 20)
    frame = pb.Envelope(payload=b"x" * (1 << 20))
    n = frame.ByteSize()
    assert limits.read_step(iter([frame, frame]), _Context()) == ([frame, frame], 2 * n)
    assert limits.buffered_bytes == 2 * n
    ctx = _Context()
    with pytest.raises(_Aborted):
        limits.read_step(iter([frame, frame]), ctx)  # a third and fourth MiB: over the 3 MiB in all
    assert ctx.status == (grpc.StatusCode.UNAVAILABLE, "RelayStep: the tracker buffers 3145728 bytes of "
                                                       "relayed steps already; try again later")
    assert limits.buffered_bytes == 2 * n  # what the refused step had taken went back
    limits.give_back(2 * n)
    assert limits.buffered_bytes == 0
    big = RelayLimits(max_bytes=1 << 40)
    huge = pb.Envelope(payload=b"y" * (16 << 20))
    ctx = _Context()
    with pytest.raises(_Aborted):
        big.read_step(iter([huge] * 17), ctx)
    assert ctx.status == (grpc.StatusCode.INVALID_ARGUMENT,
                          f"RelayStep: the request reaches {16 * huge.ByteSize()} bytes, over the limit of "
                          f"{MAX_REQUEST_BYTES} bytes a request")
    assert big.buffered_bytes == 0


def test_attached_nodes_and_steps_in_flight_have_budgets_of_their_own():
    """One budget for both let relayed nodes, attached for their whole lives, take the slots their own
    steps needed."""
    limits = RelayLimits(max_nodes=2, max_steps=1)
    with limits.stream(_Context(), "Relay"), limits.stream(_Context(), "Relay"):
        with limits.stream(_Context(), "RelayStep"):
            ctx = _Context()
            with pytest.raises(_Aborted):
                with limits.stream(ctx, "RelayStep"):
                    pass
            assert ctx.status == (grpc.StatusCode.UNAVAILABLE,
                                  "RelayStep: the tracker has 1 steps for relayed nodes in flight already; try "
                                  "again later")
        with limits.stream(_Context(), "RelayStep"):  # its slot came back
            pass


def test_relay_control_calls_have_a_budget_and_wait_a_bounded_time(tracker):
    """RelayControl had no budget and, without a deadline of its own, waited as long as the node's stream
    lived: calls to a relayed node that never answers could take every tracker thread. Its budget is its
    own: sharing the steps' let a flood of steps refuse health probes (a live node recorded as down)."""
    stub, service = tracker
    service.relay_limits = RelayLimits(max_steps=1, max_controls=1, answer_s=0.5)
    with service.relay_limits.stream(_Context(), "RelayStep"):  # the steps' budget is full: controls pass
        with service.relay_limits.stream(_Context(), "RelayControl"):
            pass
    service.relays.attach("mute")  # attached, never answers
    health = pb.RelayControlRequest(node_id="mute", kind=pb.RelayDown.HEALTH)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as ei:
        stub.RelayControl(health)  # no deadline of its own
    assert ei.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert ei.value.details() == "node mute did not answer through the relay within 0.5s"
    assert time.monotonic() - started < 3
    held = stub.RelayControl.future(health)
    time.sleep(0.2)  # on the tracker, waiting for the node: the one call slot is taken
    with pytest.raises(grpc.RpcError) as ei:
        stub.RelayControl(health, timeout=5)
    assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
    assert ei.value.details() == ("RelayControl: the tracker has 1 control calls for relayed nodes in flight "
                                  "already; try again later")
    assert dict(ei.value.trailing_metadata())["retry-after-s"] == "1.000"
    assert held.exception(timeout=5).code() is grpc.StatusCode.DEADLINE_EXCEEDED


def test_an_overlong_relayed_node_id_is_refused_without_quoting_it(tracker):
    """A 100,000-character node id was quoted whole in RelayControl's refusal, which gRPC sends as a header:
    the caller saw 'metadata size exceeds hard limit' instead."""
    stub, _ = tracker
    with pytest.raises(grpc.RpcError) as ei:
        stub.RelayControl(pb.RelayControlRequest(node_id="\u00e9" * 100_000, kind=pb.RelayDown.HEALTH), timeout=5)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == "RelayControl: node_id must have 1 to 128 characters, got 100000"


@pytest.mark.parametrize("kind", [pb.RelayDown.ATTACHED, pb.RelayDown.STEP, 99])
def test_relay_control_of_a_kind_it_does_not_carry_is_refused_before_the_node_is_asked(tracker, kind):
    """An unknown kind (99) was passed on to the relayed node; only ATTACHED and STEP were refused."""
    stub, _ = tracker
    with pytest.raises(grpc.RpcError) as ei:
        stub.RelayControl(pb.RelayControlRequest(node_id="any-node", kind=kind), timeout=5)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == ("RelayControl: kind must be CANCEL, RELEASE, HEALTH or CAPABILITIES "
                                  "(steps use RelayStep)")
