"""Hostile and careless input against a real `specserve serve` (issue 35): never a 5xx, never a body of more than
a few KB, one log line with the request's id for every refusal; and the mechanisms that keep such requests from
stalling others (the pre-admission pool, OpenMP threads that sleep instead of spinning).

One server process serves the module (JSON logs, so that each line's request id can be read back).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _server import ServerProcess, server_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api import admission
from app.api import body as body_module
from app.engine.decoding.grammar import MAX_ALTERNATIVES, MAX_SCHEMA_DEPTH
from app.service.logs import _NotTwice

SMALL = 4096  # the most bytes an error body may take


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("hostile") / "serve.log"
    args = ("--dtype", "float32", "--draft", "ngram", "--max-new-tokens", "16", "--default-max-new-tokens", "4")
    args += ("--log-format", "json")
    with server_process(log, *args) as proc:
        yield proc


def _records(log: Path) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _app_lines(log: Path, rid: str) -> list[dict]:
    """The records of request `rid` other than uvicorn's access line."""
    return [r for r in _records(log) if r.get("request_id") == rid and r["logger"] != "uvicorn.access"]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _objects(n: int) -> list[dict]:
    return [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(n)]


DEEP_TEXT = "[" * 2000 + "]" * 2000
C = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]

# (method, path, JSON body or None, status, words of the message)
CASES = {
    "structured_outputs.json as text nested 2,000 deep": (
        "POST",
        C,
        {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": DEEP_TEXT}},
        400,
        ["structured_outputs.json", "nests deeper than"],
    ),
    "the same on chat": (
        "POST",
        CHAT,
        {"messages": MESSAGES, "max_tokens": 2, "structured_outputs": {"json": DEEP_TEXT}},
        400,
        ["structured_outputs.json"],
    ),
    "an object nested 60 deep, disable_additional_properties": (
        "POST",
        C,
        {
            "prompt": "x",
            "max_tokens": 2,
            "structured_outputs": {"json": _nested(60), "disable_additional_properties": True},
        },
        400,
        [f"over the limit of {MAX_SCHEMA_DEPTH}"],
    ),
    "the same as text, nested 450 deep": (
        "POST",
        C,
        {
            "prompt": "x",
            "max_tokens": 2,
            "structured_outputs": {"json": json.dumps(_nested(450)), "disable_additional_properties": True},
        },
        400,
        ["structured_outputs.json"],
    ),
    "a body nested 500 deep": (
        "POST",
        C,
        {"prompt": "x", "structured_outputs": {"json": _nested(250)}},
        400,
        ["nested too deeply"],
    ),
    "2,500 choices": (
        "POST",
        C,
        {"prompt": "x", "max_tokens": 2, "guided_choice": [f"c{i}" for i in range(2500)]},
        400,
        ["guided_choice", f"over the limit of {MAX_ALTERNATIVES}"],
    ),
    "an anyOf of 3,000 objects": (
        "POST",
        C,
        {"prompt": "x", "max_tokens": 2, "guided_json": {"anyOf": _objects(3000)}},
        400,
        ["guided_json", "anyOf of 3000"],
    ),
    "600 optional properties (llguidance's row limit at the first token)": (
        "POST",
        CHAT,
        {
            "messages": MESSAGES,
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(600)}},
                },
            },
        },
        400,
        ["response_format", "cannot run", "max is 2000"],
    ),
    "TGI grammar nested 2,000 deep": (
        "POST",
        "/generate",
        {"inputs": "x", "parameters": {"max_new_tokens": 2, "grammar": {"type": "json", "value": DEEP_TEXT}}},
        422,
        ["parameters.grammar.value"],
    ),
    "a model name of 900,000 characters": (
        "POST",
        C,
        {"prompt": "x", "model": "m" * 900_000},
        404,
        ["(900000 characters)"],
    ),
    "a model card of 60,000 characters": ("GET", "/v1/models/" + "m" * 60_000, None, 404, ["(60000 characters)"]),
    "a model card for tgi": ("GET", "/v1/models/tgi", None, 404, ["`tgi`"]),
    "an unknown path of 10,000 characters": ("GET", "/" + "p" * 10_000, None, 404, ["no route", "characters)"]),
}


