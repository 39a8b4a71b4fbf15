"""Sampling parameters and the one warping both the draft and the target go through.

Rejection sampling keeps the target's distribution exactly only when p and q are warped alike
(temperature, then top-k, then top-p, as HF and vLLM order them), so this module is the single place
that does it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no cut."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # Dividing logits by less overflows float32 to inf and the probabilities to NaN.
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0: no cut)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def argmax(logits: Tensor) -> Tensor:
    """`logits.argmax(-1)`: long [...] for logits [..., V], the first index on ties.

    On CPU in float32 numpy's vectorised argmax does it: torch's is not vectorised there (95 vs 8 us over
    49k logits, 945 vs 140 us for 16 rows, on this machine), and the target's head emits a row per
    verified token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1)))
    return logits.argmax(-1)


def warp(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities [..., V] (float32) after temperature, top-k and top-p on `logits` [..., V].

    Greedy parameters give the one-hot distribution of the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token id per row of `probs` [..., V], drawn with `generator`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
