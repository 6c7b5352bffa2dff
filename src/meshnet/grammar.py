"""Constrained decoding: a JSON schema turned into a token mask with llguidance (the grammar library
llama.cpp and vLLM use), over the tokens of the model's own GGUF vocabulary.

:class:`GrammarCompiler` holds llguidance's view of one vocabulary (built from
:class:`~meshnet.tokenizer.GGUFTokenizer`'s token bytes, nothing downloaded) and compiles schemas, refusing
one the library cannot enforce with :class:`GrammarError` naming why. :class:`SessionGrammar` is one
session's matcher on the tail: it follows the session's tokens (consuming new ones, rolling back ones a
rollback step cut, rebuilding from a replay) and gives the mask of the tokens allowed next.

The JSON the grammar admits is laid out one way: ``", "`` between items, ``": "`` after keys and no other
whitespace between tokens (llguidance's ``whitespace_flexible: false``, fixed here whatever the schema's
``x-guidance`` says). A model free to add whitespace can add it forever; with this layout a schema whose
strings, numbers and arrays are bounded has a bounded document, so generation ends.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from meshnet.sampling_params import Grammar
from meshnet.tokenizer import GGUFTokenizer

__all__ = ["GrammarCompiler", "GrammarError", "SessionGrammar", "schema_text"]

_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Compiled schemas kept per vocabulary (a tool schema comes back with every request of a client).
_CACHED = 64
# Tokens a new schema's matcher is walked before the schema is accepted (see GrammarCompiler.compile).
PROBE_TOKENS = 8
# llguidance marks a special (control) token by this byte before its text, as its llama.cpp binding does.
_SPECIAL = b"\xff"


class GrammarError(ValueError):
    """A schema llguidance refuses (its message says what is wrong), or tokens a grammar does not allow."""


def schema_text(schema: object) -> str:
    """A JSON schema (a decoded JSON value) as the compact JSON text :class:`Grammar` carries.

    Raises:
        GrammarError: ``schema`` is not a JSON object (a dict).
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class _Vocabulary:
    """The tokenizer interface llguidance's ``TokenizerWrapper`` reads: each token's bytes (control tokens
    marked special), BOS/EOS, and text -> ids for the strings it must tokenize itself."""

    def __init__(self, tok: GGUFTokenizer) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_control(i)]
        special = set(self.special_token_ids)
        self.tokens = [_SPECIAL + tok.token_bytes(i, special=True) if i in special
                       else tok.token_bytes(i, special=True) for i in range(tok.n_vocab)]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # the wrapper probes with bytes; we tokenize text only
            raise TypeError("text only")
        return self._tok.encode(text, add_bos=False)


def first_line(error: str) -> str:
    """llguidance's error without the parser state it dumps after the first line."""
    return error.strip().split("\n", 1)[0]


