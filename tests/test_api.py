"""The OpenAI-compatible API, end to end: a live uvicorn server on loopback over an in-process chain of the
bundled SmolLM2, driven with the official ``openai`` package and with raw HTTP (httpx)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from meshnet.api.backend import ApiBackend, local_backend  # noqa: E402
from meshnet.api.server import start_api_in_thread, stop_api  # noqa: E402
from meshnet.chat_template import chat_prompt_ids  # noqa: E402
from meshnet.client.mesh_client import MeshUnavailable  # noqa: E402
from meshnet.contract import GREEDY, SampledToken, Status, StepResult  # noqa: E402
from meshnet.generation import generate  # noqa: E402

N_CTX = 512
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    backend = local_backend(str(smollm2_path), n_ctx=N_CTX, max_sessions=4, name="smollm2")
    server, thread = start_api_in_thread(backend, "127.0.0.1", 0)
    yield backend, f"http://127.0.0.1:{server.config.port}"
    stop_api(server, thread)


@pytest.fixture(scope="module")
def backend(served):
    return served[0]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[1], timeout=120) as c:
        yield c


def _engines(backend):
    return backend.chain.stages


def _active_sessions(backend) -> int:
    return sum(e.health().active_sessions for e in _engines(backend))


def _wait_idle(backend, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while _active_sessions(backend) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _active_sessions(backend)


def _greedy_reference(backend, max_tokens: int):
    tok = backend.tokenizer
    return generate(backend.chain, tok, tok.encode(PROMPT), max_tokens, GREEDY)


def _stream_text(stream) -> tuple[str, list[str | None], list]:
    """Joined content, finish reasons and chunks of a streamed completion or chat completion."""
    text, finishes, chunks = [], [], []
    for chunk in stream:
        chunks.append(chunk)
        for ch in chunk.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            text.append(piece)
            finishes.append(ch.finish_reason)
    return "".join(text), finishes, chunks


# ---- happy paths ---------------------------------------------------------------------------------


def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    h = http.get("/health")
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok" and body["n_ctx"] == N_CTX and body["route"] == ["in-process 0:30"]


def test_greedy_completion_equals_generation(backend, client):
    ref = _greedy_reference(backend, 8)
    assert ref.text.startswith(" Paris.")
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    ch = r.choices[0]
    assert ch.text == ref.text
    assert ch.finish_reason == ref.finish_reason == "length"
    assert r.usage.prompt_tokens == len(backend.tokenizer.encode(PROMPT)) == 5
    assert r.usage.completion_tokens == len(ref.generated_token_ids) == 8
    assert r.usage.total_tokens == 13
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == ch.text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok_str, chosen, top, ref_tok in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, ref.tokens):
        assert chosen == pytest.approx(ref_tok.logprob)
        values = list(top.values())
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert chosen == pytest.approx(values[0]) and top[tok_str] == pytest.approx(chosen)  # greedy = argmax
    # the same request streamed gives the same text, token by token
    text, finishes, _ = _stream_text(client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert text == ref.text and finishes[-1] == "length"


def test_stop_sequence_spanning_tokens(backend, client):
    ref = _greedy_reference(backend, 12)
    tok = backend.tokenizer
    pieces = [tok.decode([t]) for t in ref.generated_token_ids]
    # a stop sequence made of the end of one token and the start of the next
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    stop = pieces[k][-2:] + pieces[k + 1][:1]
    expected = ref.text[:ref.text.find(stop)]
    assert expected and len(expected) < len(ref.text)
    kw = dict(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "never-seen"])
    r = client.completions.create(**kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    text, finishes, chunks = _stream_text(client.completions.create(stream=True, **kw))
    assert text == expected and finishes[-1] == "stop"
    assert all(stop not in c.choices[0].text for c in chunks if c.choices)
    assert _wait_idle(backend) == 0  # stopping early released the session


def test_chat_stream_and_not_agree(backend, client):
    tok = backend.tokenizer
    kw = dict(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    for marker in ("<|im_start|>", "<|im_end|>", "assistant\n", "<|endoftext|>"):
        assert marker not in msg.content
    prompt_ids = chat_prompt_ids(tok, QUESTION)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert prompt_ids.count(tok.bos_id) == 3  # the template's own turn markers; no extra BOS (add_bos=False)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    text, finishes, chunks = _stream_text(stream)
    assert text == msg.content
    assert [f for f in finishes if f] == [r.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # list-of-parts content renders the same prompt
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    r2 = client.chat.completions.create(model="smollm2", messages=parts, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == msg.content and r2.usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_stops_at_end_of_turn(backend, client):
    """A short answer ends with <|im_end|> (an end-of-generation token): finish_reason stop, marker unseen."""
    r = client.chat.completions.create(model="smollm2", max_tokens=64, temperature=0, messages=[
        {"role": "user", "content": "Say just the word yes."}])
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and r.usage.completion_tokens < 64
    assert "<|im_end|>" not in ch.message.content and "<|im_start|>" not in ch.message.content


def test_n_choices_and_seed(backend, client):
    kw = dict(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234, logprobs=0)
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    assert a.usage.prompt_tokens == 5
    # choice i is seeded with seed + i
    single = client.completions.create(**{**kw, "seed": 1235})
    assert single.choices[0].text == a.choices[1].text


def test_streamed_chat_with_two_choices(client):
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=3, temperature=0.8,
                                            seed=5, n=2, stream=True, stream_options={"include_usage": True})
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert set(finishes) == {0, 1} and all(texts.values())
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=3, temperature=0.8,
                                           seed=5, n=2)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_requests_choices_run_side_by_side_each_equal_to_its_run_alone(backend, http):
    """A request's choices ran one after another: n = 4 took four times n = 1. They now hold generation
    slots side by side (half the server's: 4 of 8) and share the stage's iterations; each choice's text
    is still the one its seed gives alone, whole or streamed, and a stream interleaves the choices."""
    tail = _engines(backend)[-1]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 77, "ignore_eos": True}
    alone = [http.post("/v1/completions", json=body | {"seed": 77 + i}).json()["choices"][0]["text"]
             for i in range(4)]
    before = tail.metrics()
    whole = http.post("/v1/completions", json=body | {"n": 4}).json()
    assert [c["text"] for c in whole["choices"]] == alone and whole["usage"]["completion_tokens"] == 48
    # alone, each of the 4 x 12 steps (a prefill, 11 decodes) is an iteration of its own; side by side fewer
    after = tail.metrics()
    assert after.decode_tokens - before.decode_tokens == 44 and after.iterations - before.iterations < 40
    events = [json.loads(line[6:]) for line in http.post("/v1/completions", json=body | {"n": 4, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    order = [e["choices"][0]["index"] for e in events]
    assert ["".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i)
            for i in range(4)] == alone
    assert order != sorted(order)  # choice 0 did not stream to its end before choice 1 began
    assert _wait_idle(backend) == 0


def test_a_prompt_longer_than_its_answer_is_computed_once_for_all_its_choices(backend, http):
    """Side by side, every choice computed the whole prompt: a 1229-token prompt, n = 4 of 32 tokens took 19 s
    where one after another (each later choice from the first's cells in the prefix cache) took 6.8 s. Now
    the later choices of a prompt longer than its answer wait for the first to end and start from its
    cells; each text still equals its choice alone."""
    from meshnet.api.choices import leaders
    from meshnet.api.runner import GenJob

    def job(prompt, max_tokens):
        return GenJob(list(prompt), max_tokens, GREEDY)

    # the first job of the same prompt leads, when the prompt is longer than the answer may be
    assert leaders([job((1, 2, 3), 2), job((1, 2, 3), 2), job((4, 5, 6), 2), job((1, 2, 3), 3),
                    job((4, 5, 6), 2)]) == [None, 0, None, None, 2]
    stage = _engines(backend)[0]
    body = {"prompt": "Once more: " + PROMPT * 60, "max_tokens": 4, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}  # a prompt no other test leaves in the prefix cache
    n_prompt = len(backend.tokenizer.encode(body["prompt"]))
    before = stage.metrics().batch_rows
    r = http.post("/v1/completions", json=body | {"n": 3, "stream": True})
    # rows computed: the prompt once, each later choice the rows of it a reuse may not take (those past the
    # last micro-batch boundary, whose attention path would differ), and the 3 x 3 decodes; three times
    # the prompt side by side
    computed = stage.metrics().batch_rows - before
    assert n_prompt < computed < 1.5 * n_prompt, (computed, n_prompt)
    texts = ["".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                     if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["index"] == i)
             for i in range(3)]
    assert texts == [http.post("/v1/completions", json=body | {"seed": 5 + i}).json()["choices"][0]["text"]
                     for i in range(3)]
    assert _wait_idle(backend) == 0


def test_one_failing_choice_ends_the_request_and_releases_every_choice(tok):
    """Choices run side by side: when one fails, the others are cancelled and their sessions released,
    whole or streamed; the request says why (503 mesh_unavailable) and the server serves the next one."""
    from mesh_util import wait_for

    class Tracked(_ChargedClient):
        """Records the sessions it stepped and those cancelled or released; the second of each three fails
        its 3rd decode."""

        def __init__(self, fail_at: int) -> None:
            super().__init__([], 0.05)
            self.fail_at, self.seen, self.ended = fail_at, set(), set()

        def step(self, req, decode):
            self.seen.add(req.session_id)
            return super().step(req, decode)

        def cancel(self, session_id):
            self.ended.add(session_id)

        release = cancel

        def open_sessions(self) -> set:
            return self.seen - self.ended

    clients: list = []

    def new_client():
        clients.append(Tracked(3 if len(clients) % 3 == 1 else 10**9))
        return clients[-1]

    b = ApiBackend(new_client, tok, "smollm2", N_CTX, retry_after_s=3)
    server, thread = start_api_in_thread(b, "127.0.0.1", 0)
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "n": 3}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=30) as http:
            err = _error(http.post("/v1/completions", json=body), 503)
            assert err["code"] == "mesh_unavailable"
            with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            assert s.status_code == 200 and events[-1]["error"]["code"] == "mesh_unavailable"
            assert len(clients) == 6 and all(c.seen for c in clients)
            # every session was cancelled or released: none left open on any client
            assert wait_for(lambda: not any(c.open_sessions() for c in clients), 10) is not None, \
                [c.open_sessions() for c in clients]
            assert sum(c.steps for c in clients) < 6 * 20  # the others stopped: 40 decodes each had they not
            assert http.post("/v1/completions", json=body | {"n": 1, "max_tokens": 3}).status_code == 200
    finally:
        stop_api(server, thread)


@pytest.mark.parametrize("stream", [False, True])
def test_a_later_choice_waits_its_turn_without_failing_a_request_that_holds_a_slot(tok, monkeypatch, stream):
    """A request's later choice waited for a slot of its own while its first choice ran, and gave up after
    ADMISSION_WAIT_S: with the server's other slots held by long answers, n = 2 was a 503 (or a stream's
    error event) though its first choice held a slot, where one after another it had taken that slot next.
    A later choice waits its turn however long; only the request's first choice is bounded."""
    import meshnet.api.backend as backend_module

    monkeypatch.setattr(backend_module, "ADMISSION_WAIT_S", 1.0)
    b = ApiBackend(lambda: _ChargedClient([], 0.05), tok, "smollm2", N_CTX, max_concurrency=4, retry_after_s=3)
    server, thread = start_api_in_thread(b, "127.0.0.1", 0)
    long = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}  # 2 s each, past the 1 s bound
    try:
        url = f"http://127.0.0.1:{server.config.port}"
        with httpx.Client(base_url=url, timeout=30) as http:
            others = [threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": long})
                      for _ in range(3)]  # 3 of the 4 slots
            for t in others:
                t.start()
            time.sleep(0.3)
            body = long | {"n": 2, "stream": stream}
            answer: list = []
            asking = threading.Thread(target=lambda: answer.append(http.post("/v1/completions", json=body)))
            asking.start()
            time.sleep(0.5)
            # its second choice waits for a slot, but no request waits: the queue counts requests
            assert _gauge(http, "meshnet_api_queued_requests") == "0.0" and asking.is_alive()
            asking.join(30)
            r = answer[0]
            assert r.status_code == 200, r.text
            if stream:
                assert "error" not in r.text and r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
            else:
                assert r.json()["usage"]["completion_tokens"] == 80
            for t in others:
                t.join()
    finally:
        stop_api(server, thread)


