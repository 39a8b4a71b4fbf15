"""The feature draft: its network, its per-request session (catch-up and rollback), saving and loading,
and generation with it (greedy output must equal the target's own, with any schedule and cut-off)."""

from __future__ import annotations

import json

import pytest
import torch

import app.engine.drafting.eagle as eagle_module
from app.engine import kernels
from app.engine.decoding.sampling import SamplingParams
from app.engine.drafting.eagle import (
    EagleConfig,
    EagleDraft,
    EagleDrafter,
    EagleError,
    is_eagle_dir,
    load_draft,
    save_draft,
)
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.kernels.quantized import quantize
from app.engine.model.loading import LoadedModel
from app.engine.reference import greedy_decode
from app.engine.step import GenerationParams
from tests.conftest import KERNEL_ENDS, use_kernel

V = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def target(make_tiny_model):
    return make_tiny_model(seed=11, vocab_size=V)


@pytest.fixture(scope="module")
def tok(word_tokenizer):
    return word_tokenizer(V)


def _draft(target, vocab: list[int] | None = None, seed: int = 0) -> EagleDraft:
    torch.manual_seed(seed)
    ids = vocab if vocab is not None else list(range(V))
    draft = EagleDraft(EagleConfig.for_target(target.config, len(ids), "tiny"))
    draft.vocab_ids.copy_(torch.tensor(ids))
    draft = draft.eval().requires_grad_(False)
    draft.attach(target)
    return draft


def _drafter(target, tok, **kwargs) -> EagleDrafter:
    return EagleDrafter("eagle", _draft(target, **kwargs), LoadedModel(target, tok, "t", 0.0))


@torch.no_grad()
def _states(target, ids: list[int]) -> torch.Tensor:
    return target.hidden(torch.tensor([ids]))[0]


@torch.no_grad()
def _reference_proposal(draft: EagleDraft, target, ids: list[int], k: int, start: int = 0) -> list[int]:
    """What the session must propose, recomputed from scratch without any cache: true states for every
    known position from `start` (the draft's window), then the draft's own guesses fed back."""
    states = _states(target, ids)[start:-1]  # the newest token has no state yet
    tokens = list(ids[start + 1 :])
    out = []
    for _ in range(k):
        guess = draft(states[None], torch.tensor([tokens]))[0, -1]
        tok = int(draft.vocab_ids[draft.draft_logits(guess).argmax()])
        out.append(tok)
        states = torch.cat([states, guess[None]])
        tokens.append(tok)
    return out


def test_session_proposals_match_a_recomputation_across_rollbacks(target, tok):
    drafter = _drafter(target, tok)
    session = drafter.session(capacity=64)
    ids = list(PROMPT)
    session.features[: len(ids)] = _states(target, ids)
    for accepted in (2, 0, 3, 1):
        got = session.propose(ids, 4)
        assert got == _reference_proposal(drafter.draft, target, ids, 4)
        # The target keeps `accepted` drafts and adds a different token of its own; states follow.
        ids = [*ids, *got[:accepted], (got[accepted] + 1) % V if accepted < len(got) else 7]
        session.features[: len(ids)] = _states(target, ids)
    assert session.propose(ids, 0) == []


def test_p_min_one_cuts_every_proposal_and_zero_none(target, tok):
    drafter = _drafter(target, tok)
    session = drafter.session(capacity=64)
    session.features[: len(PROMPT)] = _states(target, PROMPT)
    assert session.propose(PROMPT, 4, p_min=1.0) == []
    assert len(session.propose(PROMPT, 4, p_min=0.0)) == 4


