"""Tool calls on the chat route (OpenAI's `tools` and `tool_choice`): the tools and earlier calls rendered into
the conversation, the grammar of a forced call, and an answer's text read back as tool calls, streamed too.

A chat template that renders tools itself (Qwen2.5's) is given them, and the messages as transformers gives
them. Otherwise (our default target's template has no tool support) the messages are rewritten into the Hermes
format that Qwen2.5's and NousResearch's templates write (and vLLM's `hermes` tool parser reads) before the
template renders them as plain turns: the tools' signatures go into the system message inside
``<tools></tools>``, each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and a tool's
result comes back in a user turn inside ``<tool_response></tool_response>``. Answers are read in that format.

`tool_choice` decides how an answer becomes calls:
- `none`: the tools are in the prompt, the text is the answer (as vLLM: nothing is parsed);
- `auto`: the text is read as vLLM's hermes parser does: each ``<tool_call>`` block naming a tool is a call (the
  last may be unclosed), the text before the first one is the content, text after a block is dropped; a block
  that does not parse, or names no tool, leaves the whole text as content;
- `required`: the output is decoded under a JSON schema: an array (one item or more) of
  ``{"name": <a tool's name>, "arguments": <its parameters' schema>}``, a single such object with
  `parallel_tool_calls` false; read as it comes: a call is sent once its name is complete, its arguments' text
  piece by piece (as vLLM streams forced calls);
- a named function: the output is that function's arguments, decoded under its parameters' schema.

A forced call is compact JSON (no white space between its tokens).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.api.schemas import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    Grammar,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
    ToolDefinition,
    closed_schema,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"

# A function without `parameters` takes an object with any properties, as OpenAI's.
ANY_OBJECT: dict[str, Any] = {"type": "object"}

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def parameters(tool: ToolDefinition) -> dict[str, Any]:
    """The JSON schema of a tool's arguments, closed as vLLM compiles it (`closed_schema`: an object that
    declares properties takes no others unless it says so)."""
    return closed_schema(tool.function.parameters) if tool.function.parameters is not None else ANY_OBJECT


def _signature(tool: ToolDefinition) -> str:
    return json.dumps({"type": "function", "function": tool.function.model_dump(exclude_none=True)}, ensure_ascii=False)


def _call_text(name: str, arguments: str) -> str:
    call = {"name": name, "arguments": _arguments_value(arguments)}
    return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # a history's call whose arguments are not JSON: rendered as the text it was


def template_messages(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and tools as transformers hands them to a chat template that renders tools itself
    (`Tokenizer.takes_tools`): an assistant's `tool_calls` with their arguments as objects, a tool message's
    `tool_call_id`, the tools in OpenAI's format."""
    messages: list[dict[str, Any]] = []
    for m in body.messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments_value(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages, [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def render_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The conversation as plain {role, content} turns for the chat template: the tools' signatures in the system
    message, assistant tool calls as ``<tool_call>`` blocks, tool results in ``<tool_response>`` user turns (a
    run of tool messages shares one turn). Without tools or tool messages, the messages as they are."""
    turns: list[dict[str, str]] = []
    after_tool = False
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        if role == "tool":
            response = f"<tool_response>\n{m.text()}\n</tool_response>"
            if after_tool:
                turns[-1]["content"] += "\n" + response
            else:
                turns.append({"role": "user", "content": response})
            after_tool = True
            continue
        after_tool = False
        text = m.text()
        if m.tool_calls:
            calls = "\n".join(_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        turns.append({"role": role, "content": text})
    if body.tools:
        described = _INSTRUCTIONS.format(tools="\n".join(_signature(t) for t in body.tools))
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{described}"
        else:
            turns.insert(0, {"role": "system", "content": described})
    return turns


def grammar(body: ChatCompletionRequest) -> Grammar | None:
    """The grammar of a forced call (`required` or a named function); None otherwise."""
    mode = body.tool_mode()
    tools = body.tools or []
    if mode == "named":
        assert isinstance(body.tool_choice, NamedToolChoice)
        i, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == body.tool_choice.function.name)
        return Grammar("json_schema", json.dumps(_compact(parameters(tool))), f"tools[{i}].function.parameters")
    if mode != "required":
        return None
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": parameters(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema = call if body.parallel_tool_calls is False else {"type": "array", "items": call, "minItems": 1}
    return Grammar("json_schema", json.dumps(_compact(schema)), "tools")


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    # A forced call is compact JSON (`{"a":1}`): a small model given free white space spends its tokens on
    # indentation. llguidance reads this option at the schema's top; a schema's own choice stays.
    return {"x-guidance": {"whitespace_flexible": False}, **schema}


def parameter_grammars(body: ChatCompletionRequest) -> list[Grammar]:
    """Each tool's parameters schema as a grammar, so that one that cannot be compiled is a 400 naming it."""
    return [
        Grammar("json_schema", json.dumps(t.function.parameters), f"tools[{i}].function.parameters")
        for i, t in enumerate(body.tools or [])
        if t.function.parameters is not None
    ]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Delta:
    """What a piece of the answer adds: content text and tool-call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def _longest_open_prefix(text: str) -> int:
    """The length of the longest end of `text` that is the beginning of ``<tool_call>``."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _Forced:
    """One call of a `required` answer as far as it goes: its name once complete, its arguments' text so far."""

    name: str | None = None
    arguments: str = ""


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at text[i] ends (the index after it); None when the text ends first."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if text[i] in "{[":
        depth, j, in_string = 0, i, False
        while j < len(text):
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None  # a number may still go on


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _forced_call(text: str, i: int) -> tuple[_Forced, int | None]:
    """The call of a `required` answer whose object begins at text[i] (``{``): its name once that string is
    complete and its arguments' text, whole or as far as it goes; and the index after its closing brace (None
    while the text has not closed it)."""
    call = _Forced()
    i = _skip_space(text, i + 1)
    while i < len(text) and text[i] == '"':
        key_end = _value_end(text, i)
        if key_end is None:
            return call, None
        try:
            key = json.loads(text[i:key_end])
        except json.JSONDecodeError:  # not from the grammar's output; read no further
            return call, None
        i = _skip_space(text, key_end)
        if i >= len(text) or text[i] != ":":
            return call, None
        i = _skip_space(text, i + 1)
        end = _value_end(text, i)
        if key == "arguments":
            call.arguments = text[i : len(text) if end is None else end]
        elif key == "name" and end is not None:
            try:
                name = json.loads(text[i:end])
            except json.JSONDecodeError:
                return call, None
            call.name = name if isinstance(name, str) else None
        if end is None:
            return call, None
        i = _skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_space(text, i + 1)
    return call, (i + 1 if i < len(text) and text[i] == "}" else None)


class ToolCallReader:
    """Reads one choice's text, piece by piece as it is generated, into content and tool calls (see the module's
    docstring for each mode). Content that may still turn out to begin a call is held back until it cannot:
    with `auto`, trailing white space and a partial ``<tool_call>``; with `required`, the text until the first
    call's name is complete (then it is all calls)."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        self.mode = body.tool_mode()
        self.names = {t.function.name for t in body.tools or ()}
        self.single = body.parallel_tool_calls is False
        self.named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        self.called = False  # whether the answer has tool calls
        self._held = ""  # auto: text not yet sent as content; required: the whole output
        self._in_call = False  # auto: a <tool_call> began
        self._gap = ""  # auto: the white space before it, content again if no call parses
        # required: whether the answer is an array of calls (None until its first character); the calls closed so
        # far and where the text after the last of them begins (a closed call is read once, not at every piece);
        # how much of the open call's arguments was sent (None: not even its head)
        self._array: bool | None = None
        self._closed = 0
        self._after = 0
        self._open_sent: int | None = None

    def feed(self, text: str) -> Delta:
        """The content and call pieces `text`, the next piece of the output, makes sure of."""
        if self.mode == "none":
            return Delta(content=text)
        if self.mode == "named":
            if not self.called:
                self.called = True
                # The call's head and its first piece of arguments are one entry, as OpenAI sends them: a
                # second entry of the same index in one chunk is read by clients as a call of its own.
                head = ToolCallDelta(
                    index=0, id=_call_id(), type="function", function=FunctionCallDelta(name=self.named, arguments=text)
                )
                return Delta(calls=[head])
            return Delta(calls=self._arguments(text))
        self._held += text
        if self.mode == "required":
            return Delta(calls=self._forced_pieces())
        if self._in_call:
            return Delta()
        start = self._held.find(OPEN)
        if start >= 0:
            self._in_call = True
            sent, self._held = self._held[:start], self._held[start:]
            self._gap = sent[len(sent.rstrip()) :]
            return Delta(content=sent.rstrip())
        keep = _longest_open_prefix(self._held)
        before = self._held[: len(self._held) - keep]
        keep += len(before) - len(before.rstrip())
        sent, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return Delta(content=sent)

    def _arguments(self, text: str) -> list[ToolCallDelta]:
        return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))] if text else []

    def _forced_pieces(self) -> list[ToolCallDelta]:
        """`required`: what the held text adds to the calls sent so far (a new call once its name is complete)."""
        out: list[ToolCallDelta] = []
        text = self._held
        if self._array is None:
            i = _skip_space(text, 0)
            if i == len(text):
                return out
            self._array = text[i] == "["
            self._after = i + 1 if self._array else i
        while True:
            i = _skip_space(text, self._after)
            if self._closed:  # another call only in an array, once its comma has come
                if self.single or not self._array or i >= len(text) or text[i] != ",":
                    return out
                i = _skip_space(text, i + 1)
            if i >= len(text) or text[i] != "{":
                return out
            call, end = _forced_call(text, i)
            if call.name is None:
                return out  # calls go out in order, each once its name is known
            piece = call.arguments[self._open_sent or 0 :]
            if self._open_sent is None:
                # the head and the first piece as one entry (see feed)
                self.called = True
                head = FunctionCallDelta(name=call.name, arguments=piece)
                out.append(ToolCallDelta(index=self._closed, id=_call_id(), type="function", function=head))
            elif piece:
                out.append(ToolCallDelta(index=self._closed, function=FunctionCallDelta(arguments=piece)))
            if end is None:
                self._open_sent = len(call.arguments)
                return out
            self._closed, self._after, self._open_sent = self._closed + 1, end, None

    def finish(self) -> Delta:
        """What is left at the end of the output: the held text as calls, or as content when it is none."""
        if self.mode == "named":
            return self.feed("") if not self.called else Delta()
        if self.mode == "none":
            return Delta()
        if self.mode == "required":
            # Calls went out as they came (the last one's arguments cut if the output was); text that never
            # became a call (cut before the first name was complete) is the answer's content.
            return Delta(content="" if self.called else self._held)
        held, self._held = self._held, ""
        calls = _auto_calls(held, self.names)
        if calls is None:
            return Delta(content=self._gap + held if self._in_call else held.rstrip())
        if self.single:
            calls = calls[:1]
        self.called = True
        return Delta(
            calls=[
                ToolCallDelta(
                    index=i, id=_call_id(), type="function", function=FunctionCallDelta(name=name, arguments=args)
                )
                for i, (name, args) in enumerate(calls)
            ]
        )


def _one_call(value: Any, names: set[str]) -> tuple[str, str] | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters"))  # some models write Llama 3's `parameters`
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


def _auto_calls(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    """The calls of `text` (that begins with ``<tool_call>``): every block must parse and name a tool; the last
    may lack its closing tag (the model ended there). Text after a block is dropped, as vLLM's hermes parser."""
    blocks = text.split(OPEN)[1:]
    calls = []
    for j, block in enumerate(blocks):
        body, closed, _ = block.partition(CLOSE)
        if not closed and j < len(blocks) - 1:
            return None
        try:
            call = _one_call(json.loads(body), names)
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def merged(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """`calls` with one entry per index (the pieces of one call joined, its head's fields kept), in order of
    first appearance: OpenAI's clients take each entry of a chunk as a new piece, and an entry repeating an
    index as a call without its head."""
    by_index: dict[int, ToolCallDelta] = {}
    for c in calls:
        if c.index not in by_index:
            by_index[c.index] = c.model_copy(deep=True)
        else:
            by_index[c.index].function.arguments += c.function.arguments
    return list(by_index.values())


def message_parts(reader: ToolCallReader, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """A whole answer's content (None when empty beside calls) and tool calls (None when none)."""
    pieces = [reader.feed(text), reader.finish()]
    content = "".join(p.content for p in pieces)
    calls: dict[int, ToolCall] = {}
    for piece in (c for p in pieces for c in p.calls):
        if piece.index not in calls:
            calls[piece.index] = ToolCall(
                id=piece.id or _call_id(), function=FunctionCall(name=piece.function.name or "", arguments="")
            )
        calls[piece.index].function.arguments += piece.function.arguments
    if not calls:
        return content, None
    return (content or None), [calls[i] for i in sorted(calls)]


def finish_reason(reader: ToolCallReader, reason: str) -> str:
    """`tool_calls` for an answer that ended as it should with calls; else the engine's reason."""
    return "tool_calls" if reader.called and reason == "stop" else reason
