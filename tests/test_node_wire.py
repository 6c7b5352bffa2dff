"""The node's gRPC service and the activation envelope: malformed frames are refused before any state
changes, large envelopes stream in frames, and the node keeps serving."""

from __future__ import annotations

import contextlib
import zlib
from concurrent import futures

import grpc
import numpy as np
import pytest

from meshnet.client.remote import RemoteStage
from meshnet.contract import ArtifactId, LayerRange, NamedTensor, Status, StepRequest
from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.envelope import PROTOCOL_MAJOR, PROTOCOL_MINOR, WireError, frames_to_request, request_to_frames
from meshnet.wire.security import open_channel

MODEL = FakeModel()
N_EMBD = MODEL.n_embd


@contextlib.contextmanager
def served_stage(model: FakeModel, layers: LayerRange, node_id: str, workers: int = 8):
    """``(engine, port)``: a fake engine of ``model``'s ``layers`` (2 sessions) behind a real gRPC server on
    loopback with ``workers`` threads, stopped after."""
    eng = FakeEngine(model)
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(model.sha256, layers), max_sessions=2)).ok
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_NodeServicer_to_server(NodeService(eng, node_id, pb.ModelIdentity(sha256=model.sha256)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield eng, port
    finally:
        server.stop(0).wait()


@pytest.fixture
def node():
    """A middle stage (layers 10:20) of the fake model behind a real gRPC server on loopback."""
    with served_stage(MODEL, LayerRange(10, 20), "mid") as (eng, port):
        channel = open_channel(f"127.0.0.1:{port}")
        yield eng, pb_grpc.NodeStub(channel), RemoteStage("mid", f"127.0.0.1:{port}", channel)


def hidden(n: int, seed: int = 0) -> NamedTensor:
    return NamedTensor.from_numpy("hidden", np.random.default_rng(seed).standard_normal((n, N_EMBD), np.float32))


def good_frame(position=0, n=3, session="s1", epoch=0, decode=False) -> pb.Envelope:
    req = StepRequest(session, epoch, position, tuple(range(1, n + 1)), hidden=hidden(n, position))
    return request_to_frames(req, decode)[0]


def code_of(stub, frame) -> tuple[grpc.StatusCode, str]:
    try:
        stub.Step(frame, timeout=5)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _mutations():
    def unknown_dtype(f):
        f.dtype = "f64"

    def zero_dim(f):
        f.shape[:] = [0, N_EMBD]

    def shape_bytes(f):
        f.shape[:] = [4, N_EMBD]

    def wrapping_shape(f):
        # (2**62 + 1) * n_embd * 4 bytes: a 64-bit product wraps to the bytes one row carries
        f.shape[:] = [2**62 + 1, N_EMBD]

    def bad_crc(f):
        f.crc32 ^= 1

    def flipped_byte(f):
        b = bytearray(f.payload)
        b[0] ^= 0xFF
        f.payload = bytes(b)

    def newer_major(f):
        f.major = PROTOCOL_MAJOR + 1

    def byte_order(f):
        f.byte_order = "big"

    return [
        ("unknown dtype", unknown_dtype, grpc.StatusCode.INVALID_ARGUMENT, "unknown dtype 'f64'"),
        ("zero dimension", zero_dim, grpc.StatusCode.INVALID_ARGUMENT, "zero or negative dimension"),
        ("shape vs bytes", shape_bytes, grpc.StatusCode.INVALID_ARGUMENT, "needs 128 bytes"),
        ("shape wrapping 64 bits", wrapping_shape, grpc.StatusCode.INVALID_ARGUMENT,
         f"needs {(2**62 + 1) * N_EMBD * 4} bytes"),
        ("bad checksum", bad_crc, grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        ("corrupted payload", flipped_byte, grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        ("newer major", newer_major, grpc.StatusCode.FAILED_PRECONDITION,
         f"version {PROTOCOL_MAJOR + 1}.{PROTOCOL_MINOR} is newer than this node's {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"),
        ("byte order", byte_order, grpc.StatusCode.INVALID_ARGUMENT, "byte order 'big'"),
    ]


@pytest.mark.parametrize("name, mutate, code, message", _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_envelope_refused_and_session_unchanged(node, name, mutate, code, message):
    eng, stub, _ = node
    assert code_of(stub, good_frame(0, 3))[0] == grpc.StatusCode.OK
    bad = good_frame(3, 1, decode=True)
    mutate(bad)
    got, details = code_of(stub, bad)
    assert got == code and message in details
    # The session did not move: the same step, well-formed, still fits at position 3.
    assert code_of(stub, good_frame(3, 1, decode=True))[0] == grpc.StatusCode.OK
    assert eng.health().healthy


def test_stale_epoch_frame_is_refused(node):
    _, stub, _ = node
    assert code_of(stub, good_frame(0, 3, epoch=5))[0] == grpc.StatusCode.OK
    got, details = code_of(stub, good_frame(3, 1, epoch=4, decode=True))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "stale route epoch 4" in details
    assert code_of(stub, good_frame(3, 1, epoch=5, decode=True))[0] == grpc.StatusCode.OK


def test_large_envelope_streams_in_frames_and_matches_unary(node):
    eng, _, remote = node
    n = 3000
    x = hidden(n, 7)
    small = RemoteStage(remote.node_id, remote.address, open_channel(remote.address), max_frame_bytes=4096)
    req = StepRequest("big", 0, 0, tuple(i % 1000 for i in range(n)), hidden=x)
    assert len(request_to_frames(req, False, 4096)) == -(-n * N_EMBD * 4 // 4096)
    streamed = small.prefill(req)
    unary = remote.prefill(StepRequest("big-unary", 0, 0, tuple(i % 1000 for i in range(n)), hidden=x))
    assert streamed.ok and unary.ok
    assert streamed.hidden.shape == (n, N_EMBD)
    assert streamed.hidden.data == unary.hidden.data
    assert streamed.n_past == n


def test_session_limit_is_resource_exhausted_with_retry_hint(node):
    _, _, remote = node
    for sid in ("a", "b"):
        assert remote.prefill(StepRequest(sid, 0, 0, (1, 2), hidden=hidden(2))).ok
    res = remote.prefill(StepRequest("c", 0, 0, (1, 2), hidden=hidden(2)))
    assert res.status is Status.RESOURCE_EXHAUSTED and res.retry_after_s is not None and res.retry_after_s > 0
    remote.release("a")
    assert remote.prefill(StepRequest("c", 0, 0, (1, 2), hidden=hidden(2))).ok


def test_frames_out_of_order_are_refused():
    req = StepRequest("s", 0, 0, tuple(range(100)), hidden=hidden(100))
    frames = request_to_frames(req, False, 512)
    with pytest.raises(WireError, match="arrived where frame 1"):
        frames_to_request([frames[0], frames[2]] + frames[3:])
    with pytest.raises(WireError, match="ended after"):
        frames_to_request(frames[:-1])
    assert frames_to_request(frames)[0] == req
    assert frames[0].crc32 == zlib.crc32(req.hidden.data)


def test_tensor_frames_checksums_the_payload_once(monkeypatch):
    """A 5 MiB payload in 1 MiB frames: one CRC-32 pass over 5 MiB (not one per frame), and it round-trips."""
    import types

    from meshnet.wire import envelope

    calls: list[int] = []

    def counting_crc32(data, value=0):
        calls.append(memoryview(data).nbytes)
        return zlib.crc32(data, value)

    monkeypatch.setattr(envelope, "zlib", types.SimpleNamespace(crc32=counting_crc32))
    n_bytes = 5 << 20
    x = NamedTensor("hidden", (n_bytes // 4,), "f32", np.arange(n_bytes // 4, dtype=np.float32).tobytes())
    req = StepRequest("crc", 0, 0, (1,), hidden=x)
    frames = request_to_frames(req, False, 1 << 20)
    assert len(frames) == 5 and [len(f.payload) for f in frames] == [1 << 20] * 5
    assert calls == [n_bytes]  # the sender: once, over the whole payload
    assert {f.crc32 for f in frames} == {zlib.crc32(x.data)}
    calls.clear()
    assert frames_to_request(frames)[0] == req
    assert calls == [n_bytes]  # the receiver: once, over the joined payload
    with pytest.raises(ValueError, match="max_frame must be >= 1"):
        request_to_frames(req, False, 0)


def test_undecodable_requests_are_invalid_argument_and_the_node_serves_on():
    """Bytes that do not parse as the method's message: INVALID_ARGUMENT naming the method and the type
    (grpcio alone answers INTERNAL), for unary and streaming calls; a well-formed call still works."""
    from meshnet.wire.security import add_port, make_server

    eng = FakeEngine(MODEL)
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(MODEL.sha256, LayerRange(10, 20)), max_sessions=2)).ok
    server = make_server(max_workers=4)
    pb_grpc.add_NodeServicer_to_server(NodeService(eng, "mid", pb.ModelIdentity(sha256=MODEL.sha256)), server)
    port = add_port(server, "127.0.0.1:0", None)
    server.start()
    channel = open_channel(f"127.0.0.1:{port}")
    garbage = bytes(range(200, 256)) * 2
    try:
        for method in ("Health", "Step", "Cancel"):
            call = channel.unary_unary(f"/meshnet.v1.Node/{method}")  # raw bytes both ways
            with pytest.raises(grpc.RpcError) as e:
                call(garbage, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"/meshnet.v1.Node/{method}: the request is not a valid meshnet.v1." in e.value.details()
        stream = channel.stream_stream("/meshnet.v1.Node/StepStream")
        with pytest.raises(grpc.RpcError) as e:
            list(stream(iter([garbage]), timeout=5))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid meshnet.v1.Envelope" in e.value.details()
        assert pb_grpc.NodeStub(channel).Health(pb.Empty(), timeout=5).healthy
    finally:
        server.stop(0).wait()


def test_a_step_stream_is_bounded_per_request_and_by_the_nodes_budget(monkeypatch):
    """A StepStream's frames were all buffered, however many came: 8 MiB frames announcing a million
    chunks grew a node by 2.6 GB in 9 s. Now as on the data plane: INVALID_ARGUMENT past the bytes a
    request may have, RESOURCE_EXHAUSTED with a retry-after past what the node buffers at once."""
    import meshnet.node.service as service_module
    from meshnet.wire.request_budget import RequestBudget
    from meshnet.wire.security import add_port, make_server

    eng = FakeEngine(MODEL)
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(MODEL.sha256, LayerRange(10, 20)), max_sessions=2)).ok
    service = NodeService(eng, "mid", pb.ModelIdentity(sha256=MODEL.sha256))
    server = make_server(max_workers=4)
    pb_grpc.add_NodeServicer_to_server(service, server)
    port = add_port(server, "127.0.0.1:0", None)
    server.start()
    channel = open_channel(f"127.0.0.1:{port}")
    frame = pb.Envelope(session_id="s", n_chunks=1_000_000, payload=b"x" * 8192)
    n = frame.ByteSize()
    try:
        monkeypatch.setattr(service_module, "MAX_REQUEST_BYTES", 10 * n)
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.NodeStub(channel).StepStream(iter([frame] * 11), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == (f"the request reaches {11 * n} bytes (each frame counting at least 4096), over "
                                     f"the limit of {10 * n} bytes a request")
        service.budget = RequestBudget(5 * n)
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.NodeStub(channel).StepStream(iter([frame] * 6), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details() == (f"the node holds {5 * n} bytes of step requests still arriving, near its limit "
                                     f"of {5 * n}; try again shortly")
        assert dict(e.value.trailing_metadata())["retry-after-s"] == "1.000"
        assert service.budget.held == 0  # what the refused requests held went back
        assert pb_grpc.NodeStub(channel).Health(pb.Empty(), timeout=5).healthy
    finally:
        server.stop(0).wait()


def test_a_data_plane_failure_names_the_node_at_its_routed_address_and_the_data_port_in_the_message():
    """The failover line named the node at its data port (127.0.0.1:45189) while the route, `meshnet
    nodes` and --json's layers show its gRPC address: the same node looked like two."""
    import socket

    from meshnet.client.remote import StageFailure
    from meshnet.wire.data_plane import ConnectionPool

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    stage = RemoteStage("n1", "127.0.0.1:7700", open_channel("127.0.0.1:7700"),
                        data_pool=ConnectionPool(dead, None, 2.0))
    with pytest.raises(StageFailure) as e:
        stage.prefill(StepRequest("s", 0, 0, (1, 2, 3)))
    assert (e.value.node_id, e.value.address, e.value.code) == ("n1", "127.0.0.1:7700", "UNAVAILABLE")
    assert str(e.value).startswith(f"node n1 at 127.0.0.1:7700: UNAVAILABLE: data plane {dead}: ")


def test_a_unary_step_whose_output_needs_several_frames_is_refused_before_it_runs():
    # The refusal used to come after the step ran: the session held its tokens, so the StepStream its
    # message advised was refused in turn (the step starts at 0, the session had n tokens cached).
    with served_stage(FakeModel(n_embd=1024), LayerRange(0, 10), "head", workers=4) as (eng, port):
        stub = pb_grpc.NodeStub(open_channel(f"127.0.0.1:{port}"))
        n = 300  # 300 rows x 4 KiB of output: two 1 MiB frames
        [frame] = request_to_frames(StepRequest("h", 0, 0, tuple(i % 999 + 1 for i in range(n))), False)
        got, details = code_of(stub, frame)
        assert got == grpc.StatusCode.INVALID_ARGUMENT and "StepStream" in details
        assert eng.health().active_sessions == 0
        replies = list(stub.StepStream(iter([frame]), timeout=10))
        assert len(replies) == 2 and replies[0].n_past == n


def test_stalled_step_streams_leave_workers_for_other_calls_and_are_cancelled(monkeypatch):
    # StepStreams that sent one frame of two and stalled held a gRPC worker each for as long as their
    # client kept them open: with max_sessions + 8 of them (24 by default) the node answered nothing else.
    import threading
    import time
    from meshnet.node import grpc_step_limits
    monkeypatch.setattr(grpc_step_limits, "STREAM_READ_S", 2.0)  # all three arrive well within it
    release = threading.Event()
    ended: list[grpc.StatusCode] = []

    def stall(port, i):
        def frames():
            yield pb.Envelope(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR, session_id=f"stall{i}", n_chunks=2,
                              token_ids=[1], sampling=pb.Sampling(top_p=1, repetition_penalty=1))
            release.wait(30)
        try:
            list(pb_grpc.NodeStub(open_channel(f"127.0.0.1:{port}")).StepStream(frames(), timeout=30))
        except grpc.RpcError as e:
            ended.append(e.code())

    # 2 sessions + 1 spare worker
    with served_stage(MODEL, LayerRange(0, 10), "head", workers=3) as (_, port):
        threads = [threading.Thread(target=stall, args=(port, i), daemon=True) for i in range(3)]
        try:
            for t in threads:
                t.start()
            time.sleep(0.2)
            stub = pb_grpc.NodeStub(open_channel(f"127.0.0.1:{port}"))
            assert stub.Health(pb.Empty(), timeout=5).healthy
            for t in threads:
                t.join(10)
            assert sorted(c.name for c in ended) == ["CANCELLED", "CANCELLED", "RESOURCE_EXHAUSTED"]
        finally:
            release.set()


def test_a_steps_prefix_cache_rows_cross_the_wire_with_its_result():
    """``StepResult.reused`` (the rows a stage took from its prefix cache: the API's cached_tokens) travels
    in every reply message of a step, a hidden-state result of several frames as a token's."""
    from meshnet.contract import SampledToken, StepResult
    from meshnet.wire.envelope import replies_to_result, result_to_replies

    req = StepRequest("s", 0, 0, [1] * 40)
    hidden = NamedTensor.from_numpy("hidden", np.ones((40, N_EMBD), np.float32))
    replies = result_to_replies(req, StepResult(Status.OK, hidden=hidden, n_past=40, reused=31), max_frame=1 << 10)
    assert len(replies) > 1 and {r.reused for r in replies} == {31}
    assert replies_to_result(replies).reused == 31
    token = StepResult(Status.OK, token=SampledToken(7, -0.5), n_past=40, reused=31)
    assert replies_to_result(result_to_replies(req, token)).reused == 31
    assert replies_to_result(result_to_replies(req, StepResult(Status.OK, token=SampledToken(7, -0.5)))).reused == 0
