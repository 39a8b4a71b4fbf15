"""The reference contract of one speculative step (app/engine/reference.py), one test per line of it.

`speculative_decode_step(token_ids, draft, target, num_draft_tokens)`:
  * drafts exactly num_draft_tokens tokens with the draft's `greedy_decode`;
  * runs the target exactly once, on the whole drafted sequence, via `full_lm_forward` under
    `build_causal_mask`;
  * accepts drafted tokens in order from the first, stopping at the first disagreement;
  * replaces that disagreement with the target's argmax and includes nothing after it;
  * when every token is accepted, returns exactly the target's own greedy_decode for num_draft_tokens steps.

Drafts are scripted where a test needs a disagreement at a chosen position: the draft's greedy_decode is
replaced by a spy that returns chosen tokens, while the target stays real.
"""

from __future__ import annotations

import pytest
import torch

from app.engine import reference
from app.engine.reference import build_causal_mask, full_lm_forward, greedy_decode, speculative_decode_step

VOCAB = 64
PROMPT = [5, 17, 3, 42, 8, 8, 30]

_real_greedy_decode = reference.greedy_decode
_real_full_lm_forward = reference.full_lm_forward


@pytest.fixture(scope="module")
def target(make_tiny_model):
    return make_tiny_model(seed=11, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def draft(make_tiny_model):
    return make_tiny_model(seed=12, vocab_size=VOCAB, n_layers=1)


@torch.no_grad()
def _next_token(model, seq: list[int]) -> int:
    """The model's argmax after `seq`, computed without the reference module (plain causal forward)."""
    return int(model(torch.tensor([seq]))[0, -1].argmax())


def _independent_greedy(model, seq: list[int], n: int) -> list[int]:
    seq = list(seq)
    out = []
    for _ in range(n):
        out.append(_next_token(model, seq))
        seq.append(out[-1])
    return out


class _ForwardCounter:
    """Counts a module's forward passes, with the input ids and the mask of each."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls: list[tuple[list[int], torch.Tensor | None]] = []
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        assert ids.shape[0] == 1
        self.calls.append((ids[0].tolist(), kwargs.get("mask")))

    def remove(self) -> None:
        self._handle.remove()


@pytest.fixture
def counters():
    made: list[_ForwardCounter] = []

    def count(module: torch.nn.Module) -> _ForwardCounter:
        made.append(_ForwardCounter(module))
        return made[-1]

    yield count
    for c in made:
        c.remove()


def _script_draft(monkeypatch, draft, tokens: list[int]) -> list[tuple]:
    """Make the draft's greedy_decode return `tokens[:n]`; the target's stays real. Returns the call log."""
    calls: list[tuple] = []

    def fake(model, token_ids, num_tokens):
        calls.append((model, list(token_ids), num_tokens))
        if model is draft:
            return list(tokens[:num_tokens])
        return _real_greedy_decode(model, token_ids, num_tokens)

    monkeypatch.setattr(reference, "greedy_decode", fake)
    return calls


def _draft_disagreeing_at(target, prompt: list[int], k: int, j: int) -> list[int]:
    """k drafted tokens that equal the target's argmax at every position except j.

    After the wrong token at j the draft keeps following the target's own choices (given the wrong
    prefix), so positions j+1.. agree again: agreement that must not be counted.
    """
    drafted: list[int] = []
    for i in range(k):
        choice = _next_token(target, prompt + drafted)
        drafted.append((choice + 1) % VOCAB if i == j else choice)
    return drafted


# --- build_causal_mask and full_lm_forward -------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7])
def test_build_causal_mask_is_lower_triangular_bool(n):
    mask = build_causal_mask(n)
    assert mask.shape == (n, n)
    assert mask.dtype == torch.bool
    for i in range(n):
        for j in range(n):
            assert bool(mask[i, j]) == (j <= i), (i, j)


def test_full_lm_forward_shape_and_mask_is_honoured(target):
    ids = PROMPT
    causal = full_lm_forward(target, ids, build_causal_mask(len(ids)))
    assert causal.shape == (len(ids), VOCAB)
    # The mask is what decides: letting position 0 see the whole sequence changes its logits, while the
    # causal mask gives what the model's own causal attention gives.
    full = full_lm_forward(target, ids, torch.ones(len(ids), len(ids), dtype=torch.bool))
    assert not torch.allclose(causal[0], full[0], atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(causal, target(torch.tensor([ids]))[0], atol=1e-5, rtol=0)


def _cached_logits(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    cache = model.new_cache(len(ids))
    out, pos = [], 0
    with torch.inference_mode():
        for n in chunks:
            out.append(model(torch.tensor([ids[pos : pos + n]]), pos, cache)[0])
            pos += n
            assert cache.length == pos
    assert pos == len(ids)
    return torch.cat(out)


def test_full_lm_forward_with_causal_mask_equals_kv_cached_forward_tiny(target):
    ids = [*PROMPT, 1, 2, 3, 60, 61, 9]
    full = full_lm_forward(target, ids, build_causal_mask(len(ids)))
    for chunks in ([len(ids)], [1] * len(ids), [4, 1, 5, 3]):
        torch.testing.assert_close(_cached_logits(target, ids, chunks), full, atol=1e-5, rtol=0)


def test_greedy_decode_is_the_argmax_chain(target):
    assert greedy_decode(target, PROMPT, 0) == []
    assert greedy_decode(target, PROMPT, 6) == _independent_greedy(target, PROMPT, 6)


# --- the contract of speculative_decode_step ---------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5])
def test_step_drafts_exactly_k_tokens_with_the_drafts_greedy_decode(monkeypatch, counters, target, draft, k):
    calls: list[tuple] = []

    def spy(model, token_ids, num_tokens):
        out = _real_greedy_decode(model, token_ids, num_tokens)
        calls.append((model, list(token_ids), num_tokens, out))
        return out

    monkeypatch.setattr(reference, "greedy_decode", spy)
    draft_passes = counters(draft)
    target_passes = counters(target)
    speculative_decode_step(PROMPT, draft, target, k)
    n_draft_passes, n_target_passes = len(draft_passes.calls), len(target_passes.calls)

    draft_calls = [c for c in calls if c[0] is draft]
    assert len(draft_calls) == 1, "the draft proposes through one greedy_decode call"
    _, ids, n, drafted = draft_calls[0]
    assert ids == PROMPT and n == k and len(drafted) == k
    assert drafted == _independent_greedy(draft, PROMPT, k)
    # One full forward per drafted token (greedy_decode has no cache), all on the draft.
    assert n_draft_passes == k
    # What the target verifies is exactly what the draft's greedy_decode returned.
    assert n_target_passes == 1
    assert target_passes.calls[0][0] == PROMPT + drafted


@pytest.mark.parametrize("k", [1, 4])
def test_step_runs_the_target_exactly_once_on_the_whole_drafted_sequence(monkeypatch, counters, target, draft, k):
    lm_calls: list[tuple] = []

    def spy(model, token_ids, mask):
        lm_calls.append((model, list(torch.as_tensor(token_ids).tolist()), mask.clone()))
        return _real_full_lm_forward(model, token_ids, mask)

    monkeypatch.setattr(reference, "full_lm_forward", spy)
    drafted = _independent_greedy(draft, PROMPT, k)
    target_passes = counters(target)
    speculative_decode_step(PROMPT, draft, target, k)

    n = len(PROMPT) + k
    assert len(target_passes.calls) == 1, "the target runs exactly once"
    ids, mask = target_passes.calls[0]
    assert ids == PROMPT + drafted and len(ids) == n
    assert mask is not None and torch.equal(mask, build_causal_mask(n))
    target_lm_calls = [c for c in lm_calls if c[0] is target]
    assert len(target_lm_calls) == 1, "the target's pass goes through full_lm_forward"
    assert target_lm_calls[0][1] == PROMPT + drafted
    assert torch.equal(target_lm_calls[0][2], build_causal_mask(n))


@pytest.mark.parametrize("j", [0, 1, 2, 3, 4])
def test_step_stops_at_the_first_disagreement_later_agreement_not_counted(monkeypatch, target, draft, j):
    k = 5
    drafted = _draft_disagreeing_at(target, PROMPT, k, j)
    choices = [_next_token(target, PROMPT + drafted[:i]) for i in range(k)]
    agree = [d == c for d, c in zip(drafted, choices, strict=True)]
    assert agree == [i != j for i in range(k)]  # the setup: one disagreement, agreement again after it
    _script_draft(monkeypatch, draft, drafted)

    out = speculative_decode_step(PROMPT, draft, target, k)
    assert len(out) == j + 1, f"accepted {len(out) - 1} tokens, expected {j} (stop at the first disagreement)"
    assert out[:j] == drafted[:j]


@pytest.mark.parametrize("j", [0, 2, 4])
def test_step_replaces_the_disagreement_with_the_targets_argmax_and_nothing_after(monkeypatch, target, draft, j):
    k = 5
    drafted = _draft_disagreeing_at(target, PROMPT, k, j)
    _script_draft(monkeypatch, draft, drafted)

    out = speculative_decode_step(PROMPT, draft, target, k)
    expected_choice = _next_token(target, PROMPT + drafted[:j])
    assert out[-1] == expected_choice != drafted[j]
    assert out == [*drafted[:j], expected_choice]
    # The tokens after the correction are the target's greedy continuation from the same prefix.
    assert out == _independent_greedy(target, PROMPT, j + 1)


def test_step_with_a_draft_that_agrees_everywhere_accepts_all_k_and_adds_no_bonus(monkeypatch, target, draft):
    k = 4
    drafted = _independent_greedy(target, PROMPT, k)
    _script_draft(monkeypatch, draft, drafted)
    assert speculative_decode_step(PROMPT, draft, target, k) == drafted


@pytest.mark.parametrize("k", [1, 4, 9])
def test_step_with_draft_equal_to_target_returns_the_targets_own_greedy_decode(target, k):
    out = speculative_decode_step(PROMPT, target, target, k)
    assert out == greedy_decode(target, PROMPT, k)
    assert len(out) == k


def test_step_with_draft_equal_to_target_on_the_real_model(target_f32):
    model = target_f32.model
    ids = target_f32.tokenizer.encode("The capital of France is")
    out = speculative_decode_step(ids, model, model, 4)
    assert out == greedy_decode(model, ids, 4) == _independent_greedy(model, ids, 4)


def test_step_with_a_real_different_draft_is_a_prefix_of_the_targets_greedy(target, draft):
    for k in (1, 2, 6):
        out = speculative_decode_step(PROMPT, draft, target, k)
        assert 1 <= len(out) <= k
        assert out == _independent_greedy(target, PROMPT, len(out))


def test_step_needs_at_least_one_draft_token(target, draft):
    with pytest.raises(ValueError, match="at least 1"):
        speculative_decode_step(PROMPT, draft, target, 0)
