"""The batched step: several generations drafted, run through the target in ONE forward, and verified.

`Engine.step_batch` hands the generations that can share a forward to its `Batcher`, which owns what only a
batch needs: the draft lengths chosen for the batch as a whole, drafting several requests in one draft
forward, the prompt chunks of chunked prefill and the costs measured on batched forwards. It reads each
generation through its small public surface (`Generation.cache`, `plan`, `verify`, `next_prompt_chunk`,
`prefilled`, `draft_length`, `draft_session`, `p_min`, `max_draft`), as TGI's `Batch` stands between its
scheduler and its model.
"""

from __future__ import annotations

import math
import time

import torch

from app.engine.drafting.draft_length import BatchCosts, batch_draft_lengths, is_lookup
from app.engine.generation import Generation
from app.engine.model.transformer import Transformer
from app.engine.step import StepOutput, StepPlan, TreePlan


def row_keys(target: Transformer) -> float:
    """How many cached keys one row's attention reads for the multiply-adds of that row's products (the
    linear layers): the context at which attention costs a row as much again."""
    c = target.config
    products = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads) + 3 * c.dim * c.intermediate_size
    return products / (2 * c.n_heads * c.head_dim)


# Prefill's least share of a step beside decoding, in units of work relative to the decoding rows' (1.0: a step
# that decodes D units also prefills at least D while prompts wait: a prompt's prefill then runs at half the
# machine's speed or more, and the decoding rows wait at most twice their own forward between tokens).
PREFILL_SHARE = 1.0
# The part of the step's prefill budget the oldest prompt still prefilling has first claim on (docs/service.md).
OLDEST_SHARE = 0.5
# What `Batcher.calibrate` times: forwards of these many sequences of one row, and of _CALIBRATION_WIDE sequences of
# _CALIBRATION_ROWS rows.
_CALIBRATION_SEQS = (2, 4, 8)
_CALIBRATION_WIDE = 4
_CALIBRATION_ROWS = 3


