"""The scheduler and its worker thread, driven directly with the real target: interleaving, identical greedy
texts whatever runs alongside, cancellation that frees the place at once, failures that stay with their
request; and on a tiny target, admission by KV-cache memory: by bytes, the fair queue both ways (a short request
passes a big one, the big one is not starved), 4xx and 429, and issue 31's short request behind four long prompts
counted in worker steps."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from app.engine import kernels
from app.engine.step import GenerationParams
from app.service.events import Overloaded, RequestFailed
from app.service.metrics import Metrics
from app.service.scheduler import Scheduler, Ticket
from tests.conftest import FIXED_DRAFT, KERNELS

pytestmark = pytest.mark.anyio

MODEL = "smol"  # the model_name label of every series
PROMPTS = ["The capital of France is", "Water boils at", "1, 2, 3, 4, 5,"]
# What a request hears when a part of its step it shared with others failed: the exception's type only.
SHARED_FAILURE = "generation failed: the step this request shared with others failed ({}); retry it"


async def _collect(ticket: Ticket) -> tuple[str, list[int], float]:
    """Text, token ids and the time the last event arrived."""
    ids: list[int] = []
    async for event in ticket.events():
        ids.extend(t.id for t in event.tokens)
        if event.finished is not None:
            return event.finished.text, ids, time.monotonic()
    raise AssertionError("no finished event")


def _sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample of `registry`, whose model_name label is MODEL."""
    return registry.get_sample_value(name, {"model_name": MODEL, **(labels or {})})


@pytest.fixture
def scheduler(api_engine):
    metrics = Metrics(MODEL)
    s = Scheduler(api_engine, max_running=4, max_waiting=4, metrics=metrics)
    s.start()
    yield s
    s.stop()


def _ids(api_engine, prompt: str) -> list[int]:
    return api_engine.tokenizer.encode(prompt)


@pytest.fixture
def batching_scheduler(packed_target):
    """A scheduler over the bf16 target on this CPU's best kernel, where requests share target forwards."""
    from app.engine.drafting.ngram import NgramDrafter
    from app.engine.engine import Engine

    packed = packed_target(KERNELS[0])
    engine = Engine(
        packed.model,
        packed.tokenizer,
        {"ngram": NgramDrafter()},
        "ngram",
        4,
        **FIXED_DRAFT,
    )
    s = Scheduler(engine, max_running=4, max_waiting=4, metrics=Metrics(MODEL))
    s.start()
    yield s
    s.stop()


async def test_concurrent_requests_give_their_sequential_texts(batching_scheduler, api_engine) -> None:
    scheduler = batching_scheduler
    params = GenerationParams(max_new_tokens=10, num_draft_tokens=4)
    sequential = []
    for prompt in PROMPTS:
        sequential.append(await _collect(scheduler.submit(_ids(api_engine, prompt), params, None, 60)))
    tickets = [scheduler.submit(_ids(api_engine, p), params, None, 60) for p in PROMPTS]
    concurrent = await asyncio.gather(*(_collect(t) for t in tickets))
    assert [c[:2] for c in concurrent] == [s[:2] for s in sequential]
    assert len({text for text, _, _ in sequential}) == 3
    registry = scheduler.metrics.registry
    successes = sum(
        _sample(registry, "specserve_requests_total", {"outcome": "success", "finish_reason": r}) or 0
        for r in ("eos", "stop", "length")
    )
    assert successes == 6
    assert _sample(registry, "specserve_requests_total", {"outcome": "cancelled", "finish_reason": "none"}) == 0
    # Running together, their decoding steps shared target forwards.
    forwards = _sample(registry, "specserve_batch_size_count")
    alone = _sample(registry, "specserve_batch_size_bucket", {"le": "1.0"})
    assert forwards > alone > 0


async def _finished(ticket: Ticket):
    async for event in ticket.events():
        if event.finished is not None:
            return event.finished
    raise AssertionError("no finished event")


async def test_finished_carries_the_seed_sampling_used(scheduler, api_engine) -> None:
    ids = _ids(api_engine, PROMPTS[0])
    seeded = GenerationParams(max_new_tokens=6, temperature=1.0, seed=42, num_draft_tokens=4)
    given, drawn, greedy = await asyncio.gather(
        _finished(scheduler.submit(ids, seeded, None, 60)),
        _finished(
            scheduler.submit(ids, GenerationParams(max_new_tokens=6, temperature=1.0, num_draft_tokens=4), None, 60)
        ),
        _finished(scheduler.submit(ids, GenerationParams(max_new_tokens=6, seed=42, num_draft_tokens=4), None, 60)),
    )
    assert given.seed == 42
    assert isinstance(drawn.seed, int)
    assert greedy.seed is None, "greedy decoding reports no seed, as TGI"
    # The drawn seed replays the request; the given one reproduced it beside two others.
    replay = await _finished(
        scheduler.submit(
            ids, GenerationParams(max_new_tokens=6, temperature=1.0, seed=drawn.seed, num_draft_tokens=4), None, 60
        )
    )
    assert replay.text == drawn.text
    assert (await _finished(scheduler.submit(ids, seeded, None, 60))).text == given.text


