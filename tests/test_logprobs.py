"""Log-probabilities (app/engine/decoding/logprobs.py and their way through the engine): the target's raw distribution,
the same whatever the draft, the batch, the prefill's chunks or the sampler, and only for the tokens kept."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from app.engine.decoding.logprobs import TokenLogprob
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.step import GenerationError, GenerationParams, StepOutput
from tests.conftest import FIXED_DRAFT, KERNELS

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
    decoding (the target as its own draft: every step verifies k + 1 rows), and (greedy) the same request
    batched beside another with its prompt prefilled in chunks give bit-identical tokens and
    log-probabilities, prompt's included; greedy and seeded sampling."""
    packed = packed_target(KERNELS[0])
    drafters = {"self": ModelDrafter("self", packed, packed), "ngram": NgramDrafter()}
    engine = Engine(
        packed.model,
        packed.tokenizer,
        drafters,
        "self",
        3,
        prefill_chunk=16,
        draft_schedule="fixed",
        draft_p_min=0.0,
        prefill_step_seconds=0.0,
    )
    other = packed.tokenizer.encode(PROMPT)
    for sampling in ({}, {"temperature": 0.8, "seed": 3}):
        params = GenerationParams(max_new_tokens=7, logprobs=3, prompt_logprobs=2, **sampling)
        alone = _logprobs(_run(engine, chat_prompt, params, "none"))
        spec = _run(engine, chat_prompt, params, "self")
        assert sum(s.accepted for s in spec) >= 3  # verifications of several rows happened
        assert _logprobs(spec) == alone
        _, logprobs, prompt = alone
        assert len(prompt) == len(chat_prompt) and prompt[0] is None
        assert [lp.token_id for lp in prompt[1:]] == chat_prompt[1:]
        for lp in [*logprobs, *prompt[1:]]:
            assert lp is not None and lp.logprob <= 0 and lp.rank >= 1
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            assert lp.top[0][1] >= lp.logprob and (lp.rank == 1) == (lp.top[0][0] == lp.token_id)
        assert len(logprobs[0].top) == 3 and len(prompt[1].top) == 2
        if sampling:
            continue
        assert all(lp.rank == 1 for lp in logprobs)  # greedy: every token is its row's most likely
        gens = [engine.start(chat_prompt, params, "self"), engine.start(other, params, "ngram")]
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


def test_logprobs_are_log_softmax_of_the_targets_logits(target_f32) -> None:
    """float32: the prompt's and the generated tokens' log-probabilities are log_softmax of one plain forward
    over the whole text; max_new_tokens 0 runs the prompt alone (lm-eval's loglikelihood)."""
    model, tok = target_f32.model, target_f32.tokenizer
    engine = Engine(
        model,
        tok,
        {"ngram": NgramDrafter()},
        "ngram",
        4,
        **FIXED_DRAFT,
    )
    prompt = tok.encode(PROMPT)
    tokens, logprobs, prompt_lps = _logprobs(
        _run(
            engine,
            prompt,
            GenerationParams(max_new_tokens=6, logprobs=0, prompt_logprobs=0, num_draft_tokens=4),
            "ngram",
        )
    )
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens])
        expected = torch.log_softmax(model.logits(model.hidden(ids)[0]).float(), dim=-1)
    want = expected[:-1].gather(1, ids[0, 1:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in [*prompt_lps[1:], *logprobs]])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert all(lp.top == () for lp in logprobs)
    only = _run(engine, prompt, GenerationParams(max_new_tokens=0, prompt_logprobs=1, num_draft_tokens=4), "ngram")
    assert len(only) == 1 and only[0].token_ids == [] and only[0].finish_reason == "length"
    assert only[0].prompt_logprobs is not None
    assert [lp.logprob for lp in only[0].prompt_logprobs[1:] if lp] == [lp.logprob for lp in prompt_lps[1:] if lp]
    # A stop string that ends inside an accepted run: only the tokens kept have log-probabilities.
    steps = _run(
        engine, prompt, GenerationParams(max_new_tokens=8, stop=(".",), logprobs=1, num_draft_tokens=4), "ngram"
    )
    assert _logprobs(steps)[0] == tokens[:2] and steps[-1].finish_reason == "stop"
    plain = _run(engine, prompt, GenerationParams(max_new_tokens=2, num_draft_tokens=4), "ngram")
    assert all(s.logprobs is None and s.prompt_logprobs is None for s in plain)  # not asked, not computed


