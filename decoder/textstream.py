"""Incremental detokenization with stop sequences.

Text is emitted only when it is final: never a partial UTF-8 character (the decoded tail is
U+FFFD while a multi-byte character is incomplete) and never a tail that might still grow
into a stop sequence. A stop sequence cuts the text before its first occurrence.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; -> newly final text (maybe empty). Sets `stopped` on a stop sequence."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        text = self._decode()
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._take(text, cut)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete
        return self._take(text, len(text) - self._holdback(text))

    def flush(self) -> str:
        """At the end of generation: whatever is left (an incomplete character stays U+FFFD)."""
        if self.stopped:
            return ""
        return self._take(self._decode(), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        out = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def _first_stop(self, text: str) -> int | None:
        # a stop sequence may start up to len(s) - 1 characters before the emitted boundary
        hits = [i for s in self.stop
                if (i := text.find(s, max(0, self.emitted - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop sequence."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
