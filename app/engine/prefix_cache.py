"""Automatic prefix caching: the target's keys and values of token blocks already computed, reused exactly.

A request whose prompt starts with blocks that a running or finished request computed copies their keys,
values and final hidden states (what a feature draft reads) into its own cache and prefills only the rest.
Blocks are `block_tokens` long and keyed by their tokens and their parent block, so a block is found only after
the very same prefix: vLLM's chained block hashes, with the tokens themselves as the key (no hash collision can
give a request another prompt's keys). Only full blocks are kept, and a lookup leaves at least the prompt's last
token to run (its logits choose the first token).

Exact by construction where rows are independent (`Transformer.rows_independent`: the CPU kernels): a
position's keys and values are then a function of the tokens up to it, whatever forward computed them (a
whole prompt, a chunk, a verification, a tree's path), so a reused block is bit for bit what a fresh prefill
writes. The engine keeps no cache elsewhere.

Memory is bounded (`max_bytes`, and below it `limit`, which the server lowers to what running requests leave of
its KV budget: cached blocks are memory admission may take back): the least recently used blocks go first. A
lookup touches its chain from the last block to the first, so a block is always more recent than its
descendants and eviction takes leaves first (a parent evicted before its child would leave the child
unreachable).

Tenants share the memory, not the blocks, and each is owed a share of it (`tenant_share` of `limit`), so one
tenant cannot evict everyone (a noisy neighbour): a tenant whose store overflows the cache while it holds more
than its share pays with its own least recently used blocks, never another tenant's; otherwise the tenant holding
the most loses its least recently used. A tenant alone may fill the whole cache (a single-user server loses
nothing to the bound).

Copies rather than shared pages: the kernels attend over one contiguous cache per request, and a copy of a
block costs a memcpy (microseconds) against the forward that computed it (milliseconds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from app.engine.defaults import DEFAULT_TENANT_CACHE_SHARE
from app.engine.model.cache import KVCache

DEFAULT_BLOCK_TOKENS = 16


def _root(tenant: str | None) -> int | str:
    """The parent key of a tenant's first blocks: 0 for the shared default, a string no block id can equal for a
    salt, so that one tenant's blocks are never found after another's prompt (no timing side channel)."""
    return 0 if tenant is None else f"tenant:{tenant}"


@dataclass(eq=False)
class _Block:
    # (the parent block's id, or for the first block its tenant's root: 0 for the shared one; this block's tokens)
    key: tuple[int | str, tuple[int, ...]]
    tenant: str | None
    id: int
    k: Tensor  # [n_layers, n_kv_heads, block_tokens, head_dim]
    v: Tensor
    features: Tensor | None  # [block_tokens, dim]: the target's final hidden states, when they were known
    children: int = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (self.features.nbytes if self.features is not None else 0)


class PrefixCache:
    """Blocks of keys and values by exact token prefix, least recently used evicted beyond `max_bytes`, each
    tenant owed `tenant_share` (0 < share <= 1) of the memory (the module's docstring).

    Not thread-safe: the worker thread alone calls it; `bytes` and `blocks` may be read from elsewhere (plain
    ints). What a request got from it is its `GenerationStats.cached_tokens`, which the metrics count."""

    def __init__(
        self, max_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, tenant_share: float = DEFAULT_TENANT_CACHE_SHARE
    ) -> None:
        if block_tokens < 1 or max_bytes < 0:
            raise ValueError("need block_tokens >= 1 and max_bytes >= 0")
        if not 0 < tenant_share <= 1:
            raise ValueError("need 0 < tenant_share <= 1")
        self.max_bytes = max_bytes
        self.limit = max_bytes  # what the blocks may take now (`bound`)
        self.block_tokens = block_tokens
        self.tenant_share = tenant_share
        self._blocks: dict[tuple[int | str, tuple[int, ...]], _Block] = {}
        # Per tenant, its blocks least recent first, and the bytes they hold.
        self._lru: dict[str | None, OrderedDict[int, _Block]] = {}
        self._held: dict[str | None, int] = {}
        self._by_id: dict[int, _Block] = {}
        self._next_id = 1
        self.bytes = 0

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def _chain(self, ids: Sequence[int], limit: int, features: bool, tenant: str | None) -> list[_Block]:
        """The cached blocks of `tenant` that start `ids`, at most `limit` tokens of them; with `features`, only
        blocks that carry the target's hidden states."""
        b = self.block_tokens
        chain: list[_Block] = []
        parent: int | str = _root(tenant)
        for start in range(0, limit - b + 1, b):
            block = self._blocks.get((parent, tuple(ids[start : start + b])))
            if block is None or (features and block.features is None):
                break
            chain.append(block)
            parent = block.id
        return chain

    def load(
        self, ids: Sequence[int], prompt_len: int, cache: KVCache, features: Tensor | None, tenant: str | None = None
    ) -> int:
        """Copy the cached blocks of `tenant` (a request's cache_salt; None: the shared default) that continue `ids`
        from `cache.length` into `cache` (and `features` [capacity, dim], when given) and move its length past
        them; returns the tokens loaded (0: none). At most `prompt_len - 1` positions end up computed, so the
        prompt's last token still runs."""
        start = cache.length
        b = self.block_tokens
        if start % b or self.max_bytes == 0:
            return 0
        chain = self._chain(ids, prompt_len - 1, features is not None, tenant)[start // b :]
        if not chain:
            return 0
        for i, block in enumerate(chain):
            lo = start + i * b
            cache.k[:, 0, :, lo : lo + b] = block.k
            cache.v[:, 0, :, lo : lo + b] = block.v
            if features is not None:
                assert block.features is not None
                features[lo : lo + b] = block.features
        self._touch(chain)
        cache.length = start + len(chain) * b
        return len(chain) * b

    def store(self, ids: Sequence[int], cache: KVCache, features: Tensor | None, tenant: str | None = None) -> None:
        """Keep, for `tenant`, the full blocks of positions 0..cache.length-1 (`ids` their tokens; `features`
        [>= length, dim] the target's hidden states of those positions, or None) that are not cached yet. Blocks
        already cached are touched, and given `features` when they had none."""
        b = self.block_tokens
        n = min(cache.length, len(ids)) // b * b
        if n == 0 or self.limit == 0:
            return
        chain: list[_Block] = []
        parent: _Block | None = None
        for lo in range(0, n, b):
            key = (parent.id if parent is not None else _root(tenant), tuple(ids[lo : lo + b]))
            block = self._blocks.get(key)
            feats = features[lo : lo + b].clone() if features is not None else None
            if block is None:
                block = _Block(
                    key,
                    tenant,
                    self._next_id,
                    cache.k[:, 0, :, lo : lo + b].clone(),
                    cache.v[:, 0, :, lo : lo + b].clone(),
                    feats,
                )
                self._next_id += 1
                self._blocks[key] = block
                self._by_id[block.id] = block
                self._lru.setdefault(tenant, OrderedDict())[block.id] = block
                self._held[tenant] = self._held.get(tenant, 0) + block.nbytes
                self.bytes += block.nbytes
                if parent is not None:
                    parent.children += 1
            elif block.features is None and feats is not None:
                block.features = feats
                self._held[tenant] += feats.nbytes
                self.bytes += feats.nbytes
            chain.append(block)
            parent = block
        self._touch(chain)
        self._shrink(self.limit, keep=chain, writer=tenant)

    def bound(self, nbytes: int) -> None:
        """Hold at most `nbytes` (never more than `max_bytes`) from now on, evicting what is over (least recently
        used first): the memory that admitted requests leave it."""
        self.limit = max(0, min(self.max_bytes, nbytes))
        self._shrink(self.limit)

    def _touch(self, chain: list[_Block]) -> None:
        # The last block first: each block ends up more recent than its descendants (a chain is one tenant's).
        for block in reversed(chain):
            self._lru[block.tenant].move_to_end(block.id)

    def _leaf(self, tenant: str | None, spared: set[int]) -> _Block | None:
        """`tenant`'s least recently used block that no other block continues and that is not `spared`."""
        return next((b for b in self._lru[tenant].values() if b.children == 0 and b.id not in spared), None)

    def _shrink(self, limit: int, keep: Sequence[_Block] = (), writer: str | None = None) -> None:
        """Evict least recently used leaves until the blocks take at most `limit` bytes, sparing `keep` (the chain
        `writer` just stored) unless nothing else is left. A writer over its share evicts only its own blocks (that
        chain's tail too); otherwise the tenant holding the most goes first."""
        spared = {block.id for block in keep}
        while self.bytes > limit and self._blocks:
            victim: _Block | None = None
            if keep and self._held.get(writer, 0) > self.tenant_share * limit:
                victim = self._leaf(writer, set())
            else:
                for tenant in sorted(self._held, key=self._held.__getitem__, reverse=True):
                    victim = self._leaf(tenant, spared)
                    if victim is not None:
                        break
            if victim is None:
                if not spared:
                    break
                spared = set()  # the chain alone exceeds the limit: its tail goes too
                continue
            self._evict(victim)

    def _evict(self, victim: _Block) -> None:
        del self._blocks[victim.key]
        del self._by_id[victim.id]
        lru = self._lru[victim.tenant]
        del lru[victim.id]
        self._held[victim.tenant] -= victim.nbytes
        if not lru:
            del self._lru[victim.tenant], self._held[victim.tenant]
        self.bytes -= victim.nbytes
        parent = self._by_id.get(victim.key[0])
        if parent is not None:
            parent.children -= 1
