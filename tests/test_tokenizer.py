"""GGUFTokenizer against llama.cpp: golden prompt ids, detokenized text, streaming, EOG ids.

The goldens (../shared/golden) were produced by llama-cpp-python: ``llm.tokenize(prompt, add_bos=
<GGUF flag>, special=False)`` and ``llm.detokenize(greedy_ids).decode("utf-8", "replace")``.
"""

from __future__ import annotations

import functools
import heapq
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import GOLDEN_DIR, TINY_MODELS, load_golden
from meshnet.tokenizer import GGUFTokenizer

SMOLLM2_GOLDEN = "SmolLM2-135M-Instruct.Q4_1"
GEMMA_GOLDEN = "gemma-3-270m-q4_k_m"
MIXED_SCRIPT = 2  # index of "Crème brûlée ... 北京欢迎你 🙂" in every golden's prompts

# llama-cpp-python's detokenize() copies each piece through a 32-byte buffer and silently drops
# longer pieces (token_to_piece returns a negative size, and buffer[:negative] is empty).  A few
# tiny-model greedy ids are 36-37 byte runs of dashes, so the golden text lacks them.
LLAMA_CPP_PYTHON_PIECE_LIMIT = 32


@functools.lru_cache(maxsize=None)
def _load(path: str) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(path)


def _model_cases():
    cases = [pytest.param(name, id=name) for name in TINY_MODELS]
    cases.append(pytest.param(SMOLLM2_GOLDEN, id="smollm2"))
    cases.append(pytest.param(GEMMA_GOLDEN, id="gemma3-270m", marks=pytest.mark.gemma))
    return cases


@pytest.fixture
def model(request, golden_dir) -> tuple[GGUFTokenizer, dict]:
    name = request.param
    if name == SMOLLM2_GOLDEN:
        path = request.getfixturevalue("smollm2_path")
    elif name == GEMMA_GOLDEN:
        path = request.getfixturevalue("gemma_path")
    else:
        path = golden_dir / "models" / f"{name}.gguf"
    return _load(str(path)), load_golden(name)


@pytest.mark.parametrize("model", _model_cases(), indirect=True)
def test_no_token_stands_for_more_characters_than_max_token_chars(model):
    """The API refuses a prompt longer than n_ctx * max_token_chars + 1 characters untokenized: no token of
    any vocabulary, on whitespace runs, multi-byte scripts, emoji or control-token text, covers more."""
    tok, golden = model
    texts = [p["prompt"] for p in golden["prompts"]] + [
        " " * 5000, "\n" * 3000, "\t" * 999 + "x", "é" * 2000, "日本語のテキスト" * 300, "🙂" * 1000,
        "-" * 4000, "<|im_start|>user\n" * 200, "<start_of_turn>model\n" * 200, "    " * 1000 + "def f():"]
    for text in texts:
        n_tokens = len(tok.encode(text, parse_special=True, add_bos=False))
        assert len(text) <= n_tokens * tok.max_token_chars + 1, (text[:40], n_tokens, tok.max_token_chars)


def _golden_visible_ids(tok: GGUFTokenizer, ids: list[int]) -> list[int]:
    return [t for t in ids if len(tok.token_bytes(t)) <= LLAMA_CPP_PYTHON_PIECE_LIMIT]


# --- goldens ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", _model_cases(), indirect=True)
def test_prompt_ids_equal_llama_cpp(model):
    tok, golden = model
    assert tok.add_bos == golden["bos_added"]
    assert tok.n_vocab == golden["gguf"]["n_vocab"]
    for p in golden["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_ids"], p["prompt"]


@pytest.mark.parametrize("model", _model_cases(), indirect=True)
def test_decode_equals_llama_cpp_text(model):
    tok, golden = model
    for p in golden["prompts"]:
        ids = p["greedy_ids"]
        visible = _golden_visible_ids(tok, ids)
        # same bytes, decoded with the same Python "replace" handler, so even U+FFFD positions agree
        assert tok.decode(visible) == p["greedy_text"]
        if len(visible) == len(ids):
            assert tok.decode(ids) == p["greedy_text"]
        else:
            dropped = [t for t in ids if t not in visible]
            assert all(len(tok.token_bytes(t)) > LLAMA_CPP_PYTHON_PIECE_LIMIT for t in dropped)


def test_golden_long_pieces_are_the_only_text_difference(golden_dir):
    """Pin the llama-cpp-python quirk above to the case where it shows up."""
    tok = _load(str(golden_dir / "models" / "tiny-phi3-q8_0.gguf"))
    p = load_golden("tiny-phi3-q8_0")["prompts"][0]
    full = tok.decode(p["greedy_ids"])
    assert full != p["greedy_text"]
    assert "-" * 36 in full and "-" * 36 not in p["greedy_text"]


