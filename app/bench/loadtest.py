"""`specserve loadtest`: N concurrent streaming clients against a running server.

Each client sends prompts one after another, streamed (OpenAI chat completions, or TGI's /generate_stream),
until the requests are done or the time limit passes (a closed loop); or, at a request rate, requests arrive
as a Poisson process whatever is in flight (an open loop, as vLLM's serving benchmark sends them). For every
request it records when each event arrived, so the figures are what a streaming user sees: time to first
token (TTFT), the gaps between events (inter-token latency, ITL), total throughput in tokens/s, errors by
kind and 429s. Every response is checked: it must end with a final event (complete) whose text equals the
events' texts, and greedy responses must equal the text the same prompt got when sent alone (the pass at
concurrency 1).

Two more workloads (issue 31), their texts in app/bench/workload_texts.py: multi-turn conversations sharing a
system prompt (`run_conversations`, TTFT per turn and the prompts' growth: `summarize_turns`), and short requests
beside long prompts near the server's max input (`run_mixed`, the two apart: `summarize_mixed`). Every level also
reports the prefix cache's hit rate from the server's /metrics counters (`prefix_cache_hit_rate`), n/a where it
has none.

The bench's traffic workloads (issue 70) over HTTP against any OpenAI-compatible server: `run_episodes` (each client
its episodes, every turn built from the answers the server streamed, tools included, each client its cache_salt),
`episode_reference` and `same_as_alone` (each answer against its turn alone), `summarize_episodes` (per workload).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from app.bench.workload_texts import SYSTEM_PROMPT, user_turns

if TYPE_CHECKING:
    from app.bench.workloads import Episode
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
    prompt_tokens: int | None = None  # the usage field's, where the server sends one
    user: int | None = None  # multiturn: the conversation; traffic workloads: the client
    turn: int | None = None  # multiturn: 1 for the first turn; traffic workloads: 0 for the first
    kind: str | None = None  # mixed: "long" or "short"
    tool_calls: list[dict[str, Any]] | None = None  # chat: the calls the answer streamed, merged by index
    cached_tokens: int | None = None  # the usage field's prompt_tokens_details.cached_tokens, where sent
    detail: str | None = None  # an error status's body (its start)
    resent: bool = False  # sent again on a new connection: the kept-alive one was closed under it
    workload: str | None = None  # traffic workloads: the episode's workload, index and prompt's digest
    episode: int | None = None
    prompt_digest: str | None = None


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0..1) of the sorted `ordered`, the nearest rank's value; None when empty."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {"p50": percentile(ordered, 0.50), "p95": percentile(ordered, 0.95), "p99": percentile(ordered, 0.99)}


async def _one(
    client: httpx.AsyncClient,
    url: str,
    index: int,
    prompt: str | list[dict[str, str]],
    options: dict[str, Any],
    headers: dict[str, str],
    api: str,
    extra: dict[str, Any] | None = None,
) -> Result:
    """One streamed request. `api` "tgi": /generate_stream with the prompt as is; "chat":
    /v1/chat/completions with the prompt as the user message (the server applies the chat template), or a
    list of messages as they are (a conversation), with `extra` fields in the body (tools, cache_salt); the
    `speculative` field only where `options` has one."""
    if api == "tgi":
        assert isinstance(prompt, str), "a conversation needs the chat API"
        path = "/generate_stream"
        body: dict[str, Any] = {"inputs": prompt, "parameters": {**options, "details": True}}
    else:
        path = "/v1/chat/completions"
        body = {
            "model": options["model"],
            "messages": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
            "max_tokens": options["max_new_tokens"],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        if options.get("speculative") is not None:
            body["speculative"] = options["speculative"]
    result = Result(index, ok=False, start=time.perf_counter())
    for attempt in range(2):
        answered = False
        try:
            async with client.stream("POST", url + path, json=body, headers=headers) as resp:
                answered = True
                await _read(resp, api, result)
            break
        except httpx.RemoteProtocolError as exc:
            # The server closed a kept-alive connection as the request went out on it (llama-server does, at
            # times, after a streamed answer): nothing reached it, so it is sent again on a new connection, as
            # HTTP clients (the openai SDK's among them) do; counted.
            if answered or attempt:
                result.error = type(exc).__name__
                break
            result.resent = True
        except httpx.HTTPError as exc:
            result.error = type(exc).__name__
            break
    result.end = time.perf_counter()
    return result


async def _read(resp: httpx.Response, api: str, result: Result) -> None:
    """A streamed response into `result`: its text, tokens and their times, usage, or what went wrong."""
    finished = False
    if resp.status_code != 200:
        result.detail = (await resp.aread())[:500].decode(errors="replace")
        result.error = "429" if resp.status_code == 429 else f"http_{resp.status_code}"
        return
    pieces: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            continue
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            result.error = f"stream_error: {err.get('type') if isinstance(err, dict) else event.get('error_type')}"
            return
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
                result.prompt_tokens = event["usage"].get("prompt_tokens")
                details = event["usage"].get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens")
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                text = delta.get("content")
                if text or delta.get("tool_calls"):
                    result.token_times.append(time.perf_counter())
                if text:
                    pieces.append(text)
                for piece in delta.get("tool_calls") or []:
                    _merge_call(calls, piece)
                if choice.get("finish_reason"):
                    finished = True
                    result.speculative = event.get("speculative")
    if api == "chat":
        result.text = "".join(pieces)
        result.tool_calls = [calls[i] for i in sorted(calls)] or None
    result.ok = finished and "".join(pieces) == result.text
    if not result.ok:
        result.error = "incomplete_stream" if not finished else "events_do_not_add_up"


def _merge_call(calls: dict[int, dict[str, Any]], piece: dict[str, Any]) -> None:
    """One streamed tool-call delta into `calls` (by its index): the id, type and name as first sent, the
    arguments' pieces appended."""
    call = calls.setdefault(piece.get("index", 0), {"id": None, "type": "function", "function": {}})
    call["id"] = call["id"] or piece.get("id")
    function = piece.get("function") or {}
    if function.get("name"):
        call["function"]["name"] = call["function"].get("name", "") + function["name"]
    call["function"]["arguments"] = call["function"].get("arguments", "") + (function.get("arguments") or "")


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


