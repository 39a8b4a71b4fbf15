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
from app.engine.reference import greedy_decode

V = 64


@pytest.fixture(scope="module")
def tiny(make_tiny_model, word_tokenizer):
    return LoadedModel(make_tiny_model(seed=21, vocab_size=V), word_tokenizer(V, eos_token_ids=[0]), "tiny", 0.0)


def test_seed_instructions_are_reproducible_distinct_and_varied():
    a = instructions.seed_instructions(2000, seed=0)
    assert a == instructions.seed_instructions(2000, seed=0)
    assert a != instructions.seed_instructions(2000, seed=1)
    assert len(set(a)) == 2000
    starts = {" ".join(text.split()[:2]) for text in a}
    assert len(starts) > 100  # many kinds of request, not one template


def test_no_seed_instruction_comes_from_spec_bench(first_turns):
    bench = {t.strip() for t in first_turns}
    ours = instructions.seed_instructions(4000, seed=0)
    assert not bench & set(ours)
    passages = [f"Passage number {i}. It talks about many things in some detail. " * 5 for i in range(20)]
    assert not bench & set(instructions.text_tasks(passages, 200))


def test_text_tasks_work_on_the_given_passages():
    passages = ["The river rises in spring. Farmers plant rice along its banks. " * 5, "too short"]
    tasks = instructions.text_tasks(passages, 50, seed=3)
    assert len(tasks) == 50
    assert all("river" in t for t in tasks)  # the short passage is never used
    assert instructions.text_tasks(["short"], 5) == []


def test_batched_generation_equals_one_at_a_time(tiny):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, V) for _ in range(n)] for n in (3, 9, 5, 12)]
    gen = torch.Generator().manual_seed(0)
    together = corpus.generate_batch(tiny, prompts, 10, 0.0, gen)
    for prompt, sample in zip(prompts, together, strict=True):
        alone = corpus.generate_batch(tiny, [prompt], 10, 0.0, gen)[0]
        assert sample.tokens.tolist() == alone.tokens.tolist()
        assert sample.prompt_len == len(prompt)
        # Greedy answers are the target's own, cut after EOS (id 0).
        expected = greedy_decode(tiny.model, prompt, 10)
        if 0 in expected:
            expected = expected[: expected.index(0) + 1]
        assert sample.tokens[len(prompt) :].tolist() == expected
        # One state per token but the last; the states are the target's final hidden states.
        assert sample.features.shape == (len(sample.tokens) - 1, tiny.model.config.dim)
        with torch.no_grad():
            states = tiny.model.hidden(sample.tokens[None, :-1].long())[0]
        assert torch.allclose(sample.features.float(), states, atol=0.05, rtol=0.01)


def test_shards_round_trip(tiny, tmp_path):
    gen = torch.Generator().manual_seed(1)
    samples = corpus.generate_batch(tiny, [[1, 2, 3], [4, 5]], 6, 1.0, gen)
    corpus.save_shard(samples, tmp_path / "s.pt")
    back = corpus.load_shards([tmp_path / "s.pt"])
    for a, b in zip(samples, back, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)
        assert a.prompt_len == b.prompt_len


def test_choose_vocab_keeps_the_most_frequent_answer_tokens_and_eos(tiny):
    s = corpus.Sample(torch.tensor([9, 9, 3, 3, 3, 5], dtype=torch.int32), torch.zeros(5, 4), prompt_len=2)
    vocab = training.choose_vocab([s], 2, V, always=[0])
    assert vocab.tolist() == [0, 3]  # 3 is the commonest answer token; 9 is only in the prompt


# float32 is what `auto` trains in on a CPU without bf16 arithmetic (AVX2), bfloat16 on AMX and GPUs: both here.
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_training_lowers_the_loss_and_raises_agreement(tiny, tmp_path, precision):
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, V) for _ in range(6)] for _ in range(24)]
    samples = corpus.generate_batch(tiny, prompts, 24, 0.0, gen)
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
    gen = torch.Generator().manual_seed(3)
    samples = corpus.generate_batch(tiny, [[5, 6, 7, 8]] * 2, 6, 0.7, gen)
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