def test_chat_logprobs(backend, client):
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True) and c.logprob == pytest.approx(tops[0])


def test_mixed_script_stream_equals_whole(backend, client):
    prompt = "Translate to English: 你好，世界！🌍 Café, naïve, Ærøskøbing. Answer: 你好"
    kw = dict(model="smollm2", prompt=prompt, max_tokens=16, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    text, _, chunks = _stream_text(client.completions.create(stream=True, **kw))
    assert text == whole and len(chunks) > 2
    assert any(ord(c) > 0x2FFF for c in whole)  # the reply has CJK/emoji, whose bytes span several tokens
    msgs = [{"role": "user", "content": "Répète: 你好 🌍 naïve"}]
    whole = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=16,
                                           temperature=0).choices[0].message.content
    text, _, _ = _stream_text(client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=16,
                                                             temperature=0, stream=True))
    assert text == whole


# ---- client errors: 400 / 413, and the server keeps serving ------------------------------------------


def _ok(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def _error(r, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param
    return err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", b'{"messages": [', None),  # malformed JSON
    ("/v1/completions", b'[1, 2]', None),  # not an object
    ("/v1/completions", b'', None),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    ("/v1/completions", b'{"prompt": 7}', "prompt"),
    ("/v1/chat/completions", b'{"messages": "hello"}', "messages"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": []}]}', "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages.0.content.0.text"),  # the array alternative's own error, at the part that is wrong
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"prompt": ""}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "n": 0}', "n"),
    ("/v1/completions", b'{"prompt": "x", "n": 1000}', "n"),
    ("/v1/completions", b'{"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "n": 16}', "prompt"),  # 144
    ("/v1/completions", b'{"prompt": "x", "temperature": 2.5}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"5": Infinity}}', "logit_bias.5"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', "top_p"),
    ("/v1/completions", b'{"prompt": "x", "repetition_penalty": 1e-300}', "repetition_penalty"),
    ("/v1/completions", b'{"prompt": "x", "repetition_penalty": 1e-38}', "repetition_penalty"),  # overflowed
    ("/v1/completions", b'{"prompt": "x", "repetition_penalty": 0.09}', "repetition_penalty"),
    ("/v1/completions", b'{"prompt": "x", "presence_penalty": 3}', "presence_penalty"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 6}', "logprobs"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    ("/v1/completions", b'{"prompt": "x", "bogus": 1}', "bogus"),
    ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": false, '
                             b'"stream_options": {"include_usage": true}}', "stream_options"),
    ("/v1/completions", b'{"prompt": [999999]}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}', "top_logprobs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
     "tools.0"),
])
def test_bad_requests_are_400(backend, http, path, body, param):
    before = _engines(backend)[0].metrics().prefill_tokens
    err = _error(http.post(path, content=body, headers={"Content-Type": "application/json"}), 400, param)
    assert err["type"] == "invalid_request_error"
    assert _engines(backend)[0].metrics().prefill_tokens == before  # nothing reached the engine
    _ok(http)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_a_model_not_served_here_is_404_as_openai_answers_it(backend, http, path, body):
    """It was a 400: OpenAI's SDKs raise NotFoundError for a 404 ``model_not_found``, which clients catch."""
    err = _error(http.post(path, json={**body, "model": "gpt-4"}), 404, "model")
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert err["message"] == "model 'gpt-4' is not served here; this server serves 'smollm2'"
    _ok(http)


