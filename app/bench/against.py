"""`specserve bench --against`: our server beside another one, each started by the same command on the same
GGUF and driven over its OpenAI chat route (a base model without a chat template: its completions route) with the
same prompts, greedy, streamed.

Every server runs as its own process, started afresh for each configuration and each number of clients, so that
neither is measured with what an earlier configuration left in its caches. A row reports aggregate tokens/s
(every answer's tokens over the wall time of the whole level), the median time to the first streamed token, the
mean end-to-end latency, and how many answers equal our target-only answer to the same prompt (the first
configuration's, at the fewest clients). Another server's numerics differ from ours, so an answer that differs
is counted, not an error. A configuration that could not be installed, started or driven gets a row saying what
failed instead of figures, and the others still run.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# Sent once to every server before its level is timed, so that no timing includes a first request's setup.
_WARMUP = "Say hello."
# Seconds a request may take (a slow server at many clients included).
_TIMEOUT = 600.0


@dataclass(frozen=True)
class Answer:
    """One streamed chat answer: its text, its tokens (the server's usage count, else one per content chunk),
    the seconds from sending the request to the stream's end, and to its first content (None: no content)."""

    text: str
    tokens: int
    seconds: float
    first_token: float | None


@dataclass(frozen=True)
class Contender:
    """A server configuration: its name in the table, its command line for a port and a number of clients, and
    the environment it runs in (None: this process's); `error`, where it could not be prepared (installed,
    converted), says what failed, and it is reported instead of run."""

    name: str
    command: Callable[[int, int], list[str]]
    env: dict[str, str] | None = None
    error: str | None = None


def unavailable(name: str, error: str) -> Contender:
    """A configuration that cannot run, `error` saying why: a row of its own in the table."""

    def command(port: int, clients: int) -> list[str]:
        raise RuntimeError(error)

    return Contender(name, command, None, error)


# The routes a comparison sends its prompts to: one user message through the chat route, or, for a target without a
# chat template (a base model), the prompt as it is through the completions route.
ROUTES = ("chat", "completions")


def chat(client: httpx.Client, base_url: str, prompt: str, max_tokens: int, route: str = "chat") -> Answer:
    """`prompt` as one user message to `base_url`'s /v1/chat/completions (`route` "completions": as the prompt of
    /v1/completions), greedy (temperature 0), streamed with the usage asked for, through `client` (made beforehand:
    making one costs more than a short answer); raises RuntimeError on an error status, an error event or a broken
    connection (a server that died mid-answer)."""
    try:
        return _chat(client, base_url, prompt, max_tokens, route)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"{base_url}: {type(exc).__name__}: {exc}") from exc


def _chat(client: httpx.Client, base_url: str, prompt: str, max_tokens: int, route: str) -> Answer:
    if route not in ROUTES:
        raise ValueError(f"route {route!r}: one of {', '.join(ROUTES)}")
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    parts: list[str] = []
    usage: int | None = None
    first: float | None = None
    start = time.perf_counter()
    with client.stream("POST", f"{base_url}{path}", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{base_url} answered {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{base_url} sent an error: {json.dumps(event['error'])[:300]}")
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens", usage)
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if route == "chat" else choice.get("text")
                if piece:
                    if first is None:
                        first = time.perf_counter() - start
                    parts.append(piece)
    seconds = time.perf_counter() - start
    return Answer("".join(parts), usage if usage is not None else len(parts), seconds, first)


def drive(
    base_url: str, prompts: Sequence[str], max_tokens: int, clients: int, route: str = "chat"
) -> tuple[list[Answer], float]:
    """Every prompt sent by `clients` concurrent clients (each takes the next prompt when its answer is in) to
    `route`; the answers in prompt order and the wall seconds of the whole."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    with httpx.Client(timeout=_TIMEOUT, limits=limits) as client, ThreadPoolExecutor(max_workers=clients) as pool:
        start = time.perf_counter()
        answers = list(pool.map(lambda p: chat(client, base_url, p, max_tokens, route), prompts))
        return answers, time.perf_counter() - start


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(base_url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    """Return once GET /health answers 200; raises RuntimeError, with the end of `log`, if `process` exits first
    or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{process.args[0]} exited with {process.returncode} before it was ready: {_tail(log)}"
                )
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.25)
    raise RuntimeError(f"{process.args[0]} was not ready within {timeout:.0f} s: {_tail(log)}")


def _tail(log: Path, lines: int = 8) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").splitlines()[-lines:]) or f"nothing in {log}"
    except OSError:
        return f"no {log}"


