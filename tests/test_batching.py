"""Batched decoding: several requests verified in one target forward (`Transformer.hidden_batch`,
`Engine.step_batch`), with each request's tokens exactly those it gets alone."""

from __future__ import annotations

import pytest
import torch

from app.engine import kernels
from app.engine.drafting.base import Drafter, DraftSession
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.step import GenerationParams
from tests.conftest import FIXED_DRAFT, KERNEL_ENDS, KERNELS, use_kernel

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts(target_f32, first_turns) -> list[list[int]]:
    tok = target_f32.tokenizer
    turns = [*first_turns, "Write a haiku about rain.", "List three uses of copper."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in turns]


def _prefilled_cache(model, prompt: list[int], spare: int):
    cache = model.new_cache(len(prompt) + spare)
    cache.fixed_span = True
    with torch.inference_mode():
        model.hidden(torch.tensor([prompt]), 0, cache)
    return cache


@pytest.mark.parametrize("kernel", kernels.available())
def test_hidden_batch_rows_equal_each_sequence_alone(packed_target, prompts, kernel):
    """On every CPU kernel, rows of different sequences, of different counts (1 to 8, 44 in all), come out
    bit-identical to each sequence's own forward, single rows included, and every cache advances."""
    model = packed_target(kernel).model
    assert model.rows_independent()
    counts = [8, 1, 5, 2, 8, 3, 7, 4, 6]
    seqs = [prompts[i % len(prompts)][: 40 + 9 * i] for i in range(len(counts))]
    gen = torch.Generator().manual_seed(0)
    feeds = [torch.randint(0, 40000, (n,), generator=gen) for n in counts]
    with torch.inference_mode():
        alone = []
        for seq, feed in zip(seqs, feeds, strict=True):
            cache = _prefilled_cache(model, seq, 16)
            alone.append(model.hidden(feed[None], len(seq), cache)[0])
        caches = [_prefilled_cache(model, seq, 16) for seq in seqs]
        together = model.hidden_batch([(f, len(s), c) for f, s, c in zip(feeds, seqs, caches, strict=True)])
    assert sum(counts) > 32
    for a, b, n in zip(alone, together, counts, strict=True):
        assert b.shape == (n, model.config.dim)
        assert torch.equal(a, b)
    assert [c.length for c in caches] == [len(s) + n for s, n in zip(seqs, counts, strict=True)]


def test_hidden_batch_refuses_a_gap_in_a_cache(packed_target, prompts):
    model = packed_target(KERNELS[0]).model
    cache = _prefilled_cache(model, prompts[0], 8)
    with pytest.raises(ValueError, match="leaves a gap"), torch.inference_mode():
        model.hidden_batch([(torch.tensor([1, 2]), len(prompts[0]) + 1, cache)])


def _run_alone(engine: Engine, prompt, params, draft) -> list[int]:
    gen = engine.start(prompt, params, draft)
    while not gen.finished:
        gen.step()
    return gen.generated_ids


