"""Speculative sampling keeps the target's distribution exactly, under both samplers.

The distribution tests run the production loop (`Generation`) on a tiny model with a 6-token vocabulary
and compare the empirical distribution of the first three generated tokens with the exact one, computed
by enumerating all 216 continuations. Thresholds are chi-square critical values at a false-alarm rate of
1e-4 for the number of cells, so they follow from the sample size instead of being tuned. Broken variants
(of the rejection sampler, and of the gumbel sampler's noise) show that the tests have teeth. The gumbel
sampler promises more: for each seed, speculative output equals target-only output token for token.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch

import app.engine.decoding.chooser as chooser_module
from app.engine.decoding.sampling import GumbelNoise, SamplingParams, gumbel_choice, warp
from app.engine.decoding.verification import rejection_sample
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.generation import Generation
from app.engine.model.loading import LoadedModel
from app.engine.model.transformer import Transformer
from app.engine.reference import build_causal_mask, full_lm_forward
from app.engine.step import GenerationError, GenerationParams

VOCAB = 6
PROMPT = [1, 2, 3]
# An untied head gives the tiny models spread-out next-token distributions (a tied one mostly repeats the last
# token with probability ~1, which would make every test here trivially pass).
TINY = {
    "vocab_size": VOCAB,
    "dim": 16,
    "n_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 1,
    "intermediate_size": 32,
    "tie_embeddings": False,
}
PARAMS = GenerationParams(max_new_tokens=3, num_draft_tokens=2, ignore_eos=True, temperature=1.0)
N_SAMPLES = 6_000
N_BROKEN = 5_000
N_PAIRS = 500
Z_1E4 = 3.719  # one-sided standard normal quantile for a false-alarm rate of 1e-4


def _chi2_critical(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-4."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_1E4 * math.sqrt(c)) ** 3


def _exact_distribution(target: Transformer, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first three tokens) under target-only sampling, by enumerating every continuation."""
    probs: dict[tuple[int, ...], float] = {}
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def next_dist(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            seq = PROMPT + list(prefix)
            logits = full_lm_forward(target, seq, build_causal_mask(len(seq)))[-1]
            cache[prefix] = warp(logits, params).double()
        return cache[prefix]

    for seq in itertools.product(range(VOCAB), repeat=3):
        p = 1.0
        for i in range(3):
            p *= float(next_dist(seq[:i])[seq[i]])
        probs[seq] = p
    return probs


def _run(target: Transformer, tokenizer, drafter, seed: int, sampler: str, **params) -> tuple[int, ...]:
    gen = Generation(target, tokenizer, PROMPT, replace(PARAMS, seed=seed, sampler=sampler, **params), drafter)
    while not gen.finished:
        gen.step()
    return tuple(gen.generated_ids)


def _sample(target: Transformer, tokenizer, drafter, n: int, seed0: int, sampler: str = "rejection") -> Counter:
    return Counter(_run(target, tokenizer, drafter, seed, sampler) for seed in range(seed0, seed0 + n))


def _cells(expected: dict[tuple[int, ...], float], n: int) -> list[list[tuple[int, ...]]]:
    """Outcomes grouped so that every cell expects at least 5 samples (rare outcomes pooled)."""
    cells: list[list[tuple[int, ...]]] = []
    pool: list[tuple[int, ...]] = []
    for seq, p in sorted(expected.items(), key=lambda kv: -kv[1]):
        if p * n >= 5:
            cells.append([seq])
        else:
            pool.append(seq)
    if pool:
        cells.append(pool)
    return cells


def _gof(counts: Counter, expected: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """Chi-square goodness of fit of `counts` to `expected`; returns (statistic, critical value)."""
    n = sum(counts.values())
    cells = _cells(expected, n)
    stat = 0.0
    for cell in cells:
        e = n * sum(expected[s] for s in cell)
        o = sum(counts[s] for s in cell)
        stat += (o - e) ** 2 / e
    return stat, _chi2_critical(len(cells) - 1)


def _homogeneity(a: Counter, b: Counter, expected: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """Two-sample chi-square test that `a` and `b` come from one distribution."""
    na, nb = sum(a.values()), sum(b.values())
    cells = _cells(expected, min(na, nb))
    stat = 0.0
    for cell in cells:
        oa, ob = sum(a[s] for s in cell), sum(b[s] for s in cell)
        total = oa + ob
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return stat, _chi2_critical(len(cells) - 1)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny models gain nothing from a second thread, and 50,000 generations pay its start-up each op.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_pair(make_tiny_model, word_tokenizer):
    target = make_tiny_model(3, **TINY)
    draft = make_tiny_model(4, **TINY)
    tok = word_tokenizer(VOCAB)
    drafter = ModelDrafter("tiny", LoadedModel(draft, tok, "draft", 0.0), LoadedModel(target, tok, "target", 0.0))
    return target, tok, drafter


@pytest.fixture(scope="module")
def exact(tiny_pair) -> dict[tuple[int, ...], float]:
    target, _, _ = tiny_pair
    return _exact_distribution(target, SamplingParams(temperature=PARAMS.temperature))


def test_the_draft_really_differs_from_the_target(tiny_pair):
    # Otherwise every test below would pass by accepting everything.
    target, _, drafter = tiny_pair
    seq = PROMPT
    p = warp(full_lm_forward(target, seq, build_causal_mask(3))[-1], SamplingParams(1.0))
    q = warp(full_lm_forward(drafter.model, seq, build_causal_mask(3))[-1], SamplingParams(1.0))
    assert 0.5 * (p - q).abs().sum() > 0.2


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["gumbel", "rejection"])
def test_speculative_sampling_matches_the_exact_target_distribution(sampler, tiny_pair, exact):
    target, tok, drafter = tiny_pair
    counts = _sample(target, tok, drafter, N_SAMPLES, seed0=0, sampler=sampler)
    stat, critical = _gof(counts, exact)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_gumbel_speculative_sampling_is_target_only_sampling_token_for_token(drafter_kind, tiny_pair):
    target, tok, model_drafter = tiny_pair
    drafter = model_drafter if drafter_kind == "model" else NgramDrafter(max_n=2, min_n=1)
    drafted = accepted = 0
    for seed in range(N_PAIRS):
        for k in (1, 3):
            gen = Generation(
                target, tok, PROMPT, replace(PARAMS, seed=seed, sampler="gumbel", num_draft_tokens=k), drafter
            )
            while not gen.finished:
                gen.step()
            drafted, accepted = drafted + gen.stats.drafted, accepted + gen.stats.accepted
            assert tuple(gen.generated_ids) == _run(target, tok, None, seed, "gumbel"), f"seed {seed}, k {k}"
    assert 0 < accepted < drafted  # the draft was really checked, and really rejected at times


def test_noise_consumed_as_a_stream_is_caught(tiny_pair, monkeypatch):
    """Broken: noise drawn from a stream, each draw taking the next numbers (what a generator consumed per
    token does). The draft's proposals consume draws too, so speculation changes which noise each position
    gets, and with it the output."""
    target, tok, drafter = tiny_pair
    real = GumbelNoise._noise
    draws: dict[int, int] = {}

    def streamed(self, position, ids):
        draws[id(self)] = draws.get(id(self), 0) + 1
        return real(self, draws[id(self)], ids)

    monkeypatch.setattr(GumbelNoise, "_noise", streamed)

    def at(self, position, ids=None):
        return self._noise(position, np.arange(self._vocab) if ids is None else ids)

    monkeypatch.setattr(GumbelNoise, "at", at)
    differing = sum(
        _run(target, tok, drafter, seed, "gumbel") != _run(target, tok, None, seed, "gumbel") for seed in range(200)
    )
    assert differing > 20, f"a consumed stream went unnoticed ({differing} of 200 differ)"


@pytest.mark.slow
def test_exponential_instead_of_gumbel_noise_is_caught(tiny_pair, exact, monkeypatch):
    """Broken: argmax(logits + e) with exponential noise e = -log u is not distributed as softmax(logits)."""
    target, tok, drafter = tiny_pair
    real = GumbelNoise._noise
    monkeypatch.setattr(GumbelNoise, "_noise", lambda self, position, ids: np.exp(-real(self, position, ids)))
    counts = _sample(target, tok, drafter, N_BROKEN, seed0=0, sampler="gumbel")
    stat, critical = _gof(counts, exact)
    assert stat > critical, f"exponential noise went unnoticed: chi2 {stat:.1f} < {critical:.1f}"


def _plain_target_after_rejection(draft_tokens, draft_probs, target_probs, generator):
    """Broken: on rejection, sample from p instead of the residual max(0, p - q)."""
    accepted, _ = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    return accepted, int(torch.multinomial(target_probs[accepted], 1, generator=generator))


def _inverted(draft_tokens, draft_probs, target_probs, generator):
    """Broken: accept with probability min(1, q/p) instead of min(1, p/q)."""
    k = draft_tokens.shape[0]
    if k == 0:  # nothing drafted (the last token of a request): nothing to get wrong
        return rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    rows = torch.arange(k)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    u = torch.rand(k, generator=generator)
    accept = u * p < q
    accepted = int(accept.to(torch.int32).cumprod(0).sum())
    if accepted == k:
        return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    return accepted, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


@pytest.mark.slow
@pytest.mark.parametrize("broken", [_plain_target_after_rejection, _inverted])
def test_a_broken_verifier_is_caught(broken: Callable, tiny_pair, exact, monkeypatch):
    target, tok, drafter = tiny_pair
    monkeypatch.setattr(chooser_module, "rejection_sample", broken)
    counts = _sample(target, tok, drafter, N_BROKEN, seed0=0, sampler="rejection")
    stat, critical = _gof(counts, exact)
    assert stat > critical, f"{broken.__name__} went unnoticed: chi2 {stat:.1f} < {critical:.1f}"


# --- the verifier on constructed distributions ----------------------------------------------------------------


def test_a_draft_identical_to_the_target_is_always_accepted():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 10, generator=gen), -1)
    for _ in range(200):
        tokens = torch.multinomial(probs[:4], 1, generator=gen).squeeze(1)
        accepted, _ = rejection_sample(tokens, probs[:4], probs, gen)
        assert accepted == 4


