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
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType, TokenType
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from meshnet.model.gguf_file import open_gguf, string_array

__all__ = ["GGUFTokenizer", "StreamDecoder", "SUPPORTED_TOKENIZER_MODELS", "SUPPORTED_PRE_TOKENIZERS"]

_K = gguf.Keys.Tokenizer

SUPPORTED_TOKENIZER_MODELS: tuple[str, ...] = ("gpt2", "llama")

# --- pre-tokenizer regexes, copied from llama.cpp's llm_tokenizer_bpe constructor -----------------

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp rewrote the case-insensitive (?i:'s|...) group of the original HF regexes into explicit
# character classes; both spellings match the same strings.
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
_FALCON_RES = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]")
_STARCODER_RES = (r"\p{N}", _GPT2_RE)

# tokenizer.ggml.pre -> (regexes applied in sequence, ignore_merges, default add_bos)
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
for _names, _spec in (
    (("default",), (_DEFAULT_RES, False, False)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     (_STARCODER_RES, False, False)),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
      "gigachat", "exaone4", "trillion"),
     ((_GPT2_RE,), False, False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), ((_LLAMA3_RE,), True, True)),
    (("dbrx", "smaug-bpe"), ((_LLAMA3_RE,), False, False)),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), ((_QWEN2_RE,), False, False)),
    (("falcon",), (_FALCON_RES, False, False)),
):
    for _name in _names:
        _PRE_TOKENIZERS[_name] = _spec

SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_TOKENIZERS))

# --- token texts llama.cpp recognises by name (llama_vocab::impl::load) ---------------------------

# Tokens that end generation.  "</s>" is deliberately absent: recent llama.cpp lists it for one OCR
# model, but in Gemma 3 it is the HTML strikethrough tag, not a turn end.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
    "<｜end▁of▁sentence｜>",
})
# Fill-in-the-middle pad/repo/file-separator tokens also end generation in llama.cpp.
_FIM_EOG_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
})
# Tokens llama.cpp forces to CONTROL even when the GGUF typed them otherwise, which hides them in
# detokenized text and makes them special-only in tokenization.
_FORCED_CONTROL_TEXTS = _EOG_TEXTS | _FIM_EOG_TEXTS | frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
})

_SPIECE_SPACE = "\u2581"
_ASCII_SPACE = " \t\n\v\f\r"  # C isspace(), used by llama.cpp for lstrip/rstrip token attributes


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_DECODER: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_decode(text: str) -> bytes:
    """Bytes behind a byte-level BPE piece such as ``"Ġthe"`` -> ``b" the"``."""
    try:
        return bytes(map(_BYTE_DECODER.__getitem__, text))
    except KeyError:
        # not byte-level text; llama.cpp would print an [UNK_BYTE_...] marker here
        return text.encode("utf-8")


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


# --- SPM merges ------------------------------------------------------------------------------------

_HASH_BASES = (0x100000001B3, 0x9E3779B97F4A7C15)  # odd, hence invertible modulo 2**64