class GrammarCompiler:
    """Schemas compiled for one model's vocabulary; thread-safe.

    Args:
        tokenizer: the model's tokenizer (its vocabulary's bytes and end-of-generation ids).
        n_vocab: the width of the model's logits (may exceed ``tokenizer.n_vocab``; the extra ids are
            never allowed).
    """

    def __init__(self, tokenizer: GGUFTokenizer, n_vocab: int) -> None:
        self.n_vocab = max(n_vocab, tokenizer.n_vocab)
        self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)),
                                          n_vocab=self.n_vocab, eos_token=sorted(tokenizer.eog_ids))
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, json_schema: str) -> str:
        """llguidance's grammar for ``json_schema`` (JSON text), checked against the vocabulary.

        Raises:
            GrammarError: not JSON, not an object, or a schema llguidance refuses (an unknown type, an
                unsupported keyword such as ``not``, a ``$ref`` to nothing, a grammar over its size
                limits); the message is the library's, prefixed with what failed.
        """
        with self._lock:
            if json_schema in self._compiled:
                self._compiled.move_to_end(json_schema)
                return self._compiled[json_schema]
        try:
            schema = json.loads(json_schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        schema_text(schema)  # an object, or GrammarError
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_LAYOUT)
        except ValueError as e:
            raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._ll)
        if problem:
            raise GrammarError(f"the JSON schema cannot be enforced: {problem}")
        # A schema can compile yet admit no document (two $defs that only refer to each other): its
        # matcher fails on the first mask, and every answer would be the empty text.
        matcher = llguidance.LLMatcher(self._ll, grammar, log_level=0)
        bits = allocate_token_bitmask(1, self.n_vocab)
        fill_next_token_bitmask(matcher, bits)
        if matcher.is_error():
            raise GrammarError("the JSON schema admits no document (no first token is allowed)")
        # A schema can also break the parser a few tokens in (an object that requires itself: {"type":
        # "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]} exceeds llguidance's item limit
        # on its second token): walk a few tokens, each the lowest id allowed, and refuse it here rather
        # than mid-answer.
        for _ in range(PROBE_TOKENS):
            allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.n_vocab])
            if not allowed.size or matcher.is_accepting() or not matcher.consume_token(int(allowed[0])):
                break
            fill_next_token_bitmask(matcher, bits)
        if matcher.is_error():
            error = first_line(matcher.get_error())
            if "Too many items" in error:  # the library's words say nothing of the schema's
                error += ("; a schema whose required properties lead back to their own object (a \"$ref\" to "
                          "\"#\" or to a $defs entry holding it) admits no finite document")
            raise GrammarError(f"the JSON schema cannot be enforced: {error}")
        with self._lock:
            self._compiled[json_schema] = grammar
            while len(self._compiled) > _CACHED:
                self._compiled.popitem(last=False)
        return grammar

    def session(self, grammar: Grammar) -> "SessionGrammar":
        """A fresh matcher for ``grammar``, standing before its first token. Raises GrammarError."""
        problem = grammar.validate()
        if problem is not None:
            raise GrammarError(problem)
        matcher = llguidance.LLMatcher(self._ll, self.compile(grammar.json_schema), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be enforced: {matcher.get_error()}")
        return SessionGrammar(grammar, matcher, self.n_vocab)


class SessionGrammar:
    """One session's grammar state on the tail: the matcher and the constrained tokens it has consumed.

    Not thread-safe; a session's steps run one at a time. ``grammar.start`` is the session position of
    the first constrained token.
    """

    def __init__(self, grammar: Grammar, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self.grammar = grammar
        self._m = matcher
        self._n_vocab = n_vocab
        self._consumed: list[int] = []
        self._bits = allocate_token_bitmask(1, n_vocab)  # int32 [1, ceil(n_vocab / 32)]

    def follow(self, history: Sequence[int]) -> int:
        """Stand after the constrained tokens of ``history`` (the session's ids, prompt first), or after
        their longest prefix the grammar allows: what was consumed beyond the shared prefix is rolled
        back, the rest consumed (a replay onto a fresh matcher consumes them all).

        Returns:
            How many of ``history[start:]`` the grammar allows in a row (``len(history) - start`` when all).
        Raises:
            GrammarError: ``history`` is shorter than ``grammar.start`` (its prompt is not all there).
        """
        start = self.grammar.start
        if len(history) < start:
            raise GrammarError(f"the grammar starts at position {start} but the session has "
                               f"{len(history)} tokens")
        want = [int(t) for t in history[start:]]
        done = self._consumed
        common = 0
        for a, b in zip(done, want):
            if a != b:
                break
            common += 1
        if common < len(done):
            if not self._m.rollback(len(done) - common):  # beyond what it keeps: start over
                self._m.reset()
                common = 0
            del done[common:]
        rest = want[common:]
        n = self._m.validate_tokens(rest) if rest else 0
        if n and not self._m.consume_tokens(rest[:n]):
            raise GrammarError(f"the grammar matcher failed: {first_line(self._m.get_error())}")
        done += rest[:n]
        return common + n

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next: bool ``[n_vocab]``; once the document is complete, only the
        end-of-generation tokens."""
        fill_next_token_bitmask(self._m, self._bits)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self._n_vocab].astype(bool)

    @property
    def complete(self) -> bool:
        """Whether the consumed tokens form a whole document the grammar accepts."""
        return self._m.is_accepting()
