"""`provenance`, the opt-in field of every streaming route (the playground's source): each token says what proposed
it and which target pass kept it, each pass what it drafted and accepted; streams without it are unchanged.

In process with the real target: prompt lookup (`ngram`), the target's own weights in bfloat16 as a model draft
(`self`: it mostly agrees, so passes accept several tokens) and the hybrid of both.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from _provenance import check_provenance

from app.engine.drafting.hybrid import HybridDrafter
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.engine import Engine
from app.engine.model.loading import LoadedModel
from tests.conftest import FIXED_DRAFT

pytestmark = pytest.mark.anyio

# Prompt lookup drafts this pattern well: passes of up to k+1 tokens.
REPETITIVE = "a b c d a b c d a b c d a b"
PROMPT = "The capital of France is"
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def drafting_engine(target_f32: LoadedModel, target_bf16: LoadedModel) -> Engine:
    """The float32 target with prompt lookup, its bfloat16 self as a model draft, and the hybrid of the two."""
    model = ModelDrafter("self", target_bf16, target_f32)
    drafters = {"ngram": NgramDrafter(), "self": model, "hybrid": HybridDrafter("hybrid", model)}
    return Engine(
        target_f32.model,
        target_f32.tokenizer,
        drafters,
        "ngram",
        4,
        **FIXED_DRAFT,
    )


def _events(sse_data, body: str) -> list[dict[str, Any]]:
    return [json.loads(d) for d in sse_data(body) if d != "[DONE]"]


def _untimed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events without what differs from run to run: the passes' times, and the log-probabilities' last bits
    (the thread count, which follows the machine's load, changes the order of a product's sums)."""
    events = copy.deepcopy(events)
    for e in events:
        e["token"]["logprob"] = round(e["token"]["logprob"], 4)
        for t in e.get("provenance", {}).get("tokens", []):
            t["logprob"] = round(t["logprob"], 4)
        for p in e.get("provenance", {}).get("passes", []):
            p.pop("draft_ms"), p.pop("verify_ms")
    return events


async def test_native_stream_carries_provenance_only_when_asked(api_client, sse_data, drafting_engine) -> None:
    params = {"max_new_tokens": 16, "details": True, "speculative": {"draft": "ngram"}}
    async with api_client(drafting_engine) as client:
        plain = await client.post("/generate_stream", json={"inputs": REPETITIVE, "parameters": params})
        asked = await client.post(
            "/generate_stream", json={"inputs": REPETITIVE, "parameters": {**params, "provenance": True}}
        )
        compat = await client.post(
            "/", json={"inputs": REPETITIVE, "parameters": {**params, "provenance": True}, "stream": True}
        )
    assert plain.status_code == asked.status_code == compat.status_code == 200
    assert "provenance" not in plain.text
    events = _events(sse_data, asked.text)
    assert _untimed(_events(sse_data, compat.text)) == _untimed(events)  # POST / streams as /generate_stream
    # Without the field each event is what it is with the field, less `provenance`.
    without = [{k: v for k, v in e.items() if k != "provenance"} for e in _untimed(events)]
    assert without == _untimed(_events(sse_data, plain.text))
    tokens = [t for e in events for t in e["provenance"]["tokens"]]
    passes = [p for e in events for p in e["provenance"]["passes"]]
    assert [t["id"] for t in tokens] == [e["token"]["id"] for e in events]
    assert [t["text"] for t in tokens] == [e["token"]["text"] for e in events]
    assert [t["logprob"] for t in tokens] == [e["token"]["logprob"] for e in events]
    speculative = events[-1]["details"]["speculative"]
    assert speculative["accepted"] >= 4, "this prompt should accept several tokens per pass"
    assert {t["source"] for t in tokens} >= {"target", "lookup", "bonus"}
    check_provenance(tokens, passes, speculative)
    # A pass's figures come with its first token.
    for e in events:
        for p in e["provenance"]["passes"]:
            assert e["provenance"]["tokens"][0]["pass"] == p["pass"]
            assert p["draft_ms"] >= 0 and p["verify_ms"] > 0


