"""A guard in front of every route that takes a body: size limit, JSON content type, UTF-8, JSON depth.

It reads the whole body first (at most the limit), so that a body too large is refused with 413 before any
of it is parsed, and bytes that are not UTF-8, JSON nested past the parser's recursion limit and escaped lone
surrogates (which the tokenizer cannot take) are refused with a message that says so rather than a parse
error or a crash. The body is then handed on unchanged; after it, the app receives the client's own messages, so that a
disconnect still reaches the routes.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import error_response
from app.metrics import Metrics

_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _lone_surrogate(value: object) -> str | None:
    """A lone surrogate in a string of parsed JSON, if any: a \\u escape can make one, and tokenizers cannot
    take it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return item[exc.start]
    return None


class BodyGuard:
    """ASGI middleware: refuse bodies over `max_bytes`, not JSON, or not UTF-8, in the API's error shape."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: Metrics | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS_WITH_BODY:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]

        async def refuse(kind: str, message: str) -> None:
            if self.metrics is not None:
                self.metrics.request_ended("invalid")
            await error_response(path, kind, message)(scope, receive, send)

        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await refuse("too_large", f"the request body is {declared} bytes, over the limit of {self.max_bytes}")
            return
        content_type = headers.get("content-type")
        if content_type is not None and not _is_json(content_type):
            await refuse(
                "unsupported_media_type", f"the body must be JSON (Content-Type: application/json), not {content_type}"
            )
            return

        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await refuse("too_large", f"the request body is over the limit of {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await refuse(
                "validation",
                f"the request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})",
            )
            return
        try:
            value = json.loads(text)
        except RecursionError:
            await refuse("validation", "the JSON body is nested too deeply")
            return
        except ValueError:
            value = None  # not JSON: the route's own parser says where
        if "\\u" in text and (surrogate := _lone_surrogate(value)) is not None:
            await refuse(
                "validation",
                f"the request body escapes a lone UTF-16 surrogate (\\u{ord(surrogate):04x}), which is not a character",
            )
            return

        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