def test_an_api_key_is_required_of_every_request_but_health(backend, tmp_path, capsys, monkeypatch):
    """Bound beyond loopback, the API ran generations for whoever reached its port: no key could be set.
    With --api-key every request but /health must carry it as OpenAI's SDKs send it (401 otherwise, OpenAI's
    invalid_api_key), and nothing reaches the engine without it."""
    server, thread = start_api_in_thread(backend, "127.0.0.1", 0, api_key="sk-mesh-0123")
    base = f"http://127.0.0.1:{server.config.port}"
    try:
        before = _engines(backend)[0].metrics().prefill_tokens
        with httpx.Client(base_url=base, timeout=60) as raw:
            err = _error(raw.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}), 401, None)
            assert err["code"] == "invalid_api_key" and err["message"].startswith("no API key: send the header")
            wrong = raw.get("/v1/models", headers={"Authorization": "Bearer sk-mesh-0124"})
            assert _error(wrong, 401, None)["message"].startswith("an incorrect API key")
            assert wrong.headers["WWW-Authenticate"] == "Bearer"
            assert raw.get("/v1/models", headers={"Authorization": "bearer sk-mesh-0123"}).status_code == 200
            assert raw.get("/v1/models", headers={"Authorization": "Basic sk-mesh-0123"}).status_code == 401
            assert raw.get("/v1/models", headers={"Authorization": "Bearer sk-mesh-0123x"}).status_code == 401
            assert raw.get("/metrics").status_code == 401
            probe = raw.get("/health")  # load balancers probe without a key; only the key shows the route
            assert probe.status_code == 200 and probe.json() == {"status": "ok"}
            keyed_health = raw.get("/health", headers={"Authorization": "Bearer sk-mesh-0123"}).json()
            assert keyed_health["status"] == "ok" and keyed_health["route"] and keyed_health["model"] == "smollm2"
        assert _engines(backend)[0].metrics().prefill_tokens == before
        keyed = openai.OpenAI(base_url=base + "/v1", api_key="sk-mesh-0123", max_retries=0, timeout=120)
        out = keyed.completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError) as ei:
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
        assert ei.value.status_code == 401
        # bench serve --url measures a keyed server given its key, and says what is missing without it
        import argparse

        from meshnet.bench.serve_bench import add_serve_bench_parser

        monkeypatch.delenv("MESHNET_API_KEY", raising=False)
        parser = argparse.ArgumentParser()
        add_serve_bench_parser(parser.add_subparsers(dest="bench"))
        load = ["--concurrency", "2", "--requests-per-stream", "1", "--max-tokens", "2", "--rounds", "1"]
        args = parser.parse_args(["serve", "--url", base, *load, "--out", str(tmp_path / "no-key.json")])
        assert args.func(args) == 1
        assert f"{base} asks for an API key: pass the one it was started with" in capsys.readouterr().err
        out = tmp_path / "keyed.json"
        args = parser.parse_args(["serve", "--url", base, "--api-key", "sk-mesh-0123", *load, "--out", str(out)])
        assert args.func(args) == 0
        row = json.loads(out.read_text())["results"]["url"]["2"]
        assert row["errors"] == 0 and row["completion_tokens"] == 2 * row["completed"]
    finally:
        stop_api(server, thread)


def test_a_request_a_web_page_of_another_origin_sent_is_refused(backend, http):
    """A page on another site can send a form or text/plain body without asking the browser first, and
    the API read it as JSON: any page a user visited could start generations on an unauthenticated API.
    Its Origin names another host than the request's: 403, nothing reaches the engine. The API's own
    origin, and clients without an Origin (curl, SDKs), are served."""
    port = http.base_url.port
    before = _engines(backend)[0].metrics().prefill_tokens
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    for origin in ("https://evil.example", "null", f"http://localhost:{port + 1}"):
        err = _error(http.post("/v1/completions", content=body, headers={"Content-Type": "text/plain",
                                                                            "Origin": origin}), 403, None)
        assert err["code"] == "cross_origin" and f"a request from the web page at {origin} is refused" in err["message"]
    assert _engines(backend)[0].metrics().prefill_tokens == before
    r = http.post("/v1/completions", content=body, headers={"Origin": f"http://127.0.0.1:{port}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert http.get("/v1/models", headers={"Origin": "https://evil.example"}).status_code == 200
    assert http.get("/openapi.json").status_code == 404  # no schema pages either
    _ok(http)


def test_head_probes_of_health_and_models_are_answered(http):
    """Load balancers probe with HEAD: it was 405."""
    for path in ("/health", "/v1/models"):
        r = http.head(path)
        assert (r.status_code, r.content) == (200, b"")


def test_a_body_nested_too_deeply_says_so_not_invalid_json(http):
    body = b'{"prompt": "x", "stop": ' + b"[" * 300 + b"]" * 300 + b"}"
    err = _error(http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}), 400, None)
    assert err["code"] == "invalid_json" and err["message"].startswith(
        "the request body nests arrays and objects too deeply to read (Invalid JSON: recursion limit exceeded")
    _ok(http)


