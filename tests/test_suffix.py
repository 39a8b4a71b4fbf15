"""Drafts from what was already written (app.engine.drafting.suffix, suffix_index): the index finds the longest
agreement, stays within its memory, keeps tenants apart; the suffix and hybrid drafts learn from finished
answers and from a request's prediction, and the output stays the target's own."""

from __future__ import annotations

import tracemalloc

import pytest

from app.engine.drafting.base import Drafter
from app.engine.drafting.draft_length import StepCosts, prior
from app.engine.drafting.registry import REGISTRY, DraftContext, DrafterEntry, builtin, register
from app.engine.drafting.suffix import SuffixDrafter, lookup_kind, match_bucket
from app.engine.drafting.suffix_index import MAX_MATCH, SuffixIndex, TrafficIndex
from app.engine.engine import Engine
from app.engine.step import GenerationError, GenerationParams
from tests.conftest import FIXED_DRAFT

V = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_a_lookup_takes_the_longest_agreement_and_the_most_recent_on_a_tie():
    index = SuffixIndex()
    a = index.add([1, 2, 3, 4, 10, 11])  # "3 4" after "1 2"
    b = index.add([9, 2, 3, 4, 20, 21])  # "3 4" after "9 2": more recent, a shorter agreement with the context
    assert a is not None and b is not None
    found = index.match([7, 1, 2, 3, 4], 2)
    assert found is not None and (found.tokens, found.length, found.sequence) == ([10, 11], 4, a)
    found = index.match([5, 5, 3, 4], 3)  # both agree on "3 4" alone: the latest wins
    assert found is not None and (found.tokens, found.length, found.sequence) == ([20, 21], 2, b)
    assert index.match([3, 4], 2, floor=3) is None  # no occurrence agrees on 3 tokens
    assert index.match([8, 8], 2) is None and index.match([4], 2) is None
    long = list(range(100, 160))
    index.add(long)
    assert index.match(long[:50], 4).length == MAX_MATCH


def test_the_index_evicts_whole_answers_least_recently_used_within_its_budget():
    one = SuffixIndex()
    one.add(list(range(200)))
    size = one.bytes
    index = TrafficIndex(3 * size)
    for i in range(3):
        index.add(None, [i * 1000 + t for t in range(200)], 0)
    assert index.sequences == 3 and index.bytes <= 3 * size
    assert index.match(None, [1000, 1001], 1) is not None  # answer 1 drafted: now the most recent
    index.add(None, [9000 + t for t in range(200)], 0)
    assert index.sequences == 3 and index.bytes <= index.max_bytes
    assert index.match(None, [0, 1], 1) is None  # answer 0 was the least recently used
    assert index.match(None, [1000, 1001], 1) is not None and index.match(None, [2000, 2001], 1) is not None
    for i in range(2):  # sequences sharing anchors, some of which fell out of a common anchor's list
        one.add([t % 7 for t in range(100 * i, 100 * i + 300)])
    for sid in list(one._sequences):
        one.remove(sid)
    assert (one.bytes, one.tokens, one.sequences, one._table) == (0, 0, 0, {})
    small = TrafficIndex(100)
    small.add(None, list(range(200)), 0)
    assert small.sequences == 0  # larger than the whole budget: not kept


def test_the_index_counts_the_memory_it_holds():
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = SuffixIndex()
        for i in range(40):  # answers of 300 tokens over a 5,000-token vocabulary, as text repeats itself
            index.add([(i * 7919 + t * 31) % 5000 for t in range(300)])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.6 * held <= index.bytes <= 1.6 * held, (index.bytes, held)


def test_tenants_never_read_each_other_s_answers_and_share_one_budget():
    traffic = TrafficIndex(1 << 20)
    prompt = [50, 51, 52, 53]
    traffic.add("a", [*prompt, 7, 8, 9, 10], len(prompt))
    assert traffic.match("b", [*prompt, 7], 3) is None and traffic.match(None, [*prompt, 7], 3) is None
    found = traffic.match("a", [*prompt, 7], 3)
    assert found is not None and found.tokens == [8, 9, 10]
    assert (traffic.lookups, traffic.hits) == (3, 1)
    # Over the budget, the least recently used answers go first, whatever their tenant.
    small = TrafficIndex(traffic.bytes * 2 + 10)
    for tenant in ("a", "b", "c"):
        small.add(tenant, [*prompt, *range(100, 104)], len(prompt))
    assert small.sequences == 2 and small.bytes <= small.max_bytes
    assert small.match("a", [*prompt, 100], 2) is None and small.match("c", [*prompt, 100], 2) is not None
    TrafficIndex(0).add("a", [1, 2, 3], 1)  # 0: nothing kept, nothing fails