def test_logprob_counts_the_engine_refuses(target_f32) -> None:
    engine = Engine(
        target_f32.model,
        target_f32.tokenizer,
        {},
        "none",
        num_draft_tokens=4,
        **FIXED_DRAFT,
    )
    for bad in ({"logprobs": 21}, {"prompt_logprobs": -1}, {"max_new_tokens": -1}):
        with pytest.raises(GenerationError, match=next(iter(bad))):
            Generation(engine.target, engine.tokenizer, [1, 2], GenerationParams(**bad), None)


# --- the APIs, in process with the real target (float32, n-gram draft) through the real clients -------------

HI = [{"role": "user", "content": "Hi!"}]  # greedy: "Hello! How can I assist you today?" then <|im_end|>


def _direct_logprobs(engine: Engine, ids: Sequence[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 from one plain forward of the target."""
    model = engine.target
    with torch.inference_mode():
        logits = model.logits(model.hidden(torch.tensor([list(ids)]))[0]).float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.anyio
async def test_openai_completions_logprobs(api_client, api_engine, sse_data) -> None:
    import json

    import openai

    ids = api_engine.tokenizer.encode(PROMPT)
    async with api_client() as client:
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        plain = await sdk.completions.create(
            model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
        )
        # lm-eval's loglikelihood: the prompt's log-probabilities, nothing generated (older lm-eval), or one token
        loglik = await sdk.completions.create(
            model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
        )
        one = await sdk.completions.create(
            model="smollm2-135m-instruct", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
        )
        stopped = await sdk.completions.create(
            model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=6, temperature=0, stop=".", logprobs=0
        )
        body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 3, "echo": True, "stream": True}
        streamed = await client.post("/v1/completions", json=body)
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2, "echo": True, "logprobs": 1}
        vllm = await client.post("/v1/completions", json=body)
        refused = [
            await client.post("/v1/completions", json={"prompt": PROMPT, **fields})
            for fields in (
                {"max_tokens": 0, "temperature": 0},
                {"logprobs": 21},
                {"prompt_logprobs": 1, "stream": True},
            )
        ]
    choice = plain.choices[0]
    lp = choice.logprobs
    assert plain.usage.completion_tokens == 5 == len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(" Paris.")
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # greedy: the chosen token is the most likely one, among its three alternatives
        assert len(top) == 3 and top[token] == value == max(top.values()) and value < 0
    # echo, max_tokens 0: the prompt alone; its first token has no log-probability
    got = loglik.choices[0]
    assert got.text == PROMPT and loglik.usage.completion_tokens == 0 and got.finish_reason == "length"
    assert got.logprobs.token_logprobs[0] is None and got.logprobs.top_logprobs[0] is None
    assert len(got.logprobs.tokens) == len(ids) and "".join(got.logprobs.tokens) == PROMPT
    direct = _direct_logprobs(api_engine, ids)
    assert sum(got.logprobs.token_logprobs[1:]) == pytest.approx(float(direct.sum()), abs=1e-3)
    assert one.choices[0].text == PROMPT + choice.text[: len(one.choices[0].text) - len(PROMPT)]
    assert one.choices[0].logprobs.token_logprobs[: len(ids)] == got.logprobs.token_logprobs
    assert one.choices[0].logprobs.token_logprobs[-1] == lp.token_logprobs[0]
    # a stop string: only the tokens returned ("Paris" and the "." that stopped it, as usage counts them)
    assert stopped.choices[0].text == " Paris" and len(stopped.choices[0].logprobs.tokens) == 2
    assert stopped.usage.completion_tokens == 2 and stopped.choices[0].logprobs.token_logprobs == lp.token_logprobs[:2]
    # streamed with echo: the prompt's chunk first, then each step's tokens; together what one answer gives
    chunks = [json.loads(d) for d in sse_data(streamed.text)[:-1]]
    parts = [c["choices"][0]["logprobs"] for c in chunks]
    assert (
        chunks[0]["choices"][0]["text"] == PROMPT and parts[0]["token_logprobs"][1:] == got.logprobs.token_logprobs[1:]
    )
    assert [v for p in parts[1:] for v in p["token_logprobs"]] == lp.token_logprobs
    assert [o for p in parts[1:] for o in p["text_offset"]] == [len(PROMPT) + o for o in lp.text_offset]
    # vLLM's prompt_logprobs: by token id, the prompt's token with its rank and the two most likely
    entries = vllm.json()["choices"][0]["prompt_logprobs"]
    assert vllm.status_code == 200 and entries[0] is None and len(entries) == len(ids)
    for token, value, entry in zip(ids[1:], got.logprobs.token_logprobs[1:], entries[1:], strict=True):
        assert entry[str(token)]["logprob"] == value and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    # ... and echo's top_logprobs still hold logprobs' one alternative (and the chosen token)
    echoed_top = vllm.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert echoed_top[1:-1] == got.logprobs.top_logprobs[1:]
    for r, field in zip(refused, ("max_tokens", "logprobs", "prompt_logprobs"), strict=True):
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


@pytest.mark.anyio
async def test_chat_and_tgi_logprobs(api_client, api_engine, sse_data) -> None:
    import json

    import openai

    async with api_client() as client:
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        chat = await sdk.chat.completions.create(
            model="smollm2-135m-instruct", messages=HI, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
        )
        stream = await sdk.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=HI,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        chunks = [c async for c in stream]
        no_top = await client.post("/v1/chat/completions", json={"messages": HI, "top_logprobs": 2})
        tgi_body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True, "top_n_tokens": 2}}
        tgi = (await client.post("/generate", json=tgi_body)).json()["details"]
        tgi_body["parameters"]["decoder_input_details"] = True
        prefill = (await client.post("/generate", json=tgi_body)).json()["details"]["prefill"]
        tgi_stream = await client.post("/generate_stream", json=tgi_body)  # decoder_input_details: not streamed
        del tgi_body["parameters"]["decoder_input_details"]
        events = [json.loads(d) for d in sse_data((await client.post("/generate_stream", json=tgi_body)).text)]
        too_many = await client.post("/generate", json={"inputs": PROMPT, "parameters": {"top_n_tokens": 21}})
        echo = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 0}
        )
    content = chat.choices[0].logprobs.content
    # every generated token, the end-of-turn token included (as usage counts it), its text as the top list names it
    assert len(content) == chat.usage.completion_tokens == 10 and content[-1].token == "<|im_end|>"
    assert "".join(c.token for c in content[:-1]) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == c.logprob and c.bytes == list(c.token.encode())
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    assert no_top.status_code == 400 and "top_logprobs" in no_top.json()["error"]["message"]
    # TGI: every token's logprob, top_tokens, the prompt's with decoder_input_details; what the OpenAI routes give
    assert all(t["logprob"] is not None and t["logprob"] < 0 for t in tgi["tokens"])
    assert [len(top) for top in tgi["top_tokens"]] == [2] * 5
    assert all(
        top[0]["id"] == t["id"] and top[0]["logprob"] == t["logprob"]
        for t, top in zip(tgi["tokens"], tgi["top_tokens"], strict=True)
    )
    want = echo.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert [t["logprob"] for t in prefill] == want and prefill[0]["logprob"] is None
    assert tgi_stream.status_code == 422 and "decoder_input_details" in tgi_stream.json()["error"]
    assert [e["token"]["logprob"] for e in events] == [t["logprob"] for t in tgi["tokens"]]
    assert [e["top_tokens"] for e in events] == tgi["top_tokens"]
    assert too_many.status_code == 422 and "top_n_tokens" in too_many.json()["error"]