# Both schedules on the best kernel; the lower kernels and torch's path (bf16 products without oneDNN on some CPUs:
# slow) once each, with the fixed schedule: the schedule and the kernel are independent choices, and only a fixed
# length is sure to draft (the adaptive one drafts nothing where drafting does not pay: here a float32 draft's
# step costs several of the target's, and these prompts give lookups little to find).
@pytest.mark.parametrize(
    ("schedule", "kernel"),
    [
        *((s, kernels.available()[0]) for s in ("adaptive", "fixed")),
        *(("fixed", k) for k in kernels.available()[1:]),
        ("fixed", "torch"),
    ],
)
def test_step_batch_gives_every_request_its_tokens_alone(packed_target, target_f32, prompts, schedule, kernel):
    """Greedy requests stepped together (target-only, a model draft, n-gram, side by side, starting at
    different times) produce exactly the tokens each produces alone, in bfloat16, on every kernel: in one
    forward on the CPU kernels, one at a time on torch's path (whose rows depend on the batch)."""
    packed = packed_target(kernel)
    model = packed.model
    drafters = {"f32": ModelDrafter("f32", target_f32, packed), "ngram": NgramDrafter()}
    engine = Engine(
        model,
        packed.tokenizer,
        drafters,
        "f32",
        4,
        draft_schedule=schedule,
        draft_p_min=0.0,
        prefill_chunk=0,
        prefill_step_seconds=0.0,
    )
    assert engine.batching == (kernel != "torch")
    params = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=4)
    jobs = [(p, d) for p, d in zip(prompts, ["f32", "ngram", "none", "f32", "ngram"], strict=True)]
    # torch's path: slow products on some CPUs (the float32 draft most); three requests show it steps them apart.
    if kernel == "torch":
        jobs = [jobs[1], jobs[2], jobs[4]]
    alone = [_run_alone(engine, p, params, d) for p, d in jobs]
    gens: list[Generation] = []
    batched_forwards = 0
    while len(gens) < len(jobs) or any(not g.finished for g in gens):
        if len(gens) < len(jobs):  # one request joins per step, so prefills and batches mix
            gens.append(engine.start(jobs[len(gens)][0], params, jobs[len(gens)][1]))
        live = [g for g in gens if not g.finished]
        batched_forwards += sum(not g.needs_prefill for g in live) > 1
        outs = engine.step_batch(live)
        assert not [o for o in outs if isinstance(o, Exception)]
    assert [g.generated_ids for g in gens] == alone
    assert batched_forwards >= MAX_NEW // 5
    assert sum(g.stats.drafted for g in gens) > 0 or schedule == "adaptive"


def test_a_batch_verifies_what_its_lookups_found_as_far_as_it_pays(packed_target, prompts):
    """Requests that look up first (the adaptive schedule, the `suffix` drafter) are sized by the batch from what
    their lookups found this step, free to propose: a request copying a list verifies runs of it longer than 2
    tokens in the shared forward (where each request once drafted its first 2 tokens a step, its draft step never
    measured in a batch), and every request's tokens are its tokens alone."""
    from app.engine.drafting.suffix import SuffixDrafter

    packed = packed_target(KERNELS[0])
    engine = Engine(packed.model, packed.tokenizer, {"suffix": SuffixDrafter()}, "suffix", 8)
    engine.calibrate()
    tok = packed.tokenizer
    items = ", ".join(["red", "blue", "green", "gold", "gray", "pink"] * 3)
    copy = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Copy this list word for word: {items}."}]))
    params = GenerationParams(max_new_tokens=48)
    jobs = [copy, prompts[0], prompts[1], copy]
    alone = [_run_alone(engine, p, params, "suffix") for p in jobs]
    gens = [engine.start(p, params, "suffix") for p in jobs]
    longest = 0  # the most tokens the copying request drafted in a batched step
    while any(not g.finished for g in gens):
        live = [g for g in gens if not g.finished]
        outs = engine.step_batch(live)
        assert not [o for o in outs if isinstance(o, Exception)]
        if gens[0] in live and live.index(gens[0]) in outs.together and len(outs.together) > 1:
            out = outs[live.index(gens[0])]
            assert not isinstance(out, Exception)
            longest = max(longest, out.drafted)
    assert [g.generated_ids for g in gens] == alone
    assert longest > 2


class _BrokenSession(DraftSession):
    def propose(self, token_ids, k, p_min=0.0):
        raise RuntimeError("the draft broke")


class _BrokenDrafter(Drafter):
    name = "broken"

    def session(self, capacity: int) -> _BrokenSession:
        return _BrokenSession()


def test_step_batch_keeps_a_failure_to_its_request(packed_target, prompts):
    drafters = {"broken": _BrokenDrafter(), "ngram": NgramDrafter()}
    packed = packed_target(KERNELS[0])
    engine = Engine(
        packed.model,
        packed.tokenizer,
        drafters,
        "ngram",
        3,
        **FIXED_DRAFT,
    )
    params = GenerationParams(max_new_tokens=6, num_draft_tokens=4)
    expected = _run_alone(engine, prompts[0], params, "ngram")
    gens = [engine.start(prompts[0], params, "ngram"), engine.start(prompts[1], params, "broken")]
    engine.step_batch(gens)  # both prefill
    outs = engine.step_batch(gens)
    assert isinstance(outs[1], RuntimeError) and "the draft broke" in str(outs[1])
    while not gens[0].finished:
        (out,) = engine.step_batch([gens[0]])
        assert not isinstance(out, Exception)
    assert gens[0].generated_ids == expected


