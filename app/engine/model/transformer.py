"""A lean decoder in plain PyTorch over a static KV cache indexed by position (`app.engine.model.cache`).

One pre-norm block, its steps switched by `ModelConfig`'s fields: grouped-query attention, RoPE with the
model's theta (and Llama 3.1 frequency scaling), RMSNorm, optional q/k/v bias, tied or untied embeddings (the
Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2/2.5), and what other families add: q/k norms per head
(Qwen3, Gemma 3), norms after attention and MLP (Gemma 2/3), GeGLU, scaled embeddings, sliding-window layers
with their own RoPE base, a query scale, attention and final logit soft-capping (Gemma 2). Which architecture
sets which fields, and how its checkpoints name their tensors, is its module in `app.engine.model.architectures`.
Weights use the HuggingFace layout (rotate-half RoPE) with norms as multipliers (Gemma's `1 + w`);
loaders convert other layouts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.engine import kernels
from app.engine.kernels import Kernel
from app.engine.kernels.quantized import QuantizedWeight
from app.engine.model.cache import KVCache, RowsLayout, layout_rows
from app.engine.model.config import ModelConfig
from app.engine.model.packing import PackedLinear, QuantizedEmbedding, can_pack

log = logging.getLogger(__name__)


def _rope_inv_freq(config: ModelConfig) -> Tensor:
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, a smooth ramp between.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def rope_tables(config: ModelConfig, n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """RoPE tables [n, 1, head_dim] for positions 0..n-1 (rotate-half layout): cos, and sin with its first
    half negated, so that rotating x [..., T, heads, head_dim] is `x * cos + x.roll(head_dim // 2, -1) * sin`
    (one roll instead of splitting, negating and joining halves; the same bits, as negation is exact)."""
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), _rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return emb.cos().to(dtype).to(device)[:, None], sin.to(dtype).to(device)[:, None]


def final_norm(norm: nn.RMSNorm, kernel: Kernel | None, x: Tensor) -> Tensor:
    """`norm` of hidden states x [..., dim]: the kernel's where the products run on one (the bits of every CPU:
    torch's own sums its squares in an order that depends on the build's vector width, and 236 of 2.4 million bf16
    values differ between its AVX2 and its plain one), else torch's."""
    if kernel is not None and x.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0:
        return kernel.rms_norm(x, norm.weight, norm.eps)
    return norm(x)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class _Attention(nn.Module):
    """A layer's attention: its weights and its steps (projection, RoPE, attending over a cache), which
    `DecoderBlock` calls between the products it fuses with its norms and residuals; no forward of its own."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        q_size = config.n_heads * config.head_dim
        kv_size = config.n_kv_heads * config.head_dim
        # One fused projection: three small matmuls cost three dispatches on the hot path.
        self.wqkv = nn.Linear(config.dim, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.wo = nn.Linear(q_size, config.dim, bias=False)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        # None: SDPA's own 1 / sqrt(head_dim) (the kernel's too).
        self.scale = config.attn_scale or None
        self.softcap = config.attn_softcap
        self.window = config.sliding_window if layer in config.sliding_layers else 0

    def _attend_parts(self, q: Tensor, k: Tensor, v: Tensor, layout: RowsLayout, layer: int) -> Tensor:
        kernel = layout.parts[0].cache.kernel
        if kernel is not None and all(p.cache.kernel is kernel and p.mask is None for p in layout.parts):
            # One call for every sequence.
            parts = [(p.offset, p.rows, *p.cache.layers[layer], p.start_pos, p.parents) for p in layout.parts]
            return kernel.attention(self._kernel_query(q), k, v, self._window_parts(parts))
        ys = [
            self._attend(
                *(t[:, p.offset : p.offset + p.rows] for t in (q, k, v)),
                layer,
                p.cache,
                p.start_pos,
                p.mask,
                p.positions,
            )
            for p in layout.parts
        ]
        return torch.cat(ys, dim=1)

    def _project(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, kernel: Kernel | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        # qkv [B, T, (H + 2 KV) * D] -> q [B, T, H, D], k and v [B, T, KV, D]; q and k rotated in one pass.
        # `kernel`: the q/k norms run on it (its bits, which the layer stack's are), not in torch.
        b, t, _ = qkv.shape
        h, kv = self.n_heads, self.n_kv_heads
        heads = qkv.view(b, t, h + 2 * kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            if kernel is not None:
                q = kernel.rms_norm(heads[:, :, :h], self.q_norm.weight, self.q_norm.eps)
                qk = torch.cat([q, kernel.rms_norm(heads[:, :, h : h + kv], self.k_norm.weight, self.k_norm.eps)], 2)
            else:
                qk = torch.cat([self.q_norm(heads[:, :, :h]), self.k_norm(heads[:, :, h : h + kv])], dim=2)
        else:
            qk = heads[:, :, : h + kv]
        qk = _apply_rope(qk, cos, sin)
        return qk[:, :, :h], qk[:, :, h:], heads[:, :, h + kv :]

    def _kernel_query(self, q: Tensor) -> Tensor:
        # The kernel scales scores by 1 / sqrt(head_dim): another scale is folded into the queries.
        if self.scale is None or self.scale == 1.0 / math.sqrt(self.head_dim):
            return q
        return (q * (self.scale * math.sqrt(self.head_dim))).contiguous()

    def _window_parts(self, parts: list[tuple]) -> list[tuple]:
        """Kernel attention parts with this layer's sliding window: a row at position p >= window attends positions
        p - window + 1..p, as its own part over a view of the cache that starts at p - window + 1 (the keys in
        their order, as alone: each row's bits still depend on nothing but itself)."""
        w = self.window
        if not w or all(start + rows <= w for _, rows, _, _, start, *_ in parts):
            return parts
        out: list[tuple] = []
        for offset, rows, kc, vc, start, *tree in parts:
            if start + rows <= w:
                out.append((offset, rows, kc, vc, start, *tree))
                continue
            if tree and tree[0] is not None:
                raise ValueError("a tree past the sliding window attends with a mask (layout_rows)")
            first = max(0, w - start)  # rows whose window still starts at position 0
            if first:
                out.append((offset, first, kc, vc, start))
            for r in range(first, rows):
                s = start + r - w + 1
                out.append((offset + r, 1, _shifted(kc, s), _shifted(vc, s), w - 1))
        return out

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: int,
        cache: KVCache | None,
        start_pos: int,
        mask: Tensor | None,
        positions: Tensor | None = None,
    ) -> Tensor:
        b, t = q.shape[:2]
        if cache is not None and cache.kernel is not None and mask is None:
            parts = [(0, t, *cache.layers[layer], start_pos)]
            return cache.kernel.attention(self._kernel_query(q), k, v, self._window_parts(parts))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        causal = mask is None and t > 1
        span = t
        if cache is not None:
            end = start_pos + t
            cache.k[layer, :, :, start_pos:end] = k
            cache.v[layer, :, :, start_pos:end] = v
            span = mask.shape[-1] if mask is not None else end
            k = cache.k[layer, :, :, :span]
            v = cache.v[layer, :, :, :span]
        if self.window and start_pos + t > self.window:
            mask = _window_mask(mask, start_pos, t, span, self.window, positions, q)
            causal = False
        if self.softcap:
            y = _softcapped_attention(q, k, v, mask, causal, self.scale or 1.0 / math.sqrt(self.head_dim), self.softcap)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, scale=self.scale
            )
        return y.transpose(1, 2).reshape(b, t, -1)


