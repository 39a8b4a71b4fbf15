"""Structured output through the HTTP APIs, in process with the real target (n-gram draft): OpenAI's
response_format (json_object, json_schema, and the openai client's chat.completions.parse), vLLM's guided_json,
guided_regex and guided_choice, TGI's grammar; a grammar that cannot be compiled is a 4xx naming its field."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.test_grammar import PERSON, _valid

pytestmark = pytest.mark.anyio

ASK = [
    {"role": "user", "content": "Describe a famous scientist as JSON with the keys name, age and home (city, country)."}
]


class Home(BaseModel):
    city: str
    country: Literal["France", "Italy"]


class Person(BaseModel):
    name: str
    age: int
    home: Home


async def _post(client, path: str, body: dict) -> dict:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_every_api_constrains_the_output(api_client) -> None:
    """Each answer follows its constraint and ends there (finish reason stop); greedy speculative answers are
    target-only's."""
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = {"messages": ASK, "max_tokens": 48, "temperature": 0}
    async with api_client() as client:
        spec = await _post(client, "/v1/chat/completions", {**chat, "response_format": schema})
        alone = await _post(
            client, "/v1/chat/completions", {**chat, "response_format": schema, "speculative": {"draft": "none"}}
        )
        anything = await _post(client, "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})
        yes_no = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
        choice = await _post(
            client,
            "/v1/chat/completions",
            {"messages": yes_no, "max_tokens": 5, "temperature": 0, "guided_choice": ["yes", "no"]},
        )
        regex = await _post(
            client,
            "/v1/completions",
            {
                "prompt": "The year the Bastille fell:",
                "max_tokens": 8,
                "temperature": 0,
                "guided_regex": r" [0-9]{4}\.",
            },
        )
        guided = await _post(
            client,
            "/v1/completions",
            {"prompt": "A scientist as JSON: ", "max_tokens": 48, "temperature": 0, "guided_json": json.dumps(PERSON)},
        )
        tgi = await _post(
            client,
            "/generate",
            {
                "inputs": "A scientist as JSON: ",
                "parameters": {"max_new_tokens": 48, "grammar": {"type": "json", "value": PERSON}},
            },
        )
        tgi_regex = await _post(
            client,
            "/generate",
            {
                "inputs": "The year the Bastille fell:",
                "parameters": {"max_new_tokens": 8, "grammar": {"type": "regex", "value": r" [0-9]{4}\."}},
            },
        )
        metrics = (await client.get("/metrics")).text
    answer = spec["choices"][0]
    assert answer["finish_reason"] == "stop" and _valid(json.loads(answer["message"]["content"]), PERSON)
    assert alone["choices"][0]["message"]["content"] == answer["message"]["content"]
    # Tokens the grammar forced (a key's rest after its quote) are counted apart from the draft's, in the answer's
    # details and in Prometheus: each verify pass keeps its accepted drafts, its forced tokens and the target's own.
    details = spec["speculative"]
    assert details["forced"] >= 1 and alone["speculative"]["forced"] >= 1
    assert details["target_passes"] + details["accepted"] + details["forced"] == spec["usage"]["completion_tokens"]
    counted = re.search(r"^specserve_spec_decode_num_forced_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert counted is not None and float(counted.group(1)) >= details["forced"] + alone["speculative"]["forced"]
    assert isinstance(json.loads(anything["choices"][0]["message"]["content"]), dict)
    assert choice["choices"][0]["message"]["content"] in ("yes", "no")
    assert re.fullmatch(r" [0-9]{4}\.", regex["choices"][0]["text"]), regex
    assert regex["choices"][0]["finish_reason"] == "stop"
    assert _valid(json.loads(guided["choices"][0]["text"]), PERSON)
    assert json.loads(tgi["generated_text"]) == json.loads(guided["choices"][0]["text"])
    assert tgi_regex["generated_text"] == regex["choices"][0]["text"]


async def test_openai_client_parse_and_refusals(api_client) -> None:
    """openai's chat.completions.parse with a pydantic model; constraints that cannot be compiled, or several at
    once, are a 400 (422 on TGI's route) naming the field."""
    async with api_client() as client:
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        parsed = await sdk.chat.completions.parse(
            model="smollm2-135m-instruct", messages=ASK, max_tokens=48, temperature=0, response_format=Person
        )
        bad = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "guided_json": "{not json",
            "guided_regex": "a(b",
        }
        answers = {
            field: await client.post(
                "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "temperature": 0, field: value}
            )
            for field, value in bad.items()
        }
        both = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "temperature": 0, "guided_regex": "a", "guided_choice": ["a"]},
        )
        empty = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0, "guided_choice": []}
        )
        no_schema = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "temperature": 0, "response_format": {"type": "json_schema"}},
        )
        tgi = await client.post(
            "/generate",
            json={"inputs": "x", "parameters": {"max_new_tokens": 2, "grammar": {"type": "regex", "value": "(("}}},
        )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.home.country in ("France", "Italy")
    for field, r in answers.items():
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"{field}"), r.text
    assert "response_format.json_schema.schema" in answers["response_format"].json()["error"]["message"]
    assert both.status_code == 400 and "guided_regex and guided_choice" in both.json()["error"]["message"]
    assert empty.status_code == 400 and "guided_choice" in empty.json()["error"]["message"], empty.text
    assert no_schema.status_code == 400 and "json_schema" in no_schema.json()["error"]["message"]
    assert tgi.status_code == 422 and tgi.json()["error"].startswith("parameters.grammar.value"), tgi.text


