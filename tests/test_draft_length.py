"""Draft-length schedules: the cost model's choice (drafting nothing included), HF's heuristic, and fixed."""

from __future__ import annotations

import itertools

import pytest

from app.engine.drafting.draft_length import (
    _COST_PROBE_MAX,
    _MODEL_MARGIN,
    _PROBE_AFTER,
    _PROBE_MAX,
    Acceptance,
    BatchCosts,
    DraftLength,
    StepCosts,
    VerifyCosts,
    batch_draft_lengths,
    context_class,
    expected_tokens,
    prior,
)


def _costs(draft_step: float, verify: dict[int, float]) -> StepCosts:
    c = StepCosts()
    c.draft_step = draft_step
    c.verify.seed(verify)
    return c


def _batch(seqs: dict[int, float], row: float) -> BatchCosts:
    """A batch's costs as though calibrated: seconds by sequence count (one row each), and of a row more."""
    costs = BatchCosts()
    costs.seed(seqs, row)
    return costs


def _cpu_costs(draft_step: float = 0.0015, step: float = 0.010, row: float = 0.45) -> StepCosts:
    """Costs as measured on an AVX2 CPU: each verification row after the first adds `row` of a 1-row step."""
    return _costs(draft_step, {r: step * (1 + row * (r - 1)) for r in range(1, 9)})


def _set(policy: DraftLength, first: float, then: float, kind: str | None = None, weight: float = 1000.0) -> None:
    """Give `policy` a request's acceptance of `kind` as though measured on many steps."""
    seen = policy.estimate(kind)
    seen.first = [weight * first, weight * (1 - first)]
    seen.then = [weight * then, weight * (1 - then)]


def test_expected_tokens_per_pass():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def _run(policy: DraftLength, accepted_fraction: float, steps: int = 20, kind: str | None = None) -> list[int]:
    """`steps` steps of a request whose drafts are accepted in that fraction; the lengths chosen."""
    ks = []
    for _ in range(steps):
        k = policy.next_k(100, kind)
        if k:
            policy.update(k, round(k * accepted_fraction), kind)
        else:
            policy.idle(kind)
        ks.append(k)
    return ks


def test_adaptive_drafts_long_when_drafting_is_cheap_and_accepted():
    policy = DraftLength("adaptive", 7, _costs(0.001, {1: 0.028, 8: 0.030}))
    _run(policy, 1.0)
    assert policy.next_k(100) == 7
    assert policy.acceptance > 0.9


def test_adaptive_drafts_short_or_nothing_when_rejected_or_expensive():
    rejected = DraftLength("adaptive", 7, _costs(0.004, {1: 0.028, 8: 0.030}))
    _run(rejected, 0.0)
    assert rejected.next_k(100) == 0  # a plain step yields as much, sooner
    # Accepted often, but a draft step costs as much as a verification: short drafts pay best.
    costly = DraftLength("adaptive", 7, _costs(0.030, {2: 0.030, 8: 0.030}))
    _run(costly, 0.6)
    assert costly.next_k(100) <= 2


def test_expected_tokens_per_pass_with_a_first_token_rate_and_a_rate_after_it():
    # The same two rates: a geometric draw, the one-rate formula.
    same = Acceptance(0.6, weight=100.0)
    assert [same.expected(k) for k in range(7)] == pytest.approx([expected_tokens(0.6, k) for k in range(7)])
    # A lookup's draw: often wrong at once, but once right it goes on matching.
    lookup = Acceptance(0.4, 0.9, weight=100.0)
    assert lookup.expected(0) == 1.0
    assert lookup.expected(1) == pytest.approx(1.4)
    assert lookup.expected(3) == pytest.approx(1 + 0.4 * (1 + 0.9 + 0.81))
    assert Acceptance(0.5, 1.0, weight=100.0).expected(4) == pytest.approx(3.0)
    # Counting: one draft of 4 of which 2 kept is a first token accepted, then one accepted and one rejected.
    seen = Acceptance()
    seen.observe(4, 2, decay=1.0)
    assert seen.first == [1.0, 0.0] and seen.then == [1.0, 1.0]
    seen.observe(3, 0, decay=1.0)
    assert seen.first == [1.0, 1.0] and seen.then == [1.0, 1.0]
    seen.observe(2, 2, decay=1.0)  # all kept: no rejection to count
    assert seen.first == [2.0, 1.0] and seen.then == [2.0, 1.0]
    # Before any token after an accepted one was tried, the rate after the first is the first's.
    fresh = Acceptance()
    fresh.observe(1, 1, decay=1.0)
    fresh.observe(1, 1, decay=1.0)
    assert fresh.p_first == 1.0 and fresh.p_then == 1.0


