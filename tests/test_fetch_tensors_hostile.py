"""Node.FetchTensors against hostile requests: every refusal a clear status naming what was wrong, even
when what the request names is far larger than gRPC lets an error carry back; the node keeps serving."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from meshnet.model.manifest import model_manifest
from meshnet.node.service import NodeService
from meshnet.node.tensor_source import TensorSource
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