async def test_vllm_structured_outputs(api_client) -> None:
    """vLLM's structured_outputs: json (compact with disable_any_whitespace, closed objects with
    disable_additional_properties), regex, choice and json_object give what the guided_* fields give; what
    cannot be honoured (grammar), none or several kinds, or beside a guided_* field, is a 400 naming the field."""
    open_schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    city = [{"role": "user", "content": "Name a city as JSON."}]
    bastille = {"prompt": "The year the Bastille fell:", "max_tokens": 8, "temperature": 0}
    async with api_client() as client:
        compact = await _post(
            client,
            "/v1/chat/completions",
            {
                "messages": city,
                "max_tokens": 24,
                "temperature": 0,
                "structured_outputs": {
                    "json": open_schema,
                    "disable_any_whitespace": True,
                    "disable_additional_properties": True,
                },
            },
        )
        regex = await _post(client, "/v1/completions", {**bastille, "structured_outputs": {"regex": r" [0-9]{4}\."}})
        guided = await _post(client, "/v1/completions", {**bastille, "guided_regex": r" [0-9]{4}\."})
        yes_no = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
        choice = await _post(
            client,
            "/v1/chat/completions",
            {"messages": yes_no, "max_tokens": 5, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}},
        )
        anything = await _post(
            client,
            "/v1/chat/completions",
            {"messages": city, "max_tokens": 24, "temperature": 0, "structured_outputs": {"json_object": True}},
        )
        refused = {
            "structured_outputs.grammar": {"grammar": "root ::= 'a'"},
            "structured_outputs: send exactly one of json, regex, choice, json_object (got none)": {},
            "(got regex and choice)": {"regex": "a", "choice": ["a"]},
            "structured_outputs.json": {"json": {"type": "strin"}},
        }
        answers = {
            expected: await client.post("/v1/completions", json={**bastille, "structured_outputs": value})
            for expected, value in refused.items()
        }
        both = await client.post(
            "/v1/completions", json={**bastille, "structured_outputs": {"regex": "a"}, "guided_regex": "a"}
        )
    text = compact["choices"][0]["message"]["content"]
    value = json.loads(text)
    assert compact["choices"][0]["finish_reason"] == "stop" and list(value) == ["city"], text
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert regex["choices"][0]["text"] == guided["choices"][0]["text"]
    assert re.fullmatch(r" [0-9]{4}\.", regex["choices"][0]["text"])
    assert choice["choices"][0]["message"]["content"] in ("yes", "no")
    assert isinstance(json.loads(anything["choices"][0]["message"]["content"]), dict)
    for expected, r in answers.items():
        assert r.status_code == 400 and expected in r.json()["error"]["message"], (expected, r.text)
    assert both.status_code == 400 and "structured_outputs and guided_regex" in both.json()["error"]["message"]


