"""A guard in front of every route that takes a body: size limit, read timeout, JSON content type, UTF-8,
JSON depth, integers Python cannot read.

It reads the whole body first (at most the limit, within the read timeout), so that a body too large is
refused with 413 before any of it is parsed, and one that does not arrive in time (a client that stops
sending, a chunked body never ended) with 408 instead of holding the connection for ever. Bytes that are not
UTF-8, JSON nested deeper than `MAX_JSON_DEPTH` levels, escaped lone surrogates (which the tokenizer cannot
take) and integers longer than Python converts (4,300 digits) are refused with a message that says so, and
names the field, rather than a parse error or a crash. The body is then handed on unchanged; after it, the
app receives the client's own messages, so that a disconnect still reaches the routes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api import admission
from app.api.errors import error_response
from app.engine.decoding.grammar import json_depth
from app.service.metrics import Metrics

_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
# Deepest a body may nest (objects and arrays). No field needs more (a JSON schema may nest 100 levels, and
# sits a few levels down), and Python's recursive helpers (json.dumps, a schema's rewriting) reach their own
# limit near a thousand: past it a request would be a 500, not a 4xx.
MAX_JSON_DEPTH = 128


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


class _HugeInt:
    """An integer literal of the body too long for `int` (Python refuses to convert past 4,300 digits)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(literal: str) -> int | _HugeInt:
    digits = len(literal.lstrip("-"))
    limit = sys.get_int_max_str_digits()
    return _HugeInt(digits) if limit and digits > limit else int(literal)


def _huge_int(value: object) -> tuple[str, _HugeInt] | None:
    """Where in parsed JSON an integer too long to convert is (a dotted path, as validation errors name
    fields), and the integer, if any."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, _HugeInt):
            return path, item
        if isinstance(item, dict):
            stack.extend((f"{path}.{key}" if path else str(key), v) for key, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in reversed(list(enumerate(item))))
    return None


def inspect_body(body: bytes) -> str | None:
    """What is wrong with a request body the routes could not take (not UTF-8, nested too deeply, an integer
    Python cannot read, a lone surrogate), or None; a body that is not JSON at all is the routes' to refuse."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})"
    nested = f"the JSON body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)"
    try:
        # Python's own integers first: a hook per integer costs a second on a megabyte of them.
        value = json.loads(text)
    except RecursionError:
        return nested
    except json.JSONDecodeError:
        value = None  # not JSON: the route's own parser says where
    except ValueError:  # an integer longer than Python converts: parsed again, to name its field
        try:
            value = json.loads(text, parse_int=_parse_int)
        except RecursionError:
            return nested
        if (huge := _huge_int(value)) is not None:
            field, number = huge
            return f"{field or 'the body'}: an integer of {number.digits} digits is out of range"
    if (depth := json_depth(value)) > MAX_JSON_DEPTH:
        return f"the JSON body is nested too deeply ({depth} levels; the limit is {MAX_JSON_DEPTH})"
    if "\\u" in text and (surrogate := _lone_surrogate(value)) is not None:
        return f"the request body escapes a lone UTF-16 surrogate (\\u{ord(surrogate):04x}), which is not a character"
    return None


class BodyGuard:
    """ASGI middleware: refuse bodies over `max_bytes`, slower than `read_timeout` seconds, not JSON, or not
    UTF-8, in the API's error shape."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, read_timeout: float = 30.0, metrics: Metrics | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS_WITH_BODY:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]

        async def refuse(kind: str, message: str, headers: dict[str, str] | None = None) -> None:
            if self.metrics is not None:
                self.metrics.request_ended("invalid")
            await error_response(scope["method"], path, kind, message, headers)(scope, receive, send)

        declared = headers.get("content-length")
        # Compared by length first: int() refuses a string of more than 4,300 digits.
        if declared is not None and declared.isdigit() and (len(declared) > 18 or int(declared) > self.max_bytes):
            size_text = declared if len(declared) <= 18 else f"{len(declared)} digits of"
            await refuse("too_large", f"the request body is {size_text} bytes, over the limit of {self.max_bytes}")
            return
        content_type = headers.get("content-type")
        if content_type is None:
            # A web page may send a body without a type (a typeless Blob) to any origin without asking first (no
            # CORS preflight); asking for application/json means a browser asks, so no page can post to a local
            # server behind its user's back.
            await refuse(
                "unsupported_media_type", "the body must be JSON sent with the header Content-Type: application/json"
            )
            return
        if not _is_json(content_type):
            await refuse(
                "unsupported_media_type", f"the body must be JSON (Content-Type: application/json), not {content_type}"
            )
            return

        chunks: list[bytes] = []
        size = 0
        # One deadline for the whole body, not one per read: a client sending a byte now and then would
        # otherwise hold the connection as long as it likes.
        deadline = anyio.current_time() + self.read_timeout
        while True:
            message: Message | None = None
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
            if message is None:
                await refuse(
                    "request_timeout",
                    f"the request body did not arrive within {self.read_timeout:g} s ({size} bytes came)",
                    # The rest of the body may still come: it would be read as the next request.
                    {"Connection": "close"},
                )
                return
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
        # Parsing a megabyte of JSON and walking it takes a second of CPU: in the pre-admission pool, not on
        # the event loop, where it would hold every stream's next event.
        problem = await admission.run(inspect_body, body)
        if problem is not None:
            await refuse("validation", problem)
            return

        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