async def test_a_short_request_is_not_held_behind_a_long_one(scheduler, api_engine) -> None:
    # Target-only decoding: one token per step, so the long request needs 32 steps.
    params = GenerationParams(max_new_tokens=32, ignore_eos=True, num_draft_tokens=4)
    long = scheduler.submit(_ids(api_engine, PROMPTS[0]), params, "none", 60)
    short = scheduler.submit(
        _ids(api_engine, PROMPTS[1]), GenerationParams(max_new_tokens=3, num_draft_tokens=4), "none", 60
    )
    (_, long_ids, long_done), (_, short_ids, short_done) = await asyncio.gather(_collect(long), _collect(short))
    assert len(long_ids) == 32 and len(short_ids) == 3
    assert short_done < long_done


async def test_cancel_frees_the_place_and_stops_the_generation(scheduler, api_engine) -> None:
    registry = scheduler.metrics.registry
    params = GenerationParams(max_new_tokens=500, ignore_eos=True, num_draft_tokens=4)
    ticket = scheduler.submit(_ids(api_engine, PROMPTS[0]), params, "none", 60)
    events = ticket.events()
    await events.__anext__()  # the prefill's token
    assert scheduler.holding == 1
    ticket.cancel()
    assert scheduler.holding == 0, "the place is free at once"
    await events.aclose()
    deadline = time.monotonic() + 5
    while _sample(registry, "specserve_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the worker kept the cancelled generation"
        await asyncio.sleep(0.01)
    generated = _sample(registry, "specserve_generation_tokens_total")
    await asyncio.sleep(0.3)
    assert _sample(registry, "specserve_generation_tokens_total") == generated
    assert generated < 50
    assert _sample(registry, "specserve_requests_total", {"outcome": "cancelled", "finish_reason": "none"}) == 1


async def test_admission_is_bounded(api_engine) -> None:
    s = Scheduler(api_engine, max_running=1, max_waiting=1)  # not started: nothing leaves
    ids = _ids(api_engine, PROMPTS[0])
    first = s.submit(ids, GenerationParams(max_new_tokens=1, num_draft_tokens=4), None, 60)
    s.submit(ids, GenerationParams(max_new_tokens=1, num_draft_tokens=4), None, 60)
    with pytest.raises(Overloaded) as refused:
        s.submit(ids, GenerationParams(max_new_tokens=1, num_draft_tokens=4), None, 60)
    assert refused.value.retry_after >= 1
    first.cancel()
    s.submit(ids, GenerationParams(max_new_tokens=1, num_draft_tokens=4), None, 60)  # the cancelled one's place


async def test_engine_refusal_and_shutdown_fail_the_request_only(scheduler, api_engine) -> None:
    ids = _ids(api_engine, PROMPTS[0])
    too_long = scheduler.submit(ids, GenerationParams(max_new_tokens=9000, num_draft_tokens=4), None, 60)
    with pytest.raises(RequestFailed) as failed:
        await _collect(too_long)
    assert failed.value.kind == "validation" and "context" in failed.value.message
    text, _, _ = await _collect(scheduler.submit(ids, GenerationParams(max_new_tokens=2, num_draft_tokens=4), None, 60))
    assert text
    pending = scheduler.submit(
        ids, GenerationParams(max_new_tokens=500, ignore_eos=True, num_draft_tokens=4), "none", 60
    )
    await asyncio.sleep(0.05)
    await asyncio.to_thread(scheduler.stop)
    with pytest.raises(RequestFailed) as stopped:
        await _collect(pending)
    assert stopped.value.kind == "unavailable"


async def test_a_prompt_prefilled_in_chunks_streams_no_empty_event(target_bf16) -> None:
    """A long prompt prefilled a few tokens per step (on AMX) beside a running request: the steps that only
    prefilled send nothing, the first event carries the first token, and both texts equal their solo texts."""
    import copy

    from app.engine.engine import Engine

    model = copy.deepcopy(target_bf16.model)
    assert model.pack(kernels.kernel())
    engine = Engine(
        model,
        target_bf16.tokenizer,
        {},
        "none",
        0,
        prefill_chunk=16,
        draft_schedule="fixed",
        draft_p_min=0.0,
        prefill_step_seconds=0.0,
    )
    s = Scheduler(engine, max_running=4, max_waiting=4, metrics=Metrics(MODEL))
    s.start()
    try:
        params = GenerationParams(max_new_tokens=12, num_draft_tokens=4)
        long_ids = _ids(engine, " ".join(PROMPTS * 6))
        short_ids = _ids(engine, PROMPTS[0])
        alone = [await _collect(s.submit(ids, params, None, 60)) for ids in (short_ids, long_ids)]
        events: list[list[int]] = []

        async def collect(ticket: Ticket) -> tuple[str, list[int]]:
            ids: list[int] = []
            async for event in ticket.events():
                events.append([t.id for t in event.tokens])
                ids.extend(events[-1])
                if event.finished is not None:
                    return event.finished.text, ids
            raise AssertionError("no finished event")

        short = s.submit(short_ids, GenerationParams(max_new_tokens=40, num_draft_tokens=4), None, 60)
        await asyncio.sleep(0.05)  # running before the long prompt arrives
        together = await asyncio.gather(collect(short), collect(s.submit(long_ids, params, None, 60)))
    finally:
        s.stop()
    assert len(long_ids) > 3 * 16
    assert together[1] == alone[1][:2]
    assert together[0][1][:12] == alone[0][1]
    assert all(events)  # no event without a token


class _ThreadKiller(BaseException):
    """Past the worker's `except Exception`: what ends the thread."""


def _fault_once(monkeypatch, engine, exc: BaseException) -> list[str]:
    """Make `engine.step_batch` raise `exc` on its next call; returns the names of the threads it was raised in."""
    raised_in: list[str] = []
    real = engine.step_batch

    def step_batch(gens):
        if not raised_in:
            raised_in.append(threading.current_thread().name)
            raise exc
        return real(gens)

    monkeypatch.setattr(engine, "step_batch", step_batch)
    return raised_in


async def test_a_failed_step_fails_its_requests_and_the_worker_goes_on(api_engine, monkeypatch) -> None:
    s = Scheduler(api_engine, max_running=4, max_waiting=4, metrics=Metrics(MODEL))
    ids = _ids(api_engine, PROMPTS[0])
    # Submitted before the worker starts, so that both are in its first step.
    tickets = [s.submit(ids, GenerationParams(max_new_tokens=8, num_draft_tokens=4), None, 60) for _ in range(2)]
    raised_in = _fault_once(monkeypatch, api_engine, RuntimeError("injected fault"))
    s.start()
    try:
        t0 = time.monotonic()
        for ticket in tickets:
            with pytest.raises(RequestFailed) as failed:
                await _collect(ticket)
            assert failed.value.kind == "generation"
            # Every request of the step hears the type, not the text (which may quote another request).
            assert failed.value.message == SHARED_FAILURE.format("RuntimeError")
        assert time.monotonic() - t0 < 30, "failed at once, not at the timeout"
        assert raised_in == ["specserve-worker"]
        text, _, _ = await _collect(s.submit(ids, GenerationParams(max_new_tokens=4, num_draft_tokens=4), None, 60))
        assert text
        assert s.failure is None and s.holding == 0
        registry = s.metrics.registry
        deadline = time.monotonic() + 5
        while _sample(registry, "specserve_num_requests_running") != 0:
            assert time.monotonic() < deadline, "the running gauge stayed up"
            await asyncio.sleep(0.01)
        assert _sample(registry, "specserve_requests_total", {"outcome": "error", "finish_reason": "none"}) == 2
    finally:
        s.stop()


async def test_a_failed_delivery_fails_that_request_alone(api_engine, monkeypatch) -> None:
    s = Scheduler(api_engine, max_running=4, max_waiting=4, metrics=Metrics(MODEL))
    params = GenerationParams(max_new_tokens=6, num_draft_tokens=4)
    tickets = [s.submit(_ids(api_engine, p), params, None, 60) for p in PROMPTS[:2]]
    real = s.metrics.tokens_delivered
    calls: list[int] = []

    def tokens_delivered(*args) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("injected metrics fault")
        real(*args)

    monkeypatch.setattr(s.metrics, "tokens_delivered", tokens_delivered)
    s.start()
    try:
        outcomes = await asyncio.gather(*(_collect(t) for t in tickets), return_exceptions=True)
        alone = await _collect(s.submit(_ids(api_engine, PROMPTS[1]), params, None, 60))
    finally:
        s.stop()
    assert isinstance(outcomes[0], RequestFailed)
    assert outcomes[0].message == "generation failed: ValueError: injected metrics fault"
    assert outcomes[1][:2] == alone[:2]


async def test_a_failed_shared_forward_tells_no_request_another_ones_text(monkeypatch, caplog) -> None:
    """The batched target forward fails with an exception quoting one request's prompt: every request in it ends
    with the exception's type alone (none of them is known to have caused it); the log has the text."""
    engine = _chunking_engine()
    if engine is None:
        pytest.skip("no CPU kernel here: no batched forward")
    real = engine.target.hidden_batch
    raised: list[int] = []

    def hidden_batch(sequences):
        if len(sequences) > 1 and not raised:
            raised.append(len(sequences))
            raise ValueError("no room for the rows of 't7 t7 t7 the secret of request A'")
        return real(sequences)

    monkeypatch.setattr(engine.target, "hidden_batch", hidden_batch)
    s = Scheduler(engine, max_running=4, max_waiting=4)
    params = GenerationParams(max_new_tokens=4, num_draft_tokens=0)
    # Submitted before the worker starts: both in its first step, prefilled in one forward.
    tickets = [s.submit(ids, params, "none", 60) for ids in ([7, 7, 7], [1, 2, 3])]
    s.start()
    try:
        outcomes = await asyncio.gather(*(_collect(t) for t in tickets), return_exceptions=True)
        after = await _collect(s.submit([1, 2, 3], params, "none", 60))
    finally:
        s.stop()
    assert raised == [2]
    for outcome in outcomes:
        assert isinstance(outcome, RequestFailed) and outcome.kind == "generation", outcome
        assert outcome.message == SHARED_FAILURE.format("ValueError")
    assert "the secret of request A" in caplog.text
    assert after[1]  # the worker went on


async def test_a_dead_worker_fails_everything_at_once(api_engine, monkeypatch) -> None:
    s = Scheduler(api_engine, max_running=1, max_waiting=4, metrics=Metrics(MODEL))
    ids = _ids(api_engine, PROMPTS[0])
    running = s.submit(ids, GenerationParams(max_new_tokens=500, ignore_eos=True, num_draft_tokens=4), "none", 60)
    waiting = s.submit(ids, GenerationParams(max_new_tokens=4, num_draft_tokens=4), None, 60)
    raised_in = _fault_once(monkeypatch, api_engine, _ThreadKiller("injected"))
    assert s.failure is None
    s.start()
    try:
        t0 = time.monotonic()
        for ticket in (running, waiting):
            with pytest.raises(RequestFailed) as failed:
                await _collect(ticket)
            assert failed.value.kind == "unavailable"
            assert failed.value.message == "the worker stopped (_ThreadKiller); the server needs a restart"
        assert time.monotonic() - t0 < 30
        assert raised_in == ["specserve-worker"]
        assert s.failure == "the worker stopped (_ThreadKiller)"  # not its text: /health is open to anyone
        with pytest.raises(RequestFailed) as refused:
            s.submit(ids, GenerationParams(max_new_tokens=4, num_draft_tokens=4), None, 60)
        assert refused.value.kind == "unavailable" and "restart" in refused.value.message
        registry = s.metrics.registry
        assert _sample(registry, "specserve_num_requests_running") == 0
        assert _sample(registry, "specserve_num_requests_waiting") == 0
    finally:
        s.stop()


async def test_drain_refuses_new_requests_and_lets_the_held_ones_finish(scheduler, api_engine) -> None:
    ids = _ids(api_engine, PROMPTS[0])
    held = scheduler.submit(ids, GenerationParams(max_new_tokens=6, num_draft_tokens=4), None, 60)
    scheduler.drain()
    with pytest.raises(RequestFailed) as refused:
        scheduler.submit(ids, GenerationParams(max_new_tokens=6, num_draft_tokens=4), None, 60)
    assert refused.value.kind == "unavailable" and "shutting down" in refused.value.message
    text, tokens, _ = await _collect(held)
    assert text and len(tokens) == 6
    assert scheduler.failure is None


async def test_a_long_request_leaves_no_cache_behind(api_engine, monkeypatch) -> None:
    """The worker drops a generation as soon as it is over (not when the route lets the ticket go), and after
    one whose context reached `trim_after_tokens` hands the heap's free memory back."""
    s = Scheduler(api_engine, max_running=4, max_waiting=4, trim_after_tokens=20)
    trims: list[int] = []
    monkeypatch.setattr(s, "_trim", trims.append)
    ids = _ids(api_engine, PROMPTS[0])
    try:
        s.start()
        small = s.submit(ids, GenerationParams(max_new_tokens=2, num_draft_tokens=4), None, 60)
        await _collect(small)
        large = s.submit(ids, GenerationParams(max_new_tokens=20 - len(ids), num_draft_tokens=4), None, 60)
        await _collect(large)
        deadline = time.monotonic() + 5
        while not trims:
            assert time.monotonic() < deadline, "no trim after the large request"
            await asyncio.sleep(0.01)
    finally:
        s.stop()
    assert trims == [0], "once, for the large request only"
    assert small._job.gen is None and large._job.gen is None, "the tickets are still held; the caches are not"


# --- admission by memory, on a tiny target --------------------------------------------------------------------

BIG = (200, 40)  # prompt tokens, max_new_tokens: the tiny target's whole context of 256
SHORT = (4, 4)


@pytest.fixture(scope="module")
def tiny_engine(make_tiny_model, word_tokenizer):
    from app.engine.engine import Engine

    return Engine(make_tiny_model(seed=5, vocab_size=64), word_tokenizer(64), {}, "none", 0, **FIXED_DRAFT)


def _submit(s: Scheduler, size: tuple[int, int]) -> Ticket:
    prompt_len, max_new = size
    params = GenerationParams(max_new_tokens=max_new, num_draft_tokens=0)
    return s.submit([i % 64 for i in range(prompt_len)], params, "none", 60)


def _started(s: Scheduler, ticket: Ticket) -> bool:
    """Whether the request was admitted: its memory counts, the worker may start it."""
    return ticket._job in s._reserved


async def test_a_place_is_free_when_its_request_ends_not_when_the_worker_drops_it(tiny_engine) -> None:
    """A client that has its answer may send the next request at once: with one place and no queue it is
    admitted while the worker still holds the ended request's generation (whose memory still counts)."""
    s = Scheduler(tiny_engine, max_running=1, max_waiting=0)
    gate, real = threading.Event(), s._release
    s._release = lambda job: (gate.wait(30), real(job))  # the worker stops right after its last event
    s.start()
    try:
        first = _submit(s, SHORT)
        await _collect(first)
        assert _started(s, first), "the worker still holds it"
        second = _submit(s, SHORT)  # not Overloaded
        assert _started(s, second)
        gate.set()
        _, ids, _ = await _collect(second)
        assert len(ids) == SHORT[1]
    finally:
        gate.set()
        s.stop()


async def test_requests_are_admitted_by_the_bytes_of_their_caches(tiny_engine) -> None:
    big, short = tiny_engine.kv_bytes(*BIG, "none"), tiny_engine.kv_bytes(*SHORT, "none")
    assert big > 8 * short
    s = Scheduler(tiny_engine, max_running=8, max_waiting=4, kv_budget=2 * big + short)  # not started: nothing ends
    first, second = _submit(s, BIG), _submit(s, BIG)
    assert _started(s, first) and _started(s, second) and s.kv_held == 2 * big
    third = _submit(s, BIG)  # one of 8 places is free, its memory is not
    assert not _started(s, third) and (s.admitted, s.waiting) == (2, 1)
    fits = _submit(s, SHORT)
    assert _started(s, fits) and s.kv_held == s.kv_budget
    last = _submit(s, SHORT)
    assert not _started(s, last) and s.waiting == 2
    first.cancel()  # admitted, never started: its memory is free at once, and goes to the queue in order
    assert _started(s, third) and not _started(s, last)
    assert s.kv_held == 2 * big + short and (s.admitted, s.waiting, s.holding) == (3, 1, 4)


async def test_a_short_request_passes_a_big_one_waiting_for_memory(tiny_engine) -> None:
    big, short = tiny_engine.kv_bytes(*BIG, "none"), tiny_engine.kv_bytes(*SHORT, "none")
    s = Scheduler(tiny_engine, max_running=8, max_waiting=4, kv_budget=big + 2 * short)
    running, waiting = _submit(s, BIG), _submit(s, BIG)
    assert _started(s, running) and not _started(s, waiting)
    passing = [_submit(s, SHORT), _submit(s, SHORT)]
    assert all(_started(s, t) for t in passing), "the short requests fit beside the big one: they run"
    assert waiting._job.overtaken == 2 and not _started(s, waiting)
    assert _submit(s, SHORT)._job in s._waiting  # memory is full now: a short one waits too


async def test_a_request_overtaken_max_overtakes_times_is_not_passed_again(tiny_engine) -> None:
    """A stream of short requests cannot starve a big one: after `max_overtakes` passed it, the short ones wait
    behind it, and the memory freed next goes to it first."""
    big, short = tiny_engine.kv_bytes(*BIG, "none"), tiny_engine.kv_bytes(*SHORT, "none")
    s = Scheduler(tiny_engine, max_running=16, max_waiting=8, kv_budget=big + 4 * short, max_overtakes=2)
    running, waiting = _submit(s, BIG), _submit(s, BIG)
    stream = [_submit(s, SHORT) for _ in range(5)]
    assert [_started(s, t) for t in stream] == [True, True, False, False, False]
    assert waiting._job.overtaken == 2
    assert s.kv_held + short <= s.kv_budget, "the next short request fits: the rule holds it back"
    s.check_room()  # the queue has room: no 429
    running.cancel()  # the big one's memory: to the request that waited longest, then to those behind it
    assert _started(s, waiting)
    assert [_started(s, t) for t in stream] == [True, True, True, True, False]
    assert s.kv_held == big + 4 * short and s.waiting == 1


async def test_a_request_that_could_never_fit_is_refused_at_once(tiny_engine) -> None:
    big = tiny_engine.kv_bytes(*BIG, "none")
    s = Scheduler(tiny_engine, max_running=8, max_waiting=4, kv_budget=big - 1, metrics=Metrics(MODEL))
    with pytest.raises(RequestFailed) as refused:
        _submit(s, BIG)
    assert refused.value.kind == "validation"
    assert "more than the server's whole KV-cache budget" in refused.value.message
    assert "a prompt of 200 tokens and up to 40 new ones" in refused.value.message
    assert (s.holding, s.waiting, s.kv_held) == (0, 0, 0), "not queued"
    assert _started(s, _submit(s, SHORT))
    with pytest.raises(RequestFailed) as unknown:
        s.submit([1, 2], GenerationParams(max_new_tokens=2), "nope", 60)
    assert unknown.value.kind == "validation" and "unknown draft 'nope'" in unknown.value.message
    overloaded = _sample(
        s.metrics.registry, "specserve_requests_total", {"outcome": "overloaded", "finish_reason": "none"}
    )
    assert overloaded == 0, "a request that can never run is no 429"


async def test_429_only_when_memory_and_the_queue_are_both_full(tiny_engine) -> None:
    big, short = tiny_engine.kv_bytes(*BIG, "none"), tiny_engine.kv_bytes(*SHORT, "none")
    s = Scheduler(tiny_engine, max_running=8, max_waiting=1, kv_budget=2 * big + short, metrics=Metrics(MODEL))
    _submit(s, BIG), _submit(s, BIG)
    queued = _submit(s, BIG)
    assert s.waiting == s.max_waiting
    s.check_room()  # the queue is full, the memory is not: a request may still fit
    assert _started(s, _submit(s, SHORT)), "admitted beside a full queue"
    with pytest.raises(Overloaded):
        s.check_room()
    with pytest.raises(Overloaded) as refused:
        _submit(s, SHORT)
    assert refused.value.retry_after >= 1 and "1 queued of 1" in str(refused.value)
    queued.cancel()  # a place in the queue again: no 429, though memory is still full
    s.check_room()
    assert not _started(s, _submit(s, BIG)) and s.waiting == 1
    registry = s.metrics.registry
    assert _sample(registry, "specserve_requests_total", {"outcome": "overloaded", "finish_reason": "none"}) == 2
    # max_running still bounds the requests admitted, whatever memory is left.
    capped = Scheduler(tiny_engine, max_running=1, max_waiting=0, kv_budget=100 * big)
    _submit(capped, SHORT)
    with pytest.raises(Overloaded):
        _submit(capped, SHORT)


async def test_the_kv_gauge_reads_bytes_held_over_the_budget(tiny_engine) -> None:
    big, short = tiny_engine.kv_bytes(*BIG, "none"), tiny_engine.kv_bytes(*SHORT, "none")
    s = Scheduler(tiny_engine, max_running=8, max_waiting=4, kv_budget=4 * big, metrics=Metrics(MODEL))
    registry = s.metrics.registry
    first = _submit(s, BIG)
    _submit(s, SHORT)
    assert _sample(registry, "specserve_kv_cache_usage_perc") == (big + short) / (4 * big)
    assert _sample(registry, "specserve_num_requests_running") == 2
    first.cancel()
    assert _sample(registry, "specserve_kv_cache_usage_perc") == short / (4 * big)
    assert Scheduler(tiny_engine, max_running=3, max_waiting=0).kv_budget == 3 * tiny_engine.kv_bytes(256, 0, "none")


def _chunking_engine():
    """A tiny bf16 target packed for this CPU's kernel, prompts prefilled 64 tokens per step (none if the CPU has no
    kernel to chunk prompts on)."""
    import torch

    from app.engine.engine import Engine
    from tests.conftest import _make_tiny_model, _word_tokenizer

    model = _make_tiny_model(
        seed=7, vocab_size=64, dim=128, n_heads=2, n_kv_heads=1, intermediate_size=128, max_seq_len=2048
    ).to(torch.bfloat16)
    model.pack(kernels.kernel())
    engine = Engine(
        model,
        _word_tokenizer(64),
        {},
        "none",
        0,
        prefill_chunk=64,
        draft_schedule="fixed",
        draft_p_min=0.0,
        prefill_step_seconds=0.0,
    )
    return engine if engine.prefill_chunk else None


async def _short_behind_four_long(engine, max_running: int, kv_budget: int) -> tuple[int, int, int]:
    """Four 2,000-token prompts start prefilling; after two worker steps a 4-token request arrives. Returns the
    steps done when it arrived, the step that gave it its first token, and the step the first long prompt's
    prefill ended in (all counted from 0)."""
    long_size, short_size = (2000, 2), (4, 2)
    s = Scheduler(engine, max_running=max_running, max_waiting=16, kv_budget=kv_budget)
    steps: list[list[tuple[int, bool, int]]] = []  # per worker step: (prompt length, still prefilling, tokens)
    gate = threading.Event()
    real = engine.step_batch

    def step_batch(gens):
        if len(steps) == 2:
            gate.wait(30)  # the third step waits for the short request to arrive
        out = real(gens)
        steps.append([(g.prompt_len, g.needs_prefill, g.stats.generated_tokens) for g in gens])
        return out

    engine.step_batch = step_batch
    for _ in range(4):  # before the worker starts: all four in its first step
        _submit(s, long_size)
    s.start()
    try:
        while len(steps) < 2:
            await asyncio.sleep(0.005)
        arrived = len(steps)
        short = _submit(s, short_size)
        gate.set()
        _, ids, _ = await _collect(short)
        assert len(ids) == 2
        while not any(n == long_size[0] and not pre for step in steps for n, pre, _ in step):
            await asyncio.sleep(0.005)  # until the first long prompt is in (the others are not needed)
    finally:
        s.stop()
        del engine.step_batch
    first = next(i for i, step in enumerate(steps) if any(n == short_size[0] and tokens for n, _, tokens in step))
    done = next(i for i, step in enumerate(list(steps)) if any(n == long_size[0] and not pre for n, pre, _ in step))
    return arrived, first, done


async def test_a_short_request_behind_four_long_prompts_starts_at_once() -> None:
    """Issue 31's case, in worker steps: four long prompts prefilling in chunks, then a short request. Admitted
    by memory it joins the next step and, shortest first, gets its first token at once, long before the long
    prompts are in; held to four places (the old rule) it waited for a long one to finish."""
    engine = _chunking_engine()
    if engine is None:
        pytest.skip("no CPU kernel here to prefill prompts in chunks on")
    budget = 4 * engine.kv_bytes(2000, 2, "none") + engine.kv_bytes(4, 2, "none")  # exactly the five
    arrived, first, done = await _short_behind_four_long(engine, 32, budget)
    assert first <= arrived + 1, (arrived, first)
    assert done > first + 20, "the long prompts were still prefilling for many steps"
    arrived, first, done = await _short_behind_four_long(engine, 4, budget)
    assert first > done, "four places: the short request waited until a long one was over"


async def test_the_prefix_cache_keeps_what_admitted_requests_leave_of_the_budget() -> None:
    """Cached blocks are memory admission takes back: while a request runs, the prefix cache holds at most what
    it leaves of the budget, and gets its room back once the request is over."""
    engine = _chunking_engine()
    if engine is None:
        pytest.skip("no CPU kernel here: no prefix cache")
    cache = engine.prefix_cache
    assert cache is not None
    s = Scheduler(engine, max_running=4, max_waiting=4, kv_budget=1 << 40)
    s.start()
    try:
        await _collect(_submit(s, (600, 2)))
        filled = cache.bytes
        assert filled > 0 and cache.limit == cache.max_bytes
        # A budget that leaves the cache half of what it holds beside the next request.
        s.kv_budget = engine.kv_bytes(800, 2, "none") + filled // 2
        _, ids, _ = await _collect(s.submit([(i * 7) % 64 for i in range(800)], GenerationParams(2), "none", 60))
        assert len(ids) == 2
        assert cache.limit == filled // 2 and 0 < cache.bytes <= filled // 2
        s.kv_budget = 1 << 40  # room again: the blocks may fill the cache's own size
        await _collect(_submit(s, (600, 2)))
        assert cache.limit == cache.max_bytes and cache.bytes >= filled
    finally:
        s.stop()


async def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones() -> None:
    """Issue 48's long prompts, in worker steps: a 2,000-token prompt prefilling in chunks of 64 while a new
    64-token request arrives every step. Shortest first alone (the old rule), the short ones took every step's
    whole budget and the long prompt never moved past its first chunk; the oldest prompt's first claim on half
    the budget gets it in within 2,000 / 32 steps, while the short ones still go on."""
    import random

    engine = _chunking_engine()
    if engine is None:
        pytest.skip("no CPU kernel here to prefill prompts in chunks on")
    long_len, chunk = 2000, 64
    s = Scheduler(engine, max_running=256, max_waiting=16, kv_budget=1 << 40)
    loop = asyncio.get_running_loop()
    rng = random.Random(11)
    shorts: list[Ticket] = []
    steps: list[int] = []  # per worker step: the long prompt's tokens in
    real = engine.step_batch

    async def arrive() -> None:
        ids = [rng.randrange(64) for _ in range(chunk)]  # random: nothing of it in the prefix cache
        shorts.append(s.submit(ids, GenerationParams(max_new_tokens=2, num_draft_tokens=0), "none", 60))

    def step_batch(gens):
        if len(steps) < 200:  # the next request is admitted before the next step
            asyncio.run_coroutine_threadsafe(arrive(), loop).result(10)
        out = real(gens)
        steps.append(next((g.cache.length for g in gens if g.prompt_len == long_len), long_len))
        return out

    engine.step_batch = step_batch
    prompt = [rng.randrange(64) for _ in range(long_len)]
    s.submit(prompt, GenerationParams(max_new_tokens=2, num_draft_tokens=0), "none", 120)
    s.start()
    try:
        while (not steps or steps[-1] < long_len) and len(steps) < 200:
            await asyncio.sleep(0.01)
    finally:
        s.stop()
        del engine.step_batch
    done = next((i for i, n in enumerate(steps) if n >= long_len), None)
    assert done is not None, f"the long prompt was starved: {steps[-1]} of {long_len} tokens in after 200 steps"
    assert done <= long_len // (chunk // 2) + 2, done
    started = [t for t in shorts if t._job.first_token is not None]
    assert len(started) >= done // 3, "the short requests kept getting their first tokens meanwhile"


async def test_a_request_not_started_within_the_queue_timeout_is_refused_with_retry_after(tiny_engine) -> None:
    """Issue 48: every request starts within the queue timeout or is refused (``queue_timeout``, a 503) with a
    Retry-After; one admitted in time waits on to its own timeout. A stream hears ``: queued`` meanwhile."""
    from app.api import jobs

    big = tiny_engine.kv_bytes(*BIG, "none")
    metrics = Metrics(MODEL)
    s = Scheduler(tiny_engine, max_running=8, max_waiting=4, kv_budget=big, metrics=metrics, queue_timeout=0.2)
    running, late = _submit(s, BIG), _submit(s, BIG)  # not started: the first holds the memory for ever
    assert not _started(s, late) and late.state == "queued" and running.state == "prefilling"
    t0 = time.monotonic()
    seen = []
    with pytest.raises(RequestFailed) as refused:
        async for item in jobs.merged_events([late], keepalive=0.05):
            seen.append(item)
    assert 0.2 <= time.monotonic() - t0 < 2
    assert refused.value.kind == "queue_timeout" and "queue timeout of 0.2 s" in refused.value.message
    assert refused.value.retry_after is not None and refused.value.retry_after >= 1
    assert seen[0] == (-1, None) and len(seen) >= 3, "a comment at once, then one every keepalive"
    assert (s.waiting, s.holding) == (0, 1)
    labels = {"reason": "queue_timeout"}
    assert _sample(metrics.registry, "specserve_requests_refused_total", labels) == 1
    outcome = {"outcome": "overloaded", "finish_reason": "none"}
    assert _sample(metrics.registry, "specserve_requests_total", outcome) == 1
    assert "retry: " in jobs.sse_error(refused.value, openai=True).split("\n")[0]
    assert jobs.failure(refused.value).headers == {"Retry-After": str(refused.value.retry_after)}
    # Admitted before its queue deadline: no refusal, its own timeout ends it.
    params = GenerationParams(max_new_tokens=BIG[1], num_draft_tokens=0)
    admitted = s.submit([i % 64 for i in range(BIG[0])], params, "none", 0.4)
    running.cancel()
    assert _started(s, admitted)
    with pytest.raises(RequestFailed) as timed_out:
        async for _ in admitted.events():
            pass
    assert timed_out.value.kind == "timeout" and timed_out.value.retry_after is None


async def test_retry_after_is_the_queue_over_the_measured_service_rate(tiny_engine) -> None:
    s = Scheduler(tiny_engine, max_running=1, max_waiting=2, queue_timeout=30)
    assert s.retry_after_now() == 30, "nothing measured: the queue timeout"
    now = time.monotonic()
    s._ended_at.extend(now - 30 + 3 * i for i in range(10))  # 10 requests ended over the last 30 s: 1 per 3 s
    with s._lock:
        assert s._retry_after(4) == 12
    s._ended_at.appendleft(now - 100)  # out of the window: forgotten
    _submit(s, SHORT)
    _submit(s, SHORT), _submit(s, SHORT)  # the queue is full
    with pytest.raises(Overloaded) as refused:
        _submit(s, SHORT)
    assert refused.value.retry_after == 9 and "retry after 9 s" in str(refused.value)  # 3 ahead of it
