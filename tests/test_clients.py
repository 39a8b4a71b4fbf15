"""The client matrix: real libraries, used as a new user would, against one real `specserve serve` process
(TGI's text-generation client is in tests/test_server_process.py). LangChain's `with_structured_output` with
each of its three methods (json_schema, json_mode, function_calling) and its `.stream()` of tool calls through
langchain-openai; a tool round trip and the stream helper with the openai client; huggingface_hub's
InferenceClient (its "dummy" model, TGI's response_format form, streamed chat). The 135M target's answers are
not checked for sense, only for structure: they parse into the pydantic model (a nested model and an enum), the
calls name the right function."""

from __future__ import annotations

import json
import operator
from enum import Enum
from functools import reduce

import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"


class Country(str, Enum):
    france = "France"
    italy = "Italy"


class Home(BaseModel):
    city: str = Field(max_length=16)
    country: Country


class Person(BaseModel):
    """A person and where they live."""

    name: str = Field(max_length=16)
    age: int
    home: Home


@pytest.fixture
def server(real_server: str) -> str:
    """The shared `specserve serve` (conftest's `real_server`; the default draft): one request at a time here."""
    return real_server


def test_langchain_with_structured_output_every_method(server: str) -> None:
    """json_schema (response_format json_schema), json_mode (json_object, the schema in the prompt) and
    function_calling (a named tool choice) each give a Person."""
    llm = ChatOpenAI(
        base_url=f"{server}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=48, max_retries=0
    )
    ask = "Describe Marie Curie: her name, age and home."
    example = json.dumps({"name": "Marie Curie", "age": 66, "home": {"city": "Paris", "country": "France"}})
    prompts = {
        "json_schema": ask,
        # json_mode constrains the answer to a JSON object only: the keys come from the prompt, as LangChain says.
        "json_mode": f"Reply with this JSON object exactly, nothing else: {example}",
        "function_calling": ask,
    }
    for method, prompt in prompts.items():
        person = llm.with_structured_output(Person, method=method).invoke(prompt)
        assert isinstance(person, Person), (method, person)
        assert isinstance(person.home.country, Country), (method, person)


def test_langchain_streams_tool_calls(server: str) -> None:
    """`.stream()` of a tool-bound model adds its chunks up to one valid call (required, named, auto: no nameless
    call, nothing in invalid_tool_calls), and `with_structured_output(method="function_calling").stream()`
    ends with the Person (issue 32: the streamed deltas were not in OpenAI's shape)."""
    llm = ChatOpenAI(
        base_url=f"{server}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=40, max_retries=0
    )
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current temperature in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}},
        },
    }
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    copy = f"Repeat exactly, nothing else: {call}"
    asks = {"any": "What is the weather in Paris?", "get_weather": "What is the weather in Paris?", "auto": copy}
    for choice, prompt in asks.items():
        total = reduce(operator.add, llm.bind_tools([weather], tool_choice=choice).stream(prompt))
        assert total.invalid_tool_calls == [], (choice, total)
        assert len(total.tool_calls) == 1, (choice, total)
        [call] = total.tool_calls
        assert call["name"] == "get_weather" and call["id"].startswith("call_"), (choice, call)
        assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str), (choice, call)
    ask = "Describe Marie Curie: her name, age and home."
    *_, person = llm.with_structured_output(Person, method="function_calling").stream(ask)
    assert isinstance(person, Person) and isinstance(person.home.country, Country), person


def test_openai_tool_round_trip(server: str) -> None:
    """A required call of the one tool, its result sent back as a tool message after the assistant's call, and
    a final text answer to the conversation."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current temperature in a city, in degrees Celsius",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[weather], tool_choice="required", max_tokens=32, temperature=0
    )
    call_message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and call_message.content is None
    [call] = call_message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages.append(call_message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})})
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[weather], max_tokens=16, temperature=0
    )
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content, answer
    assert answer.finish_reason in ("stop", "length")


def test_huggingface_hub_inference_client(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """InferenceClient(base_url=...) as it comes: chat sends model "dummy" (accepted), its response_format
    json_schema form is TGI's `json_object` with the schema in `value` (honoured: the answer follows it), and a
    streamed chat adds up to the whole answer."""
    from huggingface_hub import InferenceClient, constants

    # The suite keeps the hub offline (conftest), which huggingface_hub applies to every URL, ours included.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    client = InferenceClient(base_url=server)
    ask = [{"role": "user", "content": "Describe Marie Curie: her name, age and home."}]
    schema = Person.model_json_schema()
    answer = client.chat_completion(
        ask, max_tokens=64, temperature=0, response_format={"type": "json_object", "value": schema}
    )
    person = Person.model_validate_json(answer.choices[0].message.content)
    assert isinstance(person.home.country, Country), person
    whole = client.chat_completion(ask, max_tokens=12, temperature=0).choices[0].message.content
    pieces = client.chat_completion(ask, max_tokens=12, temperature=0, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == whole
