"""Drafts from a small model: a GGUF with the target's vocabulary, run by the client in its own process.

llama.cpp's speculative decoding with a draft model (``common/speculative.cpp``,
``llama-server --model-draft``): the draft model decodes ``k`` tokens greedily after the session's
tokens, the mesh verifies them in one step (:mod:`meshnet.speculative`). The draft model keeps a KV
cache per session that follows the session's kept tokens: before drafting, the rows after the longest
prefix it shares with the session's tokens are dropped (a rollback step) and the new tokens fed.
Drafts never change greedy output (the tail decides); they change only how many tokens a round yields.
"""

from __future__ import annotations

import threading
import uuid
from typing import Sequence

from meshnet.contract import GREEDY, LayerRange, StepRequest


class ModelDrafter:
    """A draft model for every session of this client: all its layers in this process.

    Args:
        path: the draft GGUF (a bundled name or a path).
        target_path: the target model's GGUF, whose vocabulary the draft's must equal token for token.
        n_threads: CPU threads of the draft model.
        n_ctx: its context, tokens per session (at least the target's).
    Raises:
        ValueError: the draft's vocabulary differs from the target's (the message names the first
            difference), or the draft GGUF cannot be loaded.
    """

    def __init__(self, path: str, target_path: str, n_threads: int = 1, n_ctx: int = 0) -> None:
        from meshnet.local_mesh import load_local_chain, plan_ranges
        from meshnet.model.bundled import resolve_model
        from meshnet.tokenizer import GGUFTokenizer

        self.path = str(resolve_model(path))
        check_same_vocabulary(GGUFTokenizer.from_gguf(self.path), GGUFTokenizer.from_gguf(str(target_path)),
                              self.path, str(target_path))
        ranges = plan_ranges(self.path, 1, None)
        self.chain = load_local_chain(self.path, [LayerRange(ranges[0].start, ranges[-1].end)], n_threads=n_threads,
                                      n_ctx=n_ctx, progress=False)
        self._held: dict[str, tuple[str, list[int]]] = {}  # session -> (draft session id, tokens in its KV)
        self._lock = threading.Lock()

    def draft(self, session_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` greedy draft tokens continuing ``tokens`` (the session's prompt and kept tokens).
        Returns fewer (none) when the draft model refuses a step (its context is full, say)."""
        if k < 1 or not tokens:
            return []
        with self._lock:
            draft_id, held = self._held.get(session_id, (uuid.uuid4().hex, []))
        common = 0
        for a, b in zip(held, tokens[:-1]):  # at least the last token is fed: its row gives the first draft
            if a != b:
                break
            common += 1
        feed = list(tokens[common:])
        res = self.chain.step(StepRequest(draft_id, 0, common, tuple(feed), sampling=GREEDY,
                                          rollback=common < len(held)), decode=len(feed) == 1 and bool(held))
        out: list[int] = []
        kept = list(tokens[:common]) if res.ok else []
        while res.ok and res.token is not None:
            kept = list(tokens) + out
            out.append(res.token.token_id)
            if len(out) == k:
                break
            res = self.chain.step(StepRequest(draft_id, 0, len(kept), (out[-1],), sampling=GREEDY), decode=True)
        with self._lock:
            self._held[session_id] = (draft_id, kept if out else [])
        if not out:
            self.chain.release(draft_id)
        return out

    def end(self, session_id: str) -> None:
        """The session is over: free its draft KV cache."""
        with self._lock:
            entry = self._held.pop(session_id, None)
        if entry is not None:
            self.chain.release(entry[0])

    def close(self) -> None:
        for sid in list(self._held):
            self.end(sid)
        for stage in self.chain.stages:
            close = getattr(stage, "close", None)
            if close is not None:
                close()


def check_same_vocabulary(draft, target, draft_name: str, target_name: str) -> None:
    """Refuse a draft model whose tokenizer (a :class:`~meshnet.tokenizer.GGUFTokenizer`) maps any id
    to other text than the target's: its drafts would be other tokens. Raises ValueError."""
    if draft.n_vocab != target.n_vocab:
        raise ValueError(f"draft model {draft_name} has {draft.n_vocab} tokens, the target {target_name} "
                         f"{target.n_vocab}: a draft model needs the target's vocabulary")
    for i in range(target.n_vocab):
        if draft.token_text(i) != target.token_text(i):
            raise ValueError(f"draft model {draft_name} and the target {target_name} differ at token {i} "
                             f"({draft.token_text(i)!r} against {target.token_text(i)!r}): a draft model "
                             "needs the target's vocabulary")
