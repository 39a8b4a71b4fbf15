"""The production loop (app/engine/generation.py).

Greedy speculative output must be token for token the target's own greedy output, whatever the draft:
checked on the real target with several drafts (the target itself, its bfloat16 copy, its first layers,
prompt lookup), against transformers' `generate` and the reference `greedy_decode`, and as a hypothesis
property over random tiny models and drafts (including drafts that never agree and scripted drafts
whose every acceptance count is known in advance). Every run also checks the loop's bookkeeping: KV
rollback, bonus tokens, statistics, max_new_tokens, EOS and stop strings.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine import kernels
from app.engine.defaults import MAX_DRAFT_TOKENS
from app.engine.drafting.base import Drafter, DraftError, DraftSession
from app.engine.drafting.draft_length import StepCosts
from app.engine.drafting.hybrid import HybridDrafter
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.model.loading import LoadedModel
from app.engine.reference import greedy_decode
from app.engine.step import GenerationError, GenerationParams, GenerationStats, NumericalError, StepOutput
from tests.conftest import FIXED_DRAFT, KERNELS

MAX_NEW = 32


# --- helpers --------------------------------------------------------------------------------------------------


def run_checked(
    target, tokenizer, prompt: Sequence[int], params: GenerationParams, drafter, verify_width: int = 0
) -> tuple[Generation, list[StepOutput]]:
    """Run a generation to the end, checking the loop's invariants after every step."""
    gen = Generation(target, tokenizer, prompt, params, drafter, verify_width)
    k = params.num_draft_tokens if drafter is not None else 0
    steps: list[StepOutput] = []
    while not gen.finished:
        remaining = params.max_new_tokens - gen.stats.generated_tokens
        step = gen.step()
        steps.append(step)
        assert step.drafted <= min(k, max(remaining - 1, 0)), "never drafts what could not be kept"
        assert 0 <= step.accepted <= step.drafted
        if not gen.finished:
            # The target's cache holds every accepted token but the newest (fed on the next step).
            assert gen.cache.length == len(gen.ids) - 1
            # Accepted drafts plus the target's own token: a correction, or the bonus when all were accepted.
            assert len(step.token_ids) == step.accepted + 1
            assert step.finish_reason is None
            # Where each token came from: the accepted drafts, then the target's correction, bonus or own token.
            last = "target" if not step.drafted else "bonus" if step.accepted == step.drafted else "correction"
            assert step.sources[-1] == last
            assert all(s in ("draft", "lookup") for s in step.sources[:-1])
        else:
            assert gen.cache.length >= len(gen.ids) - 1
            assert step.finish_reason == gen.finish_reason
    _check_stats(gen, steps, prompt, params, k)
    return gen, steps


def _check_stats(gen: Generation, steps: list[StepOutput], prompt, params: GenerationParams, k: int) -> None:
    s = gen.stats
    assert gen.ids[: len(prompt)] == list(prompt)
    assert s.prompt_tokens == len(prompt)
    assert s.generated_tokens == len(gen.generated_ids) == sum(len(step.token_ids) for step in steps)
    assert [t for step in steps for t in step.token_ids] == gen.generated_ids
    assert 1 <= s.generated_tokens <= params.max_new_tokens
    assert s.accepted <= s.drafted
    assert s.drafted == sum(step.drafted for step in steps) and s.accepted == sum(step.accepted for step in steps)
    assert len(s.accepted_per_position) == k
    assert sum(s.accepted_per_position) == s.accepted
    # Position i can only be accepted when every position before it was.
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:], strict=False))
    assert s.target_passes == len(steps), "one target pass per step, the prefill included"
    assert s.verify_passes == sum(1 for step in steps if step.drafted > 0)
    assert s.target_passes == s.verify_passes + 1 + sum(1 for step in steps[1:] if step.drafted == 0)
    assert steps[0].drafted == 0 and len(steps[0].token_ids) == 1  # the prefill
    assert "".join(step.text for step in steps) == gen.text
    assert all(len(step.sources) == len(step.token_ids) for step in steps)
    # Each token's piece of the step's text, for one event per token: they add up to the text.
    assert all(len(step.pieces) == len(step.token_ids) and "".join(step.pieces) == step.text for step in steps)
    assert steps[0].sources == ["target"]
    assert gen.finish_reason in ("eos", "length", "stop")
    if gen.finish_reason == "length":
        assert s.generated_tokens == params.max_new_tokens
    if gen.finish_reason == "eos":
        assert gen.generated_ids[-1] in gen.tokenizer.eos_token_ids
    d = s.to_dict()
    assert d["generated_tokens"] == s.generated_tokens and d["target_passes"] == s.target_passes
    assert d["tokens_per_target_pass"] == round(s.generated_tokens / s.target_passes, 4)


def expected_greedy(target, prompt: Sequence[int], max_new: int, eos: frozenset[int] | set[int]) -> list[int]:
    """The target's own greedy continuation (reference, no cache), cut after the first EOS."""
    out = greedy_decode(target, prompt, max_new)
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


@torch.no_grad()
def _target_next(model, ids: Sequence[int]) -> int:
    return int(model(torch.tensor([list(ids)]))[0, -1].argmax())


class WrongDrafter(Drafter, DraftSession):
    """Proposals that are never what the target would choose next (computed from the target itself)."""

    name = "wrong"

    def __init__(self, target, vocab: int) -> None:
        DraftSession.__init__(self)
        self.target, self.vocab, self.calls = target, vocab, 0

    def session(self, capacity: int):
        return self

    def propose(self, token_ids, k, p_min=0.0):
        self.calls += 1
        first = (_target_next(self.target, token_ids) + 1) % self.vocab
        return [first] + [(first + 7 * i) % self.vocab for i in range(1, k)]


