"""tools/measure_affinity.py against stand-in servers: what it reports is what the servers' answers said."""

from __future__ import annotations

import json

import httpx
import pytest

from tools import measure_affinity

pytestmark = pytest.mark.anyio


def _balancer(servers: int, affine: bool) -> tuple[httpx.MockTransport, list[str]]:
    """Stand-in balancer over `servers` stand-in servers, each with a prefix cache of the conversations it saw:
    a turn's prompt is cached up to the last prompt of its tenant that server saw (its earlier turn), and the
    answer drafts from the index when that server saw the tenant before. By tenant (affine) or round robin."""
    seen: list[dict[str, int]] = [{} for _ in range(servers)]
    salts: list[str] = []
    counter = iter(range(10**6))

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        salt = body["cache_salt"]
        salts.append(salt)
        server = hash(salt) % servers if affine else next(counter) % servers
        prompt = 10 * len(body["messages"])
        cached = seen[server].get(salt, 0)
        seen[server][salt] = prompt
        chunks = [
            {"choices": [{"index": 0, "delta": {"content": "an answer"}}]},
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                "speculative": {"draft_sources": {"index": 1 if cached else 0, "model": 3}},
            },
            {"choices": [], "usage": {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}},
        ]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"Content-Type": "text/event-stream"})

    return httpx.MockTransport(handle), salts


async def test_affine_conversations_find_their_turns_cached_and_spread_ones_do_not() -> None:
    affine, salts = _balancer(3, affine=True)
    turns = await measure_affinity.run("http://lb", "affinity", 4, 5, 8, None, "run1", 10, transport=affine)
    summary = measure_affinity.summarize(turns, "affinity", 4, 5)
    assert summary["failed"] == 0 and len(turns) == 20
    assert len(set(salts)) == 4 and all(len(s) >= 16 for s in salts)  # a tenant per user (the API's minimum)
    # Turn t's prompt (10 tokens a message: system + 2t-1) finds turn t-1's (2t-2 messages) cached.
    for row in summary["per_turn"][1:]:
        t = row["turn"]
        assert row["cache_hit_rate"] == round(10 * (2 * t - 2) / (10 * (2 * t)), 4)
        assert row["index_share"] == 0.25
    assert summary["per_turn"][0]["cache_hit_rate"] == 0
    spread, _ = _balancer(3, affine=False)
    turns = await measure_affinity.run("http://lb", "round-robin", 4, 5, 8, None, "run1", 10, transport=spread)
    spread_summary = measure_affinity.summarize(turns, "round-robin", 4, 5)
    assert spread_summary["cache_hit_rate_after_turn_1"] < summary["cache_hit_rate_after_turn_1"]


async def test_a_failed_turn_ends_its_conversation_and_is_counted() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": "full"})

    turns = await measure_affinity.run("http://lb", "x", 2, 5, 8, "k", "run2", 10, httpx.MockTransport(handle))
    summary = measure_affinity.summarize(turns, "x", 2, 5)
    assert summary["failed"] == 2 and len(turns) == 2
    assert summary["errors"][0].startswith("429")