def test_a_tenant_filling_the_index_evicts_its_own_answers_never_another_s():
    prompt = [50, 51, 52, 53]
    one = TrafficIndex(1 << 20)
    one.add("b", [*prompt, *range(100, 150)], len(prompt))
    traffic = TrafficIndex(4 * one.bytes)  # about four answers; each tenant is owed two
    traffic.add("b", [*prompt, *range(100, 150)], len(prompt))
    for i in range(40):  # "a" writes ten times the whole budget
        traffic.add("a", [*prompt, *range(1000 * (i + 1), 1000 * (i + 1) + 50)], len(prompt))
    assert traffic.bytes <= traffic.max_bytes
    found = traffic.match("b", [*prompt, 100, 101], 2)
    assert found is not None and found.tokens == [102, 103]  # b's answer still drafts b's
    assert traffic.match("a", [1000, 1001], 1) is None  # a's oldest went instead
    assert traffic.match("a", [40000, 40001], 1) is not None


def test_a_full_index_evicts_from_the_tenant_holding_the_most():
    def answer(first: int) -> list[int]:
        return [*range(first, first + 50)]

    one = TrafficIndex(1 << 20)
    one.add("c", answer(100), 0)
    traffic = TrafficIndex(4 * one.bytes + 10)
    traffic.add("c", answer(100), 0)  # the least recently used answer of all
    traffic.add("a", answer(200), 0)
    traffic.add("a", answer(300), 0)
    traffic.add("b", answer(400), 0)
    traffic.add("d", answer(500), 0)  # within its share: room is made from "a", which holds the most
    assert traffic.sequences == 4
    assert traffic.match("c", [100, 101], 1) is not None
    assert traffic.match("a", [200, 201], 1) is None and traffic.match("a", [300, 301], 1) is not None
    assert traffic.match("d", [500, 501], 1) is not None


def test_match_lengths_are_calibrated_apart_from_a_prior_that_grows_with_them():
    assert [match_bucket(m) for m in (0, 1, 2, 3, 4, 5, 9, 17, 32, 40)] == [0, 1, 2, 4, 4, 8, 16, 32, 32, 32]
    assert lookup_kind("index", 12) == "lookup:index:16"
    assert prior("model") == prior("lookup") == 0.5 < prior("lookup:index:8") < prior("lookup:index:32") < 1
    costs = StepCosts()
    costs.observe_acceptance(4, 4, "lookup:prompt:4")
    # A longer match of the same source starts from what the shorter one has shown, not from the prior alone.
    assert costs.kind("lookup:prompt:8").p_first >= costs.kind("lookup:prompt:4").p_first
    assert costs.kind("lookup:index:8").p_first == pytest.approx(prior("lookup:index:8"))


def test_the_session_proposes_from_its_own_text_its_prediction_and_the_index():
    traffic = TrafficIndex(1 << 20)
    drafter = SuffixDrafter("suffix", traffic)
    s = drafter.session(100)
    s.start(len(PROMPT), None, [20, 21, 22, 23, 24])
    # Nothing written yet: the prediction from its start; its own text has no match for the prompt's end.
    kinds = {p.kind: p.tokens for p in s.proposals(PROMPT, 3)}
    assert kinds == {"lookup:prediction:0": [20, 21, 22]}
    kinds = {p.kind: p.tokens for p in s.proposals([*PROMPT, 20, 21], 2)}
    assert kinds["lookup:prediction:2"] == [22, 23]
    # A text that repeats with period 3 continues with that period, beyond what was written.
    s = drafter.session(100)
    s.start(len(PROMPT), None, [])
    ids = [*PROMPT, 30, 31, 32, 30, 31, 32, 30]
    assert {p.kind: p.tokens for p in s.proposals(ids, 5)}["lookup:prompt:4"] == [31, 32, 30, 31, 32]
    traffic.add(None, [*PROMPT, 40, 41, 42, 43], len(PROMPT))  # what the engine files when an answer finishes
    other = drafter.session(100)
    other.start(len(PROMPT), None, [])
    found = {p.kind: p.tokens for p in other.proposals([*PROMPT, 40], 3)}
    assert found == {"lookup:index:16": [41, 42, 43]}  # filed after the prompt's tail: matched on 9 tokens
    assert other.lookup([*PROMPT, 40], 3) == [41, 42, 43] and other.last_kind == "lookup:index:16"
    salted = drafter.session(100)
    salted.start(len(PROMPT), "tenant-b", [])
    assert salted.proposals([*PROMPT, 40], 3) == []