@pytest.mark.parametrize("kernel", KERNEL_ENDS)
def test_the_shipped_draft_and_hybrid_batched_equal_alone(prompts, kernel):
    """The server's default engine (bfloat16, the trained feature draft drafting for several requests at
    once, the hybrid), on the best kernel and generic: every request's greedy tokens are the ones it gets alone."""
    from app.engine.factory import build_engine

    with use_kernel(kernel):
        engine, _ = build_engine(num_draft_tokens=6, dtype="bfloat16", device="cpu")
    assert engine.kernel == kernel
    assert engine.default_draft == "hybrid" and "smollm2-135m-instruct-eagle" in engine.drafters
    params = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=4)
    jobs = [(p, d) for p, d in zip(prompts, ["default", "hybrid", "default", "none", "hybrid"], strict=True)]
    alone = [_run_alone(engine, p, params, d) for p, d in jobs]
    gens = [engine.start(p, params, d) for p, d in jobs]
    while any(not g.finished for g in gens):
        outs = engine.step_batch([g for g in gens if not g.finished])
        assert not [o for o in outs if isinstance(o, Exception)]
    assert [g.generated_ids for g in gens] == alone


@pytest.mark.parametrize("kernel", kernels.available())
def test_seeded_sampling_is_target_only_sampling_whatever_the_draft_and_the_batch(prompts, kernel):
    """The gumbel sampler (the default): with one seed, every draft and schedule, alone or batched beside other
    requests and joining at different steps, gives target-only sampling's tokens; and so does a second run."""
    from app.engine.factory import build_engine

    with use_kernel(kernel):
        engine, _ = build_engine(num_draft_tokens=6, dtype="bfloat16", device="cpu", prefill_chunk=32)
    eagle = next(d for d in engine.drafters if d not in ("ngram", "hybrid"))
    jobs = [
        (prompts[0], "hybrid", "adaptive", 11),
        (prompts[1], eagle, "fixed", 12),
        (prompts[2], "ngram", "fixed", 13),
        (prompts[3], eagle, "heuristic", 14),
        (prompts[4], "none", None, 15),
    ]
    if kernel != kernels.available()[0]:  # a lower kernel's bits are generic's (test_kernels): three requests
        jobs = [jobs[0], jobs[1], jobs[4]]

    def params(schedule, seed):
        return GenerationParams(
            max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, draft_schedule=schedule, seed=seed, num_draft_tokens=4
        )

    target_only = [_run_alone(engine, p, params(None, seed), "none") for p, _, _, seed in jobs]
    alone = [_run_alone(engine, p, params(sched, seed), d) for p, d, sched, seed in jobs]
    assert alone == target_only
    for _ in range(2):
        gens: list[Generation] = []
        while len(gens) < len(jobs) or any(not g.finished for g in gens):
            if len(gens) < len(jobs):
                p, d, sched, seed = jobs[len(gens)]
                gens.append(engine.start(p, params(sched, seed), d))
            outs = engine.step_batch([g for g in gens if not g.finished])
            assert not [o for o in outs if isinstance(o, Exception)]
        assert [g.generated_ids for g in gens] == target_only
    assert sum(g.stats.accepted for g in gens) > 0 and len(set(map(tuple, target_only))) == len(jobs)


