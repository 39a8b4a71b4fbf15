"""The engine: a loaded target with its drafters, which starts generations and steps them, alone or batched.

It knows nothing of HTTP: the worker (app.service.scheduler) calls `start` and `step_batch`, and reads each step's
`StepOutput` and each generation's statistics.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import overload

import torch

from app.engine.batch import Batcher
from app.engine.decoding.grammar import GrammarError, Grammars
from app.engine.defaults import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_SCHEDULE,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PREFILL_STEP_SECONDS,
    DEFAULT_PREFIX_CACHE_MB,
    DEFAULT_TENANT_CACHE_SHARE,
)
from app.engine.drafting.base import Drafter
from app.engine.drafting.draft_length import SCHEDULES, StepCosts, VerifyCosts
from app.engine.drafting.suffix_index import TrafficIndex, index_bytes
from app.engine.generation import Generation
from app.engine.memory import kv_cache_bytes
from app.engine.model.tokenizer import Tokenizer
from app.engine.model.transformer import Transformer
from app.engine.prefix_cache import PrefixCache
from app.engine.step import SLACK, GenerationError, GenerationParams, StepOutput, cache_capacity

log = logging.getLogger(__name__)

# Tenants whose drafters' acceptance the engine remembers, the least recently used forgotten.
_TENANT_COSTS = 4096


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


class Engine:
    """A loaded target with its drafters: starts generations, knows nothing of HTTP.

    `draft_schedule` and `draft_p_min` are the defaults of requests that do not say. Every default is
    `app.engine.defaults`', which the server's settings, the CLI and `build_engine` share (tests that need a
    deterministic draft length ask for a fixed one). `prefill_chunk`: prompts are prefilled at most this many
    tokens per step, in the same forward as the other requests' rows (0: each prompt whole, alone, before the
    batch); only where a row's bits do not depend on the rows beside it (`Transformer.rows_independent`), so a
    chunked prompt gets the very cache a whole one does. `prefill_step_seconds` (> 0): chunks are also sized so
    that a step takes about this long, from measured costs, however long the context already is.
    `prefix_cache_mb` (> 0): the keys and values of prompts and answers are kept, up to that much memory, and a
    prompt that starts like one of them prefills only the rest (`app.engine.prefix_cache`); only where rows are
    independent, where a reused block is bit for bit what a fresh prefill computes. `traffic`: the index of earlier
    answers the drafters that look up read (app.engine.drafting.suffix_index), shown in `/info` and the metrics.
    `tenant_cache_share`: the share of the prefix cache each tenant is owed (`PrefixCache`)."""

    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer,
        drafters: dict[str, Drafter],
        default_draft: str = "none",
        num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
        verify_width: int | None = None,
        draft_schedule: str = DEFAULT_DRAFT_SCHEDULE,
        draft_p_min: float = DEFAULT_DRAFT_P_MIN,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        prefill_step_seconds: float = DEFAULT_PREFILL_STEP_SECONDS,
        tree_rows: int = 0,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        traffic: TrafficIndex | None = None,
        tenant_cache_share: float = DEFAULT_TENANT_CACHE_SHARE,
    ) -> None:
        if default_draft != "none" and default_draft not in drafters:
            raise GenerationError(f"default draft {default_draft!r} is not loaded")
        if prefill_chunk < 0 or prefill_step_seconds < 0 or prefix_cache_mb < 0:
            raise GenerationError("prefill_chunk, prefill_step_seconds and prefix_cache_mb must be 0 or more")
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
        # Measured step costs per drafter, and acceptance per drafter and tenant, shared by its requests (adaptive
        # draft length; `StepCosts.fresh`). The seconds of a verification per row count (and context class) are the
        # target's: one for every drafter, which target-only requests fill too (their steps are 1-row verifications),
        # and `calibrate` may seed.
        self._verify_costs = VerifyCosts()
        self._drafter_costs: dict[int, StepCosts] = {}
        self._costs: OrderedDict[tuple[int, str | None], StepCosts] = OrderedDict()
        self._target_costs = StepCosts(self._verify_costs)
        # None: pad decoding forwards to 8 rows in half precision, where a 1-row forward's bits differ (see
        # Generation.plan; 2 rows would do on an AVX2 CPU, and measured no faster end to end), and not at all in
        # float32, where results differ too little to flip a token and padding would cost, nor on the AMX
        # kernels, whose rows depend on nothing but themselves.
        if verify_width is None:
            half = target.dtype in (torch.bfloat16, torch.float16)
            verify_width = 8 if half and not target.rows_independent() else 0
        self.verify_width = verify_width
        self.batcher = Batcher(target, self.prefill_chunk, self.prefill_step_seconds)
        # None where rows depend on the batch (a cached block would then differ in its last bits from a fresh one).
        self.traffic = traffic
        # Told of each finished answer that is not isolated: (tenant, the target's states [>= len(ids) - 1, dim],
        # the whole sequence, the prompt's length); the draft learner's traces (app.distill.online). The buffers
        # are the request's: a listener copies what it keeps.
        self.on_answer: Callable[[str | None, torch.Tensor, Sequence[int], int], None] | None = None
        self.prefix_cache: PrefixCache | None = None
        if self.batching and prefix_cache_mb > 0:
            self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20), tenant_share=tenant_cache_share)

    def drafter(self, name: str | None) -> Drafter | None:
        """The drafter called `name` (None: the default; "none": target-only decoding)."""
        name = self.default_draft if name in (None, "default") else name
        if name == "none":
            return None
        if name not in self.drafters:
            raise GenerationError(f"unknown draft {name!r}; available: none, {', '.join(self.drafters)}")
        return self.drafters[name]

    def kv_bytes(
        self,
        prompt_len: int,
        max_new_tokens: int,
        draft: str | None = None,
        num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
        prediction_tokens: int = 0,
    ) -> int:
        """Bytes a request's generation allocates when it starts and holds to its end: the target's KV cache and
        its draft session's, for the capacity `start` gives it (`cache_capacity`), and the lookup index of its
        prediction of `prediction_tokens` tokens. Raises GenerationError for an unknown `draft`."""
        drafter = self.drafter(draft)
        # As Generation: target-only without a drafter, and no draft session for k = 0.
        k = num_draft_tokens if drafter is not None else 0
        config = self.target.config
        capacity = cache_capacity(prompt_len, max_new_tokens, k, self.verify_width, config.max_seq_len)
        held = kv_cache_bytes(config, capacity, self.target.dtype)
        if drafter is not None and k:
            held += drafter.session_bytes(capacity)
            # Charged as the index charges what it files (an upper bound): a long prediction is no small thing.
            held += index_bytes(prediction_tokens) if prediction_tokens else 0
        return held

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
        costs = self._target_costs if drafter is None else self._tenant_costs(drafter, params)
        grammar = None
        if params.grammar is not None:
            try:
                grammar = self.grammars.start(params.grammar, params.forced_tokens)
            except GrammarError as exc:
                raise GenerationError(f"the grammar cannot be compiled: {exc}") from exc
        gen = Generation(
            self.target,
            self.tokenizer,
            prompt_ids,
            params,
            drafter,
            self.verify_width,
            costs,
            grammar=grammar,
            on_finish=self._file,
        )
        self._reuse(gen)
        return gen

    def _tenant_costs(self, drafter: Drafter, params: GenerationParams) -> StepCosts:
        """The costs a request of `drafter` starts from: its tenant's (an isolated request's own)."""
        wide = self._drafter_costs.setdefault(id(drafter), StepCosts(self._verify_costs))
        if params.isolated:
            return wide.fresh()
        key = (id(drafter), params.cache_salt)
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = wide.fresh()
            while len(self._costs) > _TENANT_COSTS:
                self._costs.popitem(last=False)
        self._costs.move_to_end(key)
        return costs

    def _file(self, gen: Generation) -> None:
        """A finished answer goes into the index of earlier answers, for its tenant's later requests to draft from
        (target-only answers too: what the server wrote, whichever draft the request chose), and with the target's
        states of its positions (where its draft read them) to `on_answer`."""
        if gen.params.isolated:
            return
        if self.traffic is not None and self.traffic.max_bytes:
            self.traffic.add(gen.params.cache_salt, gen.ids, gen.prompt_len)
        if self.on_answer is not None and gen.features is not None:
            self.on_answer(gen.params.cache_salt, gen.features, gen.ids, gen.prompt_len)

    def _reuse(self, gen: Generation) -> None:
        """Load the cached blocks that continue `gen`'s prompt past what its cache holds."""
        # Prompt log-probabilities need every prompt row's hidden state, which the cache does not keep.
        if (
            self.prefix_cache is None
            or not gen.needs_prefill
            or gen.params.prompt_logprobs is not None
            or gen.params.isolated
        ):
            return
        salt = gen.params.cache_salt
        gen.stats.cached_tokens += self.prefix_cache.load(gen.ids, gen.prompt_len, gen.cache, gen.features, salt)

    def _keep(self, gen: Generation) -> None:
        """Cache what `gen` computed: called after a prefill step and when it finishes."""
        if self.prefix_cache is not None and not gen.params.isolated:
            self.prefix_cache.store(gen.ids, gen.cache, gen.features, gen.params.cache_salt)

    @torch.inference_mode()
    def calibrate(self, rows: int | None = None, context: int = 32) -> dict[int, float]:
        """Time a verification of 1..`rows` rows (default num_draft_tokens + 1: a plain step up to the longest
        draft's) once, and seed the verification costs every drafter's adaptive schedule reads with them, so
        that the first requests choose their draft lengths from this machine's costs rather than from a short
        first draft and a guessed cost per row. Optional (without it the first steps measure) and cheap (0.3 s
        for the 135M target on AVX2): a `context`-token prompt, then two forwards of each row count, padded as
        decoding pads them, the faster kept (the first of a shape can be slow). Replaces what was measured for
        those row counts; returns the seconds. Where requests are batched, batched forwards too
        (`Batcher.calibrate`), so that the first batches choose their draft lengths from measured prices rather
        than each request as though alone (which drafts where a batch cannot pay)."""
        rows = max(1, min(rows or self.num_draft_tokens + 1, SLACK))
        cache = self.target.new_cache(min(self.target.config.max_seq_len, context + rows + SLACK))
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
        self._verify_costs.seed(seconds, context)
        if self.batching:
            self.batcher.calibrate(context)
        return seconds

    @torch.inference_mode()
    def step_batch(self, gens: Sequence[Generation]) -> BatchStep:
        """One step of every generation in `gens`, the decoding ones verified in ONE target forward.

        Draft lengths are chosen for the batch as a whole (`batch_draft_lengths`), and requests of a drafter
        that drafts several at once share its forwards; then the target runs all their rows together, prompts'
        prefill chunks beside (`Batcher`), reading its weights once instead of once per request, and each
        request verifies its own rows. Returns, per generation, its step's output or the exception that ended
        it (one request's failure leaves the others untouched), and which of them ran in the shared forward.
        Greedy tokens are the same as with `Generation.step`.
        """
        results: dict[int, StepOutput | Exception] = {}
        prefilling = [gen.needs_prefill for gen in gens]
        if self.prefix_cache is not None:
            for gen, prefills in zip(gens, prefilling, strict=True):
                if prefills:  # what another request computed since this one's last step
                    self._reuse(gen)
        batch = self.together(gens)
        for i, gen in enumerate(gens):
            if i not in batch:
                try:
                    results[i] = gen.step()
                except Exception as exc:
                    results[i] = exc
        if batch:
            results.update(zip(batch, self.batcher.step([gens[i] for i in batch]), strict=True))
        if self.prefix_cache is not None:
            for i, gen in enumerate(gens):
                out = results[i]
                if not isinstance(out, Exception) and (prefilling[i] or out.finish_reason is not None):
                    self._keep(gen)
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
