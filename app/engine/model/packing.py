"""Weights laid out once, at load, for what computes on them: a linear layer's matrix packed for a CPU kernel or
reordered for oneDNN (`PackedLinear`), GGUF blocks computed on as they are, and an embedding table kept as blocks
(`QuantizedEmbedding`). `Transformer.pack` puts them in place."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.engine import kernels
from app.engine.kernels import Kernel
from app.engine.kernels.quantized import QuantizedWeight


class PackedLinear(nn.Module):
    """A bfloat16 linear layer whose weight was laid out once, at load, for the CPU kernel that runs it.

    On a CPU kernel (`kernel`, the one the model is packed for), the product runs on it (`KernelLinear`):
    weights streamed once per call for all rows, and a row's result never depends on how many rows a call has.
    Without one (`SPECSERVE_KERNEL=torch`, or no compiler) oneDNN runs it on a weight reordered once: unpacked, oneDNN
    reorders a bf16 weight on every call, which costs more than the product itself for the few rows of a
    decoding step (bit-identical to F.linear).
    """

    def __init__(
        self, weight: Tensor | QuantizedWeight | kernels.QuantLinear, bias: Tensor | None, kernel: Kernel | None
    ) -> None:
        super().__init__()
        self.quantized: kernels.QuantLinear | None = None  # the product on GGUF blocks, which holds them
        self.packed = None
        self.weight: Tensor | None = None
        self.bias = bias
        self.fused: kernels.KernelLinear | kernels.QuantLinear | None
        if isinstance(weight, kernels.QuantLinear):  # blocks packed before (a tied head packed again)
            if weight.kernel is kernel:
                self.fused = self.quantized = weight
                return
            weight = weight.blocks()
        if isinstance(weight, QuantizedWeight):
            # GGUF blocks: only a kernel computes on them.
            if kernel is None:
                raise ValueError("quantized weights need a CPU kernel (SPECSERVE_KERNEL is torch, or none builds)")
            self.fused = self.quantized = kernel.qlinear(weight, bias)
            return
        # On a kernel, with what can ride along with the product (norm before, residual after; DecoderBlock).
        self.fused = kernel.linear(weight, bias) if kernel is not None and kernels.fits(weight) else None
        self.weight: Tensor | None = None
        if self.fused is None:
            if _onednn_packs():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            else:
                self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        if self.fused is not None:
            return self.fused(x)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device, kernel: Kernel | None) -> bool:
    """Whether `Transformer.pack(kernel)` does anything for this dtype and device: bfloat16 on a CPU, with a
    kernel or where oneDNN can reorder bf16 weights."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    return kernel is not None or _onednn_packs()


@functools.cache
def _onednn_packs() -> bool:
    # oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU raises).
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


class QuantizedEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks: a lookup dequantizes the rows it needs, exactly, into `dtype`
    (the values a dequantized table in that dtype holds).

    The rows of the last tokens looked up one or a few at a time (a decoding step's) are kept, up to
    `_ROW_CACHE_BYTES`, the oldest dropped first: a lookup through torch's dozen small operations costs a
    decoding step of the default target about 4 % (each runs cold, after the step's weights went through the
    caches), and a text uses few distinct tokens."""

    _ROW_CACHE_BYTES = 8 << 20
    _FEW = 16  # lookups of at most this many ids go through the kept rows

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        # The blocks as the file stores them; or, once the head tied to them is packed for a kernel, that
        # head's product, which holds the only copy (`Transformer.pack`).
        self.quantized: QuantizedWeight | kernels.QuantLinear = weight
        self.dtype = dtype
        self._rows: dict[int, Tensor] = {}
        self._most = max(1, self._ROW_CACHE_BYTES // (weight.in_features * torch.finfo(dtype).bits // 8))

    def forward(self, ids: Tensor) -> Tensor:
        if ids.numel() > self._FEW:
            return self.quantized.rows(ids).to(self.dtype)
        keys = ids.reshape(-1).tolist()
        missing = [key for key in dict.fromkeys(keys) if key not in self._rows]
        if missing:
            found = self.quantized.rows(torch.tensor(missing, dtype=torch.long)).to(self.dtype)
            for key, row in zip(missing, found, strict=True):
                if len(self._rows) >= self._most:
                    del self._rows[next(iter(self._rows))]
                self._rows[key] = row.clone()  # its own storage: a view would keep the whole lookup alive
        # A new tensor: the caller may write into what it gets, never into a kept row.
        return torch.stack([self._rows[key] for key in keys]).reshape(*ids.shape, -1)
