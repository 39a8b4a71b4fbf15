"""The OpenAI-compatible routes in process: completions and chat, streamed and not, with the real target."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.anyio

PROMPT = "The capital of France is"
MODEL = "smollm2-135m-instruct"  # the served name: the target's
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]


def _chunks(sse_data, body: str) -> list[dict]:
    data = sse_data(body)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


async def test_completions_streamed_and_not_match_native(api_client, sse_data) -> None:
    async with api_client() as client:
        native = (await client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10}})).json()
        whole = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
        )
        streamed = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": [PROMPT],
                "max_tokens": 10,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert whole.status_code == 200, whole.text
    w = whole.json()
    assert w["object"] == "text_completion" and w["model"] == "smollm2-135m-instruct"
    assert w["choices"][0]["text"] == native["generated_text"]
    assert w["choices"][0]["finish_reason"] == "length"
    assert w["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 10,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},  # the float32 engine has no prefix cache
        "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }
    chunks = _chunks(sse_data, streamed.text)
    *text_chunks, usage_chunk = chunks
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == w["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == w["usage"]
    assert len({c["id"] for c in chunks}) == 1


async def test_chat_streamed_and_not_agree(api_client, api_engine, sse_data) -> None:
    async with api_client() as client:
        whole = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 10, "temperature": 0}
        )
        streamed = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_completion_tokens": 10, "temperature": 0, "stream": True},
        )
    assert whole.status_code == 200, whole.text
    w = whole.json()
    answer = w["choices"][0]["message"]
    assert answer["role"] == "assistant" and answer["content"]
    prompt_ids = api_engine.tokenizer.encode(api_engine.tokenizer.apply_chat_template(CHAT))
    assert w["usage"]["prompt_tokens"] == len(prompt_ids)
    assert w["usage"]["completion_tokens"] == 10
    chunks = _chunks(sse_data, streamed.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == answer["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == w["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["speculative"]["draft"] == "ngram"


async def test_chat_stop_string_and_content_parts(api_client) -> None:
    async with api_client() as client:
        base = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10, "temperature": 0})
        text = base.json()["choices"][0]["message"]["content"]
        stop = text.split()[1]  # the second word: the answer ends before it
        parts = [
            CHAT[0],
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": " of France?"}],
            },
        ]
        stopped = await client.post(
            "/v1/chat/completions", json={"messages": parts, "max_tokens": 10, "temperature": 0, "stop": stop}
        )
    got = stopped.json()["choices"][0]
    assert got["message"]["content"] == text[: text.index(stop)]
    assert got["finish_reason"] == "stop"


async def test_completion_echo_and_token_prompt(api_client, api_engine, sse_data) -> None:
    ids = api_engine.tokenizer.encode(PROMPT)
    async with api_client() as client:
        echoed = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True}
        )
        by_ids = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0})
        streamed = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "stream": True}
        )
    text = by_ids.json()["choices"][0]["text"]
    assert echoed.json()["choices"][0]["text"] == PROMPT + text
    chunks = _chunks(sse_data, streamed.text)
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + text


async def test_models_and_info(api_client) -> None:
    async with api_client(model_name="smol") as client:
        models = (await client.get("/v1/models")).json()
        info = (await client.get("/info")).json()
        metrics = (await client.get("/metrics")).text
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["smol"]
    assert info["served_model_name"] == "smol" and info["served_model_names"] == ["smol"]
    assert info["model_id"] == "smollm2-135m-instruct"
    assert info["model_dtype"] == "float32" and info["model_device_type"] == "cpu"
    assert info["model_weights"] == "float32" and 500e6 < info["model_weight_bytes"] < 700e6  # 135M x 4 bytes
    # float32 runs on torch's products, whose rows depend on the batch: requests step one at a time.
    assert info["cpu_kernel"] == "torch" and info["batched_decoding"] is False
    assert (
        'specserve_engine_info{batched_decoding="false",dtype="float32",kernel="torch",model_name="smol"} 1.0'
        in metrics
    )
    assert info["draft"] == "ngram" and info["num_draft_tokens"] == 4
    assert info["available_drafts"] == ["default", "none", "ngram"]
    assert info["max_total_tokens"] == 8192 and info["max_input_tokens"] == 8191


async def test_only_served_model_names_are_accepted(api_client) -> None:
    """vLLM's rule: `model` must be a served name (the reported one or a --served-model-name alias), else 404
    NotFoundError; a request without `model` is served; answers always report the first name."""
    missing = {
        "error": {
            "message": "The model `gpt-4o-mini` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    short = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    chat = {"messages": CHAT, "max_tokens": 2, "temperature": 0}
    async with api_client(model_name="smol", served_model_name="alias-a, org/alias-b") as client:
        listed = (await client.get("/v1/models")).json()
        one = await client.get("/v1/models/org/alias-b")
        unknown_card = await client.get("/v1/models/gpt-4o-mini")
        unknown = await client.post("/v1/completions", json={**short, "model": "gpt-4o-mini"})
        unknown_chat = await client.post("/v1/chat/completions", json={**chat, "model": "gpt-4o-mini", "stream": True})
        target = await client.post("/v1/completions", json={**short, "model": MODEL})  # not served under it now
        by_alias = await client.post("/v1/chat/completions", json={**chat, "model": "org/alias-b"})
        by_name = await client.post("/v1/completions", json={**short, "model": "smol"})
        unnamed = await client.post("/v1/completions", json=short)
        # TGI's Python client's chat() always sends "tgi", huggingface_hub's InferenceClient(base_url=...)
        # "dummy": accepted, not listed.
        tgi_client = await client.post("/v1/chat/completions", json={**chat, "model": "tgi"})
        hub_client = await client.post("/v1/chat/completions", json={**chat, "model": "dummy"})
        info = (await client.get("/info")).json()
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await sdk.completions.create(model="gpt-4o-mini", prompt=PROMPT, max_tokens=2, temperature=0)
        assert (await sdk.models.retrieve("alias-a")).id == "alias-a"
        assert [m.id async for m in sdk.models.list()] == ["smol", "alias-a", "org/alias-b"]
    assert [m["id"] for m in listed["data"]] == ["smol", "alias-a", "org/alias-b"]
    assert all(m["root"] == MODEL and m["max_model_len"] == 8192 for m in listed["data"])
    assert one.status_code == 200 and one.json() == listed["data"][2]
    assert unknown_card.status_code == 404 and unknown_card.json() == missing
    for refused in (unknown, unknown_chat):
        assert refused.status_code == 404 and refused.json() == missing
    assert target.status_code == 404
    assert by_alias.status_code == by_name.status_code == unnamed.status_code == tgi_client.status_code == 200
    assert hub_client.status_code == 200 and hub_client.json()["model"] == "smol"
    # created: when the models were loaded (not 0), the same on every card
    assert len({m["created"] for m in listed["data"]}) == 1 and listed["data"][0]["created"] > 1_700_000_000
    assert by_alias.json()["model"] == by_name.json()["model"] == unnamed.json()["model"] == "smol"
    assert by_name.json()["choices"] == unnamed.json()["choices"]
    assert info["served_model_names"] == ["smol", "alias-a", "org/alias-b"]


async def test_several_prompts_are_one_choice_each(api_client, api_engine, sse_data) -> None:
    """A list of prompts (strings, or lists of token ids as lm-eval sends them) is one generation each,
    answered as choices[i] in order; usage adds them up; a stream's chunks carry their choice's index."""
    prompts = [PROMPT, "Once upon a time"]
    ids = [api_engine.tokenizer.encode(p) for p in prompts]
    async with api_client() as client:
        alone = [
            (await client.post("/v1/completions", json={"prompt": p, "max_tokens": 3, "temperature": 0})).json()
            for p in prompts
        ]
        texts = await client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3, "temperature": 0})
        tokens = await client.post(
            "/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True}
        )
        streamed = await client.post(
            "/v1/completions",
            json={
                "prompt": ids,
                "max_tokens": 3,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert texts.status_code == 200, texts.text
    got = texts.json()
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert [c["text"] for c in got["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert got["usage"] == {
        "prompt_tokens": sum(len(i) for i in ids),
        "completion_tokens": 6,
        "total_tokens": sum(len(i) for i in ids) + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }
    assert got["speculative"]["target_passes"] == sum(a["speculative"]["target_passes"] for a in alone)
    # echo of token ids is their text
    echoed = [p + c["text"] for p, c in zip(prompts, got["choices"], strict=True)]
    assert [c["text"] for c in tokens.json()["choices"]] == echoed
    *chunks, usage = _chunks(sse_data, streamed.text)
    for i, choice in enumerate(got["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert sum(c["finish_reason"] is not None for c in mine) == 1
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert usage["choices"] == [] and usage["usage"] == got["usage"]


async def test_n_samples_are_seeded_one_after_the_other(api_client, sse_data) -> None:
    """n > 1 (sampling only): sample i of each prompt is seeded with seed + i, so it is what that prompt alone
    gives with seed + i; the answer reports the seed; choices are prompt * n + sample."""
    sampled = {"max_tokens": 4, "temperature": 1.0}
    async with api_client() as client:
        single = [
            (await client.post("/v1/completions", json={**sampled, "prompt": PROMPT, "seed": 7 + i})).json()
            for i in range(3)
        ]
        many = await client.post("/v1/completions", json={**sampled, "prompt": [PROMPT, PROMPT], "n": 3, "seed": 7})
        chat_single = (await client.post("/v1/chat/completions", json={**sampled, "messages": CHAT, "seed": 6})).json()
        chat = (await client.post("/v1/chat/completions", json={**sampled, "messages": CHAT, "n": 2, "seed": 5})).json()
        chat_streamed = await client.post(
            "/v1/chat/completions", json={**sampled, "messages": CHAT, "n": 2, "seed": 5, "stream": True}
        )
        unseeded = (await client.post("/v1/completions", json={**sampled, "prompt": PROMPT, "n": 2})).json()
        replayed = (
            await client.post("/v1/completions", json={**sampled, "prompt": PROMPT, "seed": unseeded["seed"] + 1})
        ).json()
    assert many.status_code == 200, many.text
    got = many.json()
    assert got["seed"] == 7
    assert [c["index"] for c in got["choices"]] == list(range(6))
    expected = [s["choices"][0]["text"] for s in single]
    assert [c["text"] for c in got["choices"]] == expected + expected
    assert got["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in single) * 2
    assert got["usage"]["prompt_tokens"] == 2 * single[0]["usage"]["prompt_tokens"]  # once per prompt, not per n
    assert chat["seed"] == 5 and [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][1]["message"]["content"] == chat_single["choices"][0]["message"]["content"]
    chunks = _chunks(sse_data, chat_streamed.text)
    for i, choice in enumerate(chat["choices"]):
        mine = [c for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in mine) == choice["message"]["content"]
        assert mine[-1]["seed"] == 5 + i and mine[-1]["choices"][0]["finish_reason"] is not None
    assert replayed["choices"][0]["text"] == unseeded["choices"][1]["text"]


async def test_several_choices_are_admitted_together_or_not_at_all(api_client) -> None:
    """Each choice takes a place: with too few free, the request is a 429 and the choices already admitted give
    their places back at once."""
    import asyncio

    async with api_client(max_concurrent_requests=1, max_queue_size=1) as client:
        scheduler = client.app.state.runtime.scheduler
        running = asyncio.ensure_future(
            client.post("/generate", json={"inputs": "Tell me a story.", "parameters": {"max_new_tokens": 30}})
        )
        while scheduler.holding < 1:
            await asyncio.sleep(0.01)
        refused = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2, "temperature": 0})
        holding_after = scheduler.holding
        assert (await running).status_code == 200
        served = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2, "temperature": 0})
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_exceeded"
    assert holding_after == 1
    assert served.status_code == 200 and len(served.json()["choices"]) == 2
