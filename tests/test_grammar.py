"""Constrained decoding (app.engine.decoding.grammar): the grammar state's masks and forced tokens, drafts
proposing within the grammar, and on the real target greedy and seeded constrained output that is the same
speculative or target-only, with or without forced tokens, with every draft, alone or batched, and parses against
its schema."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from app.engine.decoding.grammar import GrammarError, Grammars, GrammarSpec
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.engine import Engine
from app.engine.factory import build_engine
from app.engine.generation import Generation
from app.engine.step import GenerationError, GenerationParams
from tests.conftest import FIXED_DRAFT, KERNELS, use_kernel

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Italy"]}},
            "required": ["city", "country"],
        },
    },
    "required": ["name", "age", "home"],
}


def _valid(value: object, schema: dict) -> bool:
    """Whether `value` follows the subset of JSON Schema that PERSON uses."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    assert kind == "object"
    props = schema["properties"]
    return (
        isinstance(value, dict)
        and set(schema["required"]) <= set(value)
        and set(value) <= set(props)
        and all(_valid(v, props[k]) for k, v in value.items())
    )


@pytest.fixture(scope="module")
def grammars(target_f32) -> Grammars:
    return Grammars(target_f32.tokenizer, target_f32.model.config.vocab_size)


def test_masks_follow_the_drafts_and_leave_the_state_as_it_was(target_f32, grammars) -> None:
    tok = target_f32.tokenizer
    state = grammars.start(GrammarSpec("json_schema", json.dumps(PERSON)))
    text = tok.encode('{"name": "Ada", "age": 36, "home": {"city": "London", "country": "France"}}')
    before, n = state.masks()
    assert n == 0 and before.shape == (1, target_f32.model.config.vocab_size)
    assert before[0, text[0]] and not before[0, tok.encode("Hello")[0]]
    # Drafts the grammar takes, then one it refuses: rows up to the refused one, each the mask after the ones before
    wrong = tok.encode(" Italy")[0]  # where the age's integer goes
    rows, n = state.masks([*text[:10], wrong, text[10]])
    assert n == 10 and rows.shape[0] == 11
    assert (rows[0] == before[0]).all()
    for i in range(1, 11):
        state.accept([text[i - 1]])
        assert (rows[i] == state.masks()[0][0]).all()
        assert rows[i - 1, text[i - 1]]
    assert not rows[10, wrong] and rows[10, text[10]]
    # Tokens the grammar forces: the only one its mask allows (a key of the schema, the rest of an enum's value)
    fresh = grammars.start(GrammarSpec("json_schema", json.dumps(PERSON)))
    key = tok.encode('{"name": "Ada", "')
    forced = fresh.forced_tokens(key, 4)
    assert tok.decode(forced) == "age" and fresh.forced(key) == forced[0]
    flags = fresh.forced_flags([*key, *forced])
    assert flags[0] is False and flags[1] and flags[-1]  # '{"' is not forced, 'name' and 'age' are
    rows, n = fresh.masks([*key, *forced])
    assert n == len(key) + 1 and int(rows[len(key)].sum()) == 1 and (fresh.allowed(key) == rows[len(key)]).all()
    assert fresh.allowed([*key, wrong]) is None
    country = tok.encode('{"name": "A", "age": 1, "home": {"city": "B", "country": "Fr')
    assert tok.decode(fresh.forced_tokens(country, 4)) == "ance"
    fresh.accept(key)  # after all that exploring, the state is where the accepted tokens put it
    assert (fresh.masks()[0][0] == rows[len(key)]).all() and fresh.forced() == forced[0]
    off = grammars.start(GrammarSpec("json_schema", json.dumps(PERSON)), forcing=False)
    assert off.forced(key) is None and off.forced_tokens(key, 4) == []
    # A lookup stops at the first token the grammar refuses
    lookup = NgramDrafter().session(64)
    lookup.grammar = regex = grammars.start(GrammarSpec("regex", "12-34"))
    regex.accept(tok.encode("12"))
    assert tok.decode(lookup.propose(tok.encode("12-34 ab 12"), 4)) == "-34"
    # Nothing but an end-of-sequence token once the object is complete; the enum admits only its values
    state.accept(text[10:])
    assert state.complete
    end, _ = state.masks()
    assert set(end[0].nonzero().flatten().tolist()) == set(tok.eos_token_ids)
    spain = tok.encode('{"name": "A", "age": 1, "home": {"city": "B", "country": "Spain"}}')
    n = grammars.start(GrammarSpec("json_schema", json.dumps(PERSON))).masks(spain)[1]
    assert n < len(spain) and "country" in tok.decode(spain[:n]) and "Sp" not in tok.decode(spain[:n])
    # Choices and regexes match whole
    choice = grammars.start(GrammarSpec("choice", json.dumps(["yes", "no way"])))
    assert choice.masks(tok.encode("no way"))[1] == len(tok.encode("no way"))
    assert choice.masks(tok.encode("nope"))[1] < len(tok.encode("nope"))
    regex = grammars.start(GrammarSpec("regex", r"\d{3}-[a-z]+"))
    assert regex.masks(tok.encode("123-abc"))[1] == len(tok.encode("123-abc"))
    assert regex.masks(tok.encode("12-abc"))[1] < len(tok.encode("12-abc"))
    for bad in (
        GrammarSpec("json_schema", '{"type": "strin"}'),
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("json_schema", "[1]"),
        GrammarSpec("regex", "a(b"),
        GrammarSpec("choice", "[]"),
        GrammarSpec("choice", "yes"),
        GrammarSpec("yaml", ""),
    ):
        with pytest.raises(GrammarError):
            grammars.check(bad)


