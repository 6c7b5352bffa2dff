"""Chat ``tools`` / ``tool_choice`` on the bundled SmolLM2 through the ``openai`` client: ``required`` and a named
function constrain the answer to tool calls (OpenAI's shape, ``finish_reason`` "tool_calls", arguments valid
under the tool's schema); ``auto`` reads Hermes ``<tool_call>`` blocks or a bare call object; templates that
read ``tools`` render them; malformed tools are 400s naming the field."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from api_served import served_api  # noqa: E402
from meshnet.api.backend import local_backend  # noqa: E402
from meshnet.api.tools import ToolPlan, plan_tools, tool_calls_from, tools_system_message  # noqa: E402
from meshnet.chat_template import chat_prompt_ids, render_chat, template_has_tools  # noqa: E402

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    with served_api(local_backend(str(smollm2_path), n_ctx=1024, max_sessions=2, name="smollm2"), 300) as s:
        yield s


NAMED_F = {"type": "function", "function": {"name": "f"}}


def test_tool_arguments_admit_only_declared_keys_unless_the_schema_says_otherwise():
    """As llama.cpp's grammar does: a named call to get_time ({"city"} without additionalProperties) added
    keys until max_tokens and came back as content, finish_reason "length", tool_calls null."""
    city = {"type": "string"}
    params = {"type": "object", "properties": {"city": city, "where": {"type": "object", "properties": {"x": city}},
                                               "properties": {"type": "object", "properties": {}},
                                               "alt": {"anyOf": [{"properties": {"z": city}}, city]}},
              "$defs": {"P": {"properties": {"y": city}}, "Q": {"type": "object", "additionalProperties": city}},
              "default": {"properties": {"k": 1}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    named = plan_tools([tool], {"type": "function", "function": {"name": "f"}}).schema
    assert named["additionalProperties"] is False
    assert named["properties"]["where"]["additionalProperties"] is False  # nested objects too
    assert named["properties"]["properties"]["additionalProperties"] is False  # a key named "properties"
    assert "additionalProperties" not in named["properties"]  # the map of names is no schema
    assert named["$defs"]["P"]["additionalProperties"] is False
    assert named["properties"]["alt"]["anyOf"][0]["additionalProperties"] is False  # one whole alternative
    assert named["$defs"]["Q"]["additionalProperties"] == city  # said otherwise: kept
    assert named["default"] == {"properties": {"k": 1}}  # a value, not a schema
    required = plan_tools([tool], "required").schema
    assert required["$defs"]["tool_0"]["additionalProperties"] is False
    # parameters without a type are an object all the same (a named call's answer was a bare JSON string)
    untyped = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"z": city}}}}
    assert plan_tools([untyped], NAMED_F).schema == {"properties": {"z": city}, "type": "object",
                                                     "additionalProperties": False}
    # Parts that describe one object together are never closed, each would refuse the other's keys
    # (named / required with allOf was a 400 "Unsatisfiable schema"): allOf members, anyOf branches of an
    # object with properties, an object beside a $ref, the $defs entry such a $ref names.
    part = {"properties": {"b": city}, "required": ["b"]}
    for params in ({"type": "object", "allOf": [{"properties": {"a": city}, "required": ["a"]}, part]},
                   {"type": "object", "properties": {"a": city}, "anyOf": [part, {"properties": {"c": city}}]},
                   {"$defs": {"B": part}, "properties": {"a": city}, "$ref": "#/$defs/B"},
                   {"$defs": {"B": part}, "allOf": [{"$ref": "#/$defs/B"}, {"properties": {"a": city}}]}):
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        assert "additionalProperties" not in json.dumps(plan_tools([tool], NAMED_F).schema)
    alone = {"$defs": {"B": part}, "type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}}
    closed = plan_tools([{"type": "function", "function": {"name": "f", "parameters": alone}}], NAMED_F).schema
    assert closed["$defs"]["B"]["additionalProperties"] is False  # a $ref alone names a whole object


# An object described by allOf parts stays open to other keys, where greedy answers part by CPU: with ggml's
# AVX2 kernels SmolLM2 went on after "country" with a "weather" key of prose until max_tokens (with AVX-512's
# it closed the object). maxProperties ends it after the two required keys on every CPU.
ALL_OF = {"type": "function", "function": {"name": "get_place", "parameters": {
    "type": "object", "maxProperties": 2,
    "allOf": [{"properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
              {"properties": {"country": {"type": "string", "maxLength": 30}}, "required": ["country"]}]}}}


@pytest.mark.parametrize("choice, tool, params", [
    ("required", WEATHER, WEATHER_PARAMS),
    ({"type": "function", "function": {"name": "get_weather"}}, WEATHER, WEATHER_PARAMS),
    ({"type": "function", "function": {"name": "get_time"}}, TIME, TIME["function"]["parameters"]),
    ({"type": "function", "function": {"name": "get_place"}}, ALL_OF, ALL_OF["function"]["parameters"])])
def test_required_and_named_tool_choice_answer_with_tool_calls(served, choice, tool, params):
    _, _, client = served
    tools = [WEATHER, TIME] + ([tool] if tool is ALL_OF else [])
    out = client.chat.completions.create(model="smollm2", messages=ASK, tools=tools, tool_choice=choice,
                                         temperature=0, max_tokens=100)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, params)
    assert args["city"] == "Paris"
    if "properties" in params:  # closed; the allOf parts stay open, as JSON Schema has them
        assert set(args) <= set(params["properties"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_calls_join_into_the_calls_of_the_whole_answer(served, choice):
    """Streaming with tools was a 400 (agent frameworks and chat UIs stream with tools). The calls come
    as ``delta.tool_calls`` at the end, each token's log-prob once, and the SDK's stream helper joins them."""
    _, http, client = served
    body = {"model": "smollm2", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice,
            "temperature": 0, "max_tokens": 100}
    whole = client.chat.completions.create(**body, logprobs=True).choices[0]
    chunks = list(client.chat.completions.create(**body, logprobs=True, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "tool_calls"
    assert "".join(d.delta.content or "" for d in deltas) == ""
    streamed = [call for d in deltas for call in d.delta.tool_calls or ()]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == \
        [(k, c.function.name, c.function.arguments) for k, c in enumerate(whole.message.tool_calls)]
    assert [t.token for d in deltas if d.logprobs for t in d.logprobs.content] == \
        [t.token for t in whole.logprobs.content]
    with client.beta.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content is None
    assert [c.function.arguments for c in final.message.tool_calls] == \
        [c.function.arguments for c in whole.message.tool_calls]


def test_a_streamed_auto_answer_without_a_call_is_the_same_content(served):
    _, _, client = served
    body = {"model": "smollm2", "messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "temperature": 0,
            "max_tokens": 12}
    whole = client.chat.completions.create(**body).choices[0]
    deltas = [c.choices[0] for c in client.chat.completions.create(**body, stream=True) if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == whole.message.content and whole.message.content
    assert deltas[-1].finish_reason == whole.finish_reason and not any(d.delta.tool_calls for d in deltas)


AUTO = ToolPlan("auto", (WEATHER,))
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("pieces, content, calls", [
    (["Hello", " world"], "Hello world", None),
    # a Hermes block after some text: the text goes out as it comes, the block becomes a call
    (["Let me look. <tool", "_call>", CALL[:10], CALL[10:], "</tool_call>"], "Let me look. ", ["get_weather"]),
    ([" ", "\n<tool_call>" + CALL + "</tool_call>"], None, ["get_weather"]),
    # blank, then a token that may start a block: the blank is no content of a call, streamed or not
    (["\n", "<", "tool_call>" + CALL + "</tool_call>"], None, ["get_weather"]),
    (["\n", "<tool_call>", "bad</tool_call>"], "\n<tool_call>bad</tool_call>", None),
    (["\n\n<tool_call>bad</tool_call>"], "\n\n<tool_call>bad</tool_call>", None),
    # a bare object naming a tool is the whole answer; one that names none is content after all
    (["{", CALL[1:]], None, ["get_weather"]),
    (['{"name": "nothing", "arguments": {}}'], '{"name": "nothing", "arguments": {}}', None),
    # text that only looked like the start of a block
    (["a <tool", "box> b"], "a <toolbox> b", None),
    (["<tool_call>{\"name\": \"get_we"], "<tool_call>{\"name\": \"get_we", None),  # never closed
])
def test_an_auto_answer_is_told_apart_as_it_streams(pieces, content, calls):
    from meshnet.api.tool_stream import ToolAnswer, whole_answer

    answer = ToolAnswer(AUTO)
    released = [answer.feed(p) for p in pieces]
    tail, got = answer.finish("stop")
    assert "".join(released) + tail == (content or "")
    assert [c["function"]["name"] for c in got or ()] == (calls or [])
    if calls:  # nothing of a call went out as content before it was known to be one
        assert "".join(released) == (content or "")
    w_content, w_calls = whole_answer(AUTO, "".join(pieces), "stop")  # the answer without streaming
    assert w_content == content and [c["function"]["name"] for c in w_calls or ()] == (calls or [])


def test_a_call_whose_arguments_escape_a_lone_surrogate_can_be_sent():
    """An answer that wrote the escape ``\\ud83d`` alone: as a character in the arguments, the response
    could not be encoded as UTF-8 (a 500; streamed, cut without ``[DONE]``)."""
    from meshnet.api.tools import hermes_calls_text

    for text, plan in (('<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud83d"}}</tool_call>', AUTO),
                       ('[{"name": "get_weather", "parameters": {"city": "\\ud83d"}}]',
                        plan_tools([WEATHER], "required"))):
        (call,) = tool_calls_from(text, plan)
        call["function"]["arguments"].encode("utf-8")
        assert json.loads(call["function"]["arguments"]) == {"city": "\ud83d"}
    # the same call sent back in the history is shown to the model as it was written
    shown = hermes_calls_text([{"type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "\\ud83d"}'}}], "m")
    assert shown.encode("utf-8") and '"\\ud83d"' in shown


def test_parallel_tool_calls_false_keeps_the_first_call_of_an_auto_answer():
    """Only the required schema held it to one call (maxItems): an auto answer of two blocks gave two."""
    two = "<tool_call>" + CALL + "</tool_call>\n<tool_call>" + CALL.replace("Paris", "Rome") + "</tool_call>"
    assert [json.loads(c["function"]["arguments"])["city"] for c in tool_calls_from(two, AUTO)] == ["Paris", "Rome"]
    one = plan_tools([WEATHER], "auto", parallel=False)
    assert [json.loads(c["function"]["arguments"])["city"] for c in tool_calls_from(two, one)] == ["Paris"]


def test_an_auto_call_with_nan_arguments_is_content():
    """json reads NaN and Infinity and wrote them back into arguments that no client's JSON reader takes."""
    for bad in ('{"name": "get_weather", "arguments": {"city": NaN}}',
                '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": Infinity}"}</tool_call>'):
        assert tool_calls_from(bad, AUTO) is None


