"""The load generator against the app served in process: complete responses, equality checks, 429s."""

from __future__ import annotations

import httpx
import pytest

from app.loadtest import markdown, run_in_process, run_level, summarize_level
from app.server import create_app
from app.settings import Settings

pytestmark = pytest.mark.anyio

PROMPTS = ["Name three colours.", "Count from one to five.", "What is the capital of Italy?"]


async def _level(engine, clients: int, requests: int, api: str, **settings):
    app = create_app(Settings(**settings), engine)
    async with app.router.lifespan_context(app):
        options = {"max_new_tokens": 8, "speculative": {"draft": "ngram"}, "model": "smollm2-135m-instruct"}
        if api == "tgi":
            options.pop("model")
        return await run_level(
            "http://testserver", PROMPTS, clients, requests, options, 120, api, None, httpx.ASGITransport(app=app)
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
    assert [r.text for r in direct] == [r.text for r in served]
    row = summarize_level(direct, wall, {r.prompt_index: r.text for r in served}, greedy=True)
    assert row["completed"] == 3 and row["differs_from_alone"] == 0 and row["tokens_per_second"] > 0
    http = {**summarize_level(served, 2 * wall, None, True), "speculative": "ngram", "clients": 1}
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
    from app.loadtest import Result

    r = Result(0, ok=True, text="other", tokens=2, start=0.0, token_times=[0.1, 0.2], end=0.3)
    assert summarize_level([r], 1.0, {0: "expected"}, greedy=True)["differs_from_alone"] == 1


async def test_an_open_loop_level_sends_every_request_at_its_arrival_time(api_engine):
    """At a request rate, requests arrive on a seeded Poisson schedule whatever is in flight (so they overlap),
    and each still completes with the text its prompt gets alone."""
    from app.loadtest import run_rate

    alone, _ = await _level(api_engine, 1, 3, "chat")
    reference = {r.prompt_index: r.text for r in alone}
    app = create_app(Settings(), api_engine)
    async with app.router.lifespan_context(app):
        options = {"max_new_tokens": 8, "speculative": {"draft": "ngram"}, "model": "smollm2-135m-instruct"}
        transport = httpx.ASGITransport(app=app)
        results, wall = await run_rate("http://testserver", PROMPTS, 50.0, 6, options, 120, "chat", None, transport)
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
    import app.loadtest
    from app import cli
    from app.bench import read_prompts

    class Answer:
        def json(self):
            return {"data": [{"id": "m"}]}

    sent: list[list[str]] = []

    async def run_level(url, prompts, *args):
        sent.append(list(prompts))
        return [], 1.0

    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: Answer())
    monkeypatch.setattr(app.loadtest, "run_level", run_level)
    monkeypatch.setattr(app.loadtest, "summarize_level", lambda *args: {})
    monkeypatch.setattr(app.loadtest, "markdown", lambda rows: "")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["loadtest", "--clients", "1", "--draft", "none", "--out", "out"]) == 0
    assert sent == [[p.text for p in read_prompts(cli.BENCH_PROMPTS)]] and len(sent[0]) == 13
    assert (tmp_path / "out" / "loadtest.json").is_file()
