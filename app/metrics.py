"""Prometheus metrics of the service, prefix ``specserve_``.

The speculative counters are defined as vLLM defines its ``spec_decode`` counters, so that its dashboards
carry over: a *draft* is one target pass that verified at least one drafted token; acceptance rate is
accepted / draft tokens; mean acceptance length is 1 + accepted / drafts. Each app has its own registry so
that several apps (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TOKENS_PER_PASS_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 17)
_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

OUTCOMES = ("success", "invalid", "overloaded", "cancelled", "timeout", "error")
FINISH_REASONS = ("eos", "stop", "length", "none")


class Metrics:
    """The metrics of one app, with one method per thing that happens; safe to call from any thread."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "specserve_"
        self.num_drafts = Counter(
            p + "spec_decode_num_drafts", "Target passes that verified at least one drafted token.", registry=r
        )
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Tokens drafted.", registry=r)
        self.num_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.", registry=r
        )
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each draft position (0 is the first drafted token).",
            ["position"],
            registry=r,
        )
        self.target_passes = Counter(
            p + "target_passes",
            "Target passes per request, prefill included (a batched forward counts once per request in it).",
            registry=r,
        )
        self.tokens_per_pass = Histogram(
            p + "spec_decode_tokens_per_target_pass",
            "Tokens one target pass produced (accepted drafts plus the target's own token).",
            buckets=_TOKENS_PER_PASS_BUCKETS,
            registry=r,
        )
        self.draft_length = Histogram(
            p + "spec_decode_draft_length",
            "Tokens the draft proposed per decoding step (after the adaptive length and the confidence cut-off).",
            buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16),
            registry=r,
        )
        self.acceptance_rate = Histogram(
            p + "request_acceptance_rate",
            "Per finished request that drafted anything: accepted / drafted tokens.",
            buckets=_RATE_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            p + "requests",
            "Requests that ended, by outcome and finish reason.",
            ["outcome", "finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "From arrival to the first generated token (queue wait and prefill included).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Per generated token after the first: the wait since the previous step, shared by the tokens "
            "that step produced.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "From arrival to the end of a request that was admitted.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "From arrival until the worker started the generation.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(p + "num_requests_running", "Generations the worker is interleaving.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Admitted requests waiting for the worker.", registry=r)
        self.draft_time = Histogram(
            p + "draft_forward_seconds", "Time the draft took to propose, per step.", buckets=_STEP_BUCKETS, registry=r
        )
        self.target_time = Histogram(
            p + "target_forward_seconds",
            "Time of one target pass (prefill or verification), per step.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            p + "batch_size",
            "Requests whose rows one target forward ran together (1: a prefill or a request running alone).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.engine_info = Info(
            p + "engine", "How the target runs: CPU kernel (or device), dtype, batched decoding.", registry=r
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of generations started.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        # Every series exists from the start, so that rate() has a zero to begin from.
        for outcome in OUTCOMES:
            for reason in FINISH_REASONS[:-1] if outcome == "success" else ("none",):
                self.requests.labels(outcome, reason)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)

    def request_ended(self, outcome: str, finish_reason: str | None = None) -> None:
        """Count a request that ended (rejected ones included) by `outcome` (see OUTCOMES)."""
        self.requests.labels(outcome, finish_reason or "none").inc()

    def request_started(self, queue_seconds: float, prompt_tokens: int) -> None:
        """The worker took the request off the queue."""
        self.queue_time.observe(queue_seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def step(
        self, tokens: int, drafted: int, accepted: int, draft_seconds: float, target_seconds: float, prefill: bool
    ) -> None:
        """One target pass of one generation."""
        self.target_passes.inc()
        self.generation_tokens.inc(tokens)
        self.tokens_per_pass.observe(tokens)
        self.target_time.observe(target_seconds)
        if not prefill:
            self.draft_time.observe(draft_seconds)
            self.draft_length.observe(drafted)
        if drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(str(position)).inc()

    def forward(self, batch_size: int) -> None:
        """One target forward over `batch_size` requests' rows."""
        self.batch_size.observe(batch_size)

    def tokens_delivered(self, gap_seconds: float, tokens: int, first: bool) -> None:
        """A step's tokens reached the request; `gap_seconds` since arrival (first) or the previous step."""
        if first:
            self.ttft.observe(gap_seconds)
            tokens -= 1
        for _ in range(tokens):
            self.itl.observe(gap_seconds / tokens)

    def generation_ended(self, e2e_seconds: float, drafted: int, accepted: int) -> None:
        """An admitted request ended, however it ended."""
        self.e2e.observe(e2e_seconds)
        if drafted:
            self.acceptance_rate.observe(accepted / drafted)

    def load(self, running: int, waiting: int) -> None:
        """How many requests the worker is running and how many wait."""
        self.running.set(running)
        self.waiting.set(waiting)
