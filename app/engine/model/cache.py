"""Where a decoder's keys and values live: the KV cache (`KVCache`, indexed by absolute position), and the layout of
several sequences' rows, each over its own cache, in one batched forward (`layout_rows`; a tree's rows among them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from app.engine import kernels
from app.engine.kernels import Kernel
from app.engine.model.config import ModelConfig


class KVCache:
    """Preallocated keys and values for every layer, indexed by absolute position.

    `k` and `v` have shape [n_layers, batch, n_kv_heads, capacity, head_dim]. Only positions below
    `length` are valid; rolling back rejected tokens is `truncate(n)`, an O(1) change of `length`.
    """

    def __init__(
        self,
        config: ModelConfig,
        capacity: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernel: Kernel | None = None,
    ) -> None:
        shape = (config.n_layers, batch, config.n_kv_heads, capacity, config.head_dim)
        # Sliding-window layers: a row attends its last `window` positions, on a kernel through a view of the cache
        # that starts later (`_window_parts`); the storage's tail leaves room for the last layer's view.
        self.window = config.sliding_window if config.sliding_layers else 0
        tail = capacity * config.head_dim if self.window else 0
        numel = math.prod(shape)
        self.k = torch.zeros(numel + tail, dtype=dtype, device=device)[:numel].view(shape)
        self.v = torch.zeros(numel + tail, dtype=dtype, device=device)[:numel].view(shape)
        # Each layer's first sequence as views made once: a batched forward's attention takes them per layer
        # and sequence every step.
        self.layers = [(self.k[i, 0], self.v[i, 0]) for i in range(config.n_layers)]
        self.capacity = capacity
        self.length = 0
        # Attention over this cache runs on a CPU kernel (`Kernel.attention`), whose rows depend on nothing but
        # themselves: no causal mask to build, no padding or fixed span needed for bit-exact results.
        # `kernel`: the one the model's products were packed for (see `Transformer.pack`), None for SDPA.
        # Soft-capped scores are not in the kernel's attention.
        fits = batch == 1 and kernels.attention_fits(kernel, config.head_dim, dtype, torch.device(device))
        self.kernel = kernel if fits and not config.attn_softcap else None
        # Attend over the whole capacity (masked) instead of the valid length: every forward then reduces over
        # the same number of keys, so a token's attention does not depend on how many tokens were fed with it.
        # (Softmax and attention kernels vectorise over the key axis, and a different length changes the order
        # of additions.) Set by callers that need bit-identical results across step shapes.
        self.fixed_span = False

    def needs_mask(self, t: int) -> bool:
        """Whether a forward of `t` rows over this cache needs an explicit causal mask: not on a kernel's
        attention (causal by itself); elsewhere for several rows, or for any with a fixed span."""
        return self.kernel is None and (t > 1 or self.fixed_span)

    def check_span(self, start: int, end: int) -> None:
        """Raise ValueError unless positions start..end-1 can be written next (no gap, within capacity)."""
        if start > self.length:
            raise ValueError(f"start_pos {start} leaves a gap after cache length {self.length}")
        if end > self.capacity:
            raise ValueError(f"position {end - 1} is beyond the cache capacity {self.capacity}")

    def truncate(self, length: int) -> None:
        """Forget every position at or after `length` (rollback after a rejection)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def attention_mask(self, start: int, t: int, mask: Tensor | None = None) -> Tensor:
        """The additive mask (0 or -inf, in the cache's dtype) of a forward of `t` rows from position `start`:
        [T, span], row i (position start+i) seeing keys <= start+i; or `mask` (bool [T, start+T] or [B, T, start+T]
        per sequence, True = may attend) in its place. `span`: the capacity with `fixed_span`, else start+T."""
        # Built once per forward, not per layer: [T, span], query i (position start+i) sees keys <= start+i.
        # Additive (0 or -inf, in the cache's dtype): attention converts a boolean mask on every call.
        span = self.capacity if self.fixed_span else start + t
        device = self.k.device
        if mask is not None:  # the caller's mask over 0..start+T-1 replaces the causal one
            allowed = torch.zeros(*mask.shape[:-1], span, dtype=torch.bool, device=device)
            allowed[..., : mask.shape[-1]] = mask
            # A per-sequence mask [B, T, S] broadcasts over the heads.
            allowed = allowed[:, None] if allowed.dim() == 3 else allowed
        else:
            allowed = torch.arange(span, device=device)[None, :] <= (start + torch.arange(t, device=device))[:, None]
        return torch.zeros(allowed.shape, dtype=self.k.dtype, device=device).masked_fill_(~allowed, float("-inf"))


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's rows in a batched forward (see `layout_rows`)."""

    offset: int  # first row in the batch
    rows: int
    start_pos: int
    cache: KVCache
    mask: Tensor | None
    parents: Tensor | None = None  # int32 [rows]: the rows are a tree (see `layout_rows`)
    positions: Tensor | None = None  # long [rows]: a tree's rows' positions, where a mask carries the tree


