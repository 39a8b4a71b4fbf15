"""How many tokens to draft in the next step.

Three schedules:
- "fixed": always the request's num_draft_tokens;
- "heuristic": HuggingFace assisted generation's schedule: +2 after a fully accepted draft, -1 otherwise;
- "adaptive": the k in 0..num_draft_tokens that maximises expected tokens per second, 0 (a plain target step,
  no draft) included.

The adaptive arithmetic. A draft of k tokens costs k draft steps plus one verification of k+1 rows and yields 1 + p
(1 - q^k) / (1 - q) tokens per target pass, p being the probability that its first token is accepted and q that a
token after an accepted one is; k = 0 yields 1 token for the cost of a 1-row step. Two rates, not one per-token
rate, because a prompt lookup either continues a passage the text repeats, and then goes on matching, or is wrong at
once: one rate would overrate its short drafts and underrate its long ones. The rates are each request's own (recent
steps weigh most), per kind of draft (a model's, a lookup's: a hybrid has both), starting from what the drafter has
shown on earlier requests. The costs are measured: seconds of a verification per row count are the target's, per
class of context length (a row's attention reads every cached key: `VerifyCosts`, one per `Engine`, which every
drafter and target-only request fills and `Engine.calibrate` may seed), seconds of a draft step the drafter's, and a
lookup counts as free (it is made before the choice and costs microseconds).

Rows are not free on CPUs (on AVX2 a verification row costs about 0.45 of a 1-row step): a draft accepted
too rarely makes a request slower than target-only decoding, and the schedule then drafts nothing. Since
acceptance cannot be learnt from drafts not made, it probes: after `_PROBE_AFTER` steps on which it could
have drafted and chose not to (alone, or left out by a batch), it drafts one token, the cheapest evidence; a
probe that fails doubles that wait, up to `_PROBE_MAX` steps, so a draft that never agrees costs one row every
so many steps (under 3 % at 0.45 a row), and one accepted brings the first wait back. No probe where no length
would pay even if every token were accepted: then the draft's cost keeps it out, which evidence of acceptance
cannot change. Before a cost was measured it drafts `_START_K` tokens, not num_draft_tokens: that step measures.

Costs need probes too. A row count's cost is measured only by verifications of that many rows, so a figure that
came out high (a calibration or a step during another process's burst) would keep lookups short for the rest of
the process, and their rows never measured again (a calibration whose 4-7 row figures were doubled left a server
at a third of its tokens per pass on repeated prompts). So where a lookup had more tokens than the schedule
verified and the longer draft is expected to yield at least half a token more, every `_PROBE_AFTER`-th such step
verifies all it had (`cost_probe`); a probe that finds the cost about as priced doubles the wait (to
`_COST_PROBE_MAX`), one that finds it lower brings it back. The wait is the machine's, kept with the verification
costs and counted over every request's steps: each request probing on its own would probe every short request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence

SCHEDULES = ("adaptive", "heuristic", "fixed")
# Kinds of draft, each with its own acceptance: a model's, and a lookup's in the text (free to propose). A lookup
# that names its source and match length (`lookup:index:16`, app.engine.drafting.suffix) is a kind of its own,
# created when first seen: each source's acceptance is calibrated per match length.
KINDS = ("model", "lookup")


def is_lookup(kind: str) -> bool:
    """Whether drafts of `kind` are lookups in what was written (free to propose: made before the choice)."""
    return kind.startswith("lookup")


def lookup_kind(source: str, bucket: int) -> str:
    """The kind of a lookup from `source` whose match falls in length class `bucket`."""
    return f"lookup:{source}:{bucket}"


@functools.lru_cache(maxsize=64)  # a handful of kinds, asked several times a request's step
def named_lookup(kind: str) -> tuple[str, int] | None:
    """(source, match-length class) of a kind `lookup_kind` made; None for any other kind."""
    head, _, rest = kind.partition(":")
    source, _, bucket = rest.partition(":")
    return (source, int(bucket)) if head == "lookup" and source and bucket.isdigit() else None


def _shorter(kind: str, known: dict[str, Acceptance]) -> Acceptance | None:
    """Of the kinds in `known` from the same lookup source as `kind`, the one with the longest match shorter than
    its own (None: none): a longer match is accepted at least as often, so a new length class starts from it."""
    named = named_lookup(kind)
    if named is None:
        return None
    source, bucket = named
    best, best_bucket = None, -1
    for other, seen in known.items():
        other_named = named_lookup(other)
        if other_named is not None and other_named[0] == source and best_bucket < other_named[1] < bucket:
            best, best_bucket = seen, other_named[1]
    return best


def prior(kind: str) -> float:
    """The acceptance a kind starts from before any draft of it was verified: 0.5, or for a lookup whose match
    is m tokens long m / (m + 2) (a Laplace-like guess that a longer agreement goes on longer: 0.33 at 1 token,
    0.5 at 2, 0.8 at 8, 0.94 at 32), which the first verifications then correct."""
    named = named_lookup(kind)
    m = named[1] if named is not None else 0
    return m / (m + 2) if m >= 1 else 0.5


_DECAY = 0.8  # weight of the past in a request's figures (about the last five steps count)
_DRAFTER_DECAY = 0.99  # the same in the drafter-wide figures (each new request's starting point)
_PRIOR_STEPS = 2.0  # how many steps' worth of weight the drafter-wide figures get at a request's start
_START_K = 2  # drafted while a cost is still unknown: enough to measure, little to lose
# Until two row counts were timed, each row after the first is taken to cost this much of a 1-row step (AVX2
# measured 0.45): a single measurement says nothing of the slope, and flat would mean rows for free.
_ROW_PRIOR = 0.5
_PROBE_AFTER = 8  # steps without a draft (though one was possible) before a one-token probe
_PROBE_MAX = 64  # the longest wait between probes after failed ones
_BATCH_MARGIN = 1.02  # what a batch's draft must gain, at least, over not drafting (batch_draft_lengths)
# What a model draft's expected tokens per second must beat the alternatives by. Its price is an estimate from noisy
# parts (an acceptance that moves step by step, a draft step whose catch-up varies), and in place the model steps
# it priced as paying ran at 0.96-0.99 of a plain step's rate (docs/bench/amxint8/2026-12-07-hybrid-in-place.md):
# a model draft that only breaks even on paper loses, where a lookup's is free to propose.
_MODEL_MARGIN = 1.08
# The highest value cut-off a model draft gets (DraftLength.value_floor): a row dearer than this share of a step
# would cut nearly every chain, where what the schedule's price says is better heard.
_VALUE_CAP = 0.5
# A cost probe (DraftLength.cost_probe) found its rows cheaper than priced when they took under this share of it.
_COST_PROBE_FOUND = 0.85
# The longest wait between cost probes, in steps of all requests on which a lookup was cut short: a probe verifies
# up to 17 rows where a few would do, so once the figures hold, a few per thousand steps.
_COST_PROBE_MAX = 512
# What a cost probe's longer lookup must be expected to add, at least, in tokens per target pass.
_COST_PROBE_GAIN = 0.5
_DRAFT_DROP = 0.1  # a draft step's running figure follows drops as slowly as rises: a mean (see _smooth)
_ROW_DECAY = 0.9  # weight of the past in a batch's cost of a row (BatchCosts): about the last ten forwards count
_ROW_SEED_WEIGHT = 4.0  # a calibration's row figure counts as this many measured rows
# The least a batch's row is priced at, as a share of a sequence's mean cost in it (0.35-0.7 measured on the AMX
# Xeon; an accelerator's rows cost next to nothing until its tiles fill).
_ROW_FLOOR = 0.05


def _smooth(old: float | None, new: float, drop: float = 0.5) -> float:
    """A running time that follows a drop at once (weight `drop`) and a rise slowly: other work on the machine only
    ever lengthens a measurement, and a shape's first forward can be slow, which left as it was would price that
    row count out of use (and unused, it would never be measured again). `drop` 0.1, as a rise: a running mean,
    for a draft step, whose time varies for reasons of its own (the catch-up on the tokens since the model last
    drafted: one row, or dozens after a run of lookups), so that a price at its fastest does not draft where the
    average step does not pay."""
    if old is None:
        return new
    # One outlier (a page fault, another process's burst) moves the figure at most a fifth: a row count priced
    # far out of use would not be measured again for a long time.
    return old + (drop if new < old else 0.1) * (min(new, 3.0 * old) - old)


class Acceptance:
    """How drafted tokens fared, as decayed counts: a draft's first token (`first`: [accepted, rejected]) and
    each token after an accepted one (`then`), up to the first rejection."""

    def __init__(self, first: float = 0.5, then: float | None = None, weight: float = 0.0) -> None:
        then = first if then is None else then
        self.first = [weight * first, weight * (1.0 - first)]
        self.then = [weight * then, weight * (1.0 - then)]

    def observe(self, drafted: int, accepted: int, decay: float) -> None:
        """A verification of `drafted` tokens of which the first `accepted` were kept."""
        for counts in (self.first, self.then):
            counts[0] *= decay
            counts[1] *= decay
        if drafted <= 0:
            return
        self.first[0 if accepted else 1] += 1.0
        if accepted:
            self.then[0] += accepted - 1
            self.then[1] += float(accepted < drafted)

    def drift(self, toward: Acceptance, decay: float, weight: float) -> None:
        """A step without evidence: the counts move toward `toward`'s rates, held at `weight` steps."""
        for own, rate in ((self.first, toward.p_first), (self.then, toward.p_then)):
            own[0] = decay * own[0] + weight * rate
            own[1] = decay * own[1] + weight * (1.0 - rate)

    @property
    def p_first(self) -> float:
        accepted, rejected = self.first
        return accepted / (accepted + rejected) if accepted + rejected > 0 else 0.5

    @property
    def p_then(self) -> float:
        # Until a token after an accepted one was tried, lean on the first token's rate (a geometric draw):
        # drafts of one token would otherwise never show whether longer ones pay.
        accepted, tried = self.then[0], self.then[0] + self.then[1]
        lean = max(0.0, 1.0 - tried)
        return (accepted + lean * self.p_first) / (tried + lean) if tried + lean > 0 else self.p_first

    @property
    def per_token(self) -> float:
        """Accepted over tried, all positions together (what `expected_tokens` takes)."""
        accepted = self.first[0] + self.then[0]
        tried = accepted + self.first[1] + self.then[1]
        return accepted / tried if tried > 0 else 0.5

    def expected(self, k: int) -> float:
        """Tokens per target pass with a draft of `k` tokens: the accepted ones plus the target's own."""
        return self.expected_upto(k)[-1] if k > 0 else 1.0

    def expected_upto(self, cap: int) -> list[float]:
        """`expected(k)` for k in 0..cap."""
        p, q = self.p_first, self.p_then
        return [1.0] + [1.0 + p * (k if q >= 1.0 else (1.0 - q**k) / (1.0 - q)) for k in range(1, cap + 1)]


