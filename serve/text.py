"""Incremental detokenization with stop strings, for streaming.

Re-decodes the whole output at every token (outputs are bounded by max_tokens), holds back text
that ends in an incomplete UTF-8 character or that could be the start of a stop string, and cuts
the text at the first stop string. A stop token id that ends the generation (`stop_ids`) counts as
a token but is not part of the text (vLLM's default)."""

from __future__ import annotations


class TextTracker:
    """Turns a sequence's tokens into text deltas; `add` returns (new text, finish reason)."""

    def __init__(self, tokenizer, stops: list[str] = (), stop_ids=()):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.stop_ids = frozenset(stop_ids)
        self.hidden = 0  # 1 once a stop token id ended the generation: the last id is not decoded
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def add(self, token: int | None, finish_reason: str | None) -> tuple[str, str | None]:
        """Feeds one engine event; the reason is "stop" when a stop string appears."""
        if token is not None:
            self.ids.append(token)
            self.hidden = int(finish_reason == "stop" and token in self.stop_ids)
        full = self.tokenizer.decode(self.ids[: len(self.ids) - self.hidden])
        cut = self._first_stop(full)
        if cut is not None:
            return self._emit(full[:cut], cut), "stop"
        if finish_reason is not None:
            return self._emit(full, len(full)), finish_reason
        if full.endswith("\ufffd"):
            return "", None
        return self._emit(full, len(full) - self._held_back(full)), None

    def _emit(self, full: str, upto: int) -> str:
        self.text = full[:max(upto, self.sent)]
        delta = full[self.sent:upto]
        self.sent = max(self.sent, upto)
        return delta

    def _first_stop(self, text: str) -> int | None:
        hits = [text.find(stop) for stop in self.stops if stop in text]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    longest = max(longest, size)
                    break
        return longest
