"""How a request turns the target's logits into tokens, picked once per request: greedy, the Gumbel (coupled)
sampler or the rejection sampler. The generation asks its chooser for the target's token where nothing was
drafted (`first`) and for the verdict on a draft (`verify`); drafts and trees draw with its `rng`."""

from __future__ import annotations

import secrets

import torch
from torch import Tensor

from app.engine.decoding.sampling import GumbelNoise, SamplingParams, argmax, gumbel_choice, sample, warp
from app.engine.decoding.verification import coupled_verify, greedy_verify, rejection_sample


class Chooser:
    """One request's way of choosing tokens. `params` None: greedy; `rng`: what a sampled draft draws with (the
    Gumbel noise, a generator, or None); `noise`: the Gumbel noise, or None; `seed`: the seed in use (None
    when greedy)."""

    name = "greedy"
    params: SamplingParams | None = None
    rng: GumbelNoise | torch.Generator | None = None
    noise: GumbelNoise | None = None
    seed: int | None = None

    def first(self, logits: Tensor, position: int) -> int:
        """The target's token at sequence `position` from its (penalised, masked) `logits` [V], no draft."""
        return int(argmax(logits))

    def verify(self, drafts: list[int], q: Tensor | None, logits: Tensor, position: int) -> tuple[int, int]:
        """(accepted drafts, the target's token after them) from `logits` [len(drafts) + 1, V], row i at sequence
        `position` + i; `q`: the drafts' distributions, when drawn with a generator."""
        return greedy_verify(torch.tensor(drafts, dtype=torch.long, device=logits.device), logits)


class GumbelChooser(Chooser):
    """Coupled sampling: the same seed gives target-only sampling's tokens whatever the draft."""

    name = "gumbel"

    def __init__(self, params: SamplingParams, seed: int, vocab: int) -> None:
        self.params, self.seed = params, seed
        self.noise = self.rng = GumbelNoise(seed, vocab)

    def first(self, logits: Tensor, position: int) -> int:
        assert self.params is not None and self.noise is not None
        return gumbel_choice(logits, self.params, self.noise, position)

    def verify(self, drafts: list[int], q: Tensor | None, logits: Tensor, position: int) -> tuple[int, int]:
        assert self.params is not None and self.noise is not None
        return coupled_verify(drafts, logits, self.params, self.noise, position)


class RejectionChooser(Chooser):
    """Leviathan et al.'s rejection sampler: accepts a model draft more often; what a seed gives depends on it."""

    name = "rejection"

    def __init__(self, params: SamplingParams, seed: int, device: torch.device) -> None:
        self.params, self.seed = params, seed
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.rng = self.generator

    def first(self, logits: Tensor, position: int) -> int:
        assert self.params is not None
        return int(sample(warp(logits, self.params), self.generator))

    def verify(self, drafts: list[int], q: Tensor | None, logits: Tensor, position: int) -> tuple[int, int]:
        assert self.params is not None
        tokens = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        return rejection_sample(tokens, q, warp(logits, self.params), self.generator)


def make_chooser(params: SamplingParams, sampler: str, seed: int | None, vocab: int, device: torch.device) -> Chooser:
    """The chooser of a request: greedy at temperature 0, else `sampler` ("gumbel" or "rejection") seeded with
    `seed` (None: a fresh random one). Each request draws from its own noise (or generator), so that a seed
    reproduces it whatever else is running."""
    if params.greedy:
        return Chooser()
    seed = seed if seed is not None else secrets.randbits(63)
    if sampler == "gumbel":
        return GumbelChooser(params, seed, vocab)
    return RejectionChooser(params, seed, device)
