"""Kernels and CPU architectures (issue 69, item 6): each kernel's record names its architecture, detection reads
an aarch64 CPU's features as well as x86's flags and runs a kernel only on its own architecture, and the generic
kernel builds and runs on a non-x86 target: cross-compiled with Debian's gcc-aarch64-linux-gnu at the build's
optimisation level and run under qemu-aarch64, it gives the bits it gives on this CPU.

Under CI (.ci/run installs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user) a missing tool fails the
test; elsewhere it is skipped with the command that installs it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from app.engine import kernels
from app.engine.kernels import build, detect

DATA = Path(__file__).parent / "data"
# /proc/cpuinfo of a Neoverse V1 (AWS Graviton3), its first two processors: "Features", no "flags", no model name.
NEOVERSE_V1 = DATA / "cpuinfo_neoverse_v1.txt"
X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_vnni avx512vl avx512bw
"""
SYSROOT = Path("/usr/aarch64-linux-gnu")
EM_AARCH64 = 183  # an ELF file's e_machine for aarch64


def test_detection_reads_an_arm_cpus_features() -> None:
    """An aarch64 /proc/cpuinfo lists its extensions under "Features" (dot products: asimddp, int8 matrices: i8mm,
    sve, bf16) and names its core by "CPU part"; x86's lists "flags" and "model name"."""
    model, flags = detect.parse_cpuinfo(NEOVERSE_V1.read_text())
    assert model == "0xd40"
    assert {"asimd", "asimddp", "i8mm", "sve", "bf16"} <= flags and "avx2" not in flags
    model, flags = detect.parse_cpuinfo(X86_CPUINFO)
    assert model == "Intel(R) Xeon(R) Platinum 8488C" and {"avx2", "fma", "avx512_vnni"} <= flags
    assert detect.parse_cpuinfo("") == ("", frozenset())
    assert detect.arch("aarch64") == detect.arch("arm64") == "aarch64"
    assert detect.arch("x86_64") == detect.arch("AMD64") == "x86_64"


def test_a_kernel_runs_only_on_its_own_architecture() -> None:
    """A flag's name means nothing outside its architecture: no x86 kernel runs on ARM even where its Features
    spelled every x86 flag, and an aarch64 kernel runs on ARM with the features it needs, never on x86."""
    _, arm = detect.parse_cpuinfo(NEOVERSE_V1.read_text())
    every_x86_flag = frozenset().union(*(spec.needs for spec in kernels.SPECS.values()))
    on_arm = [name for name, spec in kernels.SPECS.items() if detect.supports(spec, "aarch64", arm | every_x86_flag)]
    assert on_arm == ["generic"]
    on_x86 = [name for name, spec in kernels.SPECS.items() if detect.supports(spec, "x86_64", every_x86_flag)]
    assert on_x86 == list(kernels.SPECS)
    dot = dataclasses.replace(kernels.SPECS["generic"], name="neon-dot", arch="aarch64", needs=frozenset({"asimddp"}))
    assert detect.supports(dot, "aarch64", arm)
    assert not detect.supports(dot, "aarch64", arm - {"asimddp"})
    assert not detect.supports(dot, "x86_64", arm)


def test_an_arm_cpu_is_offered_the_generic_kernel_and_told_why_not_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process seen as an ARM one (its architecture and /proc/cpuinfo): selection offers the generic kernel
    alone, and forcing an x86 one says which architecture it needs."""
    monkeypatch.setattr(detect, "ARCH", "aarch64")
    monkeypatch.setattr(detect, "cpu", lambda: detect.parse_cpuinfo(NEOVERSE_V1.read_text()))
    assert kernels.available() == ["generic"]
    assert detect.lacks(kernels.SPECS["avx2"]) == "the avx2 kernel needs an x86_64 CPU; this CPU (0xd40) lacks it"
    assert not detect.bf16_arithmetic()


def test_x86_sources_are_x86_kernels() -> None:
    """A kernel whose source includes x86 intrinsics is an x86_64 kernel; one that names no architecture ("any")
    is plain C (the generic kernel, cross-built below)."""
    for spec in kernels.SPECS.values():
        source = (build.HERE / f"{spec.source}.c").read_text()
        assert spec.arch in ("x86_64", "aarch64", "any"), spec.name
        if "immintrin.h" in source:
            assert spec.arch == "x86_64", spec.name
    assert kernels.SPECS["generic"].arch == "any"


def _tool(name: str, *packages: str, also: Path | None = None) -> str:
    """The path of program `name` (and the file `also` beside it), from Debian's `packages`: a failure under CI, where
    .ci/run installs them; elsewhere a skip that says how to install them."""
    path = shutil.which(name)
    if path is None or (also is not None and not also.exists()):
        missing = name if path is None else str(also)
        if os.environ.get("CI"):
            pytest.fail(f"{missing} is missing in CI (Debian packages {' '.join(packages)}, which .ci/run installs)")
        pytest.skip(f"{missing} not installed (apt-get install --no-install-recommends {' '.join(packages)})")
    return path


# The generic kernel's products and attention on fixed inputs: a product whose value is known (exit 1 where it is
# not), then the bits of a pseudo-random product, of the same with SwiGLU first (sk_exp's polynomial) and of an
# attention call, two threads each, printed to compare with another build's.
_DRIVER = r"""
#include <stdio.h>
#include "common.h"