@pytest.mark.parametrize("name", CASES)
def test_hostile_input_is_a_short_4xx_logged_once(server: ServerProcess, name: str) -> None:
    method, path, body, status, words = CASES[name]
    rid = uuid.uuid4().hex
    r = httpx.request(method, server.url + path, json=body, headers={"X-Request-ID": rid}, timeout=60)
    assert r.status_code == status, r.text[:500]
    assert len(r.content) < SMALL, len(r.content)
    err = r.json()["error"]
    message = err["message"] if isinstance(err, dict) else err
    for word in words:
        assert word in message, message
    assert r.headers["x-request-id"] == rid
    lines = _app_lines(server.log, rid)
    assert len(lines) == 1, lines
    assert f"refused with {status}" in lines[0]["message"]
    assert len(lines[0]["message"]) < 1000


def _raw(server: ServerProcess, request: bytes) -> bytes:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(("path", "openai"), [("/generate", False), ("/v1/completions", True)])
def test_a_malformed_content_length_is_a_json_400(server: ServerProcess, path: str, openai: bool) -> None:
    answer = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{{}}".encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert ("malformed" in error["message"]) if openai else ("malformed" in error)


# A structured-output constraint as the fuzz test sends it: nested, wide, or given as text.
_depths = st.integers(min_value=0, max_value=400)
_widths = st.integers(min_value=0, max_value=2500)


@st.composite
def _constraints(draw: st.DrawFn) -> dict:
    depth, width = draw(_depths), draw(_widths)
    shape = draw(st.sampled_from(["nested", "anyOf", "choice", "properties", "array"]))
    if shape == "nested":
        schema: object = _nested(depth)
    elif shape == "anyOf":
        schema = {"anyOf": _objects(width)}
    elif shape == "properties":
        schema = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(width)}}
    elif shape == "array":
        schema = json.loads("[" * max(depth, 1) + "]" * max(depth, 1))  # depth 0 would be no JSON at all
    else:
        return {"guided_choice": [f"c{i}" for i in range(max(width, 1))]}
    as_text = draw(st.booleans())
    value = json.dumps(schema) if as_text else schema
    field = draw(st.sampled_from(["structured_outputs", "guided_json", "response_format"]))
    if field == "structured_outputs":
        return {"structured_outputs": {"json": value, "disable_additional_properties": draw(st.booleans())}}
    if field == "guided_json":
        return {"guided_json": value}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(constraint=_constraints(), chat=st.booleans())
def test_fuzzed_structured_outputs_never_5xx(server: ServerProcess, constraint: dict, chat: bool) -> None:
    body = {"max_tokens": 1, **constraint, **({"messages": MESSAGES} if chat else {"prompt": "x"})}
    r = httpx.post(server.url + (CHAT if chat else C), json=body, timeout=120)
    assert r.status_code < 500, r.text[:500]
    assert r.status_code == 200 or len(r.content) < SMALL


# --- mechanisms, in process ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_pre_admission_work_runs_in_the_bounded_low_priority_pool(api_client, monkeypatch) -> None:
    """Tokenizing, compiling a grammar and reading the body run in `admission`'s threads, at most THREADS at once,
    at a lower priority: never on the event loop, never more of them than the pool has."""
    seen: list[tuple[str, int]] = []
    running = 0
    most = 0
    lock = threading.Lock()

    def watched(fn):
        def call(*args):
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
                nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform == "linux" else 0
                seen.append((threading.current_thread().name, nice))
            try:
                return fn(*args)
            finally:
                with lock:
                    running -= 1

        return call

    async with api_client() as client:
        runtime = client.app.state.runtime
        monkeypatch.setattr(runtime.tokenizer, "encode", watched(runtime.tokenizer.encode))
        monkeypatch.setattr(runtime.grammars, "check", watched(runtime.grammars.check))
        monkeypatch.setattr(body_module, "inspect_body", watched(body_module.inspect_body))
        body = {"prompt": "word " * 40, "max_tokens": 1, "guided_regex": "(a|b)+"}
        answers = await asyncio.gather(*(client.post(C, json=body) for _ in range(8)))
    assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
    assert len(seen) == 8 * 3  # each request: its body, its prompt, its grammar
    assert {name.split("_")[0] for name, _ in seen} == {admission.THREAD_NAME}
    assert most <= admission.THREADS
    if sys.platform == "linux":
        assert {nice for _, nice in seen} == {max(admission.NICENESS, os.getpriority(os.PRIO_PROCESS, 0))}


def test_an_exception_logged_by_the_app_is_not_logged_again() -> None:
    """The handler of unexpected errors logs the traceback under the request's id and marks the exception;
    uvicorn's own line about it (Starlette raises it again) is then dropped."""
    exc = RuntimeError("boom")
    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", (), None)
    record.exc_info = (RuntimeError, exc, None)
    assert _NotTwice().filter(record)
    exc.specserve_logged = True  # type: ignore[attr-defined]
    assert not _NotTwice().filter(record)
