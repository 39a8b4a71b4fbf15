"""The bench's traffic workloads (`specserve bench --workload`): what a server's traffic looks like.

Everything here is written for this project (no benchmark data set) and deterministic for a seed, so every run
offers the same load. Each workload (`WORKLOADS`, `episodes`) is a list of `Episode`s, an episode a few requests
sent one after another, each built from the answers to the earlier ones:

* `agent`: a tool-calling loop over a fixed schema of four tools (OpenAI's `tools`, rendered by the server in
  the Hermes `<tool_call>` format), a task, then 10 tool results fed back as `tool` messages, one per turn;
* `chat`: conversations of 5 turns (the load test's user messages, app.bench.workload_texts), each turn's
  history holding the model's earlier answers;
* `code-edit`: a short source file and an instruction to change a few lines; the answer is mostly the file,
  which the request carries as its `prediction`;
* `extraction`: one instruction and JSON schema over 10 invoices, one conversation each;
* `rag`: a document of five paragraphs, then a question to answer from it or a summary to write.

Every prompt stays under about 1,500 tokens of SmolLM2's tokenizer with answers of the episode's
`max_new_tokens` (the longest history included).

An answer fed back is the model's text (the bench, in process) or the assistant message a server sent over HTTP
(`specserve loadtest`: its `content` and `tool_calls`), so both send the same episodes.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.bench.workload_texts import VERBS, sentence, user_turns

# An answer to a turn: the model's text, or the assistant message a server sent (`content`, `tool_calls`).
Answer = str | dict[str, Any]


def answer_text(answer: Answer) -> str:
    """The text of `answer` (a message's `content`, none: empty)."""
    return answer if isinstance(answer, str) else str(answer.get("content") or "")


@dataclass
class Episode:
    """`turns` requests of one workload, sent one after another: turn t's messages are `messages(answers)`, the
    answers being the model's to turns 0..t-1 (one-turn workloads ignore them). `tools`: OpenAI's `tools` sent
    with every turn; `prediction`: the text the answers will mostly be (OpenAI's predicted outputs)."""

    workload: str
    index: int
    turns: int
    max_new_tokens: int
    build: Callable[[Sequence[Answer]], list[dict[str, Any]]] = field(repr=False, compare=False)
    tools: list[dict[str, Any]] | None = None
    prediction: str | None = None

    def messages(self, answers: Sequence[Answer]) -> list[dict[str, Any]]:
        """The chat messages of turn `len(answers)`, built from the model's answers to the turns before it."""
        if len(answers) >= self.turns:
            raise ValueError(f"{self.workload} episode {self.index} has {self.turns} turns, not {len(answers) + 1}")
        return self.build(answers)


def _one_turn(workload: str, index: int, max_new_tokens: int, prompt: str, prediction: str | None = None) -> Episode:
    """A one-turn episode: the user's `prompt`, whatever came before."""
    return Episode(
        workload, index, 1, max_new_tokens, lambda answers: [{"role": "user", "content": prompt}], prediction=prediction
    )


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


AGENT_TOOLS: list[dict[str, Any]] = [
    _function(
        "search_docs",
        "Search the documentation; returns the best matching passage.",
        {"query": {"type": "string"}},
        ["query"],
    ),
    _function(
        "list_files",
        "List a folder of the repository.",
        {"path": {"type": "string"}},
        ["path"],
    ),
    _function(
        "read_file",
        "Read a few lines of a file, from line `start`.",
        {"path": {"type": "string"}, "start": {"type": "integer"}},
        ["path"],
    ),
    _function(
        "run_tests",
        "Run the tests matching a pattern.",
        {"pattern": {"type": "string"}},
        ["pattern"],
    ),
]
AGENT_SYSTEM = (
    "You are a coding agent in the specserve repository. Call one tool per turn and read its result before the "
    "next step; when you know the answer, reply to the user without a tool call."
)
# The repository the agent's tools answer about: folders and their entries.
_TREE = {
    ".": ["app/", "tests/", "docs/", "README.md", "Makefile"],
    "app": ["engine/", "api/", "cli.py", "settings.py", "worker.py"],
    "app/engine": ["engine.py", "step.py", "prefix_cache.py", "drafting/", "model/"],
    "app/engine/drafting": ["base.py", "ngram.py", "hybrid.py", "suffix.py", "draft_length.py"],
    "app/api": ["openai.py", "native.py", "tools.py", "schemas.py", "jobs.py"],
    "tests": ["test_prefix_cache.py", "test_drafters.py", "test_api_tools.py", "test_settings.py"],
    "docs": ["architecture.md", "service.md", "deploy.md", "bench/"],
}
# Each task: the request, then the plan a careful agent follows (one call per turn, the last ten turns fed back).
_Call = tuple[str, dict[str, Any]]  # a tool's name and arguments
_AGENT_TASKS: list[tuple[str, list[_Call]]] = [
    (
        "The prefix cache hit rate drops to zero after the server restarts with a larger prefix_cache_mb. Find "
        "where the cache's size is read, why a restart could clear it, and say what to change.",
        [
            ("list_files", {"path": "app/engine"}),
            ("search_docs", {"query": "prefix_cache_mb"}),
            ("read_file", {"path": "app/engine/prefix_cache.py", "start": 1}),
            ("read_file", {"path": "app/engine/prefix_cache.py", "start": 90}),
            ("search_docs", {"query": "restart cache eviction"}),
            ("read_file", {"path": "app/settings.py", "start": 1}),
            ("list_files", {"path": "tests"}),
            ("run_tests", {"pattern": "test_prefix_cache"}),
            ("read_file", {"path": "app/engine/engine.py", "start": 190}),
            ("run_tests", {"pattern": "test_settings"}),
        ],
    ),
    (
        "A user reports that tool calls stream as plain text when tool_choice is auto. Find how the chat route "
        "reads tool calls out of the answer, find a test that covers it, and explain the likely cause.",
        [
            ("list_files", {"path": "app/api"}),
            ("search_docs", {"query": "tool_choice auto"}),
            ("read_file", {"path": "app/api/tools.py", "start": 1}),
            ("read_file", {"path": "app/api/tools.py", "start": 280}),
            ("search_docs", {"query": "tool_call streaming delta"}),
            ("read_file", {"path": "app/api/openai.py", "start": 420}),
            ("list_files", {"path": "tests"}),
            ("run_tests", {"pattern": "test_api_tools"}),
            ("read_file", {"path": "app/api/tools.py", "start": 400}),
            ("run_tests", {"pattern": "test_api_tools and stream"}),
        ],
    ),
    (
        "Decoding got slower after the draft-length schedule changed. Find which module picks the draft length, "
        "what it measures, and which setting turns the old behaviour back on.",
        [
            ("list_files", {"path": "app/engine/drafting"}),
            ("search_docs", {"query": "draft_schedule adaptive"}),
            ("read_file", {"path": "app/engine/drafting/draft_length.py", "start": 1}),
            ("read_file", {"path": "app/engine/drafting/draft_length.py", "start": 60}),
            ("search_docs", {"query": "num_draft_tokens default"}),
            ("read_file", {"path": "app/settings.py", "start": 40}),
            ("list_files", {"path": "tests"}),
            ("run_tests", {"pattern": "test_drafters"}),
            ("read_file", {"path": "app/engine/drafting/hybrid.py", "start": 1}),
            ("run_tests", {"pattern": "test_draft_length"}),
        ],
    ),
]
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*(?:</tool_call>|$)", re.DOTALL)


def _parse_call(answer: Answer) -> tuple[str, str, dict[str, Any]] | None:
    """(the text beside the call, the tool's name, its arguments) of an answer's first call that names one of
    `AGENT_TOOLS` with object arguments: a server's first such `tool_calls` entry, else the text's first
    `<tool_call>` block, as the server's `auto` parser reads it; else None."""
    names = {t["function"]["name"] for t in AGENT_TOOLS}
    if isinstance(answer, dict):
        for sent in answer.get("tool_calls") or []:
            function = sent.get("function") if isinstance(sent, dict) else None
            if not isinstance(function, dict):
                continue
            try:
                arguments = json.loads(function.get("arguments") or "")
            except (json.JSONDecodeError, TypeError):
                continue
            if function.get("name") in names and isinstance(arguments, dict):
                return answer_text(answer).strip(), function["name"], arguments
    text = answer_text(answer)
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
        return None
    return text[: match.start()].strip(), call["name"], call["arguments"]


def tool_result(name: str, arguments: dict[str, Any], seed: int = 0) -> str:
    """What tool `name` answers to `arguments`: a short JSON string, the same for the same call and seed (a
    call the plan never makes gets an answer too, so a model's own calls are answered)."""
    rng = random.Random(f"{seed}|{name}|{json.dumps(arguments, sort_keys=True)}")
    path = str(arguments.get("path", "")).strip("/") or "."
    if name == "list_files":
        if path not in _TREE:
            return json.dumps({"error": f"no folder {path}"})
        return json.dumps({"path": path, "entries": _TREE[path]})
    if name == "search_docs":
        passage = {"file": f"docs/{rng.choice(['architecture', 'service', 'deploy'])}.md", "text": sentence(rng)}
        return json.dumps({"results": [passage]})
    if name == "read_file":
        start = max(1, _as_int(arguments.get("start"), 1))
        source = rng.choice([text for _, text in _SOURCES]).splitlines()
        first = rng.randrange(max(1, len(source) - 2))
        return json.dumps(
            {"path": path, "lines": {str(start + i): line for i, line in enumerate(source[first : first + 2])}}
        )
    if name == "run_tests":
        failed = rng.randint(0, 1)
        failures = [f"tests/{rng.choice(_TREE['tests'])}::test_{rng.choice(VERBS)}" for _ in range(failed)]
        return json.dumps(
            {
                "pattern": str(arguments.get("pattern", ""))[:60],
                "passed": rng.randint(3, 40),
                "failed": failed,
                "failures": failures,
            }
        )
    return json.dumps({"error": f"no tool {name}"})


def _as_int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _agent(seed: int) -> list[Episode]:
    """One episode per task: the task, then ten turns each feeding back the last call's result. The call is the
    model's own where its answer holds one the server would parse; otherwise the plan's call of that turn is
    made in its place (a fixed-plan harness), so that every episode keeps its ten results whatever the model."""
    episodes = []
    for index, (task, plan) in enumerate(_AGENT_TASKS):

        def build(
            answers: Sequence[Answer], index: int = index, task: str = task, plan: list[_Call] = plan
        ) -> list[dict[str, Any]]:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": AGENT_SYSTEM},
                {"role": "user", "content": task},
            ]
            for turn, answer in enumerate(answers):
                parsed = _parse_call(answer)
                # An answer without a call the server would read is replaced by the plan's call (its text
                # dropped, as a fixed-plan harness does), which also bounds the history's growth per turn.
                content, name, arguments = parsed if parsed is not None else (None, *plan[turn])
                # The harness's own id, not a server's (random) one: a template that renders ids then gets the
                # same prompt in every run, so that answers can be compared with the same turn's alone.
                call_id = f"call_{index:012x}{turn:012x}"
                call = {"name": name, "arguments": json.dumps(arguments)}
                messages.append(
                    {
                        "role": "assistant",
                        "content": content or None,
                        "tool_calls": [{"id": call_id, "type": "function", "function": call}],
                    }
                )
                messages.append(
                    {"role": "tool", "tool_call_id": call_id, "content": tool_result(name, arguments, seed)}
                )
            return messages

        episodes.append(Episode("agent", index, len(plan) + 1, 40, build, tools=AGENT_TOOLS))
    return episodes


