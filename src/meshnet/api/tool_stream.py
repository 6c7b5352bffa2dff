"""A chat answer with tools, told apart as it streams: the text released as content at once, and what may
still become tool calls held back until the answer ends (:class:`ToolAnswer`).

OpenAI streams a call as ``delta.tool_calls`` chunks; which text is a call is only known at its end (a
``<tool_call>`` block must close, a bare ``{"name", "arguments"}`` object must parse and name a tool). So:

* a required or named call (the grammar makes the whole answer one) is held whole, and never becomes
  content: cut by ``max_tokens``, its broken call is dropped;
* under ``"auto"``, text goes out as content until it could start a call: an answer whose first
  non-blank character is ``{`` is held whole (a bare call is the whole answer), and from a
  ``<tool_call>`` on the rest is held (a suffix that could still grow into one waits for the next token).

At the end the held text is read as :func:`~meshnet.api.tools.tool_calls_from` reads a whole answer: calls,
or content after all. The answer without streaming goes through the same object, so both tell the same
text apart the same way.
"""

from __future__ import annotations

from typing import Callable

from meshnet.api.runner import Piece
from meshnet.api.schemas import ChatLogprobs
from meshnet.api.sse import ChatChunks, HeldAnswer
from meshnet.api.tools import ToolPlan, tool_calls_from

_BLOCK = "<tool_call>"


class ToolAnswer:
    """One choice's answer under ``plan`` (whose mode is not ``"none"``), fed its text as it comes."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.content = ""  # released so far
        self._held = ""
        self._whole = plan.forced  # hold everything from here to the end

    def feed(self, text: str) -> str:
        """Take the answer's next ``text``; returns what may go out as content now ("" while held)."""
        self._held += text
        if self._whole:
            return ""
        if not self.content:
            lead = self._held.lstrip()
            if not lead:
                return ""  # blank so far: what follows decides
            if lead.startswith("{"):
                self._whole = True  # a bare call is the whole answer
                return ""
        at = self._held.find(_BLOCK)
        if at >= 0:
            self._whole = True
            if not self.content and not self._held[:at].strip():
                return ""  # blank before a first block: held with it (no content if it is a call)
            out, self._held = self._held[:at], self._held[at:]
        else:
            keep = next((k for k in range(min(len(_BLOCK) - 1, len(self._held)), 0, -1)
                         if _BLOCK.startswith(self._held[-k:])), 0)
            if not self.content and not self._held[:len(self._held) - keep].strip():
                return ""  # blank before what may start a block: as blank alone, what follows decides
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        self.content += out
        return out

    def finish(self, reason: str) -> tuple[str, list[dict] | None]:
        """The answer ended with ``reason``: ``(content still to release, tool calls or None)``. Held
        text is read as calls when the answer ended by itself ("stop"); under ``"auto"`` one cut by
        ``max_tokens`` is content, as OpenAI returns a cut answer. A required or named answer is calls
        whatever way it ended (the grammar made it so): cut, it keeps its whole calls (see
        :func:`finish_reason`) and drops the one the cut broke, which is no content (its text is the call's
        JSON, for a required answer inside this server's array of calls) and no call either (its broken
        arguments, sent back with the next turn's messages, would make that request a 400)."""
        held, self._held = self._held, ""
        if self.plan.forced and reason != "stop":
            return "", tool_calls_from(held, self.plan) if held.strip() else None
        calls = tool_calls_from(held, self.plan) if held.strip() and reason == "stop" else None
        if calls:
            return "", calls
        self.content += held
        return held, None


def finish_reason(reason: str, calls: list[dict] | None) -> str:
    """What an answer that ended with ``reason`` and was read as ``calls`` reports: "tool_calls", or, for the
    whole calls of an answer ``max_tokens`` cut, "length" (OpenAI's reason for a cut answer)."""
    return "tool_calls" if calls and reason == "stop" else reason


def whole_answer(plan: ToolPlan, text: str, reason: str) -> tuple[str | None, list[dict] | None]:
    """``(content, tool calls)`` of a whole answer ``text`` that ended with ``reason``, told apart as its
    stream would be: content None beside calls when the answer was calls alone."""
    if plan.mode == "none":
        return text, None
    answer = ToolAnswer(plan)
    answer.feed(text)
    _, calls = answer.finish(reason)
    # A required or named answer is calls: no content beside them, nor in place of one a cut dropped.
    return (answer.content or None) if calls or plan.forced else answer.content, calls


class ChatEvents:
    """The server-sent events of a streamed chat answer's pieces, choice by choice: text as content chunks;
    with tools (``plan``'s mode not ``"none"``), text held by a :class:`ToolAnswer` goes out when it turns
    out to be content, or as one ``tool_calls`` chunk at the end (finish reason "tool_calls").
    ``logprobs_of``: the ``logprobs`` of some pieces' tokens, or None when the request asked for none; a
    held piece's go out with the chunk its text ends up in."""

    def __init__(self, chunks: ChatChunks, plan: ToolPlan, n_choices: int,
                 logprobs_of: Callable[[list[Piece]], ChatLogprobs] | None) -> None:
        self.chunks, self.logprobs_of, self.plan = chunks, logprobs_of, plan
        self.answers = [ToolAnswer(plan) if plan.mode != "none" else None for _ in range(n_choices)]
        self.unsent: list[list[Piece]] = [[] for _ in range(n_choices)]
        self.held = HeldAnswer()

    def start(self, i: int) -> list[str]:
        """The first event of choice ``i``: its role (no content for a required or named call)."""
        return self.held.sent([self.chunks.role(i, None if self.plan.forced else "")])

    def piece(self, i: int, piece: Piece) -> list[str]:
        """The events for choice ``i``'s next piece (none while it is held)."""
        answer, text, calls = self.answers[i], piece.text, None
        if answer is not None:
            text = answer.feed(piece.text)
            if piece.finish_reason is not None:
                tail, calls = answer.finish(piece.finish_reason)
                text += tail
            if not text and not calls and piece.finish_reason is None:
                self.unsent[i].append(piece)  # held: its log-probs go with what its text becomes
                return self.held.sent([])
        pieces, self.unsent[i] = self.unsent[i] + [piece], []
        logprobs = self.logprobs_of(pieces) if self.logprobs_of is not None and any(p.tokens for p in pieces) \
            else None
        events = []
        if text or (logprobs is not None and not calls) or (answer is None and piece.tokens):
            events.append(self.chunks.content(i, text, logprobs))
            logprobs = None  # sent
        if calls:  # after the text that came before them in this piece, if any
            events.append(self.chunks.tool_calls(i, calls, logprobs))
        if piece.finish_reason is not None:
            events.append(self.chunks.finish(i, finish_reason(piece.finish_reason, calls)))
        return self.held.sent(events)