enum { M = 3, K = 64, N = 32, D = 32, T = 3, CAP = 8 };

static uint32_t seed = 1;

static uint16_t next_bf16(void) {
    seed = seed * 1664525u + 1013904223u;
    return sk_f32_to_bf16((float)((int)(seed >> 16) % 2001 - 1000) / 512.0f);
}

/* w [N][K] -> the generic kernel's layout [N/16][K][8 pairs][2], pair i holding columns i and 8 + i. */
static void pack(const uint16_t *w, uint16_t *out) {
    for (int c = 0; c < N; c++)
        for (int kk = 0; kk < K; kk++) out[((c / 16) * K + kk) * 16 + (c % 8) * 2 + (c % 16) / 8] = w[c * K + kk];
}

static void print(const uint16_t *y, int count) {
    for (int i = 0; i < count; i++) printf("%04x%c", y[i], i + 1 < count ? ' ' : '\n');
}

int main(void) {
    static uint16_t w[N * K], packed[N * K], x[M * 2 * K], y[M * N], scratch[M * K];
    for (int c = 0; c < N; c++)
        for (int kk = 0; kk < K; kk++) w[c * K + kk] = sk_f32_to_bf16((float)(c + 1));
    for (int i = 0; i < M * K; i++) x[i] = sk_f32_to_bf16(1.0f);
    pack(w, packed);
    sk_linear(packed, x, y, NULL, M, K, N, 2, 0, NULL, 0.0f, NULL, scratch);
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++)
            if (sk_bf16_to_f32(y[r * N + c]) != (float)(K * (c + 1))) {
                fprintf(stderr, "y[%d][%d] = %g, not %d\n", r, c, sk_bf16_to_f32(y[r * N + c]), K * (c + 1));
                return 1;
            }
    for (int i = 0; i < N * K; i++) w[i] = next_bf16();
    for (int i = 0; i < M * 2 * K; i++) x[i] = next_bf16();
    pack(w, packed);
    sk_linear(packed, x, y, NULL, M, K, N, 2, 0, NULL, 0.0f, NULL, scratch);
    print(y, M * N);
    sk_linear(packed, x, y, NULL, M, K, N, 2, 2, NULL, 0.0f, NULL, scratch);
    print(y, M * N);
    /* Two query heads on one kv head of D dimensions, T rows from position 0. */
    static uint16_t q[T * 2 * D], k[T * D], v[T * D], kc[CAP * D], vc[CAP * D], out[T * 2 * D];
    for (int i = 0; i < T * 2 * D; i++) q[i] = next_bf16();
    for (int i = 0; i < T * D; i++) k[i] = next_bf16(), v[i] = next_bf16();
    part_t part = {q, k, v, kc, vc, out, CAP, T, 0, NULL};
    sk_attention(&part, 1, 2 * D, D, D, 2, 1, D, 0.17677669f, 2);
    print(out, T * 2 * D);
    return 0;
}
"""


def _build(gcc: str, driver: Path, exe: Path) -> subprocess.Popen[str]:
    """The driver linked with generic.c as the build compiles it (its -O3, its flags as this gcc takes them)."""
    spec = kernels.SPECS["generic"]
    common = [flag for flag in build.COMMON if flag != "-shared"]
    cmd = [gcc, *common, *build.flags(spec, gcc), f"-I{build.HERE}", str(driver), str(build.HERE / "generic.c")]
    return subprocess.Popen([*cmd, "-o", str(exe), "-lm", "-Wall", "-Werror"], stderr=subprocess.PIPE, text=True)


def test_the_generic_kernel_builds_for_aarch64_and_gives_this_cpus_bits(tmp_path: Path) -> None:
    """Cross-compiled for aarch64 (no x86 header reaches it), run under qemu: the known product is right, and the
    products' and attention's bits are those of the same driver built for this CPU."""
    cross = _tool(
        "aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", also=SYSROOT / "include" / "stdio.h"
    )
    gcc = shutil.which("gcc")
    assert gcc is not None, "the kernels need gcc"
    driver = tmp_path / "driver.c"
    driver.write_text(_DRIVER)
    builds = {"arm": _build(cross, driver, tmp_path / "arm"), "here": _build(gcc, driver, tmp_path / "here")}
    for name, proc in builds.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name}: {err}"
    assert int.from_bytes((tmp_path / "arm").read_bytes()[18:20], "little") == EM_AARCH64
    qemu = _tool("qemu-aarch64", "qemu-user")
    here = subprocess.run([tmp_path / "here"], capture_output=True, text=True, timeout=60)
    assert here.returncode == 0, here.stderr
    arm = subprocess.run([qemu, "-L", str(SYSROOT), tmp_path / "arm"], capture_output=True, text=True, timeout=60)
    assert arm.returncode == 0, arm.stderr
    assert len(here.stdout.splitlines()) == 3 and arm.stdout == here.stdout
