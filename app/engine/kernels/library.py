"""A loaded kernel library and what runs on it: bf16 products (`KernelLinear`), products on GGUF blocks
(`QuantLinear`), cached attention (`Kernel.attention`), a decoder's layers in one call (`LayerStack`) and a feature
draft's greedy chain in one call (`DraftChain`)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from app.engine.kernels import abi
from app.engine.kernels.quantized import FORMATS, QuantizedWeight, row_bytes
from app.engine.kernels.table import KernelSpec


class Kernel:
    """One loaded kernel library: `linear` lays a weight out for it, `attention` runs cached attention."""

    def __init__(self, spec: KernelSpec, lib: ctypes.CDLL, path: Path) -> None:
        self.spec = spec
        self.name = spec.name
        self.path = path
        self._lib = lib
        abi.bind(lib, spec.dot)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"

    def linear(self, weight: Tensor, bias: Tensor | None) -> KernelLinear:
        """`weight` [N, K] (bf16, K % 32 == 0; see `fits`) laid out once for this kernel's products."""
        return KernelLinear(self, weight, bias)

    def qlinear(self, weight: QuantizedWeight, bias: Tensor | None) -> QuantLinear:
        """`weight` [N, K]: GGUF blocks (see `app.engine.kernels.quantized`), computed on as they are."""
        return QuantLinear(self, weight, bias)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
        """Each row of x [..., K] (bf16, K % 16 == 0) RMS-normalised with `weight` [K] and `eps`, as a product's
        fused norm computes it, plus `residual` (as x) where given: the norms a block runs outside its products
        (q/k heads, post-attention, post-MLP), with the bits the layer stack gives them."""
        _check_rows(x)
        k = x.shape[-1]
        if weight.dtype != torch.bfloat16 or k % 16 or weight.shape != (k,):
            raise ValueError("rms_norm takes bf16 rows of a multiple of 16 and a bf16 weight of that size")
        x = x.contiguous()
        y = torch.empty_like(x)
        if residual is not None:
            residual = _residual(residual, x.shape)
        self._lib.sk_rms_norm(
            x.data_ptr(),
            y.data_ptr(),
            weight.contiguous().data_ptr(),
            x.numel() // k,
            k,
            eps,
            None if residual is None else residual.data_ptr(),
        )
        return y

    @property
    def dot(self) -> str | None:
        """How its integer products take their 4-byte dot products (dot4.h): `avx512vnni`, `avxvnni`, `avx2`
        or `twin`; None for a kernel without them (generic: plain C)."""
        return self._lib.sk_dot_kind().decode() if self.spec.dot else None

    @property
    def trees(self) -> bool:
        """Whether `attention` takes tree parts (a parent per row): the exact kernels, whose attention reads a
        tree row's keys in its sequential order (common.h); not amx, whose tiles read keys by slot."""
        return self.spec.trees

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        parts: Sequence[tuple[int, int, Tensor, Tensor, int] | tuple[int, int, Tensor, Tensor, int, Tensor | None]],
    ) -> Tensor:
        """Causal attention for several sequences whose rows lie one after another, in one call.

        q [1, N, H, D], k and v [1, N, KV, D]: the rows' queries and new keys and values (bf16; heads
        contiguous, rows any stride; D % 32 == 0). `parts`: per sequence (first row, rows T_i, k_cache,
        v_cache [KV, capacity, D], start position[, parents]); its new keys and values are written into its
        cache at start..start+T_i-1 and its rows attend its keys 0..their own position. `parents` (int32
        [T_i], where `trees`): the rows are a tree, row r's parent row parents[r] < r (-1 for row 0): row r
        at depth D attends keys 0..start-1 and its ancestors' and its own, in depth order, with the bits it
        gets at position start + D in sequential decoding. Returns [1, N, H * D] bf16, each row depending on
        nothing but its query and the keys it sees."""
        _, n, h, d = q.shape
        kv = k.shape[2]
        for t in (q, k, v):
            _check_rows(t)
            if t.dim() != 4 or t.shape[1] != n or t.shape[3] != d:
                raise ValueError(f"attention takes q [1, N, H, D], k and v [1, N, KV, D], not {list(t.shape)}")
            if t.stride(3) != 1 or (t.shape[2] > 1 and t.stride(2) != d):
                raise ValueError("attention needs each row's heads side by side")
        if v.shape[2] != kv or kv == 0 or h % kv:
            raise ValueError(f"attention takes heads in groups: {h} query heads, {kv} and {v.shape[2]} kv heads")
        out = torch.empty(1, n, h * d, dtype=torch.bfloat16)
        size = 2  # bytes per element
        table = (abi.Part * len(parts))()
        for i, (offset, rows, k_cache, v_cache, start, *tree) in enumerate(parts):
            _check_part(offset, rows, n, k_cache, v_cache, start, kv, d)
            parents = tree[0] if tree else None
            if parents is not None:
                if not self.trees:
                    raise ValueError(f"the {self.name} kernel does not attend over trees")
                if parents.dtype != torch.int32 or not parents.is_contiguous() or parents.shape != (rows,):
                    raise ValueError("a tree's parents are int32 [rows], contiguous")
            table[i] = abi.Part(
                q.data_ptr() + offset * q.stride(1) * size,
                k.data_ptr() + offset * k.stride(1) * size,
                v.data_ptr() + offset * v.stride(1) * size,
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                out.data_ptr() + offset * h * d * size,
                k_cache.shape[1],
                rows,
                start,
                None if parents is None else parents.data_ptr(),
            )
        threads = torch.get_num_threads()
        scale = 1.0 / math.sqrt(d)
        self._lib.sk_attention(table, len(parts), q.stride(1), k.stride(1), v.stride(1), h, kv, d, scale, threads)
        return out