def test_a_draft_with_zero_mass_where_the_target_has_it_all_is_always_rejected():
    gen = torch.Generator().manual_seed(0)
    target = torch.zeros(3, 4)
    target[:, 0] = 1.0  # the target only ever writes token 0
    draft = torch.zeros(2, 4)
    draft[:, 1:] = 1 / 3  # the draft never proposes token 0
    for _ in range(200):
        tokens = torch.multinomial(draft, 1, generator=gen).squeeze(1)
        accepted, nxt = rejection_sample(tokens, draft, target, gen)
        assert (accepted, nxt) == (0, 0)


def test_a_deterministic_proposal_counts_as_one_hot_q():
    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.5, 0.0]])
    hits = Counter()
    for _ in range(4000):
        accepted, nxt = rejection_sample(torch.tensor([1]), None, target, gen)
        hits[(accepted, nxt if accepted == 0 else None)] += 1
    # Token 1 is accepted with p(1)/1 = 0.75; a rejection then draws from max(0, p - onehot(1)) = token 0.
    assert abs(hits[(1, None)] / 4000 - 0.75) < 0.03
    assert hits[(0, 0)] + hits[(1, None)] == 4000


def test_same_seed_same_output_and_identical_draft_always_accepted(tiny_pair):
    target, tok, _ = tiny_pair
    same = ModelDrafter("self", LoadedModel(target, tok, "t", 0.0), LoadedModel(target, tok, "t", 0.0))
    params = replace(PARAMS, max_new_tokens=24, num_draft_tokens=3, seed=1234, top_k=4, top_p=0.9)
    runs = []
    for _ in range(2):
        gen = Generation(target, tok, PROMPT, params, same)
        while not gen.finished:
            gen.step()
        runs.append(gen)
    assert runs[0].generated_ids == runs[1].generated_ids
    assert runs[0].seed == 1234
    assert runs[0].stats.drafted > 0
    assert runs[0].stats.accepted == runs[0].stats.drafted


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.count_nonzero(warp(logits, SamplingParams(1.0, top_k=2))) == 2
    p = warp(logits, SamplingParams(1.0, top_p=0.5))
    assert torch.count_nonzero(p) == 1 and float(p[0, 0]) == 1.0
    assert torch.allclose(warp(logits, SamplingParams(0.0)), torch.tensor([[1.0, 0, 0, 0, 0]]))


