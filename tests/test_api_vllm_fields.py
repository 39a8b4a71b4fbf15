"""vLLM's extra request fields on the OpenAI routes, in process with the real target: the ones honoured
(ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens,
truncate_prompt_tokens) change the answer as in vLLM; the ones that would change it and are not supported
are a 400 naming the field; fields that change nothing are accepted, and unknown ones are logged."""

from __future__ import annotations

import json
import logging

import openai
import pytest

pytestmark = pytest.mark.anyio

PROMPT = "The capital of France is"  # greedy: " Paris." "\n" "\n" "The" ...
HI = [{"role": "user", "content": "Hi!"}]  # greedy: "Hello! How can I assist you today?" then <|im_end|> (10)


async def _chat(client, **fields) -> dict:
    r = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 14, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


async def _complete(client, **fields) -> dict:
    r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


async def test_end_of_sequence_fields(api_client) -> None:
    async with api_client() as client:
        plain = await _chat(client)
        ignored = await _chat(client, ignore_eos=True)
        shown = await _chat(client, ignore_eos=True, skip_special_tokens=False)
        at_least = await _chat(client, min_tokens=12)
        stopped = await _chat(client, stop="How")
        stop_late = await _chat(client, stop="How", min_tokens=5)
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        via_sdk = await sdk.chat.completions.create(
            model="smollm2-135m-instruct", messages=HI, max_tokens=14, temperature=0, extra_body={"ignore_eos": True}
        )
    answer = _text(plain)
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] == 10
    # ignore_eos: on to max_tokens, past the end-of-sequence token (whose text is skipped unless asked for)
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 14
    assert _text(ignored).startswith(answer) and len(_text(ignored)) > len(answer)
    assert _text(shown).startswith(answer + "<|im_end|>")
    assert via_sdk.choices[0].message.content == _text(ignored)
    # min_tokens: the end-of-sequence token at the 10th token ends nothing; the text goes on as with ignore_eos
    assert at_least["usage"]["completion_tokens"] > 12
    assert _text(ignored).startswith(_text(at_least)) and len(_text(at_least)) > len(answer)
    # ... and neither does a stop string within the first min_tokens tokens
    assert _text(stopped) == "Hello! " and stopped["choices"][0]["finish_reason"] == "stop"
    assert _text(stop_late) == answer


async def test_stop_tokens_and_stop_strings_in_the_output(api_client) -> None:
    async with api_client() as client:
        plain = await _complete(client)
        newline = 198
        at_token = await _complete(client, stop_token_ids=[newline])
        with_token = await _complete(client, stop_token_ids=[newline], include_stop_str_in_output=True)
        at_string = await _complete(client, stop=".")
        with_string = await _complete(client, stop=".", include_stop_str_in_output=True)
        late_token = await _complete(client, stop_token_ids=[newline], min_tokens=3)
    assert _text(plain).startswith(" Paris.\n\n")
    assert _text(at_token) == " Paris." and at_token["choices"][0]["finish_reason"] == "stop"
    assert at_token["usage"]["completion_tokens"] == 3  # the stop token is generated, its text not returned
    assert _text(with_token) == " Paris.\n"
    assert _text(at_string) == " Paris" and _text(with_string) == " Paris."
    # min_tokens 3: the first newline (3rd token) ends nothing, the second (4th) does
    assert _text(late_token) == " Paris.\n" and late_token["usage"]["completion_tokens"] == 4


def _engine_tokens(engine, prompt_ids: list[int], max_new: int, penalties) -> list[int]:
    from app.engine.step import GenerationParams

    gen = engine.start(prompt_ids, GenerationParams(max_new_tokens=max_new, num_draft_tokens=4, penalties=penalties))
    while not gen.finished:
        gen.step()
    return gen.generated_ids