def _shifted(cache: Tensor, start: int) -> Tensor:
    """cache [KV, capacity, D] seen from position `start` on: the same strides, so that the kernel reads head g's
    keys at g * capacity * D from the new start (the cache's storage has room past its end; see KVCache)."""
    return torch.as_strided(cache, cache.shape, cache.stride(), cache.storage_offset() + start * cache.stride(1))


def _window_mask(
    mask: Tensor | None, start: int, t: int, span: int, window: int, positions: Tensor | None, like: Tensor
) -> Tensor:
    """The additive mask [.., T, span] of a sliding-window layer: `mask` (None: causal) with the keys before each
    row's window masked out. `positions` (a tree's rows', [T]): only the keys before `start` are windowed (a
    tree's own rows are its row's ancestors, within the window)."""
    device = like.device
    keys = torch.arange(span, device=device)[None, :]
    rows = (start + torch.arange(t, device=device) if positions is None else positions.to(device))[:, None]
    if mask is None:
        allowed = keys <= rows
        mask = torch.zeros(allowed.shape, dtype=like.dtype, device=device).masked_fill_(~allowed, float("-inf"))
    old = keys <= rows - window
    if positions is not None:
        old = old & (keys < start)
    return mask.masked_fill(old, float("-inf"))


def _softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float, cap: float
) -> Tensor:
    """Attention with scores soft-capped to (-cap, cap) before the mask and softmax (Gemma 2): q [B, H, T, D],
    k and v [B, KV, S, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / cap) * cap
    if causal:
        t, s = scores.shape[-2:]
        allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


# A batched forward multiplies at most this many rows per call. Measured with oneDNN's bfloat16 kernels on
# this CPU: every row of a product of up to 32 rows is bit-identical to the same row computed in a product
# of 8 (a solo verification), while from 40 rows on another kernel takes over and the last bits change,
# enough to flip a near-tie and break "batched == alone". Chunking keeps the batched path exact.
_MAX_ROWS = 32


def _rows(linear: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """`linear(x)` for x [1, N, in], computed in chunks of at most _MAX_ROWS rows."""
    n = x.shape[1]
    if n <= _MAX_ROWS:
        return linear(x)
    return torch.cat([linear(x[:, i : i + _MAX_ROWS]) for i in range(0, n, _MAX_ROWS)], dim=1)


class DecoderBlock(nn.Module):
    """One pre-norm decoder layer: attention then a gated MLP, each with a residual (and, with `sandwich_norms`,
    a norm on each one's output before its residual add).

    On a kernel with every product on it (`_fusable`), the norms before the products, SwiGLU and the residual adds
    run inside the product calls; what the kernel's products do not take (GeGLU, the output norms, q/k norms) runs
    in torch between them, row by row. Elsewhere every step is its own torch op."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = _Attention(config, layer)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)
        sandwich = config.sandwich_norms
        self.post_attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps) if sandwich else None
        self.post_ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps) if sandwich else None
        self.gelu = config.activation == "gelu_tanh"
        self.sliding = layer in config.sliding_layers

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        layer: int,
        cache: KVCache | None,
        start_pos: int,
        mask: Tensor | None,
    ) -> Tensor:
        kernel = self._kernel()
        q, k, v = self.attn._project(self._qkv(x, kernel is not None, False), cos, sin, kernel)
        return self._rest(self.attn._attend(q, k, v, layer, cache, start_pos, mask), x, kernel, False)

    def forward_parts(self, x: Tensor, layout: RowsLayout, layer: int) -> Tensor:
        """The layer over several sequences' rows, one after another in `x` [1, N, dim] (see `layout_rows`).

        The products and RoPE run over all rows at once (in chunks of `_MAX_ROWS` off a kernel, see `_rows`);
        attention runs per sequence on its own cache, with the ops `forward` uses, so each row comes out as it
        would alone."""
        kernel = self._kernel()  # a kernel's rows do not depend on the row count: no chunking
        q, k, v = self.attn._project(self._qkv(x, kernel is not None, True), *layout.tables(self.sliding), kernel)
        return self._rest(self.attn._attend_parts(q, k, v, layout, layer), x, kernel, True)

    def _fusable(self) -> bool:
        # Every product on a kernel: the norms, SwiGLU and residual adds then run inside the product calls (about a
        # third of a decoding step's time went to those small ops, each a dispatch of its own).
        products = (self.attn.wqkv, self.attn.wo, self.w13, self.w2)
        return all(isinstance(p, PackedLinear) and p.fused is not None for p in products)

    def _kernel(self) -> Kernel | None:
        # The kernel every product runs on (`_fusable`), which then runs the block's other norms and GeGLU too.
        return self.attn.wqkv.fused.kernel if self._fusable() else None

    def _qkv(self, x: Tensor, fused: bool, chunked: bool) -> Tensor:
        if fused:
            return self.attn.wqkv.fused(x, norm=self.attn_norm.weight, eps=self.attn_norm.eps)
        h = self.attn_norm(x)
        return _rows(self.attn.wqkv, h) if chunked else self.attn.wqkv(h)

    def _rest(self, y: Tensor, x: Tensor, kernel: Kernel | None, chunked: bool) -> Tensor:
        """After attention (`y`, the heads' outputs; `x`, the layer's input): the output projection, the residual,
        the MLP and its residual. On a `kernel` (every product on it): norms, activation and residual adds in the
        kernel's calls (what the layer stack runs, with its bits)."""
        a = self.attn
        if kernel is not None:
            # The residual rides along with the product unless a norm comes between them.
            if self.post_attn_norm is None:
                h = a.wo.fused(y, residual=x)
            else:
                h = kernel.rms_norm(a.wo.fused(y), self.post_attn_norm.weight, self.post_attn_norm.eps, residual=x)
            gate_up = self.w13.fused(h, norm=self.ffn_norm.weight, eps=self.ffn_norm.eps)
            act = {"geglu": True} if self.gelu else {"swiglu": True}
            if self.post_ffn_norm is None:
                return self.w2.fused(gate_up, residual=h, **act)
            d = self.w2.fused(gate_up, **act)
            return kernel.rms_norm(d, self.post_ffn_norm.weight, self.post_ffn_norm.eps, residual=h)
        o = _rows(a.wo, y) if chunked else a.wo(y)
        h = x + (o if self.post_attn_norm is None else self.post_attn_norm(o))
        n = self.ffn_norm(h)
        gate_up = _rows(self.w13, n) if chunked else self.w13(n)
        act = self._act(gate_up)
        return h + self._post_ffn(_rows(self.w2, act) if chunked else self.w2(act))

    def _act(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up

    def _post_ffn(self, d: Tensor) -> Tensor:
        return d if self.post_ffn_norm is None else self.post_ffn_norm(d)


class Transformer(nn.Module):
    """A decoder of any architecture `ModelConfig` describes (see `app.engine.model.architectures`).

    `forward(input_ids [B, T], start_pos, cache)` runs tokens at positions start_pos..start_pos+T-1
    and returns logits [B, T, vocab]; `hidden(...)` returns the final-normed hidden states [B, T, dim]
    (what feature-conditioned drafts consume) and `logits(hidden)` projects them.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        # RoPE tables are plain attributes, not buffers: rebuilt lazily for the current dtype and device.
        self._rope_len = 0
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._local: tuple[Tensor, Tensor] | None = None  # the sliding layers' tables (their own RoPE base)
        self._packed_head: PackedLinear | None = None
        self.kernel: Kernel | None = None  # what pack() laid the products out for; its caches attend on it too
        self._stack: kernels.LayerStack | None = None  # every layer in one kernel call (see `hidden`)

    def pack(self, kernel: Kernel | None) -> bool:
        """Lay every bf16 weight out once for `kernel` (None: reorder it for oneDNN; see `PackedLinear`), which
        then runs the products and the attention; inference only, irreversible. `load_model` passes the kernel
        it selected (`kernels.kernel()`: SPECSERVE_KERNEL, read once).

        Returns whether anything was packed (only bfloat16 on CPU is).
        """
        if not can_pack(self.dtype, self.device, kernel):
            return False
        self.kernel = kernel
        for block in self.layers:
            for owner, name in ((block.attn, "wqkv"), (block.attn, "wo"), (block, "w13"), (block, "w2")):
                lin = getattr(owner, name)
                if isinstance(lin, nn.Linear):
                    setattr(owner, name, PackedLinear(lin.weight, lin.bias, kernel))
        if isinstance(self.lm_head, PackedLinear):  # quantized (see load_quantized)
            self._packed_head = self.lm_head
        else:
            self._packed_head = PackedLinear(self._head_weight(), None, kernel)
            if isinstance(self.embed, QuantizedEmbedding) and self._packed_head.quantized is not None:
                self.embed.quantized = self._packed_head.quantized  # tied: one copy of the blocks
        self._stack = self._layer_stack()
        self._say_path()
        return True

    def _say_path(self) -> None:
        # Loudly, once at load: what of the fast path this architecture cannot take, and what that costs.
        cfg = self.config
        if self.kernel is None:
            return
        if not cfg.fused_stack and all(block._fusable() for block in self.layers):
            log.info(
                "%s: layer by layer (products fused on the %s kernel; the C layer stack does not run %s)",
                cfg.architecture,
                self.kernel.name,
                ", ".join(cfg.beyond_stack()) or "this architecture",
            )
        if not self.rows_independent():
            why = (
                "attention soft-capping is not in the kernel's attention"
                if cfg.attn_softcap
                else "some product or the attention does not fit the kernel"
            )
            log.warning(
                "%s on the %s kernel: %s, so it runs per op in torch and rows are not independent (no batching, "
                "chunked prefill or prefix cache)",
                cfg.architecture,
                self.kernel.name,
                why,
            )

    def _layer_stack(self) -> kernels.LayerStack | None:
        # Every product and the attention on the kernel: one call runs all the layers of a sequence's forward
        # (per-call overhead of a dozen small calls per layer cost about as much as a decoding step's products).
        # Only where the architecture opts in (`ModelConfig.fused_stack`: its block's features are the stack's).
        cfg = self.config
        if not cfg.fused_stack:
            return None
        if self.kernel is None or not kernels.attention_fits(self.kernel, cfg.head_dim, self.dtype, self.device):
            return None
        if not all(block._fusable() for block in self.layers):
            return None
        layers = [
            kernels.StackLayer(
                b.attn.wqkv.fused,
                b.attn.wo.fused,
                b.w13.fused,
                b.w2.fused,
                b.attn_norm.weight,
                b.ffn_norm.weight,
                None if b.attn.q_norm is None else b.attn.q_norm.weight,
                None if b.attn.k_norm is None else b.attn.k_norm.weight,
                None if b.post_attn_norm is None else b.post_attn_norm.weight,
                None if b.post_ffn_norm is None else b.post_ffn_norm.weight,
                gelu=b.gelu,
                window=b.attn.window,
                local=b.sliding,
            )
            for b in self.layers
        ]
        try:
            return kernels.LayerStack(self.kernel, layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps)
        except ValueError:  # padded products, or more segments than the stack takes: layer by layer
            return None

    def load_quantized(self, weights: dict[str, QuantizedWeight], kernel: Kernel | None) -> None:
        """Put GGUF quantized matrices in place (names as the state dict's: `layers.0.w13.weight`, `embed.weight`,
        `lm_head.weight`), each computed on as its blocks by the CPU kernel (`PackedLinear`); call before `pack`.
        The model's other weights set its dtype, the activations' (bfloat16: what the kernels take)."""
        for name, weight in weights.items():
            path, _, leaf = name.rpartition(".")
            if leaf != "weight":
                raise ValueError(f"{name}: only weights are kept quantized")
            # The kernels read a quantized matrix by the sizes it carries: it must be the parameter it replaces.
            if not isinstance(weight, QuantizedWeight):
                raise ValueError(f"{name}: {type(weight).__name__} is not a QuantizedWeight")
            want = tuple(self.get_parameter(name).shape)
            if weight.shape != want:
                raise ValueError(f"{name}: a quantized weight {list(weight.shape)} for a parameter {list(want)}")
            if path == "embed":
                self.embed = QuantizedEmbedding(weight, self.dtype)  # type: ignore[assignment]
                continue
            owner_path, _, attr = path.rpartition(".")
            owner = self.get_submodule(owner_path) if owner_path else self
            linear = getattr(owner, attr)
            bias = linear.bias if isinstance(linear, nn.Linear) else None
            setattr(owner, attr, PackedLinear(weight, bias, kernel))

    def _head_weight(self) -> Tensor | QuantizedWeight | kernels.QuantLinear:
        if self.lm_head is not None:
            return self.lm_head.quantized if isinstance(self.lm_head, PackedLinear) else self.lm_head.weight
        return self.embed.quantized if isinstance(self.embed, QuantizedEmbedding) else self.embed.weight

    def head_rows(self, ids: Tensor) -> Tensor | QuantizedWeight:
        """Rows `ids` (long [M]) of the output layer: [M, dim] in the model's dtype, or still quantized."""
        head = self._head_weight()
        if isinstance(head, Tensor):
            return head.detach()[ids.to(head.device)].contiguous()
        return head.select(ids)

    def weights(self) -> tuple[str, int]:
        """What the decoder's weights run as (`bfloat16`, `float32`, or the GGUF formats computed on, as
        `Q8_0+Q4_1`, with `+bfloat16` where some matrices are not) and the bytes they hold (each memory once:
        a tied head computed on the embedding's blocks costs nothing more)."""
        held: dict[tuple[str, int], int] = {}
        formats: dict[str, None] = {}
        plain = False
        for module in self.modules():
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            quantized = getattr(module, "quantized", None)
            if isinstance(module, PackedLinear):
                tensors += [t for t in (module.packed, module.weight) if t is not None]
                if isinstance(module.fused, kernels.KernelLinear):
                    tensors.append(module.fused.weight)
                plain = plain or quantized is None
            elif not isinstance(module, QuantizedEmbedding):
                plain = plain or any(t.dim() == 2 for t in tensors)
            if isinstance(quantized, (QuantizedWeight, kernels.QuantLinear)):
                formats.update(dict.fromkeys(quantized.formats))
                tensors += [segment[1] for segment in quantized.segments]  # (format, blocks[, rows])
            for t in tensors:
                if t.device.type == "meta":
                    continue
                if t.is_mkldnn:
                    # oneDNN's opaque layout (a weight it reordered) has no storage to ask about (asking raises)
                    # and shares its memory with no other tensor: the tensor itself is the memory.
                    held["opaque", id(t)] = t.numel() * t.element_size()
                else:
                    held["storage", t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        dtype = str(self.dtype).removeprefix("torch.")
        if not formats:
            return dtype, sum(held.values())
        return "+".join([*formats, *([dtype] if plain else [])]), sum(held.values())

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def rows_independent(self) -> bool:
        """Whether every op of a decoding forward computes each row on its own, so that a token's bits do not
        depend on how many rows were fed with it (true on the CPU kernels: products and attention)."""
        head = self._packed_head is not None and self._packed_head.fused is not None
        attention = kernels.attention_fits(self.kernel, self.config.head_dim, self.dtype, self.device)
        attention = attention and not self.config.attn_softcap  # scores capped in torch (see KVCache)
        return head and attention and all(block._fusable() for block in self.layers)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        """A KV cache for `batch` sequences of up to `capacity` positions, in this model's dtype."""
        if capacity > self.config.max_seq_len:
            raise ValueError(f"{capacity} positions exceed the model's context of {self.config.max_seq_len}")
        return KVCache(self.config, capacity, batch, self.dtype, self.device, self.kernel)

    def _rope(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        if end > self._rope_len or self._cos.dtype != self.dtype or self._cos.device != self.device:
            n = max(end, min(self.config.max_seq_len, 4096))
            self._cos, self._sin = rope_tables(self.config, n, self.dtype, self.device)
            if self.config.rope_local_theta:
                local = dataclasses.replace(self.config, rope_theta=self.config.rope_local_theta, rope_scaling=None)
                self._local = rope_tables(local, n, self.dtype, self.device)
            self._rope_len = n
        return self._cos[start:end], self._sin[start:end]

    def _rope_local(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        self._rope(start, end)
        assert self._local is not None
        return self._local[0][start:end], self._local[1][start:end]

    def _embed(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        if self.config.embed_scale != 1.0:  # as Gemma scales them: by the factor in the activations' dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def hidden(
        self,
        input_ids: Tensor,
        start_pos: int = 0,
        cache: KVCache | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """Final-normed hidden states [B, T, dim] for `input_ids` [B, T] at start_pos..start_pos+T-1.

        With a cache, keys and values are written at those positions and attention covers positions
        0..start_pos+T-1; `cache.length` becomes start_pos+T. Without one, attention is causal over the
        inputs alone. `mask` (bool [T, start_pos+T], or [B, T, start_pos+T] per sequence, True = may
        attend) overrides the causal mask.
        """
        t = input_ids.shape[1]
        end = start_pos + t
        if cache is not None:
            cache.check_span(start_pos, end)
        elif start_pos != 0:
            raise ValueError("start_pos must be 0 without a cache")
        cos, sin = self._rope(start_pos, end)
        local = self._rope_local(start_pos, end) if self.config.rope_local_theta else (cos, sin)
        if cache is not None and (mask is not None or cache.needs_mask(t)):
            mask = cache.attention_mask(start_pos, t, mask)
        x = self._embed(input_ids)
        stack = self._stack_for([cache]) if mask is None and cache is not None else None
        if stack is not None:
            # The layers below in one call, bit for bit (the cache has one sequence and attends on the kernel).
            x = stack(x, cos, sin, cache.k, cache.v, start_pos, local)
        else:
            for i, layer in enumerate(self.layers):
                c, s = local if layer.sliding else (cos, sin)
                x = layer(x, c, s, i, cache, start_pos, mask)
        if cache is not None:
            cache.length = end
        return self._final_norm(x)

    def _stack_for(self, caches: Sequence[KVCache]) -> kernels.LayerStack | None:
        """The layer stack, where it runs every layer and each of `caches` attends on this model's kernel."""
        stack = self._stack
        whole = stack is not None and stack.n_layers == len(self.layers)
        return stack if whole and all(cache.kernel is self.kernel for cache in caches) else None

    def hidden_batch(
        self, sequences: Sequence[tuple[Tensor, int, KVCache] | tuple[Tensor, int, KVCache, Tensor | None]]
    ) -> list[Tensor]:
        """Final-normed hidden states of several sequences in one forward, each with its own cache.

        `sequences`: (input_ids long [T_i], start_pos_i, cache_i[, parents_i]) per sequence, T_i >= 1;
        `parents_i` (int32 [T_i]): its rows are a tree, each at its depth's position (see `layout_rows`; the
        cache then holds row r's keys and values in slot start_pos_i + r, until `app.engine.drafting.tree` moves the
        accepted path's into place). Returns one
        [T_i, dim] tensor per sequence. The weights are read once for all rows (what makes serving many
        requests cheaper than serving them in turn); each sequence's attention runs on its own cache exactly
        as `hidden(input_ids[None], start_pos, cache)` would, and its rows come out bit-identical to that
        call as long as the products' row results do not depend on the row count (see `_MAX_ROWS`).
        """
        local = self._rope_local if self.config.rope_local_theta else None
        layout = layout_rows([(ids.shape[0], *rest) for ids, *rest in sequences], self._rope, local)
        x = self._embed(torch.cat([ids for ids, *_ in sequences])[None])
        unmasked = all(p.mask is None for p in layout.parts)
        stack = self._stack_for([p.cache for p in layout.parts]) if unmasked else None
        if stack is not None:
            # The layers below in one call for every sequence, bit for bit (each attends its own cache on the
            # kernel; a part with a mask, a tree past a window among them, takes the layers one by one).
            seqs = [(p.cache.k, p.cache.v, p.start_pos, p.rows, p.parents) for p in layout.parts]
            x = stack.batch(x, layout.cos, layout.sin, seqs, layout.tables(True))
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward_parts(x, layout, i)
        layout.advance()
        return layout.split(self._final_norm(x)[0])

    def _final_norm(self, x: Tensor) -> Tensor:
        return final_norm(self.norm, self.kernel, x)

    def logits(self, hidden: Tensor) -> Tensor:
        """Project hidden states [..., dim] to vocabulary logits [..., vocab].

        Rows [N, dim] are projected in chunks of at most `_MAX_ROWS`, so that a row's logits do not depend
        on how many rows a batch asked for."""
        if self._packed_head is not None:
            head: Callable[[Tensor], Tensor] = self._packed_head
        else:
            weight = self._head_weight()
            assert isinstance(weight, Tensor), "quantized weights run packed"
            head = lambda h: F.linear(h, weight)  # noqa: E731
        chunked = hidden.dim() == 2 and hidden.shape[0] > _MAX_ROWS
        logits = _rows(head, hidden[None])[0] if chunked else head(hidden)
        cap = self.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def forward(
        self,
        input_ids: Tensor,
        start_pos: int = 0,
        cache: KVCache | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, T, vocab] for every input position; see `hidden` for the arguments."""
        return self.logits(self.hidden(input_ids, start_pos, cache, mask))
