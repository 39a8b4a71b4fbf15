"""Models named by their Hugging Face Hub id, as users type them: ``owner/repo:QUANT`` (llama.cpp's ``-hf``: the
quant picks the repo's GGUF file), ``owner/repo/path/to/file.gguf`` (one file by name) or ``owner/repo`` (a
safetensors repo, loaded as an HF directory, as vLLM's ``--model``; or a GGUF repo's default quant).

Files are fetched by ``huggingface_hub`` into its standard cache and read from there afterwards, offline too.
The Hub's variables are honoured as ``huggingface_hub`` documents them, and read when a name is resolved (not
when ``huggingface_hub`` is first imported, which may be earlier): ``HF_ENDPOINT`` (a mirror), ``HF_HOME`` /
``HF_HUB_CACHE`` (the cache), ``HF_TOKEN`` (private and gated repos), ``HF_HUB_OFFLINE`` (no network: the
cache only). Without ``HF_HUB_OFFLINE``, a Hub that cannot be reached falls back to the cache too.

The GGUF rule (:func:`pick_gguf`): a quant matches a file whose name holds it as a whole word, case-insensitive
(``Q4_K`` is not ``Q4_K_M``); without a quant ``Q4_K_M`` is taken as llama.cpp does, else ``Q8_0``, else the
repo's only GGUF. Vision projectors (``mmproj``) are never picked; a quant only published split into several
files is refused (the loader reads one file). A repo with both safetensors and GGUF files gives the safetensors
without a quant, a GGUF with one.

Every failure is a :class:`HubError` whose message is one line naming what is missing; the store turns it into
its own ``ModelStoreError``, which the command line prints.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["HubError", "HubId", "is_hub_id", "parse", "pick_gguf", "resolve"]

# The Hub's own rule for a user or repo name: letters, digits, '-', '_', '.', not starting with '.' or '-'.
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}"
_HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?::(?P<quant>[A-Za-z0-9_.-]+)|(?P<file>(?:/[^/:]+)+\.gguf))?$")
# A name of two parts that ends like a model file is a path that does not exist, not a repo.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# llama.cpp's default quant for `-hf owner/repo`, then the near-lossless one.
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
# What the HF-directory loader reads (app/engine/model/weights.py, tokenizer.py): the config, the weights, the
# fast tokenizer and the chat template; the rest of a repo (other formats, images, READMEs) is not fetched.
_HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class HubError(Exception):
    """A Hub id that cannot be resolved; the message is one line saying what is missing."""


@dataclass(frozen=True)
class HubId:
    """A parsed Hub id: the repo, and the quant or the file inside it, if named."""

    repo: str
    quant: str | None = None
    file: str | None = None


def parse(name: str) -> HubId | None:
    """The Hub id `name` spells, or None when it does not look like one (a path, a catalog name)."""
    if name.startswith(("/", "./", "../", "~")) or "\\" in name:
        return None
    m = _HUB_ID.match(name)
    if m is None:
        return None
    repo = m.group("repo")
    if ".." in repo or (m.group("quant") is None and m.group("file") is None and repo.endswith(_FILE_SUFFIXES)):
        return None
    file = m.group("file")
    return HubId(repo, m.group("quant"), file[1:] if file else None)


def is_hub_id(name: str) -> bool:
    """Does `name` look like a Hub id (``owner/repo``, ``owner/repo:QUANT``, ``owner/repo/FILE.gguf``)?"""
    return parse(name) is not None


@dataclass(frozen=True)
class _Config:
    """The Hub's environment as it stands now."""

    endpoint: str | None  # None: huggingface_hub's default
    cache_dir: str | None  # None: huggingface_hub's default
    offline: bool

    def where(self) -> str:
        return self.cache_dir or "the Hugging Face cache"


