"""Requests as OpenAI's API and its newer clients shape them, on the bundled SmolLM2 over raw HTTP: earlier
answers sent back in their own shapes (content parts beside tool calls, refusals), fields newer SDKs set,
seeds at the edge of int64, values below float32's range, and the HTTP around them (a trailing slash, a
compressed body)."""

from __future__ import annotations

import gzip
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

from api_served import served_api  # noqa: E402
from meshnet.api.backend import local_backend  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
CALL = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    with served_api(local_backend(str(smollm2_path), n_ctx=512, max_sessions=2, name="smollm2")) as served:
        yield served


@pytest.fixture(scope="module")
def http(served):
    return served[1]


def _prompt_tokens(http, messages: list[dict]) -> int:
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _error(r, status: int, param: str | None, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code)
    return err["message"]


def test_an_earlier_answer_with_content_parts_and_tool_calls_is_read_as_its_text(http):
    """It was a 500 (a TypeError joining the parts with the call's text)."""
    def history(content) -> list[dict]:
        return [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": CALL},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

    as_text = _prompt_tokens(http, history("Let me look.\nOne moment."))
    assert _prompt_tokens(http, history([{"type": "text", "text": "Let me look."},
                                         {"type": "text", "text": "One moment."}])) == as_text
    r = http.post("/v1/chat/completions", json={"messages": history([{"type": "image_url", "image_url": {}}]),
                                                "max_tokens": 1})
    assert "unsupported content part type(s) 'image_url'" in _error(r, 400, "messages")


def test_an_earlier_refusal_is_read_as_its_text(http):
    """OpenAI returns a refusal as ``content: null`` beside ``refusal``, and takes it back either so or as a
    ``refusal`` part; both were 400."""
    def history(answer: dict) -> list[dict]:
        return [{"role": "user", "content": "Tell me a secret."}, {"role": "assistant", **answer},
                {"role": "user", "content": "Why not?"}]

    as_text = _prompt_tokens(http, history({"content": "I can't share that."}))
    assert _prompt_tokens(http, history({"content": None, "refusal": "I can't share that."})) == as_text
    assert _prompt_tokens(http, history({"content": [{"type": "refusal", "refusal": "I can't share that."}]})) == as_text


@pytest.mark.parametrize("extra", [{"prompt_cache_key": "conversation-7"}, {"safety_identifier": "u-1"},
                                   {"verbosity": "low"}, {"audio": None}, {"prediction": None},
                                   {"web_search_options": None},
                                   {"stream": True, "stream_options": {"include_usage": True,
                                                                       "include_obfuscation": False}}])
def test_fields_newer_sdks_set_are_accepted_and_ignored(http, extra):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if extra.get("stream"):
        usage = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]["usage"]
        assert usage["completion_tokens"] == 2
    else:
        assert r.json()["usage"]["completion_tokens"] == 2


def test_audio_output_is_refused_by_name(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                "audio": {"voice": "alloy", "format": "wav"}})
    assert _error(r, 400, "audio", "unsupported_parameter") == "audio output is not supported"


@pytest.mark.parametrize("field, value, words", [
    ("prediction", {"type": "content", "content": "Hi"}, "predicted outputs (prediction) are not supported"),
    ("web_search_options", {}, "web search is not supported")])
def test_documented_openai_fields_we_lack_are_refused_by_name(http, field, value, words):
    """They were "unrecognized request argument", even as null, which SDKs may send."""
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], field: value})
    assert _error(r, 400, field, "unsupported_parameter") == words


def test_the_seed_of_a_later_choice_wraps_around_int64(http):
    """Choice i draws from seed + i: with seed 2**63 - 1 and n = 2 that was refused, naming a seed the
    client never sent. Choice 1 now draws from -2**63, as a request with that seed does."""
    def texts(seed: int, n: int) -> list[str]:
        r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0,
                                               "seed": seed, "n": n})
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    pair = texts((1 << 63) - 1, 2)
    assert pair[0] == texts((1 << 63) - 1, 1)[0]
    assert pair[1] == texts(-(1 << 63), 1)[0]


def test_a_top_p_below_float32s_range_keeps_the_top_token(http):
    """1e-46 is in OpenAI's (0, 1] but 0 as the 32-bit float steps carry: it was refused, while as tiny a
    temperature was greedy. It keeps the top token alone: the greedy answer, whatever the seed."""
    def text(**sampling) -> str:
        r = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8, **sampling})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text(temperature=1.5, top_p=1e-46, seed=3) == greedy
    assert text(temperature=1.5, top_p=1e-300, seed=4) == greedy


