"""Errors as the clients of each API expect them.

The native (TGI) routes answer ``{"error": "...", "error_type": "..."}`` with 422 for a bad request, the way
text-generation-inference does, so that its client raises its own ValidationError, OverloadedError and
GenerationError. The OpenAI routes (``/v1/...``) answer ``{"error": {"message", "type", "param", "code"}}``
with 400 for a bad request, which the ``openai`` client turns into BadRequestError and friends. Every
message says what is wrong in the request and, for a limit, what the limit is.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1/"
# Longest error message a body carries: each quotes what it needs (`shown` cuts values), and this bounds what
# slips through (a library's message quoting its input), so that no error answer runs to more than a few KB.
MAX_MESSAGE = 1000
# Kinds logged where they happen, with the request's id (the worker's failed step, a deadline): not again here.
_LOGGED_ELSEWHERE = frozenset({"generation", "timeout", "internal"})

# error_type -> (status on the native routes, status on the OpenAI routes, OpenAI error type)
_KINDS: dict[str, tuple[int, int, str]] = {
    "validation": (422, 400, "invalid_request_error"),
    "unauthorized": (401, 401, "invalid_request_error"),
    "not_found": (404, 404, "not_found_error"),
    "model_not_found": (404, 404, "NotFoundError"),  # vLLM's answer to a `model` it does not serve
    "method_not_allowed": (405, 405, "invalid_request_error"),
    "request_timeout": (408, 408, "timeout"),
    "too_large": (413, 413, "invalid_request_error"),
    "unsupported_media_type": (415, 415, "invalid_request_error"),
    "overloaded": (429, 429, "rate_limit_exceeded"),
    "generation": (424, 424, "server_error"),
    "internal": (500, 500, "server_error"),
    "unavailable": (503, 503, "server_error"),
    "queue_timeout": (503, 503, "server_error"),  # not started within queue_timeout; with Retry-After
    "timeout": (504, 504, "timeout"),
    # a client that read nothing of its stream for send_timeout, or fell max_stream_backlog tokens behind: the
    # last event of its stream, should it read again (its 200 headers went already)
    "client_stalled": (408, 408, "timeout"),
}


class APIError(Exception):
    """A request that cannot be served; `kind` is the TGI ``error_type`` and picks the status."""

    def __init__(
        self,
        kind: str,
        message: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        if kind not in _KINDS:
            raise ValueError(f"unknown error kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.headers = headers
        self.param = param  # OpenAI's `param` (the field at fault) and `code` (default: the kind)
        self.code = code


def is_openai_path(path: str) -> bool:
    """Does `path` belong to the OpenAI-compatible API (which has its own error shape)?"""
    return path.startswith(OPENAI_PREFIX)


def status_of(kind: str, openai: bool) -> int:
    """HTTP status of an error of `kind` on the native or the OpenAI routes."""
    native, oai, _ = _KINDS[kind]
    return oai if openai else native


def error_body(
    kind: str, message: str, openai: bool, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The JSON body of an error, in the shape the API's clients parse (also used inside SSE streams); a message
    over MAX_MESSAGE characters is cut."""
    message = cut(message)
    if openai:
        code = kind if code is None else code
        return {"error": {"message": message, "type": _KINDS[kind][2], "param": param, "code": code}}
    return {"error": message, "error_type": kind}


def error_response(
    method: str,
    path: str,
    kind: str,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
    code: str | int | None = None,
    status: int | None = None,
) -> JSONResponse:
    """A complete error response for a `method` request to `path` (`status`: instead of the kind's), with its one
    log line (`_log_refusal`)."""
    openai = is_openai_path(path)
    body = error_body(kind, message, openai, param, code)
    response = JSONResponse(body, status_code=status or status_of(kind, openai), headers=headers)
    _log_refusal(method, path, response.status_code, kind, message)
    return response


