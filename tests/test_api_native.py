"""The TGI-compatible routes in process: /generate, /generate_stream and POST /, with the real target.

Greedy decoding makes every answer a fact to compare: the streamed tokens add up to the same text as the
non-streamed answer, one event per generated token, and stop strings never leak, not even when one
draft-and-verify step accepted tokens past them.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.anyio

PROMPT = "The capital of France is"
# Prompt lookup drafts this pattern well: steps of up to k+1 = 5 tokens.
REPETITIVE = "a b c d a b c d a b c d a b"


async def _stream(client, sse_data, body: dict, path: str = "/generate_stream") -> list[dict]:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return [json.loads(d) for d in sse_data(r.text)]


async def test_generate_details_add_up(api_client, api_engine) -> None:
    async with api_client() as client:
        r = await client.post(
            "/generate",
            json={
                "inputs": PROMPT,
                "parameters": {"max_new_tokens": 12, "details": True, "decoder_input_details": True},
            },
        )
    assert r.status_code == 200, r.text
    out = r.json()
    d = out["details"]
    assert d["finish_reason"] == "length"
    assert d["generated_tokens"] == 12 == len(d["tokens"])
    assert "".join(t["text"] for t in d["tokens"]) == out["generated_text"]
    assert out["generated_text"].startswith(" Paris")
    assert [t["id"] for t in d["prefill"]] == api_engine.tokenizer.encode(PROMPT)
    spec = d["speculative"]
    assert spec["draft"] == "ngram" and spec["num_draft_tokens"] == 4
    assert len(spec["accepted_per_position"]) == 4
    assert sum(spec["accepted_per_position"]) == spec["accepted"] <= spec["drafted"]
    # Every pass but the prefill added at least one token; accepted drafts add more.
    assert spec["target_passes"] == 12 - spec["accepted"]


async def test_stream_is_one_event_per_token_and_matches_generate(api_client, sse_data) -> None:
    body = {"inputs": REPETITIVE, "parameters": {"max_new_tokens": 16, "details": True}}
    async with api_client() as client:
        whole = (await client.post("/generate", json=body)).json()
        events = await _stream(client, sse_data, body)
    assert whole["details"]["speculative"]["accepted"] >= 4, "this prompt should accept several tokens per step"
    assert len(events) == 16 == whole["details"]["generated_tokens"]
    assert [e["index"] for e in events] == list(range(1, 17))
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert "".join(e["token"]["text"] for e in events) == whole["generated_text"]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == whole["generated_text"]
    assert last["details"]["finish_reason"] == "length"
    assert last["details"]["generated_tokens"] == 16
    assert last["details"]["speculative"] == whole["details"]["speculative"]


async def test_stop_string_inside_an_accepted_run_is_not_returned(api_client, sse_data) -> None:
    # Greedy continues " c d a b c d ..."; the second step accepts " d a b c d" at once, and "b c" ends in it.
    body = {"inputs": REPETITIVE, "parameters": {"max_new_tokens": 24, "stop": ["b c"], "details": True}}
    async with api_client() as client:
        whole = (await client.post("/generate", json=body)).json()
        events = await _stream(client, sse_data, body)
    assert whole["generated_text"] == " c d a "
    assert whole["details"]["finish_reason"] == "stop_sequence"
    streamed = "".join(e["token"]["text"] for e in events)
    assert streamed == " c d a " == events[-1]["generated_text"]
    assert len(events) == whole["details"]["generated_tokens"]
    assert all("b" not in e["token"]["text"] for e in events)


@pytest.mark.parametrize("prompt", ["Emoji party: 😀🎉😀🎉😀🎉", "日本の首都は"])
async def test_stream_never_splits_a_character(api_client, sse_data, prompt: str) -> None:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 10}}
    async with api_client() as client:
        whole = (await client.post("/generate", json=body)).json()
        events = await _stream(client, sse_data, body)
    texts = [e["token"]["text"] for e in events]
    assert len(events) == 10
    # Only a generation cut off by its length inside a character ends with the leftover bytes as U+FFFD.
    assert not any("\ufffd" in t for t in texts[:-1])
    assert "\ufffd" not in texts[-1].rstrip("\ufffd")
    assert "".join(texts) == whole["generated_text"] == events[-1]["generated_text"]
    assert any(ord(ch) > 0x2FFF for ch in whole["generated_text"]), whole["generated_text"]


async def test_compat_route_answers_a_list_or_a_stream(api_client, sse_data) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}}
    async with api_client() as client:
        listed = await client.post("/", json=body)
        events = await _stream(client, sse_data, {**body, "stream": True}, path="/")
    assert listed.status_code == 200
    assert isinstance(listed.json(), list) and len(listed.json()) == 1
    assert events[-1]["generated_text"] == listed.json()[0]["generated_text"]


async def test_return_full_text_and_speculative_parameters(api_client) -> None:
    async with api_client() as client:
        base = await client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
        full = await client.post(
            "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "return_full_text": True}}
        )
        plain = await client.post(
            "/generate",
            json={
                "inputs": PROMPT,
                "parameters": {"max_new_tokens": 8, "details": True, "speculative": {"draft": "none"}},
            },
        )
        k2 = await client.post(
            "/generate",
            json={
                "inputs": PROMPT,
                "parameters": {"max_new_tokens": 8, "details": True, "speculative": {"num_draft_tokens": 2}},
            },
        )
    text = base.json()["generated_text"]
    assert base.json()["details"] is None
    assert full.json()["generated_text"] == PROMPT + text
    # The draft changes how many passes it takes, never the greedy text.
    assert plain.json()["generated_text"] == text == k2.json()["generated_text"]
    none = plain.json()["details"]["speculative"]
    assert none["draft"] == "none" and none["drafted"] == 0 and none["target_passes"] == 8
    assert len(k2.json()["details"]["speculative"]["accepted_per_position"]) == 2
