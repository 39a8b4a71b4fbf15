"""A model draft: a small decoder sharing the target's vocabulary, with its own KV cache, driven by the draft
loop (app.engine.drafting.loop)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from app.engine.defaults import MAX_DRAFT_TOKENS
from app.engine.drafting.base import Drafter, DraftError, DraftSession
from app.engine.drafting.loop import NetworkSession
from app.engine.memory import kv_cache_bytes
from app.engine.model.cache import KVCache
from app.engine.model.loading import LoadedModel


class _ModelDraftSession(NetworkSession):
    def __init__(self, drafter: ModelDrafter, capacity: int) -> None:
        super().__init__()
        self._model = drafter.model
        self._vocab = drafter.vocab_limit
        self.target_vocab = drafter.target_vocab
        self.device = drafter.model.device
        # A draft's context can be shorter than the request's: it proposes while the sequence fits it.
        self._cache: KVCache = self._model.new_cache(min(capacity, self._model.config.max_seq_len))
        self._ids: list[int] = []  # the tokens whose keys and values sit in the cache, in order
        self._feed = torch.empty(0)  # the next forward's tokens, long [1, T], from position `_pos`
        self._pos = 0

    def begin(self, token_ids: Sequence[int], k: int) -> int:
        if len(token_ids) > self._cache.capacity:
            return 0
        # Roll back to the longest prefix the cache shares with the accepted sequence (an O(1) move),
        # keeping at least one token to feed so the next logits exist.
        keep = 0
        limit = min(len(self._ids), len(token_ids) - 1)
        while keep < limit and self._ids[keep] == token_ids[keep]:
            keep += 1
        self._cache.truncate(keep)
        self._ids = list(token_ids)
        self._feed = torch.tensor([token_ids[keep:]], dtype=torch.long, device=self._model.device)
        self._pos = keep
        return min(max(k, MAX_DRAFT_TOKENS), self._cache.capacity - len(token_ids) + 1)

    def feed(self, token: int) -> None:
        self._feed = torch.tensor([[token]], dtype=torch.long, device=self._model.device)
        self._ids.append(token)

    def readable(self, token: int) -> bool:
        return token < self._vocab

    @classmethod
    def forward(cls, sessions: Sequence[NetworkSession], heads: Sequence[bool], batched: bool) -> list[Tensor | None]:
        # Each session alone: the draft's forward takes one cache.
        out: list[Tensor | None] = []
        for s, head in zip(sessions, heads, strict=True):
            assert isinstance(s, _ModelDraftSession)
            hidden = s._model.hidden(s._feed, s._pos, s._cache)
            s._pos += s._feed.shape[1]
            # Only ids the target can verify may be proposed (a padded draft head can be wider).
            out.append(s._model.logits(hidden[0, -1])[: s._vocab] if head else None)
        return out


class ModelDrafter(Drafter):
    """A small decoder sharing the target's vocabulary, proposing with its own KV cache."""

    def __init__(self, name: str, draft: LoadedModel, target: LoadedModel) -> None:
        differs = target.tokenizer.difference(draft.tokenizer)
        if differs is not None:
            raise DraftError(
                f"draft {name!r} does not share the target's vocabulary ({differs}); a draft must use the target's "
                "tokenizer (any target has the lookup drafts: ngram, suffix)"
            )
        self.name = name
        self.model = draft.model
        # Only ids the target can verify may be proposed (a padded draft head can be wider).
        self.vocab_limit = min(draft.model.config.vocab_size, target.model.config.vocab_size)
        self.target_vocab = target.model.config.vocab_size

    def session(self, capacity: int) -> DraftSession:
        return _ModelDraftSession(self, capacity)

    def session_bytes(self, capacity: int) -> int:
        """The draft's own KV cache, within its context (as `_ModelDraftSession` allocates it)."""
        config = self.model.config
        return kv_cache_bytes(config, min(capacity, config.max_seq_len), self.model.dtype)