@pytest.mark.parametrize("model", _model_cases(), indirect=True)
def test_stream_decoder_joins_to_decode(model):
    tok, golden = model
    for p in golden["prompts"]:
        for ids in (p["greedy_ids"], p["prompt_ids"]):
            dec = tok.stream_decoder()
            chunks = [dec.feed(t) for t in ids]
            tail = dec.flush()
            assert "".join(chunks) + tail == tok.decode(ids)
            if "\ufffd" not in tok.decode(ids):
                assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("model", _model_cases(), indirect=True)
def test_stream_decoder_holds_back_split_characters(model):
    """The mixed-script prompt's ids split 北京欢迎你 / 🙂 / accents across tokens."""
    tok, golden = model
    p = golden["prompts"][MIXED_SCRIPT]
    ids = [t for t in p["prompt_ids"] if t != tok.bos_id]
    pieces = [tok.token_bytes(t) for t in ids]
    split = [b for b in pieces if b and not _is_complete_utf8(b)]
    dec = tok.stream_decoder()
    chunks = [dec.feed(t) for t in ids]
    assert "".join(chunks) + dec.flush() == p["prompt"]
    assert not any("\ufffd" in c for c in chunks)
    if split:  # byte-level BPE splits multibyte characters; Gemma has whole-character pieces
        assert any(c == "" for c, b in zip(chunks, pieces) if b)


def _is_complete_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# --- SmolLM2 specifics ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> GGUFTokenizer:
    return _load(str(smollm2_path))


def test_smollm2_special_ids(smollm2):
    assert smollm2.n_vocab == 49152
    assert smollm2.token_text(0) == "<|endoftext|>"
    assert smollm2.token_text(1) == "<|im_start|>"
    assert smollm2.token_text(2) == "<|im_end|>"
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.add_bos) == (1, 2, False)
    # <|im_end|> (EOS, 2) and <|endoftext|> (0) end generation; llama.cpp also treats <reponame>
    # (4) as the fill-in-the-middle repo token, which it counts as end-of-generation
    assert {0, 2} <= smollm2.eog_ids
    assert smollm2.eog_ids == {0, 2, 4}
    assert smollm2.is_eog(2) and smollm2.is_eog(0) and not smollm2.is_eog(1)
    assert not smollm2.is_eog(smollm2.encode(" Paris")[0])


def test_smollm2_parse_special(smollm2):
    text = "<|im_start|>user\nHi<|im_end|>\n"
    ids = smollm2.encode(text, parse_special=True)
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1
    assert smollm2.decode(ids) == "user\nHi\n"  # control tokens hidden by default
    assert smollm2.decode(ids, skip_special=False) == text
    plain = smollm2.encode(text)  # llama.cpp special=False: control-token text is just text
    assert 1 not in plain and 2 not in plain
    assert smollm2.decode(plain) == text


def test_smollm2_token_bytes(smollm2):
    (the,) = smollm2.encode(" the")
    assert smollm2.token_text(the) == "Ġthe"
    assert smollm2.token_bytes(the) == b" the"
    assert smollm2.token_bytes(2) == b""
    assert smollm2.token_bytes(2, special=True) == b"<|im_end|>"
    with pytest.raises(IndexError):
        smollm2.token_bytes(smollm2.n_vocab)
    with pytest.raises(IndexError):
        smollm2.decode([0, -1])


@pytest.mark.parametrize("text", [
    "", " ", "Hello, world!", "  two  spaces\tand\ttabs\n\nnew\r\nlines  ", "don't we'll I'M",
    "1234567890 3.14159 1e-9", "Crème brûlée, 北京欢迎你, 🙂👍🏽 👨‍👩‍👧, العربية, हिन्दी",
    "def f(x):\n    return x ** 2  # comment", "<|im_start|> is text here", "\u0000\u0001\x7f",
])
def test_smollm2_roundtrip(smollm2, text):
    ids = smollm2.encode(text)
    assert smollm2.decode(ids) == text
    if text.isdigit():
        assert len(ids) == len(text)


def test_smollm2_digits_split_like_smollm_pretokenizer(smollm2):
    # smollm pre-tokenization isolates every digit (\p{N} first), so numbers are one token per digit
    ids = smollm2.encode("2024")
    assert [smollm2.token_text(t) for t in ids] == ["2", "0", "2", "4"]


