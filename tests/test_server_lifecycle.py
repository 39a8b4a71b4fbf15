"""A real `specserve serve` process through failures and a shutdown.

A fault injected into the worker's step (tests/_faulty_server.py) fails that step's requests at once and the
worker goes on; a fault that ends the worker thread turns /health and every request into 503 at once. SIGTERM
drains: /health says so, new requests are refused, requests in flight finish within the grace period, and
the rest end with their error event (and ``[DONE]``) before the process exits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _server import metric, server_process

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy counts on for hundreds of tokens
MODEL = "smollm2-135m-instruct"
LONG = {"inputs": COUNTING, "parameters": {"max_new_tokens": 1500}}
# Target-only decoding: one token per step, so that 1,500 tokens take far longer than the grace period.
BASE_ARGS = ("--dtype", "float32", "--draft", "none", "--log-level", "warning")
FAULTY = [sys.executable, str(Path(__file__).with_name("_faulty_server.py"))]


def _events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


def _stream(url: str, path: str, body: dict, started: threading.Event) -> list[str]:
    """Every event of a streamed answer, read to its end (httpx raises on a body cut short); `started` is set
    at the first one."""
    events = []
    with httpx.Client(timeout=120) as client, client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        for data in _events(r.iter_lines()):
            events.append(data)
            started.set()
    return events


def _start_stream(pool: ThreadPoolExecutor, url: str, path: str, body: dict) -> Future[list[str]]:
    """A stream read in `pool`, returned once its first event has arrived (so its request is running)."""
    started = threading.Event()
    future = pool.submit(_stream, url, path, body, started)
    while not started.wait(0.05):
        if future.done():
            future.result()  # raises what went wrong
            pytest.fail("the stream ended before its first event")
    return future


def test_worker_faults_over_the_wire(tmp_path: Path, target_path: Path) -> None:
    trigger = tmp_path / "fault"
    env = {**os.environ, "FAULTY_SERVER_TRIGGER": str(trigger)}
    args = (*BASE_ARGS, "--request-timeout", "60")
    with server_process(tmp_path / "serve.log", *args, env=env, command=FAULTY) as server:
        url = server.url
        # A step that fails as a whole fails its request at once (not after the 60 s timeout), as a 424.
        trigger.write_text("step")
        t0 = time.monotonic()
        failed = httpx.post(f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}}, timeout=60)
        assert time.monotonic() - t0 < 20
        assert failed.status_code == 424, failed.text
        assert failed.json() == {
            "error": "generation failed: the step this request shared with others failed (RuntimeError); retry it",
            "error_type": "generation",
        }
        assert not trigger.exists(), "the fault was raised inside the worker's step"
        # A stream hit mid-way ends with the error event.
        with ThreadPoolExecutor(1) as pool:
            stream = _start_stream(pool, url, "/generate_stream", LONG)
            trigger.write_text("step")
            events = [json.loads(e) for e in stream.result(timeout=60)]
        assert "token" in events[0]
        assert events[-1] == {
            "error": "generation failed: the step this request shared with others failed (RuntimeError); retry it",
            "error_type": "generation",
        }
        # The worker went on: the server is healthy, serves the next request, and its gauges came back to 0.
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "error": None}
        ok = httpx.post(f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}}, timeout=60)
        assert ok.status_code == 200 and ok.json()["generated_text"]
        deadline = time.monotonic() + 10
        while metric(url, "specserve_num_requests_running"):
            assert time.monotonic() < deadline, "the running gauge stayed up"
            time.sleep(0.05)
        assert metric(url, "specserve_requests_total", outcome="error", finish_reason="none") == 2

        # A fault that ends the worker thread: the request it held fails at once, /health is 503 (so that an
        # orchestrator restarts the server) and every later request is refused at once.
        with ThreadPoolExecutor(1) as pool:
            stream = _start_stream(pool, url, "/generate_stream", LONG)
            trigger.write_text("fatal")
            events = [json.loads(e) for e in stream.result(timeout=60)]
        assert events[-1]["error_type"] == "unavailable"
        assert "the worker stopped (InjectedFatal)" in events[-1]["error"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and "InjectedFatal" in health.json()["error"]
        assert "injected fatal fault" not in health.text  # the exception's text is for the log only
        t0 = time.monotonic()
        refused = httpx.post(f"{url}/generate", json=LONG, timeout=60)
        refused_oai = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert time.monotonic() - t0 < 5
        assert refused.status_code == 503 and "restart" in refused.json()["error"]
        assert refused_oai.status_code == 503 and refused_oai.json()["error"]["code"] == "unavailable"
        assert metric(url, "specserve_num_requests_running") == 0
    assert "the worker stopped" in server.log.read_text()


def test_sigterm_drains_then_exits(tmp_path: Path, target_path: Path) -> None:
    # Long enough for the short request to finish on a slow, shared machine (three requests stepping in turn).
    grace = 6
    args = (*BASE_ARGS, "--max-concurrent-requests", "3", "--shutdown-grace-period", str(grace))
    with server_process(tmp_path / "serve.log", *args) as server, ThreadPoolExecutor(3) as pool:
        url = server.url
        long_oai = _start_stream(
            pool,
            url,
            "/v1/completions",
            # Greedy: OpenAI's default temperature of 1 may sample an end of text within the grace period.
            {"prompt": COUNTING, "max_tokens": 1500, "temperature": 0, "stream": True, "model": MODEL},
        )
        long_tgi = _start_stream(pool, url, "/generate_stream", LONG)
        short = _start_stream(pool, url, "/generate_stream", {"inputs": COUNTING, "parameters": {"max_new_tokens": 4}})
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        # Draining: still answering, but not admitting.
        deadline = time.monotonic() + 2
        while (health := httpx.get(f"{url}/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health did not turn to draining"
            time.sleep(0.02)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{url}/generate", json={"inputs": "Hi"}, timeout=10)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]

        # A request in flight that finishes within the grace period finishes as usual.
        events = [json.loads(e) for e in short.result(timeout=grace + 10)]
        assert len(events) == 4 and events[-1]["generated_text"] and events[-1]["token"]
        # The others end with their error event when the grace period is over; the OpenAI stream with [DONE].
        oai = long_oai.result(timeout=grace + 10)
        assert oai[-1] == "[DONE]"
        error = json.loads(oai[-2])["error"]
        assert error["code"] == "unavailable"
        assert error["message"] == (
            f"the server is shutting down: the request did not finish within the shutdown grace period of {grace} s"
        )
        assert all("choices" in json.loads(e) for e in oai[:-2])
        tgi = [json.loads(e) for e in long_tgi.result(timeout=grace + 10)]
        assert tgi[-1]["error_type"] == "unavailable" and "grace period" in tgi[-1]["error"]
        assert all("token" in e for e in tgi[:-1])

        assert server.proc.wait(timeout=15) == 0
        # Not before the grace period (the long requests had all of it), not much after.
        assert grace - 0.5 < time.monotonic() - signalled < grace + 10
