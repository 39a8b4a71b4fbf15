"""The scheduler and its worker thread, driven directly with the real target: interleaving, identical greedy
texts whatever runs alongside, cancellation that frees the place at once, failures that stay with their
request."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from app.engine import kernels
from app.engine.step import GenerationParams
from app.metrics import Metrics
from app.worker import Overloaded, RequestFailed, Scheduler, Ticket
from tests.conftest import FIXED_DRAFT, KERNELS

pytestmark = pytest.mark.anyio

MODEL = "smol"  # the model_name label of every series
PROMPTS = ["The capital of France is", "Water boils at", "1, 2, 3, 4, 5,"]


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
            assert failed.value.message == "generation failed: RuntimeError: injected fault"
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
            assert failed.value.message == "the worker stopped (_ThreadKiller: injected); the server needs a restart"
        assert time.monotonic() - t0 < 30
        assert raised_in == ["specserve-worker"]
        assert s.failure == "the worker stopped (_ThreadKiller: injected)"
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