def test_a_held_answer_sends_keep_alives_and_a_call_has_no_content():
    """A required call is held whole: nothing went out for its whole length (a 1000-token call ran past httpx's
    5 s read timeout, 3000 tokens past nginx's 60 s). A comment, which SSE readers skip, goes out every 2 s;
    the role chunk of a call carries no content (its message has none: the SDKs' helpers made it "")."""
    from meshnet.api import sse, tool_stream
    from meshnet.api.runner import Piece
    from meshnet.api.sse import ChatChunks

    now = [100.0]
    events = tool_stream.ChatEvents(ChatChunks("id", 0, "m"), plan_tools([WEATHER], "required"), 1, None)
    real = sse.time.monotonic
    sse.time.monotonic = lambda: now[0]
    try:
        start = events.start(0)
        assert json.loads(start[0][6:])["choices"][0]["delta"] == {"role": "assistant"}
        sent = []
        for k, text in enumerate(['[{"name": ', '"get_weather", ', '"parameters": ', '{"city": "Paris"}}]']):
            now[0] += 1.1
            sent.append(events.piece(0, Piece(text, finish_reason="stop" if k == 3 else None)))
    finally:
        sse.time.monotonic = real
    assert sent[0] == [] and sent[1] == [": keep-alive\n\n"] and sent[2] == []
    deltas = [json.loads(e[6:])["choices"][0] for e in sent[3]]
    assert deltas[0]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert deltas[1]["finish_reason"] == "tool_calls"
    plain = tool_stream.ChatEvents(ChatChunks("id", 0, "m"), plan_tools([WEATHER], "auto"), 1, None)
    assert json.loads(plain.start(0)[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_a_required_answer_that_repeats_a_call_ends_with_that_call_once(served):
    """SmolLM2 wrote this SDK-made tool's call again and again until max_tokens (or, without it, the whole
    context: 3878 tokens, 2 minutes) cut the array, and the cut answer came back as content. The answer now
    ends where a call repeats, with the call once, streamed or not."""
    from typing import Optional

    from pydantic import BaseModel

    class Address(BaseModel):
        city: str
        country: str

    class GetWeather(BaseModel):
        location: Address
        unit: Optional[str] = None

    _, _, client = served
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Weather in Paris, France?"}],
            "tools": [openai.pydantic_function_tool(GetWeather)], "tool_choice": "required", "temperature": 0,
            "max_tokens": 300}
    out = client.chat.completions.create(**body)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and out.usage.completion_tokens < 150
    assert [(t.function.name, json.loads(t.function.arguments)["location"]) for t in c.message.tool_calls] == \
        [("GetWeather", {"city": "Paris", "country": "France"})]
    deltas = [d.choices[0] for d in client.chat.completions.create(**body, stream=True) if d.choices]
    assert [t.function.arguments for d in deltas for t in d.delta.tool_calls or ()] == \
        [c.message.tool_calls[0].function.arguments] and deltas[-1].finish_reason == "tool_calls"


def test_a_required_answer_cut_by_max_tokens_keeps_its_whole_calls():
    from meshnet.api.tool_stream import ToolAnswer, finish_reason

    answer = ToolAnswer(plan_tools([WEATHER], "required"))
    answer.feed('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", "para')
    tail, calls = answer.finish("length")
    assert tail == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert finish_reason("length", calls) == "length" and finish_reason("stop", calls) == "tool_calls"
    # The call the cut broke is no content: its text was this server's array of calls (the SDK's helper showed
    # '[{"name": "get_weather", "' as the message's content).
    nothing = ToolAnswer(plan_tools([WEATHER], "required"))
    nothing.feed('[{"name": "get_we')
    assert nothing.finish("length") == ("", None)


def test_text_and_a_call_in_one_last_piece_both_go_out():
    """A last piece that held the text before a block and the block too sent only the call."""
    from meshnet.api.runner import Piece
    from meshnet.api.sse import ChatChunks
    from meshnet.api.tool_stream import ChatEvents

    events = ChatEvents(ChatChunks("id", 0, "m"), AUTO, 1, None)
    sent = events.piece(0, Piece("Let me look. <tool_call>" + CALL + "</tool_call>", finish_reason="stop"))
    deltas = [json.loads(e[6:])["choices"][0] for e in sent]
    assert deltas[0]["delta"] == {"content": "Let me look. "}
    assert deltas[1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert deltas[2]["finish_reason"] == "tool_calls" and len(deltas) == 3


def test_a_named_call_cut_by_max_tokens_is_neither_content_nor_a_call(served):
    """A named call cut by max_tokens came back as content holding its arguments' JSON ('{"city":'), which a
    client shows its user; handed back as a call, its broken arguments would make the next turn a 400. It is
    dropped: finish_reason "length", content and tool_calls null, streamed or not. A whole call stays."""
    from meshnet.api.tool_stream import ToolAnswer, whole_answer

    plan = ToolPlan("named", (WEATHER,), named="get_weather")
    answer = ToolAnswer(plan)
    assert answer.feed('{"city": "Par') == ""
    assert answer.finish("length") == ("", None)
    assert whole_answer(plan, '{"city": "Par', "length") == (None, None)
    [call] = whole_answer(plan, '{"city": "Paris"}', "length")[1]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    _, _, client = served
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        body = {"model": "smollm2", "messages": ASK, "tools": [WEATHER], "tool_choice": choice, "temperature": 0,
                "max_tokens": 3}
        out = client.chat.completions.create(**body)
        c = out.choices[0]
        assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("length", None, None)
        assert out.usage.completion_tokens == 3
        deltas = [d.choices[0] for d in client.chat.completions.create(**body, stream=True) if d.choices]
        assert [d.delta.content for d in deltas if d.delta.content] == [] and deltas[-1].finish_reason == "length"
        assert not any(d.delta.tool_calls for d in deltas)


def test_none_and_auto_without_a_call_answer_with_content(served):
    _, _, client = served
    for choice in ("none", "auto"):
        out = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                             temperature=0, max_tokens=12)
        assert out.choices[0].message.content and out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason in ("stop", "length")


def test_auto_reads_hermes_blocks_and_bare_calls():
    plan = plan_tools([WEATHER, TIME], "auto")
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    calls = tool_calls_from(text, plan)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"city": "Oslo"})]
    bare = tool_calls_from(' {"name": "get_time", "arguments": {"city": "Lima"}}', plan)
    assert json.loads(bare[0]["function"]["arguments"]) == {"city": "Lima"}
    assert tool_calls_from("It is sunny in Oslo.", plan) is None
    assert tool_calls_from('{"name": "launch_rocket", "arguments": {}}', plan) is None  # not a declared tool
    # a "name" that is not a string (a list, an object) is content too, not a server error
    assert tool_calls_from('{"name": [1], "arguments": {}}', plan) is None
    assert tool_calls_from('{"name": {}, "arguments": {}}', plan) is None


