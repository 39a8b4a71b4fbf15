"""What this CPU offers the kernels: its architecture, model name and instruction-set flags, as /proc/cpuinfo
names them (x86's "flags", aarch64's "Features")."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from app.engine.kernels.table import KernelSpec

# platform.machine()'s spellings of the architectures a kernel names (table.Arch).
_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def arch(machine: str) -> str:
    """`machine` (platform.machine()'s text) as a kernel's `arch` names it: x86_64, aarch64, or as it is (lower
    case) for an architecture no kernel is written for."""
    return _ARCHES.get(machine.lower(), machine.lower())


ARCH = arch(platform.machine())


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) from the text of /proc/cpuinfo: x86's "model name" and "flags", aarch64's "Features"
    (asimd, asimddp, i8mm, sve, bf16, ...) and, where it gives no model name, its "CPU part"; the first
    processor's, empty where a field is missing."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "cpu part") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model, flags


@functools.cache
def cpu() -> tuple[str, frozenset[str]]:
    """(model name, flags) of this CPU from /proc/cpuinfo (`parse_cpuinfo`); no flags where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor(), frozenset()
    return parse_cpuinfo(text)


def supports(spec: KernelSpec, arch: str, flags: frozenset[str]) -> bool:
    """Whether a CPU of architecture `arch` with `flags` has the instructions `spec` needs: its architecture
    (the same flag name means different things on x86 and ARM) and then its flags."""
    return spec.arch in ("any", arch) and spec.needs <= flags


def runs(spec: KernelSpec) -> bool:
    """Whether this CPU has the instructions `spec` needs (whether gcc builds it is found out by building)."""
    return supports(spec, ARCH, cpu()[1])


def lacks(spec: KernelSpec) -> str:
    """Why this CPU cannot run `spec`, in one line."""
    need = " ".join(sorted(spec.needs)) if spec.arch in ("any", ARCH) else f"an {spec.arch} CPU"
    return f"the {spec.name} kernel needs {need}; this CPU ({cpu()[0] or platform.machine()}) lacks it"


def bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX): elsewhere torch's bf16 matrix
    products are emulated, several times slower than float32 ones."""
    return ARCH == "x86_64" and bool({"avx512_bf16", "amx_bf16"} & cpu()[1])
