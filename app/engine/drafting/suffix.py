"""The suffix draft: lookups in everything already written, the request's own text, the text it predicted, and the
answers the server gave before (vLLM's `suffix` method, llama.cpp's context and dynamic n-gram caches).

Three sources, each a `SuffixIndex` (app.engine.drafting.suffix_index):
- `prompt`: the request's own prompt and output so far (prompt lookup: a summary quoting its document, code
  repeating its names, a chat answering in the words of its earlier turns); where no two tokens match, what
  followed the last token's latest occurrence (a match of 1: the target's own choice after that token last time,
  which Token Recycling keeps as its draft; priced apart, it drafts where it pays);
- `prediction`: the text the request said the answer will mostly be (OpenAI's predicted outputs: a code edit's
  file), proposed from its start while the answer follows it from its first token;
- `index`: the server's earlier answers, of the request's tenant only (`TrafficIndex`, which the engine files
  every finished answer in, target-only ones too): agents writing the same JSON shapes turn after turn,
  extraction filling one template a thousand times.

Each lookup is a `Proposal` whose kind names its source and how long its match is (`lookup:index:16`), so that the
adaptive schedule prices each kind with its own measured acceptance: a long match in a resent schema drafts long,
a 2-token match after a common pair drafts little or nothing, and no match costs nothing. A lookup costs
microseconds; the text it proposes is verified by the target like any draft, so the output is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from app.engine.drafting import draft_length
from app.engine.drafting.base import Drafter, DraftSession, Proposal
from app.engine.drafting.suffix_index import ANCHOR, Match, SuffixIndex, TrafficIndex

# The sources, in the order a tie in match length is broken (the prediction was given for this answer; the own
# text is this conversation's; the index is other requests').
SOURCES = ("prediction", "prompt", "index")


def match_bucket(length: int) -> int:
    """The match-length class a lookup's acceptance is calibrated in: 0 (a prediction's start), 1 (the own text's
    last token alone), 2, 4, 8, 16, 32."""
    if length <= 1:
        return max(length, 0)
    bucket = 2
    while bucket < length and bucket < 32:
        bucket *= 2
    return bucket


def lookup_kind(source: str, length: int) -> str:
    """The draft kind of a lookup from `source` with a match of `length` tokens (draft_length prices each)."""
    return draft_length.lookup_kind(source, match_bucket(length))


class _SuffixSession(DraftSession):
    looks_up: ClassVar[bool] = True  # lookups and nothing else (`model` None)

    def __init__(self, drafter: SuffixDrafter) -> None:
        super().__init__()
        self._d = drafter
        self._own = SuffixIndex()
        self._own_id = self._own.open()  # the request's sequence, filed as far as `_own.tokens`
        self._prediction: list[int] = []
        self._predicted = SuffixIndex()
        # Token -> the position after its latest occurrence in the own text (whose successor is written): the
        # one-token fallback of the `prompt` source.
        self._after: dict[int, int] = {}
        self._prompt_len = 0
        self._tenant: str | None = None
        self._history = True  # whether the index of other requests' answers is read
        self.used_lookup = True

    def start(self, prompt_len: int, tenant: str | None, prediction: Sequence[int], history: bool = True) -> None:
        self._prompt_len = prompt_len
        self._history = history
        self._tenant = tenant
        self._prediction = list(prediction)
        if self._prediction:
            self._predicted.add(self._prediction)

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        return self.lookup(token_ids, k)

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        found = self.proposals(token_ids, k)
        if not self._d.one_token:
            found = [p for p in found if p.match != 1]
        if not found:
            self.last_kind = "lookup"
            return []
        # Without the schedule's prices (a batch's length, a fixed one): the longest match, the first source on a tie.
        best = max(found, key=lambda p: p.match)
        self.last_kind = best.kind
        return best.tokens

    def proposals(self, token_ids: Sequence[int], k: int) -> list[Proposal]:
        if k <= 0 or len(token_ids) < ANCHOR:
            return []
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        self._catch_up(ids)
        found: list[Proposal] = []
        for source in SOURCES:
            match = self._match(source, ids, k)
            if match is None or not match.tokens:
                continue
            tokens = match.tokens
            if self.grammar is not None:  # what was written may not follow the grammar here
                tokens = tokens[: self.grammar.valid_prefix(tokens)]
            if tokens:
                found.append(Proposal(tokens, lookup_kind(source, match.length), match.length))
        return found

    def _match(self, source: str, ids: list[int], k: int) -> Match | None:
        if source == "prompt":
            match = self._own.match(ids, k)
            if match is None:
                match = self._after_last(ids, k)
            if match is not None and len(match.tokens) < k and match.position + len(match.tokens) == len(ids):
                # The match runs into the end of the text: the text repeats with period len(ids) - position (a
                # loop, a list), and what follows it is that period again.
                period = match.tokens
                tokens = [period[i % len(period)] for i in range(k)]
                match = Match(tokens, match.length, match.sequence, match.position)
            return match
        if source == "index":
            if self._d.traffic is None or not self._history:
                return None
            return self._d.traffic.match(self._tenant, ids, k)
        if not self._prediction:
            return None
        # The answer's first tokens follow the prediction's: proposed from its start, before an anchor can match.
        written = len(ids) - self._prompt_len
        if 0 <= written < ANCHOR and ids[self._prompt_len :] == self._prediction[:written]:
            return Match(self._prediction[written : written + k], written)
        return self._predicted.match(ids, k)

    def _after_last(self, ids: list[int], k: int) -> Match | None:
        """What followed the latest earlier occurrence of the last token of `ids` (up to `k` tokens; a match of
        length 1), None where it did not occur before."""
        at = self._after.get(ids[-1])
        return None if at is None else Match(ids[at : at + k], 1, self._own_id, at)

    def _catch_up(self, ids: list[int]) -> None:
        """File the tokens of `ids` not yet in the own-text index (the accepted sequence only grows)."""
        seen = self._own.tokens
        if seen > len(ids) or (seen and ids[seen - 1] != self._own.last(self._own_id)):
            # Not the sequence indexed so far (never, in a generation, whose accepted sequence only grows).
            self._own = SuffixIndex()
            self._own_id, seen = self._own.open(), 0
            self._after = {}
        if seen < len(ids):
            self._own.extend(self._own_id, ids[seen:])
            after = self._after
            for pos in range(max(seen, 1), len(ids)):
                after[ids[pos - 1]] = pos


class SuffixDrafter(Drafter):
    """Lookups in the request's own text, its prediction and the tenant's earlier answers (`traffic`: the engine's
    index, None: none kept). `one_token`: whether a session's `lookup` (the choice without the adaptive schedule's
    prices) drafts from a match of the last token alone; `proposals` gives every match, for the schedule to price."""

    def __init__(self, name: str = "suffix", traffic: TrafficIndex | None = None, one_token: bool = True) -> None:
        self.name = name
        self.traffic = traffic
        self.one_token = one_token

    def session(self, capacity: int) -> DraftSession:
        return _SuffixSession(self)
