"""``POST /v1/responses``: OpenAI's Responses API for text, over the chat path's generation.

A request's ``instructions`` and ``input`` (a string, or items: messages whose ``content`` is a string or
``input_text`` / ``output_text`` parts, and the ``function_call`` / ``function_call_output`` items of earlier
tool calls) become a chat (``instructions`` as its system message) rendered with the model's chat template,
and its function ``tools`` / ``tool_choice`` the chat endpoint's (:mod:`meshnet.api.tools`). The answer is a
``message`` output item of one ``output_text`` part and a ``function_call`` item per call
(:mod:`meshnet.api.responses_events`, streamed as the Responses API's events). An answer cut by
``max_output_tokens`` is
``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens"; one that fails once its stream
has started ends with ``response.failed``, its ``error`` saying why. ``include`` of
``message.output_text.logprobs`` adds each token's log-prob (and ``top_logprobs`` alternatives) to the text, in
chat's entries; ``text.format`` ``json_object`` or ``json_schema`` holds the text to JSON as chat's
``response_format`` does (:mod:`meshnet.api.structured`); ``truncation`` "auto" drops input items from the
start of the conversation until the rest fits the context (the instructions stay), where "disabled", the
default, refuses such an input.

What it does not do is refused by name (400 ``unsupported_parameter``): tools other than functions (web
search, file search, ...), a ``previous_response_id`` or
``conversation`` (this server keeps no responses, so ``GET /v1/responses/{id}`` is a 404 saying so), a stored
``prompt``, ``background``, images and files in the input.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field

from meshnet.api.errors import ApiError, bad_request, model_not_found
from meshnet.api.prompts import chat_prompt
from meshnet.api.responses_events import ResponseShapes, response_status
from meshnet.api.runner import GenJob
from meshnet.api.schemas import ChatCompletionRequest, ChatMessage, TextPart, Usage, _Strict
from meshnet.api.streaming import stream_choices
from meshnet.api.structured import text_format_grammar
from meshnet.api.tools import ToolPlan, plan_tools, repeats_a_call
from meshnet.api.validation import parse_body, sampling_params, token_budget

# What ``include`` may ask for: the text's log-probs, which this server adds, and OpenAI's other values, which
# name items (tool calls' results, images, reasoning) that its answers never hold.
LOGPROBS = "message.output_text.logprobs"
_INCLUDES = frozenset({LOGPROBS, "file_search_call.results", "web_search_call.results",
                       "web_search_call.action.sources", "message.input_image.image_url",
                       "computer_call_output.output.image_url", "code_interpreter_call.outputs",
                       "reasoning.encrypted_content"})


class _Part(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class _InputItem(_Strict):
    """A message (``type`` "message", or none with a ``role``), or an earlier tool call (``function_call``:
    ``call_id``, ``name``, ``arguments``) or its result (``function_call_output``: ``call_id``, ``output``)."""

    model_config = ConfigDict(strict=True, extra="allow")  # an earlier output item's id, status, ...

    type: Literal["message", "function_call", "function_call_output"] | None = None
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[_Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (text only). Fields OpenAI defines with no meaning here (``store``, ``metadata``,
    ``user``, ...) are accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: str | list[_InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)  # of built-in tools, which none are here: ignored
    prompt: Any = None
    reasoning: Any = None  # accepted, ignored
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, Any] | None = None


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None or req.conversation is not None:
        param = "previous_response_id" if req.previous_response_id is not None else "conversation"
        raise bad_request("this server keeps no responses: send the whole conversation as input", param,
                          "unsupported_parameter")
    if req.prompt is not None:
        raise bad_request("this server keeps no prompt templates: send instructions and input instead", "prompt",
                          "unsupported_parameter")
    if req.background:
        raise bad_request("background responses are not supported", "background", "unsupported_parameter")
    for i, value in enumerate(req.include or ()):
        if value not in _INCLUDES:
            raise bad_request(f"include[{i}] is {value!r}, which is none of {sorted(_INCLUDES)}", f"include.{i}",
                              "invalid_value")


def _chat(req: ResponsesRequest) -> tuple[ChatCompletionRequest, int]:
    """The chat the request asks for, ``instructions`` first, as the system message, with its tools in the
    chat endpoint's shape; and how many of its messages come before the input's (1 with instructions, else 0).
    Consecutive ``function_call`` items are one assistant message's tool calls (after its text, if an
    assistant message comes just before them); a ``function_call_output`` is a ``tool`` message."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    items = [_InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, m in enumerate(items):
        if m.type == "function_call":
            call = {"id": _needed(m.call_id, i, "call_id"), "type": "function",
                    "function": {"name": _needed(m.name, i, "name"), "arguments": _arguments(m.arguments, i)}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # its text, or calls of the same turn
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif m.type == "function_call_output":
            output = _needed(m.output, i, "output")
            messages.append(ChatMessage(role="tool", tool_call_id=_needed(m.call_id, i, "call_id"),
                                        content=output if isinstance(output, str) else _text(output, i, "output")))
        else:
            if m.role is None:
                raise bad_request(f"input[{i}] has no role", f"input.{i}.role", "missing_required_parameter")
            content = _needed(m.content, i, "content")
            messages.append(ChatMessage(role=m.role, content=content if isinstance(content, str) else
                                        [TextPart(type="text", text=t) for t in _texts(content, i, "content")]))
    if not messages:
        raise bad_request("input is empty", "input", "empty_messages")
    return ChatCompletionRequest(messages=messages, temperature=req.temperature, top_p=req.top_p,
                                 tools=_chat_tools(req.tools), tool_choice=_chat_tool_choice(req.tool_choice),
                                 parallel_tool_calls=req.parallel_tool_calls), 1 if req.instructions else 0


def _needed(value, i: int, field: str):
    if value is None:
        raise bad_request(f"input[{i}] has no {field}", f"input.{i}.{field}", "missing_required_parameter")
    return value


def _arguments(value: str | None, i: int) -> str:
    """A ``function_call`` item's ``arguments``: a JSON object as text (400 naming ``input.N.arguments``, not
    the chat message it becomes, when it is not)."""
    text = _needed(value, i, "arguments")
    try:
        ok = isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        ok = False
    if not ok:
        raise bad_request(f"input[{i}].arguments must be a JSON object as text, got {text[:40]!r}",
                          f"input.{i}.arguments", "invalid_value")
    return text


def _texts(parts: list[_Part], i: int, field: str) -> list[str]:
    """The texts of an item's parts (text parts only: 400 naming the first other one)."""
    if not parts:
        raise bad_request(f"input[{i}].{field} is empty", f"input.{i}.{field}", "empty_messages")
    for k, p in enumerate(parts):
        if p.type not in ("input_text", "output_text", "text") or p.text is None:
            raise bad_request(f"input[{i}].{field}[{k}] is {p.type!r}: only text parts are supported",
                              f"input.{i}.{field}.{k}", "unsupported_parameter")
    return [p.text for p in parts]


def _text(parts: list[_Part], i: int, field: str) -> str:
    return "".join(_texts(parts, i, field))


def _chat_tools(tools: list[Any] | None) -> list[Any] | None:
    """The Responses API's function tools (``{"type": "function", "name", "parameters", ...}``) in the chat
    endpoint's shape (``{"type": "function", "function": {...}}``), checked there; others refused by name."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_request(f"tools[{i}] is {kind!r}: only function tools are supported here", f"tools.{i}",
                              "unsupported_parameter")
        if "name" not in tool and isinstance(tool.get("function"), dict):
            raise bad_request(f"tools[{i}] has no name: the Responses API's function tools are flat "
                              "({\"type\": \"function\", \"name\": ..., \"parameters\": ...}), not the chat "
                              "endpoint's {\"type\": \"function\", \"function\": {...}}", f"tools.{i}.name",
                              "missing_required_parameter")
        # the Responses API's parameters and strict are nullable (OpenAI's FunctionToolParam): null, none given
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and not (
            v is None and k in ("parameters", "strict", "description"))}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """``tool_choice`` in the chat endpoint's shape: a string as it is, ``{"type": "function", "name"}`` as
    ``{"type": "function", "function": {"name"}}``; a hosted tool or ``allowed_tools`` refused by name."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                          "tool_choice", "unsupported_parameter")
    return {"type": "function", "function": {"name": choice["name"]}}


_CHAT_TOOL_FIELD = re.compile(r"^(tools(?:\[\d+\]|\.\d+))\.function(?=[.:\s])")


def _responses_fields(e: ApiError) -> ApiError:
    """``e`` naming the Responses API's fields (``tools.N.parameters``), not the chat shape's
    (``tools.N.function.parameters``), in its param and at the start of its message."""
    if e.param and e.param.startswith("tools"):
        e.param = e.param.replace(".function.", ".").replace(".function", "")
        e.message = _CHAT_TOOL_FIELD.sub(r"\1", e.message)
    return e


def _plan(chat: ChatCompletionRequest) -> ToolPlan:
    """The chat's tool plan; an error names the Responses API's fields (``tools.N.parameters``)."""
    try:
        return plan_tools(chat.tools, chat.tool_choice, parallel=chat.parallel_tool_calls is not False)
    except ApiError as e:
        raise _responses_fields(e) from None


def fitted_prompt(tok, chat: ChatCompletionRequest, kept: int, n_ctx: int, truncate: bool,
                  plan: ToolPlan = ToolPlan("none")) -> list[int]:
    """The token ids of ``chat`` rendered; with ``truncate`` (``truncation: "auto"``), of the chat less as few
    input messages from its start as leave a prompt of at most ``n_ctx`` tokens, ``kept`` leading messages
    (the instructions) and the last message always kept. The prompt's length falls as messages are dropped,
    so the number to drop is found by bisection: a few renderings, not one per message.

    Raises:
        ApiError: 400 ``context_length_exceeded`` when even the shortest such chat does not fit (the
            token budget refuses a prompt beyond ``n_ctx``), or as :func:`chat_prompt`.
    """
    def render(dropped: int) -> list[int] | None:
        """The prompt with ``dropped`` input messages left out; None when it cannot fit."""
        shorter = chat.model_copy(update={"messages": chat.messages[:kept] + chat.messages[kept + dropped:]})
        try:
            ids = chat_prompt(tok, shorter, plan, n_ctx)
        except ApiError as e:
            if truncate and e.code == "context_length_exceeded":
                return None
            raise
        return ids if not truncate or len(ids) <= n_ctx else None

    whole = render(0)
    if whole is not None or not truncate:
        return whole
    low, high = 0, len(chat.messages) - kept - 1  # render(low) does not fit; high keeps the last message alone
    best = render(high)
    if best is None:
        return chat_prompt(tok, chat.model_copy(update={"messages": chat.messages[:kept] + chat.messages[-1:]}),
                           plan, n_ctx)  # refused as the chat path refuses it
    while high - low > 1:
        mid = (low + high) // 2
        ids = render(mid)
        if ids is None:
            low = mid
        else:
            high, best = mid, ids
    return best


async def create_response(api, request: Request) -> Response:
    """Answer ``POST /v1/responses`` with ``api`` (the app's request handler: its backend, slots and runs).

    Raises:
        ApiError: 400 for a malformed or unsupported request, 404 for a model not served, 503 as chat's.
    """
    t0 = time.perf_counter()
    req = parse_body(ResponsesRequest, await request.body())
    if req.model is not None and req.model != api.backend.model_name:
        raise model_not_found(req.model, api.backend.model_name)
    _refuse_unsupported(req)
    chat, kept = _chat(req)
    plan = _plan(chat)
    tok = api.backend.tokenizer
    prompt_ids = await anyio.to_thread.run_sync(fitted_prompt, tok, chat, kept, api.backend.n_ctx,
                                                req.truncation == "auto", plan)
    # Compiled off the event loop, as chat's response_format (a new schema takes milliseconds).
    grammar = await anyio.to_thread.run_sync(text_format_grammar, (req.text or {}).get("format"),
                                             api.backend.grammars)
    try:
        grammar = await api.tools_grammar(plan, grammar)
    except ApiError as e:  # a schema the grammar cannot enforce: tools.N.parameters
        raise _responses_fields(e) from None
    budget = token_budget(api.backend.n_ctx, prompt_ids, req.max_output_tokens, "input")
    logprobs = LOGPROBS in (req.include or ())
    job = GenJob(prompt_ids, budget, sampling_params(chat, tok.n_vocab, req.top_logprobs or 0, 0, grammar,
                                                     logprobs=logprobs),
                 stop_at_control=True, speculation=api._speculation(chat),
                 ends_early=repeats_a_call if plan.mode == "required" else None)
    await api._check_route()
    shapes = ResponseShapes(req, api.backend.model_name, plan, tok if logprobs else None)
    if req.stream:
        return await stream_choices(api._runs, [job], t0, len(prompt_ids), True, shapes.start, shapes.piece,
                                    shapes.end, request, done=None, error_event=shapes.failed)
    [(pieces, run)] = await api.whole_choices([job], request, t0)
    shapes.take_whole(pieces, run.finish_reason)
    usage = Usage.of(len(prompt_ids), run.completion_tokens, run.cached_tokens)
    return JSONResponse(shapes.response(response_status(run.finish_reason), usage))