@contextmanager
def serving(command: list[str], port: int, log: Path, env: dict[str, str] | None, timeout: float) -> Iterator[str]:
    """`command` running (its output in `log`) until the block ends, yielding its base URL once it is healthy."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_healthy(base_url, process, log, timeout)
            yield base_url
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_comparison(
    contenders: Sequence[Contender],
    prompts: Sequence[str],
    max_tokens: int,
    levels: Sequence[int],
    logs: Path,
    start_timeout: float = 600.0,
    say: Callable[[str], None] = print,
    route: str = "chat",
) -> list[dict[str, Any]]:
    """Every contender at every number of clients in `levels`, each a fresh process (its output in
    logs/NAME-N.log), the prompts sent to `route` (`ROUTES`): one record per pair, {"server", "clients", "seconds",
    "answers": [Answer]}, or {"server", "clients", "error"} where it was not prepared, did not start or failed an
    answer."""
    logs.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    for clients in sorted(set(levels)):
        for contender in contenders:
            if contender.error is not None:
                records.append({"server": contender.name, "clients": clients, "error": contender.error})
                continue
            port = free_port()
            log = logs / f"{contender.name.replace('/', '-')}-{clients}.log"
            say(f"{contender.name}, {clients} client(s): starting (log {log})")
            try:
                with serving(contender.command(port, clients), port, log, contender.env, start_timeout) as url:
                    with httpx.Client(timeout=_TIMEOUT) as client:
                        chat(client, url, _WARMUP, 8, route)
                    answers, seconds = drive(url, prompts, max_tokens, clients, route)
            except (RuntimeError, OSError) as exc:
                say(f"{contender.name}, {clients} client(s) failed: {exc}")
                records.append({"server": contender.name, "clients": clients, "error": str(exc)})
                continue
            records.append({"server": contender.name, "clients": clients, "seconds": seconds, "answers": answers})
    return records


def summarize(records: Sequence[dict[str, Any]], reference: str, anchor: str) -> list[dict[str, Any]]:
    """One row per record: tokens/s over the level's wall time, that over `anchor`'s at the same clients, the
    median time to first token, the mean latency, the answers equal to `reference`'s at its fewest clients, and
    for a speculative configuration the answers equal to its own server's without speculation at the same clients
    (`equal_own`: `own_plain`; None for the others); a failed record's row is {"server", "clients", "error"}."""
    runs = [r for r in records if r["server"] == reference and "error" not in r]
    if not runs:
        failed = [r["error"] for r in records if r["server"] == reference]
        why = f" ({failed[0]})" if failed else ""
        raise ValueError(f"no run of {reference}, the answers every other is compared with{why}")
    expected = [a.text for a in min(runs, key=lambda r: r["clients"])["answers"]]
    speed = {
        (r["server"], r["clients"]): sum(a.tokens for a in r["answers"]) / r["seconds"]
        for r in records
        if "error" not in r
    }
    texts = {(r["server"], r["clients"]): [a.text for a in r["answers"]] for r in records if "error" not in r}
    names = {r["server"] for r in records}
    rows: list[dict[str, Any]] = []
    for r in records:
        if "error" in r:
            rows.append({"server": r["server"], "clients": r["clients"], "error": r["error"]})
            continue
        answers: list[Answer] = r["answers"]
        plain = texts.get((own_plain(r["server"], names, reference), r["clients"]))
        tps = speed[(r["server"], r["clients"])]
        base = speed.get((anchor, r["clients"]))
        firsts = [a.first_token for a in answers if a.first_token is not None]
        rows.append(
            {
                "server": r["server"],
                "clients": r["clients"],
                "requests": len(answers),
                "tokens": sum(a.tokens for a in answers),
                "seconds": r["seconds"],
                "tokens_per_second": tps,
                "vs_anchor": tps / base if base else None,
                "first_token_median": statistics.median(firsts) if firsts else None,
                "latency_mean": statistics.fmean(a.seconds for a in answers) if answers else None,
                "equal": sum(a.text == e for a, e in zip(answers, expected, strict=True)),
                "equal_own": None if plain is None else sum(a.text == e for a, e in zip(answers, plain, strict=True)),
            }
        )
    return rows


def own_plain(name: str, names: set[str], reference: str) -> str | None:
    """The configuration of `name`'s own server without speculation: the longest other name that `name` extends
    by a `/` or `-` part (`llama-server/ngram-mod` -> `llama-server`, `openvino/fp16-prompt-lookup` ->
    `openvino/fp16`), `reference` for another of ours (`specserve/default` -> `specserve/none`); None for a plain
    configuration itself."""
    found = [n for n in names if n != name and (name.startswith(n + "/") or name.startswith(n + "-"))]
    if found:
        return max(found, key=len)
    ours = reference.split("/")[0] + "/"
    return reference if name != reference and name.startswith(ours) and reference in names else None


def markdown(rows: Sequence[dict[str, Any]], anchor: str, reference: str) -> str:
    """The rows as a markdown table."""

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    lines = [
        f"| server | clients | tok/s | x {anchor} | first token (median) | latency (mean) | equal to {reference} "
        "| equal to its own without speculation |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            # One line, and no pipe that would split the cell.
            error = " ".join(r["error"].split()).replace("|", "/")
            lines.append(f"| {r['server']} | {r['clients']} | failed: {error} | | | | | |")
            continue
        vs = "-" if r["vs_anchor"] is None else f"{r['vs_anchor']:.2f}x"
        own = "-" if r.get("equal_own") is None else f"{r['equal_own']}/{r['requests']}"
        lines.append(
            f"| {r['server']} | {r['clients']} | {r['tokens_per_second']:.1f} | {vs} | "
            f"{secs(r['first_token_median'])} | {secs(r['latency_mean'])} | {r['equal']}/{r['requests']} | {own} |"
        )
    return "\n".join(lines)
