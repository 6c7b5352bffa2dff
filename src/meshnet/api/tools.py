"""Chat ``tools`` and ``tool_choice``: what the prompt shows the model, which grammar constrains its answer,
and the answer read back as OpenAI ``tool_calls``.

* ``"none"`` (or no tools): the tools are not shown; a plain answer.
* ``"auto"``: the tools go to the chat template (``tools``, as Hugging Face templates read them); a template
  that never mentions ``tools`` gets them in a system message instead. The answer is read as tool calls when
  it is ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (the Hermes format Qwen 2.5 and SmolLM3
  templates teach) or one bare ``{"name", "arguments"}`` object naming a tool; otherwise it is content.
* ``"required"``: the answer is constrained to a JSON array of ``{"name", "parameters"}`` calls, each a
  declared tool with arguments valid under its schema (vLLM's schema for ``required``), no other keys, and
  one call at most when ``parallel_tool_calls`` is false. Each tool's parameters sit under ``$defs`` with
  their own ``$ref`` s rewritten, so schemas that point into themselves (``#/$defs/...``, as pydantic
  writes them) still resolve inside the array.
* ``{"type": "function", "function": {"name"}}``: the answer is constrained to that tool's arguments.

Under both constraints an object schema with ``properties`` admits only those keys unless it says
otherwise (``additionalProperties``, ``patternProperties``), as llama.cpp's grammar for a schema does
(``common/json-schema.cpp``): a function's arguments are what it declares, and where JSON Schema's own
default (any other key) holds, a small model adds keys until ``max_tokens`` cuts the call off. Parts that
describe one object together (``allOf`` members, ``anyOf`` branches beside ``properties``, a ``$ref``
beside other keywords) stay open: closed, each would refuse the keys of the others.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from meshnet.api.errors import bad_request

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_NO_PARAMETERS = {"type": "object", "properties": {}}
_VALUE_KEYS = frozenset({"const", "enum", "default", "examples"})  # JSON values inside a schema, not schemas


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: ``mode`` ("none", "auto", "required", "named"), the tools in
    OpenAI's shape (``{"type": "function", "function": {...}}``), the named tool, and the JSON schema that
    constrains the answer (None: unconstrained). ``parts``: each tool's own schema (within ``schema``, if
    any), with the field an error in it names (``tools.N.function.parameters``), to be checked first:
    within the whole, an error names neither the tool nor its own paths."""

    mode: str
    tools: tuple[dict, ...] = ()
    named: str | None = None
    schema: dict | None = None
    parts: tuple[tuple[dict, str], ...] = ()
    parallel: bool = True  # False (parallel_tool_calls): one call at most, the first an "auto" answer makes

    @property
    def forced(self) -> bool:
        """Whether the answer is calls whatever it says ("required" or "named": the grammar makes it so)."""
        return self.mode in ("required", "named")

    def prompt_tools(self) -> list[dict] | None:
        """The tools the prompt shows (None for ``"none"``)."""
        return None if self.mode == "none" or not self.tools else list(self.tools)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool = True) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` and plan their use; ``parallel`` False (``parallel_tool_calls``)
    allows one call at most.

    Raises:
        ApiError: 400 naming the field: a tool that is not ``{"type": "function", "function": {"name", ...}}``,
            a bad or repeated name, parameters that are not an object, an unknown ``tool_choice``, a named
            function that is not among the tools, or ``required`` / a named function without tools.
    """
    checked = tuple(_tool(t, i) for i, t in enumerate(tools or ()))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) < len(names):
        raise bad_request("tools name a function twice", "tools")
    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    if not (choice in ("none", "auto", "required") or isinstance(choice, dict)):
        raise bad_request(f"tool_choice {json.dumps(choice)} is not one of 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice == "none":
        return ToolPlan("none", checked)
    if not checked:
        raise bad_request(f"tool_choice {json.dumps(choice)} needs tools", "tool_choice")
    # Each tool's parameters, to check as required / named check them: "auto" enforces none of them, but a
    # schema that cannot be enforced (an unknown type) is as wrong under one choice as under another.
    parts = tuple((_closed(_parameters(t)), f"tools.{i}.function.parameters") for i, t in enumerate(checked))
    if choice == "auto":
        return ToolPlan("auto", checked, parts=parts, parallel=parallel)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": {"$ref": f"#/$defs/tool_{i}"}},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for i, t in enumerate(checked)]
        schema = {"$defs": {f"tool_{i}": _moved(closed, f"#/$defs/tool_{i}") for i, (closed, _) in enumerate(parts)},
                  "type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", checked, schema=schema, parts=parts)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    i = names.index(name)
    return ToolPlan("named", checked, named=name, schema=parts[i][0], parts=(parts[i],))


def tools_system_message(tools: list[dict]) -> dict:
    """The system message that shows ``tools`` to a model whose chat template has no place for them."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return {"role": "system", "content": "You can call these functions:\n" + listed + "\nTo call one, answer "
            "with <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> and nothing else."}


def tool_calls_from(text: str, plan: ToolPlan) -> list[dict] | None:
    """The answer ``text`` as OpenAI tool calls (``{"id", "type": "function", "function": {"name",
    "arguments"}}``, arguments as JSON text), or None when it holds none (content, then)."""
    try:
        return _tool_calls(text, plan)
    except RecursionError:  # JSON nested past what json reads and writes: content, not a call
        return None


def _tool_calls(text: str, plan: ToolPlan) -> list[dict] | None:
    if plan.mode == "named":
        # The grammar makes the whole answer a call, but max_tokens can end it early: cut text is content.
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        return [_call(plan.named, doc)]
    if plan.mode == "required":
        # An array ended early (max_tokens, or a call repeated: see repeats_a_call) keeps its whole calls; the
        # same call twice is one (a small model repeats one call until the context is full).
        unique = {json.dumps(c, sort_keys=True): c for c in _whole_items(text)}
        return [_call(c["name"], c["parameters"]) for c in unique.values()] or None
    if plan.mode != "auto":
        return None
    names = {t["function"]["name"] for t in plan.tools}
    found = _HERMES.findall(text) or [text.strip()]
    calls = []
    for raw in found:
        try:  # NaN and Infinity, which json reads, are no JSON a client could read back
            obj = json.loads(raw, parse_constant=_no_constant)
        except ValueError:
            return None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"] in names):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some templates teach arguments as JSON text
            try:
                args = json.loads(args, parse_constant=_no_constant)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(_call(obj["name"], args))
    return (calls if plan.parallel else calls[:1]) or None


def _whole_items(text: str) -> list[Any]:
    """The items of the JSON array ``text`` begins, up to the first that is not whole (the grammar wrote it,
    so what is there is well-formed up to where it was cut)."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    while at:
        at = len(text) - len(text[at:].lstrip(" \n\t,"))
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
    return items


def repeats_a_call(text: str) -> bool:
    """Whether a required answer (a JSON array of calls, being written) holds the same call twice: it ends
    there (see :func:`_tool_calls`) rather than repeating it to ``max_tokens`` or the context's end."""
    if not text.endswith("}"):  # only a call's closing brace can complete one
        return False
    keys = [json.dumps(c, sort_keys=True) for c in _whole_items(text)]
    return len(set(keys)) < len(keys)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def hermes_calls_text(tool_calls: list[Any], param: str) -> str:
    """An assistant message's OpenAI ``tool_calls`` as the ``<tool_call>{"name", "arguments"}</tool_call>``
    blocks :func:`tools_system_message` teaches, for a chat template that never reads ``tool_calls``.

    Raises:
        ApiError: 400 naming ``param.i`` for a call that is not ``{"function": {"name": str, "arguments":
            JSON text or object}}``, or whose arguments nest too deeply for Python's json to read or write.
    """
    blocks = []
    for i, call in enumerate(tool_calls):
        try:
            blocks.append(_hermes_call(call, param, i))
        except RecursionError:  # a 2 KB string of 1000 brackets was an HTTP 500
            raise bad_request(f"{param}[{i}].function.arguments is JSON nested too deeply to read",
                              f"{param}.{i}") from None
    return "\n".join(blocks)


def _hermes_call(call: Any, param: str, i: int) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(args, dict)):
        raise bad_request(f"{param}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                          "\"arguments\": a JSON object as text}}", f"{param}.{i}")
    return "<tool_call>" + _json_text({"name": fn["name"], "arguments": args}) + "</tool_call>"


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": _json_text(arguments)}}


def _json_text(value: Any) -> str:
    """``value`` as JSON text, non-ASCII kept as is; a lone UTF-16 surrogate (an answer that wrote the
    escape ``\\ud83d`` alone) stays an escape: as a character no UTF-8 response could carry it (a 500, or a
    stream cut without ``[DONE]``)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def _tool(tool: Any, i: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
        raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                          f"tools.{i}")
    if not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
        raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got "
                          f"{fn.get('name')!r}", f"tools.{i}.function.name")
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                          f"tools.{i}.function.parameters")
    kind = (fn.get("parameters") or {}).get("type", "object")
    if kind != "object":
        # A call's arguments are one JSON object (clients call f(**json.loads(arguments))): a string
        # schema made them a bare JSON string.
        raise bad_request(f"tools[{i}].function.parameters must describe an object (a call's arguments are "
                          f"a JSON object), got type {json.dumps(kind)}", f"tools.{i}.function.parameters")
    return tool


def _parameters(tool: dict) -> dict:
    """A tool's parameters schema; an object whatever it says of its type (OpenAI's arguments are one:
    without ``"type"``, JSON Schema let a constrained answer be a bare string)."""
    params = tool["function"].get("parameters") or _NO_PARAMETERS
    return params if "type" in params else {**params, "type": "object"}


# Keywords whose value is a schema of its own (or a list of them), a map of names to such schemas.
_SCHEMA_KEYS = frozenset({"items", "additionalProperties", "contains", "propertyNames", "additionalItems",
                          "unevaluatedItems", "unevaluatedProperties"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
# Keywords whose schemas apply to the same object as the schema holding them: their properties add up
# with its own (allOf, if / then / else, dependentSchemas), or with each other's (anyOf / oneOf branches
# of an object that has properties), or say what it must not be (not). Neither side is closed there.
_SAME_OBJECT = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "$ref"})
_OPEN_KEYS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
# Keywords whose value maps names to schemas: their keys are names, not keywords.
_NAMED_SCHEMAS = _SCHEMA_MAPS | {"dependentSchemas"}


def _closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema, at any depth, that lists
    ``properties``, says nothing of other keys and is whole by itself: neither combined with others that
    describe the same object (:data:`_SAME_OBJECT`) nor a ``$defs`` entry a ``$ref`` combines so (see
    the module's docstring). Values stay as they are."""
    merged = _merged_refs(schema)

    def close(node: Any, closable: bool = True) -> Any:
        if not isinstance(node, dict):
            return node
        has_properties = isinstance(node.get("properties"), dict)
        out = {}
        for k, v in node.items():
            if k in _SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {name: close(sub, k not in ("$defs", "definitions") or f"#/{k}/{name}" not in merged)
                          for name, sub in v.items()}
            elif k in ("anyOf", "oneOf") and isinstance(v, list):  # alternatives: whole unless they extend it
                out[k] = [close(sub, not has_properties) for sub in v]
            elif k in _SAME_OBJECT:
                out[k] = ([close(sub, False) for sub in v] if isinstance(v, list) else
                          {n: close(sub, False) for n, sub in v.items()} if isinstance(v, dict) and
                          k == "dependentSchemas" else close(v, False))
            elif k in _SCHEMA_KEYS or k == "prefixItems":
                out[k] = [close(sub) for sub in v] if isinstance(v, list) else close(v)
            else:
                out[k] = v
        if closable and has_properties and not (_OPEN_KEYS | _SAME_OBJECT) & node.keys():
            out["additionalProperties"] = False
        return out

    return close(schema)


def _merged_refs(schema: Any) -> set[str]:
    """The local ``$ref`` s used where their schema describes an object together with others: beside
    other keywords of :data:`_SAME_OBJECT` or ``properties``, or inside one of them (an ``allOf`` member)."""
    found: set[str] = set()

    combining = _SAME_OBJECT - {"$ref"}

    def walk(node: Any, merging: bool) -> None:
        if isinstance(node, list):
            for sub in node:
                walk(sub, merging)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (merging or "properties" in node or combining & node.keys()):
                found.add(ref)
            for k, v in node.items():
                if k in _VALUE_KEYS:
                    continue
                if k in _NAMED_SCHEMAS and isinstance(v, dict):  # names (a property called "default"...)
                    for sub in v.values():
                        walk(sub, k == "dependentSchemas")
                    continue
                alternatives = k in ("anyOf", "oneOf")
                walk(v, k in combining and not alternatives or alternatives and "properties" in node)

    walk(schema, False)
    return found


def _moved(schema: Any, root: str) -> Any:
    """``schema`` with every local ``$ref`` (``#``, ``#/...``) pointing below ``root`` instead: where the
    schema goes when it is placed at ``root`` of a larger one. Values (``const``, ``enum``, ...) stay; the
    keys of ``properties`` and the other maps of :data:`_NAMED_SCHEMAS` are names, whatever they spell."""
    if isinstance(schema, dict):
        return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else v if k in _VALUE_KEYS
                else {name: _moved(sub, root) for name, sub in v.items()}
                if k in _NAMED_SCHEMAS and isinstance(v, dict) else _moved(v, root) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_moved(v, root) for v in schema]
    return schema