class ScriptedDrafter(Drafter, DraftSession):
    """Proposes the target's true greedy continuation for a scripted number of tokens, then a wrong one,
    then the target's own greedy continuation after that wrong token: agreement that must not count.

    `log` holds (k asked, tokens proposed, how many of them the target must accept) for every call.
    """

    name = "scripted"

    def __init__(self, target, vocab: int, script: Sequence[int]) -> None:
        DraftSession.__init__(self)
        self.target, self.vocab, self.script = target, vocab, list(script)
        self.log: list[tuple[int, list[int], int]] = []

    def session(self, capacity: int):
        return self

    def propose(self, token_ids, k, p_min=0.0):
        correct = self.script[len(self.log) % len(self.script)]
        truth = greedy_decode(self.target, token_ids, min(correct, k) + 1)
        if correct >= k:
            out, must_accept = truth[:k], k
        else:
            out = [*truth[:correct], (truth[correct] + 1) % self.vocab]
            out += greedy_decode(self.target, [*token_ids, *out], k - len(out))
            must_accept = correct
        self.log.append((k, out, must_accept))
        return out


def _loaded(model, tokenizer, name="tiny") -> LoadedModel:
    return LoadedModel(model, tokenizer, name, 0.0)


def _noisy_copy(model, scale: float, seed: int):
    noisy = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return noisy


# --- the real target -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_prompts(target_f32, first_turns) -> list[list[int]]:
    tok = target_f32.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in first_turns]


@pytest.fixture(scope="module")
def baseline(target_f32, bench_prompts) -> list[Generation]:
    """Target-only greedy decoding (no draft) of each Spec-Bench prompt."""
    params = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=4)
    return [run_checked(target_f32.model, target_f32.tokenizer, p, params, None)[0] for p in bench_prompts]


@pytest.fixture(scope="module")
def real_drafters(target_f32, target_bf16, truncate_layers) -> dict:
    early_exit = _loaded(truncate_layers(target_f32.model, 6), target_f32.tokenizer, "first-6-layers")
    return {
        "self": ModelDrafter("self", target_f32, target_f32),
        "bf16": ModelDrafter("bf16", target_bf16, target_f32),
        "first-6-layers": ModelDrafter("first-6-layers", early_exit, target_f32),
        "ngram": NgramDrafter(),
    }


def test_target_only_equals_transformers_generate(target_f32, hf_target, bench_prompts, baseline):
    eos = sorted(target_f32.tokenizer.eos_token_ids)
    for prompt, base in zip(bench_prompts, baseline, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf_target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                num_beams=1,
                max_new_tokens=MAX_NEW,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        theirs = out[0, len(prompt) :].tolist()
        assert base.generated_ids == theirs, (
            f"differs from transformers at token {_first_diff(base.generated_ids, theirs)}"
        )


def test_target_only_equals_reference_greedy_decode(target_f32, bench_prompts, baseline):
    # One prompt: without a cache, every token is a full forward over the whole sequence.
    n = len(baseline[0].generated_ids)
    assert greedy_decode(target_f32.model, bench_prompts[0], n) == baseline[0].generated_ids


@pytest.mark.parametrize("draft", ["self", "bf16", "first-6-layers", "ngram"])
def test_speculative_equals_target_only_on_the_real_target(target_f32, bench_prompts, baseline, real_drafters, draft):
    drafter = real_drafters[draft]
    k = 4
    params = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=k)
    total_accepted = 0
    # The target as its own draft only proves the bonus-token bookkeeping: one prompt is enough. The
    # early-exit draft is rarely right (its proposals cost half a target pass each): two prompts.
    n = {"self": 1, "first-6-layers": 2}.get(draft, len(bench_prompts))
    for prompt, base in zip(bench_prompts[:n], baseline[:n], strict=True):
        gen, steps = run_checked(target_f32.model, target_f32.tokenizer, prompt, params, drafter)
        assert gen.generated_ids == base.generated_ids, f"{draft}: differs at {_first_diff(gen.generated_ids, base)}"
        assert gen.text == base.text and gen.finish_reason == base.finish_reason
        total_accepted += gen.stats.accepted
        if draft == "self":
            # Every draft is accepted, and each verification adds the bonus token: k + 1 tokens per pass.
            assert gen.stats.accepted == gen.stats.drafted > 0
            for step in steps[1:-1]:
                assert step.drafted == step.accepted == k and len(step.token_ids) == k + 1
    if draft in ("self", "bf16"):
        assert total_accepted > 0


@pytest.mark.parametrize("k", [1, 7])
def test_speculative_k_extremes_on_the_real_target(target_f32, bench_prompts, baseline, real_drafters, k):
    params = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=k)
    gen, _ = run_checked(target_f32.model, target_f32.tokenizer, bench_prompts[0], params, real_drafters["bf16"])
    assert gen.generated_ids == baseline[0].generated_ids


