"""Limits on what forwarded steps may cost a node: abandoned awaits hold no connection, empty frames
count, a FORWARD stream is read no faster than its steps run, a route never loops. Each was once a way
to lock clients out of a healthy node or to make one request cost without bound."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from meshnet.contract import ArtifactId, LayerRange, NamedTensor, Status, StepRequest

from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.node.forwarding import MAX_NEXT_HOPS, AwaitedOutcomes, next_hops_error
from meshnet.node.service import NodeService, StepOutcome
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import (AUTH, AWAIT, ERROR, FORWARD, DataPlaneConnection, decode_error,
                                     encode_messages, recv_message)
from meshnet.wire.data_plane_conn import FRAME_CHARGE
from meshnet.wire.data_plane_server import DataPlaneServer
from meshnet.wire.envelope import request_to_frames


def _authed(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(encode_messages(AUTH, (b"",)))
    assert recv_message(s) == (AUTH, b"")
    return s


def _await(key: tuple[str, int, int]) -> bytes:
    session, step, epoch = key
    return encode_messages(AWAIT, (pb.AwaitStep(session_id=session, step_id=step, epoch=epoch).SerializeToString(),))


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _await_server(reg: AwaitedOutcomes, **limits) -> DataPlaneServer:
    server = DataPlaneServer("127.0.0.1", 0, lambda frames: StepOutcome("OK"), run_forward=lambda f: None,
                             run_await=lambda a, answer: reg.await_((a.session_id, a.step_id, a.epoch), answer),
                             **limits)
    server.start()
    return server


def test_an_await_whose_client_hung_up_frees_its_connection_and_is_withdrawn():
    """A client gives up on its await (the head refused the step, so it never reaches the tail) and
    closes the connection: the tail drops the await and the connection at once, not after the awaits'
    TTL, so refused steps cannot fill max_connections."""
    reg = AwaitedOutcomes(StepOutcome)
    server = _await_server(reg, max_connections=4)
    try:
        for i in range(4):
            s = _authed(server.port)
            s.sendall(_await((f"s{i}", 1, 1)))
            assert _wait_for(lambda: reg.pending == (0, 1))
            s.close()
            assert _wait_for(lambda: reg.pending == (0, 0) and server.open_connections == 0)
        DataPlaneConnection(f"127.0.0.1:{server.port}", None, 5).close()
        assert server.stats["refused"] == 0
        # An outcome arriving after its await was withdrawn is kept for a later await, as any other.
        reg.deliver(("s0", 1, 1), StepOutcome("OK", replies=[pb.StepReply(n_past=7)]))
        assert reg.pending == (1, 0)
    finally:
        server.stop()


def test_an_awaiting_client_that_sends_first_is_refused_and_its_await_dropped():
    reg = AwaitedOutcomes(StepOutcome)
    server = _await_server(reg)
    try:
        s = _authed(server.port)
        s.sendall(_await(("s", 1, 1)))
        assert _wait_for(lambda: reg.pending == (0, 1))
        s.sendall(_await(("s", 2, 1)))
        kind, payload = recv_message(s)
        assert kind == ERROR and decode_error(payload)[0] == "INVALID_ARGUMENT"
        assert _wait_for(lambda: reg.pending == (0, 0))
        assert server.stats["malformed"] == 1
    finally:
        server.stop()


def test_an_await_is_answered_on_its_connection_which_then_serves_again():
    reg = AwaitedOutcomes(StepOutcome)
    server = _await_server(reg)
    try:
        s = _authed(server.port)
        for step in (1, 2):
            s.sendall(_await(("s", step, 3)))
            assert _wait_for(lambda: reg.pending == (0, 1))
            reg.deliver(("s", step, 3), StepOutcome("OK", replies=[pb.StepReply(n_past=10 + step)]))
            kind, payload = recv_message(s)
            assert kind != ERROR and pb.StepReply.FromString(payload).n_past == 10 + step
        assert reg.pending == (0, 0) and server.open_connections == 1
    finally:
        server.stop()


def test_empty_frames_count_toward_max_request_bytes():
    """A first frame announcing 2**30 chunks, then tiny frames in order: each counts FRAME_CHARGE bytes, so
    the request is refused after max_request_bytes / FRAME_CHARGE frames instead of being buffered
    forever. (Empty frames are refused sooner still: they stand where frame 1 was expected.)"""
    limit = 64 << 10
    server = DataPlaneServer("127.0.0.1", 0, lambda frames: StepOutcome("OK"), run_forward=lambda f: None,
                             max_request_bytes=limit)
    server.start()
    try:
        s = _authed(server.port)
        frames = [pb.Envelope(major=1, session_id="s", n_chunks=1 << 30, chunk_index=i).SerializeToString()
                  for i in range(200)]
        try:
            s.sendall(encode_messages(FORWARD, frames))
        except OSError:
            pass  # refused and closed meanwhile
        kind, payload = recv_message(s)
        code, _, message = decode_error(payload)
        assert kind == ERROR and code == "INVALID_ARGUMENT" and "max_request_bytes" in message
        assert server.stats["too_large"] == 1 and limit // FRAME_CHARGE == 16
    finally:
        server.stop()


def test_a_forward_stream_is_not_read_past_its_pending_steps_and_loses_none():
    """FORWARD is one way: with every worker stuck, the server takes max_pending_forwards steps of a
    connection and stops reading it (the sender blocks: TCP backpressure); once the workers move, every
    step sent is run."""
    gate = threading.Event()
    ran = []
    server = DataPlaneServer("127.0.0.1", 0, lambda frames: StepOutcome("OK"),
                             run_forward=lambda frames: (gate.wait(), ran.append(frames[0].step_id)),
                             workers=2, max_pending_forwards=8)
    server.start()
    n_steps = 200
    try:
        s = _authed(server.port)
        s.settimeout(30)
        hidden = NamedTensor("hidden", (64, 256), "f32", np.zeros((64, 256), np.float32).tobytes())
        messages = [encode_messages(FORWARD, [f.SerializeToString() for f in request_to_frames(
            StepRequest("s", 1, 0, tuple([1] * 64), hidden=hidden, step_id=i), False)]) for i in range(n_steps)]
        sender = threading.Thread(target=lambda: [s.sendall(m) for m in messages], daemon=True)
        sender.start()
        time.sleep(1.0)
        assert server.stats["steps"] == 8 and sender.is_alive()  # 64 KiB steps: far more than 8 fit buffers
        gate.set()
        sender.join(30)
        assert _wait_for(lambda: len(ran) == n_steps, 30)
        assert sorted(ran) == list(range(n_steps)) and server.stats["steps"] == n_steps
    finally:
        gate.set()
        server.stop()


def _hops(*names: str) -> list[pb.ForwardHop]:
    return [pb.ForwardHop(node_id=n, data_address=f"10.0.0.{i + 1}:7000") for i, n in enumerate(names)]


def test_next_hops_must_be_a_route_that_never_loops():
    assert next_hops_error(_hops("b", "c"), "a") is None
    assert next_hops_error([], "a") is None
    assert "is this node (a)" in next_hops_error(_hops("b", "a"), "a")
    assert "named twice" in next_hops_error(_hops("b", "c", "b"), "a")
    same_address = _hops("b", "c")
    same_address[1].data_address = same_address[0].data_address
    assert "named twice" in next_hops_error(same_address, "a")
    assert "HOST:PORT" in next_hops_error([pb.ForwardHop(node_id="b", data_address="nowhere")], "a")
    many = [pb.ForwardHop(node_id=f"n{i}", data_address=f"10.0.{i // 250}.{i % 250}:1") for i in range(MAX_NEXT_HOPS + 1)]
    assert next_hops_error(many, "a", 10_000) == (f"next_hops names {MAX_NEXT_HOPS + 1} hops, but {MAX_NEXT_HOPS} at "
                                                  f"most can follow this node (10000 layers come after its range)")


def test_next_hops_are_at_most_the_layers_after_the_node_and_addresses_differ_in_more_than_case():
    """A middle node reached under 511 spellings of its own address (localhost, LOCALHOST, lOcalhost...)
    with one request ran that step 512 times (72 s of compute): each later hop serves one layer at least,
    and a DNS name is the same name in any case."""
    aliases = [pb.ForwardHop(node_id=f"x{i}", data_address=f"{'LOCALHOST'[:i]}{'localhost'[i:]}:7000")
               for i in range(3)]
    assert next_hops_error(aliases[:1], "a", 10) is None
    assert next_hops_error(aliases[:2], "a", 10) == "next_hops[1] (x1 at Localhost:7000) is named twice in the route"
    eleven = [pb.ForwardHop(node_id=f"n{i}", data_address=f"10.0.0.{i + 1}:7000") for i in range(11)]
    assert next_hops_error(eleven[:10], "a", 10) is None
    assert next_hops_error(eleven, "a", 10) == ("next_hops names 11 hops, but 10 at most can follow this node (10 "
                                                "layers come after its range)")
    assert next_hops_error(eleven[:1], "a", 0) == ("next_hops names 1 hops, but 0 at most can follow this node (0 "
                                                   "layers come after its range)")  # the tail


def test_a_step_naming_a_looping_route_is_refused_before_it_runs():
    """One request whose next_hops point back at the node (300 times) would run and forward 301 steps;
    it is refused INVALID_ARGUMENT and runs none."""
    engine = FakeEngine(FakeModel())
    assert engine.load(LoadSpec(path="", artifact=ArtifactId("", LayerRange(10, 20)))).ok
    service = NodeService(engine, "m", pb.ModelIdentity())
    server = DataPlaneServer("127.0.0.1", 0, service.run_step, run_forward=service.run_forward,
                             run_await=service.run_await)
    server.start()
    steps = []
    prefill = engine.prefill
    engine.prefill = lambda req: (steps.append(req.position), prefill(req))[1]
    address = f"127.0.0.1:{server.port}"
    try:
        conn = DataPlaneConnection(address, None, 10)
        hidden = NamedTensor.from_numpy("hidden", np.ones((1, 8), np.float32))
        assert conn.call(request_to_frames(StepRequest("s", 1, 0, (5,), hidden=hidden), False))[1] is None
        for n, words in ((300, "300 hops, but 10 at most can follow this node"), (1, "this node (m)")):
            loop = [pb.ForwardHop(node_id="m", data_address=address)] * n
            _, error = conn.call(request_to_frames(StepRequest("s", 1, 0, (5,), hidden=hidden, rollback=True), False,
                                                   next_hops=loop))
            assert error is not None and error[0] == "INVALID_ARGUMENT" and words in error[2]
        time.sleep(0.5)
        assert steps == [0]
        conn.close()
    finally:
        server.stop()


def test_steps_the_head_refuses_leave_the_tail_open_to_clients(mesh, tok, solo):
    """A forwarded step the head refuses never reaches the tail, so the client's await there is abandoned:
    260 in a row (more than the tail's 256 data-plane connections) leave the tail serving, and a
    generation after them equals the solo run."""
    from meshnet.contract import GREEDY
    from meshnet.generation import Generation

    nodes = mesh.start_nodes([("a-head", "0:10"), ("b-mid", "10:20"), ("c-tail", "20:30")])
    client = mesh.client(forwarding=True, failover_deadline_s=3.0)
    for i in range(260):
        res = client.step(StepRequest(f"bad-{i}", 0, 0, (10**6,), reserve_tokens=8), decode=False)
        assert res.status is Status.INVALID_ARGUMENT, res.message
    gen = Generation(client, tok, solo.prompt_ids(0), 8, GREEDY, stop_at_eog=False)
    list(gen)
    assert gen.result.generated_token_ids == solo.greedy(0, 8)
    assert client.failovers == 0
    client.close()
    assert [n.active_sessions() for n in nodes] == [0, 0, 0]


def test_a_next_node_that_cannot_be_reached_fails_at_once_for_a_while(monkeypatch):
    """Each step naming an address that accepts and never answers held a step thread for the whole
    connect timeout: 24 of them kept every thread of a node busy, and a chat prompt waited 4.5 s for its
    first token. After one failed connection, sends there fail at once for UNREACHABLE_S."""
    import meshnet.node.forwarding as forwarding
    from meshnet.node.forwarding import Forwarder

    hole = socket.create_server(("127.0.0.1", 0))  # accepts into its backlog, never answers
    address = f"127.0.0.1:{hole.getsockname()[1]}"
    hop = pb.ForwardHop(node_id="hole", data_address=address)
    frame = pb.Envelope(session_id="s", n_chunks=1)
    forwarder = Forwarder(None, timeout_s=0.5)
    monkeypatch.setattr(forwarding, "UNREACHABLE_S", 0.6)
    try:
        started = time.monotonic()
        failure = forwarder.send(hop, [frame])
        assert failure.code == "UNAVAILABLE" and time.monotonic() - started >= 0.5
        started = time.monotonic()
        failure = forwarder.send(hop, [frame])
        assert time.monotonic() - started < 0.1
        assert failure.message == f"the hop before it could not reach {address} within the last 0.6 s"
        time.sleep(0.7)
        started = time.monotonic()
        assert forwarder.send(hop, [frame]).code == "UNAVAILABLE"
        assert time.monotonic() - started >= 0.5  # tried again once the mark expired
        # A refused connection costs no wait and is not marked: a node restarting on its port is used at once.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        restarting = pb.ForwardHop(node_id="r", data_address=f"127.0.0.1:{port}")
        assert forwarder.send(restarting, [frame]).code == "UNAVAILABLE"
        engine = FakeEngine(FakeModel())
        assert engine.load(LoadSpec(path="", artifact=ArtifactId("", LayerRange(10, 20)))).ok
        service = NodeService(engine, "r", pb.ModelIdentity())
        server = DataPlaneServer("127.0.0.1", port, service.run_step, run_forward=service.run_forward)
        server.start()
        try:
            assert forwarder.send(restarting, [frame]) is None
        finally:
            server.stop()
        # Made-up addresses are not kept for good: past MAX_PEERS, the least recently used pool goes.
        monkeypatch.setattr(forwarding, "MAX_PEERS", 2)
        for port in (1, 2, 3):
            forwarder.send(pb.ForwardHop(node_id="x", data_address=f"127.0.0.1:{port}"), [frame])
        assert list(forwarder._pools) == ["127.0.0.1:2", "127.0.0.1:3"]
    finally:
        forwarder.close()
        hole.close()
