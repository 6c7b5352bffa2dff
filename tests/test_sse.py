"""Streamed chunks: the per-token fast path gives exactly the bytes the pydantic schemas give."""

from __future__ import annotations

import json

import pytest

from meshnet.api.schemas import ChatDelta
from meshnet.api.sse import ChatChunks, CompletionChunks

TEXTS = ["", "Hello", ' "quoted" \\ back', "line\nbreak\ttab", "héllo wörld ✓ 🙂", "\x00\x1f", "</script>"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 3])
def test_chat_text_chunk_equals_the_schema_chunk(text, index):
    chunks = ChatChunks("chatcmpl-1", 1700000000, 'model "x"')
    fast = chunks.content(index, text)
    assert fast == chunks._chunk(index, ChatDelta(content=text))
    body = json.loads(fast.removeprefix("data: ").removesuffix("\n\n"))
    assert body["choices"] == [{"index": index, "delta": {"content": text}, "logprobs": None,
                                "finish_reason": None}]
    assert (body["id"], body["object"], body["model"]) == ("chatcmpl-1", "chat.completion.chunk", 'model "x"')


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_chunk_equals_the_schema_chunk(text):
    chunks = CompletionChunks("cmpl-1", 1700000000, "smollm2")
    assert chunks.text(1, text) == chunks._chunk(1, text, None, None)
    assert json.loads(chunks.text(1, text)[6:])["choices"][0]["text"] == text
    # the finish goes through the schemas
    assert json.loads(chunks.text(0, text, finish_reason="stop")[6:])["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("client,named", [(("10.0.0.7", 5000), "10.0.0.7:5000"),
                                          (("::1", 5000), "[::1]:5000")])  # it said ::1:5000
def test_a_client_that_takes_nothing_is_let_go_after_the_stall_deadline(monkeypatch, caplog, client, named):
    """A streaming client that read nothing held its generation slot and KV cells for as long as it kept
    the connection: the server's send waits while the client's socket is full, and nothing bounded it."""
    import asyncio
    import time

    from meshnet.api import sse as sse_module

    monkeypatch.setattr(sse_module, "STALL_S", 0.3)
    sent, ended, closed = [], [], []

    async def events():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            ended.append(True)  # the generation's cleanup: its session released

    async def on_close():
        closed.append(True)

    async def send(message):
        if len(sent) >= 3:  # the client's socket is full from here on
            await asyncio.Event().wait()
        sent.append(message)

    async def receive():
        await asyncio.Event().wait()  # no disconnect: the client keeps the connection

    async def run() -> float:
        started = time.monotonic()
        await sse_module.sse(events(), on_close=on_close)(
            {"type": "http", "asgi": {"spec_version": "2.3"}, "client": client}, receive, send)
        return time.monotonic() - started

    with caplog.at_level("WARNING", logger="meshnet.api"):
        elapsed = asyncio.run(run())
    assert 0.3 <= elapsed < 2
    assert [m.get("body") for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n"]  # after the response start
    assert ended == [True] and closed == [True]
    assert [r.getMessage() for r in caplog.records] == [
        f"the client at {named} took nothing of its stream for 0.3 s: the stream ends and its generation is "
        "stopped"]
