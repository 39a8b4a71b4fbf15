"""The FastAPI application: `create_app` and the lifespan that loads the models once.

Loading takes seconds, so the lifespan starts it in a thread and the server answers at once: /health is
503 until the models are loaded, then 200. Tests hand `create_app` an engine they loaded once; then the
app is ready as soon as it starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi

from app import __version__
from app.api import native, openai, ops
from app.api.body import BodyGuard
from app.api.errors import OPENAI_PREFIX, install_error_handlers
from app.api.schemas import ChatCompletionChunk
from app.api.security import REQUEST_ID_HEADER, APIKeyGuard, RequestID
from app.engine.generation import Engine
from app.metrics import Metrics
from app.runtime import Runtime
from app.settings import Settings

log = logging.getLogger(__name__)

_DESCRIPTION = """Speculative-decoding text generation: a cheap draft proposes, the target verifies in one pass.

* **Native API**, compatible with text-generation-inference: `/generate`, `/generate_stream`, `POST /`.
* **OpenAI API**: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.
* **Operations**: `/health`, `/info`, `/metrics`.

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
        app.state.load_error = f"{type(exc).__name__}: {exc}"
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
    if settings.api_key is not None:
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


def open_paths(settings: Settings) -> tuple[str, ...]:
    """The paths served without the API key."""
    return ("/health", "/metrics") if settings.metrics_public else ("/health",)


def create_app(settings: Settings | None = None, engine: Engine | None = None) -> FastAPI:
    """The service: routes, error handlers, body guard, metrics; with `engine`, served as is instead of loaded."""
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
    install_error_handlers(app)
    app.include_router(native.router)
    app.include_router(openai.router)
    app.include_router(ops.router)
    # The last added runs first: request id, CORS (a preflight carries no key), API key, then the body guard
    # (so that a client without the key never gets to send a body).
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes, metrics=metrics)
    if settings.api_key is not None:
        app.add_middleware(
            APIKeyGuard, api_key=settings.api_key.get_secret_value(), open_paths=open_paths(settings), metrics=metrics
        )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
            expose_headers=[REQUEST_ID_HEADER, "Retry-After"],
        )
    app.add_middleware(RequestID)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
