"""What one request can make the server do before it holds a place, and where that work runs (issue 67,
findings 4 and 5): tools and messages are capped (a 4xx naming the limit), a full server refuses before it
renders or compiles anything, a grammar compiled at admission goes with its request (the worker never compiles
it again, however many wait), and the chat template, /tokenize's token strings and non-streamed answers with
log-probabilities are built off the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from app.api import native, openai, tools
from app.api.schemas import MAX_MESSAGES, MAX_TOOLS
from app.service.events import Overloaded

pytestmark = pytest.mark.anyio

C, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


def _tool(i: int) -> dict:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    return {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}


def _recording(fn, threads: list[int]):
    def call(*args, **kwargs):
        threads.append(threading.get_ident())
        return fn(*args, **kwargs)

    return call


async def test_too_many_tools_or_messages_are_refused_naming_the_limit(api_client, monkeypatch) -> None:
    compiled: list[int] = []
    async with api_client() as client:
        grammars = client.app.state.runtime.grammars
        monkeypatch.setattr(grammars, "check", _recording(grammars.check, compiled))
        tools_over = {"messages": HI, "max_tokens": 1, "tools": [_tool(i) for i in range(MAX_TOOLS + 1)]}
        messages_over = {"messages": HI * (MAX_MESSAGES + 1), "max_tokens": 1}
        answers = [
            await client.post(CHAT, json=tools_over),
            await client.post(CHAT, json=messages_over),
            await client.post("/tokenize", json={"messages": HI * (MAX_MESSAGES + 1)}),
        ]
    assert [a.status_code for a in answers] == [400, 400, 422], [a.text[:300] for a in answers]
    errors = [answers[0].json()["error"]["message"], answers[1].json()["error"]["message"], answers[2].json()["error"]]
    assert "tools" in errors[0] and str(MAX_TOOLS) in errors[0], errors[0]
    assert all("messages" in e and str(MAX_MESSAGES) in e for e in errors[1:]), errors
    assert compiled == []  # refused before any tool's schema was compiled


async def test_a_full_server_refuses_a_chat_request_before_rendering_or_compiling(api_client, monkeypatch) -> None:
    work: list[int] = []
    async with api_client() as client:
        runtime = client.app.state.runtime

        def full() -> None:
            raise Overloaded("the server is full", 3)

        monkeypatch.setattr(runtime.scheduler, "check_room", full)
        monkeypatch.setattr(runtime.grammars, "check", _recording(runtime.grammars.check, work))
        monkeypatch.setattr(tools, "render_messages", _recording(tools.render_messages, work))
        monkeypatch.setattr(tools, "template_messages", _recording(tools.template_messages, work))
        body = {"messages": HI, "max_tokens": 1, "tools": [_tool(i) for i in range(8)]}
        answer = await client.post(CHAT, json=body)
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "3", answer.text
    assert work == []


async def test_no_grammar_is_compiled_twice_with_many_grammar_requests_waiting(
    api_client, api_engine, monkeypatch
) -> None:
    """More grammar requests wait between their check and their start than any cache of compiled grammars
    could hold: each grammar is still compiled once, at admission (the worker is held until all were)."""
    requests = 24
    compiles: Counter[str] = Counter()
    release = threading.Event()
    start = api_engine.start

    def held_start(*args, **kwargs):
        release.wait(60)
        return start(*args, **kwargs)

    monkeypatch.setattr(api_engine, "start", held_start)
    async with api_client(max_concurrent_requests=4, max_queue_size=requests) as client:
        runtime = client.app.state.runtime
        grammars, scheduler = runtime.grammars, runtime.scheduler
        matcher, submit = grammars._matcher, scheduler.submit
        submitted = 0

        def counted_matcher(grammar: str):
            compiles[grammar] += 1
            return matcher(grammar)

        def counted_submit(*args, **kwargs):
            nonlocal submitted
            ticket = submit(*args, **kwargs)
            submitted += 1
            return ticket

        monkeypatch.setattr(grammars, "_matcher", counted_matcher)
        monkeypatch.setattr(scheduler, "submit", counted_submit)
        bodies = [{"prompt": "Hi", "max_tokens": 1, "guided_regex": f"x{i:03d}y"} for i in range(requests)]
        calls = [asyncio.ensure_future(client.post(C, json=b)) for b in bodies]
        try:
            for _ in range(6000):  # every request checked and handed to the scheduler, none started
                if submitted == requests or any(c.done() for c in calls):
                    break
                await asyncio.sleep(0.01)
        finally:
            release.set()
        answers = await asyncio.gather(*calls)
    assert [a.status_code for a in answers] == [200] * requests, [a.text[:200] for a in answers]
    texts = [a.json()["choices"][0]["text"] for a in answers]
    assert all(text and body["guided_regex"].startswith(text) for text, body in zip(texts, bodies, strict=True))
    assert len(compiles) == requests and set(compiles.values()) == {1}, compiles


async def test_chat_rendering_token_strings_and_logprob_answers_run_off_the_event_loop(api_client, monkeypatch) -> None:
    loop_thread = threading.get_ident()
    rendered: list[int] = []
    decoded: list[int] = []
    named: list[int] = []
    monkeypatch.setattr(tools, "render_messages", _recording(tools.render_messages, rendered))
    monkeypatch.setattr(tools, "template_messages", _recording(tools.template_messages, rendered))
    monkeypatch.setattr(openai, "chat_logprobs", _recording(openai.chat_logprobs, named))
    monkeypatch.setattr(openai, "completion_logprobs", _recording(openai.completion_logprobs, named))
    monkeypatch.setattr(native, "tgi_top_tokens", _recording(native.tgi_top_tokens, named))
    async with api_client() as client:
        tokenizer = client.app.state.runtime.tokenizer
        chat = {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 3}
        completion = {"prompt": "Hi", "max_tokens": 2, "logprobs": 3}
        generate = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "details": True, "top_n_tokens": 3}}
        answers = [
            await client.post(CHAT, json=chat),
            await client.post(C, json=completion),
            await client.post("/generate", json=generate),
        ]
        monkeypatch.setattr(tokenizer, "decode", _recording(tokenizer.decode, decoded))
        strs = await client.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
    assert [a.status_code for a in [*answers, strs]] == [200] * 4, [a.text[:200] for a in answers]
    assert "".join(strs.json()["token_strs"]) == "Hello there"
    assert rendered and decoded and len(named) >= 3
    assert loop_thread not in rendered, "the conversation was rendered on the event loop"
    assert loop_thread not in decoded, "/tokenize's token strings were decoded on the event loop"
    assert loop_thread not in named, "an answer's log-probabilities were built on the event loop"
