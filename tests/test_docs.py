"""The documentation stays true to the repository: links resolve, and the README's curls name real routes and fields.

- Every relative link and image in the Markdown files (README.md, docs/, model_store/) points at a file that
  exists, and every ``#anchor`` at a heading of its target (GitHub's anchor slugs).
- Every ``docs/...`` path that the code, the container files and the build files mention exists, and so does
  the section a mention names, as in ``(docs/service.md, Configuration)`` or ``(README, Benchmarks)``.
- docs/service.md's configuration table lists every ``specserve serve`` flag (generated from the settings)
  with its variable and default.
- Every ``curl`` in README.md and docs/ names a route of the app with its method, and its JSON body uses
  only fields of the route's pydantic request model, nested objects included (``parameters``,
  ``speculative``, ``messages``); the body must also validate. The README shows a curl for every route.

Nothing here loads a model: the app is built without running its lifespan, and its routes come from its
OpenAPI schema.
"""

from __future__ import annotations

import json
import re
import shlex
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_README_LINES = 300

# Markdown files whose links must resolve.
MARKDOWN = sorted({README, *(REPO / "docs").rglob("*.md"), *(REPO / "model_store").rglob("*.md")})
# Files and folders whose mentions of docs/... must resolve.
MENTION_ROOTS = ["app", "docker", "docker-compose.yml", "Makefile", ".ci", "model_store", "pyproject.toml"]
TEXT_SUFFIXES = {"", ".py", ".c", ".h", ".yml", ".yaml", ".json", ".md", ".toml", ".conf", ".cfg", ".txt", ".sh"}
# curls aimed at these ports talk to Prometheus and Grafana, not to specserve.
OTHER_SERVICES = {3000, 9090}

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, without punctuation, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor a Markdown file defines: heading slugs (repeats get -1, -2, ...) and HTML anchors."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(_HTML_ANCHOR.findall(line))
    return frozenset(out)


def _headings(path: Path) -> set[str]:
    return {m.group(2) for _, line in _prose_lines(path.read_text(encoding="utf-8")) if (m := _HEADING.match(line))}