def test_sampled_proposals_come_with_distributions_over_the_target_vocabulary(target, tok):
    vocab = list(range(0, V, 2))  # the draft may propose even ids only
    drafter = _drafter(target, tok, vocab=vocab)
    session = drafter.session(capacity=64)
    session.features[: len(PROMPT)] = _states(target, PROMPT)
    gen = torch.Generator().manual_seed(0)
    tokens, q = session.propose_sampled(PROMPT, 3, SamplingParams(1.0, 0, 1.0), gen)
    assert len(tokens) == 3 and all(t % 2 == 0 for t in tokens)
    assert q is not None and q.shape == (3, V)
    assert torch.allclose(q.sum(-1), torch.ones(3), atol=1e-5)
    assert float(q[:, 1::2].abs().sum()) == 0.0
    assert all(float(q[i, t]) > 0 for i, t in enumerate(tokens))


@pytest.mark.parametrize("schedule", ["fixed", "heuristic", "adaptive"])
@pytest.mark.parametrize("p_min", [0.0, 0.3])
@pytest.mark.parametrize("width", [0, 8])
def test_generation_with_a_feature_draft_equals_target_greedy(target, tok, schedule, p_min, width):
    drafter = _drafter(target, tok, seed=3)
    params = GenerationParams(
        max_new_tokens=24, num_draft_tokens=4, ignore_eos=True, draft_schedule=schedule, draft_p_min=p_min
    )
    gen = Generation(target, tok, PROMPT, params, drafter, verify_width=width)
    while not gen.finished:
        gen.step()
    assert gen.generated_ids == greedy_decode(target, PROMPT, 24)
    s = gen.stats
    assert s.drafted > 0 and s.schedule == schedule and s.p_min == p_min
    assert sum(s.draft_lengths) >= s.verify_passes and s.p_min_stops <= sum(s.draft_lengths)
    if p_min == 0 and schedule != "adaptive":  # the adaptive schedule's value cut-off may stop a draft too
        assert s.p_min_stops == 0 and sum(s.draft_lengths) == s.verify_passes


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_greedy_adaptive_draft_is_cut_at_the_schedules_value_floor(target, tok, temperature, monkeypatch):
    """Before each greedy draft the generation gives the model session the adaptive schedule's value floor (its
    chains stop where their value falls below it); a sampled request's drafts take none. The answer stays the
    target's."""
    from app.engine.drafting import loop
    from app.engine.drafting.draft_length import DraftLength

    monkeypatch.setattr(DraftLength, "value_floor", lambda self: 0.37)
    floors = []
    real = loop.run_drafts
    monkeypatch.setattr(loop, "run_drafts", lambda *a, **kw: floors.append(kw.get("value_mins")) or real(*a, **kw))
    params = GenerationParams(
        max_new_tokens=24, num_draft_tokens=4, ignore_eos=True, draft_schedule="adaptive", temperature=temperature
    )
    gen = Generation(target, tok, PROMPT, params, _drafter(target, tok, seed=3))
    while not gen.finished:
        gen.step()
    assert floors and set(map(str, floors)) == {"[0.37]" if temperature == 0 else "None"}
    if temperature == 0:
        assert gen.generated_ids == greedy_decode(target, PROMPT, 24)


def test_the_generation_hands_the_draft_the_target_states_of_every_verified_position(target, tok):
    drafter = _drafter(target, tok, seed=5)
    params = GenerationParams(max_new_tokens=20, num_draft_tokens=3, ignore_eos=True)
    gen = Generation(target, tok, PROMPT, params, drafter)
    features = gen._draft.features
    while not gen.finished:
        gen.step()
        known = len(gen.ids) - 1  # the newest token has not been through the target yet
        assert torch.allclose(features[:known], _states(target, gen.ids)[:known], atol=1e-5)


def test_a_draft_reads_a_token_as_the_targets_first_layer_does_scaled_where_the_target_scales_it(make_tiny_model):
    """Gemma multiplies its embeddings by sqrt(dim) before its first layer; the draft, which borrows them, reads them
    scaled too: beside a target that scales by 4 it computes what it computes beside the same target whose embedding
    rows were multiplied by 4 instead, and not what it computes from the raw rows."""
    scaled = make_tiny_model(seed=11, vocab_size=V, embed_scale=4.0)
    raw = make_tiny_model(seed=11, vocab_size=V)
    premultiplied = make_tiny_model(seed=11, vocab_size=V)
    premultiplied.embed.weight.mul_(4.0)
    ids = [*PROMPT, 7, 8]
    states, tokens = _states(raw, ids)[:-1][None], torch.tensor([ids[1:]])
    with torch.no_grad():
        out = {name: _draft(model)(states, tokens) for name, model in [("s", scaled), ("p", premultiplied), ("r", raw)]}
    assert torch.equal(out["s"], out["p"])
    assert not torch.allclose(out["s"], out["r"], atol=1e-3)


