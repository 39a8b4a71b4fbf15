"""Repetition, presence and frequency penalties (app/engine/decoding/penalties.py) in the speculative loop.

A penalty makes a position's logits depend on the tokens before it, drafts included: a verification's row i
must be penalised over the accepted sequence plus drafts[:i]. Checked against transformers' own logits
processors and a plain loop, and as the promises: greedy speculative == target-only, batched == alone, and a
seed gives target-only sampling's tokens, with every draft.
"""

from __future__ import annotations

import pytest
import torch

from app.engine.decoding.penalties import NO_PENALTIES, Penalty, PenaltyParams
from app.engine.engine import Engine
from app.engine.factory import build_engine
from app.engine.generation import Generation
from app.engine.step import GenerationParams
from tests.conftest import KERNELS, use_kernel

STRONG = PenaltyParams(repetition=1.3, presence=0.4, frequency=0.3)


def test_rows_see_the_drafts_before_them_and_match_transformers():
    """Row i of a verification over k drafts equals penalising one row over the context plus drafts[:i],
    and that equals transformers' RepetitionPenaltyLogitsProcessor followed by OpenAI's formula."""
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    vocab, prompt, generated, drafts = 50, [3, 4, 4, 9], [7, 7, 3], [7, 11, 12]
    params = PenaltyParams(repetition=1.7, presence=0.5, frequency=0.25)
    penalty = Penalty(params, prompt, vocab, torch.device("cpu"))
    penalty.accept(generated)
    logits = torch.randn(len(drafts) + 1, vocab) * 3
    rows = penalty.apply(logits, drafts)
    for i in range(len(drafts) + 1):
        context = prompt + generated + drafts[:i]
        hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([context]), logits[i : i + 1].clone())[0]
        counts = torch.bincount(torch.tensor(generated + drafts[:i]), minlength=vocab).float()
        expected = hf - 0.25 * counts - 0.5 * (counts > 0).float()
        assert torch.equal(rows[i], expected)
        # A draft's one row after drafts[:i] is the same row.
        assert torch.equal(penalty.apply(logits[i : i + 1], drafts[:i])[0], expected)
    # A draft's own vocabulary: columns are token ids.
    ids = torch.tensor([11, 7, 0])
    assert torch.equal(penalty.apply(logits[1:2, ids], drafts[:1], ids)[0], rows[1][ids])
    # The prompt counts for presence and frequency only when asked (TGI's frequency_penalty reads the whole text).
    whole = Penalty(PenaltyParams(frequency=1.0, count_prompt=True), prompt, vocab, torch.device("cpu"))
    assert float(logits[0, 4] - whole.apply(logits[:1])[0, 4]) == pytest.approx(2.0)
    assert PenaltyParams().neutral and not params.neutral
    for bad in ({"repetition": 0.0}, {"presence": 2.5}, {"frequency": -3.0}):
        with pytest.raises(ValueError):
            PenaltyParams(**bad)


def test_penalised_target_only_decoding_is_a_plain_penalised_loop(target_f32, first_turns):
    """Target-only greedy decoding with penalties == a loop that runs the whole sequence each step and applies
    transformers' repetition processor and OpenAI's presence/frequency formula; and the penalties change the text."""
    from transformers import RepetitionPenaltyLogitsProcessor

    model, tok = target_f32.model, target_f32.tokenizer
    prompt = tok.encode("List the numbers one, two, three, one, two, three, one, two,")
    params = GenerationParams(max_new_tokens=12, num_draft_tokens=0, ignore_eos=True, penalties=STRONG)
    gen = Generation(model, tok, prompt, params, None)
    while not gen.finished:
        gen.step()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            logits = model(torch.tensor([ids]))[0, -1:].float()
            logits = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([ids]), logits)[0]
            counts = torch.bincount(torch.tensor(ids[len(prompt) :], dtype=torch.long), minlength=logits.shape[0])
            logits = logits - 0.3 * counts - 0.4 * (counts > 0).float()
            ids.append(int(logits.argmax()))
    assert gen.generated_ids == ids[len(prompt) :]
    plain = Generation(
        model, tok, prompt, GenerationParams(max_new_tokens=12, num_draft_tokens=0, ignore_eos=True), None
    )
    while not plain.finished:
        plain.step()
    assert plain.generated_ids != gen.generated_ids


def _alone(engine: Engine, prompt: list[int], params: GenerationParams, draft: str) -> list[int]:
    gen = engine.start(prompt, params, draft)
    while not gen.finished:
        gen.step()
    return gen.generated_ids


@pytest.mark.slow
def test_penalties_keep_speculative_equal_to_target_only_alone_and_batched(first_turns):
    """The server's engine (feature draft, hybrid, n-gram) with penalties: greedy and seeded sampling give
    target-only's tokens with every draft, alone and batched (the feature draft then drafts for all at once)."""
    with use_kernel(KERNELS[0]):
        engine, _ = build_engine(num_draft_tokens=4, dtype="bfloat16", device="cpu")
    eagle = next(d for d in engine.drafters if d not in ("ngram", "hybrid"))
    prompts = [engine.tokenizer.encode(t)[:48] for t in first_turns]
    drafts = [eagle, "hybrid", "ngram"]
    for sampling in ({}, {"temperature": 0.8, "seed": 5}):
        params = GenerationParams(
            max_new_tokens=12, num_draft_tokens=4, draft_schedule="fixed", penalties=STRONG, **sampling
        )
        target_only = [_alone(engine, p, params, "none") for p in prompts]
        for draft in drafts:
            assert [_alone(engine, p, params, draft) for p in prompts] == target_only, (draft, sampling)
        gens: list[Generation] = [engine.start(p, params, d) for p, d in zip(prompts, drafts, strict=True)]
        while any(not g.finished for g in gens):
            outs = engine.step_batch([g for g in gens if not g.finished])
            assert not [o for o in outs if isinstance(o, Exception)]
        assert [g.generated_ids for g in gens] == target_only
        assert sum(g.stats.accepted for g in gens) > 0
    # The penalties change what the target says (on some prompt: one may end at once either way).
    plain, penalised = (
        GenerationParams(max_new_tokens=20, num_draft_tokens=4, penalties=p) for p in (NO_PENALTIES, STRONG)
    )
    assert any(_alone(engine, p, plain, "none") != _alone(engine, p, penalised, "none") for p in prompts)