def test_stop_string_on_the_real_target(target_f32, bench_prompts, baseline, real_drafters):
    tok = target_f32.tokenizer
    base = baseline[0]
    full = base.text
    # A stop string that starts inside one token and ends inside a later one, from the middle of the text.
    bounds = [len(tok.decode(base.generated_ids[:n])) for n in range(len(base.generated_ids) + 1)]
    a = next(b for b in bounds if b >= len(full) // 3) + 1
    stop = full[a : a + 6]
    assert stop.strip() and any(a < b < a + 6 for b in bounds), "the stop string spans a token boundary"
    first = full.index(stop)
    needed = next(n for n in range(1, len(base.generated_ids) + 1) if stop in tok.decode(base.generated_ids[:n]))
    params = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=4, stop=(stop, "never appears"))
    gen, steps = run_checked(target_f32.model, tok, bench_prompts[0], params, real_drafters["self"])
    assert gen.finish_reason == "stop"
    assert gen.text == full[:first] and stop not in "".join(s.text for s in steps)
    assert gen.generated_ids == base.generated_ids[:needed], "no tokens past the one completing the stop string"


def _one_row_steps_and_a_chunk(model) -> tuple[torch.Tensor, torch.Tensor]:
    # The same 5 tokens at the same positions: as five 1-row steps, and as one 5-row verification.
    ids = torch.arange(100, 160).reshape(1, -1)
    with torch.inference_mode():
        one, five = model.new_cache(64), model.new_cache(64)
        model(ids[:, :50], 0, one)
        model(ids[:, :50], 0, five)
        rows = torch.stack([model(ids[:, 50 + i : 51 + i], 50 + i, one)[0, 0] for i in range(5)])
        chunk = model(ids[:, 50:55], 50, five)[0]
    return rows, chunk


def test_half_precision_rows_depend_on_the_row_count_on_torch(target_bf16):
    """Why decoding forwards are padded in bf16 on torch's path (oneDNN or plain products, SDPA): the same
    token at the same position gets other logits as a 1-row step than as a row of a 5-row verification."""
    rows, chunk = _one_row_steps_and_a_chunk(target_bf16.model)
    assert not torch.equal(rows, chunk)


@pytest.mark.parametrize("kernel", kernels.available())
def test_kernel_rows_do_not_depend_on_the_row_count(packed_target, kernel):
    """On every CPU kernel each row is computed on its own: no padding needed (the engine pads nothing)."""
    packed = packed_target(kernel)
    model = packed.model
    assert model.rows_independent() and model.kernel is not None and model.kernel.name == kernel
    rows, chunk = _one_row_steps_and_a_chunk(model)
    assert torch.equal(rows, chunk)
    assert (
        Engine(
            model,
            packed.tokenizer,
            {},
            "none",
            num_draft_tokens=4,
            **FIXED_DRAFT,
        ).verify_width
        == 0
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_half_precision_speculative_equals_target_only(target_f32, packed_target, bench_prompts, kernel):
    """In bfloat16, with weights packed as `load_model` packs them on each kernel (torch's path included,
    where the engine pads verifications), speculative greedy decoding with many multi-token verifications
    equals target-only decoding token for token."""
    bf16 = packed_target(kernel)
    model = bf16.model
    drafters = {"f32": ModelDrafter("f32", target_f32, bf16), "ngram": NgramDrafter()}
    engine = Engine(
        model,
        target_f32.tokenizer,
        drafters,
        "f32",
        4,
        **FIXED_DRAFT,
    )
    assert engine.verify_width == (8 if kernel == "torch" else 0)
    params = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=4)
    # Drafts wider than the padding: the cache's span (its capacity) must not depend on the draft length.
    long = GenerationParams(max_new_tokens=MAX_NEW, num_draft_tokens=12)
    # Two prompts on this CPU's best kernel, one on the others (their bits equal generic's: test_kernels).
    for prompt in bench_prompts[: 2 if kernel == KERNELS[0] else 1]:
        base = run_checked(model, target_f32.tokenizer, prompt, params, None, engine.verify_width)[0]
        for draft, p in (("f32", params), ("ngram", params), ("f32", long)):
            spec = run_checked(model, target_f32.tokenizer, prompt, p, drafters[draft], engine.verify_width)[0]
            assert spec.generated_ids == base.generated_ids, (draft, p.num_draft_tokens)
            if draft == "f32":  # the float32 draft mostly agrees: verifications of several tokens happened
                assert spec.stats.target_passes < base.stats.target_passes / 2


def test_a_draft_with_another_vocabulary_is_refused(target_f32, make_tiny_model, word_tokenizer):
    tiny = _loaded(make_tiny_model(seed=0, vocab_size=64), word_tokenizer(64))
    with pytest.raises(DraftError, match=r"draft 'tiny' does not share the target's vocabulary \(64 vs 49152 tokens"):
        ModelDrafter("tiny", tiny, target_f32)


def _first_diff(a, b) -> int:
    b = b.generated_ids if isinstance(b, Generation) else b
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# --- tiny models: edge cases, one by one -----------------------------------------------------------------------

V = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def tiny_target(make_tiny_model):
    return make_tiny_model(seed=5, vocab_size=V)


@pytest.fixture(scope="module")
def tok(word_tokenizer):
    return word_tokenizer(V)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_equal_to_target_gives_k_plus_one_tokens_per_pass(tiny_target, tok, k):
    drafter = ModelDrafter("self", _loaded(tiny_target, tok), _loaded(tiny_target, tok))
    params = GenerationParams(max_new_tokens=20, num_draft_tokens=k)
    gen, steps = run_checked(tiny_target, tok, PROMPT, params, drafter)
    assert gen.generated_ids == expected_greedy(tiny_target, PROMPT, 20, set())
    for step in steps[1:-1]:
        assert len(step.token_ids) == k + 1 and step.accepted == step.drafted == k
    per_position = [sum(1 for step in steps if step.accepted > i) for i in range(k)]
    assert gen.stats.accepted_per_position == per_position
    assert per_position[0] == gen.stats.verify_passes
    assert gen.stats.target_passes < 20


