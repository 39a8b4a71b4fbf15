"""The FastAPI application: `create_app` and the lifespan that loads the models once.

Loading takes seconds, so the lifespan starts it in a thread and the server answers at once: /health is
503 until the models are loaded, then 200. Tests hand `create_app` an engine they loaded once; then the
app is ready as soon as it starts.

`serve` runs the app under uvicorn and drains it on SIGTERM (`drain`): uvicorn's own shutdown closes the
listening socket and, after a timeout, the connections, so that a stream in flight would end mid-body
without its last event; draining first keeps the socket open (/health answers 503 ``draining``, a new
request 503), lets the requests in flight finish, ends the rest with an error event, and only then hands
over to uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from app import __version__
from app.api import native, openai, ops, tokenize, ui
from app.api.body import BodyGuard
from app.api.errors import OPENAI_PREFIX, error_body, install_error_handlers
from app.api.schemas import ChatCompletionChunk
from app.api.security import REQUEST_ID_HEADER, APIKeyGuard, RequestID, TrustedHost
from app.engine.engine import Engine
from app.service.metrics import Metrics
from app.service.runtime import Runtime
from app.service.settings import Settings, is_loopback

log = logging.getLogger(__name__)

_DESCRIPTION = """Speculative-decoding text generation: a cheap draft proposes, the target verifies in one pass.

* **Native API**, compatible with text-generation-inference: `/generate`, `/generate_stream`, `POST /`.
* **OpenAI API**: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.
* **Operations**: `/health`, `/info`, `/metrics`.
* **Playground**: `GET /` in a browser streams an answer coloured by what proposed each token.

Both generation APIs take an extra `speculative` object (`num_draft_tokens`, `draft`) and report what the
draft bought in `speculative` details.
"""


async def _in_own_thread(fn: Callable[[], Any]) -> Any:
    """`fn()` in a thread that ends with it; awaited without blocking the event loop.

    Not `asyncio.to_thread`: loading runs torch's OpenMP code, and libgomp keeps a pool of helper threads for
    every thread that ran parallel code, until that thread exits. A pooled executor thread never exits, so its
    helpers would count against the CPUs for as long as the server runs, and once libgomp manages more threads
    than there are CPUs it stops spinning between parallel regions: every one of the ~150 regions of a
    decoding step then waits for a sleeping helper to wake. Measured on 2 cores: the worker's target forward
    took 32.6 ms per token with the loader's pool alive against ~20 ms in a plain process."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(set_outcome: Callable[[Any], None], outcome: Any) -> None:
        if not done.done():
            set_outcome(outcome)

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, done.set_result, result)

    thread = threading.Thread(target=run, name="specserve-load", daemon=True)
    thread.start()
    try:
        return await done
    finally:
        await asyncio.to_thread(thread.join)  # its OpenMP pool is gone once it has exited


async def _load(app: FastAPI, settings: Settings, metrics: Metrics) -> None:
    try:
        runtime = await _in_own_thread(lambda: Runtime.load(settings, metrics))
    except Exception as exc:
        log.exception("loading %s failed", settings.target)
        # Only the exception's type: /health is open to anyone, and its text may name paths, hosts or the
        # Hub's answers; the log above has it whole.
        app.state.load_error = f"{type(exc).__name__}; the server's log says why"
        return
    if app.state.closing:
        runtime.close()
        return
    app.state.runtime = runtime
    _log_ready(runtime)


def _log_ready(runtime: Runtime) -> None:
    i = runtime.info
    log.info(
        "ready: %s (%s, %s, context %d), draft %s, k=%d", i.model_id, i.dtype, i.device, i.context_length,
        i.default_draft, i.num_draft_tokens,
    )  # fmt: skip


def _limit(prop: dict[str, Any], type_: str, key: str, value: int) -> None:
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == type_:
            branch[key] = value


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, made exact: the 422 FastAPI documents for every body is 400 on the OpenAI routes, the
    configured limits are in it, and so is the schema of the streamed chat chunks."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path, operations in schema.get("paths", {}).items():
        if path.startswith(OPENAI_PREFIX):
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    if "/HTTPValidationError" not in json.dumps(schema["paths"]):
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
    chunk = ChatCompletionChunk.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(chunk.pop("$defs", {}))
    components["ChatCompletionChunk"] = chunk

    settings: Settings = app.state.settings
    if settings.named_api_keys:
        schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"apiKey": []}]
        for path in open_paths(settings):
            for operation in schema["paths"].get(path, {}).values():
                operation["security"] = []
    runtime: Runtime | None = app.state.runtime
    params = components["GenerateParameters"]["properties"]
    _limit(params["max_new_tokens"], "integer", "maximum", settings.max_new_tokens)
    _limit(params["stop"], "array", "maxItems", settings.max_stop_sequences)
    for name, fields in (
        ("CompletionRequest", ("max_tokens",)),
        ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens")),
    ):
        props = components[name]["properties"]
        for field in fields:
            _limit(props[field], "integer", "maximum", settings.max_new_tokens)
        _limit(props["stop"], "array", "maxItems", settings.max_stop_sequences)
    if runtime is None:
        return schema  # the drafts and the vocabulary are not known yet: not cached, so that they are added
    components["SpeculativeParameters"]["properties"]["draft"]["anyOf"][0]["enum"] = list(runtime.info.drafts)
    for branch in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if branch.get("items", {}).get("type") == "integer":
            branch["items"]["maximum"] = runtime.info.vocab_size - 1
    app.openapi_schema = schema
    return schema


