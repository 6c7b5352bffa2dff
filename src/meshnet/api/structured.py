"""OpenAI's ``response_format`` as the :class:`~meshnet.sampling_params.Grammar` a generation's sampling carries:
``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON object) and ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}``; the Responses API's ``text.format`` likewise,
its ``json_schema`` fields in the format itself. The schema is compiled here, against the
served vocabulary, so a schema the grammar library cannot enforce is a 400 naming why before any node runs.
``strict`` is accepted either way: the schema is always enforced."""

from __future__ import annotations

import re
from typing import Any

from meshnet.api.errors import bad_request
from meshnet.grammar import GrammarCompiler, GrammarError, schema_text
from meshnet.sampling_params import Grammar

# OpenAI's rule for a response format's name.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# json_object: OpenAI promises a JSON object, nothing more.
ANY_OBJECT = {"type": "object"}


def response_grammar(fmt: dict[str, Any] | None, compiler: GrammarCompiler) -> Grammar | None:
    """The grammar ``fmt`` asks for, or None for text.

    Raises:
        ApiError: 400 with ``param`` ``response_format``: an unknown type, a malformed ``json_schema``
            object, a schema that is not an object, over
            :data:`~meshnet.sampling_params.MAX_GRAMMAR_BYTES`, or one the grammar
            library refuses (its message says which keyword or value).
    """
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        _only(fmt, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only(fmt, {"type"}, "response_format")
        return grammar_for(ANY_OBJECT, compiler, "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format")
    _only(fmt, {"type", "json_schema"}, "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with 'name' and 'schema'",
                          "response_format.json_schema")
    return _schema_grammar(spec, compiler, "response_format.json_schema")


def text_format_grammar(fmt: Any, compiler: GrammarCompiler) -> Grammar | None:
    """The grammar the Responses API's ``text.format`` asks for, or None for text: ``{"type": "text"}``,
    ``{"type": "json_object"}`` or ``{"type": "json_schema", "name", "schema", "strict", "description"}``
    (the chat shape's ``json_schema`` object, flattened into the format).

    Raises:
        ApiError: 400 naming ``text.format`` or its field, as :func:`response_grammar`.
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object such as {\"type\": \"text\"}", "text.format",
                          "invalid_type")
    if "type" not in fmt:  # as chat's response_format: {} is refused, not taken for text
        raise bad_request("text.format needs a type: 'text', 'json_object' or 'json_schema'", "text.format.type")
    kind = fmt["type"]
    if kind in ("text", "json_object"):
        _only(fmt, {"type"}, "text.format")
        return grammar_for(ANY_OBJECT, compiler, "text.format") if kind == "json_object" else None
    if kind != "json_schema":
        raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "text.format.type")
    return _schema_grammar({k: v for k, v in fmt.items() if k != "type"}, compiler, "text.format")


def _schema_grammar(spec: dict[str, Any], compiler: GrammarCompiler, param: str) -> Grammar:
    """The grammar of a named JSON schema ``spec`` (``name``, ``schema``, ``strict``, ``description``), its
    fields named ``<param>.<field>`` in a 400."""
    _only(spec, _JSON_SCHEMA_KEYS, param)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{param}.name must be 1-64 letters, digits, '_' or '-', got {name!r}", f"{param}.name")
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise bad_request(f"{param}.strict must be a boolean", f"{param}.strict")
    if not isinstance(spec.get("description", ""), str | None):
        raise bad_request(f"{param}.description must be a string", f"{param}.description")
    return grammar_for(spec.get("schema", {}), compiler, f"{param}.schema")


def grammar_for(schema: Any, compiler: GrammarCompiler, param: str) -> Grammar:
    """A compiled, enforceable grammar for the JSON schema ``schema`` (a decoded JSON value).

    Raises:
        ApiError: 400 naming ``param``: not an object, over the size limit, or refused by the library.
    """
    try:
        text = schema_text(schema)
        grammar = Grammar(text)
        if (problem := grammar.validate()) is not None:
            raise GrammarError(problem.replace("grammar json_schema", "the JSON schema"))
        compiler.compile(text)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param, "invalid_schema") from None
    return grammar


def _only(obj: dict[str, Any], keys: set[str], param: str) -> None:
    extra = sorted(set(obj) - keys)
    if extra:
        raise bad_request(f"{param} has unknown field {extra[0]!r} (expected {', '.join(sorted(keys))})",
                          f"{param}.{extra[0]}")


def tools_grammar(plan, grammar: Grammar | None, compiler: GrammarCompiler) -> Grammar | None:
    """The grammar an answer under ``plan`` (a :class:`~meshnet.api.tools.ToolPlan`) follows: its call
    schema for a required or named call, else ``grammar`` (the response format's, or None). Each tool's own
    schema is checked first, so that an error names its tool (``tools.N.function.parameters``). Raises
    ApiError 400 for a schema that cannot be enforced."""
    for schema, param in plan.parts:
        grammar_for(schema, compiler, param)
    if plan.schema is None:  # "auto": the tools' schemas are checked, not enforced
        return grammar
    return grammar_for(plan.schema, compiler, "tools")
