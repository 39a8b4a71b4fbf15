"""Middleware in front of the routes: request ids, the Host check, the optional API key.

`RequestID` gives every request an id, the client's ``X-Request-ID`` when it sent a sane one, else a new
one; the id goes back in the ``X-Request-ID`` response header and into every log record of the request.

`TrustedHost` answers 400 to a request whose ``Host`` header names none of the allowed hosts: on a keyless server
listening on 127.0.0.1, the loopback names only, so that a web page whose name its owner re-points at 127.0.0.1
(DNS rebinding) cannot use the server from the victim's browser as if it were the page's own origin.

`APIKeyGuard` refuses, with 401 in the API's error shape, any request without ``Authorization: Bearer
<key>`` of one of the configured keys, except to the open paths (``/health``, and ``/metrics`` when the
settings say so) and a ``GET`` of the open pages (the playground, which asks for the key itself). Each key is
compared in constant time. It runs before the body is read, so an unauthenticated client cannot make the
server buffer a body. The name of the key a request came with is its ``api_key_name`` in the request's state:
its tenant (`app.api.jobs.tenant`).
"""

from __future__ import annotations

import hmac
import re
import uuid
from collections.abc import Iterable, Mapping

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import error_response, shown
from app.service.logs import request_id_var
from app.service.metrics import Metrics
from app.service.settings import normal_host

REQUEST_ID_HEADER = "X-Request-ID"
# What a client's own id may look like: no spaces, quotes or control characters (it goes into log lines).
_SANE_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


class RequestID:
    """ASGI middleware: an id per request, in the ``X-Request-ID`` response header and the request's logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-request-id"), None)
        rid = given if given is not None and _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        # Not reset afterwards: each request runs in a task of its own (so nothing leaks to the next), and
        # Starlette's handler for unexpected errors runs outside this middleware, after it, and logs with it.
        request_id_var.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


class TrustedHost:
    """ASGI middleware: 400 for a request whose ``Host`` header (any port) names none of `hosts` (as
    `normal_host` spells them), or that has none."""

    def __init__(self, app: ASGIApp, hosts: Iterable[str]) -> None:
        self.app = app
        self.hosts = frozenset(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"), None)
        if given is not None and normal_host(given) in self.hosts:
            await self.app(scope, receive, send)
            return
        allowed = ", ".join(sorted(self.hosts))
        if given is None:
            message = f"the request has no Host header; this server answers to {allowed}"
        else:
            # shown(): the header is the client's text, and the message goes into a log line.
            message = (
                f"Host {shown(given)} is not a name this server answers to ({allowed}); "
                "a server reached by another name lists it in allowed_hosts (--allowed-hosts)"
            )
        response = error_response(scope.get("method", "GET"), scope["path"], "validation", message, status=400)
        await response(scope, receive, send)


def _bearer_token(scope: Scope) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, as sent; None without one."""
    for key, value in scope["headers"]:
        if key.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
            return None
    return None


def key_name(scope: Scope) -> str | None:
    """The name of the API key the request came with; None on a server without keys (or an open path)."""
    return scope.get("state", {}).get("api_key_name")


class APIKeyGuard:
    """ASGI middleware: 401 for a request without one of the API keys (`keys`: each key by its name), except to
    `open_paths`."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Mapping[str, str],
        open_paths: Iterable[str],
        metrics: Metrics | None = None,
        open_pages: Iterable[str] = (),
    ) -> None:
        self.app = app
        self._keys = [(name, key.encode("utf-8")) for name, key in keys.items()]
        self.open_paths = frozenset(open_paths)
        self.open_pages = frozenset(open_pages)
        self.metrics = metrics
        if metrics is not None:
            metrics.keys_configured([name for name, _ in self._keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD") and scope["path"] in self.open_pages:
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        if token is not None:
            # compare_digest takes time independent of where the bytes differ (a length difference shows); every
            # key is compared, so the time does not say which key matched either.
            matched = [name for name, key in self._keys if hmac.compare_digest(token, key)]
            if matched:
                scope.setdefault("state", {})["api_key_name"] = matched[0]
                if self.metrics is not None:
                    self.metrics.key_used(matched[0])
                await self.app(scope, receive, send)
                return
        if token is None:
            message = "this server requires an API key: send the header Authorization: Bearer <key>"
        else:
            message = "the API key is not valid"
        if self.metrics is not None and scope["method"] == "POST":
            self.metrics.request_ended("invalid")
        headers = {"WWW-Authenticate": 'Bearer realm="specserve"'}
        await error_response(scope["method"], scope["path"], "unauthorized", message, headers)(scope, receive, send)
