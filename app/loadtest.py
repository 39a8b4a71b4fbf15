"""`specserve loadtest`: N concurrent streaming clients against a running server.

Each client sends prompts one after another, streamed (OpenAI chat completions, or TGI's /generate_stream),
until the requests are done or the time limit passes (a closed loop); or, at a request rate, requests arrive
as a Poisson process whatever is in flight (an open loop, as vLLM's serving benchmark sends them). For every
request it records when each event arrived, so the figures are what a streaming user sees: time to first
token (TTFT), the gaps between events (inter-token latency, ITL), total throughput in tokens/s, errors by
kind and 429s. Every response is checked: it must end with a final event (complete) whose text equals the
events' texts, and greedy responses must equal the text the same prompt got when sent alone (the pass at
concurrency 1).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from app.engine.engine import Engine


@dataclass
class Result:
    prompt_index: int
    ok: bool
    error: str | None = None
    text: str = ""
    tokens: int = 0
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    speculative: dict[str, Any] | None = None


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)}


async def _one(
    client: httpx.AsyncClient,
    url: str,
    index: int,
    prompt: str,
    options: dict[str, Any],
    headers: dict[str, str],
    api: str,
) -> Result:
    """One streamed request. `api` "tgi": /generate_stream with the prompt as is; "chat":
    /v1/chat/completions with the prompt as the user message (the server applies the chat template)."""
    if api == "tgi":
        path = "/generate_stream"
        body: dict[str, Any] = {"inputs": prompt, "parameters": {**options, "details": True}}
    else:
        path = "/v1/chat/completions"
        body = {
            "model": options["model"],
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": options["max_new_tokens"],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "speculative": options.get("speculative"),
        }
    result = Result(index, ok=False, start=time.perf_counter())
    finished = False
    try:
        async with client.stream("POST", url + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.error = "429" if resp.status_code == 429 else f"http_{resp.status_code}"
                return result
            pieces: list[str] = []
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    result.error = (
                        f"stream_error: {err.get('type') if isinstance(err, dict) else event.get('error_type')}"
                    )
                    return result
                if api == "tgi":
                    result.token_times.append(time.perf_counter())
                    pieces.append(event["token"]["text"])
                    if event.get("generated_text") is not None:
                        finished = True
                        result.text = event["generated_text"]
                        result.speculative = (event.get("details") or {}).get("speculative")
                        result.tokens = len(result.token_times)
                else:
                    if event.get("usage"):
                        result.tokens = event["usage"]["completion_tokens"]
                    for choice in event.get("choices", []):
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            result.token_times.append(time.perf_counter())
                            pieces.append(text)
                        if choice.get("finish_reason"):
                            finished = True
                            result.speculative = event.get("speculative")
            if api == "chat":
                result.text = "".join(pieces)
            result.ok = finished and "".join(pieces) == result.text
            if not result.ok:
                result.error = "incomplete_stream" if not finished else "events_do_not_add_up"
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    finally:
        result.end = time.perf_counter()
    return result


def _client(time_limit: float, connections: int, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """The load generator's HTTP client: reads may take the whole level, `connections` at once (never fewer
    than are in flight, so none waits for a connection)."""
    timeout = httpx.Timeout(connect=10.0, read=max(60.0, time_limit), write=10.0, pool=10.0)
    return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=connections), transport=transport)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header a server with an API key wants (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_level(
    url: str,
    prompts: list[str],
    clients: int,
    requests: int,
    parameters: dict[str, Any],
    time_limit: float,
    api: str = "chat",
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[Result], float]:
    """`requests` requests over `clients` concurrent clients (prompt i mod len(prompts)); returns the results
    and the wall time. Clients stop picking up new requests after `time_limit` seconds. `parameters`: TGI
    parameters (max_new_tokens, speculative, ...) plus `model` for the chat API."""
    headers = auth_headers(api_key)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results: list[Result] = []
    started = time.perf_counter()
    async with _client(time_limit, clients + 2, transport) as client:

        async def worker() -> None:
            while not queue.empty() and time.perf_counter() - started < time_limit:
                i = queue.get_nowait()
                n = i % len(prompts)
                results.append(await _one(client, url, n, prompts[n], parameters, headers, api))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return results, time.perf_counter() - started


async def run_rate(
    url: str,
    prompts: list[str],
    rate: float,
    requests: int,
    parameters: dict[str, Any],
    time_limit: float,
    api: str = "chat",
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    seed: int = 0,
) -> tuple[list[Result], float]:
    """`requests` requests arriving at `rate` per second on average (exponential gaps drawn from `seed`, so
    every run offers the same schedule), each sent when it arrives whatever is still in flight; returns the
    results and the wall time until the last one ended. None is sent after `time_limit` seconds."""
    headers = auth_headers(api_key)
    gaps = random.Random(seed)
    tasks: list[asyncio.Task[Result]] = []
    started = time.perf_counter()
    async with _client(time_limit, requests + 2, transport) as client:
        due = 0.0
        for i in range(requests):
            due += gaps.expovariate(rate)
            if due >= time_limit:
                break
            await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
            n = i % len(prompts)
            tasks.append(asyncio.create_task(_one(client, url, n, prompts[n], parameters, headers, api)))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - started


def run_in_process(
    engine: Engine, prompts: list[str], requests: int, max_new_tokens: int, draft: str, chat: bool
) -> tuple[list[Result], float]:
    """The one-client level without HTTP: the same requests, one after another, straight on `engine`,
    timed as the clients time them (a step's tokens count as arriving when the step ends), so that what
    serving costs over the engine can be read off beside the HTTP level."""
    from app.engine.step import GenerationParams

    # The server's defaults, as /info reported them: the engine was built with them.
    params = GenerationParams(max_new_tokens=max_new_tokens, num_draft_tokens=engine.num_draft_tokens)
    tok = engine.tokenizer
    results: list[Result] = []
    started = time.perf_counter()
    for i in range(requests):
        n = i % len(prompts)
        result = Result(n, ok=False, start=time.perf_counter())
        text = tok.apply_chat_template([{"role": "user", "content": prompts[n]}]) if chat else prompts[n]
        gen = engine.start(tok.encode(text), params, draft)
        while not gen.finished:
            out = gen.step()
            if out.text:
                result.token_times.append(time.perf_counter())
        result.end = time.perf_counter()
        result.ok = True
        result.text = gen.text
        result.tokens = gen.stats.generated_tokens
        result.speculative = {"drafted": gen.stats.drafted, "accepted": gen.stats.accepted}
        results.append(result)
    return results, time.perf_counter() - started


def summarize_level(
    results: list[Result], wall: float, reference: dict[int, str] | None, greedy: bool
) -> dict[str, Any]:
    """Throughput, TTFT and ITL percentiles (milliseconds), errors by kind, and the output checks."""
    ok = [r for r in results if r.ok]
    ttft = [(r.token_times[0] - r.start) * 1e3 for r in ok if r.token_times]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    errors = Counter(r.error for r in results if r.error)
    mismatched = None
    if greedy and reference is not None:
        mismatched = sum(1 for r in ok if r.prompt_index in reference and reference[r.prompt_index] != r.text)
    tokens = sum(r.tokens for r in ok)
    accepted = sum((r.speculative or {}).get("accepted", 0) for r in ok)
    drafted = sum((r.speculative or {}).get("drafted", 0) for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_ms": {k: (round(v, 1) if v is not None else None) for k, v in _percentiles(ttft).items()},
        "itl_ms": {k: (round(v, 1) if v is not None else None) for k, v in _percentiles(itl).items()},
        "mean_request_seconds": round(statistics.fmean(r.end - r.start for r in ok), 3) if ok else None,
        "errors": dict(errors),
        "rejected_429": errors.get("429", 0),
        "differs_from_alone": mismatched,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """One table row per (speculation, concurrency or request rate)."""
    lines = [
        "| speculative | via | clients or rate | requests | tok/s | x one client | TTFT p50/p95 ms | "
        "ITL p50/p95/p99 ms | errors | 429 | differs from alone |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base: dict[str, float] = {}
    in_process: dict[str, float] = {}
    notes = []
    for r in rows:
        via, spec, rate = r.get("via", "http"), r["speculative"], r["tokens_per_second"]
        if via == "in-process":
            in_process[spec] = rate
        elif r["clients"] == 1:
            base[spec] = rate
            if in_process.get(spec):
                share = rate / in_process[spec]
                notes.append(f"- {spec}: one client over HTTP streams {share:.0%} of in-process tok/s")
        closed = r.get("rate") is None
        scale = f"{rate / base[spec]:.2f}x" if via == "http" and closed and base.get(spec) else "-"
        load = r["clients"] if closed else f"{r['rate']:g}/s"
        t, i = r["ttft_ms"], r["itl_ms"]
        lines.append(
            f"| {spec} | {via} | {load} | {r['completed']}/{r['requests']} | {rate:.1f} | "
            f"{scale} | {t['p50']}/{t['p95']} | {i['p50']}/{i['p95']}/{i['p99']} | "
            f"{sum(r['errors'].values()) - r['rejected_429']} | {r['rejected_429']} | {r['differs_from_alone']} |"
        )
    return "\n".join(lines + (["", *notes] if notes else []))