CHAT_SYSTEM = "You are a helpful assistant who knows how text-generation servers work. Answer clearly and briefly."


def _chat(seed: int) -> list[Episode]:
    """Three conversations of five turns (the load test's user messages), each turn's history holding the
    model's earlier answers."""
    episodes = []
    for index in range(3):
        texts = user_turns(index, 5, seed)

        def build(answers: Sequence[Answer], texts: list[str] = texts) -> list[dict[str, Any]]:
            messages: list[dict[str, Any]] = [{"role": "system", "content": CHAT_SYSTEM}]
            for text, answer in zip(texts, answers, strict=False):
                messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer_text(answer)}]
            return [*messages, {"role": "user", "content": texts[len(answers)]}]

        episodes.append(Episode("chat", index, len(texts), 128, build))
    return episodes


# Short source files of our own for the code-edit workload (and the lines `read_file` answers with).
_SOURCES: list[tuple[str, str]] = [
    (
        "rate_limiter.py",
        '''"""A token bucket: requests spend tokens, which refill at a steady rate."""

import time


class TokenBucket:
    """Allows `rate` requests per second on average, bursts of up to `capacity`."""

    def __init__(self, rate: float, capacity: int) -> None:
        if rate <= 0 or capacity < 1:
            raise ValueError("rate must be positive and capacity at least 1")
        self.rate = rate
        self.capacity = capacity
        self.tokens = float(capacity)
        self.updated = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def try_acquire(self, cost: float = 1.0) -> bool:
        """Spend `cost` tokens if there are enough; say whether they were spent."""
        self._refill()
        if self.tokens < cost:
            return False
        self.tokens -= cost
        return True

    def wait_time(self, cost: float = 1.0) -> float:
        """Seconds until `cost` tokens will be there."""
        self._refill()
        missing = max(0.0, cost - self.tokens)
        return missing / self.rate
''',
    ),
    (
        "latency_report.py",
        '''"""Latency figures of a load test: percentiles and a one-line summary."""

import statistics


def percentile(values: list[float], q: float) -> float:
    """The q-th quantile (0..1) of `values`, nearest rank."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(latencies: list[float]) -> dict[str, float]:
    """Median, p95, p99 and mean of latencies in seconds, as milliseconds."""
    return {
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p95_ms": percentile(latencies, 0.95) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "mean_ms": statistics.mean(latencies) * 1000,
    }


def format_line(name: str, latencies: list[float]) -> str:
    """One line of a report: the name, the request count and the figures."""
    figures = summarize(latencies)
    cells = ", ".join(f"{key} {value:.1f}" for key, value in figures.items())
    return f"{name}: {len(latencies)} requests, {cells}"
''',
    ),
    (
        "env_settings.py",
        '''"""Settings read from environment variables, each with a default."""

import os
from dataclasses import dataclass


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64
    log_level: str = "info"


def _read_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {value!r}") from None


def load_settings() -> Settings:
    """The settings, each from its SERVER_* variable when set."""
    return Settings(
        host=os.environ.get("SERVER_HOST", "127.0.0.1"),
        port=_read_int("SERVER_PORT", 8000),
        max_queue=_read_int("SERVER_MAX_QUEUE", 64),
        log_level=os.environ.get("SERVER_LOG_LEVEL", "info").lower(),
    )
''',
    ),
]
# Two edits per file, each a few lines: a rename, a new parameter, a changed default.
_EDITS: list[list[str]] = [
    [
        "Rename the attribute `capacity` to `burst` everywhere, the parameter and the error message included.",
        "Add a `clock` parameter to `TokenBucket.__init__` (default `time.monotonic`), keep it as `self.clock`, "
        "and call it instead of `time.monotonic()`.",
    ],
    [
        "Add a `digits` parameter to `format_line` (default 1) and use it for the figures' decimals.",
        "Rename `percentile` to `quantile` and update its callers.",
    ],
    [
        "Change the default port from 8000 to 8080, in the dataclass and in `load_settings`.",
        "Add a `workers: int = 1` setting read from SERVER_WORKERS with `_read_int`.",
    ],
]