def test_adaptive_picks_the_k_that_maximises_expected_tokens_per_second():
    costs = _costs(0.003, {2: 0.020, 8: 0.035})
    policy = DraftLength("adaptive", 7, costs)
    _set(policy, 0.7, 0.8)

    def by_hand(k: int) -> float:
        tokens = 1 + 0.7 * (1 - 0.8**k) / (1 - 0.8)
        seconds = k * 0.003 + (0.020 + (k + 1 - 2) * 0.015 / 6)  # the line through the two measurements
        return tokens / seconds / (_MODEL_MARGIN if k else 1.0)  # a model draft must beat the rest by a margin

    assert [policy.rate(k) for k in range(8)] == pytest.approx([by_hand(k) for k in range(8)])
    rates = {k: by_hand(k) for k in range(8)}
    assert policy.next_k(100) == max(rates, key=rates.get) > 0
    assert policy.next_k(2) <= 2  # never more than the room left
    assert policy.next_k(100, available=1) == 1  # nor than a lookup found


def test_adaptive_drafts_nothing_when_no_length_pays_and_the_threshold_is_the_arithmetic():
    """With rows at 0.45 of a step, a free lookup pays from a first-token acceptance of 0.45 on (1 + p tokens
    for 1.45 steps' time); a model draft that costs 0.15 of a step per token from 0.73 (1 + p for 1.6, and its
    margin: 1.6 * 1.08 = 1.73)."""
    policy = DraftLength("adaptive", 6, _cpu_costs(draft_step=0.0015))
    assert policy.rate(0) == pytest.approx(1 / 0.010)
    for p, lookup_k, model_k in ((0.40, 0, 0), (0.50, 1, 0), (0.65, 1, 0), (0.72, 1, 0), (0.75, 2, 1), (0.95, 6, 4)):
        for kind in ("lookup", "model"):
            _set(policy, p, p, kind)
        assert policy.rate(1, "lookup") == pytest.approx((1 + p) / 0.0145)
        assert policy.rate(1, "model") == pytest.approx((1 + p) / (0.0015 + 0.0145) / _MODEL_MARGIN)
        assert (policy.next_k(100, "lookup"), policy.next_k(100, "model")) == (lookup_k, model_k), p
    # A lookup that either runs long or fails at once, first token at 0.4, then 0.95: no length pays (one token
    # gives 1.4 tokens for 1.45 steps' time, six 1 + 0.4 * 5.3 = 3.1 for 3.7). At 0.55 first, a longer draft
    # does (three: 1 + 0.55 * 2.85 = 2.57 tokens for 2.35 steps), where one rate of 0.55 would draft one token.
    _set(policy, 0.4, 0.95, "lookup")
    assert policy.next_k(100, "lookup") == 0
    _set(policy, 0.55, 0.95, "lookup")
    assert policy.next_k(100, "lookup") == 3
    _set(policy, 0.55, 0.55, "lookup")
    assert policy.next_k(100, "lookup") == 1
    _set(policy, 0.55, 0.95, "lookup")
    assert policy.next_k(100, "lookup", available=2) == 2
    assert policy.next_k(100, "lookup", available=0) == 0


def test_the_cost_model_probes_when_it_drafts_nothing_and_waits_longer_after_each_failed_probe():
    policy = DraftLength("adaptive", 6, _cpu_costs())
    _set(policy, 0.0, 0.0)
    waits = []
    idle = 0
    for _ in range(300):
        k = policy.next_k(100)
        assert policy.next_k(100) == k  # choosing has no side effect: steps are counted when they happen
        if k == 0:
            policy.idle()
            idle += 1
            continue
        assert k == 1  # a probe: one token, the cheapest evidence
        waits.append(idle)
        idle = 0
        policy.update(1, 0)
    assert waits[:5] == [_PROBE_AFTER, 2 * _PROBE_AFTER, 4 * _PROBE_AFTER, 8 * _PROBE_AFTER, _PROBE_MAX]
    assert set(waits[4:]) == {_PROBE_MAX}
    # A probe that is accepted: at this request's acceptance then, drafting pays again (a lookup's first token
    # at 0.78 > 0.45), and a later stretch without drafts waits the first wait again.
    while not policy.probing():
        policy.idle()
    _set(policy, 0.5, 0.5, weight=1.0)
    assert policy.next_k(100) == 1
    policy.update(1, 1)
    assert policy.estimate().p_first == pytest.approx(1.4 / 1.8) and policy.next_k(100) >= 1
    _set(policy, 0.0, 0.0)
    ks = []
    for _ in range(_PROBE_AFTER + 1):
        ks.append(policy.next_k(100))
        policy.idle()
    assert ks == [0] * _PROBE_AFTER + [1]