def test_an_auto_answer_naming_a_list_is_content_not_a_500(served):
    """The answer is constrained by response_format to ``{"name": [int]}``: an object whose name is a list."""
    _, http, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"name": {"type": "array", "items": {"type": "integer"}, "maxItems": 1}},
        "required": ["name"], "additionalProperties": False}}}
    r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "auto",
                                                "response_format": fmt, "temperature": 0, "max_tokens": 40})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["tool_calls"] is None and isinstance(json.loads(msg["content"])["name"], list)


# pydantic's shape: the parameters point into their own $defs
CITY_PARAMS = {"$defs": {"City": {"type": "string", "maxLength": 20}}, "type": "object",
               "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "additionalProperties": False}
FIND = {"type": "function", "function": {"name": "find_city", "parameters": CITY_PARAMS}}


def test_required_resolves_each_tools_own_refs_and_allows_one_call_without_parallel_calls(served):
    _, _, client = served
    for parallel in (None, False):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        out = client.chat.completions.create(model="smollm2", messages=ASK, tools=[FIND, TIME], tool_choice="required",
                                             temperature=0, max_tokens=200, **extra)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", c
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                CITY_PARAMS if call.function.name == "find_city" else TIME["function"]["parameters"])
        if parallel is False:
            assert len(c.message.tool_calls) == 1
    plan = plan_tools([FIND, TIME], "required", parallel=False)
    assert plan.schema["maxItems"] == 1 and plan.schema["$defs"]["tool_0"]["properties"]["city"] == {
        "$ref": "#/$defs/tool_0/$defs/City"}
    assert all(call["additionalProperties"] is False for call in plan.schema["items"]["anyOf"])


