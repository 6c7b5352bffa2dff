"""Special tokens of a GGUF vocabulary: which texts llama.cpp treats as control / end-of-generation,
and splitting a text at special-token texts before BPE (``tokenizer_st_partition`` in llama.cpp's
``src/llama-vocab.cpp``).
"""

from __future__ import annotations

# Token texts llama.cpp recognises by name (llama_vocab::impl::load).

# Tokens that end generation.  "</s>" is deliberately absent: recent llama.cpp lists it for one OCR
# model, but in Gemma 3 it is the HTML strikethrough tag, not a turn end.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
    "<｜end▁of▁sentence｜>",
})
# Fill-in-the-middle pad/repo/file-separator tokens also end generation in llama.cpp.
FIM_EOG_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
})
# Tokens llama.cpp forces to CONTROL even when the GGUF typed them otherwise, which hides them in
# detokenized text and makes them special-only in tokenization.
FORCED_CONTROL_TEXTS = EOG_TEXTS | FIM_EOG_TEXTS | frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
})

_ASCII_SPACE = " \t\n\v\f\r"  # C isspace(), used by llama.cpp for lstrip/rstrip token attributes


class SpecialTokens:
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


    def partition(self, text: str) -> list[str | int]:
        """Split ``text`` into raw-text fragments (``str``) and special-token ids (``int``), in text
        order, matching the longest special text first; a token with the rstrip attribute also eats
        the C ``isspace`` characters after it."""
        fragments: list[str | int] = [text]
        for tid, tok_text, rstrip in self.present_in(text):
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