def context_class(context: int) -> int:
    """The class of contexts whose verifications share a cost table: cached keys below 256, then each doubling
    (256-511, 512-1,023, ...). A row's attention reads every cached key, so at long contexts a row costs several
    times what it does at short ones (docs/bench: attention at long contexts), and the price of a draft is the
    price at the request's own context."""
    return (max(0, context) >> 8).bit_length()


def _nearest_class(own: int, classes: list[int]) -> int | None:
    """Of `classes`, `own` itself, else the one nearest it (the longer context on a tie: a dearer guess drafts
    less); None when there are none."""
    if not classes:
        return None
    return own if own in classes else min(classes, key=lambda c: (abs(c - own), -c))


class VerifyCosts:
    """Running seconds of a target verification by row count, one table per `context_class`. Shared by every
    drafter of a target (its rows cost the same whoever drafted them).

    Where a class has fewer than two row counts measured, its costs are borrowed: the nearest class with two or
    more gives the slope (scaled to this class's one measurement, when it has one), and a class with none takes
    the nearest measured class's costs as they are. The first steps at a new context length are then priced
    near their cost, and measure it."""

    def __init__(self) -> None:
        self._tables: dict[int, dict[int, float]] = {}
        # Cost probes (DraftLength.cost_probe): steps a lookup was cut short since the last, and how many to wait.
        self.short_steps = 0
        self.probe_wait = _PROBE_AFTER

    def __bool__(self) -> bool:
        return any(self._tables.values())

    def table(self, context: int = 0) -> dict[int, float]:
        """The measured seconds by row count of `context`'s class (read only)."""
        return self._tables.get(context_class(context), {})

    def observe(self, rows: int, seconds: float, context: int = 0) -> None:
        """A verification of `rows` rows after `context` cached positions took `seconds`."""
        table = self._tables.setdefault(context_class(context), {})
        table[rows] = _smooth(table.get(rows), seconds)

    def seed(self, seconds: dict[int, float], context: int = 0, replace: bool = True) -> None:
        """Timed forwards by row count at `context` (`Engine.calibrate`'s): replacing what was measured for those
        row counts, or (`replace` False) only where nothing was."""
        table = self._tables.setdefault(context_class(context), {})
        for rows, t in seconds.items():
            if replace or rows not in table:
                table[rows] = t

    def cost(self, rows: int, context: int = 0) -> float | None:
        """Seconds to verify `rows` rows after `context` cached positions: measured, or a line through what was
        measured in its class (borrowing as the class says); None while nothing was measured at all."""
        costs = self.costs(rows, context, rows)
        return None if costs is None else costs[0]

    def costs(self, most: int, context: int = 0, least: int = 1) -> list[float] | None:
        """`cost(rows, context)` for rows `least`..`most`, the table and its line found once."""
        own = context_class(context)
        table = self._tables.get(own) or self._nearest(own, 1)
        if table is None:
            return None
        wanted = range(least, most + 1)
        if len(table) >= 2:
            line = _Line(table)
            return [table[r] if r in table else line(r) for r in wanted]
        [(x, t)] = table.items()
        if all(r == x for r in wanted):
            return [t for _ in wanted]
        sloped = self._nearest(own, 2)
        if sloped is None:  # one row count measured anywhere: a single figure says nothing of the slope
            return [t if r == x else t * (1.0 + _ROW_PRIOR * (r - 1)) / (1.0 + _ROW_PRIOR * (x - 1)) for r in wanted]
        line = _Line(sloped)
        return [t if r == x else t * line(r) / line(x) for r in wanted]

    def _nearest(self, own: int, least: int) -> dict[int, float] | None:
        """The table of the class nearest `own` (the longer context on a tie: a dearer guess drafts less) with at
        least `least` row counts measured, `own` excluded; None: no such class."""
        found = _nearest_class(own, [c for c, table in self._tables.items() if c != own and len(table) >= least])
        return None if found is None else self._tables[found]