def test_a_parameter_named_like_a_value_keyword_is_a_name_when_refs_are_moved():
    """A parameter called ``default`` (or ``enum``, ``const``, ``examples``) was taken for the keyword: its
    ``$ref`` stayed unmoved under tool_choice "required", pointing at nothing (400) or at another tool's
    parameters (tool calls that broke their own schema)."""
    level = {"type": "integer", "enum": [1, 2, 3]}
    for name in ("default", "enum", "const", "examples", "level"):
        params = {"type": "object", "properties": {name: {"$ref": "#/$defs/Level"}}, "required": [name],
                  "$defs": {"Level": level}}
        plan = plan_tools([{"type": "function", "function": {"name": "set_level", "parameters": params}}],
                          "required")
        own = plan.schema["$defs"]["tool_0"]
        assert own["properties"][name] == {"$ref": "#/$defs/tool_0/$defs/Level"}, name
        assert own["$defs"]["Level"] == level and own["additionalProperties"] is False


def test_a_template_that_reads_tools_renders_them(tok):
    template = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
                "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert template_has_tools(template) and not template_has_tools(tok.chat_template)
    text = render_chat(template, ASK, bos_token="", eos_token="", tools=[WEATHER, TIME])
    assert text == "<tools>get_weather;get_time;</tools>[user]What is the weather in Paris?"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    # a string or an array of arguments: a named call answered `"arguments": "\"Paris, France\""`
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": ["array", "object"]}}}]},
     "tools.0.function.parameters"),
    # an error in one tool's schema under a constrained choice named "tools" and the path it had inside
    # the combined schema (/$defs/tool_1/$defs/Nope)
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/Nope"}}}],
      "tool_choice": "required"}, "tools.1.function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/Nope"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.1.function.parameters"),
    # a schema no choice can enforce was taken under "auto" (the default), refused under "required"
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}]}, "tools.1.function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}], "tool_choice": "auto"},
     "tools.1.function.parameters"),
    # a choice of another type was "tool_choice 5 needs tools"
    ({"tool_choice": 5}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": ["auto"]}, "tool_choice"),
])
def test_bad_tools_are_400_naming_the_field(served, body, param):
    _, http, _ = served
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "$defs/tool_" not in r.json()["error"]["message"]
    if body.get("tool_choice") in (5, ["auto"]):
        assert r.json()["error"]["message"].startswith(f"tool_choice {json.dumps(body['tool_choice'])} is not one "
                                                       "of 'none', 'auto', 'required' or "), r.text


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_stop_sequence_inside_the_constrained_call_does_not_cut_it(served, choice):
    # The grammar makes the answer a call and ends it: a stop sequence inside its JSON cut it into content
    # that did not parse (finish_reason "stop", no tool_calls), though the caller required a call.
    _, http, _ = served
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 40, "temperature": 0}
    alone = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    r = http.post("/v1/chat/completions", json={**body, "stop": ["city"]})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    assert [call["function"] for call in c["message"]["tool_calls"]] == \
        [call["function"] for call in alone["message"]["tool_calls"]]  # ids are drawn for each answer
    assert [json.loads(call["function"]["arguments"])["city"] for call in c["message"]["tool_calls"]] == ["Paris"]


