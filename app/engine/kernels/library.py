"""A loaded kernel library and what runs on it: bf16 products (`KernelLinear`), products on GGUF blocks
(`QuantLinear`), cached attention (`Kernel.attention`) and a decoder's layers in one call (`LayerStack`)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from app.engine.kernels import abi
from app.engine.kernels.quantized import FORMATS, QuantizedWeight
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
        k = x.shape[-1]
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or k % 16 or weight.shape != (k,):
            raise ValueError("rms_norm takes bf16 rows of a multiple of 16 and a bf16 weight of that size")
        x = x.contiguous()
        y = torch.empty_like(x)
        if residual is not None:
            assert residual.shape == x.shape
            residual = residual.contiguous()
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
            if t.stride(3) != 1 or (t.shape[2] > 1 and t.stride(2) != d):
                raise ValueError("attention needs each row's heads side by side")
        out = torch.empty(1, n, h * d, dtype=torch.bfloat16)
        size = 2  # bytes per element
        table = (abi.Part * len(parts))()
        for i, (offset, rows, k_cache, v_cache, start, *tree) in enumerate(parts):
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
        x = x.contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        if self.local and local is None:
            raise ValueError("this stack's local layers need the local RoPE tables")
        cos_l, sin_l = (t.contiguous() for t in local) if local is not None else (cos, sin)
        seqs = (abi.Seq * len(sequences))()
        keep = []
        for seq, (k_cache, v_cache, start, rows, parents) in zip(seqs, sequences, strict=True):
            if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1] == 1):
                raise ValueError("a layer stack runs on each sequence's own contiguous cache")
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
        n, k = weight.shape
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
        x = x.contiguous()
        k = self.in_features
        rows, op, scratch = _fusion(x, k, norm, swiglu, geglu)
        y = torch.empty(*x.shape[:-1], self._padded, dtype=torch.bfloat16)
        if residual is not None:
            assert self._padded == self.out_features and residual.shape == y.shape
            residual = residual.contiguous()
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


def _fusion(x: Tensor, k: int, norm: Tensor | None, swiglu: bool, geglu: bool) -> tuple[int, int, Tensor | None]:
    """What a product kernel fuses before its product, for x [..., K] (or [..., 2K] with swiglu or geglu): (rows,
    the op code the C side takes: 0 none, 1 RMS norm, 2 SwiGLU, 3 GeGLU, and the bf16 scratch [rows, K] the op
    writes)."""
    rows = x.numel() // (2 * k if swiglu or geglu else k)
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
        # Per segment: its GGML type name, its blocks as the kernel reads them, its row count.
        self.segments = [(qtype, _packed(kernel, qtype, data), data.shape[0]) for qtype, data in weight.segments]
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features, self.in_features = weight.shape

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
        x = x.contiguous()
        k, n = self.in_features, self.out_features
        rows, op, scratch = _fusion(x, k, norm, swiglu, geglu)
        y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
        if residual is not None:
            assert residual.shape == y.shape
            residual = residual.contiguous()
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
    data = data.contiguous()
    out = torch.empty((data.shape[0] + 7) // 8 * 8, data.shape[1], dtype=torch.uint8)
    kernel._lib.sk_q_pack(
        FORMATS[qtype][0], data.data_ptr(), data.shape[1], data.shape[0], out.data_ptr(), torch.get_num_threads()
    )
    return out
