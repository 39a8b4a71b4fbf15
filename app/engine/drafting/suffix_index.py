"""A bounded index of token sequences that a lookup drafts from: what the server wrote, a request's own text, or
the text a request predicted.

Every position of every indexed sequence is filed under the two tokens before it (its anchor). A lookup takes the
context's last two tokens, examines the most recent occurrences of that anchor, measures how far back each agrees
with the context (up to `MAX_MATCH` tokens: the match length, the lookup's confidence) and proposes what followed
the longest one, the most recent on a tie. This is prompt lookup's rule (the latest match wins) made to measure its
own evidence: a 2-token match after a common pair is a guess, a 20-token match inside a resent tool schema is
nearly certain, and the draft length follows from that (app.engine.drafting.draft_length calibrates each source's
acceptance per match length).

Why a hashed anchor table rather than a suffix tree or automaton: one dict lookup and a few backward comparisons
per step cost microseconds in Python, a sequence is added or evicted in one pass over its tokens, and the memory
per token is a packed int in a list (SuffixDecoding's suffix tree needs a node per distinct suffix and per-node
counts, which in Python objects cost several times more per token for no better drafts at these match lengths).

`SuffixIndex.bytes` counts what the lists, ints and dict entries hold (checked against tracemalloc in the tests);
`TrafficIndex` keeps the server's answers within `max_bytes`, evicting whole answers least recently used first (a
lookup that drafts from an answer makes it the most recent), each tenant owed a share of it. Not thread-safe: the
worker thread alone adds and looks up; gauges read plain ints.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from app.engine.defaults import DEFAULT_TENANT_CACHE_SHARE

# The anchor: tokens a match shares at least, the key of the table.
ANCHOR = 2
# How far back a match is measured; past this a longer match says no more.
MAX_MATCH = 32
# The most recent occurrences of an anchor a lookup examines, and the most an anchor keeps (older ones fall out:
# a common pair's oldest occurrences are the least likely to be the best match).
_EXAMINED = 8
_KEPT = 32
# Token ids are packed two to a key and with a sequence id to an occurrence; ids below 2**24 (every vocabulary
# we load is far smaller) keep the packing exact.
_TOKEN_BITS = 24
_POSITION_BITS = 32
_POSITION_MASK = (1 << _POSITION_BITS) - 1
# Bytes the accounting charges, from CPython's object sizes: a sequence's array and its entry; an occurrence's
# packed int and list slot; an anchor's dict entry, key int and list (with its over-allocation).
_SEQUENCE_BYTES = 160
_TOKEN_BYTES = 4
_OCCURRENCE_BYTES = 40
_ANCHOR_BYTES = 200


@dataclass(frozen=True)
class Match:
    """What followed the best occurrence of the context's end: `tokens`, and `length`, how many tokens of the
    context that occurrence shares (ANCHOR..MAX_MATCH; 0 for a prediction's start, which nothing precedes)."""

    tokens: list[int]
    length: int
    sequence: int = -1  # the id of the sequence it came from
    position: int = 0  # where in it `tokens` start


def index_bytes(tokens: int) -> int:
    """The most bytes a sequence of `tokens` tokens may be charged in an index (what memory admission counts for a
    request's prediction)."""
    return _SEQUENCE_BYTES + tokens * (_TOKEN_BYTES + _OCCURRENCE_BYTES + _ANCHOR_BYTES)


def _key(a: int, b: int) -> int:
    return (a << _TOKEN_BITS) | b


class SuffixIndex:
    """Token sequences filed by anchor, with the bytes they hold (`TrafficIndex` keeps a budget over them)."""

    def __init__(self) -> None:
        self._sequences: dict[int, array] = {}
        self._table: dict[int, list[int]] = {}  # anchor -> packed (sequence, position), oldest first
        self._next_id = 0
        self.bytes = 0
        self.tokens = 0

    @property
    def sequences(self) -> int:
        return len(self._sequences)

    def add(self, tokens: Sequence[int]) -> int:
        """Index a whole sequence (a finished answer); its id."""
        sid = self.open()
        self.extend(sid, tokens)
        return sid

    def open(self) -> int:
        """A new empty sequence, to `extend` as its text grows."""
        sid = self._next_id
        self._next_id += 1
        self._sequences[sid] = array("i")
        self.bytes += _SEQUENCE_BYTES
        return sid

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `sid`, filing each new position under the two tokens before it."""
        seq = self._sequences[sid]
        start = len(seq)
        seq.extend(tokens)
        table = self._table
        base = sid << _POSITION_BITS
        added = 0
        for pos in range(max(start, ANCHOR), len(seq)):
            key = _key(seq[pos - 2], seq[pos - 1])
            occurrences = table.get(key)
            if occurrences is None:
                table[key] = [base | pos]
                self.bytes += _ANCHOR_BYTES
            else:
                if len(occurrences) >= _KEPT:
                    del occurrences[0]
                    self.bytes -= _OCCURRENCE_BYTES
                occurrences.append(base | pos)
            added += 1
        self.bytes += added * _OCCURRENCE_BYTES + (len(seq) - start) * _TOKEN_BYTES
        self.tokens += len(seq) - start

    def last(self, sid: int) -> int | None:
        """The last token of sequence `sid` (None: it is empty)."""
        seq = self._sequences[sid]
        return seq[-1] if seq else None

    def remove(self, sid: int) -> None:
        """Forget sequence `sid` and every occurrence filed for it."""
        seq = self._sequences.pop(sid)
        table = self._table
        base = sid << _POSITION_BITS
        for pos in range(ANCHOR, len(seq)):
            key = _key(seq[pos - 2], seq[pos - 1])
            occurrences = table.get(key)
            if occurrences is None:
                continue
            try:
                occurrences.remove(base | pos)
            except ValueError:  # it had fallen out of a common anchor's list already
                continue
            self.bytes -= _OCCURRENCE_BYTES
            if not occurrences:
                del table[key]
                self.bytes -= _ANCHOR_BYTES
        self.bytes -= _SEQUENCE_BYTES + len(seq) * _TOKEN_BYTES
        self.tokens -= len(seq)

    def match(self, context: Sequence[int], k: int, floor: int = ANCHOR) -> Match | None:
        """Up to `k` tokens that followed the best occurrence of the end of `context` (the longest agreement
        with it, the most recent on a tie); None when no occurrence agrees on at least `floor` tokens or none has
        a token after it."""
        n = len(context)
        if k <= 0 or n < ANCHOR:
            return None
        occurrences = self._table.get(_key(context[-2], context[-1]))
        if not occurrences:
            return None
        best_sid, best_pos, best_len = -1, 0, 0
        for packed in reversed(occurrences[-_EXAMINED:]):
            sid, pos = packed >> _POSITION_BITS, packed & _POSITION_MASK
            seq = self._sequences[sid]
            limit = min(MAX_MATCH, pos, n)
            m = ANCHOR
            while m < limit and seq[pos - 1 - m] == context[n - 1 - m]:
                m += 1
            if m > best_len:
                best_sid, best_pos, best_len = sid, pos, m
                if m == MAX_MATCH:
                    break
        if best_len < floor:
            return None
        seq = self._sequences[best_sid]
        if best_pos >= len(seq):
            return None
        return Match(seq[best_pos : best_pos + k].tolist(), best_len, best_sid, best_pos)


class TrafficIndex:
    """The answers the server wrote, one `SuffixIndex` per tenant under one memory budget.

    A tenant is the request's `cache_salt` (None: the shared default): a lookup reads its own tenant's answers
    only, so one tenant's text never changes how fast another's comes (a cross-request index, like the prefix
    cache, is otherwise a timing side channel). Each answer is filed with the prompt's last `CONTEXT` tokens
    before it, so that a new answer's first tokens can match after the same chat-template tail. The least
    recently used answers go first; each tenant is owed `tenant_share` (0 < share <= 1) of `max_bytes`, so one
    tenant cannot evict everyone: a tenant whose answer overflows the index while it holds more than its share
    loses its own least recently used answers, never another tenant's; otherwise the tenant holding the most
    loses its least recently used (a tenant alone may fill the whole index). `lookups` and `hits` count what the
    metrics show."""

    CONTEXT = 8

    def __init__(self, max_bytes: int, tenant_share: float = DEFAULT_TENANT_CACHE_SHARE) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be 0 or more")
        if not 0 < tenant_share <= 1:
            raise ValueError("tenant_share must be above 0 and at most 1")
        self.max_bytes = max_bytes
        self.tenant_share = tenant_share
        self._tenants: dict[str | None, SuffixIndex] = {}
        self._order: dict[str | None, OrderedDict[int, None]] = {}  # per tenant, its sequences least recent first
        self.lookups = 0
        self.hits = 0

    @property
    def bytes(self) -> int:
        return sum(index.bytes for index in self._tenants.values())

    @property
    def sequences(self) -> int:
        return sum(len(order) for order in self._order.values())

    @property
    def tokens(self) -> int:
        return sum(index.tokens for index in self._tenants.values())

    def add(self, tenant: str | None, token_ids: Sequence[int], prompt_len: int) -> None:
        """File a finished request's answer (token_ids[prompt_len:], after the prompt's last CONTEXT tokens)."""
        answer = token_ids[max(0, prompt_len - self.CONTEXT) :]
        if len(token_ids) - prompt_len < 1 or index_bytes(len(answer)) > self.max_bytes:
            return  # nothing written, or more than the whole budget (which would evict every other answer)
        sid = self._tenants.setdefault(tenant, SuffixIndex()).add(answer)
        self._order.setdefault(tenant, OrderedDict())[sid] = None
        self._evict(tenant)

    def match(self, tenant: str | None, context: Sequence[int], k: int) -> Match | None:
        """What followed the best occurrence of the end of `context` in `tenant`'s answers."""
        index = self._tenants.get(tenant)
        self.lookups += 1
        found = index.match(context, k) if index is not None else None
        if found is not None:
            self.hits += 1
            self._order[tenant].move_to_end(found.sequence)  # what drafts is what stays
        return found

    def _evict(self, writer: str | None) -> None:
        total = self.bytes
        while total > self.max_bytes and self._order:
            tenant = writer
            held = self._tenants[writer].bytes if writer in self._tenants else 0
            if held <= self.tenant_share * self.max_bytes:
                tenant = max(self._tenants, key=lambda t: self._tenants[t].bytes)
            index, order = self._tenants[tenant], self._order[tenant]
            sid, _ = order.popitem(last=False)
            before = index.bytes
            index.remove(sid)
            total -= before - index.bytes
            if not order:
                del self._tenants[tenant], self._order[tenant]
