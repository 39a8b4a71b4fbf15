"""What a drafter is: loaded once and shared, it opens a `DraftSession` per request, which proposes tokens.

A session holds its request's draft state (a KV cache, an n-gram index) and keeps it in step with the accepted
sequence by rolling back. Beside `propose`, a session may declare capabilities, as class attributes that the
class's definition is checked against (`__init_subclass__`): a capability without its method, or a method
without its capability, fails at import, so that renaming a method cannot quietly turn a feature off.

- `trees`: `propose_tree`, several candidates verified in one target forward (app.engine.drafting.tree);
- `candidates`: `propose_candidates`, a chain with the draft's next choices at each depth (a tree's material);
- `looks_up`: `lookup`, prompt lookup first; `model` is the session that drafts where it finds nothing.
  `proposals` gives every source's lookup apart, each with its kind, for the schedule to price.

A session's lifecycle: `start` when its generation starts (the prompt's length, the request's tenant and
predicted output), `finish` when it ended with an answer (its whole sequence), `cancel` when it was given up;
the generation calls them, so a drafter that learns from the traffic hears of every answer.

What every session takes: the request's `penalty` and `grammar` (`constrain`), and where it reads the target's
hidden states, a `features` buffer the generation writes. A `Drafter` declares `batches` when it drafts for
several sessions at once (`propose_batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from app.engine.decoding.grammar import GrammarState
from app.engine.decoding.penalties import Penalty
from app.engine.decoding.sampling import GumbelNoise, SamplingParams
from app.engine.drafting.tree import Candidates, DraftTree, TreeShape

# What a sampled draft draws with: the target's Gumbel noise (coupled sampling, exact-match verification) or
# a generator (rejection sampling).
Randomness = GumbelNoise | torch.Generator | None


class DraftError(ValueError):
    """A draft that cannot serve this target."""


@dataclass(frozen=True)
class Proposal:
    """A lookup's continuation: `tokens`, its draft `kind` (`lookup`, or `lookup:SOURCE:BUCKET` where the
    schedule calibrates each source per match length) and `match`, the tokens of context it agrees on."""

    tokens: list[int]
    kind: str = "lookup"
    match: int = 0


def _check_capabilities(cls: type, base: type, required: dict[str, str]) -> None:
    """A class declares a capability exactly when it defines the method that capability needs."""
    for capability, method in required.items():
        defines = getattr(cls, method) is not getattr(base, method)
        if getattr(cls, capability) != defines:
            missing = "declares" if getattr(cls, capability) else "does not declare"
            raise TypeError(
                f"{cls.__name__} {missing} `{capability}` but {'does not define' if not defines else 'defines'} "
                f"`{method}`: a drafter's capabilities and its methods go together"
            )


class DraftSession:
    """Per-request proposer state."""

    trees: ClassVar[bool] = False
    candidates: ClassVar[bool] = False
    looks_up: ClassVar[bool] = False
    _REQUIRES: ClassVar[dict[str, str]] = {
        "trees": "propose_tree",
        "candidates": "propose_candidates",
        "looks_up": "lookup",
    }

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.propose is DraftSession.propose:
            raise TypeError(f"{cls.__name__} does not define `propose`")
        _check_capabilities(cls, DraftSession, cls._REQUIRES)

    def __init__(self) -> None:
        self.penalty: Penalty | None = None
        self.grammar: GrammarState | None = None
        # The target's final hidden state of each position [capacity, dim], written by the generation as soon as
        # the position is verified; None: this session reads none.
        self.features: Tensor | None = None
        # With `looks_up`: the session that drafts where the lookup finds nothing (None: the lookup alone), and
        # whether the last proposal was the lookup's.
        self.model: DraftSession | None = None
        self.used_lookup = False
        # With `looks_up`: the kind of the last lookup's proposal (what `lookup` returned).
        self.last_kind = "lookup"

    def start(self, prompt_len: int, tenant: str | None, prediction: Sequence[int], history: bool = True) -> None:
        """The generation starts: its prompt's length, its tenant (the request's cache_salt; None: the shared
        default), the tokens it predicted its answer will mostly be (none: empty), and whether it may draft from
        other requests' answers (not where its text depends on its drafts: the rejection sampler, whose seed must
        give the same text whatever the server answered before)."""

    def finish(self, token_ids: Sequence[int]) -> None:
        """The generation ended with an answer: `token_ids` is its whole sequence, prompt first."""

    def cancel(self) -> None:
        """The generation was given up (a client gone, a timeout, a failure) before its answer was complete."""

    def constrain(self, penalty: Penalty | None, grammar: GrammarState | None) -> None:
        """The request's penalties (a model draft proposes what the penalised target would choose; a lookup
        proposes what the text holds) and grammar (a model draft proposes its best token the grammar allows,
        and a token it forces without counting it against k; a lookup stops at the first token it refuses)."""
        self.penalty = penalty
        self.grammar = grammar

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        """Up to `k` tokens likely to follow `token_ids` (the whole accepted sequence so far), greedily; a model
        draft stops early when its top probability falls below `p_min`."""
        raise NotImplementedError

    def propose_sampled(
        self, token_ids: Sequence[int], k: int, params: SamplingParams, rng: Randomness, p_min: float = 0.0
    ) -> tuple[list[int], Tensor | None]:
        """Up to `k` tokens drawn with `rng` (the request's Gumbel noise or generator) and, with a generator, the
        distributions they were drawn from [len(tokens), target vocab], rejection sampling's q (None with Gumbel
        noise). By default a proposer is deterministic under sampling too: what `propose` gives, q one-hot
        (None), which exact-match and rejection verification both allow; every network draft samples
        (app.engine.drafting.loop.NetworkSession)."""
        return self.propose(token_ids, k, p_min), None

    def propose_tree(self, token_ids: Sequence[int], shape: TreeShape) -> DraftTree:
        """A tree after `token_ids` (its root their last token) within `shape` (`trees`)."""
        raise NotImplementedError

    def propose_candidates(self, token_ids: Sequence[int], shape: TreeShape) -> Candidates:
        """The chain `propose` gives (at most `shape.k` tokens), with each token's draft probability and the
        draft's next `shape.rows - 1` choices at each depth (`candidates`)."""
        raise NotImplementedError

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last tokens
        (`looks_up`); `last_kind` says which kind they are."""
        raise NotImplementedError

    def proposals(self, token_ids: Sequence[int], k: int) -> list[Proposal]:
        """Every source's lookup of up to `k` tokens, apart (`looks_up`); by default `lookup`'s alone."""
        found = self.lookup(token_ids, k)
        return [Proposal(found, self.last_kind)] if found else []


class Drafter:
    """A proposer, loaded once and shared by its requests' sessions."""

    name: str
    batches: ClassVar[bool] = False  # propose_batch: greedy drafts of several sessions, one forward per position

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.session is Drafter.session:
            raise TypeError(f"{cls.__name__} does not define `session`")
        _check_capabilities(cls, Drafter, {"batches": "propose_batch"})

    def session(self, capacity: int) -> DraftSession:
        """State for one request whose sequence will hold at most `capacity` tokens."""
        raise NotImplementedError

    def session_bytes(self, capacity: int) -> int:
        """Bytes a `session(capacity)` allocates when it opens (its KV cache, a features buffer), which the
        scheduler admits requests by. 0 by default: a drafter whose state grows with the text instead (the
        n-gram index) holds little beside the target's cache."""
        return 0

    def propose_batch(
        self,
        sessions: Sequence[DraftSession],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        p_mins: Sequence[float],
    ) -> list[list[int]]:
        """What each session's greedy `propose(token_ids[i], ks[i], p_mins[i])` gives, for all of them together."""
        raise NotImplementedError
