"""What this CPU offers the kernels: its model name and instruction-set flags, as /proc/cpuinfo names them."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from app.engine.kernels.table import KernelSpec

X86 = platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu() -> tuple[str, frozenset[str]]:
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


def runs(spec: KernelSpec) -> bool:
    """Whether this CPU has the instructions `spec` needs (whether gcc builds it is found out by building)."""
    if not spec.needs:
        return True
    # cpuinfo flag names are x86's only where the CPU is one (an ARM core may list a same-named feature).
    return X86 and spec.needs <= cpu()[1]


def lacks(spec: KernelSpec) -> str:
    """Why this CPU cannot run `spec`, in one line."""
    need = " ".join(sorted(spec.needs)) if X86 else "an x86-64 CPU"
    return f"the {spec.name} kernel needs {need}; this CPU ({cpu()[0] or platform.machine()}) lacks it"


def bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX): elsewhere torch's bf16 matrix
    products are emulated, several times slower than float32 ones."""
    return X86 and bool({"avx512_bf16", "amx_bf16"} & cpu()[1])
