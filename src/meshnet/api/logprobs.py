"""Log-probabilities in OpenAI's two shapes: the completions endpoint's parallel lists and the chat
endpoint's per-token entries (token text, logprob, UTF-8 bytes, alternatives)."""

from __future__ import annotations

from meshnet.api.runner import Piece
from meshnet.api.schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def completion_logprobs(tok, pieces: list[Piece]) -> CompletionLogprobs:
    """``tokens``, ``token_logprobs``, ``top_logprobs`` (text -> logprob) and ``text_offset`` (characters
    into the answer) of the tokens in ``pieces``; ``tok``: the served model's tokenizer."""
    lp = CompletionLogprobs()
    for piece in pieces:
        for t, offset in piece.tokens:
            lp.tokens.append(_token_str(tok, t.token_id))
            lp.token_logprobs.append(t.logprob)
            top: dict[str, float] = {}
            for alt in t.top:
                top.setdefault(_token_str(tok, alt.token_id), alt.logprob)
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
    return lp


def chat_logprobs(tok, pieces: list[Piece]) -> ChatLogprobs:
    """One entry per token in ``pieces`` (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
    content = []
    for piece in pieces:
        for t, _ in piece.tokens:
            content.append(ChatTokenLogprob(
                **_top_entry(tok, t.token_id, t.logprob),
                top_logprobs=[TopLogprob(**_top_entry(tok, a.token_id, a.logprob)) for a in t.top]))
    return ChatLogprobs(content=content)


def _token_str(tok, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def _top_entry(tok, token_id: int, logprob: float) -> dict:
    raw = tok.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