@dataclass(frozen=True)
class RowsLayout:
    """Several sequences' rows, one after another, for a batched forward: each sequence's place, cache and
    mask, and the RoPE tables of every row ([N, 1, head_dim], see `rope_tables`; `local`: the sliding layers'
    own, where their RoPE base differs)."""

    parts: list[SequenceRows]
    cos: Tensor
    sin: Tensor
    local: tuple[Tensor, Tensor] | None = None

    def tables(self, local: bool) -> tuple[Tensor, Tensor]:
        """The RoPE tables of a layer (`local`: a sliding one)."""
        return self.local if local and self.local is not None else (self.cos, self.sin)

    def advance(self) -> None:
        """After the forward: each cache now holds its sequence's rows."""
        for p in self.parts:
            p.cache.length = p.start_pos + p.rows

    def split(self, x: Tensor) -> list[Tensor]:
        """Rows [N, ...] of the whole batch -> one [T_i, ...] tensor per sequence."""
        return [x[p.offset : p.offset + p.rows] for p in self.parts]


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each row's depth (its number of ancestors) in a tree of rows given by their parents (-1 for row 0, the
    root; every other row's parent an earlier row). Raises ValueError for anything else."""
    if not parents or parents[0] != -1:
        raise ValueError("a tree's row 0 is its root (parent -1)")
    depths = [0]
    for r in range(1, len(parents)):
        if not 0 <= parents[r] < r:
            raise ValueError(f"row {r}'s parent {parents[r]} is not an earlier row")
        depths.append(depths[parents[r]] + 1)
    return depths


def layout_rows(
    sequences: Sequence[tuple[int, int, KVCache] | tuple[int, int, KVCache, Tensor | None]],
    rope: Callable[[int, int], tuple[Tensor, Tensor]],
    rope_local: Callable[[int, int], tuple[Tensor, Tensor]] | None = None,
) -> RowsLayout:
    """Lay sequences of (rows T_i, start_pos_i, cache_i[, parents_i]) one after another for a batched forward,
    with the RoPE tables of their positions (`rope(start, end)` gives a sequence's) and each one's causal mask
    over its own cache. `parents_i` (int32 [T_i], see `tree_depths`): the rows are a tree (speculative tree
    verification): row r sits at position start_i + its depth and sees the keys before start_i, its ancestors'
    and its own (the kernel's attention reads them in that order; elsewhere an explicit mask). `rope_local`: the
    sliding layers' tables, where their RoPE base differs."""
    parts: list[SequenceRows] = []
    tables: list[tuple[Tensor, Tensor]] = []
    local: list[tuple[Tensor, Tensor]] = []
    offset = 0
    for t, start, cache, *tree in sequences:
        parents = tree[0] if tree else None
        end = start + t
        cache.check_span(start, end)
        positions = None
        if parents is None:
            tables.append(rope(start, end))
            if rope_local is not None:
                local.append(rope_local(start, end))
            mask = cache.attention_mask(start, t) if cache.needs_mask(t) else None
        else:
            listed = parents.tolist()
            depths = tree_depths(listed)
            if len(depths) != t:
                raise ValueError(f"{len(depths)} parents for {t} rows")
            cos, sin = rope(start, start + max(depths) + 1)
            at = torch.tensor(depths, device=cos.device)
            tables.append((cos[at], sin[at]))
            if rope_local is not None:
                cos_l, sin_l = rope_local(start, start + max(depths) + 1)
                local.append((cos_l[at], sin_l[at]))
            mask = None
            # A tree past a sliding window: the window and the tree in one mask (the kernel's parts take either).
            windowed = cache.window and start + t > cache.window
            if cache.kernel is None or not cache.kernel.trees or windowed:
                positions = start + at
                seen = torch.ones(t, start + t, dtype=torch.bool, device=cache.k.device)
                tail = seen[:, start:]
                tail.fill_(False)
                for r in range(t):
                    a = r
                    while a >= 0:
                        tail[r, a] = True
                        a = listed[a]
                mask = cache.attention_mask(start, t, seen)
                parents = None
        parts.append(SequenceRows(offset, t, start, cache, mask, parents, positions))
        offset += t
    both = (torch.cat([c for c, _ in local]), torch.cat([s for _, s in local])) if local else None
    return RowsLayout(parts, torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables]), both)
