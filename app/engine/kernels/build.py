"""Building a kernel's library with the system's gcc, cached by everything that decides its bits.

A library is built at first use into the directory the caller gives (none: a private temporary directory,
removed when the process exits), named by a key over its sources, flags, compiler, CPU and OpenMP runtime, and
written beside a digest that is checked before it is loaded.

Trust: loading a library runs its code in this process, and a digest beside it vouches for nothing against
whoever can write both. So a cached library is loaded only from a directory that this user owns and that neither
its group nor others may write, and only when the library and its digest are this user's and not writable by
others either: then whoever could have put it there could run as this user already. A cache directory that fails
the test (a shared volume writable by a group, another user's directory) is not used: the library is built into
the private directory instead, with a warning. The digest only catches a library cut short (a crash, a full
disk).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from app.engine.kernels import detect
from app.engine.kernels.table import KernelSpec

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# What every kernel's source includes (part of the build key).
HEADERS = (
    "common.h",
    "attention.h",
    "quant.h",
    "quant_avx2.h",
    "quant_avx512.h",
    "quant_tile.h",
    "quant_amx.h",
    "dot4.h",
    "layers.h",
    "lanes.h",
)


class KernelUnavailable(RuntimeError):
    """A kernel that was asked for cannot run here (CPU, compiler or operating system)."""


def torch_gomp() -> Path | None:
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


def compiler() -> tuple[str, str]:
    """(gcc's path, its version line); raises KernelUnavailable where there is none."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise KernelUnavailable("no C compiler (gcc) on PATH")
    version = subprocess.run([gcc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    return gcc, version


def flags(spec: KernelSpec, gcc: str) -> list[str]:
    """gcc's flags for `spec` beyond `COMMON`, as this gcc takes them."""
    out = list(spec.flags)
    if spec.march_native and _accepts(gcc, "-march=native"):
        out.append("-march=native")
    return out


@functools.cache
def _accepts(gcc: str, flag: str) -> bool:
    cmd = [gcc, flag, "-x", "c", "-E", "-", "-o", os.devnull]
    done = subprocess.run(cmd, input="", capture_output=True, timeout=30)
    return done.returncode == 0


def digest(path: Path) -> str:
    """The sha256 a built library is checked against before it is loaded."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def private_dir() -> Path:
    """Where kernels are built when the caller names no directory: this process's own, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="specserve-kernels-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def library(spec: KernelSpec, cache_dir: Path | None) -> Path:
    """The path of `spec`'s library in `cache_dir` (None: `private_dir`), built there unless a whole one is.

    Raises KernelUnavailable without a compiler or where gcc fails; OSError or SubprocessError where the
    directory or gcc cannot be used."""
    gcc, version = compiler()
    these = flags(spec, gcc)
    sources = "".join((HERE / f).read_text() for f in (*HEADERS, f"{spec.source}.c"))
    model, cpu_flags = detect.cpu()
    # The flags sorted: a frozenset's text follows string hashing, which differs from process to process, and with
    # it the key, so that no process ever found another's build.
    key_text = f"{sources}{COMMON}{these}{version}{model}{sorted(cpu_flags)}{torch_gomp()}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    directory = cache_dir
    if cache_dir is not None:
        cache_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        why = _writable_by_others(cache_dir)
        if why is not None:
            directory = None
            log.warning(
                "kernel cache %s %s: building the %s kernel into %s instead", cache_dir, why, spec.name, private_dir()
            )
    path = (directory or private_dir()) / f"{spec.name}_{key}.so"
    stamp = Path(f"{path}.sha256")
    if path.exists() and stamp.exists():
        why = _writable_by_others(path) or _writable_by_others(stamp)
        if why is not None:
            log.warning("cached %s kernel %s %s; rebuilding", spec.name, path, why)
        elif stamp.read_text().strip() == digest(path):
            return path
        else:
            log.warning("cached %s kernel %s does not match its digest; rebuilding", spec.name, path)
    _build(spec, gcc, these, path)
    return path


def _writable_by_others(path: Path) -> str | None:
    """Why someone other than this user may have written `path` (another user owns it, or its group or everyone
    may write it), as a warning says it; None when only this user (and root, who may write anything) can have."""
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not this process's {os.getuid()}"
    if st.st_mode & 0o022:
        return f"is writable by its group or by others (mode {st.st_mode & 0o777:o})"
    return None


def _build(spec: KernelSpec, gcc: str, these: list[str], target: Path) -> None:
    gomp = torch_gomp()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        # Link the libgomp torch loaded, by path: one OpenMP runtime, one pool of threads.
        openmp = [str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp is not None else ["-lgomp"]
        cmd = [gcc, *COMMON, *these, f"-I{HERE}", str(HERE / f"{spec.source}.c"), "-o", str(out), *openmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KernelUnavailable(f"gcc failed to build the {spec.name} kernel: {done.stderr.strip()[:500]}")
        Path(f"{out}.sha256").write_text(digest(out))
        # Whatever the umask: a library others may write would not be trusted (`_writable_by_others`).
        os.chmod(out, 0o755)
        os.chmod(f"{out}.sha256", 0o644)
        # Library first, digest second, each atomically: a reader sees a digest only beside its whole library.
        os.replace(out, target)
        os.replace(f"{out}.sha256", f"{target}.sha256")
