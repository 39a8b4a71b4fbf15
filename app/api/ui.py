"""The playground: one page, served at ``GET /`` and ``GET /ui``, that streams an answer and shows what speculation did.

The page (app/api/playground.html, package data) is plain HTML, CSS and JavaScript with nothing to build and
nothing fetched from elsewhere: it talks to this server's own streaming routes with their `provenance` field
(docs/service.md, Provenance). It is served without the API key, since it holds no data and asks for the key
itself; the key then lives in the page's memory only. Its Content-Security-Policy allows its own inline script and
style (by hash) and connections to this origin alone, so that the browser itself refuses any other request.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

# GET only: POST / is TGI's generation route and keeps needing the key.
PAGES = ("/", "/ui")

router = APIRouter(include_in_schema=False)


def _hashes(html: str, tag: str) -> str:
    """The CSP sources allowing exactly the page's inline `tag` blocks."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)


@cache
def page() -> tuple[str, dict[str, str]]:
    """The playground's HTML and the headers it is served with (read once from the package)."""
    html = resources.files("app.api").joinpath("playground.html").read_text(encoding="utf-8")
    policy = (
        f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    headers = {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return html, headers


@router.get("/", response_class=HTMLResponse)
@router.get("/ui", response_class=HTMLResponse)
async def playground() -> HTMLResponse:
    """The playground page."""
    html, headers = page()
    return HTMLResponse(html, headers=headers)
