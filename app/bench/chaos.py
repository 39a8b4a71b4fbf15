"""`specserve loadtest --workload chaos`: a mixed, hostile load bounded in time (issue 48).

`clients` concurrent clients, for `duration` seconds, each sending one request after another, its kind drawn
at random (`WEIGHTS`):

* ``greedy`` and ``seeded``: short prompts on all four generation routes (/generate, /generate_stream,
  /v1/completions, /v1/chat/completions), streamed and not; each answer is compared with the first answer the
  same prompt got on the same API (a greedy or seeded text must never change);
* ``multiturn``: chat conversations resending the whole conversation every turn (greedy, so the same
  conversation is the same text every time it is replayed, and compared likewise);
* ``disconnect``: a stream the client closes after its first event;
* ``malformed``: bodies the server must refuse with a small 4xx (not JSON, wrong types, an empty prompt,
  nested too deeply, not UTF-8, ...);
* ``long``: three long prompts (2-5 k tokens) with max_tokens 8, sent again and again, greedy and compared.

Beside them one client polls /health every `health_interval` seconds on one kept-alive connection (the race
between a client's idle pool and the server's keep-alive timeout shows there), and another reads the server's
RSS from /metrics (specserve_process_resident_memory_bytes) every `rss_interval` seconds.

Per kind the report gives the status counts, how many got no first byte (response headers) within
`first_byte_timeout`, hangs (nothing at all, headers or stream bytes, for `hang_timeout` seconds: the client
gives up), malformed SSE frames, texts that changed, refusals (429/503, and refusals sent as a stream's error
event) and how many of them carried ``Retry-After``; beside it the /health failures and the RSS series
(after the warm-up, its peak, after the load) with the prefix cache's bytes from /info.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.bench.loadtest import auth_headers, percentile

# The kinds of request and how often a client draws each.
WEIGHTS = {"greedy": 30, "seeded": 18, "multiturn": 20, "disconnect": 8, "malformed": 6, "long": 8}
ROUTES = ("generate", "generate_stream", "completions", "completions_stream", "chat", "chat_stream")
SHORT_PROMPTS = (
    "Name three colours of the rainbow.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Count from one to five.",
    "Give a synonym of happy.",
    "What do bees make?",
)
USER_TURNS = ("Hello! Who are you?", "Tell me a fact about cats.", "And one about dogs.", "Thanks, summarize both.")
LONG_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. " * 300 + "Summarize the text above:",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor. " * 280,
    " ".join(str(i) for i in range(1, 700)),
)
# Bodies the server must refuse with a 4xx, as (name, bytes, content type).
MALFORMED: tuple[tuple[str, str, bytes], ...] = (
    ("not_json", "/generate", b"{this is not json"),
    ("wrong_type", "/generate", b'{"inputs": 42}'),
    ("empty_prompt", "/v1/completions", b'{"prompt": "", "max_tokens": 4}'),
    ("negative_tokens", "/v1/completions", b'{"prompt": "hi", "max_tokens": -3}'),
    ("bad_messages", "/v1/chat/completions", b'{"messages": [{"role": "wizard"}]}'),
    ("deep_nesting", "/generate", b'{"inputs": "hi", "parameters": ' + b"[" * 500 + b"]" * 500 + b"}"),
    ("not_utf8", "/generate", b'{"inputs": "\xff\xfe"}'),
    ("huge_int", "/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
)
REFUSALS = frozenset({429, 503})


@dataclass
class Outcome:
    """One request as the client saw it."""

    kind: str
    route: str
    status: int | str = "none"  # the HTTP status, or the name of the exception that ended it
    headers_s: float | None = None  # seconds to the response headers (the first byte)
    first_event_s: float | None = None  # streams: to the first bytes of the body (an event or a comment)
    total_s: float = 0.0
    hang: bool = False  # nothing at all came for hang_timeout seconds
    bad_frames: int = 0
    text: str | None = None  # the generated text, when the request finished
    key: str | None = None  # what its text is compared under
    retry_after: bool = False  # a refusal's Retry-After header
    stream_error: str | None = None  # the type of a stream's error event
    comments: int = 0  # SSE comments (": queued", keep-alives) while it waited


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    health: Counter = field(default_factory=Counter)  # "ok" or what failed
    health_failures: list[str] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the start, bytes)
    texts: dict[str, str] = field(default_factory=dict)  # key -> the first answer
    compared: int = 0
    changed: list[str] = field(default_factory=list)


def _body(
    route: str, prompt: str | list[dict[str, str]], max_tokens: int, seed: int | None, salt: str | None = None
) -> tuple[str, dict]:
    """The path and body of a generation request on `route`; `seed` None: greedy; `salt`: its prefix-cache
    tenant (a salt no other request sent finds nothing cached)."""
    stream = route.endswith("_stream")
    sampling: dict[str, Any] = {"temperature": 0.8, "seed": seed} if seed is not None else {"temperature": 0}
    if route in ("generate", "generate_stream"):
        assert isinstance(prompt, str)
        parameters: dict[str, Any] = {"max_new_tokens": max_tokens}
        if seed is not None:
            parameters.update(do_sample=True, temperature=0.8, seed=seed)
        if salt is not None:
            parameters["cache_salt"] = salt
        return f"/{route}", {"inputs": prompt, "parameters": parameters}
    if salt is not None:
        sampling["cache_salt"] = salt
    if route.startswith("completions"):
        assert isinstance(prompt, str)
        return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "stream": stream, **sampling}
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "stream": stream, **sampling}


def _api(route: str) -> str:
    """Which API a route belongs to: its streamed and whole answers are the same text."""
    return "tgi" if route.startswith("generate") else route.removesuffix("_stream")


def _text_of(route: str, data: dict[str, Any]) -> str:
    """The generated text of a whole (not streamed) answer."""
    if route == "generate":
        return data["generated_text"]
    if route == "completions":
        return data["choices"][0]["text"]
    return data["choices"][0]["message"]["content"] or ""


_FIELDS = ("data:", "event:", "id:", "retry:")


class _Stream:
    """What one SSE stream said: its text, frames that were not well-formed, its end."""

    def __init__(self, route: str) -> None:
        self.route = route
        self.pieces: list[str] = []
        self.bad = 0
        self.done = False  # the final event ([DONE], or TGI's event with generated_text)
        self.final_text: str | None = None
        self.error: str | None = None
        self.comments = 0
        self.events = 0

    def line(self, line: str) -> None:
        if not line:
            return
        if line.startswith(":"):
            self.comments += 1
            return
        if not line.startswith(_FIELDS):
            self.bad += 1
            return
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.bad += 1
            return
        self.events += 1
        if not isinstance(event, dict):
            self.bad += 1
        elif "error" in event:
            err = event["error"]
            self.error = str(err.get("type") if isinstance(err, dict) else event.get("error_type"))
            if self.route == "generate_stream":
                self.done = True
        elif self.route == "generate_stream":
            self.pieces.append(event.get("token", {}).get("text", ""))
            if event.get("generated_text") is not None:
                self.final_text = event["generated_text"]
                self.done = True
        else:
            for choice in event.get("choices") or []:
                piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                self.pieces.append(piece or "")

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Chaos:
    """The chaos load against the server at `url`; `run` sends it and returns the Report."""

    def __init__(
        self,
        url: str,
        clients: int = 16,
        duration: float = 300.0,
        first_byte_timeout: float = 5.0,
        hang_timeout: float = 60.0,
        health_interval: float = 5.0,
        rss_interval: float = 5.0,
        seed: int = 0,
        api_key: str | None = None,
        max_tokens: int = 16,
        long_prompts: tuple[str, ...] = LONG_PROMPTS,
        short_prompts: tuple[str, ...] = SHORT_PROMPTS,
        weights: dict[str, int] | None = None,
        log: Callable[[str], None] | None = None,
        pid: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.clients = clients
        self.duration = duration
        self.first_byte_timeout = first_byte_timeout
        self.hang_timeout = hang_timeout
        self.health_interval = health_interval
        self.rss_interval = rss_interval
        self.seed = seed
        self.headers = auth_headers(api_key)
        self.max_tokens = max_tokens
        self.long_prompts = long_prompts
        self.short_prompts = short_prompts
        self.weights = weights or WEIGHTS
        self.log = log or (lambda _: None)
        self.pid = pid  # the server's process on this machine: its RSS read from /proc where /metrics has none
        self.report = Report()
        self._t0 = 0.0
        self.warm: dict[str, Any] = {}

    # --- one request --------------------------------------------------------------------------------

    async def _send(
        self, client: httpx.AsyncClient, kind: str, route: str, path: str, body: bytes, key: str | None, leave: bool
    ) -> Outcome:
        """Send one request and read its answer as a client would, timing the first byte; `leave`: close a
        stream after its first event."""
        out = Outcome(kind, route, key=key)
        stream = route.endswith("_stream") or (kind == "malformed")
        t0 = time.perf_counter()
        headers = {**self.headers, "Content-Type": "application/json"}
        try:
            async with asyncio.timeout(None) as scope:

                def later() -> None:  # nothing may stay silent for hang_timeout seconds
                    scope.reschedule(asyncio.get_running_loop().time() + self.hang_timeout)

                later()
                request = client.build_request("POST", self.url + path, content=body, headers=headers)
                response = await client.send(request, stream=True)
                try:
                    later()
                    out.headers_s = time.perf_counter() - t0
                    out.status = response.status_code
                    out.retry_after = "retry-after" in response.headers
                    if response.status_code != 200 or not stream:
                        raw = await response.aread()
                        if response.status_code == 200:
                            out.text = _text_of(route, json.loads(raw))
                        return out
                    sse = _Stream(route)
                    async for line in response.aiter_lines():
                        later()
                        if out.first_event_s is None:
                            out.first_event_s = time.perf_counter() - t0
                        sse.line(line)
                        if leave and sse.events:
                            return out
                    out.bad_frames = sse.bad
                    out.comments = sse.comments
                    out.stream_error = sse.error
                    if sse.error is None:
                        if not sse.done:
                            out.bad_frames += 1  # a stream that ended without its final event
                        elif sse.final_text is not None and sse.final_text != sse.text:
                            out.bad_frames += 1  # TGI's final text is not what its events added up to
                        else:
                            out.text = sse.text
                finally:
                    await response.aclose()
        except TimeoutError:
            out.hang = True
            out.status = "hang"
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
            out.status = type(exc).__name__
        finally:
            out.total_s = time.perf_counter() - t0
        return out

    def _record(self, out: Outcome) -> None:
        self.report.outcomes.append(out)
        if out.text is None or out.key is None:
            return
        first = self.report.texts.setdefault(out.key, out.text)
        if first is not out.text:
            self.report.compared += 1
            if first != out.text:
                self.report.changed.append(out.key)

    async def generation(
        self, client: httpx.AsyncClient, kind: str, route: str, prompt: str | list[dict[str, str]], **kw: Any
    ) -> Outcome:
        max_tokens = kw.get("max_tokens", self.max_tokens)
        seed = kw.get("seed")
        path, body = _body(route, prompt, max_tokens, seed, kw.get("salt"))
        key = kw.get("key")
        if key is None and not kw.get("leave"):
            key = json.dumps([_api(route), prompt, max_tokens, seed])
        out = await self._send(client, kind, route, path, json.dumps(body).encode(), key, kw.get("leave", False))
        self._record(out)
        return out

    # --- the clients --------------------------------------------------------------------------------

    async def _client(self, client: httpx.AsyncClient, index: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        kinds, weights = list(self.weights), list(self.weights.values())
        while time.perf_counter() < deadline:
            kind = rng.choices(kinds, weights)[0]
            route = rng.choice(ROUTES)
            if kind == "greedy":
                await self.generation(client, kind, route, rng.choice(self.short_prompts))
            elif kind == "seeded":
                await self.generation(client, kind, route, rng.choice(self.short_prompts), seed=rng.randrange(4))
            elif kind == "long":
                route = rng.choice(("generate", "generate_stream", "completions", "completions_stream"))
                await self.generation(client, kind, route, rng.choice(self.long_prompts), max_tokens=8)
            elif kind == "disconnect":
                route = rng.choice(("generate_stream", "completions_stream", "chat_stream"))
                await self.generation(client, kind, route, rng.choice(self.short_prompts), max_tokens=64, leave=True)
            elif kind == "malformed":
                name, path, body = rng.choice(MALFORMED)
                self._record(await self._send(client, kind, name, path, body, None, False))
            else:  # a conversation, turn by turn, while the load lasts
                messages: list[dict[str, str]] = []
                stream = rng.random() < 0.5
                for turn in USER_TURNS:
                    if time.perf_counter() >= deadline:
                        break
                    messages.append({"role": "user", "content": turn})
                    route = "chat_stream" if stream else "chat"
                    out = await self.generation(client, kind, route, list(messages))
                    if out.text is None:
                        break
                    messages.append({"role": "assistant", "content": out.text})

    async def _health(self, deadline: float) -> None:
        """/health every health_interval seconds on one kept-alive connection."""
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=None)
        async with httpx.AsyncClient(timeout=10.0, limits=limits) as client:
            while time.perf_counter() < deadline:
                try:
                    response = await client.get(self.url + "/health", headers=self.headers)
                    what = "ok" if response.status_code == 200 else f"http_{response.status_code}"
                except httpx.HTTPError as exc:
                    what = f"{type(exc).__name__}({exc})"
                self.report.health[what if what == "ok" else "failed"] += 1
                if what != "ok":
                    self.report.health_failures.append(f"{time.perf_counter() - self._t0:.1f} s: {what}")
                await asyncio.sleep(self.health_interval)

    async def rss_now(self, client: httpx.AsyncClient) -> int | None:
        """The server's resident memory: /metrics' specserve_process_resident_memory_bytes, or /proc for `pid`."""
        if self.pid is not None:
            return _proc_rss(self.pid)
        try:
            text = (await client.get(self.url + "/metrics", headers=self.headers)).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith(("specserve_process_resident_memory_bytes", "process_resident_memory_bytes ")):
                return int(float(line.split()[-1]))
        return None

    async def _rss(self, client: httpx.AsyncClient, deadline: float) -> None:
        while time.perf_counter() < deadline:
            rss = await self.rss_now(client)
            if rss is not None:
                self.report.rss.append((round(time.perf_counter() - self._t0, 1), rss))
            await asyncio.sleep(self.rss_interval)

    async def _info(self, client: httpx.AsyncClient) -> dict[str, Any]:
        try:
            return (await client.get(self.url + "/info", headers=self.headers)).json()
        except (httpx.HTTPError, ValueError):
            return {}

    async def run(self) -> dict[str, Any]:
        """Warm up (each short prompt greedily on every API), send the load (the long prompts' first copies arrive
        in it, cold), let the server settle, send the warm-up's greedy requests again (they must not have
        changed), time each long prompt on the idle server (in a prefix-cache tenant of its own, so cold, then
        again warm), and summarize."""
        timeout = httpx.Timeout(connect=10.0, read=None, write=10.0, pool=None)
        limits = httpx.Limits(max_connections=self.clients + 4, max_keepalive_connections=self.clients + 4)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            self._t0 = time.perf_counter()
            for route in ("generate", "completions", "chat"):
                for prompt in self.short_prompts:
                    await self.generation(client, "warmup", route, prompt)
            self.warm = {"rss": await self.rss_now(client)}
            self.log(f"warm-up done at {time.perf_counter() - self._t0:.1f} s, RSS {self.warm['rss']}")
            start = time.perf_counter()
            deadline = start + self.duration
            background = [
                asyncio.ensure_future(self._health(deadline)),
                asyncio.ensure_future(self._rss(client, deadline)),
            ]
            await asyncio.gather(*(self._client(client, i, deadline) for i in range(self.clients)))
            wall = time.perf_counter() - start
            await asyncio.gather(*background)
            self.log(f"load done in {wall:.1f} s; settling")
            await asyncio.sleep(min(5.0, self.duration / 10))
            after_load = await self.rss_now(client)
            info = await self._info(client)
            for route in ("generate", "completions", "chat"):
                for prompt in self.short_prompts:
                    await self.generation(client, "after", route, prompt)
            idle: dict[str, list[float]] = {"cold": [], "warm": []}
            for i, prompt in enumerate(self.long_prompts):
                salt = f"chaos-idle-{self.seed}-{i}-{time.time_ns()}"
                for state in ("cold", "warm"):
                    # Keyed as the load's own long requests: the same greedy text.
                    key = json.dumps(["completions", prompt, 8, None])
                    out = await self.generation(client, "idle", "completions", prompt, max_tokens=8, salt=salt, key=key)
                    idle[state].append(out.total_s)
            self.warm["idle_long_s"] = idle
        return self.summary(wall, after_load, info)

    # --- the report ---------------------------------------------------------------------------------

    def summary(self, wall: float, rss_after: int | None, info: dict[str, Any]) -> dict[str, Any]:
        r = self.report
        kinds: dict[str, Any] = {}
        for kind in [*self.weights, "warmup", "after", "idle"]:
            outs = [o for o in r.outcomes if o.kind == kind]
            if outs:
                kinds[kind] = _kind_summary(outs, self.first_byte_timeout)
        loaded = [o for o in r.outcomes if o.kind in self.weights]
        refusals = [o for o in loaded if o.status in REFUSALS]
        rss = [b for _, b in r.rss]
        prefix_used = info.get("prefix_cache_used_bytes")
        warm_rss = self.warm.get("rss")
        idle = self.warm.get("idle_long_s", {})
        longs = sorted(o.total_s for o in loaded if o.kind == "long" and o.status == 200)
        bound = None
        if warm_rss is not None and prefix_used is not None:
            bound = round(1.2 * warm_rss + prefix_used)
        return {
            "clients": self.clients,
            "duration_s": round(wall, 1),
            "requests": len(loaded),
            "kinds": kinds,
            "first_byte_timeout_s": self.first_byte_timeout,
            "hang_timeout_s": self.hang_timeout,
            "no_first_byte": sum(1 for o in loaded if _late(o, self.first_byte_timeout)),
            "no_first_byte_streamed": sum(
                1 for o in loaded if o.route.endswith("_stream") and _late(o, self.first_byte_timeout)
            ),
            "hangs": sum(o.hang for o in loaded),
            # A non-streamed answer has no byte before it is done: a long one that outlives hang_timeout while it
            # runs is counted a hang too, so the streamed ones are told apart.
            "hangs_streamed": sum(1 for o in loaded if o.route.endswith("_stream") and o.hang),
            "5xx": sum(1 for o in loaded if isinstance(o.status, int) and o.status >= 500 and o.status != 503),
            "refusals": len(refusals),
            "refusals_with_retry_after": sum(o.retry_after for o in refusals),
            "stream_errors": dict(Counter(o.stream_error for o in loaded if o.stream_error)),
            "bad_frames": sum(o.bad_frames for o in r.outcomes),
            "texts_compared": r.compared,
            "texts_changed": len(r.changed),
            "changed": r.changed[:10],
            "health": dict(r.health),
            "health_failures": r.health_failures[:10],
            "long": {
                "idle_cold_s": [round(t, 2) for t in idle.get("cold", [])],
                "idle_warm_s": [round(t, 2) for t in idle.get("warm", [])],
                "p50_s": _round(percentile(longs, 0.5)),
                "p99_s": _round(percentile(longs, 0.99)),
                "max_s": _round(longs[-1] if longs else None),
            },
            "rss": {
                "after_warmup": warm_rss,
                "peak": max(rss) if rss else None,
                "after_load": rss_after,
                "prefix_cache_used_bytes": prefix_used,
                "bound": bound,
                "within_bound": None if bound is None or rss_after is None else rss_after <= bound,
                "series": r.rss,
            },
        }


def _proc_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _late(o: Outcome, limit: float) -> bool:
    return o.headers_s is None or o.headers_s > limit


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _kind_summary(outs: list[Outcome], limit: float) -> dict[str, Any]:
    heads = sorted(o.headers_s for o in outs if o.headers_s is not None)
    totals = sorted(o.total_s for o in outs)
    return {
        "requests": len(outs),
        "status": dict(Counter(str(o.status) for o in outs)),
        "no_first_byte": sum(1 for o in outs if _late(o, limit)),
        "hangs": sum(o.hang for o in outs),
        "bad_frames": sum(o.bad_frames for o in outs),
        "first_byte_p50_s": _round(percentile(heads, 0.5)),
        "first_byte_p99_s": _round(percentile(heads, 0.99)),
        "first_byte_max_s": _round(heads[-1] if heads else None),
        "total_p50_s": _round(percentile(totals, 0.5)),
        "total_p99_s": _round(percentile(totals, 0.99)),
        "total_max_s": _round(totals[-1] if totals else None),
        "stream_errors": dict(Counter(o.stream_error for o in outs if o.stream_error)),
        "queued_comments": sum(o.comments for o in outs),
    }


def markdown(row: dict[str, Any]) -> str:
    """The chaos report as a table per kind and the totals beneath."""
    lines = [
        "| kind | requests | status | no first byte | hangs | bad frames | first byte p99 (s) "
        "| total p50/p99/max (s) |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for kind, k in row["kinds"].items():
        status = ", ".join(f"{s}: {n}" for s, n in sorted(k["status"].items()))
        lines.append(
            f"| {kind} | {k['requests']} | {status} | {k['no_first_byte']} | {k['hangs']} | {k['bad_frames']} | "
            f"{k['first_byte_p99_s']} | {k['total_p50_s']} / {k['total_p99_s']} / {k['total_max_s']} |"
        )
    rss = row["rss"]
    mb = {k: None if rss[k] is None else round(rss[k] / 1e6) for k in ("after_warmup", "peak", "after_load", "bound")}
    lines += [
        "",
        f"{row['requests']} requests from {row['clients']} clients in {row['duration_s']} s: "
        f"{row['no_first_byte']} without a first byte within {row['first_byte_timeout_s']:g} s "
        f"({row['no_first_byte_streamed']} streamed), {row['hangs']} hangs ({row['hangs_streamed']} streamed), "
        f"{row['5xx']} x 5xx (503 apart), "
        f"{row['bad_frames']} bad frames, {row['texts_changed']} of {row['texts_compared']} texts changed; "
        f"{row['refusals']} refusals, {row['refusals_with_retry_after']} with Retry-After; stream errors "
        f"{row['stream_errors'] or 'none'}; /health {row['health']}; long prompts p50 {row['long']['p50_s']} s, "
        f"p99 {row['long']['p99_s']} s (idle: cold {row['long']['idle_cold_s']}, warm {row['long']['idle_warm_s']}); "
        f"RSS MB after warm-up {mb['after_warmup']}, peak {mb['peak']}, after the load {mb['after_load']} "
        f"(bound 1.2 x warm-up + prefix cache {mb['bound']}: {'within' if rss['within_bound'] else 'over'})",
    ]
    return "\n".join(lines)
