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
end-of-generation and special-token partitioning); this module reads the GGUF vocabulary and puts
them together.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType, TokenType

from meshnet.model.gguf_file import open_gguf, string_array
from meshnet.tokenizer_bpe import PRE_TOKENIZERS, SUPPORTED_PRE_TOKENIZERS, byte_level_decode, byte_level_tokenizer
from meshnet.tokenizer_specials import EOG_TEXTS, FIM_EOG_TEXTS, FORCED_CONTROL_TEXTS, SpecialTokens
from meshnet.tokenizer_spm import SPIECE_SPACE, spm_tokenizer
from meshnet.tokenizer_stream import StreamDecoder

__all__ = ["GGUFTokenizer", "StreamDecoder", "SUPPORTED_TOKENIZER_MODELS", "SUPPORTED_PRE_TOKENIZERS"]

_K = gguf.Keys.Tokenizer

SUPPORTED_TOKENIZER_MODELS: tuple[str, ...] = ("gpt2", "llama")


# --- GGUF metadata ---------------------------------------------------------------------------------

class _Metadata:
    """Typed accessors over the reader's key/value fields (missing key -> default)."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._reader = reader
        self._fields = reader.fields

    def scalar(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        if field.types[0] == GGUFValueType.ARRAY:
            raise ValueError(f"GGUF key {key!r} is an array, expected a single value")
        return field.contents()

    def strings(self, key: str) -> list[str] | None:
        return string_array(self._reader, key)

    def numbers(self, key: str) -> np.ndarray | None:
        field = self._fields.get(key)
        if field is None:
            return None
        if field.types[0] != GGUFValueType.ARRAY or field.types[-1] == GGUFValueType.STRING:
            raise ValueError(f"GGUF key {key!r} is not a numeric array")
        return np.asarray(field.parts[field.data[0]])



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

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None
    eog_ids: frozenset[int]
    model: str
    pre: str | None

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
        meta = _Metadata(open_gguf(path))
        self = object.__new__(cls)
        self._load(meta)
        return self

    def _load(self, meta: _Metadata) -> None:
        model = meta.scalar(_K.MODEL)
        if model not in SUPPORTED_TOKENIZER_MODELS:
            raise ValueError(
                f"unsupported GGUF tokenizer model {model!r} ({_K.MODEL}); "
                f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}")
        tokens = meta.strings(_K.LIST)
        if not tokens:
            raise ValueError(f"GGUF has no {_K.LIST}")
        n = len(tokens)
        # llama.cpp renames empty pieces so that every text maps back to one id
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

        types = meta.numbers(_K.TOKEN_TYPE)
        types = np.full(n, TokenType.NORMAL, dtype=np.int32) if types is None else types[:n].astype(np.int32)
        if len(types) < n:
            raise ValueError(f"{_K.TOKEN_TYPE} has {len(types)} entries for {n} tokens")

        # a duplicated text maps to its first id
        vocab = dict(zip(reversed(tokens), range(n - 1, -1, -1)))

        self.model = model
        self.pre = meta.scalar(_K.PRE)
        self.n_vocab = n
        self._tokens = tokens
        self._vocab = vocab

        spm = model == "llama"
        if spm:
            default_bos, default_eos, default_add_bos = 1, 2, True
            self.add_space_prefix = bool(meta.scalar(_K.ADD_PREFIX, True))
            ignore_merges = False
        else:
            pre = self.pre or "default"
            if pre not in PRE_TOKENIZERS:
                raise ValueError(
                    f"unsupported GGUF pre-tokenizer {pre!r} ({_K.PRE}) for tokenizer model 'gpt2'; "
                    f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
            regexes, ignore_merges, default_add_bos = PRE_TOKENIZERS[pre]
            default_bos = default_eos = None
            # llama.cpp reads add_space_prefix for BPE too but never applies it
            self.add_space_prefix = False

        def special_id(key: str, default: int | None) -> int | None:
            v = meta.scalar(key)
            if v is None:
                v = default
            return int(v) if v is not None and 0 <= int(v) < n else None

        self.bos_id = special_id(_K.BOS_ID, default_bos)
        self.eos_id = special_id(_K.EOS_ID, default_eos)
        eot_id = special_id(_K.EOT_ID, None)
        eom_id = special_id(_K.EOM_ID, None)
        self.add_bos = bool(meta.scalar(_K.ADD_BOS, default_add_bos))
        self.add_eos = bool(meta.scalar(_K.ADD_EOS, False))
        template = meta.scalar(_K.CHAT_TEMPLATE)
        self.chat_template = template if isinstance(template, str) and template else None

        # end-of-generation set, as llama.cpp builds it
        for text in FORCED_CONTROL_TEXTS:
            tid = vocab.get(text)
            if tid is not None:
                types[tid] = TokenType.CONTROL
        eog = {vocab[t] for t in EOG_TEXTS | FIM_EOG_TEXTS if t in vocab}
        for key in (_K.FIM_PAD_ID, _K.FIM_REP_ID, _K.FIM_SEP_ID):
            tid = special_id(key, None)
            if tid is not None:
                eog.add(tid)
        eog.update(i for i in (self.eos_id, eot_id, eom_id) if i is not None)
        self.eog_ids = frozenset(eog)

        # special-token partitioning (llama_vocab::impl::tokenizer_st_partition): longest text first
        name = str(meta.scalar(gguf.Keys.General.NAME, "") or "").lower()
        rstrip_all = "phi-3" in name or "phi3" in name  # llama.cpp's per-model attribute override
        specials = []
        for tid in np.flatnonzero(np.isin(types, (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN))):
            tid = int(tid)
            text = tokens[tid]
            rstrip = rstrip_all and text not in ("<unk>", "<s>", "<|endoftext|>")
            specials.append((len(text.encode("utf-8")), tid, text, rstrip))
        if rstrip_all and "</s>" in vocab:
            tid = vocab["</s>"]
            if not any(s[1] == tid for s in specials):
                specials.append((len(b"</s>"), tid, "</s>", True))
        specials.sort(key=lambda s: -s[0])  # stable: equal lengths keep id order
        self._specials_all = SpecialTokens([(tid, text, rstrip) for _, tid, text, rstrip in specials])
        self._specials_plain = SpecialTokens([(tid, text, rstrip) for _, tid, text, rstrip in specials
                                               if types[tid] == TokenType.USER_DEFINED])
        # the ones parse_special adds (control tokens): what chat messages must not spell
        self._specials_control = SpecialTokens([(tid, text, rstrip) for _, tid, text, rstrip in specials
                                                 if types[tid] != TokenType.USER_DEFINED])

        # BPE model
        if spm:
            scores = meta.numbers(_K.SCORES)
            scores = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores[:n], dtype=np.float32)
            self._hf = spm_tokenizer(tokens, scores, vocab)
        else:
            raw_merges = meta.strings(_K.MERGES)
            if raw_merges is None:
                raise ValueError(f"GGUF tokenizer model 'gpt2' needs {_K.MERGES}")
            self._hf = byte_level_tokenizer(raw_merges, vocab, regexes, ignore_merges)

        # detokenization pieces (llama_token_to_piece with special=True) and which ones are hidden
        # when special=False
        if spm:
            pieces = [t.replace(SPIECE_SPACE, " ").encode("utf-8") for t in tokens]
        else:
            pieces = [byte_level_decode(t) for t in tokens]
        for tid in np.flatnonzero(types != TokenType.NORMAL).tolist():
            ttype = types[tid]
            if ttype in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
                pieces[tid] = tokens[tid].encode("utf-8")
            elif ttype == TokenType.BYTE:
                pieces[tid] = bytes([int(tokens[tid][3:5], 16)])
            else:  # UNUSED / undefined types render as nothing
                pieces[tid] = b""
        self._pieces = pieces
        self._hidden = frozenset(
            int(i) for i in np.flatnonzero(np.isin(types, (TokenType.CONTROL, TokenType.UNKNOWN))))

    # ---- vocabulary access ----

    def token_text(self, token_id: int) -> str:
        """The vocabulary text of ``token_id`` as stored in the GGUF (e.g. ``"Ġthe"``, ``"<|im_end|>"``).

        Raises:
            IndexError: ``token_id`` is outside ``[0, n_vocab)``.
        """
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary text is exactly ``text``, or ``None``."""
        return self._vocab.get(text)

    def is_control(self, token_id: int) -> bool:
        """Whether ``token_id`` is a control/unknown token (hidden from text unless ``special``)."""
        self._check_id(token_id)
        return token_id in self._hidden

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
            encoded = [self._hf.encode(raw[0], add_special_tokens=False).ids]
        elif raw:
            encoded = [e.ids for e in self._hf.encode_batch(raw, add_special_tokens=False)]
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
        return [t for _, t, _ in self._specials_control.present_in(text)]

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split ``text`` into raw-text fragments and special-token ids, longest special text first."""
        return (self._specials_all if parse_special else self._specials_plain).partition(text)
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
        if not special and token_id in self._hidden:
            return b""
        return self._pieces[token_id]

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
        pieces = self._pieces
        hidden = self._hidden if skip_special else frozenset()
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