def test_a_temperature_too_cold_for_float32_is_greedy(http):
    """1e-38 overflows float32 when the logits are divided by it; the answer is the greedy one."""
    def text(temperature):
        r = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                               "temperature": temperature, "seed": 1})
        assert r.status_code == 200
        return r.json()["choices"][0]["text"]

    greedy = text(0)
    assert greedy and text(1e-38) == greedy and text(1e-46) == greedy


def test_a_union_error_says_what_is_wrong_inside_the_value(http):
    def message(path, body):
        r = http.post(path, json=body)
        assert r.status_code == 400
        return r.json()["error"]["message"]

    assert message("/v1/completions", {"prompt": ["a", 1]}).endswith(
        "expected str or list[str] or list[int] or list[list[int]], got an array holding a string and an integer")
    assert message("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}) == (
        "invalid value for messages.0.content: List should have at least 1 item after validation, not 0")


def test_over_context_prompt_allocates_nothing(backend, http):
    tok = backend.tokenizer
    prompt = "hello " * (N_CTX + 50)
    assert len(tok.encode(prompt)) > N_CTX
    before = _engines(backend)[0].metrics()
    for path, body in [("/v1/completions", {"prompt": prompt, "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "stream": True})]:
        err = _error(http.post(path, json=body), 400)
        assert err["code"] == "context_length_exceeded" and str(N_CTX) in err["message"]
        assert _active_sessions(backend) == 0
    after = _engines(backend)[0].metrics()
    assert (after.prefill_tokens, after.decode_tokens) == (before.prefill_tokens, before.decode_tokens)
    _ok(http)


def test_a_prompt_no_context_could_hold_is_refused_by_its_length_untokenized(backend, http, monkeypatch):
    """A 1.3 MB prompt was tokenized (1 s of Python holding the interpreter lock, every other request and
    stream waiting) before it was refused; past what n_ctx tokens of the vocabulary could hold it is now
    refused by its length, and tokenized up to there."""
    tok = backend.tokenizer
    most = N_CTX * tok.max_token_chars + 1
    tokenized: list[int] = []
    real = type(tok).encode_pieces
    monkeypatch.setattr(type(tok), "encode_pieces",
                        lambda self, pieces, *a, **k: tokenized.append(sum(len(t) for t, _ in pieces)) or
                        real(self, pieces, *a, **k))
    for path, body in [("/v1/completions", {"prompt": "x" * (most + 1), "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x" * most},
                                                             {"role": "user", "content": [{"type": "text",
                                                                                           "text": "y"}]}]})]:
        err = _error(http.post(path, json=body), 400)
        assert err["code"] == "context_length_exceeded"
        assert err["message"] == (f"This model's maximum context length is {N_CTX} tokens, but the prompt has "
                                  f"{most + 1} characters, more than {N_CTX} tokens of its vocabulary hold (at "
                                  f"most {tok.max_token_chars} characters a token). Shorten the prompt.")
    assert tokenized == []
    # At the bound it is tokenized, and refused by its tokens as before.
    err = _error(http.post("/v1/completions", json={"prompt": "x" * most, "max_tokens": 4}), 400)
    assert err["code"] == "context_length_exceeded" and "tokens. Shorten the prompt." in err["message"]
    assert tokenized == [most]
    _ok(http)


def test_more_messages_than_the_context_holds_are_refused_unrendered(backend, http, monkeypatch):
    """50,000 one-letter messages (1.7 MB, under the body limit) were rendered and tokenized, holding every
    stream for over a second, before their refusal; each renders to a token at least, so more messages
    than n_ctx are refused before the template runs. N_CTX of them are rendered as before."""
    import meshnet.chat_template as chat_template

    rendered: list[int] = []
    real = chat_template.chat_prompt_ids
    monkeypatch.setattr(chat_template, "chat_prompt_ids",
                        lambda tok, messages, *a, **k: rendered.append(len(messages)) or real(tok, messages, *a, **k))
    err = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}] * 50_000}),
                 400, "messages")
    assert err["code"] == "context_length_exceeded" and err["message"] == (
        f"This model's maximum context length is {N_CTX} tokens, but there are 50000 messages, a token each at "
        "least. Shorten the conversation.")
    assert rendered == []
    err = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}] * N_CTX}),
                 400, "messages")
    assert err["code"] == "context_length_exceeded" and rendered == [N_CTX]
    _ok(http)


def test_oversized_body_is_413(http):
    big = json.dumps({"prompt": "x" * (3 * 1024 * 1024), "max_tokens": 1}).encode()
    err = _error(http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413)
    assert err["code"] == "request_too_large"
    _ok(http)


def test_unknown_endpoint_and_method_use_openai_errors(http):
    def errors(kind: str) -> float:
        return float(next((line.split()[1] for line in http.get("/metrics").text.splitlines()
                           if line.startswith(f'meshnet_api_errors_total{{kind="{kind}"}}')), 0))

    before = errors("404"), errors("405")
    assert _error(http.get("/v1/nothing"), 404)["code"] is None
    _error(http.get("/v1/completions"), 405)
    assert (errors("404"), errors("405")) == (before[0] + 1, before[1] + 1)  # they were not counted
    # OpenAI's endpoints this server lacks say so (a bare "no such endpoint" read as a wrong URL)
    for path, what in (("/v1/embeddings", "embeddings"), ("/v1/images/generations", "images")):
        err = _error(http.post(path, json={"model": "smollm2", "input": "Hi"}), 404)
        assert err["code"] == "unsupported_endpoint" and err["message"] == (
            f"no such endpoint: POST {path} ({what} are not served here: this server generates text with "
            "/v1/chat/completions and /v1/completions)")
    _ok(http)


def test_a_body_that_stops_arriving_is_408_and_the_server_keeps_serving(served, http, monkeypatch):
    """Headers, then 6 of 100 bytes of body: the connection and its task were held for good. A slow body
    whose bytes keep coming is read to its end."""
    import socket

    import meshnet.api.middleware as middleware

    monkeypatch.setattr(middleware, "BODY_TIMEOUT_S", 0.5)
    port = int(served[1].rsplit(":", 1)[1])
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        for i in range(0, len(body), 8):  # 2 s in all, a piece every 0.2 s
            raw.sendall(body[i:i + 8])
            time.sleep(0.2)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"prom")
        answer = b""
        while chunk := raw.recv(65536):  # the server closes the connection after its answer
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and err["message"] == \
        "no byte of the request body came for 0.5 s (6 of 100 bytes came)"
    _ok(http)


