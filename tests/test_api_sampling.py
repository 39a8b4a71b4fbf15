"""Sampling through both APIs, in process with the real target: a seed reproduces a request's text, also
while another request runs beside it; different seeds differ; `details.seed` reports the seed used; greedy
requests stay greedy (seed null); bad sampling parameters are a 4xx naming the field.

Which parameters ask for sampling: on the native routes TGI's rule (`do_sample`, a temperature other than
1.0, `top_k`, or `top_p` < 1); on the OpenAI routes a temperature > 0, and an unset one is the server's default
(the model's generation config, else 1.0, as vLLM; `default_temperature` 0 keeps such requests greedy).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.anyio

PROMPT = "Once upon a time"
N = 12


def _native(**parameters) -> dict:
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": N, "details": True, **parameters}}


async def _generate(client, body: dict) -> dict:
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _completion(client, **fields) -> str:
    r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def test_native_seed_reproduces_alone_and_beside_another_request(api_client) -> None:
    seeded = _native(do_sample=True, seed=1234)
    # Another sampling request, long enough to be stepped between the seeded one's steps.
    other = {"inputs": "The weather today", "parameters": {"max_new_tokens": 2 * N, "temperature": 0.8}}
    async with api_client() as client:
        solo = await _generate(client, seeded)
        again = await _generate(client, seeded)
        beside, _ = await asyncio.gather(_generate(client, seeded), _generate(client, other))
    assert solo["details"]["seed"] == again["details"]["seed"] == beside["details"]["seed"] == 1234
    assert solo["generated_text"] == again["generated_text"] == beside["generated_text"]
    assert [t["id"] for t in solo["details"]["tokens"]] == [t["id"] for t in beside["details"]["tokens"]]
    assert solo["details"]["generated_tokens"] == N


async def test_openai_seed_reproduces_alone_and_beside_another_request(api_client) -> None:
    chat = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": N,
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": 99,
    }

    async def ask(client, body: dict) -> str:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    other = {**chat, "messages": [{"role": "user", "content": "Name a colour."}], "seed": None, "max_tokens": 2 * N}
    async with api_client() as client:
        solo = await ask(client, chat)
        again = await ask(client, chat)
        beside, _ = await asyncio.gather(ask(client, chat), ask(client, other))
        # The gumbel sampler: target-only sampling with the seed gives the very same text.
        target_only = await ask(client, {**chat, "speculative": {"draft": "none"}})
        fixed_k = await ask(client, {**chat, "speculative": {"schedule": "fixed", "num_draft_tokens": 2}})
        completion = await _completion(client, temperature=0.7, top_k=40, seed=5)
        completion_beside, _ = await asyncio.gather(
            _completion(client, temperature=0.7, top_k=40, seed=5), ask(client, other)
        )
    assert solo == again == beside == target_only == fixed_k
    assert completion == completion_beside


async def test_different_seeds_give_different_texts(api_client) -> None:
    async with api_client() as client:
        native = {
            (await _generate(client, _native(temperature=1.0, do_sample=True, seed=s)))["generated_text"]
            for s in range(4)
        }
        openai = {await _completion(client, temperature=1.0, seed=s) for s in range(4)}
    assert len(native) > 1, native
    assert len(openai) > 1, openai


async def test_details_seed_is_the_seed_used(api_client, sse_data) -> None:
    async with api_client() as client:
        drawn = (await _generate(client, _native(do_sample=True)))["details"]
        # Reporting the drawn seed is what makes a sampled request reproducible after the fact.
        replay = await _generate(client, _native(do_sample=True, seed=drawn["seed"]))
        # TGI's rule: top_k or top_p < 1 alone asks for sampling (at temperature 1.0).
        by_top_k = (await _generate(client, _native(top_k=20)))["details"]
        by_top_p = (await _generate(client, _native(top_p=0.9)))["details"]
        r = await client.post("/generate_stream", json=_native(temperature=0.5))
        last = json.loads(sse_data(r.text)[-1])
    assert isinstance(drawn["seed"], int) and drawn["seed"] >= 0
    assert [t["id"] for t in replay["details"]["tokens"]] == [t["id"] for t in drawn["tokens"]]
    assert isinstance(by_top_k["seed"], int) and isinstance(by_top_p["seed"], int)
    assert isinstance(last["details"]["seed"], int)
    assert by_top_k["seed"] != by_top_p["seed"], "each unseeded request draws its own seed"


async def test_greedy_requests_stay_greedy(api_client, sse_data) -> None:
    async with api_client() as client:
        plain = await _generate(client, _native())
        # Neither temperature 0, nor TGI's neutral temperature 1.0, nor a seed alone asks for sampling; temperature 0
        # is greedy whatever top_k and top_p say.
        variants = [
            await _generate(client, _native(temperature=0)),
            await _generate(client, _native(temperature=1.0)),
            await _generate(client, _native(seed=7)),
            await _generate(client, _native(temperature=0, top_k=5, top_p=0.5, seed=3)),
            await _generate(client, _native(do_sample=False, top_p=1.0)),
        ]
        r = await client.post("/generate_stream", json=_native(seed=7))
        streamed = json.loads(sse_data(r.text)[-1])
        # OpenAI: temperature 0 is greedy, whatever top_p, top_k and seed say.
        openai = [
            await _completion(client, temperature=0),
            await _completion(client, temperature=0, top_p=0.5, top_k=3, seed=11),
        ]
        # Unset, it is the server's default: 1.0 here (a GGUF has no generation config), as vLLM and OpenAI.
        unset = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "seed": 11})
        at_one = await _completion(client, temperature=1.0, seed=11)
    async with api_client(default_temperature=0) as client:
        kept_greedy = await _completion(client, top_p=0.5, seed=11)
    assert unset.json()["seed"] == 11 and unset.json()["speculative"]["sampler"] == "gumbel"
    assert unset.json()["choices"][0]["text"] == at_one
    assert kept_greedy == plain["generated_text"]
    assert plain["details"]["seed"] is None
    for v in variants:
        assert v["generated_text"] == plain["generated_text"]
        assert v["details"]["seed"] is None
    assert streamed["generated_text"] == plain["generated_text"] and streamed["details"]["seed"] is None
    assert openai == [plain["generated_text"]] * 2


async def test_sampled_stream_adds_up_to_the_text(api_client, sse_data) -> None:
    body = _native(do_sample=True, temperature=0.9, top_k=50, top_p=0.9, seed=2024)
    async with api_client() as client:
        whole = await _generate(client, body)
        r = await client.post("/generate_stream", json=body)
        assert r.status_code == 200, r.text
        events = [json.loads(d) for d in sse_data(r.text)]
        chunks = await client.post(
            "/v1/completions",
            json={
                "prompt": PROMPT,
                "max_tokens": N,
                "temperature": 0.9,
                "top_k": 50,
                "top_p": 0.9,
                "seed": 2024,
                "stream": True,
            },
        )
        streamed_openai = "".join(
            c["choices"][0]["text"] for c in map(json.loads, sse_data(chunks.text)[:-1]) if c["choices"]
        )
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == whole["generated_text"]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert events[-1]["details"]["seed"] == 2024
    # The same prompt, parameters and seed through the other API: the same request to the engine.
    assert streamed_openai == whole["generated_text"]


async def test_openai_negative_seed_is_taken_modulo_2_64(api_client) -> None:
    async with api_client() as client:
        negative = await _completion(client, temperature=1.0, seed=-1)
        native = await _generate(client, _native(temperature=1.0, do_sample=True, seed=2**64 - 1))
    assert native["details"]["seed"] == 2**64 - 1
    assert negative == native["generated_text"]


NATIVE_INVALID = {
    "negative temperature": ({"temperature": -0.1}, ["parameters.temperature", "greater than or equal to 0"]),
    "temperature too small": ({"temperature": 1e-9}, ["parameters.temperature", "0 (greedy) or at least 1e-06"]),
    "temperature too large": ({"temperature": 100.5}, ["parameters.temperature", "less than or equal to 100"]),
    "top_p 0": ({"do_sample": True, "top_p": 0}, ["parameters.top_p", "greater than 0"]),
    "top_p over 1": ({"do_sample": True, "top_p": 1.5}, ["parameters.top_p", "less than or equal to 1"]),
    "top_k 0": ({"do_sample": True, "top_k": 0}, ["parameters.top_k", "greater than or equal to 1"]),
    "seed not an integer": ({"do_sample": True, "seed": 1.5}, ["parameters.seed", "integer"]),
    "seed as a string": ({"do_sample": True, "seed": "7"}, ["parameters.seed", "integer"]),
    "negative seed": ({"do_sample": True, "seed": -1}, ["parameters.seed", "greater than or equal to 0"]),
    "seed over 64 bits": ({"do_sample": True, "seed": 2**64}, ["parameters.seed", "less than or equal to"]),
    "do_sample at temperature 0": ({"do_sample": True, "temperature": 0}, ["temperature 0", "do_sample"]),
}

OPENAI_INVALID = {
    "negative temperature": ({"temperature": -0.1}, ["temperature", "greater than or equal to 0"]),
    "top_p 0": ({"temperature": 1, "top_p": 0}, ["top_p", "greater than 0"]),
    "top_p over 1": ({"temperature": 1, "top_p": 1.5}, ["top_p", "less than or equal to 1"]),
    "top_k 0": ({"temperature": 1, "top_k": 0}, ["top_k", "greater than or equal to 1"]),
    "seed not an integer": ({"temperature": 1, "seed": 0.5}, ["seed", "integer"]),
    "seed over 63 bits": ({"temperature": 1, "seed": 2**63}, ["seed", "less than or equal to"]),
}


async def test_invalid_sampling_parameters_name_the_field(api_client) -> None:
    async with api_client() as client:
        for name, (parameters, words) in NATIVE_INVALID.items():
            for path in ("/generate", "/generate_stream"):
                r = await client.post(path, json={"inputs": PROMPT, "parameters": parameters})
                assert r.status_code == 422, (name, path, r.text)
                assert r.headers["content-type"] == "application/json"
                err = r.json()
                assert err["error_type"] == "validation", name
                for word in words:
                    assert word in err["error"], (name, err["error"])
        for name, (fields, words) in OPENAI_INVALID.items():
            for path, body in (
                ("/v1/completions", {"prompt": PROMPT}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            ):
                r = await client.post(path, json={**body, **fields})
                assert r.status_code == 400, (name, path, r.text)
                message = r.json()["error"]["message"]
                for word in words:
                    assert word in message, (name, message)


async def test_openai_answers_report_the_seed_and_the_sampler(api_client, sse_data) -> None:
    chat = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4, "temperature": 0.9}
    async with api_client() as client:
        drawn = (await client.post("/v1/chat/completions", json=chat)).json()
        replay = (await client.post("/v1/chat/completions", json={**chat, "seed": drawn["seed"]})).json()
        rejection = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0.9, "seed": 3,
                                     "speculative": {"sampler": "rejection"}},
        )  # fmt: skip
        streamed = await client.post("/v1/chat/completions", json={**chat, "seed": 8, "stream": True})
        greedy = (await client.post("/v1/chat/completions", json={**chat, "temperature": 0})).json()
        bad = await client.post("/v1/completions", json={"prompt": PROMPT, "speculative": {"sampler": "beam"}})
    assert isinstance(drawn["seed"], int) and drawn["speculative"]["sampler"] == "gumbel"
    assert replay["choices"][0]["message"]["content"] == drawn["choices"][0]["message"]["content"]
    assert rejection.status_code == 200, rejection.text
    assert rejection.json()["seed"] == 3 and rejection.json()["speculative"]["sampler"] == "rejection"
    chunks = [json.loads(d) for d in sse_data(streamed.text) if d != "[DONE]"]
    assert chunks[-1]["seed"] == 8
    assert greedy["seed"] is None and greedy["speculative"]["sampler"] == "greedy"
    assert bad.status_code in (400, 422) and "sampler" in bad.text


def test_the_default_temperature_comes_from_the_generation_config(tmp_path, target_path) -> None:
    """An HF checkpoint's generation_config.json gives the OpenAI routes' default temperature (as vLLM takes it);
    a GGUF, a config without one, or a target that is not there give none (the server then takes 1.0)."""
    from app.service.runtime import generation_temperature

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9}')
    assert generation_temperature(str(tmp_path)) == 0.6
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    assert generation_temperature(str(tmp_path)) is None
    assert generation_temperature(str(target_path)) is None
    assert generation_temperature(str(tmp_path / "missing")) is None
