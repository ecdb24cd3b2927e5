"""Incremental detokenization: the text each new output token adds, never half a character.

A byte-level tokenizer may split one UTF-8 character over several tokens; decoding a prefix
that ends inside such a character gives U+FFFD. The detokenizer decodes a short window of
recent tokens twice (with and without the new ones) and hands out the difference only when
it does not end in U+FFFD; otherwise the bytes wait for the tokens that complete them.
Decoding a window rather than the whole output keeps each step O(window), and the window
always starts at a token boundary that was already emitted, so the text a tokenizer adds
for a token in context (a leading space, a merged byte sequence) is the same as in a full
decode. `finish` reconciles with one full decode, so the deltas always add up to exactly
`tokenizer.decode(output_token_ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    tokenizer: a transformers tokenizer (anything with `decode(ids, skip_special_tokens=)`).
    Call `add(new_token_ids)` as tokens arrive and `finish()` once at the end.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""          # everything handed out so far
        self._prefix_offset = 0  # window start: decoded only for context
        self._read_offset = 0    # tokens before this index are reflected in `text`

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is split)."""
        self.token_ids.extend(int(t) for t in new_token_ids)
        if self.tokenizer is None:
            return ""
        window = self.token_ids[self._prefix_offset:]
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT) \
                or not new_text.startswith(prefix_text):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The text not handed out yet, so that all deltas equal one full decode (a split
        character at the very end comes out as U+FFFD, as a full decode gives it)."""
        if self.tokenizer is None:
            return ""
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            delta = full[len(self.text):]
            self.text = full
            return delta
        # The windowed decode disagreed with a full one (a tokenizer whose decoding of a
        # token depends on more than one token of context); what was sent stays sent.
        return ""