def test_headers_that_stop_arriving_close_the_connection_and_the_server_keeps_serving(served, http, monkeypatch):
    """``POST ... HTTP/1.1`` and then a byte every few seconds held a connection for good, before or after
    a first request on it: 20,000 of them took every file descriptor of the process."""
    import socket

    import meshnet.api.http_protocol as http_protocol

    monkeypatch.setattr(http_protocol, "HEADERS_S", 0.6)
    port = int(served[1].rsplit(":", 1)[1])

    def trickle_until_closed(raw) -> float:
        """Send a byte every 0.1 s until the server closes the connection; seconds it took."""
        started = time.monotonic()
        raw.setblocking(False)
        while time.monotonic() - started < 10:
            try:
                if raw.recv(65536) == b"":
                    break
            except BlockingIOError:
                pass
            except OSError:  # reset
                break
            try:
                raw.send(b"X")
            except OSError:  # closed under us
                break
            time.sleep(0.1)
        return time.monotonic() - started

    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        # A byte every 0.1 s is not a request: the deadline counts from connecting, not from the last byte.
        assert 0.5 <= trickle_until_closed(raw) < 3
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        raw.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a whole request first: answered
        assert raw.recv(65536).startswith(b"HTTP/1.1 200 ")
        raw.sendall(b"GET /health HTTP/1.1\r\n")  # then the next one a byte at a time
        assert 0.5 <= trickle_until_closed(raw) < 3
    _ok(http)


def test_an_internal_error_is_a_500_and_the_connection_keeps_serving(served, monkeypatch):
    """A bug inside a request (here: planning the tools raising) answers 500 in OpenAI's shape, and the
    client's keep-alive connection serves its next request (Starlette's handler re-raised to the server,
    which dropped it)."""
    import meshnet.api.app as app_module

    def broken(*_a, **_k):
        raise TypeError("unhashable type: 'list'")

    monkeypatch.setattr(app_module, "plan_tools", broken)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with httpx.Client(base_url=served[1], timeout=120, limits=httpx.Limits(max_connections=1)) as one:
        r = one.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "tools": [tool],
                                                   "max_tokens": 2, "temperature": 0})
        assert r.status_code == 500 and r.json()["error"] == {"message": "internal error: TypeError", "type":
                                                              "server_error", "param": None, "code": "internal_error"}
        assert one.get("/health").status_code == 200  # on the same connection, which stayed open


def test_an_internal_error_mid_stream_ends_it_with_an_error_event(served, http, monkeypatch):
    """A bug while a stream's events were made (here: building a chunk raising) cut the response mid-body
    ("incomplete chunked read" in the client, "ASGI callable returned without completing response" in the
    log). The stream now ends with an error event in OpenAI's shape, and the server serves on."""
    from meshnet.api.sse import ChatChunks

    def broken(*_a, **_k):
        raise TypeError("not a str")

    monkeypatch.setattr(ChatChunks, "content", broken)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                "temperature": 0, "stream": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1] == {"error": {"message": "internal error: TypeError", "type": "server_error", "param": None,
                                    "code": "internal_error"}}
    monkeypatch.undo()
    _ok(http)


def test_a_stream_waiting_for_its_next_piece_sends_keep_alive_comments(served, http, monkeypatch):
    """A stream whose next piece is slow to come (a failover replaying the session: 6-8 s on a 3-stage mesh)
    sent nothing meanwhile, past httpx's 5 s read timeout and towards a proxy's; it now sends an SSE comment
    each KEEPALIVE_S (here 0.1 s) until the piece comes, and the answer is the same."""
    from meshnet.api import sse
    from meshnet.api.runner import ChoiceRun

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "stream": True}
    plain = http.post("/v1/chat/completions", json=body).text
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.1)
    real, calls = ChoiceRun.next_piece, {}

    async def slow_third(self):  # counted per run: another test's stream may still be ending meanwhile
        calls[id(self)] = calls.get(id(self), 0) + 1
        if calls[id(self)] == 3:
            await asyncio.sleep(0.6)
        return await real(self)

    monkeypatch.setattr(ChoiceRun, "next_piece", slow_third)
    r = http.post("/v1/chat/completions", json=body)
    lines = [line for line in r.text.splitlines() if line]
    assert r.status_code == 200, lines
    # The run of comments while the third piece is held: a loaded machine may also hold another piece past
    # 0.1 s (CI saw single stray comments), so the held one is the longest run, not the only comments.
    runs, start = [], None
    for i, line in enumerate(lines + [""]):
        if line == ": keep-alive" and start is None:
            start = i
        elif line != ": keep-alive" and start is not None:
            runs.append((i - start, start))
            start = None
    length, first = max(runs, default=(0, 0))
    assert 3 <= length <= 15 and first >= 2, lines  # 0.6 s held (more when loaded), one each 0.1 s, mid-stream

    def content(text: str) -> str:
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

    assert content(r.text) == content(plain) and content(plain)


# ---- disconnects ---------------------------------------------------------------------------------


def test_disconnect_mid_stream_releases_sessions(backend, http):
    eng = _engines(backend)[0]
    body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 3:
                    break
        assert _active_sessions(backend) == 1
        decoded_at_close = eng.metrics().decode_tokens
    # leaving the block closes the connection mid-stream
    assert _wait_idle(backend, 10.0) == 0
    # the stream may have run ahead of what the client read, but not on after the close
    assert eng.metrics().decode_tokens - decoded_at_close <= 2
    _ok(http)


# ---- mesh trouble: 503 with Retry-After --------------------------------------------------------------


