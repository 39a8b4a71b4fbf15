"""The production speculative loop: KV-cached drafting and verification, one request at a time.

A `Generation` advances by `step()`: the drafter proposes up to k tokens, the target verifies them in
one forward over [last accepted token, drafts...], the accepted prefix plus the target's own next token
(a correction, or a bonus when everything was accepted) is appended, and both KV caches roll back past
the rejected positions by moving a length. Greedy output is token for token the target's own.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import overload

import torch

from app.engine.defaults import MAX_DRAFT_TOKENS, MAX_LOGPROBS, SAMPLERS
from app.engine.detokenizer import Detokenizer
from app.engine.draft_length import SCHEDULES, DraftLength, StepCosts
from app.engine.drafters import (
    ConstrainedSession,
    Drafter,
    DraftSession,
    FeatureSession,
    LookupSession,
    PenalizedSession,
    SamplingSession,
)
from app.engine.grammar import GrammarError, Grammars, GrammarSpec, GrammarState, mask_logits
from app.engine.logprobs import TokenLogprob, token_logprobs
from app.engine.model import KVCache, Transformer
from app.engine.penalties import NO_PENALTIES, Penalty, PenaltyParams
from app.engine.sampling import GumbelNoise, SamplingParams, argmax, gumbel_choice, sample, warp
from app.engine.tokenizer import Tokenizer
from app.engine.tree import DraftTree, TreeSession, compact, row_value
from app.engine.tree import accept as accept_tree
from app.engine.verification import coupled_verify, greedy_verify, rejection_sample

log = logging.getLogger(__name__)


class GenerationError(ValueError):
    """A request the engine cannot run as given; the message says what to change."""


class NumericalError(RuntimeError):
    """The target produced NaN or infinite logits: this request cannot go on (others are unaffected)."""


@dataclass(frozen=True)
class GenerationParams:
    """What one request asks of the engine."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    # Not app.engine.defaults' k on purpose: the server, the CLI and the load test always set it (from the
    # engine's or the request's k); the tests that build params directly rely on this fixed 4.
    num_draft_tokens: int = 4
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
    # The most rows of a tree verification (app.engine.tree: the draft's next choices and prompt lookup's
    # continuation beside its chain, in one target forward); 0: a chain; None: the engine's default. Trees run
    # where the kernel's attention takes them, greedy or with the gumbel sampler, without penalties or grammar.
    tree_rows: int | None = None
    # Log-probabilities under the target's raw distribution (app.engine.logprobs), computed only when asked:
    # `logprobs` of each generated token with that many alternatives (None: not asked), `prompt_logprobs` of
    # each prompt token after the first. max_new_tokens 0 runs the prompt alone, for its log-probabilities.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Repetition, presence and frequency penalties (app.engine.penalties), on the target's and the draft's logits.
    penalties: PenaltyParams = NO_PENALTIES
    # The output's grammar (app.engine.grammar): every chosen token is one it allows, drafts it refuses end
    # acceptance, and its end ends the generation. Engine.start compiles it.
    grammar: GrammarSpec | None = None
    # With a grammar: a token it forces (the only one its mask allows, so the target's masked choice whatever
    # its logits) is proposed as it is, within a draft and after it, target-only too, without counting against
    # the draft length; the target still runs its row. False: only the draft proposes (to measure the gain).
    forced_tokens: bool = True