class BatchCosts:
    """Running seconds of a batched target forward, its sequences and its rows apart, per `context_class`: `seqs`,
    S sequences of one row each (a `VerifyCosts` whose row count is the sequence count), and `row`, each row beyond
    a sequence's first. A sequence brings its own share of the step (its cache's keys read, its layout, its
    attention's setup) that a further row of a sequence already in the batch does not: on the AMX Xeon at context
    512, 1.5 ms a sequence against 0.7 ms a row (docs/bench/amxint8/2026-12-07-batch-rows-apart.md). Priced by total
    rows, a drafted row cost what a sequence does, and a batch of 16 drafted nothing.

    A forward of one row per sequence measures `seqs`; one with more rows measures `row` from its seconds over the
    sequences' own cost, where that many sequences were measured at its context class (a ratio of decayed sums, so a
    forward with many extra rows counts for more than a probe's one). Until a class has a row figure, the nearest
    class's serves; until any has, a sequence's own slope (dear: the first forwards with rows measure it)."""

    def __init__(self) -> None:
        self.seqs = VerifyCosts()
        self._rows: dict[int, list[float]] = {}  # per context class: decayed [seconds over the sequences', rows]

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def observe(self, seqs: int, rows: int, seconds: float, context: int = 0) -> None:
        """A forward of `rows` rows over `seqs` sequences, after `context` cached positions (their mean), took
        `seconds`."""
        if rows <= seqs:
            self.seqs.observe(seqs, seconds, context)
            return
        base = self.seqs.table(context).get(seqs)
        if base is None:  # a line's guess at the sequences' cost, off by a row's cost or more, would be the row's
            return
        extra = rows - seqs
        over = seconds - base
        known = self.row(context)
        if known is not None:  # one outlier (another process's burst) moves the figure a little, as _smooth's
            over = max(-known * extra, min(over, 3.0 * known * extra))
        sums = self._rows.setdefault(context_class(context), [0.0, 0.0])
        sums[0] = _ROW_DECAY * sums[0] + over
        sums[1] = _ROW_DECAY * sums[1] + extra

    def seed(self, seqs: dict[int, float], row: float | None = None, context: int = 0) -> None:
        """Timed forwards (`Batcher.calibrate`'s) at `context`: seconds by sequence count, one row each, and
        seconds of a further row; only where nothing was measured."""
        self.seqs.seed(seqs, context, replace=False)
        if row is not None and context_class(context) not in self._rows:
            self._rows[context_class(context)] = [_ROW_SEED_WEIGHT * row, _ROW_SEED_WEIGHT]

    def row(self, context: int = 0) -> float | None:
        """Seconds of a row beyond its sequence's first, after `context` cached positions: its class's figure, else
        the nearest measured class's (the longer context on a tie); None where none was measured."""
        found = _nearest_class(context_class(context), [c for c, (_, n) in self._rows.items() if n > 0])
        if found is None:
            return None
        over, n = self._rows[found]
        return max(0.0, over / n)

    def pricer(self, seqs: int, context: int = 0) -> Callable[[int], float] | None:
        """Seconds of a forward over `seqs` sequences by its total rows (at least `seqs`); None while nothing was
        measured."""
        row = self.row(context)
        own = self.seqs.table(context).get(seqs)
        # Measured as it is, no line fitted (a batch asks every step).
        base = [own] if own is not None and row is not None else self.seqs.costs(seqs + 1, context, seqs)
        if base is None:
            return None
        if row is None:  # no row measured: a sequence's slope, the dearest a row could be
            row = max(0.0, base[1] - base[0])
        # Never near free: a figure from a few noisy forwards that came out low would draft every row it could.
        row = max(row, _ROW_FLOOR * base[0] / max(1, seqs))
        return lambda rows: base[0] + row * max(0, rows - seqs)