def _code_edit(seed: int) -> list[Episode]:
    """Every (file, edit): the file in a fenced block, the edit, and the request's prediction is the file itself
    (the answer is the file with a few lines changed); one turn each, in a seeded order."""
    pairs = [(f, e) for f in range(len(_SOURCES)) for e in range(len(_EDITS[f]))]
    random.Random(seed).shuffle(pairs)
    episodes = []
    for index, (f, e) in enumerate(pairs):
        name, source = _SOURCES[f]
        prompt = (
            f"Here is `{name}`:\n\n```python\n{source}```\n\n{_EDITS[f][e]} Answer with the whole changed file in "
            "one ```python block and nothing else."
        )
        episodes.append(_one_turn("code-edit", index, 448, prompt, prediction=source))
    return episodes


INVOICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string"},
        "invoice_number": {"type": "string"},
        "date": {"type": "string", "description": "YYYY-MM-DD"},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "unit_price": {"type": "number"},
                },
                "required": ["description", "quantity", "unit_price"],
            },
        },
        "total": {"type": "number"},
    },
    "required": ["vendor", "invoice_number", "date", "currency", "items", "total"],
}
EXTRACTION_INSTRUCTION = (
    "Extract the invoice below into JSON that follows this schema. Use numbers for amounts, the date as "
    "YYYY-MM-DD, and answer with the JSON object only.\n\nSchema:\n"
)
_VENDORS = [
    "Nordlicht Papier GmbH",
    "Harbour Lane Coffee Ltd",
    "Atlas Office Supply Co.",
    "Verde Garden Services",
    "Blue Fjord Software AS",
    "Maple Street Printing",
    "Oakridge Cleaning Ltd",
    "Lumen Electrical Supplies",
]
_ITEMS = [
    ("A4 copy paper, box of 5 reams", 18.5),
    ("Toner cartridge, black", 64.0),
    ("Espresso beans, 1 kg", 21.9),
    ("Monthly plant care visit", 85.0),
    ("Software licence, one seat, one year", 240.0),
    ("Business cards, 500", 39.0),
    ("Office cleaning, per hour", 28.0),
    ("LED panel light 60x60", 47.5),
    ("Extension cord, 5 m", 12.75),
    ("Printed brochures, 250", 132.0),
]
_CURRENCIES = [("EUR", "€"), ("USD", "$"), ("GBP", "£")]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]