@pytest.mark.parametrize(
    "bad", [{"temperature": -0.5}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}], ids=lambda d: next(iter(d))
)
def test_invalid_sampling_parameters_are_refused(bad, tiny_pair):
    target, tok, _ = tiny_pair
    with pytest.raises(GenerationError):
        Generation(target, tok, PROMPT, replace(PARAMS, **bad), None)


# --- the gumbel sampler's parts --------------------------------------------------------------------------------


def test_gumbel_noise_is_a_pure_function_of_seed_position_and_token():
    noise = GumbelNoise(seed=42, vocab=1000)
    full = noise.at(7)
    ids = np.array([999, 3, 500])
    assert np.array_equal(GumbelNoise(42, 1000).at(7, ids), full[ids])  # asked for a part first: same values
    assert np.array_equal(GumbelNoise(42, 1000).at(7), full)
    assert not np.array_equal(noise.at(8), full)
    assert not np.array_equal(GumbelNoise(43, 1000).at(7), full)
    # Standard Gumbel: mean is Euler's constant, variance pi^2 / 6 (10^5 draws: a few standard errors).
    draws = np.concatenate([GumbelNoise(1, 10_000).at(p) for p in range(10)])
    assert abs(draws.mean() - 0.5772) < 0.02 and abs(draws.var() - math.pi**2 / 6) < 0.05


