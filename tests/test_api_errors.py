"""Every class of bad input gets a 4xx with a JSON body naming the problem; failures stay with their request.

The native routes answer as TGI does (``{error, error_type}``, 422), the OpenAI routes as OpenAI does
(``{error: {message, type, ...}}``, 400). None of these requests reaches the model, so they are cheap; the
last tests run real generations to show that a failing or overdue request ends alone, with an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from app.engine.drafting.base import Drafter, DraftSession
from app.engine.drafting.ngram import NgramDrafter
from app.engine.engine import Engine
from tests.conftest import FIXED_DRAFT

# The requests counter's sample for an outcome, on an app serving the default target.
ENDED = 'specserve_requests_total{finish_reason="none",model_name="smollm2-135m-instruct",outcome='

pytestmark = pytest.mark.anyio

P = {"max_new_tokens": 4}
LONG_PROMPT = "hello " * 7000  # about 7000 tokens: fits the context of 8192, not with 2048 more
HUGE = b"9" * 5000  # past the 4,300 digits Python converts to an int
LONG_INT = b"9" * 4300  # the longest it converts


def _native(parameters: dict, inputs: object = "Hi") -> dict:
    return {"inputs": inputs, "parameters": parameters}


# (body as JSON or raw bytes, expected status, words the message must contain)
NATIVE_CASES = {
    "invalid json": (b'{"inputs": "Hi", ', 422, ["not valid JSON"]),
    "not an object": ([1, 2], 422, ["JSON object"]),
    "missing inputs": ({"parameters": P}, 422, ["missing", "inputs"]),
    "inputs not a string": ({"inputs": 5}, 422, ["inputs", "string"]),
    "max_new_tokens as string": (_native({"max_new_tokens": "4"}), 422, ["max_new_tokens", "integer"]),
    "do_sample not bool": (_native({"do_sample": "yes"}), 422, ["do_sample", "boolean"]),
    "stop not a list": (_native({"stop": "x"}), 422, ["stop", "list"]),
    "parameters not an object": ({"inputs": "Hi", "parameters": 3}, 422, ["parameters"]),
    "empty prompt": (_native(P, ""), 422, ["inputs must not be empty"]),
    "prompt plus new tokens over the context": (
        _native({"max_new_tokens": 2048}, LONG_PROMPT),
        422,
        ["context of 8192 tokens"],
    ),
    "max_new_tokens 0": (_native({"max_new_tokens": 0}), 422, ["max_new_tokens", "greater than or equal to 1"]),
    "max_new_tokens over the limit": (_native({"max_new_tokens": 2049}), 422, ["max_new_tokens", "at most 2048"]),
    "negative temperature": (_native({**P, "temperature": -0.5}), 422, ["temperature", "greater than or equal to 0"]),
    "NaN temperature": (b'{"inputs": "Hi", "parameters": {"temperature": NaN}}', 422, ["temperature", "finite"]),
    # Sampling is supported (tests/test_api_sampling.py); what stays refused is a contradiction or an unusable value.
    "do_sample at temperature 0": (
        _native({**P, "do_sample": True, "temperature": 0}),
        422,
        ["temperature 0", "do_sample"],
    ),
    "temperature over the maximum": (
        _native({**P, "temperature": 700}),
        422,
        ["temperature", "less than or equal to 100"],
    ),
    "seed not an integer": (_native({**P, "do_sample": True, "seed": 2.5}), 422, ["parameters.seed", "integer"]),
    "top_p 0": (_native({**P, "top_p": 0}), 422, ["top_p", "greater than 0"]),
    "top_p over 1": (_native({**P, "top_p": 1.5}), 422, ["top_p", "less than or equal to 1"]),
    "top_k 0": (_native({**P, "top_k": 0}), 422, ["top_k", "greater than or equal to 1"]),
    "too many stop strings": (_native({**P, "stop": list("abcde")}), 422, ["at most 4 stop strings", "got 5"]),
    "empty stop string": (_native({**P, "stop": [""]}), 422, ["parameters.stop.0", "at least 1 character"]),
    "truncate 0": (_native({**P, "truncate": 0}), 422, ["truncate"]),
    "unknown draft": (
        _native({**P, "speculative": {"draft": "eagle"}}),
        422,
        ["unknown speculative.draft 'eagle'", "ngram"],
    ),
    "too many draft tokens": (_native({**P, "speculative": {"num_draft_tokens": 17}}), 422, ["num_draft_tokens"]),
    "unknown speculative field": (_native({**P, "speculative": {"k": 2}}), 422, ["speculative.k"]),
    "repetition penalty 0": (_native({**P, "repetition_penalty": 0}), 422, ["repetition_penalty", "greater than 0"]),
    "unsupported typical_p": (_native({**P, "typical_p": 0.5}), 422, ["typical_p: not supported"]),
    "non-UTF-8 bytes": (b'{"inputs": "caf\xe9"}', 422, ["not valid UTF-8", "0xe9"]),
    "escaped lone surrogate": (b'{"inputs": "a\\ud800b"}', 422, ["lone UTF-16 surrogate", "\\ud800"]),
    "nested too deeply": (b'{"inputs": "\\u00e9", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 422, ["nested"]),
    "no body": (b"", 422, ["body is missing"]),
    "integer of 5000 digits": (
        b'{"inputs": "Hi", "parameters": {"max_new_tokens": ' + HUGE + b"}}",
        422,
        ["parameters.max_new_tokens: an integer of 5000 digits is out of range"],
    ),
    "integer of 5000 digits in a list": (
        b'{"inputs": "Hi", "parameters": {"stop": ["a", ' + HUGE + b"]}}",
        422,
        ["parameters.stop.1: an integer of 5000 digits"],
    ),
    "integer of 4300 digits": (
        b'{"inputs": "Hi", "parameters": {"max_new_tokens": ' + LONG_INT + b"}}",
        422,
        ["parameters.max_new_tokens must be at most 2048, got 9999", "(an integer of 4300 digits)"],
    ),
    "seed of 4300 digits": (
        b'{"inputs": "Hi", "parameters": {"do_sample": true, "seed": ' + LONG_INT + b"}}",
        422,
        ["parameters.seed", "(an integer of 4300 digits)"],
    ),
    "long unknown draft": (_native({**P, "speculative": {"draft": "x" * 5000}}), 422, ["(5002 characters)"]),
}

OPENAI_CASES = {
    "invalid json": ("/v1/chat/completions", b"{", 400, ["not valid JSON"]),
    "missing messages": ("/v1/chat/completions", {"model": "m"}, 400, ["missing", "messages"]),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, ["messages", "at least 1"]),
    "unknown chat role": (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "Hi"}]},
        400,
        ["messages.0.role", "'wizard'", "user"],
    ),
    "content of a wrong type": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        ["messages.0.content"],
    ),
    "chat max_tokens over the limit": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5000, "temperature": 0},
        400,
        ["max_tokens must be at most 2048"],
    ),
    "chat temperature too small": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e-9},
        400,
        ["temperature", "0 (greedy) or at least 1e-06"],
    ),
    "n of 2 greedy": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "temperature": 0},
        400,
        ["n: 2 samples need sampling"],
    ),
    "unknown nested field": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi", "x": 1}]},
        400,
        ["messages.0.x: unknown field"],
    ),
    "missing prompt": ("/v1/completions", {"model": "m"}, 400, ["missing", "prompt"]),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, ["prompt: must not be empty"]),
    "an empty prompt in a list": ("/v1/completions", {"prompt": ["a", ""]}, 400, ["prompt 1 of the list", "empty"]),
    "no prompts": ("/v1/completions", {"prompt": []}, 400, ["prompt: must not be empty"]),
    "more prompts than places": ("/v1/completions", {"prompt": ["a"] * 49}, 400, ["49 generations", "(48:"]),
    "n greedy": ("/v1/completions", {"prompt": "Hi", "n": 2, "temperature": 0}, 400, ["n: 2 samples need sampling"]),
    "best_of over n": ("/v1/completions", {"prompt": "Hi", "best_of": 2}, 400, ["best_of: only best_of = n (1)"]),
    "token id out of range": ("/v1/completions", {"prompt": [1, 10**6]}, 400, ["token ids must lie in"]),
    "max_tokens 0": ("/v1/completions", {"prompt": "Hi", "max_tokens": 0, "temperature": 0}, 400, ["max_tokens"]),
    "top_p over 1": ("/v1/completions", {"prompt": "Hi", "top_p": 2}, 400, ["top_p"]),
    "stop of a wrong type": ("/v1/completions", {"prompt": "Hi", "stop": 3}, 400, ["stop"]),
    "non-UTF-8 bytes": ("/v1/completions", b'{"prompt": "\xff"}', 400, ["not valid UTF-8"]),
    "escaped lone surrogate": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
        400,
        ["lone UTF-16 surrogate"],
    ),
    "token id of 5000 digits": ("/v1/completions", b'{"prompt": [1, ' + HUGE + b"]}", 400, ["prompt.1: an integer"]),
    "max_tokens of 4300 digits": (
        "/v1/completions",
        b'{"prompt": "Hi", "max_tokens": ' + LONG_INT + b"}",
        400,
        ["max_tokens must be at most 2048", "(an integer of 4300 digits)"],
    ),
}


async def _post(client, path: str, body: object, headers: dict | None = None):
    if isinstance(body, bytes):
        return await client.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})
    return await client.post(path, json=body, headers=headers)


async def test_native_bad_input(api_client) -> None:
    async with api_client() as client:
        for name, (body, status, words) in NATIVE_CASES.items():
            r = await _post(client, "/generate", body)
            assert r.status_code == status, (name, r.text)
            err = r.json()
            assert err["error_type"] == "validation", name
            for word in words:
                assert word in err["error"], (name, err["error"])
            assert len(err["error"]) < 200, (name, "a value quoted whole")
        # The streaming route validates before it streams: the same 422, not an event.
        r = await _post(client, "/generate_stream", _native({"max_new_tokens": 0}))
        assert r.status_code == 422 and r.headers["content-type"] == "application/json"
        metrics = (await client.get("/metrics")).text
    assert f'{ENDED}"invalid"}} {len(NATIVE_CASES) + 1}.0' in metrics


async def test_openai_bad_input(api_client) -> None:
    async with api_client() as client:
        for name, (path, body, status, words) in OPENAI_CASES.items():
            r = await _post(client, path, body)
            assert r.status_code == status, (name, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error", name
            for word in words:
                assert word in err["message"], (name, err["message"])
            assert len(err["message"]) < 200, (name, "a value quoted whole")


async def test_prompt_over_max_input_tokens_names_the_limit(api_client) -> None:
    async with api_client(max_input_tokens=16) as client:
        r = await client.post("/generate", json=_native(P, "one two three " * 10))
        o = await client.post("/v1/completions", json={"prompt": "one two three " * 10})
    assert r.status_code == 422
    assert "over the limit of 16 tokens" in r.json()["error"]
    assert o.status_code == 400 and "over the limit of 16 tokens" in o.json()["error"]["message"]


async def test_body_limits_and_content_type(api_client) -> None:
    async with api_client(max_body_bytes=2048) as client:
        big = await client.post("/generate", json=_native(P, "x" * 4000))
        big_oai = await client.post("/v1/completions", json={"prompt": "x" * 4000})
        form = await client.post("/generate", content=b"inputs=Hi", headers={"content-type": "text/plain"})
        no_type = await client.post("/generate", content=b'{"inputs": "Hi", "parameters": {"max_new_tokens": 1}}')
        # An escaped surrogate pair is one character (an emoji), not a lone surrogate.
        pair = await _post(client, "/generate", b'{"inputs": "\\ud83d\\ude00", "parameters": {"max_new_tokens": 1}}')
        missing = await client.get("/nope")
        wrong_method = await client.get("/generate")
    assert big.status_code == 413 and "over the limit of 2048" in big.json()["error"]
    assert big_oai.status_code == 413 and "2048" in big_oai.json()["error"]["message"]
    assert form.status_code == 415 and "application/json" in form.json()["error"]
    # Nor is a body without a content type: a web page can send one to any origin without a CORS preflight.
    assert no_type.status_code == 415 and "Content-Type: application/json" in no_type.json()["error"]
    assert pair.status_code == 200, pair.text
    assert missing.status_code == 404 and missing.json()["error_type"] == "not_found"
    assert wrong_method.status_code == 405 and "GET" in wrong_method.json()["error"]


async def test_a_body_that_never_ends_is_408(api_client) -> None:
    """A client that stops sending mid-body is answered 408 once the read timeout is over, and the connection
    is to close (the rest of the body would otherwise be read as the next request)."""

    async def stalled():
        yield b'{"inputs": "Hi", '
        await asyncio.sleep(30)
        yield b"}"

    async with api_client(body_read_timeout=0.5) as client:
        t0 = time.monotonic()
        native = await client.post("/generate", content=stalled(), headers={"content-type": "application/json"})
        oai = await client.post("/v1/completions", content=stalled(), headers={"content-type": "application/json"})
        waited = time.monotonic() - t0
        metrics = (await client.get("/metrics")).text
    assert native.status_code == 408 and oai.status_code == 408
    assert native.json() == {
        "error": "the request body did not arrive within 0.5 s (17 bytes came)",
        "error_type": "request_timeout",
    }
    assert oai.json()["error"]["code"] == "request_timeout"
    assert native.headers["connection"] == "close"
    assert waited < 5
    assert f'{ENDED}"invalid"}} 2.0' in metrics


class _ExplodingDraft(Drafter, DraftSession):
    """A draft whose every proposal raises, as a broken draft model would."""

    name = "boom"

    def __init__(self) -> None:
        DraftSession.__init__(self)

    def session(self, capacity: int) -> _ExplodingDraft:
        return self

    def propose(self, token_ids, k: int, p_min: float = 0.0) -> list[int]:
        raise RuntimeError("draft exploded")


@pytest.fixture(scope="module")
def fragile_engine(api_engine) -> Engine:
    drafters = {"ngram": NgramDrafter(), "boom": _ExplodingDraft()}
    return Engine(
        api_engine.target,
        api_engine.tokenizer,
        drafters,
        "ngram",
        4,
        **FIXED_DRAFT,
    )


async def test_a_failing_request_fails_alone(api_client, fragile_engine, sse_data) -> None:
    good = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 10}}
    bad = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 10, "speculative": {"draft": "boom"}}}
    async with api_client(engine=fragile_engine) as client:
        alone = (await client.post("/generate", json=good)).json()["generated_text"]
        failed, streamed, together = await asyncio.gather(
            client.post("/generate", json=bad),
            client.post("/generate_stream", json=bad),
            client.post("/generate", json=good),
        )
        after = await client.post("/generate", json=good)
        health = await client.get("/health")
        metrics = (await client.get("/metrics")).text
    assert failed.status_code == 424
    assert failed.json() == {"error": "generation failed: RuntimeError: draft exploded", "error_type": "generation"}
    events = [json.loads(d) for d in sse_data(streamed.text)]
    assert streamed.status_code == 200
    assert "token" in events[0]  # the prefill ran; the first draft-and-verify step failed
    assert events[-1] == {"error": "generation failed: RuntimeError: draft exploded", "error_type": "generation"}
    assert together.json()["generated_text"] == alone == after.json()["generated_text"]
    assert health.status_code == 200
    assert f'{ENDED}"error"}} 2.0' in metrics


async def test_timeout_ends_with_an_error(api_client, sse_data, caplog) -> None:
    body = {"inputs": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "parameters": {"max_new_tokens": 1000}}
    caplog.set_level(logging.INFO)
    async with api_client(request_timeout=0.5) as client:
        t0 = time.monotonic()
        r = await client.post("/generate", json=body)
        s = await client.post("/generate_stream", json=body)
        elapsed = time.monotonic() - t0
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 504
    assert r.json()["error_type"] == "timeout" and "0.5 s" in r.json()["error"]
    last = json.loads(sse_data(s.text)[-1])
    assert last["error_type"] == "timeout"
    assert elapsed < 10
    assert f'{ENDED}"timeout"}} 2.0' in metrics
    # One log line each, under its request's id, whichever side saw the deadline first (the worker or the route).
    for answer in (r, s):
        rid = answer.headers["x-request-id"]
        lines = [rec for rec in caplog.records if getattr(rec, "request_id", None) == rid]
        assert [rec.getMessage().split(": ", 1)[1] for rec in lines] == [
            "the request did not finish within the timeout of 0.5 s"
        ]


async def test_overload_is_429_at_once_with_retry_after(api_client) -> None:
    body = {"inputs": "Tell me a story.", "parameters": {"max_new_tokens": 30}}
    async with api_client(max_concurrent_requests=1, max_queue_size=1) as client:
        scheduler = client.app.state.runtime.scheduler
        running = asyncio.ensure_future(client.post("/generate", json=body))
        queued = asyncio.ensure_future(client.post("/generate", json=body))
        while scheduler.holding < 2:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        refused = await client.post("/generate", json=body)
        refused_oai = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        waited = time.monotonic() - t0
        first, second = await running, await queued
        after = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert refused.status_code == 429 and refused_oai.status_code == 429
    # No request has ended yet, so no service rate is measured: Retry-After is the queue timeout (30 s).
    assert refused.headers["retry-after"] == "30" and refused_oai.headers["retry-after"] == "30"
    assert refused.json()["error_type"] == "overloaded"
    assert refused_oai.json()["error"]["type"] == "rate_limit_exceeded"
    assert waited < 1.0, "a refusal must not wait for a place"
    assert first.status_code == second.status_code == after.status_code == 200
    assert first.json() == second.json()


async def test_a_request_that_could_never_fit_the_kv_budget_is_a_4xx(api_client) -> None:
    """A request whose KV cache alone exceeds the budget is refused at once with a validation error naming it, on
    both APIs (retrying would never help: no 429); smaller requests are served. /info shows the budget."""
    budget = 2 * 2**20  # the float32 target's cache: 45 KiB a position, room for about 45
    async with api_client(kv_cache_memory="2MiB") as client:
        info = (await client.get("/info")).json()
        native = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 100}})
        oai = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 100, "temperature": 0})
        small = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}})
        metrics = (await client.get("/metrics")).text
    assert info["kv_cache_memory_bytes"] == budget and info["max_concurrent_requests"] == 32
    assert native.status_code == 422 and native.json()["error_type"] == "validation"
    assert "more than the server's whole KV-cache budget of 2.0 MiB" in native.json()["error"]
    assert oai.status_code == 400 and oai.json()["error"]["type"] == "invalid_request_error"
    assert "KV-cache budget" in oai.json()["error"]["message"]
    assert small.status_code == 200
    assert f'{ENDED}"invalid"}} 2.0' in metrics and f'{ENDED}"overloaded"}} 0.0' in metrics