class _Line:
    """The least-squares line through a table's (two or more) row counts, its slope held at 0 or more: seconds
    for any row count."""

    def __init__(self, table: dict[int, float]) -> None:
        xs = sorted(table)
        n = len(xs)
        self.mx = sum(xs) / n
        self.my = sum(table[x] for x in xs) / n
        sxx = sum((x - self.mx) ** 2 for x in xs)
        self.slope = max(0.0, sum((x - self.mx) * (table[x] - self.my) for x in xs) / sxx)

    def __call__(self, rows: int) -> float:
        return max(1e-6, self.my + self.slope * (rows - self.mx))


class StepCosts:
    """Running seconds of one draft step of a drafter and of one target verification per number of rows and
    context class, and the drafter's acceptance per kind. `verify` may be a table shared with other drafters of
    the same target."""

    def __init__(self, verify: VerifyCosts | None = None) -> None:
        self.draft_step: float | None = None
        self.verify: VerifyCosts = VerifyCosts() if verify is None else verify
        # The acceptance its requests showed (a drafter's, or one tenant's of it: `fresh`), the starting point of
        # each new request's estimate.
        self.acceptance: dict[str, Acceptance] = {kind: Acceptance() for kind in KINDS}
        self._parent: StepCosts | None = None

    def fresh(self) -> StepCosts:
        """Costs for one tenant of this drafter: its seconds (the machine's: a draft step, the shared verification
        table) and acceptance of its own, from the priors. A tenant's acceptance says what its text is like (how
        often it repeats itself, how well the draft knows it), so it is never another tenant's starting point: a
        drafter-wide figure would shape the draft lengths, and the speed, another tenant sees."""
        child = StepCosts(self.verify)
        child.draft_step = self.draft_step
        child._parent = self
        return child

    def kind(self, kind: str) -> Acceptance:
        """The drafter-wide acceptance of `kind`, created at its prior the first time."""
        seen = self.acceptance.get(kind)
        if seen is None:
            start = prior(kind)
            shorter = _shorter(kind, self.acceptance)
            first, then = (
                (start, start) if shorter is None else (max(start, shorter.p_first), max(start, shorter.p_then))
            )
            # Worth one verification: the first real ones outweigh it.
            seen = self.acceptance[kind] = Acceptance(first, then, 1.0)
        return seen

    def observe(
        self, draft_steps: int, draft_seconds: float, rows: int, verify_seconds: float | None, context: int = 0
    ) -> None:
        """One step's measured times, its verification after `context` cached positions; `verify_seconds` None
        when the verification was not this request's alone."""
        if draft_steps > 0:
            self.draft_step = _smooth(self.draft_step, draft_seconds / draft_steps, _DRAFT_DROP)
            if self._parent is not None:  # the machine's cost, every tenant's next starting point
                self._parent.draft_step = _smooth(self._parent.draft_step, draft_seconds / draft_steps, _DRAFT_DROP)
        if verify_seconds is not None:
            self.verify.observe(rows, verify_seconds, context)

    def observe_acceptance(self, drafted: int, accepted: int, kind: str = "model") -> None:
        self.kind(kind).observe(drafted, accepted, _DRAFTER_DECAY)

    def verify_cost(self, rows: int, context: int = 0) -> float | None:
        """Seconds to verify `rows` rows after `context` cached positions (`VerifyCosts.cost`)."""
        return self.verify.cost(rows, context)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens per target pass when each drafted token is accepted with probability `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class DraftLength:
    """The draft-length schedule of one request. `kind`: what its drafter drafts unless told ("lookup" for
    prompt lookup alone, else "model"); a hybrid's steps say which of its parts drafted. `max_lookup`: the most
    a lookup of a named source (`lookup:SOURCE:BUCKET`) may draft on the adaptive schedule (default `max_k`): a
    long match in text already written is worth drafting further than a model's guesses."""

    def __init__(
        self, schedule: str, max_k: int, costs: StepCosts, kind: str = "model", max_lookup: int | None = None
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"draft_schedule must be one of {', '.join(SCHEDULES)}")
        if kind not in KINDS:
            raise ValueError(f"draft kind must be one of {', '.join(KINDS)}")
        self.schedule = schedule
        self.max_k = max_k
        self.max_lookup = max_k if max_lookup is None else max_lookup
        self.costs = costs
        self.kind = kind
        # Cached positions before the next verification's first row: its costs are those of this context's class.
        self.context = 0
        self._k = max_k  # the heuristic's current length
        # The drafter-wide rates, worth a couple of steps, until this request's own evidence outweighs them.
        self._seen = {kind: self._start(seen) for kind, seen in costs.acceptance.items()}
        # Per kind: steps on which it could have drafted and drafted nothing, and how many before a probe.
        self._idle: dict[str, int] = {}
        self._wait: dict[str, int] = {}
        self._cost_probe = False  # whether this step's draft is a cost probe

    @staticmethod
    def _start(seen: Acceptance) -> Acceptance:
        return Acceptance(seen.p_first, seen.p_then, _PRIOR_STEPS)

    def estimate(self, kind: str | None = None) -> Acceptance:
        """This request's acceptance of drafts of `kind` (default: its drafter's)."""
        kind = kind or self.kind
        seen = self._seen.get(kind)
        if seen is None:
            start = self.costs.kind(kind)
            # This request's own evidence at a shorter match of the same source, where it is better.
            shorter = _shorter(kind, self._seen)
            if shorter is not None and shorter.p_then > start.p_then:
                start = Acceptance(max(start.p_first, shorter.p_first), shorter.p_then)
            seen = self._seen[kind] = self._start(start)
        return seen

    @property
    def lookup_cap(self) -> int:
        """The most tokens a lookup of a named source may draft."""
        return self.max_lookup if self.schedule == "adaptive" else self.max_k

    def cap(self, kind: str | None = None) -> int:
        """The most tokens a draft of `kind` may have."""
        return self.lookup_cap if named_lookup(kind or self.kind) is not None else self.max_k

    @property
    def acceptance(self) -> float:
        """The current estimate of the probability that a drafted token (of the drafter's kind) is accepted."""
        return self.estimate().per_token

    def expected(self, k: int, kind: str | None = None) -> float:
        """Expected tokens per target pass with a draft of `k` tokens of `kind`."""
        return self.estimate(kind).expected(k)

    def rate(self, k: int, kind: str | None = None) -> float | None:
        """Expected tokens per second with a draft of `k` tokens of `kind` (k = 0: a plain target step); None
        while a cost it needs was not measured."""
        rates = self._rates(k, kind or self.kind)
        return None if rates is None else rates[k]

    def _margin(self, kind: str | None) -> float:
        """What a draft of `kind` must beat a plain step by: `_MODEL_MARGIN` for a model's, nothing for a lookup's."""
        return 1.0 if is_lookup(kind or self.kind) else _MODEL_MARGIN

    def value_floor(self) -> float:
        """On the adaptive schedule, what a model draft's chain must still be worth for its next token to be
        verified (`NetworkSession.value_min`): the price of one more verified row as a share of a plain step at this
        context, at most `_VALUE_CAP` (0 while unmeasured, and on the fixed and heuristic schedules, whose k is the
        user's). An accepted token saves about a plain step; the chain's tokens are all accepted with about the
        product of the draft's top probabilities (docs/bench/amxint8/2026-12-07-draft-chain.md), so a token that
        brings it below the row's share is expected to save less than its row costs."""
        if self.schedule != "adaptive":
            return 0.0
        costs = self.costs.verify.costs(2, self.context)
        if costs is None:
            return 0.0
        return min(_VALUE_CAP, max(0.0, (costs[1] - costs[0]) / costs[0]))

    def next_k(self, limit: int, kind: str | None = None, available: int | None = None) -> int:
        """How many tokens to draft now, at most `limit`. The adaptive schedule's choice, for drafts of `kind`,
        of which at most `available` can be had (a lookup's match), may be 0: drafting does not pay."""
        if self.schedule == "fixed":
            return min(self.max_k, limit)
        if self.schedule == "heuristic":
            return min(self._k, limit)
        kind = kind or self.kind
        most = self.cap(kind)
        cap = min(most, limit, most if available is None else available)
        if cap <= 0:
            return 0
        best = self._best(cap, kind)
        if best < 0:
            return min(_START_K, cap)
        if named_lookup(kind) is not None:
            return best  # no probes: the target's tokens show every step how far a lookup would have been accepted
        return 1 if best == 0 and self.probing(kind) and self.could_pay(cap, kind) else best

    def _best(self, cap: int, kind: str) -> int:
        """The k in 0..cap of the highest expected tokens per second (the shorter on a tie); -1 while a cost it
        needs was not measured."""
        rates = self._rates(cap, kind)
        if rates is None:
            return -1
        return max(range(cap + 1), key=lambda k: rates[k])

    def _rates(self, cap: int, kind: str, sure: bool = False) -> list[float] | None:
        """`rate(k, kind)` for k in 0..cap, in one pass (a step's schedule prices every length of every kind it
        could draft): k draft steps (none for a lookup, free to propose) and a verification of k + 1 rows; with
        `sure`, as if every drafted token were accepted. None while a cost it needs was not measured."""
        draft = 0.0 if is_lookup(kind) or cap == 0 else self.costs.draft_step
        if draft is None:
            return None
        costs = self.costs.verify.costs(cap + 1, self.context)
        if costs is None:
            return None
        margin = self._margin(kind)
        expected = [float(k + 1) for k in range(cap + 1)] if sure else self.estimate(kind).expected_upto(cap)
        return [expected[k] / max(k * draft + costs[k], 1e-9) / (margin if k else 1.0) for k in range(cap + 1)]

    def could_pay(self, cap: int, kind: str | None = None) -> bool:
        """Whether a draft of `kind` of at most `cap` tokens would pay were every token accepted. If not, what
        keeps it from paying is its cost, not its acceptance, and a probe could not change the choice (a draft
        step dearer than a target step, say)."""
        # Every length priced in one pass (a batch asks this of every idle request each step).
        rates = self._rates(cap, kind or self.kind, sure=True)
        return rates is None or any(rate > rates[0] for rate in rates[1:])

    def cost_probe(self, k: int, most: int, kind: str | None = None) -> int:
        """`k` (the schedule's choice for a lookup of `kind` that had `most` tokens), or `most` where this step
        probes what verifying them costs (see the module's docstring); lookups only (free to propose)."""
        kind = kind or self.kind
        if self.schedule != "adaptive" or not is_lookup(kind) or k >= most:
            return k
        if self.expected(most, kind) < self.expected(k, kind) + _COST_PROBE_GAIN:
            return k
        table = self.costs.verify
        table.short_steps += 1
        if table.short_steps < table.probe_wait:
            return k
        table.short_steps = 0
        self._cost_probe = True
        return most

    def probed(self, rows: int, seconds: float | None) -> None:
        """After a step's verification of `rows` rows took `seconds` (None: not this request's alone), before the
        costs observe it: a cost probe that found them cheaper than priced probes again soon, else later."""
        probe, self._cost_probe = self._cost_probe, False
        if not probe or seconds is None:
            return
        priced = self.costs.verify_cost(rows, self.context)
        table = self.costs.verify
        found = priced is not None and seconds < _COST_PROBE_FOUND * priced
        table.probe_wait = _PROBE_AFTER if found else min(2 * table.probe_wait, _COST_PROBE_MAX)

    def probing(self, kind: str | None = None) -> bool:
        """Whether the next draft of `kind` would be a probe: enough steps went without one."""
        kind = kind or self.kind
        return self._idle.get(kind, 0) >= self._wait.get(kind, _PROBE_AFTER)

    def idle(self, kind: str | None = None) -> None:
        """A step on which this request could have drafted (`kind`) and the schedule chose not to."""
        kind = kind or self.kind
        self._idle[kind] = self._idle.get(kind, 0) + 1

    def rest(self) -> None:
        """A step on which a batch gave this request nothing to draft: with no new evidence, the estimate
        drifts back toward the drafter-wide acceptance, so that a request is not kept from drafting for the rest
        of its life by the misses that once made the batch skip it; and it counts toward a probe. A named lookup's
        estimate stays: every step's proposals are evidence of it, drafted or not."""
        for kind, seen in self._seen.items():
            if named_lookup(kind) is None:
                seen.drift(self.costs.kind(kind), _DECAY, (1.0 - _DECAY) * _PRIOR_STEPS)
        self.idle()

    def observe(self, drafted: int, accepted: int, kind: str) -> None:
        """Evidence of `kind`'s acceptance without a draft of it: of `drafted` tokens a lookup proposed, the
        target's own tokens agreed with the first `accepted` (probes and lengths are not touched)."""
        if drafted > 0:
            self.estimate(kind).observe(drafted, accepted, _DECAY)
            self.costs.observe_acceptance(drafted, accepted, kind)

    def update(self, drafted: int, accepted: int, kind: str | None = None) -> None:
        """After a step that asked for a draft: `drafted` tokens of `kind` verified, the first `accepted` kept."""
        kind = kind or self.kind
        probe = self.probing(kind)
        self._idle[kind] = 0
        if drafted > 0:
            self.estimate(kind).observe(drafted, accepted, _DECAY)
            self.costs.observe_acceptance(drafted, accepted, kind)
        if probe:
            # A probe after which drafting still does not pay (it failed, found nothing to propose, or was accepted
            # at a rate that still does not pay for the draft) makes the next one wait longer: a draft accepted
            # half the time that its cost keeps out would otherwise probe every few steps, each a model step that
            # does not pay.
            wait = self._wait.get(kind, _PROBE_AFTER)
            pays = accepted > 0 and self._best(self.max_k, kind) > 0
            self._wait[kind] = _PROBE_AFTER if pays else min(2 * wait, _PROBE_MAX)
        else:
            self._wait[kind] = _PROBE_AFTER
        if drafted == 0:
            return
        if self.schedule == "heuristic":
            rejected = accepted < drafted
            self._k = min(self.max_k, self._k + 2) if not rejected else max(1, self._k - 1)


def _with(ks: list[int], move: Sequence[int], f: Callable[[list[int]], float]) -> float:
    """f(ks) with one more token for each request of `move` (ks is left as it was)."""
    for i in move:
        ks[i] += 1
    try:
        return f(ks)
    finally:
        for i in move:
            ks[i] -= 1


def batch_draft_lengths(
    lengths: Sequence[DraftLength],
    limits: Sequence[int],
    verify: BatchCosts,
    min_rows: int,
    draft_steps: Sequence[float | None] | None = None,
    groups: Sequence[Hashable | None] | None = None,
    context: int = 0,
    kinds: Sequence[str | None] | None = None,
) -> list[int]:
    """Draft lengths for requests whose drafts one target forward verifies together.

    In a batch, every drafted token delays every request: it widens the shared forward (`verify`: measured seconds
    of the batch's sequences and of each row more, priced at `context` cached positions, the batch's mean; each
    request takes at least `min_rows`) and costs draft steps. `draft_steps`: seconds of one draft step of each request
    (default: its solo draft step). `groups`: requests with the same key draft together, one draft forward per
    position for all of them, so their drafts cost that key's step times the longest draft among them; None drafts
    alone (its k steps). `kinds`: the kind each request drafts this step (None: its drafter's); a lookup's is free
    to propose (its step costs nothing), and `limits` then hold no more than the tokens it found.
    Requests on the adaptive schedule get tokens while the batch's expected tokens per second still grow:
    one more token to the request that gains most, or one more to every such request at once (the move that
    pays when a shared draft forward is dear for one row but cheap for all). When drafting no longer pays
    (many requests, costly drafts, low acceptance) they draft nothing. The other schedules keep their own
    choice, as does a request whose draft step was never measured (its first draft measures it). Until a batched
    forward was measured, each request chooses as it would alone.
    """
    kinds = [kind or length.kind for kind, length in zip(kinds or [None] * len(lengths), lengths, strict=True)]
    steps = list(draft_steps) if draft_steps is not None else [length.costs.draft_step for length in lengths]
    steps = [0.0 if is_lookup(kind) else step for kind, step in zip(kinds, steps, strict=True)]
    keys = list(groups) if groups is not None else [None] * len(lengths)
    price = verify.pricer(len(lengths), context)
    if price is None:
        return [length.next_k(limit, kind) for length, limit, kind in zip(lengths, limits, kinds, strict=True)]
    caps = [min(length.cap(kind), limit) for length, limit, kind in zip(lengths, limits, kinds, strict=True)]
    free = [
        i for i, length in enumerate(lengths) if length.schedule == "adaptive" and caps[i] > 0 and steps[i] is not None
    ]
    free_set = set(free)
    # The requests the search below sizes start at 0; the others keep their own schedule's choice.
    ks = [0 if i in free_set or caps[i] <= 0 else lengths[i].next_k(limits[i], kinds[i]) for i in range(len(lengths))]

    def table(i: int, sure: bool) -> list[float]:
        """Request i's expected tokens per draft length (every token accepted, if `sure` and it is sized here)."""
        n = max(caps[i], ks[i]) + 1
        if sure and i in free_set:
            return [float(k + 1) for k in range(n)]
        return lengths[i].estimate(kinds[i]).expected_upto(n - 1)

    # A move must beat the batch's rate by this much: a verification's cost per row is a line through noisy
    # timings, and in a large batch a wrong row costs every request (the move is kept only for a clear gain).
    margin = _BATCH_MARGIN if len(lengths) > 1 else 1.0
    sure = [table(i, True) for i in range(len(lengths))]

    def rate(ks: list[int], gains: list[list[float]] = sure) -> float:
        tokens = sum(g[k] for g, k in zip(gains, ks, strict=True))
        rows = sum(max(min_rows, k + 1) for k in ks)
        draft = 0.0
        depth: dict[Hashable, tuple[int, float]] = {}
        for k, step, key in zip(ks, steps, keys, strict=True):
            if key is None:
                draft += k * (step or 0.0)
            elif k > depth.get(key, (0, 0.0))[0]:
                depth[key] = (k, step or 0.0)
        draft += sum(k * step for k, step in depth.values())
        return tokens / max(draft + price(rows), 1e-9)

    best = rate(ks)
    # Where not even a draft whose every token is accepted would pay (one request's cheapest, or one token each
    # for all: a large batch on a CPU, where a row costs about what a token is worth), nothing is searched: the
    # free requests draft nothing and probe nothing.
    if free:
        cheapest = min(free, key=lambda i: steps[i] or 0.0)
        moves = [[cheapest], free]
        if all(_with(ks, move, lambda ks: rate(ks, sure)) <= best * margin for move in moves):
            return ks
    # Each request's expected tokens per draft length, computed once: the search below weighs many moves (the
    # others' tables are `sure`'s already).
    gains = [table(i, False) if i in free_set else sure[i] for i in range(len(lengths))]
    while True:
        moves = [[i] for i in free if ks[i] < caps[i]]
        if len(moves) > 1:
            moves.append([i for [i] in moves])
        choice = None
        for move in moves:
            r = _with(ks, move, lambda ks: rate(ks, gains))
            if r > best * margin:
                best, choice = r, move
        if choice is None:
            break
        for i in choice:
            ks[i] += 1
    # A move of all at once may have given tokens to requests that cost the batch more than they bring.
    for i in free:
        while ks[i] > 0:
            ks[i] -= 1
            r = rate(ks, gains)
            if r <= best:
                ks[i] += 1
                break
            best = r
    # A request left without drafts long enough probes, as it would alone: a batch that never drafts for it would
    # never learn that its drafts are accepted again. Only where the batch could pay for its token were it
    # accepted: where a row costs the batch more than a whole token is worth, no acceptance could change the
    # choice, and the probe would be a row every request pays for nothing.
    for i in free:
        if named_lookup(kinds[i]) is not None:  # a named lookup learns without drafting: no probes
            continue
        if ks[i] == 0 and lengths[i].probing(kinds[i]) and lengths[i].could_pay(caps[i], kinds[i]):
            probe = list(gains)
            probe[i] = sure[i]  # its token accepted
            ks[i] = 1
            if rate(ks, probe) <= best:
                ks[i] = 0
    return ks
