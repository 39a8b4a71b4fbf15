"""The load generator against the app served in process: complete responses, equality checks, 429s; the
multi-turn and mixed workloads (their texts, runners and summaries, mostly on fakes) and the prefix-cache
hit rate read from /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.api.server import create_app
from app.bench.loadtest import (
    NO_PREFIX_CACHE,
    Result,
    markdown,
    markdown_mixed,
    markdown_multiturn,
    prefix_cache_counters,
    prefix_cache_hit_rate,
    run_conversations,
    run_in_process,
    run_level,
    run_mixed,
    summarize_level,
    summarize_mixed,
    summarize_turns,
)
from app.bench.workload_texts import SHORT_PROMPTS, SYSTEM_PROMPT, long_document, long_prompt, user_turns
from app.service.settings import Settings

pytestmark = pytest.mark.anyio

PROMPTS = ["Name three colours.", "Count from one to five.", "What is the capital of Italy?"]


async def _level(engine, clients: int, requests: int, api: str, **settings):
    app = create_app(Settings(**settings), engine)
    async with app.router.lifespan_context(app):
        options = {"max_new_tokens": 8, "speculative": {"draft": "ngram"}, "model": "smollm2-135m-instruct"}
        if api == "tgi":
            options.pop("model")
        return await run_level(
            "http://localhost", PROMPTS, clients, requests, options, 120, api, None, httpx.ASGITransport(app=app)
        )


@pytest.mark.parametrize("api", ["chat", "tgi"])
async def test_concurrent_clients_all_complete_with_the_text_sent_alone(api_engine, api):
    alone, wall = await _level(api_engine, 1, 3, api)
    assert all(r.ok for r in alone) and wall > 0
    reference = {r.prompt_index: r.text for r in alone}
    together, wall = await _level(api_engine, 3, 6, api)
    row = summarize_level(together, wall, reference, greedy=True)
    assert row["completed"] == row["requests"] == 6
    assert row["differs_from_alone"] == 0 and row["errors"] == {}
    assert row["tokens"] > 0 and row["tokens_per_second"] > 0
    assert row["ttft_ms"]["p50"] is not None and row["itl_ms"]["p99"] >= row["itl_ms"]["p50"]
    table = markdown(
        [
            {"speculative": "ngram", "clients": 1, **summarize_level(alone, 1.0, None, True)},
            {"speculative": "ngram", "clients": 3, **row},
        ]
    )
    assert "| ngram | http | 3 | 6/6 |" in table


async def test_in_process_requests_give_the_texts_served_over_http(api_engine):
    """The in-process baseline runs the very requests the chat clients send: same template, same texts."""
    served, _ = await _level(api_engine, 1, 3, "chat")
    direct, wall = run_in_process(api_engine, PROMPTS, 3, 8, "ngram", chat=True)
    assert [r.text for r in direct] == [r.text for r in served] and wall > 0
    # Walls of 1 s and 2 s, not the measured one: rates rounded to 0.01 tok/s on a slow (busy) machine would not
    # halve exactly.
    row = summarize_level(direct, 1.0, {r.prompt_index: r.text for r in served}, greedy=True)
    assert row["completed"] == 3 and row["differs_from_alone"] == 0 and row["tokens_per_second"] > 0
    http = {**summarize_level(served, 2.0, None, True), "speculative": "ngram", "clients": 1}
    table = markdown([{**row, "speculative": "ngram", "via": "in-process", "clients": 1}, http])
    # HTTP took twice the in-process wall time for the same tokens: half the rate.
    assert "| ngram | in-process | 1 | 3/3 |" in table and "nan" not in table
    assert "ngram: one client over HTTP streams 50% of in-process tok/s" in table


async def test_a_full_server_is_counted_as_429s(api_engine):
    results, wall = await _level(api_engine, 4, 4, "tgi", max_concurrent_requests=1, max_queue_size=0)
    row = summarize_level(results, wall, None, greedy=True)
    assert row["rejected_429"] >= 1 and row["completed"] >= 1
    assert row["completed"] + row["rejected_429"] == 4


def test_a_reference_mismatch_is_reported():
    from app.bench.loadtest import Result

    r = Result(0, ok=True, text="other", tokens=2, start=0.0, token_times=[0.1, 0.2], end=0.3)
    assert summarize_level([r], 1.0, {0: "expected"}, greedy=True)["differs_from_alone"] == 1


async def test_an_open_loop_level_sends_every_request_at_its_arrival_time(api_engine):
    """At a request rate, requests arrive on a seeded Poisson schedule whatever is in flight (so they overlap),
    and each still completes with the text its prompt gets alone."""
    from app.bench.loadtest import run_rate

    alone, _ = await _level(api_engine, 1, 3, "chat")
    reference = {r.prompt_index: r.text for r in alone}
    app = create_app(Settings(), api_engine)
    async with app.router.lifespan_context(app):
        options = {"max_new_tokens": 8, "speculative": {"draft": "ngram"}, "model": "smollm2-135m-instruct"}
        transport = httpx.ASGITransport(app=app)
        results, wall = await run_rate("http://localhost", PROMPTS, 50.0, 6, options, 120, "chat", None, transport)
    starts = sorted(r.start for r in results)
    ends = sorted(r.end for r in results)
    assert len(results) == 6 and starts[1] < ends[0]  # the second arrived before the first was done
    row = summarize_level(results, wall, reference, greedy=True)
    assert row["completed"] == 6 and row["differs_from_alone"] == 0 and row["errors"] == {}
    table = markdown([{"speculative": "ngram", "clients": None, "rate": 50.0, **row}])
    assert "| ngram | http | 50/s | 6/6 |" in table


def test_loadtest_sends_the_packages_prompts_by_default(monkeypatch, tmp_path):
    """With no --input, `specserve loadtest` sends the package's own prompts (as `specserve bench`), from any
    directory: no path that only this repository's CI layout has."""
    import app.bench.loadtest
    from app import cli
    from app.bench.specbench import read_prompts
    from app.cli import common

    class Answer:
        status_code = 200
        text = ""  # /metrics: no prefix-cache counters

        def json(self):
            return {"data": [{"id": "m"}]}

    sent: list[tuple[list[str], int, int]] = []

    async def run_level(url, prompts, clients, requests, *args):
        sent.append((list(prompts), clients, requests))
        return [], 1.0

    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: Answer())
    monkeypatch.setattr(app.bench.loadtest, "run_level", run_level)
    monkeypatch.setattr(app.bench.loadtest, "summarize_level", lambda *args: {})
    monkeypatch.setattr(app.bench.loadtest, "markdown", lambda rows: "")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["loadtest", "--clients", "2", "--draft", "none", "--out", "out"]) == 0
    texts = [p.text for p in read_prompts(common.BENCH_PROMPTS)]
    # First the warm-up (each prompt once, one client: the server's prefix cache is as warm for the first level
    # as for the others), then the level.
    assert sent == [(texts, 1, 13), (texts, 2, 16)] and len(texts) == 13  # 16 requests: the default
    sent.clear()
    assert cli.main(["loadtest", "--clients", "2", "--draft", "none", "--no-warmup", "--out", "out"]) == 0
    assert sent == [(texts, 2, 16)]
    assert (tmp_path / "out" / "loadtest.json").is_file()
    assert json.loads((tmp_path / "out" / "loadtest.json").read_text())[0]["prefix_cache"]["note"] == NO_PREFIX_CACHE


