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
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0", "tools[0] is 'web_search': only function tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, 400, "tools.0.parameters", ""),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "web_search_preview"}}, 400,
     "tool_choice", "tool_choice must be"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input.0.call_id",
     "input[0] has no call_id"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input.0.type", ""),
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "this server keeps no responses"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name",
     "text.format.name must be 1-64 letters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {"type": "string"}}}}}, 400,
     "text.format.schema", "text.format.schema: "),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}}}, 400,
     "text.format.strict", "text.format.strict must be a boolean"),
    ({"text": {"format": {"type": "json_object", "schema": {}}}}, 400, "text.format.schema",
     "text.format has unknown field 'schema'"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type", "text.format.type must be 'text', 'json_object'"),
    ({"text": {"format": {}}}, 400, "text.format.type", "text.format needs a type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "description": 5}}}, 400,
     "text.format.description", "text.format.description must be a string"),
    ({"text": {"format": "json_object"}}, 400, "text.format", "text.format must be an object"),
    ({"text": {"format": 5}}, 400, "text.format", "text.format must be an object"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0.content.0",
     "only text parts are supported"),
    ({"input": []}, 400, "input", "input is empty"),
    ({"input": [{"role": "user", "content": []}]}, 400, "input.0.content", "input[0].content is empty"),
    ({"model": "gpt-4o"}, 404, "model", "model 'gpt-4o' is not served here"),
    ({"temperature": 3}, 400, "temperature", ""),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt", "this server keeps no prompt templates"),
    ({"truncation": "middle"}, 400, "truncation", ""),
    ({"top_logprobs": 21}, 400, "top_logprobs", ""),
])
def test_what_responses_do_not_do_is_refused_by_name(served, body, status, param, words):
    _, http, _ = served
    r = http.post("/v1/responses", json={"input": "Hi", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_text_format_holds_the_answer_to_json_as_chats_response_format_does(served):
    """``text.format`` json_schema (what the SDK's ``responses.parse(text_format=Model)`` sends) and json_object:
    the output text is chat's answer under the same ``response_format``, and the SDK parses it into the model."""
    import pydantic

    _, _, client = served

    class City(pydantic.BaseModel):
        name: str
        capital: bool

    ask = "Is Paris a capital? Answer as JSON."
    parsed = client.responses.parse(model="smollm2", input=ask, temperature=0, max_output_tokens=80, text_format=City)
    city = parsed.output_parsed
    assert isinstance(city, City) and parsed.status == "completed"
    chat = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": ask}], temperature=0,
                                         max_tokens=80, response_format=City)
    assert parsed.output_text == chat.choices[0].message.content and chat.choices[0].message.parsed == city
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "City"
    loose = client.responses.create(model="smollm2", input=ask, temperature=0, max_output_tokens=80,
                                    text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(loose.output_text), dict) and loose.text.format.type == "json_object"


def test_the_texts_log_probs_come_when_include_asks_for_them(served):
    """``include: ["message.output_text.logprobs"]`` (with ``top_logprobs``) adds chat's entries to the text,
    streamed in the deltas as in the whole response; without it the parts carry an empty list."""
    _, http, client = served
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASK}], temperature=0,
                                          max_tokens=8, logprobs=True, top_logprobs=2)
    ask = {"model": "smollm2", "input": ASK, "temperature": 0, "max_output_tokens": 8,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    out = client.responses.create(**ask)
    entries = [e.model_dump() for e in out.output[0].content[0].logprobs]
    expected = [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert len(entries) == out.usage.output_tokens == chat.usage.completion_tokens
    assert [(e["token"], e["logprob"], e["bytes"]) for e in entries] == [
        (e["token"], e["logprob"], e["bytes"]) for e in expected]
    assert [[a["token"] for a in e["top_logprobs"]] for e in entries] == [
        [a["token"] for a in e["top_logprobs"]] for e in expected]
    assert out.top_logprobs == 2
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    streamed = [e.model_dump() for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    final = events[-1].response  # response.completed, or .incomplete (the SDK's final response raises on it)
    assert streamed == entries and [e.model_dump() for e in final.output[0].content[0].logprobs] == entries
    plain = client.responses.create(model="smollm2", input=ASK, temperature=0, max_output_tokens=8)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == out.output_text
    bad = http.post("/v1/responses", json={"input": ASK, "include": ["message.output_text.logprobs", "logits"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "include.1"
    assert "'logits', which is none of" in bad.json()["error"]["message"]


def test_auto_truncation_drops_the_oldest_input_until_the_rest_fits(served, tok):
    """``truncation: "auto"`` keeps the instructions, the last message and as many of the latest before it as
    fit the context (1024 tokens here); "disabled", the default, refuses the same input by name."""
    from meshnet.api.prompts import chat_prompt
    from meshnet.api.responses import ResponsesRequest, _chat, fitted_prompt
    from meshnet.api.tools import ToolPlan

    _, http, client = served
    history = []
    for i in range(12):  # about 1,300 tokens in all
        history += [{"role": "user", "content": f"Tell me fact number {i} about the sea. " + "Waves roll. " * 20},
                    {"role": "assistant", "content": f"Fact {i}: the sea is deep and " + "salty, " * 20}]
    body = {"instructions": "Be brief.", "input": history + [{"role": "user", "content": ASK}], "temperature": 0,
            "max_output_tokens": 4}
    refused = http.post("/v1/responses", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    out = client.responses.create(model="smollm2", truncation="auto", **body)
    assert out.status in ("completed", "incomplete") and out.truncation == "auto"
    chat, kept = _chat(ResponsesRequest(truncation="auto", **body))
    ids = fitted_prompt(tok, chat, kept, 1024, True)
    assert len(ids) == out.usage.input_tokens <= 1024
    # the instructions, then the latest messages that fit: one message more does not
    def prompt(first: int) -> list[int]:
        return chat_prompt(tok, chat.model_copy(update={"messages": chat.messages[:1] + chat.messages[first:]}),
                           ToolPlan("none"))

    first = next(k for k in range(2, len(chat.messages)) if prompt(k) == ids)
    assert len(prompt(first - 1)) > 1024 and tok.decode(ids).startswith("system\nBe brief.\n")


def test_a_response_failing_mid_stream_ends_with_response_failed(served, monkeypatch):
    """A failure once a Responses stream has started ends it with ``response.failed`` naming the error (it was
    chat's ``{"error": ...}`` event, on which the SDK raised mid-stream), the text so far in its output."""
    from meshnet.api.responses_events import ResponseShapes

    calls = []
    piece = ResponseShapes.piece

    def breaks_second(self, i, p):
        calls.append(p)
        if len(calls) == 2:
            raise TypeError("not a str")
        return piece(self, i, p)

    monkeypatch.setattr(ResponseShapes, "piece", breaks_second)
    _, http, _ = served
    r = http.post("/v1/responses", json={"input": "Count from one to fifty.", "temperature": 0,
                                         "max_output_tokens": 20, "stream": True})
    assert r.status_code == 200
    lines = [line for line in r.text.splitlines() if line]
    last = json.loads(lines[-1][6:])
    assert lines[-2] == "event: response.failed" and last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "internal_error", "message": "internal error: TypeError"}
    assert last["response"]["output"][0]["content"][0]["text"] == calls[0].text
    monkeypatch.undo()
    gone = http.get("/v1/responses/" + last["response"]["id"])
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    assert "this server keeps no responses" in gone.json()["error"]["message"]



WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
WHERE = "What is the weather in Paris?"


@pytest.mark.parametrize("choice, chat_choice", [
    ("required", "required"),
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}})])
def test_function_tools_answer_with_the_chat_endpoints_calls_streamed_and_whole(served, choice, chat_choice):
    """Function tools (the Responses API's flat shape) were refused; agent frameworks that default to the
    Responses API call them. A required or named call answers with ``function_call`` items whose names and
    arguments are the chat endpoint's for the same request; streamed, each call comes as its item's events
    and the SDK's stream helper joins them into the same response."""
    _, _, client = served
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": WHERE}],
                                          tools=[CHAT_WEATHER], tool_choice=chat_choice, temperature=0, max_tokens=60)
    want = [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls]
    ask = {"model": "smollm2", "input": WHERE, "tools": [WEATHER], "tool_choice": choice, "temperature": 0,
           "max_output_tokens": 60}
    out = client.responses.create(**ask)
    assert out.status == "completed" and [o.type for o in out.output] == ["function_call"] * len(want)
    assert [(o.name, o.arguments) for o in out.output] == want and json.loads(want[0][1])["city"] == "Paris"
    assert all(o.call_id.startswith("call_") and o.id.startswith("fc_") and o.status == "completed"
               for o in out.output)
    assert out.usage.output_tokens == chat.usage.completion_tokens and out.tools[0].name == "get_weather"
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress"] + [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"] * len(want) + ["response.completed"]
    assert [(o.name, o.arguments) for o in final.output] == want
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_tool_round_trip_answers_as_the_chat_endpoint_does(served):
    """An earlier call and its result come back as ``function_call`` and ``function_call_output`` input items;
    the answer equals the chat endpoint's for the same conversation (an assistant message with the call, a
    tool message with its result)."""
    _, _, client = served
    call_id, args = "call_1", json.dumps({"city": "Paris"})
    chat = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=40, tools=[CHAT_WEATHER], messages=[
        {"role": "user", "content": WHERE},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 C and sunny"}])
    out = client.responses.create(model="smollm2", temperature=0, max_output_tokens=40, tools=[WEATHER], input=[
        {"role": "user", "content": WHERE},
        {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": call_id, "output": "18 C and sunny"}])
    assert chat.choices[0].message.tool_calls is None  # SmolLM2 answers in prose here
    assert out.output_text == chat.choices[0].message.content and out.output_text
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert [o.type for o in out.output] == ["message"]


def test_an_auto_answer_in_prose_is_one_message_streamed_and_whole(served):
    """Under ``auto`` SmolLM2 answers in prose: one message item, opened with the first text that cannot
    become a call; streamed and whole agree."""
    _, _, client = served
    ask = {"model": "smollm2", "input": "Say hello to Ann.", "tools": [WEATHER], "temperature": 0,
           "max_output_tokens": 30}
    whole = client.responses.create(**ask)
    assert [o.type for o in whole.output] == ["message"] and whole.output_text
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.tool_choice == "auto"


_F = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}
_CALL = {"type": "function_call", "call_id": "c1", "name": "f"}
_OUT = {"type": "function_call_output", "call_id": "c1", "output": "ok"}


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"role": "user", "content": "Hi"}, {**_CALL, "arguments": "{not json"}, _OUT]}, "input.1.arguments",
     "input[1].arguments must be a JSON object as text"),
    ({"instructions": "Be terse.", "input": [{"role": "user", "content": "Hi"}, {**_CALL, "arguments": "{}"},
                                             {**_CALL, "call_id": "c2", "arguments": "[1, 2]"}, _OUT]},
     "input.2.arguments", "input[2].arguments"),
    ({"input": [{"role": "user", "content": "Hi"}, {**_CALL, "arguments": ""}, _OUT]}, "input.1.arguments",
     "input[1].arguments"),
    ({"input": [{"role": "user", "content": "Hi"}, {**_CALL, "arguments": "[" * 5000 + "]" * 5000}, _OUT]},
     "input.1.arguments", "input[1].arguments"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools.0.name",
     "not the chat endpoint's"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name", "tools[0].name must be"),
    ({"tools": [{**_F, "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}}],
      "tool_choice": "required"}, "tools.0.parameters", "tools.0.parameters: the JSON schema cannot be enforced"),
])
def test_bad_tools_and_calls_are_refused_naming_the_responses_fields(served, body, param, words):
    """A function_call item's bad ``arguments`` was refused naming ``messages.N.tool_calls.0`` (the chat message
    it becomes: neither the field nor, with instructions or parallel calls, the index a client sent), and a
    schema the grammar cannot enforce ``tools.N.function.parameters``; they name the Responses API's fields."""
    _, http, _ = served
    r = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], "function." in err["message"]) == (param, False) and words in err["message"], err


def test_a_function_tools_null_parameters_and_strict_are_none_given(served):
    """OpenAI's Responses API types a function tool's ``parameters`` and ``strict`` as nullable (the SDK's
    ``FunctionToolParam``: ``Required[Optional[...]]``): a tool of no arguments sent with ``parameters: null``
    was a 400; it is called with ``{}``, as one without ``parameters``."""
    _, _, client = served
    out = client.responses.create(model="smollm2", input="What time is it?", temperature=0, max_output_tokens=30,
                                  tools=[{"type": "function", "name": "now", "parameters": None, "strict": None,
                                          "description": None}], tool_choice={"type": "function", "name": "now"})
    assert [(o.type, o.name, o.arguments) for o in out.output] == [("function_call", "now", "{}")]