def test_a_draft_that_never_agrees_costs_less_than_3_percent():
    """Simulated on the CPU's costs (a row at 0.45 of a step; a model draft step at 0.15): a request whose drafts
    are never accepted, from its first step, keeps within 0.97 of target-only decoding's tokens per second."""
    for kind, draft_step in (("lookup", 0.0), ("model", 0.0015)):
        costs = _cpu_costs(draft_step=draft_step)
        policy = DraftLength("adaptive", 6, costs, kind)
        seconds = 0.0
        for _ in range(128):
            k = policy.next_k(100)
            seconds += k * draft_step + costs.verify.table()[k + 1]
            if k:
                policy.update(k, 0)
            else:
                policy.idle()
        assert 128 * costs.verify.table()[1] / seconds >= 0.97, kind


def test_adaptive_without_measurements_starts_short():
    assert DraftLength("adaptive", 5, StepCosts()).next_k(100) == 2
    assert DraftLength("adaptive", 1, StepCosts()).next_k(100) == 1
    # Verification measured, a model draft's step not: still the short start; a lookup needs no draft step.
    policy = DraftLength("adaptive", 5, _costs(0.0, {1: 0.01, 2: 0.0101}))
    policy.costs.draft_step = None
    _set(policy, 0.9, 0.9, "lookup")
    assert policy.next_k(100) == 2 and policy.next_k(100, "lookup") == 5


def test_lookup_and_model_drafts_keep_their_own_acceptance():
    costs = _cpu_costs()
    hybrid = DraftLength("adaptive", 6, costs)  # a hybrid: model drafts unless a step says "lookup"
    for _ in range(10):
        hybrid.update(6, 6, "lookup")
        hybrid.update(3, 0)
    assert hybrid.estimate("lookup").p_first > 0.9 and hybrid.estimate("model").p_first < 0.15
    assert hybrid.next_k(100, "lookup", available=6) == 6 and hybrid.next_k(100) == 0
    # The drafter-wide figures too, which the next request of this drafter starts from.
    assert costs.acceptance["lookup"].p_first > 0.9 and costs.acceptance["model"].p_first < 0.1
    following = DraftLength("adaptive", 6, costs)
    assert following.estimate("lookup").p_first > 0.9 and following.estimate("model").p_first < 0.1


def test_a_lookup_cut_short_by_its_rows_cost_probes_it_and_a_figure_too_high_is_measured_down():
    """A row cost priced too high (a calibration during another process's burst) would keep a lookup short for
    ever, its rows never verified again: every _PROBE_AFTER-th such step verifies all the lookup had; a probe that
    finds the rows as priced doubles the wait, one that finds them cheaper brings it back. The wait is the
    machine's: counted over all requests' steps."""
    step = 0.010
    true = {r: step * (1 + 0.05 * (r - 1)) for r in range(1, 18)}  # what rows cost (AMX-like)
    stale = {r: step * (1 + 2.0 * (r - 1)) for r in range(1, 18)}  # what the table says
    kind = "lookup:prompt:16"
    policy = DraftLength("adaptive", 6, _costs(0.001, stale), max_lookup=16)
    _set(policy, 0.95, 0.95, kind)
    assert policy.next_k(100, kind, 16) == 0  # priced out
    probes, ks = [], []
    for i in range(40):
        k = policy.next_k(100, kind, 16)
        k = policy.cost_probe(k, 16, kind)
        ks.append(k)
        if k == 16:
            probes.append(i)
        seconds = true[k + 1]
        policy.probed(k + 1, seconds)
        policy.costs.observe(0, 0.0, k + 1, seconds)
    # Probes found 17 rows far cheaper than priced: the schedule then verifies the long lookup on its own choice.
    assert probes[0] == _PROBE_AFTER - 1 and ks[-10:] == [16] * 10
    # Rows that cost what the table says: each probe doubles the wait, up to _COST_PROBE_MAX, whichever request
    # makes the steps (a new request every 10 steps, on the drafter's costs).
    costs = _costs(0.001, stale)
    probes = []
    for i in range(2100):
        if i % 10 == 0:
            policy = DraftLength("adaptive", 6, costs, max_lookup=16)
            _set(policy, 0.95, 0.95, kind)
        k = policy.cost_probe(policy.next_k(100, kind, 16), 16, kind)
        if k:
            probes.append(i)
        policy.probed(k + 1, stale[k + 1])
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[:6] == [2 * _PROBE_AFTER * 2**i for i in range(6)] and set(gaps[5:]) == {_COST_PROBE_MAX}
    # No probe where the longer lookup is not expected to yield half a token more (a match that is rarely right),
    # nor for a model draft (not free to propose), nor off the adaptive schedule.
    rare = DraftLength("adaptive", 6, _costs(0.001, stale), max_lookup=16)
    _set(rare, 0.1, 0.1, kind)
    _set(rare, 0.9, 0.9)
    fixed = DraftLength("fixed", 6, _costs(0.001, stale))
    for _ in range(3 * _PROBE_AFTER):
        assert rare.cost_probe(0, 16, kind) == 0 and rare.cost_probe(0, 6) == 0
        assert fixed.cost_probe(0, 6, kind) == 0


