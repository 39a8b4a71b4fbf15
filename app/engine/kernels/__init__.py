"""CPU kernels for the decoder's bfloat16 and integer products and cached attention, one C library per
instruction set.

Every kernel computes each output row as the same chain of operations whatever else the call holds: a row's
bits depend on nothing but its own inputs (not the row count, the other sequences of a batch, the thread count
or the cache's capacity). Batched decoding then equals decoding alone, and a verification of k+1 rows gives
the bits of k+1 single steps, without padding or a fixed key span.

The kernels, best first, one record each in `table.SPECS`: ``amxint8`` (avx512vnni with the integer products
of many rows on AMX-INT8 tiles), ``amx`` (bf16 products and attention on AMX tiles), ``avx512vnni`` and
``avx512`` (AVX-512F, with and without VPDPBUSD), ``avxvnni`` and ``avx2`` (AVX2 + FMA, with and without
AVX-VNNI), ``generic`` (plain C, any gcc target). All but amx are exact: they compute the generic kernel's bits
(the arithmetic is fixed in ``common.h`` and ``quant.h``); ``amx`` sums its bf16 products in its tiles' order.
The sources (``*.c`` beside this file; the VNNI builds compile their family's) are compiled with the system's
gcc at first use (`build`) into the directory the caller gives (`build_engine`: ``kernels/`` in the model store's cache
directory; none given: a private temporary directory, removed when the process exits). ``SPECSERVE_KERNEL``
picks one: ``auto`` (default: the best this CPU runs and gcc builds), a kernel's name (an error where it cannot
run), or ``torch`` (oneDNN and SDPA; rows are not independent there, see `Engine`).

Modules: `table` (the records), `detect` (the CPU's architecture and flags), `build` (gcc and the build cache),
`abi` (the C functions' ctypes signatures), `library` (a loaded kernel and its products), `quantized` (GGUF
blocks); this one selects.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.engine.kernels import build, detect
from app.engine.kernels.abi import SIGNATURES
from app.engine.kernels.build import KernelUnavailable
from app.engine.kernels.detect import bf16_arithmetic
from app.engine.kernels.library import (
    DraftChain,
    Kernel,
    KernelLinear,
    LayerStack,
    QuantLinear,
    StackLayer,
    attention_fits,
    fits,
)
from app.engine.kernels.table import KERNELS, SPECS, STAND_INS, KernelSpec

__all__ = [
    "CHOICES",
    "KERNELS",
    "SIGNATURES",
    "SPECS",
    "STAND_INS",
    "DraftChain",
    "Kernel",
    "KernelLinear",
    "KernelSpec",
    "KernelUnavailable",
    "LayerStack",
    "QuantLinear",
    "StackLayer",
    "attention_fits",
    "available",
    "bf16_arithmetic",
    "fits",
    "kernel",
    "load",
    "name",
    "runs_here",
    "selected",
    "setting",
]

log = logging.getLogger(__name__)

CHOICES = ("auto", *KERNELS, "torch")


def setting() -> str:
    """The `SPECSERVE_KERNEL` choice (validated)."""
    choice = os.environ.get("SPECSERVE_KERNEL", "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"SPECSERVE_KERNEL={choice!r}: choose one of {', '.join(CHOICES)}")
    return choice


def runs_here(name: str) -> bool:
    """Whether this CPU has the instructions kernel `name` needs (the compiler is checked by `load`)."""
    return detect.runs(SPECS[name])


def available() -> list[str]:
    """The kernels this CPU can run, best first (whether gcc builds them is found out by `load`)."""
    return [name for name in KERNELS if runs_here(name)]


@functools.cache
def load(name: str, cache_dir: Path | None = None) -> Kernel:
    """Kernel `name` (one of `KERNELS` or `STAND_INS`), built at first use into `cache_dir` (None: a private
    temporary directory) and kept there, loaded once per directory; raises KernelUnavailable where it cannot run
    here."""
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown kernel {name!r}; kernels: {', '.join(KERNELS)}")
    if not detect.runs(spec):
        raise KernelUnavailable(detect.lacks(spec))
    try:
        path = build.library(spec, cache_dir)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the {name} kernel could not be built or loaded: {exc}") from exc
    lib.sk_init.restype = SIGNATURES["sk_init"][0]
    if not lib.sk_init():
        raise KernelUnavailable(f"the operating system refused the {name} kernel's register state")
    return Kernel(spec, lib, path)


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
