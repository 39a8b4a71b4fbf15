"""What flows through the engine's loop: a request's parameters and their check, its statistics, a step's plan
(between drafting and verification) and a step's output.

These are plain values: the generation (`app.engine.generation`), the batch (`app.engine.batch`), the engine
(`app.engine.engine`) and the API read them; none of them imports anything above the drafting and decoding
packages.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

from app.engine.decoding.grammar import GrammarSpec
from app.engine.decoding.logprobs import TokenLogprob
from app.engine.decoding.penalties import NO_PENALTIES, PenaltyParams
from app.engine.decoding.sampling import SamplingParams
from app.engine.defaults import DEFAULT_NUM_DRAFT_TOKENS, MAX_DRAFT_TOKENS, MAX_LOGPROBS, SAMPLERS
from app.engine.drafting.draft_length import SCHEDULES
from app.engine.drafting.tree import DraftTree


class GenerationError(ValueError):
    """A request the engine cannot run as given; the message says what to change."""


class NumericalError(RuntimeError):
    """The target produced NaN or infinite logits: this request cannot go on (others are unaffected)."""


@dataclass(frozen=True)
class GenerationParams:
    """What one request asks of the engine."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    # The most tokens drafted per step (app.engine.defaults, as everywhere).
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    ignore_eos: bool = False
    # Until min_tokens were generated, end-of-sequence and stop tokens and stop strings end nothing (vLLM's).
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the generation like an end-of-sequence token
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the text
    skip_special_tokens: bool = True  # special tokens add no text
    temperature: float = 0.0  # 0: greedy, the exact-match verification of the reference contract
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed, reported in Generation.seed
    # How sampled tokens are drawn: "gumbel" (coupled: the same seed gives target-only sampling's tokens whatever
    # the draft) or "rejection" (Leviathan et al.'s rejection sampler: accepts a model draft more often, but what
    # a seed gives depends on the draft and its lengths). Greedy decoding ignores it.
    sampler: str = "gumbel"
    # None: the engine's default. With "adaptive" or "heuristic", num_draft_tokens is the most ever drafted.
    draft_schedule: str | None = None
    # The draft stops proposing when its top probability falls below this (0: never); None: engine default.
    draft_p_min: float | None = None
    # The most rows of a tree verification (app.engine.drafting.tree: the draft's next choices and prompt lookup's
    # continuation beside its chain, in one target forward); 0: a chain; None: the engine's default. Trees run
    # where the kernel's attention takes them, greedy or with the gumbel sampler, without penalties or grammar.
    tree_rows: int | None = None
    # Log-probabilities under the target's raw distribution (app.engine.decoding.logprobs), computed only when asked:
    # `logprobs` of each generated token with that many alternatives (None: not asked), `prompt_logprobs` of
    # each prompt token after the first. max_new_tokens 0 runs the prompt alone, for its log-probabilities.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Repetition, presence and frequency penalties (app.engine.decoding.penalties), on the target's and the draft's
    # logits.
    penalties: PenaltyParams = NO_PENALTIES
    # The output's grammar (app.engine.decoding.grammar): every chosen token is one it allows, drafts it refuses end
    # acceptance, and its end ends the generation. Engine.start compiles it, or copies what Grammars.check compiled.
    grammar: GrammarSpec | None = None
    # With a grammar: a token it forces (the only one its mask allows, so the target's masked choice whatever
    # its logits) is proposed as it is, within a draft and after it, target-only too, without counting against
    # the draft length; the target still runs its row. False: only the draft proposes (to measure the gain).
    forced_tokens: bool = True
    # The tenant: the prefix cache and the index of earlier answers are read and written within it only, so one
    # tenant's text never changes how fast another's comes. None: the shared default. Opaque to the engine: the
    # caller composes it (the service from the request's API key and cache_salt).
    cache_salt: str | None = None
    # A tenant of its own: reads nothing earlier requests left in the prefix cache or the index, and leaves nothing
    # there for later ones (strict isolation, where no tenant was named).
    isolated: bool = False
    # The tokens the answer will mostly be (OpenAI's predicted outputs: a code edit's file), a lookup source.
    prediction: tuple[int, ...] = ()
    # The most tokens a lookup in text already written (app.engine.drafting.suffix) drafts per step on the
    # adaptive schedule (None: the engine's default); num_draft_tokens bounds the model draft's.
    lookup_draft_tokens: int | None = None


