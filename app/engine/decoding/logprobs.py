"""Log-probabilities of tokens under the target's raw distribution, for requests that ask for them.

Raw: the log-softmax of the target's logits as the model gives them (temperature 1, no top-k or top-p, no
penalty), whatever the request samples with, as vLLM's default ``logprobs_mode=raw_logprobs``. They are
the same for greedy and sampled decoding, and for a token accepted from a draft and one the target chose
alone: the row of the target's forward that predicts a position is the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, its `rank` in the distribution (1: the most likely; ties share the
    better rank) and the `top` most likely tokens as (id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """The log-probabilities of `token_ids` [rows], row i's token under `logits` [rows, vocab], each with the
    `top_n` most likely tokens of its row (0: none)."""
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])
    ranks = (logp > chosen).sum(dim=1) + 1
    # One transfer each to Python numbers: per-element .item() calls would cost more than the maths.
    values, ranks_ = chosen[:, 0].tolist(), ranks.tolist()
    if top_n > 0:
        top_values, top_ids = logp.topk(top_n, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), top_values.tolist(), strict=True)]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(int(t), v, r, top) for t, v, r, top in zip(token_ids, values, ranks_, tops, strict=True)]
