"""How many tokens to draft in the next step.

Three schedules:
- "fixed": always the request's num_draft_tokens;
- "heuristic": HuggingFace assisted generation's schedule: +2 after a fully accepted draft, -1 otherwise;
- "adaptive": the k that maximises expected tokens per second, from this request's recent acceptance and
  the measured cost of a draft step and of verifying j tokens (shared by every request of a drafter).

With a per-token acceptance a, a draft of k tokens yields (1 - a^(k+1)) / (1 - a) tokens per target pass
(the accepted prefix plus the target's own next token) and costs k draft steps plus one verification of
k+1 rows. In bfloat16 the verification is padded to a fixed width, so its cost hardly depends on k and the
choice is driven by the draft step's cost; in float32 it grows with k and longer drafts pay less.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

SCHEDULES = ("adaptive", "heuristic", "fixed")

_DECAY = 0.8  # weight of the past in the running figures (about the last five steps count)
_PRIOR_STEPS = 2.0  # how many steps' worth of weight the drafter-wide acceptance gets at the start


class StepCosts:
    """Running seconds of one draft step and of one verification per number of rows, for one drafter."""

    def __init__(self) -> None:
        self.draft_step: float | None = None
        self.verify: dict[int, float] = {}
        # Drafter-wide acceptance, the starting point of each new request's estimate.
        self.accepted = 0.0
        self.rejected = 0.0

    def observe(self, draft_steps: int, draft_seconds: float, rows: int, verify_seconds: float | None) -> None:
        """One step's measured times; `verify_seconds` None when the verification was not this request's alone."""
        if draft_steps > 0:
            per = draft_seconds / draft_steps
            self.draft_step = per if self.draft_step is None else 0.9 * self.draft_step + 0.1 * per
        if verify_seconds is None:
            return
        old = self.verify.get(rows)
        self.verify[rows] = verify_seconds if old is None else 0.9 * old + 0.1 * verify_seconds

    def observe_acceptance(self, accepted: int, rejected: bool) -> None:
        self.accepted = 0.99 * self.accepted + accepted
        self.rejected = 0.99 * self.rejected + float(rejected)

    def verify_cost(self, rows: int) -> float | None:
        """Seconds to verify `rows` rows: measured, or a line through what was measured."""
        if rows in self.verify:
            return self.verify[rows]
        if not self.verify:
            return None
        xs = sorted(self.verify)
        if len(xs) == 1:
            return self.verify[xs[0]]
        n = len(xs)
        mx = sum(xs) / n
        my = sum(self.verify[x] for x in xs) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (self.verify[x] - my) for x in xs) / sxx)
        return max(1e-6, my + slope * (rows - mx))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens per target pass when each drafted token is accepted with probability `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class DraftLength:
    """The draft-length schedule of one request."""

    def __init__(self, schedule: str, max_k: int, costs: StepCosts) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"draft_schedule must be one of {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self.max_k = max_k
        self.costs = costs
        self._k = max_k  # the heuristic's current length
        # Pseudo-counts: the drafter-wide acceptance, worth a couple of steps, until this request's own count.
        prior = self.prior()
        self._acc = _PRIOR_STEPS * 2 * prior
        self._rej = _PRIOR_STEPS * 2 * (1.0 - prior)

    def prior(self) -> float:
        c = self.costs
        return c.accepted / (c.accepted + c.rejected) if c.accepted + c.rejected > 0 else 0.5

    @property
    def acceptance(self) -> float:
        """The current estimate of the probability that a drafted token is accepted."""
        total = self._acc + self._rej
        return self._acc / total if total > 0 else 0.5

    def next_k(self, limit: int) -> int:
        """How many tokens to draft now, at most `limit`."""
        if self.schedule == "fixed":
            return min(self.max_k, limit)
        if self.schedule == "heuristic":
            return min(self._k, limit)
        return min(self._best_k(), limit)

    def _best_k(self) -> int:
        c_draft = self.costs.draft_step
        if c_draft is None or not self.costs.verify:
            return self.max_k  # nothing measured yet: the configured length, until a step is timed
        a = min(self.acceptance, 0.995)
        best_k, best_rate = 1, 0.0
        for k in range(1, self.max_k + 1):
            cost = k * c_draft + (self.costs.verify_cost(k + 1) or 0.0)
            rate = expected_tokens(a, k) / max(cost, 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def rest(self) -> None:
        """A step on which a batch gave this request nothing to draft: with no new evidence, the estimate
        drifts back toward the drafter-wide acceptance, so that a request is not kept from drafting for the rest
        of its life by the misses that once made the batch skip it."""
        prior = self.prior()
        weight = (1.0 - _DECAY) * _PRIOR_STEPS * 2
        self._acc = _DECAY * self._acc + weight * prior
        self._rej = _DECAY * self._rej + weight * (1.0 - prior)

    def update(self, drafted: int, accepted: int) -> None:
        """After a verification of `drafted` tokens of which the first `accepted` were kept."""
        if drafted == 0:
            return
        rejected = accepted < drafted
        # Per-token acceptance from a truncated geometric draw: accepted successes, one failure if rejected.
        self._acc = _DECAY * self._acc + accepted
        self._rej = _DECAY * self._rej + float(rejected)
        self.costs.observe_acceptance(accepted, rejected)
        if self.schedule == "heuristic":
            self._k = min(self.max_k, self._k + 2) if not rejected else max(1, self._k - 1)


def batch_draft_lengths(
    lengths: Sequence[DraftLength],
    limits: Sequence[int],
    verify: StepCosts,
    min_rows: int,
    draft_steps: Sequence[float | None] | None = None,
    groups: Sequence[Hashable | None] | None = None,
) -> list[int]:
    """Draft lengths for requests whose drafts one target forward verifies together.

    In a batch, every drafted token delays every request: it widens the shared forward (`verify`: measured
    seconds per number of rows in the whole forward; each request takes at least `min_rows`) and costs draft
    steps. `draft_steps`: seconds of one draft step of each request (default: its solo draft step).
    `groups`: requests with the same key draft together, one draft forward per position for all of them, so
    their drafts cost that key's step times the longest draft among them; None drafts alone (its k steps).
    Requests on the adaptive schedule get tokens while the batch's expected tokens per second still grow:
    one more token to the request that gains most, or one more to every such request at once (the move that
    pays when a shared draft forward is dear for one row but cheap for all). When drafting no longer pays
    (many requests, costly drafts, low acceptance) they draft nothing. The other schedules keep their own
    choice. Until a batched forward was measured, each request chooses as it would alone.
    """
    ks = [length.next_k(limit) for length, limit in zip(lengths, limits, strict=True)]
    steps = list(draft_steps) if draft_steps is not None else [length.costs.draft_step for length in lengths]
    keys = list(groups) if groups is not None else [None] * len(lengths)
    if not verify.verify or any(step is None for step in steps):
        return ks
    caps = [min(length.max_k, limit) for length, limit in zip(lengths, limits, strict=True)]
    free = [i for i, length in enumerate(lengths) if length.schedule == "adaptive" and caps[i] > 0]
    for i in free:
        ks[i] = 0
    accept = [min(length.acceptance, 0.995) for length in lengths]

    def rate(ks: list[int]) -> float:
        tokens = sum(expected_tokens(a, k) for a, k in zip(accept, ks, strict=True))
        rows = sum(max(min_rows, k + 1) for k in ks)
        draft = 0.0
        depth: dict[Hashable, tuple[int, float]] = {}
        for k, step, key in zip(ks, steps, keys, strict=True):
            if key is None:
                draft += k * (step or 0.0)
            elif k > depth.get(key, (0, 0.0))[0]:
                depth[key] = (k, step or 0.0)
        draft += sum(k * step for k, step in depth.values())
        return tokens / max(draft + (verify.verify_cost(rows) or 0.0), 1e-9)

    best = rate(ks)
    while True:
        moves = [[i] for i in free if ks[i] < caps[i]]
        if len(moves) > 1:
            moves.append([i for [i] in moves])
        choice = None
        for move in moves:
            for i in move:
                ks[i] += 1
            r = rate(ks)
            for i in move:
                ks[i] -= 1
            if r > best:
                best, choice = r, move
        if choice is None:
            break
        for i in choice:
            ks[i] += 1
    # A move of all at once may have given tokens to requests that cost the batch more than they bring.
    for i in free:
        while ks[i] > 0:
            ks[i] -= 1
            r = rate(ks)
            if r <= best:
                ks[i] += 1
                break
            best = r
    return ks