# --- the multi-turn and mixed workloads ------------------------------------------------------------------------


def test_conversations_are_seeded_distinct_per_user_and_about_300_tokens_a_turn_with_the_answer():
    turns = user_turns(0, 10, seed=0)
    assert turns == user_turns(0, 10, seed=0) and len(turns) == 10 and len(set(turns)) == 10
    assert turns != user_turns(1, 10, seed=0) and turns != user_turns(0, 10, seed=1)
    # About 150 tokens a message (a word is 1.3 tokens or so): with a 128-token answer, ~300 a turn.
    assert all(100 <= len(t.split()) <= 170 for t in turns)
    assert len(SYSTEM_PROMPT.split()) >= 300  # a few hundred tokens every conversation shares


def test_the_workload_texts_are_the_projects_own_not_a_benchmarks():
    """The texts are written in app/bench/workload_texts.py (and the bench's episodes in app/bench/workloads.py):
    neither reads a file, and none of the texts is a Spec-Bench prompt."""
    import app.bench.workload_texts
    import app.bench.workloads

    for module in (app.bench.workload_texts, app.bench.workloads):
        source = Path(module.__file__).read_text()
        assert "shared" not in source and "open(" not in source and "read_text" not in source
    bench = [json.loads(line) for line in Path("app/bench/prompts.jsonl").read_text().splitlines() if line]
    specbench = Path(__file__).resolve().parents[2] / "shared" / "bench" / "specbench-dev.jsonl"
    if specbench.is_file():
        bench += [json.loads(line) for line in specbench.read_text().splitlines() if line]
    theirs = " ".join(" ".join(map(str, b.get("turns", []))) for b in bench)
    ours = [SYSTEM_PROMPT, *SHORT_PROMPTS, *user_turns(3, 10), long_document(0, 20)]
    assert not any(text[:60] in theirs for text in ours)