def test_a_draft_that_never_agrees(tiny_target, tok):
    drafter = WrongDrafter(tiny_target, V)
    params = GenerationParams(max_new_tokens=12, num_draft_tokens=4)
    gen, steps = run_checked(tiny_target, tok, PROMPT, params, drafter)
    assert gen.generated_ids == expected_greedy(tiny_target, PROMPT, 12, set())
    assert gen.stats.accepted == 0 and gen.stats.drafted > 0
    assert all(len(step.token_ids) == 1 for step in steps)
    assert gen.stats.target_passes == 12
    assert drafter.calls == gen.stats.verify_passes == 10  # the last step has room for no draft


def test_agreement_after_a_rejection_is_not_accepted(tiny_target, tok):
    drafter = ScriptedDrafter(tiny_target, V, [0, 2, 1, 5])
    params = GenerationParams(max_new_tokens=20, num_draft_tokens=4)
    gen, steps = run_checked(tiny_target, tok, PROMPT, params, drafter)
    assert gen.generated_ids == expected_greedy(tiny_target, PROMPT, 20, set())
    verifying = [step for step in steps if step.drafted > 0]
    assert [step.accepted for step in verifying] == [m for _, _, m in drafter.log]
    assert [step.accepted for step in verifying][:4] == [0, 2, 1, 4]


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
@pytest.mark.parametrize("k", [0, 1, 4, 16])
def test_max_new_tokens_is_respected_exactly(tiny_target, tok, max_new, k):
    drafter = ModelDrafter("self", _loaded(tiny_target, tok), _loaded(tiny_target, tok))
    params = GenerationParams(max_new_tokens=max_new, num_draft_tokens=k, ignore_eos=True)
    gen, _ = run_checked(tiny_target, tok, PROMPT, params, drafter)
    assert len(gen.generated_ids) == max_new and gen.finish_reason == "length"
    assert gen.generated_ids == expected_greedy(tiny_target, PROMPT, max_new, set())


def test_every_request_gets_the_same_cache_whatever_its_draft_length(tiny_target, tok, monkeypatch):
    """The spare slots hold a verification of the longest draft allowed (MAX_DRAFT_TOKENS, the API's limit, plus
    one), so a request's cache capacity, and with it a fixed span's reductions, is the same for every k; a
    self-draft accepts every token, so the k = MAX_DRAFT_TOKENS run verifies its widest drafts in that room."""
    capacities: set[int] = set()
    new_cache = tiny_target.new_cache
    monkeypatch.setattr(tiny_target, "new_cache", lambda capacity: capacities.add(capacity) or new_cache(capacity))
    drafter = ModelDrafter("self", _loaded(tiny_target, tok), _loaded(tiny_target, tok))
    max_new = 3 * MAX_DRAFT_TOKENS
    expected = expected_greedy(tiny_target, PROMPT, max_new, set())
    for k in (0, 1, 5, MAX_DRAFT_TOKENS):
        params = GenerationParams(max_new_tokens=max_new, num_draft_tokens=k, ignore_eos=True)
        gen, steps = run_checked(tiny_target, tok, PROMPT, params, drafter, verify_width=8)
        assert gen.generated_ids == expected, k
        assert max(len(step.token_ids) for step in steps) == k + 1
    assert capacities == {len(PROMPT) + max_new + MAX_DRAFT_TOKENS + 1}


def test_eos_at_once(tiny_target, word_tokenizer):
    first = expected_greedy(tiny_target, PROMPT, 1, set())[0]
    tok = word_tokenizer(V, [first])
    drafter = ModelDrafter("self", _loaded(tiny_target, tok), _loaded(tiny_target, tok))
    gen, steps = run_checked(tiny_target, tok, PROMPT, GenerationParams(max_new_tokens=10, num_draft_tokens=4), drafter)
    assert gen.generated_ids == [first] and gen.finish_reason == "eos"
    assert gen.text == "" and len(steps) == 1  # the EOS token is kept in the ids, never in the text


def test_eos_inside_an_accepted_run_cuts_it(tiny_target, word_tokenizer):
    greedy = expected_greedy(tiny_target, PROMPT, 12, set())
    eos = greedy[6]
    cut = greedy.index(eos)
    tok = word_tokenizer(V, [eos])
    drafter = ModelDrafter("self", _loaded(tiny_target, tok), _loaded(tiny_target, tok))
    gen, _ = run_checked(tiny_target, tok, PROMPT, GenerationParams(max_new_tokens=12, num_draft_tokens=5), drafter)
    assert gen.generated_ids == greedy[: cut + 1] and gen.finish_reason == "eos"
    assert gen.text == tok.decode(greedy[:cut])
    ignoring = GenerationParams(max_new_tokens=12, num_draft_tokens=5, ignore_eos=True)
    gen, _ = run_checked(tiny_target, tok, PROMPT, ignoring, drafter)
    assert gen.generated_ids == greedy and gen.finish_reason == "length"