def invoice(index: int, seed: int = 0) -> str:
    """Invoice `index`: a short letter-like document (vendor, number, date, two to four items, total), seeded."""
    rng = random.Random(seed * 1_000_003 + 700_000 + index)
    vendor = rng.choice(_VENDORS)
    code, sign = rng.choice(_CURRENCIES)
    number = f"{vendor.split()[0][:3].upper()}-{rng.randint(2024, 2026)}-{rng.randint(100, 9999):04d}"
    day, month = rng.randint(1, 28), rng.randrange(len(_MONTHS))
    lines, total = [], 0.0
    for description, price in rng.sample(_ITEMS, rng.randint(2, 4)):
        quantity = rng.randint(1, 12)
        total += quantity * price
        lines.append(f"- {description}: {quantity} x {sign}{price:.2f} = {sign}{quantity * price:.2f}")
    items = "\n".join(lines)
    return (
        f"{vendor}\nInvoice {number}, issued on {_MONTHS[month]} {day}, 2025\n"
        f"Bill to: customer account {rng.randint(10000, 99999)}\n\n{items}\n\n"
        f"Total due: {sign}{total:.2f} ({code}), payable within {rng.choice([14, 30, 45])} days.\n"
        "Thank you for your business."
    )


def _extraction(seed: int) -> list[Episode]:
    """Ten invoices, each its own one-turn conversation under the same instruction and schema (what a batch
    extraction job sends)."""
    head = EXTRACTION_INSTRUCTION + json.dumps(INVOICE_SCHEMA) + "\n\nInvoice:\n"
    return [_one_turn("extraction", i, 192, head + invoice(i, seed)) for i in range(10)]