def test_save_and_load_round_trip(target, tmp_path):
    draft = _draft(target, vocab=[0, 5, 7, 63], seed=4)
    save_draft(draft, tmp_path / "d")
    assert is_eagle_dir(tmp_path / "d") and not is_eagle_dir(tmp_path)
    loaded = load_draft(tmp_path / "d", target)
    assert loaded.vocab_ids.tolist() == [0, 5, 7, 63]
    x = torch.randn(1, 3, target.config.dim)
    t = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(x, t), draft(x, t))
    # Only the draft's own weights are saved: not the target's embedding or output rows.
    names = set(json.loads((tmp_path / "d" / "config.json").read_text()))
    assert "architecture" in names
    assert sum(p.numel() for p in loaded.parameters()) < target.embed.weight.numel() + 10 * target.config.dim**2


def test_a_draft_for_another_target_is_refused(target, make_tiny_model, tmp_path):
    save_draft(_draft(target), tmp_path / "d")
    other = make_tiny_model(seed=1, vocab_size=V, dim=48)
    with pytest.raises(EagleError, match="dim 32"):
        load_draft(tmp_path / "d", other)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EagleError, match="cannot read"):
        load_draft(tmp_path / "d", target)


def test_engine_defaults_apply_and_requests_override_them(target, tok):
    drafter = _drafter(target, tok)
    engine = Engine(
        target,
        tok,
        {"eagle": drafter},
        "eagle",
        4,
        draft_schedule="heuristic",
        draft_p_min=0.2,
        prefill_chunk=0,
        prefill_step_seconds=0.0,
    )
    gen = engine.start(PROMPT, GenerationParams(max_new_tokens=4, num_draft_tokens=4))
    assert (gen.stats.schedule, gen.stats.p_min) == ("heuristic", 0.2)
    gen = engine.start(
        PROMPT, GenerationParams(max_new_tokens=4, draft_schedule="fixed", draft_p_min=0.0, num_draft_tokens=4)
    )
    assert (gen.stats.schedule, gen.stats.p_min) == ("fixed", 0.0)
    gen = engine.start(PROMPT, GenerationParams(max_new_tokens=4, num_draft_tokens=4), draft="none")
    assert gen.stats.schedule == "none"


def test_batched_proposals_match_each_session_alone(target, tok):
    """`propose_batch` drafts for several requests, each draft step one forward over all of them, and gives
    each what a recomputation from scratch gives, also on the next round after some tokens were kept."""
    drafter = _drafter(target, tok, seed=7)
    prefixes = [PROMPT, PROMPT[:5], PROMPT[2:]]
    ks = [3, 1, 4]
    sessions = [drafter.session(64) for _ in prefixes]
    for session, ids in zip(sessions, prefixes, strict=True):
        session.features[: len(ids)] = _states(target, ids)
    out = drafter.propose_batch(sessions, prefixes, ks, [0.0, 0.0, 0.0])
    assert out == [_reference_proposal(drafter.draft, target, ids, k) for ids, k in zip(prefixes, ks, strict=True)]
    # The target kept the first proposed token of each and added one of its own; the sessions roll back.
    longer = [[*ids, d[0], 2] for ids, d in zip(prefixes, out, strict=True)]
    for session, ids in zip(sessions, longer, strict=True):
        session.features[: len(ids)] = _states(target, ids)
    again = drafter.propose_batch(sessions, longer, [2, 2, 0], [0.0, 0.0, 0.0])
    assert again[:2] == [_reference_proposal(drafter.draft, target, ids, 2) for ids in longer[:2]]
    assert again[2] == []