@pytest.mark.parametrize("k", [0, 5])
def test_stop_token_ids_and_min_tokens_inside_accepted_runs(tiny_target, word_tokenizer, k):
    """vLLM's stop_token_ids end the text like an end-of-sequence token (finish "stop", the token's text only
    with include_stop_str_in_output); min_tokens lets neither end it before that many tokens, even in the
    middle of a run of accepted drafts."""
    greedy = expected_greedy(tiny_target, PROMPT, 12, set())
    end = greedy[6]
    cut = greedy.index(end)
    plain = word_tokenizer(V)
    drafter = ModelDrafter("self", _loaded(tiny_target, plain), _loaded(tiny_target, plain))

    def run(tokenizer, **fields):
        params = GenerationParams(max_new_tokens=12, num_draft_tokens=k, **fields)
        return run_checked(tiny_target, tokenizer, PROMPT, params, drafter)[0]

    gen = run(plain, stop_token_ids=(end,))
    assert gen.generated_ids == greedy[: cut + 1] and gen.finish_reason == "stop"
    assert gen.text == plain.decode(greedy[:cut])
    assert run(plain, stop_token_ids=(end,), include_stop_str_in_output=True).text == plain.decode(greedy[: cut + 1])
    later = next((i for i in range(cut + 1, 12) if greedy[i] == end), None)
    expected = greedy if later is None else greedy[: later + 1]
    assert run(plain, stop_token_ids=(end,), min_tokens=cut + 1).generated_ids == expected
    assert run(word_tokenizer(V, [end]), min_tokens=cut + 1).generated_ids == expected  # the same for EOS
    with pytest.raises(GenerationError, match="min_tokens"):
        run(plain, min_tokens=13)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_stop_string_spanning_tokens_ends_generation(tiny_target, tok, k):
    greedy = expected_greedy(tiny_target, PROMPT, 16, set())
    full = tok.decode(greedy)
    # The last digit of token 4's word, the space, and the 't' of token 5: across a token boundary.
    end4 = len(tok.decode(greedy[:5]))
    stop = full[end4 - 1 : end4 + 2]
    first = full.index(stop)
    needed = next(n for n in range(1, 17) if stop in tok.decode(greedy[:n]))
    drafter = ModelDrafter("self", _loaded(tiny_target, tok), _loaded(tiny_target, tok))
    params = GenerationParams(max_new_tokens=16, num_draft_tokens=k, stop=(stop,))
    gen, _ = run_checked(tiny_target, tok, PROMPT, params, drafter)
    assert gen.finish_reason == "stop"
    assert gen.text == full[:first] and stop not in gen.text
    assert gen.generated_ids == greedy[:needed]


def test_step_after_the_end_is_an_error(tiny_target, tok):
    gen, _ = run_checked(tiny_target, tok, PROMPT, GenerationParams(max_new_tokens=2, num_draft_tokens=4), None)
    with pytest.raises(RuntimeError, match="already finished"):
        gen.step()


def test_requests_the_engine_refuses(make_tiny_model, tok):
    target = make_tiny_model(seed=5, vocab_size=V, max_seq_len=32)
    engine = Engine(
        target,
        tok,
        {"ngram": NgramDrafter()},
        default_draft="ngram",
        num_draft_tokens=4,
        **FIXED_DRAFT,
    )
    with pytest.raises(GenerationError, match="prompt must not be empty"):
        engine.start([], GenerationParams(max_new_tokens=2, num_draft_tokens=4))
    with pytest.raises(GenerationError, match="exceeds the model's context of 32"):
        engine.start(list(range(30)), GenerationParams(max_new_tokens=3, num_draft_tokens=4))
    engine.start(
        list(range(29)), GenerationParams(max_new_tokens=3, num_draft_tokens=4)
    )  # exactly at the context: fine
    with pytest.raises(GenerationError, match="unknown draft 'nope'"):
        engine.start(PROMPT, GenerationParams(max_new_tokens=2, num_draft_tokens=4), draft="nope")
    with pytest.raises(GenerationError, match="max_new_tokens"):
        engine.start(PROMPT, GenerationParams(max_new_tokens=-1, num_draft_tokens=4))
    with pytest.raises(GenerationError, match="num_draft_tokens"):
        engine.start(PROMPT, GenerationParams(max_new_tokens=2, num_draft_tokens=-1))
    with pytest.raises(GenerationError, match=r"\[0, 64\)"):
        engine.start([1, V], GenerationParams(max_new_tokens=2, num_draft_tokens=4))
    with pytest.raises(GenerationError, match="default draft 'missing' is not loaded"):
        Engine(
            target,
            tok,
            {},
            default_draft="missing",
            num_draft_tokens=4,
            **FIXED_DRAFT,
        )


def test_engine_draft_selection_and_generate(make_tiny_model, tok):
    target = make_tiny_model(seed=5, vocab_size=V)
    ngram = NgramDrafter()
    engine = Engine(
        target,
        tok,
        {"ngram": ngram},
        default_draft="ngram",
        num_draft_tokens=3,
        **FIXED_DRAFT,
    )
    assert engine.drafter(None) is ngram and engine.drafter("default") is ngram and engine.drafter("none") is None
    steps = list(
        engine.generate(PROMPT, GenerationParams(max_new_tokens=9, ignore_eos=True, num_draft_tokens=4), draft="none")
    )
    assert [t for s in steps for t in s.token_ids] == expected_greedy(target, PROMPT, 9, set())
    assert steps[-1].finish_reason == "length" and all(s.drafted == 0 for s in steps)