async def run_conversations(
    url: str,
    users: int,
    turns: int,
    parameters: dict[str, Any],
    time_limit: float,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    seed: int = 0,
    system: str = SYSTEM_PROMPT,
) -> tuple[list[Result], float]:
    """`users` conversations at once over the chat API, `turns` turns each: the shared system prompt, then every
    turn the conversation so far (each earlier answer as the assistant's message) and the user's next message
    (`user_turns`). A conversation stops at its first failed turn (the rest would not be that conversation)
    and starts no turn after `time_limit` seconds. Returns the results (`user`, `turn` set) and the wall time."""
    headers = auth_headers(api_key)
    results: list[Result] = []
    started = time.perf_counter()
    async with _client(time_limit, users + 2, transport) as client:

        async def converse(user: int) -> None:
            messages = [{"role": "system", "content": system}]
            for turn, text in enumerate(user_turns(user, turns, seed), 1):
                if time.perf_counter() - started >= time_limit:
                    return
                messages.append({"role": "user", "content": text})
                result = await _one(client, url, user, list(messages), parameters, headers, "chat")
                result.user, result.turn = user, turn
                results.append(result)
                if not result.ok:
                    return
                messages.append({"role": "assistant", "content": result.text})

        await asyncio.gather(*(converse(u) for u in range(users)))
    return results, time.perf_counter() - started


