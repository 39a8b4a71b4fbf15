"""Incremental detokenization with stop strings, for streaming text that is always safe to show.

Text is released only when it is complete UTF-8 (a character split across tokens is held back) and
cannot be the start of a stop string; once a stop string appears, nothing from it onwards is released (or,
with `include_stop`, nothing after it).
"""

from __future__ import annotations

from collections.abc import Sequence

from app.engine.model.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """Turns the generated ids of one request into text deltas, watching for stop strings."""

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop: bool = False, skip_special: bool = True
    ) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._skip_special = skip_special
        self._armed_at = 0  # a stop string counts only if it ends past this index of the text (min_tokens)
        self._ids: list[int] = []
        self._text = ""  # everything decoded so far that is complete UTF-8
        self._released = 0  # how much of _text the caller has received
        self._prefix = 0  # ids[_prefix:_read] were decoded last time, as context for the next token
        self._read = 0
        self.stopped_at: int | None = None  # index in `text` where a stop string begins (ends, with include_stop)
        self._step_start = 0  # where the text released since the last push begins
        self._step_ends: list[int] = []  # per id of the last push: how much text was decoded once it was in

    @property
    def text(self) -> str:
        """The generated text so far, ending before any stop string."""
        return self._text if self.stopped_at is None else self._text[: self.stopped_at]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, new_ids: Sequence[int], armed: int = 0) -> tuple[str, int]:
        """Add generated ids; return (text newly safe to release, how many of `new_ids` to keep).

        Fewer ids are kept than were given only when a stop string ended inside them: the ids after
        the one that completed it are dropped. Stop strings count from `new_ids[armed]` on (min_tokens):
        one that ends in the text of the ids before it ends nothing, now or later.
        """
        self._step_start, self._step_ends = self._released, []
        if self.stopped_at is not None:
            return "", 0
        keep = len(new_ids)
        for i in range(len(new_ids)):
            self._ids.append(new_ids[i])
            # Decode a short window that starts one token back (as TGI does): decoders that strip or
            # merge at token boundaries see the same context as a full decode, at constant cost.
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            if len(after) > len(before) and not after.endswith(_INCOMPLETE):
                self._text += after[len(before) :]
                self._prefix, self._read = self._read, len(self._ids)
            self._step_ends.append(len(self._text))
            if i < armed:
                self._armed_at = len(self._text)
            elif self._stop and self._find_stop():
                keep = i + 1
                break
        return self._release(final=False), keep

    def _find_stop(self) -> bool:
        longest = max(len(s) for s in self._stop)
        window_start = max(0, self._released - longest)
        # (start, end) of the first occurrence of each stop string that ends past the armed point
        hits = [
            (i, i + len(s))
            for s in self._stop
            if (i := self._text.find(s, max(window_start, self._armed_at - len(s) + 1))) >= 0
        ]
        if hits:
            start, end = min(hits)
            self.stopped_at = end if self._include_stop else start
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

    def pieces(self, count: int) -> list[str]:
        """The text released since the last push (with a flush after it, if any) shared among that step's `count`
        tokens, for one event per token: each gets the text up to where its own decoding ends, clamped to what
        was released, and the last the rest; so the pieces add up to exactly the released text. Tokens past
        those pushed (an end-of-sequence token, a stop token whose text is not shown) get what is left."""
        start, end = self._step_start, self._released
        released = self.text[start:end]
        cursor, out = start, []
        for i in range(count):
            decoded = self._step_ends[i] if i < len(self._step_ends) else end
            cut = end if i == count - 1 else min(max(decoded, cursor), end)
            out.append(released[cursor - start : cut - start])
            cursor = cut
        return out

    def flush(self) -> str:
        """The rest of the text at the end of generation, including a trailing undecodable byte."""
        if self.stopped_at is None:
            before = self._decode(self._ids[self._prefix : self._read])
            self._text += self._decode(self._ids[self._prefix :])[len(before) :]
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)