def shown(value: object, limit: int = 40) -> str:
    """`value` as an error message quotes it (``repr``), cut to about `limit` characters: a request may send
    a number of thousands of digits, or a string of a megabyte, and the message must stay a line."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's limit on converting one to text
        return f"(an integer of more than {sys.get_int_max_str_digits()} digits)"
    if len(text) <= limit:
        return text
    if isinstance(value, int):
        digits = len(text.lstrip("-"))
        return f"{text[: limit // 2]}... (an integer of {digits} digits)"
    return f"{text[:limit]}... ({len(text)} characters)"


# A field name a message or a log line shows as it is; any other (a client's key with a line break, quotes or a
# megabyte of text) is quoted by `shown`, so that it cannot start a log line of its own or pass for our words.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def field_name(name: object) -> str:
    """A request's field name (or a list index) as an error message or a log line names it: as it is when it is
    a plain identifier, else quoted and cut (`shown`)."""
    text = str(name)
    return text if _PLAIN_NAME.fullmatch(text) else shown(text)


def cut(message: str, limit: int = MAX_MESSAGE) -> str:
    """`message` cut to about `limit` characters, saying how long it was."""
    return message if len(message) <= limit else f"{message[:limit]}... ({len(message)} characters)"


def _log_refusal(method: str, path: str, status: int, kind: str, message: str) -> None:
    """One log line for a request answered with an error (its id comes with the record), unless the place
    where it failed logged it already."""
    if kind in _LOGGED_ELSEWHERE:
        return
    # repr: a path or a message may hold line breaks, which must not start a log line of their own.
    log.info("%s %r refused with %d %s: %r", method, cut(path, 80), status, kind, cut(message, 300))


# Union members show up in pydantic's error locations as type tags ("str", "list[ContentPart]"): not fields.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|function-\w+)\[.*\]|constrained-\w+|[A-Z][A-Za-z0-9]*)$")


def describe_validation_errors(errors: list[dict[str, Any]] | Any) -> str:
    """One line naming each invalid field of a request, from pydantic's or FastAPI's error list."""
    general: list[str] = []
    by_field: dict[str, list[str]] = {}
    given_of: dict[str, str] = {}
    for err in errors:
        # A location holds the client's own keys (an unknown field, a logit_bias key): each as field_name shows it.
        loc = [field_name(x) for x in err.get("loc", ()) if x != "body" and not _TYPE_TAG.match(str(x))]
        field = ".".join(loc)
        kind = err.get("type", "")
        if kind == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "")
            general.append(f"the body is not valid JSON ({reason} at character {field or '?'})")
        elif kind == "missing":
            general.append(f"missing field '{field}'" if field else "the request body is missing (send a JSON object)")
        elif kind == "model_attributes_type" and not loc:
            general.append("the body must be a JSON object")
        elif kind == "extra_forbidden":
            # A field inside an object that we do not know: refused rather than dropped unread.
            by_field.setdefault(field, ["unknown field: not supported here, leave it out"])
        else:
            # Pydantic prefixes custom errors with "Value error, "; the rest of the message is ours.
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            if not field:
                general.append(msg)
                continue
            if msg not in by_field.setdefault(field, []):
                by_field[field].append(msg)
            given = err.get("input")
            if isinstance(given, str | int | float | bool):
                given_of[field] = f" (got {shown(given)})"
    parts = general + [
        f"{f}: {' or '.join([msgs[0], *(m.removeprefix('Input should be ') for m in msgs[1:])])}{given_of.get(f, '')}"
        for f, msgs in by_field.items()
    ]
    return "; ".join(parts) or "invalid request"


def _count_invalid(request: Request) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None and request.method == "POST":
        metrics.request_ended("invalid")


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    if exc.kind in ("validation", "model_not_found"):
        _count_invalid(request)
    return error_response(request.method, request.url.path, exc.kind, exc.message, exc.headers, exc.param, exc.code)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    _count_invalid(request)
    return error_response(request.method, request.url.path, "validation", describe_validation_errors(exc.errors()))


_HTTP_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "too_large", 415: "unsupported_media_type"}


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = _HTTP_KINDS.get(exc.status_code, "validation" if exc.status_code < 500 else "internal")
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    path = cut(request.url.path, 200)  # a path may be as long as the server reads a request line
    if exc.status_code == 404:
        detail = f"no route {request.method} {path}"
    elif exc.status_code == 405:
        detail = f"method {request.method} is not allowed on {path}"
    # Report the status Starlette chose, even where our table would pick another for that kind.
    return error_response(
        request.method, request.url.path, kind, detail, dict(exc.headers or {}), status=exc.status_code
    )


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # The traceback goes to the log, never to the client: the answer names the exception's type only. This
    # handler runs outside the middleware, so it adds the request id header itself.
    # Once: this handler may see the same exception twice, and Starlette raises it again for the server, whose
    # own log line would repeat the traceback (app.service.logs drops that one).
    if not getattr(exc, "specserve_logged", False):
        log.exception("unhandled error on %s %r", request.method, cut(request.url.path, 80))
        exc.specserve_logged = True  # type: ignore[attr-defined]
    rid = request.scope.get("state", {}).get("request_id")
    headers = {"X-Request-ID": rid} if rid else None
    return error_response(
        request.method, request.url.path, "internal", f"internal error: {type(exc).__name__}", headers
    )


def install_error_handlers(app: FastAPI) -> None:
    """Make every error of `app`, FastAPI's own included, answer in the shape of its API."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)


def documented_errors(model: type, validation_status: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a family of generation routes documents in OpenAPI (FastAPI's `responses=`), with
    its own error body `model` and the status it gives invalid requests (TGI 422, OpenAI 400)."""
    described = {
        validation_status: "invalid request (the message names the field and the limit)",
        408: "the body did not arrive within body_read_timeout",
        413: "body over the size limit",
        415: "body not JSON",
        424: "the generation failed",
        429: "no memory to start the request and the queue is full; see Retry-After",
        503: "the model is loading, the server is draining, or the request was not started within queue_timeout "
        "(error_type queue_timeout, with Retry-After)",
        504: "the request outlived its timeout",
    }
    return {status: {"model": model, "description": text} for status, text in described.items()}