async def run_mixed(
    url: str,
    long_prompts: list[str],
    short_prompts: list[str],
    short_requests: int,
    parameters: dict[str, Any],
    short_max_tokens: int,
    short_delay: float,
    time_limit: float,
    api: str = "chat",
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[Result], float]:
    """Every long prompt at once and, `short_delay` seconds later (the long ones admitted and prefilling),
    `short_requests` short requests one after another, `short_max_tokens` tokens each: what a user with a quick
    question sees beside long documents. Returns the results (`kind` "long" or "short") and the wall time."""
    headers = auth_headers(api_key)
    short_options = {**parameters, "max_new_tokens": short_max_tokens}
    started = time.perf_counter()
    async with _client(time_limit, len(long_prompts) + 3, transport) as client:

        async def send(index: int, prompt: str, options: dict[str, Any], kind: str) -> Result:
            result = await _one(client, url, index, prompt, options, headers, api)
            result.kind = kind
            return result

        longs = [asyncio.create_task(send(i, p, parameters, "long")) for i, p in enumerate(long_prompts)]
        await asyncio.sleep(short_delay)
        shorts = []
        for i in range(short_requests):
            if time.perf_counter() - started >= time_limit:
                break
            n = i % len(short_prompts)
            shorts.append(await send(n, short_prompts[n], short_options, "short"))
        results = [*await asyncio.gather(*longs), *shorts]
    return results, time.perf_counter() - started


def answer_message(result: Result) -> dict[str, Any]:
    """A chat answer as the assistant message the server sent: its content and tool calls."""
    return {"role": "assistant", "content": result.text or None, "tool_calls": result.tool_calls}


def answer_key(result: Result) -> str:
    """What two answers must share to be the same: the text, and each tool call's name and arguments (not its
    id: a server draws those at random)."""
    calls = [(c["function"].get("name"), c["function"].get("arguments")) for c in result.tool_calls or []]
    return result.text + ("\n" + json.dumps(calls) if calls else "")


def client_order(episodes: int, clients: int, client: int, count: int) -> list[int]:
    """The episodes (indices into a list of `episodes`) that client `client` of `clients` runs, in order: `count`
    of them (at most `episodes`, so a client never runs one twice) from its own start, the starts spread evenly
    over the list, so that at any moment the clients run different episodes."""
    start = client * episodes // clients
    return [(start + j) % episodes for j in range(min(count, episodes))]


async def run_episodes(
    url: str,
    episodes: Sequence[Episode],
    clients: int,
    per_client: int,
    parameters: dict[str, Any],
    time_limit: float,
    salts: Sequence[str] | None,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    max_new_tokens: int | None = None,
) -> tuple[list[Result], float]:
    """The traffic workloads over the chat API: `clients` concurrent clients, each running `per_client` episodes
    (`client_order`) one after another, each episode's turns in order, every turn's messages built from that
    episode's earlier answers as the server sent them (content and tool calls; `Episode.messages`), with the
    episode's `tools`. Client c's requests carry `cache_salt` `salts[c]` (None: no salt sent), so it is a tenant of
    its own. `parameters`: `model` and, for our server, `speculative`; `max_new_tokens`: every turn's (None: the
    episode's own). An episode stops at its first failed turn and a client starts no turn after `time_limit`
    seconds. Returns the results (`user` the client, `workload`, `episode`, `turn` from 0, `prompt_digest`) and the
    wall time."""
    if salts is not None and len(salts) < clients:
        raise ValueError(f"{clients} clients need {clients} salts, not {len(salts)}")
    headers = auth_headers(api_key)
    results: list[Result] = []
    started = time.perf_counter()
    async with _client(time_limit, clients + 2, transport) as client:

        async def run_client(c: int) -> None:
            for n in client_order(len(episodes), clients, c, per_client):
                episode = episodes[n]
                options = {**parameters, "max_new_tokens": max_new_tokens or episode.max_new_tokens}
                extra: dict[str, Any] = {"tools": episode.tools} if episode.tools else {}
                if salts is not None:
                    extra["cache_salt"] = salts[c]
                answers: list[dict[str, Any]] = []
                for turn in range(episode.turns):
                    if time.perf_counter() - started >= time_limit:
                        return
                    messages = episode.messages(answers)
                    result = await _one(client, url, n, messages, options, headers, "chat", extra)
                    result.user, result.turn, result.workload, result.episode = c, turn, episode.workload, episode.index
                    result.prompt_digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
                    results.append(result)
                    if not result.ok:
                        break
                    answers.append(answer_message(result))

        await asyncio.gather(*(run_client(c) for c in range(clients)))
    return results, time.perf_counter() - started


