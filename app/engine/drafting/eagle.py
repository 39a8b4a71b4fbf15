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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from app.engine.defaults import DEFAULT_DRAFT_WEIGHTS, DRAFT_WEIGHTS, MAX_DRAFT_TOKENS
from app.engine.drafting.adapter import Adapter
from app.engine.drafting.base import Drafter, DraftSession
from app.engine.drafting.loop import NetworkSession, run_drafts
from app.engine.drafting.tree import Candidates, DraftTree, TreeShape, build_tree
from app.engine.kernels import DraftChain, Kernel, LayerStack, StackLayer, attention_fits
from app.engine.kernels.quantized import FORMATS, QuantizedWeight, quantize
from app.engine.memory import kv_cache_bytes
from app.engine.model.cache import KVCache, layout_rows
from app.engine.model.config import ModelConfig
from app.engine.model.loading import LoadedModel
from app.engine.model.packing import PackedLinear, can_pack
from app.engine.model.transformer import DecoderBlock, Transformer, final_norm, rope_tables

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
    output layer). Both take a tenant's `Adapter` (app.engine.drafting.adapter), which adds to the fusion
    layer's output and to the logits. `source`: the directory it was read from, if any."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.block = DecoderBlock(config.block_config())
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.register_buffer("vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)
        self.__dict__["_embed"] = None  # the target's embedding module (attach), kept out of the registry
        self._embed_scale = 1.0  # the target's factor on its embeddings (attach)
        self._head_rows = torch.empty(0)
        self.__dict__["_head"] = None
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        self.__dict__["_kernel"] = None  # the CPU kernel pack() laid the block out for (its caches attend on it)
        self.__dict__["_stack"] = None  # the decoder layer in one kernel call (pack)
        self.__dict__["_chain"] = None  # a greedy chain of draft tokens in one kernel call (pack)
        self._ids: list[int] | None = None  # vocab_ids as a list, and each id's index (chain)
        self._index: dict[int, int] = {}
        self._extra: dict[int, Tensor] = {}  # embedding rows of tokens outside the draft vocabulary (chain)
        self.source: Path | None = None  # the directory it was read from

    def attach(self, target: Transformer, pack: bool = False, qtype: str | None = None) -> None:
        """Borrow `target`'s (frozen) embedding and the rows of its output layer for `vocab_ids`. `pack`: the rows
        run on the target's kernel; `qtype` (with `pack`): bf16 rows run as blocks of that format too (a quantized
        target's rows always run as its own blocks)."""
        c, d = target.config, self.config
        if (c.dim, c.vocab_size, c.n_layers) != (d.dim, d.target_vocab_size, d.target_n_layers):
            raise EagleError(
                f"draft was trained for a target with dim {d.dim}, vocabulary {d.target_vocab_size} and "
                f"{d.target_n_layers} layers; this target has {c.dim}, {c.vocab_size} and {c.n_layers}"
            )
        # Plain tensors and a module kept out of the registry: they belong to the target, so they are
        # neither trained nor saved with the draft.
        self.__dict__["_embed"] = target.embed
        self._embed_scale = c.embed_scale
        rows = target.head_rows(self.vocab_ids)
        if isinstance(rows, QuantizedWeight):  # a quantized target's rows run as blocks, on its kernel
            if pack and qtype is not None and _bytes_per_weight(qtype) < min(map(_bytes_per_weight, rows.formats)):
                rows = quantize(rows.dequantize(), qtype)  # fewer bytes a draft token (q4_0 of Q8_0 rows)
            self.__dict__["_head"] = PackedLinear(rows, None, target.kernel)
            self._head_rows = torch.empty(0)
            return
        packs = pack and can_pack(rows.dtype, rows.device, target.kernel)
        if packs and qtype is not None and target.kernel is not None:
            self.__dict__["_head"] = PackedLinear(quantize(rows, qtype), None, target.kernel)
            self._head_rows = torch.empty(0)
            return
        self.__dict__["_head"] = PackedLinear(rows, None, target.kernel) if packs else None
        self._head_rows = rows

    def _matrices(self) -> list[tuple[nn.Module, str]]:
        b = self.block
        return [(self, "fc"), (b.attn, "wqkv"), (b.attn, "wo"), (b, "w13"), (b, "w2")]

    def quantize(self, kernel: Kernel, qtype: str) -> None:
        """Every matrix of the draft (the fusion layer and the decoder layer's four) as `qtype` blocks (see
        `app.engine.kernels.quantized.quantize`), computed on by `kernel`'s integer products: a draft token then
        reads about half (Q8_0) or a quarter (Q4_0) of its bf16 bytes. Call on the float32 weights, before `pack`
        (inference only, irreversible)."""
        for owner, name in self._matrices():
            lin = getattr(owner, name)
            if isinstance(lin, nn.Linear):
                # The bias copied: the module's own is cast with the draft's dtype later, and the product keeps floats.
                bias = None if lin.bias is None else lin.bias.detach().float().clone()
                setattr(owner, name, PackedLinear(quantize(lin.weight, qtype), bias, kernel))

    def pack(self, kernel: Kernel | None) -> None:
        """Lay the bf16 weights out for `kernel` (the target's) or oneDNN (inference only), as `Transformer.pack`
        does; on a kernel whose attention fits, the decoder layer then runs as a one-layer `LayerStack` (one C
        call for its norms, products, RoPE, attention and residuals)."""
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        if not can_pack(dtype, device, kernel):
            return
        self.__dict__["_kernel"] = kernel
        for owner, name in self._matrices():
            lin = getattr(owner, name)
            if isinstance(lin, nn.Linear):
                setattr(owner, name, PackedLinear(lin.weight, lin.bias, kernel))
        self.__dict__["_stack"] = self._layer_stack(kernel)
        self.__dict__["_chain"] = self._draft_chain()

    def _draft_chain(self) -> DraftChain | None:
        stack, head = self.__dict__["_stack"], self.__dict__["_head"]
        if stack is None or head is None or not isinstance(self.fc, PackedLinear):
            return None
        if head.fused is None or self.fc.fused is None or head.fused.kernel is not stack.kernel:
            return None
        # The chain feeds back tokens it chose, so it holds their rows: the draft vocabulary's, as the lookup
        # gives them (bf16 [V', dim]: 9.4 MB for the default draft), read without a call back into Python.
        embed = torch.cat([self._embedded(ids) for ids in self.vocab_ids.split(4096)]).to(torch.bfloat16)
        try:
            return DraftChain(stack, self.fc.fused, head.fused, self.norm.weight, embed, self.config.norm_eps)
        except ValueError:  # a padded product, or a width the chain does not take: token by token
            return None

    def _layer_stack(self, kernel: Kernel | None) -> LayerStack | None:
        # A draft token ran a dozen torch operations around its products (RoPE, the residuals, norms), each a
        # dispatch that cost more than the arithmetic of a 1-row layer.
        b, cfg = self.block, self.config
        if kernel is None or not attention_fits(kernel, cfg.head_dim, self.norm.weight.dtype, self.norm.weight.device):
            return None
        if not b._fusable():
            return None
        layer = StackLayer(
            b.attn.wqkv.fused, b.attn.wo.fused, b.w13.fused, b.w2.fused, b.attn_norm.weight, b.ffn_norm.weight
        )
        try:
            return LayerStack(kernel, [layer], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps)
        except ValueError:  # padded products: the layer's own calls
            return None

    @property
    def runs_as(self) -> str:
        """What the draft's matrices run as: their GGUF format (`Q8_0`), `bfloat16` or `float32`."""
        fc = self.fc
        if isinstance(fc, PackedLinear) and fc.quantized is not None:
            return "+".join(fc.quantized.formats)
        return str(self.norm.weight.dtype).removeprefix("torch.")

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(self.config.block_config(), capacity, 1, dtype, device, self.__dict__["_kernel"])

    def _rope(self, start: int, end: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        if end > self._rope_len or self._cos.dtype != dtype or self._cos.device != device:
            n = max(end, 4096)
            self._cos, self._sin = rope_tables(self.config.block_config(), n, dtype, device)
            self._rope_len = n
        return self._cos[start:end], self._sin[start:end]

    def _stack_for(self, caches: Sequence[KVCache]) -> LayerStack | None:
        stack = self.__dict__["_stack"]
        return stack if stack is not None and all(c.kernel is stack.kernel for c in caches) else None

    def _embedded(self, ids: Tensor) -> Tensor:
        # The token as the target's first layer reads it: Gemma scales its embeddings (by sqrt(dim), in the
        # activations' dtype), and a draft fed the raw rows sees its token 25 times fainter than the target's state.
        x = self._embed(ids)
        return x if self._embed_scale == 1.0 else x * torch.tensor(self._embed_scale, dtype=x.dtype)

    def _final_norm(self, x: Tensor) -> Tensor:
        return final_norm(self.norm, self.__dict__["_kernel"], x)

    def forward(
        self,
        states: Tensor,
        next_tokens: Tensor,
        start_pos: int = 0,
        cache: KVCache | None = None,
        adapter: Adapter | None = None,
    ) -> Tensor:
        if self._embed is None:
            raise RuntimeError("attach(target) first")
        t = states.shape[1]
        inputs = torch.cat([self._embedded(next_tokens).to(states.dtype), states], dim=-1)
        x = self.fc(inputs)
        if adapter is not None:
            x = x + adapter.fusion(inputs).to(x.dtype)
        cos, sin = self._rope(start_pos, start_pos + t, x.dtype, x.device)
        stack = self._stack_for([cache]) if cache is not None and x.shape[0] == 1 else None
        if stack is not None:
            assert cache is not None
            x = stack(x, cos, sin, cache.k, cache.v, start_pos)
        else:
            mask = None
            if cache is not None and cache.needs_mask(t):
                keys = torch.arange(start_pos + t, device=x.device)
                mask = keys[None, :] <= (start_pos + torch.arange(t, device=x.device))[:, None]
            x = self.block(x, cos, sin, 0, cache, start_pos, mask)
        if cache is not None:
            cache.length = start_pos + t
        return self._final_norm(x)

    def forward_batch(
        self,
        items: Sequence[tuple[Tensor, Tensor, int, KVCache]],
        adapters: Sequence[Adapter | None] | None = None,
    ) -> list[Tensor]:
        """`forward` for several sessions at once: (states [T_i, dim], next_tokens [T_i], start_pos_i,
        cache_i) each, and each one's adapter (None: none); returns predicted states [T_i, dim] per session.
        The weights are read once for all."""
        if self._embed is None:
            raise RuntimeError("attach(target) first")
        states = torch.cat([s for s, _, _, _ in items])[None]
        tokens = torch.cat([t for _, t, _, _ in items])[None]
        dtype, device = states.dtype, states.device
        layout = layout_rows(
            [(s.shape[0], start, cache) for s, _, start, cache in items],
            lambda a, b: self._rope(a, b, dtype, device),
        )
        inputs = torch.cat([self._embedded(tokens).to(dtype), states], dim=-1)
        x = self.fc(inputs)
        if adapters is not None and any(a is not None for a in adapters):
            x = x.clone()
            lo = 0
            for (s, _, _, _), adapter in zip(items, adapters, strict=True):
                hi = lo + s.shape[0]
                if adapter is not None:
                    x[0, lo:hi] += adapter.fusion(inputs[0, lo:hi]).to(x.dtype)
                lo = hi
        stack = self._stack_for([p.cache for p in layout.parts])
        if stack is not None and all(p.mask is None for p in layout.parts):
            seqs = [(p.cache.k, p.cache.v, p.start_pos, p.rows, None) for p in layout.parts]
            x = stack.batch(x, layout.cos, layout.sin, seqs)
        else:
            x = self.block.forward_parts(x, layout, 0)
        layout.advance()
        return layout.split(self._final_norm(x)[0])

    def chain(
        self,
        states: Tensor,
        tokens: Sequence[int],
        start: int,
        cache: KVCache,
        k: int,
        p_min: float,
        value_min: float = 0.0,
    ) -> tuple[list[int], Tensor, int] | None:
        """Up to `k` greedy tokens in one kernel call (`DraftChain`), without an adapter: what `forward` over
        states [T, dim] and `tokens` (T) from `start`, then `draft_logits` and the greedy choice with the cut-offs
        `p_min` and `value_min` (`choose_draft_token`'s), each chosen token fed back with its guessed state, give.
        Returns (target token ids, the last guessed state [1, dim], the position after the last forward), or None
        where the chain does not run (no kernel, or a cache of another)."""
        chain = self.__dict__["_chain"]
        if chain is None or self._stack_for([cache]) is None:
            return None
        if self._ids is None:
            self._ids = self.vocab_ids.tolist()
            self._index = {token: i for i, token in enumerate(self._ids)}
        rows = [self._row(chain, token) for token in tokens]
        cos, sin = self._rope(0, start + len(tokens) + k, states.dtype, states.device)
        addresses = [addr for addr, _ in rows]
        found, guess, end = chain(states, addresses, cache.k, cache.v, start, cos, sin, k, p_min, value_min)
        cache.length = end
        return [self._ids[i] for i in found], guess, end

    def _row(self, chain: DraftChain, token: int) -> tuple[int, Tensor | None]:
        # The address of `token`'s embedding row (and the tensor that holds it, where it is not the chain's): a
        # token of the target's text may lie outside the draft vocabulary.
        index = self._index.get(token)
        if index is not None:
            return chain.row(index), None
        row = self._extra.pop(token, None)
        if row is None:
            row = self._embedded(torch.tensor([token], dtype=torch.long))[0].to(torch.bfloat16).contiguous()
            if len(self._extra) >= 1024:
                del self._extra[next(iter(self._extra))]
        self._extra[token] = row
        return row.data_ptr(), row

    def draft_logits(self, states: Tensor, adapter: Adapter | None = None) -> Tensor:
        """Logits over the draft vocabulary [..., draft_vocab_size] for predicted states [..., dim]."""
        head = self.__dict__["_head"]
        logits = head(states) if head is not None else F.linear(states, self._head_rows)
        return logits if adapter is None else adapter.logits(logits)


def _bytes_per_weight(qtype: str) -> float:
    _, inputs, size = FORMATS[qtype]
    return size / inputs


def save_draft(draft: EagleDraft, out_dir: Path) -> None:
    """Write model.safetensors (float32 weights and the vocabulary ids), then config.json, into `out_dir`: a
    directory with config.json holds a whole draft (the model store counts a trained one as present by it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else torch.int64).contiguous()
        for k, v in draft.state_dict().items()
    }
    save_file(state, str(out_dir / WEIGHTS_FILE))
    cfg = {"architecture": ARCHITECTURE, **asdict(draft.config)}
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def is_eagle_dir(path: Path) -> bool:
    """Whether `path` is a directory holding a feature draft."""
    cfg = path / CONFIG_FILE
    if not (path.is_dir() and cfg.is_file() and (path / WEIGHTS_FILE).is_file()):
        return False
    try:
        return json.loads(cfg.read_text()).get("architecture") == ARCHITECTURE
    except (OSError, ValueError):
        return False


def read_draft(path: Path) -> EagleDraft:
    """The draft in `path` as saved (float32, on the CPU, not attached to a target): what training resumes
    from."""
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
    draft.source = path
    return draft


def load_draft(path: Path, target: Transformer, weights: str = DEFAULT_DRAFT_WEIGHTS) -> EagleDraft:
    """The draft in `path`, attached to `target`, in its dtype and on its device, ready for inference; on the
    target's CPU kernel with its matrices as `weights` (`app.engine.defaults.DRAFT_WEIGHTS`)."""
    if weights not in DRAFT_WEIGHTS:
        raise EagleError(f"draft weights {weights!r}: choose one of {', '.join(DRAFT_WEIGHTS)}")
    draft = read_draft(path)
    if int(draft.vocab_ids.max()) >= target.config.vocab_size:
        raise EagleError("draft vocabulary ids exceed the target's vocabulary")
    kernel = target.kernel
    if weights == "auto":
        # Plain C's integer products (generic) are slower than its bf16 ones (docs/bench, the draft on the kernels).
        weights = "q8_0" if kernel is not None and kernel.spec.dot else "bf16"
    qtype = weights.upper() if weights != "bf16" and kernel is not None else None
    if qtype is not None and can_pack(target.dtype, target.device, kernel):
        assert kernel is not None
        draft.quantize(kernel, qtype)  # from the float32 weights as saved
    else:
        qtype = None
    draft = draft.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    draft.attach(target, pack=True, qtype=qtype)
    draft.pack(kernel)
    return draft


# The most positions the draft catches up on before it drafts: behind by more (a long prompt, or a long stretch of
# lookups or plain steps), its context (its one block's attention over its own cache) restarts at the last
# DRAFT_WINDOW positions, and the earlier ones are left out of it. Catching up on every position since cost a step
# as much as several draft tokens (1.6 ms a call after more than 16 positions, against 0.38 ms after one), and such
# steps were a third of a hybrid's model steps, mostly probes after long stretches without the model; the target's
# states the draft reads carry what the window leaves out (agreement at depth 1 0.38 with every draft from a fresh
# window of 32 against 0.39 with the whole context, docs/bench). RoPE scores depend on positions' differences only,
# so the draft's positions start at 0 where its window starts.
DRAFT_WINDOW = 32


class _EagleSession(NetworkSession):
    """Per-request state: the draft's KV cache, and how many positions it holds with the target's true
    states. The generation writes the target's state of every verified position into `features`."""

    candidates: ClassVar[bool] = True
    trees: ClassVar[bool] = True

    def __init__(self, drafter: EagleDrafter, capacity: int) -> None:
        super().__init__()
        self._draft = drafter.draft
        self.target_vocab = drafter.draft.config.target_vocab_size
        self.vocab_ids = drafter.draft.vocab_ids
        dtype, device = drafter.target.dtype, drafter.target.device
        self.device = device
        self.features = torch.zeros(capacity, drafter.draft.config.dim, dtype=dtype, device=device)
        self._cache = self._draft.new_cache(capacity, dtype, device)
        self._true_len = 0  # positions computed from the target's states, never to be rolled back
        # The first position in the draft's context (DRAFT_WINDOW): position p is the draft's position p - base.
        self._base = 0
        # The next forward's input: states [T, dim], its T tokens, from a position; and its last guess [1, dim].
        self._input: tuple[Tensor, list[int], int] | None = None
        self._guess = torch.empty(0)
        self._next_pos = 0
        self._adapters = drafter.adapters
        # The request's tenant's adapter (start), None: the shipped draft. Taken again at each draft step (`begin`),
        # so that a newer adapter kept mid-request drafts its next tokens (the answer is the target's either way).
        self.adapter: Adapter | None = None
        self._tenant: str | None = None
        self._learns = False

    def start(self, prompt_len: int, tenant: str | None, prediction: Sequence[int], history: bool = True) -> None:
        # Like the index of earlier answers, a tenant's adapter is learnt from its earlier requests: none for a
        # request whose text must not depend on them (history False: the rejection sampler, an isolated request).
        self._tenant, self._learns = tenant, history
        self.refresh()

    def refresh(self) -> None:
        """Take the tenant's newest adapter (None where it has none, or the request may not read one)."""
        self.adapter = self._adapters(self._tenant) if self._learns and self._adapters is not None else None

    def propose_candidates(self, token_ids: Sequence[int], shape: TreeShape) -> Candidates:
        """The chain `propose` gives (greedy with `params` None, or with Gumbel `noise`), with each token's
        draft probability and the draft's next `width` choices at each depth (by probability): a tree's
        material (`app.engine.drafting.tree.build_tree`), for no more draft forwards than the chain."""
        found = Candidates([])
        run_drafts([self], [token_ids], [shape.k], [shape.p_min], shape.params, shape.noise, found, shape.rows - 1)
        return found

    def propose_tree(self, token_ids: Sequence[int], shape: TreeShape) -> DraftTree:
        found = self.propose_candidates(token_ids, shape)
        return build_tree(token_ids[-1], found, (), shape.rows, min_value=shape.min_value)

    def begin(self, token_ids: Sequence[int], k: int) -> int:
        self.refresh()
        first = self._catch_up(token_ids, k)
        if first is None:
            return 0
        self._input = first
        return min(max(k, MAX_DRAFT_TOKENS), self._cache.capacity - len(token_ids))

    def feed(self, token: int) -> None:
        self._input = (self._guess, [token], self._next_pos)

    def chain(self, k: int, p_min: float, value_min: float) -> list[int] | None:
        if self.adapter is not None or self._input is None:
            return None
        states, tokens, pos = self._input
        got = self._draft.chain(states, tokens, pos, self._cache, k, p_min, value_min)
        if got is None:
            return None
        found, self._guess, self._next_pos = got
        return found

    @classmethod
    def forward(cls, sessions: Sequence[NetworkSession], heads: Sequence[bool], batched: bool) -> list[Tensor | None]:
        eagles = [s for s in sessions if isinstance(s, _EagleSession)]
        assert len(eagles) == len(sessions)
        draft = eagles[0]._draft
        inputs = []
        for s in eagles:
            assert s._input is not None
            states, tokens, pos = s._input
            inputs.append((states, torch.tensor(tokens, dtype=torch.long, device=s.device), pos))
            s._next_pos = pos + states.shape[0]
        if not batched:
            (states, tokens, pos), s = inputs[0], eagles[0]
            guess = draft(states[None], tokens[None], pos, s._cache, s.adapter)[0, -1:]  # [1, dim]
            s._guess = guess
            # A forced token needs no head (a draft-vocabulary product per step).
            return [draft.draft_logits(guess[0], s.adapter).float() if heads[0] else None]
        # Several sessions: each draft position one forward over all of them, its weights read once; the head
        # runs on every row (what `propose` gives each alone, up to the last bits of the products).
        adapters = [s.adapter for s in eagles]
        guesses = draft.forward_batch(
            [(st, t, pos, s._cache) for (st, t, pos), s in zip(inputs, eagles, strict=True)], adapters
        )
        for s, g in zip(eagles, guesses, strict=True):
            s._guess = g[-1:]
        logits = draft.draft_logits(torch.cat([g[-1:] for g in guesses])).float()
        return [lg if a is None else a.logits(lg) for lg, a in zip(logits, adapters, strict=True)]

    def _catch_up(self, token_ids: Sequence[int], k: int) -> tuple[Tensor, list[int], int] | None:
        """The first draft forward's input: (states [T, dim], its T tokens, start position), or None when
        nothing can be drafted. Rolls the cache back to the positions computed from the target's states."""
        assert self.features is not None
        n = len(token_ids)
        # States are known for positions 0..n-2 (the newest token has not been through the target yet).
        # Position p reads (state p, token p+1), so the draft catches up on positions true_len..n-2.
        if k <= 0 or n < 2 or n + k > self._cache.capacity:
            return None
        if n - 1 - self._true_len > DRAFT_WINDOW:
            self._base = self._true_len = n - 1 - DRAFT_WINDOW  # behind by more than the window: restart at its start
        # Re-feed at least the newest known position: its output is the first guess.
        self._true_len = max(self._base, min(self._true_len, n - 2))
        self._cache.truncate(self._true_len - self._base)
        states = self.features[self._true_len : n - 1]
        tokens = list(token_ids[self._true_len + 1 : n])
        pos = self._true_len - self._base
        self._true_len = n - 1
        return states, tokens, pos


class EagleDrafter(Drafter):
    """Proposer backed by a feature draft; its sessions read the target's states (`features`)."""

    batches: ClassVar[bool] = True

    def __init__(self, name: str, draft: EagleDraft, target: LoadedModel) -> None:
        self.name = name
        self.draft = draft
        self.target = target.model
        # A tenant's adapter, or None (app.distill.online.DraftLearner.adapter); None: no draft learning.
        self.adapters: Callable[[str | None], Adapter | None] | None = None

    def session(self, capacity: int) -> _EagleSession:
        return _EagleSession(self, capacity)

    def session_bytes(self, capacity: int) -> int:
        """The target's states it reads (`features`) and the draft block's KV cache, in the target's dtype."""
        config = self.draft.config
        itemsize = torch.empty(0, dtype=self.target.dtype).element_size()
        return capacity * config.dim * itemsize + kv_cache_bytes(config.block_config(), capacity, self.target.dtype)

    def propose_batch(
        self,
        sessions: Sequence[DraftSession],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        p_mins: Sequence[float],
    ) -> list[list[int]]:
        """Greedy drafts for several requests, each draft step one forward over all of them."""
        eagles = [s for s in sessions if isinstance(s, _EagleSession)]
        assert len(eagles) == len(sessions)
        return [tokens for tokens, _ in run_drafts(eagles, token_ids, ks, p_mins)]