def _alone(engine: Engine, prompt: list[int], params: GenerationParams, draft: str) -> Generation:
    gen = engine.start(prompt, params, draft)
    while not gen.finished:
        gen.step()
    return gen


def test_constrained_speculative_equals_target_only_alone_and_batched(packed_target) -> None:
    """Greedy constrained decoding gives target-only's tokens with the target as its own draft (which, proposing
    within the grammar, has every draft kept) and with n-grams, alone and batched, and so does seeded sampling;
    the answers parse and follow the schema or the choice; the grammar's end ends the generation."""
    packed = packed_target(KERNELS[0])
    tok = packed.tokenizer
    drafters = {"self": ModelDrafter("self", packed, packed), "ngram": NgramDrafter()}
    engine = Engine(
        packed.model,
        tok,
        drafters,
        "self",
        4,
        **FIXED_DRAFT,
    )
    ask = "Describe a famous scientist as JSON with the keys name, age and home (city, country)."
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}])),
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "Is Paris in France? Answer yes or no."}])),
    ]
    grammars = [GrammarSpec("json_schema", json.dumps(PERSON)), GrammarSpec("choice", json.dumps(["yes", "no"]))]
    params = [
        GenerationParams(max_new_tokens=48, draft_schedule="fixed", grammar=g, num_draft_tokens=4) for g in grammars
    ]
    alone = [_alone(engine, p, q, "none") for p, q in zip(prompts, params, strict=True)]
    outputs = [g.generated_ids for g in alone]
    assert [g.finish_reason for g in alone] == ["eos", "eos"]
    person = json.loads(alone[0].text)
    assert _valid(person, PERSON), person
    assert alone[1].text in ("yes", "no")
    spec = [_alone(engine, p, q, "self") for p, q in zip(prompts, params, strict=True)]
    assert [g.generated_ids for g in spec] == outputs
    # The target drafting for itself within the grammar: k drafts a step (the choice's end-of-sequence token
    # ends its drafts), every one kept (unmasked, most were refused), the tokens the grammar forced counted apart
    assert all(g.stats.drafted == g.stats.accepted > 0 for g in spec)
    assert spec[0].stats.drafted == sum(k * n for k, n in enumerate(spec[0].stats.draft_lengths))
    assert spec[0].stats.forced > 0 and alone[0].stats.forced > 0
    # Each kept token names its source: target-only, the grammar's forced tokens and the target's own.
    gen, sources = engine.start(prompts[0], params[0], "none"), []
    while not gen.finished:
        sources += gen.step().sources
    assert sources.count("forced") == gen.stats.forced and set(sources) == {"target", "forced"}
    gens = [engine.start(p, q, d) for p, q, d in zip(prompts, params, ("ngram", "self"), strict=True)]
    together = 0
    while any(not g.finished for g in gens):
        outs = engine.step_batch([g for g in gens if not g.finished])
        together = max(together, len(outs.together))
        assert not [o for o in outs if isinstance(o, Exception)]
    assert [g.generated_ids for g in gens] == outputs and together == 2
    # Seeded sampling: the same tokens with and without the draft, an answer that parses
    sampled = replace(params[0], temperature=0.8, seed=11)
    by_target = _alone(engine, prompts[0], sampled, "none")
    assert _alone(engine, prompts[0], sampled, "self").generated_ids == by_target.generated_ids
    assert by_target.finish_reason != "eos" or _valid(json.loads(by_target.text), PERSON)
    # The grammar's end ends a generation that ignores end-of-sequence tokens too
    ignoring = replace(params[1], ignore_eos=True)
    gen = _alone(engine, prompts[1], ignoring, "self")
    assert gen.finish_reason == "stop" and gen.text == alone[1].text
    with pytest.raises(GenerationError, match="grammar"):
        engine.start(prompts[1], GenerationParams(grammar=GrammarSpec("regex", "a("), num_draft_tokens=4), "none")