# An episode's turn: (workload, episode index, turn).
TurnKey = tuple[str, int, int]


def _turn_key(result: Result) -> TurnKey:
    return (result.workload or "", result.episode or 0, result.turn or 0)


def episode_reference(results: list[Result]) -> dict[TurnKey, tuple[str, str]]:
    """Each turn's prompt digest and answer (`answer_key`) in `results` (the episodes run alone): what the same
    turn must give under load."""
    return {_turn_key(r): (r.prompt_digest or "", answer_key(r)) for r in results if r.ok}


def same_as_alone(results: list[Result], reference: dict[TurnKey, tuple[str, str]] | None) -> dict[str, Any]:
    """How many answers equal their turn's alone, among those whose prompt was that turn's alone (a turn after an
    answer that differed has another prompt: `diverged`, not compared); None figures without a reference."""
    if reference is None:
        return {"compared": None, "same": None, "diverged": None}
    compared = same = diverged = 0
    for r in results:
        alone = reference.get(_turn_key(r))
        if not r.ok or alone is None:
            continue
        if alone[0] != r.prompt_digest:
            diverged += 1
            continue
        compared += 1
        same += alone[1] == answer_key(r)
    return {"compared": compared, "same": same, "diverged": diverged}


def _cached_share(results: list[Result]) -> float | None:
    """The share of prompt tokens the server reports it served from its cache (None: it reports none)."""
    ok = [r for r in results if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    prompts = sum(r.prompt_tokens or 0 for r in ok)
    return round(sum(r.cached_tokens or 0 for r in ok) / prompts, 4) if prompts else None


def summarize_episodes(
    results: list[Result], episodes: Sequence[Episode], reference: dict[TurnKey, tuple[str, str]] | None
) -> dict[str, Any]:
    """A traffic level's figures beyond `summarize_level`'s: episodes completed (every turn of one of `episodes`
    answered), how many clients' first requests found prompt tokens cached (with salts: the server ignores them),
    the answers' agreement with their
    turn's alone (`same_as_alone`), the share of prompt tokens served from the server's cache, and per workload:
    requests, tokens, tokens/s of a request while it ran (tokens over the requests' own seconds), TTFT and ITL
    p50/p95 (ms), errors, agreement."""
    runs: dict[tuple[int, str, int], list[Result]] = {}
    for r in results:
        runs.setdefault((r.user or 0, r.workload or "", r.episode or 0), []).append(r)
    # Each client's first request is a salt's first: a server that honours salts has nothing cached for it.
    firsts: dict[int | None, Result] = {}
    for r in sorted(results, key=lambda r: r.start):
        firsts.setdefault(r.user, r)
    turns = {(e.workload, e.index): e.turns for e in episodes}
    done = sum(
        all(r.ok for r in run) and len(run) == turns.get((workload, index))
        for (_, workload, index), run in runs.items()
    )
    per_workload = {}
    for workload in dict.fromkeys(r.workload for r in results if r.workload):
        group = [r for r in results if r.workload == workload]
        ok = [r for r in group if r.ok]
        seconds = sum(r.end - r.start for r in ok)
        ttft = _percentiles([t * 1e3 for r in ok if (t := _ttft(r)) is not None])
        itl = _percentiles([(b - a) * 1e3 for r in ok for a, b in itertools.pairwise(r.token_times)])
        per_workload[workload] = {
            "requests": len(group),
            "completed": len(ok),
            "tokens": sum(r.tokens for r in ok),
            "tokens_per_second_per_request": round(sum(r.tokens for r in ok) / seconds, 2) if seconds > 0 else None,
            "ttft_ms": {k: _round(ttft[k]) for k in ("p50", "p95")},
            "itl_ms": {k: _round(itl[k]) for k in ("p50", "p95")},
            "errors": dict(Counter(r.error for r in group if r.error)),
            "cached_prompt_share": _cached_share(group),
            **same_as_alone(group, reference),
        }
    return {
        "episodes": len(runs),
        "completed_episodes": done,
        "cached_prompt_share": _cached_share(results),
        "first_requests_cached": sum(1 for r in firsts.values() if r.cached_tokens),
        **same_as_alone(results, reference),
        "per_workload": per_workload,
    }


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
    ttft = [t * 1e3 for r in ok if (t := _ttft(r)) is not None]
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
        "resent": sum(r.resent for r in results),
        "differs_from_alone": mismatched,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
    }