@pytest.mark.parametrize("kernel", KERNEL_ENDS)
def test_a_long_prompt_prefills_in_chunks_beside_running_requests(prompts, kernel):
    """On the CPU kernels (rows independent of the batch), a prompt joining running requests is prefilled a
    chunk per step inside their forward: they keep getting tokens meanwhile, it gets none until its last
    chunk, and everyone's tokens are those it gets alone. On torch's path prompts stay whole."""
    from app.engine.factory import build_engine

    with use_kernel(kernel):
        engine, _ = build_engine(
            num_draft_tokens=6,
            dtype="bfloat16",
            device="cpu",
            prefill_chunk=64,
            prefill_step_seconds=0,
            prefix_cache_mb=0,  # the long prompt starts with a running one's: counted chunks, not cached blocks
        )
    chunked = engine.target.rows_independent()
    assert chunked
    assert engine.prefill_chunk == (64 if chunked else 0)
    long_prompt = [t for p in prompts for t in p][:300]
    params = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=4)
    jobs = [(prompts[0], "hybrid"), (prompts[1], "none"), (long_prompt, "hybrid")]
    alone = [_run_alone(engine, p, params, d) for p, d in jobs]
    gens = [engine.start(p, params, d) for p, d in jobs[:2]]
    while any(g.needs_prefill for g in gens):
        engine.step_batch(gens)
    late = engine.start(long_prompt, params, "hybrid")
    gens.append(late)
    steps = 0
    while late.needs_prefill:
        live = [g for g in gens if not g.finished]
        outs = dict(zip(map(id, live), engine.step_batch(live), strict=True))
        steps += 1
        if chunked and late.needs_prefill:
            assert outs[id(late)].token_ids == [] and late.generated_ids == []
            assert all(outs[id(g)].token_ids for g in gens[:2] if g in live)  # not held up by the prompt
    assert steps == (-(-len(long_prompt) // 64) if chunked else 1)
    assert len(late.generated_ids) == 1
    while any(not g.finished for g in gens):
        outs = engine.step_batch([g for g in gens if not g.finished])
        assert not [o for o in outs if isinstance(o, Exception)]
    assert [g.generated_ids for g in gens] == alone


def test_a_short_prompt_goes_before_long_ones_and_a_lone_long_prompt_is_chunked(packed_target, prompts):
    """Chunked prefill gives the oldest prompt first claim on half the step's budget and the rest to the shortest
    prompt left first: a short request arriving while a long prompt is being prefilled gets its first token at the
    next step, the long one keeps its half (and what the short one left), and a long prompt prefilling alone still
    goes a chunk per step (a request arriving meanwhile waits one step, not the whole prompt). Tokens as alone."""
    packed = packed_target(KERNELS[0])
    engine = Engine(
        packed.model,
        packed.tokenizer,
        {"ngram": NgramDrafter()},
        "ngram",
        3,
        prefill_chunk=48,
        draft_schedule="fixed",
        draft_p_min=0.0,
        prefill_step_seconds=0.0,
        prefix_cache_mb=0,  # the short prompt is the long one's start: the budget's split, not cached blocks
    )
    params = GenerationParams(max_new_tokens=4, num_draft_tokens=4)
    long_prompt = [t for p in prompts for t in p][:200]
    alone = [_run_alone(engine, p, params, "ngram") for p in (long_prompt, prompts[0])]
    late = engine.start(long_prompt, params, "ngram")
    assert engine.together([late]) == [0]
    engine.step_batch([late])
    assert late.needs_prefill and late.cache.length == 48
    short = engine.start(prompts[0][:20], params, "ngram")
    long_left = late.prompt_len - late.cache.length
    outs = engine.step_batch([late, short])
    assert outs.together == [0, 1]  # one forward, as the worker's metrics count it
    assert outs[1].token_ids and not outs[0].token_ids  # the short prompt is in, within the budget's other half
    assert late.prompt_len - late.cache.length == long_left - (48 - 20)  # its half, and what the short one left
    short_ref = _run_alone(engine, prompts[0][:20], params, "ngram")
    gens = [late, short]
    while any(not g.finished for g in gens):
        engine.step_batch([g for g in gens if not g.finished])
    assert late.generated_ids == alone[0] and short.generated_ids == short_ref


def test_chunks_shrink_with_the_context_to_keep_a_step_near_its_target(packed_target):
    """With prefill_step_seconds, a chunk is what the measured seconds per unit of work allow, a row at context
    c costing 1 + c / row_keys units (its attention over c keys beside its products), less the decoding rows'
    share; the first chunk, before any measurement, is modest. A prompt with no stream decoding beside it (no
    pause to bound) goes prefill_chunk tokens a step."""
    packed = packed_target(KERNELS[0])
    engine = Engine(
        packed.model,
        packed.tokenizer,
        {},
        "none",
        0,
        prefill_chunk=512,
        prefill_step_seconds=0.1,
        draft_schedule="fixed",
        draft_p_min=0.0,
    )
    batcher = engine.batcher
    row_keys = batcher.row_keys
    assert 2000 < row_keys < 4000  # SmolLM2-135M: products of ~3.5M weights a layer, attention 576 wide
    params = GenerationParams(max_new_tokens=2, num_draft_tokens=4)
    fresh = engine.start(list(range(1, 1001)), params)
    stream = [_FakePlan(real=1, start=0)]  # one request decoding a row a step: 1 unit
    assert batcher.chunk_sizes([fresh], []) == [512]
    assert 56 <= batcher.chunk_sizes([fresh], stream)[0] <= 64  # 64 units
    batcher.unit_seconds = 0.001  # 100 units per step
    assert batcher.chunk_sizes([fresh], []) == [512]
    (shallow,) = batcher.chunk_sizes([fresh], stream)
    assert batcher.units(shallow, 0) <= 99 < batcher.units(shallow + 1, 0) and shallow >= 94
    fresh.cache.length = 500  # as if 500 tokens were in already
    assert batcher.chunk_sizes([fresh], []) == [500]  # the rest of the prompt
    (deep,) = batcher.chunk_sizes([fresh], stream)
    assert batcher.units(deep, 500) <= 99 < batcher.units(deep + 1, 500)
    assert deep < 90
    # Decoding rows take their share first; however much they take, the prompt gets as much work as they do
    # (PREFILL_SHARE), and never less than 16 units.
    fewer = batcher.chunk_sizes([fresh], [_FakePlan(real=40, start=0)])
    assert fewer == [batcher.rows_within(100 - batcher.units(40, 0), 500)] and 0 < fewer[0] < deep
    for real in (90, 300):
        assert batcher.chunk_sizes([fresh], [_FakePlan(real, 0)]) == [batcher.rows_within(batcher.units(real, 0), 500)]
    assert batcher.chunk_sizes([fresh], [_FakePlan(8, 0)]) == [batcher.rows_within(100 - batcher.units(8, 0), 500)]


class _FakePlan:
    def __init__(self, real: int, start: int) -> None:
        self.real, self.start = real, start


def test_torch_path_neither_batches_nor_chunks(make_tiny_model, word_tokenizer):
    """Where rows depend on the batch (torch's products and SDPA), requests step one at a time and prompts
    are prefilled whole, so that a request's tokens never depend on what runs beside it."""
    model = make_tiny_model(seed=3, vocab_size=64).to(torch.bfloat16)
    with use_kernel("torch"):
        model.pack(kernels.kernel())
    engine = Engine(
        model,
        word_tokenizer(64),
        {"ngram": NgramDrafter()},
        "ngram",
        3,
        prefill_chunk=64,
        draft_schedule="fixed",
        draft_p_min=0.0,
        prefill_step_seconds=0.0,
    )
    assert not engine.batching and engine.prefill_chunk == 0 and engine.kernel == "torch"
    params = GenerationParams(max_new_tokens=5, num_draft_tokens=4)
    gens = [engine.start([3, 1, 4, 1, 5], params), engine.start([2, 7, 1, 8], params)]
    engine.step_batch(gens)
    assert engine.together(gens) == []


def test_calibration_seeds_the_batch_s_costs_with_batched_forwards(packed_target):
    """Where requests are batched, calibration also times batched forwards of 2, 4 and 8 sequences and of
    further rows: the first batches then size their drafts from measured prices of a sequence and of a row,
    not each request as though alone."""
    packed = packed_target(KERNELS[0])
    engine = Engine(packed.model, packed.tokenizer, {"ngram": NgramDrafter()}, "ngram", 4)
    costs = engine.batcher._batch_costs
    assert engine.batching and not costs and costs.row() is None
    seconds = engine.calibrate()
    assert sorted(seconds) == [1, 2, 3, 4, 5]
    batch = costs.seqs.table(32)
    assert sorted(batch) == [2, 4, 8] and batch[8] > batch[2]
    assert costs.row(32) is not None and costs.row(32) >= 0.0