def broken_link(source: Path, target: str) -> str | None:
    """Why the link `target` in `source` does not resolve, or None when it does."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    path = (source.parent / unquote(path_part)).resolve() if path_part else source
    if not path.is_relative_to(REPO):
        return "points outside the repository"
    if not path.exists():
        return "no such file"
    if not anchor:
        return None
    if path.is_dir():  # GitHub shows a folder's README.md
        path = path / "README.md"
    if path.suffix != ".md" or not path.exists():
        return f"#{anchor} on a file without headings"
    if unquote(anchor).lower() not in anchors(path):
        return f"no heading #{anchor} in {_rel(path)}"
    return None


def _links(path: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        out += [(number, m.group(1)) for m in _LINK.finditer(_INLINE_CODE.sub("", line)) if m.group(1)]
    return out


@pytest.mark.parametrize("path", MARKDOWN, ids=_rel)
def test_markdown_links_resolve(path: Path) -> None:
    broken = [f"{_rel(path)}:{n}: ({target}) {why}" for n, target in _links(path) if (why := broken_link(path, target))]
    assert not broken, "\n".join(broken)


def test_the_link_checker_catches_broken_links() -> None:
    assert broken_link(README, "docs/service.md#configuration") is None
    assert broken_link(README, "docs/nowhere.md") == "no such file"
    assert broken_link(README, "docs/service.md#no-such-section")
    assert broken_link(README, "#no-such-section")
    assert slug("`docker compose up`") == "docker-compose-up"
    assert slug("Concurrency: how requests share the model") == "concurrency-how-requests-share-the-model"
    assert slug("Native (TGI) API") == "native-tgi-api"


def test_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; reference material belongs in docs/"


# --- mentions of docs/... and README sections outside Markdown -----------------------------------------------

_DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*")
# "(docs/service.md, Configuration)", "(README, Benchmarks)": a file and one of its sections.
_SECTION = re.compile(r"\((README(?:\.md)?|docs/[\w./-]+\.md), ([^)]+)\)")
_README_SECTION = re.compile(r"README's ([A-Z][\w ]*?) section")


def _mention_files() -> list[Path]:
    files = []
    for root in MENTION_ROOTS:
        path = REPO / root
        candidates = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        files += [
            p
            for p in candidates
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts and p.stat().st_size < 2**20
        ]
    return files


def _has_section(path: Path, section: str) -> bool:
    return slug(section) in anchors(path) or any(section.lower() in h.lower() for h in _headings(path))


def test_mentions_of_docs_resolve() -> None:
    files = _mention_files()
    assert any(p.name == "docker-compose.yml" for p in files)
    broken = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            where = f"{_rel(path)}:{number}"
            for m in _DOCS_PATH.finditer(line):
                mentioned = m.group(0).rstrip(".")
                if not (REPO / mentioned).exists():
                    broken.append(f"{where}: {mentioned} does not exist")
            for m in _SECTION.finditer(line):
                doc = REPO / ("README.md" if m.group(1).startswith("README") else m.group(1))
                if doc.exists() and not _has_section(doc, m.group(2)):
                    broken.append(f"{where}: no section {m.group(2)!r} in {_rel(doc)}")
            for m in _README_SECTION.finditer(line):
                if not _has_section(README, m.group(1)):
                    broken.append(f"{where}: no section {m.group(1)!r} in README.md")
    assert not broken, "\n".join(broken)


# --- the configuration table ---------------------------------------------------------------------------------

SERVICE = REPO / "docs" / "service.md"


def configuration_rows(text: str) -> dict[str, tuple[str, str]]:
    """flag: (environment variable, default) of each row of service.md's table of `specserve serve` flags."""
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`--"):
            rows[cells[0].split("`")[1]] = (cells[1].strip("`"), cells[2])
    return rows


def configuration_problems(text: str) -> list[str]:
    """How service.md's table differs from the serve flags (generated from app.service.settings.Settings)."""
    from app.cli import common
    from app.service.settings import Settings

    rows = configuration_rows(text)
    flags = {flag: field for flag, field, _ in common.serve_flags()}
    problems = [f"{flag}: not in the table" for flag in flags.keys() - rows.keys()]
    problems += [f"{flag}: no such flag" for flag in rows.keys() - flags.keys()]
    for flag, (variable, default) in rows.items():
        if flag not in flags:
            continue
        field = flags[flag]
        if variable != "SPECSERVE_" + field.upper():
            problems.append(f"{flag}: variable {variable}")
        value = Settings.model_fields[field].default
        if value is None or value == "":  # shown in words: "the target", "unset", "empty"
            if default.startswith("`"):
                problems.append(f"{flag}: default {default}, the setting has none")
        else:
            shown = str(value).lower() if isinstance(value, bool) else common.serve_default(value)
            if default != f"`{shown}`":
                problems.append(f"{flag}: default {default}, the setting's is `{shown}`")
    return problems


def test_the_configuration_table_matches_the_settings() -> None:
    """docs/service.md lists every serve flag, its variable and its default, as the settings define them."""
    assert configuration_problems(SERVICE.read_text(encoding="utf-8")) == []


def test_the_configuration_check_catches_a_stale_table() -> None:
    text = SERVICE.read_text(encoding="utf-8")
    stale = text.replace("| `SPECSERVE_PORT` | `8000` |", "| `SPECSERVE_PORT` | `8080` |")
    stale = "\n".join(line for line in stale.splitlines() if not line.startswith("| `--host`"))
    assert configuration_problems(stale) == [
        "--host: not in the table",
        "--port: default `8080`, the setting's is `8000`",
    ]


# --- the curl examples -------------------------------------------------------------------------------------

_SHELL_BLOCK = {"", "bash", "sh", "shell", "console"}
_VALUE_OPTIONS = {"-H", "--header", "-X", "--request", "-o", "--output", "-u", "--user", "-w", "--write-out"}
_DATA_OPTIONS = {"-d", "--data", "--data-raw", "--data-binary", "--json"}


class Curl(NamedTuple):
    where: str
    method: str
    url: str
    body: str | None