def test_a_session_far_behind_restarts_its_context_at_the_window(target, tok, monkeypatch):
    """A session behind by more than DRAFT_WINDOW positions (a long stretch without model drafts) runs the draft over
    the last DRAFT_WINDOW only, its context restarted there: it proposes what a draft given only that stretch
    proposes, and no forward takes more than the window's rows."""
    monkeypatch.setattr(eagle_module, "DRAFT_WINDOW", 6)
    drafter = _drafter(target, tok, seed=2)
    rows = []
    forward = EagleDraft.forward

    def counted(self, states, *args):
        if len(args) >= 3 and args[2] is not None:  # a session's forward (over its cache), not the reference's
            rows.append(states.shape[1])
        return forward(self, states, *args)

    monkeypatch.setattr(EagleDraft, "forward", counted)
    ids = [(3 * i + 1) % V for i in range(30)]
    session = drafter.session(capacity=64)
    session.features[: len(ids)] = _states(target, ids)
    assert session.propose(ids[:6], 2) == _reference_proposal(drafter.draft, target, ids[:6], 2)  # within the window
    got = session.propose(ids, 4)  # 23 positions behind
    assert got == _reference_proposal(drafter.draft, target, ids, 4, len(ids) - 1 - 6)
    assert max(rows) <= 6, rows


def test_the_draft_reads_the_last_window_of_a_long_prompt(target, tok, monkeypatch):
    """A prompt longer than DRAFT_WINDOW positions: the draft runs over its last DRAFT_WINDOW only (its positions
    from 0 there: RoPE sees differences), proposing what a draft given only that stretch proposes, and keeps that
    start on the next steps and across a rollback; a prompt within the window is read whole."""
    monkeypatch.setattr(eagle_module, "DRAFT_WINDOW", 6)
    drafter = _drafter(target, tok, seed=2)
    ids = [(3 * i + 1) % V for i in range(30)]
    start = len(ids) - 1 - 6
    session = drafter.session(capacity=64)
    session.features[: len(ids)] = _states(target, ids)
    got = session.propose(ids, 4)
    assert got == _reference_proposal(drafter.draft, target, ids, 4, start)
    assert got != _reference_proposal(drafter.draft, target, ids, 4)  # (this draft reads the window differently)
    longer = [*ids, *got[:2], (got[2] + 1) % V]  # two drafts kept, the third replaced
    session.features[: len(longer)] = _states(target, longer)
    assert session.propose(longer, 3) == _reference_proposal(drafter.draft, target, longer, 3, start)
    short = drafter.session(capacity=64)
    short.features[:10] = _states(target, ids[:10])
    assert short.propose(ids[:10], 3) == _reference_proposal(drafter.draft, target, ids[:10], 3)


# --- the draft on a CPU kernel: its matrices as integer blocks, its layer in one kernel call -------------------


def _kernel_target(make_tiny_model, kernel: str):
    """A tiny bf16 target packed for `kernel`, shaped so that its products and attention run there (heads of 64: the
    amx kernel's attention takes multiples of 64, the others' of 32)."""
    model = make_tiny_model(seed=12, vocab_size=V, dim=128, n_heads=2, n_kv_heads=1, intermediate_size=96)
    model = model.to(torch.bfloat16)
    with use_kernel(kernel):
        model.pack(kernels.kernel())
    return model