@dataclass
class GenerationStats:
    """Counters of one request, the one record the API, the metrics and the CLI read; rates are derived, never
    stored. A field the API shows is named as its `SpeculativeDetails` field, which copies it by name."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    forced: int = 0  # tokens kept that the grammar forced (never counted as drafted or accepted)
    refused: int = 0  # drafted tokens the grammar refused before verification (in drafted, never accepted)
    target_passes: int = 0  # every target forward, the prefill included
    verify_passes: int = 0  # target forwards that checked at least one drafted token
    accepted_per_position: list[int] = field(default_factory=list)
    # The request's draft settings (not counters: a sum of several requests keeps the first's).
    schedule: str = field(default="fixed", metadata={"setting": True})
    p_min: float = field(default=0.0, metadata={"setting": True})
    draft_lengths: list[int] = field(default_factory=list)  # [k]: steps that asked the draft for k tokens
    p_min_stops: int = 0  # steps whose draft stopped early for lack of confidence (p_min, or the value cut-off)
    # Steps whose verified draft came from each source: "model", or a lookup's ("prompt", "prediction", "index").
    draft_sources: dict[str, int] = field(default_factory=dict)
    # Tokens of the request's prediction that were drafted and kept, or drafted and rejected (OpenAI's usage).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def __add__(self, other: GenerationStats) -> GenerationStats:
        """Two requests' counts together (the choices of one answer): counters summed, per-position lists added
        element by element, the settings the first's."""
        merged = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.metadata.get("setting"):
                merged[f.name] = a
            elif isinstance(a, list):
                merged[f.name] = [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]
            elif isinstance(a, dict):
                merged[f.name] = {key: a.get(key, 0) + b.get(key, 0) for key in {**a, **b}}
            else:
                merged[f.name] = a + b
        return GenerationStats(**merged)

    def to_dict(self) -> dict[str, float | int | str | list[int] | dict[str, int]]:
        """The fields and rates, rounded, for JSON (the CLI's and the benchmarks' records)."""
        out: dict[str, float | int | str | list[int] | dict[str, int]] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                out[f.name] = round(value, 4)
            elif isinstance(value, list | dict):
                out[f.name] = value.copy()
            else:
                out[f.name] = value
        out["acceptance_rate"] = round(self.acceptance_rate, 4)
        out["tokens_per_target_pass"] = round(self.tokens_per_target_pass, 4)
        out["tokens_per_second"] = round(self.tokens_per_second, 3)
        return out


@dataclass
class StepOutput:
    """What one draft-and-verify step added."""

    token_ids: list[int]
    text: str
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    finish_reason: str | None = None  # "eos", "stop" or "length" on the last step
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked
    # When asked, on the step that ends the prefill: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    forced: int = 0  # tokens kept that the grammar forced (not in drafted or accepted)
    # Per token of token_ids, what proposed it (SOURCES): the draft's accepted tokens, then the target's own.
    sources: list[str] = field(default_factory=list)
    # Per token of token_ids, its part of `text` (they add up to it): for one event per token.
    pieces: list[str] = field(default_factory=list)


# What proposed a kept token: the target alone (no draft this step), the model draft or prompt lookup (accepted
# by the target), the grammar (the only token it allowed), or the target's token after the accepted drafts:
# a correction of the first rejected one, or a bonus when every drafted token was accepted.
SOURCES = ("target", "draft", "lookup", "forced", "correction", "bonus")


@dataclass
class StepPlan:
    """One step's drafts and the rows the target will run, between drafting and verification."""

    k: int  # the draft length asked for
    drafts: list[int]
    q: torch.Tensor | None  # the draft's distributions when sampling
    start: int  # position of the first row (the last accepted token)
    real: int  # 1 + len(drafts); rows after these are padding
    feed: torch.Tensor  # long [rows]
    draft_seconds: float
    refused: int = 0  # drafts cut, before verification, from the first one the request's grammar refuses
    # Per draft: whether the grammar forced it (the only token it allowed there), proposed at no draft's cost.
    forced: list[bool] = field(default_factory=list)
    kind: str = "model"  # what drafted: "model" or "lookup" (app.engine.drafting.draft_length.KINDS)
    # Every lookup's whole proposal by kind (the adaptive choice's), whether drafted or not: the target's tokens
    # say how far each would have been accepted, free evidence of each kind's acceptance.
    lookups: dict[str, list[int]] = field(default_factory=dict)


