"""Automatic prefix caching (app.engine.prefix_cache): blocks found only after the very same prefix, evicted least
recently used first within their memory, and reused bit for bit: a cached prompt gives the tokens a fresh
prefill gives, greedy and seeded, alone and batched, on the best kernel and generic (KERNEL_ENDS)."""

from __future__ import annotations

import pytest
import torch

from app.engine import kernels
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.prefix_cache import PrefixCache
from app.engine.step import GenerationParams
from tests.conftest import KERNEL_ENDS, use_kernel

B = 16  # the cache's block length


def _filled_cache(model, ids: list[int]):
    cache = model.new_cache(len(ids) + 8)
    with torch.inference_mode():
        model.hidden(torch.tensor([ids]), 0, cache)
    return cache


def _block_bytes(model) -> int:
    c = model.config
    return 2 * c.n_layers * c.n_kv_heads * B * c.head_dim * 4  # float32


def test_a_block_is_found_only_after_the_same_prefix(make_tiny_model):
    model = make_tiny_model(0)
    cache = PrefixCache(1 << 30, B)
    a = list(range(1, 50))  # 3 full blocks (48 positions) and one token
    src = _filled_cache(model, a)
    cache.store(a, src, None)
    assert cache.blocks == 3 and cache.bytes == 3 * _block_bytes(model)

    # The same prompt: every block but the one holding its last token, whose logits must still be computed.
    dst = model.new_cache(60)
    assert cache.load(a, 48, dst, None) == 32 and dst.length == 32
    assert torch.equal(dst.k[..., :32, :], src.k[..., :32, :]) and torch.equal(dst.v[..., :32, :], src.v[..., :32, :])
    dst = model.new_cache(60)
    assert cache.load(a, 49, dst, None) == 48
    # A prompt that differs in its first block shares nothing, though its second block's tokens are a's.
    b = [63, *a[1:]]
    assert cache.load(b, len(b), model.new_cache(60), None) == 0
    # Diverging inside the second block: the first block only.
    c = a[:20] + [0] * 30
    assert cache.load(c, len(c), model.new_cache(60), None) == 16
    # Blocks without the target's hidden states do not serve a request that needs them.
    assert cache.load(a, 49, model.new_cache(60), torch.zeros(60, model.config.dim)) == 0


def test_the_least_recently_used_leaves_go_first(make_tiny_model):
    model = make_tiny_model(0)
    size = _block_bytes(model)
    cache = PrefixCache(4 * size, B)
    a = [1] * 32 + [2] * 16  # blocks a0 a1 a2
    b = [1] * 32 + [3] * 16  # shares a0 a1, then b2
    cache.store(a, _filled_cache(model, a), None)
    cache.store(b, _filled_cache(model, b), None)
    assert cache.blocks == 4 and cache.bytes == 4 * size
    # a is used again: b's leaf is now the least recent, and goes for a new block.
    assert cache.load(a, 49, model.new_cache(60), None) == 48
    c = [4] * 16
    cache.store(c, _filled_cache(model, c), None)
    assert cache.blocks == 4
    assert cache.load(b, 49, model.new_cache(60), None) == 32  # its shared blocks remain, its leaf is gone
    assert cache.load(a, 49, model.new_cache(60), None) == 48
    # Bound to the memory that requests leave it: leaves before their parents, whatever is asked.
    cache.bound(2 * size)
    assert cache.blocks == 2 and cache.bytes == 2 * size and cache.limit == 2 * size
    kept = cache.load(a, 49, model.new_cache(60), None) + cache.load(c, 17, model.new_cache(60), None)
    assert kept in (16, 32)
    cache.bound(0)
    assert cache.blocks == 0 and cache.bytes == 0


def test_a_chain_longer_than_the_cache_keeps_its_head(make_tiny_model):
    model = make_tiny_model(0)
    cache = PrefixCache(2 * _block_bytes(model), B)
    a = list(range(1, 60))
    cache.store(a, _filled_cache(model, a), None)
    assert cache.blocks == 2 and cache.load(a, len(a), model.new_cache(70), None) == 32


