"""The conductor's tokenizer: UTF-8 bytes as token ids, and back.

No tokenizer is downloaded. The engine presets (`tiny`, `bench`) have random weights and
no vocabulary of their own, so the honest mapping of text is its bytes: token id = byte
value (0..255). Engines sample ids from their whole vocabulary; an id outside 0..255 has
no text and is shown as U+FFFD, the replacement character, as is an invalid UTF-8 sequence.
Clients that care about exact output read the token ids the API returns beside the text.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

REPLACEMENT = "\ufffd"
NUM_BYTES = 256


class ByteTokenizer:
    """Text to UTF-8 byte ids and back; stateless."""

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`, one token id each."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`; ids outside 0..255 and invalid UTF-8 become U+FFFD."""
        return Detokenizer().feed(token_ids, final=True)


class Detokenizer:
    """Incremental `ByteTokenizer.decode` for a stream: a multi-byte character split across
    chunks is emitted once its last byte arrives, never as two replacement characters."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text completed by `token_ids`; `final` flushes a dangling partial character."""
        parts = []
        for token in token_ids:
            if 0 <= token < NUM_BYTES:
                parts.append(self._utf8.decode(bytes((token,))))
            else:
                parts.append(self._utf8.decode(b"", final=True) + REPLACEMENT)
        if final:
            parts.append(self._utf8.decode(b"", final=True))
        return "".join(parts)
