"""Constrained decoding (app.engine.grammar): the grammar state's masks, and on the real target greedy and seeded
constrained output that is the same speculative or target-only, alone or batched, and parses against its schema."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from app.engine.drafters import ModelDrafter, NgramDrafter
from app.engine.generation import Engine, Generation, GenerationError, GenerationParams
from app.engine.grammar import GrammarError, Grammars, GrammarSpec
from tests.conftest import KERNELS

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
    """Greedy constrained decoding gives target-only's tokens with the target as its own draft (drafts that the
    grammar refuses at every turn) and with n-grams, alone and batched, and so does seeded sampling; the answers
    parse and follow the schema or the choice; the grammar's end ends the generation."""
    packed = packed_target(KERNELS[0])
    tok = packed.tokenizer
    drafters = {"self": ModelDrafter("self", packed, packed), "ngram": NgramDrafter()}
    engine = Engine(packed.model, tok, drafters, "self", 4)
    ask = "Describe a famous scientist as JSON with the keys name, age and home (city, country)."
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}])),
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "Is Paris in France? Answer yes or no."}])),
    ]
    grammars = [GrammarSpec("json_schema", json.dumps(PERSON)), GrammarSpec("choice", json.dumps(["yes", "no"]))]
    params = [GenerationParams(max_new_tokens=48, draft_schedule="fixed", grammar=g) for g in grammars]
    alone = [_alone(engine, p, q, "none") for p, q in zip(prompts, params, strict=True)]
    outputs = [g.generated_ids for g in alone]
    assert [g.finish_reason for g in alone] == ["eos", "eos"]
    person = json.loads(alone[0].text)
    assert _valid(person, PERSON), person
    assert alone[1].text in ("yes", "no")
    spec = [_alone(engine, p, q, "self") for p, q in zip(prompts, params, strict=True)]
    assert [g.generated_ids for g in spec] == outputs
    # drafts the grammar refused (cut before the target runs them, still counted as drafted), and drafts it kept
    assert sum(g.stats.accepted for g in spec) > 0 and sum(g.stats.drafted - g.stats.accepted for g in spec) > 0
    assert [g.stats.drafted for g in spec] == [sum(k * n for k, n in enumerate(g.stats.draft_lengths)) for g in spec]
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
        engine.start(prompts[1], GenerationParams(grammar=GrammarSpec("regex", "a(")), "none")
