"""Tokenizer built from a GGUF file's own vocabulary, reproducing llama.cpp's token ids.

Two GGUF tokenizer families are supported:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokenizer.ggml.tokens`` and
  ``tokenizer.ggml.merges``, with the pre-tokenizer regexes llama.cpp uses for the file's
  ``tokenizer.ggml.pre`` (SmolLM2 and the tiny golden models use ``smollm``).
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE driven by ``tokenizer.ggml.scores``
  (Llama 2, Gemma).  llama.cpp merges, at every step, the adjacent pair whose concatenation is the
  highest-scoring vocabulary piece.  That is ordinary rank-based BPE once every split ``(l, r)`` of
  every piece ``l + r`` becomes a merge ranked by the piece's score, which is how the merges are
  derived here (the same construction as transformers' GGUF converter).

The BPE itself always runs in the Hugging Face ``tokenizers`` library.  What happens around it
follows llama.cpp (``src/llama-vocab.cpp``): control and user-defined tokens are split out of the
text first (``tokenizer_st_partition``), a space prefix is added per fragment for SPM vocabularies,
BOS/EOS are added from the GGUF flags, and detokenization concatenates per-token pieces exactly like
``llama_token_to_piece`` (control tokens render as nothing unless asked for).

The pieces: :mod:`meshnet.tokenizer_bpe` (gpt2 pre-tokenizers and byte-level BPE),
:mod:`meshnet.tokenizer_spm` (SPM merges from scores), :mod:`meshnet.tokenizer_specials` (control,
end-of-generation and special-token partitioning), :mod:`meshnet.tokenizer_vocab` (reads the GGUF
vocabulary and builds them); this module encodes and decodes with them.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence


from meshnet.model.gguf_file import open_gguf
from meshnet.tokenizer_bpe import SUPPORTED_PRE_TOKENIZERS
from meshnet.tokenizer_stream import StreamDecoder
from meshnet.tokenizer_vocab import SUPPORTED_TOKENIZER_MODELS, GGUFMetadata, read_vocabulary

__all__ = ["GGUFTokenizer", "StreamDecoder", "SUPPORTED_TOKENIZER_MODELS", "SUPPORTED_PRE_TOKENIZERS"]


class GGUFTokenizer:
    """Tokenizer for a GGUF model, matching llama.cpp's ``llama_tokenize`` / ``llama_token_to_piece``.

    Build one with :meth:`from_gguf`.  Instances are immutable and safe to share between threads.

    Attributes:
        n_vocab: number of tokens in ``tokenizer.ggml.tokens``.
        bos_id, eos_id: BOS / EOS ids, or ``None`` when the GGUF has none.
        add_bos: whether :meth:`encode` prepends BOS by default (``tokenizer.ggml.add_bos_token``,
            falling back to llama.cpp's per-tokenizer default).
        add_eos: whether :meth:`encode` appends EOS by default.
        add_space_prefix: SPM only: a space is prepended to each text fragment that starts the
            input or follows a special token.
        chat_template: the ``tokenizer.chat_template`` Jinja source, or ``None``.
        eog_ids: every id that ends generation (EOS, EOT, EOM and the turn-end / FIM control tokens
            llama.cpp recognises by text).
        model, pre: ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre``.
    """

    def __init__(self) -> None:  # pragma: no cover - guidance only
        raise TypeError("use GGUFTokenizer.from_gguf(path)")

    # ---- construction ----

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> "GGUFTokenizer":
        """Load the tokenizer stored in a GGUF file's metadata.

        Args:
            path: path of a ``.gguf`` file.

        Returns:
            A ready tokenizer.  Loading takes about 0.3 s for a 49k vocabulary and a few seconds
            for Gemma's 262k (the SPM merge table is derived from the scores at load time).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: not a GGUF file, the tokenizer model or pre-tokenizer is unsupported (the
                message lists the supported ones), or the tokenizer metadata is missing/malformed.
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        meta = GGUFMetadata(open_gguf(path))
        self = object.__new__(cls)
        self._load(meta)
        return self

    def _load(self, meta: GGUFMetadata) -> None:
        self._v = read_vocabulary(meta)  # the one record of what the file's vocabulary holds; read, not copied

    # The attributes above, as the vocabulary holds them.
    model = property(lambda self: self._v.model)
    pre = property(lambda self: self._v.pre)
    n_vocab = property(lambda self: self._v.n_vocab)
    bos_id = property(lambda self: self._v.bos_id)
    eos_id = property(lambda self: self._v.eos_id)
    add_bos = property(lambda self: self._v.add_bos)
    add_eos = property(lambda self: self._v.add_eos)
    add_space_prefix = property(lambda self: self._v.add_space_prefix)
    chat_template = property(lambda self: self._v.chat_template)
    eog_ids = property(lambda self: self._v.eog_ids)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for: its vocabulary text's length at most (a
        byte-level BPE text holds a character per byte of the text it stands for, an SPM text its own
        characters with ``▁`` for a space, a byte token ``<0xNN>`` one byte). A text of more than
        ``n * max_token_chars + 1`` characters (the one: SPM's space prefix) is more than ``n`` tokens,
        known without tokenizing it."""
        return max(map(len, self._v.tokens), default=1)

    # ---- vocabulary access ----

    def token_text(self, token_id: int) -> str:
        """The vocabulary text of ``token_id`` as stored in the GGUF (e.g. ``"Ġthe"``, ``"<|im_end|>"``).

        Raises:
            IndexError: ``token_id`` is outside ``[0, n_vocab)``.
        """
        self._check_id(token_id)
        return self._v.tokens[token_id]

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary text is exactly ``text``, or ``None``."""
        return self._v.vocab.get(text)

    def is_control(self, token_id: int) -> bool:
        """Whether ``token_id`` is a control/unknown token (hidden from text unless ``special``)."""
        self._check_id(token_id)
        return token_id in self._v.hidden

    def is_eog(self, token_id: int) -> bool:
        """Whether generating ``token_id`` ends generation (membership in :attr:`eog_ids`)."""
        return token_id in self.eog_ids

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise IndexError(f"token id {token_id} out of range [0, {self.n_vocab})")

    # ---- encoding ----

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False,
               add_eos: bool | None = None) -> list[int]:
        """Tokenize ``text`` exactly like ``llama_tokenize``.

        Args:
            text: the text to tokenize.
            add_bos: prepend BOS; ``None`` uses the GGUF's :attr:`add_bos`.
            parse_special: when True, text of control tokens (``"<|im_start|>"``, ``"<bos>"``, ...)
                becomes those token ids, as needed for rendered chat prompts.  When False it is
                tokenized as plain text.  User-defined tokens are always matched, as in llama.cpp.
            add_eos: append EOS; ``None`` uses the GGUF's :attr:`add_eos` (false for most models).

        Returns:
            Token ids (``list[int]``).

        Raises:
            TypeError: ``text`` is not a ``str``.
            ValueError: BOS/EOS was requested but the GGUF defines no such token.
        """
        return self.encode_pieces([(text, parse_special)], add_bos, add_eos)

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]], add_bos: bool | None = None,
                      add_eos: bool | None = None) -> list[int]:
        """Tokenize the concatenation of ``pieces``, each ``(text, parse_special)``: control-token text
        becomes those tokens only in pieces that parse it (a chat template's own text), while the text
        between them is tokenized as one (the BPE does not see the seams). See :meth:`encode`."""
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this GGUF defines no BOS token")
            out.append(self.bos_id)

        fragments: list[str | int] = []
        for text, parse_special in pieces:
            if not isinstance(text, str):
                raise TypeError(f"text must be str, not {type(text).__name__}")
            for frag in self._partition(text, parse_special) if text else []:
                if isinstance(frag, str) and fragments and isinstance(fragments[-1], str):
                    fragments[-1] += frag
                else:
                    fragments.append(frag)
        raw: list[str] = []
        prev_special = True
        for frag in fragments:
            if isinstance(frag, str):
                raw.append(" " + frag if self.add_space_prefix and prev_special else frag)
                prev_special = False
            else:
                prev_special = True
        if len(raw) == 1:
            encoded = [self._v.hf.encode(raw[0], add_special_tokens=False).ids]
        elif raw:
            encoded = [e.ids for e in self._v.hf.encode_batch(raw, add_special_tokens=False)]
        else:
            encoded = []
        it = iter(encoded)
        for frag in fragments:
            if isinstance(frag, str):
                out.extend(next(it))
            else:
                out.append(frag)

        if add_eos:
            if self.eos_id is None:
                raise ValueError("this GGUF defines no EOS token")
            out.append(self.eos_id)
        return out

    def control_texts_in(self, text: str) -> list[str]:
        """The texts of control tokens that occur in ``text`` (those :meth:`encode` turns into tokens only
        with ``parse_special``), longest first."""
        return [t for _, t, _ in self._v.specials_control.present_in(text)]

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split ``text`` into raw-text fragments and special-token ids, longest special text first."""
        return (self._v.specials_all if parse_special else self._v.specials_plain).partition(text)
    # ---- decoding ----

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The raw bytes ``token_id`` contributes to the detokenized text.

        A piece may be an incomplete UTF-8 sequence (byte-fallback tokens, or byte-level BPE pieces
        that split a multibyte character); use :meth:`stream_decoder` to turn a token stream into
        text.

        Args:
            token_id: a token id.
            special: when False (the default, like ``decode(skip_special=True)``), control tokens
                contribute ``b""``; when True they contribute their text.

        Raises:
            IndexError: ``token_id`` is outside ``[0, n_vocab)``.
        """
        self._check_id(token_id)
        if not special and token_id in self._v.hidden:
            return b""
        return self._v.pieces[token_id]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Detokenize ``ids``: the concatenated :meth:`token_bytes`, decoded as UTF-8.

        Invalid or truncated UTF-8 becomes U+FFFD.  No leading space is stripped and no
        clean-up of spaces around punctuation is applied, so the result equals llama.cpp's
        ``llama_token_to_piece`` output joined together.

        Args:
            ids: token ids.
            skip_special: hide control tokens (True, default) or render their text (False).

        Raises:
            IndexError: an id is outside ``[0, n_vocab)``.
        """
        pieces = self._v.pieces
        hidden = self._v.hidden if skip_special else frozenset()
        n = self.n_vocab
        out = []
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < n:
                raise IndexError(f"token id {tid} out of range [0, {n})")
            if tid not in hidden:
                out.append(pieces[tid])
        return b"".join(out).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` for detokenizing generated ids one at a time."""
        return StreamDecoder(self, skip_special=skip_special)