def _config() -> _Config:
    # huggingface_hub reads these once, when first imported: read here, a test or an embedding program that
    # sets them later is honoured too. The precedence is huggingface_hub's own.
    env = os.environ
    endpoint = env.get("HF_ENDPOINT", "").rstrip("/") or None
    cache = env.get("HF_HUB_CACHE") or (os.path.join(env["HF_HOME"], "hub") if env.get("HF_HOME") else None)
    offline = (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").upper() in ("1", "ON", "YES", "TRUE")
    return _Config(endpoint, os.path.expanduser(cache) if cache else None, offline)


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (huggingface_hub's span several)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__


def _split_parts(path: str) -> bool:
    return _SPLIT.search(path) is not None


def quant_label(path: str) -> str:
    """The quant a GGUF file's name says: its last '-' or '.' separated word (``Qwen2.5-0.5B-Q4_K_M.gguf``:
    ``Q4_K_M``), split files' ``-00001-of-00002`` left out."""
    stem = _SPLIT.sub("", PurePosixPath(path).name)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return re.split(r"[-.]", stem)[-1]


def _has_quant(path: str, quant: str) -> bool:
    # A whole word: not inside a longer name (BF16 is not F16) nor a longer quant (Q4_K_M is not Q4_K).
    pattern = rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9]|_[A-Za-z0-9])"
    return re.search(pattern, PurePosixPath(path).name, re.IGNORECASE) is not None


def _quants(ggufs: list[str]) -> str:
    labels = dict.fromkeys(quant_label(f).upper() for f in ggufs)
    return ", ".join(labels) or "(none)"


