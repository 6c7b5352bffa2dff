"""Server-sent events of a streamed answer: the chunks OpenAI's streaming API sends, one per piece of text.

A stream sends one chunk per token, so the encoding is on the serving path: a chunk of text without
log-probs (nearly all of them) is the stream's fixed JSON around the text's own JSON string, and only
that string is encoded per token. Every other chunk (the role, the finish, log-probs, usage) goes
through the pydantic schemas; the fixed parts are cut from such a chunk too, so both kinds of chunk
are byte for byte what the schemas give.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

from fastapi.responses import Response, StreamingResponse

from meshnet.api.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from meshnet.wire.addresses import format_address

DONE = "data: [DONE]\n\n"
# A comment line, which SSE readers skip: sent while an answer is held back (a tool call), or while a
# stream waits for its next piece (a failover's replay, a later choice's turn), so that a client's or a
# proxy's read timeout (httpx: 5 s, nginx: 60 s) does not end a stream that is working; after this many
# seconds without an event.
KEEPALIVE = ": keep-alive\n\n"
KEEPALIVE_S = 2.0


class HeldAnswer:
    """The keep-alive rule of a stream whose answer may be held back (text that could still turn out to
    be a tool call, sent as nothing until it is known): a comment in place of the events of a piece
    once ``KEEPALIVE_S`` passed since the last event sent. Chat's and the Responses API's events share it."""

    def __init__(self) -> None:
        self._sent_at = time.monotonic()

    def sent(self, events: list[str]) -> list[str]:
        """``events`` (sent now), or when there are none and the stream has been quiet for ``KEEPALIVE_S``
        seconds, a keep-alive comment."""
        now = time.monotonic()
        if events or now - self._sent_at >= KEEPALIVE_S:
            self._sent_at = now
            return events or [KEEPALIVE]
        return []


# How long a stream waits for its client to take what it was sent, seconds. A client that read nothing
# (its socket's buffers full) held its generation slot and KV cells for as long as it kept the connection;
# two such clients of a server with two slots turned everyone else away.
STALL_S = 60.0

log = logging.getLogger("meshnet.api")

# A text whose JSON string occurs nowhere else in a chunk: where the fixed parts are cut.
_MARK = "\x00meshnet-text\x00"


def event(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as compact JSON (non-ASCII kept as is, as OpenAI sends)."""
    return f"data: {_dumps(obj)}\n\n"


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _TextTemplate:
    """The event of a text-only chunk as (prefix, suffix) around the text's JSON string, per choice
    index, cut from the event the schemas give for a marker text."""

    def __init__(self, render) -> None:
        self._render = render  # (index, text) -> the event the schemas give
        self._parts: dict[int, tuple[str, str]] = {}

    def __call__(self, index: int, text: str) -> str:
        parts = self._parts.get(index)
        if parts is None:
            prefix, _, suffix = self._render(index, _MARK).partition(_dumps(_MARK))
            parts = self._parts[index] = (prefix, suffix)
        return parts[0] + _dumps(text) + parts[1]


class ChatChunks:
    """The events of one streamed ``/v1/chat/completions`` answer (``chat.completion.chunk`` objects).

    Args:
        rid: the completion id (``chatcmpl-...``); created: Unix seconds; model: the served model id.
    """

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.rid, self.created, self.model = rid, created, model
        self._text = _TextTemplate(lambda i, text: self._chunk(i, ChatDelta(content=text)))

    def _chunk(self, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None = None,
               finish_reason: str | None = None) -> str:
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[
            ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)])
        d = c.model_dump(exclude={"usage"})
        # OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}, then {}.
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return event(d)

    def role(self, index: int, content: str | None = "") -> str:
        """The first chunk of choice ``index``: ``{"role": "assistant", "content": ""}``; without content
        (None) for an answer that is a tool call, whose message has none."""
        return self._chunk(index, ChatDelta(role="assistant", content=content))

    def content(self, index: int, text: str, logprobs: ChatLogprobs | None = None) -> str:
        """A chunk of text of choice ``index``, with the log-probs of its tokens when asked for."""
        if logprobs is None:
            return self._text(index, text)
        return self._chunk(index, ChatDelta(content=text), logprobs)

    def tool_calls(self, index: int, calls: list[dict], logprobs: ChatLogprobs | None = None) -> str:
        """Choice ``index``'s tool calls (``{"id", "type", "function": {"name", "arguments"}}``), each whole in one
        delta with its ``index`` among them, as OpenAI's streamed calls join up."""
        return self._chunk(index, ChatDelta(tool_calls=[{"index": k, **c} for k, c in enumerate(calls)]), logprobs)

    def finish(self, index: int, reason: str) -> str:
        """The last chunk of choice ``index``: an empty delta and its ``finish_reason``."""
        return self._chunk(index, ChatDelta(), None, reason)

    def usage(self, usage: Usage) -> str:
        """The chunk with no choices and the request's token counts (``stream_options.include_usage``)."""
        return event(ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[],
                                         usage=usage).model_dump())


class CompletionChunks:
    """The events of one streamed ``/v1/completions`` answer (``text_completion`` objects)."""

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.rid, self.created, self.model = rid, created, model
        self._text = _TextTemplate(lambda i, text: self._chunk(i, text, None, None))

    def _chunk(self, index: int, text: str, logprobs: CompletionLogprobs | None,
               finish_reason: str | None) -> str:
        c = CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[
            CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)])
        return event(c.model_dump(exclude={"usage"}))

    def text(self, index: int, text: str, logprobs: CompletionLogprobs | None = None,
             finish_reason: str | None = None) -> str:
        """A chunk of text of choice ``index`` (its log-probs when asked for; the finish with the last)."""
        if logprobs is None and finish_reason is None:
            return self._text(index, text)
        return self._chunk(index, text, logprobs, finish_reason)

    def usage(self, usage: Usage) -> str:
        return event(CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[],
                                        usage=usage).model_dump())


class _Stalled(Exception):
    """The client took nothing for :data:`STALL_S` seconds."""


class SSEResponse(StreamingResponse):
    """A server-sent-event stream whose body iterator is always closed when the response ends, so a
    client that goes away (however the server notices) releases its session promptly; ``on_close`` then
    runs too (a generator that never started runs none of its own cleanup). A client that takes nothing
    for :data:`STALL_S` seconds is let go the same way, and its connection closed."""

    on_close: Callable[[], Awaitable[None]] | None = None

    async def stream_response(self, send) -> None:
        async def send_in_time(message) -> None:
            # The server's send waits only while the client's socket is full (uvicorn's flow control).
            try:
                async with asyncio.timeout(STALL_S):
                    await send(message)
            except TimeoutError:
                raise _Stalled() from None

        try:
            await super().stream_response(send_in_time)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except _Stalled:  # the server closes a connection whose response is left incomplete
            client = scope.get("client") or ("?", 0)
            log.warning("the client at %s took nothing of its stream for %g s: the stream ends and its "
                        "generation is stopped", format_address(client[0], client[1]), STALL_S)
        finally:  # here, not in stream_response: a client gone at once cancels that before it runs
            if self.on_close is not None:
                await self.on_close()


def sse(gen: AsyncIterator[str], on_close: Callable[[], Awaitable[None]] | None = None) -> Response:
    """The HTTP response streaming ``gen``'s events (``text/event-stream``, never cached or buffered);
    ``on_close`` runs when it ends, however it ends."""
    r = SSEResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    r.on_close = on_close
    return r