def test_a_probe_accepted_at_a_rate_that_still_does_not_pay_waits_longer_and_draft_steps_are_priced_at_their_mean():
    """A model draft accepted about half the time that its cost keeps out: its probes are often accepted, and an
    accepted probe used to bring the first wait back, a model step every few steps that did not pay; now only a
    probe after which drafting pays does. And a draft step is priced at its mean, not its fastest: its time varies
    with the catch-up before it (one row, or dozens after a run of lookups)."""
    policy = DraftLength("adaptive", 6, _cpu_costs(draft_step=0.004))
    _set(policy, 0.45, 0.45)
    waits, idle = [], 0
    for _ in range(400):
        if policy.next_k(100) == 0:
            policy.idle()
            idle += 1
            continue
        waits.append(idle)
        idle = 0
        policy.update(1, 1)  # accepted: still 0.45-ish, still not worth a draft step and a row
        _set(policy, 0.45, 0.45)
    assert waits[:4] == [_PROBE_AFTER, 2 * _PROBE_AFTER, 4 * _PROBE_AFTER, 8 * _PROBE_AFTER]
    costs = StepCosts()
    for seconds in (0.001, 0.001, 0.004, 0.001, 0.001, 0.004) * 20:
        costs.observe(1, seconds, 2, None)
    assert costs.draft_step == pytest.approx(0.002, rel=0.2)  # the mean (0.002), not the fastest (0.001)


def test_verify_cost_interpolates_and_extrapolates_a_line():
    c = _costs(0.001, {2: 0.010, 6: 0.030})
    assert c.verify_cost(4) == pytest.approx(0.020)
    assert c.verify_cost(8) == pytest.approx(0.040)
    # One row count measured: each further row is taken to cost half a 1-row step, not nothing.
    one = _costs(0.001, {5: 0.03})
    assert one.verify_cost(1) == pytest.approx(0.01) and one.verify_cost(3) == pytest.approx(0.02)


