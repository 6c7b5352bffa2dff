"""The API's llama.cpp/OpenAI sampling extras on the bundled SmolLM2: ``logit_bias`` (OpenAI's map of token
id strings to a bias; -100 bans, +100 forces), ``ignore_eos`` and ``repeat_penalty`` (llama-server's name
for ``repetition_penalty``), through raw HTTP and through the official ``openai`` client."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from api_served import served_api  # noqa: E402
from meshnet.api.backend import local_backend  # noqa: E402
from meshnet.contract import SamplingParams  # noqa: E402
from meshnet.generation import generate  # noqa: E402
from meshnet.speculative import Speculation  # noqa: E402

PROMPT = "The capital of France is"
# greedy, the answer to this ends its turn after a few tokens
SHORT_ANSWER = [{"role": "user", "content": "Reply with the single word yes."}]
# a prompt whose continuation repeats it, so n-gram drafts are found and verified
REPEATING = "a b c d e f g a b c d e f g a b c d e f g a b c"


@pytest.fixture(scope="module")
def served(smollm2_path):
    with served_api(local_backend(str(smollm2_path), n_ctx=512, max_sessions=2, name="smollm2")) as served:
        yield served


def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _reference(backend, prompt: str, max_tokens: int, **sampling) -> list[int]:
    tok = backend.tokenizer
    return generate(backend.chain, tok, tok.encode(prompt), max_tokens, SamplingParams(**sampling)).generated_token_ids


def test_banning_the_first_greedy_token_changes_it(served):
    backend, http, _ = served
    plain = _reference(backend, PROMPT, 6)
    ban = {str(plain[0]): -100}
    banned = _reference(backend, PROMPT, 6, logit_bias=((plain[0], -100.0),))
    assert banned[0] != plain[0] and plain[0] not in banned
    got = _complete(http, logit_bias=ban)
    assert got["text"] == backend.tokenizer.decode(banned) != backend.tokenizer.decode(plain)


def test_plus_100_forces_a_token_greedy_and_sampled(served):
    backend, http, _ = served
    tok = backend.tokenizer
    (london,) = tok.encode(" London")
    assert _complete(http, logit_bias={str(london): 100}, max_tokens=3)["text"] == " London" * 3
    sampled = _complete(http, logit_bias={str(london): 100}, max_tokens=3, temperature=1.5, seed=7)
    assert sampled["text"] == " London" * 3


def test_a_banned_token_is_never_accepted_as_a_draft(served):
    backend, http, _ = served
    plain = _reference(backend, REPEATING, 12)
    ban = plain[2]  # a token the run produces, and that n-gram lookup drafts from the repeated prompt
    want = _reference(backend, REPEATING, 12, logit_bias=((ban, -100.0),))
    assert ban not in want
    for extra in ({}, {"speculative": "ngram", "draft_tokens": 4}):
        got = http.post("/v1/completions", json={"prompt": REPEATING, "max_tokens": 12, "temperature": 0,
                                                 "logit_bias": {str(ban): -100}, **extra})
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == backend.tokenizer.decode(want)
    spec = Speculation(4, adaptive=False)
    tok = backend.tokenizer
    ids = generate(backend.chain, tok, tok.encode(REPEATING), 12, SamplingParams(logit_bias=((ban, -100.0),)),
                   speculation=spec)
    assert ids.generated_token_ids == want and ids.drafted > 0
    for seed in range(3):  # sampled: the rejection rule never keeps the banned draft either
        sp = SamplingParams(temperature=0.8, seed=seed, logit_bias=((ban, -100.0),))
        run = generate(backend.chain, tok, tok.encode(REPEATING), 12, sp, speculation=spec)
        assert ban not in run.generated_token_ids and run.drafted > 0


def test_logit_bias_crosses_the_wire_to_the_tail(served):
    """The whole model behind a real gRPC node: the step header carries the bias, the tail applies it, and
    a token id outside the tail's vocabulary is refused as INVALID_ARGUMENT."""
    from concurrent import futures

    import grpc

    from meshnet.client.remote import RemoteStage
    from meshnet.contract import Status, StepRequest
    from meshnet.node.service import NodeService
    from meshnet.proto import meshnet_pb2 as pb
    from meshnet.proto import meshnet_pb2_grpc as pb_grpc
    from meshnet.wire.security import open_channel

    backend = served[0]
    (engine,) = backend.chain.stages  # one stage: head and tail
    tok = backend.tokenizer
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_NodeServicer_to_server(NodeService(engine, "whole", pb.ModelIdentity()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        remote = RemoteStage("whole", f"127.0.0.1:{port}", open_channel(f"127.0.0.1:{port}"))
        plain = _reference(backend, PROMPT, 6)
        for sp in (SamplingParams(logit_bias=((plain[0], -100.0), (plain[1], 2.5))),
                   SamplingParams(temperature=0.9, seed=4, logit_bias=((plain[0], -100.0),))):
            local = generate(backend.chain, tok, tok.encode(PROMPT), 6, sp).generated_token_ids
            wired = generate(remote, tok, tok.encode(PROMPT), 6, sp).generated_token_ids
            assert wired == local and plain[0] not in wired
        # Negative seeds (OpenAI's seed is an int64) cross as they are: one arrived as 2**64 - 1 and was refused.
        for seed in (-5, -(1 << 63), (1 << 63) - 1):
            sp = SamplingParams(temperature=0.9, seed=seed)
            local = generate(backend.chain, tok, tok.encode(PROMPT), 6, sp)
            wired = generate(remote, tok, tok.encode(PROMPT), 6, sp)
            assert wired.generated_token_ids == local.generated_token_ids and local.generated_token_ids
        bad = StepRequest("bad-bias", 0, 0, tuple(tok.encode(PROMPT)),
                          sampling=SamplingParams(logit_bias=((tok.n_vocab, 1.0),)))
        res = remote.step(bad, decode=False)
        assert res.status is Status.INVALID_ARGUMENT and "outside the vocabulary" in res.message
    finally:
        server.stop(0).wait()


def test_ignore_eos_runs_to_max_tokens(served):
    _, http, client = served
    plain = client.chat.completions.create(model="smollm2", messages=SHORT_ANSWER, max_tokens=24, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 24
    for stream in (False, True):
        body = {"messages": SHORT_ANSWER, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": stream, "stream_options": {"include_usage": True} if stream else None}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 24
            assert choice["message"]["content"].startswith(plain.choices[0].message.content)
        else:
            assert '"finish_reason":"length"' in r.text.replace(" ", "")
            assert '"completion_tokens":24' in r.text.replace(" ", "")
    done = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 20 and done.choices[0].finish_reason == "length"


def test_repeat_penalty_is_repetition_penalty(served):
    _, http, _ = served
    body = {"prompt": REPEATING, "max_tokens": 10}
    by_llama_name = _complete(http, repeat_penalty=1.5, **body)
    by_hf_name = _complete(http, repetition_penalty=1.5, **body)
    both = _complete(http, repetition_penalty=1.5, repeat_penalty=1.5, **body)
    assert by_llama_name == by_hf_name == both
    assert by_llama_name["text"] != _complete(http, **body)["text"]  # the penalty does something here


def test_openai_client_sends_logit_bias_and_extra_body(served):
    backend, http, client = served
    plain = _reference(backend, PROMPT, 6)
    bias = {str(plain[0]): -100}
    extra = {"repeat_penalty": 1.3, "top_k": 20, "ignore_eos": True}
    raw = _complete(http, logit_bias=bias, **extra)
    via_client = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0,
                                           logit_bias=bias, extra_body=extra)
    assert via_client.choices[0].text == raw["text"]
    assert via_client.usage.completion_tokens == 6
    chat_raw = http.post("/v1/chat/completions", json={"messages": SHORT_ANSWER, "max_tokens": 5, "temperature": 0,
                                                       "logit_bias": bias, **extra}).json()
    chat = client.chat.completions.create(model="smollm2", messages=SHORT_ANSWER, max_tokens=5, temperature=0,
                                          logit_bias=bias, extra_body=extra)
    assert chat.choices[0].message.content == chat_raw["choices"][0]["message"]["content"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, logit_bias={"not-a-token": 1})
    assert e.value.body["param"] == "logit_bias"


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # SmolLM2's vocabulary is [0, 49152)
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"logit_bias": {"5": True}}, "logit_bias.5"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"repeat_penalty": 1.2, "repetition_penalty": 1.3}, "repeat_penalty"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": "1.1"}, "repeat_penalty"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": 10**12}, "top_k"),
    # Wrapped modulo 2**64 on the wire: seeds 0, 2**64 and 10**100 drew the same tokens.
    ({"seed": 2**63}, "seed"),
    ({"seed": 10**100}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_400_naming_the_field(served, path, body, param):
    _, http, _ = served
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": SHORT_ANSWER}
    r = http.post(path, json={**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_top_k_is_capped_at_the_wires_int32(served):
    """``top_k`` crosses the wire as int32: a larger one is a 400 naming it (it used to pass the in-process
    API and be a 500 behind a mesh, where the step header could not hold it); the cap itself is served,
    and keeps every token, so greedy output is unchanged."""
    from meshnet.sampling_params import MAX_INT32

    _, http, _ = served
    for path, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": SHORT_ANSWER})):
        r = http.post(path, json={**base, "max_tokens": 2, "top_k": 10**12})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "top_k" and str(MAX_INT32) in err["message"], err
    assert _complete(http, top_k=MAX_INT32)["text"] == _complete(http)["text"]
    assert "top_k must be in [0, 2147483647]" in SamplingParams(top_k=2**31).validate()
    assert "penalty_last_n must be in [-1, 2147483647]" in SamplingParams(penalty_last_n=2**31).validate()
    assert SamplingParams(top_k=MAX_INT32, penalty_last_n=MAX_INT32).validate() is None


def test_a_completion_without_max_tokens_stops_at_openais_default_of_16(served):
    """It ran to the end of the context (4093 tokens, a minute and a half of a slot) where OpenAI's
    completions stop at 16."""
    _, http, _ = served
    r = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"