def _ttft(result: Result) -> float | None:
    """Seconds from sending to the first token, None without one."""
    return result.token_times[0] - result.start if result.token_times else None


def _round(value: float | None, digits: int = 1) -> float | None:
    return round(value, digits) if value is not None else None


def summarize_turns(results: list[Result], turns: int) -> dict[str, Any]:
    """The multi-turn figures: per turn index, TTFT p50/p95 (ms) and the prompt and answer tokens (the usage
    field's); the last turn's TTFT p50 over the first's (issue 31's goal: at most 1.5); and whether every
    conversation's prompt grew as it should, each turn at least the previous prompt plus the previous answer
    (the server saw the whole conversation every turn)."""
    by_turn: dict[int, list[Result]] = {}
    by_user: dict[int, list[Result]] = {}
    for r in results:
        if r.turn is not None:
            by_turn.setdefault(r.turn, []).append(r)
            by_user.setdefault(r.user if r.user is not None else -1, []).append(r)
    per_turn = []
    for turn in sorted(by_turn):
        ok = [r for r in by_turn[turn] if r.ok]
        ttft = _percentiles([t * 1e3 for r in ok if (t := _ttft(r)) is not None])
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        per_turn.append(
            {
                "turn": turn,
                "requests": len(by_turn[turn]),
                "completed": len(ok),
                "ttft_p50_ms": _round(ttft["p50"]),
                "ttft_p95_ms": _round(ttft["p95"]),
                "prompt_tokens_p50": statistics.median(prompts) if prompts else None,
                "answer_tokens_p50": statistics.median(r.tokens for r in ok) if ok else None,
            }
        )
    first = per_turn[0]["ttft_p50_ms"] if per_turn else None
    last = per_turn[-1]["ttft_p50_ms"] if len(per_turn) > 1 else None
    ratio = round(last / first, 2) if first and last is not None else None
    grew = checked = 0
    for conversation in by_user.values():
        done = sorted((r for r in conversation if r.ok and r.prompt_tokens is not None), key=lambda r: r.turn or 0)
        if len(done) < 2:
            continue
        checked += 1
        pairs = itertools.pairwise(done)
        grew += all(b.prompt_tokens >= a.prompt_tokens + a.tokens for a, b in pairs)  # type: ignore[operator]
    complete = sum(1 for c in by_user.values() if sum(r.ok for r in c) == turns)
    # Every answer of every conversation, in order: two runs (with and without the prefix cache, speculative or
    # not) that gave the very same tokens give the same digest.
    digest = hashlib.sha256()
    for r in sorted(results, key=lambda r: (r.user or 0, r.turn or 0)):
        if r.turn is not None:
            digest.update(f"{r.user}/{r.turn}/{r.ok}/{r.text}\n".encode())
    return {
        "turns": turns,
        "conversations": len(by_user),
        "completed_conversations": complete,
        "per_turn": per_turn,
        "ttft_last_over_first": ratio,
        "ttft_goal_met": ratio <= 1.5 if ratio is not None else None,
        "prompts_grew": f"{grew}/{checked}" if checked else None,
        "answers_sha256": digest.hexdigest()[:16],
    }


