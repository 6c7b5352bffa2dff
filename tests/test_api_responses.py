"""``POST /v1/responses`` (OpenAI's Responses API, text) on the bundled SmolLM2 through the official ``openai``
client: the answer equals the chat endpoint's for the same messages, streamed as the Responses API's events
(the SDK's stream helper joins them), cut answers are "incomplete", and what it does not do is refused by name."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from api_served import served_api  # noqa: E402
from meshnet.api.backend import local_backend  # noqa: E402

ASK = "Reply with just the word yes."


@pytest.fixture(scope="module")
def served(smollm2_path):
    with served_api(local_backend(str(smollm2_path), n_ctx=1024, max_sessions=2, name="smollm2"), 300) as served:
        yield served


def test_a_response_is_the_chat_answer_to_the_same_messages(served):
    _, _, client = served
    chat = client.chat.completions.create(model="smollm2", messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": ASK},
        {"role": "assistant", "content": "yes"}, {"role": "user", "content": ASK}], temperature=0, max_tokens=60)
    out = client.responses.create(model="smollm2", instructions="You are terse.", temperature=0, max_output_tokens=60,
                                  input=[{"role": "user", "content": ASK},
                                         {"role": "assistant", "content": [{"type": "output_text", "text": "yes"}]},
                                         {"role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    assert out.status == "completed" and out.incomplete_details is None and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content and out.output_text
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)
    assert [(o.type, o.role, o.status) for o in out.output] == [("message", "assistant", "completed")]


def test_a_streamed_response_comes_as_the_responses_apis_events(served):
    _, http, client = served
    whole = client.responses.create(model="smollm2", input=ASK, temperature=0, max_output_tokens=60)
    with client.responses.stream(model="smollm2", input=ASK, temperature=0, max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    # cut by max_output_tokens: incomplete, streamed or not
    cut = client.responses.create(model="smollm2", input="Count from one to fifty.", temperature=0, max_output_tokens=4)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 4
    r = http.post("/v1/responses", json={"input": "Count from one to fifty.", "temperature": 0, "max_output_tokens": 4,
                                         "stream": True})
    lines = [line for line in r.text.splitlines() if line]
    last = json.loads(lines[-1][6:])
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"}
    # each event named on its own line, as OpenAI's are; no chat-style [DONE] at the end
    assert lines[-2] == "event: response.incomplete" and lines[0] == "event: response.created"
    assert "data: [DONE]" not in lines and last["response"]["temperature"] == 0.0


@pytest.mark.parametrize("body, status, param, words", [
    ({"tools": [{"type": "web_search"}]}, 400, "tools", "tools are not supported on /v1/responses"),
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "this server keeps no responses"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, 400, "text.format",
     "only text.format"),
    ({"text": {"format": "json_object"}}, 400, "text.format", "text.format must be an object"),
    ({"text": {"format": 5}}, 400, "text.format", "text.format must be an object"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0.content.0",
     "only text parts are supported"),
    ({"input": []}, 400, "input", "input is empty"),
    ({"input": [{"role": "user", "content": []}]}, 400, "input.0.content", "input[0].content is empty"),
    ({"model": "gpt-4o"}, 404, "model", "model 'gpt-4o' is not served here"),
    ({"temperature": 3}, 400, "temperature", ""),
])
def test_what_responses_do_not_do_is_refused_by_name(served, body, status, param, words):
    _, http, _ = served
    r = http.post("/v1/responses", json={"input": "Hi", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]
