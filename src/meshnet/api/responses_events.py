"""A Responses API answer's shapes: the ``response`` object and, streamed, its events (``/v1/responses``).

An answer's output items are a ``message`` of one ``output_text`` part when it has text, then a
``function_call`` item per tool call. Streamed, text goes out as ``response.output_text.delta`` events
until it could become a call (the chat stream's rule: :class:`~meshnet.api.tool_stream.ToolAnswer`), the
message item opened with its first text; the calls come at the end, each as ``response.output_item.added``,
its arguments in one ``response.function_call_arguments.delta`` and ``.done``, and
``response.output_item.done``, as OpenAI streams them. Every event carries its ``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from meshnet.api.errors import ApiError
from meshnet.api.logprobs import chat_logprobs
from meshnet.api.runner import Piece
from meshnet.api.schemas import Usage
from meshnet.api.sse import HeldAnswer, event
from meshnet.api.tool_stream import ToolAnswer, whole_answer
from meshnet.api.tools import ToolPlan


def response_status(finish_reason: str) -> str:
    """A response's status for its answer's finish reason: cut by ``max_output_tokens``, incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


class ResponseShapes:
    """The response object and its stream's events, for one answer of ``req`` (a ResponsesRequest) under
    ``plan``; ``tok``: the tokenizer when the text's log-probs are asked for."""

    def __init__(self, req: Any, model: str, plan: ToolPlan, tok=None) -> None:
        self.req, self.model, self.plan, self.tok = req, model, plan, tok
        self.id, self.msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created, self.seq, self.text = int(time.time()), 0, ""
        self.logprobs: list[dict] = []
        self.calls: list[dict] = []  # function_call items
        self.opened = False  # whether the stream has opened the message item
        self.finish_reason = "stop"  # the streamed answer's, once its last piece came
        self._answer = ToolAnswer(plan) if plan.mode != "none" else None
        self._held: list[dict] = []  # log-prob entries of text held back
        self.quiet = HeldAnswer()  # an answer held while it could become a call: clients' read timeouts

    # ---- the whole answer ----
    def take_whole(self, pieces: list[Piece], finish_reason: str) -> None:
        """The unstreamed answer: its text and calls (:func:`~meshnet.api.tool_stream.whole_answer`)."""
        content, calls = whole_answer(self.plan, "".join(p.text for p in pieces), finish_reason)
        self.text = content or ""
        self.logprobs = self._entries(pieces) if self.text else []
        self.calls = [self._call_item(c) for c in calls or ()]
        self.finish_reason = finish_reason

    def response(self, status: str, usage: Usage | None = None, error: ApiError | None = None) -> dict:
        req = self.req
        done = status != "in_progress"
        message = [self.message("completed" if status == "completed" else "incomplete")] \
            if self.text or not self.calls else []  # an empty answer is an empty message
        output = message + self.calls if done else []
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output,
                "error": None if error is None else {"code": error.code or error.type, "message": error.message},
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": 1.0 if req.temperature is None else req.temperature,  # the values in effect
                "top_p": 1.0 if req.top_p is None else req.top_p,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False, "background": False,
                "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
                "tools": req.tools or [], "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
                "truncation": req.truncation or "disabled", "top_logprobs": req.top_logprobs,
                "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
                "usage": None if usage is None else {
                    "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                    "total_tokens": usage.total_tokens, "input_tokens_details": {
                        "cached_tokens": usage.prompt_tokens_details.cached_tokens},
                    "output_tokens_details": {"reasoning_tokens": 0}}}

    def message(self, status: str) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [self.part()] if status != "in_progress" else []}

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}

    @staticmethod
    def _call_item(call: dict, status: str = "completed") -> dict:
        """A chat tool call (``{"id", "type", "function": {"name", "arguments"}}``) as a function_call item."""
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def _entries(self, pieces: list[Piece]) -> list[dict]:
        """The log-prob entries of ``pieces``' tokens (none unless asked for)."""
        return [] if self.tok is None else [e.model_dump() for e in chat_logprobs(self.tok, pieces).content]

    # ---- the stream ----
    def event(self, kind: str, **fields) -> str:
        """One event, named on an ``event:`` line as OpenAI's are, its ``type`` and ``sequence_number`` in it."""
        self.seq += 1
        return f"event: {kind}\n" + event({"type": kind, "sequence_number": self.seq - 1, **fields})

    def start(self, _i: int) -> list[str]:
        return self.quiet.sent([self.event("response.created", response=self.response("in_progress")),
                                self.event("response.in_progress", response=self.response("in_progress"))])

    def piece(self, _i: int, piece: Piece) -> list[str]:
        text, calls = piece.text, None
        if self._answer is not None:
            text = self._answer.feed(piece.text)
            if piece.finish_reason is not None:
                tail, calls = self._answer.finish(piece.finish_reason)
                text += tail
        entries = self._held + self._entries([piece])
        self._held = []
        out = []
        if text or (entries and self._answer is None):
            out += self._open()
            self.text += text
            self.logprobs += entries
            out.append(self.event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                  content_index=0, delta=text, logprobs=entries))
        else:
            self._held = entries  # with the text they come out as, if they do
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason
            if not calls:
                out += self._open()  # an empty answer is an empty message
            out += self._close() + self._emit_calls(calls or [])
        return self.quiet.sent(out)

    def end(self, usage: Usage) -> str:
        status = response_status(self.finish_reason)
        return self.event(f"response.{status}", response=self.response(status, usage))

    def failed(self, error: ApiError) -> str:
        """The event that ends a stream whose answer failed once it had started: ``response.failed``, the
        response's ``error`` saying why (chat's ``{"error": ...}`` event made the SDK raise mid-stream)."""
        return self.event("response.failed", response=self.response("failed", error=error))

    def _open(self) -> list[str]:
        if self.opened:
            return []
        self.opened = True
        return [self.event("response.output_item.added", output_index=0, item=self.message("in_progress")),
                self.event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close(self) -> list[str]:
        if not self.opened:
            return []
        status = response_status(self.finish_reason)
        where = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        return [self.event("response.output_text.done", text=self.text, logprobs=self.logprobs, **where),
                self.event("response.content_part.done", part=self.part(), **where),
                self.event("response.output_item.done", output_index=0, item=self.message(status))]

    def _emit_calls(self, calls: list[dict]) -> list[str]:
        out = []
        for call in calls:
            index = int(self.opened) + len(self.calls)
            item = self._call_item(call)
            self.calls.append(item)
            out += [self.event("response.output_item.added", output_index=index,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return out