@pytest.fixture(scope="module")
def served_engine() -> Engine:
    """The server's engine: bfloat16, feature draft, hybrid and n-gram."""
    with use_kernel(KERNELS[0]):
        engine, _ = build_engine(num_draft_tokens=4, dtype="bfloat16", device="cpu")
    return engine


@pytest.mark.slow
def test_forced_tokens_and_drafts_within_the_grammar_keep_target_only_output(served_engine) -> None:
    """With forced tokens and without, target-only and with the feature draft, the hybrid and n-grams, alone and
    all batched: greedy and seeded (gumbel) constrained outputs are the same tokens; forced tokens save target
    passes and are counted apart from drafts; the feature draft proposes within the grammar (none refused); the
    rejection sampler's seed reproduces its answer."""
    engine = served_engine
    tok = engine.tokenizer
    eagle = next(d for d in engine.drafters if d not in ("ngram", "hybrid"))
    ask = "Describe a famous scientist as JSON with the keys name, age and home (city, country)."
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}]))
    drafts = ["none", eagle, "hybrid", "ngram"]
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    for sampling in ({}, {"temperature": 0.8, "seed": 3}):
        base = GenerationParams(max_new_tokens=24, draft_schedule="fixed", grammar=spec, **sampling)
        plain = _alone(engine, prompt, replace(base, forced_tokens=False), "none")
        for forced in (False, True) if not sampling else (True,):
            params = replace(base, forced_tokens=forced)
            gens = {d: _alone(engine, prompt, params, d) for d in drafts}
            assert {d: g.generated_ids for d, g in gens.items()} == dict.fromkeys(drafts, plain.generated_ids)
            assert all((g.stats.forced > 0) == forced for g in gens.values()), sampling
            if forced:
                assert gens["none"].stats.target_passes < plain.stats.target_passes
            batch = [engine.start(prompt, params, d) for d in drafts]
            while any(not g.finished for g in batch):
                outs = engine.step_batch([g for g in batch if not g.finished])
                assert not [o for o in outs if isinstance(o, Exception)]
            assert [g.generated_ids for g in batch] == [plain.generated_ids] * len(drafts), (sampling, forced)
        # The feature draft proposes only tokens the grammar allows: none is cut before verification
        gen = engine.start(prompt, params, eagle)
        gen.step()
        while not gen.finished:
            plan = gen.plan(engine.verify_width)
            assert plan.refused == 0
            hidden = engine.target.hidden(plan.feed[None], plan.start, gen.cache)[0]
            gen.verify(plan, hidden, engine.target.logits(hidden), 0.0, solo=True)
        assert gen.generated_ids == plain.generated_ids
    rejection = replace(base, sampler="rejection")
    first = _alone(engine, prompt, rejection, "hybrid")
    assert _alone(engine, prompt, rejection, "hybrid").generated_ids == first.generated_ids and first.stats.forced > 0
