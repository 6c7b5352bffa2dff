"""The raw-TCP step data plane under hostile peers: nothing is allocated or trusted before the join token,
frames and requests have named limits, silent connections are closed, connections are capped, and a
legitimate step still goes through while 1000 hostile connections are open."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest

from meshnet.bench.hostile_bench import hostile_connection
from meshnet.contract import ArtifactId, LayerRange, NamedTensor, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import (AUTH, ENVELOPE, ERROR, HEADER, REPLY, ConnectionPool, DataPlaneConnection,
                                     DataPlaneError, decode_error, encode_messages, recv_message,
                                     send_message)
from meshnet.wire.data_plane_server import DataPlaneServer
from meshnet.wire.envelope import replies_to_result, request_to_frames

MODEL = FakeModel()
TOKEN = "secret"


def _service() -> NodeService:
    eng = FakeEngine(MODEL)
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(MODEL.sha256, LayerRange(10, 20)), max_sessions=4)).ok
    return NodeService(eng, "mid", pb.ModelIdentity(sha256=MODEL.sha256))


@contextlib.contextmanager
def data_planes():
    """``start(host, **limits) -> (server, "127.0.0.1:PORT")``: data planes over a fake middle stage
    (``limits``: DataPlaneServer's keyword arguments), all stopped on exit."""
    servers = []

    def start(host: str = "127.0.0.1", **limits):
        s = DataPlaneServer(host, 0, _service().run_step, TOKEN, **limits)
        s.start()
        servers.append(s)
        return s, f"127.0.0.1:{s.port}"

    try:
        yield start
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def serve():
    with data_planes() as start:
        yield start


def _raw(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _authed(address: str) -> socket.socket:
    sock = _raw(address)
    send_message(sock, AUTH, TOKEN.encode())
    assert recv_message(sock) == (AUTH, b"")
    return sock


def _error(sock: socket.socket) -> tuple[str, float | None, str]:
    kind, payload = recv_message(sock)
    assert kind == ERROR
    return decode_error(payload)


def _closed(sock: socket.socket) -> bool:
    """True once the server has closed the connection (waits up to the socket's 5 s timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _prefill(n_tokens: int, session: str = "s") -> list[pb.Envelope]:
    """A middle stage's prefill request: ``[n_tokens, n_embd]`` f32 hidden states in 4 KiB frames."""
    x = np.random.default_rng(0).standard_normal((n_tokens, MODEL.n_embd), np.float32)
    ids = tuple(i % 1000 for i in range(n_tokens))
    req = StepRequest(session, 0, 0, ids, hidden=NamedTensor.from_numpy("hidden", x))
    return request_to_frames(req, False, 4096)


def test_a_multi_frame_prefill_round_trips(serve):
    _, address = serve()
    frames = _prefill(1200)
    assert len(frames) == 10
    conn = DataPlaneConnection(address, TOKEN, 5)
    replies, error = conn.call(frames)
    assert error is None
    res = replies_to_result(replies)
    assert res.ok and res.hidden.shape == (1200, MODEL.n_embd) and res.n_past == 1200
    conn.close()


def test_a_node_without_a_join_token_serves_a_client_that_brings_one():
    """As the node's gRPC port does. Its data plane refused every token but the empty one, while gRPC and the
    tracker let the client in: `meshnet generate` with a token on an open mesh failed over 150 times a
    second without end."""
    s = DataPlaneServer("127.0.0.1", 0, _service().run_step, None)
    s.start()
    try:
        for token in ("secret", ""):
            conn = DataPlaneConnection(f"127.0.0.1:{s.port}", token, 5)
            replies, error = conn.call(_prefill(4, session=f"s-{token}"))
            assert error is None and replies_to_result(replies).n_past == 4
            conn.close()
    finally:
        s.stop()


def test_a_huge_announced_token_is_refused_without_waiting_for_it(serve):
    server, address = serve()
    sock = _raw(address)
    sock.sendall(HEADER.pack(8 << 20, AUTH))  # 8 MiB announced, none of it sent
    assert _error(sock) == ("UNAUTHENTICATED", None, "missing or wrong join token")
    assert _closed(sock) and server.stats["unauthenticated"] == 1


@pytest.mark.parametrize("first", [HEADER.pack(6, AUTH) + b"wrong!", HEADER.pack(3, ENVELOPE) + b"abc",
                                   bytes(range(7, 71))])
def test_a_wrong_token_or_garbage_is_unauthenticated(serve, first):
    server, address = serve()
    sock = _raw(address)
    sock.sendall(first)
    assert _error(sock)[0] == "UNAUTHENTICATED"
    assert _closed(sock) and server.stats["unauthenticated"] == 1 and server.open_connections == 0


def test_an_oversized_frame_is_refused_naming_the_limit(serve):
    server, address = serve(max_message_bytes=2 << 20)
    sock = _authed(address)
    sock.sendall(HEADER.pack((2 << 20) + 1, ENVELOPE))
    code, _, message = _error(sock)
    assert code == "INVALID_ARGUMENT" and "a frame of 2097153 bytes" in message
    assert "limit of 2097152 bytes per frame (max_message_bytes)" in message
    assert _closed(sock) and server.stats["too_large"] == 1


@pytest.mark.parametrize("index,n_chunks", [(5, 2), (1, 2)])
def test_a_frame_out_of_place_is_refused_at_once(serve, index, n_chunks):
    server, address = serve()
    sock = _authed(address)
    frame = _prefill(10)[0]
    frame.chunk_index, frame.n_chunks = index, n_chunks
    body = frame.SerializeToString()
    sock.sendall(HEADER.pack(len(body), ENVELOPE) + body)
    code, _, message = _error(sock)  # at once: before, the node waited 30 s for the frames it announced
    assert code == "INVALID_ARGUMENT"
    assert f"envelope frame {index} of {n_chunks} arrived where frame 0 of {n_chunks} was expected" in message
    assert _closed(sock) and server.stats["malformed"] == 1


def test_an_oversized_request_is_refused_naming_the_limit(serve):
    server, address = serve(max_request_bytes=64 << 10)
    conn = DataPlaneConnection(address, TOKEN, 5)
    replies, (code, _, message) = conn.call(_prefill(3000))  # 96000 bytes of hidden states alone
    assert replies is None and code == "INVALID_ARGUMENT"
    assert "limit of 65536 bytes per request (max_request_bytes)" in message
    assert server.stats["too_large"] == 1 and server.stats["steps"] == 0


def test_silent_connections_are_closed(serve):
    server, address = serve(auth_timeout_s=0.3, read_timeout_s=0.3, idle_timeout_s=0.6)
    never_authenticates = _raw(address)
    stops_mid_message = _authed(address)
    stops_mid_message.sendall(HEADER.pack(1000, ENVELOPE) + b"x" * 10)
    idle = _authed(address)
    assert _closed(never_authenticates) and _closed(stops_mid_message) and _closed(idle)
    assert server.stats["timed_out"] == 3 and server.open_connections == 0


def test_connections_beyond_the_cap_are_refused_or_replace_unauthenticated_ones(serve):
    server, address = serve(max_connections=3)
    silent = [_raw(address) for _ in range(3)]
    conns = [DataPlaneConnection(address, TOKEN, 5) for _ in range(3)]  # each replaces the oldest silent one
    assert all(_closed(s) for s in silent) and server.stats["evicted"] == 3
    with pytest.raises(DataPlaneError, match="RESOURCE_EXHAUSTED: .*limit of 3 connections"):
        DataPlaneConnection(address, TOKEN, 5)
    assert server.stats["refused"] == 1 and server.open_connections == 3
    replies, error = conns[0].call(_prefill(2))  # the authenticated ones still work
    assert error is None and replies_to_result(replies).hidden.shape == (2, MODEL.n_embd)


def test_the_pool_replaces_a_connection_the_node_closed(serve):
    server, address = serve(idle_timeout_s=0.3)
    pool = ConnectionPool(address, TOKEN, 5)
    first = pool.acquire()
    assert first.call(_prefill(2, "a"))[1] is None
    pool.release(first)
    deadline = time.monotonic() + 5
    while server.open_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.open_connections == 0  # the node closed the idle connection
    second = pool.acquire()
    assert second is not first
    replies, error = second.call(_prefill(2, "b"))
    assert error is None and replies_to_result(replies).n_past == 2
    pool.release(second)
    pool.close()


# ---- 1000 hostile connections against a node process -----------------------------------------------

_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from test_data_plane import TOKEN, _service
    from meshnet.wire.data_plane_server import DataPlaneServer

    server = DataPlaneServer("127.0.0.1", 0, _service().run_step, TOKEN)
    server.start()
    print(server.port, flush=True)
    for line in sys.stdin:
        rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
        print(json.dumps({"rss_kb": rss, "open": server.open_connections, "stats": dict(server.stats)}), flush=True)
""")


def test_1000_hostile_connections_cost_little_memory_and_a_step_still_succeeds():
    child = subprocess.Popen([sys.executable, "-c", _CHILD, os.path.dirname(__file__)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(child.stdout.readline())}"

        def probe() -> dict:
            child.stdin.write("\n")
            child.stdin.flush()
            return json.loads(child.stdout.readline())

        conn = DataPlaneConnection(address, TOKEN, 30)
        assert conn.call(_prefill(8, "warm"))[1] is None  # the step path's own memory, before measuring
        before = probe()
        hostile = [hostile_connection(address, i) for i in range(1000)]
        # The node accepts from its listen backlog as its selector gets to it: wait (bounded) until
        # every hostile connection has reached it, so the figures below count all of them.
        deadline = time.monotonic() + 20
        while probe()["stats"]["accepted"] < 1001 and time.monotonic() < deadline:
            time.sleep(0.05)
        replies, error = conn.call(_prefill(8, "legit"))  # while the hostile ones are open
        during = probe()
        assert error is None and replies_to_result(replies).hidden.shape == (8, MODEL.n_embd)
        grown_mb = (during["rss_kb"] - before["rss_kb"]) / 1024
        print(f"\nhostile connections: {sum(s is not None for s in hostile)} opened; node RSS "
              f"{before['rss_kb'] / 1024:.1f} -> {during['rss_kb'] / 1024:.1f} MB (+{grown_mb:.1f} MB); "
              f"open {during['open']}; {during['stats']}")
        assert during["stats"]["accepted"] >= 1000 and during["open"] <= 256
        assert grown_mb < 100  # loose: measured about 1-3 MB
        for s in hostile:
            if s is not None:
                s.close()
        conn.close()
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_an_overdue_reply_is_waited_for_while_the_node_answers_and_not_when_it_is_silent():
    """A step past its deadline on a node that is busy (its Health still answers) is not a hung node:
    the client waits on and gets the reply; on a node that answers nothing it gives up at the deadline."""
    service = _service()

    def slow_step(frames):
        time.sleep(1.5)  # e.g. queued behind another client's long prefill
        return service.run_step(frames)

    server = DataPlaneServer("127.0.0.1", 0, slow_step, TOKEN)
    server.start()
    try:
        address = f"127.0.0.1:{server.port}"
        probes = []

        def alive() -> bool:
            probes.append(time.monotonic())
            return True

        conn = DataPlaneConnection(address, TOKEN, 5)
        replies, error = conn.call(_prefill(8, "busy"), 0.4, alive, patience_s=10)
        assert error is None and replies_to_result(replies).hidden.shape == (8, MODEL.n_embd)
        assert 2 <= len(probes) <= 4  # one probe per 0.4 s window of the 1.5 s wait
        conn.close()

        conn = DataPlaneConnection(address, TOKEN, 5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer within 0.4"):
            conn.call(_prefill(8, "hung"), 0.4, lambda: False, patience_s=10)
        assert time.monotonic() - t0 < 1.4  # gave up at the deadline, did not wait out the step
        conn.close()

        conn = DataPlaneConnection(address, TOKEN, 5)
        with pytest.raises(TimeoutError):  # patience is bounded even for a node that answers
            conn.call(_prefill(8, "patience"), 0.3, lambda: True, patience_s=0.5)
        conn.close()

        # A deadline lengthened by work queued ahead (here 30 s) does not put off the first probe past
        # probe_s: a silent node is given up on then (a busy one is waited for, as above).
        conn = DataPlaneConnection(address, TOKEN, 5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer within 0.4"):
            conn.call(_prefill(8, "hung, queued"), 30, lambda: False, patience_s=60, probe_s=0.4)
        assert time.monotonic() - t0 < 1.4
        conn.close()
    finally:
        server.stop()


def test_many_requests_go_out_at_once_and_their_answers_come_back_in_order():
    """A replay's steps in one round trip: a prefill and 1000 decodes of 4096-wide rows, 16 MB each way
    (sent without reading the answers, the sends block: the node stops reading while its answers wait
    to be read; so the requests go out while the answers are read); then one refused step ends the
    reading."""
    model = FakeModel(n_embd=4096)
    eng = FakeEngine(model)
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(model.sha256, LayerRange(10, 20)))).ok
    server = DataPlaneServer("127.0.0.1", 0, NodeService(eng, "mid", pb.ModelIdentity()).run_step, TOKEN)
    server.start()
    try:
        conn = DataPlaneConnection(f"127.0.0.1:{server.port}", TOKEN, 5)

        def step(position: int, n: int = 1) -> list[pb.Envelope]:
            x = NamedTensor.from_numpy("hidden", np.ones((n, model.n_embd), dtype=np.float32))
            return request_to_frames(StepRequest("many", 0, position, (7,) * n, x), n == 1)

        answers = conn.call_many([step(0, 8)] + [step(8 + i) for i in range(1000)], 30.0)
        assert [e for _, e in answers] == [None] * 1001
        assert [replies_to_result(r).n_past for r, _ in answers] == list(range(8, 1009))
        # A step at a position the session does not have: refused, and nothing after it is read.
        answers = conn.call_many([step(1008), step(5), step(1010)], 5.0)
        assert len(answers) == 2 and answers[0][1] is None and answers[1][1][0] == "FAILED_PRECONDITION"
        conn.close()
    finally:
        server.stop()


def test_a_data_port_or_an_http_server_given_as_the_tracker_is_named_so():
    """A node's data port given as --tracker was taken for an HTTP server ("such as meshnet api or the
    dashboard?"); an HTTP server still is."""
    import http.server
    import threading

    from meshnet.wire.call_problems import tracker_refusal

    plane = DataPlaneServer("127.0.0.1", 0, _service().run_step, None)
    plane.start()
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        refusal = tracker_refusal(f"127.0.0.1:{plane.port}", None, None, retry_s=0)
        assert refusal.endswith(" (that address is not a gRPC server (a node's --data-port?): give the tracker's)")
        refusal = tracker_refusal(f"127.0.0.1:{web.server_address[1]}", None, None, retry_s=0)
        assert refusal.endswith(" (that address is not a gRPC server (an HTTP server, such as meshnet api or the "
                                "dashboard?): give the tracker's)")
    finally:
        plane.stop()
        web.shutdown()


def test_requests_still_arriving_are_bounded_over_all_connections(serve):
    """Each request was bounded, not all of them: 6 connections that sent 31 frames of 8 MiB each and then
    a byte every 20 s grew a node by 1.5 GB. Past the node's budget a frame is refused RESOURCE_EXHAUSTED
    with a retry-after; what a connection held goes back when it closes or its request completes."""
    from meshnet.wire.request_budget import RequestBudget

    frames = _prefill(2000)  # 64000 bytes of hidden states in 4 KiB frames
    assert len(frames) > 8
    share = sum(max(f.ByteSize(), 4096) for f in frames[:8])  # each frame counts 4 KiB at least
    budget = RequestBudget(2 * share)
    server, address = serve(budget=budget)
    first, second = _authed(address), _authed(address)
    half = b"".join(encode_messages(ENVELOPE, (f.SerializeToString(),)) for f in frames[:8])
    first.sendall(half)  # 8 of the request's frames
    second.sendall(half)  # as many more: the budget is full
    deadline = time.monotonic() + 5
    while budget.held < 2 * share and time.monotonic() < deadline:
        time.sleep(0.01)
    assert budget.held == 2 * share
    third = _authed(address)
    third.sendall(encode_messages(ENVELOPE, (frames[0].SerializeToString(),)))
    code, retry, message = _error(third)
    assert (code, retry) == ("RESOURCE_EXHAUSTED", 1.0)
    assert message == (f"the node holds {2 * share} bytes of step requests still arriving, near its limit of "
                       f"{2 * share}; try again shortly")
    assert _closed(third) and server.stats["busy"] == 1
    first.close()
    deadline = time.monotonic() + 5
    while budget.held > share and time.monotonic() < deadline:
        time.sleep(0.01)
    assert budget.held == share  # the closed connection's share went back
    second.sendall(b"".join(encode_messages(ENVELOPE, (f.SerializeToString(),)) for f in frames[8:]))
    kind, _ = recv_message(second)  # its request completed and ran
    assert kind == REPLY and budget.held == 0
    conn = DataPlaneConnection(address, TOKEN, 5)
    replies, error = conn.call(_prefill(4, session="after"))
    assert error is None and replies_to_result(replies).n_past == 4
    conn.close()


def test_a_forwarded_step_waits_for_room_in_the_budget_rather_than_being_refused():
    """A node forwarding a step reads no answer: refused for the budget, the step was lost without a word,
    and left out of the budget, forwarded frames were bounded by nothing in total. A forwarded frame past
    the budget now waits, unread (its sender waits on TCP), until there is room."""
    from meshnet.wire.data_plane import FORWARD
    from meshnet.wire.request_budget import RequestBudget

    ran = []
    frames = _prefill(4, session="fwd")
    need = sum(max(f.ByteSize(), 4096) for f in frames)
    budget = RequestBudget(need)
    assert budget.take(need)  # another request holds all of it (a gRPC StepStream, say)
    s = DataPlaneServer("127.0.0.1", 0, _service().run_step, None, run_forward=ran.append, budget=budget)
    s.start()
    try:
        sock = _raw(f"127.0.0.1:{s.port}")
        send_message(sock, AUTH, b"")
        assert recv_message(sock) == (AUTH, b"")
        sock.sendall(b"".join(encode_messages(FORWARD, (f.SerializeToString(),)) for f in frames))
        time.sleep(0.6)
        assert ran == [] and s.stats["held_back"] == 1 and s.stats["busy"] == 0
        budget.give_back(need)  # room: the frame is read, the step runs
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [f.session_id for f in ran[0]] == ["fwd"] * len(frames)
        assert budget.held == 0  # given back once its request was complete
        sock.close()
    finally:
        s.stop()


def test_a_data_port_that_lets_no_connection_in_fails_a_step_within_the_connect_bound(monkeypatch):
    """A data port a firewall drops packets to answers nothing: with the step's timeout for its connect, a
    client waited 60 s for the step, then 60 s for its failover's replay, to learn that it cannot reach the
    node. The connect and the handshake have their own bound. Here a listener whose accept queue is full
    (the kernel drops the SYNs past it, as a firewall does) and one that never answers the join token."""
    from meshnet.client.remote import RemoteStage, StageFailure
    from meshnet.wire import data_plane
    from meshnet.wire.data_plane import ConnectTimeout

    monkeypatch.setattr(data_plane, "CONNECT_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        # the kernel completes the handshake of a listener that never accepts: the join token goes unanswered
        with pytest.raises(ConnectTimeout, match=r"^connected, but no handshake within 0\.5 s$"):
            DataPlaneConnection(address, TOKEN, timeout_s=60.0)
        fillers = [socket.socket() for _ in range(4)]
        try:
            for f in fillers:  # fill the accept queue: the SYNs after it are dropped
                f.setblocking(False)
                f.connect_ex(silent.getsockname())
            time.sleep(0.2)
            started = time.monotonic()
            with pytest.raises(ConnectTimeout, match=r"^cannot connect within 0\.5 s \(is the port open"):
                DataPlaneConnection(address, TOKEN, timeout_s=60.0)
            assert time.monotonic() - started < 30.0  # the bound, not the step's 60 s
            with grpc.insecure_channel("127.0.0.1:1") as channel:
                stage = RemoteStage("n1", "127.0.0.1:1", channel, timeout_s=60.0,
                                    data_pool=ConnectionPool(address, TOKEN, 60.0))
                with pytest.raises(StageFailure) as failed:
                    stage.step(StepRequest("s", 1, 0, (1, 2, 3)), decode=False)
            assert failed.value.code == "UNAVAILABLE"  # not DEADLINE_EXCEEDED: no step reached the node
            assert f"data plane {address}: cannot connect within 0.5 s" in str(failed.value)
        finally:
            for f in fillers:
                f.close()


def test_a_service_that_is_no_data_plane_is_named_so_without_repeating_its_bytes():
    """A step's next_hops may name any address: a node dialling another service there said "message of
    1347703880 bytes exceeds the limit", the first four bytes of its banner ("HTTP") read as a length,
    which let whoever sends steps learn what serves at any address the node reaches."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def banner() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nServer: secret-service/9.9\r\n\r\n")
            time.sleep(0.5)

    threading.Thread(target=banner, daemon=True).start()
    try:
        with pytest.raises(DataPlaneError) as ei:
            DataPlaneConnection(f"127.0.0.1:{port}", None, 5.0)
        assert str(ei.value) == "it does not answer as a meshnet node's data plane (another service at that port?)"
    finally:
        listener.close()


def test_one_address_cannot_hold_the_connections_kept_for_others(serve):
    """A join-token holder that opened authenticated connections up to the cap (each with an await, or idle)
    locked every new client and node out for the connections' idle timeout: one address's authenticated
    connections now hold at most three quarters of them, and another address still gets in."""
    server, address = serve(max_connections=8)
    mine = [DataPlaneConnection(address, TOKEN, 5) for _ in range(6)]
    with pytest.raises(DataPlaneError, match=r"RESOURCE_EXHAUSTED: 127\.0\.0\.1 holds 6 of this data plane's "
                                             r"connections, the most one address may \(6 of max_connections 8\)"):
        DataPlaneConnection(address, TOKEN, 5)
    host, port = address.rsplit(":", 1)
    other = socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0))
    send_message(other, AUTH, TOKEN.encode())
    assert recv_message(other) == (AUTH, b"")  # another address is let in
    assert server.stats["refused"] == 1 and server.open_connections == 7
    replies, error = mine[0].call(_prefill(2))  # and the first address's connections still work
    assert error is None and replies_to_result(replies).n_past == 2
    other.close()
