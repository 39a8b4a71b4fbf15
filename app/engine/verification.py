"""Deciding which drafted tokens the target keeps, from one target pass over all of them."""

from __future__ import annotations

import torch
from torch import Tensor


def greedy_verify(draft_tokens: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """Exact-match verification of k drafted tokens.

    draft_tokens: long [k]; target_logits: [k + 1, vocab], row i being the target's prediction after
    the i-th drafted token (row 0: after the last accepted token). Returns (a, token): the number of
    drafted tokens accepted, in order up to the first mismatch, and the target's own choice at that
    point: the correction of the first rejected token, or the bonus token when all k were accepted.
    """
    choices = target_logits.argmax(dim=-1)
    k = draft_tokens.shape[0]
    if k == 0:
        return 0, int(choices[0])
    agree = (choices[:k] == draft_tokens).to(torch.int32)
    accepted = int(agree.cumprod(dim=0).sum())
    return accepted, int(choices[accepted])
