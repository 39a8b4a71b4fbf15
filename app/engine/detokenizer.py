"""Incremental detokenization with stop strings, for streaming text that is always safe to show.

Text is released only when it is complete UTF-8 (a character split across tokens is held back) and
cannot be the start of a stop string; once a stop string appears, nothing from it onwards is released.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.engine.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """Turns the generated ids of one request into text deltas, watching for stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._text = ""  # everything decoded so far that is complete UTF-8
        self._released = 0  # how much of _text the caller has received
        self._prefix = 0  # ids[_prefix:_read] were decoded last time, as context for the next token
        self._read = 0
        self.stopped_at: int | None = None  # index in `text` where a stop string begins

    @property
    def text(self) -> str:
        """The generated text so far, ending before any stop string."""
        return self._text if self.stopped_at is None else self._text[: self.stopped_at]

    def push(self, new_ids: Sequence[int]) -> tuple[str, int]:
        """Add generated ids; return (text newly safe to release, how many of `new_ids` to keep).

        Fewer ids are kept than were given only when a stop string ended inside them: the ids after
        the one that completed it are dropped.
        """
        if self.stopped_at is not None:
            return "", 0
        keep = len(new_ids)
        for i in range(len(new_ids)):
            self._ids.append(new_ids[i])
            # Decode a short window that starts one token back (as TGI does): decoders that strip or
            # merge at token boundaries see the same context as a full decode, at constant cost.
            before = self._tok.decode(self._ids[self._prefix : self._read])
            after = self._tok.decode(self._ids[self._prefix :])
            if len(after) > len(before) and not after.endswith(_INCOMPLETE):
                self._text += after[len(before) :]
                self._prefix, self._read = self._read, len(self._ids)
            if self._stop and self._find_stop():
                keep = i + 1
                break
        return self._release(final=False), keep

    def _find_stop(self) -> bool:
        longest = max(len(s) for s in self._stop)
        window_start = max(0, self._released - longest)
        hits = [i for s in self._stop if (i := self._text.find(s, window_start)) >= 0]
        if hits:
            self.stopped_at = min(hits)
            return True
        return False

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stopped_at is None and self._stop:
            # Hold back the longest tail that could still grow into a stop string.
            for s in self._stop:
                for n in range(min(len(s) - 1, end - self._released), 0, -1):
                    if self._text.endswith(s[:n]):
                        end = min(end, len(self._text) - n)
                        break
        delta = self.text[self._released : end] if end > self._released else ""
        self._released = max(self._released, end)
        return delta

    def flush(self) -> str:
        """The rest of the text at the end of generation, including a trailing undecodable byte."""
        if self.stopped_at is None:
            before = self._tok.decode(self._ids[self._prefix : self._read])
            self._text += self._tok.decode(self._ids[self._prefix :])[len(before) :]
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)
