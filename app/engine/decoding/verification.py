"""Deciding which drafted tokens the target keeps, from one target pass over all of them."""

from __future__ import annotations

import torch
from torch import Tensor

from app.engine.decoding.sampling import GumbelNoise, SamplingParams, argmax, gumbel_choice


def greedy_verify(draft_tokens: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """Exact-match verification of k drafted tokens.

    draft_tokens: long [k]; target_logits: [k + 1, vocab], row i being the target's prediction after
    the i-th drafted token (row 0: after the last accepted token). Returns (a, token): the number of
    drafted tokens accepted, in order up to the first mismatch, and the target's own choice at that
    point: the correction of the first rejected token, or the bonus token when all k were accepted.
    """
    choices = argmax(target_logits)
    k = draft_tokens.shape[0]
    if k == 0:
        return 0, int(choices[0])
    agree = (choices[:k] == draft_tokens).to(torch.int32)
    accepted = int(agree.cumprod(dim=0).sum())
    return accepted, int(choices[accepted])


def coupled_verify(
    draft_tokens: list[int], target_logits: Tensor, params: SamplingParams, noise: GumbelNoise, position: int
) -> tuple[int, int]:
    """Exact-match verification of sampled drafts under coupled (Gumbel-max) sampling.

    The target's token at each position is what target-only sampling with the same noise draws there:
    `gumbel_choice` of its row (row i of `target_logits` [k + 1, V] predicts sequence position
    `position + i`). A drafted token is kept while it equals that choice, as in greedy verification, so the
    output is target-only sampling's token for token, whatever was drafted. Rows after the first mismatch
    are not sampled at all. Returns (accepted, the target's token after them).
    """
    for i in range(len(draft_tokens) + 1):
        choice = gumbel_choice(target_logits[i], params, noise, position + i)
        if i == len(draft_tokens) or choice != draft_tokens[i]:
            return i, choice
    raise AssertionError("unreachable")


def rejection_sample(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1) of k drafted tokens.

    draft_tokens: long [k]; draft_probs: [k, V], the draft's warped distributions the tokens were drawn
    from, or None for a deterministic proposer (one-hot q, as for n-gram lookup); target_probs: [k + 1, V],
    the target's warped distributions. Token i is accepted with probability min(1, p(x)/q(x)); at the
    first rejection a token is drawn from normalised max(0, p - q) and nothing after it is kept; when all
    k are accepted a bonus token is drawn from the target's last row. Returns (accepted, next token).
    The output is distributed exactly as sampling the target alone.
    """
    k = draft_tokens.shape[0]
    # Draw every uniform up front: the same seed then consumes the same randomness whatever is accepted.
    uniforms = torch.rand(k, generator=generator, device=target_probs.device) if k else None
    if k:
        rows = torch.arange(k, device=target_probs.device)
        p = target_probs[rows, draft_tokens]
        q = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones_like(p)
        accept = uniforms * q < p  # u < p/q without dividing by a zero q
        accepted = int(accept.to(torch.int32).cumprod(0).sum())
    else:
        accepted = 0
    if accepted == k:
        return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
    p_row = target_probs[accepted]
    if draft_probs is not None:
        q_row = draft_probs[accepted]
    else:
        q_row = torch.zeros_like(p_row)
        q_row[draft_tokens[accepted]] = 1.0
    residual = (p_row - q_row).clamp_min(0)
    total = residual.sum()
    # A zero residual means p <= q everywhere, i.e. p == q: then no rejection could have happened except by
    # rounding, and p itself is the right distribution to draw from.
    dist = residual / total if total > 0 else p_row
    return accepted, int(torch.multinomial(dist, 1, generator=generator))
