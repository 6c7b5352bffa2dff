"""The vocabulary a GGUF file's metadata describes, read into what :class:`~meshnet.tokenizer.GGUFTokenizer`
encodes and decodes with: token texts and types, BOS/EOS and the end-of-generation set as llama.cpp builds
them (``llama_vocab::impl::load``), the special tokens to split out of text, the BPE model (in the Hugging
Face ``tokenizers`` library) and the detokenization pieces (``llama_token_to_piece``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType, TokenType

from meshnet.model.gguf_file import string_array
from meshnet.tokenizer_bpe import PRE_TOKENIZERS, SUPPORTED_PRE_TOKENIZERS, byte_level_decode, byte_level_tokenizer
from meshnet.tokenizer_specials import EOG_TEXTS, FIM_EOG_TEXTS, FORCED_CONTROL_TEXTS, SpecialTokens
from meshnet.tokenizer_spm import SPIECE_SPACE, spm_tokenizer

_K = gguf.Keys.Tokenizer

SUPPORTED_TOKENIZER_MODELS: tuple[str, ...] = ("gpt2", "llama")


class GGUFMetadata:
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


@dataclass(frozen=True)
class Vocabulary:
    """What a GGUF file's tokenizer metadata holds, as the tokenizer uses it (see
    :class:`~meshnet.tokenizer.GGUFTokenizer` for the public fields' meaning).

    ``tokens``: each id's text (empty ones renamed ``[EMPTY_i]``, as llama.cpp does); ``vocab``: text to
    its first id; ``specials_all`` / ``specials_plain`` / ``specials_control``: the special tokens split
    out of text with ``parse_special``, without it (user-defined ones), and those only ``parse_special``
    adds (control tokens); ``hf``: the ``tokenizers`` BPE model; ``pieces``: each id's detokenized bytes
    (``special=True``); ``hidden``: the ids that render as nothing with ``special=False``."""

    model: str
    pre: str | None
    n_vocab: int
    tokens: list[str]
    vocab: dict[str, int]
    add_space_prefix: bool
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    eog_ids: frozenset[int]
    specials_all: SpecialTokens
    specials_plain: SpecialTokens
    specials_control: SpecialTokens
    hf: Any
    pieces: list[bytes]
    hidden: frozenset[int]


def read_vocabulary(meta: GGUFMetadata) -> Vocabulary:
    """Read the tokenizer a GGUF file's metadata describes.

    Raises:
        ValueError: the tokenizer model or pre-tokenizer is unsupported (the message lists the supported
            ones), or the tokenizer metadata is missing or malformed.
    """
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
    pre = meta.scalar(_K.PRE)

    spm = model == "llama"
    if spm:
        default_bos, default_eos, default_add_bos = 1, 2, True
        add_space_prefix = bool(meta.scalar(_K.ADD_PREFIX, True))
        ignore_merges = False
    else:
        pre_name = pre or "default"
        if pre_name not in PRE_TOKENIZERS:
            raise ValueError(
                f"unsupported GGUF pre-tokenizer {pre_name!r} ({_K.PRE}) for tokenizer model 'gpt2'; "
                f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
        regexes, ignore_merges, default_add_bos = PRE_TOKENIZERS[pre_name]
        default_bos = default_eos = None
        # llama.cpp reads add_space_prefix for BPE too but never applies it
        add_space_prefix = False

    def special_id(key: str, default: int | None) -> int | None:
        v = meta.scalar(key)
        if v is None:
            v = default
        return int(v) if v is not None and 0 <= int(v) < n else None

    bos_id = special_id(_K.BOS_ID, default_bos)
    eos_id = special_id(_K.EOS_ID, default_eos)
    eot_id = special_id(_K.EOT_ID, None)
    eom_id = special_id(_K.EOM_ID, None)
    add_bos = bool(meta.scalar(_K.ADD_BOS, default_add_bos))
    add_eos = bool(meta.scalar(_K.ADD_EOS, False))
    template = meta.scalar(_K.CHAT_TEMPLATE)
    chat_template = template if isinstance(template, str) and template else None

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
    eog.update(i for i in (eos_id, eot_id, eom_id) if i is not None)
    eog_ids = frozenset(eog)

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
    specials_all = SpecialTokens([(tid, text, rstrip) for _, tid, text, rstrip in specials])
    specials_plain = SpecialTokens([(tid, text, rstrip) for _, tid, text, rstrip in specials
                                    if types[tid] == TokenType.USER_DEFINED])
    # the ones parse_special adds (control tokens): what chat messages must not spell
    specials_control = SpecialTokens([(tid, text, rstrip) for _, tid, text, rstrip in specials
                                      if types[tid] != TokenType.USER_DEFINED])

    # BPE model
    if spm:
        scores = meta.numbers(_K.SCORES)
        scores = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores[:n], dtype=np.float32)
        hf = spm_tokenizer(tokens, scores, vocab)
    else:
        raw_merges = meta.strings(_K.MERGES)
        if raw_merges is None:
            raise ValueError(f"GGUF tokenizer model 'gpt2' needs {_K.MERGES}")
        hf = byte_level_tokenizer(raw_merges, vocab, regexes, ignore_merges)

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
    hidden = frozenset(int(i) for i in np.flatnonzero(np.isin(types, (TokenType.CONTROL, TokenType.UNKNOWN))))
    return Vocabulary(model=model, pre=pre, n_vocab=n, tokens=tokens, vocab=vocab,
                      add_space_prefix=add_space_prefix, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos,
                      add_eos=add_eos, chat_template=chat_template, eog_ids=eog_ids, specials_all=specials_all,
                      specials_plain=specials_plain, specials_control=specials_control, hf=hf, pieces=pieces,
                      hidden=hidden)