def test_context_edge_with_drafts(make_tiny_model, tok):
    """Prompt plus max_new_tokens fill the context exactly: the draft's cache and the target's must fit."""
    target = make_tiny_model(seed=6, vocab_size=V, max_seq_len=24)
    prompt = PROMPT * 2  # 16 tokens, 8 more to the end of the context
    for drafter in (ModelDrafter("self", _loaded(target, tok), _loaded(target, tok)), NgramDrafter()):
        params = GenerationParams(max_new_tokens=8, num_draft_tokens=6, ignore_eos=True)
        gen, _ = run_checked(target, tok, prompt, params, drafter)
        assert gen.generated_ids == expected_greedy(target, prompt, 8, set())


def test_a_draft_with_a_shorter_context_drafts_while_the_sequence_fits(make_tiny_model, tok):
    target = make_tiny_model(seed=6, vocab_size=V, max_seq_len=64)
    short = make_tiny_model(seed=6, vocab_size=V, max_seq_len=16)  # the same weights, a 16-token context
    drafter = ModelDrafter("short", _loaded(short, tok), _loaded(target, tok))
    params = GenerationParams(max_new_tokens=20, num_draft_tokens=3, ignore_eos=True)
    gen, steps = run_checked(target, tok, PROMPT, params, drafter)
    assert gen.generated_ids == expected_greedy(target, PROMPT, 20, set())
    assert gen.stats.accepted > 0
    lengths = [len(PROMPT) + sum(len(s.token_ids) for s in steps[:i]) for i in range(len(steps))]
    assert all(step.drafted == 0 for step, n in zip(steps, lengths, strict=True) if n > 16)


# --- the adaptive draft length: no draft makes a request slower than target-only decoding ------------------


def _fixed_costs(engine: Engine, monkeypatch, step: float = 0.010, row: float = 0.45) -> dict[int, float]:
    """The engine's verification costs as a CPU measures them (each row after the first adds `row` of a 1-row
    step; AVX2: 0.45), and none of this machine's measurements: the choices are the cost model's on these alone."""
    monkeypatch.setattr(StepCosts, "observe", lambda self, *args: None)
    costs = {r: step * (1 + row * (r - 1)) for r in range(1, MAX_DRAFT_TOKENS + 2)}
    engine._verify_costs.seed(costs)
    return costs


def _run_engine(engine: Engine, params: GenerationParams, draft_step: float | None = None) -> tuple[Generation, list]:
    gen = engine.start(PROMPT, params)
    if draft_step is not None:
        gen.draft_length.costs.draft_step = draft_step
    steps = []
    while not gen.finished:
        steps.append(gen.step())
    return gen, steps


def test_adaptive_drafts_nothing_on_most_steps_when_the_draft_never_agrees_and_rows_cost(tiny_target, tok, monkeypatch):
    drafter = WrongDrafter(tiny_target, V)
    engine = Engine(
        tiny_target,
        tok,
        {"wrong": drafter},
        "wrong",
        4,
        draft_schedule="adaptive",
        draft_p_min=0.0,
        prefill_chunk=0,
        prefill_step_seconds=0.0,
    )
    verify = _fixed_costs(engine, monkeypatch)
    params = GenerationParams(max_new_tokens=48, ignore_eos=True, num_draft_tokens=4)
    gen, steps = _run_engine(engine, params, draft_step=0.0015)
    assert gen.generated_ids == expected_greedy(tiny_target, PROMPT, 48, set())
    # At the drafter's starting acceptance (0.5) a token does not pay (1.5 tokens for 1.6 steps' time): no
    # draft, then a one-token probe after 8 steps without, and, that one rejected, after 16 more.
    assert [i for i, step in enumerate(steps) if step.drafted] == [9, 26]
    assert drafter.calls == 2 and gen.stats.drafted == 2 and gen.stats.accepted == 0

    # Priced on the costs it chose from, the request runs within 3 % of target-only decoding's speed; the fixed
    # schedule's 4 tokens a step take over three times as long.
    def speed(steps: list) -> float:
        seconds = sum(verify[1 + step.drafted] + 0.0015 * step.drafted for step in steps[1:])
        return 47 * verify[1] / seconds

    assert speed(steps) >= 0.97
    fixed, fixed_steps = _run_engine(engine, replace(params, draft_schedule="fixed"))
    assert fixed.generated_ids == gen.generated_ids and all(step.drafted == 4 for step in fixed_steps[1:-4])
    assert speed(fixed_steps) < 0.33


def test_adaptive_hybrid_prices_its_lookup_and_its_model_apart(tiny_target, tok, monkeypatch):
    """This target repeats one token: prompt lookup is right every time, while the model part is never."""
    wrong = WrongDrafter(tiny_target, V)
    drafters = {"hybrid": HybridDrafter("hybrid", wrong)}
    engine = Engine(
        tiny_target,
        tok,
        drafters,
        "hybrid",
        4,
        draft_schedule="adaptive",
        draft_p_min=0.0,
        prefill_chunk=0,
        prefill_step_seconds=0.0,
    )
    _fixed_costs(engine, monkeypatch)
    gen, steps = _run_engine(
        engine, GenerationParams(max_new_tokens=40, ignore_eos=True, num_draft_tokens=4), draft_step=0.0015
    )
    assert gen.generated_ids == expected_greedy(tiny_target, PROMPT, 40, set())
    # The lookup finds the repeated token from the second decoding step on, and what follows it is that token again
    # (a text that repeats with period one): it is verified (free to propose, its prior enough for its rows), ever
    # longer as every token is accepted, and the model is never asked (at 0.5 its step and row do not pay).
    drafted = [step.drafted for step in steps[2:-1]]
    assert steps[1].drafted == 0 and all(d >= 1 for d in drafted) and max(drafted) > 1
    assert wrong.calls == 0 and gen.stats.drafted == gen.stats.accepted
    assert set(gen.stats.draft_sources) == {"prompt"}
    assert gen.draft_length.estimate("model").p_first == pytest.approx(0.5)


