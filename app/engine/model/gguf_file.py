"""A GGUF file's metadata and tensor table, read in one pass over its header.

The `gguf` package's reader makes a numpy view for every part of every metadata value: a vocabulary of 262 k
tokens (Gemma 3) costs it seconds to a minute per read, and a 49 k one (SmolLM2) seconds, each time a model
is loaded or listed. Here the header is parsed with `struct` into plain Python values, and the tensors are
views of one memory map, laid out as the package lays them out (so `gguf.quants.dequantize` takes them as
they are). Little-endian files only, as llama.cpp writes them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

__all__ = ["GGUFFile", "GGUFTensor"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.GGUFValueType) that are fixed-size scalars: struct format and numpy dtype.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
# Unquantized tensor types and the numpy element they are read as (the package's choice); the rest are bytes.
_PLAIN = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFError(ValueError):
    """A file that is not a GGUF this reader can read (its name and why)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. `shape`: its dimensions in GGUF order (the fastest-moving first); `data`: a
    read-only view of the file, shaped [*reversed(shape)] for unquantized types, else [rows, bytes per row]."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    """The metadata (`fields`: key -> value; strings as str, arrays as lists, numbers as Python numbers, the
    values `gguf.GGUFReader`'s ``field.contents()`` gives; `types`: key -> its value type and, for an array,
    its items', as `gguf.GGUFWriter.add_key_value` takes them) and the tensors of the GGUF at `path`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)
        if bytes(buf[:4]) != _MAGIC:
            raise GGUFError(f"{self.path.name}: not a GGUF file")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"{self.path.name}: GGUF version {version} (a big-endian file?) is not supported")
        self._buf, self._pos = buf, 24
        self.fields: dict[str, Any] = {}
        self.types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            item = GGUFValueType(struct.unpack_from("<I", buf, self._pos)[0]) if kind == _ARRAY else None
            self.types[key] = (GGUFValueType(kind), item)
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        del self._buf

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return str(self._buf[start : self._pos], "utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0])[0]
        if kind != _ARRAY:
            raise GGUFError(f"{self.path.name}: unknown metadata type {kind}")
        item, count = self._unpack("<IQ")
        if item in _SCALARS:  # one read for the whole array
            dtype = np.dtype(_SCALARS[item][1])
            values = np.frombuffer(self._buf, dtype, count, self._pos)
            self._pos += dtype.itemsize * count
            return values.tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        qtype = GGMLQuantizationType(kind)
        n_elements = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * size // block
        shape = tuple(reversed(dims))
        begin = start + offset
        raw = self._map[begin : begin + n_bytes]
        if qtype in _PLAIN:
            data = raw.view(_PLAIN[qtype]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
        return GGUFTensor(name, qtype, tuple(int(d) for d in dims), n_elements, n_bytes, data)
