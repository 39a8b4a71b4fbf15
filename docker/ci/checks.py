"""What docker/ci/test.sh asks of the running containers, over their ports published on 127.0.0.1.

Python's standard library only: `make docker-test` needs no project venv. Each subcommand exits 0 when its
check holds and 1 with the reason otherwise:

  server URL                    healthy; /generate, /v1/chat/completions and /metrics answer as they should
  drain URL -- COMMAND...       a long generation in flight when COMMAND stops the server still ends whole
  prometheus PROM URL           Prometheus scrapes the one specserve, reads its acceptance counters as its
                                /metrics has them, and every query of the Grafana dashboard returns data
  spread LB N -- COMMAND...     requests through nginx reach every one of the N specserve containers, by
                                nginx's access log (COMMAND prints it) against the addresses in Prometheus
  affinity LB FILE -- COMMAND...
                                each tenant's (cache_salt) requests through nginx reach one container and the
                                tenants several (nginx's log); a chat's second turn finds its first in that
                                container's prefix cache; FILE gets "TENANT ADDRESS" lines
  failover LB ADDRESS FILE -- COMMAND...
                                the tenants FILE puts on ADDRESS (a container just killed) are each answered,
                                within 5 s, by another container

With SPECSERVE_API_KEY set (as compose passes it on to the servers), every request sends it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent.parent / "grafana" / "dashboards" / "specserve.json"
ACCEPTED = "specserve_spec_decode_num_accepted_tokens_total"
DRAFTED = "specserve_spec_decode_num_draft_tokens_total"
# A prompt the n-gram draft predicts well, so that the speculative counters move.
REPETITIVE = "a b c d a b c d a b c d a b"


class CheckFailed(Exception):
    pass


def request(url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    key = os.environ.get("SPECSERVE_API_KEY")
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **auth, **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=180) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def post_ok(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    status, text = request(url, body, headers)
    if status != 200:
        raise CheckFailed(f"POST {url}: {status} {text[:500]}")
    return json.loads(text)


def wait_until(what: str, seconds: float, probe: Callable[[], bool]) -> None:
    deadline = time.monotonic() + seconds
    last = ""
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except (OSError, ValueError, KeyError, IndexError) as exc:  # not up yet, or an answer without data
            last = f" (last: {exc})"
        time.sleep(0.5)
    raise CheckFailed(f"{what}: not within {seconds:g} s{last}")


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on a server's /metrics (every label)."""
    status, text = request(f"{url}/metrics")
    if status != 200:
        raise CheckFailed(f"/metrics: {status}")
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if re.match(rf"{name}(\{{| )", line)]
    if not values:
        raise CheckFailed(f"/metrics has no {name}")
    return sum(values)


def healthy(url: str) -> bool:
    return request(f"{url}/health")[0] == 200


def check_server(url: str) -> None:
    wait_until(f"{url}/health", 300, lambda: healthy(url))
    generated = post_ok(f"{url}/generate", {"inputs": REPETITIVE, "parameters": {"max_new_tokens": 16}})
    if not generated["generated_text"].strip():
        raise CheckFailed(f"/generate generated nothing: {generated}")
    chat = post_ok(
        f"{url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12},
    )
    if not chat["choices"][0]["message"]["content"]:
        raise CheckFailed(f"/v1/chat/completions answered nothing: {chat}")
    if metric(url, "specserve_generation_tokens_total") < 16:
        raise CheckFailed("/metrics did not count the generation")
    metric(url, ACCEPTED)  # the speculative counters are there from the start
    print(f"server {url}: healthy, generates, chats, counts ({generated['generated_text'][:40]!r})")