def _log_tenancy(settings: Settings) -> None:
    """Say at start-up who may use the server and who may read what others left in its caches: both are choices,
    and the keyless ones defaults."""
    names = list(settings.named_api_keys)
    if not names and not is_loopback(settings.host):
        log.warning(
            "serving %s without an API key (allow_unauthenticated): anyone who reaches it may use it", settings.host
        )
    strict = settings.isolation == "strict"
    if names:
        rest = "its own tenant" if strict else "its key's"
        log.info(
            "API keys %s: each key is a tenant (refined by cache_salt); a request without cache_salt is %s",
            ", ".join(names),
            rest,
        )
    elif strict:
        log.info("no API key; isolation strict: each request without cache_salt is a tenant of its own")
    else:
        log.info(
            "no API key: requests without cache_salt share one tenant (the prefix cache and the index of earlier "
            "answers, whose effect shows in the responses); set API keys or --isolation strict to keep them apart"
        )


def open_paths(settings: Settings) -> tuple[str, ...]:
    """The paths served without the API key."""
    return ("/health", "/metrics") if settings.metrics_public else ("/health",)


def create_app(settings: Settings | None = None, engine: Engine | None = None) -> FastAPI:
    """The service: routes, error handlers, body guard, metrics; with `engine`, served as is instead of loaded."""
    settings = settings or Settings()
    metrics = Metrics(settings.served_model_names[0])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _log_tenancy(settings)
        loader = None
        if engine is not None:
            app.state.runtime = Runtime.from_engine(engine, settings, metrics)
            _log_ready(app.state.runtime)
        else:
            log.info("loading %s with draft %s", settings.target, settings.draft)
            loader = asyncio.create_task(_load(app, settings, metrics))
        try:
            yield
        finally:
            app.state.closing = True
            if loader is not None and not loader.done():
                loader.cancel()
            if app.state.runtime is not None:
                await asyncio.to_thread(app.state.runtime.close)
                app.state.runtime = None

    app = FastAPI(
        title="specserve",
        version=__version__,
        description=_DESCRIPTION,
        lifespan=lifespan,
        strict_content_type=False,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.runtime = None
    app.state.load_error = None
    app.state.closing = False
    app.state.draining = False
    install_error_handlers(app)
    app.include_router(native.router)
    app.include_router(openai.router)
    app.include_router(ops.router)
    app.include_router(tokenize.router)
    app.include_router(ui.router)
    # The last added runs first: request id, Host, CORS (a preflight carries no key), API key, then the body guard
    # (so that a client without the key never gets to send a body).
    app.add_middleware(
        BodyGuard, max_bytes=settings.max_body_bytes, read_timeout=settings.body_read_timeout, metrics=metrics
    )
    keys = settings.named_api_keys
    if keys:
        app.add_middleware(
            APIKeyGuard,
            keys=keys,
            open_paths=open_paths(settings),
            metrics=metrics,
            open_pages=ui.PAGES,
        )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
            expose_headers=[REQUEST_ID_HEADER, "Retry-After"],
        )
    hosts = settings.trusted_hosts
    if hosts is not None:
        # Before CORS and the key: a rebound page's request is refused whatever else it carries.
        app.add_middleware(TrustedHost, hosts=hosts)
    app.add_middleware(RequestID)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


# What uvicorn's own shutdown gives the connections still open after a drain (a client slow to read its last
# events) before it cancels them: the drain has ended every request, so this is seconds, not the grace period.
_CLOSE_SECONDS = 3