def test_gumbel_choice_samples_the_warped_distribution_and_respects_the_cut():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(0.7, top_k=4, top_p=0.9)
    p = warp(logits, params)
    n = 20_000
    counts = np.bincount([gumbel_choice(logits, params, GumbelNoise(s, 6), 0) for s in range(n)], minlength=6)
    assert counts[p.numpy() == 0].sum() == 0  # cut tokens are never drawn
    kept = p.numpy() > 0
    expected = n * p.numpy()[kept]
    stat = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert stat < _chi2_critical(int(kept.sum()) - 1)
    # A draft's logits over part of the vocabulary use the noise of the token ids they stand for.
    ids = torch.tensor([5, 0, 3])
    noise = GumbelNoise(9, 6)
    idx = gumbel_choice(logits[ids], SamplingParams(1.0), noise, 4, ids)
    assert idx == int(np.argmax(logits[ids].double().numpy() + noise.at(4)[ids.numpy()]))


def test_top_p_beyond_the_first_candidates_falls_back_to_the_whole_vocabulary():
    # A flat distribution: the nucleus of 0.9 spans 90 % of 1,000 tokens, past the 256 looked at first.
    logits = torch.linspace(0.0, 0.01, 1000)
    p = warp(logits, SamplingParams(1.0, top_p=0.9))
    probs = logits.softmax(-1)
    top, order = torch.sort(probs, descending=True)
    reference = torch.zeros(1000, dtype=torch.bool)
    reference[order[(top.cumsum(-1) - top) < 0.9]] = True
    assert torch.equal(p > 0, reference)
    assert 850 < int((p > 0).sum()) < 950