def check_drain(url: str, stop: Sequence[str]) -> None:
    """SIGTERM (COMMAND) while a long generation runs: it still ends with every token it asked for.

    Long is about 8 s at the speed this machine generates now (at most 400 tokens): well inside the server's
    25 s grace period on a fast machine or a busy one, so that a failure means a drain that cut it short.
    """
    started = time.monotonic()
    post_ok(f"{url}/v1/completions", {"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True})
    tokens = max(32, min(400, int(32 / (time.monotonic() - started) * 8)))
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True}
    result: dict[str, Any] = {}

    def generate() -> None:
        try:
            result["answer"] = post_ok(f"{url}/v1/completions", body)
        except Exception as exc:  # reported by the main thread
            result["error"] = exc

    thread = threading.Thread(target=generate)
    thread.start()
    wait_until("the generation running", 30, lambda: metric(url, "specserve_num_requests_running") >= 1)
    started = time.monotonic()
    stopped = subprocess.run(list(stop), capture_output=True, text=True)
    thread.join(120)
    if stopped.returncode != 0:
        raise CheckFailed(f"{' '.join(stop)} failed: {stopped.stderr}")
    if "error" in result or "answer" not in result:
        raise CheckFailed(f"the generation in flight did not end well: {result.get('error', 'no answer')}")
    usage = result["answer"]["usage"]
    if usage["completion_tokens"] != tokens:
        raise CheckFailed(f"the generation in flight was cut short: {usage}")
    print(f"drain: the {tokens} tokens in flight finished during the stop ({time.monotonic() - started:.1f} s)")


def prom_query(prom: str, expr: str) -> list[dict[str, Any]]:
    status, text = request(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    answer = json.loads(text)
    if status != 200 or answer["status"] != "success":
        raise CheckFailed(f"Prometheus refused {expr!r}: {text[:500]}")
    return answer["data"]["result"]


def prom_value(prom: str, expr: str) -> float | None:
    result = prom_query(prom, expr)
    return float(result[0]["value"][1]) if result else None


def dashboard_expr(expr: str) -> str:
    """A dashboard query as Grafana sends it with every replica selected."""
    return expr.replace("$instance", ".*").replace("$__rate_interval", "1m")


def check_prometheus(prom: str, url: str) -> None:
    wait_until("Prometheus ready", 60, lambda: request(f"{prom}/-/ready")[0] == 200)
    wait_until("the specserve target up", 60, lambda: prom_value(prom, 'count(up{job="specserve"} == 1)') == 1)
    for _ in range(3):
        post_ok(f"{url}/generate", {"inputs": REPETITIVE, "parameters": {"max_new_tokens": 16}})
    # The adaptive draft length may rightly draft nothing on a slow machine: the counters are compared as
    # they are, zero included.
    accepted, drafted = metric(url, ACCEPTED), metric(url, DRAFTED)
    if not 0 <= accepted <= drafted:
        raise CheckFailed(f"accepted {accepted} > drafted {drafted}")
    wait_until(
        f"Prometheus reading {accepted:g} accepted of {drafted:g} drafted tokens",
        30,
        lambda: (prom_value(prom, f"sum({ACCEPTED})"), prom_value(prom, f"sum({DRAFTED})")) == (accepted, drafted),
    )
    queries = [(p["title"], t["expr"]) for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]

    def all_answer() -> bool:
        empty = [title for title, expr in queries if not prom_query(prom, dashboard_expr(expr))]
        if empty:
            raise ValueError(f"no data yet for {empty}")
        return True

    # rate() needs two scrapes in its window after the counters moved: a few 5 s scrape intervals.
    wait_until("every dashboard query answering", 45, all_answer)
    print(f"prometheus: the target scraped, acceptance {accepted:g}/{drafted:g} read back, {len(queries)} queries")


def check_spread(lb: str, prom: str, replicas: int, logs: Sequence[str]) -> None:
    """Requests through the balancer, each with an id of ours, until nginx's log shows every container."""
    up = 'up{job="specserve"} == 1'
    # Prometheus looks the alias up again every 5 s and scrapes every 5 s.
    wait_until(f"Prometheus scraping {replicas} containers", 60, lambda: len(prom_query(prom, up)) == replicas)
    addresses = {r["metric"]["instance"] for r in prom_query(prom, up)}
    reached: set[str] = set()
    sent = 0
    while reached != addresses and sent < 60:
        for _ in range(8):
            # A tenant each (nginx keeps one tenant's requests on one container).
            body = {
                "inputs": "Hi",
                "parameters": {"max_new_tokens": 2, "cache_salt": f"ci-spread-{sent:04d}-0123456789"},
            }
            post_ok(f"{lb}/generate", body, headers={"X-Request-ID": f"ci-spread-{sent}"})
            sent += 1
        log = subprocess.run(list(logs), capture_output=True, text=True, check=True).stdout
        for line in log.splitlines():
            m = re.search(r"upstream=(\S+) upstream_status=200 request_id=ci-spread-\d+\b", line)
            if m:
                reached.add(m.group(1))
    if reached != addresses:
        raise CheckFailed(f"{sent} requests through nginx reached {sorted(reached)} of {sorted(addresses)}")
    print(f"spread: {sent} requests through nginx reached all {replicas} containers")


TENANTS = [f"ci-affinity-tenant-{i:02d}-0123456789" for i in range(12)]
# A system prompt of several prefix-cache blocks (16 tokens each), so that a second turn has whole blocks to find.
SYSTEM = "You are a careful assistant for the specserve project. " * 6


def upstreams(logs: Sequence[str], prefix: str) -> dict[str, str]:
    """request id -> the container address that answered it 200, from nginx's log, for ids starting `prefix` (a
    request nginx passed on has every address it tried, the last one answering: `upstream=A, B`)."""
    log = subprocess.run(list(logs), capture_output=True, text=True, check=True).stdout
    found = re.findall(rf"upstream=([^=]+) upstream_status=([^=]+) request_id=({re.escape(prefix)}\S+)", log)
    return {
        rid: address.split(",")[-1].strip() for address, status, rid in found if status.split(",")[-1].strip() == "200"
    }


def ask_tenant(lb: str, tenant: str, rid: str) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "cache_salt": tenant}}
    post_ok(f"{lb}/generate", body, headers={"X-Request-ID": rid})