class _FlakyClient:
    """A mesh client whose prefill works and whose ``fail_at``-th decode raises MeshUnavailable."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.steps = fail_at, 0

    def step(self, req, decode):
        self.steps += 1
        if decode and self.steps > self.fail_at:
            raise MeshUnavailable("session x: a node failed and no replacement route exists (layers 10:20)")
        return StepResult(Status.OK, token=SampledToken(token_id=314, logprob=-0.5))

    def cancel(self, session_id):
        pass

    def release(self, session_id):
        pass


class _ChargedClient(_FlakyClient):
    """A mesh client that records the positions the API charges (``delivered``) and takes ``step_s`` a
    decode step."""

    def __init__(self, charged: list[int], step_s: float) -> None:
        super().__init__(10**9)
        self.charged, self.step_s = charged, step_s

    def step(self, req, decode):
        if decode:
            time.sleep(self.step_s)
        return super().step(req, decode)

    def delivered(self, session_id, position):
        self.charged.append(position)


def test_a_non_streamed_answer_is_charged_once_whole_and_not_when_its_client_left(backend):
    """A client that left a non-streamed request before its answer was charged the tokens read until
    then (499, yet one token on the ledger); a whole answer is charged each of its tokens."""
    charged: list[int] = []
    b = ApiBackend(lambda: _ChargedClient(charged, 0.2), backend.tokenizer, "smollm2", N_CTX, retry_after_s=3)
    server, thread = start_api_in_thread(b, "127.0.0.1", 0)
    n_prompt = len(backend.tokenizer.encode(PROMPT))
    try:
        url = f"http://127.0.0.1:{server.config.port}"
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert charged == [n_prompt, n_prompt + 1, n_prompt + 2]
        charged.clear()
        with httpx.Client(base_url=url, timeout=1.0) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True})
        time.sleep(1.0)  # the run sees the client gone at its next token, and stops
        assert charged == []
    finally:
        stop_api(server, thread)


@pytest.fixture(scope="module")
def broken_servers(backend):
    """One server whose route check fails, one whose mesh dies after two tokens."""
    def no_route():
        raise MeshUnavailable("no route: layers [10, 20) are not served by any node")

    tok = backend.tokenizer
    servers = []
    for kw in ({"new_client": lambda: _FlakyClient(10**9), "check_route": no_route},
               {"new_client": lambda: _FlakyClient(2)}):
        b = ApiBackend(tokenizer=tok, model_name="smollm2", n_ctx=N_CTX, retry_after_s=3, **kw)
        servers.append(start_api_in_thread(b, "127.0.0.1", 0))
    urls = [f"http://127.0.0.1:{s.config.port}" for s, _ in servers]
    yield urls
    for s, t in servers:
        stop_api(s, t)


def test_no_route_is_503_with_retry_after(broken_servers):
    with httpx.Client(base_url=broken_servers[0], timeout=30) as http:
        for path, body in [("/v1/chat/completions", {"messages": QUESTION}),
                           ("/v1/completions", {"prompt": PROMPT, "stream": True})]:
            r = http.post(path, json=body)
            err = _error(r, 503)
            assert r.headers["Retry-After"] == "3" and "10, 20" in err["message"]
        h = http.get("/health")
        assert h.status_code == 503 and h.headers["Retry-After"] == "3" and h.json()["status"] == "unavailable"
        # client errors are still 400 when the mesh is down
        _error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
        assert "meshnet_api_requests_total" in http.get("/metrics").text


def test_mesh_failure_mid_request(broken_servers, caplog):
    """A 503 and a stream's error event are answered, and logged under the request's x-request-id (a user
    quoting it found nothing in the log: only the client's "failing over" under a session id); a 400 is the
    caller's and is not logged."""
    import logging

    with caplog.at_level(logging.WARNING, logger="meshnet.api"), \
            httpx.Client(base_url=broken_servers[1], timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10}, headers={"X-Request-Id": "whole-1"})
        err = _error(r, 503)
        assert err["code"] == "mesh_unavailable" and r.headers["Retry-After"] == "3"
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "stream": True},
                         headers={"X-Request-Id": "stream-1"}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "mesh_unavailable"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) != ""
        _error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}, headers={"X-Request-Id": "bad-1"}),
               400, "max_tokens")
    logged = [r.getMessage() for r in caplog.records if "x-request-id" in r.getMessage()]
    for rid in ("whole-1", "stream-1"):
        [line] = [m for m in logged if f"(x-request-id {rid})" in m]
        assert line.startswith(f"POST /v1/completions (x-request-id {rid}) answered 503 mesh_unavailable: "), line
    assert not [m for m in logged if "bad-1" in m]


def _requests_total(http, endpoint: str) -> dict[str, float]:
    """``meshnet_api_requests_total`` of ``endpoint`` on ``/metrics``, by status."""
    prefix = f'meshnet_api_requests_total{{endpoint="{endpoint}",status="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1])
            for line in http.get("/metrics").text.splitlines() if line.startswith(prefix)}


def test_a_stream_is_counted_once_when_it_ends_by_how_it_ended(tok):
    """Three streams all sent 200 before their first token: one finished (200), one whose client left
    after its first chunk (499), one the mesh failed mid-way (503, the status of its error event). Each
    is counted once, under how it ended; the one whose client left counted 200 before."""
    from mesh_util import wait_for

    clients = [_ChargedClient([], 0.0), _ChargedClient([], 0.2), _FlakyClient(2)]  # one per stream, in turn
    b = ApiBackend(lambda: clients.pop(0), tok, "smollm2", N_CTX, retry_after_s=3)
    server, thread = start_api_in_thread(b, "127.0.0.1", 0)
    body = {"prompt": PROMPT, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body | {"max_tokens": 3}) as s:
                assert s.status_code == 200 and list(s.iter_lines())[-2] == "data: [DONE]"
            assert _requests_total(http, "/v1/completions") == {"200": 1.0}
            with http.stream("POST", "/v1/completions", json=body | {"max_tokens": 40}) as s:  # 8 s of decodes
                assert s.status_code == 200 and next(s.iter_lines()).startswith("data: {")
            # leaving the block closed the connection after the first chunk
            assert wait_for(lambda: "499" in _requests_total(http, "/v1/completions"), 10) is not None
            with http.stream("POST", "/v1/completions", json=body | {"max_tokens": 10}) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            assert s.status_code == 200 and events[-1]["error"]["code"] == "mesh_unavailable"
            assert _requests_total(http, "/v1/completions") == {"200": 1.0, "499": 1.0, "503": 1.0}
    finally:
        stop_api(server, thread)


class _HeldClient(_FlakyClient):
    """A client whose first prefill waits until ``go`` is set, holding its generation slot meanwhile."""

    def __init__(self, go: threading.Event) -> None:
        super().__init__(10**9)
        self.go = go

    def step(self, req, decode):
        if not decode:
            self.go.wait(30)
        return super().step(req, decode)


def _gauge(http, name: str) -> str:
    """The value of the unlabelled metric ``name`` on ``/metrics``, as text."""
    return next(line.split()[1] for line in http.get("/metrics").text.splitlines() if line.startswith(name + " "))


def test_a_request_waiting_past_the_admission_time_for_a_slot_is_503(backend, monkeypatch):
    """One generation slot, held: the next request waits for it at most ADMISSION_WAIT_S (the time the
    wait for room on the stages shares), then gets 503 server_busy with Retry-After, streamed or not; it used
    to wait on. Refused, its prompt was never processed: the prompt-token counter counted it anyway."""
    import meshnet.api.backend as backend_module

    monkeypatch.setattr(backend_module, "ADMISSION_WAIT_S", 0.5)
    go = threading.Event()
    b = ApiBackend(lambda: _HeldClient(go), backend.tokenizer, "smollm2", N_CTX, max_concurrency=1, retry_after_s=3)
    server, thread = start_api_in_thread(b, "127.0.0.1", 0)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=30) as http:
            held = threading.Thread(target=lambda: http.post("/v1/completions", json={"prompt": PROMPT,
                                                                                      "max_tokens": 2}))
            held.start()
            deadline = time.monotonic() + 10
            while "meshnet_api_active_sessions 1.0" not in http.get("/metrics").text:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            prompt_tokens = _gauge(http, "meshnet_api_prompt_tokens_total")
            assert float(prompt_tokens) == len(backend.tokenizer.encode(PROMPT))  # the held one's
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            err = _error(r, 503)
            assert err["code"] == "server_busy" and r.headers["Retry-After"] == "3"
            assert err["message"] == ("the server is busy: waited 0.5 s for one of its 1 generation slots; "
                                      "retry later")
            # Streamed, the same status before any event (it was a 200 whose stream held an error event,
            # which clients do not retry).
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2, "stream": True})
            assert _error(r, 503)["code"] == "server_busy" and r.headers["Retry-After"] == "3"
            assert "meshnet_api_active_sessions 1.0" in http.get("/metrics").text  # the held one only
            assert _gauge(http, "meshnet_api_prompt_tokens_total") == prompt_tokens
            go.set()
            held.join(30)
            assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    finally:
        go.set()
        stop_api(server, thread)



