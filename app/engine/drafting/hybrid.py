"""The hybrid draft: lookups where the text repeats what was written (the request's own text, its predicted output,
the tenant's earlier answers: app.engine.drafting.suffix), a model draft everywhere else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from torch import Tensor

from app.engine.decoding.grammar import GrammarState
from app.engine.decoding.penalties import Penalty
from app.engine.decoding.sampling import SamplingParams
from app.engine.drafting.base import Drafter, DraftSession, Proposal, Randomness
from app.engine.drafting.suffix import SuffixDrafter
from app.engine.drafting.suffix_index import TrafficIndex
from app.engine.drafting.tree import Candidates, DraftTree, TreeShape, build_tree


class _HybridSession(DraftSession):
    looks_up: ClassVar[bool] = True
    trees: ClassVar[bool] = True

    def __init__(self, drafter: HybridDrafter, capacity: int) -> None:
        super().__init__()
        self._lookup = drafter.lookup.session(capacity)
        # The model draft's session, which drafts where the lookup finds nothing.
        self.model: DraftSession = drafter.model.session(capacity)
        # A feature draft's buffer, which the generation fills; None for a draft that needs no states.
        self.features = self.model.features
        self.lookups = 0  # steps the lookup proposed

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        found = self._lookup.lookup(token_ids, k)
        self.lookups += bool(found)
        self.used_lookup = bool(found)
        self.last_kind = self._lookup.last_kind
        return found

    def proposals(self, token_ids: Sequence[int], k: int) -> list[Proposal]:
        return self._lookup.proposals(token_ids, k)

    def start(self, prompt_len: int, tenant: str | None, prediction: Sequence[int], history: bool = True) -> None:
        self._lookup.start(prompt_len, tenant, prediction, history)
        self.model.start(prompt_len, tenant, prediction, history)

    def finish(self, token_ids: Sequence[int]) -> None:
        self._lookup.finish(token_ids)
        self.model.finish(token_ids)

    def cancel(self) -> None:
        self._lookup.cancel()
        self.model.cancel()

    def constrain(self, penalty: Penalty | None, grammar: GrammarState | None) -> None:
        # A lookup proposes what the text holds, penalties or not (and stops at a token the grammar refuses,
        # where the model drafts); the model draft is the one to penalise, and it proposes within the grammar.
        super().constrain(penalty, grammar)
        self._lookup.constrain(None, grammar)
        self.model.constrain(penalty, grammar)

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        found = self.lookup(token_ids, k)
        return found if found else self.model.propose(token_ids, k, p_min)

    def propose_sampled(
        self, token_ids: Sequence[int], k: int, params: SamplingParams, rng: Randomness, p_min: float = 0.0
    ) -> tuple[list[int], Tensor | None]:
        found = self.lookup(token_ids, k)
        if found:  # a lookup is deterministic: q is one-hot, which rejection sampling takes as None
            return found, None
        return self.model.propose_sampled(token_ids, k, params, rng, p_min)

    def propose_tree(self, token_ids: Sequence[int], shape: TreeShape) -> DraftTree:
        """Both proposals in one tree (`app.engine.drafting.tree.build_tree`): the lookup's continuation as a
        branch, the model draft's chain and its next choices; the lookup's first where rows run short."""
        k, params = shape.k, shape.params
        found = self.lookup(token_ids, k)
        if self.model.candidates:
            chain = self.model.propose_candidates(token_ids, shape)
        elif params is None or params.greedy:
            chain = Candidates(self.model.propose(token_ids, k, shape.p_min))
        else:
            chain = Candidates(self.model.propose_sampled(token_ids, k, params, shape.noise, shape.p_min)[0])
        return build_tree(token_ids[-1], chain, found, shape.rows, branch_first=True, min_value=shape.min_value)


class HybridDrafter(Drafter):
    """Lookups where the text repeats what was written, a model draft everywhere else.

    Each step first looks the end of the sequence up in the request's own text (a summary quoting its document,
    code repeating its names, a rewrite), its predicted output and the tenant's earlier answers (`traffic`):
    what followed a match is proposed at no cost and often accepted many tokens at a time. The adaptive schedule
    prices each lookup by its source and match length beside the model draft and drafts whichever is worth most
    (app.engine.generation); other schedules, and batches, take the longest match where there is one, and the
    model draft elsewhere.
    """

    batches: ClassVar[bool] = True

    def __init__(self, name: str, model: Drafter, traffic: TrafficIndex | None = None) -> None:
        self.name = name
        self.model = model
        # Unpriced, a match of the last token alone is a weaker guess than the model draft's, which drafts instead.
        self.lookup = SuffixDrafter(f"{name}/lookup", traffic, one_token=False)

    def session(self, capacity: int) -> DraftSession:
        return _HybridSession(self, capacity)

    def session_bytes(self, capacity: int) -> int:
        """Both sessions' (the lookup's index holds next to nothing)."""
        return self.model.session_bytes(capacity) + self.lookup.session_bytes(capacity)

    def propose_batch(
        self,
        sessions: Sequence[DraftSession],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        p_mins: Sequence[float],
    ) -> list[list[int]]:
        """Greedy drafts for several requests: lookups first, the model draft for the rest, batched when
        it can be."""
        out = [s.lookup(ids, k) for s, ids, k in zip(sessions, token_ids, ks, strict=True)]
        rest = [i for i, found in enumerate(out) if not found and ks[i] > 0]
        models: list[DraftSession] = []
        for i in rest:
            model = sessions[i].model
            assert model is not None  # a hybrid session always holds its model draft's
            models.append(model)
        if self.model.batches and len(rest) > 1:
            drafts = self.model.propose_batch(
                models, [token_ids[i] for i in rest], [ks[i] for i in rest], [p_mins[i] for i in rest]
            )
        else:
            drafts = [m.propose(token_ids[i], ks[i], p_mins[i]) for i, m in zip(rest, models, strict=True)]
        for i, d in zip(rest, drafts, strict=True):
            out[i] = d
        return out