def _random_draft(target, out, seed: int, std: float, vocab: torch.Tensor | None = None) -> EagleDraft:
    """A float32 draft for `target` with weights drawn from N(0, std) (`vocab`: its draft vocabulary, default the first
    V ids), saved into `out` as `load_draft` reads it."""
    draft = EagleDraft(EagleConfig.for_target(target.config, V, "tiny"))
    if vocab is not None:
        draft.vocab_ids.copy_(vocab)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, std)
    save_draft(draft, out)
    return draft


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_blocks_round_each_weight_to_its_nearest_step(qtype):
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    q = quantize(w, qtype)
    assert q.shape == (16, 96) and q.formats == [qtype]
    back = q.dequantize()
    # Each block of 32 inputs has one step: its largest magnitude over 127 (Q8_0: each value rounded to the
    # nearest) or over 8 (Q4_0: -8..7 steps, so the side opposite the largest value is clamped a step short); the
    # step is stored in float16, whose rounding moves the largest values by up to 2^-11 of it.
    largest = w.reshape(16, 3, 32).abs().amax(-1, keepdim=True)
    steps = largest / (127 if qtype == "Q8_0" else 8)
    err = (back - w).reshape(16, 3, 32).abs()
    assert bool((err <= steps * (0.5 if qtype == "Q8_0" else 1.0) + largest * 2**-10).all())
    assert float(err.mean()) < float(steps.mean()) * 0.4
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), qtype)
    with pytest.raises(ValueError, match="32-input"):
        quantize(w, "Q4_K")