def test_adaptive_hybrid_drafts_with_its_model_where_that_pays_more(tiny_target, tok, monkeypatch):
    """Rows nearly free (AMX-like) and a model part that is the target itself: four model tokens a step pay
    more than the one token the lookup finds in a repeated token."""
    self_draft = ModelDrafter("self", _loaded(tiny_target, tok), _loaded(tiny_target, tok))
    engine = Engine(
        tiny_target,
        tok,
        {"hybrid": HybridDrafter("hybrid", self_draft)},
        "hybrid",
        4,
        **FIXED_DRAFT,
    )
    _fixed_costs(engine, monkeypatch, row=0.02)
    # The lookup held to one token (a repeated token's lookup would otherwise continue it 16 tokens at a time).
    params = GenerationParams(
        max_new_tokens=40, ignore_eos=True, draft_schedule="adaptive", num_draft_tokens=4, lookup_draft_tokens=1
    )
    gen, steps = _run_engine(engine, params, draft_step=0.0005)
    assert gen.generated_ids == expected_greedy(tiny_target, PROMPT, 40, set())
    # 3 tokens at the starting acceptance (0.5), 4 once they are all accepted; the lookup's one token never.
    assert steps[1].drafted == 3 and all(step.drafted == 4 for step in steps[2:-1])
    assert gen.stats.accepted == gen.stats.drafted
    assert gen.draft_length.estimate("model").p_first > 0.95


def test_a_long_prompt_s_verifications_are_measured_apart_from_short_ones(make_tiny_model, tok):
    """Rows at a long context cost more (their attention reads every cached key): a request's steps are timed
    into its context's class, and its drafts priced from that class."""
    target = make_tiny_model(seed=5, vocab_size=V, max_seq_len=640)
    engine = Engine(target, tok, {"ngram": NgramDrafter()}, "ngram", 4, draft_schedule="adaptive", prefill_chunk=0)
    engine.calibrate()
    costs = engine._verify_costs
    short = dict(costs.table(len(PROMPT)))
    prompt = [(7 * i) % V for i in range(520)]
    gen = engine.start(prompt, GenerationParams(max_new_tokens=6, ignore_eos=True), "none")
    assert gen.draft_length.context == len(prompt) - 1
    while not gen.finished:
        gen.step()
    assert gen.draft_length.context == len(gen.ids) - 1
    assert costs.table(len(PROMPT)) == short and 1 in costs.table(len(prompt))


def test_calibrate_seeds_the_verification_costs_every_drafter_and_target_only_request_share(tiny_target, tok):
    drafters = {"ngram": NgramDrafter(), "wrong": WrongDrafter(tiny_target, V)}
    engine = Engine(
        tiny_target,
        tok,
        drafters,
        "ngram",
        4,
        draft_schedule="adaptive",
        draft_p_min=0.0,
        prefill_chunk=0,
        prefill_step_seconds=0.0,
    )
    # Nothing measured: the first draft is short, not the configured 4.
    _, steps = _run_engine(engine, GenerationParams(max_new_tokens=3, ignore_eos=True, num_draft_tokens=4))
    assert 0 < steps[1].drafted <= 2
    seconds = engine.calibrate()
    assert sorted(seconds) == [1, 2, 3, 4, 5] and all(s > 0 for s in seconds.values())
    params = GenerationParams(max_new_tokens=24, ignore_eos=True, num_draft_tokens=4)
    gens = [engine.start(PROMPT, params, draft) for draft in ("ngram", "wrong", "none")]
    tables = [gen.draft_length.costs.verify for gen in gens]
    assert tables[0] is tables[1] is tables[2] and tables[0].table(32) == seconds
    # Draft steps and acceptance stay each drafter's.
    assert gens[0].draft_length.costs is not gens[1].draft_length.costs
    while not gens[2].finished:
        gens[2].step()
    # A target-only request's plain steps are measurements for every drafter.
    assert tables[0].table(len(PROMPT))[1] != seconds[1]
    for gen in gens[:2]:
        while not gen.finished:
            gen.step()
    assert gens[0].generated_ids == gens[1].generated_ids == gens[2].generated_ids
    assert sorted(
        Engine(
            tiny_target,
            tok,
            {},
            verify_width=8,
            num_draft_tokens=4,
            **FIXED_DRAFT,
        ).calibrate(rows=3)
    ) == [1, 2, 3]


# --- the property: speculative == target-only greedy, for random tiny models and drafts ----------------------

