"""A request's `prediction` is bounded and paid for: at most `PREDICTION_TOKENS_PER_NEW_TOKEN` times the tokens the
request may generate (else a 4xx naming the field, before anything is queued), and the index the worker builds
of it is charged to the request's memory at admission, beside its KV cache."""

from __future__ import annotations

import pytest

from app.api.jobs import PREDICTION_TOKENS_PER_NEW_TOKEN
from app.engine import kernels
from app.engine.drafting.suffix import SuffixDrafter
from app.engine.drafting.suffix_index import TrafficIndex
from app.engine.engine import Engine
from tests.conftest import FIXED_DRAFT

pytestmark = pytest.mark.anyio

K = 4
PROMPT_IDS = list(range(100, 120))


@pytest.fixture
def suffix_engine(packed_target) -> Engine:
    packed = packed_target(kernels.available()[0])
    traffic = TrafficIndex(1 << 20)
    drafts = {"suffix": SuffixDrafter("suffix", traffic)}
    return Engine(packed.model, packed.tokenizer, drafts, "suffix", K, traffic=traffic, **FIXED_DRAFT)


async def test_a_prediction_longer_than_a_multiple_of_max_tokens_is_refused_naming_it(suffix_engine, api_client):
    max_tokens = 4
    words = PREDICTION_TOKENS_PER_NEW_TOKEN * max_tokens + 4
    too_long = " word" * words  # one token a word
    fits = " word" * (PREDICTION_TOKENS_PER_NEW_TOKEN * max_tokens - 1)
    chat = {"messages": [{"role": "user", "content": "Say word."}], "max_tokens": max_tokens, "temperature": 0}
    gen = {"inputs": "Say word.", "parameters": {"max_new_tokens": max_tokens}}
    async with api_client(suffix_engine) as c:
        r = await c.post("/v1/chat/completions", json={**chat, "prediction": {"type": "content", "content": too_long}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]["message"]
        assert "prediction is" in error and f"limit of {PREDICTION_TOKENS_PER_NEW_TOKEN * max_tokens}" in error
        assert "max_tokens" in error
        r = await c.post(
            "/v1/completions",
            json={"prompt": "Say", "max_tokens": max_tokens, "prediction": {"type": "content", "content": too_long}},
        )
        assert r.status_code == 400 and "prediction" in r.json()["error"]["message"]
        r = await c.post("/generate", json={**gen, "parameters": {**gen["parameters"], "prediction": too_long}})
        assert r.status_code == 422 and "parameters.prediction is" in r.json()["error"], r.text
        r = await c.post("/v1/chat/completions", json={**chat, "prediction": {"type": "content", "content": fits}})
        assert r.status_code == 200, r.text


def test_the_prediction_index_is_charged_at_admission(suffix_engine):
    plain = suffix_engine.kv_bytes(len(PROMPT_IDS), 64, "suffix", K)
    predicted = suffix_engine.kv_bytes(len(PROMPT_IDS), 64, "suffix", K, prediction_tokens=200)
    assert predicted - plain >= 200 * 200  # bytes per token the index holds, and more


async def test_a_prediction_that_makes_a_request_exceed_the_budget_is_refused(suffix_engine, api_client):
    """With a budget just over what the request's KV cache takes, the request runs; with a prediction whose index
    does not fit beside it, it is refused as one that could never run, naming the prediction."""
    need = suffix_engine.kv_bytes(len(PROMPT_IDS), 64, "suffix", K)
    body = {"prompt": PROMPT_IDS, "max_tokens": 64, "temperature": 0, "speculative": {"draft": "suffix"}}
    prediction = {"type": "content", "content": " one two three four" * 8}
    async with api_client(suffix_engine, kv_cache_memory=str(need + 1024)) as c:
        r = await c.post("/v1/completions", json={**body, "max_tokens": 64})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json={**body, "prediction": prediction})
    assert r.status_code == 400, r.text
    error = r.json()["error"]["message"]
    assert "could never run" in error and "prediction" in error
