"""``POST /v1/responses``: OpenAI's Responses API for text, over the chat path's generation.

A request's ``instructions`` and ``input`` (a string, or messages whose ``content`` is a string or
``input_text`` / ``output_text`` parts) become a chat (``instructions`` as its system message) rendered with
the model's chat template; the answer is one ``message`` output item of one ``output_text`` part. Streamed, its
events are the Responses API's own (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), each with its ``sequence_number``. An answer cut by ``max_output_tokens`` is
``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens"; one that fails once its stream
has started ends with ``response.failed``, its ``error`` saying why. ``include`` of
``message.output_text.logprobs`` adds each token's log-prob (and ``top_logprobs`` alternatives) to the text, in
chat's entries; ``truncation`` "auto" drops input items from the start of the conversation until the rest fits
the context (the instructions stay), where "disabled", the default, refuses such an input.

What it does not do is refused by name (400 ``unsupported_parameter``): tools, a ``previous_response_id`` or
``conversation`` (this server keeps no responses, so ``GET /v1/responses/{id}`` is a 404 saying so), a stored
``prompt``, ``background``, a ``text.format`` other than text, images and files in the input.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field

from meshnet.api.errors import ApiError, bad_request, model_not_found
from meshnet.api.logprobs import chat_logprobs
from meshnet.api.prompts import chat_prompt
from meshnet.api.runner import GenJob, Piece
from meshnet.api.schemas import ChatCompletionRequest, ChatMessage, TextPart, Usage, _Strict
from meshnet.api.sse import event
from meshnet.api.streaming import stream_choices
from meshnet.api.tools import ToolPlan
from meshnet.api.validation import parse_body, sampling_params, token_budget

_ROLES = ("system", "developer", "user", "assistant")
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


class _InputMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # an earlier output item's id, status, ...

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_Part]


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (text only). Fields OpenAI defines with no meaning here (``store``, ``metadata``,
    ``user``, ...) are accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: str | list[_InputMessage]
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
    max_tool_calls: int | None = Field(default=None, ge=1)  # no tools are called here: accepted, ignored
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
    if req.tools:
        raise bad_request("tools are not supported on /v1/responses; use /v1/chat/completions", "tools",
                          "unsupported_parameter")
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
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object such as {\"type\": \"text\"}", "text.format",
                          "invalid_type")
    if fmt and fmt.get("type", "text") != "text":
        raise bad_request("only text.format {\"type\": \"text\"} is supported on /v1/responses; for JSON use "
                          "response_format on /v1/chat/completions", "text.format", "unsupported_parameter")


def _chat(req: ResponsesRequest) -> tuple[ChatCompletionRequest, int]:
    """The chat the request asks for, ``instructions`` first, as the system message; and how many of its
    messages come before the input's (1 with instructions, else 0)."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    items = [_InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, m in enumerate(items):
        if isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content))
            continue
        if not m.content:
            raise bad_request(f"input[{i}].content is empty", f"input.{i}.content", "empty_messages")
        for k, p in enumerate(m.content):
            if p.type not in ("input_text", "output_text", "text") or p.text is None:
                raise bad_request(f"input[{i}].content[{k}] is {p.type!r}: only text parts are supported",
                                  f"input.{i}.content.{k}", "unsupported_parameter")
        messages.append(ChatMessage(role=m.role, content=[TextPart(type="text", text=p.text) for p in m.content]))
    if not messages:
        raise bad_request("input is empty", "input", "empty_messages")
    return ChatCompletionRequest(messages=messages, temperature=req.temperature, top_p=req.top_p), \
        1 if req.instructions else 0


def fitted_prompt(tok, chat: ChatCompletionRequest, kept: int, n_ctx: int, truncate: bool) -> list[int]:
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
            ids = chat_prompt(tok, shorter, ToolPlan("none"), n_ctx)
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
                           ToolPlan("none"), n_ctx)  # refused as the chat path refuses it
    while high - low > 1:
        mid = (low + high) // 2
        ids = render(mid)
        if ids is None:
            low = mid
        else:
            high, best = mid, ids
    return best


