"""OpenAI tool calls on the chat route: the reader that turns an answer's text into content and tool calls (every
mode, piece by piece and whole), and real requests in process (real target, n-gram draft): a named function, a
required call, an `auto` call, `none`, streamed and whole, the tools and a call's round trip rendered into the
prompt, and refusals naming the field."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from app.api import tools
from app.api.schemas import ChatCompletionRequest

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The 135M target copies this, so `auto` gets a call to read.
COPY = [
    {
        "role": "user",
        "content": 'Repeat exactly, nothing else: <tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>',
    }
]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, ADD], **fields})


def _read(body: ChatCompletionRequest, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]] | None, bool]:
    """The content and (name, arguments) calls of `pieces` fed one by one, and whether every piece's content
    and calls add up to what the whole text gives."""
    reader = tools.ToolCallReader(body)
    deltas = [reader.feed(p) for p in pieces] + [reader.finish()]
    content, calls = tools.message_parts(tools.ToolCallReader(body), "".join(pieces))
    streamed: dict[int, list[str]] = {}
    for c in (c for d in deltas for c in d.calls):
        entry = streamed.setdefault(c.index, [c.function.name or "", ""])
        entry[1] += c.function.arguments
    as_whole = "".join(d.content for d in deltas) == (content or "") and [
        tuple(streamed[i]) for i in sorted(streamed)
    ] == [(c.function.name, c.function.arguments) for c in calls or ()]
    return content, None if calls is None else [(c.function.name, c.function.arguments) for c in calls], as_whole


def test_reader_finds_calls_in_every_mode() -> None:
    """`auto` reads Hermes blocks (content before them, several, the last unclosed, Llama's `parameters`) and
    leaves text that is not a call as content; `required` reads the JSON of its grammar; streamed piece by piece
    (one character at a time) is the whole text's answer."""
    auto = _request()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    cases = {
        "Let me look.\n" + call: ("Let me look.", [("get_weather", '{"city": "Paris"}')]),
        call + "\n" + call.replace("Paris", "Rome") + "\n": (
            None,
            [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')],
        ),
        '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}': (None, [("add", '{"a": 1, "b": 2}')]),
        "It is sunny. <tool_call is a tag\n\n": ("It is sunny. <tool_call is a tag", None),
        "Sure:\n<tool_call>\n{not json}\n</tool_call>": ("Sure:\n<tool_call>\n{not json}\n</tool_call>", None),
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>': (
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
            None,
        ),
    }
    for text, expected in cases.items():
        for pieces in ([text], list(text)):
            content, calls, as_whole = _read(auto, pieces)
            assert (content, calls) == expected, text
            assert as_whole, text
    single = _request(parallel_tool_calls=False)
    assert _read(single, [call + call])[1] == [("get_weather", '{"city": "Paris"}')]
    none = _request(tool_choice="none")
    assert _read(none, [call]) == (call, None, True)
    required = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "X"}}]'
    content, calls, as_whole = _read(_request(tool_choice="required"), list(required))
    assert content is None and calls == [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "X"}')] and as_whole
    # Cut short (max_tokens): the calls as far as they went, the last one's arguments cut (as a named call's);
    # text that never completed a first name is content. Piece by piece, each call goes out once its name is whole.
    cut = {
        '[{"name": "add", "argu': (None, [("add", "")]),
        '[{"name":"add","arguments":{"a":1,': (None, [("add", '{"a":1,')]),
        '[{"name":"add","arguments":{"a":"}{\\"","b":2}},{"name":"get_w': (None, [("add", '{"a":"}{\\"","b":2}')]),
        '[{"name":"ad': ('[{"name":"ad', None),
        "": ("", None),
    }
    for text, expected in cut.items():
        for pieces in ([text], list(text)):
            assert _read(_request(tool_choice="required"), pieces) == (*expected, True), text
    reader = tools.ToolCallReader(_request(tool_choice="required"))
    assert reader.feed('[{"name":"ad').calls == []
    # the head and the first piece of arguments are one entry (one entry per index per chunk, as OpenAI's)
    [head] = reader.feed('d","arguments":{"a"').calls
    assert (head.index, head.function.name, head.id is not None, head.function.arguments) == (0, "add", True, '{"a"')
    assert [c.function.arguments for c in reader.feed(":1}},").calls] == [":1}"]
    single = '{"name":"add","arguments":{"a":1}}'
    assert _read(_request(tool_choice="required", parallel_tool_calls=False), list(single)) == (
        None,
        [("add", '{"a":1}')],
        True,
    )
    named = _request(tool_choice={"type": "function", "function": {"name": "add"}})
    assert _read(named, ['{"a": 1,', ' "b": 2}']) == (None, [("add", '{"a": 1, "b": 2}')], True)