def test_a_long_prompt_is_sized_to_the_token_budget_and_distinct_per_index():
    def count(text: str) -> int:  # a fake tokenizer: 1.3 tokens a word, plus a chat template's 20
        return int(len(text.split()) * 1.3) + 20

    sizes = []
    for i in range(3):
        text = long_prompt(i, 4000, count, seed=7)
        assert text == long_prompt(i, 4000, count, seed=7)
        sizes.append(count(text))
    assert all(0.95 * 4000 <= n <= 4000 for n in sizes)
    assert len({long_prompt(i, 500, count)[:200] for i in range(3)}) == 3


def _turn(user: int, turn: int, ttft: float, prompt_tokens: int, tokens: int = 10, ok: bool = True) -> Result:
    start = 100.0 * user + 10.0 * turn
    return Result(
        user, ok, None if ok else "http_500", "x", tokens, start, [start + ttft, start + ttft + 0.05], start + 1,
        None, prompt_tokens, user, turn,
    )  # fmt: skip


def test_turns_are_summarized_per_turn_index_with_the_growth_of_the_prompts():
    results = [
        _turn(0, 1, 0.10, 400),
        _turn(0, 2, 0.12, 700),
        _turn(0, 3, 0.14, 1000),
        _turn(1, 1, 0.20, 410),
        _turn(1, 2, 0.22, 720),
        _turn(1, 3, 0.30, 1030),
    ]
    m = summarize_turns(results, 3)
    assert [t["turn"] for t in m["per_turn"]] == [1, 2, 3]
    assert [t["prompt_tokens_p50"] for t in m["per_turn"]] == [405, 710, 1015]
    assert m["per_turn"][0]["ttft_p50_ms"] == 100.0 and m["per_turn"][2]["ttft_p50_ms"] == 140.0
    assert m["ttft_last_over_first"] == 1.4 and m["ttft_goal_met"] is True
    assert m["prompts_grew"] == "2/2" and m["completed_conversations"] == 2
    # The answers' digest: the same answers in any order give it; one token's difference changes it.
    assert summarize_turns(results[::-1], 3)["answers_sha256"] == m["answers_sha256"]
    changed = _turn(1, 3, 0.30, 1030)
    changed.text += "!"
    assert summarize_turns([*results[:5], changed], 3)["answers_sha256"] != m["answers_sha256"]
    # A prompt that did not grow by the previous answer (the server lost the conversation), and a failed turn.
    results[4] = _turn(1, 2, 0.22, 415)
    results[2] = _turn(0, 3, 0.50, 1000, ok=False)
    m = summarize_turns(results, 3)
    assert m["prompts_grew"] == "1/2" and m["completed_conversations"] == 1
    assert m["per_turn"][2]["completed"] == 1 and m["ttft_last_over_first"] == 3.0 and m["ttft_goal_met"] is False
    row = {"speculative": "none", "clients": 2, **summarize_level(results, 1.0, None, True), "multiturn": m}
    table = markdown_multiturn([{**row, "prefix_cache": prefix_cache_hit_rate("", "")}])
    assert "| none | 2 | 5/6 | 1/2 |" in table and "| 3.0 | 1/2 | 1 | n/a (server has no prefix cache) |" in table
    assert "| none | 2 | 3 | 1/2 | 300.0/300.0 | 1030 | 10 |" in table


def test_short_requests_are_summarized_apart_from_the_long_ones():
    def req(kind: str, start: float, ttft: float, end: float) -> Result:
        return Result(0, True, None, "x", 4, start, [start + ttft], end, kind=kind)

    results = [req("long", 0.0, 30.0, 60.0), req("long", 0.0, 40.0, 61.0)]
    results += [req("short", 1.5, 0.3, 1.9), req("short", 1.9, 0.9, 3.5), req("short", 70.0, 0.1, 70.2)]
    m = summarize_mixed(results)
    assert m["long"]["requests"] == 2 and m["long"]["ttft_s"] == {"p50": 35.0, "max": 40.0}
    assert m["short"]["requests"] == 3 and m["short"]["ttft_s"]["max"] == 0.9
    # Two of the short ones ran beside the long ones; the second took 1.6 s: within 2 s, first token within 1 s.
    assert m["short"]["beside_long"] == 2 and m["short"]["goal_met"] is True
    results[3] = req("short", 1.9, 1.2, 3.5)
    assert summarize_mixed(results)["short"]["goal_met"] is False
    row = {"speculative": "default", **summarize_level(results, 70.2, None, True), "mixed": summarize_mixed(results)}
    assert "| default | 2/2 | None | 35.0/40.0 | 60.5/61.0 | 3/3 | 2 | 0.3/1.2 |" in markdown_mixed([row])


