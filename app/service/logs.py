"""Logging of the service: plain lines for a terminal, or one JSON object per line for a log collector.

Every record logged while a request is served carries that request's id (the ``X-Request-ID`` it came with,
or one the server made up; see `app.api.security.RequestID`): ``[id]`` after the logger's name in text lines,
``"request_id"`` in JSON. Code outside the request's task (the worker thread) passes it as
``extra={"request_id": ...}``.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

# The id of the request being served in this context; None outside a request.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("specserve_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request this code runs for, if any."""
    return request_id_var.get()


class _RequestIdFilter(logging.Filter):
    """Give every record a `request_id` (None outside a request) and the `request_tag` text lines show."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or request_id_var.get()
        record.request_id = rid
        record.request_tag = f" [{rid}]" if rid else ""
        return True


class _NotTwice(logging.Filter):
    """Drop a record whose exception was logged already: the app's handler of unexpected errors logs the
    traceback under the request's id, then Starlette raises it again and uvicorn would log it a second time."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not getattr(exc, "specserve_logged", False)


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """Send every logger (uvicorn's included) to stderr in `log_format` (``text`` or ``json``)."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.addFilter(_NotTwice())
    if log_format == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        # uvicorn's loggers would otherwise keep handlers of their own and log twice.
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