def test_verification_costs_are_kept_per_class_of_context():
    assert [context_class(c) for c in (0, 255, 256, 511, 512, 1023, 1024, 2047, 2048)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    costs = VerifyCosts()
    assert costs.cost(1) is None and not costs
    costs.seed({1: 0.004, 5: 0.0064}, context=100)  # a row 0.6 ms at a short context
    # Nothing measured at 1,500 keys: the nearest class's costs, as they are.
    assert costs.cost(3, 1500) == pytest.approx(0.0052)
    costs.observe(1, 0.006, 1500)  # a 1-row step there: the short class's slope scaled to it
    assert costs.cost(1, 1500) == 0.006 and costs.cost(5, 1500) == pytest.approx(0.006 * 0.0064 / 0.004)
    costs.observe(5, 0.0124, 1500)  # then its own line: 1.6 ms a row
    assert costs.cost(3, 1500) == pytest.approx(0.0092) and costs.cost(3, 1100) == pytest.approx(0.0092)
    assert costs.cost(3, 100) == pytest.approx(0.0052)  # the short context keeps its own
    # A class with none measured takes the nearest measured class's; on a tie the longer context's (dearer).
    assert costs.cost(1, 600) == 0.006 and costs.cost(1, 300) == 0.004
    costs.seed({1: 0.010, 5: 0.020}, context=4000)
    assert costs.cost(1, 2100) == 0.010 and costs.cost(1, 3000) == 0.010 and costs.cost(1, 8000) == 0.010
    apart = VerifyCosts()
    apart.seed({1: 0.004}, context=0)
    apart.seed({1: 0.008}, context=600)
    assert apart.cost(1, 300) == 0.008
    # One row count measured anywhere: each further row taken to cost half a 1-row step.
    assert apart.cost(3, 300) == pytest.approx(0.016)


def test_a_draft_that_pays_at_a_short_context_is_not_made_at_a_long_one():
    """The same acceptance, priced at each request's context: rows that read 2,000 keys cost several times what
    they cost at 300 (the default target on AVX-512), and a lookup that pays for its row at 300 does not there."""
    costs = StepCosts()
    costs.verify.seed({r: 0.0038 + 0.00065 * (r - 1) for r in (1, 2, 4, 8)}, context=300)
    costs.verify.seed({r: 0.0061 + 0.0016 * (r - 1) for r in (1, 2, 4, 8)}, context=2000)
    policy = DraftLength("adaptive", 6, costs, "lookup")
    _set(policy, 0.25, 0.25, "lookup")
    policy.context = 300
    assert policy.next_k(100) == 1
    policy.context = 2000
    assert policy.next_k(100) == 0


def test_a_slow_first_measurement_is_forgotten_quickly_and_a_slow_spell_slowly():
    c = StepCosts()
    c.observe(0, 0.0, 2, 0.100)  # a shape's first forward
    for _ in range(4):
        c.observe(0, 0.0, 2, 0.010)
    assert c.verify_cost(2) < 0.017
    c.observe(0, 0.0, 2, 0.100)  # another process took the cores for a moment
    assert c.verify_cost(2) < 0.027


def test_heuristic_is_huggingface_schedule():
    policy = DraftLength("heuristic", 9, StepCosts())
    policy._k = 5
    policy.update(5, 5)
    assert policy.next_k(100) == 7
    policy.update(7, 3)
    assert policy.next_k(100) == 6
    for _ in range(10):
        policy.update(6, 0)
    assert policy.next_k(100) == 1
    for _ in range(10):
        policy.update(policy.next_k(100), policy.next_k(100))
    assert policy.next_k(100) == 9  # capped at the most the request allows


def test_fixed_and_unknown_schedules():
    policy = DraftLength("fixed", 4, _costs(0.1, {5: 0.001}))
    _run(policy, 0.0)
    assert policy.next_k(100) == 4 and policy.next_k(3) == 3
    with pytest.raises(ValueError, match="adaptive, heuristic, fixed"):
        DraftLength("greedy", 4, StepCosts())


def test_costs_and_acceptance_are_shared_by_the_requests_of_a_drafter():
    verify = VerifyCosts()
    costs = StepCosts(verify)
    first = DraftLength("adaptive", 7, costs)
    for _ in range(30):
        first.update(4, 4)
        costs.observe(4, 0.004, 5, 0.03)
    assert costs.draft_step == pytest.approx(0.001) and costs.verify_cost(5) == pytest.approx(0.03)
    second = DraftLength("adaptive", 7, costs)
    assert second.acceptance > 0.9  # starts from what the drafter has shown, not from a blank 0.5
    # The verification seconds are the target's: another drafter's costs on the same table see them.
    other = StepCosts(verify)
    assert other.verify_cost(5) == pytest.approx(0.03) and other.draft_step is None


def _policy(schedule: str, acceptance_steps: int, accepted_fraction: float, draft_step: float) -> DraftLength:
    policy = DraftLength(schedule, 6, _costs(draft_step, {8: 0.030}))
    for _ in range(acceptance_steps):
        policy.update(4, round(4 * accepted_fraction))
    return policy


def test_batch_lengths_follow_each_request_until_a_batch_was_measured():
    policies = [_policy("adaptive", 10, 1.0, 0.001), _policy("fixed", 0, 0.0, 0.001)]
    assert batch_draft_lengths(policies, [100, 100], BatchCosts(), 2) == [p.next_k(100) for p in policies]


def test_batch_lengths_draft_where_it_pays_and_not_where_it_does_not():
    batch = _batch({2: 0.050, 3: 0.0525}, 0.00125)
    sure = _policy("adaptive", 10, 1.0, 0.001)
    unsure = _policy("adaptive", 10, 0.0, 0.001)
    fixed = _policy("fixed", 0, 0.0, 0.001)
    ks = batch_draft_lengths([sure, unsure, fixed], [100, 100, 100], batch, 2)
    assert ks[0] >= 4  # accepted nearly always and cheap: long drafts
    assert ks[1] == 0  # never accepted: drafting only slows the whole batch
    assert ks[2] == 6  # a fixed schedule keeps its length
    assert batch_draft_lengths([sure], [2], batch, 2) == [2]  # never past what the request may still add
    # The same request with a draft step as dear as a whole batched forward: not worth a single token.
    dear = _policy("adaptive", 10, 0.6, 0.5)
    assert batch_draft_lengths([dear, dear], [100, 100], batch, 2) == [0, 0]


def test_a_request_the_batch_stopped_drafting_for_drifts_back_to_the_drafters_acceptance():
    costs = StepCosts()
    others = DraftLength("adaptive", 6, costs)
    for _ in range(40):
        others.update(4, 3)  # the drafter does well on other requests: acceptance about 0.75
    unlucky = DraftLength("adaptive", 6, costs)
    for _ in range(10):
        unlucky.update(4, 0)
    assert unlucky.acceptance < 0.2
    batch = _batch({2: 0.050, 3: 0.0525}, 0.00125)
    for length in (unlucky, others):
        length.costs.draft_step = 0.001
    assert batch_draft_lengths([unlucky, others], [100, 100], batch, 2)[0] == 0
    # Skipped step after step, it carries no new evidence: its estimate returns toward the drafter's,
    # and the batch tries it again.
    for _ in range(30):
        unlucky.rest()
    drafter = costs.acceptance["model"]
    assert unlucky.estimate().p_first == pytest.approx(drafter.p_first, abs=0.02)
    assert unlucky.estimate().p_then == pytest.approx(drafter.p_then, abs=0.02)
    assert batch_draft_lengths([unlucky, others], [100, 100], batch, 2)[0] > 1  # more than a probe's one token


def test_a_batch_probes_a_request_it_keeps_from_drafting_unless_its_draft_could_never_pay():
    batch = _batch({2: 0.050, 3: 0.0525}, 0.00125)
    hopeless, dear = DraftLength("adaptive", 6, _cpu_costs()), DraftLength("adaptive", 6, _cpu_costs(0.050))
    for length in (hopeless, dear):
        _set(length, 0.0, 0.0, weight=1e6)  # so much evidence that resting does not move it
    ks = []
    for _ in range(4 * _PROBE_AFTER):
        ks.append(batch_draft_lengths([hopeless, dear], [100, 100], batch, 2))
        for length, k in zip((hopeless, dear), ks[-1], strict=True):
            if k:
                length.update(k, 0)
            else:
                length.rest()
    probes = [i for i, (k, _) in enumerate(ks) if k]
    assert probes == [_PROBE_AFTER, 3 * _PROBE_AFTER + 1] and all(ks[i][0] == 1 for i in probes)
    # A draft step five times a target step's: no length pays even if every token is accepted, no probe.
    assert all(k == 0 for _, k in ks)
    assert not dear.could_pay(6) and hopeless.could_pay(6)


def _half_accepted(max_k: int = 6) -> DraftLength:
    policy = DraftLength("adaptive", max_k, _costs(0.005, {8: 0.030}))
    _set(policy, 0.5, 0.5)  # half of the tokens accepted, at every position
    return policy


def test_a_shared_draft_forward_is_priced_once_per_position_for_all_its_requests():
    # Verifying 16 rows costs about what 8 do (one 16-row tile); a draft step costs 5 ms alone or for all 8.
    batch = _batch({4: 0.015, 8: 0.020}, 0.000125)
    policies = [_half_accepted() for _ in range(8)]
    limits = [100] * 8
    # Drafting alone, each token costs its own 5 ms step: 8 of them would double the step. Nothing pays.
    assert batch_draft_lengths(policies, limits, batch, 0, [0.005] * 8) == [0] * 8
    # Drafted together, one 5 ms forward drafts a token for each of the 8 (4 tokens expected for 25 % more
    # time), though one token for one request alone would not pay (0.5 token for 25 %).
    assert batch_draft_lengths(policies, limits, batch, 0, [0.005] * 8, ["eagle"] * 8) == [1] * 8
    # A request that is never accepted is left out of the shared draft even so.
    hopeless = DraftLength("adaptive", 6, _costs(0.005, {8: 0.030}))
    for _ in range(20):
        hopeless.update(2, 0)
    ks = batch_draft_lengths([*policies[:7], hopeless], limits, batch, 0, [0.005] * 8, ["eagle"] * 8)
    assert ks == [1] * 7 + [0]
    # Each drafter's forward is priced on its own: at 2.5 ms a step, two forwards for four requests each pay,
    # eight forwards for one each do not.
    ks = batch_draft_lengths(policies, limits, batch, 0, [0.0025] * 8, ["a"] * 4 + ["b"] * 4)
    assert ks == [1] * 8
    ks = batch_draft_lengths(policies, limits, batch, 0, [0.0025] * 8, list("abcdefgh"))
    assert ks == [0] * 8


def test_a_large_batch_whose_rows_cost_a_token_each_neither_drafts_nor_probes():
    """On a CPU whose verification rows cost about what a token is worth in a large batch (AVX2: 16 rows 94 ms,
    each more 5.9 ms, so a drafted row pays only if accepted nearly always), a batch of 16 requests whose drafts
    are accepted two times in three drafts nothing, and its idle requests do not probe (a probe's row would
    cost every request, and no acceptance could make it pay); two such requests alone still draft."""
    batch = _batch({s: 0.0060 + 0.0055 * s for s in (2, 4, 8, 16)}, 0.0055)
    lengths = [DraftLength("adaptive", 6, _cpu_costs(0.0015)) for _ in range(16)]
    for length in lengths:
        _set(length, 0.67, 0.67)
    for _ in range(3 * _PROBE_AFTER):
        ks = batch_draft_lengths(lengths, [100] * 16, batch, 0)
        assert ks == [0] * 16
        for length in lengths:
            length.rest()
    assert lengths[0].probing() and lengths[0].could_pay(6)  # alone, it would have probed
    assert sum(batch_draft_lengths(lengths[:2], [100, 100], batch, 0)) > 0


def test_a_large_batch_whose_rows_cost_less_than_its_sequences_drafts_what_pays():
    """On the AMX Xeon at context 512 a sequence costs a batch 1.5 ms and a further row of a sequence already in
    it 0.7 ms (docs/bench/amxint8/2026-12-07-batch-rows-apart.md). A token of a 16-request step is worth its
    1.6 ms: a free lookup accepted two times in three pays for its row. Priced as a sequence (by total rows, as
    before), the same row would not, and the batch drafted nothing."""
    seqs = {s: 0.002 + 0.0015 * s for s in (2, 4, 8, 16)}
    lengths = [DraftLength("adaptive", 6, _cpu_costs(0.0)) for _ in range(16)]
    for length in lengths:
        _set(length, 0.67, 0.67)
    ks = batch_draft_lengths(lengths, [100] * 16, _batch(seqs, 0.0007), 0)
    assert all(k >= 1 for k in ks)
    assert batch_draft_lengths(lengths, [100] * 16, _batch(seqs, 0.0015), 0) == [0] * 16


def test_a_batch_sizes_lookups_as_free_to_propose_and_within_what_they_found():
    """A lookup's tokens cost a batch only their rows: a request whose lookup found 5 tokens of a long match is
    sized by the batch though its drafter never timed a draft step (a lookup has none), never past what was
    found (3 tokens here); a model draft whose step was never measured drafts its first tokens, which measure it."""
    seqs = {s: 0.002 + 0.0015 * s for s in (2, 4, 8, 16)}
    lengths = [DraftLength("adaptive", 8, StepCosts(), kind="lookup") for _ in range(8)]
    kinds = ["lookup:self:16"] * 8
    ks = batch_draft_lengths(lengths, [3] * 8, _batch(seqs, 0.0004), 0, None, None, 0, kinds)
    assert ks == [3] * 8  # a 16-token match: accepted about 0.89 a token, cheap rows
    assert batch_draft_lengths(lengths, [3] * 8, _batch(seqs, 0.004), 0, None, None, 0, kinds) == [0] * 8
    model = DraftLength("adaptive", 8, StepCosts())
    assert model.costs.draft_step is None
    ks = batch_draft_lengths(
        [*lengths[:7], model], [3] * 7 + [20], _batch(seqs, 0.0004), 0, None, None, 0, [*kinds[:7], None]
    )
    assert ks == [3] * 7 + [2]


def test_batch_costs_keep_sequences_and_rows_apart():
    costs = BatchCosts()
    assert not costs and costs.pricer(4) is None and costs.row() is None
    for seqs in (2, 4, 8):
        costs.observe(seqs, seqs, 0.002 + 0.0015 * seqs, 300)  # one row each: the sequences' own cost
    assert costs.row(300) is None
    price = costs.pricer(8, 300)
    assert price is not None
    # No row measured yet: a row is priced as a sequence, the dearest it could be.
    assert price(8) == pytest.approx(0.014) and price(10) == pytest.approx(0.017)
    costs.observe(8, 24, 0.014 + 16 * 0.0007, 300)  # two rows more for each: 0.7 ms a row
    assert costs.row(300) == pytest.approx(0.0007)
    assert costs.pricer(8, 300)(12) == pytest.approx(0.014 + 4 * 0.0007)
    # A one-row probe that ran slow moves the figure less than the sixteen rows did, and an outlier at most
    # three times the known price of its rows.
    costs.observe(8, 9, 0.014 + 0.0100, 300)
    assert 0.0007 < costs.row(300) < 0.0007 + 0.0021 / 16
    # Another context class borrows the nearest measured class's row figure until it has its own.
    assert costs.row(5000) == costs.row(300)
    costs.seed({2: 0.009}, 0.0002, 5000)
    assert costs.row(5000) == pytest.approx(0.0002) and costs.row(300) > 0.0007
    # A seed never replaces what was measured.
    costs.seed({8: 1.0}, 1.0, 300)
    assert costs.seqs.table(300)[8] == pytest.approx(0.014) and costs.row(300) < 0.001


def test_each_tenant_starts_from_its_own_acceptance_and_shares_only_the_machines_costs(make_tiny_model, word_tokenizer):
    """A tenant's acceptance says what its text is like; another tenant's requests must not start from it (their
    draft lengths, in their responses, would say it), while the seconds of a draft step are the machine's."""
    from app.engine.drafting.registry import DraftContext, builtin
    from app.engine.engine import Engine
    from app.engine.step import GenerationParams

    target = make_tiny_model(seed=3, vocab_size=32)
    drafters = builtin(DraftContext(None, None))
    engine = Engine(target, word_tokenizer(32), drafters, "ngram", 4, prefill_chunk=0, prefill_step_seconds=0.0)
    ids = [1, 2, 3, 4, 5, 6, 7] * 3

    def start(salt, isolated=False):
        return engine.start(ids, GenerationParams(max_new_tokens=16, cache_salt=salt, isolated=isolated), "ngram")

    first = start("salt:a")
    for _ in range(40):
        first.draft_length.update(4, 4, "lookup")
        first.draft_length.costs.observe_acceptance(4, 4, "lookup")
        first.draft_length.costs.observe(4, 0.004, 5, 0.03)
    assert start("salt:a").draft_length.costs is first.draft_length.costs  # a tenant's requests share theirs
    assert start("salt:a").draft_length.estimate("lookup").p_first > 0.9
    for other in (start("salt:b"), start(None), start(None, isolated=True)):
        assert other.draft_length.costs is not first.draft_length.costs
        assert other.draft_length.estimate("lookup").p_first == pytest.approx(prior("lookup"))
        assert other.draft_length.costs.draft_step == pytest.approx(first.draft_length.costs.draft_step)


def test_the_value_floor_is_a_verified_rows_price_as_a_share_of_a_plain_step():
    """The adaptive schedule's value cut-off for a model draft: one more verified row's price over a plain step's at
    the request's context (the borrowed line where that row count was not timed), capped; nothing while no cost was
    measured, and nothing on the fixed and heuristic schedules, whose k is the user's."""
    policy = DraftLength("adaptive", 8, _costs(0.001, {1: 0.004, 2: 0.0048, 8: 0.0090}))
    assert policy.value_floor() == pytest.approx(0.2)
    policy.context = 1000  # a class of its own, unmeasured: the nearest class's figures
    assert policy.value_floor() == pytest.approx(0.2)
    own = policy.costs.verify
    own.seed({1: 0.010, 3: 0.013}, context=1000)  # 2 rows on the line through 1 and 3: 0.0115
    assert policy.value_floor() == pytest.approx(0.15)
    assert DraftLength("adaptive", 8, _costs(0.001, {1: 0.004, 2: 0.010})).value_floor() == 0.5
    assert DraftLength("adaptive", 8, _costs(0.001, {1: 0.004, 2: 0.0039})).value_floor() == 0.0
    assert DraftLength("adaptive", 8, StepCosts()).value_floor() == 0.0
    for schedule in ("fixed", "heuristic"):
        assert DraftLength(schedule, 8, _costs(0.001, {1: 0.004, 2: 0.0048})).value_floor() == 0.0
