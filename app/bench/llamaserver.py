"""llama.cpp's own HTTP server, `llama-server`, as an anchor of `specserve bench --against llama-server`.

It is built once, on the user's machine, from the llama.cpp tree that the `llama-cpp-python` sdist vendors (the
release the bench's llama-cpp-python baseline builds too), into the model store's cache; nothing of it is a
dependency of specserve. `server_command` is the command line that serves a GGUF with it, plain or with one of its
model-free speculative modes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

# The llama-cpp-python release whose vendored llama.cpp is built.
VERSION = "0.3.36"

# llama-server's model-free speculative modes, each with the settings that the vendored tree's speculative decoding
# doc suggests for it; `plain` decodes without speculation.
SPEC_MODES: dict[str, tuple[str, ...]] = {
    "plain": (),
    "ngram-simple": ("--spec-type", "ngram-simple", "--spec-draft-n-max", "64"),
    "ngram-mod": (
        "--spec-type",
        "ngram-mod",
        "--spec-ngram-mod-n-match",
        "24",
        "--spec-ngram-mod-n-min",
        "48",
        "--spec-ngram-mod-n-max",
        "64",
    ),
}

# Each slot's share of llama-server's context (`-c` is split evenly between its `-np` slots): the most that one
# request's prompt and answer take.
SLOT_CONTEXT = 4096
MIN_CONTEXT = 8192

# /proc/cpuinfo flags -> the ggml option that builds for them, where -march=native cannot be used (below).
_X86_OPTIONS = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def root(cache: Path, version: str = VERSION) -> Path:
    """Where `version`'s llama.cpp lives in the model store's cache `cache`: source/ (the sdist unpacked),
    build/ (cmake's), build.log."""
    return cache / "llama.cpp" / version


def binary(cache: Path, version: str = VERSION) -> Path:
    """The built `llama-server` (which may not exist yet)."""
    return root(cache, version) / "build" / "bin" / "llama-server"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's feature flags as /proc/cpuinfo spells them; empty where there is no such file."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_options(flags: set[str]) -> list[str]:
    """cmake's -D options for this CPU (`flags`: `cpu_flags`).

    -march=native (GGML_NATIVE) everywhere but on a CPU with AMX-INT8: there -march=native defines __AMX_INT8__,
    which turns on ggml's AMX matrix path (it crashes on Q4_1 weights, the default target's), and GGML_AMX_INT8=OFF
    does not undo that beside GGML_NATIVE=ON. So on such a CPU every other instruction set it has is named, and
    the AMX ones are off."""
    options = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]
    if "amx_int8" not in flags:
        return [*options, "-DGGML_NATIVE=ON"]
    options.append("-DGGML_NATIVE=OFF")
    options += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in _X86_OPTIONS.items()]
    return [*options, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def ensure_built(cache: Path, jobs: int = 2, version: str = VERSION, say: Callable[[str], None] = print) -> Path:
    """The `llama-server` binary, built first if it is not in the cache: the sdist downloaded by pip and
    unpacked (once), configured by `cmake_options` and built with `jobs` compilers (output in build.log).
    Raises RuntimeError saying what failed."""
    exe = binary(cache, version)
    if exe.is_file():
        return exe
    home = root(cache, version)
    source = home / "source"
    if not (source / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        _unpack_sdist(home, version, say)
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake (apt-get install cmake, or pip install cmake)")
    log = home / "build.log"
    say(f"building llama-server {version} into {home} (once; several minutes, output in {log})")
    steps = [
        ["cmake", "-S", str(source / "vendor" / "llama.cpp"), "-B", str(home / "build"), *cmake_options(cpu_flags())],
        ["cmake", "--build", str(home / "build"), "--target", "llama-server", f"-j{jobs}"],
    ]
    with log.open("w") as out:
        for step in steps:
            out.write("$ " + " ".join(step) + "\n")
            out.flush()
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"building llama-server failed: {' '.join(step[:3])} ...; see {log}")
    if not exe.is_file():
        raise RuntimeError(f"the build finished without {exe}; see {log}")
    return exe


def _unpack_sdist(home: Path, version: str, say: Callable[[str], None]) -> None:
    """llama-cpp-python's sdist, by pip, unpacked into home/source (whole or not at all)."""
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        say(f"downloading the llama-cpp-python {version} sdist (llama.cpp's sources)")
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        done = subprocess.run([*pip, f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True)
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise RuntimeError(f"pip could not download the llama-cpp-python {version} sdist: {done.stderr[-500:]}")
        with tarfile.open(archives[0]) as archive:
            # The data filter (no links out, no devices) where this Python has it (3.10.12, 3.11.4 and later).
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(tmp, **safe)
        (unpacked,) = (p for p in Path(tmp).iterdir() if p.is_dir())
        unpacked.rename(home / "source")


def server_command(exe: Path, gguf: Path, port: int, threads: int, clients: int = 1, mode: str = "plain") -> list[str]:
    """llama-server serving `gguf` on 127.0.0.1:`port` with `threads` threads (prompt and generation alike),
    `clients` slots of SLOT_CONTEXT tokens each (at least MIN_CONTEXT in all), speculating as `mode`
    (a SPEC_MODES key) says."""
    if mode not in SPEC_MODES:
        raise ValueError(f"unknown llama-server mode {mode!r}; choose {', '.join(SPEC_MODES)}")
    context = max(MIN_CONTEXT, SLOT_CONTEXT * clients)
    return [
        str(exe),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(context),
        "-np",
        str(clients),
        *SPEC_MODES[mode],
    ]