# The RAG documents are five of these paragraphs (a design review of a fictional service), each with a question
# its text answers.
_PARAGRAPHS: list[tuple[str, str]] = [
    (
        "The review covers the request router that the platform team rewrote in the spring. The old router kept a "
        "single queue for every model and sent each request to the first replica that answered a health check, "
        "which meant that a slow replica received as much work as a fast one. The new router keeps one queue per "
        "model and sends each request to the replica with the fewest tokens still to generate, a figure every "
        "replica reports twice a second.",
        "How does the new router choose the replica for a request?",
    ),
    (
        "Capacity was planned for the busiest hour of the week, Monday between nine and ten, when the service "
        "received about 4,200 requests with a median prompt of 850 tokens and a median answer of 210 tokens. The "
        "team sized the fleet at twelve replicas, so that the busiest hour runs at about sixty percent of what the "
        "replicas can decode, and kept two more replicas warm for failures and deployments.",
        "How many replicas was the fleet sized at, and why?",
    ),
    (
        "Three incidents shaped the design. In March a replica with a failing disk kept passing its health check "
        "while answering every request in forty seconds. In April a configuration push set the queue limit to "
        "zero and every request was refused for eleven minutes. In May a client retried refused requests without "
        "waiting, and the retries alone filled the queues of two regions.",
        "What happened in April?",
    ),
    (
        "Refusals are now explicit. When a model's queue holds more than its limit, the router answers 429 with a "
        "Retry-After header computed from the queue's current drain rate, never less than one second. Clients in "
        "the official libraries wait that long and then retry at most three times, with jitter, so that a burst of "
        "refusals does not return as a burst of retries.",
        "What does a client of the official libraries do after a 429?",
    ),
    (
        "Streaming changed the most for users. Answers are sent as server-sent events, one event per decoding "
        "step, and the router forwards each event as it arrives instead of buffering a whole answer. The median "
        "time to first token fell from 1.9 seconds to 0.6 seconds in the busiest hour, while the total time of an "
        "answer stayed about the same.",
        "How did the median time to first token change?",
    ),
    (
        "Prefix caching was enabled in June. Requests that share a long system prompt reuse the keys and values "
        "computed for the first of them, per tenant, so that one customer's prompts never change how fast another "
        "customer's answers arrive. In the week after the change the cache served 71 percent of prompt tokens and "
        "the prefill time per request fell by more than half.",
        "Why is the prefix cache kept per tenant?",
    ),
    (
        "Observability follows the names other serving stacks use, so that existing dashboards work unchanged. "
        "Every replica exports the number of running and waiting requests, histograms of time to first token and "
        "of the time between tokens, the prefix cache's hit rate, and counters of refused requests by reason. "
        "Alerts fire when the p95 time to first token stays above two seconds for ten minutes.",
        "When do the alerts fire?",
    ),
    (
        "Two questions stay open. The first is whether speculative decoding should be on by default for every "
        "model, since it helps most when answers repeat their prompts and least on short creative answers. The "
        "second is how to share replicas between a model and its fine-tuned variants without loading the weights "
        "twice. The team will decide both after a month of measurements on production traffic.",
        "Which two questions are still open?",
    ),
]
_RAG_TASKS = [
    "Summarise the document in five bullet points, one sentence each.",
    "Answer from the document only: {question}",
    "Write a one-paragraph abstract of the document for an engineer who has not read it.",
    "Answer from the document only, quoting the sentence you rely on: {question}",
]


def _rag(seed: int) -> list[Episode]:
    """Four documents of five paragraphs each (seeded choice, in the review's order) and a task on each:
    a summary, or a question one of its paragraphs answers."""
    rng = random.Random(seed * 1_000_003 + 900_000)
    episodes = []
    for index, task in enumerate(_RAG_TASKS):
        chosen = sorted(rng.sample(range(len(_PARAGRAPHS)), 5))
        document = "\n\n".join(_PARAGRAPHS[i][0] for i in chosen)
        question = _PARAGRAPHS[rng.choice(chosen)][1]
        prompt = f"Document:\n\n{document}\n\n{task.format(question=question)}"
        episodes.append(_one_turn("rag", index, 160, prompt))
    return episodes


# The bench's workloads by name, each `(seed) -> episodes`.
WORKLOADS: dict[str, Callable[[int], list[Episode]]] = {
    "agent": _agent,
    "chat": _chat,
    "code-edit": _code_edit,
    "extraction": _extraction,
    "rag": _rag,
}


def episodes(name: str, seed: int = 0, limit: int | None = None) -> list[Episode]:
    """Workload `name`'s episodes for `seed` (the first `limit` of them); the same for the same arguments."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](seed)[:limit]
