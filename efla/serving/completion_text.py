"""``CompletionText``: a request's new tokens turned into text as they come, cut at its stop strings.

Tokens are decoded incrementally by the tokenizers library's ``DecodeStream`` (constant work per
token; a character split over several byte-level tokens appears when complete). Text that could be
the start of a stop string is held back until the next tokens decide, so a streamed response never
shows a stop string or part of one. When the request ends, the text is the tokenizer's decoding of
all its tokens (cut at the first stop string), and the streamed pieces always join to it.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

__all__ = ["CompletionText"]


class CompletionText:
    """The text of one request's new tokens (special tokens skipped), cut at the first of ``stop``."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._stream = DecodeStream(skip_special_tokens=True)
        self.text = ""
        self.sent = 0  # characters handed out so far
        self.stopped = False  # a stop string was found (the text ends before it)

    def add(self, token: int) -> None:
        piece = self._stream.step(self.tokenizer.backend_tokenizer, token)
        if piece:
            searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
            self.text += piece
            self._cut_at_stop(searched_from)

    def ready(self) -> str:
        """The text not handed out yet that no stop string can still claim."""
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        return self._take(end)

    def finish(self, tokens: list[int]) -> str:
        """The rest of the text once the request ended after ``tokens`` (all its new tokens)."""
        if not self.stopped:
            self.text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            self._cut_at_stop(0)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def _cut_at_stop(self, searched_from: int) -> None:
        found = [i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def _held_back(self) -> int:
        """The length of the longest end of the text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
