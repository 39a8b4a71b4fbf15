"""Proposers: what suggests the next k tokens for the target to verify.

A `Drafter` is loaded once and shared; each request gets its own `DraftSession`, which holds any per-
request state (a draft KV cache) and keeps it in step with the accepted sequence by rolling back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from app.engine.defaults import MAX_DRAFT_TOKENS
from app.engine.grammar import GrammarState
from app.engine.loading import LoadedModel
from app.engine.model import KVCache
from app.engine.penalties import Penalty
from app.engine.sampling import GumbelNoise, SamplingParams, argmax, gumbel_choice, sample, warp
from app.engine.tree import Candidates, CandidateSession, DraftTree, build_tree

# What a sampled draft draws with: the target's Gumbel noise (coupled sampling, exact-match verification) or
# a generator (rejection sampling).
Randomness = GumbelNoise | torch.Generator | None


class DraftError(ValueError):
    """A draft that cannot serve this target."""


class DraftSession(Protocol):
    """Per-request proposer state. What more a session can do is told by the capability protocols below,
    checked with isinstance: `SamplingSession` (samples), `FeatureSession` (reads the target's states)."""

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        """Up to `k` tokens likely to follow `token_ids` (the whole accepted sequence so far); a model draft
        stops early when its top probability falls below `p_min`."""
        ...


@runtime_checkable
class SamplingSession(Protocol):
    """A session that can sample. One that cannot is deterministic under sampling too (one-hot q), which both
    exact-match and rejection verification allow."""

    def propose_sampled(
        self, token_ids: Sequence[int], k: int, params: SamplingParams, rng: Randomness, p_min: float = 0.0
    ) -> tuple[list[int], Tensor | None]:
        """Up to `k` tokens drawn with `rng` (the request's Gumbel noise or generator) and, with a generator,
        the warped distributions they were drawn from [len(tokens), target vocab] (None with Gumbel noise)."""
        ...


@runtime_checkable
class FeatureSession(Protocol):
    """A session that conditions on the target's hidden states: the generation writes the target's final
    hidden state of each position into `features` [capacity, dim] as soon as it is verified (None: a session
    that may hold a feature draft but does not)."""

    features: Tensor | None


@runtime_checkable
class PenalizedSession(Protocol):
    """A session whose proposals go through the request's penalties (`penalty`, set by the generation; None:
    none), so that the draft proposes what the penalised target would choose."""

    penalty: Penalty | None


@runtime_checkable
class ConstrainedSession(Protocol):
    """A session whose proposals follow the request's grammar (`grammar`, set by the generation; None: none):
    a model draft proposes its best token the grammar allows, and with the grammar's `forcing` a token the
    grammar forces as it is, without counting it against k; a lookup stops at the first token it refuses."""

    grammar: GrammarState | None


@runtime_checkable
class LookupSession(Protocol):
    """A session whose first resort is prompt lookup, a continuation found in the text at next to no cost. A
    generation on the adaptive schedule looks first (`lookup`), then chooses how many of the found tokens are
    worth verifying, and when none are (or nothing was found) how long a draft `model` should make (None: the
    session has nothing but the lookup). `used_lookup`: whether its last proposal was the lookup's."""

    model: DraftSession | None
    used_lookup: bool

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last tokens."""
        ...


class Drafter(Protocol):
    name: str

    def session(self, capacity: int) -> DraftSession:
        """State for one request whose sequence will hold at most `capacity` tokens."""
        ...


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter that drafts greedily for several requests at once, one forward per draft position."""

    def propose_batch(
        self,
        sessions: Sequence[DraftSession],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        p_mins: Sequence[float],
    ) -> list[list[int]]:
        """What each session's `propose(token_ids[i], ks[i], p_mins[i])` gives, for all of them together."""
        ...


def choose_draft_token(
    logits: Tensor,
    params: SamplingParams | None,
    rng: Randomness,
    p_min: float,
    position: int = 0,
    ids: Tensor | None = None,
    penalty: Penalty | None = None,
    drafted: Sequence[int] = (),
    grammar: GrammarState | None = None,
) -> tuple[int, Tensor | None] | None:
    """One drafted token from a draft's `logits` [V'] for sequence `position`: (index into V', None) greedily
    or by the Gumbel-max trick on the target's noise (`rng` a GumbelNoise; `ids` long [V']: the token id of
    each logit, None when logit i is token i), or (index, warped distribution [V']) drawn with a generator,
    the q of rejection sampling. None when the draft's top probability is below `p_min` (the confidence
    cut-off, llama.cpp's --draft-p-min: an unsure guess is more likely rejected than accepted, and each
    further token costs a draft step). `penalty`: the request's penalties, over its accepted sequence plus
    `drafted` (this step's proposals so far). `grammar`: the request's grammar, whose allowed tokens after the
    accepted sequence plus `drafted` are the only ones proposed (None when it allows none of the draft's)."""
    if penalty is not None:
        logits = penalty.apply(logits[None], drafted, ids)[0]
    if grammar is not None:
        allowed = grammar.allowed(drafted)
        if allowed is None:
            return None
        allowed = allowed.to(logits.device) if ids is None else allowed.to(logits.device)[ids]
        if not bool(allowed.any()):
            return None
        logits = torch.where(allowed, logits, torch.tensor(float("-inf"), device=logits.device))
    if params is None or params.greedy:
        choice: tuple[int, Tensor | None] = (int(argmax(logits.float())), None)
    elif isinstance(rng, GumbelNoise):
        choice = (gumbel_choice(logits, params, rng, position, ids), None)
    else:
        probs = warp(logits, params)
        choice = (int(sample(probs, rng)), probs)
    if p_min > 0 and float(torch.softmax(logits.float(), -1).max()) < p_min:
        return None
    return choice


class _ModelDraftSession:
    def __init__(self, drafter: ModelDrafter, capacity: int) -> None:
        self._model = drafter.model
        self._vocab = drafter.vocab_limit
        self._target_vocab = drafter.target_vocab
        # A draft's context can be shorter than the request's: it proposes while the sequence fits it.
        self._cache: KVCache = self._model.new_cache(min(capacity, self._model.config.max_seq_len))
        self._ids: list[int] = []  # the tokens whose keys and values sit in the cache, in order
        self.penalty: Penalty | None = None
        self.grammar: GrammarState | None = None

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        return self._draft(token_ids, k, None, None, p_min)[0]

    def propose_sampled(
        self,
        token_ids: Sequence[int],
        k: int,
        params: SamplingParams,
        rng: Randomness,
        p_min: float = 0.0,
    ) -> tuple[list[int], Tensor | None]:
        """Up to `k` tokens drawn from the draft's warped distributions with `rng`, and with a generator those
        distributions [len(tokens), target vocab], the q of rejection sampling (None with Gumbel noise)."""
        return self._draft(token_ids, k, params, rng, p_min)

    @torch.inference_mode()
    def _draft(
        self,
        token_ids: Sequence[int],
        k: int,
        params: SamplingParams | None,
        rng: Randomness,
        p_min: float,
    ) -> tuple[list[int], Tensor | None]:
        if k <= 0 or len(token_ids) > self._cache.capacity:
            return [], None
        # Roll back to the longest prefix the cache shares with the accepted sequence (an O(1) move),
        # keeping at least one token to feed so the next logits exist.
        keep = 0
        limit = min(len(self._ids), len(token_ids) - 1)
        while keep < limit and self._ids[keep] == token_ids[keep]:
            keep += 1
        self._cache.truncate(keep)
        self._ids = list(token_ids)
        room = self._cache.capacity - len(token_ids)
        # Tokens the grammar forces do not count against k: `limit` bounds them all.
        limit = min(max(k, MAX_DRAFT_TOKENS), room + 1)
        k = min(k, limit)
        feed = torch.tensor([token_ids[keep:]], dtype=torch.long, device=self._model.device)
        pos = keep
        out: list[int] = []
        dists: list[Tensor] = []
        own = 0
        while True:
            hidden = self._model.hidden(feed, pos, self._cache)
            nxt = self.grammar.forced(out) if self.grammar is not None else None
            if nxt is not None:  # no choice to make: the head need not run
                if nxt >= self._vocab:  # a token this draft cannot read
                    break
                probs = one_hot(nxt, self._target_vocab, feed.device) if drawn(params, rng) else None
            else:
                logits = self._model.logits(hidden[0, -1])[: self._vocab]
                choice = choose_draft_token(
                    logits, params, rng, p_min, len(token_ids) + len(out), None, self.penalty, out, self.grammar
                )
                if choice is None:
                    break
                nxt, probs = choice
                own += 1
                if probs is not None:
                    # q must cover the target's whole vocabulary: ids the draft cannot propose have q = 0.
                    probs = torch.nn.functional.pad(probs, (0, self._target_vocab - probs.shape[-1]))
            if probs is not None:
                dists.append(probs)
            out.append(nxt)
            if own >= k or len(out) >= limit:
                break
            pos += feed.shape[1]
            feed = torch.tensor([[nxt]], dtype=torch.long, device=self._model.device)
            self._ids.append(nxt)
        return out, torch.stack(dists) if dists else None


def drawn(params: SamplingParams | None, rng: Randomness) -> bool:
    """Whether draft tokens are drawn with a generator, so that each needs its distribution (rejection sampling)."""
    return params is not None and not params.greedy and not isinstance(rng, GumbelNoise)


def one_hot(token: int, vocab: int, device: torch.device) -> Tensor:
    """A forced token's q [vocab]: proposed for certain."""
    q = torch.zeros(vocab, device=device)
    q[token] = 1.0
    return q


class ModelDrafter:
    """A small decoder sharing the target's vocabulary, proposing greedily with its own KV cache."""

    def __init__(self, name: str, draft: LoadedModel, target: LoadedModel) -> None:
        t_vocab = target.tokenizer.backend.get_vocab()
        d_vocab = draft.tokenizer.backend.get_vocab()
        if t_vocab != d_vocab:
            differing = len(set(t_vocab.items()) ^ set(d_vocab.items()))
            raise DraftError(
                f"draft {name!r} does not share the target's vocabulary ({len(d_vocab)} vs {len(t_vocab)} tokens, "
                f"{differing} entries differ); a draft must use the target's tokenizer"
            )
        self.name = name
        self.model = draft.model
        # Only ids the target can verify may be proposed (a padded draft head can be wider).
        self.vocab_limit = min(draft.model.config.vocab_size, target.model.config.vocab_size)
        self.target_vocab = target.model.config.vocab_size

    def session(self, capacity: int) -> DraftSession:
        return _ModelDraftSession(self, capacity)


class _NgramSession:
    """Lookups over one request's growing sequence, from an index of where each n-gram last ended.

    The index grows with the sequence (a few dict writes per new token), so a step's lookup costs
    microseconds where scanning the whole sequence cost 100-350 us per request for 100-2,000 tokens."""

    model = None  # a lookup and nothing else (`LookupSession`)
    used_lookup = True

    def __init__(self, drafter: NgramDrafter) -> None:
        self._d = drafter
        self._seen: list[int] = []  # the tokens indexed: every window within them is in `_ends`
        # Per n: n-gram -> the position just past its latest occurrence.
        self._ends: dict[int, dict[tuple[int, ...], int]] = {}
        self.grammar: GrammarState | None = None

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        found = self._find(token_ids, k)
        # What the text repeated may not follow the grammar here: up to the first token it refuses.
        return found[: self.grammar.valid_prefix(found)] if self.grammar is not None and found else found

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        return self.propose(token_ids, k)

    def _find(self, token_ids: Sequence[int], k: int) -> list[int]:
        # A lookup has no confidence to cut on: p_min does not apply.
        if k <= 0 or len(token_ids) < 2:
            return []
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        n_tokens = len(ids)
        # Windows ending before the last token; the latest match wins, as in HF's prompt lookup, because
        # recent text predicts what comes next best.
        self._index(ids, n_tokens - 1)
        for n in range(min(self._d.max_n, n_tokens - 1), self._d.min_n - 1, -1):
            end = self._ends[n].get(tuple(ids[n_tokens - n :]))
            if end is not None:
                return ids[end : end + k]
        return []

    def _index(self, ids: list[int], upto: int) -> None:
        """Index every window within ids[:upto]."""
        known = len(self._seen)
        if known > upto or ids[:known] != self._seen:  # not the sequence indexed so far: start over
            self._seen, self._ends, known = [], {}, 0
        lo, hi = self._d.min_n, self._d.max_n
        ends = [self._ends.setdefault(n, {}) for n in range(lo, hi + 1)]
        for end in range(known + 1, upto + 1):
            for n, table in zip(range(lo, hi + 1), ends, strict=True):
                if end >= n:
                    table[tuple(ids[end - n : end])] = end
        self._seen.extend(ids[known:upto])


class NgramDrafter:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n = max_n
        self.min_n = min_n

    def session(self, capacity: int) -> DraftSession:
        return _NgramSession(self)


class _HybridSession:
    def __init__(self, drafter: HybridDrafter, capacity: int) -> None:
        self._lookup = drafter.lookup.session(capacity)
        self._model = drafter.model.session(capacity)
        # A feature draft's buffer, which the generation fills; None for a draft that needs no states.
        self.features: Tensor | None = self._model.features if isinstance(self._model, FeatureSession) else None
        self.lookups = 0  # steps the lookup proposed
        self.used_lookup = False

    @property
    def model(self) -> DraftSession:
        """The model draft's session, which drafts where the lookup finds nothing (`LookupSession`)."""
        return self._model

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        found = self._lookup.propose(token_ids, k)
        self.lookups += bool(found)
        self.used_lookup = bool(found)
        return found

    @property
    def penalty(self) -> Penalty | None:
        return self._model.penalty if isinstance(self._model, PenalizedSession) else None

    @penalty.setter
    def penalty(self, penalty: Penalty | None) -> None:
        # A lookup proposes what the text holds, penalties or not; the model draft is the one to penalise.
        if isinstance(self._model, PenalizedSession):
            self._model.penalty = penalty

    @property
    def grammar(self) -> GrammarState | None:
        return self._lookup.grammar

    @grammar.setter
    def grammar(self, grammar: GrammarState | None) -> None:
        # The lookup stops at a token the grammar refuses (and then the model drafts), the model proposes in it.
        self._lookup.grammar = grammar
        if isinstance(self._model, ConstrainedSession):
            self._model.grammar = grammar

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        found = self.lookup(token_ids, k)
        return found if found else self._model.propose(token_ids, k, p_min)

    def propose_tree(
        self,
        token_ids: Sequence[int],
        k: int,
        max_rows: int,
        params: SamplingParams | None = None,
        noise: GumbelNoise | None = None,
        p_min: float = 0.0,
        min_value: float = 0.0,
    ) -> DraftTree:
        """Both proposals in one tree (`app.engine.tree.build_tree`): the lookup's continuation as a branch, the
        model draft's chain and its next choices; the lookup's first where rows run short."""
        found = self.lookup(token_ids, k)
        if isinstance(self._model, CandidateSession):
            chain = self._model.propose_candidates(token_ids, k, max_rows - 1, params, noise, p_min)
        elif params is None or params.greedy or not isinstance(self._model, SamplingSession):
            chain = Candidates(self._model.propose(token_ids, k, p_min))
        else:
            chain = Candidates(self._model.propose_sampled(token_ids, k, params, noise, p_min)[0])
        return build_tree(token_ids[-1], chain, found, max_rows, branch_first=True, min_value=min_value)

    def propose_sampled(
        self,
        token_ids: Sequence[int],
        k: int,
        params: SamplingParams,
        rng: Randomness,
        p_min: float = 0.0,
    ) -> tuple[list[int], Tensor | None]:
        found = self.lookup(token_ids, k)
        if found:  # a lookup is deterministic: q is one-hot, which rejection sampling takes as None
            return found, None
        if not isinstance(self._model, SamplingSession):
            return self._model.propose(token_ids, k, p_min), None
        return self._model.propose_sampled(token_ids, k, params, rng, p_min)


class HybridDrafter:
    """Prompt lookup where the text repeats itself, a model draft everywhere else.

    Each step first looks for the last `min_match` or more tokens earlier in the sequence (a summary quoting
    its document, code repeating its names, a rewrite): when found, what followed is proposed, at no cost
    and often accepted many tokens at a time. Only without such a match does the model draft run. A short
    match is not trusted (min_match 1 would fire on nearly every common token, crowding the model out).
    """

    def __init__(self, name: str, model: Drafter, min_match: int = 2, max_match: int = 4) -> None:
        self.name = name
        self.model = model
        self.lookup = NgramDrafter(max_n=max_match, min_n=min_match)

    def session(self, capacity: int) -> DraftSession:
        return _HybridSession(self, capacity)

    def propose_batch(
        self,
        sessions: Sequence[_HybridSession],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        p_mins: Sequence[float],
    ) -> list[list[int]]:
        """Greedy drafts for several requests: lookups first, the model draft for the rest, batched when
        it can be."""
        out = [s.lookup(ids, k) for s, ids, k in zip(sessions, token_ids, ks, strict=True)]
        rest = [i for i, found in enumerate(out) if not found and ks[i] > 0]
        if isinstance(self.model, BatchDrafter) and len(rest) > 1:
            drafts = self.model.propose_batch(
                [sessions[i]._model for i in rest],
                [token_ids[i] for i in rest],
                [ks[i] for i in rest],
                [p_mins[i] for i in rest],
            )
        else:
            drafts = [sessions[i]._model.propose(token_ids[i], ks[i], p_mins[i]) for i in rest]
        for i, d in zip(rest, drafts, strict=True):
            out[i] = d
        return out
