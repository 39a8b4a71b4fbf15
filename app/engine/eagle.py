"""A feature-conditioned draft (EAGLE-style): one decoder layer that reads the target's hidden states.

The target's final hidden state at position p already encodes most of what it will say next, so a tiny
network that sees it predicts the target far better than an independent small model of the same cost.
At position p the draft reads [embedding of token p+1, target state h_p], runs one decoder layer with its
own KV cache, and outputs its guess of the next state h_(p+1); the target's own output layer turns that
into token logits. To draft further it feeds its own guessed state back with the token it chose.

The output layer is the target's, restricted to the `vocab_ids` the draft may propose (its most frequent
tokens, as in FR-Spec): a 49k-wide projection per draft step would cost as much as 8 target layers.
The embedding is the target's too, so a shipped draft holds only the fusion layer, the decoder layer, its
norm and the list of ids (a few MB).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from app.engine import kernels
from app.engine.defaults import MAX_DRAFT_TOKENS
from app.engine.drafters import Randomness, choose_draft_token, drawn, one_hot
from app.engine.grammar import GrammarState
from app.engine.loading import LoadedModel
from app.engine.model import (
    DecoderBlock,
    KVCache,
    ModelConfig,
    PackedLinear,
    Transformer,
    can_pack,
    layout_rows,
    rope_tables,
)
from app.engine.penalties import Penalty
from app.engine.quantized import QuantizedWeight
from app.engine.sampling import GumbelNoise, SamplingParams
from app.engine.tree import Candidates, DraftTree, build_tree

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "specserve-eagle"


class EagleError(ValueError):
    """A draft directory that is not a feature draft, or does not fit the target."""


@dataclass(frozen=True)
class EagleConfig:
    """Shape of the draft, and the target it was trained for."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    norm_eps: float
    max_seq_len: int
    target_vocab_size: int
    draft_vocab_size: int
    target_n_layers: int
    target_name: str = ""

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, target_name: str = "") -> EagleConfig:
        """A draft layer shaped like one of `target`'s layers."""
        return cls(
            dim=target.dim,
            n_heads=target.n_heads,
            n_kv_heads=target.n_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rope_theta=target.rope_theta,
            norm_eps=target.norm_eps,
            max_seq_len=target.max_seq_len,
            target_vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_n_layers=target.n_layers,
            target_name=target_name,
        )

    def block_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.target_vocab_size,
            dim=self.dim,
            n_layers=1,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            intermediate_size=self.intermediate_size,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            max_seq_len=self.max_seq_len,
        )