@pytest.mark.parametrize("draft", ["self", "hybrid"])
async def test_openai_streams_carry_provenance(api_client, sse_data, drafting_engine, draft: str) -> None:
    common = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": True, "speculative": {"draft": draft}}
    async with api_client(drafting_engine) as client:
        for route, body in (
            ("/v1/completions", {"prompt": PROMPT}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            plain = await client.post(route, json={**common, **body})
            asked = await client.post(route, json={**common, **body, "provenance": True})
            assert plain.status_code == asked.status_code == 200, asked.text
            assert "provenance" not in plain.text
            chunks = _events(sse_data, asked.text)
            chat = route.endswith("chat/completions")

            def text_of(chunk: dict[str, Any], chat: bool = chat) -> str:
                if not chunk["choices"]:
                    return ""
                choice = chunk["choices"][0]
                return (choice["delta"].get("content") or "") if chat else choice["text"]

            text = "".join(text_of(c) for c in chunks)
            assert text == "".join(text_of(c) for c in _events(sse_data, plain.text))
            tokens = [t for c in chunks if "provenance" in c for t in c["provenance"]["tokens"]]
            passes = [p for c in chunks if "provenance" in c for p in c["provenance"]["passes"]]
            # Every chunk's provenance holds the text the chunk carries (an end-of-sequence token adds none).
            for c in chunks:
                if "provenance" in c:
                    assert "".join(t["text"] for t in c["provenance"]["tokens"]) == text_of(c)
            assert "".join(t["text"] for t in tokens) == text
            speculative = next(c["speculative"] for c in chunks if c.get("speculative"))
            assert speculative["draft"] == draft
            check_provenance(tokens, passes, speculative)
            sources = {t["source"] for t in tokens}
            assert "draft" in sources, sources  # the bfloat16 self agrees often


async def test_greedy_race_texts_are_identical(api_client, sse_data, drafting_engine) -> None:
    """What the playground's race shows: the same prompt with a draft and with none, the same greedy text."""
    texts, passes = {}, {}
    async with api_client(drafting_engine) as client:
        for draft in ("hybrid", "none"):
            body = {"inputs": REPETITIVE, "parameters": {"max_new_tokens": 16, "speculative": {"draft": draft}}}
            body["parameters"]["provenance"] = True
            r = await client.post("/generate_stream", json=body)
            events = _events(sse_data, r.text)
            texts[draft] = "".join(e["token"]["text"] for e in events)
            tokens = [t for e in events for t in e["provenance"]["tokens"]]
            passes[draft] = max(t["pass"] for t in tokens)
            if draft == "none":
                assert {t["source"] for t in tokens} == {"target"}
    assert texts["hybrid"] == texts["none"]
    assert passes["hybrid"] < passes["none"] == 16


async def test_structured_output_shows_forced_tokens(api_client, sse_data, drafting_engine) -> None:
    """The playground's JSON schema box: tokens the grammar allowed alone are `forced`, and the rest still add up."""
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    body = {
        "messages": [{"role": "user", "content": "Name a colour, as JSON."}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "provenance": True,
        "speculative": {"draft": "self"},
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    async with api_client(drafting_engine) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = _events(sse_data, r.text)
    tokens = [t for c in chunks if "provenance" in c for t in c["provenance"]["tokens"]]
    passes = [p for c in chunks if "provenance" in c for p in c["provenance"]["passes"]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert json.loads(content)["colour"] and "".join(t["text"] for t in tokens) == content
    speculative = next(c["speculative"] for c in chunks if c.get("speculative"))
    assert sum(t["source"] == "forced" for t in tokens) == speculative["forced"] > 0
    check_provenance(tokens, passes, speculative, grammar=True)


async def test_provenance_is_refused_where_nothing_streams(api_client) -> None:
    async with api_client() as client:
        native = await client.post("/generate", json={"inputs": PROMPT, "parameters": {"provenance": True}})
        completion = await client.post("/v1/completions", json={"prompt": PROMPT, "provenance": True})
        chat = await client.post("/v1/chat/completions", json={"messages": CHAT, "provenance": True})
        wrong = await client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"provenance": "yes"}})
        unknown = await client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"provenances": True}})
    assert native.status_code == 422 and "parameters.provenance" in native.text
    assert completion.status_code == chat.status_code == 400
    assert "provenance" in completion.json()["error"]["message"]
    assert wrong.status_code == 422  # strict: a string is not a boolean
    assert unknown.status_code == 422 and "provenances" in unknown.text  # extra="forbid" still holds