def pick_gguf(repo: str, files: list[str], quant: str | None) -> str:
    """The GGUF file of `repo` (whose files are `files`) that `quant` names, by the module's rule; raises
    :class:`HubError` naming the quants there when none (or more than one) fits."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower()]
    if not ggufs:
        raise HubError(f"Hub repo '{repo}' has no GGUF file")
    if quant is None:
        for default in DEFAULT_QUANTS:
            single = [f for f in ggufs if _has_quant(f, default) and not _split_parts(f)]
            if len(single) == 1:
                return single[0]
        singles = [f for f in ggufs if not _split_parts(f)]
        if len(singles) == 1:
            return singles[0]
        raise HubError(
            f"Hub repo '{repo}' has several GGUF files and none is {' or '.join(DEFAULT_QUANTS)}; "
            f"name one as {repo}:QUANT (quants there: {_quants(ggufs)})"
        )
    matches = [f for f in ggufs if _has_quant(f, quant)]
    if not matches:
        raise HubError(f"Hub repo '{repo}' has no GGUF file for quant {quant}; quants there: {_quants(ggufs)}")
    singles = [f for f in matches if not _split_parts(f)]
    if not singles:
        whole = _quants([f for f in ggufs if not _split_parts(f)])
        raise HubError(
            f"Hub repo '{repo}' has quant {quant} only split into {len(matches)} files ({matches[0]}, ...); "
            f"specserve loads a single-file GGUF (quants there in one file: {whole})"
        )
    if len(singles) > 1:
        raise HubError(
            f"Hub repo '{repo}' has {len(singles)} GGUF files for quant {quant} ({', '.join(singles)}); "
            f"name one as {repo}/FILE.gguf"
        )
    return singles[0]


def _hf_files(repo: str, files: list[str]) -> list[str] | None:
    """The files of a safetensors repo that the HF-directory loader reads; None when `repo` is not one."""
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    if "config.json" not in top or not weights:
        return None
    if "tokenizer.json" not in top:
        raise HubError(f"Hub repo '{repo}' has no tokenizer.json (specserve reads the fast tokenizer's file)")
    # An index names the shards (a repo may also hold a consolidated copy, as Mistral's do); else one file.
    if "model.safetensors.index.json" in top:
        weights = [f for f in weights if not f.startswith("consolidated")]
    elif "model.safetensors" in top:
        weights = ["model.safetensors"]
    return [f for f in top if f in _HF_FILES] + weights


def _cached_files(repo: str, cfg: _Config) -> list[str] | None:
    """The files of `repo` as the cache knows them: the listing a fetch stored (all of the repo's files), else
    the files of its cached snapshot; None when the repo is not cached."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    try:
        return [f.path for f in get_cached_repo_tree(repo, cache_dir=cfg.cache_dir)]
    except CachedRepoTreeNotFoundError:
        pass
    from huggingface_hub import constants

    # Fetched by another tool (`hf download`, transformers) that stores no listing: what its snapshot holds.
    folder = Path(cfg.cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    try:
        commit = (folder / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = folder / "snapshots" / commit
    return sorted(str(p.relative_to(snapshot).as_posix()) for p in snapshot.rglob("*") if p.is_file()) or None


def _not_found(repo: str, cfg: _Config) -> HubError:
    where = cfg.endpoint or "https://huggingface.co"
    return HubError(
        f"'{repo}' is not a model repo on the Hub ({where}), nor an existing path or a catalog model "
        "(a private repo needs HF_TOKEN)"
    )


def _gated(repo: str) -> HubError:
    return HubError(f"Hub repo '{repo}' is gated: accept its terms on its page, then set HF_TOKEN to your token")


def _listing(hub: HubId, cfg: _Config) -> tuple[list[str], str | None]:
    """The repo's files, from the Hub or, offline or when it cannot be reached, from the cache; and why the
    Hub was not asked (None when it answered)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    offline_why = "HF_HUB_OFFLINE is set" if cfg.offline else None
    if offline_why is None:
        try:
            info = HfApi(endpoint=cfg.endpoint).model_info(hub.repo)
            return [s.rfilename for s in info.siblings or ()], None
        except GatedRepoError:
            raise _gated(hub.repo) from None
        except RepositoryNotFoundError:
            raise _not_found(hub.repo, cfg) from None
        except Exception as exc:  # no network, the Hub down, a proxy's refusal: the cache may still have it
            offline_why = f"the Hub cannot be reached ({_one_line(exc)})"
    files = _cached_files(hub.repo, cfg)
    if files is None:
        raise HubError(f"'{hub.repo}' is not in {cfg.where()} and {offline_why}; fetch it once with the network on")
    return files, offline_why


def resolve(name: str, force: bool = False) -> Path:
    """The local path of Hub id `name`, fetched into the Hugging Face cache unless already there (with `force`:
    again): a GGUF file, or the snapshot directory of a safetensors repo. Raises :class:`HubError` (one line)
    otherwise."""
    hub = parse(name)
    if hub is None:
        raise HubError(f"'{name}' is not a Hub id (owner/repo, owner/repo:QUANT or owner/repo/FILE.gguf)")
    cfg = _config()
    files, offline_why = _listing(hub, cfg)
    if hub.file is not None:
        if hub.file not in files:
            there = ", ".join(f for f in files if f.lower().endswith(".gguf")) or "none"
            raise HubError(f"Hub repo '{hub.repo}' has no file {hub.file} (GGUF files there: {there})")
        if _split_parts(hub.file):
            raise HubError(f"{hub.file} is one part of a split GGUF; specserve loads a single-file GGUF")
        wanted, directory = [hub.file], False
    else:
        hf = None if hub.quant is not None else _hf_files(hub.repo, files)
        wanted = hf if hf is not None else [pick_gguf(hub.repo, files, hub.quant)]
        directory = hf is not None
    snapshot = _download(hub, wanted, cfg, offline_why, force)
    missing = [f for f in wanted if not (snapshot / f).is_file()]
    if missing:
        raise HubError(f"'{hub.repo}' in {cfg.where()} lacks {', '.join(missing)}; fetch it once with the network on")
    return snapshot if directory else snapshot / wanted[0]


def _download(hub: HubId, files: list[str], cfg: _Config, offline_why: str | None, force: bool) -> Path:
    """Fetch `files` of the repo (the cached ones are not fetched again) and return its snapshot directory.
    huggingface_hub shows the progress on stderr and retries a dropped transfer from where it stopped."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = snapshot_download(
            hub.repo,
            # exact names: a pattern's metacharacters in a file name ('[') are escaped
            allow_patterns=[glob.escape(f) for f in files],
            cache_dir=cfg.cache_dir,
            endpoint=cfg.endpoint,
            local_files_only=offline_why is not None,
            force_download=force and offline_why is None,
        )
    except GatedRepoError:
        raise _gated(hub.repo) from None
    except RepositoryNotFoundError:
        raise _not_found(hub.repo, cfg) from None
    except LocalEntryNotFoundError:
        why = offline_why or "the Hub cannot be reached"
        raise HubError(
            f"'{hub.repo}' ({', '.join(files)}) is not in {cfg.where()} and {why}; fetch it once with the network on"
        ) from None
    except Exception as exc:  # the Hub's other answers, a full disk, a transfer that failed past its retries
        raise HubError(
            f"fetching '{hub.repo}' ({', '.join(files)}) failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    return Path(folder)
