"""Node.FetchTensors against hostile requests: every refusal a clear status naming what was wrong, even
when what the request names is far larger than gRPC lets an error carry back; the node keeps serving."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from conftest import moe_model_path

from meshnet.model.manifest import model_manifest
from meshnet.node.service import NodeService
from meshnet.node.tensor_source import MAX_FETCHES, TensorSource
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc


class _Servicer(pb_grpc.NodeServicer):
    """The node's own FetchTensors over one file, without an engine."""

    FetchTensors = NodeService.FetchTensors

    def __init__(self, source: TensorSource):
        self.tensors = source


@pytest.fixture(scope="module")
def node(qwen3moe_path):
    manifest = model_manifest(qwen3moe_path)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_NodeServicer_to_server(_Servicer(TensorSource(str(qwen3moe_path), manifest.id)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.NodeStub(channel), manifest
    server.stop(0)


def _fetch(stub, model_id: str, names) -> list[pb.TensorChunk]:
    return list(stub.FetchTensors(pb.TensorRequest(model_id=model_id, names=names), timeout=10))


def _refused(stub, model_id: str, names) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        _fetch(stub, model_id, names)
    return e.value


@pytest.mark.parametrize("model_id", ["a" * 200_000, ""])
def test_another_model_id_is_refused_as_a_precondition_whatever_its_length(node, model_id):
    stub, manifest = node
    e = _refused(stub, model_id, [manifest.tensors[0].name])
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"this node serves model {manifest.id}, not '{model_id[:10]}" in e.details()
    assert len(e.details()) < 300


def test_a_tensor_named_twice_is_refused_naming_it(node):
    stub, manifest = node
    name = manifest.tensors[3].name
    e = _refused(stub, manifest.id, [manifest.tensors[0].name, name, name])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == f"FetchTensors: tensor {name!r} is named twice"
    huge = _refused(stub, manifest.id, ["x" * 100_000] * 2)
    assert huge.code() == grpc.StatusCode.INVALID_ARGUMENT and "is named twice" in huge.details()


def test_names_it_does_not_hold_get_nothing_and_the_node_keeps_serving(node):
    stub, manifest = node
    odd = ["../../etc/passwd", "/etc/passwd", "blk.0\x00.attn_q.weight", ""] + [f"x{i}" for i in range(5000)]
    assert _fetch(stub, manifest.id, odd) == []
    assert _fetch(stub, manifest.id, []) == []
    t = manifest.tensors[0]
    got = _fetch(stub, manifest.id, [t.name])
    assert [c.name for c in got] == [t.name] * len(got) and sum(len(c.data) for c in got) == t.n_bytes


def test_peers_that_stop_reading_hold_at_most_max_fetches_workers_and_other_calls_still_answer():
    """Streams of a 10 MB file read one chunk and then stalled: past MAX_FETCHES they are refused at once,
    so the node's other calls (Health here) keep a worker of its 4."""
    deepseek4_path = moe_model_path("tiny-deepseek4")
    manifest = model_manifest(deepseek4_path)

    class WithHealth(_Servicer):
        def Health(self, request, context):
            return pb.HealthReply(healthy=True)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_NodeServicer_to_server(WithHealth(TensorSource(str(deepseek4_path), manifest.id)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    request = pb.TensorRequest(model_id=manifest.id, names=[t.name for t in manifest.tensors])
    channels, stalled = [], []
    try:
        for _ in range(MAX_FETCHES):  # one connection each, so flow control stalls each on its own
            own = [("grpc.use_local_subchannel_pool", 1)]
            channels.append(grpc.insecure_channel(f"127.0.0.1:{port}", options=own))
            stalled.append(pb_grpc.NodeStub(channels[-1]).FetchTensors(request))
            assert next(stalled[-1]).offset == 0
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stub = pb_grpc.NodeStub(channels[-1])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.FetchTensors(request, timeout=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"serving {MAX_FETCHES} fetches already" in e.value.details()
        assert stub.Health(pb.Empty(), timeout=3).healthy
        for call in stalled:
            call.cancel()
        deadline = time.monotonic() + 5
        while True:  # the stalled streams' workers notice the cancellation and free their slots
            try:
                got = sum(len(c.data) for c in stub.FetchTensors(request, timeout=10))
                break
            except grpc.RpcError as again:
                if again.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert got == sum(t.n_bytes for t in manifest.tensors)
    finally:
        for ch in channels:
            ch.close()
        server.stop(0)


def test_a_node_fetching_from_a_busy_peer_waits_its_turn(qwen3moe_path, tmp_path, monkeypatch):
    from meshnet.contract import LayerRange
    from meshnet.node import fetch

    monkeypatch.setattr(fetch, "BUSY_RETRY_S", 0.05)
    manifest = model_manifest(qwen3moe_path)
    source = TensorSource(str(qwen3moe_path), manifest.id, max_fetches=1)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_NodeServicer_to_server(_Servicer(source), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    held = source.chunks(pb.TensorRequest(model_id=manifest.id, names=[manifest.tensors[0].name]))
    next(held)  # another fetch holds the peer's only slot
    timer = threading.Timer(0.3, held.close)
    timer.start()
    try:
        got = fetch.fetch_range(manifest, LayerRange(0, 1), tmp_path, [("busy", f"127.0.0.1:{port}")],
                                grpc.insecure_channel, progress=False)
        assert got.bytes_moved > 0 and model_manifest(got.path).id == manifest.id
    finally:
        timer.join()
        server.stop(0)
