"""CPU kernels for the decoder's bfloat16 products and cached attention, one C library per instruction set.

Every kernel computes each output row as the same chain of operations whatever else the call holds: a row's
bits depend on nothing but its own inputs (not the row count, the other sequences of a batch, the thread count
or the cache's capacity). Batched decoding then equals decoding alone, and a verification of k+1 rows gives
the bits of k+1 single steps, without padding or a fixed key span.

Kernels, best first: ``amx`` (Intel AMX tiles), ``avx512`` (AVX-512F), ``avx2`` (AVX2 + FMA), ``generic``
(plain C, any gcc target). The portable three compute the same bits (the arithmetic is fixed in
``common.h``); ``amx`` sums in its tiles' order. The sources (``*.c`` beside this file) are compiled with the
system's gcc at first use into the directory the caller gives (`build_engine`: ``kernels/`` in the model
store's cache directory; none given: a private temporary directory, removed when the process exits),
keyed by source, flags, compiler, CPU and OpenMP runtime, and each library's digest is checked before it is
loaded. ``SPECSERVE_KERNEL`` picks one:
``auto`` (default: the best this CPU runs and gcc builds), a kernel's name (an error where it cannot run),
or ``torch`` (oneDNN and SDPA; rows are not independent there, see `Engine`).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from app.engine.kernels.quantized import FORMATS, QuantizedWeight

log = logging.getLogger(__name__)

KERNELS = ("amx", "avx512vnni", "avx512", "avxvnni", "avx2", "generic")
CHOICES = ("auto", *KERNELS, "torch")
# A test-only build: the avx2 source with dot4.h's exact plain-integer stand-in for VPDPBUSD, so that the code the
# VNNI kernels run is checked bit for bit on a CPU without VNNI. Loadable by `load`, never selected.
STAND_INS = ("vnni-twin",)

_HERE = Path(__file__).parent
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# The C file each kernel compiles (the VNNI kernels are their family's source built with VPDPBUSD; dot4.h).
_SOURCE = {"avx512vnni": "avx512", "avxvnni": "avx2", "vnni-twin": "avx2"}
# CPU flags (as /proc/cpuinfo names them) each kernel needs.
_NEEDS = {
    "amx": {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512_vnni", "avx512vl"},
    "avx512vnni": {"avx512f", "avx512_vnni", "avx512vl", "avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx2", "fma", "f16c"},
    "avxvnni": {"avx_vnni", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "vnni-twin": {"avx2", "fma", "f16c"},
    "generic": set(),
}
# -ffp-contract=off: the portable kernels' bits are defined by explicit fused multiply-adds only.
_AVX512 = ["-mavx512f", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
_FLAGS = {
    "amx": ["-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mfma", "-mf16c", "-mavx512vnni", "-mavx512vl"],
    "avx512vnni": [*_AVX512, "-mavx512vnni", "-mavx512vl"],
    "avx512": _AVX512,
    "avxvnni": [*_AVX2, "-mavxvnni"],
    "avx2": _AVX2,
    "vnni-twin": [*_AVX2, "-DSK_DOT_TWIN"],
    "generic": ["-ffp-contract=off"],
}
_COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# What every kernel's source includes (part of the build key).
_HEADERS = ("common.h", "quant.h", "quant_avx2.h", "dot4.h", "layers.h")


def source(name: str) -> str:
    """The C source (without .c) kernel `name` compiles: its own, or its family's for a VNNI build."""
    return _SOURCE.get(name, name)


class KernelUnavailable(RuntimeError):
    """A kernel that was asked for cannot run here (CPU, compiler or operating system)."""


def setting() -> str:
    """The `SPECSERVE_KERNEL` choice (validated)."""
    choice = os.environ.get("SPECSERVE_KERNEL", "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"SPECSERVE_KERNEL={choice!r}: choose one of {', '.join(CHOICES)}")
    return choice


@functools.cache
def _cpu() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor(), frozenset()
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "cpu part") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def runs_here(name: str) -> bool:
    """Whether this CPU has the instructions kernel `name` needs (the compiler is checked by `load`)."""
    if name == "generic":
        return True
    return _X86 and _NEEDS[name] <= _cpu()[1]


def bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX): elsewhere torch's bf16 matrix
    products are emulated, several times slower than float32 ones."""
    return _X86 and bool({"avx512_bf16", "amx_bf16"} & _cpu()[1])


def available() -> list[str]:
    """The kernels this CPU can run, best first (whether gcc builds them is found out by `load`)."""
    return [name for name in KERNELS if runs_here(name)]


def _torch_gomp() -> Path | None:
    """The OpenMP runtime torch loaded: a kernel must link that very file, or the process gets two runtimes
    and two thread pools."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1]
        if "/libgomp" in path:
            return Path(path)
    return None


def _compiler() -> tuple[str, str]:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise KernelUnavailable("no C compiler (gcc) on PATH")
    version = subprocess.run([gcc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    return gcc, version


def _flags(name: str, gcc: str) -> list[str]:
    flags = list(_FLAGS[name])
    if name == "generic" and _accepts(gcc, "-march=native"):
        flags.append("-march=native")  # lets gcc vectorise the plain loops; the bits stay IEEE's
    return flags


@functools.cache
def _accepts(gcc: str, flag: str) -> bool:
    cmd = [gcc, flag, "-x", "c", "-E", "-", "-o", os.devnull]
    done = subprocess.run(cmd, input="", capture_output=True, timeout=30)
    return done.returncode == 0


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(name: str, gcc: str, flags: list[str], target: Path) -> None:
    gomp = _torch_gomp()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        # Link the libgomp torch loaded, by path: one OpenMP runtime, one pool of threads.
        openmp = [str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp is not None else ["-lgomp"]
        cmd = [gcc, *_COMMON, *flags, f"-I{_HERE}", str(_HERE / f"{source(name)}.c"), "-o", str(out), *openmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KernelUnavailable(f"gcc failed to build the {name} kernel: {done.stderr.strip()[:500]}")
        Path(f"{out}.sha256").write_text(_digest(out))
        # Library first, digest second, each atomically: a reader sees a digest only beside its whole library.
        os.replace(out, target)
        os.replace(f"{out}.sha256", f"{target}.sha256")


@functools.cache
def _private_dir() -> Path:
    """Where kernels are built when the caller names no directory: this process's own, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="specserve-kernels-"))
    atexit.register(shutil.rmtree, path, True)
    return path


_P, _I = ctypes.c_void_p, ctypes.c_int
# The C functions every kernel library exports, as ctypes calls them: name -> (return type, argument types). One
# table, which tests/test_kernels.py checks against the prototypes in the headers (common.h, quant.h, layers.h,
# dot4.h), so that a changed C signature cannot go unnoticed on the Python side.
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "sk_init": (ctypes.c_int, []),
    "sk_linear": (None, [_P, _P, _P, _P, _I, _I, _I, _I, _I, _P, ctypes.c_float, _P, _P]),
    "sk_qlinear": (None, [_I, _P, ctypes.c_long, _P, _P, _I, _P, _I, _I, _I, _I, _I, _P, ctypes.c_float, _P, _P]),
    "sk_attention": (None, [_P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I]),
    "sk_layers": (
        None,
        [_P, _I, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P]
        + [ctypes.c_int64] * 3
        + [ctypes.c_float, ctypes.c_float, _I],
    ),
    "sk_dot_kind": (ctypes.c_char_p, []),
}


class Kernel:
    """One loaded kernel library: `linear` lays a weight out for it, `attention` runs cached attention."""

    def __init__(self, name: str, lib: ctypes.CDLL, path: Path) -> None:
        self.name = name
        # The C source it was built from: what decides the weights' layout (a VNNI build lays them out as its
        # family does).
        self.source = source(name)
        self.path = path
        self._lib = lib
        for function, (restype, argtypes) in SIGNATURES.items():
            if function == "sk_dot_kind" and not hasattr(lib, function):
                continue  # the generic kernel has no integer dot products
            getattr(lib, function).restype = restype
            getattr(lib, function).argtypes = argtypes

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"

    def linear(self, weight: Tensor, bias: Tensor | None) -> KernelLinear:
        """`weight` [N, K] (bf16, K % 32 == 0; see `fits`) laid out once for this kernel's products."""
        return KernelLinear(self, weight, bias)

    def qlinear(self, weight: QuantizedWeight, bias: Tensor | None) -> QuantLinear:
        """`weight` [N, K]: GGUF blocks (see `app.engine.kernels.quantized`), computed on as they are."""
        return QuantLinear(self, weight, bias)

    @property
    def dot(self) -> str | None:
        """How its integer products take their 4-byte dot products (dot4.h): `avx512vnni`, `avxvnni`, `avx2`
        or `twin`; None for the generic kernel (plain C)."""
        try:
            kind = self._lib.sk_dot_kind
        except AttributeError:
            return None
        return kind().decode()

    @property
    def trees(self) -> bool:
        """Whether `attention` takes tree parts (a parent per row): the portable kernels, whose attention reads
        a tree row's keys in its sequential order (common.h); not amx, whose tiles read keys by slot."""
        return self.name != "amx"

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
        table = (_Part * len(parts))()
        for i, (offset, rows, k_cache, v_cache, start, *tree) in enumerate(parts):
            parents = tree[0] if tree else None
            if parents is not None:
                if not self.trees:
                    raise ValueError(f"the {self.name} kernel does not attend over trees")
                if parents.dtype != torch.int32 or not parents.is_contiguous() or parents.shape != (rows,):
                    raise ValueError("a tree's parents are int32 [rows], contiguous")
            table[i] = _Part(
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


class _Part(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "k", "v", "kc", "vc", "out")] + [
        (name, ctypes.c_int64) for name in ("cap", "t", "start")
    ]
    _fields_ += [("parent", ctypes.c_void_p)]


class _Product(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("nseg", ctypes.c_int64)]
    _fields_ += [(name, ctypes.c_int64 * 4) for name in ("type", "rows", "row_bytes")]
    _fields_ += [("data", ctypes.c_void_p * 4)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _Product) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p)]


Product = "KernelLinear | QuantLinear"


class LayerStack:
    """A decoder's layers run in one kernel call (layers.h): the products, RMS norms, RoPE, cached attention and
    residuals of every layer, each value with the bits the layer-by-layer calls give (the same kernels, the
    same arguments), without a Python or torch call between them.

    `layers`: per layer (qkv, o, gate_up, down, attn_norm weight [dim], ffn_norm weight [dim]), the products
    `KernelLinear` or `QuantLinear` of one kernel, none padded; `heads`, `kv_heads`, `head_dim` and `eps` as
    the model's."""

    def __init__(
        self,
        kernel: Kernel,
        layers: Sequence[tuple[Product, Product, Product, Product, Tensor, Tensor]],
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> None:
        self.kernel = kernel
        self._keep: list[Tensor] = []  # what the table points into
        self._table = (_Layer * len(layers))()
        for i, (qkv, o, gate_up, down, attn_norm, ffn_norm) in enumerate(layers):
            entry = self._table[i]
            for name, product in (("qkv", qkv), ("o", o), ("gate_up", gate_up), ("down", down)):
                self._product(getattr(entry, name), product)
            norms = [attn_norm.contiguous(), ffn_norm.contiguous()]
            self._keep += norms
            entry.attn_norm, entry.ffn_norm = norms[0].data_ptr(), norms[1].data_ptr()
        self.n_layers = len(layers)
        self.dim = layers[0][0].in_features
        self.inter = layers[0][3].in_features
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps

    def _product(self, out: _Product, product: Product) -> None:
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
        for s, (qtype, data) in enumerate(product.segments):
            self._keep.append(data)
            out.type[s], out.rows[s], out.row_bytes[s] = qtype, data.shape[0], data.shape[1]
            out.data[s] = data.data_ptr()

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, start: int) -> Tensor:
        """x [1, T, dim] bf16 through every layer at positions start..start+T-1; returns the new x [1, T, dim].
        cos, sin: [T, 1, head_dim] (`rope_tables`'); k_cache, v_cache: [layers, 1, kv_heads, capacity, head_dim]
        bf16, written at those positions as the layers' attention does."""
        x = x.contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        t = x.shape[1]
        cap = k_cache.shape[3]
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1] == 1):
            raise ValueError("a layer stack runs on one sequence's contiguous cache")
        self.kernel._lib.sk_layers(
            self._table,
            self.n_layers,
            x.data_ptr(),
            t,
            self.dim,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.inter,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.stride(0),
            cap,
            start,
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
    """Whether a model's cached attention can run on `kernel`: bf16 on CPU, head_dim a multiple of 32 (of 64
    on amx, whose value pass takes 64 dimensions at a time) and at most 256."""
    if kernel is None or dtype != torch.bfloat16 or device.type != "cpu" or head_dim > 256:
        return False
    return head_dim % (64 if kernel.name == "amx" else 32) == 0


class KernelLinear:
    """`x @ weight.T + bias` for bf16 x [..., K] on a kernel; the weight is laid out for it once."""

    def __init__(self, kernel: Kernel, weight: Tensor, bias: Tensor | None) -> None:
        n, k = weight.shape
        pad = -n % 64
        if pad:  # zero columns, cut off again in __call__
            weight = torch.cat([weight, weight.new_zeros(pad, k)])
        if kernel.source == "amx":
            # [N, K] -> [N/16, K/2, 16, 2]: for each 16-column block, input pairs of each column side by side.
            self.weight = weight.reshape(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            # [N, K] -> [N/W, K, W/2, 2] (see common.h): a block of W columns read as one stream, input by input,
            # columns i and W/2 + i side by side.
            width = 32 if kernel.source == "avx512" else 16
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
    ) -> Tensor:
        """x [..., K] -> [..., N]. Fused around the product, each row on its own: `norm` [K]: RMS-normalise x
        with this weight and `eps` first; `swiglu`: x is [..., 2K] = [gate | up], multiplied as
        silu(gate) * up; `residual` [..., N]: added to the result."""
        x = x.contiguous()
        k = self.in_features
        rows, op, scratch = _fusion(x, k, norm, swiglu)
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


def _fusion(x: Tensor, k: int, norm: Tensor | None, swiglu: bool) -> tuple[int, int, Tensor | None]:
    """What a product kernel fuses before its product, for x [..., K] (or [..., 2K] with swiglu): (rows, the
    op code the C side takes: 0 none, 1 RMS norm, 2 SwiGLU, and the bf16 scratch [rows, K] the op writes)."""
    rows = x.numel() // (2 * k if swiglu else k)
    op = 1 if norm is not None else 2 if swiglu else 0
    return rows, op, torch.empty(rows, k, dtype=torch.bfloat16) if op else None


class QuantLinear:
    """`x @ weight.T + bias` for bf16 x [..., K] on GGUF quantized weights, read as the file stores them.

    Each output is quant.h's fixed chain over the exact dequantized weights (the bits of the generic kernel on
    every portable kernel), whatever the row count: the same promises as `KernelLinear`. Every format quantizes
    each row of x to 8 bits per 32 inputs and multiplies in integers, as llama.cpp does."""

    def __init__(self, kernel: Kernel, weight: QuantizedWeight, bias: Tensor | None) -> None:
        self.kernel = kernel
        self.weight = weight
        self.segments = [(FORMATS[qtype][0], data.contiguous()) for qtype, data in weight.segments]
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features, self.in_features = weight.shape

    def __call__(
        self,
        x: Tensor,
        norm: Tensor | None = None,
        eps: float = 0.0,
        swiglu: bool = False,
        residual: Tensor | None = None,
    ) -> Tensor:
        """x [..., K] -> [..., N]; `norm`, `eps`, `swiglu` and `residual` as `KernelLinear`."""
        x = x.contiguous()
        k, n = self.in_features, self.out_features
        rows, op, scratch = _fusion(x, k, norm, swiglu)
        y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
        if residual is not None:
            assert residual.shape == y.shape
            residual = residual.contiguous()
        norm_w = None if norm is None else norm.contiguous()
        first = 0
        for qtype, data in self.segments:
            if rows:
                col = first * 2  # bytes per bf16 output
                self.kernel._lib.sk_qlinear(
                    qtype,
                    data.data_ptr(),
                    data.shape[1],
                    x.data_ptr(),
                    y.data_ptr() + col,
                    n,
                    None if self.bias is None else self.bias.data_ptr() + first * 4,
                    rows,
                    k,
                    data.shape[0],
                    torch.get_num_threads(),
                    op,
                    None if norm_w is None else norm_w.data_ptr(),
                    eps,
                    None if residual is None else residual.data_ptr() + col,
                    None if scratch is None else scratch.data_ptr(),
                )
            first += data.shape[0]
        return y


@functools.cache
def load(name: str, cache_dir: Path | None = None) -> Kernel:
    """Kernel `name`, built at first use into `cache_dir` (None: a private temporary directory) and kept there,
    loaded once per directory; raises KernelUnavailable where it cannot run here."""
    if name not in KERNELS and name not in STAND_INS:
        raise ValueError(f"unknown kernel {name!r}; kernels: {', '.join(KERNELS)}")
    if not runs_here(name):
        need = " ".join(sorted(_NEEDS[name])) if _X86 else "an x86-64 CPU"
        cpu = _cpu()[0] or platform.machine()
        raise KernelUnavailable(f"the {name} kernel needs {need}; this CPU ({cpu}) lacks it")
    gcc, version = _compiler()
    flags = _flags(name, gcc)
    sources = "".join((_HERE / f).read_text() for f in (*_HEADERS, f"{source(name)}.c"))
    key_text = f"{sources}{_COMMON}{flags}{version}{_cpu()}{_torch_gomp()}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    path = (cache_dir or _private_dir()) / f"{name}_{key}.so"
    stamp = Path(f"{path}.sha256")
    try:
        if not (path.exists() and stamp.exists() and stamp.read_text().strip() == _digest(path)):
            if path.exists():
                log.warning("cached %s kernel %s does not match its digest; rebuilding", name, path)
            _build(name, gcc, flags, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the {name} kernel could not be built or loaded: {exc}") from exc
    lib.sk_init.restype = SIGNATURES["sk_init"][0]
    if not lib.sk_init():
        raise KernelUnavailable(f"the operating system refused the {name} kernel's register state")
    return Kernel(name, lib, path)


# The selection, made by the first `kernel()` call (and again after `selected`): {"kernel": Kernel | None}.
_selection: dict[str, Kernel | None] = {}


def kernel(cache_dir: Path | None = None) -> Kernel | None:
    """The kernel `SPECSERVE_KERNEL` selects (None: torch's oneDNN and SDPA), chosen and logged once per process.

    The call that chooses builds (or finds) the library in `cache_dir` (None: a private temporary directory);
    later calls return the same kernel, whatever directory they name. `load_model` makes that first call with
    the directory its caller gives (`build_engine`: the model store's), before anything is packed.
    """
    if "kernel" not in _selection:
        _selection["kernel"] = _select(cache_dir)
    return _selection["kernel"]


def _select(cache_dir: Path | None) -> Kernel | None:
    choice = setting()
    if choice == "torch":
        log.info("CPU kernel: torch (oneDNN products, SDPA attention), as SPECSERVE_KERNEL asks")
        return None
    if choice != "auto":
        chosen = load(choice, cache_dir)
        log.info("CPU kernel: %s (SPECSERVE_KERNEL), %s", chosen.name, chosen.path)
        return chosen
    for name in available():
        try:
            chosen = load(name, cache_dir)
        except KernelUnavailable as exc:
            log.warning("CPU kernel %s unavailable: %s", name, exc)
            continue
        log.info("CPU kernel: %s (the best this CPU runs), %s", chosen.name, chosen.path)
        return chosen
    log.warning("no CPU kernel could be built; bfloat16 runs on oneDNN and SDPA, without row independence")
    return None


@contextmanager
def selected(choice: str) -> Iterator[None]:
    """Within: `kernel()` is what SPECSERVE_KERNEL=`choice` selects (models packed inside run on it)."""
    old = os.environ.get("SPECSERVE_KERNEL")
    os.environ["SPECSERVE_KERNEL"] = choice
    _selection.clear()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPECSERVE_KERNEL", None)
        else:
            os.environ["SPECSERVE_KERNEL"] = old
        _selection.clear()


def name() -> str:
    """The selected kernel's name, `torch` where none runs."""
    chosen = kernel()
    return "torch" if chosen is None else chosen.name
