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


def _half_accepted(max_k: int = 6) -> DraftLength:
    policy = DraftLength("adaptive", max_k, _costs(0.005, {8: 0.030}))
    for _ in range(20):
        policy.update(2, 1)  # one of two accepted: about 0.5 per token
    return policy


def test_a_shared_draft_forward_is_priced_once_per_position_for_all_its_requests():
    # Verifying 16 rows costs about what 8 do (one 16-row tile); a draft step costs 5 ms alone or for all 8.
    batch = _costs(0.0, {8: 0.020, 16: 0.021})
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