Product = "KernelLinear | QuantLinear"


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer of a `LayerStack`: its four products (`KernelLinear` or `QuantLinear` of the stack's
    kernel, none padded) and norm weights [dim] (bf16), and what a block beyond Llama's adds (layers.h's
    sk_layer_t): q/k norms [head_dim], post-attention and post-MLP norms [dim], GeGLU for SwiGLU, a sliding
    `window` (0: none), RoPE from the local tables."""

    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    attn_norm: Tensor
    ffn_norm: Tensor
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    post_attn_norm: Tensor | None = None
    post_ffn_norm: Tensor | None = None
    gelu: bool = False
    window: int = 0
    local: bool = False


class LayerStack:
    """A decoder's layers run in one kernel call (layers.h): the products, RMS norms, RoPE, cached attention and
    residuals of every layer, each value with the bits the layer-by-layer calls give (the same kernels, the
    same arguments), without a Python or torch call between them.

    `layers`: one `StackLayer` each; `heads`, `kv_heads`, `head_dim` and `eps` as the model's."""

    def __init__(
        self,
        kernel: Kernel,
        layers: Sequence[StackLayer],
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> None:
        self.kernel = kernel
        self._keep: list[Tensor] = []  # what the table points into
        self._table = (abi.Layer * len(layers))()
        for i, layer in enumerate(layers):
            entry = self._table[i]
            for name in ("qkv", "o", "gate_up", "down"):
                self._product(getattr(entry, name), getattr(layer, name))
            for name in ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"):
                norm = getattr(layer, name)
                if norm is not None:
                    if norm.dtype != torch.bfloat16:
                        raise ValueError("a layer stack's norms are bf16")
                    norm = norm.contiguous()
                    self._keep.append(norm)
                    setattr(entry, name, norm.data_ptr())
            if (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError("a layer stack norms q and k both or neither")
            entry.gelu, entry.window, entry.local = int(layer.gelu), layer.window, int(layer.local)
        self.n_layers = len(layers)
        self.dim = layers[0].qkv.in_features
        self.inter = layers[0].down.in_features
        self.local = any(layer.local for layer in layers)
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        for i, layer in enumerate(layers):
            self._check_shapes(i, layer)

    def _check_shapes(self, i: int, layer: StackLayer) -> None:
        # The C stack sizes every buffer from dim, inter and the heads: a product or norm of another size would
        # be read or written past its end.
        dim, inter, hd = self.dim, self.inter, self.head_dim
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError(f"a layer stack takes heads in groups, not {self.heads} over {self.kv_heads} kv heads")
        products = {
            "qkv": (layer.qkv, (self.heads + 2 * self.kv_heads) * hd, dim),
            "o": (layer.o, dim, self.heads * hd),
            "gate_up": (layer.gate_up, 2 * inter, dim),
            "down": (layer.down, dim, inter),
        }
        for name, (product, n, k) in products.items():
            if (product.out_features, product.in_features) != (n, k):
                raise ValueError(
                    f"layer {i}'s {name} product is [{product.out_features}, {product.in_features}]; "
                    f"the stack's shape needs [{n}, {k}]"
                )
        for name, size in (("attn_norm", dim), ("ffn_norm", dim), ("post_attn_norm", dim), ("post_ffn_norm", dim)):
            norm = getattr(layer, name)
            if norm is not None and norm.shape != (size,):
                raise ValueError(f"layer {i}'s {name} is {list(norm.shape)}, not [{size}]")
        for name in ("q_norm", "k_norm"):
            norm = getattr(layer, name)
            if norm is not None and norm.shape != (hd,):
                raise ValueError(f"layer {i}'s {name} is {list(norm.shape)}, not [{hd}]")

    def _product(self, out: abi.Product, product: Product) -> None:
        if product.kernel is not self.kernel:
            raise ValueError("every product of a layer stack runs on its kernel")
        out.n = product.out_features
        if product.bias is not None:
            self._keep.append(product.bias)
            out.bias = product.bias.data_ptr()
        if isinstance(product, KernelLinear):
            if product._padded != product.out_features:
                raise ValueError("a layer stack takes unpadded products")
            self._keep.append(product.weight)
            out.w, out.nseg = product.weight.data_ptr(), 0
            return
        if not 1 <= len(product.segments) <= 4:
            raise ValueError("a layer stack takes products of at most 4 segments")
        out.nseg = len(product.segments)
        for s, (qtype, data, rows) in enumerate(product.segments):
            self._keep.append(data)
            out.type[s], out.rows[s], out.row_bytes[s] = FORMATS[qtype][0], rows, data.shape[1]
            out.data[s] = data.data_ptr()

    def __call__(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        start: int,
        local: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x [1, T, dim] bf16 through every layer at positions start..start+T-1; returns the new x [1, T, dim].
        cos, sin: [T, 1, head_dim] (`rope_tables`'); `local`: the same for the layers with `local` RoPE;
        k_cache, v_cache: [layers, 1, kv_heads, capacity, head_dim] bf16, written at those positions as the
        layers' attention does. `batch` with one sequence."""
        return self.batch(x, cos, sin, [(k_cache, v_cache, start, x.shape[1], None)], local)

    def batch(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        sequences: Sequence[tuple[Tensor, Tensor, int, int, Tensor | None]],
        local: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x [1, T, dim] bf16, several sequences' rows one after another, through every layer (layers.h's
        sk_layers): `sequences` (k_cache, v_cache, start, rows, parents) each, its caches [layers, 1, kv_heads,
        capacity, head_dim] as `__call__`'s and `parents` None or int32 [rows] (a tree, as `hidden_batch`'s);
        cos, sin (and `local`): [T, 1, head_dim], each row's. Returns the new x [1, T, dim]: each row the bits
        the layer-by-layer batched forward gives."""
        _check_rows(x)
        total = sum(rows for _, _, _, rows, _ in sequences)
        if x.shape != (1, total, self.dim):
            raise ValueError(f"a layer stack takes x [1, {total}, {self.dim}] for these sequences, not {list(x.shape)}")
        x = x.contiguous().clone()
        if self.local and local is None:
            raise ValueError("this stack's local layers need the local RoPE tables")
        tables = (cos, sin, *(local or ()))
        for table in tables:
            if table.dtype != torch.bfloat16 or table.numel() != total * self.head_dim:
                raise ValueError(f"a layer stack's RoPE tables are bf16 [{total}, 1, {self.head_dim}]")
        cos, sin = cos.contiguous(), sin.contiguous()
        cos_l, sin_l = (t.contiguous() for t in local) if local is not None else (cos, sin)
        seqs = (abi.Seq * len(sequences))()
        keep = []
        for seq, (k_cache, v_cache, start, rows, parents) in zip(seqs, sequences, strict=True):
            if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1] == 1):
                raise ValueError("a layer stack runs on each sequence's own contiguous cache")
            layers, _, kv, cap, hd = k_cache.shape
            if (
                k_cache.dtype != torch.bfloat16
                or v_cache.shape != k_cache.shape
                or v_cache.dtype != torch.bfloat16
                or (layers, kv, hd) != (self.n_layers, self.kv_heads, self.head_dim)
            ):
                raise ValueError(
                    f"a layer stack's caches are bf16 [{self.n_layers}, 1, {self.kv_heads}, capacity, "
                    f"{self.head_dim}], not {list(k_cache.shape)}"
                )
            if start < 0 or rows < 0 or start + rows > cap:
                raise ValueError(f"positions {start}..{start + rows - 1} past a cache of {cap}")
            if parents is not None and parents.numel() != rows:
                raise ValueError(f"a tree of {rows} rows has {rows} parents, not {parents.numel()}")
            seq.kc, seq.vc, seq.layer_stride = k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0)
            seq.cap, seq.t, seq.start = k_cache.shape[3], rows, start
            if parents is not None:
                parents = parents.to(torch.int32).contiguous()
                keep.append(parents)
                seq.parent = parents.data_ptr()
        self.kernel._lib.sk_layers(
            self._table,
            self.n_layers,
            x.data_ptr(),
            seqs,
            len(sequences),
            self.dim,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.inter,
            cos.data_ptr(),
            sin.data_ptr(),
            cos_l.data_ptr(),
            sin_l.data_ptr(),
            self.eps,
            1.0 / math.sqrt(self.head_dim),
            torch.get_num_threads(),
        )
        return x


class DraftChain:
    """A feature draft's greedy chain in one kernel call (layers.h's sk_draft_chain): its fusion product `fc`, its
    one-layer `stack`, its final `norm` weight [dim] (bf16), its `head` over the draft vocabulary and that
    vocabulary's embedding rows `embed` [vocab, dim] (bf16), each product of the stack's kernel and unpadded; every
    value the bits of the calls one by one (`EagleDraft.forward`, `draft_logits`, the greedy choice)."""

    def __init__(self, stack: LayerStack, fc: Product, head: Product, norm: Tensor, embed: Tensor, eps: float) -> None:
        if stack.n_layers != 1:
            raise ValueError("a draft chain runs one layer")
        dim, vocab = stack.dim, head.out_features
        shapes = ((fc.out_features, fc.in_features), (head.in_features,), tuple(norm.shape), tuple(embed.shape))
        if shapes != ((dim, 2 * dim), (dim,), (dim,), (vocab, dim)):
            raise ValueError(f"a draft chain of width {dim} does not take products and tables shaped {shapes}")
        if norm.dtype != torch.bfloat16 or embed.dtype != torch.bfloat16 or dim % 16:
            raise ValueError("a draft chain's norm and embedding rows are bf16, its width a multiple of 16")
        self.kernel = stack.kernel
        self._keep = [stack, norm.contiguous(), embed.contiguous()]
        self._draft = abi.Draft()
        stack._product(self._draft.fc, fc)
        stack._product(self._draft.head, head)
        self._draft.layer = stack._table[0]
        self._draft.norm, self._draft.embed = self._keep[1].data_ptr(), self._keep[2].data_ptr()
        self._draft.dim, self._draft.heads, self._draft.kv_heads = dim, stack.heads, stack.kv_heads
        self._draft.head_dim, self._draft.inter, self._draft.vocab = stack.head_dim, stack.inter, vocab
        self._draft.eps, self._draft.scale = eps, 1.0 / math.sqrt(stack.head_dim)
        self.dim, self.vocab = dim, vocab
        self._row_bytes = dim * 2
        self._embed_ptr = self._draft.embed

    def row(self, index: int) -> int:
        """The address of the draft vocabulary's `index`th embedding row."""
        return self._embed_ptr + index * self._row_bytes

    def __call__(
        self,
        states: Tensor,
        embeds: Sequence[int],
        k_cache: Tensor,
        v_cache: Tensor,
        start: int,
        cos: Tensor,
        sin: Tensor,
        k: int,
        p_min: float,
        value_min: float = 0.0,
    ) -> tuple[list[int], Tensor, int]:
        """Up to `k` greedy tokens (draft vocabulary indices) after the first forward's T rows: states [T, dim]
        (bf16, contiguous) and the addresses of their tokens' embedding rows (`embeds`, T), at cache positions
        start..start+T-1; the chain stops before a token whose probability is below `p_min`, or where the product
        of the chain's probabilities falls below `value_min`. k_cache, v_cache:
        the draft's [1, 1, kv_heads, capacity, head_dim] (bf16); cos, sin: `rope_tables`' [n, 1, head_dim], n past
        every position the chain reaches (start + T + k - 1). Returns (tokens, the last guessed state [1, dim], the
        position after the last forward)."""
        t, cap = len(embeds), k_cache.shape[3]
        if not (t >= 1 and k >= 1 and states.shape == (t, self.dim) and states.is_contiguous()):
            raise ValueError(f"a draft chain takes states [{t}, {self.dim}] and at least one token")
        # Each token but the last is fed back: at most T + k - 1 positions written.
        if start < 0 or start + t + k - 1 > min(cap, cos.shape[0]):
            raise ValueError(f"a chain from {start} of {t} + {k} rows runs past a cache or table of {cap}")
        contiguous = k_cache.is_contiguous() and v_cache.is_contiguous()
        if k_cache.shape[:3] != (1, 1, self._draft.kv_heads) or not contiguous:
            raise ValueError("a draft chain runs on the draft's own contiguous one-layer cache")
        tokens = (ctypes.c_int32 * k)()
        guess = torch.empty(1, self.dim, dtype=torch.bfloat16)
        end = ctypes.c_int64()
        n = self.kernel._lib.sk_draft_chain(
            ctypes.byref(self._draft),
            states.data_ptr(),
            (ctypes.c_void_p * t)(*embeds),
            t,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            cap,
            start,
            cos.data_ptr(),
            sin.data_ptr(),
            k,
            p_min,
            value_min,
            torch.get_num_threads(),
            tokens,
            guess.data_ptr(),
            ctypes.byref(end),
        )
        return tokens[:n], guess, end.value


def _check_rows(x: Tensor) -> None:
    # What every C function reads its rows as: bf16 on the CPU (a pointer it can follow).
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() == 0:
        raise ValueError(
            f"the kernels take bf16 rows on the CPU, not {str(x.dtype).removeprefix('torch.')} on {x.device}"
        )


def _residual(residual: Tensor, shape: torch.Size) -> Tensor:
    """`residual` as the C side reads it: contiguous bf16 of the output's `shape` (it adds one per output)."""
    if residual.shape != shape or residual.dtype != torch.bfloat16 or residual.device.type != "cpu":
        raise ValueError(
            f"a residual is bf16 {list(shape)} on the CPU, as the output; not "
            f"{str(residual.dtype).removeprefix('torch.')} {list(residual.shape)} on {residual.device}"
        )
    return residual.contiguous()


def _check_part(offset: int, rows: int, n: int, k_cache: Tensor, v_cache: Tensor, start: int, kv: int, d: int) -> None:
    # One sequence of an attention call: its rows within the call's and its positions within its cache, whose
    # keys and values the C side writes at start..start+rows-1 of every kv head.
    if offset < 0 or rows < 0 or offset + rows > n:
        raise ValueError(f"rows {offset}..{offset + rows - 1} of an attention call of {n}")
    for cache in (k_cache, v_cache):
        if cache.dtype != torch.bfloat16 or cache.dim() != 3 or cache.shape[0] != kv or cache.shape[2] != d:
            raise ValueError(f"an attention cache is bf16 [{kv}, capacity, {d}], not {list(cache.shape)}")
    cap = k_cache.shape[1]
    if v_cache.shape[1] != cap or start < 0 or start + rows > cap:
        raise ValueError(f"positions {start}..{start + rows - 1} past a cache of {cap}")


def fits(weight: Tensor) -> bool:
    """Whether `weight` [N, K] can run on a kernel: bfloat16 on CPU, K a multiple of 32 (N is padded)."""
    on_cpu = weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
    return on_cpu and weight.dim() == 2 and weight.shape[1] % 32 == 0


def attention_fits(kernel: Kernel | None, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model's cached attention can run on `kernel`: bf16 on CPU, head_dim a multiple of the kernel's
    `head_multiple` (32; 64 on amx) and at most 256."""
    if kernel is None or dtype != torch.bfloat16 or device.type != "cpu" or head_dim > 256:
        return False
    return head_dim % kernel.spec.head_multiple == 0


class KernelLinear:
    """`x @ weight.T + bias` for bf16 x [..., K] on a kernel; the weight is laid out for it once."""

    def __init__(self, kernel: Kernel, weight: Tensor, bias: Tensor | None) -> None:
        if not fits(weight):
            raise ValueError(
                f"a kernel's bf16 product takes a bf16 weight [N, K], K a multiple of 32; not {weight.shape}"
            )
        n, k = weight.shape
        _check_bias(bias, n)
        pad = -n % 64
        if pad:  # zero columns, cut off again in __call__
            weight = torch.cat([weight, weight.new_zeros(pad, k)])
        width = kernel.spec.block
        if kernel.spec.layout == "tiles":
            # [N, K] -> [N/W, K/2, W, 2]: for each W-column block, input pairs of each column side by side.
            self.weight = weight.reshape(-1, width, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            # [N, K] -> [N/W, K, W/2, 2] (see common.h): a block of W columns read as one stream, input by input,
            # columns i and W/2 + i side by side.
            self.weight = weight.reshape(-1, 2, width // 2, k).permute(0, 3, 2, 1).contiguous()
        self.bias = None
        if bias is not None:
            self.bias = torch.cat([bias.float(), bias.new_zeros(pad, dtype=torch.float32)]).contiguous()
        self.out_features, self.in_features, self._padded = n, k, n + pad
        self.kernel = kernel

    def __call__(
        self,
        x: Tensor,
        norm: Tensor | None = None,
        eps: float = 0.0,
        swiglu: bool = False,
        residual: Tensor | None = None,
        geglu: bool = False,
    ) -> Tensor:
        """x [..., K] -> [..., N]. Fused around the product, each row on its own: `norm` [K]: RMS-normalise x
        with this weight and `eps` first; `swiglu`: x is [..., 2K] = [gate | up], multiplied as
        silu(gate) * up (`geglu`: with gelu's tanh form, common.h's sk_gelu_times); `residual` [..., N]: added
        to the result."""
        k = self.in_features
        rows, op, scratch = _fusion(x, k, norm, swiglu, geglu)
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], self._padded, dtype=torch.bfloat16)
        if residual is not None:
            if self._padded != self.out_features:
                raise ValueError("a padded product takes no residual")
            residual = _residual(residual, y.shape)
        if rows:
            self.kernel._lib.sk_linear(
                self.weight.data_ptr(),
                x.data_ptr(),
                y.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(),
                rows,
                k,
                self._padded,
                torch.get_num_threads(),
                op,
                None if norm is None else norm.contiguous().data_ptr(),
                eps,
                None if residual is None else residual.data_ptr(),
                None if scratch is None else scratch.data_ptr(),
            )
        return y if self._padded == self.out_features else y[..., : self.out_features]


def _check_bias(bias: Tensor | None, n: int) -> None:
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"a product of {n} outputs takes a bias [{n}], not {list(bias.shape)}")


def _fusion(x: Tensor, k: int, norm: Tensor | None, swiglu: bool, geglu: bool) -> tuple[int, int, Tensor | None]:
    """What a product kernel fuses before its product, for x [..., K] (or [..., 2K] with swiglu or geglu): (rows,
    the op code the C side takes: 0 none, 1 RMS norm, 2 SwiGLU, 3 GeGLU, and the bf16 scratch [rows, K] the op
    writes). ValueError for an x, or a norm, of another width than the C side reads: it takes the row count and
    K from here and reads and writes whole rows."""
    _check_rows(x)
    if (norm is not None) + swiglu + geglu > 1:
        raise ValueError("a product fuses one of norm, swiglu and geglu")
    width = 2 * k if swiglu or geglu else k
    if x.shape[-1] != width:
        raise ValueError(f"a product of {k} inputs takes rows of {width}, not {x.shape[-1]}")
    if norm is not None and (norm.shape != (k,) or norm.dtype != torch.bfloat16):
        raise ValueError(f"a product's fused norm is a bf16 weight [{k}], not {list(norm.shape)}")
    rows = x.numel() // width
    op = 1 if norm is not None else 2 if swiglu else 3 if geglu else 0
    return rows, op, torch.empty(rows, k, dtype=torch.bfloat16) if op else None


class QuantLinear:
    """`x @ weight.T + bias` for bf16 x [..., K] on GGUF quantized weights: the file's blocks interleaved 8 rows
    at a time (quant.h's x8 layout, `sk_q_pack`), once, here; it holds the only copy (`select` and `rows` read
    rows back as the file stores them, for a tied embedding).

    Each output is quant.h's fixed chain over the exact dequantized weights (the bits of the generic kernel on
    every portable kernel), whatever the row count: the same promises as `KernelLinear`. Every format quantizes
    each row of x to 8 bits (per 32 inputs; the K-quants per 256, with power-of-two steps per 32) and multiplies
    in integers, as llama.cpp does."""

    def __init__(self, kernel: Kernel, weight: QuantizedWeight, bias: Tensor | None) -> None:
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        for qtype, data in weight.segments:
            # The C product reads K / QK blocks a row: a row of fewer bytes would be read past its end.
            size = row_bytes(qtype, self.in_features)
            if data.dim() != 2 or data.shape[1] != size:
                raise ValueError(
                    f"{qtype} rows of {self.in_features} inputs are [rows, {size}] bytes, not {list(data.shape)}"
                )
        _check_bias(bias, self.out_features)
        # Per segment: its GGML type name, its blocks as the kernel reads them, its row count.
        self.segments = [(qtype, _packed(kernel, qtype, data), data.shape[0]) for qtype, data in weight.segments]
        self.bias = None if bias is None else bias.float().contiguous()

    @property
    def formats(self) -> list[str]:
        return list(dict.fromkeys(qtype for qtype, _, _ in self.segments))

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: every segment's blocks (an x8 layout's last group padded to 8 rows)."""
        return sum(data.numel() for _, data, _ in self.segments)

    def select(self, ids: Tensor) -> QuantizedWeight:
        """Rows `ids` (long [M]) as the file stores them (`QuantizedWeight.select`; one format only)."""
        if len(self.segments) != 1:
            raise ValueError("rows are selected from a weight of one format only")
        return self._unpacked(0, ids)

    def blocks(self) -> QuantizedWeight:
        """The whole weight as the file stores it (for another kernel)."""
        return QuantizedWeight.cat(
            [self._unpacked(s, torch.arange(count)) for s, (_, _, count) in enumerate(self.segments)]
        )

    def _unpacked(self, segment: int, ids: Tensor) -> QuantizedWeight:
        qtype, data, count = self.segments[segment]
        ids = ids.reshape(-1).long().contiguous()
        if ids.numel() and (ids.min() < 0 or ids.max() >= count):
            raise IndexError(f"rows of a weight of {count} rows")
        out = torch.empty(ids.numel(), data.shape[1], dtype=torch.uint8)
        self.kernel._lib.sk_q_unpack(
            FORMATS[qtype][0], data.data_ptr(), data.shape[1], ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        return QuantizedWeight([(qtype, out)], self.in_features)

    def rows(self, ids: Tensor) -> Tensor:
        """The exact values of rows `ids` (long [...]), float32 [..., K]: an embedding lookup
        (`QuantizedWeight.rows`)."""
        return self.select(ids).dequantize().reshape(*ids.shape, self.in_features)

    def __call__(
        self,
        x: Tensor,
        norm: Tensor | None = None,
        eps: float = 0.0,
        swiglu: bool = False,
        residual: Tensor | None = None,
        geglu: bool = False,
    ) -> Tensor:
        """x [..., K] -> [..., N]; `norm`, `eps`, `swiglu`, `residual` and `geglu` as `KernelLinear`."""
        k, n = self.in_features, self.out_features
        rows, op, scratch = _fusion(x, k, norm, swiglu, geglu)
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
        if residual is not None:
            residual = _residual(residual, y.shape)
        norm_w = None if norm is None else norm.contiguous()
        first = 0
        for qtype, data, count in self.segments:
            if rows:
                col = first * 2  # bytes per bf16 output
                self.kernel._lib.sk_qlinear(
                    FORMATS[qtype][0],
                    data.data_ptr(),
                    data.shape[1],
                    x.data_ptr(),
                    y.data_ptr() + col,
                    n,
                    None if self.bias is None else self.bias.data_ptr() + first * 4,
                    rows,
                    k,
                    count,
                    torch.get_num_threads(),
                    op,
                    None if norm_w is None else norm_w.data_ptr(),
                    eps,
                    None if residual is None else residual.data_ptr() + col,
                    None if scratch is None else scratch.data_ptr(),
                )
            first += count
        return y


def _packed(kernel: Kernel, qtype: str, data: Tensor) -> Tensor:
    """uint8 [N, bytes per row] blocks of `qtype` as sk_qlinear takes them, in the x8 layout: [(N + 7) // 8 * 8,
    bytes per row], the last group zero-padded."""
    if qtype not in FORMATS or data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"blocks to pack are uint8 [rows, bytes per row] of a format in {', '.join(FORMATS)}")
    if data.shape[1] == 0 or data.shape[1] % FORMATS[qtype][2]:
        raise ValueError(f"{qtype} rows are whole blocks of {FORMATS[qtype][2]} bytes, not {data.shape[1]}")
    data = data.contiguous()
    out = torch.empty((data.shape[0] + 7) // 8 * 8, data.shape[1], dtype=torch.uint8)
    kernel._lib.sk_q_pack(
        FORMATS[qtype][0], data.data_ptr(), data.shape[1], data.shape[0], out.data_ptr(), torch.get_num_threads()
    )
    return out
