"""Log-probabilities (app/engine/logprobs.py and their way through the engine): the target's raw distribution,
the same whatever the draft, the batch, the prefill's chunks or the sampler, and only for the tokens kept."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from app.engine.drafters import ModelDrafter, NgramDrafter
from app.engine.generation import Engine, Generation, GenerationError, GenerationParams, StepOutput
from app.engine.logprobs import TokenLogprob
from tests.conftest import KERNELS

PROMPT = "The capital of France is"  # greedy: " Paris." "\n" "\n" "The" ...


def _run(engine: Engine, prompt: Sequence[int], params: GenerationParams, draft: str) -> list[StepOutput]:
    gen = engine.start(prompt, params, draft)
    steps = []
    while not gen.finished:
        steps.append(gen.step())
    return steps


def _logprobs(steps: Sequence[StepOutput]) -> tuple[list[int], list[TokenLogprob], list[TokenLogprob | None]]:
    """(tokens, their log-probabilities, the prompt's) of a generation's steps, checking they line up."""
    tokens, logprobs = [], []
    prompt = [s.prompt_logprobs for s in steps if s.prompt_logprobs is not None]
    for s in steps:
        if not s.token_ids and s.finish_reason is None:
            continue  # a chunk of the prompt: nothing to emit yet
        assert s.logprobs is not None and len(s.logprobs) == len(s.token_ids)
        tokens += s.token_ids
        logprobs += s.logprobs
    assert [lp.token_id for lp in logprobs] == tokens
    return tokens, logprobs, prompt[0] if prompt else []


@pytest.fixture(scope="module")
def chat_prompt(target_f32) -> list[int]:
    tok = target_f32.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours and a fruit."}]))


def test_logprobs_do_not_depend_on_the_draft_the_batch_the_chunks_or_the_sampler(
    packed_target, target_f32, chat_prompt
) -> None:
    """On a CPU kernel (each row's bits independent of the rows beside it), target-only decoding, speculative
    decoding with a model draft, and the same request batched beside another with its prompt prefilled in
    chunks give bit-identical tokens and log-probabilities, prompt's included; greedy and seeded sampling."""
    packed = packed_target(KERNELS[0])
    drafters = {"f32": ModelDrafter("f32", target_f32, packed), "ngram": NgramDrafter()}
    engine = Engine(packed.model, packed.tokenizer, drafters, "f32", 4, prefill_chunk=16)
    other = packed.tokenizer.encode(PROMPT)
    for sampling in ({}, {"temperature": 0.8, "seed": 3}):
        params = GenerationParams(max_new_tokens=10, logprobs=3, prompt_logprobs=2, **sampling)
        alone = _logprobs(_run(engine, chat_prompt, params, "none"))
        spec = _run(engine, chat_prompt, params, "f32")
        assert sum(s.accepted for s in spec) >= 3  # verifications of several rows happened
        assert _logprobs(spec) == alone
        gens = [engine.start(chat_prompt, params, "f32"), engine.start(other, params, "ngram")]
        steps: list[list[StepOutput]] = [[], []]
        while not all(g.finished for g in gens):
            live = [i for i, g in enumerate(gens) if not g.finished]
            outs = engine.step_batch([gens[i] for i in live])
            assert len(outs.together) == len(live) or len(live) == 1
            for i, out in zip(live, outs, strict=True):
                assert isinstance(out, StepOutput)
                steps[i].append(out)
        assert sum(1 for s in steps[0] if not s.token_ids) >= 2  # the prompt went in chunks of 16
        assert _logprobs(steps[0]) == alone
        _, logprobs, prompt = alone
        assert len(prompt) == len(chat_prompt) and prompt[0] is None
        assert [lp.token_id for lp in prompt[1:]] == chat_prompt[1:]
        for lp in [*logprobs, *prompt[1:]]:
            assert lp is not None and lp.logprob <= 0 and lp.rank >= 1
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            assert lp.top[0][1] >= lp.logprob and (lp.rank == 1) == (lp.top[0][0] == lp.token_id)
        assert len(logprobs[0].top) == 3 and len(prompt[1].top) == 2
        if not sampling:  # greedy: every token is its row's most likely
            assert all(lp.rank == 1 for lp in logprobs)


def test_logprobs_are_log_softmax_of_the_targets_logits(target_f32) -> None:
    """float32: the prompt's and the generated tokens' log-probabilities are log_softmax of one plain forward
    over the whole text; max_new_tokens 0 runs the prompt alone (lm-eval's loglikelihood)."""
    model, tok = target_f32.model, target_f32.tokenizer
    engine = Engine(model, tok, {"ngram": NgramDrafter()}, "ngram", 4)
    prompt = tok.encode(PROMPT)
    tokens, logprobs, prompt_lps = _logprobs(
        _run(engine, prompt, GenerationParams(max_new_tokens=6, logprobs=0, prompt_logprobs=0), "ngram")
    )
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens])
        expected = torch.log_softmax(model.logits(model.hidden(ids)[0]).float(), dim=-1)
    want = expected[:-1].gather(1, ids[0, 1:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in [*prompt_lps[1:], *logprobs]])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert all(lp.top == () for lp in logprobs)
    only = _run(engine, prompt, GenerationParams(max_new_tokens=0, prompt_logprobs=1), "ngram")
    assert len(only) == 1 and only[0].token_ids == [] and only[0].finish_reason == "length"
    assert only[0].prompt_logprobs is not None
    assert [lp.logprob for lp in only[0].prompt_logprobs[1:] if lp] == [lp.logprob for lp in prompt_lps[1:] if lp]
    # A stop string that ends inside an accepted run: only the tokens kept have log-probabilities.
    steps = _run(engine, prompt, GenerationParams(max_new_tokens=8, stop=(".",), logprobs=1), "ngram")
    assert _logprobs(steps)[0] == tokens[:2] and steps[-1].finish_reason == "stop"
    plain = _run(engine, prompt, GenerationParams(max_new_tokens=4), "ngram")
    assert all(s.logprobs is None and s.prompt_logprobs is None for s in plain)  # not asked, not computed


def test_logprob_counts_the_engine_refuses(target_f32) -> None:
    engine = Engine(target_f32.model, target_f32.tokenizer, {}, "none")
    for bad in ({"logprobs": 21}, {"prompt_logprobs": -1}, {"max_new_tokens": -1}):
        with pytest.raises(GenerationError, match=next(iter(bad))):
            Generation(engine.target, engine.tokenizer, [1, 2], GenerationParams(**bad), None)