@pytest.mark.parametrize("kernel", KERNEL_ENDS)
@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "bf16"])
def test_a_draft_on_a_kernel_runs_its_layer_in_one_call_with_the_layer_by_layer_bits(
    make_tiny_model, tok, tmp_path, kernel, weights
):
    """`load_draft` on a packed target: the matrices as `weights` blocks (or bf16) on the target's kernel, the
    decoder layer in one LayerStack call that gives the bits of its calls one by one, predictions close to the
    float32 draft's, and sessions that propose, across rollbacks and batched, what a fresh session proposes."""
    target = _kernel_target(make_tiny_model, kernel)
    float_draft = _random_draft(target, tmp_path / "d", seed=2, std=0.2)
    draft = load_draft(tmp_path / "d", target, weights)
    assert draft.runs_as == ("bfloat16" if weights == "bf16" else weights.upper())
    assert draft._stack is not None and draft._stack.kernel is target.kernel
    assert isinstance(draft._head.fused, kernels.QuantLinear) == (weights != "bf16")

    states = torch.randn(1, 5, target.config.dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        one = draft.new_cache(16, torch.bfloat16, torch.device("cpu"))
        stacked = draft(states, tokens, 0, one)
        stack, draft.__dict__["_stack"] = draft._stack, None
        apart = draft(states, tokens, 0, draft.new_cache(16, torch.bfloat16, torch.device("cpu")))
        draft.__dict__["_stack"] = stack
        assert torch.equal(stacked, apart)
        float_draft.attach(target)
        want = float_draft(states.float(), tokens)
        got = draft(states, tokens, 0, draft.new_cache(16, torch.bfloat16, torch.device("cpu")))
    assert torch.nn.functional.cosine_similarity(got.float(), want, dim=-1).min() > 0.98

    drafter = EagleDrafter("eagle", draft, LoadedModel(target, tok, "t", 0.0))
    ids = list(PROMPT)
    features = _states(target, [*ids, *range(20, 30)])
    session = drafter.session(capacity=64)
    session.features[: len(features)] = features
    for accepted in (2, 0, 3):
        fresh = drafter.session(capacity=64)
        fresh.features[: len(features)] = features
        got_ids = session.propose(ids, 4)
        assert got_ids == fresh.propose(ids, 4) and len(got_ids) == 4
        ids = [*ids, *got_ids[:accepted], 20 + accepted]
    sessions = [drafter.session(64) for _ in range(3)]
    prefixes = [PROMPT, PROMPT[:5], PROMPT[2:]]
    for s, p in zip(sessions, prefixes, strict=True):
        s.features[: len(p)] = _states(target, p)
    batched = drafter.propose_batch(sessions, prefixes, [3, 1, 4], [0.0] * 3)
    alone = []
    for p, k in zip(prefixes, [3, 1, 4], strict=True):
        s = drafter.session(64)
        s.features[: len(p)] = _states(target, p)
        alone.append(s.propose(p, k))
    assert batched == alone


@pytest.mark.parametrize("kernel", kernels.available())
@pytest.mark.parametrize("weights", ["q8_0", "bf16", "bf16, scaled embeddings"])
def test_a_greedy_chain_in_one_kernel_call_proposes_what_the_token_by_token_loop_does(
    make_tiny_model, tok, tmp_path, kernel, weights, monkeypatch
):
    """On every kernel this machine runs: a session's greedy drafts through `DraftChain` (one C call a draft)
    equal the loop's token by token (forward, head, choice), across rollbacks, cut-offs that stop a chain early
    (`p_min` on a token's probability, `value_min` on the chain's), and target tokens outside the draft vocabulary;
    the next draft after each starts from the same state. Also beside a target that scales its embeddings
    (Gemma): the chain's rows of the draft vocabulary and of tokens outside it are scaled as the loop's."""
    scale = 4.0 if "scaled" in weights else 1.0
    weights = weights.split(",")[0]
    model = make_tiny_model(
        seed=12, vocab_size=2 * V, dim=128, n_heads=2, n_kv_heads=1, intermediate_size=96, embed_scale=scale
    )
    model = model.to(torch.bfloat16)
    with use_kernel(kernel):
        model.pack(kernels.kernel())
    # The draft vocabulary the upper half of the target's: the prompt's tokens (below V) lie outside it.
    _random_draft(model, tmp_path / "d", seed=3, std=0.3, vocab=torch.arange(V, 2 * V).flip(0))
    draft = load_draft(tmp_path / "d", model, weights)
    assert draft._chain is not None
    drafter = EagleDrafter("eagle", draft, LoadedModel(model, tok, "t", 0.0))
    calls = []
    real = kernels.DraftChain.__call__
    monkeypatch.setattr(kernels.DraftChain, "__call__", lambda self, *a: calls.append(1) or real(self, *a))

    def drafts(chained: bool) -> list:
        chain = draft._chain
        draft.__dict__["_chain"] = chain if chained else None
        try:
            ids = list(PROMPT)
            features = _states(model, [*ids, *range(V, V + 40)])
            session = drafter.session(capacity=96)
            session.features[: len(features)] = features
            out = []
            cuts = [(0.0, 0.0), (0.0, 0.0), (0.05, 0.0), (0.1, 0.0), (0.2, 0.0), (0.3, 0.0), (0.0, 0.5), (0.0, 0.02)]
            cuts += [(0.05, 0.01), (0.0, 0.0)]
            for step, (p_min, value_min) in enumerate(cuts):
                session.value_min = value_min
                got = session.propose(ids, 5, p_min)
                out.append((got, session._cache.length, session._next_pos))
                ids = [*ids, *got[: step % 3], step % 7]  # accepted, then a target token outside the draft's
            return out
        finally:
            draft.__dict__["_chain"] = chain

    chained = drafts(True)
    assert len(calls) == 10
    assert chained == drafts(False)
    lengths = {len(got) for got, _, _ in chained}
    assert 5 in lengths and len(lengths) > 1, lengths  # full chains, and chains the cut-off stopped


def test_a_draft_beside_a_target_without_a_kernel_keeps_its_dtype(target, tmp_path):
    save_draft(_draft(target, seed=1), tmp_path / "d")
    draft = load_draft(tmp_path / "d", target, "q8_0")
    assert draft.runs_as == "float32" and draft._stack is None
    with pytest.raises(EagleError, match="auto, q8_0, q4_0, bf16"):
        load_draft(tmp_path / "d", target, "q2_k")


@pytest.mark.parametrize("kernel", KERNEL_ENDS)
def test_auto_draft_weights_are_q8_0_where_the_kernel_has_integer_dot_products(make_tiny_model, tmp_path, kernel):
    target = _kernel_target(make_tiny_model, kernel)
    save_draft(EagleDraft(EagleConfig.for_target(target.config, V, "tiny")), tmp_path / "d")
    draft = load_draft(tmp_path / "d", target)
    assert draft.runs_as == ("Q8_0" if target.kernel.spec.dot else "bfloat16")