# Spare cache slots of every request: a verification of the longest draft allowed (k + 1 rows), so that every
# request's capacity is the same whatever its k.
SLACK = MAX_DRAFT_TOKENS + 1


def cache_capacity(prompt_len: int, max_new_tokens: int, k: int, verify_width: int, context_length: int) -> int:
    """The positions a request's KV caches are allocated for when it starts (the generation allocates them, the
    scheduler admits by them): its prompt, its new tokens and spare slots, within the model's context. `k`: the
    tokens it drafts per step at most (0: target-only); `verify_width`: the rows a verification is padded to."""
    # Spare slots past the last token: a verification writes k+1 entries (at least the padded width) before
    # rolling back. With a fixed span attention reduces over the whole capacity, and a different span changes
    # the last bits, so the capacity must not depend on the draft: the same slack for every request.
    slack = max(k + 1, verify_width, SLACK)
    return min(context_length, prompt_len + max_new_tokens + slack)


@dataclass
class TreePlan(StepPlan):
    """A step whose rows are a tree (`feed`: its tokens, root first; `drafts`: its nodes')."""

    tree: DraftTree = field(default_factory=lambda: DraftTree([0], [-1], [0]))


def check_request(
    prompt_ids: Sequence[int],
    params: GenerationParams,
    vocab_size: int,
    context_length: int,
    names: Mapping[str, str] | None = None,
) -> SamplingParams:
    """Every check of a request against the engine, in one place (the API calls it before queueing, the
    generation when it starts): raises GenerationError saying what to change; returns the sampling parameters.
    `names`: what the caller calls `prompt` and `max_new_tokens` (an API's field names), for the messages."""
    name = {"prompt": "prompt", "max_new_tokens": "max_new_tokens", **(names or {})}
    max_new = params.max_new_tokens
    if not prompt_ids:
        raise GenerationError(f"{name['prompt']} must not be empty")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise GenerationError(f"{name['prompt']}: token ids must lie in [0, {vocab_size})")
    if max_new < 0:
        raise GenerationError(f"{name['max_new_tokens']} must be 0 or more")
    if len(prompt_ids) + max_new > context_length:
        raise GenerationError(
            f"the prompt ({len(prompt_ids)} tokens) plus {name['max_new_tokens']} ({max_new}) exceeds the model's "
            f"context of {context_length} tokens"
        )
    if params.min_tokens < 0:
        raise GenerationError("min_tokens must be 0 or more")
    if params.min_tokens > max_new:
        raise GenerationError(f"min_tokens ({params.min_tokens}) exceeds {name['max_new_tokens']} ({max_new})")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise GenerationError(f"stop_token_ids must lie in [0, {vocab_size})")
    for field_name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, field_name)
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise GenerationError(f"{field_name} must lie in [0, {MAX_LOGPROBS}]")
    if params.num_draft_tokens < 0:
        raise GenerationError("num_draft_tokens must be 0 or more")
    schedule = params.draft_schedule or "fixed"
    if schedule not in SCHEDULES:
        raise GenerationError(f"draft_schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if not 0.0 <= (params.draft_p_min or 0.0) <= 1.0:
        raise GenerationError("draft_p_min must lie in [0, 1]")
    if params.lookup_draft_tokens is not None and not 0 <= params.lookup_draft_tokens <= MAX_DRAFT_TOKENS:
        raise GenerationError(f"lookup_draft_tokens must lie in [0, {MAX_DRAFT_TOKENS}]")
    if any(not 0 <= t < vocab_size for t in params.prediction):
        raise GenerationError(f"prediction token ids must lie in [0, {vocab_size})")
    if params.tree_rows is not None and not 0 <= params.tree_rows <= SLACK:
        raise GenerationError(f"tree_rows must lie in [0, {SLACK}]")
    if params.seed is not None and not 0 <= params.seed < 2**64:
        raise GenerationError("seed must lie in [0, 2**64)")
    if params.sampler not in SAMPLERS:
        raise GenerationError(f"sampler must be one of {', '.join(SAMPLERS)}, not {params.sampler!r}")
    try:
        return SamplingParams(params.temperature, params.top_k, params.top_p)
    except ValueError as exc:
        raise GenerationError(str(exc)) from exc
