"""The admission policy alone (app.service.admission): no engine, no thread, no clock; requests are sizes in bytes.
The scheduler's use of it, with a worker and a tiny engine, is in tests/test_worker.py."""

from __future__ import annotations

from dataclasses import dataclass

from app.service.admission import MAX_RETRY_AFTER, RATE_WINDOW, Admission


@dataclass(eq=False)
class _Req:
    kv_bytes: int
    overtaken: int = 0
    admitted: bool = False
    ended: bool = False


def _arrive(policy: Admission[_Req], *sizes: int) -> tuple[list[_Req], list[_Req]]:
    """Queue requests of `sizes` bytes one after the other, admitting after each as the scheduler does; returns
    them and those admitted."""
    reqs, admitted = [], []
    for size in sizes:
        req = _Req(size)
        reqs.append(req)
        policy.waiting.append(req)
        admitted += policy.admit_waiting()
    return reqs, admitted


def test_requests_are_admitted_while_their_bytes_fit_the_budget() -> None:
    policy: Admission[_Req] = Admission(kv_budget=100, max_running=8, max_waiting=4)
    (a, b, c), admitted = _arrive(policy, 40, 50, 20)
    assert admitted == [a, b] and a.admitted and b.admitted and not c.admitted
    assert policy.held_bytes == 90 and policy.reserved == {a: 40, b: 50} and list(policy.waiting) == [c]
    assert policy.fits(10) and not policy.fits(11)
    assert policy.release(a) and not policy.release(a), "a request's memory is freed once"
    assert policy.held_bytes == 50
    assert policy.admit_waiting() == [c] and policy.held_bytes == 70 and not policy.waiting


def test_max_running_bounds_the_places_and_an_ended_request_frees_its_place_not_its_memory() -> None:
    policy: Admission[_Req] = Admission(kv_budget=1000, max_running=2, max_waiting=4)
    (a, b, c), admitted = _arrive(policy, 10, 10, 10)
    assert admitted == [a, b] and policy.places_taken() == 2 and not policy.may_start(1)
    a.ended = True  # its client has its answer; the worker has not dropped its generation yet
    assert policy.places_taken() == 1 and policy.held_bytes == 20
    assert policy.admit_waiting() == [c] and policy.held_bytes == 30


def test_a_short_request_passes_a_big_one_at_most_max_overtakes_times() -> None:
    policy: Admission[_Req] = Admission(kv_budget=100, max_running=16, max_waiting=8, max_overtakes=2)
    (running, big, *shorts), admitted = _arrive(policy, 60, 60, 10, 10, 10)
    assert admitted == [running, shorts[0], shorts[1]], "the short ones fit beside the running one: they pass"
    assert big.overtaken == 2 and not big.admitted
    assert policy.fits(10) and not policy.may_start(10), "the third short one fits, the rule holds it back"
    assert not shorts[2].admitted and list(policy.waiting) == [big, shorts[2]]
    assert policy.release(running)
    assert policy.admit_waiting() == [big, shorts[2]], "the memory freed goes to the big one first"
    assert policy.held_bytes == 90 and not policy.waiting


def test_retry_after_is_the_requests_ahead_over_the_rate_at_which_requests_ended() -> None:
    policy: Admission[_Req] = Admission(kv_budget=1, max_running=1, max_waiting=1, retry_after=2, queue_timeout=30)
    now = 1000.0
    assert policy.retry_after_for(4, now) == 30, "nothing measured: the queue timeout"
    policy.ended_at.extend(now - 30 + 3 * i for i in range(10))  # 10 ended in the last 30 s: 1 per 3 s
    assert policy.retry_after_for(4, now) == 12
    policy.ended_at.appendleft(now - RATE_WINDOW - 1)  # out of the window: forgotten
    assert policy.retry_after_for(3, now) == 9 and len(policy.ended_at) == 10
    assert policy.retry_after_for(0, now) == 2, "at least `retry_after`"
    assert policy.retry_after_for(10_000, now) == MAX_RETRY_AFTER
    unbounded: Admission[_Req] = Admission(kv_budget=1, max_running=1, max_waiting=1)
    assert unbounded.retry_after_for(1, now) == RATE_WINDOW, "no queue timeout: the window"
