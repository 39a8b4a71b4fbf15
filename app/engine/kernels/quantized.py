"""GGUF quantized weights kept as the file stores them (llama.cpp's blocks), for the CPU kernels to compute on.

A `QuantizedWeight` [N, K] is N rows of K / QK blocks each, in one or more row segments of one format each (a
fused projection concatenates GGUF tensors, and a Q4_K_M file may give q and v different formats). Its exact
values are what `gguf.quants.dequantize` gives: the reference the quantized kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# Formats the CPU kernels compute on (GGML type name -> id, quant.h's SK_*), with (inputs, bytes) per block.
FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}


def computable(qtype: str, in_features: int) -> bool:
    """Whether a tensor of GGML type `qtype` with rows of `in_features` can stay quantized on the kernels."""
    return qtype in FORMATS and in_features > 0 and in_features % FORMATS[qtype][1] == 0


def row_bytes(qtype: str, in_features: int) -> int:
    """The bytes of one row of `in_features` inputs in format `qtype`; ValueError where the kernels cannot take
    such rows (an unknown format, or inputs not a whole number of its blocks). The C products read a row's blocks
    from the row's width, so a row of other bytes than this is read past its end."""
    if qtype not in FORMATS:
        raise ValueError(f"{qtype} is not a format the kernels compute on ({', '.join(FORMATS)})")
    _, qk, size = FORMATS[qtype]
    if in_features <= 0 or in_features % qk:
        raise ValueError(f"{qtype} rows are whole blocks of {qk} inputs, not {in_features}")
    return in_features // qk * size


@dataclass
class QuantizedWeight:
    """A weight [N, K] as GGUF blocks: `segments` of consecutive rows, each (GGML type name, uint8 [rows,
    K / QK * bytes per block])."""

    segments: list[tuple[str, Tensor]]
    in_features: int

    def __post_init__(self) -> None:
        for qtype, data in self.segments:
            size = row_bytes(qtype, self.in_features)
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != size:
                raise ValueError(
                    f"{qtype} rows of {self.in_features} inputs are uint8 [rows, {size}], "
                    f"not {str(data.dtype).removeprefix('torch.')} {list(data.shape)}"
                )

    @property
    def out_features(self) -> int:
        return sum(data.shape[0] for _, data in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(data.numel() for _, data in self.segments)

    @property
    def formats(self) -> list[str]:
        return list(dict.fromkeys(qtype for qtype, _ in self.segments))

    def dequantize(self) -> Tensor:
        """The exact values, float32 [N, K]."""
        return torch.cat([_dequantize(qtype, data) for qtype, data in self.segments])

    def rows(self, ids: Tensor) -> Tensor:
        """The exact values of rows `ids` (long [...]), float32 [..., K] (an embedding lookup)."""
        flat = ids.reshape(-1)
        if len(self.segments) == 1:  # an embedding: one row per decoding step, no masks to build
            qtype, data = self.segments[0]
            return _dequantize(qtype, data[flat]).reshape(*ids.shape, self.in_features)
        out = torch.empty(flat.shape[0], self.in_features)
        start = 0
        for qtype, data in self.segments:
            mine = (flat >= start) & (flat < start + data.shape[0])
            if mine.any():
                out[mine] = _dequantize(qtype, data[flat[mine] - start])
            start += data.shape[0]
        return out.reshape(*ids.shape, self.in_features)

    def select(self, ids: Tensor) -> QuantizedWeight:
        """Rows `ids` (long [M]), in that order, still quantized (a weight of one format only)."""
        if len(self.segments) != 1:
            raise ValueError("rows are selected from a weight of one format only")
        qtype, data = self.segments[0]
        return QuantizedWeight([(qtype, data[ids].contiguous())], self.in_features)

    def permute_rows(self, order: Tensor) -> QuantizedWeight:
        """Rows in `order` (long [N], a permutation within each segment's rows)."""
        out, start = [], 0
        for qtype, data in self.segments:
            idx = order[start : start + data.shape[0]] - start
            if idx.numel() and (idx.min() < 0 or idx.max() >= data.shape[0]):
                raise ValueError("a permutation may not move rows between segments")
            out.append((qtype, data[idx].contiguous()))
            start += data.shape[0]
        return QuantizedWeight(out, self.in_features)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows of `parts` one after another (segments of one format joined)."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("cannot join weights of different input sizes")
        segments: list[tuple[str, Tensor]] = []
        for qtype, data in (s for p in parts for s in p.segments):
            if segments and segments[-1][0] == qtype:
                segments[-1] = (qtype, torch.cat([segments[-1][1], data]))
            else:
                segments.append((qtype, data))
        return QuantizedWeight(segments, parts[0].in_features)


def quantize(weight: Tensor, qtype: str) -> QuantizedWeight:
    """`weight` [N, K] (any float dtype; K a multiple of the format's block) as `qtype` blocks, rounded as
    llama.cpp's reference quantizer does (`gguf.quants.quantize`): what a model's own matrices (a trained draft's)
    become to run on the integer kernels. The 32-input formats only (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)."""
    import gguf

    if qtype not in FORMATS or FORMATS[qtype][1] != 32:
        raise ValueError(f"{qtype} is not a 32-input format the kernels compute on")
    if weight.dim() != 2 or weight.shape[1] % 32:
        raise ValueError(f"{qtype} quantizes [N, K] weights with K a multiple of 32, not {list(weight.shape)}")
    values = np.ascontiguousarray(weight.detach().to("cpu", torch.float32).numpy())
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    return QuantizedWeight([(qtype, torch.from_numpy(np.ascontiguousarray(blocks)))], weight.shape[1])


def _dequantize(qtype: str, data: Tensor) -> Tensor:
    if qtype in _IN_TORCH:
        return _IN_TORCH[qtype](data)
    import gguf

    values = gguf.quants.dequantize(np.ascontiguousarray(data.numpy()), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _q8_0(data: Tensor) -> Tensor:
    blocks = data.reshape(data.shape[0], -1, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).reshape(data.shape[0], -1)


def _q4_1(data: Tensor) -> Tensor:
    blocks = data.reshape(data.shape[0], -1, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # inputs 0-15: low nibbles, 16-31: high
    return (d * q + m).reshape(data.shape[0], -1)


# The formats of the default target's embedding and layers, dequantized with torch's ops: the same float32
# products and sums as gguf's numpy code (checked bit for bit by the tests), without its per-call overhead, which
# was about 5 % of a decoding step for the one embedding row a step looks up.
_IN_TORCH = {"Q8_0": _q8_0, "Q4_1": _q4_1}
