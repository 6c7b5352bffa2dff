"""Node.Step against hostile envelopes: mtp_drafts past the limit on any stage, and a session id too long
to echo, are INVALID_ARGUMENT naming the field; on a stage without an MTP block mtp_drafts is ignored
(the contract's rule) and the step's token is the one it samples without it."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from meshnet.contract import MAX_DRAFT_TOKENS, ArtifactId, LayerRange, StepRequest

from meshnet.load_spec import LoadSpec
from meshnet.engine.fake import FakeEngine, FakeModel
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.envelope import MAX_SESSION_ID_CHARS, request_to_frames

MODEL = FakeModel()


@pytest.fixture(params=[LayerRange(0, MODEL.n_layer), LayerRange(0, 10)], ids=["whole", "head-only"])
def stub(request):
    eng = FakeEngine(MODEL)
    assert eng.load(LoadSpec(path="", artifact=ArtifactId(MODEL.sha256, request.param), max_sessions=4)).ok
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_NodeServicer_to_server(NodeService(eng, "n", pb.ModelIdentity(sha256=MODEL.sha256)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.NodeStub(channel)
    server.stop(0)


def _step(stub, session_id: str = "s", position: int = 0, mtp_drafts: int = 0) -> pb.StepReply:
    frame = request_to_frames(StepRequest(session_id, 0, position, (1, 2, 3)), False)[0]
    frame.mtp_drafts = mtp_drafts
    return stub.Step(frame, timeout=5)


@pytest.mark.parametrize("drafts", [MAX_DRAFT_TOKENS + 1, 2**32 - 1])
def test_mtp_drafts_past_the_limit_are_refused_naming_the_field(stub, drafts):
    with pytest.raises(grpc.RpcError) as e:
        _step(stub, mtp_drafts=drafts)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"mtp_drafts must be in [0, {MAX_DRAFT_TOKENS}], got {drafts}"


def test_mtp_drafts_on_a_stage_without_an_mtp_block_are_ignored(stub):
    plain, asked = _step(stub, "a"), _step(stub, "b", mtp_drafts=MAX_DRAFT_TOKENS)
    assert list(asked.drafts) == [] and asked.has_token == plain.has_token
    assert (asked.token_id, asked.n_past) == (plain.token_id, plain.n_past) and asked.n_past == 3


@pytest.mark.parametrize("position", [0, 5])  # a new session, and one the stage would say it lacks
def test_a_session_id_too_long_to_echo_is_refused_by_its_length(stub, position):
    with pytest.raises(grpc.RpcError) as e:
        _step(stub, "x" * 100_000, position)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"session_id of 100000 characters; at most {MAX_SESSION_ID_CHARS}"
    assert _step(stub, "x" * MAX_SESSION_ID_CHARS).n_past == 3