def _spread(values: list[float]) -> dict[str, float | None]:
    """p50 and max of a few values (seconds, to the millisecond)."""
    if not values:
        return {"p50": None, "max": None}
    return {"p50": round(statistics.median(values), 3), "max": round(max(values), 3)}


def summarize_mixed(results: list[Result]) -> dict[str, Any]:
    """The long prompts and the short requests apart: TTFT and whole-answer time (seconds, p50 and max),
    prompt tokens, errors; for the short ones, how many started while a long one still ran (beside it), and
    issue 31's goal for those: first token within 1 s and the whole answer within 2 s."""
    longs = [r for r in results if r.kind == "long"]
    shorts = [r for r in results if r.kind == "short"]
    last_long_end = max((r.end for r in longs), default=None)

    def part(group: list[Result]) -> dict[str, Any]:
        ok = [r for r in group if r.ok]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        return {
            "requests": len(group),
            "completed": len(ok),
            "ttft_s": _spread([t for r in ok if (t := _ttft(r)) is not None]),
            "total_s": _spread([r.end - r.start for r in ok]),
            "prompt_tokens_p50": statistics.median(prompts) if prompts else None,
            "errors": dict(Counter(r.error for r in group if r.error)),
        }

    short = part(shorts)
    beside = [r for r in shorts if last_long_end is not None and r.start < last_long_end]
    short["beside_long"] = len(beside)
    short["goal_met"] = (
        all(r.ok and (_ttft(r) or 0.0) <= 1.0 and r.end - r.start <= 2.0 for r in beside) if beside else None
    )
    return {"long": part(longs), "short": short}