class EagleDraft(nn.Module):
    """The draft network. `forward(states [B, T, dim], next_tokens [B, T], start_pos, cache)` returns its
    predicted next states [B, T, dim]; `draft_logits(states)` projects them onto the draft vocabulary
    [..., draft_vocab_size]. `attach(target)` must be called before either (it lends the embedding and
    output layer)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.block = DecoderBlock(config.block_config())
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.register_buffer("vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)
        self.__dict__["_embed"] = None  # the target's embedding module (attach), kept out of the registry
        self._head_rows = torch.empty(0)
        self.__dict__["_head"] = None
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        self.__dict__["_kernel"] = None  # the CPU kernel pack() laid the block out for (its caches attend on it)

    def attach(self, target: Transformer, pack: bool = False) -> None:
        """Borrow `target`'s (frozen) embedding and the rows of its output layer for `vocab_ids`."""
        c, d = target.config, self.config
        if (c.dim, c.vocab_size, c.n_layers) != (d.dim, d.target_vocab_size, d.target_n_layers):
            raise EagleError(
                f"draft was trained for a target with dim {d.dim}, vocabulary {d.target_vocab_size} and "
                f"{d.target_n_layers} layers; this target has {c.dim}, {c.vocab_size} and {c.n_layers}"
            )
        # Plain tensors and a module kept out of the registry: they belong to the target, so they are
        # neither trained nor saved with the draft.
        self.__dict__["_embed"] = target.embed
        rows = target.head_rows(self.vocab_ids)
        if isinstance(rows, QuantizedWeight):  # a quantized target's rows run as its blocks, on its kernel
            self.__dict__["_head"] = PackedLinear(rows, None)
            self._head_rows = torch.empty(0)
            return
        self.__dict__["_head"] = PackedLinear(rows, None) if pack and can_pack(rows.dtype, rows.device) else None
        self._head_rows = rows

    def pack(self) -> None:
        """Lay the bf16 weights out for the CPU kernel or oneDNN (inference only), as `Transformer.pack` does."""
        dtype, device = self.fc.weight.dtype, self.fc.weight.device
        if not can_pack(dtype, device):
            return
        self.__dict__["_kernel"] = kernels.kernel()
        self.fc = PackedLinear(self.fc.weight, self.fc.bias)  # type: ignore[assignment]
        b = self.block
        b.attn.wqkv = PackedLinear(b.attn.wqkv.weight, b.attn.wqkv.bias)  # type: ignore[assignment]
        b.attn.wo = PackedLinear(b.attn.wo.weight, None)  # type: ignore[assignment]
        b.w13 = PackedLinear(b.w13.weight, None)  # type: ignore[assignment]
        b.w2 = PackedLinear(b.w2.weight, None)  # type: ignore[assignment]

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(self.config.block_config(), capacity, 1, dtype, device, self.__dict__["_kernel"])

    def _rope(self, start: int, end: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        if end > self._rope_len or self._cos.dtype != dtype or self._cos.device != device:
            n = max(end, 4096)
            self._cos, self._sin = rope_tables(self.config.block_config(), n, dtype, device)
            self._rope_len = n
        return self._cos[start:end], self._sin[start:end]

    def forward(self, states: Tensor, next_tokens: Tensor, start_pos: int = 0, cache: KVCache | None = None) -> Tensor:
        if self._embed is None:
            raise RuntimeError("attach(target) first")
        t = states.shape[1]
        x = self.fc(torch.cat([self._embed(next_tokens).to(states.dtype), states], dim=-1))
        cos, sin = self._rope(start_pos, start_pos + t, x.dtype, x.device)
        mask = None
        if cache is not None and cache.needs_mask(t):
            keys = torch.arange(start_pos + t, device=x.device)
            mask = keys[None, :] <= (start_pos + torch.arange(t, device=x.device))[:, None]
        x = self.block(x, cos, sin, 0, cache, start_pos, mask)
        if cache is not None:
            cache.length = start_pos + t
        return self.norm(x)

    def forward_batch(self, items: Sequence[tuple[Tensor, Tensor, int, KVCache]]) -> list[Tensor]:
        """`forward` for several sessions at once: (states [T_i, dim], next_tokens [T_i], start_pos_i,
        cache_i) each; returns predicted states [T_i, dim] per session. The weights are read once for all."""
        if self._embed is None:
            raise RuntimeError("attach(target) first")
        states = torch.cat([s for s, _, _, _ in items])[None]
        tokens = torch.cat([t for _, t, _, _ in items])[None]
        dtype, device = states.dtype, states.device
        layout = layout_rows(
            [(s.shape[0], start, cache) for s, _, start, cache in items],
            lambda a, b: self._rope(a, b, dtype, device),
        )
        x = self.fc(torch.cat([self._embed(tokens).to(dtype), states], dim=-1))
        x = self.block.forward_parts(x, layout, 0)
        layout.advance()
        return layout.split(self.norm(x)[0])

    def draft_logits(self, states: Tensor) -> Tensor:
        """Logits over the draft vocabulary [..., draft_vocab_size] for predicted states [..., dim]."""
        head = self.__dict__["_head"]
        return head(states) if head is not None else F.linear(states, self._head_rows)


def save_draft(draft: EagleDraft, out_dir: Path) -> None:
    """Write config.json and model.safetensors (float32 weights and the vocabulary ids) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"architecture": ARCHITECTURE, **asdict(draft.config)}
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    state = {
        k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else torch.int64).contiguous()
        for k, v in draft.state_dict().items()
    }
    save_file(state, str(out_dir / WEIGHTS_FILE))


def is_eagle_dir(path: Path) -> bool:
    """Whether `path` is a directory holding a feature draft."""
    cfg = path / CONFIG_FILE
    if not (path.is_dir() and cfg.is_file() and (path / WEIGHTS_FILE).is_file()):
        return False
    try:
        return json.loads(cfg.read_text()).get("architecture") == ARCHITECTURE
    except (OSError, ValueError):
        return False


def load_draft(path: Path, target: Transformer) -> EagleDraft:
    """The draft in `path`, attached to `target`, in its dtype and on its device, ready for inference."""
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
        cfg.pop("architecture", None)
        config = EagleConfig(**cfg)
        state = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError, TypeError, SafetensorError) as exc:
        raise EagleError(f"cannot read the draft in {path}: {exc}") from exc
    draft = EagleDraft(config)
    try:
        draft.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise EagleError(f"draft weights in {path} do not match its config: {exc}") from exc
    if int(draft.vocab_ids.max()) >= target.config.vocab_size:
        raise EagleError("draft vocabulary ids exceed the target's vocabulary")
    draft = draft.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    draft.attach(target, pack=True)
    draft.pack()
    return draft


# Most positions a session catches up on in one step (see _EagleSession._catch_up).
_CATCH_UP = 512


class _EagleSession:
    """Per-request state: the draft's KV cache, and how many positions it holds with the target's true
    states. The generation writes the target's state of every verified position into `features`."""

    def __init__(self, drafter: EagleDrafter, capacity: int) -> None:
        self._draft = drafter.draft
        self._target_vocab = drafter.draft.config.target_vocab_size
        dtype, device = drafter.target.dtype, drafter.target.device
        self.features = torch.zeros(capacity, drafter.draft.config.dim, dtype=dtype, device=device)
        self._cache = self._draft.new_cache(capacity, dtype, device)
        self._true_len = 0  # draft positions computed from the target's states, never to be rolled back
        self.penalty: Penalty | None = None  # the request's penalties, set by the generation
        self.grammar: GrammarState | None = None  # the request's grammar, set by the generation

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        return self._run(token_ids, k, p_min, None, None)[0]

    def propose_sampled(
        self,
        token_ids: Sequence[int],
        k: int,
        params: SamplingParams,
        rng: Randomness,
        p_min: float = 0.0,
    ) -> tuple[list[int], Tensor | None]:
        return self._run(token_ids, k, p_min, params, rng)

    def propose_candidates(
        self,
        token_ids: Sequence[int],
        k: int,
        width: int,
        params: SamplingParams | None = None,
        noise: GumbelNoise | None = None,
        p_min: float = 0.0,
    ) -> Candidates:
        """The chain `propose` (greedy, `params` None) or `propose_sampled` with Gumbel `noise` gives, with
        each token's draft probability and the draft's next `width` choices at each depth (by probability): a
        tree's material (`app.engine.tree.build_tree`), for no more draft forwards than the chain."""
        found = Candidates([])
        self._run(token_ids, k, p_min, params, noise, found, width)
        return found

    def propose_tree(
        self,
        token_ids: Sequence[int],
        k: int,
        max_rows: int,
        params: SamplingParams | None = None,
        noise: GumbelNoise | None = None,
        p_min: float = 0.0,
        min_value: float = 0.0,
    ) -> DraftTree:
        found = self.propose_candidates(token_ids, k, max_rows - 1, params, noise, p_min)
        return build_tree(token_ids[-1], found, (), max_rows, min_value=min_value)

    def _catch_up(self, token_ids: Sequence[int], k: int) -> tuple[Tensor, Tensor, int] | None:
        """The first draft forward's input: (states [T, dim], tokens [T], start position), or None when
        nothing can be drafted. Rolls the cache back to the positions computed from the target's states."""
        n = len(token_ids)
        # States are known for positions 0..n-2 (the newest token has not been through the target yet).
        # Position p reads (state p, token p+1), so the draft catches up on positions true_len..n-2.
        if k <= 0 or n < 2 or n + k > self._cache.capacity:
            return None
        # Re-feed at least the newest known position: its output is the first guess.
        self._true_len = min(self._true_len, n - 2)
        self._cache.truncate(self._true_len)
        if n - 1 - self._true_len > _CATCH_UP:
            # After a long prompt: catch up a slice per step and draft nothing meanwhile, so that no step runs the
            # draft over the whole prompt at once (seconds at 8k tokens), which every request beside it would wait for.
            end = self._true_len + _CATCH_UP
            feed = torch.tensor(token_ids[self._true_len + 1 : end + 1], dtype=torch.long, device=self.features.device)
            self._draft(self.features[self._true_len : end][None], feed[None], self._true_len, self._cache)
            self._true_len = end
            return None
        states = self.features[self._true_len : n - 1]
        tokens = torch.tensor(token_ids[self._true_len + 1 : n], dtype=torch.long, device=self.features.device)
        pos = self._true_len
        self._true_len = n - 1
        return states, tokens, pos

    @torch.inference_mode()
    def _run(
        self,
        token_ids: Sequence[int],
        k: int,
        p_min: float,
        params: SamplingParams | None,
        rng: Randomness,
        found: Candidates | None = None,
        width: int = 0,
    ) -> tuple[list[int], Tensor | None]:
        """Up to `k` drafted tokens (and with a generator their warped distributions); `found`: filled with
        the tokens, their probabilities and the next `width` choices at each depth."""
        first = self._catch_up(token_ids, k)
        if first is None:
            return [], None
        draft = self._draft
        device = self.features.device
        states, tokens, pos = first[0][None], first[1][None], first[2]
        out: list[int] = []
        dists: list[Tensor] = []
        # Tokens the grammar forces do not count against k (`own` does): `limit` bounds them all.
        own, limit = 0, min(max(k, MAX_DRAFT_TOKENS), self._cache.capacity - len(token_ids))
        while own < k and len(out) < limit:
            guess = draft(states, tokens, pos, self._cache)[:, -1:]  # [1, 1, dim]
            pos += states.shape[1]
            forced = self.grammar.forced(out) if self.grammar is not None else None
            if forced is not None:  # no choice to make: the head need not run
                if drawn(params, rng):
                    dists.append(one_hot(forced, self._target_vocab, device))
                out.append(forced)
                states = guess
                tokens = torch.tensor([[forced]], dtype=torch.long, device=device)
                continue
            own += 1
            logits = draft.draft_logits(guess[0, 0]).float()
            choice = choose_draft_token(
                logits, params, rng, p_min, len(token_ids) + len(out), draft.vocab_ids, self.penalty, out, self.grammar
            )
            if choice is None:
                break
            idx, warped = choice
            if found is not None:
                probs = torch.softmax(logits, -1)
                top = torch.topk(probs, min(width + 1, probs.shape[0]))
                found.probs.append(float(probs[idx]))
                found.alternatives.append(
                    [
                        (int(draft.vocab_ids[i]), float(p))
                        for p, i in zip(top.values, top.indices, strict=True)
                        if i != idx
                    ][:width]
                )
                found.tokens.append(int(draft.vocab_ids[idx]))
            if warped is not None:
                # q over the target's whole vocabulary: ids outside the draft's have q = 0.
                full = torch.zeros(self._target_vocab, dtype=warped.dtype, device=device)
                full[draft.vocab_ids] = warped
                dists.append(full)
            tok = int(draft.vocab_ids[idx])
            out.append(tok)
            states = guess
            tokens = torch.tensor([[tok]], dtype=torch.long, device=device)
        return out, torch.stack(dists) if dists else None


class EagleDrafter:
    """Proposer backed by a feature draft; its sessions need the target's states (a `FeatureSession`)."""

    def __init__(self, name: str, draft: EagleDraft, target: LoadedModel) -> None:
        self.name = name
        self.draft = draft
        self.target = target.model

    def session(self, capacity: int) -> _EagleSession:
        return _EagleSession(self, capacity)

    @torch.inference_mode()
    def propose_batch(
        self,
        sessions: Sequence[_EagleSession],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        p_mins: Sequence[float],
    ) -> list[list[int]]:
        """Greedy drafts for several requests, each draft step one forward over all of them (what
        `propose` gives each alone, up to the last bits of the products)."""
        draft = self.draft
        out: list[list[int]] = [[] for _ in sessions]
        # As in `_run`: forced tokens do not count against k, `limits` bounds them all.
        own = [0] * len(sessions)
        limits = [
            min(max(k, MAX_DRAFT_TOKENS), s._cache.capacity - len(ids))
            for s, ids, k in zip(sessions, token_ids, ks, strict=True)
        ]
        # (request, states [T, dim], tokens [T], start position) of the sessions still drafting.
        active = []
        for i, (session, ids, k) in enumerate(zip(sessions, token_ids, ks, strict=True)):
            first = session._catch_up(ids, k)
            if first is not None:
                active.append((i, *first))
        while active:
            guesses = draft.forward_batch([(s, t, pos, sessions[i]._cache) for i, s, t, pos in active])
            last = torch.cat([g[-1:] for g in guesses])  # [n, dim]
            logits = draft.draft_logits(last).float()
            going = []
            for row, ((i, states, _, pos), guess) in enumerate(zip(active, guesses, strict=True)):
                grammar = sessions[i].grammar
                tok = grammar.forced(out[i]) if grammar is not None else None
                if tok is None:
                    choice = choose_draft_token(
                        logits[row],
                        None,
                        None,
                        p_mins[i],
                        ids=draft.vocab_ids,
                        penalty=sessions[i].penalty,
                        drafted=out[i],
                        grammar=grammar,
                    )
                    if choice is None:
                        continue
                    tok = int(draft.vocab_ids[choice[0]])
                    own[i] += 1
                out[i].append(tok)
                if own[i] < ks[i] and len(out[i]) < limits[i]:
                    feed = torch.tensor([tok], dtype=torch.long, device=last.device)
                    going.append((i, guess[-1:], feed, pos + states.shape[0]))
            active = going
        return out
