"""A local stand-in for the Hugging Face Hub: the few endpoints huggingface_hub calls to list and fetch a model
repo, answered from repos held in memory, so that tests of Hub ids never reach the real Hub (HF_ENDPOINT points
here).

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: the repo's info (``sha``, ``siblings``,
  ``gated``), what ``HfApi.model_info`` and ``snapshot_download`` read.
- ``GET /api/models/{repo}/tree/{rev}``: the file listing (one page), what ``snapshot_download`` stores.
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: a file with the headers ``hf_hub_download`` needs
  (``X-Repo-Commit``, ``ETag``, ``Content-Length``), and ``Range`` answered with 206 (a resumed transfer).

Errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``, ``GatedRepo``, ``EntryNotFound``), which
huggingface_hub turns into its exception types. ``drop_first`` files are cut off half-way through their first
GET, as a dropped connection would be; every request is logged in ``requests``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_INFO = re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_RESOLVE = re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class HubMirror:
    """Serves `repos` ({repo id: {file path: bytes}}) on 127.0.0.1 in a thread; `gated`: repos whose files
    need a token; use as a context manager, or start() and stop()."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: frozenset[str] = frozenset()) -> None:
        self.repos = repos
        self.gated = gated
        self.drop_first: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @staticmethod
    def commit(repo: str) -> str:
        """The repo's one commit: 40 hex digits, as the Hub's are."""
        return hashlib.sha1(repo.encode()).hexdigest()

    def start(self) -> HubMirror:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering and close the port: the Hub is out of reach from now on."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HubMirror:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _error(self, status: int, code: str, repo: str | None = None) -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
                if repo in mirror.repos:
                    self.send_header("X-Repo-Commit", mirror.commit(repo))
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _json(self, value: object) -> None:
                data = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _answer(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                mirror.requests.append((self.command, path, self.headers.get("Range")))
                for pattern, route in ((_INFO, self._info), (_TREE, self._tree), (_RESOLVE, self._file)):
                    m = pattern.match(path)
                    if m:
                        repo = m.group("repo")
                        if repo not in mirror.repos:
                            return self._error(404, "RepoNotFound")
                        rev = m.group("rev")
                        if rev not in (None, "main", mirror.commit(repo)):
                            return self._error(404, "RevisionNotFound", repo)
                        return route(m, repo, body)
                self._error(404, "RepoNotFound")

            def _info(self, m: re.Match, repo: str, body: bool) -> None:
                files = mirror.repos[repo]
                self._json(
                    {
                        "_id": repo,
                        "id": repo,
                        "modelId": repo,
                        "sha": mirror.commit(repo),
                        "private": False,
                        "gated": "manual" if repo in mirror.gated else False,
                        "siblings": [{"rfilename": f} for f in files],
                    }
                )

            def _tree(self, m: re.Match, repo: str, body: bool) -> None:
                files = mirror.repos[repo]
                self._json(
                    [
                        {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": f}
                        for f, data in files.items()
                    ]
                )

            def _file(self, m: re.Match, repo: str, body: bool) -> None:
                if repo in mirror.gated and "authorization" not in {k.lower() for k in self.headers}:
                    return self._error(401, "GatedRepo", repo)
                name = m.group("path")
                data = mirror.repos[repo].get(name)
                if data is None:
                    return self._error(404, "EntryNotFound", repo)
                start = 0
                ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if ranged:
                    start = int(ranged.group(1))
                self.send_response(206 if ranged else 200)
                self.send_header("X-Repo-Commit", mirror.commit(repo))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                if name in mirror.drop_first:  # half the body, then the connection closes
                    mirror.drop_first.discard(name)
                    self.wfile.write(data[start : start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        return Handler