def test_encode_rejects_non_text(smollm2):
    with pytest.raises(TypeError):
        smollm2.encode(b"bytes")  # type: ignore[arg-type]


def test_smollm2_loads_quickly(smollm2_path):
    start = time.perf_counter()
    GGUFTokenizer.from_gguf(str(smollm2_path))
    # ~0.3-0.6 s here; gguf's stock GGUFReader alone takes ~4 s on this file
    assert time.perf_counter() - start < 3.0


# --- Gemma 3 (SentencePiece-style) ---------------------------------------------------------------

def spm_reference(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """Straight port of llama.cpp's llm_tokenizer_spm_session::tokenize (an oracle, not used by meshnet).

    ``text`` is one raw fragment with spaces already escaped to U+2581.  Repeatedly merges the
    adjacent pair whose concatenation is the best-scoring vocabulary piece (ties: leftmost), then
    emits pieces, falling back to <0xXX> byte tokens for anything not in the vocabulary.
    """
    sym = list(text)
    nxt = list(range(1, len(sym))) + [-1]
    prv = list(range(-1, len(sym) - 1))
    heap: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            tid = vocab.get(sym[left] + sym[right])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, len(sym[left]) + len(sym[right])))

    for i in range(1, len(sym)):
        push(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left] += sym[right]
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    out: list[int] = []
    i = 0 if sym else -1
    while i != -1:
        tid = vocab.get(sym[i])
        out.extend([tid] if tid is not None else [vocab[f"<0x{b:02X}>"] for b in sym[i].encode()])
        i = nxt[i]
    return out


def _write_spm_gguf(path: Path) -> dict[str, int]:
    """A tiny llama-type (SPM) vocabulary with byte fallback, a user-defined and a turn-end token."""
    pieces = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
    pieces += [(f"<0x{b:02X}>", 6) for b in range(256)]
    # best score first: "▁hello" forms as ll, he, ▁he, llo, ▁hello; "▁h" exists but loses to "he"
    pieces += [(p, 1) for p in ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "ll", "he", "▁he",
                                "llo", "▁hello", "or", "▁w", "▁wor", "ld", "▁world", "▁a", "▁b", "▁h"]]
    pieces += [("<tag>", 4), ("<|im_end|>", 1)]  # <|im_end|> typed NORMAL on purpose
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-spm")
    w.add_tokenizer_model("llama")
    w.add_token_list([p for p, _ in pieces])
    w.add_token_types([t for _, t in pieces])
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {p: i for i, (p, _) in enumerate(pieces)}


def test_spm_tokenizer_on_synthetic_vocab(tmp_path):
    path = tmp_path / "spm.gguf"
    ids_of = _write_spm_gguf(path)
    tok = GGUFTokenizer.from_gguf(str(path))
    assert tok.model == "llama" and tok.add_bos and tok.add_space_prefix  # llama.cpp SPM defaults
    assert tok.encode("hello world") == [1, ids_of["▁hello"], ids_of["▁world"]]
    # é is not in the vocabulary: byte fallback, and the bytes come back as one character
    ids = tok.encode("hé", add_bos=False)
    assert ids == [ids_of["▁h"], ids_of["<0xC3>"], ids_of["<0xA9>"]]
    assert tok.decode(ids) == " hé"  # pieces concatenated, like llama_token_to_piece
    # user-defined tokens are split out even without parse_special; every fragment after a
    # special token gets its own space prefix
    assert tok.encode("a<tag>b", add_bos=False) == [ids_of["▁a"], ids_of["<tag>"], ids_of["▁b"]]
    # <|im_end|> is forced to a control, end-of-generation token, as llama.cpp does
    assert tok.eog_ids == {2, ids_of["<|im_end|>"]}
    assert tok.encode("<|im_end|>", add_bos=False, parse_special=True) == [ids_of["<|im_end|>"]]
    assert tok.decode([ids_of["▁a"], ids_of["<|im_end|>"]]) == " a"

    vocab = dict(ids_of)
    scores = [0.0] * 259 + [-float(i) for i in range(len(ids_of) - 259)]
    for text in ["hello world", "hellohello", "worldhello wor", "lo ll", "héllo wörld 🙂", "abba"]:
        expect = [1] + spm_reference(("▁" + text).replace(" ", "▁"), vocab, scores)
        assert tok.encode(text) == expect, text