METRICS = """# HELP specserve_prefix_cache_queries Prompt tokens looked up in the prefix cache.
# TYPE specserve_prefix_cache_queries counter
specserve_prefix_cache_queries_total{{model_name="m"}} {queries}
specserve_prefix_cache_queries_created{{model_name="m"}} 1.7e+09
# TYPE specserve_prefix_cache_hits counter
specserve_prefix_cache_hits_total{{model_name="m"}} {hits}
specserve_prefix_cache_hits_created{{model_name="m"}} 1.7e+09
specserve_num_requests_running{{model_name="m"}} 3.0
"""


def test_the_prefix_cache_hit_rate_comes_from_the_metrics_counters_when_there_are_some():
    before, after = METRICS.format(queries=100.0, hits=10.0), METRICS.format(queries=1100.0, hits=610.0)
    assert prefix_cache_counters(before) == (100.0, 10.0)
    assert prefix_cache_hit_rate(before, after) == {"queries": 1000.0, "hits": 600.0, "hit_rate": 0.6}
    # vLLM's own names, one series per label set: summed.
    vllm = 'vllm:prefix_cache_queries_total{engine="0"} 30\nvllm:prefix_cache_queries_total{engine="1"} 20\n'
    assert prefix_cache_counters(vllm + 'vllm:prefix_cache_hits_total{engine="0"} 5\n') == (50.0, 5.0)
    # No counters (today's server), or no /metrics at all: a note, not an error.
    plain = 'specserve_num_requests_running{model_name="m"} 0.0\n'
    assert prefix_cache_counters(plain) is None
    assert prefix_cache_hit_rate(plain, plain) == {"hit_rate": None, "note": NO_PREFIX_CACHE}
    assert prefix_cache_hit_rate(None, plain)["note"] == "n/a (no /metrics)"
    assert prefix_cache_hit_rate(before, before)["hit_rate"] is None  # no queries in the level
    level = summarize_level([Result(0, True, None, "x", 2, 0.0, [0.1, 0.2], 0.3)], 1.0, None, True)
    rows = [
        {"speculative": "none", "clients": c, **level, "prefix_cache": prefix_cache_hit_rate(plain, plain)}
        for c in (1, 2)
    ]
    assert markdown(rows).endswith("\n- prefix cache hit rate: n/a (server has no prefix cache)")  # once
    rows[1]["prefix_cache"] = prefix_cache_hit_rate(before, after)
    assert "- none 2: prefix cache hit rate 60.0% (600/1000 tokens)" in markdown(rows)


