"""Structured output: what a request constrains its answer to (OpenAI's `response_format`, vLLM's
`structured_outputs`), as the engine's `Grammar`, and the closing of JSON schemas as vLLM compiles them."""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, Field, model_validator

from app.api.schemas.common import REQUEST_CONFIG, NonEmptyStr, neutral_only
from app.engine.decoding.grammar import MAX_SCHEMA_DEPTH, json_depth


class Grammar(NamedTuple):
    """What a request constrains its output to, as the engine takes it: `kind` json_schema (`spec`: the schema's
    JSON text), json_object, regex (`spec`: the pattern) or choice (`spec`: a JSON array of the strings);
    `field` names the request field it came from, for the message when the engine cannot compile it."""

    kind: str
    spec: str
    field: str


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = REQUEST_CONFIG

    name: str = Field(description="the schema's name (reported nowhere)")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the answer follows")
    strict: bool | None = Field(None, description="true or false alike: the answer always follows the schema")


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (plain text, any JSON object, or JSON that follows `json_schema.schema`) and TGI's
    chat forms, which carry a `value` (huggingface_hub's InferenceClient sends them): `json` and `json_object` with
    a JSON schema, `regex` with a pattern, `json_schema` with `{"name", "schema"}`."""

    model_config = REQUEST_CONFIG

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: JsonSchemaFormat | None = None
    value: dict[str, Any] | str | None = Field(
        None,
        description="TGI's: json and json_object: the JSON schema (an object, or its JSON text); regex: the pattern; "
        'json_schema: {"name", "schema"}',
    )

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError("json_schema is sent with type json_schema, and only with it")
        if self.type == "json_schema" and (self.json_schema is None) == (self.value is None):
            raise ValueError("type json_schema takes json_schema (OpenAI's form) or value (TGI's), one of them")
        tgi_schema = self.type == "json_schema" and self.value is not None
        if tgi_schema and not (isinstance(self.value, dict) and isinstance(self.value.get("schema"), dict)):
            raise ValueError('value: TGI\'s json_schema value is {"name": ..., "schema": {...}}')
        if self.type in ("json", "regex") and self.value is None:
            raise ValueError(f"type {self.type} takes its {'schema' if self.type == 'json' else 'pattern'} in value")
        if self.type == "regex" and not isinstance(self.value, str):
            raise ValueError("value: a regex is a string")
        if self.type == "text" and self.value is not None:
            raise ValueError("value: not with type text")
        return self

    def grammar(self) -> Grammar | None:
        """The engine's constraint; `field` names where it came from."""
        if self.type == "text":
            return None
        if self.json_schema is not None:
            return Grammar("json_schema", json.dumps(self.json_schema.schema_), "response_format.json_schema.schema")
        if self.type == "regex":
            return Grammar("regex", str(self.value), "response_format.value")
        if self.value is None:
            return Grammar("json_object", "", "response_format")
        schema = self.value["schema"] if self.type == "json_schema" else self.value  # type: ignore[index]
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return Grammar("json_schema", text, "response_format.value")


def _no_additional_properties(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if ("properties" in schema or schema.get("type") == "object") and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


# Where a JSON schema holds schemas: one, a list of them, or a map of names to them.
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema: Any, _in_all_of: bool = False) -> Any:
    """`schema` with every object schema that declares `properties` and says nothing of others closed to them
    (`additionalProperties: false`), as vLLM's default backend (xgrammar's strict mode) compiles schemas: open,
    a small model invents keys until max_tokens. A schema that says (`additionalProperties`,
    `unevaluatedProperties`, `patternProperties`) keeps its word; `{"type": "object"}` without properties stays any
    object; the branches of an `allOf` stay open, since each names only its share of the properties. Only places
    that hold schemas are walked, so a property named `properties` is a name, not a keyword."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    for key in (*_ONE_SCHEMA, "additionalProperties", "unevaluatedProperties"):
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_schema(sub, _in_all_of=True) for sub in out["allOf"]]
    says = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if "properties" in schema and not _in_all_of and not any(key in schema for key in says):
        out["additionalProperties"] = False
    return out


def closed_grammar(grammar: Grammar | None) -> Grammar | None:
    """A JSON-schema grammar with its schema closed (`closed_schema`); any other grammar as it is. A schema
    that is not JSON is left for the engine to refuse, naming the field."""
    if grammar is None or grammar.kind != "json_schema":
        return grammar
    try:
        schema = json.loads(grammar.spec)
    except (json.JSONDecodeError, RecursionError):
        return grammar
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        return grammar  # the engine refuses it, before closed_schema's recursion (or json.dumps) overflows on it
    return grammar._replace(spec=json.dumps(closed_schema(schema)))


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, json_object."""

    model_config = REQUEST_CONFIG

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="the output follows this JSON schema (an object, or its JSON text)"
    )
    regex: str | None = Field(None, description="the output matches this regex, whole")
    choice: list[NonEmptyStr] | None = Field(None, min_length=1, description="the output is one of these strings")
    json_object: bool | None = Field(None, description="true: the output is a JSON object")
    disable_any_whitespace: bool = Field(False, description="true: JSON without white space between its tokens")
    disable_additional_properties: bool = Field(
        False, description="true: an object schema that does not say takes no properties beyond its own"
    )
    disable_fallback: bool = Field(False, description="changes nothing: there is one grammar engine, no fallback")
    grammar: neutral_only(Any, None) = None
    structural_tag: neutral_only(Any, None) = None
    whitespace_pattern: neutral_only(Any, None) = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        kinds = [k for k in ("json", "regex", "choice", "json_object") if self._kind(k)]
        if len(kinds) != 1:
            given = f"got {' and '.join(kinds)}" if kinds else "got none"
            raise ValueError(f"send exactly one of json, regex, choice, json_object ({given})")
        return self

    def _kind(self, name: str) -> bool:
        value = self.json_ if name == "json" else getattr(self, name)
        return bool(value) if name == "json_object" else value is not None

    def grammar_spec(self) -> Grammar:
        """The engine's constraint; `field` names the one sent."""
        if self.regex is not None:
            return Grammar("regex", self.regex, "structured_outputs.regex")
        if self.choice is not None:
            return Grammar("choice", json.dumps(self.choice), "structured_outputs.choice")
        if self.json_ is None and not self.disable_any_whitespace and not self.disable_additional_properties:
            return Grammar("json_object", "", "structured_outputs.json_object")
        schema: Any = {"type": "object"} if self.json_ is None else self.json_
        field = "structured_outputs.json" if self.json_ is not None else "structured_outputs.json_object"
        if isinstance(schema, str):
            text = schema
            try:
                schema = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                return Grammar("json_schema", text, field)  # the engine says why it is not JSON
            if json_depth(schema) > MAX_SCHEMA_DEPTH:
                # Refused by the engine, before the recursive rewriting below (or json.dumps) overflows on it.
                return Grammar("json_schema", text, field)
        if isinstance(schema, dict):
            if self.disable_additional_properties:
                schema = _no_additional_properties(schema)
            if self.disable_any_whitespace:
                # llguidance reads its options at the schema's top level
                schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_flexible": False}}
        return Grammar("json_schema", json.dumps(schema), field)