async def test_penalties_are_honoured_in_every_api(api_client, api_engine) -> None:
    """OpenAI's presence/frequency and vLLM's repetition penalty (through the openai client), TGI's repetition and
    frequency penalty: each answer is the engine's penalised decoding (with
    the n-gram draft, which the penalties must not let change the tokens), and differs from the plain one."""
    from app.engine.decoding.penalties import PenaltyParams

    prompt = "Repeat after me: one two three one two three one two three"
    ids = api_engine.tokenizer.encode(prompt)
    async with api_client() as client:
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        plain = await sdk.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=10, temperature=0)
        penalised = await sdk.completions.create(
            model="smollm2-135m-instruct",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            presence_penalty=0.5,
            frequency_penalty=1.0,
            extra_body={"repetition_penalty": 1.3, "return_tokens_as_token_ids": True, "logprobs": 0},
        )
        bad = [
            await client.post("/v1/completions", json={"prompt": prompt, "presence_penalty": 2.5}),
            await client.post("/generate", json={"inputs": prompt, "parameters": {"repetition_penalty": 0}}),
        ]
        native = await client.post(
            "/generate",
            json={
                "inputs": prompt,
                "parameters": {
                    "max_new_tokens": 10,
                    "repetition_penalty": 1.3,
                    "frequency_penalty": 0.5,
                    "details": True,
                },
            },
        )
    expected = _engine_tokens(api_engine, ids, 10, PenaltyParams(repetition=1.3, presence=0.5, frequency=1.0))
    got = [int(t.removeprefix("token_id:")) for t in penalised.choices[0].logprobs.tokens]
    assert got == expected
    assert penalised.choices[0].text != plain.choices[0].text
    assert native.status_code == 200, native.text
    tgi_expected = _engine_tokens(api_engine, ids, 10, PenaltyParams(repetition=1.3, frequency=0.5, count_prompt=True))
    assert [t["id"] for t in native.json()["details"]["tokens"]] == tgi_expected
    assert bad[0].status_code == 400 and "presence_penalty" in bad[0].json()["error"]["message"]
    assert bad[1].status_code == 422 and "repetition_penalty" in bad[1].json()["error"]


async def test_truncate_prompt_tokens_keeps_the_end(api_client, api_engine) -> None:
    ids = api_engine.tokenizer.encode(PROMPT)
    longer = api_engine.tokenizer.encode("Tell me something else entirely.") + ids
    async with api_client() as client:
        plain = await _complete(client, prompt=ids)
        truncated = await _complete(client, prompt=longer, truncate_prompt_tokens=len(ids))
    assert _text(truncated) == _text(plain)
    assert truncated["usage"]["prompt_tokens"] == len(ids)


REFUSED = {
    "/v1/completions": [
        ("guided_grammar", "root ::= 'a'"),
        ("guided_whitespace_pattern", " *"),
        ("structural_tag", "{}"),
        ("logits_processors", ["my.processor"]),
        ("min_p", 0.1),
        ("use_beam_search", True),
        ("bad_words", ["Paris"]),
        ("allowed_token_ids", [1, 2]),
        ("return_token_ids", True),
        ("add_special_tokens", False),
        ("vllm_xargs", {"a": 1}),
    ],
    "/v1/chat/completions": [
        ("guided_grammar", "root ::= 'a'"),
        ("echo", True),
        ("chat_template", "{{ messages }}"),
        ("chat_template_kwargs", {"enable_thinking": True}),
        ("continue_final_message", True),
        ("add_generation_prompt", False),
        ("reasoning_effort", "high"),
        ("functions", [{"name": "f"}]),
        ("modalities", ["text", "audio"]),
    ],
}


async def test_fields_that_would_change_the_output_are_refused(api_client) -> None:
    bodies = {
        "/v1/completions": {"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
        "/v1/chat/completions": {"messages": HI},
    }
    async with api_client() as client:
        for path, cases in REFUSED.items():
            for field, value in cases:
                r = await client.post(path, json={**bodies[path], field: value})
                assert r.status_code == 400, (path, field, r.text)
                assert r.json()["error"]["message"].startswith(f"{field}: not supported"), (field, r.text)
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="guided_grammar"):
            await sdk.completions.create(
                model="smollm2-135m-instruct",
                prompt=PROMPT,
                max_tokens=2,
                temperature=0,
                extra_body={"guided_grammar": "a"},
            )
        for body, message in [
            ({"min_tokens": 5}, "min_tokens (5) exceeds max_tokens (2)"),
            ({"stop_token_ids": [10**6]}, "stop_token_ids must lie in"),
            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ]:
            r = await client.post("/v1/completions", json={**bodies["/v1/completions"], **body})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


