"""Speculative tree verification: several drafted continuations checked in one target forward.

A chain draft loses the whole step at its first wrong token, even when the draft's second choice there
was right. A tree keeps several candidates: the feature draft's chain (its top choice at each depth), its
next choices at the first depths as extra leaves (siblings), and prompt lookup's continuation as another
branch where it differs from the chain. The target runs every row of the tree at once, each row at the
position of its depth and attending to the prefix and its own ancestors only (`Transformer.hidden_batch`
with parents; on the CPU kernels with the very bits sequential decoding gives that row). Acceptance walks
from the root: at each node the target's own choice (argmax, or the Gumbel-max choice of its position)
must be one of the node's children; the longest such path is kept, followed by the target's token after
it. `compact` then moves the path's keys and values into the slots sequential decoding would have written,
so the cache, and every step after, is what chain (or target-only) decoding gives: greedy output is the
target's own token for token.

Rows are laid out root first (row 0: the last accepted token, in the slot after the cache), then the chain
(row i at depth i, so an accepted chain needs no move), then the other nodes, every parent before its
children.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from app.engine.decoding.sampling import GumbelNoise, SamplingParams, argmax, gumbel_choice
from app.engine.drafting.draft_length import StepCosts
from app.engine.model.cache import KVCache, tree_depths


@dataclass
class Candidates:
    """What a model draft proposes for a tree: its chain (`tokens`, with each one's draft probability in
    `probs`) and, per depth i of the chain, its next choices there as (token, probability), best first
    (`alternatives[i]`, never holding tokens[i])."""

    tokens: list[int]
    probs: list[float] = field(default_factory=list)
    alternatives: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class TreeShape:
    """What one step's tree may be: depth `k` at most, `rows` rows at most (the root included), drafted greedily
    (`params` None) or with the request's Gumbel `noise`, the draft stopping below `p_min`; model nodes whose value
    is below `min_value` are left out (`build_tree`)."""

    k: int
    rows: int
    params: SamplingParams | None = None
    noise: GumbelNoise | None = None
    p_min: float = 0.0
    min_value: float = 0.0


@dataclass
class DraftTree:
    """Rows of one tree verification: `tokens[r]` fed at row r (row 0 the root, the last accepted token),
    `parents[r]` its parent row (-1 for the root, an earlier row otherwise), `depths[r]` its ancestors."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    # Per row, what proposed it: "draft" (the model draft's chain or a sibling) or "lookup" (prompt lookup's branch
    # where the chain did not hold it); empty: every node the draft's.
    sources: list[str] = field(default_factory=list)

    def source(self, row: int) -> str:
        """What proposed the node at `row`: "draft" or "lookup"."""
        return self.sources[row] if row < len(self.sources) else "draft"

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def nodes(self) -> int:
        """Drafted tokens (every row but the root)."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        """The deepest node's depth: the most drafted tokens one step can keep."""
        return max(self.depths)

    def parents_tensor(self, device: torch.device | str = "cpu") -> Tensor:
        """int32 [rows], what `Transformer.hidden_batch` takes."""
        return torch.tensor(self.parents, dtype=torch.int32, device=device)

    def children(self, row: int) -> dict[int, int]:
        """token -> child row, of `row`'s children."""
        return {self.tokens[c]: c for c in range(row + 1, self.rows) if self.parents[c] == row}


