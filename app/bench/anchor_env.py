"""What the Python anchors of `specserve bench --against` (vLLM's CPU build, OpenVINO GenAI) need besides their
server: a virtual environment of their own, made once into the model store's cache, and the target converted from
its GGUF to a Hugging Face checkpoint they load.

Neither anchor is a dependency of specserve: each lives in cache/anchors/NAME-VERSION/, a venv that pip fills and
that is marked ready (a file `ready`) only once every step succeeded, so that a failed or interrupted install is
redone rather than used. The checkpoint is cache/anchors/hf/STEM-HASH/, written by transformers (which reads a
GGUF and dequantizes it) in bfloat16.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def anchors_dir(cache: Path) -> Path:
    """The anchors' home in the model store's cache `cache`."""
    return cache / "anchors"


def venv_python(home: Path) -> Path:
    """The Python of the venv at `home`."""
    return home / "bin" / "python"


def ensure_venv(
    home: Path, steps: Sequence[list[str]], say: Callable[[str], None] = print, marker: str = "ready"
) -> Path:
    """The Python of a venv at `home` made by this Python's venv module, then filled by `steps` (each an argv; a
    leading "python" is the venv's), the output in home/MARKER.log; done once (the file home/MARKER marks it, so
    that steps for another part of the venv take another marker). Raises RuntimeError naming the failed step and
    the log's end."""
    python = venv_python(home)
    if (home / marker).is_file() and python.is_file():
        return python
    home.mkdir(parents=True, exist_ok=True)
    log = home / f"{marker}.log"
    say(f"installing into {home} (once; output in {log})")
    with log.open("w") as out:
        if not python.is_file():
            _step([sys.executable, "-m", "venv", str(home)], out, log)
        for step in steps:
            _step([str(python), *step[1:]] if step[:1] == ["python"] else step, out, log)
    (home / marker).write_text("")
    return python


def run_step(argv: list[str], log: Path) -> None:
    """`argv` run with its output in `log` (overwritten); RuntimeError naming it and the log's end if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        _step(argv, out, log)


def _step(argv: list[str], out, log: Path) -> None:
    out.write("$ " + " ".join(argv) + "\n")
    out.flush()
    try:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
    except OSError as exc:
        raise RuntimeError(f"{' '.join(argv[:4])} could not run: {exc}") from exc
    if code != 0:
        out.flush()
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited with {code}: {_tail(log)} (whole log: {log})")


def _tail(log: Path, lines: int = 4) -> str:
    try:
        return " / ".join(line.strip() for line in log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"no {log}"


def hf_checkpoint(cache: Path, gguf: Path, say: Callable[[str], None] = print) -> Path:
    """`gguf` as a Hugging Face checkpoint (config, bfloat16 safetensors, tokenizer with its chat template) in
    cache/anchors/hf/, converted once by transformers; raises RuntimeError saying what failed."""
    digest = hashlib.sha256(f"{gguf.resolve()}:{gguf.stat().st_size}".encode()).hexdigest()[:12]
    out = anchors_dir(cache) / "hf" / f"{gguf.stem}-{digest}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"converting {gguf.name} to a bfloat16 Hugging Face checkpoint in {out} (once)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        try:
            _convert(gguf, Path(tmp) / "hf")
        except Exception as exc:  # whatever transformers raises is the reason to report
            raise RuntimeError(f"transformers could not convert {gguf.name}: {type(exc).__name__}: {exc}") from exc
        (Path(tmp) / "hf").rename(out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # The loaded model is marked GGUF-quantized, which save_pretrained refuses, though its weights are already
    # dequantized: they go into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if getattr(tokenizer, "chat_template", None) is None:
        raise RuntimeError(f"{gguf.name} has no chat template, which the chat route needs")


def which_library(names: Sequence[str], roots: Sequence[Path]) -> Path | None:
    """The first file named one of `names` under any of `roots` (searched in order, recursively); None if none."""
    for root in roots:
        if not root.is_dir():
            continue
        for name in names:
            found = next(iter(sorted(root.rglob(name))), None)
            if found is not None:
                return found
    return None
