"""Byte-level BPE for GGUF ``tokenizer.ggml.model == "gpt2"`` vocabularies (SmolLM2, Llama 3, Qwen 2).

The pre-tokenizer regexes are llama.cpp's, chosen by ``tokenizer.ggml.pre``
(``llm_tokenizer_bpe``'s constructor in ``src/llama-vocab.cpp``); the merges are
``tokenizer.ggml.merges``; the BPE runs in Hugging Face ``tokenizers``. Pieces are GPT-2's
byte-to-printable-character spelling (``"Ġthe"`` is ``b" the"``), undone by :func:`byte_level_decode`.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

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
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
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
        PRE_TOKENIZERS[_name] = _spec

SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(PRE_TOKENIZERS))

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


def byte_level_decode(text: str) -> bytes:
    """Bytes behind a byte-level BPE piece such as ``"Ġthe"`` -> ``b" the"``."""
    try:
        return bytes(map(_BYTE_DECODER.__getitem__, text))
    except KeyError:
        # not byte-level text; llama.cpp would print an [UNK_BYTE_...] marker here
        return text.encode("utf-8")



def byte_level_tokenizer(raw_merges: list[str], vocab: dict[str, int], regexes: tuple[str, ...],
                         ignore_merges: bool) -> Tokenizer:
    """The ``tokenizers`` BPE model for a byte-level vocabulary.

    Args:
        raw_merges: ``tokenizer.ggml.merges``, each ``"left right"`` (a left part may start with a space).
        vocab: piece text -> id.
        regexes: the pre-tokenizer's regexes (a :data:`PRE_TOKENIZERS` entry), applied in sequence.
        ignore_merges: take a pre-tokenized word that is itself a vocabulary piece whole (Llama 3).

    Merges whose parts or result are not in ``vocab`` are dropped: ``tokenizers`` rejects them and
    llama.cpp would split such a result back into bytes anyway.
    """
    merges = []
    for m in raw_merges:
        pos = m.find(" ", 1)
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1:]
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
    hf = Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf
