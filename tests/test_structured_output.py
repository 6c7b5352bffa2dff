"""``response_format`` (json_object, json_schema) on the bundled SmolLM2 through the official ``openai``
client and raw HTTP: the answers parse and validate, greedy and seeded sampled; constrained requests batched
with unconstrained ones leave those equal to their solo runs; n-gram speculation gives the constrained
greedy answer unchanged; bad schemas are 400s naming what is wrong."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from api_served import served_api  # noqa: E402
from meshnet.api.backend import local_backend  # noqa: E402
from meshnet.bench.structured_bench import PERSON  # noqa: E402
from meshnet.chat_template import chat_prompt_ids  # noqa: E402
from meshnet.generation import generate  # noqa: E402
from meshnet.sampling_params import MAX_GRAMMAR_BYTES, Grammar, SamplingParams  # noqa: E402
from meshnet.speculative import Speculation  # noqa: E402

# Required string, integer, enum and bounded array (the shape), as the structured bench asks for.
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age, color and tags."}]
PLAIN = "The capital of France is"


@pytest.fixture(scope="module")
def served(smollm2_path):
    with served_api(local_backend(str(smollm2_path), n_ctx=1024, max_sessions=4, name="smollm2"), 300) as served:
        yield served


def _valid(text: str, schema: dict) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, schema)
    return doc


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11},
                                      {"temperature": 1.2, "seed": 5, "top_p": 0.95}])
def test_openai_client_json_schema_answers_parse_and_validate(served, sampling):
    _, _, client = served
    out = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=300,
                                         response_format=PERSON_FORMAT, **sampling)
    choice = out.choices[0]
    doc = _valid(choice.message.content, PERSON)
    assert choice.finish_reason == "stop" and set(doc) == {"name", "age", "color", "tags"}
    assert out.usage.completion_tokens < 300


def test_completions_json_schema_and_json_object(served):
    _, http, client = served
    got = client.completions.create(model="smollm2", prompt="A person as JSON: ", max_tokens=300, temperature=0,
                                    extra_body={"response_format": PERSON_FORMAT})
    _valid(got.choices[0].text, PERSON)
    assert got.choices[0].finish_reason == "stop"
    # json_object admits any object (unbounded: this prompt is one the model ends by itself)
    city = [{"role": "user", "content": 'Reply with a JSON object with the keys "city" and "country" for Paris.'}]
    obj = client.chat.completions.create(model="smollm2", messages=city, max_tokens=100, temperature=0,
                                         response_format={"type": "json_object"})
    assert json.loads(obj.choices[0].message.content) == {"city": "Paris", "country": "France"}
    # streamed: the deltas join into the same document as the whole answer
    whole = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=300, temperature=0,
                                           response_format=PERSON_FORMAT).choices[0].message.content
    chunks = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=300, temperature=0,
                                            response_format=PERSON_FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_a_stop_sequence_inside_the_document_does_not_cut_it(served):
    """The grammar ends a constrained answer: a stop sequence met inside its JSON cut it into a document that
    did not parse, reported as finished ("stop"). The stops still apply to an unconstrained answer."""
    _, _, client = served
    alone = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=300, temperature=0,
                                           response_format=PERSON_FORMAT).choices[0]
    cut = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=300, temperature=0,
                                         response_format=PERSON_FORMAT, stop=['"age"', "name"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == alone.message.content
    assert set(_valid(cut.message.content, PERSON)) == {"name", "age", "color", "tags"}
    got = client.completions.create(model="smollm2", prompt="A person as JSON: ", max_tokens=300, temperature=0,
                                    stop=["name"], extra_body={"response_format": PERSON_FORMAT}).choices[0]
    assert got.finish_reason == "stop" and "name" in _valid(got.text, PERSON)
    free = client.completions.create(model="smollm2", prompt=PLAIN, max_tokens=20, temperature=0, stop=["Paris"])
    assert free.choices[0].text == " " and free.choices[0].finish_reason == "stop"


def test_batched_constrained_and_unconstrained_leave_the_unconstrained_as_alone(served):
    backend, http, _ = served
    tok = backend.tokenizer
    solo = tok.decode(generate(backend.chain, tok, tok.encode(PLAIN), 24, SamplingParams()).generated_token_ids)
    bodies = [("/v1/completions", {"prompt": PLAIN, "max_tokens": 24, "temperature": 0}),
              ("/v1/chat/completions", {"messages": ASK, "max_tokens": 300, "temperature": 0,
                                        "response_format": PERSON_FORMAT}),
              ("/v1/chat/completions", {"messages": ASK, "max_tokens": 300, "temperature": 1.0, "seed": 3,
                                        "response_format": PERSON_FORMAT}),
              ("/v1/completions", {"prompt": PLAIN, "max_tokens": 24, "temperature": 0})]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: http.post(b[0], json=b[1]), bodies))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert answers[0].json()["choices"][0]["text"] == answers[3].json()["choices"][0]["text"] == solo
    for a in answers[1:3]:
        _valid(a.json()["choices"][0]["message"]["content"], PERSON)
    # batched over the engines too: some iterations carried more than one session's rows
    assert any(m.max_batch_rows > 1 for _, m in backend.stage_metrics())


def test_ngram_speculation_keeps_the_constrained_greedy_answer(served):
    backend, http, _ = served
    tok = backend.tokenizer
    # the keys and values in the prompt give n-gram drafts, some of which the grammar refuses
    ask = [{"role": "user", "content": 'Fill in {"name": "Ann", "age": 30, "color": "red", "tags": ["a", "b"]} '
                                       'for another person, as JSON.'}]
    ids = chat_prompt_ids(tok, ask)
    sp = SamplingParams(grammar=Grammar(json.dumps(PERSON)))
    plain = generate(backend.chain, tok, ids, 120, sp)
    spec = generate(backend.chain, tok, ids, 120, sp, speculation=Speculation(6, adaptive=False))
    assert spec.generated_token_ids == plain.generated_token_ids and spec.drafted > 0
    assert spec.accepted < spec.drafted  # rejected drafts were rolled back, the matcher with them
    _valid(plain.text, PERSON)
    body = {"messages": ask, "max_tokens": 120, "temperature": 0, "response_format": PERSON_FORMAT}
    got = [http.post("/v1/chat/completions", json={**body, **extra}).json()["choices"][0]["message"]["content"]
           for extra in ({}, {"speculative": "ngram", "draft_tokens": 6})]
    assert got == [plain.text, plain.text]


@pytest.mark.parametrize("fmt, param, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}, "response_format.json_schema.schema",
     "must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "description": ["a"]}},
     "response_format.json_schema.description", "must be a string"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     "response_format.json_schema.schema", "Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}},
     "response_format.json_schema.schema", "not"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/none"}}},
     "response_format.json_schema.schema", "/defs/none"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        f"field_{i:05d}": {"type": "string"} for i in range(2000)}}}}, "response_format.json_schema.schema",
     f"limit of {MAX_GRAMMAR_BYTES}"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}},
     "response_format.json_schema.schema", "admits no document"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {  # an object that requires itself
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}},
     "response_format.json_schema.schema", "Too many items (limit 50000; ff_tokens); try avoiding single-byte/short "
     "lexemes; a schema whose required properties lead back to their own object"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name", "name"),
    ({"type": "json_schema"}, "response_format.json_schema", "json_schema must be an object"),
    ({"type": "xml"}, "response_format", "'xml'"),
    ({}, "response_format", "response_format.type must be"),  # no type: refused, not taken for text
])
def test_bad_schemas_are_400_naming_what_is_wrong(served, fmt, param, words):
    _, http, _ = served
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": PLAIN})):
        r = http.post(path, json={**body, "max_tokens": 8, "response_format": fmt})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
        assert "<state>" not in err["message"]  # the library's parser dump stays out of the answer


def test_ignore_eos_with_a_json_format_is_400(served):
    _, http, _ = served
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "ignore_eos": True,
                                                "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
