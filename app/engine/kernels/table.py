"""The kernels, one record each: what detection, the build, selection, the loader and the tests know of a kernel.

Adding a kernel is adding its record to `SPECS` (and its C source, when it brings one): nothing else names a
kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# A kernel's architecture, as detect.arch names this machine's; `any`: plain C.
Arch = Literal["x86_64", "aarch64", "any"]


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: how it is built, what CPU runs it, and what it supports.

    `source`: the C file (without .c) it compiles; a VNNI build compiles its family's (dot4.h picks the instruction
    from the flags). `arch`: the architecture whose instructions it uses (`any`: plain C, any CPU gcc targets).
    `needs`: the /proc/cpuinfo flags it runs on, as its architecture names them (x86's "flags", aarch64's
    "Features": asimddp, i8mm, sve, ...; empty: any CPU of its architecture). `flags`: gcc's flags beyond the common
    ones; `march_native`: `-march=native` too where gcc takes it. `exact`: it computes the reference's bits (the
    fixed chains of common.h and quant.h), not merely values near them. `trees`: its attention takes tree parts (a
    parent per row). `head_multiple`: the head sizes its attention takes are multiples of this (at most 256).
    `layout` and `block`: how a bf16 weight is laid out for its products, `block` columns at a time (`stream`:
    [N/block, K, block/2, 2], common.h; `tiles`: [N/16, K/2, 16, 2], AMX's). `dot`: its library exports sk_dot_kind
    (its integer products take dot4.h's 4-byte dot products). `auto_native`: `--weights auto` keeps a GGUF's
    quantized blocks native on it. `stand_in`: a test-only build, loadable but never selected or listed among the
    kernels.
    """

    name: str
    source: str
    needs: frozenset[str]
    flags: tuple[str, ...]
    march_native: bool
    exact: bool
    trees: bool
    head_multiple: int
    layout: Literal["stream", "tiles"]
    block: int
    dot: bool
    auto_native: bool
    arch: Arch
    stand_in: bool = False


# -ffp-contract=off: the exact kernels' bits are defined by explicit fused multiply-adds only.
_AVX512 = ("-mavx512f", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off")
_AVX2 = ("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off")
_VNNI512 = (*_AVX512, "-mavx512vnni", "-mavx512vl", "-mavx512bw")
_VNNI512_NEEDS = frozenset({"avx512f", "avx512_vnni", "avx512vl", "avx512bw", "avx2", "fma", "f16c"})
_AMX_FLAGS = (
    "-mavx512f",
    "-mavx512bf16",
    "-mamx-tile",
    "-mamx-bf16",
    "-mamx-int8",
    "-mfma",
    "-mf16c",
    "-mavx512vnni",
    "-mavx512vl",
    "-mavx512bw",
)

# Best first: `auto` selects the first this CPU runs and gcc builds. amxint8 is avx512vnni with AMX-INT8 tiles
# for the integer products of many rows (a prefill, a verification, a batch), exact; a GGUF's quantized weights
# stay native on it: one row reads a third of bf16's bytes (the default target's step 3.3 ms against amx's 10.4
# ms in bf16, docs/bench). amx multiplies bf16 rows on AMX-BF16 tiles, so rows cost little there beside the
# first; its GGUF weights are dequantized under `auto` (it is the kernel for bf16 checkpoints, forced); so are
# generic's, whose plain-C integer products are three times slower than its bf16 ones. amx's tiles add in their
# own order and read keys by slot: neither exact nor trees.
_ALL = (
    KernelSpec(
        "amxint8",
        "avx512",
        _VNNI512_NEEDS | {"amx_tile", "amx_int8"},
        (*_VNNI512, "-mamx-tile", "-mamx-int8"),
        march_native=False,
        exact=True,
        trees=True,
        head_multiple=32,
        layout="stream",
        block=32,
        dot=True,
        auto_native=True,
        arch="x86_64",
    ),
    KernelSpec(
        "amx",
        "amx",
        _VNNI512_NEEDS - {"avx2", "fma", "f16c"} | {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"},
        _AMX_FLAGS,
        march_native=False,
        exact=False,
        trees=False,
        head_multiple=64,  # its value pass takes 64 dimensions at a time
        layout="tiles",
        block=16,
        dot=True,
        auto_native=False,
        arch="x86_64",
    ),
    KernelSpec(
        "avx512vnni",
        "avx512",
        _VNNI512_NEEDS,
        _VNNI512,
        march_native=False,
        exact=True,
        trees=True,
        head_multiple=32,
        layout="stream",
        block=32,
        dot=True,
        auto_native=True,
        arch="x86_64",
    ),
    KernelSpec(
        "avx512",
        "avx512",
        frozenset({"avx512f", "avx2", "fma", "f16c"}),
        _AVX512,
        march_native=False,
        exact=True,
        trees=True,
        head_multiple=32,
        layout="stream",
        block=32,
        dot=True,
        auto_native=True,
        arch="x86_64",
    ),
    KernelSpec(
        "avxvnni",
        "avx2",
        frozenset({"avx_vnni", "avx2", "fma", "f16c"}),
        (*_AVX2, "-mavxvnni"),
        march_native=False,
        exact=True,
        trees=True,
        head_multiple=32,
        layout="stream",
        block=16,
        dot=True,
        auto_native=True,
        arch="x86_64",
    ),
    KernelSpec(
        "avx2",
        "avx2",
        frozenset({"avx2", "fma", "f16c"}),
        _AVX2,
        march_native=False,
        exact=True,
        trees=True,
        head_multiple=32,
        layout="stream",
        block=16,
        dot=True,
        auto_native=True,
        arch="x86_64",
    ),
    KernelSpec(
        "generic",
        "generic",
        frozenset(),
        ("-ffp-contract=off",),
        march_native=True,  # lets gcc vectorise the plain loops; the bits stay IEEE's
        exact=True,
        trees=True,
        head_multiple=32,
        layout="stream",
        block=16,
        dot=False,  # plain C: no integer dot products
        auto_native=False,
        arch="any",
    ),
    # The avx2 source with dot4.h's exact plain-integer stand-in for VPDPBUSD, so that the code the VNNI kernels
    # run is checked bit for bit on a CPU without VNNI.
    KernelSpec(
        "vnni-twin",
        "avx2",
        frozenset({"avx2", "fma", "f16c"}),
        (*_AVX2, "-DSK_DOT_TWIN"),
        march_native=False,
        exact=True,
        trees=True,
        head_multiple=32,
        layout="stream",
        block=16,
        dot=True,
        auto_native=False,
        arch="x86_64",
        stand_in=True,
    ),
    # The avx512vnni source with quant_amx.h's plain-C stand-in for the AMX-INT8 tile instructions: amxint8's
    # code checked bit for bit on an AVX-512 CPU without AMX.
    KernelSpec(
        "amx-twin",
        "avx512",
        _VNNI512_NEEDS,
        (*_VNNI512, "-DSK_AMX_TWIN"),
        march_native=False,
        exact=True,
        trees=True,
        head_multiple=32,
        layout="stream",
        block=32,
        dot=True,
        auto_native=False,
        arch="x86_64",
        stand_in=True,
    ),
)

# Every record by name, best first (the stand-ins last).
SPECS: dict[str, KernelSpec] = {spec.name: spec for spec in _ALL}
# The kernels selection chooses from, best first.
KERNELS: tuple[str, ...] = tuple(spec.name for spec in _ALL if not spec.stand_in)
STAND_INS: tuple[str, ...] = tuple(spec.name for spec in _ALL if spec.stand_in)
# The kernel whose bits the exact ones reproduce: plain C, any CPU.
REFERENCE = "generic"
