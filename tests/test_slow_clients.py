"""Slow clients (issue 67, finding 6): a client that stops reading its stream is cut off (its generation
cancelled as ``client_stalled``, its memory freed) while the worker serves everyone else; a connection whose
request head does not arrive in time is closed; and the server is started with a connection limit.

The scheduler is driven directly on a tiny engine, and the HTTP checks run a real uvicorn in this process (its
sockets' buffers small, so that a client reading nothing fills them within a few hundred events), serving the
same tiny engine with the configuration `specserve serve` builds (`server.uvicorn_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from app.api.server import create_app, uvicorn_config
from app.engine.engine import Engine
from app.engine.step import GenerationParams
from app.service.events import RequestFailed
from app.service.metrics import Metrics
from app.service.scheduler import Scheduler
from app.service.settings import Settings
from tests.conftest import _make_tiny_model, _word_tokenizer

MODEL = "tiny"
PROMPT = [1, 2, 3]
LONG = GenerationParams(max_new_tokens=3000, ignore_eos=True, num_draft_tokens=0)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """A tiny float32 target (a word tokenizer without an end of sequence): generations run to max_new_tokens."""
    model = _make_tiny_model(seed=3, vocab_size=64, max_seq_len=4096)
    return Engine(model, _word_tokenizer(64), {}, "none", 0, draft_schedule="fixed", draft_p_min=0.0)


def _outcome(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "specserve_requests_total", {"model_name": MODEL, "outcome": outcome, "finish_reason": "none"}
    )
    return value or 0.0


def _generated(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("specserve_generation_tokens_total", {"model_name": MODEL}) or 0.0


async def _until(done: Callable[[], bool], what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def _tokens(scheduler: Scheduler, max_new_tokens: int) -> int:
    """How many tokens a request of `max_new_tokens` got, read to its end."""
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True, num_draft_tokens=0)
    n = 0
    async for event in scheduler.submit(PROMPT, params, "none", 60).events():
        n += len(event.tokens)
        if event.finished is not None:
            return n
    raise AssertionError("no finished event")


@pytest.mark.anyio
async def test_a_stream_past_its_backlog_is_cancelled_and_freed(engine: Engine) -> None:
    """The consumer takes the first event and reads no more: once more than 16 tokens wait for it, the request is
    cancelled as client_stalled, long before its 3,000 tokens; its memory goes back to zero, the worker serves the
    next request, and the consumer, should it read again, hears why."""
    metrics = Metrics(MODEL)
    s = Scheduler(engine, max_running=2, max_waiting=2, metrics=metrics, max_backlog=16)
    s.start()
    try:
        events = s.submit(PROMPT, LONG, "none", 60).events()
        await anext(events)
        await _until(lambda: _outcome(metrics, "client_stalled") == 1, "the stalled stream was not cut off")
        await _until(lambda: s.kv_held == 0 and s.admitted == 0, "the stalled request's memory was not freed")
        assert s.holding == 0
        assert _generated(metrics) < 200, "the generation ran on for a client that read nothing"
        assert await _tokens(s, 5) == 5
        with pytest.raises(RequestFailed) as failed:
            await anext(events)
        assert failed.value.kind == "client_stalled"
        assert "more than a stream may hold (16)" in failed.value.message
        assert _outcome(metrics, "cancelled") == 0
    finally:
        s.stop()


@pytest.mark.anyio
async def test_a_consumer_that_holds_an_event_past_the_stall_timeout_is_cut_off(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No backlog bound: the consumer holds the first event (its route stuck writing it) past the stall timeout;
    the next step's arrival cancels the request. A consumer that gives up sooner is a plain cancel."""
    real = engine.step_batch

    def slow_step(gens):  # a step of a few milliseconds: the generation outlasts the timeout on any machine
        time.sleep(0.002)
        return real(gens)

    monkeypatch.setattr(engine, "step_batch", slow_step)
    metrics = Metrics(MODEL)
    s = Scheduler(engine, max_running=2, max_waiting=2, metrics=metrics, stall_timeout=0.3)
    s.start()
    try:
        quick = s.submit(PROMPT, LONG, "none", 60).events()
        await anext(quick)
        await quick.aclose()  # leaves at once: a client gone, not a stalled one
        await _until(lambda: _outcome(metrics, "cancelled") == 1, "the cancel was not counted")

        held = s.submit(PROMPT, LONG, "none", 60).events()
        await anext(held)
        await _until(lambda: _outcome(metrics, "client_stalled") == 1, "the held stream was not cut off")
        await _until(lambda: s.kv_held == 0, "the stalled request's memory was not freed")
        assert _generated(metrics) < LONG.max_new_tokens, "the generation ran on for a client that read nothing"
        assert await _tokens(s, 3) == 3
        await held.aclose()
        assert _outcome(metrics, "cancelled") == 1, "the stalled request was counted once"
    finally:
        s.stop()


