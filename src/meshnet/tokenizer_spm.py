"""SentencePiece-style BPE for GGUF ``tokenizer.ggml.model == "llama"`` vocabularies (Llama 2, Gemma).

llama.cpp merges, at every step, the adjacent pair whose concatenation is the highest-scoring
vocabulary piece (``tokenizer.ggml.scores``). That is ordinary rank-based BPE once every split
``(l, r)`` of every piece ``l + r`` becomes a merge ranked by the piece's score, which is how
:func:`spm_merges` derives the merges (the same construction as transformers' GGUF converter); the
BPE then runs in Hugging Face ``tokenizers`` with byte fallback.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, models, normalizers

SPIECE_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

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


def spm_merges(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> list[tuple[str, str]]:
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
        return spm_merges_exact(tokens, scores, vocab)
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


def spm_merges_exact(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Slow, obviously-correct version of :func:`spm_merges`."""
    found = []
    for tid, piece in enumerate(tokens):
        for i in range(1, len(piece)):
            if piece[:i] in vocab and piece[i:] in vocab:
                found.append((-float(scores[tid]), tid, i))
    found.sort()
    return [(tokens[t][:i], tokens[t][i:]) for _, t, i in found]



def spm_tokenizer(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> Tokenizer:
    """The ``tokenizers`` BPE model for an SPM vocabulary.

    Args:
        tokens: piece texts by id (``n_vocab`` strings).
        scores: ``[n_vocab]`` float32 piece scores, higher merges first.
        vocab: piece text -> id.

    Spaces are rewritten to :data:`SPIECE_SPACE` before the BPE; text with no piece falls back to
    the ``<0xNN>`` byte tokens.
    """
    merges = spm_merges(tokens, scores, vocab)
    bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False)
    hf = Tokenizer(bpe)
    hf.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    return hf