def _sse(pieces: list[str], prompt_tokens: int) -> bytes:
    """An OpenAI chat stream of `pieces`, ending with finish_reason and the usage chunk."""
    chunks = [{"choices": [{"delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    chunks.append({"choices": [{"delta": {}, "finish_reason": "length"}]})
    chunks.append({"choices": [], "usage": {"completion_tokens": len(pieces), "prompt_tokens": prompt_tokens}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


async def test_mixed_sends_the_short_requests_beside_the_long_ones():
    """On a fake server whose long answers take 0.4 s: the short requests start after the delay, while the long
    ones still run, with their own max_tokens."""
    bodies: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        long = len(body["messages"][0]["content"]) > 100
        if long:
            await asyncio.sleep(0.4)
        return httpx.Response(200, content=_sse(["a", " b", " c"], 4000 if long else 12))

    longs = [long_document(i, 20) for i in range(2)]
    options = {"max_new_tokens": 16, "speculative": {"draft": "none"}, "model": "m"}
    transport = httpx.MockTransport(handler)
    results, wall = await run_mixed("http://x", longs, SHORT_PROMPTS, 3, options, 4, 0.05, 60, transport=transport)
    assert wall >= 0.4 and all(r.ok for r in results) and [r.kind for r in results] == ["long"] * 2 + ["short"] * 3
    assert sorted(b["max_tokens"] for b in bodies) == [4, 4, 4, 16, 16]
    m = summarize_mixed(results)
    assert m["short"]["beside_long"] == 3 and m["long"]["prompt_tokens_p50"] == 4000 and m["short"]["goal_met"]


async def test_conversations_over_a_real_server_grow_turn_by_turn(api_engine):
    """Two users, two turns, 4 tokens an answer: every turn completes, each prompt holds the system prompt and
    the whole conversation so far (the usage field's prompt tokens grow by at least the previous answer)."""
    app = create_app(Settings(), api_engine)
    async with app.router.lifespan_context(app):
        options = {"max_new_tokens": 4, "speculative": {"draft": "ngram"}, "model": "smollm2-135m-instruct"}
        transport = httpx.ASGITransport(app=app)
        results, _ = await run_conversations("http://localhost", 2, 2, options, 120, None, transport, seed=1)
    assert len(results) == 4 and all(r.ok for r in results), [r.error for r in results]
    m = summarize_turns(results, 2)
    assert m["prompts_grew"] == "2/2" and m["completed_conversations"] == 2
    prompts = [t["prompt_tokens_p50"] for t in m["per_turn"]]
    assert prompts[0] > 300 and prompts[1] > prompts[0] + 100  # the system prompt, then the turn's ~150 more
    assert m["ttft_last_over_first"] is not None


def test_loadtest_mixed_sizes_the_long_prompts_from_info_and_reports_them_apart(monkeypatch, tmp_path, capsys):
    """`specserve loadtest --workload mixed`: long prompts sized to /info's limits (less the answer) by the
    server's /tokenize, the short ones with --short-tokens, the table and JSON with both parts and the
    prefix-cache hit rate (this server's /metrics has the counters)."""
    import app.bench.loadtest
    from app import cli

    metrics = iter([METRICS.format(queries=0.0, hits=0.0), METRICS.format(queries=9000.0, hits=3000.0)])

    class Answer:
        status_code = 200

        def __init__(self, url: str, body: dict | None = None):
            self.url, self.body = url, body
            self.text = next(metrics) if url.endswith("/metrics") else ""

        def json(self):
            if self.url.endswith("/info"):
                return {"max_input_tokens": 8191, "max_total_tokens": 8192}
            if self.url.endswith("/tokenize"):
                return {"count": int(len(self.body["messages"][0]["content"].split()) * 1.3)}
            return {"data": [{"id": "m"}]}

    sent: dict = {}

    async def run_mixed(url, longs, shorts, short_requests, options, short_tokens, *args):
        sent.update(longs=longs, short_requests=short_requests, short_tokens=short_tokens, options=options)

        def req(kind: str, start: float, end: float) -> Result:
            return Result(0, True, None, "x", 4, start, [start + 0.2], end, prompt_tokens=8000, kind=kind)

        return [req("long", 0.0, 50.0), req("short", 1.5, 2.0)], 50.0

    monkeypatch.setattr(httpx, "get", lambda url, **kwargs: Answer(url))
    monkeypatch.setattr(httpx, "post", lambda url, json=None, **kwargs: Answer(url, json))
    monkeypatch.setattr(app.bench.loadtest, "run_mixed", run_mixed)
    args = ["loadtest", "--workload", "mixed", "--draft", "none", "--long-prompts", "2", "-n", "64"]
    assert cli.main([*args, "--short-requests", "3", "--out", str(tmp_path)]) == 0
    assert len(sent["longs"]) == 2 and sent["short_requests"] == 3 and sent["short_tokens"] == 4
    target = 8192 - 64 - 8
    assert all(0.95 * target <= int(len(p.split()) * 1.3) <= target for p in sent["longs"])
    row = json.loads((tmp_path / "loadtest.json").read_text())[0]
    assert row["mixed"]["long"]["target_tokens"] == target and row["mixed"]["short"]["goal_met"] is True
    assert row["prefix_cache"]["hit_rate"] == 0.3333
    table = (tmp_path / "loadtest.md").read_text()
    assert (
        "| none | 1/1 | 8000 | 0.2/0.2 | 50.0/50.0 | 1/1 | 1 | 0.2/0.2 | 0.5/0.5 | met | 0 | 33.3% (3000/9000" in table
    )
    capsys.readouterr()  # the run's table
    assert cli.main(["loadtest", "--workload", "multiturn", "--api", "tgi"]) == 1
    assert "needs --api chat" in capsys.readouterr().err


# --- the traffic workloads (issue 70, item 2) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def batching_engine(packed_target):
    """The target packed for a CPU kernel, with the n-gram draft: batched decoding and a prefix cache, as served."""
    from app.engine import kernels
    from app.engine.drafting.ngram import NgramDrafter
    from app.engine.engine import Engine
    from tests.conftest import FIXED_DRAFT

    packed = packed_target(kernels.available()[0])
    engine = Engine(packed.model, packed.tokenizer, {"ngram": NgramDrafter()}, "ngram", 4, **FIXED_DRAFT)
    assert engine.prefix_cache is not None
    return engine


class _Recording(httpx.AsyncBaseTransport):
    """A transport that keeps every request body it passes on."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.bodies = inner, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(await request.aread()))
        return await self.inner.handle_async_request(request)


async def test_traffic_episodes_answer_as_alone_each_client_its_own_tenant(batching_engine):
    """Two clients each run an agent and a chat episode at once (different orders) on a batching server with a
    prefix cache: every turn's messages are built from the answers the server streamed (the agent's tools sent,
    its calls answered by their results), every answer equals its turn alone, and each client's requests carry its
    own salt. On the server's side the salts keep the tenants apart: the first turn of every episode finds nothing
    cached although the alone pass sent the very same prompt, while later turns find their own history; without
    salts one client's first turn reads what the other left."""
    import dataclasses

    from app.bench import loadtest, workloads

    episodes = [
        dataclasses.replace(workloads.episodes("agent")[0], turns=3),
        dataclasses.replace(workloads.episodes("chat")[1], turns=2),
    ]
    options = {"model": "smollm2-135m-instruct", "speculative": {"draft": "ngram"}}
    app = create_app(Settings(), batching_engine)
    async with app.router.lifespan_context(app):
        transport = _Recording(httpx.ASGITransport(app=app))

        async def level(clients: int, salts: list[str] | None):
            transport.bodies.clear()
            args = ("http://localhost", episodes, clients, 2, options, 120, salts, None, transport, 8)
            results, wall = await loadtest.run_episodes(*args)
            assert all(r.ok for r in results) and len(results) == 5 * clients, [r.error for r in results]
            return results, wall, list(transport.bodies)

        alone, _, _ = await level(1, ["loadtest-test-alone-client-0"])
        salts = ["loadtest-test-level2-client-0", "loadtest-test-level2-client-1"]
        results, wall, bodies = await level(2, salts)
        unsalted, _, unsalted_bodies = await level(2, None)
    reference = loadtest.episode_reference(alone)
    summary = loadtest.summarize_episodes(results, episodes, reference)
    assert (summary["same"], summary["compared"], summary["diverged"]) == (10, 10, 0)
    assert summary["completed_episodes"] == summary["episodes"] == 4
    assert set(summary["per_workload"]) == {"agent", "chat"}
    assert summary["per_workload"]["agent"]["same"] == summary["per_workload"]["agent"]["compared"] == 6
    # Each client started with another episode, so the two ran side by side.
    assert {r.workload for r in results if r.turn == 0 and r.user == 0} == {"agent", "chat"}
    assert results[0].workload != results[1].workload
    assert {b["cache_salt"] for b in bodies} == set(salts) and all("cache_salt" not in b for b in unsalted_bodies)
    assert all(b["speculative"] == {"draft": "ngram"} and b["stream"] and b["temperature"] == 0 for b in bodies)
    agent = [b for b in bodies if b.get("tools")]
    assert len(agent) == 6 and all(b["tools"] == workloads.AGENT_TOOLS for b in agent)
    last = max(agent, key=lambda b: len(b["messages"]))["messages"]
    assert [m["role"] for m in last[2:]] == ["assistant", "tool", "assistant", "tool"]
    call = last[-2]["tool_calls"][0]["function"]
    assert last[-1]["content"] == workloads.tool_result(call["name"], json.loads(call["arguments"]))
    chat = max((b for b in bodies if not b.get("tools")), key=lambda b: len(b["messages"]))["messages"]
    first_answers = {r.text for r in results if r.workload == "chat" and r.turn == 0}
    assert chat[2]["role"] == "assistant" and chat[2]["content"] in first_answers
    # The server's side: cached prompt tokens as its usage reports them.
    assert all(r.cached_tokens == 0 for r in results if r.turn == 0)
    assert all(r.cached_tokens and r.cached_tokens > 0 for r in results if r.turn > 0)
    assert any(r.cached_tokens for r in unsalted if r.turn == 0)
    row = {"speculative": "ngram", "clients": 2, **summarize_level(results, wall, None, True), "traffic": summary}
    table = loadtest.markdown_traffic([row], ["cache_salt: its own"])
    assert "| ngram | 2 | 4/4 | 10/10 |" in table and "| 10/10 |" in table
    assert "| ngram | 2 | agent | 6/6 |" in table and table.endswith("- cache_salt: its own")


@contextlib.contextmanager
def _serving(app) -> Iterator[str]:
    """uvicorn serving `app` on a free port of 127.0.0.1 in a thread; yields its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def test_loadtest_traffic_against_our_server_salts_every_level(batching_engine, tmp_path, capsys):
    """`specserve loadtest --workload rag` against our server: the episodes alone first, then each level, every
    answer equal to its alone, the draft sent, and no level finds a prompt in the server's cache although the
    alone pass sent every one of them (unsalted, they share one tenant: the test above)."""
    from app import cli

    app = create_app(Settings(allowed_hosts="127.0.0.1"), batching_engine)
    argv = ["loadtest", "--workload", "rag", "--clients", "1,2", "--episodes", "1", "-n", "4", "--draft", "ngram"]
    with _serving(app) as url:
        assert cli.main([*argv, "--url", url, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "loadtest.json").read_text())
    assert [r["clients"] for r in rows] == [1, 2] and all(r["server"] == "specserve" for r in rows)
    assert all(r["speculative"] == "ngram" and r["completed"] == r["requests"] for r in rows)
    assert all(r["traffic"]["same"] == r["traffic"]["compared"] == r["requests"] for r in rows)
    assert all(r["cache_salt"] == "per level and client" for r in rows)
    assert all(r["traffic"]["cached_prompt_share"] == 0.0 for r in rows)
    notes = (tmp_path / "loadtest.md").read_text()
    assert "server: specserve" in notes and "cache_salt: its own for each level and client" in notes
    assert "alone: 4 episodes" in capsys.readouterr().out


class _ToyServer:
    """An OpenAI-compatible toy on 127.0.0.1 that refuses `cache_salt` (as OpenAI's own API refuses a field it does
    not know) and has no /info: it streams a tool call to requests with tools, else a text naming how many messages
    it got; every body it receives is kept. `ours`: it answers /info as specserve does, takes `cache_salt`, and
    numbers its texts, so that no answer under load equals its alone. `cached`: it takes `cache_salt` and reports
    that many prompt tokens cached on every request (as llama-server, which ignores the field)."""

    def __init__(self, ours: bool = False, cached: int | None = None) -> None:
        import http.server
        import threading

        bodies = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._json(200, {"data": [{"id": "toy"}]})
                elif self.path == "/info" and ours:
                    self._json(200, {"model_id": "toy", "available_drafts": ["none"]})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                if "cache_salt" in body and not ours and cached is None:
                    message = "Unrecognized request argument supplied: cache_salt"
                    return self._json(400, {"error": {"message": message, "type": "invalid_request_error"}})
                if body.get("tools"):
                    head = {"index": 0, "id": f"call_{len(bodies)}", "type": "function"}
                    deltas = [
                        {"tool_calls": [{**head, "function": {"name": "list_files", "arguments": ""}}]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": '}}]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": '"docs"}'}}]},
                    ]
                else:
                    seen = f"{len(body['messages'])} messages" + (f", request {len(bodies)}" if ours else "")
                    deltas = [{"content": "seen "}, {"content": seen}]
                chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
                chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                usage = {"prompt_tokens": 50, "completion_tokens": len(deltas)}
                if cached is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": cached}
                chunks.append({"choices": [], "usage": usage})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in chunks:
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_loadtest_traffic_against_a_server_that_refuses_cache_salt(tmp_path, capsys):
    """Another server (no /info of ours): a refused cache_salt stops the run with the way out (--no-salt); with it,
    every workload runs mixed, neither salt nor `speculative` is sent (nor --draft taken), the agent's tools and the
    toy's own calls go back with their results, and the report says the salts were not sent and that answers are
    compared with the server's own alone as agreement."""
    from app import cli
    from app.bench import workloads

    toy = _ToyServer()
    try:
        argv = ["loadtest", "--url", toy.url, "--workload", "traffic", "--clients", "1,2", "--episodes", "2"]
        assert cli.main([*argv, "--out", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert "refused the cache_salt field" in err and "rerun with --no-salt" in err
        assert toy.bodies[0]["cache_salt"].startswith("loadtest-")
        assert cli.main([*argv, "--draft", "none", "--out", str(tmp_path)]) == 1
        assert "--draft chooses ours only" in capsys.readouterr().err
        toy.bodies.clear()
        assert cli.main([*argv, "--no-salt", "--out", str(tmp_path)]) == 0
    finally:
        toy.close()
    assert toy.bodies and all("cache_salt" not in b and "speculative" not in b for b in toy.bodies)
    agent = [b for b in toy.bodies if b.get("tools")]
    assert agent and all(b["tools"] == workloads.AGENT_TOOLS for b in agent)
    later = max(agent, key=lambda b: len(b["messages"]))["messages"]
    assert later[-2]["tool_calls"][0]["function"] == {"name": "list_files", "arguments": '{"path": "docs"}'}
    assert later[-1] == {
        "role": "tool",
        "tool_call_id": later[-2]["tool_calls"][0]["id"],
        "content": workloads.tool_result("list_files", {"path": "docs"}),
    }
    rows = json.loads((tmp_path / "loadtest.json").read_text())
    assert [r["clients"] for r in rows] == [1, 2] and all(r["server"] == "other" for r in rows)
    assert all(r["cache_salt"] == "not sent" and r["speculative"] == "(not sent)" for r in rows)
    # Two episodes a client, the first two of the mixed list for one client: an agent loop and a conversation.
    assert set(rows[0]["traffic"]["per_workload"]) == {"agent", "chat"}
    assert all(r["traffic"]["same"] == r["traffic"]["compared"] > 0 for r in rows)
    table = (tmp_path / "loadtest.md").read_text()
    assert "cache_salt NOT sent (--no-salt)" in table and "server: not specserve" in table
    assert "| (not sent) | 2 | 4/4 |" in table


def test_loadtest_traffic_fails_where_our_answers_under_load_differ_from_alone(tmp_path, capsys):
    """Against our server (its /info) an answer that differs from its turn alone is a failure (exit status 1, said),
    after the report is written; the draft goes in `speculative` (default and none unless --draft says), salted."""
    from app import cli

    toy = _ToyServer(ours=True)
    try:
        argv = ["loadtest", "--url", toy.url, "--workload", "chat", "--clients", "2", "--episodes", "1"]
        assert cli.main([*argv, "--out", str(tmp_path)]) == 1
    finally:
        toy.close()
    assert "error: 4 of our server's answers under load differ from the same turn alone" in capsys.readouterr().err
    drafts = [b["speculative"]["draft"] for b in toy.bodies]
    assert set(drafts) == {"default", "none"} and all(b["cache_salt"].startswith("loadtest-") for b in toy.bodies)
    rows = json.loads((tmp_path / "loadtest.json").read_text())
    # Each level's first turns differ; the turns after them had other prompts than alone: not compared.
    assert [(r["speculative"], r["traffic"]["same"], r["traffic"]["compared"]) for r in rows] == [
        ("default", 0, 2),
        ("none", 0, 2),
    ]
    assert all(r["traffic"]["diverged"] == 8 for r in rows)
    assert "| default | 2 | 2/2 | 10/10 |" in (tmp_path / "loadtest.md").read_text()


def test_loadtest_traffic_says_when_a_server_ignores_cache_salt(tmp_path, capsys):
    """A server that takes cache_salt but still reports prompt tokens cached on a salt's first request ignores it
    (llama-server does): the row and the notes say so instead of claiming that no level read another's prompts."""
    from app import cli

    toy = _ToyServer(cached=40)
    try:
        argv = ["loadtest", "--url", toy.url, "--workload", "rag", "--clients", "1,2", "--episodes", "1"]
        assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    finally:
        toy.close()
    assert all(b["cache_salt"].startswith("loadtest-") for b in toy.bodies)
    rows = json.loads((tmp_path / "loadtest.json").read_text())
    assert [r["traffic"]["first_requests_cached"] for r in rows] == [1, 2]
    assert all(r["cache_salt"] == "sent, ignored by the server" for r in rows)
    table = (tmp_path / "loadtest.md").read_text()
    assert "cache_salt sent but IGNORED by the server: 3 clients' first requests" in table
    assert "its own for each level and client" not in table and "| 80.0% |" in table


async def test_a_request_is_sent_again_once_where_the_kept_alive_connection_was_closed():
    """A connection the server closed under a request that had not reached it (RemoteProtocolError before any
    response): sent again, once, and counted; a second such failure is the request's error."""
    failures = iter([True, False, True, True])

    async def handler(request: httpx.Request) -> httpx.Response:
        if next(failures):
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, content=_sse(["a", " b"], 12))

    options = {"max_new_tokens": 4, "model": "m"}
    transport = httpx.MockTransport(handler)
    results, wall = await run_level("http://x", ["p"], 1, 2, options, 60, "chat", None, transport)
    assert [(r.ok, r.resent, r.error) for r in results] == [(True, True, None), (False, True, "RemoteProtocolError")]
    assert results[0].text == "a b" and summarize_level(results, wall, None, True)["resent"] == 2