@pytest.mark.parametrize("best_of,n,message", [
    (1, 3, "best_of must be at least n (3), got 1"), (0, 1, "best_of must be at least n (1), got 0"),
    (-5, 1, "best_of must be at least n (1), got -5"), (4, 2, "best_of is not supported (only best_of == n)")])
def test_best_of_below_n_is_refused_as_openai_does(http, best_of, n, message):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "best_of": best_of, "n": n})
    assert _error(r, 400, "best_of") == message


def test_ignore_eos_with_a_required_tool_call_is_refused_before_any_work(served, http):
    """It ran the generation, then failed it with the grammar's "token 2 ... is not allowed"."""
    backend = served[0]
    before = backend.chain.stages[0].metrics().prefill_tokens
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Weather?"}],
                                                    "max_tokens": 40, "ignore_eos": True, "tools": TOOLS,
                                                    "tool_choice": choice})
        assert _error(r, 400, "ignore_eos").startswith("ignore_eos cannot be combined with a required or named "
                                                       "tool_choice")
    assert backend.chain.stages[0].metrics().prefill_tokens == before


def test_a_trailing_slash_is_a_404_not_a_redirect(http):
    """It was a 307 to a location built from the client's Host header."""
    r = http.post("/v1/chat/completions/", json={"messages": [{"role": "user", "content": "Hi"}]},
                  headers={"Host": "evil.example:999"})
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_compressed_body_is_a_415_that_says_so(http):
    body = gzip.compress(json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json",
                                                             "Content-Encoding": "gzip"})
    assert "Content-Encoding 'gzip' is not supported" in _error(r, 415, None, "unsupported_content_encoding")
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"Content-Encoding": "identity"})
    assert r.status_code == 200


def test_every_answer_carries_an_x_request_id(served):
    """OpenAI's answers carry ``x-request-id`` (the SDK's ``_request_id``, what a bug report quotes); ours had
    none. A client's own sensible id is answered back; an error answer (a 400, a 404) carries one too."""
    _, http, client = served
    out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert out._request_id is not None and len(out._request_id) == 36 and out._request_id.startswith("req_")
    ids = {http.get("/v1/models").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3  # one per request
    assert http.get("/v1/models", headers={"X-Request-Id": "proxy-42"}).headers["x-request-id"] == "proxy-42"
    assert http.get("/v1/models", headers={"X-Request-Id": "x" * 129}).headers["x-request-id"].startswith("req_")
    assert http.post("/v1/chat/completions", json={"messages": []}).headers["x-request-id"].startswith("req_")
    assert http.get("/v1/nothing").headers["x-request-id"].startswith("req_")


def test_usage_reports_the_prompt_tokens_taken_from_the_prefix_cache(served, tok):
    """``usage.prompt_tokens_details.cached_tokens`` (the Responses API's ``input_tokens_details``), which
    llama-server and OpenAI report, was never given: a second chat sharing the first's system prompt takes
    those rows from the prefix cache, and says how many (its tokens in common with the first), streamed or
    not; the first shares only the chat template's opening with the requests before it."""
    from meshnet.chat_template import chat_prompt_ids

    _, http, client = served
    system = {"role": "system", "content": "You answer in one word, always, whatever the question."}

    def ask(q: str, **kw):
        return client.chat.completions.create(model="smollm2", temperature=0, max_tokens=2, **kw,
                                              messages=[system, {"role": "user", "content": q}])

    first = ask("Name a fruit that is yellow.")
    second = ask("Name a colour of the sky.")
    a, b = (chat_prompt_ids(tok, [system, {"role": "user", "content": q}])
            for q in ("Name a fruit that is yellow.", "Name a colour of the sky."))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    shared = second.usage.prompt_tokens_details.cached_tokens
    assert shared == common and common > 20 and first.usage.prompt_tokens_details.cached_tokens < 8, second.usage
    chunks = list(ask("Name a large animal.", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == shared
    out = client.responses.create(model="smollm2", temperature=0, max_output_tokens=2, instructions=system["content"],
                                  input="Name a small animal.")
    assert out.usage.input_tokens_details.cached_tokens == shared