def test_a_tenant_filling_the_cache_evicts_its_own_blocks_never_another_s(make_tiny_model):
    model = make_tiny_model(0)
    size = _block_bytes(model)
    cache = PrefixCache(4 * size, B)  # each tenant is owed 2 blocks (the default share, half)
    b = list(range(1, 18))  # one block and a token
    cache.store(b, _filled_cache(model, b), None, tenant="b")
    firsts = []
    for i in range(12):  # "a" writes 24 blocks, six times the whole cache
        a = [20 + i] * 16 + [40 + i] * 16 + [7]
        cache.store(a, _filled_cache(model, a), None, tenant="a")
        firsts.append(a)
    assert cache.bytes <= cache.limit and cache.blocks == 4
    # b's block still serves b; a lost its own least recently used blocks instead.
    assert cache.load(b, len(b), model.new_cache(40), None, tenant="b") == 16
    assert cache.load(firsts[0], 33, model.new_cache(40), None, tenant="a") == 0
    assert cache.load(firsts[-1], 33, model.new_cache(40), None, tenant="a") == 32


def test_a_full_cache_evicts_from_the_tenant_holding_the_most(make_tiny_model):
    model = make_tiny_model(0)
    size = _block_bytes(model)
    cache = PrefixCache(4 * size, B)

    def store(tenant: str, token: int, blocks: int) -> list[int]:
        ids = [token] * (16 * blocks) + [1]
        cache.store(ids, _filled_cache(model, ids), None, tenant=tenant)
        return ids

    c = store("c", 3, 1)  # the least recently used block of all
    a = store("a", 4, 2)
    store("b", 5, 1)
    d = store("d", 6, 1)  # within its share: the cache makes room from "a", which holds the most
    assert cache.blocks == 4
    assert cache.load(c, len(c), model.new_cache(40), None, tenant="c") == 16
    assert cache.load(a, len(a), model.new_cache(40), None, tenant="a") == 16  # its leaf went
    assert cache.load(d, len(d), model.new_cache(40), None, tenant="d") == 16


def _run_batched(engine: Engine, jobs, stagger: bool = True) -> list[Generation]:
    """Run (prompt, params, draft) jobs in batched steps, each joining one step after the one before it."""
    gens: list[Generation] = []
    while len(gens) < len(jobs) or any(not g.finished for g in gens):
        if len(gens) < len(jobs):
            for prompt, params, draft in jobs[len(gens) : len(gens) + 1 if stagger else len(jobs)]:
                gens.append(engine.start(prompt, params, draft))
        outs = engine.step_batch([g for g in gens if not g.finished])
        assert not [o for o in outs if isinstance(o, Exception)]
    return gens


def _fresh(engine: Engine, prompt, params, draft) -> list[int]:
    """`prompt`'s tokens from a full prefill, run alone with the prefix cache out of the way."""
    cache, engine.prefix_cache = engine.prefix_cache, None
    try:
        gen = engine.start(prompt, params, draft)
        while not gen.finished:
            gen.step()
        return gen.generated_ids
    finally:
        engine.prefix_cache = cache