class Batcher:
    """Steps generations together in one target forward; created by `Engine`, which decides who joins.

    `prefill_chunk` (> 0): prompts are prefilled at most that many tokens per step beside the decoding rows;
    `prefill_step_seconds` (> 0): chunks are sized from measured costs so a step takes about that long."""

    def __init__(self, target: Transformer, prefill_chunk: int, prefill_step_seconds: float) -> None:
        self.target = target
        self.prefill_chunk = prefill_chunk
        self.prefill_step_seconds = prefill_step_seconds
        self.row_keys = row_keys(target)
        # Measured seconds per unit of work (`units`) of batched forwards; None until one was measured.
        self.unit_seconds: float | None = None
        # Measured seconds of batched target forwards, sequences and rows apart (the draft lengths of a batch weigh
        # them).
        self._batch_costs = BatchCosts()
        # Measured seconds per drafted token when a drafter drafts for several requests at once, per drafter.
        self._batch_draft_step: dict[int, float] = {}

    def calibrate(self, context: int) -> None:
        """Time batched forwards after a `context`-token prompt, as `_forward` runs them: 2, 4 and 8 sequences of
        one row, and 4 of `_CALIBRATION_ROWS` rows (what a further row costs), each twice, the faster kept; and
        seed the batch's costs with them where no batch measured yet. The first batches then size their drafts
        from this machine's prices of a sequence and of a row, not from a single request's."""
        device = self.target.device
        caches = []
        for _ in range(max(_CALIBRATION_SEQS)):
            cache = self.target.new_cache(min(self.target.config.max_seq_len, context + _CALIBRATION_ROWS + 8))
            self.target.hidden(torch.ones((1, context), dtype=torch.long, device=device), 0, cache)
            caches.append(cache)

        def timed(seqs: int, rows: int) -> float:
            best = math.inf
            for _ in range(2):
                feeds = [(torch.ones(rows, dtype=torch.long, device=device), context, c) for c in caches[:seqs]]
                t0 = time.perf_counter()
                hidden = self.target.hidden_batch(feeds)
                float(self.target.logits(torch.cat(hidden)).float().sum())
                best = min(best, time.perf_counter() - t0)
                for c in caches[:seqs]:
                    c.truncate(context)
            return best

        seqs = {n: timed(n, 1) for n in _CALIBRATION_SEQS}
        wide = timed(_CALIBRATION_WIDE, _CALIBRATION_ROWS)
        row = max(0.0, wide - seqs[_CALIBRATION_WIDE]) / (_CALIBRATION_WIDE * (_CALIBRATION_ROWS - 1))
        self._batch_costs.seed(seqs, row, context)

    def step(self, gens: list[Generation]) -> list[StepOutput | Exception]:
        """One step of each of `gens` in one target forward: the decoding ones drafted and verified, the
        prefilling ones a prompt chunk each (or nothing, when the step's budget is spent). Per generation its
        output or the exception that ended it."""
        results: list[StepOutput | Exception | None] = [None] * len(gens)
        decoding = [j for j, gen in enumerate(gens) if not gen.needs_prefill]
        planned = self._plan([gens[j] for j in decoding])
        plans: list[tuple[int, StepPlan]] = []
        for j, plan in zip(decoding, planned, strict=True):
            if isinstance(plan, StepPlan):
                plans.append((j, plan))
            else:
                results[j] = plan
        chunks: list[tuple[int, torch.Tensor, int]] = []
        prefilling = [j for j, gen in enumerate(gens) if gen.needs_prefill]
        sizes = self.chunk_sizes([gens[j] for j in prefilling], [plan for _, plan in plans])
        for j, size in zip(prefilling, sizes, strict=True):
            if size:
                feed, start = gens[j].next_prompt_chunk(size)
                chunks.append((j, feed, start))
            else:  # no budget left this step: it waits for the next
                results[j] = StepOutput([], "", 0, 0, 0.0, 0.0)
        if plans or chunks:
            self._forward(gens, plans, chunks, results)
        return [r if r is not None else RuntimeError("no step ran") for r in results]

    def units(self, rows: int, start: int) -> float:
        """The work of `rows` rows at positions start.. in units of one row at position 0: each row's products,
        plus its attention over the keys before it, `row_keys` keys costing one row's products."""
        return rows * (1.0 + (start + (rows - 1) / 2) / self.row_keys)

    def rows_within(self, units: float, start: int) -> int:
        """The most rows from position `start` whose `units` stay within `units` (the root of a quadratic)."""
        a, b = 0.5 / self.row_keys, 1.0 + (start - 0.5) / self.row_keys
        n = int((-b + math.sqrt(b * b + 4 * a * units)) / (2 * a))
        while n > 0 and self.units(n, start) > units:  # rounding
            n -= 1
        return n

    def chunk_sizes(self, prompts: list[Generation], plans: list[StepPlan]) -> list[int]:
        """Prompt tokens each prefilling generation runs this step, within the step's budget: `prefill_chunk`
        tokens, and with `prefill_step_seconds` while requests decode (`plans`) what the measured seconds per unit
        of work leave beside their rows, but never less than `PREFILL_SHARE` of the decoding rows' own work:
        however many requests decode, prompts keep moving at a known fraction of the machine's speed.

        `prompts` come in the order they started (the scheduler's). The oldest has first claim on `OLDEST_SHARE`
        of the budget (tokens and work); the rest goes to the shortest prompts left first, the oldest included
        (a short request is not held behind long ones, and a stream of short ones cannot starve a long one)."""
        cap = self.prefill_chunk
        # Without a step time, or with no stream decoding (whose pause the time bounds), the budget is cap tokens
        # whatever they cost: a prompt alone, cut to a step time's chunks (a few dozen tokens on a big model),
        # would read every weight once per chunk and wait on those reads (docs/bench, chunked prefill).
        units = math.inf
        if self.prefill_step_seconds and plans:
            if self.unit_seconds is None:  # nothing measured yet: a modest first chunk, which measures
                units = float(min(cap, 64))
            else:
                decoding = sum(self.units(p.real, p.start) for p in plans)
                units = max(self.prefill_step_seconds / self.unit_seconds - decoding, PREFILL_SHARE * decoding)
            # However busy the step, each one moves a prompt along by some tokens.
            units = max(units, min(cap, 16))
        sizes = [0] * len(prompts)
        budget = [units, cap]  # work and tokens left this step

        def grant(i: int, most_units: float, most_tokens: int) -> None:
            start = prompts[i].cache.length + sizes[i]
            left = prompts[i].prompt_len - start
            if left <= 0 or most_tokens <= 0 or most_units < 1:
                return
            n = min(left, most_tokens, max(1, self.rows_within(most_units, start)) if most_units < math.inf else left)
            sizes[i] += n
            budget[0] -= self.units(n, start)
            budget[1] -= n

        if len(prompts) > 1:
            grant(0, units * OLDEST_SHARE, max(1, int(cap * OLDEST_SHARE)))
        order = sorted(range(len(prompts)), key=lambda i: prompts[i].prompt_len - prompts[i].cache.length - sizes[i])
        for i in order:
            if budget[0] < 1 or budget[1] <= 0:
                break
            grant(i, budget[0], budget[1])
        return sizes

    def _plan(self, gens: list[Generation]) -> list[StepPlan | Exception]:
        """Draft lengths chosen for the batch as a whole, the drafts (batched where a drafter can), and each
        request's rows; an exception in place of a request whose drafting failed."""
        limits = [gen.params.max_new_tokens - gen.stats.generated_tokens - 1 for gen in gens]
        # What each request drafts: a lookup's tokens found now (free), or its model's, sized below.
        failed: list[StepOutput | Exception | None] = [None] * len(gens)
        choices: list[tuple[str, int, dict[str, list[int]] | None]] = []
        for j, (gen, limit) in enumerate(zip(gens, limits, strict=True)):
            try:
                choices.append(gen.batch_choice(limit))
            except Exception as exc:  # this request ends; the others step on
                failed[j] = exc
                choices.append((gen.draft_length.kind, 0, None))
        kinds = [kind for kind, _, _ in choices]
        limits = [most for _, most, _ in choices]
        # Greedy requests of a drafter that drafts several at once share one draft forward per position: its
        # seconds measured on batched drafts when there were, else one solo step. A lookup's tokens are had.
        groups = [
            id(gen.drafter) if self._drafts_in_batch(gen) and not is_lookup(kind) else None
            for gen, kind in zip(gens, kinds, strict=True)
        ]
        steps = [
            self._batch_draft_step.get(key, gen.draft_length.costs.draft_step)
            if key is not None
            else gen.draft_length.costs.draft_step
            for gen, key in zip(gens, groups, strict=True)
        ]
        lengths = [gen.draft_length for gen in gens]
        context = round(sum(length.context for length in lengths) / len(lengths)) if lengths else 0
        ks = batch_draft_lengths(lengths, limits, self._batch_costs, 0, steps, groups, context, kinds)
        ks = [k if gen.max_draft and failed[j] is None else 0 for j, (gen, k) in enumerate(zip(gens, ks, strict=True))]
        drafted = self._draft(gens, ks, groups, failed)
        plans: list[StepPlan | Exception] = []
        for j, (gen, k) in enumerate(zip(gens, ks, strict=True)):
            problem = failed[j]
            if isinstance(problem, Exception):
                plans.append(problem)
                continue
            try:
                kind, _, found = choices[j]
                plans.append(gen.plan(0, k, drafted.get(j), (kind, found) if found is not None else None))
            except Exception as exc:
                plans.append(exc)
        return plans

    def _forward(
        self,
        gens: list[Generation],
        plans: list[tuple[int, StepPlan]],
        chunks: list[tuple[int, torch.Tensor, int]],
        results: list[StepOutput | Exception | None],
    ) -> None:
        """One target forward over every planned request's rows and every prompt chunk, then each request's
        own verification (or prefill), into `results` by request index. A failure of the shared forward ends
        every request in it."""
        t0 = time.perf_counter()
        members = [j for j, _ in plans] + [j for j, _, _ in chunks]
        try:
            hidden = self.target.hidden_batch(
                [(plan.feed, plan.start, gens[j].cache, _parents(plan)) for j, plan in plans]
                + [(feed, start, gens[j].cache) for j, feed, start in chunks]
            )
            # The head runs on every verified row, and on a prompt's last row once the prompt is all in.
            done = [start + feed.shape[0] == gens[j].prompt_len for j, feed, start in chunks]
            heads = hidden[: len(plans)] + [h[-1:] for h, last in zip(hidden[len(plans) :], done, strict=True) if last]
            # One head product for every row of the batch: its weights (a fifth of the model) read once.
            logits = list(self.target.logits(torch.cat(heads)).split([h.shape[0] for h in heads])) if heads else []
        except Exception as exc:
            for j in members:
                results[j] = exc
            return
        seconds = time.perf_counter() - t0
        if plans and not chunks:  # what the draft lengths weigh: forwards of verified rows alone, at their mean context
            context = round(sum(plan.start for _, plan in plans) / len(plans))
            self._batch_costs.observe(len(plans), sum(plan.feed.shape[0] for _, plan in plans), seconds, context)
        units = sum(self.units(p.feed.shape[0], p.start) for _, p in plans)
        units += sum(self.units(feed.shape[0], start) for _, feed, start in chunks)
        if self.prefill_step_seconds and units >= 8:  # a forward of a few rows says little of a big one's cost
            per = seconds / units
            self.unit_seconds = per if self.unit_seconds is None else 0.7 * self.unit_seconds + 0.3 * per
        for (j, plan), h, lg in zip(plans, hidden[: len(plans)], logits[: len(plans)], strict=True):
            try:
                results[j] = gens[j].verify(plan, h, lg, seconds, solo=False)
            except Exception as exc:
                results[j] = exc
        last_logits = iter(logits[len(plans) :])
        for (j, _, start), h, last in zip(chunks, hidden[len(plans) :], done, strict=True):
            try:
                results[j] = gens[j].prefilled(start, h, next(last_logits)[0] if last else None, seconds)
            except Exception as exc:
                results[j] = exc

    def _draft(
        self,
        gens: list[Generation],
        ks: list[int],
        groups: list[int | None],
        results: list[StepOutput | Exception | None],
    ) -> dict[int, tuple[list[int], float]]:
        """Greedy drafts of the requests of each key of `groups` (a drafter that drafts several at once), by
        request index: (tokens, that request's share of the seconds). A failure ends the requests of that
        drafter's batch."""
        together: dict[int, list[int]] = {}
        for j, (gen, k, key) in enumerate(zip(gens, ks, groups, strict=True)):
            if k > 0 and gen.draft_session is not None and key is not None:
                together.setdefault(key, []).append(j)
        drafted: dict[int, tuple[list[int], float]] = {}
        for key, js in together.items():
            if len(js) < 2:
                continue
            drafter = gens[js[0]].drafter
            t0 = time.perf_counter()
            try:
                assert drafter is not None and drafter.batches
                out = drafter.propose_batch(
                    [gens[j].draft_session for j in js],
                    [gens[j].ids for j in js],
                    [ks[j] for j in js],
                    [gens[j].p_min for j in js],
                )
            except Exception as exc:
                for j in js:
                    results[j] = exc
                continue
            seconds = time.perf_counter() - t0
            # Seconds per draft position (one batched draft forward): what batch_draft_lengths prices with.
            per = seconds / max(ks[j] for j in js)
            old = self._batch_draft_step.get(key)
            self._batch_draft_step[key] = per if old is None else 0.9 * old + 0.1 * per
            for j, tokens in zip(js, out, strict=True):
                drafted[j] = (tokens, seconds / len(js))
        return drafted

    @staticmethod
    def _drafts_in_batch(gen: Generation) -> bool:
        """Whether `gen` drafts in its drafter's batched forward when a batch has several such requests (a
        request verifying trees drafts its own: `propose_batch` drafts chains)."""
        return gen.sampling.greedy and gen.drafter is not None and gen.drafter.batches and not gen.tree_rows


def _parents(plan: StepPlan) -> torch.Tensor | None:
    """A tree plan's parents (int32 [rows]), what `Transformer.hidden_batch` takes; None for a chain."""
    return plan.tree.parents_tensor() if isinstance(plan, TreePlan) else None
