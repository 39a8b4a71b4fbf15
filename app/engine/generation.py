"""One request's speculative decoding: KV-cached drafting and verification, step by step.

A `Generation` advances by `step()` (alone) or by `plan` / `verify` / `prefilled` (as one member of a batch,
app.engine.batch): the drafter proposes up to k tokens, the target verifies them in one forward over
[last accepted token, drafts...], the accepted prefix plus the target's own next token (a correction, or a
bonus when everything was accepted) is appended, and both KV caches roll back past the rejected positions by
moving a length. Greedy output is token for token the target's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from app.engine.decoding.chooser import make_chooser
from app.engine.decoding.detokenizer import Detokenizer
from app.engine.decoding.grammar import GrammarState, mask_logits
from app.engine.decoding.logprobs import TokenLogprob, token_logprobs
from app.engine.decoding.penalties import Penalty
from app.engine.defaults import DEFAULT_LOOKUP_DRAFT_TOKENS, MAX_DRAFT_TOKENS
from app.engine.drafting.base import Drafter, DraftSession
from app.engine.drafting.draft_length import DraftLength, StepCosts, is_lookup, named_lookup
from app.engine.drafting.loop import NetworkSession
from app.engine.drafting.tree import TreeShape, compact, row_value
from app.engine.drafting.tree import accept as accept_tree
from app.engine.model.cache import KVCache
from app.engine.model.tokenizer import Tokenizer
from app.engine.model.transformer import Transformer
from app.engine.step import (
    GenerationError,
    GenerationParams,
    GenerationStats,
    NumericalError,
    StepOutput,
    StepPlan,
    TreePlan,
    cache_capacity,
    check_request,
)


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
        on_finish: Callable[[Generation], None] | None = None,
    ) -> None:
        limit = target.config.max_seq_len
        vocab = target.config.vocab_size
        self.sampling = check_request(prompt_ids, params, vocab, limit)
        schedule = params.draft_schedule or "fixed"
        p_min = params.draft_p_min or 0.0
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
        self.stats.schedule = schedule if self._k else "none"
        self.stats.p_min = p_min if self._k else 0.0
        self._p_min = p_min
        self._width = verify_width
        capacity = cache_capacity(len(prompt_ids), params.max_new_tokens, self._k, verify_width, limit)
        self._cache: KVCache = target.new_cache(capacity)
        self._cache.fixed_span = verify_width > 0
        self.drafter = drafter
        self._draft: DraftSession | None = drafter.session(capacity) if drafter is not None and self._k else None
        lookup_only = self._draft is not None and self._draft.looks_up and self._draft.model is None
        lookup_k = DEFAULT_LOOKUP_DRAFT_TOKENS if params.lookup_draft_tokens is None else params.lookup_draft_tokens
        self._length = DraftLength(
            schedule, self._k, costs or StepCosts(), "lookup" if lookup_only else "model", lookup_k if self._k else 0
        )
        self._length.context = len(prompt_ids) - 1
        if self._draft is not None:
            # The rejection sampler's text depends on its drafts: no drafts from other requests' answers, so that its
            # seed gives the same text whatever the server answered before.
            # An isolated request reads no other request's answers either.
            history = (self.sampling.greedy or params.sampler != "rejection") and not params.isolated
            self._draft.start(len(prompt_ids), params.cache_salt, params.prediction, history)
        # A feature-conditioned draft reads the target's final hidden state of every verified position.
        self._features = self._draft.features if self._draft is not None else None
        self._penalty: Penalty | None = None
        if not params.penalties.neutral:
            self._penalty = Penalty(params.penalties, prompt_ids, vocab, target.device)
        if (params.grammar is None) != (grammar is None):
            raise GenerationError("a grammar state comes with its spec: Engine.start builds both")
        self._grammar = grammar
        if self._draft is not None:
            self._draft.constrain(self._penalty, grammar)
        # With a grammar an end-of-sequence token comes only once it is complete, and then it ends the generation
        # whatever ignore_eos and min_tokens say (the grammar allows nothing after it).
        self._grammar_end = tokenizer.eos_token_ids if grammar is not None else frozenset()
        self._detok = Detokenizer(tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
        self._eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self._stop_ids = frozenset(params.stop_token_ids)
        # Greedy, Gumbel or rejection: chosen once, asked at every step.
        self._choose = make_chooser(self.sampling, params.sampler, params.seed, vocab, target.device)
        self.seed = self._choose.seed  # the seed actually used; None under greedy decoding
        self._tree_rows = self._tree_rows_allowed(params.tree_rows or 0)
        # On the adaptive schedule a lookup is made before the draft length is chosen: what it found, and whether
        # it pays to verify, decide the step (a tree takes the lookup's continuation in with the model's).
        self._lookup_first = schedule == "adaptive" and self._draft is not None and self._draft.looks_up
        self._lookup_first = self._lookup_first and not self._tree_rows
        # Whether this request's drafter drafted before. Its first draft runs over the prompt's window, a cost of
        # the request, not of the tokens drafted then; every later one is timed whole, catching up on the tokens
        # since its last draft included: a hybrid that returns to its model draft after lookups or plain steps
        # pays that catch-up (and the draft's weights read again from memory) each time, and a price without it
        # drafted by a model that did not pay for itself (docs/architecture.md, Draft length).
        self._drafted_before = False
        # The prompt's log-probabilities gathered chunk by chunk, sent with the first token (None: not asked).
        self._prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self._started = time.perf_counter()
        self._on_finish = on_finish  # told of the finished generation (the engine files its answer)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """The request was given up before it finished (its client gone, a timeout, a failure): its drafter hears
        of it. Nothing happens to a finished generation."""
        if not self.finished and self._draft is not None:
            self._draft.cancel()

    def _tree_rows_allowed(self, rows: int) -> int:
        """The rows this request's tree verifications may have (0: it verifies chains)."""
        kernel = self._cache.kernel
        # A tree row gets sequential decoding's bits only where the kernel's attention reads its keys in order;
        # penalties and grammars judge each row by the text before it, which a tree's rows do not share.
        exact = kernel is not None and kernel.trees and self._penalty is None and self._grammar is None
        sampler = self._choose.name in ("greedy", "gumbel")
        trees = self._draft is not None and self._draft.trees
        return rows if rows > 1 and exact and sampler and trees else 0

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
    def features(self) -> torch.Tensor | None:
        """The target's final hidden state of each computed position [capacity, dim], where a feature draft reads
        them; None otherwise."""
        return self._features

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

    def batch_choice(self, limit: int) -> tuple[str, int, dict[str, list[int]] | None]:
        """What a batch sizes this step's draft by (app.engine.batch): the kind of draft, the most tokens it can
        have (at most `limit`), and every lookup's proposal by kind (None: this request does not look up first).
        A request that looks up first proposes now, at no cost: the lookup of the most expected tokens where any
        found some, else its model draft, else nothing; the others draft as their drafter does."""
        if not self._lookup_first:
            return self._length.kind, limit, None
        if limit <= 0:
            return self._length.kind, 0, {}
        session = self._draft
        assert session is not None
        found = self._lookups(limit)
        if found:
            kind = max(found, key=lambda kind: self._length.expected(len(found[kind]), kind))
            return kind, len(found[kind]), found
        return ("model", limit, found) if session.model is not None else (self._length.kind, 0, found)

    def plan(
        self,
        width: int,
        k: int | None = None,
        drafted: tuple[list[int], float] | None = None,
        choice: tuple[str, dict[str, list[int]]] | None = None,
    ) -> StepPlan:
        """Draft this step's tokens and lay out the target's rows: [last token, drafts..., padding].

        `width`: rows to pad to (0: none); `k`: the draft length when a batch chose it, else this request's
        own schedule chooses; `drafted`: (tokens, seconds) when a batch drafted them (greedy) already; `choice`:
        the kind and the lookups' proposals of `batch_choice`, with `k` of that kind."""
        remaining = self.params.max_new_tokens - self.stats.generated_tokens
        t0 = time.perf_counter()
        found: list[int] | None = None  # a lookup's tokens, chosen before any draft ran
        lookups: dict[str, list[int]] = {}  # every lookup's proposal by kind, for verification's evidence
        kind = self._length.kind
        chosen = k is None and self._lookup_first  # the kind is known from the choice
        if choice is not None and k is not None:
            kind, lookups = choice
            found = lookups[kind][:k] if k and kind in lookups else None
            chosen = True
        if k is None:
            # A step adds up to k+1 tokens; never draft what could not be kept.
            if chosen:
                k, kind, found, lookups = self._choose_with_lookup(remaining - 1)
            else:
                k = self._length.next_k(remaining - 1) if self._k else 0
                if self._k and self._length.kind == "lookup":  # prompt lookup alone: its cost probes
                    k = self._length.cost_probe(k, min(self._length.max_k, remaining - 1))
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
                session = self._draft.model if chosen and self._draft is not None else None
                drafts, q = self._propose(k, session)
            draft_seconds = time.perf_counter() - t0
        if not chosen and k > 0 and self._draft is not None and self._draft.looks_up and self._draft.used_lookup:
            # A hybrid asked for k tokens (a batch's, or a fixed length) and its lookup had them.
            kind = self._draft.last_kind
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
        return StepPlan(k, drafts, q, start, real, feed, draft_seconds, refused, forced, kind, lookups)

    def _lookups(self, limit: int) -> dict[str, list[int]]:
        """Every lookup's proposal of up to `limit` tokens (at most the lookup cap), by kind: one per kind, the
        first source's on a tie. Only for a session that looks up first."""
        assert self._draft is not None and self._draft.looks_up
        proposals = self._draft.proposals(self.ids, min(self._length.lookup_cap, limit))
        return {p.kind: p.tokens for p in reversed(proposals)}

    def _choose_with_lookup(self, limit: int) -> tuple[int, str, list[int] | None, dict[str, list[int]]]:
        """The adaptive choice of a session that looks up first: (k, its kind, the lookup's tokens to verify or
        None, every lookup's proposal by kind). Verifying some of a lookup's tokens (free to propose: only their
        rows cost) and a model draft are priced each with its own acceptance; the one expected to yield more
        tokens per second is drafted, none when a plain step yields more (bar a probe). A lookup wins a tie, and
        while the model's step is not yet measured."""
        session = self._draft
        assert session is not None and session.looks_up
        if limit <= 0:
            return 0, self._length.kind, None, {}
        found = self._lookups(limit)
        choices: list[tuple[str, int | None]] = [(kind, len(tokens)) for kind, tokens in found.items()]
        if session.model is not None:
            choices.append(("model", None))
        options: list[tuple[float, int, str]] = []
        for kind, available in choices:
            k = self._length.next_k(limit, kind, available)
            if available is not None and self._length.cost_probe(k, available, kind) > k:
                return available, kind, found[kind][:available], found  # verify all it had: what do its rows cost
            if k:
                options.append((self._length.rate(k, kind) or 0.0, k, kind))
            elif named_lookup(kind) is None:  # a named lookup kind learns without drafting: no probes
                self._length.idle(kind)
        if not options:
            return 0, self._length.kind, None, found
        _, k, kind = max(options, key=lambda option: option[0])  # the first best: lookups before the model
        return k, kind, found[kind][:k] if kind != "model" else None, found

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
        # Tokens are chosen from the penalised logits (row i over the context plus drafts[:i]); log-probabilities
        # stay the raw distribution's.
        chosen = logits if self._penalty is None else self._penalty.apply(logits, drafts)
        checked, q = drafts, plan.q
        if self._grammar is not None:
            # Row i masked by the grammar after the accepted text plus drafts[:i], after the penalties; a draft it
            # refuses ends acceptance there (its masked logit is -inf: no verification could keep it anyway), and
            # counts as drafted and rejected.
            allowed, valid = self._grammar.masks(drafts)
            checked = drafts[:valid]
            q = None if q is None else q[:valid]
            chosen = mask_logits(chosen[: valid + 1], allowed)
        accepted, nxt = self._choose.verify(checked, q, chosen, start + 1)
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
        self.stats.refused += plan.refused
        if proposed:
            self._count_draft(plan.kind, proposed, kept_own)
        self.stats.draft_seconds += plan.draft_seconds
        self.stats.verify_seconds += verify_seconds
        k = plan.k
        new = [*drafts[:accepted], nxt]
        # How far each lookup's proposal agrees with the target's tokens: free evidence of its kind's acceptance,
        # past what was drafted too (a drafted lookup's next token against the bonus), so that one-token drafts
        # still teach how long a match goes on, and a lookup not drafted still shows whether it would have paid.
        tested = {kind: (min(len(t), len(new)), _agreed(t, new)) for kind, t in plan.lookups.items()}
        for kind, (n, agreed) in tested.items():
            if kind != plan.kind or k == 0:
                self._length.observe(n, agreed, kind)
        if k > 0:
            self._count_length(k)
            self.stats.p_min_stops += proposed < k
            if plan.kind in tested and not plan.refused and not kept_forced:
                self._length.update(*tested[plan.kind], plan.kind)
            else:
                self._length.update(proposed, kept_own, plan.kind)
        elif not solo and self._k and self.params.max_new_tokens - self.stats.generated_tokens > 1:
            # A batch chose not to draft for this request. (Alone, the schedule's own 0 was counted by `plan`.)
            self._length.rest()
        # A draft that stopped for lack of confidence still ran one more step than it proposed. A batch's
        # times are the whole batch's: they say nothing of what drafting or verifying this request alone costs.
        steps = self._timed_draft_steps(plan, min(k, proposed + 1))
        self._length.probed(real, verify_seconds if solo else None)
        if solo:
            self._length.costs.observe(steps, plan.draft_seconds, real, verify_seconds, start)
        drafted_by = "lookup" if is_lookup(plan.kind) else "draft"
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
        assert self._draft is not None and self._draft.trees
        start = len(self.ids) - 1
        rows = min(self._tree_rows, self._cache.capacity - start)
        # Model nodes whose value (expected accepted tokens) is below what a row costs are left out: where rows
        # cost (AVX2: a 16-row pass takes about 3x a 1-row one) the tree stays small, where they are free it fills.
        floor = row_value(self._length.costs, self.stats.tokens_per_target_pass, k + 1, start)
        shape = TreeShape(k, rows, self._choose.params, self._choose.noise, self._p_min, floor)
        tree = self._draft.propose_tree(self.ids, shape)
        feed = torch.tensor(tree.tokens, dtype=torch.long, device=self.target.device)
        seconds = time.perf_counter() - t0
        return TreePlan(k, tree.tokens[1:], None, start, tree.rows, feed, seconds, tree=tree)

    def _verify_tree(
        self, plan: TreePlan, hidden: torch.Tensor, logits: torch.Tensor, forward_seconds: float, solo: bool
    ) -> StepOutput:
        """`verify` of a tree: the longest path the target agrees with (`app.engine.drafting.tree.accept`) and its token
        after it; the path's keys and values moved where sequential decoding puts them, and its hidden states
        given to a feature draft in depth order. `drafted` counts the tree's nodes."""
        t0 = time.perf_counter()
        tree, start = plan.tree, plan.start
        logits = self._checked(logits[: tree.rows])
        path, nxt = accept_tree(tree, logits, self.sampling, self._choose.noise, start + 1)
        rows = [0, *path]
        if self._features is not None:
            self._features[start : start + len(rows)] = hidden[rows]
        compact(self._cache, start, path)
        accepted = len(path)
        verify_seconds = forward_seconds + time.perf_counter() - t0
        self.stats.target_passes += 1
        self.stats.verify_passes += bool(tree.nodes)
        if tree.nodes:
            self._count_draft("model", tree.nodes, accepted)
        self.stats.draft_seconds += plan.draft_seconds
        self.stats.verify_seconds += verify_seconds
        if plan.k > 0:
            self._count_length(plan.k)
            self.stats.p_min_stops += tree.depth < plan.k
            # Acceptance along the depth, as a chain of the tree's depth would count it.
            self._length.update(tree.depth, accepted)
        steps = self._timed_draft_steps(plan, min(plan.k, tree.depth + 1))
        if solo:
            self._length.costs.observe(steps, plan.draft_seconds, tree.rows, verify_seconds, start)
        new = [*(tree.tokens[r] for r in path), nxt]
        # The target's token is a bonus after a leaf (every drafted token on its path accepted), else a correction.
        last = "target" if not tree.nodes else "correction" if tree.children(rows[-1]) else "bonus"
        sources = [*(tree.source(r) for r in path), last]
        # The rows that chose them: the root's (the first), then each accepted node's.
        n = self.params.logprobs
        logprobs = None if n is None else token_logprobs(logits[rows], new, n)
        return self._emit(new, tree.nodes, accepted, plan.draft_seconds, verify_seconds, logprobs, sources)

    def _count_draft(self, kind: str, proposed: int, kept: int) -> None:
        """A verified draft of `kind`: `proposed` tokens of which the first `kept` were kept."""
        stats = self.stats
        stats.drafted += proposed
        stats.accepted += kept
        # A lookup may draft further than num_draft_tokens: the per-position counts grow to its length.
        if len(stats.accepted_per_position) < kept:
            stats.accepted_per_position.extend([0] * (kept - len(stats.accepted_per_position)))
        for i in range(kept):
            stats.accepted_per_position[i] += 1
        named = named_lookup(kind)
        source = named[0] if named is not None else "prompt" if kind == "lookup" else "model"
        stats.draft_sources[source] = stats.draft_sources.get(source, 0) + 1
        if source == "prediction":
            stats.accepted_prediction_tokens += kept
            stats.rejected_prediction_tokens += proposed - kept

    def _count_length(self, k: int) -> None:
        lengths = self.stats.draft_lengths
        if len(lengths) <= k:
            lengths.extend([0] * (k + 1 - len(lengths)))
        lengths[k] += 1

    def _timed_draft_steps(self, plan: StepPlan, steps: int) -> int:
        """The draft steps whose seconds `plan.draft_seconds` measures: `steps`, or 0 where they measure no draft
        step of this request's drafter: its first draft (see `_drafted_before`), and a hybrid's lookup (its
        microseconds would make the model draft look free)."""
        own = plan.k > 0 and plan.kind == self._length.kind
        timed = own and self._drafted_before
        self._drafted_before = self._drafted_before or own
        return steps if timed else 0

    def _propose(self, k: int, session: DraftSession | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Up to `k` drafted tokens (and their q when sampling with a generator), from `session` (default: the
        request's draft session; a hybrid's model part when its lookup was passed over)."""
        draft = session if session is not None else self._draft
        if draft is None or k <= 0:
            return [], None
        params = self._choose.params
        model = getattr(draft, "model", None) or draft  # a hybrid's model part, or the draft itself
        if isinstance(model, NetworkSession):
            model.value_min = self._length.value_floor() if params is None else 0.0
        if params is None:
            return draft.propose(self.ids, k, self._p_min), None
        return draft.propose_sampled(self.ids, k, params, self._choose.rng, self._p_min)

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
        nxt = self._choose.first(chosen, len(self.ids))
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
        self._length.context = len(self.ids) - 1  # the next verification's first row follows these keys
        if self._penalty is not None:
            self._penalty.accept(new)
        if self._grammar is not None and finish is None:  # nothing comes after a finished generation's last token
            self._grammar.accept(new)
        self.stats.generated_tokens += len(new)
        if finish is not None:
            self.finish_reason = finish
            text += self._detok.flush()
            self.stats.total_seconds = time.perf_counter() - self._started
            if self._draft is not None:
                self._draft.finish(self.ids)
            if self._on_finish is not None:
                self._on_finish(self)
        # Only the tokens kept (not those past the end, an end-of-sequence token or a stop string) have theirs.
        kept = None if logprobs is None else logprobs[: len(new)]
        return StepOutput(
            new,
            text,
            drafted,
            accepted,
            draft_s,
            verify_s,
            finish,
            kept,
            sources=(sources or [])[: len(new)],
            pieces=self._detok.pieces(len(new)),
        )


def _agreed(proposal: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens of `proposal` equal `tokens`'."""
    n = 0
    for a, b in zip(proposal, tokens, strict=False):
        if a != b:
            break
        n += 1
    return n
