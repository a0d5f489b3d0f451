"""Incremental detokenisation with stop strings.

Tokens arrive a round at a time; the text a client sees must be what decoding all of
them at once gives, cut before the first stop string. Two things hold text back: a
trailing incomplete UTF-8 character (the tokenizer decodes it as U+FFFD until its last
byte arrives), and a tail that could still grow into a stop string.
"""

from __future__ import annotations

__all__ = ["TextStream"]


class TextStream:
    """The text of a growing token sequence, released as it becomes final.

    Members
    -------
    tokens : list of int
        Every token fed so far.
    stopped : bool
        A stop string was found: the text ends before it and no more is released.
    text : str
        The text released so far.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.tokens: list[int] = []
        self.stopped = False
        self.text = ""

    def _decoded(self) -> str:
        return self._tokenizer.decode(self.tokens, skip_special_tokens=True)

    def feed(self, tokens: list[int]) -> str:
        """Add ``tokens``; the text newly final (empty while held back or once stopped)."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        full = self._decoded()
        # A stop string may start in the text already released, up to _hold chars back.
        search_from = max(0, len(self.text) - self._hold)
        cuts = [i for i in (full.find(s, search_from) for s in self._stop) if i >= 0]
        if cuts:
            self.stopped = True
            return self._release(full[:min(cuts)])
        end = len(full) - self._hold
        while end > len(self.text) and full[end - 1] == "\ufffd":
            end -= 1
        return self._release(full[:end])

    def finish(self) -> str:
        """The text still held back, once no more tokens will come."""
        return "" if self.stopped else self._release(self._decoded())

    def _release(self, final: str) -> str:
        if len(final) <= len(self.text):
            return ""
        delta = final[len(self.text):]
        self.text = final
        return delta