def test_a_last_token_written_before_proposes_what_followed_it_as_a_match_of_one():
    s = SuffixDrafter("suffix", None).session(100)
    s.start(len(PROMPT), None, [])
    # No pair matches "7 1", but 1 was written before: what followed its latest occurrence (index 3) is proposed.
    ids = [*PROMPT, 7, 1]
    assert {p.kind: p.tokens for p in s.proposals(ids, 3)} == {"lookup:prompt:1": [5, 9, 2]}
    assert s.lookup(ids, 3) == [5, 9, 2] and s.last_kind == "lookup:prompt:1"  # the suffix draft alone drafts it
    assert s.proposals([*ids, 8], 3) == []  # a token never written before: nothing
    # A token that follows itself repeats, beyond what was written; a pair's match still wins over one token.
    assert {p.kind: p.tokens for p in s.proposals([*ids, 8, 8], 3)} == {"lookup:prompt:1": [8, 8, 8]}
    assert {p.kind for p in s.proposals([*ids, 8, 8, 7, 1], 2)} == {"lookup:prompt:2"}
    assert prior("lookup:prompt:1") == pytest.approx(1 / 3) and prior("lookup:prompt:2") == 0.5


def test_drafters_are_registered_entries():
    assert {"ngram", "suffix", "hybrid"} <= set(REGISTRY)
    assert set(builtin(DraftContext(None, None))) == {n for n, e in REGISTRY.items() if not e.needs_model}
    with pytest.raises(ValueError, match="taken"):
        register(DrafterEntry("ngram", "again", lambda ctx: REGISTRY["ngram"].build(ctx)))
    with pytest.raises(ValueError, match="taken"):
        register(DrafterEntry("none", "reserved", lambda ctx: REGISTRY["ngram"].build(ctx)))


def _engine(tiny_target, tok, drafters: dict[str, Drafter], default: str, traffic: TrafficIndex | None) -> Engine:
    settings = {**FIXED_DRAFT, "draft_schedule": "adaptive"}
    return Engine(tiny_target, tok, drafters, default, 4, traffic=traffic, **settings)


def _run(engine: Engine, params: GenerationParams, draft: str):
    gen = engine.start(PROMPT, params, draft)
    while not gen.finished:
        gen.step()
    return gen


@pytest.fixture(scope="module")
def tiny(make_tiny_model, word_tokenizer):
    return make_tiny_model(seed=3, vocab_size=V), word_tokenizer(V)


@pytest.mark.parametrize("schedule", ["adaptive", "fixed"])
def test_a_tenant_s_answers_speed_its_next_requests_only_and_change_no_token(tiny, schedule, monkeypatch):
    tiny_target, tok = tiny
    traffic = TrafficIndex(1 << 20)
    engine = _engine(tiny_target, tok, {"suffix": SuffixDrafter("suffix", traffic)}, "suffix", traffic)
    # Rows priced as a CPU's (each after the first 0.3 of a step), not as this machine's noise: the choices are
    # the cost model's alone.
    monkeypatch.setattr(StepCosts, "observe", lambda self, *args: None)
    engine._verify_costs.seed({r: 0.01 * (1 + 0.3 * (r - 1)) for r in range(1, 18)})
    params = GenerationParams(max_new_tokens=24, ignore_eos=True, num_draft_tokens=4, draft_schedule=schedule)
    alone = _run(engine, params, "none").generated_ids
    a = replace_salt(params, "a")
    first = _run(engine, a, "suffix")
    assert first.generated_ids == alone and "index" not in first.stats.draft_sources
    assert traffic.sequences == 2  # target-only answers are filed too (under the shared tenant)
    before = traffic.hits
    second = _run(engine, a, "suffix")
    assert second.generated_ids == alone
    assert traffic.hits > before  # its lookups found tenant a's earlier answers
    if schedule == "fixed":  # the longest match drafts: the earlier answer, not the own text's one-token match
        assert second.stats.draft_sources.get("index", 0) > 0
    # (The adaptive schedule may draft the same tokens from the own text: a tiny random model repeats its input.)
    hits = traffic.hits
    other = _run(engine, replace_salt(params, "b"), "suffix")
    assert other.generated_ids == alone and "index" not in other.stats.draft_sources
    assert traffic.hits == hits  # tenant b's lookups found nothing of tenant a's


def replace_salt(params: GenerationParams, salt: str) -> GenerationParams:
    from dataclasses import replace

    return replace(params, cache_salt=salt)