CALLED = {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}


def test_a_tool_round_trip_renders_on_a_template_without_tool_calls(served, tok):
    # OpenAI's follow-up shape: the assistant's call with content null, then the tool's answer. SmolLM2's
    # template concatenates content, so the call is shown as the Hermes block the system message teaches.
    _, http, _ = served
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [CALLED]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 1})
    assert r.status_code == 200, r.text
    shown = ASK + [{"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": '
                    '{"city": "Paris", "unit": "celsius"}}</tool_call>'},
                   {"role": "tool", "content": "18 C, sunny"}]
    want = chat_prompt_ids(tok, [tools_system_message([WEATHER])] + shown)
    assert r.json()["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize("calls", [[5], [{"type": "function", "function": 3}],
                                   [{"type": "function", "function": {"name": "f", "arguments": "not json"}}],
                                   [{"type": "function", "function": {"arguments": "{}"}}]])
def test_malformed_tool_calls_in_messages_are_400(served, calls):
    _, http, _ = served
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": calls}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.1.tool_calls.0"
    # the shape it names has balanced braces (the message used to end in four)
    assert err["message"].endswith('"arguments": a JSON object as text}}'), err
    assert err["message"].count("{") == err["message"].count("}"), err


def test_tool_call_arguments_nested_past_what_json_reads_are_400_and_a_model_answer_so_nested_is_content(served):
    """A 2 KB `arguments` string of 1000 brackets was an HTTP 500 (json.loads raised RecursionError)."""
    from meshnet.api.tools import ToolPlan, tool_calls_from

    _, http, _ = served
    deep = '{"a": ' + "[" * 1000 + "]" * 1000 + "}"
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": deep}}]
    r = http.post("/v1/chat/completions", json={"messages": ASK + [{"role": "assistant", "content": None,
                                                                     "tool_calls": calls}], "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "messages.1.tool_calls[0].function.arguments is JSON nested too deeply "
                                            "to read", "type": "invalid_request_error",
                                 "param": "messages.1.tool_calls.0", "code": None}
    plan = ToolPlan("auto", [{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert tool_calls_from('{"name": "f", "arguments": ' + deep + "}", plan) is None  # the model's text: content


def test_tool_calls_off_an_assistant_message_are_400_and_a_tool_answer_without_its_id_is_taken(served):
    """Calls on a user message were accepted and dropped without a word. A tool's answer without
    tool_call_id is taken, as llama-server and Ollama take it (OpenAI's API refuses it), and an empty
    tool_calls list, which generic serializers send, is no call."""
    _, http, _ = served
    r = http.post("/v1/chat/completions", json={"messages": ASK + [{"role": "user", "content": "hi", "tool_calls": [
        CALLED]}], "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.1.tool_calls"
    assert "has role 'user' and tool_calls: only an assistant message calls tools" in err["message"]
    for message in ({"role": "tool", "content": "18 C"}, {"role": "user", "content": "hi", "tool_calls": []}):
        r = http.post("/v1/chat/completions", json={"messages": ASK + [message], "max_tokens": 1})
        assert r.status_code == 200, r.text
