"""A node forwards steps only to the data planes of nodes registered with its tracker: a step names its
next hops itself, and a node dialled whatever address a step named (a port scan from inside the mesh's
network, open and closed ports told apart by the failure's timing and words)."""

from __future__ import annotations

import json
import logging
import socket

import grpc
import pytest

from mesh_util import RpcFailure, wait_for

from meshnet.node.forwarding import Forwarder, WouldWait
from meshnet.node.registered_peers import REFRESH_S, NeedsRefresh, RegisteredPeers
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane_server import DataPlaneServer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_address_off_the_list_asks_the_tracker_again_at_most_once_a_second():
    clock, asked, listed = Clock(), [], ["10.0.0.1:7701"]
    peers = RegisteredPeers(lambda: asked.append(clock.now) or list(listed), clock)
    assert peers.admits("10.0.0.1:7701") and asked == [100.0]
    assert not peers.admits("10.0.0.9:22") and asked == [100.0]  # listed just now: not asked again
    with pytest.raises(NeedsRefresh):  # the list is due again, which may block: not on this thread
        clock.now += REFRESH_S
        peers.admits("10.0.0.2:7701", may_block=False)
    listed.append("10.0.0.2:7701")  # a node that joined since
    assert peers.admits("10.0.0.2:7701") and asked == [100.0, 101.0]
    assert peers.admits("10.0.0.2:7701", may_block=False)  # listed: no asking, no waiting
    assert not peers.admits("10.0.0.7:22", may_block=False)  # asked just now: refused without the lock
    with peers._lock:  # another thread asking: passed on to a thread that may wait for its answer
        with pytest.raises(NeedsRefresh):
            peers.admits("10.0.0.7:22", may_block=False)
    assert peers.admits("10.0.0.1:7701".upper()) and len(asked) == 2  # host names without case


def test_while_the_tracker_cannot_be_asked_only_the_nodes_it_last_listed_are_let_through(caplog):
    """A mesh goes on serving through a tracker outage, and its forwarding to the nodes its routes name with
    it; every other address stays refused (letting any through made a stopped tracker a port scan, and sent
    the join token to whatever address a step named); its client steps such a hop itself."""
    down = RpcFailure(grpc.StatusCode.UNAVAILABLE)
    clock, answers = Clock(), [["10.0.0.1:7701"], down, down, ["10.0.0.1:7701", "10.0.0.5:7701"]]

    def listing():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    peers = RegisteredPeers(listing, clock)
    assert not peers.admits("10.0.0.5:7701")
    with caplog.at_level(logging.WARNING, logger="meshnet.node"):
        for _ in range(2):
            clock.now += REFRESH_S
            assert not peers.admits("10.0.0.5:7701")
            assert peers.admits("10.0.0.1:7701") and peers.admits("10.0.0.1:7701", may_block=False)
    assert [r.getMessage() for r in caplog.records] == [
        "could not ask the tracker which nodes are registered (UNAVAILABLE): steps are forwarded only to the 1 "
        "nodes it last listed until it answers"]
    clock.now += REFRESH_S
    assert peers.admits("10.0.0.5:7701") and peers.admits("10.0.0.1:7701")  # listed once it answers


def test_a_node_restarted_while_the_tracker_is_down_starts_from_the_list_it_kept(tmp_path):
    """A node restarted during a tracker outage held no list: every link out of it was refused, and its clients
    stepped them all themselves, told to open a data port that was open. The list is kept beside the node's
    key, for its tracker only, and read back at start; what does not read as such a list is no list."""
    down = RpcFailure(grpc.StatusCode.UNAVAILABLE)

    def tracker_down():
        raise down

    kept = tmp_path / "node-b.peers.json"
    first = RegisteredPeers(lambda: ["10.0.0.1:7701", "10.0.0.3:7701"], Clock(), kept=(kept, "t:7700"))
    assert not kept.exists()  # nothing asked yet
    first.refresh()
    assert json.loads(kept.read_text()) == {"tracker": "t:7700", "data_addresses": ["10.0.0.1:7701", "10.0.0.3:7701"]}
    again = RegisteredPeers(tracker_down, Clock(), kept=(kept, "t:7700"))
    again.refresh()
    assert again.admits("10.0.0.3:7701") and not again.admits("10.0.0.9:7701")
    assert not RegisteredPeers(tracker_down, Clock(), kept=(kept, "other:7700")).admits("10.0.0.3:7701")
    for junk in ("{", "[]", '{"tracker": "t:7700", "data_addresses": [1]}',
                 json.dumps({"tracker": "t:7700", "data_addresses": ["a:1"] * 5000})):
        kept.write_text(junk)
        assert not RegisteredPeers(tracker_down, Clock(), kept=(kept, "t:7700")).admits("a:1"), junk
    # Answered again: the new list replaces the kept one, in the file too.
    back = RegisteredPeers(lambda: ["10.0.0.4:7701"], Clock(), kept=(kept, "t:7700"))
    assert back.admits("10.0.0.4:7701") and not back.admits("10.0.0.3:7701")
    assert json.loads(kept.read_text())["data_addresses"] == ["10.0.0.4:7701"]