def check_affinity(lb: str, out: str, logs: Sequence[str]) -> None:
    for round_ in range(4):
        for i, tenant in enumerate(TENANTS):
            ask_tenant(lb, tenant, f"ci-affinity-{i:02d}-{round_}")
    answered = upstreams(logs, "ci-affinity-")
    where: dict[str, set[str]] = {}
    for rid, address in answered.items():
        where.setdefault(TENANTS[int(rid.split("-")[2])], set()).add(address)
    if len(answered) != 4 * len(TENANTS):
        raise CheckFailed(f"nginx's log shows {len(answered)} of {4 * len(TENANTS)} requests answered")
    split = {t: sorted(a) for t, a in where.items() if len(a) != 1}
    if split:
        raise CheckFailed(f"tenants split over containers: {split}")
    used = {a for addresses in where.values() for a in addresses}
    if len(used) < 2:
        raise CheckFailed(f"all {len(TENANTS)} tenants on one container ({used})")
    # The second turn of a conversation reaches the container that cached the first.
    tenant = TENANTS[0]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    first = post_ok(f"{lb}/v1/chat/completions", {"messages": messages, "max_tokens": 8, "cache_salt": tenant})
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And another one?"},
    ]
    second = post_ok(f"{lb}/v1/chat/completions", {"messages": messages, "max_tokens": 8, "cache_salt": tenant})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    if not cached:
        raise CheckFailed(f"the second turn found nothing of the first in the prefix cache: {second['usage']}")
    Path(out).write_text("".join(f"{t} {next(iter(a))}\n" for t, a in where.items()))
    print(
        f"affinity: {len(TENANTS)} tenants x 4 requests, each tenant on one container, {len(used)} containers used;"
        f" a chat's second turn found {cached} of {second['usage']['prompt_tokens']} prompt tokens cached"
    )


def check_failover(lb: str, killed: str, mapping: str, logs: Sequence[str]) -> None:
    """Each tenant of the killed container: its next request answered 200 by another one, within 5 s."""
    tenants = [t for t, a in (line.split() for line in Path(mapping).read_text().splitlines()) if a == killed]
    if not tenants:
        raise CheckFailed(f"no tenant was on {killed}")
    took = []
    for tenant in tenants:
        started = time.monotonic()
        ask_tenant(lb, tenant, f"ci-failover-{TENANTS.index(tenant):02d}")
        took.append(time.monotonic() - started)
    answered = upstreams(logs, "ci-failover-")
    moved = {rid: address for rid, address in answered.items() if address != killed}
    if len(moved) != len(tenants):
        raise CheckFailed(f"of {len(tenants)} tenants of {killed}, {len(moved)} were answered elsewhere: {answered}")
    if max(took) > 5:
        raise CheckFailed(f"failover took {max(took):.1f} s (at most 5 s): {[round(t, 1) for t in took]}")
    print(
        f"failover: {len(tenants)} tenants of the killed {killed} answered by {sorted(set(moved.values()))}, "
        f"each within {max(took):.1f} s"
    )


def main(argv: Sequence[str]) -> int:
    command, *args = argv
    rest = list(args[args.index("--") + 1 :]) if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    try:
        if command == "server":
            check_server(args[0])
        elif command == "drain":
            check_drain(args[0], rest)
        elif command == "prometheus":
            check_prometheus(args[0], args[1])
        elif command == "spread":
            check_spread(args[0], args[1], int(args[2]), rest)
        elif command == "affinity":
            check_affinity(args[0], args[1], rest)
        elif command == "failover":
            check_failover(args[0], args[1], args[2], rest)
        else:
            raise CheckFailed(f"no check {command!r}")
    except CheckFailed as exc:
        print(f"FAILED {command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