# --- over HTTP: a real uvicorn in this process -------------------------------------------------------------------

_BUFFER = 4096  # bytes of each socket buffer: a client reading nothing blocks the server's writes quickly


@contextlib.contextmanager
def _serving(engine: Engine, **values: Any) -> Iterator[tuple[int, FastAPI]]:
    """uvicorn serving `engine` on 127.0.0.1 with `values` as settings, configured as `specserve serve` does; yields
    its port and the app."""
    settings = Settings(model_name=MODEL, **values)
    app = create_app(settings, engine)
    config = uvicorn_config(app, settings)
    sock = socket.socket()
    # Accepted connections inherit the listening socket's buffer sizes (and lose their growth).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started or app.state.runtime is None:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield sock.getsockname()[1], app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def _connect(port: int) -> socket.socket:
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
    client.settimeout(10)
    client.connect(("127.0.0.1", port))
    return client


def _closed_by_server(client: socket.socket) -> bool:
    """Whether the server closed `client` (reading what it sent until the end); False if it is still open after the
    socket's timeout."""
    try:
        while client.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _closes(app: FastAPI, reason: str) -> float:
    return app.state.metrics.registry.get_sample_value(
        "specserve_connections_closed_total", {"model_name": MODEL, "reason": reason}
    )


def _wait(done: Callable[[], bool], what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_client_that_reads_nothing_is_disconnected_and_its_generation_cancelled(engine: Engine) -> None:
    """A streaming client reads nothing: once the connection's buffers are full and nothing was read for the send
    timeout, the server aborts the connection and cancels the generation (client_stalled), its memory freed,
    while another client is served. No backlog bound here: the send timeout does it."""
    values = {"send_timeout": 0.5, "max_stream_backlog": 100_000, "max_new_tokens": 4000, "stream_keepalive": 0}
    with _serving(engine, **values) as (port, app):
        scheduler = app.state.runtime.scheduler
        metrics: Metrics = app.state.metrics
        body = json.dumps({"inputs": "t1 t2 t3", "parameters": {"max_new_tokens": 4000}}).encode()
        head = "POST /generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        stalled = _connect(port)
        stalled.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait(lambda: _closes(app, "send_timeout") == 1, "the stalled connection was not closed")
        _wait(lambda: scheduler.kv_held == 0 and scheduler.holding == 0, "the stalled request's memory was held")
        assert metrics.registry.get_sample_value(
            "specserve_requests_total", {"model_name": MODEL, "outcome": "client_stalled", "finish_reason": "none"}
        )
        assert _generated(metrics) < 4000, "the generation ran to its end for a client that read nothing"
        assert _closed_by_server(stalled)
        stalled.close()
        answer = httpx.post(
            f"http://127.0.0.1:{port}/generate", json={"inputs": "t1 t2", "parameters": {"max_new_tokens": 5}}
        )
        assert answer.status_code == 200 and answer.json()["generated_text"]


def test_a_request_head_that_does_not_arrive_in_time_closes_the_connection(engine: Engine) -> None:
    """Half a request head, then nothing: the connection is closed after header_read_timeout (uvicorn alone held it
    open forever). A kept-alive connection idle for longer than that is not: its idle time is keep-alive's."""
    with _serving(engine, header_read_timeout=0.3) as (port, app):
        slow = _connect(port)
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _closed_by_server(slow), "the connection was held open"
        slow.close()
        assert _closes(app, "header_timeout") == 1

        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert client.get("/health").status_code == 200
            time.sleep(0.5)  # idle on its kept-alive connection, longer than the head's timeout
        assert _closes(app, "header_timeout") == 1


def test_the_server_limits_its_connections(engine: Engine) -> None:
    """uvicorn's configuration carries the settings' limits; over max_connections a request is answered 503."""
    settings = Settings(max_connections=7, keep_alive_timeout=12, header_read_timeout=3, send_timeout=4)
    config = uvicorn_config(create_app(settings, engine), settings)
    assert config.limit_concurrency == 8  # uvicorn counts the connection asking too
    assert config.timeout_keep_alive == 12
    assert (config.http.header_timeout, config.http.send_timeout) == (3, 4)

    with _serving(engine, max_connections=1) as (port, _), httpx.Client(base_url=f"http://127.0.0.1:{port}") as first:
        assert first.get("/health").status_code == 200  # its connection stays open, kept alive
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
        assert first.get("/health").status_code == 200