def _commands(block: str) -> list[tuple[int, str]]:
    """Split a shell block into commands at newlines outside quotes, joining `\\` continuations."""
    out: list[tuple[int, str]] = []
    current, quote, line, start = [], None, 0, 0
    i = 0
    while i < len(block):
        c = block[i]
        if quote is None and c == "\\" and block[i + 1 : i + 2] == "\n":
            i, line = i + 2, line + 1
            current.append(" ")
            continue
        if quote is None and c == "#" and (i == 0 or block[i - 1].isspace()):  # a comment, to the line's end
            end = block.find("\n", i)
            i = len(block) if end < 0 else end
            continue
        if c == "\n":
            line += 1
            if quote is None:
                out.append((start, "".join(current)))
                current, start = [], line
                i += 1
                continue
        elif c in "'\"" and (quote is None or quote == c):
            quote = None if quote == c else c
        current.append(c)
        i += 1
    out.append((start, "".join(current)))
    return [(n, cmd) for n, cmd in out if cmd.strip()]


def _curls_in(cmd: str) -> list[list[str]]:
    if not re.search(r"(^|[\s/;|&(])curl\s", cmd):
        return []
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    out = []
    for i, token in enumerate(tokens):
        if token == "curl" or token.endswith("/curl"):
            args = []
            for arg in tokens[i + 1 :]:
                if arg and set(arg) <= set("();<>|&"):
                    break
                args.append(arg)
            out.append(args)
    return out


def parse_curl(args: list[str], where: str) -> Curl:
    method, url, body = None, None, None
    it = iter(args)
    for arg in it:
        if arg in _DATA_OPTIONS:
            body = next(it)
        elif arg in ("-X", "--request"):
            method = next(it)
        elif arg in _VALUE_OPTIONS:
            next(it)
        elif not arg.startswith("-") and url is None:
            url = arg
    assert url, f"{where}: a curl without a URL"
    return Curl(where, method or ("POST" if body is not None else "GET"), url, body)


def curls(path: Path) -> list[Curl]:
    """Every curl command in the shell blocks of a Markdown file."""
    out, block, lang, start = [], None, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if m and block is None:
            block, lang, start = [], line.strip()[3:].strip().lower(), number
        elif m:
            if lang in _SHELL_BLOCK:
                for offset, cmd in _commands("\n".join(block)):
                    for args in _curls_in(cmd):
                        out.append(parse_curl(args, f"{_rel(path)}:{start + 1 + offset}"))
            block = None
        elif block is not None:
            block.append(line)
    return out


@cache
def openapi() -> dict[str, Any]:
    from app.api.server import create_app
    from app.service.settings import Settings

    return create_app(Settings()).openapi()


def _route(curl: Curl) -> tuple[str, str]:
    """The method and the route a curl calls: its path, or the templated path it fills in (/v1/models/{model_id})."""
    url = curl.url if "://" in curl.url else "http://" + curl.url
    path = urlsplit(url).path or "/"
    for template in openapi()["paths"]:
        pattern = re.sub(r"\\\{[^}]*\\\}", "[^/].*", re.escape(template))
        if "{" in template and path not in openapi()["paths"] and re.fullmatch(pattern, path):
            return curl.method.upper(), template
    return curl.method.upper(), path


def _port(curl: Curl) -> int | None:
    return urlsplit(curl.url if "://" in curl.url else "http://" + curl.url).port


def request_model(method: str, path: str) -> type[BaseModel] | None:
    """The pydantic model of a route's JSON body (None: the route takes no body); KeyError for no such route."""
    from app.api import schemas

    operation = openapi()["paths"][path][method.lower()]
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if schema is None:
        return None
    model = getattr(schemas, schema["$ref"].rsplit("/", 1)[-1])
    assert issubclass(model, BaseModel)
    return model


