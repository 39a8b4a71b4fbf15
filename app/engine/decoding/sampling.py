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
    return _truncate(logits / params.temperature, params).softmax(-1)


def _truncate(scaled: Tensor, params: SamplingParams) -> Tensor:
    """`scaled` [..., V] (logits over the temperature) with the tokens top-k and top-p cut set to -inf."""
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs = scaled.softmax(-1)
        # The nucleus is nearly always a few dozen tokens: look among the most likely first, and sort the whole
        # vocabulary (a hundred times slower) only when they do not reach top_p.
        width = min(vocab, 256)
        while True:
            top, order = torch.topk(probs, width, dim=-1)
            # Drop a token when the mass before it already reaches top_p; the top token always stays.
            drop_sorted = (top.cumsum(-1) - top) >= params.top_p
            if width == vocab or bool(drop_sorted[..., -1].all()):
                break
            width = vocab
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, ~drop_sorted)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return scaled


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token id per row of `probs` [..., V], drawn with `generator`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


# --- coupled sampling: the Gumbel-max trick on noise that depends on (seed, position) only --------------------

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int: a bijection of [0, 2**64) that scatters every input bit."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """`_mix64` over a uint64 array (numpy's uint64 products wrap modulo 2**64, as the finaliser wants)."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


class GumbelNoise:
    """Standard Gumbel noise g[position, token] of one seed, a pure function of (seed, position, token).

    A counter-based generator (SplitMix64 of a key made from seed and position, plus the token id times the
    golden ratio, as SplitMix64 steps its state) gives a 53-bit uniform u, and g = -log(-log u). Nothing
    is consumed: whoever asks for a position gets the same numbers, whatever was asked before, so the
    draft and the target share each position's noise, and the same seed gives the same tokens whatever
    the draft, its length or the batch. Float64 so the tail is not clipped: u < 1 - 2**-54 bounds g
    below 37.4, which loses a mass below 1e-11 over the whole vocabulary.
    """

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed = seed
        self._key = _mix64(seed)
        self._vocab = vocab
        self._rows: dict[int, np.ndarray] = {}  # position -> noise over the whole vocabulary

    def at(self, position: int, ids: np.ndarray | None = None) -> np.ndarray:
        """float64 noise of `position` for token `ids` (int64 [n]; None: the whole vocabulary [V])."""
        row = self._rows.get(position)
        if row is not None:
            return row if ids is None else row[ids]
        if ids is not None and ids.shape[0] * 8 < self._vocab:
            return self._noise(position, ids)
        row = self._noise(position, np.arange(self._vocab, dtype=np.int64))
        # A verification asks again for the positions its draft just asked for; older ones are never asked again.
        if len(self._rows) >= 64:
            self._rows.pop(min(self._rows))
        self._rows[position] = row
        return row if ids is None else row[ids]

    def _noise(self, position: int, ids: np.ndarray) -> np.ndarray:
        key = _mix64(self._key ^ _mix64(position * _GOLDEN + 1))
        x = (ids.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN) + np.uint64(key)
        u = ((_mix64_array(x) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        return -np.log(-np.log(u))


def gumbel_choice(
    logits: Tensor, params: SamplingParams, noise: GumbelNoise, position: int, ids: Tensor | None = None
) -> int:
    """The token at `position` drawn from the warped `logits` [V'] by the Gumbel-max trick: the index into V'
    of argmax(logits / temperature + g[position]) over the tokens top-k and top-p keep, which is distributed
    exactly as `warp(logits, params)`. `ids` long [V']: the token id of each logit, when the logits cover
    part of the vocabulary (a draft's own); None: logit i is token i."""
    scaled = _truncate(logits.float() / params.temperature, params)
    cut = params.top_p < 1.0 or 0 < params.top_k < scaled.shape[-1]
    kept = torch.nonzero(torch.isfinite(scaled)).squeeze(-1) if cut else None
    columns = kept if kept is not None else slice(None)
    token_ids = ids[columns] if ids is not None else kept
    g = noise.at(position, None if token_ids is None else token_ids.cpu().numpy())
    scores = scaled[columns].double().cpu().numpy() + g
    best = int(scores.argmax())
    return int(kept[best]) if kept is not None else best