def test_a_forwarder_sends_to_registered_nodes_only_and_never_dials_another_address():
    target = socket.create_server(("127.0.0.1", 0))  # what a scan would probe: it must see no connection
    target.settimeout(0.5)
    received: list = []
    node = DataPlaneServer("127.0.0.1", 0, lambda frames: None, run_forward=received.append)
    node.start()
    registered = f"127.0.0.1:{node.port}"
    fwd = Forwarder(None, timeout_s=5.0)
    fwd.peers = RegisteredPeers(lambda: [registered])
    step = [pb.Envelope(session_id="s", n_chunks=1, byte_order="little")]
    try:
        probe = f"127.0.0.1:{target.getsockname()[1]}"
        failure = fwd.send(pb.ForwardHop(node_id="x", data_address=probe), step)
        assert (failure.node_id, failure.code, failure.unreachable) == ("x", "UNAVAILABLE", True)
        assert failure.message == ("the hop before it sends steps to the nodes registered with its tracker "
                                   f"only, and none has the data address {probe}")
        with pytest.raises(socket.timeout):
            target.accept()
        assert fwd.send(pb.ForwardHop(node_id="n", data_address=registered), step) is None
        assert wait_for(lambda: len(received) == 1, 5.0) is not None and received[0][0].session_id == "s"
        # From a thread that must not block (the engine worker's answers), a due asking is passed on.
        fwd.peers = RegisteredPeers(lambda: [registered])
        with pytest.raises(WouldWait):
            fwd.send(pb.ForwardHop(node_id="n", data_address=registered), step, connect=False)
    finally:
        fwd.close()
        node.stop()
        target.close()


def test_a_node_of_a_mesh_sends_on_to_its_tracker_s_nodes_only(mesh):
    """The same in a node process: a step naming an address no registered node has is never sent there;
    one naming the registered tail reaches it."""
    from meshnet.contract import StepRequest
    from meshnet.wire.data_plane import FORWARD, DataPlaneConnection
    from meshnet.wire.envelope import request_to_frames

    target = socket.create_server(("127.0.0.1", 0))
    target.settimeout(2.0)
    head, tail = mesh.start_nodes([("a-head", "0:15"), ("b-tail", "15:30")], "smollm2", "--engine", "fake")
    data = {n.info.node_id: n.info.data_address for n in mesh.tracker_stub().ListNodes(pb.Empty(), timeout=5).nodes}
    receiver = pb.ForwardHop(node_id="a-head", layers=pb.LayerRange(start=0, end=15))
    conn = DataPlaneConnection(data["a-head"], None, 5.0)
    try:
        for session, address in (("probe", f"127.0.0.1:{target.getsockname()[1]}"), ("honest", data["b-tail"])):
            hop = pb.ForwardHop(node_id="b-tail", data_address=address, layers=pb.LayerRange(start=15, end=30))
            frames = request_to_frames(StepRequest(session, 1, 0, (1, 2, 3)), False, next_hops=[hop],
                                       receiver=receiver)
            conn.send(FORWARD, [f.SerializeToString() for f in frames], 5.0)
        with pytest.raises(socket.timeout):
            target.accept()
        assert wait_for(lambda: tail.active_sessions() == 1, 10.0) is not None, tail.log_tail()
        assert "sends steps to the nodes registered with its tracker only" not in head.log_tail()  # no noise
    finally:
        conn.close()
        target.close()


def test_refresh_asks_the_tracker_at_once_so_a_node_restarted_just_before_an_outage_has_a_list():
    """A node asks its tracker's list when it registers: asked first on its first forwarded step, a node
    restarted just before the tracker stopped had none, and every link out of it was stepped by clients."""
    clock, asked = Clock(), []
    peers = RegisteredPeers(lambda: asked.append(clock.now) or ["10.0.0.3:7701"], clock)
    peers.refresh()
    peers.refresh()  # at once, however recently asked
    assert asked == [100.0, 100.0] and peers.admits("10.0.0.3:7701") and len(asked) == 2
    # Not the last asking: a node that registered after this one is asked for at the first step naming it.
    assert not peers.admits("10.0.0.4:7701") and len(asked) == 3


def test_a_forwarder_logs_the_address_it_will_not_send_to_and_why(caplog):
    fwd = Forwarder(None, timeout_s=5.0)
    fwd.peers = RegisteredPeers(lambda: [])
    step = [pb.Envelope(session_id="s", n_chunks=1, byte_order="little")]
    try:
        with caplog.at_level(logging.WARNING, logger="meshnet.node"):
            for _ in range(2):  # logged once an address
                assert fwd.send(pb.ForwardHop(node_id="nC", data_address="127.0.0.1:9"), step).unreachable
    finally:
        fwd.close()
    assert [r.getMessage() for r in caplog.records] == [
        "this node does not send steps to 127.0.0.1:9 (next node nC): its tracker has not listed that address "
        "as a registered node's (or cannot be asked now); clients step that link themselves meanwhile"]
