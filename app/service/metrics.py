"""Prometheus metrics of the service, prefix ``specserve_``.

Names, types and labels follow vLLM's (``vllm:x`` is ``specserve_x``), so that its dashboards carry over
with the prefix swapped; every series carries the label ``model_name`` (the served model name), as vLLM's
do. The speculative counters are defined as vLLM defines its ``spec_decode`` counters: a *draft* is one
target pass that verified at least one drafted token; acceptance rate is accepted / draft tokens; mean
acceptance length is 1 + accepted / drafts. The draft length adapts, so position i is drafted only in steps
that drafted more than i tokens: the per-position drafted counter is the denominator of the acceptance rate
at a position. Each app has its own registry so that several apps (tests) can live in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:  # the metrics load without torch
    from collections.abc import Iterator

    from prometheus_client.core import Metric

    from app.distill.online import DraftLearner
    from app.engine.drafting.suffix_index import TrafficIndex
    from app.engine.step import StepOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TOKENS_PER_PASS_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 17)
_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Token counts per request: 1, 2, 5 times each power of ten, past any context length this server loads.
_LENGTH_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))

OUTCOMES = ("success", "invalid", "overloaded", "cancelled", "client_stalled", "timeout", "error")
FINISH_REASONS = ("eos", "stop", "length", "none")
# Why a request was refused before it started (``specserve_requests_refused_total``): the queue was full (429), or
# it waited in the queue past queue_timeout (503); both with Retry-After.
REFUSALS = ("queue_full", "queue_timeout")
# vLLM's finish reasons, for ``request_success``: an end of sequence is a stop there too; an admitted request
# that ended without finishing (cancelled, its client stalled, timed out, failed) is an abort.
FINISHED_REASONS = ("stop", "length", "abort")
_FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length"}
_ABORTED = ("cancelled", "client_stalled", "timeout", "error")
# Why the server closed a connection itself (``specserve_connections_closed_total``): its client sent no whole
# request head within header_read_timeout, or read nothing of an answer for send_timeout.
CLOSES = ("header_timeout", "send_timeout")


@dataclass(frozen=True)
class RequestRecord:
    """What one admitted request did, for the request-level histograms; times are ``time.monotonic()``."""

    arrived: float
    ended: float
    started: float | None  # the worker started its generation (None: it never did)
    first_token: float | None  # its first token reached it (None: none did)
    prompt_tokens: int
    generated_tokens: int
    max_tokens: int  # the max_new_tokens it asked for
    drafted: int
    accepted: int


class Metrics:
    """The metrics of one app, with one method per thing that happens; safe to call from any thread.

    `model_name` is the value of the ``model_name`` label of every series."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "specserve_"
        m = model_name
        labels = ["model_name"]
        self.num_drafts = Counter(
            p + "spec_decode_num_drafts", "Target passes that verified at least one drafted token.", labels, registry=r
        ).labels(m)
        self.num_draft_tokens = Counter(
            p + "spec_decode_num_draft_tokens", "Tokens drafted.", labels, registry=r
        ).labels(m)
        self.num_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.", labels, registry=r
        ).labels(m)
        self.num_forced_tokens = Counter(
            p + "spec_decode_num_forced_tokens",
            "Tokens a grammar allowed alone, proposed without the draft and kept (not counted as drafted).",
            labels,
            registry=r,
        ).labels(m)
        self._accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each draft position (0 is the first drafted token).",
            [*labels, "position"],
            registry=r,
        )
        self._drafted_per_pos = Counter(
            p + "spec_decode_num_draft_tokens_per_pos",
            "Tokens drafted at each draft position: steps that drafted more than `position` tokens.",
            [*labels, "position"],
            registry=r,
        )
        self.target_passes = Counter(
            p + "target_passes",
            "Target passes per request, prefill included (a batched forward counts once per request in it).",
            labels,
            registry=r,
        ).labels(m)
        self.tokens_per_pass = Histogram(
            p + "spec_decode_tokens_per_target_pass",
            "Tokens one target pass produced (accepted drafts plus the target's own token).",
            labels,
            buckets=_TOKENS_PER_PASS_BUCKETS,
            registry=r,
        ).labels(m)
        self.draft_length = Histogram(
            p + "spec_decode_draft_length",
            "Tokens the draft proposed per decoding step (after the adaptive length and the confidence cut-off).",
            labels,
            buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16),
            registry=r,
        ).labels(m)
        self.acceptance_rate = Histogram(
            p + "request_acceptance_rate",
            "Per finished request that drafted anything: accepted / drafted tokens.",
            labels,
            buckets=_RATE_BUCKETS,
            registry=r,
        ).labels(m)
        self._requests = Counter(
            p + "requests",
            "Requests that ended, by outcome and finish reason.",
            [*labels, "outcome", "finish_reason"],
            registry=r,
        )
        self._success = Counter(
            p + "request_success",
            "Admitted requests that ended, by vLLM's finish reason: stop (end of sequence or a stop string), "
            "length, abort (cancelled, timed out or failed).",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "From arrival to the first generated token (queue wait and prefill included).",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(m)
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Per generated token after the first: the wait since the previous step, shared by the tokens "
            "that step produced.",
            labels,
            buckets=_STEP_BUCKETS,
            registry=r,
        ).labels(m)
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "The same observations as inter_token_latency_seconds, under the name vLLM's dashboards read.",
            labels,
            buckets=_STEP_BUCKETS,
            registry=r,
        ).labels(m)
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "From arrival to the end of a request that was admitted.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(m)
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "From arrival until the worker started the generation.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(m)
        self.prefill_time = Histogram(
            p + "request_prefill_time_seconds",
            "From the start of the generation to its first token (the prompt's prefill).",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(m)
        self.decode_time = Histogram(
            p + "request_decode_time_seconds",
            "From the first token to the end of the request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(m)
        self.inference_time = Histogram(
            p + "request_inference_time_seconds",
            "From the start of the generation to the end of the request (prefill plus decode).",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(m)
        self.request_prompt_tokens = Histogram(
            p + "request_prompt_tokens",
            "Prompt tokens per started generation.",
            labels,
            buckets=_LENGTH_BUCKETS,
            registry=r,
        ).labels(m)
        self.request_generation_tokens = Histogram(
            p + "request_generation_tokens",
            "Tokens generated per started generation.",
            labels,
            buckets=_LENGTH_BUCKETS,
            registry=r,
        ).labels(m)
        self.max_num_generation_tokens = Histogram(
            p + "request_max_num_generation_tokens",
            "Per started generation, the most tokens one of its sequences generated (one sequence per request: "
            "the same as request_generation_tokens).",
            labels,
            buckets=_LENGTH_BUCKETS,
            registry=r,
        ).labels(m)
        self.params_max_tokens = Histogram(
            p + "request_params_max_tokens",
            "The max_new_tokens (max_tokens) each started generation asked for.",
            labels,
            buckets=_LENGTH_BUCKETS,
            registry=r,
        ).labels(m)
        self.running = Gauge(
            p + "num_requests_running", "Generations the worker is interleaving.", labels, registry=r
        ).labels(m)
        self.waiting = Gauge(
            p + "num_requests_waiting", "Admitted requests waiting for the worker.", labels, registry=r
        ).labels(m)
        cache_doc = (
            "Bytes of KV cache the admitted generations hold (each allocates its whole cache, its draft's included, "
            "when it starts), over the budget (kv_cache_memory): 1 means no more memory to admit a request with."
        )
        self.kv_cache_usage = Gauge(p + "kv_cache_usage_perc", cache_doc, labels, registry=r).labels(m)
        self.gpu_cache_usage = Gauge(
            p + "gpu_cache_usage_perc", "The same as kv_cache_usage_perc (vLLM's older name).", labels, registry=r
        ).labels(m)
        self.draft_time = Histogram(
            p + "draft_forward_seconds",
            "Time the draft took to propose, per step.",
            labels,
            buckets=_STEP_BUCKETS,
            registry=r,
        ).labels(m)
        self.target_time = Histogram(
            p + "target_forward_seconds",
            "Time of one target pass (prefill or verification), per step.",
            labels,
            buckets=_STEP_BUCKETS,
            registry=r,
        ).labels(m)
        self.batch_size = Histogram(
            p + "batch_size",
            "Requests whose rows one target forward ran together (1: a prefill or a request running alone).",
            labels,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        ).labels(m)
        self._engine_info = Info(
            p + "engine", "How the target runs: CPU kernel (or device), dtype, batched decoding.", labels, registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of generations started.", labels, registry=r
        ).labels(m)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", labels, registry=r).labels(m)
        # vLLM's names and units: tokens, so that hits / queries is the share of prompt tokens not prefilled.
        self.prefix_cache_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        ).labels(m)
        self.prefix_cache_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens the prefix cache served (not prefilled).", labels, registry=r
        ).labels(m)
        self._refused = Counter(
            p + "requests_refused",
            "Requests refused before they started, by reason: queue_full (429: memory and the queue were full) or "
            "queue_timeout (503: not started within queue_timeout); also counted as outcome overloaded.",
            [*labels, "reason"],
            registry=r,
        )
        self._by_key = Counter(
            p + "api_key_requests",
            "Requests that came with each API key, by the key's name (never the key).",
            [*labels, "key"],
            registry=r,
        )
        self._closed = Counter(
            p + "connections_closed",
            "Connections the server closed on a slow client, by reason: header_timeout (no whole request head "
            "within header_read_timeout) or send_timeout (nothing of an answer read for send_timeout).",
            [*labels, "reason"],
            registry=r,
        )
        r.register(_MemoryCollector(m))
        # Every series exists from the start, so that rate() has a zero to begin from.
        for reason in REFUSALS:
            self._refused.labels(m, reason)
        for reason in CLOSES:
            self._closed.labels(m, reason)
        for outcome in OUTCOMES:
            for reason in FINISH_REASONS[:-1] if outcome == "success" else ("none",):
                self._requests.labels(m, outcome, reason)
        for finished in FINISHED_REASONS:
            self._success.labels(m, finished)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)

    def engine_started(self, kernel: str, dtype: str, batched_decoding: bool, num_draft_tokens: int) -> None:
        """Describe the loaded engine, and start the per-position series of its draft positions
        0..`num_draft_tokens`-1 at zero (a request asking for a longer draft adds its positions as it drafts)."""
        batched = "true" if batched_decoding else "false"
        self._engine_info.labels(self.model_name).info({"kernel": kernel, "dtype": dtype, "batched_decoding": batched})
        for position in range(num_draft_tokens):
            self._accepted_per_pos.labels(self.model_name, str(position))
            self._drafted_per_pos.labels(self.model_name, str(position))

    def watch_index(self, index: TrafficIndex) -> None:
        """Export the index of earlier answers as it is at each scrape (its counts are plain ints the worker
        keeps; reading them needs no lock)."""
        self.registry.register(_IndexCollector(index, self.model_name))

    def watch_learner(self, learner: DraftLearner) -> None:
        """Export the draft learner's figures as they are at each scrape."""
        self.registry.register(_LearnerCollector(learner, self.model_name))

    def request_ended(self, outcome: str, finish_reason: str | None = None) -> None:
        """Count a request that ended (rejected ones included) by `outcome` (see OUTCOMES)."""
        self._requests.labels(self.model_name, outcome, finish_reason or "none").inc()

    def key_used(self, name: str) -> None:
        """A request came with the API key named `name`."""
        self._by_key.labels(self.model_name, name).inc()

    def keys_configured(self, names: list[str]) -> None:
        """Start each API key's series at zero, so that rate() has a zero to begin from."""
        for name in names:
            self._by_key.labels(self.model_name, name)

    def request_refused(self, reason: str) -> None:
        """A request refused before it started (`reason`: one of REFUSALS), counted as outcome overloaded too."""
        self._refused.labels(self.model_name, reason).inc()

    def connection_closed(self, reason: str) -> None:
        """The server closed a slow client's connection (`reason`: one of CLOSES)."""
        self._closed.labels(self.model_name, reason).inc()

    def request_started(self, queue_seconds: float, prompt_tokens: int) -> None:
        """The worker took the request off the queue."""
        self.queue_time.observe(queue_seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A generation's prompt is in: `cached_tokens` of its `prompt_tokens` came from the prefix cache."""
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)

    def step(self, out: StepOutput, tokens: int, prefill: bool) -> None:
        """One target pass of one generation (`out`, the engine's record of it): it delivered `tokens`, verifying
        `out.drafted` tokens drafted at positions 0..drafted-1, of which the first `out.accepted` were accepted,
        and kept `out.forced` tokens a grammar forced."""
        drafted, accepted = out.drafted, out.accepted
        self.target_passes.inc()
        self.num_forced_tokens.inc(out.forced)
        self.generation_tokens.inc(tokens)
        self.tokens_per_pass.observe(tokens)
        self.target_time.observe(out.verify_seconds)
        if not prefill:
            self.draft_time.observe(out.draft_seconds)
            self.draft_length.observe(drafted)
        if drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for position in range(drafted):
                self._drafted_per_pos.labels(self.model_name, str(position)).inc()
            for position in range(accepted):
                self._accepted_per_pos.labels(self.model_name, str(position)).inc()

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
            self.tpot.observe(gap_seconds / tokens)

    def generation_ended(self, request: RequestRecord, outcome: str, finish_reason: str | None = None) -> None:
        """An admitted request ended, however it ended (`outcome` and `finish_reason` as in `request_ended`)."""
        self.e2e.observe(request.ended - request.arrived)
        if request.drafted:
            self.acceptance_rate.observe(request.accepted / request.drafted)
        finished = _FINISHED_REASON.get(finish_reason or "") if outcome == "success" else None
        if finished is None and outcome in _ABORTED:
            finished = "abort"
        if finished is not None:
            self._success.labels(self.model_name, finished).inc()
        if request.started is None:
            return
        self.request_prompt_tokens.observe(request.prompt_tokens)
        self.request_generation_tokens.observe(request.generated_tokens)
        self.max_num_generation_tokens.observe(request.generated_tokens)
        self.params_max_tokens.observe(request.max_tokens)
        self.inference_time.observe(request.ended - request.started)
        if request.first_token is not None:
            self.prefill_time.observe(request.first_token - request.started)
            self.decode_time.observe(request.ended - request.first_token)

    def load(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        """How many requests the worker is running and how many wait; the share of the KV-cache budget held."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_cache_usage.set(kv_cache_usage)
        self.gpu_cache_usage.set(kv_cache_usage)


def resident_bytes() -> int | None:
    """This process's resident memory (Linux /proc/self/statm); None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _MemoryCollector:
    """The process's resident memory at each scrape (Prometheus' process collector's figure, with the prefix and
    the model_name label every series here carries)."""

    def __init__(self, model_name: str) -> None:
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        rss = resident_bytes()
        if rss is not None:
            metric = GaugeMetricFamily(
                "specserve_process_resident_memory_bytes",
                "Resident memory of the process (bytes).",
                labels=["model_name"],
            )
            metric.add_metric([self._model], rss)
            yield metric


class _IndexCollector:
    """The index of earlier answers (app.engine.drafting.suffix_index.TrafficIndex), read at scrape time."""

    def __init__(self, index: TrafficIndex, model_name: str) -> None:
        self._index = index
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        index, labels = self._index, ["model_name"]
        figures: list[tuple[str, str, float, type]] = [
            (
                "suffix_index_bytes",
                "Memory the index of earlier answers holds (bytes).",
                index.bytes,
                GaugeMetricFamily,
            ),
            ("suffix_index_limit_bytes", "Memory the index may hold (bytes).", index.max_bytes, GaugeMetricFamily),
            ("suffix_index_answers", "Answers the index holds, all tenants.", index.sequences, GaugeMetricFamily),
            ("suffix_index_tokens", "Tokens the index holds, all tenants.", index.tokens, GaugeMetricFamily),
            (
                "suffix_index_lookups",
                "Lookups in the index (one per drafting step that read it).",
                index.lookups,
                CounterMetricFamily,
            ),
            ("suffix_index_hits", "Lookups in the index that found a continuation.", index.hits, CounterMetricFamily),
        ]
        for name, doc, value, family in figures:
            metric = family("specserve_" + name, doc, labels=labels)
            metric.add_metric([self._model], value)
            yield metric


class _LearnerCollector:
    """The draft learner (app.distill.online.DraftLearner), read at scrape time. Tenants are labelled by API key
    name, `shared` or `salted` (a salt is a secret: never a label)."""

    def __init__(self, learner: DraftLearner, model_name: str) -> None:
        self._learner = learner
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        learner, model = self._learner, self._model
        stats = learner.snapshot()
        traces = GaugeMetricFamily(
            "specserve_draft_learning_trace_bytes",
            "Memory the answers the draft learns from hold.",
            labels=["model_name"],
        )
        traces.add_metric([model], stats.trace_bytes)
        yield traces
        seconds = CounterMetricFamily(
            "specserve_draft_learning_seconds", "Seconds the draft learner computed.", labels=["model_name"]
        )
        seconds.add_metric([model], stats.seconds)
        yield seconds
        updates = CounterMetricFamily(
            "specserve_draft_learning_updates",
            "Rounds of draft learning by outcome: kept (the new adapter agreed more often with the target on the "
            "tenant's newest answers) or dropped.",
            labels=["model_name", "tenant", "outcome"],
        )
        for outcome, counts in (("kept", stats.kept), ("dropped", stats.dropped)):
            for tenant, n in counts.items():
                updates.add_metric([model, tenant, outcome], n)
        yield updates
        agreement = GaugeMetricFamily(
            "specserve_draft_learning_agreement",
            "Top-1 agreement of the draft's first token with the target on a tenant's held-back answers, at the last "
            "round: before (the adapter it had) and after (the one trained).",
            labels=["model_name", "tenant", "when"],
        )
        for when, figures in (("before", stats.before), ("after", stats.after)):
            for tenant, value in figures.items():
                agreement.add_metric([model, tenant, when], value)
        yield agreement