def build_tree(
    root: int,
    chain: Candidates | None,
    branch: Sequence[int] = (),
    max_rows: int = 16,
    branch_first: bool = False,
    min_value: float = 0.0,
) -> DraftTree:
    """The tree of one step: `root` (the last accepted token), the model draft's `chain` with the best of its
    alternatives, and `branch` (prompt lookup's continuation), in at most `max_rows` rows (the root included).

    The chain and the branch come first, merged where they agree (the branch first with `branch_first`: its
    rows then sit in their sequential slots); siblings then fill the rows left, best first by the draft's
    estimate that the target takes them: the product of the chain's probabilities down to their parent times
    their own (EAGLE-2's value). `min_value`: a model node (chain or sibling) whose value is below it is left
    out (what a row costs, in tokens: see `row_value`); the chain ends at its first such node."""
    if chain is not None and min_value > 0:
        keep, reach = 0, 1.0
        for p in chain.probs:
            reach *= p
            if reach < min_value:
                break
            keep += 1
        chain = Candidates(chain.tokens[:keep], chain.probs[:keep], chain.alternatives[:keep])
    tokens, parents, sources = [root], [-1], ["target"]

    def add_path(path: Sequence[int], source: str) -> list[int]:
        rows, node = [], 0
        for tok in path:
            child = next((c for c in range(node + 1, len(tokens)) if parents[c] == node and tokens[c] == tok), None)
            if child is None:
                if len(tokens) >= max_rows:
                    break
                tokens.append(tok)
                parents.append(node)
                sources.append(source)
                child = len(tokens) - 1
            rows.append(child)
            node = child
        return rows

    chain_tokens = list(chain.tokens) if chain is not None else []
    if branch_first:
        add_path(branch, "lookup")
    chain_rows = add_path(chain_tokens, "draft")
    if not branch_first:
        add_path(branch, "lookup")
    if chain is not None and chain.alternatives and len(tokens) < max_rows:
        reach, options = 1.0, []
        for i, row in enumerate([0, *chain_rows][: len(chain_rows)]):
            for tok, p in chain.alternatives[i] if i < len(chain.alternatives) else []:
                options.append((reach * p, row, tok))
            reach *= chain.probs[i] if i < len(chain.probs) else 1.0
        options.sort(key=lambda o: -o[0])
        for value, row, tok in options:
            if len(tokens) >= max_rows or value < min_value:
                break
            if any(parents[c] == row and tokens[c] == tok for c in range(1, len(tokens))):
                continue  # the branch holds it already
            tokens.append(tok)
            parents.append(row)
            sources.append("draft")
    return DraftTree(tokens, parents, tree_depths(parents), sources)


def row_value(costs: StepCosts, tokens_per_pass: float, rows: int, context: int = 0) -> float:
    """The least value (expected accepted tokens) for which a tree row pays its cost: a row adds the measured
    seconds per verified row (the slope of `costs`' verification seconds by rows, at `context` cached positions)
    to a step of about `rows` rows that yields `tokens_per_pass` tokens, so it pays when it brings at least its
    share of the step's time in tokens. 0 until two row counts were measured at a context of its class (the whole
    tree runs, and measures)."""
    if len(costs.verify.table(context)) < 2:
        return 0.0
    one, step = costs.verify_cost(1, context), costs.verify_cost(max(1, rows), context)
    per_row = ((costs.verify_cost(16, context) or 0.0) - (one or 0.0)) / 15
    if not step or per_row <= 0:
        return 0.0
    return per_row / step * max(1.0, tokens_per_pass)


def walk(tree: DraftTree, choose: Callable[[int], int]) -> tuple[list[int], int]:
    """The longest path the target agrees with: from the root, while `choose(row)` (the target's token after
    that row) is a child's token, go to that child. Returns (the path's rows, root excluded, in depth order;
    the target's token after the path's last row)."""
    path: list[int] = []
    row = 0
    while True:
        token = choose(row)
        child = tree.children(row).get(token)
        if child is None:
            return path, token
        path.append(child)
        row = child


def accept(
    tree: DraftTree,
    logits: Tensor,
    params: SamplingParams,
    noise: GumbelNoise | None,
    position: int,
) -> tuple[list[int], int]:
    """`walk` with the target's choices from its `logits` [rows, V] (already penalised or masked where that
    applies): greedily the argmax of each row, or under coupled sampling the Gumbel-max choice with the noise
    of the position the row predicts (row r predicts `position` + its depth, `position` being the first
    drafted token's), as target-only sampling draws there. Only the rows the walk visits are sampled."""
    if params.greedy:
        choices = argmax(logits).tolist()
        return walk(tree, lambda row: choices[row])
    if noise is None:
        raise ValueError("tree verification samples with Gumbel noise only")
    return walk(tree, lambda row: gumbel_choice(logits[row], params, noise, position + tree.depths[row]))


def compact(cache: KVCache, start: int, path: Sequence[int]) -> None:
    """After a tree forward from `start`: move the keys and values of the accepted `path`'s rows (root excluded)
    into slots start + 1.. in depth order, as sequential decoding writes them, and forget the rest. A row's
    slot never precedes its depth's (parents come first), so moving in depth order overwrites nothing still
    to be moved."""
    moves = [(start + 1 + i, start + row) for i, row in enumerate(path) if row != i + 1]
    if moves:
        dst = torch.tensor([d for d, _ in moves], device=cache.k.device)
        src = torch.tensor([s for _, s in moves], device=cache.k.device)
        for kv in (cache.k, cache.v):
            kv[:, :, :, dst] = kv[:, :, :, src]
    cache.truncate(start + 1 + len(path))