@dataclass
class GenerationStats:
    """Counters of one request; rates are derived, never stored."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    forced: int = 0  # tokens kept that the grammar forced (never counted as drafted or accepted)
    target_passes: int = 0  # every target forward, the prefill included
    verify_passes: int = 0  # target forwards that checked at least one drafted token
    accepted_per_position: list[int] = field(default_factory=list)
    draft_schedule: str = "fixed"
    draft_p_min: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)  # [k]: steps that asked the draft for k tokens
    p_min_stops: int = 0  # steps whose draft stopped early for lack of confidence
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

    def to_dict(self) -> dict[str, float | int | list[int]]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "forced": self.forced,
            "target_passes": self.target_passes,
            "verify_passes": self.verify_passes,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_target_pass": round(self.tokens_per_target_pass, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "draft_schedule": self.draft_schedule,
            "draft_p_min": self.draft_p_min,
            "draft_lengths": list(self.draft_lengths),
            "p_min_stops": self.p_min_stops,
            "tokens_per_second": round(self.tokens_per_second, 3),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "total_seconds": round(self.total_seconds, 4),
        }


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


# What proposed a kept token: the target alone (no draft this step), the model draft or prompt lookup (accepted
# by the target), the grammar (the only token it allowed), or the target's token after the accepted drafts:
# a correction of the first rejected one, or a bonus when every drafted token was accepted.
SOURCES = ("target", "draft", "lookup", "forced", "correction", "bonus")


class BatchStep(Sequence[StepOutput | Exception]):
    """What `Engine.step_batch` did: per generation its step's output or the exception that ended it (a
    sequence of them, in the order given), and `together`, the indices of those that shared one forward."""

    def __init__(self, outputs: list[StepOutput | Exception], together: list[int]) -> None:
        self.outputs = outputs
        self.together = together

    def __len__(self) -> int:
        return len(self.outputs)

    @overload
    def __getitem__(self, index: int) -> StepOutput | Exception: ...
    @overload
    def __getitem__(self, index: slice) -> list[StepOutput | Exception]: ...
    def __getitem__(self, index: int | slice) -> StepOutput | Exception | list[StepOutput | Exception]:
        return self.outputs[index]


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
    kind: str = "model"  # what drafted: "model" or "lookup" (app.engine.draft_length.KINDS)


# Spare cache slots of every request: a verification of the longest draft allowed (k + 1 rows), so that every
# request's capacity is the same whatever its k.
_SLACK = MAX_DRAFT_TOKENS + 1


@dataclass
class TreePlan(StepPlan):
    """A step whose rows are a tree (`feed`: its tokens, root first; `drafts`: its nodes')."""

    tree: DraftTree = field(default_factory=lambda: DraftTree([0], [-1], [0]))


class Generation:
    """The decoding state of one request. Not thread-safe: one worker steps it."""

    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        drafter: Drafter | None,
        verify_width: int = 0,
        costs: StepCosts | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        if not prompt_ids:
            raise GenerationError("the prompt is empty")
        if params.max_new_tokens < 0:
            raise GenerationError("max_new_tokens must be 0 or more")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise GenerationError(f"{name} must lie in [0, {MAX_LOGPROBS}]")
        if params.num_draft_tokens < 0:
            raise GenerationError("num_draft_tokens must be 0 or more")
        if not 0 <= params.min_tokens <= params.max_new_tokens:
            raise GenerationError(f"min_tokens must lie in [0, max_new_tokens = {params.max_new_tokens}]")
        schedule = params.draft_schedule or "fixed"
        if schedule not in SCHEDULES:
            raise GenerationError(f"draft_schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
        p_min = params.draft_p_min or 0.0
        if not 0.0 <= p_min <= 1.0:
            raise GenerationError("draft_p_min must lie in [0, 1]")
        try:
            self.sampling = SamplingParams(params.temperature, params.top_k, params.top_p)
        except ValueError as exc:
            raise GenerationError(str(exc)) from exc
        limit = target.config.max_seq_len
        if len(prompt_ids) + params.max_new_tokens > limit:
            raise GenerationError(
                f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the model's context of {limit} tokens"
            )
        vocab = target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise GenerationError(f"prompt token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise GenerationError(f"stop token ids must lie in [0, {vocab})")
        self.params = params
        self.target = target
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self._k = params.num_draft_tokens if drafter is not None else 0
        self.stats.accepted_per_position = [0] * self._k
        self.stats.draft_lengths = [0] * (self._k + 1)
        self.stats.draft_schedule = schedule if self._k else "none"
        self.stats.draft_p_min = p_min if self._k else 0.0
        self._p_min = p_min
        # Spare slots past the last token: a verification writes k+1 entries (at least the padded width) before
        # rolling back. With a fixed span attention reduces over the whole capacity, and a different span
        # changes the last bits, so the capacity must not depend on the draft: the same slack for every request.
        self._width = verify_width
        slack = max(self._k + 1, verify_width, _SLACK)
        capacity = min(limit, len(prompt_ids) + params.max_new_tokens + slack)
        self._cache: KVCache = target.new_cache(capacity)
        self._cache.fixed_span = verify_width > 0
        self.drafter = drafter
        self._draft: DraftSession | None = drafter.session(capacity) if drafter is not None and self._k else None
        lookup_only = isinstance(self._draft, LookupSession) and self._draft.model is None
        self._length = DraftLength(schedule, self._k, costs or StepCosts(), "lookup" if lookup_only else "model")
        # A feature-conditioned draft reads the target's final hidden state of every verified position.
        self._features = self._draft.features if isinstance(self._draft, FeatureSession) else None
        self._penalty: Penalty | None = None
        if not params.penalties.neutral:
            self._penalty = Penalty(params.penalties, prompt_ids, vocab, target.device)
            if isinstance(self._draft, PenalizedSession):
                self._draft.penalty = self._penalty
        if (params.grammar is None) != (grammar is None):
            raise GenerationError("a grammar state comes with its spec: Engine.start builds both")
        self._grammar = grammar
        if grammar is not None and isinstance(self._draft, ConstrainedSession):
            self._draft.grammar = grammar
        # With a grammar an end-of-sequence token comes only once it is complete, and then it ends the generation
        # whatever ignore_eos and min_tokens say (the grammar allows nothing after it).
        self._grammar_end = tokenizer.eos_token_ids if grammar is not None else frozenset()
        self._detok = Detokenizer(tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
        self._eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self._stop_ids = frozenset(params.stop_token_ids)
        if params.seed is not None and not 0 <= params.seed < 2**64:
            raise GenerationError("seed must lie in [0, 2**64)")
        if params.sampler not in SAMPLERS:
            raise GenerationError(f"sampler must be one of {', '.join(SAMPLERS)}, not {params.sampler!r}")
        # Each request draws from its own noise (or generator), so a seed reproduces it whatever else is running.
        self.seed: int | None = None  # the seed actually used; None under greedy decoding
        self._rng: GumbelNoise | torch.Generator | None = None
        if not self.sampling.greedy:
            self.seed = params.seed if params.seed is not None else secrets.randbits(63)
            if params.sampler == "gumbel":
                self._rng = GumbelNoise(self.seed, vocab)
            else:
                self._rng = torch.Generator(device=target.device).manual_seed(self.seed)
        self._tree_rows = self._tree_rows_allowed(params.tree_rows or 0)
        # On the adaptive schedule a lookup is made before the draft length is chosen: what it found, and whether
        # it pays to verify, decide the step (a tree takes the lookup's continuation in with the model's).
        self._lookup_first = schedule == "adaptive" and isinstance(self._draft, LookupSession) and not self._tree_rows
        # The kind of the last step's draft (None: it drafted nothing). A draft step's seconds are measured only
        # after a step that drafted the same kind: a model draft that did not run last step first catches up on
        # the tokens since (the whole prompt, the first time), which is no cost of the tokens it drafts now.
        self._last_kind: str | None = None
        # The prompt's log-probabilities gathered chunk by chunk, sent with the first token (None: not asked).
        self._prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self._started = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _tree_rows_allowed(self, rows: int) -> int:
        """The rows this request's tree verifications may have (0: it verifies chains)."""
        if not 0 <= rows <= _SLACK:
            raise GenerationError(f"tree_rows must lie in [0, {_SLACK}]")
        kernel = self._cache.kernel
        # A tree row gets sequential decoding's bits only where the kernel's attention reads its keys in order;
        # penalties and grammars judge each row by the text before it, which a tree's rows do not share.
        exact = kernel is not None and kernel.trees and self._penalty is None and self._grammar is None
        sampler = self.sampling.greedy or isinstance(self._rng, GumbelNoise)
        return rows if rows > 1 and exact and sampler and isinstance(self._draft, TreeSession) else 0

    @property
    def tree_rows(self) -> int:
        """The most rows of this request's tree verifications (0: it verifies chains)."""
        return self._tree_rows

    # What a batch (app.engine.batch) reads of a generation to step it beside others.
    @property
    def cache(self) -> KVCache:
        """The target's KV cache of this request (its length: the positions computed)."""
        return self._cache

    @property
    def draft_length(self) -> DraftLength:
        """This request's draft-length state: its schedule, measured acceptance and costs."""
        return self._length

    @property
    def max_draft(self) -> int:
        """The most tokens drafted per step (0: target-only)."""
        return self._k

    @property
    def draft_session(self) -> DraftSession | None:
        """The drafter's state of this request (None: target-only)."""
        return self._draft

    @property
    def p_min(self) -> float:
        """The draft's confidence cut-off."""
        return self._p_min

    @property
    def generated_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    @property
    def text(self) -> str:
        """The generated text so far (without the stop string, when one ended it)."""
        return self._detok.text

    @torch.inference_mode()
    def step(self) -> StepOutput:
        """Run one step: prefill and first token on the first call, then draft and verify."""
        if self.finished:
            raise RuntimeError("generation already finished")
        if self.needs_prefill:
            return self._prefill()
        plan = self.plan(self._width)
        t0 = time.perf_counter()
        if isinstance(plan, TreePlan):
            hidden = self.target.hidden_batch([(plan.feed, plan.start, self._cache, plan.tree.parents_tensor())])[0]
        else:
            hidden = self.target.hidden(plan.feed[None], plan.start, self._cache)[0]
        # The head runs on every row, padding included, for the same reason the padding exists.
        logits = self.target.logits(hidden)
        return self.verify(plan, hidden, logits, time.perf_counter() - t0, solo=True)

    @property
    def needs_prefill(self) -> bool:
        """Whether the prompt is not yet (all) in the cache: the next step prefills (the rest of) it."""
        return self._cache.length < self.prompt_len

    def next_prompt_chunk(self, budget: int) -> tuple[torch.Tensor, int]:
        """The next at most `budget` prompt tokens to prefill in a batch: (ids long [n], start position)."""
        start = self._cache.length
        end = min(self.prompt_len, start + budget)
        return torch.tensor(self.ids[start:end], dtype=torch.long, device=self.target.device), start

    def plan(self, width: int, k: int | None = None, drafted: tuple[list[int], float] | None = None) -> StepPlan:
        """Draft this step's tokens and lay out the target's rows: [last token, drafts..., padding].

        `width`: rows to pad to (0: none); `k`: the draft length when a batch chose it, else this request's
        own schedule chooses; `drafted`: (tokens, seconds) when a batch drafted them (greedy) already."""
        remaining = self.params.max_new_tokens - self.stats.generated_tokens
        t0 = time.perf_counter()
        found: list[int] | None = None  # a lookup's tokens, chosen before any draft ran
        kind = self._length.kind
        chosen = k is None and self._lookup_first  # the kind is known from the choice
        if k is None:
            # A step adds up to k+1 tokens; never draft what could not be kept.
            if chosen:
                k, kind, found = self._choose_with_lookup(remaining - 1)
            else:
                k = self._length.next_k(remaining - 1) if self._k else 0
                if k == 0 and self._k and remaining > 1:
                    self._length.idle()
        if self._tree_rows and k > 0 and drafted is None:
            return self._plan_tree(k)
        if drafted is not None:
            (drafts, draft_seconds), q = drafted, None
        else:
            if found is not None:
                drafts, q = found, None
            else:
                session = self._draft.model if chosen and isinstance(self._draft, LookupSession) else None
                drafts, q = self._propose(k, session)
            draft_seconds = time.perf_counter() - t0
        if not chosen and k > 0 and isinstance(self._draft, LookupSession) and self._draft.used_lookup:
            kind = "lookup"  # a hybrid asked for k tokens (a batch's, or a fixed length) and its lookup had them
        refused = 0
        forced: list[bool] = []
        if self._grammar is not None:
            # Drafts from the first one the grammar refuses on could never be kept: the target does not run them.
            valid = self._grammar.valid_prefix(drafts)
            drafts, q, refused = drafts[:valid], None if q is None else q[:valid], len(drafts) - valid
            if self._grammar.forcing:
                # The tokens the grammar forces after the drafts (after the last token, target-only) are verified
                # with them: rows the target's masked choice agrees with whatever its logits, no draft's guess.
                limit = min(remaining - 1, max(self._k, MAX_DRAFT_TOKENS))
                more = self._grammar.forced_tokens(drafts, limit - len(drafts)) if len(drafts) < limit else []
                if more and q is not None:  # a forced token's q is one-hot, as a lookup's
                    q = torch.cat([q, torch.nn.functional.one_hot(torch.tensor(more), q.shape[-1]).to(q)])
                # (Forced tokens within a draft do not count against k: cut what could not be kept.)
                drafts = [*drafts, *more][:limit]
                q = None if q is None else q[:limit]
                forced = self._grammar.forced_flags(drafts)
        start = len(self.ids) - 1
        real = 1 + len(drafts)
        # Padded to at least `width` rows, so each real row is computed by the same kernels whether it is a plain
        # step or one row of a verification: in bfloat16 a 1-row forward takes another attention path, whose
        # last bits differ, enough to flip a near-tie and make "speculative == target alone" false. Padding
        # sits after the real rows, so causality keeps it from touching them.
        pad = max(0, min(width, self._cache.capacity - start) - real)
        feed = torch.tensor([self.ids[-1], *drafts, *[0] * pad], dtype=torch.long, device=self.target.device)
        return StepPlan(k, drafts, q, start, real, feed, draft_seconds, refused, forced, kind)

    def _choose_with_lookup(self, limit: int) -> tuple[int, str, list[int] | None]:
        """The adaptive choice of a session that looks up first: (k, its kind, the lookup's tokens to verify or
        None). Verifying some of the lookup's tokens (free to propose: only their rows cost) and a model draft
        are priced each with its own acceptance; the one expected to yield more tokens per second is drafted,
        neither when a plain step yields more (bar a probe). A lookup wins a tie, and while the model's step
        is not yet measured."""
        session = self._draft
        assert isinstance(session, LookupSession)
        found = session.lookup(self.ids, min(self._k, limit)) if limit > 0 else []
        options: list[tuple[float, int, str]] = []
        for kind, available in (("lookup", len(found)), ("model", None if session.model is not None else 0)):
            if available == 0 or limit <= 0:
                continue  # nothing to draft of this kind
            k = self._length.next_k(limit, kind, available)
            if k:
                options.append((self._length.rate(k, kind) or 0.0, k, kind))
            else:
                self._length.idle(kind)
        if not options:
            return 0, self._length.kind, None
        _, k, kind = max(options, key=lambda option: option[0])
        return k, kind, found[:k] if kind == "lookup" else None

    def verify(
        self, plan: StepPlan, hidden: torch.Tensor, logits: torch.Tensor, forward_seconds: float, solo: bool
    ) -> StepOutput:
        """Keep what the target agrees with, given its hidden states [rows, dim] and logits [rows, vocab]
        over `plan.feed`."""
        if isinstance(plan, TreePlan):
            return self._verify_tree(plan, hidden, logits, forward_seconds, solo)
        t0 = time.perf_counter()
        start, real, drafts = plan.start, plan.real, plan.drafts
        logits = self._checked(logits[:real])
        if self._features is not None:
            self._features[start : start + real] = hidden[:real]
        draft_tensor = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        # Tokens are chosen from the penalised logits (row i over the context plus drafts[:i]); log-probabilities
        # stay the raw distribution's.
        chosen = logits if self._penalty is None else self._penalty.apply(logits, drafts)
        checked, q = drafts, plan.q
        if self._grammar is not None:
            # Row i masked by the grammar after the accepted text plus drafts[:i], after the penalties; a draft it
            # refuses ends acceptance there (its masked logit is -inf: no verification could keep it anyway), and
            # counts as drafted and rejected.
            allowed, valid = self._grammar.masks(drafts)
            checked, draft_tensor = drafts[:valid], draft_tensor[:valid]
            q = None if q is None else q[:valid]
            chosen = mask_logits(chosen[: valid + 1], allowed)
        if self.sampling.greedy:
            accepted, nxt = greedy_verify(draft_tensor, chosen)
        elif isinstance(self._rng, GumbelNoise):
            accepted, nxt = coupled_verify(checked, chosen, self.sampling, self._rng, start + 1)
        else:
            accepted, nxt = rejection_sample(draft_tensor, q, warp(chosen, self.sampling), self._rng)
        # Keep the last accepted token and the accepted drafts; the rest of the cache is rolled back.
        self._cache.truncate(start + 1 + accepted)
        verify_seconds = forward_seconds + time.perf_counter() - t0
        self.stats.target_passes += 1
        # Drafts the grammar refused before verification count as drafted and rejected; tokens it forced count
        # apart (the draft did not guess them), the kept ones in `forced`.
        kept_forced = sum(plan.forced[:accepted])
        own, kept_own = len(drafts) - sum(plan.forced), accepted - kept_forced
        proposed = own + plan.refused
        self.stats.verify_passes += bool(own)
        self.stats.forced += kept_forced
        if proposed:
            self.stats.drafted += proposed
            self.stats.accepted += kept_own
            for i in range(kept_own):
                self.stats.accepted_per_position[i] += 1
        self.stats.draft_seconds += plan.draft_seconds
        self.stats.verify_seconds += verify_seconds
        k = plan.k
        if k > 0:
            self.stats.draft_lengths[k] += 1
            self.stats.p_min_stops += proposed < k
            self._length.update(proposed, kept_own, plan.kind)
        elif not solo and self._k and self.params.max_new_tokens - self.stats.generated_tokens > 1:
            # A batch chose not to draft for this request. (Alone, the schedule's own 0 was counted by `plan`.)
            self._length.rest()
        # A draft that stopped for lack of confidence still ran one more step than it proposed. A batch's
        # times are the whole batch's: they say nothing of what drafting or verifying this request alone costs.
        steps = self._timed_draft_steps(plan, min(k, proposed + 1))
        if solo:
            self._length.costs.observe(steps, plan.draft_seconds, real, verify_seconds)
        new = [*drafts[:accepted], nxt]
        drafted_by = "lookup" if plan.kind == "lookup" else "draft"
        sources = ["forced" if plan.forced and plan.forced[i] else drafted_by for i in range(accepted)]
        if accepted < len(drafts) or plan.refused:
            sources.append("correction")
        else:
            sources.append("bonus" if own else "target")
        # Row i of the target's logits predicted new[i]: the accepted drafts' rows, then the row that chose nxt.
        n = self.params.logprobs
        logprobs = None if n is None else token_logprobs(logits[: len(new)], new, n)
        out = self._emit(new, own, kept_own, plan.draft_seconds, verify_seconds, logprobs, sources)
        out.forced = kept_forced
        return out

    def _plan_tree(self, k: int) -> TreePlan:
        """Draft this step's tree (depth at most `k`) and lay out its rows, root first."""
        t0 = time.perf_counter()
        assert isinstance(self._draft, TreeSession)
        start = len(self.ids) - 1
        rows = min(self._tree_rows, self._cache.capacity - start)
        noise = self._rng if isinstance(self._rng, GumbelNoise) else None
        params = None if self.sampling.greedy else self.sampling
        # Model nodes whose value (expected accepted tokens) is below what a row costs are left out: where rows
        # cost (AVX2: a 16-row pass takes about 3x a 1-row one) the tree stays small, where they are free it fills.
        floor = row_value(self._length.costs, self.stats.tokens_per_target_pass, k + 1)
        tree = self._draft.propose_tree(self.ids, k, rows, params, noise, self._p_min, floor)
        feed = torch.tensor(tree.tokens, dtype=torch.long, device=self.target.device)
        seconds = time.perf_counter() - t0
        return TreePlan(k, tree.tokens[1:], None, start, tree.rows, feed, seconds, tree=tree)

    def _verify_tree(
        self, plan: TreePlan, hidden: torch.Tensor, logits: torch.Tensor, forward_seconds: float, solo: bool
    ) -> StepOutput:
        """`verify` of a tree: the longest path the target agrees with (`app.engine.tree.accept`) and its token
        after it; the path's keys and values moved where sequential decoding puts them, and its hidden states
        given to a feature draft in depth order. `drafted` counts the tree's nodes."""
        t0 = time.perf_counter()
        tree, start = plan.tree, plan.start
        logits = self._checked(logits[: tree.rows])
        noise = self._rng if isinstance(self._rng, GumbelNoise) else None
        path, nxt = accept_tree(tree, logits, self.sampling, noise, start + 1)
        rows = [0, *path]
        if self._features is not None:
            self._features[start : start + len(rows)] = hidden[rows]
        compact(self._cache, start, path)
        accepted = len(path)
        verify_seconds = forward_seconds + time.perf_counter() - t0
        self.stats.target_passes += 1
        self.stats.verify_passes += bool(tree.nodes)
        if tree.nodes:
            self.stats.drafted += tree.nodes
            self.stats.accepted += accepted
            for i in range(accepted):
                self.stats.accepted_per_position[i] += 1
        self.stats.draft_seconds += plan.draft_seconds
        self.stats.verify_seconds += verify_seconds
        if plan.k > 0:
            self.stats.draft_lengths[plan.k] += 1
            self.stats.p_min_stops += tree.depth < plan.k
            # Acceptance along the depth, as a chain of the tree's depth would count it.
            self._length.update(tree.depth, accepted)
        steps = self._timed_draft_steps(plan, min(plan.k, tree.depth + 1))
        if solo:
            self._length.costs.observe(steps, plan.draft_seconds, tree.rows, verify_seconds)
        new = [*(tree.tokens[r] for r in path), nxt]
        # The target's token is a bonus after a leaf (every drafted token on its path accepted), else a correction.
        last = "target" if not tree.nodes else "correction" if tree.children(rows[-1]) else "bonus"
        sources = [*(tree.source(r) for r in path), last]
        # The rows that chose them: the root's (the first), then each accepted node's.
        n = self.params.logprobs
        logprobs = None if n is None else token_logprobs(logits[rows], new, n)
        return self._emit(new, tree.nodes, accepted, plan.draft_seconds, verify_seconds, logprobs, sources)

    def _timed_draft_steps(self, plan: StepPlan, steps: int) -> int:
        """The draft steps whose seconds `plan.draft_seconds` measures: `steps`, or 0 where they measure no draft
        step of this request's drafter: after a step that drafted another kind or nothing (see `_last_kind`), and
        a hybrid's lookup (its microseconds would make the model draft look free)."""
        warm = plan.kind == self._last_kind == self._length.kind
        self._last_kind = plan.kind if plan.k > 0 else None
        return steps if warm else 0

    def _propose(self, k: int, session: DraftSession | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Up to `k` drafted tokens (and their q when sampling with a generator), from `session` (default: the
        request's draft session; a hybrid's model part when its lookup was passed over)."""
        draft = session if session is not None else self._draft
        if draft is None or k <= 0:
            return [], None
        if self.sampling.greedy:
            return draft.propose(self.ids, k, p_min=self._p_min), None
        if not isinstance(draft, SamplingSession):  # a deterministic proposer: q is one-hot on what it proposes
            return draft.propose(self.ids, k, p_min=self._p_min), None
        return draft.propose_sampled(self.ids, k, self.sampling, self._rng, p_min=self._p_min)

    @staticmethod
    def _checked(logits: torch.Tensor) -> torch.Tensor:
        # In float32 (an exact conversion): bfloat16's argmax over a 49k vocabulary takes twice float32's. One
        # sum finds any NaN or infinity (both propagate; inf - inf is NaN) at a twentieth of isfinite().all()'s
        # cost (18 vs 343 us for 3 rows here); finite logits cannot add up to an overflow.
        logits = logits.float()
        if not bool(torch.isfinite(logits.sum())):
            raise NumericalError("the target produced non-finite logits")
        return logits

    def _prefill(self) -> StepOutput:
        """The prompt (what a batch left of it) in one forward, then the first token."""
        t0 = time.perf_counter()
        start = self._cache.length
        prompt = torch.tensor([self.ids[start : self.prompt_len]], dtype=torch.long, device=self.target.device)
        hidden = self.target.hidden(prompt, start, self._cache)[0]
        # Only the last position's logits are needed: a 49k-wide projection of every prompt token is not.
        logits = self.target.logits(hidden[-1])
        return self.prefilled(start, hidden, logits, time.perf_counter() - t0)

    def prefilled(self, start: int, hidden: torch.Tensor, logits: torch.Tensor | None, seconds: float) -> StepOutput:
        """After prompt rows start.. were run (`hidden` [n, dim]): their states for a feature draft, and with the
        prompt's last row's `logits` [vocab] (None while the prompt is not all in) the first token."""
        t0 = time.perf_counter()
        if self._features is not None:
            self._features[start : start + hidden.shape[0]] = hidden
        if self._prompt_logprobs is not None:
            self._add_prompt_logprobs(start, hidden)
        if logits is None:
            self.stats.prefill_seconds += seconds + time.perf_counter() - t0
            return StepOutput([], "", 0, 0, 0.0, 0.0)
        logits = self._checked(logits)
        chosen = logits if self._penalty is None else self._penalty.apply(logits[None])[0]
        if self._grammar is not None:
            chosen = mask_logits(chosen[None], self._grammar.masks()[0])[0]
        if self.sampling.greedy:
            nxt = int(argmax(chosen))
        elif isinstance(self._rng, GumbelNoise):
            nxt = gumbel_choice(chosen, self.sampling, self._rng, len(self.ids))
        else:
            nxt = int(sample(warp(chosen, self.sampling), self._rng))
        logprobs = None if self.params.logprobs is None else token_logprobs(logits[None], [nxt], self.params.logprobs)
        seconds += time.perf_counter() - t0
        self.stats.target_passes += 1
        self.stats.prefill_seconds += seconds
        out = self._emit([nxt], 0, 0, 0.0, seconds, logprobs, ["target"])
        out.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        return out

    # Prompt rows whose logits are computed at once for prompt log-probabilities: a [rows, vocab] float32 block
    # (12 MB per 64 rows of a 49k vocabulary) instead of one for the whole prompt.
    _PROMPT_LOGPROB_ROWS = 64

    def _add_prompt_logprobs(self, start: int, hidden: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens that rows start.. (`hidden` [n, dim]) predict: row i, at
        position start + i, predicts the token at start + i + 1; the prompt's last row predicts the first
        generated token, not a prompt token."""
        assert self._prompt_logprobs is not None
        rows = min(hidden.shape[0], self.prompt_len - 1 - start)
        step = self._PROMPT_LOGPROB_ROWS
        for a in range(0, rows, step):
            b = min(rows, a + step)
            logits = self._checked(self.target.logits(hidden[a:b]))
            targets = self.ids[start + a + 1 : start + b + 1]
            self._prompt_logprobs.extend(token_logprobs(logits, targets, self.params.prompt_logprobs or 0))

    def _emit(
        self,
        new: list[int],
        drafted: int,
        accepted: int,
        draft_s: float,
        verify_s: float,
        logprobs: list[TokenLogprob] | None = None,
        sources: list[str] | None = None,
    ) -> StepOutput:
        finish = None
        remaining = self.params.max_new_tokens - self.stats.generated_tokens
        if len(new) >= remaining:
            new, finish = new[:remaining], "length"
        # Before min_tokens were generated, end-of-sequence and stop tokens and stop strings end nothing: they
        # count from new[armed] on. The token that ends the generation adds its text only when asked to.
        armed = max(0, self.params.min_tokens - self.stats.generated_tokens)
        shown = new
        for i, tok in enumerate(new):
            if (i >= armed and (tok in self._eos or tok in self._stop_ids)) or tok in self._grammar_end:
                new, finish = new[: i + 1], "eos" if tok in self._eos else "stop"
                shown = new if self.params.include_stop_str_in_output else new[:i]
                break
        text, keep = self._detok.push(shown, armed)
        if self._detok.stopped_at is not None:
            # The stop string ended inside this step: drop the tokens after the one that completed it.
            new, finish = new[:keep], "stop"
        self.ids.extend(new)
        if self._penalty is not None:
            self._penalty.accept(new)
        if self._grammar is not None and finish is None:  # nothing comes after a finished generation's last token
            self._grammar.accept(new)
        self.stats.generated_tokens += len(new)
        if finish is not None:
            self.finish_reason = finish
            text += self._detok.flush()
            self.stats.total_seconds = time.perf_counter() - self._started
        # Only the tokens kept (not those past the end, an end-of-sequence token or a stop string) have theirs.
        kept = None if logprobs is None else logprobs[: len(new)]
        return StepOutput(
            new, text, drafted, accepted, draft_s, verify_s, finish, kept, sources=(sources or [])[: len(new)]
        )


class Engine:
    """A loaded target with its drafters: starts generations, knows nothing of HTTP.

    `draft_schedule` and `draft_p_min` are the defaults of requests that do not say; the plain constructor
    keeps a fixed length of 4 without a confidence cut-off (deterministic, for tests and experiments, which
    rely on it), while `build_engine`, the server's settings and the CLI share `app.engine.defaults` (the
    adaptive schedule). `prefill_chunk`: prompts are prefilled at most this many tokens per step, in the
    same forward as the other requests' rows (0: each prompt whole, alone, before the batch); only where a
    row's bits do not depend on the rows beside it (`Transformer.rows_independent`), so a chunked prompt gets
    the very cache a whole one does. `prefill_step_seconds` (> 0): chunks are also sized so that a step takes
    about this long, from measured costs, however long the context already is."""

    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer,
        drafters: dict[str, Drafter],
        default_draft: str = "none",
        num_draft_tokens: int = 4,
        verify_width: int | None = None,
        draft_schedule: str = "fixed",
        draft_p_min: float = 0.0,
        prefill_chunk: int = 0,
        prefill_step_seconds: float = 0.0,
        tree_rows: int = 0,
    ) -> None:
        if default_draft != "none" and default_draft not in drafters:
            raise GenerationError(f"default draft {default_draft!r} is not loaded")
        if prefill_chunk < 0 or prefill_step_seconds < 0:
            raise GenerationError("prefill_chunk and prefill_step_seconds must be 0 or more")
        # On the CPU kernels a row's bits depend on nothing but itself, so requests can share a forward (and a
        # prompt can be prefilled in chunks beside them) and still get the tokens they get alone. Elsewhere
        # (SPECSERVE_KERNEL=torch, CUDA, float32) that promise holds only request by request: no batching.
        self.batching = target.rows_independent()
        on_cpu = target.device.type == "cpu"
        self.kernel = (target.kernel.name if target.kernel is not None else "torch") if on_cpu else target.device.type
        self.prefill_chunk = prefill_chunk if self.batching else 0
        # With a step time to aim for, chunks are sized from the measured seconds per unit of work (see
        # `Batcher`); 0: every step may prefill prefill_chunk tokens, whatever they cost.
        self.prefill_step_seconds = prefill_step_seconds if self.prefill_chunk else 0.0
        if not self.batching:
            log.warning(
                "rows are not independent on %s %s: requests step one at a time, so that a request's tokens do "
                "not depend on what runs beside it (no batched decoding)",
                self.kernel,
                str(target.dtype).removeprefix("torch."),
            )
        self.target = target
        self.tokenizer = tokenizer
        self.drafters = drafters
        self.default_draft = default_draft
        self.num_draft_tokens = num_draft_tokens
        if draft_schedule not in SCHEDULES:
            raise GenerationError(f"draft_schedule must be one of {', '.join(SCHEDULES)}")
        self.draft_schedule = draft_schedule
        self.draft_p_min = draft_p_min
        # The default of requests' `tree_rows` (0: chains).
        self.tree_rows = tree_rows
        # Compiles requests' output grammars (their library loads at the first one).
        self.grammars = Grammars(tokenizer, target.config.vocab_size)
        # Measured step costs and acceptance per drafter, shared by its requests (adaptive draft length). The
        # seconds of a verification per row count are the target's: one table for every drafter, which
        # target-only requests fill too (their steps are 1-row verifications), and `calibrate` may seed.
        self._verify_costs: dict[int, float] = {}
        self._costs: dict[int, StepCosts] = {}
        self._target_costs = StepCosts(self._verify_costs)
        # None: pad decoding forwards to 8 rows in half precision, where a 1-row forward's bits differ (see
        # Generation._plan; on this CPU 2 rows would do, and measured no faster end to end), and not at all in
        # float32, where results differ too little to flip a token and padding would cost, nor on the AMX
        # kernels, whose rows depend on nothing but themselves.
        if verify_width is None:
            half = target.dtype in (torch.bfloat16, torch.float16)
            verify_width = 8 if half and not target.rows_independent() else 0
        self.verify_width = verify_width
        # Imported here: the batch steps this module's generations.
        from app.engine.batch import Batcher

        self.batcher = Batcher(target, verify_width, self.prefill_chunk, self.prefill_step_seconds)

    def drafter(self, name: str | None) -> Drafter | None:
        """The drafter called `name` (None: the default; "none": target-only decoding)."""
        name = self.default_draft if name in (None, "default") else name
        if name == "none":
            return None
        if name not in self.drafters:
            raise GenerationError(f"unknown draft {name!r}; available: none, {', '.join(self.drafters)}")
        return self.drafters[name]

    def start(self, prompt_ids: Sequence[int], params: GenerationParams, draft: str | None = None) -> Generation:
        """A new generation, ready to `step()`; raises GenerationError for a request it cannot run.

        Draft-length settings left None in `params` take the engine's defaults."""
        drafter = self.drafter(draft)
        params = replace(
            params,
            draft_schedule=params.draft_schedule or self.draft_schedule,
            draft_p_min=self.draft_p_min if params.draft_p_min is None else params.draft_p_min,
            tree_rows=self.tree_rows if params.tree_rows is None else params.tree_rows,
        )
        costs = self._target_costs
        if drafter is not None:
            costs = self._costs.setdefault(id(drafter), StepCosts(self._verify_costs))
        grammar = None
        if params.grammar is not None:
            try:
                grammar = self.grammars.start(params.grammar, params.forced_tokens)
            except GrammarError as exc:
                raise GenerationError(f"the grammar cannot be compiled: {exc}") from exc
        return Generation(
            self.target, self.tokenizer, prompt_ids, params, drafter, self.verify_width, costs, grammar=grammar
        )

    @torch.inference_mode()
    def calibrate(self, rows: int | None = None, context: int = 32) -> dict[int, float]:
        """Time a verification of 1..`rows` rows (default num_draft_tokens + 1: a plain step up to the longest
        draft's) once, and seed the verification costs every drafter's adaptive schedule reads with them, so
        that the first requests choose their draft lengths from this machine's costs rather than from a short
        first draft and a guessed cost per row. Optional (without it the first steps measure) and cheap (0.3 s
        for the 135M target on AVX2): a `context`-token prompt, then two forwards of each row count, padded as
        decoding pads them, the faster kept (the first of a shape can be slow). Replaces what was measured for
        those row counts; returns the seconds."""
        rows = max(1, min(rows or self.num_draft_tokens + 1, _SLACK))
        cache = self.target.new_cache(min(self.target.config.max_seq_len, context + rows + _SLACK))
        cache.fixed_span = self.verify_width > 0
        device = self.target.device
        self.target.hidden(torch.ones((1, context), dtype=torch.long, device=device), 0, cache)
        seconds: dict[int, float] = {}
        for _ in range(2):
            for r in range(1, rows + 1):
                feed = torch.ones((1, max(r, self.verify_width)), dtype=torch.long, device=device)
                t0 = time.perf_counter()
                hidden = self.target.hidden(feed, context, cache)[0]
                # What a verification does after the forward: the head on every row, and a reduction that waits
                # for the result (on an accelerator too).
                float(self.target.logits(hidden).float().sum())
                elapsed = time.perf_counter() - t0
                cache.truncate(context)
                seconds[r] = min(seconds.get(r, elapsed), elapsed)
        self._verify_costs.update(seconds)
        return seconds

    @torch.inference_mode()
    def step_batch(self, gens: Sequence[Generation]) -> BatchStep:
        """One step of every generation in `gens`, the decoding ones verified in ONE target forward.

        Each request drafts on its own (lengths chosen for the batch as a whole, see
        `batch_draft_lengths`), then the target runs all their rows together, reading its weights once
        instead of once per request, and each request verifies its own rows. Prompts are prefilled one by
        one. Returns, per generation, its step's output or the exception that ended it: one request's
        failure leaves the others untouched, and which of them ran in the shared forward. Greedy tokens are
        the same as with `Generation.step`.
        """
        results: dict[int, StepOutput | Exception] = {}
        batch = self.together(gens)
        for i, gen in enumerate(gens):
            if i not in batch:
                try:
                    results[i] = gen.step()
                except Exception as exc:
                    results[i] = exc
        if batch:
            results.update(zip(batch, self.batcher.step([gens[i] for i in batch]), strict=True))
        return BatchStep([results[i] for i in range(len(gens))], batch)

    def together(self, gens: Sequence[Generation]) -> list[int]:
        """Indices of `gens` that `step_batch` runs in one target forward: the decoding ones, and with
        `prefill_chunk` the prefilling ones too; none when fewer than two, unless the one is a prompt to chunk
        (a lone request decodes alone; a lone long prompt still goes a chunk per step, so that a request
        arriving meanwhile waits one step, not the whole prefill)."""
        if not self.batching:
            return []
        batch = [i for i, gen in enumerate(gens) if not gen.finished and (self.prefill_chunk or not gen.needs_prefill)]
        return batch if len(batch) > 1 or (batch and gens[batch[0]].needs_prefill) else []

    def generate(
        self, prompt_ids: Sequence[int], params: GenerationParams, draft: str | None = None
    ) -> Iterator[StepOutput]:
        """Steps of one generation until it finishes (a convenience over `start` and `step`)."""
        gen = self.start(prompt_ids, params, draft)
        while not gen.finished:
            yield gen.step()
