"""Incremental detokenization: the text of each new token without decoding the whole sequence again.

Decoding token by token is wrong for most tokenizers (a byte-level BPE cuts UTF-8 characters across
tokens, SentencePiece drops the leading space of the first token of a decode, merges can change the
text at a boundary), and decoding the whole sequence at every token costs its length each time. So each
new token is decoded together with a short window of the tokens before it, and the text the window
decoded to without the new token(s) is cut off the front: what is left is the new text. The window
restarts after every piece of text released; while the tail decodes to a replacement character (an
incomplete UTF-8 sequence), nothing is released and the window grows until the character is whole.
At the end, :meth:`IncrementalDecoder.flush` releases whatever is left, replacement characters included,
so the pieces always add up to ``tokenizer.decode(tokens, skip_special_tokens=True)`` of tokens that
decode independently at a window boundary (true of byte-level and SentencePiece tokenizers).
"""

from __future__ import annotations

from typing import Any

#: Tokens decoded before the released ones, for the context a boundary needs (a leading space, a merge).
LOOKBACK = 4
_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """One sequence's tokens in, its text out piece by piece (:meth:`push`, then :meth:`flush`)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._start = 0  # first token of the window decoded for context
        self._released = 0  # tokens whose text has been released

    def _decode(self, tokens: list[int]) -> str:
        text: str = self._tokenizer.decode(tokens, skip_special_tokens=True)
        return text

    def push(self, token: int) -> str:
        """Add ``token``; the new text it completes ("" while a character is still incomplete)."""
        self._tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is still held back (an incomplete character at the very end comes out as is)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._released == len(self._tokens):
            return ""
        before = self._decode(self._tokens[self._start : self._released])
        after = self._decode(self._tokens[self._start :])
        if not final and (len(after) <= len(before) or after.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or a character cut between tokens: wait for the next one
        # Text before the window's new tokens already went out; should the new token have changed it
        # (a merge across the boundary), what was sent stands and only the new length counts.
        piece = after[len(before) :]
        self._released = len(self._tokens)
        self._start = max(0, self._released - LOOKBACK)
        return piece
