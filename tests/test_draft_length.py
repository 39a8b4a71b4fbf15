"""Draft-length schedules: the cost model's choice, HF's heuristic, and fixed."""

from __future__ import annotations

import pytest

from app.engine.draft_length import DraftLength, StepCosts, batch_draft_lengths, expected_tokens


def _costs(draft_step: float, verify: dict[int, float]) -> StepCosts:
    c = StepCosts()
    c.draft_step = draft_step
    c.verify = dict(verify)
    return c


def test_expected_tokens_per_pass():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def _run(policy: DraftLength, accepted_fraction: float, steps: int = 20) -> None:
    for _ in range(steps):
        k = policy.next_k(100)
        policy.update(k, round(k * accepted_fraction))


def test_adaptive_drafts_long_when_drafting_is_cheap_and_accepted():
    policy = DraftLength("adaptive", 7, _costs(0.001, {8: 0.030}))
    _run(policy, 1.0)
    assert policy.next_k(100) == 7
    assert policy.acceptance > 0.9


def test_adaptive_drafts_short_when_rejected_or_expensive():
    rejected = DraftLength("adaptive", 7, _costs(0.004, {8: 0.030}))
    _run(rejected, 0.0)
    assert rejected.next_k(100) == 1
    # Accepted often, but a draft step costs as much as a verification: short drafts pay best.
    costly = DraftLength("adaptive", 7, _costs(0.030, {2: 0.030, 8: 0.030}))
    _run(costly, 0.6)
    assert costly.next_k(100) <= 2


def test_adaptive_picks_the_k_that_maximises_expected_tokens_per_second():
    costs = _costs(0.003, {2: 0.020, 8: 0.035})
    policy = DraftLength("adaptive", 7, costs)
    a = policy.acceptance
    rates = {k: expected_tokens(a, k) / (k * 0.003 + costs.verify_cost(k + 1)) for k in range(1, 8)}
    assert policy.next_k(100) == max(rates, key=rates.get)
    assert policy.next_k(2) <= 2  # never more than the room left


def test_adaptive_without_measurements_uses_the_configured_length():
    assert DraftLength("adaptive", 5, StepCosts()).next_k(100) == 5


def test_verify_cost_interpolates_and_extrapolates_a_line():
    c = _costs(0.001, {2: 0.010, 6: 0.030})
    assert c.verify_cost(4) == pytest.approx(0.020)
    assert c.verify_cost(8) == pytest.approx(0.040)
    assert _costs(0.001, {5: 0.02}).verify_cost(2) == 0.02


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
    costs = StepCosts()
    first = DraftLength("adaptive", 7, costs)
    for _ in range(30):
        first.update(4, 4)
        costs.observe(4, 0.004, 5, 0.03)
    assert costs.draft_step == pytest.approx(0.001) and costs.verify[5] == pytest.approx(0.03)
    second = DraftLength("adaptive", 7, costs)
    assert second.acceptance > 0.9  # starts from what the drafter has shown, not from a blank 0.5


def _policy(schedule: str, acceptance_steps: int, accepted_fraction: float, draft_step: float) -> DraftLength:
    policy = DraftLength(schedule, 6, _costs(draft_step, {8: 0.030}))
    for _ in range(acceptance_steps):
        policy.update(4, round(4 * accepted_fraction))
    return policy


def test_batch_lengths_follow_each_request_until_a_batch_was_measured():
    policies = [_policy("adaptive", 10, 1.0, 0.001), _policy("fixed", 0, 0.0, 0.001)]
    assert batch_draft_lengths(policies, [100, 100], StepCosts(), 2) == [p.next_k(100) for p in policies]


def test_batch_lengths_draft_where_it_pays_and_not_where_it_does_not():
    batch = _costs(0.0, {8: 0.060, 16: 0.070, 24: 0.080, 32: 0.090})
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
    batch = _costs(0.0, {8: 0.060, 16: 0.070, 24: 0.080, 32: 0.090})
    for length in (unlucky, others):
        length.costs.draft_step = 0.001
    assert batch_draft_lengths([unlucky, others], [100, 100], batch, 2)[0] == 0
    # Skipped step after step, it carries no new evidence: its estimate returns toward the drafter's,
    # and the batch tries it again.
    for _ in range(30):
        unlucky.rest()
    assert unlucky.acceptance == pytest.approx(unlucky.prior(), abs=0.02)
    assert batch_draft_lengths([unlucky, others], [100, 100], batch, 2)[0] > 0