def test_a_prediction_is_drafted_and_counted_as_openai_counts_it(tiny):
    tiny_target, tok = tiny
    engine = _engine(tiny_target, tok, {"suffix": SuffixDrafter("suffix", None)}, "suffix", None)
    params = GenerationParams(max_new_tokens=20, ignore_eos=True, num_draft_tokens=4, draft_schedule="fixed")
    answer = _run(engine, params, "none").generated_ids
    # The answer with two tokens changed in its middle: accepted up to the change, rejected there, then the
    # prediction is picked up again where the answer follows it.
    predicted = list(answer)
    predicted[8:10] = [(t + 1) % V for t in predicted[8:10]]
    from dataclasses import replace

    gen = _run(engine, replace(params, prediction=tuple(predicted)), "suffix")
    assert gen.generated_ids == answer
    s = gen.stats
    assert s.accepted_prediction_tokens >= 4 and s.draft_sources.get("prediction", 0) > 0
    assert s.target_passes < len(answer)
    with pytest.raises(GenerationError, match="prediction"):
        engine.start(PROMPT, replace(params, prediction=(V + 1,)), "suffix")
    with pytest.raises(GenerationError, match="lookup_draft_tokens"):
        engine.start(PROMPT, replace(params, lookup_draft_tokens=17), "suffix")


@pytest.mark.anyio
async def test_prediction_and_cache_salt_over_http(packed_target, api_client):
    """Both APIs: a prediction is drafted from (usage counts what it kept, OpenAI's fields), the answer is the one
    without it; a cache_salt keeps the prefix cache and the index apart (another salt gets nothing cached); the
    index shows in /info and /metrics; a malformed prediction or salt is a 400 naming it."""
    from app.engine import kernels

    packed = packed_target(kernels.available()[0])
    traffic = TrafficIndex(1 << 22)
    suffix = SuffixDrafter("suffix", traffic)
    engine = Engine(packed.model, packed.tokenizer, {"suffix": suffix}, "suffix", 4, traffic=traffic, **FIXED_DRAFT)
    question = "List the days of the week, one per line, then say which one is the first of the weekend. " * 3
    chat = {"messages": [{"role": "user", "content": question}], "max_tokens": 40, "temperature": 0}
    async with api_client(engine) as c:
        plain = (await c.post("/v1/chat/completions", json={**chat, "cache_salt": "tenant-a-0123456789abcdef"})).json()
        text = plain["choices"][0]["message"]["content"]
        assert plain["usage"]["completion_tokens_details"] == {
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        }
        again = (await c.post("/v1/chat/completions", json={**chat, "cache_salt": "tenant-a-0123456789abcdef"})).json()
        assert again["choices"][0]["message"]["content"] == text
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # tenant a's prompt, cached
        assert again["speculative"]["draft_sources"].get("index", 0) > 0  # and its answer, drafted from
        other = (await c.post("/v1/chat/completions", json={**chat, "cache_salt": "tenant-b-0123456789abcdef"})).json()
        assert other["choices"][0]["message"]["content"] == text
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing of tenant a's
        assert other["speculative"]["draft_sources"].get("index", 0) == 0
        # A fresh tenant, so that only the prediction has the answer: drafted from it, the same text.
        predicted = {"type": "content", "content": [{"type": "text", "text": text.replace("Monday", "Sunday")}]}
        r = await c.post(
            "/v1/chat/completions", json={**chat, "cache_salt": "tenant-p-0123456789abcdef", "prediction": predicted}
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["message"]["content"] == text
        assert got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0

        native = await c.post(
            "/generate",
            json={
                "inputs": "Count: one, two, three,",
                "parameters": {
                    "max_new_tokens": 12,
                    "details": True,
                    "prediction": " four, five, six, seven, eight",
                    "cache_salt": "tenant-n-0123456789abcdef",
                },
            },
        )
        assert native.status_code == 200, native.text
        spec = native.json()["details"]["speculative"]
        assert spec["accepted_prediction_tokens"] + spec["rejected_prediction_tokens"] > 0
        assert spec["draft_sources"].get("prediction", 0) > 0

        for bad, field in (({"type": "text", "content": "x"}, "prediction"), ("x", "prediction")):
            r = await c.post("/v1/chat/completions", json={**chat, field: bad})
            assert r.status_code == 400 and field in r.text, r.text
        r = await c.post("/v1/chat/completions", json={**chat, "cache_salt": ""})
        assert r.status_code == 400 and "cache_salt" in r.text

        info = (await c.get("/info")).json()
        assert info["suffix_index_answers"] >= 4 and 0 < info["suffix_index_used_bytes"] <= info["suffix_index_bytes"]
        metrics = (await c.get("/metrics")).text
        assert "specserve_suffix_index_bytes{" in metrics and "specserve_suffix_index_hits_total{" in metrics