def test_history_and_tools_rendered_in_the_hermes_format() -> None:
    """The tools' signatures join the system message; an assistant's calls are <tool_call> blocks, a run of tool
    results one user turn of <tool_response> blocks; without tools the messages are as they were."""
    body = ChatCompletionRequest.model_validate(
        {
            "tools": [ADD],
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "1+2 and 3+4?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a":3,"b":4}'}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "3"},
                {"role": "tool", "tool_call_id": "call_2", "content": "7"},
            ],
        }
    )
    turns = tools.render_messages(body)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\n# Tools\n") and json.dumps(ADD) in turns[0]["content"]
    assert turns[2]["content"] == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    )
    assert turns[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>"
    plain = ChatCompletionRequest.model_validate({"messages": ASK})
    assert tools.render_messages(plain) == ASK


# A template that renders tools itself, after Qwen2.5's (tools as tojson lines, calls with their arguments).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_with_tools_renders_them_as_transformers(api_engine, hf_tokenizer) -> None:
    """A chat template that takes `tools` gets them and the history's calls (arguments as objects) as
    transformers hands them, and renders what transformers renders (its plain tojson); SmolLM2's does not."""
    from app.engine.model.tokenizer import Tokenizer

    tok = Tokenizer(api_engine.tokenizer.backend, [], TOOL_TEMPLATE, None, ())
    f = ADD["function"]
    described = {"type": "function", "function": {"name": f["name"], "description": "a + b, for a < b", **f}}
    body = ChatCompletionRequest.model_validate(
        {
            "tools": [described],
            "messages": [
                {"role": "user", "content": "1+2?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "3"},
            ],
        }
    )
    messages, functions = tools.template_messages(body)
    ours = tok.apply_chat_template(messages, tools=functions)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tools=functions, chat_template=TOOL_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert tok.takes_tools and not api_engine.tokenizer.takes_tools
    assert ours == theirs
    assert json.dumps(described) in ours and '{"name": "add", "arguments": {"a": 1, "b": 2}}' in ours


class Weather(BaseModel):
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def _streamed(chunks) -> tuple[str, list[tuple[str, str]], str | None]:
    """The content, (name, arguments) calls and finish reason a stream of openai chunks adds up to."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or ():
                entry = calls.setdefault(c.index, [c.function.name, "", c.id])
                assert c.id is None or c.id == entry[2]
                entry[1] += c.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(name, args) for name, args, _ in (calls[i] for i in sorted(calls))], finish


async def test_tool_calls_through_the_openai_client(api_client) -> None:
    """A named function's arguments follow its schema; `required` calls one of the tools; `auto` reads the call
    the model writes; `none` answers text; each as a whole and streamed (the same calls). Every call has an id
    `call_...`, null content and finish reason tool_calls. The typed client's parse() reads a named call's
    arguments into its pydantic model."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    asks = {
        "named": dict(messages=ASK, tool_choice=named, max_tokens=24, temperature=0),
        "required": dict(messages=ASK, tool_choice="required", parallel_tool_calls=False, max_tokens=32, temperature=0),
        "auto": dict(messages=COPY, tool_choice="auto", max_tokens=32, temperature=0),
        "none": dict(messages=ASK, tool_choice="none", max_tokens=8, temperature=0),
    }
    async with api_client() as client:
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        whole, streamed = {}, {}
        for mode, ask in asks.items():
            whole[mode] = await sdk.chat.completions.create(model="smollm2-135m-instruct", tools=[WEATHER, ADD], **ask)
            stream = await sdk.chat.completions.create(
                model="smollm2-135m-instruct", tools=[WEATHER, ADD], stream=True, **ask
            )
            streamed[mode] = _streamed([chunk async for chunk in stream])
        # openai's typed client: a strict pydantic tool, its arguments parsed into the model
        parsed = await sdk.chat.completions.parse(
            model="smollm2-135m-instruct",
            messages=ASK,
            tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
            tool_choice=named,
            max_tokens=24,
            temperature=0,
        )
    for mode in ("named", "required", "auto"):
        choice = whole[mode].choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, (mode, choice)
        [(name, args)] = _calls(choice.message)
        assert jsonschema_rs.is_valid(SCHEMAS[name], args) or mode == "auto", (mode, args)
        assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert streamed[mode] == ("", calls, "tool_calls"), mode
    assert _calls(whole["named"].choices[0].message)[0][0] == "get_weather"
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, Weather)
    assert _calls(whole["auto"].choices[0].message) == [("get_weather", {"city": "Paris"})]
    text = whole["none"].choices[0]
    assert text.message.tool_calls is None and text.message.content and text.finish_reason == "length"
    assert streamed["none"] == (text.message.content, [], "length")