def test_a_burst_of_requests_queues_no_more_than_max_queued(backend):
    """One slot, held, and room for 2 in line: of 10 requests sent at once, 2 wait and 8 get 503
    server_busy. The bound was checked before the prompt's work, and the queue joined after it, with
    awaits between: a burst all passed the check and queued past the bound (257 of 256)."""
    from meshnet.api.app import create_app
    from meshnet.api.server import serve_app_in_thread

    go = threading.Event()
    b = ApiBackend(lambda: _HeldClient(go), backend.tokenizer, "smollm2", N_CTX, max_concurrency=1, retry_after_s=3)
    server, thread = serve_app_in_thread(create_app(b, max_queued=2), "127.0.0.1", 0)
    codes: list[tuple[int, str]] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=60) as http:
            def ask() -> None:
                r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                codes.append((r.status_code, r.json().get("error", {}).get("code", "")))

            held = threading.Thread(target=ask)
            held.start()
            deadline = time.monotonic() + 10
            while "meshnet_api_active_sessions 1.0" not in http.get("/metrics").text:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            burst = [threading.Thread(target=ask) for _ in range(10)]
            for t in burst:
                t.start()
            while len(codes) < 8:
                assert time.monotonic() < deadline + 20
                time.sleep(0.02)
            assert _gauge(http, "meshnet_api_queued_requests") == "2.0"
            assert sorted(codes) == [(503, "server_busy")] * 8
            go.set()
            for t in [held, *burst]:
                t.join(30)
        assert sorted(codes) == [(200, "")] * 3 + [(503, "server_busy")] * 8
    finally:
        go.set()
        stop_api(server, thread)


def test_requests_waiting_for_a_slot_get_it_in_arrival_order(backend):
    """A waiting request gave its place up every 0.25 s (to look whether the server was stopping) and
    queued again behind later ones: a slot freed at 0.4 s went to the second request, not the first. The
    order is the one the prefills reached the stages in (the clients' threads may read their answers in
    another order on a busy machine)."""
    go = threading.Event()
    prefilled: list[str] = []

    class Recording(_HeldClient):
        def step(self, req, decode):
            res = super().step(req, decode)
            if not decode:
                prefilled.append(backend.tokenizer.decode(list(req.token_ids)).rsplit(" ", 1)[-1])
            return res

    b = ApiBackend(lambda: Recording(go), backend.tokenizer, "smollm2", N_CTX, max_concurrency=1, retry_after_s=3)
    server, thread = start_api_in_thread(b, "127.0.0.1", 0)
    done: list[str] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=30) as http:
            def ask(name: str) -> None:
                r = http.post("/v1/completions", json={"prompt": f"{PROMPT} {name}", "max_tokens": 2})
                assert r.status_code == 200
                done.append(name)

            threads = [threading.Thread(target=ask, args=(name,)) for name in ("held", "first", "second")]
            threads[0].start()
            deadline = time.monotonic() + 10
            while "meshnet_api_active_sessions 1.0" not in http.get("/metrics").text:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            threads[1].start()
            while _gauge(http, "meshnet_api_queued_requests") != "1.0":  # the first is in line
                assert time.monotonic() < deadline
                time.sleep(0.02)
            threads[2].start()
            while _gauge(http, "meshnet_api_queued_requests") != "2.0":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.4)  # both wait, the first past a 0.25 s slice
            go.set()
            for t in threads:
                t.join(30)
        assert sorted(done) == ["first", "held", "second"]
        assert prefilled == ["held", "first", "second"]
    finally:
        go.set()
        stop_api(server, thread)


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_client_leaves_while_it_waits_for_a_slot_leaves_the_queue(backend, monkeypatch, stream):
    """A client gone while its request waits in line must not keep its place (nor, once a slot frees, run
    its prefill for nobody, ahead of those still waiting). A streamed request did not; a plain one kept
    it until a slot freed."""
    import socket

    from mesh_util import wait_for

    import meshnet.api.backend as backend_module

    monkeypatch.setattr(backend_module, "ADMISSION_WAIT_S", 20.0)
    go = threading.Event()
    b = ApiBackend(lambda: _HeldClient(go), backend.tokenizer, "smollm2", N_CTX, max_concurrency=1, retry_after_s=3)
    server, thread = start_api_in_thread(b, "127.0.0.1", 0)
    port = server.config.port

    def until(http, name: str, value: str, timeout_s: float) -> None:
        assert wait_for(lambda: _gauge(http, name) == value, timeout_s) is not None, f"{name} never {value}"

    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            held = threading.Thread(target=lambda: http.post("/v1/completions", json={"prompt": PROMPT,
                                                                                      "max_tokens": 2}))
            held.start()
            until(http, "meshnet_api_active_sessions", "1.0", 10)
            prompt_tokens = _gauge(http, "meshnet_api_prompt_tokens_total")
            body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "stream": stream}).encode()
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                until(http, "meshnet_api_queued_requests", "1.0", 10)
            until(http, "meshnet_api_queued_requests", "0.0", 5)  # it waited on, up to 20 s, and then ran
            assert _gauge(http, "meshnet_api_active_sessions") == "1.0"  # the held one only
            go.set()
            held.join(30)
            until(http, "meshnet_api_active_sessions", "0.0", 10)
            assert _gauge(http, "meshnet_api_prompt_tokens_total") == prompt_tokens  # the gone one's: never run
    finally:
        go.set()
        stop_api(server, thread)


def test_metrics_exported(backend, http):
    # its own requests: the module's other tests may run in another process (pytest -n without loadfile)
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -1}).status_code == 400
    text = http.get("/metrics").text
    assert 'meshnet_api_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'meshnet_api_requests_total{endpoint="/v1/completions",status="400"}' in text
    count = [ln for ln in text.splitlines() if ln.startswith("meshnet_api_ttft_seconds_count")]
    assert count and float(count[0].split()[-1]) > 0
    gen = [ln for ln in text.splitlines() if ln.startswith("meshnet_api_generated_tokens_total")]
    assert float(gen[0].split()[-1]) > 0
    assert "meshnet_api_active_sessions 0.0" in text
    assert "meshnet_api_admission_waiting 0.0" in text


