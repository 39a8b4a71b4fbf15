"""Repetition, presence and frequency penalties over a request's accepted context.

A penalty changes a position's logits by what came before it, so under speculation each verified row must
see exactly the context target-only decoding would have had there: the accepted tokens plus the drafts
before that row. `Penalty.apply` does that for a whole verification at once; the draft uses the same call
for the row it is about to propose, so both distributions are penalised alike (which keeps acceptance up;
exactness only needs the target's rows right).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PenaltyParams:
    """`repetition`: a token already in the sequence (prompt included) has its logit divided by it when
    positive and multiplied by it when negative (HF's and vLLM's rule; 1.0: none). `presence` and `frequency`
    are OpenAI's: logit -= presence * [count > 0] + frequency * count, counting the generated tokens only
    (as OpenAI and vLLM do), or the prompt's too with `count_prompt` (0.0: none)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    count_prompt: bool = False

    def __post_init__(self) -> None:
        if not self.repetition > 0:
            raise ValueError("repetition_penalty must be > 0 (1.0: none)")
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must lie in [-2, 2] (0: none)")

    @property
    def neutral(self) -> bool:
        return self.repetition == 1.0 and self.presence == 0.0 and self.frequency == 0.0


NO_PENALTIES = PenaltyParams()


class Penalty:
    """One request's penalty state: which tokens its accepted sequence holds, and how often."""

    def __init__(self, params: PenaltyParams, prompt_ids: Sequence[int], vocab: int, device: torch.device) -> None:
        self.params = params
        self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # prompt and generated: repetition
        self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # presence and frequency
        prompt = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
        self._seen[prompt] = True
        if params.count_prompt:
            self._counts.index_add_(0, prompt, torch.ones_like(prompt, dtype=torch.float32))

    def accept(self, token_ids: Sequence[int]) -> None:
        """Add tokens appended to the accepted sequence."""
        if not token_ids:
            return
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self._seen.device)
        self._seen[ids] = True
        self._counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))

    def apply(self, logits: Tensor, drafted: Sequence[int] = (), ids: Tensor | None = None) -> Tensor:
        """Penalised float32 copy of `logits` [rows, V'], row i predicting the position after the accepted
        sequence plus the first `len(drafted) - rows + 1 + i` of `drafted` (a verification: rows = k + 1 over k
        drafts, row i after drafted[:i]; a draft's one row: after all of `drafted`). `ids` long [V']: the token
        of each column, when the logits cover part of the vocabulary (a draft's own); None: column j is token j.
        """
        rows = logits.shape[0]
        seen = self._seen.expand(rows, -1).clone()
        counts = self._counts.expand(rows, -1).clone()
        offset = len(drafted) - rows + 1
        for j, token in enumerate(drafted):
            first = max(0, j + 1 - offset)  # the first row whose context holds drafted[j]
            if first < rows:
                seen[first:, token] = True
                counts[first:, token] += 1.0
        if ids is not None:
            seen, counts = seen[:, ids], counts[:, ids]
        out = logits.float()
        p = self.params
        if p.repetition != 1.0:
            out = torch.where(seen, torch.where(out > 0, out / p.repetition, out * p.repetition), out)
        if p.frequency != 0.0 or p.presence != 0.0:
            out = out - p.frequency * counts - p.presence * (counts > 0).float()
        return out
