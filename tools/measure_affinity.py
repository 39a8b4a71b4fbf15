"""Tenant affinity behind the scaled profile's nginx (issue 67, finding 9): multi-turn TTFT and cache hits.

`--users` conversations at once over the chat API, `--turns` turns each (the load test's multi-turn texts: its
system prompt, then each turn the whole conversation so far and the user's next message), each user a tenant of
its own (`cache_salt`, fresh for every run, so that no run finds another's caches). Streamed; per turn it
records the time to the first content token, the prompt's tokens and how many of them the server found in its
prefix cache (`usage.prompt_tokens_details.cached_tokens`), and the steps whose verified draft came from the
index of the tenant's earlier answers (`speculative.draft_sources.index`) among all drafted steps. Where a
conversation's turns land on the server that holds its earlier turns, turn t's prompt is mostly cached; spread
round robin over N servers, about 1/N of the turns find it.

    python3 tools/measure_affinity.py --url http://127.0.0.1:8080 --label affinity --users 12 --turns 10

prints a table per turn and a summary line (the last turn's TTFT p50, the cache hit rate of turns 2 and later,
the index's share of drafted steps), and with `--out FILE` writes them as JSON. docs/deploy.md (Tenant affinity)
gives the three runs to compare: affinity and round robin through nginx, and one server alone. Standard
library and httpx only; no model is loaded here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from app.bench.workload_texts import SYSTEM_PROMPT, user_turns


@dataclass
class Turn:
    """One turn of one conversation, as the client saw it."""

    user: int
    turn: int  # 1 for the first
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    index_steps: int = 0  # steps whose verified draft came from the index of the tenant's earlier answers
    drafted_steps: int = 0  # steps with a verified draft from any source
    text: str = ""


def _salt(run: str, label: str, user: int) -> str:
    return f"affinity-{run}-{label}-user-{user:03d}"


async def _turn(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], user: int, turn: int
) -> Turn:
    """One streamed chat completion: TTFT, the usage chunk's cached tokens, the last chunk's draft sources."""
    result = Turn(user=user, turn=turn, ok=False)
    started = time.perf_counter()
    pieces: list[str] = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"{response.status_code} {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if result.ttft_s is None:
                            result.ttft_s = time.perf_counter() - started
                        pieces.append(content)
                sources = (chunk.get("speculative") or {}).get("draft_sources")
                if sources:
                    result.index_steps = int(sources.get("index", 0))
                    result.drafted_steps = sum(int(v) for v in sources.values())
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.text = "".join(pieces)
    result.ok = result.ttft_s is not None
    if not result.ok:
        result.error = "no content"
    return result


async def run(
    url: str,
    label: str,
    users: int,
    turns: int,
    max_tokens: int,
    api_key: str | None,
    run_id: str,
    timeout: float,
    transport: httpx.AsyncBaseTransport | None = None,
    model: str | None = None,
) -> list[Turn]:
    """Every conversation at once, each turn after the previous one's answer; a conversation stops at its first
    failed turn. Returns every turn's record."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[Turn] = []
    limits = httpx.Limits(max_connections=users + 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:

        async def converse(user: int) -> None:
            messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
            for turn, text in enumerate(user_turns(user, turns), 1):
                messages.append({"role": "user", "content": text})
                body = {
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "cache_salt": _salt(run_id, label, user),
                } | ({"model": model} if model else {})
                result = await _turn(client, url, body, headers, user, turn)
                results.append(result)
                if not result.ok:
                    return
                messages.append({"role": "assistant", "content": result.text})

        await asyncio.gather(*(converse(u) for u in range(users)))
    return results


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(results: list[Turn], label: str, users: int, turns: int) -> dict[str, Any]:
    """Per turn: requests, failures, TTFT p50/p95 (ms), cached / prompt tokens, index / drafted steps; and the
    summary: the last turn's TTFT p50, the cache hit rate of turns 2 and later, the index's share overall."""
    per_turn = []
    for t in range(1, turns + 1):
        rows = [r for r in results if r.turn == t]
        ok = [r for r in rows if r.ok]
        ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        drafted = sum(r.drafted_steps for r in ok)
        per_turn.append(
            {
                "turn": t,
                "requests": len(rows),
                "failed": len(rows) - len(ok),
                "ttft_p50_ms": _round(_p(ttfts, 0.5)),
                "ttft_p95_ms": _round(_p(ttfts, 0.95)),
                "prompt_tokens": prompt,
                "cached_tokens": sum(r.cached_tokens for r in ok),
                "cache_hit_rate": _round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None,
                "index_share": _round(sum(r.index_steps for r in ok) / drafted, 4) if drafted else None,
            }
        )
    later = [r for r in results if r.ok and r.turn > 1]
    later_prompt = sum(r.prompt_tokens for r in later)
    drafted = sum(r.drafted_steps for r in results if r.ok)
    last = per_turn[-1] if per_turn else {}
    return {
        "label": label,
        "users": users,
        "turns": turns,
        "failed": sum(1 for r in results if not r.ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "last_turn_ttft_p50_ms": last.get("ttft_p50_ms"),
        "cache_hit_rate_after_turn_1": _round(sum(r.cached_tokens for r in later) / later_prompt, 4)
        if later_prompt
        else None,
        "index_share": _round(sum(r.index_steps for r in results if r.ok) / drafted, 4) if drafted else None,
        "per_turn": per_turn,
    }


def _round(value: float | None, digits: int = 1) -> float | None:
    return round(value, digits) if value is not None else None


def _table(summary: dict[str, Any]) -> str:
    lines = [f"{'turn':>4} {'ok':>4} {'TTFT p50 ms':>12} {'p95 ms':>9} {'cached/prompt':>15} {'index share':>12}"]
    for row in summary["per_turn"]:
        ok = row["requests"] - row["failed"]
        lines.append(
            f"{row['turn']:>4} {ok:>4} {_fmt(row['ttft_p50_ms']):>12} {_fmt(row['ttft_p95_ms']):>9} "
            f"{_fmt(row['cache_hit_rate']):>15} {_fmt(row['index_share']):>12}"
        )
    lines.append(
        f"{summary['label']}: {summary['users']} users x {summary['turns']} turns, {summary['failed']} failed; "
        f"turn {summary['turns']} TTFT p50 {_fmt(summary['last_turn_ttft_p50_ms'])} ms, cache hit rate (turns 2+) "
        f"{_fmt(summary['cache_hit_rate_after_turn_1'])}, index share of drafted steps {_fmt(summary['index_share'])}"
    )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the balancer (http://127.0.0.1:8080) or one server")
    parser.add_argument("--label", required=True, help="names the run (affinity, round-robin, one-server)")
    parser.add_argument("--users", type=int, default=12, help="conversations at once (default 12)")
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation (default 10)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each answer (default 64)")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument("--model", default=None, help="the model field (default: none, the served model)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per request (default 300)")
    parser.add_argument("--out", type=Path, default=None, help="write the summary here as JSON")
    args = parser.parse_args(argv)
    if args.users < 1 or args.turns < 1 or args.max_tokens < 1:
        parser.error("--users, --turns and --max-tokens must be at least 1")
    run_id = uuid.uuid4().hex[:12]
    results = asyncio.run(
        run(
            args.url,
            args.label,
            args.users,
            args.turns,
            args.max_tokens,
            args.api_key,
            run_id,
            args.timeout,
            model=args.model,
        )
    )
    summary = summarize(results, args.label, args.users, args.turns)
    summary["run"] = run_id
    print(_table(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary | {"turn_records": [asdict(r) for r in results]}, indent=1) + "\n")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
