"""Distilling a draft: the seed instructions, batched corpus generation, and training."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from app.distill import corpus, instructions, training
from app.engine import kernels
from app.engine.drafting.eagle import EagleConfig, EagleDraft
from app.engine.model.loading import LoadedModel
from app.engine.model.tokenizer import Tokenizer
from app.engine.reference import greedy_decode

V = 64


@pytest.fixture(scope="module")
def tiny(make_tiny_model, word_tokenizer):
    return LoadedModel(make_tiny_model(seed=21, vocab_size=V), word_tokenizer(V, eos_token_ids=[0]), "tiny", 0.0)


def _answers(
    loaded: LoadedModel,
    prompts: list[list[int]],
    n: int,
    temperature: float,
    seed: int,
    rows: int = 48,
    continuous: bool | None = None,
) -> list[corpus.Sample]:
    """`corpus.generate`'s samples in the prompts' order, every prompt at `temperature`."""
    k = len(prompts)
    seeds = [seed + i for i in range(k)]
    out = dict(corpus.generate(loaded, prompts, n, [temperature] * k, seeds, rows, continuous=continuous))
    return [out[i] for i in range(k)]


def test_seed_instructions_are_reproducible_distinct_and_varied():
    a = instructions.seed_instructions(2000, seed=0)
    assert a == instructions.seed_instructions(2000, seed=0)
    assert a != instructions.seed_instructions(2000, seed=1)
    assert len(set(a)) == 2000
    starts = {" ".join(text.split()[:2]) for text in a}
    assert len(starts) > 100  # many kinds of request, not one template


def test_no_seed_instruction_comes_from_spec_bench(first_turns):
    bench = {t.strip() for t in first_turns}
    ours = instructions.seed_instructions(4000, seed=0) + instructions.traffic_instructions(4000, seed=0)
    assert not bench & set(ours)
    passages = [f"Passage number {i}. It talks about many things in some detail. " * 5 for i in range(20)]
    assert not bench & set(instructions.text_tasks(passages, 200))
    assert not bench & set(instructions.long_passage_tasks(passages, 200))
    conversations = instructions.follow_ups([(q, passages[0]) for q in ours[:50]], 200)
    assert not bench & {m["content"] for c in conversations for m in c}


def test_traffic_instructions_cover_the_kinds_chat_traffic_holds_and_extend():
    a = instructions.traffic_instructions(3000, seed=0)
    assert len(set(a)) == 3000
    assert a[:1000] == instructions.traffic_instructions(1000, seed=0)  # a bigger run extends a smaller one's list
    assert a != instructions.traffic_instructions(3000, seed=1)
    kinds = {
        "question": lambda t: t.lower().startswith(("who ", "when ", "where ", "how ", "why ", "what ")),
        "translation": lambda t: any(s in t for sents in instructions.FOREIGN.values() for s in sents),
        "word problem": lambda t: "step by step" in t or "Show your work" in t,
        "code": lambda t: any(lang in t for lang in ("Python", "JavaScript", "Rust")),
        "story": lambda t: "story" in t,
    }
    for kind, test in kinds.items():
        assert sum(map(test, a)) > 60, kind


def test_second_turns_and_long_articles_are_built_on_the_given_answers():
    answers = [f"Answer {i}: the river rises in spring and farmers plant rice. " * 4 for i in range(8)]
    pairs = [(f"Question {i}?", a) for i, a in enumerate(answers)]
    talks = instructions.follow_ups(pairs, 30, seed=2)
    assert len(talks) == 30
    for talk in talks:
        assert [m["role"] for m in talk] == ["user", "assistant", "user"]
        assert (talk[0]["content"], talk[1]["content"]) in {(q, a.strip()) for q, a in pairs}
    long = instructions.long_passage_tasks(answers, 30, seed=2)
    assert len(long) == 30
    assert all(sum(a.strip() in t for a in answers) >= 2 for t in long)  # two to five answers in each article
    assert instructions.long_passage_tasks(answers[:4], 5) == []  # too few passages to join


def test_text_tasks_work_on_the_given_passages():
    passages = ["The river rises in spring. Farmers plant rice along its banks. " * 5, "too short"]
    tasks = instructions.text_tasks(passages, 50, seed=3)
    assert len(tasks) == 50
    assert all("river" in t for t in tasks)  # the short passage is never used
    assert instructions.text_tasks(["short"], 5) == []


@pytest.mark.parametrize("continuous", [True, False])
def test_batched_generation_equals_one_at_a_time(tiny, continuous):
    """Continuously (a CPU's way), prompts join the forward as others end (2 rows at a time here, so 6 prompts
    take turns); padded (an accelerator's), 4 at a time in one cache. Either way each answer, greedy or sampled
    from its own seed, is the one it gets alone and the other way's, greedy ones the target's own."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, V) for _ in range(n)] for n in (3, 9, 5, 12, 4, 7)]
    for temperature in (0.0, 3.0):
        together = _answers(tiny, prompts, 10, temperature, 0, rows=2 if continuous else 4, continuous=continuous)
        other_way = _answers(tiny, prompts, 10, temperature, 0, continuous=not continuous)
        for i, (prompt, sample) in enumerate(zip(prompts, together, strict=True)):
            alone = dict(corpus.generate(tiny, [prompt], 10, [temperature], [i], rows=1, continuous=continuous))[0]
            assert sample.tokens.tolist() == alone.tokens.tolist() == other_way[i].tokens.tolist()
            assert torch.allclose(sample.features.float(), alone.features.float(), atol=0.02, rtol=0.01)
            assert sample.prompt_len == len(prompt)
            # One state per token but the last; the states are the target's final hidden states.
            assert sample.features.shape == (len(sample.tokens) - 1, tiny.model.config.dim)
            with torch.no_grad():
                states = tiny.model.hidden(sample.tokens[None, :-1].long())[0]
            assert torch.allclose(sample.features.float(), states, atol=0.05, rtol=0.01)
            if temperature == 0:
                # Greedy answers are the target's own, cut after EOS (id 0).
                expected = greedy_decode(tiny.model, prompt, 10)
                if 0 in expected:
                    expected = expected[: expected.index(0) + 1]
                assert sample.tokens[len(prompt) :].tolist() == expected
    draws = [
        [s.tokens.tolist() for s in _answers(tiny, prompts, 10, 3.0, seed, continuous=continuous)] for seed in (0, 100)
    ]
    assert draws[0] != draws[1]  # another seed, other draws
    ended = [i for i, _ in corpus.generate(tiny, prompts, 10, [0.0] * 6, [0] * 6, 3, 4, continuous)]
    assert sorted(ended) == list(range(6))  # every prompt ends once (continuously, each admitted past the budget)


def test_shards_round_trip(tiny, tmp_path):
    samples = _answers(tiny, [[1, 2, 3], [4, 5]], 6, 1.0, 1)
    corpus.save_shard(samples, tmp_path / "s.pt")
    back = corpus.load_shards([tmp_path / "s.pt"])
    for a, b in zip(samples, back, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)
        assert a.prompt_len == b.prompt_len


def test_a_corpus_is_token_ids_that_a_later_run_extends_and_whose_states_can_be_made_again(tiny, tmp_path):
    """Shards hold the ids (and each prompt's key); a run with more prompts answers only the new ones; the
    states, deleted, are made again by one teacher-forced forward and match what generation kept."""
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok = Tokenizer(tiny.tokenizer.backend, [], template, None, [0])
    loaded = LoadedModel(tiny.model, tok, "tiny", 0.0)
    prompts: list[corpus.Prompt] = [f"t{i} t{i + 1} t{i + 2}" for i in range(1, 7)]
    prompts.append(
        [
            {"role": "user", "content": "t5 t6"},
            {"role": "assistant", "content": "t7"},
            {"role": "user", "content": "t8"},
        ]
    )
    first = corpus.build_corpus(loaded, prompts[:4], tmp_path, 3, 5, [0.0], 0, prefix="r1")
    assert [p.name for p in first] == ["r1-00000.pt", "r1-00001.pt"]
    assert len(corpus.load_shards(first)) == 4
    answered: list[int] = []
    paths = corpus.build_corpus(loaded, prompts, tmp_path, 3, 5, [0.0], 0, lambda n, _: answered.append(n), prefix="r1")
    assert sum(answered) == 3 and paths[:2] == first and len(paths) == 3
    assert corpus.build_corpus(loaded, prompts, tmp_path, 3, 5, [0.0], 0, prefix="r1") == paths  # nothing new
    samples = corpus.load_shards(paths)
    assert len(samples) == 7
    by_key = corpus.answers(paths, loaded)
    assert set(by_key) == {corpus.prompt_key(p) for p in prompts}
    talk = next(s for s in samples if s.prompt_len == 4)  # "t5 t6 t7 t8": the conversation
    assert talk.tokens[:4].tolist() == [5, 6, 7, 8]
    for path in paths:
        path.with_suffix(".features.pt").unlink()
    assert corpus.compute_features(loaded, paths) == sum(len(s.tokens) - 1 for s in samples)
    for old, new in zip(samples, corpus.load_shards(paths), strict=True):
        assert torch.equal(old.tokens, new.tokens)
        assert torch.allclose(old.features.float(), new.features.float(), atol=0.05, rtol=0.01)


def test_choose_vocab_keeps_the_most_frequent_answer_tokens_and_eos(tiny):
    s = corpus.Sample(torch.tensor([9, 9, 3, 3, 3, 5], dtype=torch.int32), torch.zeros(5, 4), prompt_len=2)
    vocab = training.choose_vocab([s], 2, V, always=[0])
    assert vocab.tolist() == [0, 3]  # 3 is the commonest answer token; 9 is only in the prompt


# float32 is what `auto` trains in on a CPU without bf16 arithmetic (AVX2), bfloat16 on AMX and GPUs: both here.
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_training_lowers_the_loss_and_raises_agreement(tiny, tmp_path, precision):
    rng = random.Random(1)
    prompts = [[rng.randrange(1, V) for _ in range(6)] for _ in range(24)]
    samples = _answers(tiny, prompts, 24, 0.0, 2)
    torch.manual_seed(0)
    draft = EagleDraft(EagleConfig.for_target(tiny.model.config, V))
    draft.attach(tiny.model)
    cfg = training.TrainConfig(
        steps=60, lr=3e-3, seq_len=64, tokens_per_batch=256, seed=0, warmup=5, precision=precision
    )
    seen: list[dict[str, float]] = []
    checkpoint = tmp_path / "checkpoint.pt"
    training.train(draft, tiny.model, samples, cfg, checkpoint, lambda step, r: seen.append(dict(r)))
    assert seen[-1]["loss"] < 0.7 * seen[0]["loss"]
    assert seen[-1]["agree1"] > seen[0]["agree1"]
    assert checkpoint.exists()
    assert training.compute_dtype(precision, torch.device("cpu")) == getattr(torch, precision)


def test_train_draft_device_flag_is_checked_before_anything_runs(monkeypatch, capsys, tmp_path):
    """`specserve train-draft --device`: cpu (default), cuda or cuda:N; one error line for a device torch does
    not have here or does not know, before any model is loaded or any file written."""
    from app.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device, says in [("cuda", "no CUDA device"), ("cuda:1", "no CUDA device"), ("tpu", "--device 'tpu'")]:
        assert main(["train-draft", "--out", str(tmp_path / "out"), "--device", device]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert main(["train-draft", "--out", str(tmp_path / "out"), "--device", "meta"]) == 1
    assert "choose cpu, cuda or cuda:N" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_training_follows_the_draft_device(tiny, tmp_path):
    """What runs on a GPU with `--device cuda`, on the CPU here: the corpus comes back to the CPU whatever the
    model's device, batches go to the draft's, and a checkpoint resumes onto the draft's device."""
    samples = _answers(tiny, [[5, 6, 7, 8]] * 2, 6, 0.7, 3)
    assert all(s.features.device.type == "cpu" and s.tokens.device.type == "cpu" for s in samples)
    cfg = training.TrainConfig(steps=2, lr=1e-3, seed=0, seq_len=8, tokens_per_batch=16, checkpoint_every=1)
    batch = training.make_batches(samples, cfg, random.Random(0))[0]
    moved = batch.to(torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(vars(moved).values(), vars(batch).values(), strict=True))
    draft = EagleDraft(EagleConfig.for_target(tiny.model.config, V)).to(tiny.model.device)
    draft.attach(tiny.model)
    training.train(draft, tiny.model, samples, cfg, tmp_path / "c.pt")
    more = dataclasses.replace(cfg, steps=3)
    training.train(draft, tiny.model, samples, more, tmp_path / "c.pt")  # resumes at step 2, on the draft's device
    assert torch.load(tmp_path / "c.pt", weights_only=False)["step"] == 3
    fast = kernels.bf16_arithmetic()
    assert training.compute_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if fast else torch.float32)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        training.compute_dtype("fp8", torch.device("cpu"))


def test_training_unrolls_the_draft_on_its_own_guesses(tiny, tmp_path):
    """Pass j reads what pass j-1 guessed: `unroll` passes report one agreement each, and with one pass the
    draft's later guesses are never trained (what the second pass's agreement shows at the same step)."""
    rng = random.Random(1)
    samples = _answers(tiny, [[rng.randrange(1, V) for _ in range(6)] for _ in range(12)], 16, 0.0, 2)
    final = {}
    for unroll in (1, 3):
        torch.manual_seed(0)
        draft = EagleDraft(EagleConfig.for_target(tiny.model.config, V))
        draft.attach(tiny.model)
        cfg = training.TrainConfig(
            steps=4, lr=3e-3, seq_len=32, tokens_per_batch=128, seed=0, warmup=1, precision="float32", unroll=unroll
        )
        final[unroll] = training.train(draft, tiny.model, samples, cfg, tmp_path / f"c{unroll}.pt")
    assert [k for k in final[1] if k.startswith("agree")] == ["agree1"]
    assert [k for k in final[3] if k.startswith("agree")] == ["agree1", "agree2", "agree3"]
    assert final[3]["positions_per_s"] > 0


def test_training_resumes_from_a_shipped_draft_or_a_checkpoint(tiny, tmp_path):
    """`train-draft --resume`: a draft directory or a run's checkpoint gives its weights and its vocabulary
    (not one chosen again from the corpus); a draft for another target is refused."""
    from app.distill import recipe
    from app.engine.drafting.eagle import EagleError, save_draft

    torch.manual_seed(5)
    shipped = EagleDraft(EagleConfig.for_target(tiny.model.config, 8, "shipped"))
    shipped.vocab_ids.copy_(torch.tensor([0, 3, 5, 9, 11, 20, 33, 40]))
    save_draft(shipped, tmp_path / "shipped")
    torch.save({"draft": shipped.state_dict(), "opt": {}, "step": 7}, tmp_path / "checkpoint-old.pt")
    for source in (tmp_path / "shipped", tmp_path / "checkpoint-old.pt"):
        back = recipe._resumed(source, tiny.model, "x")
        assert torch.equal(back.vocab_ids, shipped.vocab_ids)
        for (name, a), (_, b) in zip(back.state_dict().items(), shipped.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    samples = _answers(tiny, [[1, 2, 3]] * 4, 8, 0.7, 2)
    r = dataclasses.replace(recipe.Recipe(), steps=2, seq_len=16, tokens_per_batch=32, draft_vocab=4, unroll=2)
    (tmp_path / "w").mkdir()
    draft, figures = recipe.train_stage(tiny.model, [0], r, samples, tmp_path / "w", "x", tmp_path / "shipped")
    assert torch.equal(draft.vocab_ids, shipped.vocab_ids) and "agree2" in figures
    other = EagleDraft(dataclasses.replace(EagleConfig.for_target(tiny.model.config, 8), target_vocab_size=V + 1))
    save_draft(other, tmp_path / "other")
    with pytest.raises(EagleError, match="another target"):
        recipe._resumed(tmp_path / "other", tiny.model, "x")
    wider = EagleDraft(dataclasses.replace(EagleConfig.for_target(tiny.model.config, 8), intermediate_size=8))
    torch.save({"draft": wider.state_dict()}, tmp_path / "checkpoint-other.pt")  # another target's shapes
    with pytest.raises(EagleError, match="cannot resume from"):
        recipe._resumed(tmp_path / "checkpoint-other.pt", tiny.model, "x")


def test_train_draft_resume_flag_is_checked_before_anything_runs(capsys, tmp_path):
    """`--resume` names a checkpoint file, a feature draft's directory or a catalog draft; anything else is one
    error line before a model is loaded."""
    from app.cli import main

    (tmp_path / "empty").mkdir()
    for source, says in [(tmp_path / "missing.pt", "no such file"), (tmp_path / "empty", "neither a checkpoint")]:
        assert main(["train-draft", "--out", str(tmp_path / "out"), "--resume", str(source)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_a_sampled_corpus_token_follows_the_targets_distribution_and_its_prompts_generator():
    """The corpus's draw at a temperature: frequencies within sampling error of softmax(logits / T), a token of
    probability 0 never drawn, and the same draws again from a generator seeded alike."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    want = torch.softmax(logits / 0.7, -1)
    gen = torch.Generator().manual_seed(5)
    n = 20_000
    draws = [corpus._draw(logits, 0.7, gen) for _ in range(n)]
    freq = torch.bincount(torch.tensor(draws), minlength=6).double() / n
    assert freq[4] == 0
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-9).all(), (freq, want)
    again = torch.Generator().manual_seed(5)
    assert [corpus._draw(logits, 0.7, again) for _ in range(50)] == draws[:50]
    assert corpus._draw(logits, 0.0, gen) == 0


def test_a_target_without_a_chat_template_gets_its_prompts_as_plain_text(tiny):
    """A base model (Gemma 3 270M's GGUF has no chat template) is asked what its completions route and the bench
    send it: the text itself, a conversation's turns one after another; not an error."""
    tok = tiny.tokenizer
    assert tok.chat_template is None
    assert corpus.encode_prompt(tiny, "t3 t4 t5") == tok.encode("t3 t4 t5") == [3, 4, 5]
    turns = [
        {"role": "user", "content": "t3 t4"},
        {"role": "assistant", "content": "t5"},
        {"role": "user", "content": "t6"},
    ]
    assert corpus.encode_prompt(tiny, turns) == [3, 4, 5, 6]


@pytest.mark.parametrize("kernel", kernels.available())
def test_corpus_answers_on_a_cpu_kernel_are_the_ones_each_prompt_gets_alone(packed_target, kernel):
    """The real target on each CPU kernel this machine runs: prompts taking turns in one forward get the tokens,
    and the very states, they get alone (a kernel's rows depend on nothing but themselves)."""
    loaded = packed_target(kernel)
    assert loaded.model.rows_independent()
    questions = ["What is the capital of France?", "Name three fruits.", "Say hello."]
    prompts = [corpus.encode_prompt(loaded, q) for q in questions]
    temps, seeds = [0.0, 0.7, 0.7], [1, 2, 3]
    # 2 rows: the third prompt joins when one ends (the budget admits one prompt a step).
    together = dict(corpus.generate(loaded, prompts, 6, temps, seeds, rows=2, prefill_tokens=20))
    for i, prompt in enumerate(prompts):
        alone = dict(corpus.generate(loaded, [prompt], 6, [temps[i]], [seeds[i]], rows=1))[0]
        assert together[i].tokens.tolist() == alone.tokens.tolist()
        assert torch.equal(together[i].features, alone.features)


def test_the_committed_corpus_holds_no_held_out_instruction():
    """model_store's corpus: every round-1 prompt is one of the recipe's training instructions (for the
    --instructions of the run that wrote it), none of the held-out ones the card measures on."""
    from pathlib import Path

    from app.distill import recipe

    folder = Path(__file__).resolve().parents[1] / "model_store" / "corpus" / "smollm2-135m-instruct"
    # (not the states `train-draft` leaves beside the shards, NAME.features.pt, which git ignores)
    shards = [p for p in sorted(folder.glob("r1-*.pt")) if not p.name.endswith(".features.pt")]
    keys = [k for path in shards for k in torch.load(path, weights_only=True)["keys"]]
    assert len(keys) == len(set(keys)) > 0
    r = recipe.Recipe(first_round=len(keys))
    trained = {corpus.prompt_key(q) for q in instructions.traffic_instructions(r.first_round + r.held_out, r.seed)}
    held = {corpus.prompt_key(q) for q in recipe.held_out_instructions(r)}
    assert set(keys) == trained - held
