"""The integer products' rate against this CPU's roofline: tools/roofline.c (each instruction family's multiply-add
peak, chains the compiler cannot merge) and tools/tile_rate.c (each format's sk_qlinear on one thread, weights in
the core's cache) for each kernel named (default: every exact SIMD kernel that runs here), as a table: G MAC/s,
and how many times its multiply-adds at the peak of the family the kernel's tiles use a row costs.

Run: .venv/bin/python tools/measure_tiles.py [KERNEL ...]
"""

import subprocess
import sys
import tempfile
from pathlib import Path

from app.engine import kernels
from app.engine.kernels import build
from app.engine.kernels.table import REFERENCE

HERE = Path(__file__).parent
# The family each kernel's integer tiles run on (its roofline line's name, up to the width).
FAMILY = {
    "amxint8": "int8 vpdpbusd, 512-bit",
    "avx512vnni": "int8 vpdpbusd, 512-bit",
    "amx": "int8 vpdpbusd, 512-bit",
    "avxvnni": "int8 vpdpbusd, 256-bit (AVX-VNNI)",
    "avx512": "int8 maddubs+madd",
    "avx2": "int8 maddubs+madd",
}


def _compile(tmp: Path, name: str, *extra: str) -> Path:
    gcc, _ = build.compiler()
    out = tmp / name
    subprocess.run([gcc, "-O2", "-fopenmp", str(HERE / f"{name}.c"), "-o", str(out), *extra], check=True)
    return out


def main() -> None:
    """What the docstring says, when run as a script."""
    names = sys.argv[1:] or [n for n in kernels.available() if kernels.SPECS[n].exact and n != REFERENCE]
    with tempfile.TemporaryDirectory() as tmp:
        roofline = subprocess.run([_compile(Path(tmp), "roofline")], capture_output=True, text=True, check=True).stdout
        print(roofline)
        peaks = {}
        for line in roofline.splitlines():
            if " 1 thread(s):" in line:
                family, rate = line.split(" 1 thread(s):")
                peaks[family.strip()] = float(rate.split()[0])
        rate = _compile(Path(tmp), "tile_rate", "-ldl")
        for name in names:
            lib = kernels.load(name).path
            done = subprocess.run([rate, lib], capture_output=True, text=True, check=True)
            rows = [line.split() for line in done.stdout.splitlines()]
            peak = next((v for f, v in peaks.items() if name in FAMILY and f.startswith(FAMILY[name])), None)
            counts = sorted({int(r[1]) for r in rows})
            against = f" (x: a row's cost in its MACs at {peak:.0f}, {FAMILY[name]})" if peak else ""
            print(f"{name}: G MAC/s on 1 thread{against}")
            print("| format | " + " | ".join(f"{c} rows" for c in counts) + " |")
            print("|---|" + "---:|" * len(counts))
            for fmt in dict.fromkeys(r[0] for r in rows):
                cells = [float(r[3]) for r in rows if r[0] == fmt]
                shown = [f"{g:.0f}" + (f" ({peak / g:.2f}x)" if peak else "") for g in cells]
                print(f"| {fmt} | " + " | ".join(shown) + " |")
            print()


if __name__ == "__main__":
    main()
