"""The draft learns from what it serves (app.distill.online, app.engine.drafting.adapter): traces per tenant within
a bound, adapters trained only while the worker is idle and kept only when they agree more often, persisted under
a keyed name, and answers that never depend on them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from app.distill.corpus import Sample
from app.distill.online import ADAPTER_SUFFIX, DraftLearner, LearningConfig, TraceBuffer, tenant_label
from app.engine.drafting.adapter import Adapter
from app.engine.drafting.eagle import EagleConfig, EagleDraft, EagleDrafter, load_draft, save_draft
from app.engine.engine import Engine
from app.engine.model.loading import LoadedModel
from app.engine.reference import greedy_decode
from app.engine.step import GenerationParams

V = 64


@pytest.fixture(scope="module")
def target(make_tiny_model):
    return make_tiny_model(seed=21, vocab_size=V)


@pytest.fixture(scope="module")
def tok(word_tokenizer):
    return word_tokenizer(V)


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    torch.manual_seed(2)
    draft = EagleDraft(EagleConfig.for_target(target.config, V, "tiny")).eval().requires_grad_(False)
    draft.attach(target)
    path = tmp_path_factory.mktemp("draft") / "d"
    save_draft(draft, path)
    return path


def _setup(target, tok, draft_dir, directory=None, **config):
    drafter = EagleDrafter("eagle", load_draft(draft_dir, target), LoadedModel(target, tok, "t", 0.0))
    settings = {"min_answers": 1, "steps": 15, "idle_seconds": 0.0, "lr": 3e-2, **config}
    learner = DraftLearner(draft_dir, target, LearningConfig(**settings), directory)
    engine = Engine(target, tok, {"eagle": drafter}, "eagle", 4, prefill_chunk=0, prefill_step_seconds=0.0)
    engine.on_answer = learner.observe
    drafter.adapters = learner.adapter
    return engine, drafter, learner


def _prompts(n: int, seed: int) -> list[list[int]]:
    # A tenant's traffic: prompts built on one repeated pattern, which its answers continue.
    gen = torch.Generator().manual_seed(seed)
    return [[5, 9, 2, *torch.randint(10, V, (4,), generator=gen).tolist(), 5, 9] for _ in range(n)]


def _serve(engine, prompts, tenant, draft="eagle", **params):
    answers = []
    for ids in prompts:
        p = GenerationParams(max_new_tokens=24, num_draft_tokens=4, ignore_eos=True, cache_salt=tenant, **params)
        gen = engine.start(ids, p, draft)
        while not gen.finished:
            gen.step()
        answers.append(gen.generated_ids)
    return answers


def _sample(n: int, prompt_len: int = 2, dim: int = 8) -> Sample:
    return Sample(torch.zeros(n, dtype=torch.int32), torch.zeros(n - 1, dim, dtype=torch.bfloat16), prompt_len)


def test_traces_stay_within_their_bound_and_the_fullest_tenant_gives_up_its_oldest_first():
    one = TraceBuffer.sample_bytes(_sample(11))
    buffer = TraceBuffer(5 * one)
    for i in range(4):
        buffer.add("big", Sample(torch.full((11,), i, dtype=torch.int32), _sample(11).features, 2))
    buffer.add("small", _sample(11))
    assert buffer.bytes == 5 * one
    buffer.add("small", _sample(11))
    assert buffer.bytes <= buffer.max_bytes
    assert [int(s.tokens[0]) for s in buffer.samples("big")] == [1, 2, 3]  # the oldest of the fullest went
    assert len(buffer.samples("small")) == 2
    buffer.add("huge", _sample(200))  # larger than the whole bound: not kept, nothing evicted for it
    assert buffer.samples("huge") == [] and len(buffer.samples("big")) == 3


def test_metrics_labels_never_hold_a_salt():
    assert tenant_label(None) == "shared"
    assert tenant_label("salt:secret-value") == "salted"
    assert tenant_label("key:team-a|salt:secret-value") == "team-a"
    assert tenant_label("key:team-a") == "team-a"


def test_a_zero_adapter_drafts_exactly_what_the_shipped_draft_drafts(target, draft_dir):
    draft = load_draft(draft_dir, target)
    adapter = Adapter.zeros(target.config.dim, V, "tiny", rank=4)
    x, t = torch.randn(1, 5, target.config.dim), torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        plain = draft(x, t)
        assert torch.equal(draft(x, t, adapter=adapter), plain)
        assert torch.equal(draft.draft_logits(plain[0], adapter), draft.draft_logits(plain[0]))
    adapter.bias[3] = 1.0
    with torch.no_grad():
        assert not torch.equal(draft.draft_logits(plain[0], adapter), draft.draft_logits(plain[0]))


def test_adapters_round_trip_and_a_foreign_file_is_refused(tmp_path):
    adapter = Adapter.zeros(8, 16, "abc", rank=2)
    adapter.up.normal_()
    adapter.save(tmp_path / "a.safetensors")
    back = Adapter.load(tmp_path / "a.safetensors")
    assert back.draft == "abc" and all(
        torch.equal(a, b) for a, b in zip(back.parameters(), adapter.parameters(), strict=True)
    )
    (tmp_path / "b.safetensors").write_bytes(b"not an adapter")
    with pytest.raises(ValueError, match="not a draft adapter"):
        Adapter.load(tmp_path / "b.safetensors")


def test_a_tenant_learns_its_traffic_and_no_other_tenant_reads_what_it_learnt(target, tok, draft_dir):
    engine, drafter, learner = _setup(target, tok, draft_dir)
    _serve(engine, _prompts(16, seed=1), "salt:a")
    assert len(learner.traces.samples("salt:a")) == 16 and learner.traces.samples("salt:b") == []
    assert learner.due() == "salt:a"
    result = learner.train_round("salt:a")
    assert result is not None and result.kept and result.after > result.before
    assert learner.adapter("salt:a") is not None
    # Another tenant, and the shared one, still draft with the shipped weights: the same proposals as a drafter
    # that never learnt anything.
    assert learner.adapter("salt:b") is None and learner.adapter(None) is None
    plain = EagleDrafter("plain", load_draft(draft_dir, target), LoadedModel(target, tok, "t", 0.0))
    ids = _prompts(1, seed=9)[0]
    states = target.hidden(torch.tensor([ids]))[0]
    proposals, adapters = [], []
    for d, tenant in ((drafter, "salt:b"), (plain, "salt:b"), (drafter, "salt:a")):
        session = d.session(64)
        session.start(len(ids), tenant, (), True)
        session.features[: len(ids)] = states
        proposals.append(session.propose(ids, 4))
        adapters.append(session.adapter)
    assert proposals[0] == proposals[1]
    assert adapters == [None, None, learner.adapter("salt:a")]


def test_answers_equal_target_only_with_an_adapter_swapped_in_mid_stream(target, tok, draft_dir):
    engine, _, learner = _setup(target, tok, draft_dir)
    _serve(engine, _prompts(12, seed=3), "salt:a")
    assert learner.train_round("salt:a").kept
    kept = learner.adapter("salt:a")
    ids = _prompts(1, seed=4)[0]
    for swap in (False, True):
        learner._adapters.clear()
        if not swap:
            learner._keep("salt:a", kept)
        p = GenerationParams(
            max_new_tokens=32, num_draft_tokens=4, ignore_eos=True, cache_salt="salt:a", draft_schedule="fixed"
        )
        gen = engine.start(ids, p, "eagle")
        steps = 0
        while not gen.finished:
            gen.step()
            steps += 1
            if swap and steps == 2:
                learner._keep("salt:a", kept)  # a round kept mid-request: the next draft step reads it
        assert gen.generated_ids == greedy_decode(target, ids, 32)
        assert gen._draft.adapter is kept
    # Seeded sampling with the rejection sampler reads no adapter (its text depends on its drafts), and leaves a
    # trace like any answer.
    params = {"temperature": 0.8, "seed": 7, "sampler": "rejection"}
    gen = engine.start(ids, GenerationParams(max_new_tokens=8, cache_salt="salt:a", **params), "eagle")
    while not gen.finished:
        gen.step()
    assert gen._draft.adapter is None


def test_an_isolated_request_leaves_no_trace_and_reads_no_adapter(target, tok, draft_dir):
    engine, _, learner = _setup(target, tok, draft_dir)
    _serve(engine, _prompts(8, seed=5), None)
    assert learner.train_round(None).kept
    before = learner.traces.bytes
    p = GenerationParams(max_new_tokens=8, num_draft_tokens=4, isolated=True)
    gen = engine.start(_prompts(1, seed=6)[0], p, "eagle")
    while not gen.finished:
        gen.step()
    assert gen._draft.adapter is None and learner.traces.bytes == before


def test_a_round_that_does_not_agree_more_often_is_dropped(target, tok, draft_dir):
    engine, _, learner = _setup(target, tok, draft_dir, min_gain=1.0)  # no adapter can gain a whole 1.0
    _serve(engine, _prompts(8, seed=1), "salt:a")
    result = learner.train_round("salt:a")
    assert result is not None and not result.kept
    assert learner.adapter("salt:a") is None
    stats = learner.snapshot()
    assert stats.dropped == {"salted": 1} and stats.kept == {}


def test_adapters_persist_under_keyed_names_for_their_own_draft_only(target, tok, draft_dir, tmp_path):
    engine, _, learner = _setup(target, tok, draft_dir, tmp_path / "learnt")
    _serve(engine, _prompts(12, seed=1), "salt:my-secret-salt")
    assert learner.train_round("salt:my-secret-salt").kept
    files = list((tmp_path / "learnt").glob(f"*{ADAPTER_SUFFIX}"))
    assert len(files) == 1 and "secret" not in files[0].name
    assert (tmp_path / "learnt" / "tenant-key").stat().st_mode & 0o077 == 0
    again = DraftLearner(draft_dir, target, LearningConfig(), tmp_path / "learnt")
    again._load_saved()
    found = again.adapter("salt:my-secret-salt")
    assert found is not None and torch.equal(found.up, learner.adapter("salt:my-secret-salt").up)
    assert again.adapter("salt:other") is None
    # A file trained on another draft is not applied.
    found.draft = "0" * 16
    found.save(files[0])
    other = DraftLearner(draft_dir, target, LearningConfig(), tmp_path / "learnt")
    other._load_saved()
    assert other.adapter("salt:my-secret-salt") is None


def test_training_runs_only_while_the_worker_is_idle_and_stops_within_a_step(target, tok, draft_dir):
    engine, _, learner = _setup(target, tok, draft_dir, steps=400, idle_seconds=0.05)
    _serve(engine, _prompts(8, seed=1), "salt:a")
    learner.worker_busy()
    learner.start()
    try:
        time.sleep(0.5)
        assert learner.snapshot().seconds == 0.0 and learner._positions == 256  # no step ran while busy
        steps = []
        real_loss = learner._loss

        def counting(batch, adapter):
            steps.append(time.monotonic())
            return real_loss(batch, adapter)

        learner._loss = counting
        learner.worker_idle()
        deadline = time.monotonic() + 30
        while len(steps) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(steps) >= 3  # idle: it trains
        done = threading.Event()
        threading.Thread(target=lambda: (learner.worker_busy(), done.set())).start()
        assert done.wait(10)  # the worker got its turn back after at most the step in flight
        taken = len(steps)
        time.sleep(0.3)
        assert len(steps) <= taken + 1  # and no further step started while it is busy
    finally:
        learner.stop()


def test_the_server_wires_the_learner_in_and_shows_its_figures(target, tok, draft_dir, tmp_path):
    from app.service.metrics import Metrics
    from app.service.runtime import draft_learner
    from app.service.settings import Settings

    engine, drafter, _ = _setup(target, tok, draft_dir)
    engine.on_answer, drafter.adapters = None, None
    assert draft_learner(engine, Settings(draft_learning="off")) is None and engine.on_answer is None
    learner = draft_learner(engine, Settings(draft_learning="on", draft_learning_dir=str(tmp_path / "a")))
    assert learner is not None and engine.on_answer == learner.observe and drafter.adapters == learner.adapter
    learner.config = LearningConfig(min_answers=1, steps=15, lr=3e-2)
    _serve(engine, _prompts(8, seed=1), "key:team-a|salt:x")
    learner.train_round("key:team-a|salt:x")
    metrics = Metrics("m")
    metrics.watch_learner(learner)
    text = metrics.render().decode()
    assert 'specserve_draft_learning_updates_total{model_name="m",outcome="kept",tenant="team-a"} 1.0' in text
    assert 'specserve_draft_learning_agreement{model_name="m",tenant="team-a",when="after"}' in text
    assert "salt" not in text.replace("salted", "")
    bytes_line = next(line for line in text.splitlines() if line.startswith("specserve_draft_learning_trace_bytes"))
    assert float(bytes_line.split()[-1]) == learner.traces.bytes > 0
    # Without a feature draft there is nothing to learn: refused at start, not ignored.
    plain = Engine(target, tok, {}, "none", 4, prefill_chunk=0, prefill_step_seconds=0.0)
    with pytest.raises(ValueError, match="needs a feature draft"):
        draft_learner(plain, Settings(draft_learning="on"))


def test_bench_learn_is_refused_without_a_traffic_workload(tmp_path, capsys):
    from app.bench.learning import learning_markdown
    from app.cli import main

    assert main(["bench", "--learn", "5", "--out", str(tmp_path)]) == 1
    assert "--learn is for the traffic workloads" in capsys.readouterr().err
    row = {
        "workload": "chat",
        "served": 5,
        "unseen_requests": 2,
        "shipped": {"acceptance": 0.4, "tokens_per_pass": 1.5, "tokens_per_second": 100.0},
        "learned": {"acceptance": 0.5, "tokens_per_pass": 1.75, "tokens_per_second": 110.0},
        "speedup": 1.1,
        "rounds": [{"kept": True}, {"kept": False}],
        "mid_training_wait_ms": {"median": 3.0, "max": 9.5},
        "differ_from_target_only": 0,
    }
    table = learning_markdown([row])
    assert "| chat | 5 | 2 | 0.400 -> 0.500 | 1.50 -> 1.75 | 100.0 -> 110.0 | 1.10x | 1/2 | 3.0 / 9.5 | 0 |" in table