class Add(BaseModel):
    a: int
    b: int


# The 135M target copies this call, whose arguments a strict Weather parses.
COPY_UNIT = [
    {
        "role": "user",
        "content": 'Repeat exactly, nothing else: <tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    }
]


def _nulls(value) -> list[str]:
    """Where `value` (a chunk's delta) holds a null."""
    if isinstance(value, dict):
        return [f"{k}{p}" for k, v in value.items() for p in ([""] if v is None else _nulls(v))]
    if isinstance(value, list):
        return [f"[{i}]{p}" for i, v in enumerate(value) for p in _nulls(v)]
    return []


async def test_streamed_tool_calls_in_openais_shape(api_client, sse_data) -> None:
    """Every streamed chunk as OpenAI sends it: one entry per call index per chunk, the head (id, type, name) on a
    call's first entry only, no null field in a delta, the role on the first chunk only and the finish reason in
    a chunk of its own with an empty delta; so the openai SDK's stream helper fires each call's
    arguments.delta and .done events and parses its arguments (named, required, auto)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    asks = {
        "named": dict(messages=ASK, tool_choice=named, max_tokens=24, temperature=0),
        "required": dict(messages=ASK, tool_choice="required", max_tokens=40, temperature=0),
        "auto": dict(messages=COPY_UNIT, tool_choice="auto", max_tokens=40, temperature=0),
    }
    strict = [
        openai.pydantic_function_tool(Weather, name="get_weather"),
        openai.pydantic_function_tool(Add, name="add"),
    ]
    async with api_client() as client:
        sdk = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        for mode, ask in asks.items():
            r = await client.post(
                "/v1/chat/completions", json={"tools": [WEATHER, ADD], "stream": True, "temperature": 0, **ask}
            )
            chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
            choices = [c["choices"][0] for c in chunks]
            assert [c["delta"].get("role") for c in choices] == ["assistant"] + [None] * (len(choices) - 1), mode
            assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"], mode
            assert choices[-1]["delta"] == {} and choices[-1]["logprobs"] is None, mode
            seen: set[int] = set()
            for c in choices:
                assert _nulls(c["delta"]) == [], (mode, c)
                entries = c["delta"].get("tool_calls", [])
                assert len({e["index"] for e in entries}) == len(entries), (mode, c)
                for e in entries:
                    head = e["index"] not in seen
                    seen.add(e["index"])
                    fields = {"index", "id", "type", "function"} if head else {"index", "function"}
                    assert set(e) == fields and set(e["function"]) == ({"name", "arguments"} if head else {"arguments"})
            assert seen, mode
            async with sdk.chat.completions.stream(model="smollm2-135m-instruct", tools=strict, **ask) as stream:
                events = [event async for event in stream]
                final = await stream.get_final_completion()
            calls = final.choices[0].message.tool_calls
            done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
            assert [(e.index, e.name, e.arguments) for e in done] == [
                (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)
            ], mode
            pieces = [d.arguments_delta for d in events if d.type == "tool_calls.function.arguments.delta"]
            for e in done:
                assert isinstance(e.parsed_arguments, Weather if e.name == "get_weather" else Add), (mode, e)
            assert "".join(pieces) == "".join(c.function.arguments for c in calls), mode
            assert final.choices[0].finish_reason == "tool_calls", mode


async def test_bad_tools_are_400_naming_the_field(api_client) -> None:
    """A tool without a name, a schema that cannot be compiled, an unknown or toolless tool_choice, a forced
    call beside response_format, tool_calls on a user message: 400, the message naming the field."""
    no_name = {"type": "function", "function": {"parameters": {"type": "object"}}}
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    named = {"type": "function", "function": {"name": "missing"}}
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    cases = {
        "tools.0.function.name": {"tools": [no_name]},
        "tools[1].function.parameters": {"tools": [ADD, bad_schema]},
        "tool_choice.function.name": {"tools": [ADD], "tool_choice": named},
        "tool_choice: only with tools": {"tool_choice": "required"},
        "tools: each function's name must be unique": {"tools": [ADD, ADD]},
        "tool_choice and response_format": {
            "tools": [ADD],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tools.0.type": {"tools": [{"type": "custom", "function": ADD["function"]}]},
        "tool_calls: only on an assistant message": {
            "messages": [{"role": "user", "content": "x", "tool_calls": [call]}]
        },
    }
    async with api_client() as client:
        for expected, fields in cases.items():
            r = await client.post(
                "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "temperature": 0, **fields}
            )
            assert r.status_code == 400, (expected, r.text)
            assert expected in r.json()["error"]["message"], (expected, r.text)
