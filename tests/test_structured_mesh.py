"""A grammar in the step's sampling crosses the wire to the tail: a head in this process and a tail behind
gRPC give the constrained run of the whole model in one process; a bad or oversized grammar, or a token the grammar forbids, is INVALID_ARGUMENT and the node
keeps serving; through a two-stage mesh of node processes a constrained run survives its tail being killed
(the spare tail rebuilds the matcher from the replayed tokens)."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest

from meshnet.chain import LocalChain
from meshnet.chat_template import chat_prompt_ids
from meshnet.client.remote import RemoteStage
from meshnet.contract import LayerRange, Status, StepRequest
from meshnet.generation import Generation, generate
from meshnet.local_mesh import load_local_chain
from meshnet.node.service import NodeService
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.sampling_params import MAX_GRAMMAR_BYTES, Grammar, SamplingParams
from meshnet.wire.envelope import request_to_frames
from meshnet.wire.security import open_channel
from test_structured_output import ASK, PERSON

jsonschema = pytest.importorskip("jsonschema")

GRAMMAR = Grammar(json.dumps(PERSON))


@pytest.fixture(scope="module")
def whole(smollm2_path):
    return load_local_chain(str(smollm2_path), [LayerRange(0, 30)], n_threads=2, progress=False, n_ctx=1024)


@pytest.fixture(scope="module")
def split(smollm2_path):
    return load_local_chain(str(smollm2_path), [LayerRange(0, 15), LayerRange(15, 30)], n_threads=2,
                            progress=False, n_ctx=1024)


def test_a_grammar_crosses_grpc_and_bad_ones_are_invalid_argument(whole, split, tok):
    head, engine = split.stages
    service = NodeService(engine, "tail", pb.ModelIdentity())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_NodeServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    prompt = chat_prompt_ids(tok, ASK)
    try:
        remote = LocalChain([head, RemoteStage("tail", f"127.0.0.1:{port}", open_channel(f"127.0.0.1:{port}"))])
        greedy = SamplingParams(grammar=GRAMMAR)
        local = generate(whole, tok, prompt, 200, greedy)
        wired = generate(remote, tok, prompt, 200, greedy)
        assert wired.generated_token_ids == local.generated_token_ids and wired.finish_reason == "stop"
        jsonschema.validate(json.loads(wired.text), PERSON)

        def refused(session: str, grammar: Grammar, tokens=tuple(prompt)) -> str:
            res = remote.step(StepRequest(session, 0, 0, tokens, sampling=SamplingParams(grammar=grammar)), False)
            assert res.status is Status.INVALID_ARGUMENT, res
            return res.message

        assert "Invalid type: foo" in refused("bad-type", Grammar('{"type": "foo"}'))
        assert "not valid JSON" in refused("not-json", Grammar("{"))
        big = Grammar(json.dumps({"type": "object", "description": "x" * MAX_GRAMMAR_BYTES}))
        assert f"more than the limit of {MAX_GRAMMAR_BYTES}" in refused("too-big", big)
        # the prompt's start is before the tokens: '{' is allowed, 'Hello' is not
        forbidden = tuple(prompt) + tuple(tok.encode("Hello", add_bos=False))
        assert f"at position {len(prompt)} is not allowed" in refused("forbidden", Grammar(GRAMMAR.json_schema,
                                                                                             len(prompt)),
                                                                      forbidden)
        assert engine.session_ids() == []  # refused first steps left no session behind on the tail
        for sid in ("bad-type", "not-json", "too-big", "forbidden"):
            head.release(sid)
        # the node still serves: the greedy constrained run again, token for token
        again = generate(remote, tok, prompt, 200, greedy)
        assert again.generated_token_ids == local.generated_token_ids
    finally:
        server.stop(0).wait()


def test_an_oversized_grammar_is_refused_from_the_frame(split):
    """The wire's own check, before any engine: a 40 KiB schema in a frame's header."""
    service = NodeService(split.stages[0], "head", pb.ModelIdentity())
    req = StepRequest("wire-big", 0, 0, (1, 2), sampling=SamplingParams(grammar=Grammar("x" * 40_000)))
    frames = [pb.Envelope.FromString(f.SerializeToString()) for f in request_to_frames(req, False)]
    out = service.run_step(frames)
    assert out.code == "INVALID_ARGUMENT" and "40000 bytes, more than the limit of 32768" in out.message


@pytest.mark.long
def test_constrained_run_survives_its_tail_being_killed(mesh, whole, tok):
    prompt = chat_prompt_ids(tok, ASK)
    sp = SamplingParams(temperature=0.8, seed=21, grammar=GRAMMAR)  # seeded: a replay draws the same tokens
    want = generate(whole, tok, prompt, 200, sp)
    head, tail, spare = mesh.start_nodes([("a-head", "0:15"), ("b-tail", "15:30"), ("c-tail", "15:30")])
    client = mesh.client(failover_deadline_s=30.0)
    try:
        _, route = client.route()
        victim = tail if tail.node_id in {h.node_id for h in route} else spare
        gen = Generation(client, tok, prompt, 200, sp)
        for i, _ in enumerate(gen):
            if i == 8:  # inside the document: the replacement tail must rebuild the matcher from the replay
                victim.kill()
        assert gen.result.generated_token_ids == want.generated_token_ids
        assert client.failovers == 1 and gen.result.finish_reason == "stop"
        jsonschema.validate(json.loads(gen.result.text), PERSON)
    finally:
        client.close()