def unknown_fields(annotation: Any, value: Any, where: str) -> list[str]:
    """The keys of `value` (JSON) that the type `annotation` does not have, at any depth."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return unknown_fields(typing.get_args(annotation)[0], value, where)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not isinstance(value, dict):
            return []
        fields = {(f.alias or name): f for name, f in annotation.model_fields.items()}
        out = []
        for key, item in value.items():
            if key not in fields:
                out.append(f"{where}.{key}" if where else key)
            else:
                out += unknown_fields(fields[key].annotation, item, f"{where}.{key}" if where else key)
        return out
    if origin in (list, tuple, set, frozenset) and isinstance(value, list):
        item_type = (typing.get_args(annotation) or (Any,))[0]
        return [p for i, item in enumerate(value) for p in unknown_fields(item_type, item, f"{where}[{i}]")]
    if origin in (typing.Union, types.UnionType):
        choices = [unknown_fields(arg, value, where) for arg in typing.get_args(annotation) if _fits(arg, value)]
        return min(choices, key=len) if choices else []
    return []


def _fits(annotation: Any, value: Any) -> bool:
    """Whether a JSON value has the shape of one alternative of a union: an object, an array, null or a scalar."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation) or annotation
    if isinstance(origin, type) and issubclass(origin, (BaseModel, dict)):
        return isinstance(value, dict)
    if origin in (list, tuple, set, frozenset):
        return isinstance(value, list)
    if annotation is type(None):
        return value is None
    return not isinstance(value, (dict, list))


def check_curl(curl: Curl) -> list[str]:
    """What is wrong with a curl: a route that does not exist, a field its request model does not have."""
    method, path = _route(curl)
    paths = openapi()["paths"]
    if path not in paths:
        return [f"{curl.where}: no route {path} (routes: {', '.join(sorted(paths))})"]
    if method.lower() not in paths[path]:
        return [f"{curl.where}: {path} does not answer {method}"]
    model = request_model(method, path)
    if curl.body is None:
        return [f"{curl.where}: {method} {path} needs a JSON body"] if model is not None else []
    if model is None:
        return [f"{curl.where}: {method} {path} takes no body"]
    try:
        body = json.loads(curl.body)
    except json.JSONDecodeError as exc:
        return [f"{curl.where}: the body is not JSON: {exc}"]
    problems = [f"{curl.where}: {model.__name__} has no field {f}" for f in unknown_fields(model, body, "")]
    if not problems:
        try:
            model.model_validate(body)
        except ValueError as exc:
            problems.append(f"{curl.where}: the body does not validate as {model.__name__}: {exc}")
    return problems


README_CURLS = curls(README)
DOC_CURLS = [c for p in MARKDOWN if p != README for c in curls(p)]


@pytest.mark.parametrize("curl", README_CURLS + DOC_CURLS, ids=[c.where for c in README_CURLS + DOC_CURLS])
def test_curl_examples_name_real_routes_and_fields(curl: Curl) -> None:
    if _port(curl) in OTHER_SERVICES:
        pytest.skip("not a specserve URL")
    problems = check_curl(curl)
    assert not problems, "\n".join(problems)


def test_readme_shows_every_route() -> None:
    shown = {_route(c) for c in README_CURLS}
    routes = {(m.upper(), p) for p, ops in openapi()["paths"].items() for m in ops}
    missing = sorted(routes - shown)
    assert not missing, f"README.md has no curl for {missing}"


def test_the_curl_checker_catches_wrong_routes_and_fields() -> None:
    def check(command: str) -> list[str]:
        [args] = _curls_in(command)
        return check_curl(parse_curl(args, "example"))

    good = """curl -s localhost:8000/generate -H 'Content-Type: application/json' -d '{
        "inputs": "Hi", "parameters": {"max_new_tokens": 4, "speculative": {"draft": "ngram"}}}'"""
    assert check(good) == []
    assert check(good.replace("/generate", "/generated"))  # no such route
    assert check(good.replace('"inputs"', '"input"'))  # no such top-level field
    assert check(good.replace("max_new_tokens", "max_tokens"))  # no such field in parameters
    assert check(good.replace('"draft"', '"drafter"'))[0] == (
        "example: GenerateRequest has no field parameters.speculative.drafter"
    )
    chat = """curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "text": "Hi"}]}'"""
    assert check(chat)  # a message has `content`, not `text`
    assert check('curl -s localhost:8000/v1/completions -d \'{"prompt": "Hi", "max_tokens": "16"}\'')
    assert check("curl -s -X POST localhost:8000/health") == ["example: /health does not answer POST"]
    assert len(README_CURLS) >= 8