async def test_neutral_and_unknown_fields_are_accepted(api_client, caplog: pytest.LogCaptureFixture) -> None:
    neutral = {
        "guided_json": None,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "priority": 0,
        "request_id": "r-1",
        "metadata": {"team": "a"},
        "store": False,
        "return_tokens_as_token_ids": True,
    }
    async with api_client() as client:
        plain = await _complete(client)
        with caplog.at_level(logging.WARNING, logger="app.api.openai"):
            accepted = await _complete(client, **neutral)
            assert not [r for r in caplog.records if r.name == "app.api.openai"]
            unknown = await _complete(client, frobnicate=3, also_this="x")
    assert _text(accepted) == _text(unknown) == _text(plain)
    assert "the request's fields also_this, frobnicate are unknown and were ignored" in caplog.text


async def test_unknown_fields_inside_objects_are_refused_and_top_level_ones_logged(
    api_client, sse_data, caplog: pytest.LogCaptureFixture
) -> None:
    """A field no object of the request knows is a 400 naming its path at any depth (messages, tools, stream
    options, TGI's parameters: 422); top-level ones are ignored and logged on both APIs (nothing goes unsaid);
    vLLM's stream_options.continuous_usage_stats is honoured: every chunk carries the usage so far."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    nested = {
        "messages.0.x": {"messages": [{"role": "user", "content": "Hi", "x": 1}]},
        "tools.0.function.x": {"tools": [{**tool, "function": {**tool["function"], "x": 1}}]},
        "stream_options.y": {"stream": True, "stream_options": {"include_usage": True, "y": 1}},
        "response_format.json_schema.z": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "z": 1}}
        },
    }
    async with api_client() as client:
        refused = {
            path: await client.post("/v1/chat/completions", json={**chat, **body}) for path, body in nested.items()
        }
        native = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, "x": 1}})
        with caplog.at_level(logging.WARNING, logger="app.api.native"):
            logged = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}, "q": 1})
        options = {"include_usage": True, "continuous_usage_stats": True}
        r = await client.post("/v1/chat/completions", json={**chat, "stream": True, "stream_options": options})
    for path, answer in refused.items():
        assert answer.status_code == 400, (path, answer.text)
        assert f"{path}: unknown field" in answer.json()["error"]["message"], (path, answer.text)
    assert native.status_code == 422 and "parameters.x: unknown field" in native.json()["error"]
    assert logged.status_code == 200 and "the request's fields q are unknown and were ignored" in caplog.text
    chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks)
    assert used == sorted(used) and used[-1] == 3 and chunks[-1]["choices"] == []


async def test_an_unknown_field_name_cannot_forge_a_log_line(api_client, caplog: pytest.LogCaptureFixture) -> None:
    """A field name is the client's text: one with a line break and a log line's prefix, ignored at the top level
    or refused inside an object, is named quoted (its line break as \\n) and cut, in the log and in the answer."""
    forged = "q\n2025-01-01 00:00:00,000 INFO app.api.native: key admin logged in"
    long = "z" * 5000
    async with api_client() as client:
        with caplog.at_level(logging.INFO):
            native = await client.post(
                "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}, forged: 1}
            )
            chat = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, forged: 1, long: 1})
            nested = await client.post(
                "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2, forged: 1}}
            )
            nested_long = await client.post("/v1/chat/completions", json={"messages": [{**HI[0], long: 1}]})
    assert native.status_code == 200 and chat.status_code == 200
    ignored = [r.getMessage() for r in caplog.records if "unknown and were ignored" in r.getMessage()]
    assert len(ignored) == 2
    for message in ignored:
        assert "\n" not in message and repr(forged)[:20] in message, message
    assert "'zzzz" in ignored[1] and "(5002 characters)" in ignored[1] and len(ignored[1]) < 300
    assert not [r for r in caplog.records if "\n" in r.getMessage()]
    assert nested.status_code == 422
    error = nested.json()["error"]
    assert "\n" not in error and f"parameters.{repr(forged)[:20]}" in error and "unknown field" in error, error
    assert nested_long.status_code == 400
    error = nested_long.json()["error"]["message"]
    assert "messages.0.'zzzz" in error and "unknown field" in error and len(error) < 300, error