async def test_tgi_response_formats_on_chat(api_client) -> None:
    """TGI's chat response_format forms constrain the answer as TGI does (huggingface_hub's InferenceClient sends
    `json_object` with the schema in `value`, which used to be dropped): `json`, `json_object` and `json_schema`
    with a value follow the schema, `regex` its pattern; a form without its value is a 400 naming it."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    city = {"messages": [{"role": "user", "content": "Name a city as JSON."}], "max_tokens": 24, "temperature": 0}
    forms = [
        {"type": "json", "value": schema},
        {"type": "json_object", "value": schema},
        {"type": "json_schema", "value": {"name": "city", "schema": schema}},
    ]
    yes_no = {"messages": [{"role": "user", "content": "Is Paris in France?"}], "max_tokens": 4, "temperature": 0}
    async with api_client() as client:
        answers = [await _post(client, "/v1/chat/completions", {**city, "response_format": f}) for f in forms]
        regex = await _post(
            client, "/v1/chat/completions", {**yes_no, "response_format": {"type": "regex", "value": "(yes|no)"}}
        )
        bad = [
            await client.post("/v1/chat/completions", json={**city, "response_format": f})
            for f in ({"type": "json"}, {"type": "regex", "value": {"a": 1}}, {"type": "json_schema", "value": {}})
        ]
    for answer in answers:
        assert list(json.loads(answer["choices"][0]["message"]["content"])) == ["city"], answer
    assert regex["choices"][0]["message"]["content"] in ("yes", "no")
    for r in bad:
        assert r.status_code == 400 and "response_format" in r.json()["error"]["message"], r.text


def test_schemas_are_compiled_closed() -> None:
    """closed_schema closes every object that declares properties and says nothing of others (nested, in arrays,
    anyOf and $defs), leaves what a schema says, free-form objects and allOf's branches as they are, and reads a
    property named `properties` as a name; tools are always compiled closed, response formats per the setting."""
    from app.api import tools
    from app.api.schemas import ChatCompletionRequest, closed_grammar, closed_schema

    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "string"},
            "at": point,
            "many": {"type": "array", "items": {"anyOf": [point, {"$ref": "#/$defs/p"}]}},
            "free": {"type": "object"},
            "said": {**point, "additionalProperties": True},
            "both": {"allOf": [point, {"properties": {"y": {"type": "number"}}}]},
        },
        "$defs": {"p": point},
    }
    closed = {**point, "additionalProperties": False}
    out = closed_schema(schema)
    assert out["additionalProperties"] is False and out["properties"]["properties"] == {"type": "string"}
    assert out["properties"]["at"] == closed and out["$defs"]["p"] == closed
    assert out["properties"]["many"]["items"]["anyOf"][0] == closed
    assert out["properties"]["free"] == {"type": "object"} and out["properties"]["said"] == schema["properties"]["said"]
    assert out["properties"]["both"] == schema["properties"]["both"]
    assert closed_grammar(None) is None
    body = ChatCompletionRequest.model_validate(
        {
            "messages": ASK,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": point}}],
            "tool_choice": "required",
        }
    )
    assert json.loads(tools.grammar(body).spec)["items"]["anyOf"][0]["properties"]["arguments"] == closed


async def test_response_schemas_closed_unless_switched_off(api_client) -> None:
    """By default (as vLLM) a response schema that declares properties takes no others; with the switch off it is
    compiled as written: an open schema then lets the model add keys."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}}
    body = {
        "messages": [{"role": "user", "content": 'Copy this JSON: {"city": "Rome", "country": "Italy"}'}],
        "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    async with api_client() as client:
        closed = await _post(client, "/v1/chat/completions", body)
    async with api_client(closed_response_schemas=False) as client:
        opened = await _post(client, "/v1/chat/completions", body)
    assert set(json.loads(closed["choices"][0]["message"]["content"])) <= {"city"}, closed
    assert len(json.loads(opened["choices"][0]["message"]["content"])) > 1, opened