DRAFT_KINDS = ["self", "noisy", "independent", "truncated", "wrong", "ngram", "scripted"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_speculative_equals_target_greedy(data, make_tiny_model, truncate_layers, word_tokenizer):
    vocab = data.draw(st.integers(50, 100), label="vocab")
    heads, kv = data.draw(st.sampled_from([(4, 2), (4, 4), (2, 1)]), label="heads")
    target = make_tiny_model(
        seed=data.draw(st.integers(0, 10_000), label="target seed"),
        vocab_size=vocab,
        n_layers=data.draw(st.integers(1, 2), label="layers"),
        n_heads=heads,
        n_kv_heads=kv,
        tie_embeddings=data.draw(st.booleans(), label="tied"),
        qkv_bias=data.draw(st.booleans(), label="bias"),
        max_seq_len=64,
    )
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10), label="prompt")
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    k = data.draw(st.integers(1, 8), label="k")
    greedy = greedy_decode(target, prompt, max_new)
    eos_mode = data.draw(st.sampled_from(["none", "first", "random"]), label="eos")
    eos = {"none": set(), "first": {greedy[0]}, "random": {data.draw(st.integers(0, vocab - 1), label="eos id")}}[
        eos_mode
    ]
    tok = word_tokenizer(vocab, sorted(eos))
    target_loaded = _loaded(target, tok)

    kind = data.draw(st.sampled_from(DRAFT_KINDS), label="draft")
    if kind == "self":
        drafter = ModelDrafter(kind, target_loaded, target_loaded)
    elif kind == "noisy":
        scale = data.draw(st.sampled_from([0.02, 0.1, 0.5]), label="noise")
        drafter = ModelDrafter(kind, _loaded(_noisy_copy(target, scale, seed=len(prompt)), tok), target_loaded)
    elif kind == "independent":
        other = make_tiny_model(seed=data.draw(st.integers(0, 10_000)), vocab_size=vocab, n_layers=1, max_seq_len=64)
        drafter = ModelDrafter(kind, _loaded(other, tok), target_loaded)
    elif kind == "truncated":
        drafter = ModelDrafter(kind, _loaded(truncate_layers(target, 1), tok), target_loaded)
    elif kind == "wrong":
        drafter = WrongDrafter(target, vocab)
    elif kind == "ngram":
        drafter = NgramDrafter(max_n=data.draw(st.integers(1, 3), label="max_n"))
    else:
        script = data.draw(st.lists(st.integers(0, 8), min_size=1, max_size=12), label="script")
        drafter = ScriptedDrafter(target, vocab, script)

    expected = expected_greedy(target, prompt, max_new, eos)
    params = GenerationParams(max_new_tokens=max_new, num_draft_tokens=k)
    gen, steps = run_checked(target, tok, prompt, params, drafter)
    assert gen.generated_ids == expected
    assert gen.finish_reason == ("eos" if expected[-1] in eos else "length")
    assert gen.text == tok.decode([t for t in expected if t not in eos])
    if eos_mode == "first":
        assert gen.generated_ids == greedy[:1] and len(steps) == 1
    if kind == "wrong":
        assert gen.stats.accepted == 0
    if kind == "self":
        assert gen.stats.accepted == gen.stats.drafted
    if kind == "scripted":
        verifying = [step for step in steps if step.drafted > 0]
        assert len(verifying) == len(drafter.log)
        for step, (asked, proposed, must_accept) in zip(verifying, drafter.log, strict=True):
            assert step.drafted == len(proposed) == asked
            assert step.accepted == must_accept


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), max_new=st.integers(2, 16), k=st.integers(0, 6))
def test_property_stop_strings(seed, max_new, k, make_tiny_model, word_tokenizer):
    """A stop string cut from the target's own output ends generation exactly where it first appears."""
    rng = random.Random(seed)
    tok = word_tokenizer(V)
    target = make_tiny_model(seed=seed, vocab_size=V, n_layers=1)
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
    greedy = expected_greedy(target, prompt, max_new, set())
    full = tok.decode(greedy)
    a = rng.randrange(len(full))
    stop = full[a : a + rng.randint(1, 6)]
    first = full.index(stop)
    needed = next(n for n in range(1, len(greedy) + 1) if stop in tok.decode(greedy[:n]))
    drafter = ModelDrafter("self", _loaded(target, tok), _loaded(target, tok))
    params = GenerationParams(max_new_tokens=max_new, num_draft_tokens=k, stop=(stop,))
    gen, _ = run_checked(target, tok, prompt, params, drafter)
    assert gen.finish_reason == "stop"
    assert gen.text == full[:first] and stop not in gen.text
    assert gen.generated_ids == greedy[:needed]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_an_error_not_a_token(make_tiny_model, word_tokenizer, bad):
    model = make_tiny_model(seed=0)
    with torch.no_grad():
        model.norm.weight[3] = bad  # every position's hidden state, and so its logits, turn non-finite
    tok = word_tokenizer(model.config.vocab_size)
    gen = Generation(model, tok, [1, 2, 3], GenerationParams(max_new_tokens=4, num_draft_tokens=4), None)
    with pytest.raises(NumericalError, match="non-finite logits"):
        gen.step()


def test_statistics_reach_the_api_by_field_name():
    """One record: the API's `speculative` copies every field it shares with GenerationStats by name (a new
    counter needs a field in each, nothing else), and choices add up field by field."""
    from app.api.jobs import Prepared, speculative_details

    stats = GenerationStats(
        generated_tokens=8,
        drafted=5,
        accepted=3,
        refused=1,
        target_passes=4,
        accepted_per_position=[2, 1],
        schedule="adaptive",
        p_min=0.05,
        draft_lengths=[0, 1, 2],
    )
    prepared = Prepared([1], GenerationParams(max_new_tokens=8, num_draft_tokens=4), "ngram", 4)
    details = speculative_details(prepared, stats)
    assert (details.drafted, details.accepted, details.refused, details.target_passes) == (5, 3, 1, 4)
    assert (details.tokens_per_target_pass, details.acceptance_rate, details.schedule) == (2.0, 0.6, "adaptive")
    both = stats + GenerationStats(drafted=1, accepted_per_position=[1, 0, 1], schedule="fixed", p_min=0.0)
    assert (both.drafted, both.accepted_per_position, both.schedule, both.p_min) == (6, [3, 1, 1], "adaptive", 0.05)