# One sample line of the Prometheus text format: name, labels, value.
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) of the server's prefix cache, from its /metrics text: vLLM's counters
    ``prefix_cache_queries`` and ``prefix_cache_hits`` (in tokens) under any prefix (``vllm:``, ``specserve_``),
    summed over their labels; None when the server has no such counters (no prefix cache)."""
    sums: dict[str, dict[str, float]] = {"queries": {}, "hits": {}}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:  # comments (# HELP, # TYPE) and blank lines
            continue
        name = match.group(1)
        for kind, names in sums.items():
            if name.removesuffix("_total").endswith("prefix_cache_" + kind):
                try:
                    names[name] = names.get(name, 0.0) + float(match.group(2))
                except ValueError:
                    continue
    if not sums["queries"]:
        return None

    def plainest(names: dict[str, float]) -> float:
        # Older vLLMs had device-prefixed copies (gpu_prefix_cache_queries) too: one series, the plainest name.
        return names[min(names, key=len)] if names else 0.0

    return plainest(sums["queries"]), plainest(sums["hits"])


NO_PREFIX_CACHE = "n/a (server has no prefix cache)"


def prefix_cache_hit_rate(before: str | None, after: str | None) -> dict[str, Any]:
    """Hits over queries of the prefix cache between two /metrics texts (a level's before and after); a
    `note` instead of a rate when the server exposes no prefix-cache counters or no /metrics."""
    if before is None or after is None:
        return {"hit_rate": None, "note": "n/a (no /metrics)"}
    a, b = prefix_cache_counters(before), prefix_cache_counters(after)
    if a is None or b is None:
        return {"hit_rate": None, "note": NO_PREFIX_CACHE}
    queries, hits = b[0] - a[0], b[1] - a[1]
    return {"queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4) if queries > 0 else None}


def read_metrics(url: str, headers: dict[str, str]) -> str | None:
    """The server's /metrics text, None when it has none (or refuses it): the hit rate is then n/a."""
    try:
        response = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def token_counter(url: str, headers: dict[str, str], model: str | None, api: str) -> Callable[[str], int]:
    """Counts a prompt's tokens as the server will (its /tokenize; the chat template too with the chat API),
    to size the long prompts. Without /tokenize, an estimate of three characters a token: English text takes
    about four, so the estimate errs short of the limit, not over it."""
    estimated = False

    def count(text: str) -> int:
        nonlocal estimated
        if not estimated:
            body: dict[str, Any] = {"model": model}
            if api == "chat":
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            try:
                response = httpx.post(f"{url}/tokenize", json=body, headers=headers, timeout=60)
                if response.status_code == 200:
                    return int(response.json()["count"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            estimated = True
        return len(text) // 3

    return count


def prefix_cache_summary(pc: dict[str, Any] | None) -> str:
    """One level's prefix-cache figures as text: the hit rate with hits/queries, or why there is none."""
    if not pc:
        return "-"
    if pc.get("hit_rate") is None:
        return pc.get("note") or f"no queries ({pc.get('hits', 0):g}/{pc.get('queries', 0):g})"
    return f"{pc['hit_rate']:.1%} ({pc['hits']:g}/{pc['queries']:g} tokens)"


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
    cache: dict[str, str] = {}  # level: its prefix-cache hit rate
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
        if "prefix_cache" in r:
            cache[f"{spec} {load}"] = prefix_cache_summary(r["prefix_cache"])
    if len(set(cache.values())) == 1 and next(iter(cache.values())).startswith("n/a"):
        notes.append(f"- prefix cache hit rate: {next(iter(cache.values()))}")  # one line, not one a level
    else:
        notes += [f"- {level}: prefix cache hit rate {text}" for level, text in cache.items()]
    return "\n".join(lines + (["", *notes] if notes else []))


def _ms(p: dict[str, Any], *keys: str) -> str:
    return "/".join(str(p[k]) for k in keys)


def markdown_multiturn(rows: list[dict[str, Any]]) -> str:
    """The multi-turn table, one row per (speculation, users), then TTFT and prompt tokens per turn."""
    lines = [
        "| speculative | users | turns done | conversations done | tok/s | TTFT p50/p95 ms | ITL p50/p95/p99 ms | "
        "TTFT p50 turn 1 / last ms | last / first | prompts grew | errors | prefix cache hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    detail = [
        "",
        "| speculative | users | turn | requests | TTFT p50/p95 ms | prompt tokens p50 | answer tokens p50 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["multiturn"]
        turns = m["per_turn"]
        ends = f"{turns[0]['ttft_p50_ms']} / {turns[-1]['ttft_p50_ms']}" if turns else "-"
        lines.append(
            f"| {r['speculative']} | {r['clients']} | {r['completed']}/{r['requests']} | "
            f"{m['completed_conversations']}/{m['conversations']} | {r['tokens_per_second']:.1f} | "
            f"{_ms(r['ttft_ms'], 'p50', 'p95')} | {_ms(r['itl_ms'], 'p50', 'p95', 'p99')} | {ends} | "
            f"{m['ttft_last_over_first']} | {m['prompts_grew']} | {sum(r['errors'].values())} | "
            f"{prefix_cache_summary(r.get('prefix_cache'))} |"
        )
        for t in turns:
            detail.append(
                f"| {r['speculative']} | {r['clients']} | {t['turn']} | {t['completed']}/{t['requests']} | "
                f"{t['ttft_p50_ms']}/{t['ttft_p95_ms']} | {t['prompt_tokens_p50']} | {t['answer_tokens_p50']} |"
            )
    return "\n".join(lines + detail)


def markdown_mixed(rows: list[dict[str, Any]]) -> str:
    """The mixed table, one row per speculation: the long prompts and the short requests apart (seconds)."""
    lines = [
        "| speculative | long | long prompt tokens | long TTFT p50/max s | long total p50/max s | short | "
        "short beside long | short TTFT p50/max s | short total p50/max s | short <= 1 s / 2 s | errors | "
        "prefix cache hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        lo, sh = r["mixed"]["long"], r["mixed"]["short"]
        goal = {True: "met", False: "missed", None: "-"}[sh["goal_met"]]
        lines.append(
            f"| {r['speculative']} | {lo['completed']}/{lo['requests']} | {lo['prompt_tokens_p50']} | "
            f"{_ms(lo['ttft_s'], 'p50', 'max')} | {_ms(lo['total_s'], 'p50', 'max')} | "
            f"{sh['completed']}/{sh['requests']} | {sh['beside_long']} | {_ms(sh['ttft_s'], 'p50', 'max')} | "
            f"{_ms(sh['total_s'], 'p50', 'max')} | {goal} | {sum(r['errors'].values())} | "
            f"{prefix_cache_summary(r.get('prefix_cache'))} |"
        )
    return "\n".join(lines)


def _agreement(figures: dict[str, Any]) -> str:
    """`same/compared` (and how many turns diverged after an earlier difference), or "-" without a reference."""
    if figures.get("compared") is None:
        return "-"
    text = f"{figures['same']}/{figures['compared']}"
    return text + f" ({figures['diverged']} diverged)" if figures.get("diverged") else text


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def markdown_traffic(rows: list[dict[str, Any]], notes: Sequence[str] = ()) -> str:
    """The traffic workloads' tables: one row per (speculation, clients), then one per workload within each, and
    `notes` (the server, the salts) under them."""
    lines = [
        "| speculative | clients | episodes done | requests | tok/s | x one client | TTFT p50/p95 ms | "
        "ITL p50/p95/p99 ms | errors | 429 | prompt cached | same as alone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    detail = [
        "",
        "| speculative | clients | workload | requests | tokens | tok/s a request | TTFT p50/p95 ms | ITL p50/p95 ms | "
        "errors | prompt cached | same as alone |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base: dict[str, float] = {}
    for r in rows:
        spec, rate, t = r["speculative"], r["tokens_per_second"], r["traffic"]
        if r["clients"] == 1:
            base[spec] = rate
        scale = f"{rate / base[spec]:.2f}x" if base.get(spec) else "-"
        lines.append(
            f"| {spec} | {r['clients']} | {t['completed_episodes']}/{t['episodes']} | {r['completed']}/{r['requests']} "
            f"| {rate:.1f} | {scale} | {_ms(r['ttft_ms'], 'p50', 'p95')} | {_ms(r['itl_ms'], 'p50', 'p95', 'p99')} | "
            f"{sum(r['errors'].values()) - r['rejected_429']} | {r['rejected_429']} | "
            f"{_share(t['cached_prompt_share'])} | {_agreement(t)} |"
        )
        for workload, w in t["per_workload"].items():
            per_request = w["tokens_per_second_per_request"]
            detail.append(
                f"| {spec} | {r['clients']} | {workload} | {w['completed']}/{w['requests']} | {w['tokens']} | "
                f"{'-' if per_request is None else f'{per_request:.1f}'} | {_ms(w['ttft_ms'], 'p50', 'p95')} | "
                f"{_ms(w['itl_ms'], 'p50', 'p95')} | {sum(w['errors'].values())} | "
                f"{_share(w['cached_prompt_share'])} | {_agreement(w)} |"
            )
    resent = sum(r.get("resent", 0) for r in rows)
    if resent:
        notes = [*notes, f"{resent} requests sent again on a new connection: the server had closed the kept-alive one"]
    return "\n".join(lines + detail + ([""] + [f"- {n}" for n in notes] if notes else []))