@pytest.mark.gemma
def test_gemma_special_ids_and_eog(gemma_path):
    tok = _load(str(gemma_path))
    assert tok.n_vocab == 262144 and tok.model == "llama"
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_space_prefix) == (2, 1, True, False)
    assert tok.token_text(106) == "<end_of_turn>"
    assert {1, 106} <= tok.eog_ids
    assert tok.chat_template is None  # this GGUF ships without one
    assert tok.encode("<start_of_turn>user", add_bos=False, parse_special=True)[0] == 105
    assert 105 not in tok.encode("<start_of_turn>user", add_bos=False)
    # "\n\n" and runs of spaces are user-defined tokens, split out before the SPM merges
    assert tok.token_text(108) == "\n\n" and 108 in tok.encode("a\n\nb")


@pytest.mark.gemma
def test_gemma_matches_llama_cpp_spm_algorithm(gemma_path):
    """The score-ranked merges built at load time behave exactly like llama.cpp's SPM loop."""
    from meshnet.model.gguf_file import open_gguf
    from meshnet.tokenizer_vocab import GGUFMetadata  # scores are not public API

    tok = _load(str(gemma_path))
    scores = GGUFMetadata(open_gguf(gemma_path)).numbers(gguf.Keys.Tokenizer.SCORES).tolist()
    vocab = {tok.token_text(i): i for i in range(tok.n_vocab - 1, -1, -1)}
    rng = np.random.default_rng(0)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"-_()[]{}<>/@#$%&*\t"
                    "éèüßçñøœ北京欢迎你日本語한국어ÀÉ🙂👍\u200d\u00a0")
    texts = [p["prompt"] for p in load_golden(GEMMA_GOLDEN)["prompts"]]
    texts += ["".join(rng.choice(alphabet, size=int(rng.integers(1, 60)))) for _ in range(150)]
    texts += ["".join(tok.token_text(int(i)).replace("▁", " ")
                      for i in rng.integers(256, tok.n_vocab, size=int(rng.integers(1, 8))))
              for _ in range(150)]
    for text in texts:
        expect: list[int] = []
        for frag in tok._partition(text, parse_special=False):  # user-defined tokens split first
            expect += [frag] if isinstance(frag, int) else spm_reference(frag.replace(" ", "▁"), vocab, scores)
        assert tok.encode(text, add_bos=False) == expect, repr(text)


@pytest.mark.gemma
def test_gemma_roundtrip_and_load_time(gemma_path):
    start = time.perf_counter()
    tok = GGUFTokenizer.from_gguf(str(gemma_path))
    elapsed = time.perf_counter() - start
    # ~2.5 s on a 2-core VM; gguf's stock GGUFReader alone needs > 20 s for this vocabulary
    assert elapsed < 15.0
    for text in ["Hello, world!", "  spaces  and\ttabs\n\n\n", "Crème brûlée 北京欢迎你 🙂", "x" * 200]:
        assert tok.decode(tok.encode(text, add_bos=False)) == text


# --- errors ----------------------------------------------------------------------------------------

def _write_minimal(path: Path, model: str, pre: str | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["1234"]),           # ` ?\p{N}+`: the whole number is one word
    ("llama-bpe", ["123", "4"]),   # `\p{N}{1,3}`
    ("default", ["123", "4"]),     # ... then `[0-9][0-9][0-9]`
    ("falcon", ["123", "4"]),
    ("qwen2", ["1", "2", "3", "4"]),  # `\p{N}`
    ("smollm", ["1", "2", "3", "4"]),
])
def test_pre_tokenizer_digit_splitting_follows_llama_cpp(tmp_path, pre, pieces):
    path = tmp_path / f"{pre}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(["1", "2", "3", "4", "12", "123", "1234", " "])
    w.add_token_merges(["1 2", "12 3", "123 4"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = GGUFTokenizer.from_gguf(str(path))
    assert [tok.token_text(i) for i in tok.encode("1234", add_bos=False)] == pieces


def test_unsupported_tokenizer_model_is_named(tmp_path):
    path = tmp_path / "bert.gguf"
    _write_minimal(path, "bert")
    with pytest.raises(ValueError, match=r"'bert'.*supported: gpt2, llama"):
        GGUFTokenizer.from_gguf(str(path))


def test_unsupported_pre_tokenizer_is_named(tmp_path):
    path = tmp_path / "pre.gguf"
    _write_minimal(path, "gpt2", pre="no-such-pre")
    with pytest.raises(ValueError, match=r"'no-such-pre'.*smollm"):
        GGUFTokenizer.from_gguf(str(path))


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        GGUFTokenizer.from_gguf(str(GOLDEN_DIR / "models" / "does-not-exist.gguf"))
