"""`specserve loadtest`: concurrent clients against a running server, level by level (app/bench/loadtest.py
sends and measures; the drivers here walk the levels the flags ask for and print each as it ends)."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from app.cli.common import (
    BENCH_PROMPTS,
    CliError,
    positive_int,
)

# The bench's traffic workloads (app.bench.workloads), and `traffic`: all of them mixed.
TRAFFIC = ["agent", "chat", "code-edit", "extraction", "rag", "traffic"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "loadtest",
        help="N concurrent streaming clients against a running server: throughput, TTFT, ITL, errors",
        description="For each draft (speculation on and off) and each client count, send streamed greedy requests "
        "and report tokens/s, time to first token and inter-token latency (p50/p95/p99), errors by kind and 429s; "
        "every response is checked for completeness and against the text its prompt got alone. --workload "
        "multiturn adds TTFT per turn and the prompts' growth; --workload mixed reports short requests beside long "
        "prompts apart. Every level reports the server's prefix-cache hit rate where its /metrics has one. --workload "
        "agent, chat, code-edit, extraction, rag or traffic (all of them mixed) runs the bench's traffic episodes "
        "against any OpenAI-compatible server.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--input",
        default=str(BENCH_PROMPTS),
        help="Spec-Bench-format JSONL (default: the package's 13 prompts, one per Spec-Bench category, as bench's)",
    )
    parser.add_argument("--prompts", type=positive_int, default=16, help="distinct prompts (first turns) to send")
    parser.add_argument(
        "--clients",
        default=None,
        help="comma-separated concurrency levels (default: 1,2,4,8,16; 1 with --rates); multiturn: users (4)",
    )
    parser.add_argument(
        "--rates",
        default=None,
        help="comma-separated request rates per second: open-loop levels, Poisson arrivals (after the client levels)",
    )
    parser.add_argument("--requests", type=positive_int, default=16, help="requests per level (at least the clients)")
    parser.add_argument(
        "--draft", action="append", default=None, help="speculative.draft values (default: default, none)"
    )
    parser.add_argument(
        "--max-new-tokens",
        "-n",
        type=positive_int,
        default=None,
        help="tokens per answer (default 128; traffic workloads: each episode's own, 40 to 448)",
    )
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per level before clients stop")
    parser.add_argument("--api", choices=["chat", "tgi"], default="chat", help="chat: OpenAI chat API (chat template)")
    parser.add_argument("--api-key", default=None, help="bearer key, if the server requires one")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="also run the one-client requests straight on an engine in this process (the server's models and "
        "settings, read from /info), to measure what HTTP and streaming cost",
    )
    parser.add_argument(
        "--workload",
        choices=["prompts", "multiturn", "mixed", "chaos", *TRAFFIC],
        default="prompts",
        help="prompts: independent one-turn prompts from --input (closed loop, or --rates); multiturn: --clients "
        "users, each a conversation of --turns turns with a shared system prompt (chat API); mixed: --long-prompts "
        "prompts near the server's max input, and short requests sent one after another beside them; chaos: "
        "--clients (16) clients for --duration seconds sending greedy and seeded requests on all four routes, "
        "streamed and not, multi-turn chats, streams left mid-way, malformed bodies and long prompts, with /health "
        "polled and RSS read meanwhile (app/bench/chaos.py); agent, chat, code-edit, extraction, rag, traffic (all "
        "of them mixed): --clients (1,8,16) clients, each running --episodes of the bench's episodes (agent loops "
        "with tools, conversations, code edits, invoice extraction, questions on a document), every turn built from "
        "the episode's earlier answers as the server sent them, each level and client its own cache_salt",
    )
    parser.add_argument(
        "--episodes",
        type=positive_int,
        default=None,
        help="traffic workloads: episodes each client runs per level, none twice (default: every one of the "
        "workload's once)",
    )
    parser.add_argument(
        "--no-salt",
        dest="salt",
        action="store_false",
        help="traffic workloads: send no cache_salt (for a server that refuses the field; the report says so)",
    )
    parser.add_argument("--duration", type=float, default=300.0, help="chaos: seconds of load (300)")
    parser.add_argument(
        "--first-byte-timeout",
        type=float,
        default=5.0,
        help="chaos: a request without its first byte (headers) within this many seconds is counted (5)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=60.0,
        help="chaos: a request with no byte at all (headers, events or comments) for this long is a hang (60)",
    )
    parser.add_argument("--health-interval", type=float, default=5.0, help="chaos: seconds between /health polls")
    parser.add_argument(
        "--pid",
        type=int,
        default=None,
        help="chaos: the server's process id on this machine, to read its RSS from /proc where its /metrics has "
        "no process_resident_memory_bytes (an older server)",
    )
    parser.add_argument("--turns", type=positive_int, default=10, help="multiturn: turns per conversation (10)")
    parser.add_argument(
        "--seed", type=int, default=0, help="multiturn, mixed and traffic workloads: the texts' seed; --rates: arrivals"
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="prompts workload: skip sending each prompt once before the levels (the warm-up fills the server's "
        "prefix cache, so that no level, the first one included, pays cold prefills that the others do not); "
        "traffic workloads: skip running each episode alone first (then no answer is compared with its alone)",
    )
    parser.add_argument("--long-prompts", type=positive_int, default=4, help="mixed: long prompts sent at once (4)")
    parser.add_argument(
        "--long-tokens",
        type=positive_int,
        default=None,
        help="mixed: tokens per long prompt (default: the most /info's max_input_tokens and context allow)",
    )
    parser.add_argument("--short-requests", type=positive_int, default=4, help="mixed: short requests, in turn (4)")
    parser.add_argument("--short-tokens", type=positive_int, default=4, help="mixed: max new tokens of a short one (4)")
    parser.add_argument(
        "--short-delay",
        type=float,
        default=1.5,
        help="mixed: seconds after the long prompts before the first short (1.5)",
    )
    parser.add_argument("--out", default="bench_out", help="directory for loadtest.json and loadtest.md")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    import httpx

    from app.bench import loadtest

    try:
        rates = [float(x) for x in args.rates.split(",") if x.strip()] if args.rates else []
    except ValueError as exc:
        raise CliError("--rates takes comma-separated numbers, e.g. 0.5,1,2") from exc
    if args.rates is not None and (not rates or min(rates) <= 0):
        raise CliError("--rates needs at least one rate > 0")
    if args.workload != "prompts" and (args.rates is not None or args.in_process):
        raise CliError(f"--rates and --in-process are for --workload prompts, not {args.workload}")
    if args.workload in ("multiturn", *TRAFFIC) and args.api != "chat":
        raise CliError(f"--workload {args.workload} sends conversations: it needs --api chat")
    if args.workload not in TRAFFIC:
        if args.episodes is not None or not args.salt:
            raise CliError("--episodes and --no-salt are for the traffic workloads (agent, ..., traffic)")
        if args.max_new_tokens is None:
            args.max_new_tokens = 128
    if args.workload == "chaos":
        return _loadtest_chaos(args)
    if args.workload == "mixed" and args.clients is not None:
        raise CliError("--workload mixed sends --long-prompts at once and --short-requests in turn: no --clients")
    default_clients = {"prompts": "1" if rates else "1,2,4,8,16", "multiturn": "4", "mixed": "1"}.get(
        args.workload, "1,8,16"
    )
    clients = args.clients if args.clients is not None else default_clients
    try:
        levels = [int(x) for x in clients.split(",") if x.strip()]
    except ValueError as exc:
        raise CliError("--clients takes comma-separated integers, e.g. 1,2,4,8") from exc
    if not levels or min(levels) < 1:
        raise CliError("--clients needs at least one level >= 1")
    headers = loadtest.auth_headers(args.api_key)
    try:
        model = httpx.get(f"{args.url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise CliError(f"no specserve answering at {args.url}: {exc}") from exc
    if args.workload == "multiturn":
        rows = _loadtest_multiturn(args, levels, model, headers)
        table = loadtest.markdown_multiturn(rows)
    elif args.workload == "mixed":
        rows = _loadtest_mixed(args, model, headers)
        table = loadtest.markdown_mixed(rows)
    elif args.workload in TRAFFIC:
        rows, notes = _loadtest_traffic(args, levels, model, headers)
        status = _report(args.out, "loadtest", rows, loadtest.markdown_traffic(rows, notes))
        differ = sum(r["traffic"]["compared"] - r["traffic"]["same"] for r in rows if r["traffic"]["compared"])
        if differ and rows[0]["server"] == "specserve":
            print(
                f"error: {differ} of our server's answers under load differ from the same turn alone", file=sys.stderr
            )
            return 1
        return status
    else:
        rows = _loadtest_prompts(args, levels, rates, model, headers)
        table = loadtest.markdown(rows)
    return _report(args.out, "loadtest", rows, table)


def _loadtest_engine(url: str, headers: dict[str, str]):
    """An engine with the models and draft settings the server at `url` reports in /info."""
    import httpx

    from app.engine.factory import build_engine

    try:
        info = httpx.get(f"{url}/info", headers=headers, timeout=10).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CliError(f"no /info at {url}: {exc}") from exc
    dtype = str(info["model_dtype"]).removeprefix("torch.")
    engine, _ = build_engine(
        info["model_id"],
        info["draft"],
        info["num_draft_tokens"],
        dtype,
        draft_schedule=info["draft_schedule"],
        draft_p_min=info["draft_p_min"],
    )
    return engine


def _measured(args: argparse.Namespace, headers: dict[str, str], level: Coroutine[Any, Any, Any]) -> tuple[Any, dict]:
    """What the `level` run in a new event loop returns, and the server's prefix-cache hit rate over it (its
    /metrics before and after)."""
    import asyncio

    from app.bench import loadtest

    before = loadtest.read_metrics(args.url, headers)
    answer = asyncio.run(level)
    return answer, loadtest.prefix_cache_hit_rate(before, loadtest.read_metrics(args.url, headers))


def _loadtest_prompts(
    args: argparse.Namespace, levels: list[int], rates: list[float], model: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """The one-turn workload: every draft at every client count (closed loop), then every rate (open loop)."""
    import json

    from app.bench import loadtest
    from app.bench.specbench import read_prompts

    path = Path(args.input)
    if not path.is_file():
        raise CliError(f"no prompts at {path}; give --input FILE.jsonl")
    prompts = [p.text for p in read_prompts(path, None, None)][: args.prompts]
    engine = _loadtest_engine(args.url, headers) if args.in_process else None
    rows: list[dict[str, Any]] = []
    # Greedy text is the target's own whatever the draft: the first level's answers are every level's reference.
    reference: dict[int, str] | None = None
    drafts = args.draft or ["default", "none"]

    def options_for(draft: str) -> dict[str, Any]:
        options = {"max_new_tokens": args.max_new_tokens, "speculative": {"draft": draft}, "model": model}
        if args.api == "tgi":
            options.pop("model")
        return options

    if args.warmup:
        level = loadtest.run_level(
            args.url, prompts, 1, len(prompts), options_for(drafts[0]), args.time_limit, args.api, args.api_key
        )
        (results, _), prefix = _measured(args, headers, level)
        reference = {r.prompt_index: r.text for r in results if r.ok}
        print(
            f"warm-up: {len(prompts)} prompts sent once, not reported (prefix cache "
            f"{loadtest.prefix_cache_summary(prefix)})",
            flush=True,
        )
    for draft in drafts:
        if engine is not None:  # the server is idle meanwhile: nothing else competes for the cores
            results, wall = loadtest.run_in_process(
                engine, prompts, max(args.requests, 1), args.max_new_tokens, draft, args.api == "chat"
            )
            if reference is None:
                reference = {r.prompt_index: r.text for r in results}
            row = {"speculative": draft, "via": "in-process", "clients": 1}
            row.update(loadtest.summarize_level(results, wall, reference, True))
            rows.append(row)
            print(json.dumps(row), flush=True)
        options = options_for(draft)
        for clients in levels:
            (results, wall), prefix = _measured(
                args,
                headers,
                loadtest.run_level(
                    args.url,
                    prompts,
                    clients,
                    max(args.requests, clients),
                    options,
                    args.time_limit,
                    args.api,
                    args.api_key,
                ),
            )
            if reference is None:
                reference = {r.prompt_index: r.text for r in results if r.ok}
            row = {"speculative": draft, "via": "http", "clients": clients}
            row.update(loadtest.summarize_level(results, wall, reference, True))
            row["prefix_cache"] = prefix
            rows.append(row)
            print(json.dumps(row), flush=True)
        for rate in rates:
            (results, wall), prefix = _measured(
                args,
                headers,
                loadtest.run_rate(
                    args.url,
                    prompts,
                    rate,
                    args.requests,
                    options,
                    args.time_limit,
                    args.api,
                    args.api_key,
                    None,
                    args.seed,
                ),
            )
            row = {"speculative": draft, "via": "http", "clients": None, "rate": rate}
            row.update(loadtest.summarize_level(results, wall, reference, True))
            row["prefix_cache"] = prefix
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _loadtest_multiturn(
    args: argparse.Namespace, levels: list[int], model: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """The multi-turn workload: every draft at every user count, one conversation of --turns turns per user."""

    from app.bench import loadtest

    rows: list[dict[str, Any]] = []
    for draft in args.draft or ["default", "none"]:
        options = {"max_new_tokens": args.max_new_tokens, "speculative": {"draft": draft}, "model": model}
        for users in levels:
            (results, wall), prefix = _measured(
                args,
                headers,
                loadtest.run_conversations(
                    args.url, users, args.turns, options, args.time_limit, args.api_key, seed=args.seed
                ),
            )
            # Conversations differ in every answer: no text to compare with a request sent alone.
            row: dict[str, Any] = {"speculative": draft, "via": "http", "workload": "multiturn", "clients": users}
            row.update(loadtest.summarize_level(results, wall, None, True))
            row["multiturn"] = loadtest.summarize_turns(results, args.turns)
            row["prefix_cache"] = prefix
            rows.append(row)
            m = row["multiturn"]
            print(
                f"{draft}, {users} users: TTFT p50 turn 1 {m['per_turn'][0]['ttft_p50_ms'] if m['per_turn'] else '-'} "
                f"ms, last turn x{m['ttft_last_over_first']}, prompts grew {m['prompts_grew']}, "
                f"prefix cache {loadtest.prefix_cache_summary(prefix)}, answers {m['answers_sha256']}",
                flush=True,
            )
    return rows


def _loadtest_mixed(args: argparse.Namespace, model: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """The mixed workload: for every draft, --long-prompts near-max-length prompts at once and the short
    requests one after another beside them."""
    import json

    import httpx

    from app.bench import loadtest
    from app.bench.workload_texts import SHORT_PROMPTS, long_prompt

    target = args.long_tokens
    if target is None:
        try:
            info = httpx.get(f"{args.url}/info", headers=headers, timeout=10).json()
            # The prompt leaves room for the answer; a few tokens spare, as the count may differ by a token or two.
            target = min(info["max_input_tokens"], info["max_total_tokens"] - args.max_new_tokens) - 8
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise CliError(f"no limits in {args.url}/info ({exc}); give --long-tokens N") from exc
        if target < 1:
            raise CliError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a long prompt")
    count = loadtest.token_counter(args.url, headers, model if args.api == "chat" else None, args.api)
    longs = [long_prompt(i, target, count, args.seed) for i in range(args.long_prompts)]
    rows: list[dict[str, Any]] = []
    for draft in args.draft or ["default", "none"]:
        options = {"max_new_tokens": args.max_new_tokens, "speculative": {"draft": draft}, "model": model}
        if args.api == "tgi":
            options.pop("model")
        (results, wall), prefix = _measured(
            args,
            headers,
            loadtest.run_mixed(
                args.url,
                longs,
                SHORT_PROMPTS,
                args.short_requests,
                options,
                args.short_tokens,
                args.short_delay,
                args.time_limit,
                args.api,
                args.api_key,
            ),
        )
        row: dict[str, Any] = {"speculative": draft, "via": "http", "workload": "mixed"}
        row["clients"] = args.long_prompts + 1
        row.update(loadtest.summarize_level(results, wall, None, True))
        row["mixed"] = loadtest.summarize_mixed(results)
        row["mixed"]["long"]["target_tokens"] = target
        row["prefix_cache"] = prefix
        rows.append(row)
        print(json.dumps(row["mixed"]), flush=True)
    return rows


def _is_specserve(url: str, headers: dict[str, str]) -> bool:
    """Whether the server at `url` is ours: its /info lists the drafts a request may choose."""
    import httpx

    try:
        response = httpx.get(f"{url}/info", headers=headers, timeout=10)
        info = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(info, dict) and "available_drafts" in info


def _refused_salt(results: list[Any]) -> str | None:
    """The error body of a request the server refused for its cache_salt field, None if none was."""
    for r in results:
        if r.error and r.error.startswith("http_4") and "cache_salt" in (r.detail or ""):
            return r.detail
    return None


def _loadtest_traffic(
    args: argparse.Namespace, levels: list[int], model: str, headers: dict[str, str]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The traffic workloads: every episode alone first (the answers every level's are compared with), then every
    draft (ours) or the one configuration (another server) at every client count; the rows and the notes under
    the table."""
    import json
    import secrets

    from app.bench import loadtest, workloads

    names = list(workloads.WORKLOADS) if args.workload == "traffic" else [args.workload]
    # Round robin over the workloads, so that a client's run and the clients at any moment mix them.
    lists = [workloads.episodes(name, args.seed) for name in names]
    episodes = [e for group in itertools.zip_longest(*lists) for e in group if e is not None]
    per_client = args.episodes or len(episodes)
    if per_client > len(episodes):
        raise CliError(f"--workload {args.workload} has {len(episodes)} episodes: --episodes at most that")
    ours = _is_specserve(args.url, headers)
    if not ours and args.draft:
        raise CliError(f"{args.url} is not specserve (no drafts in its /info): --draft chooses ours only")
    drafts: list[str | None] = list(args.draft or ["default", "none"]) if ours else [None]
    # Salts are fresh every run, so that neither an earlier run nor an earlier level served a prompt from its cache.
    run_id = secrets.token_hex(8)

    def salts(tag: str, clients: int) -> list[str] | None:
        return [f"loadtest-{run_id}-{tag}-client-{c}" for c in range(clients)] if args.salt else None

    def measure(clients: int, count: int, draft: str | None, tag: str) -> tuple[list[Any], float, dict[str, Any]]:
        options: dict[str, Any] = {"model": model}
        if draft is not None:
            options["speculative"] = {"draft": draft}
        level = loadtest.run_episodes(
            args.url,
            episodes,
            clients,
            count,
            options,
            args.time_limit,
            salts(tag, clients),
            args.api_key,
            max_new_tokens=args.max_new_tokens,
        )
        (results, wall), prefix = _measured(args, headers, level)
        refusal = _refused_salt(results) if args.salt else None
        if refusal is not None:
            raise CliError(f"{args.url} refused the cache_salt field ({refusal[:200]}): rerun with --no-salt")
        return results, wall, prefix

    reference = None
    if args.warmup:
        results, _, _ = measure(1, len(episodes), drafts[0], "alone")
        reference = loadtest.episode_reference(results)
        print(f"alone: {len(episodes)} episodes, {len(results)} turns, one client, not reported", flush=True)
    rows: list[dict[str, Any]] = []
    for draft in drafts:
        label = draft if draft is not None else "(not sent)"
        for clients in levels:
            results, wall, prefix = measure(clients, per_client, draft, f"{label}-{clients}")
            row: dict[str, Any] = {"speculative": label, "via": "http", "workload": args.workload, "clients": clients}
            row["server"] = "specserve" if ours else "other"
            row["cache_salt"] = "per level and client" if args.salt else "not sent"
            row.update(loadtest.summarize_level(results, wall, None, True))
            row["traffic"] = loadtest.summarize_episodes(results, episodes, reference)
            if args.salt and row["traffic"]["first_requests_cached"]:
                row["cache_salt"] = "sent, ignored by the server"
            row["prefix_cache"] = prefix
            rows.append(row)
            t = row["traffic"]
            print(
                json.dumps({k: row[k] for k in ("speculative", "clients", "tokens_per_second", "ttft_ms", "itl_ms")})
                + f" episodes {t['completed_episodes']}/{t['episodes']}, same as alone {t['same']}/{t['compared']}",
                flush=True,
            )
    ignored = sum(r["traffic"]["first_requests_cached"] for r in rows) if args.salt else 0
    notes = [
        f"workload {args.workload}: {len(episodes)} episodes ({', '.join(names)}), {per_client} a client a level, "
        f"seed {args.seed}; tokens per answer: {args.max_new_tokens or 'each episode own'}",
        "server: specserve (the speculative field sent: --draft); same as alone must be every answer"
        if ours
        else "server: not specserve: one configuration, no speculative field; same as alone is its agreement with "
        "its own answers alone (batched numerics may differ), not a failure",
        f"cache_salt sent but IGNORED by the server: {ignored} clients' first requests (salts it had never seen) "
        "found prompt tokens in its cache, so its cache serves the prompts earlier levels and clients sent (for cold "
        "levels, restart it between them)"
        if ignored
        else f"cache_salt: its own for each level and client (loadtest-{run_id}-...): no level and no client reads "
        "another's prompts from the server's cache"
        if args.salt
        else "cache_salt NOT sent (--no-salt): a server that caches prompts may serve a level's repeated prompts "
        "from what earlier levels and clients left",
    ]
    return rows, notes


def _loadtest_chaos(args: argparse.Namespace) -> int:
    """The chaos workload: one run of --clients clients for --duration seconds, its report per kind of request."""
    import asyncio

    from app.bench import chaos

    try:
        clients = int(args.clients) if args.clients is not None else 16
    except ValueError as exc:
        raise CliError("--workload chaos takes one --clients count, e.g. 16") from exc
    if clients < 1 or args.duration <= 0:
        raise CliError("--workload chaos needs --clients >= 1 and --duration > 0")
    load = chaos.Chaos(
        args.url,
        clients=clients,
        duration=args.duration,
        first_byte_timeout=args.first_byte_timeout,
        hang_timeout=args.hang_timeout,
        health_interval=args.health_interval,
        seed=args.seed,
        api_key=args.api_key,
        log=lambda line: print(line, flush=True),
        pid=args.pid,
    )
    row = asyncio.run(load.run())
    table = chaos.markdown(row)
    return _report(args.out, "chaos", row, table)


def _report(out_dir: str, name: str, result: object, table: str) -> int:
    """Write `name`.json (the figures) and `name`.md (the table) under `out_dir`, print the table."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    return 0