async def drain(app: FastAPI, grace: float, hurry: asyncio.Event | None = None) -> None:
    """Get `app` ready to stop: admit nothing more (new requests 503, /health 503 ``draining``), give the
    requests held up to `grace` seconds to finish (less once `hurry` is set), then end the rest with an error,
    which a stream sends as its last event (and ``[DONE]`` on the OpenAI routes)."""
    app.state.draining = True
    runtime: Runtime | None = app.state.runtime
    if runtime is None:
        return
    scheduler = runtime.scheduler
    scheduler.drain()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    if scheduler.holding:
        log.info("draining: %d requests in flight get up to %g s to finish", scheduler.holding, grace)
    while scheduler.holding and loop.time() < deadline and not (hurry is not None and hurry.is_set()):
        await asyncio.sleep(0.05)
    if scheduler.holding:
        log.warning("ending %d requests unfinished at shutdown", scheduler.holding)
    message = "the server is shutting down"
    if hurry is None or not hurry.is_set():
        message += f": the request did not finish within the shutdown grace period of {grace:g} s"
    # Not waiting for the worker: it may be in the middle of a long step, and the requests have heard already.
    scheduler.stop(timeout=0, message=message)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains the app (`drain`) before uvicorn shuts down; a
    second one ends what is still running at once, a third is uvicorn's own (a second Ctrl-C: exit now)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace: float) -> None:
        super().__init__(config)
        self._app = app
        self._grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry: asyncio.Event | None = None
        self._drainer: asyncio.Task[None] | None = None
        self._signals = 0

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._hurry = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler, run between two bytecodes of the event loop: it only schedules.
        self._signals += 1
        if self._loop is None or self._signals > 2 or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        assert self._loop is not None and self._hurry is not None
        if self._drainer is None:
            self._drainer = self._loop.create_task(self._drain())
        else:
            self._hurry.set()

    async def _drain(self) -> None:
        try:
            await drain(self._app, self._grace, self._hurry)
        finally:
            self.should_exit = True  # uvicorn's shutdown from here


class _JSONErrorsH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, whose answer to a request it cannot parse (a malformed Content-Length, a
    broken request line) is the API's JSON error, in the shape of the API its request line names, rather than a
    line of plain text."""

    _request_line = b""

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a request begins: its first line says which API it was for
            self._request_line = data.split(b"\r\n", 1)[0][:200]
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        openai = b" " + OPENAI_PREFIX.encode() in self._request_line
        message = "the HTTP request is malformed: its request line or a header (Content-Length, say) cannot be parsed"
        body = json.dumps(error_body("validation", message, openai)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()


class _TimedFlow(FlowControl):
    """uvicorn's flow control, whose wait for a client to read (the connection's buffers full) lasts at most
    `timeout` seconds; then `stalled` is called."""

    def __init__(self, transport: asyncio.Transport, timeout: float, stalled: Callable[[], None]) -> None:
        super().__init__(transport)
        self._timeout = timeout
        self._stalled = stalled

    async def drain(self) -> None:
        try:
            await asyncio.wait_for(super().drain(), self._timeout)
        except TimeoutError:
            self._stalled()


class _SlowClientGuard(_JSONErrorsH11):
    """The server's HTTP/1.1 protocol: closes a connection whose request head does not arrive within
    `header_timeout` seconds of the connection's opening or of its first byte (uvicorn times out idle kept-alive
    connections only, so a client sending its headers a byte at a time held a connection forever), and one
    whose client reads nothing of an answer for `send_timeout` seconds. The latter is aborted (a graceful close
    would wait for the client to read what is buffered): the app hears a disconnect, so a stream's generation
    is cancelled as a departed client's. `serve` makes a subclass with the settings' values."""

    header_timeout: float = 20.0
    send_timeout: float = 30.0
    metrics: Metrics | None = None
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _TimedFlow(transport, self.send_timeout, self._send_stalled)
        self._expect_head()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_timer is None:
            self._expect_head()  # the first byte of a kept-alive connection's next request
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self._header_timer is not None:
            self._header_timer.cancel()  # the head is in
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _expect_head(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._head_late)

    def _head_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.warning(
                "closing a connection from %s: no whole request head within %g s (header_read_timeout)",
                _peer(self.client),
                self.header_timeout,
            )
            self._closed("header_timeout")
            self.transport.close()

    def _send_stalled(self) -> None:
        if self.transport.is_closing():
            return
        log.warning(
            "closing a connection to %s: it read nothing of its answer for %g s (send_timeout)",
            _peer(self.client),
            self.send_timeout,
        )
        self._closed("send_timeout")
        if self.cycle is not None:
            self.cycle.disconnected = True  # the answer's next writes return at once, as after any disconnect
        self.transport.abort()

    def _closed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.connection_closed(reason)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def uvicorn_config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    """uvicorn's configuration of `app` (made by `create_app(settings)`): its address, its timeouts for idle, slow
    and stalled clients, and its connection limit."""
    guard = type(
        "SlowClientGuard",
        (_SlowClientGuard,),
        {
            "header_timeout": settings.header_read_timeout,
            "send_timeout": settings.send_timeout,
            "metrics": app.state.metrics,
        },
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        timeout_graceful_shutdown=_CLOSE_SECONDS,
        timeout_keep_alive=settings.keep_alive_timeout,
        # uvicorn counts the connection asking among the open ones: one more lets max_connections be served.
        limit_concurrency=settings.max_connections + 1,
        http=guard,
    )


def serve(settings: Settings) -> bool:
    """Serve the models `settings` name over HTTP until SIGTERM or SIGINT, then drain (`drain`) and stop.

    False when the server could not start (the port taken, say)."""
    app = create_app(settings)
    server = _DrainingServer(uvicorn_config(app, settings), app, settings.shutdown_grace_period)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the signal again after a forced exit
        server.run()
    return server.started
