"""``POST /v1/responses``: OpenAI's Responses API for text, over the chat path's generation.

A request's ``instructions`` and ``input`` (a string, or messages whose ``content`` is a string or
``input_text`` / ``output_text`` parts) become a chat (``instructions`` as its system message) rendered with
the model's chat template; the answer is one ``message`` output item of one ``output_text`` part. Streamed, its
events are the Responses API's own (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), each with its ``sequence_number``. An answer cut by ``max_output_tokens`` is
``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens".

What it does not do is refused by name (400 ``unsupported_parameter``): tools, a ``previous_response_id`` or
``conversation`` (this server keeps no responses), ``background``, a ``text.format`` other than text, images and
files in the input.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field

from meshnet.api.errors import bad_request, model_not_found
from meshnet.api.prompts import chat_prompt
from meshnet.api.runner import GenJob, Piece
from meshnet.api.schemas import ChatCompletionRequest, ChatMessage, TextPart, Usage, _Strict
from meshnet.api.sse import event
from meshnet.api.streaming import stream_choices
from meshnet.api.tools import ToolPlan
from meshnet.api.validation import parse_body, sampling_params, token_budget

_ROLES = ("system", "developer", "user", "assistant")


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
    reasoning: Any = None  # accepted, ignored
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    stream_options: dict[str, Any] | None = None


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.tools:
        raise bad_request("tools are not supported on /v1/responses; use /v1/chat/completions", "tools",
                          "unsupported_parameter")
    if req.previous_response_id is not None or req.conversation is not None:
        param = "previous_response_id" if req.previous_response_id is not None else "conversation"
        raise bad_request("this server keeps no responses: send the whole conversation as input", param,
                          "unsupported_parameter")
    if req.background:
        raise bad_request("background responses are not supported", "background", "unsupported_parameter")
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object such as {\"type\": \"text\"}", "text.format",
                          "invalid_type")
    if fmt and fmt.get("type", "text") != "text":
        raise bad_request("only text.format {\"type\": \"text\"} is supported on /v1/responses; for JSON use "
                          "response_format on /v1/chat/completions", "text.format", "unsupported_parameter")


def _chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat the request asks for: ``instructions`` first, as the system message."""
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
    return ChatCompletionRequest(messages=messages, temperature=req.temperature, top_p=req.top_p)


class _Shapes:
    """The response object and its stream's events, for one answer."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id, self.msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created, self.seq, self.text = int(time.time()), 0, ""
        self.finish_reason = "stop"  # the streamed answer's, once its last piece came

    def response(self, status: str, finish_reason: str | None = None, usage: Usage | None = None) -> dict:
        done = status != "in_progress"
        output = [self.message("completed" if status == "completed" else "incomplete")] if done else []
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": 1.0 if req.temperature is None else req.temperature,  # the values in effect
                "top_p": 1.0 if req.top_p is None else req.top_p,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False, "background": False,
                "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
                "metadata": self.req.metadata or {},
                "usage": None if usage is None else {
                    "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                    "total_tokens": usage.total_tokens, "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": 0}}}

    def message(self, status: str) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": self.text, "annotations": []}] if status != "in_progress"
                else []}

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
                           part={"type": "output_text", "text": "", "annotations": []}, **where)]

    def piece(self, _i: int, piece: Piece) -> list[str]:
        out = []
        if piece.text:
            self.text += piece.text
            out.append(self.event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                  content_index=0, delta=piece.text, logprobs=[]))
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason
            status = "completed" if piece.finish_reason == "stop" else "incomplete"
            out += [self.event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                               text=self.text, logprobs=[]),
                    self.event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                               part={"type": "output_text", "text": self.text, "annotations": []}),
                    self.event("response.output_item.done", output_index=0, item=self.message(status))]
        return out

    def end(self, usage: Usage) -> str:
        status = "completed" if self.finish_reason == "stop" else "incomplete"
        return self.event(f"response.{status}", response=self.response(status, self.finish_reason, usage))


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
    chat = _chat(req)
    prompt_ids = await anyio.to_thread.run_sync(chat_prompt, api.backend.tokenizer, chat, ToolPlan("none"),
                                                api.backend.n_ctx)
    budget = token_budget(api.backend.n_ctx, prompt_ids, req.max_output_tokens, "input")
    job = GenJob(prompt_ids, budget, sampling_params(chat, api.backend.tokenizer.n_vocab, 0, 0, logprobs=False),
                 stop_at_control=True, speculation=api._speculation(chat))
    await api._check_route()
    shapes = _Shapes(req, api.backend.model_name)
    if req.stream:
        return await stream_choices(api._runs, [job], t0, len(prompt_ids), True, shapes.start, shapes.piece,
                                    shapes.end, request, done=None)
    pieces, run = await api._run_whole(job, request, t0, True)
    shapes.text = "".join(p.text for p in pieces)
    usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=run.completion_tokens,
                  total_tokens=len(prompt_ids) + run.completion_tokens)
    status = "completed" if run.finish_reason == "stop" else "incomplete"
    return JSONResponse(shapes.response(status, run.finish_reason, usage))