def test_bench_serve_against_running_server(served, tmp_path):
    import argparse

    from meshnet.bench.serve_bench import add_serve_bench_parser

    parser = argparse.ArgumentParser()
    add_serve_bench_parser(parser.add_subparsers(dest="bench"))
    out = tmp_path / "serve.json"
    args = parser.parse_args(["serve", "--url", served[1], "--concurrency", "3", "--requests-per-stream", "2",
                              "--max-tokens", "3", "--rounds", "2", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    row = report["results"]["url"]["3"]
    assert row["completed"] == 8 and row["errors"] == 0  # 3 streams x 2 requests, raised to MIN_REQUESTS
    assert row["completion_tokens"] == 24  # three tokens each, unless a reply ends sooner
    assert 0 < row["ttft_s"]["p50"] <= row["ttft_s"]["p95"] <= row["latency_s"]["p95"]
    assert row["tokens_per_s"] > 0
    assert len(report["rounds"]) == 2 and report["rounds"][-1]["results"] == report["results"]
    assert report["rounds"][0]["results"]["url"]["3"]["completed"] == 8


def test_bench_serve_counts_every_choice_of_a_request(served, tmp_path):
    """``--choices 3``: each request asks for n = 3 running to their budget, and its tokens are those of all
    three (8 requests x 3 choices x 3 tokens)."""
    import argparse

    from meshnet.bench.serve_bench import add_serve_bench_parser

    parser = argparse.ArgumentParser()
    add_serve_bench_parser(parser.add_subparsers(dest="bench"))
    out = tmp_path / "serve.json"
    args = parser.parse_args(["serve", "--url", served[1], "--concurrency", "2", "--max-tokens", "3",
                              "--choices", "3", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    row = report["results"]["url"]["2"]
    assert (report["choices"], row["completed"], row["errors"]) == (3, 8, 0)
    assert row["completion_tokens"] == 72


def test_a_load_counts_choices_from_the_stream_not_from_usage():
    """llama-server's ``usage`` counts one choice's tokens for n > 1: a request's tokens are counted choice by
    choice, a choice cut by its budget holding max_tokens, one that stopped sooner its chunks."""
    import asyncio

    import httpx

    from meshnet.bench.serve_load import LoadSpec, one_request

    sent = []

    def chunk(index, content=None, finish=None):
        delta = {"content": content} if content else {}
        return {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}

    def handler(request):
        sent.append(json.loads(request.content))
        events = [chunk(0, "a"), chunk(1, "b"), chunk(0, "c"), chunk(1, None, "stop"), chunk(0, "d"),
                  chunk(0, None, "length"), {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def run():
        async with httpx.AsyncClient(base_url="http://x", transport=httpx.MockTransport(handler)) as client:
            return await one_request(client, "m", 0, LoadSpec(1, 1, max_tokens=16, choices=2))

    row = asyncio.run(run())
    assert (sent[0]["n"], sent[0]["ignore_eos"]) == (2, True)
    assert (row["ok"], row["completion_tokens"], row["prompt_tokens"]) == (True, 16 + 1, 9)


def test_bench_counts_the_cpu_of_every_process_a_server_started():
    """A parent that only waits and a child that burns 0.4 s of CPU: the tree's CPU holds the child's time
    and counts both processes (what ``bench serve`` reads around a mesh's load)."""
    import os
    import signal
    import subprocess
    import sys

    from meshnet.bench.served import tree_cpu_seconds

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"
    spawn = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {burn!r}])\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    try:
        deadline, found = time.monotonic() + 20, None
        while time.monotonic() < deadline:
            found = tree_cpu_seconds(parent.pid)
            if found is not None and found[1] == 2 and found[0] >= 0.4:
                break
            time.sleep(0.1)
        assert found is not None and found[1] == 2
        assert 0.4 <= found[0] < 5.0
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert tree_cpu_seconds(-1) is None


def test_serve_bench_ratios_are_the_medians_of_the_rounds():
    from meshnet.bench.serve_bench import _median_ratios

    rounds = [{"8": {"meshnet_aggregate_vs_llama": 0.9, "mesh_vs_meshnet": None}},
              {"8": {"meshnet_aggregate_vs_llama": 1.1, "mesh_vs_meshnet": 0.5}},
              {"8": {"meshnet_aggregate_vs_llama": 1.05, "mesh_vs_meshnet": 0.7}}]
    assert _median_ratios(rounds) == {"8": {"meshnet_aggregate_vs_llama": 1.05, "mesh_vs_meshnet": 0.6}}
    assert _median_ratios([{"1": {"mesh_vs_meshnet": None}}]) == {"1": {"mesh_vs_meshnet": None}}


def test_serve_bench_compares_cpu_per_token():
    from meshnet.bench.serve_bench import _ratios

    got = _ratios({"llama-server": {"8": {"tokens_per_s": 100.0, "cpu_ms_per_token": 10.0}},
                   "meshnet": {"8": {"tokens_per_s": 110.0, "cpu_ms_per_token": 9.0}},
                   "mesh": {"8": {"tokens_per_s": 55.0, "cpu_ms_per_token": 18.0}}})["8"]
    assert got["meshnet_cpu_vs_llama"] == 0.9 and got["mesh_cpu_vs_meshnet"] == 2.0
    assert got["mesh_vs_meshnet"] == 0.5


def test_serve_bench_runs_quiet_targets_side_by_side_in_turns(monkeypatch, tmp_path):
    """With --side-by-side, llama-server and meshnet in process take turns a load at a time, A B then B A,
    each row carrying the other's idle CPU; the mesh is started for each of its loads and stopped after it."""
    import argparse

    from meshnet.bench import serve_bench
    from meshnet.bench.served import Server

    events = []

    class Fake(Server):
        def __init__(self, name):
            self.name, self.proc, self.url = name, object(), f"http://{name}"

        def cpu_seconds(self):
            return 1.0

        def stop(self):
            events.append(("stop", self.name))

    def start(self, name, n_parallel):
        events.append(("start", name))
        return Fake(name), "m"

    def measure(server, model, c, args, sample_kv, neighbours=()):
        events.append(("load", server.name, tuple(n.name for n in neighbours)))
        return {"errors": 0, "requests": 8, "prompt_tokens": 10, "completion_tokens": 100, "completed": 8}

    monkeypatch.setattr(serve_bench._Run, "_start", start)
    monkeypatch.setattr(serve_bench, "_measure", measure)
    run = serve_bench._Run({"meshnet": None, "mesh": None}, tmp_path / "llama-server", "m.gguf",
                           argparse.Namespace(threads=2), tmp_path, {}, 1000, side_by_side=True)
    rounds = [{}, {}]
    assert run.measure_c(1, 8, rounds) is False
    assert events == [
        ("start", "llama-server"), ("start", "meshnet"),
        ("load", "llama-server", ("meshnet",)), ("load", "meshnet", ("llama-server",)),
        ("load", "meshnet", ("llama-server",)), ("load", "llama-server", ("meshnet",)),
        ("stop", "llama-server"), ("stop", "meshnet"),
        ("start", "mesh"), ("load", "mesh", ()), ("stop", "mesh"),
        ("start", "mesh"), ("load", "mesh", ()), ("stop", "mesh")]
    assert sorted(rounds[1]) == ["llama-server", "mesh", "meshnet"]
    assert rounds[0]["llama-server"]["1"]["kv"]["allocated_bytes"] == serve_bench.LLAMA_SLOT_CTX * 8 * 1000
    events.clear()
    run.side_by_side = False  # the default: every target started for each load
    run.measure_c(1, 8, [{}])
    assert events == [("start", "llama-server"), ("load", "llama-server", ()), ("stop", "llama-server"),
                      ("start", "meshnet"), ("load", "meshnet", ()), ("stop", "meshnet"),
                      ("start", "mesh"), ("load", "mesh", ()), ("stop", "mesh")]