@pytest.mark.parametrize("kernel", KERNEL_ENDS)
def test_a_cached_prefix_gives_a_fresh_prefill_s_tokens(target_f32, first_turns, kernel):
    """The server's default engine (bfloat16, the hybrid of prompt lookup and the feature draft, which reads
    cached hidden states too) on the best kernel and generic: a second chat turn (the first turn, its answer, a
    new question) and requests sharing a system prompt, greedy and seeded, alone and batched, reuse the cached
    blocks and get the tokens of a fresh prefill."""
    from app.engine.factory import build_engine

    with use_kernel(kernel):
        engine, _ = build_engine(num_draft_tokens=6, dtype="bfloat16", device="cpu", prefill_chunk=64)
    assert engine.kernel == kernel and engine.prefix_cache is not None
    tok = engine.tokenizer
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    greedy = GenerationParams(max_new_tokens=20, num_draft_tokens=4)
    seeded = GenerationParams(max_new_tokens=20, num_draft_tokens=4, temperature=0.8, top_p=0.95, seed=7)

    def chat(*turns: str, answer: str | None = None) -> list[int]:
        messages = [system]
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i == 0 and answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return tok.encode(tok.apply_chat_template(messages))

    def common(x: list[int], y: list[int]) -> int:
        return next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))

    # One user's first turn; then its second turn (the first, its answer, a new question) beside two other users'
    # first turns (the system prompt in common), batched.
    first = [chat(t) for t in first_turns[:3]]
    (turn1,) = _run_batched(engine, [(first[0], greedy, "default")])
    assert turn1.stats.cached_tokens == 0
    follow = tok.encode("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    second = first[0] + turn1.generated_ids + follow
    jobs = [(second, greedy, "default"), (first[1], seeded, "default"), (first[2], greedy, "none")]
    gens = _run_batched(engine, jobs)
    # The whole first turn but the answer's last token (never fed to the target), in full blocks; the system
    # prompt for the others.
    assert gens[0].stats.cached_tokens == (turn1.prompt_len + len(turn1.generated_ids) - 1) // B * B
    for gen, prompt in zip(gens[1:], first[1:], strict=True):
        assert gen.stats.cached_tokens == common(first[0], prompt) // B * B > 0
    expected = [_fresh(engine, p, params, d) for p, params, d in jobs]
    assert [g.generated_ids for g in gens] == expected
    assert turn1.generated_ids == _fresh(engine, first[0], greedy, "default")
    # Alone, from the cache: the same again.
    gen = engine.start(second, greedy, "default")
    assert 0 < gen.stats.cached_tokens < gen.prompt_len  # the prompt's last token always runs
    while not gen.finished:
        engine.step_batch([gen])
    assert gen.generated_ids == expected[0]


def test_no_prefix_cache_where_rows_depend_on_the_batch(make_tiny_model, word_tokenizer):
    """On torch's path a block's bits could depend on the forward that computed it: no cache there."""
    model = make_tiny_model(0)
    engine = Engine(model, word_tokenizer(model.config.vocab_size), {})
    assert not engine.batching and engine.prefix_cache is None


def test_prompt_log_probabilities_prefill_the_whole_prompt(packed_target, prompts_bf16):
    packed = packed_target(kernels.available()[0])
    engine = Engine(packed.model, packed.tokenizer, {})
    assert engine.prefix_cache is not None
    prompt = prompts_bf16
    first = _run_batched(engine, [(prompt, GenerationParams(max_new_tokens=2), "none")])[0]
    again = _run_batched(engine, [(prompt, GenerationParams(max_new_tokens=2), "none")])[0]
    asked = _run_batched(engine, [(prompt, GenerationParams(max_new_tokens=2, prompt_logprobs=1), "none")])[0]
    assert first.stats.cached_tokens == 0 and again.stats.cached_tokens > 0 and asked.stats.cached_tokens == 0
    assert first.generated_ids == again.generated_ids == asked.generated_ids


@pytest.fixture
def prompts_bf16(packed_target, first_turns) -> list[int]:
    tok = packed_target(kernels.available()[0]).tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": first_turns[0] * 3}]))


@pytest.mark.anyio
async def test_a_chat_s_next_turn_is_served_from_the_cache(packed_target, api_client, first_turns):
    """Through the OpenAI chat route: the second turn (the first, its answer, a new question) reports the cached
    prompt tokens in its usage, /metrics counts them as vLLM does (tokens queried, tokens hit), and /info shows
    the cache's size; its answer is the one a cold server gives."""
    packed = packed_target(kernels.available()[0])
    engine = Engine(packed.model, packed.tokenizer, {})
    cold = Engine(packed.model, packed.tokenizer, {}, prefix_cache_mb=0)
    assert engine.prefix_cache is not None and cold.prefix_cache is None
    system = {"role": "system", "content": "You answer in one short sentence."}
    turn1 = [system, {"role": "user", "content": first_turns[0]}]
    body = {"model": "smollm2-135m-instruct", "max_tokens": 12, "temperature": 0}

    async def chat(client, messages):
        response = await client.post("/v1/chat/completions", json={**body, "messages": messages})
        assert response.status_code == 200, response.text
        return response.json()

    async with api_client(engine=engine) as client:
        info = (await client.get("/info")).json()
        assert info["prefix_cache_bytes"] == 1024 * 2**20 and info["prefix_cache_used_bytes"] == 0
        first = await chat(client, turn1)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        answer = first["choices"][0]["message"]["content"]
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Say it again."}]
        second = await chat(client, turn2)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # Every full block of the first turn's prompt at least (the answer's tokens as re-encoded may differ).
        assert first["usage"]["prompt_tokens"] // B * B <= cached < second["usage"]["prompt_tokens"]
        assert (await client.get("/info")).json()["prefix_cache_used_bytes"] > 0
        metrics = (await client.get("/metrics")).text
    queries = first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    assert f'specserve_prefix_cache_queries_total{{model_name="smollm2-135m-instruct"}} {float(queries)}' in metrics
    assert f'specserve_prefix_cache_hits_total{{model_name="smollm2-135m-instruct"}} {float(cached)}' in metrics
    async with api_client(engine=cold) as client:
        assert (await chat(client, turn2))["choices"] == second["choices"]
