"""OpenVINO GenAI as an anchor of `specserve bench --against openvino`.

It is installed once into a virtual environment of its own in the model store's cache (app.bench.anchor_env):
`openvino-genai`, and `optimum-intel` to export the target's Hugging Face checkpoint (converted from its GGUF)
to OpenVINO's format, as int4 (group size 64: the default 128 does not divide the default target's 576-wide
layers) and as fp16. OpenVINO GenAI has no OpenAI server of its own, so each is served by our small one,
app/bench/openvino_chat.py, run in that venv: its rows measure OpenVINO's decoding behind our HTTP layer.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from app.bench import anchor_env
from app.bench.against import Contender, unavailable

VERSION = "2026.4.1"
OPTIMUM_INTEL_VERSION = "2.2.0"

# Weight formats exported, each with optimum-cli's flags for it.
FORMATS: dict[str, tuple[str, ...]] = {
    "int4": ("--weight-format", "int4", "--group-size", "64"),
    "fp16": ("--weight-format", "fp16"),
}

# The rows: a name, the weight format, and whether prompt lookup decoding is on.
CONFIGS: tuple[tuple[str, str, bool], ...] = (
    ("openvino/int4", "int4", False),
    ("openvino/fp16", "fp16", False),
    ("openvino/fp16-prompt-lookup", "fp16", True),
)

CHAT_SERVER = Path(__file__).with_name("openvino_chat.py")


def home(cache: Path, version: str = VERSION) -> Path:
    """The venv of `version`'s OpenVINO GenAI in the model store's cache `cache`."""
    return anchor_env.anchors_dir(cache) / f"openvino-{version}"


def install_steps(version: str = VERSION, torch_version: str | None = None) -> list[list[str]]:
    """The commands that fill a new venv with OpenVINO GenAI, the exporter and the chat server's web stack
    ("python": the venv's); `torch_version` pins the exporter's torch (default: this process's, a CPU build
    where ours is one, rather than whatever pip picks)."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__.split("+")[0]
    return [
        [
            "python",
            "-m",
            "pip",
            "install",
            f"torch=={torch_version}",
            f"openvino-genai=={version}",
            f"optimum-intel[openvino]=={OPTIMUM_INTEL_VERSION}",
            "fastapi",
            "uvicorn",
        ],
        ["python", "-c", "import openvino_genai, optimum.intel, fastapi, uvicorn"],
    ]


def ensure_installed(cache: Path, say: Callable[[str], None] = print) -> Path:
    """OpenVINO GenAI's venv Python, installed first where it is not; RuntimeError saying what failed."""
    return anchor_env.ensure_venv(home(cache), install_steps(), say)


def export_command(python: Path, checkpoint: Path, fmt: str, out: Path) -> list[str]:
    """optimum-cli exporting the Hugging Face `checkpoint` to OpenVINO in weight format `fmt` (a FORMATS key),
    its tokenizer beside, into `out`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose {', '.join(FORMATS)}")
    cli = ["-m", "optimum.commands.optimum_cli", "export", "openvino"]
    return [
        str(python),
        *cli,
        "--model",
        str(checkpoint),
        "--task",
        "text-generation-with-past",
        *FORMATS[fmt],
        str(out),
    ]


def ensure_exported(python: Path, cache: Path, checkpoint: Path, fmt: str, say: Callable[[str], None] = print) -> Path:
    """The checkpoint exported in `fmt`, once, under the venv's models/ (the export's output in NAME.log beside);
    RuntimeError saying what failed."""
    out = home(cache) / "models" / f"{checkpoint.name}-{fmt}"
    if (out / "openvino_model.xml").is_file() and (out / "openvino_tokenizer.xml").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"exporting {checkpoint.name} to OpenVINO {fmt} in {out} (once)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staged = Path(tmp) / "model"
        anchor_env.run_step(export_command(python, checkpoint, fmt, staged), out.with_name(out.name + ".log"))
        if not (staged / "openvino_tokenizer.xml").is_file():
            raise RuntimeError(
                f"optimum-cli wrote no openvino_tokenizer.xml (openvino-tokenizers missing?) in {staged}"
            )
        if out.exists():
            shutil.rmtree(out)  # a partial export, without its tokenizer
        staged.rename(out)
    return out


def server_command(python: Path, model: Path, port: int, threads: int, prompt_lookup: bool = False) -> list[str]:
    """Our OpenAI chat server over OpenVINO GenAI for the exported `model` on 127.0.0.1:`port`."""
    command = [str(python), str(CHAT_SERVER), "--model", str(model), "--port", str(port), "--threads", str(threads)]
    return [*command, "--prompt-lookup"] if prompt_lookup else command


def environment(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the chat server runs in: `base` (default this process's) with `threads` OpenMP threads."""
    env = dict(os.environ if base is None else base)
    env.pop("VIRTUAL_ENV", None)
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def contenders(
    cache: Path, gguf: Path, threads: int, say: Callable[[str], None] = print
) -> tuple[list[Contender], list[str]]:
    """OpenVINO GenAI's configurations for --against (CONFIGS, "openvino/int4" first) on `gguf` converted and
    exported, `threads` threads, each a Contender, or where it cannot run one that says why; and notes for the
    table's meta."""
    try:
        python = ensure_installed(cache, say)
        checkpoint = anchor_env.hf_checkpoint(cache, gguf, say)
    except (RuntimeError, ValueError, OSError) as exc:
        return [unavailable(name, f"OpenVINO GenAI {VERSION}: {exc}") for name, _, _ in CONFIGS], []
    env = environment(threads)
    models: dict[str, Path | str] = {}
    for fmt in dict.fromkeys(fmt for _, fmt, _ in CONFIGS):
        try:
            models[fmt] = ensure_exported(python, cache, checkpoint, fmt, say)
        except (RuntimeError, OSError) as exc:
            models[fmt] = f"exporting {fmt} failed: {exc}"
    rows = []
    for name, fmt, lookup in CONFIGS:
        model = models[fmt]
        if isinstance(model, str):
            rows.append(unavailable(name, model))
        else:
            rows.append(Contender(name, functools.partial(_command, python, model, threads, lookup), env))
    notes = ["the HTTP layer is specserve's (app/bench/openvino_chat.py): OpenVINO GenAI has no OpenAI server"]
    return rows, notes


def _command(python: Path, model: Path, threads: int, lookup: bool, port: int, clients: int) -> list[str]:
    return server_command(python, model, port, threads, lookup)
