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