class _Shapes:
    """The response object and its stream's events, for one answer."""

    def __init__(self, req: ResponsesRequest, model: str, tok=None) -> None:
        self.req, self.model = req, model
        self.tok = tok  # the tokenizer when the text's log-probs are asked for
        self.id, self.msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created, self.seq, self.text = int(time.time()), 0, ""
        self.logprobs: list[dict] = []
        self.finish_reason = "stop"  # the streamed answer's, once its last piece came

    def add(self, pieces: list[Piece]) -> list[dict]:
        """Take ``pieces`` into the answer; their tokens' log-prob entries (none unless asked for)."""
        self.text += "".join(p.text for p in pieces)
        entries = [] if self.tok is None else [e.model_dump() for e in chat_logprobs(self.tok, pieces).content]
        self.logprobs += entries
        return entries

    def response(self, status: str, finish_reason: str | None = None, usage: Usage | None = None,
                 error: ApiError | None = None) -> dict:
        done = status != "in_progress"
        output = [self.message("completed" if status == "completed" else "incomplete")] if done else []
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output,
                "error": None if error is None else {"code": error.code or error.type, "message": error.message},
                "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": 1.0 if req.temperature is None else req.temperature,  # the values in effect
                "top_p": 1.0 if req.top_p is None else req.top_p,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False, "background": False,
                "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
                "truncation": req.truncation or "disabled", "top_logprobs": req.top_logprobs,
                "max_tool_calls": req.max_tool_calls, "metadata": self.req.metadata or {},
                "usage": None if usage is None else {
                    "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                    "total_tokens": usage.total_tokens, "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": 0}}}

    def message(self, status: str) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [self.part()] if status != "in_progress" else []}

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}

    def event(self, kind: str, **fields) -> str:
        """One event, named on an ``event:`` line as OpenAI's are, its ``type`` and ``sequence_number`` in it."""
        self.seq += 1
        return f"event: {kind}\n" + event({"type": kind, "sequence_number": self.seq - 1, **fields})

    def start(self, _i: int) -> list[str]:
        where = {"output_index": 0}
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress")),
                self.event("response.output_item.added", item=self.message("in_progress"), **where),
                self.event("response.content_part.added", item_id=self.msg_id, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}, **where)]

    def piece(self, _i: int, piece: Piece) -> list[str]:
        out = []
        entries = self.add([piece])
        if piece.text or entries:
            out.append(self.event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                  content_index=0, delta=piece.text, logprobs=entries))
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason
            status = "completed" if piece.finish_reason == "stop" else "incomplete"
            out += [self.event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                               text=self.text, logprobs=self.logprobs),
                    self.event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                               part=self.part()),
                    self.event("response.output_item.done", output_index=0, item=self.message(status))]
        return out

    def end(self, usage: Usage) -> str:
        status = "completed" if self.finish_reason == "stop" else "incomplete"
        return self.event(f"response.{status}", response=self.response(status, self.finish_reason, usage))

    def failed(self, error: ApiError) -> str:
        """The event that ends a stream whose answer failed once it had started: ``response.failed``, the
        response's ``error`` saying why (chat's ``{"error": ...}`` event made the SDK raise mid-stream)."""
        return self.event("response.failed", response=self.response("failed", error=error))


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
    tok = api.backend.tokenizer
    prompt_ids = await anyio.to_thread.run_sync(fitted_prompt, tok, chat, kept, api.backend.n_ctx,
                                                req.truncation == "auto")
    budget = token_budget(api.backend.n_ctx, prompt_ids, req.max_output_tokens, "input")
    logprobs = LOGPROBS in (req.include or ())
    job = GenJob(prompt_ids, budget, sampling_params(chat, tok.n_vocab, req.top_logprobs or 0, 0, logprobs=logprobs),
                 stop_at_control=True, speculation=api._speculation(chat))
    await api._check_route()
    shapes = _Shapes(req, api.backend.model_name, tok if logprobs else None)
    if req.stream:
        return await stream_choices(api._runs, [job], t0, len(prompt_ids), True, shapes.start, shapes.piece,
                                    shapes.end, request, done=None, error_event=shapes.failed)
    pieces, run = await api._run_whole(job, request, t0, True)
    shapes.add(pieces)
    usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=run.completion_tokens,
                  total_tokens=len(prompt_ids) + run.completion_tokens)
    status = "completed" if run.finish_reason == "stop" else "incomplete"
    return JSONResponse(shapes.response(status, run.finish_reason, usage))