class _PieceHasher:
    """Polynomial hashes (mod 2**64) of prefixes and suffixes of the vocabulary pieces.

    ``hash(s) = sum (ord(s[m]) + 1) * base**m``; a prefix, a suffix and a whole piece with the same
    text get the same value, so split halves can be looked up among whole pieces.
    """

    def __init__(self, cps: np.ndarray, local: np.ndarray, max_len: int, base: int) -> None:
        inv = pow(base, -1, 1 << 64)
        self._pows = np.array([pow(base, m, 1 << 64) for m in range(max_len + 1)], dtype=np.uint64)
        self._inv_pows = np.array([pow(inv, m, 1 << 64) for m in range(max_len + 1)], dtype=np.uint64)
        self._acc = np.zeros(len(cps) + 1, dtype=np.uint64)  # uint64 arithmetic wraps: the modulus
        np.cumsum((cps + np.uint64(1)) * self._pows[local], out=self._acc[1:])

    def prefix(self, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """Hash of the code points ``[start, stop)`` where ``start`` is the beginning of a piece."""
        return self._acc[stop] - self._acc[start]

    def suffix(self, start: np.ndarray, split: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """Hash of ``[split, stop)`` where ``start`` is the beginning of the piece holding it."""
        return (self._acc[stop] - self._acc[split]) * self._inv_pows[split - start]


def _spm_merges(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split ``(l, r)`` of every vocabulary piece with ``l`` and ``r`` in the vocabulary, best score first.

    This reproduces llama.cpp's SPM loop (merge the adjacent pair forming the highest-scoring
    piece) as rank-ordered BPE merges.  The double loop over all split points costs about 2 s in
    Python for Gemma's 262k pieces, so the halves are matched against the vocabulary with two
    independent 64-bit hashes plus the length, vectorised with numpy.  If two vocabulary pieces
    ever share a hash the exact slow path is used instead.
    """
    n = len(tokens)
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    cps = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])
    local = np.arange(len(cps), dtype=np.int64) - np.repeat(starts[:-1], lens)
    max_len = int(lens.max(initial=0))
    h1, h2 = (_PieceHasher(cps, local, max_len, base) for base in _HASH_BASES)

    piece_hash = h1.prefix(starts[:-1], starts[1:])
    order = np.argsort(piece_hash)
    sorted_hash = piece_hash[order]
    if np.any(sorted_hash[1:] == sorted_hash[:-1]):
        return _spm_merges_exact(tokens, scores, vocab)
    piece_hash2 = h2.prefix(starts[:-1], starts[1:])

    # every interior split point of every piece, as global code-point indices
    n_splits = np.maximum(lens - 1, 0)
    owner = np.repeat(np.arange(n, dtype=np.int64), n_splits)
    piece_start = starts[:-1][owner]
    piece_end = starts[1:][owner]
    split = piece_start + 1 + (np.arange(len(owner), dtype=np.int64) - (np.cumsum(n_splits) - n_splits)[owner])

    def lookup(h: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Index into ``sorted_hash`` of the piece with hash ``h`` and this length, or -1."""
        idx = np.searchsorted(sorted_hash, h)
        idx[idx == n] = 0
        ids = order[idx]
        return np.where((sorted_hash[idx] == h) & (lens[ids] == length), ids, -1)

    left = lookup(h1.prefix(piece_start, split), split - piece_start)
    keep = left >= 0
    owner, piece_start, piece_end, split, left = (
        owner[keep], piece_start[keep], piece_end[keep], split[keep], left[keep])
    right = lookup(h1.suffix(piece_start, split, piece_end), piece_end - split)
    keep = right >= 0
    keep[keep] = (piece_hash2[left[keep]] == h2.prefix(piece_start[keep], split[keep])) & \
        (piece_hash2[right[keep]] == h2.suffix(piece_start[keep], split[keep], piece_end[keep]))
    owner, piece_start, split, left, right = (
        owner[keep], piece_start[keep], split[keep], left[keep], right[keep])

    # best score first; equal scores (only special pieces share one) by piece id, then split point
    rank = np.lexsort((split - piece_start, owner, -scores[owner].astype(np.float64)))
    get = tokens.__getitem__
    return list(zip(map(get, left[rank].tolist()), map(get, right[rank].tolist())))


def _spm_merges_exact(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Slow, obviously-correct version of :func:`_spm_merges`."""
    found = []
    for tid, piece in enumerate(tokens):
        for i in range(1, len(piece)):
            if piece[:i] in vocab and piece[i:] in vocab:
                found.append((-float(scores[tid]), tid, i))
    found.sort()
    return [(tokens[t][:i], tokens[t][i:]) for _, t, i in found]


# --- tokenizer -------------------------------------------------------------------------------------

class _SpecialTokens:
    """Special tokens in partition order, with a fast test for which ones occur in a text.

    Gemma has 6400 special tokens (6200 of them ``<unusedN>``); testing each against a long prompt
    costs ~0.2 s.  Tokens are grouped by their first characters: a group is skipped when its
    prefix does not occur, and a large group is resolved by looking up what follows each
    occurrence of the prefix.
    """

    _PREFIX = 3
    _SMALL_GROUP = 16
    _MAX_SCANNED_OCCURRENCES = 64

    def __init__(self, ordered: list[tuple[int, str, bool]]) -> None:
        self._ordered = ordered
        groups: dict[str, list[int]] = {}
        for i, (_, text, _) in enumerate(ordered):
            groups.setdefault(text[:self._PREFIX], []).append(i)
        self._groups = groups
        self._lengths = {p: sorted({len(ordered[i][1]) for i in m}) for p, m in groups.items()}
        self._index = {p: {ordered[i][1]: i for i in m} for p, m in groups.items()
                       if len(m) > self._SMALL_GROUP}

    def __iter__(self):
        return iter(self._ordered)

    def __len__(self) -> int:
        return len(self._ordered)

    def present_in(self, text: str) -> list[tuple[int, str, bool]]:
        """The tokens whose text occurs in ``text``, longest first (the partition order)."""
        ordered = self._ordered
        hits: list[int] = []
        for prefix, members in self._groups.items():
            if prefix not in text:
                continue
            index = self._index.get(prefix)
            if index is None:
                hits.extend(i for i in members if ordered[i][1] in text)
                continue
            found = set()
            lengths = self._lengths[prefix]
            pos = text.find(prefix)
            scanned = 0
            while pos >= 0 and scanned < self._MAX_SCANNED_OCCURRENCES:
                for n in lengths:
                    i = index.get(text[pos:pos + n])
                    if i is not None:
                        found.add(i)
                pos = text.find(prefix, pos + 1)
                scanned += 1
            if pos >= 0:  # a very common prefix: test every member directly instead
                found = {i for i in members if ordered[i][1] in text}
            hits.extend(found)
        hits.sort()
        return [ordered[i] for i in hits]


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
            if pre not in _PRE_TOKENIZERS:
                raise ValueError(
                    f"unsupported GGUF pre-tokenizer {pre!r} ({_K.PRE}) for tokenizer model 'gpt2'; "
                    f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
            regexes, ignore_merges, default_add_bos = _PRE_TOKENIZERS[pre]
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
        for text in _FORCED_CONTROL_TEXTS:
            tid = vocab.get(text)
            if tid is not None:
                types[tid] = TokenType.CONTROL
        eog = {vocab[t] for t in _EOG_TEXTS | _FIM_EOG_TEXTS if t in vocab}
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
        self._specials_all = _SpecialTokens([(tid, text, rstrip) for _, tid, text, rstrip in specials])
        self._specials_plain = _SpecialTokens([(tid, text, rstrip) for _, tid, text, rstrip in specials
                                               if types[tid] == TokenType.USER_DEFINED])

        # BPE model
        if spm:
            scores = meta.numbers(_K.SCORES)
            scores = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores[:n], dtype=np.float32)
            merges = _spm_merges(tokens, scores, vocab)
            bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False)
            hf = Tokenizer(bpe)
            hf.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
        else:
            raw_merges = meta.strings(_K.MERGES)
            if raw_merges is None:
                raise ValueError(f"GGUF tokenizer model 'gpt2' needs {_K.MERGES}")
            merges = []
            for m in raw_merges:
                pos = m.find(" ", 1)
                if pos < 0:
                    continue
                a, b = m[:pos], m[pos + 1:]
                # tokenizers rejects merges outside the vocabulary; llama.cpp would split such a
                # result back into bytes anyway
                if a in vocab and b in vocab and a + b in vocab:
                    merges.append((a, b))
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
            hf = Tokenizer(bpe)
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self._hf = hf

        # detokenization pieces (llama_token_to_piece with special=True) and which ones are hidden
        # when special=False
        if spm:
            pieces = [t.replace(_SPIECE_SPACE, " ").encode("utf-8") for t in tokens]
        else:
            pieces = [_byte_level_decode(t) for t in tokens]
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
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this GGUF defines no BOS token")
            out.append(self.bos_id)

        fragments = self._partition(text, parse_special) if text else []
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

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split ``text`` into raw-text fragments and special-token ids, longest special text first."""
        specials = self._specials_all if parse_special else self._specials_plain
        fragments: list[str | int] = [text]
        for tid, tok_text, rstrip in specials.present_in(text):
            updated: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok_text not in frag:
                    updated.append(frag)
                    continue
                pieces = frag.split(tok_text)
                for k, piece in enumerate(pieces):
                    if k:
                        updated.append(tid)
                        if rstrip:
                            piece = piece.lstrip(_ASCII_SPACE)
                    if piece:
                        updated.append(piece)
            fragments = updated
        return fragments

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

    def stream_decoder(self, skip_special: bool = True) -> "StreamDecoder":
        """A fresh :class:`StreamDecoder` for detokenizing generated ids one at a time."""
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Incremental detokenizer that never emits half a UTF-8 character.

    ``"".join(d.feed(t) for t in ids) + d.flush() == tok.decode(ids)`` for any ``ids``.
    """

    def __init__(self, tokenizer: GGUFTokenizer, skip_special: bool = True) -> None:
        """Args: tokenizer: the source of token pieces; skip_special: as in :meth:`GGUFTokenizer.decode`."""
        self._tok = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly ``""``).

        Bytes of a multibyte character split across tokens are held back until the character is
        complete.  Bytes that can never form a valid character become U+FFFD as soon as that is
        certain, exactly where :meth:`GGUFTokenizer.decode` would put them.

        Raises:
            IndexError: ``token_id`` is outside the vocabulary.
        """
        return self._utf8.decode(self._tok.token_bytes(token_id, special=self._special))

    def flush(self) -> str:
        """Return whatever is held back (an incomplete trailing sequence becomes U+FFFD) and reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
