"""Detokenizing generated ids one at a time without ever emitting half a UTF-8 character."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshnet.tokenizer import GGUFTokenizer


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
