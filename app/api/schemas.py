"""The wire formats: requests and responses of the native (TGI) API, the OpenAI API and the operations routes.

Requests are validated strictly (a string is not a number, NaN is not a temperature) so that a wrong type is
a 4xx naming the field, never a guess. Fields that TGI's and OpenAI's clients always send, and vLLM's extra
fields that would change the output, are accepted at their neutral values and refused, with a message, at any
value we cannot honour. Unknown fields at a request's top level are ignored, as TGI and vLLM ignore them, and
logged; inside any object they are refused, naming the field's path (`messages.0.x`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from app.api.errors import field_name
from app.engine.decoding.grammar import MAX_SCHEMA_DEPTH, json_depth
from app.engine.decoding.penalties import PenaltyParams
from app.engine.defaults import MAX_DRAFT_TOKENS, MAX_LOGPROBS
from app.engine.step import GenerationParams

# Nested objects refuse a field they do not know (a 4xx naming its path): a field we do not read would be
# dropped without a word. The top levels of the requests keep theirs to log them (see `ignored_fields`).
_REQUEST = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


# --- sampling ----------------------------------------------------------------------------------------------

MAX_TEMPERATURE = 100.0
# The smallest positive temperature: below it, logits / temperature can overflow float32 and the
# probabilities become NaN. Anything this small is greedy in all but name.
MIN_TEMPERATURE = 1e-6
MAX_SEED = 2**64 - 1  # the range of a torch.Generator seed (TGI's seed is a u64 too)


def _check_temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    return value


Temperature = Annotated[
    float,
    Field(ge=0, le=MAX_TEMPERATURE),
    AfterValidator(_check_temperature),
    WithJsonSchema(
        {"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE}]}
    ),
]


RepetitionPenalty = Annotated[
    float,
    Field(
        gt=0,
        le=10,
        description="a token already in the text (prompt included) has its logit divided by this when positive, "
        "multiplied when negative (HF's, TGI's and vLLM's rule); 1.0: none; applied alike to the draft and the target",
    ),
]
OpenAIPenalty = Annotated[float, Field(ge=-2, le=2)]


def _neutral_only(annotation: Any, *allowed: Any) -> Any:
    """A field the clients send that we cannot honour: accepted only at its neutral values."""
    shown = " or ".join(json.dumps(a) for a in allowed if a is not None)
    hint = f"leave it unset or send {shown}" if shown else "leave it unset"

    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"not supported: {hint}")
        return value

    return Annotated[
        annotation,
        AfterValidator(check),
        WithJsonSchema({"enum": list(allowed)}),
        Field(description=f"not supported: {hint}"),
    ]


NonEmptyStr = Annotated[str, Field(min_length=1)]


def _integral(value: Any) -> Any:
    # JSON Schema counts 3.0 as an integer, and so do clients that send every number as a float.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(**constraints: Any) -> Any:
    """A strict integer that also takes an integral float; constraints come first, or the schema loses them."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


# --- structured output -------------------------------------------------------------------------------------


class Grammar(NamedTuple):
    """What a request constrains its output to, as the engine takes it: `kind` json_schema (`spec`: the schema's
    JSON text), json_object, regex (`spec`: the pattern) or choice (`spec`: a JSON array of the strings);
    `field` names the request field it came from, for the message when the engine cannot compile it."""

    kind: str
    spec: str
    field: str


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = _REQUEST

    name: str = Field(description="the schema's name (reported nowhere)")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the answer follows")
    strict: bool | None = Field(None, description="true or false alike: the answer always follows the schema")


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (plain text, any JSON object, or JSON that follows `json_schema.schema`) and TGI's
    chat forms, which carry a `value` (huggingface_hub's InferenceClient sends them): `json` and `json_object` with
    a JSON schema, `regex` with a pattern, `json_schema` with `{"name", "schema"}`."""

    model_config = _REQUEST

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

    model_config = _REQUEST

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
    grammar: _neutral_only(Any, None) = None
    structural_tag: _neutral_only(Any, None) = None
    whitespace_pattern: _neutral_only(Any, None) = None

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


class TGIGrammar(BaseModel):
    """TGI's `parameters.grammar`."""

    model_config = _REQUEST

    type: Literal["json", "regex"]
    value: dict[str, Any] | str = Field(description="json: the JSON schema (an object, or its JSON text); regex: it")

    @model_validator(mode="after")
    def _regex_is_text(self) -> TGIGrammar:
        if self.type == "regex" and not isinstance(self.value, str):
            raise ValueError("a regex grammar's value is a string")
        return self

    def grammar(self) -> Grammar:
        if self.type == "regex":
            return Grammar("regex", str(self.value), "parameters.grammar.value")
        text = self.value if isinstance(self.value, str) else json.dumps(self.value)
        return Grammar("json_schema", text, "parameters.grammar.value")


class ErrorResponse(BaseModel):
    """An error of the native API, as text-generation-inference gives it."""

    error: str = Field(description="what is wrong, in one line")
    error_type: str = Field(
        description="validation, overloaded, generation, timeout, unavailable, not_found, too_large, "
        "unsupported_media_type, method_not_allowed, request_timeout (the body came too slowly) or internal"
    )


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = Field(None, description="our error_type; 404 (as vLLM) for an unknown model")


class OpenAIErrorResponse(BaseModel):
    """An error of the OpenAI API, as OpenAI gives it."""

    error: OpenAIErrorDetail


def _unset(value: Any) -> bool:
    return value is None


def _delta_field(description: str | None = None) -> Any:
    """A field of a streamed delta that is left out of the JSON when None, as OpenAI sends deltas: clients add
    each field of a delta to what they have (the openai SDK copies a `type` even when it is null)."""
    return Field(None, exclude_if=_unset, description=description)


# --- our extension -----------------------------------------------------------------------------------------

_PROVENANCE = (
    "our extension: add `provenance` to every streamed event, saying what proposed each token (the draft, prompt "
    "lookup, the target's correction or bonus token...) and what each target pass did; only when streaming "
    "(docs/service.md, Provenance)"
)


class ProvenanceToken(BaseModel):
    """One generated token and what proposed it."""

    model_config = ConfigDict(serialize_by_alias=True)

    id: int
    text: str = Field(description="the text it added (as the event's token or delta)")
    source: Literal["target", "draft", "lookup", "forced", "correction", "bonus"] = Field(
        description="`draft`: proposed by the model draft and accepted; `lookup`: by prompt lookup, accepted; "
        "`correction`: the target's token in place of the first rejected drafted one; `bonus`: the target's token "
        "after every drafted one was accepted; `target`: the target's token in a pass without a draft; `forced`: "
        "the only token the grammar allowed"
    )
    target_pass: int = Field(serialization_alias="pass", description="which target pass kept it, from 1 (prefill)")
    logprob: float | None = Field(description="its log-probability under the target's raw distribution")


class ProvenancePass(BaseModel):
    """What one target pass of the request did."""

    model_config = ConfigDict(serialize_by_alias=True)

    target_pass: int = Field(serialization_alias="pass", description="from 1: the pass that ended the prefill")
    drafted: int = Field(description="tokens the draft proposed for this pass to verify: the draft length")
    accepted: int = Field(description="of them, the ones the target kept")
    draft_ms: float = Field(description="milliseconds drafting them took")
    verify_ms: float = Field(description="milliseconds the target's pass took (a batch's: the whole batch's)")


class Provenance(BaseModel):
    """Where the tokens of a streamed event came from (with `provenance: true`)."""

    tokens: list[ProvenanceToken] = Field(description="the event's tokens, in order")
    passes: list[ProvenancePass] = Field(description="the target passes whose first token is in this event")


def _provenance_field() -> Any:
    # Left out when None: without the request field a stream is byte for byte what it was without the feature.
    return Field(None, exclude_if=_unset, description="with `provenance: true` only (our extension)")


# A salt is a secret: whoever sends the same salt (with the same API key) reads what this tenant's answers left in
# the caches, through how fast its own come. Short enough to guess, it would be no boundary at all.
MIN_CACHE_SALT = 16
CacheSalt = Annotated[str, Field(min_length=MIN_CACHE_SALT, max_length=256)]
_CACHE_SALT = (
    f"a secret ({MIN_CACHE_SALT}-256 characters; vLLM's cache_salt) naming the tenant within the request's API key: "
    "the prefix cache and the index of earlier answers are used within requests of the same key and salt only, so "
    "that no other tenant's text changes how fast this answer comes"
)


class ContentPart(BaseModel):
    """A text part of a message's (or a prediction's) content."""

    model_config = _REQUEST

    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's predicted output: text the answer will mostly be (a file that a code edit rewrites)."""

    model_config = _REQUEST

    type: Literal["content"]
    content: str | list[ContentPart] = Field(description="the predicted text, or its parts (joined)")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


_PREDICTION = (
    "text the answer will mostly be (OpenAI's predicted outputs: a code edit's file): drafted from wherever the "
    "answer follows it and verified like any draft, so the answer is the same, only sooner; usage reports "
    "completion_tokens_details.accepted_prediction_tokens and rejected_prediction_tokens"
)


class SpeculativeParameters(BaseModel):
    """How to speculate for this request (our extension of both APIs)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    num_draft_tokens: _int(ge=0, le=MAX_DRAFT_TOKENS) | None = Field(
        None, description="tokens drafted per step (0: target only); default: the server's"
    )
    draft: str | None = Field(
        None,
        description="`default`, `none` (target only), `ngram` (prompt lookup), `suffix` (lookups in the request's own "
        "text, its `prediction` and the tenant's earlier answers), `hybrid` (those lookups and the loaded model "
        "draft, the default where there is one) or the name of the loaded draft",
    )
    schedule: Literal["adaptive", "heuristic", "fixed"] | None = Field(
        None,
        description="draft length per step: `adaptive` (the length that maximises expected tokens/s from measured "
        "acceptance and costs; num_draft_tokens is the most), `heuristic` (+2 after a full accept, -1 otherwise) "
        "or `fixed`; default: the server's",
    )
    p_min: float | None = Field(
        None,
        ge=0,
        le=1,
        description="confidence cut-off: a model draft stops below this top probability; "
        "0 turns it off; default: the server's",
    )
    lookup_draft_tokens: _int(ge=0, le=MAX_DRAFT_TOKENS) | None = Field(
        None,
        description="with the adaptive schedule, the most tokens a lookup in text already written (the request's own, "
        "its `prediction`, the tenant's earlier answers) drafts per step, where its measured acceptance pays for "
        "the rows; num_draft_tokens bounds the model draft's; default: the server's (16)",
    )
    sampler: Literal["gumbel", "rejection"] | None = Field(
        None,
        description="how sampled tokens are drawn: `gumbel` (default: each position's noise depends on the seed and "
        "the position only, so a seed gives the same text whatever the draft, its length or the batch) or "
        "`rejection` (the rejection sampler: a model draft is accepted more often, but the text a seed gives "
        "depends on the draft and its lengths); greedy decoding ignores it",
    )

    def params(self) -> dict[str, Any]:
        """The fields of the engine's `GenerationParams` these set (the draft and its length are resolved against
        the server's, `app.api.jobs`)."""
        return {
            "draft_schedule": self.schedule,
            "draft_p_min": self.p_min,
            "sampler": self.sampler or "gumbel",
            "lookup_draft_tokens": self.lookup_draft_tokens,
        }


NO_SPECULATIVE = SpeculativeParameters()


class SpeculativeDetails(BaseModel):
    """What speculation did for this request."""

    draft: str = Field(description="the draft that proposed (`none`: target only)")
    num_draft_tokens: int = Field(description="tokens drafted per step at most")
    drafted: int = Field(description="tokens the draft proposed")
    accepted: int = Field(description="drafted tokens the target accepted")
    forced: int = Field(
        0, description="tokens the grammar allowed alone, proposed without the draft and kept (not in drafted)"
    )
    refused: int = Field(
        0, description="drafted tokens the grammar refused before verification (in drafted, never accepted)"
    )
    target_passes: int = Field(description="target forward passes, prefill included")
    verify_passes: int = Field(description="target passes that verified at least one drafted token")
    acceptance_rate: float = Field(description="accepted / drafted (0 when nothing was drafted)")
    tokens_per_target_pass: float = Field(description="generated tokens / target passes")
    accepted_per_position: list[int] = Field(description="accepted drafted tokens at each draft position")
    schedule: str = Field(description="the draft-length schedule used (`none` without a draft)")
    p_min: float = Field(description="the confidence cut-off used")
    draft_lengths: list[int] = Field(description="[k]: steps that asked the draft for k tokens")
    p_min_stops: int = Field(description="steps whose draft stopped early below p_min")
    draft_sources: dict[str, int] = Field(
        default_factory=dict,
        description="steps whose verified draft came from each source: `model`, or a lookup in `prompt` (the "
        "request's own text), `prediction` or `index` (the tenant's earlier answers)",
    )
    accepted_prediction_tokens: int = Field(0, description="tokens of the prediction drafted and kept")
    rejected_prediction_tokens: int = Field(0, description="tokens of the prediction drafted and rejected")
    sampler: Literal["greedy", "gumbel", "rejection"] = Field(
        description="how tokens were chosen: `greedy`, or the sampler that drew them"
    )


# --- native (TGI) API --------------------------------------------------------------------------------------


class GenerateParameters(BaseModel):
    """Generation parameters, as TGI names them."""

    model_config = _REQUEST

    max_new_tokens: _int(ge=1) | None = Field(
        None, description="most tokens to generate (default: the server's default_max_new_tokens)"
    )
    do_sample: bool = Field(False, description="sample (at temperature 1.0 unless given) instead of greedy decoding")
    temperature: Temperature | None = Field(
        None,
        description="0: greedy; otherwise sampling, asked for even without do_sample unless it is 1.0 (as in TGI)",
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="nucleus sampling mass, in (0, 1]; below 1 it asks for sampling (as in TGI)"
    )
    top_k: _int(ge=1) | None = Field(
        None, description="sample from the k most likely tokens; asks for sampling (as in TGI)"
    )
    seed: _int(ge=0, le=MAX_SEED) | None = Field(
        None, description="seed of sampling: the same seed and parameters give the same text; default: random"
    )
    stop: list[NonEmptyStr] = Field(
        default_factory=list, description="stop strings; the text ends before the first one"
    )
    details: bool = Field(False, description="add `details` to the response")
    return_full_text: bool = Field(False, description="prepend the prompt to `generated_text`")
    decoder_input_details: bool = Field(
        False,
        description="add the prompt's tokens with their log-probabilities to `details.prefill` (not when streaming)",
    )
    top_n_tokens: _int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None,
        description=f"the most likely tokens at each generated position (0..{MAX_LOGPROBS}), with their "
        "log-probabilities: `details.top_tokens`, or each event's `top_tokens` when streaming",
    )
    truncate: _int(ge=1) | None = Field(None, description="keep only the last `truncate` tokens of the prompt")
    # Sent by TGI's client; only their neutral values can be honoured.
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: OpenAIPenalty | None = Field(
        None,
        description="in [-2, 2]: subtracted from a token's logit once per occurrence in the text so far, prompt "
        "included (TGI's scope; OpenAI's formula, without TGI's division by the length); 0: none",
    )
    typical_p: _neutral_only(float | None, None) = None
    best_of: _neutral_only(_int() | None, None, 1) = None
    watermark: _neutral_only(bool, False) = False
    grammar: TGIGrammar | None = Field(None, description="the output follows this JSON schema or regex")
    adapter_id: _neutral_only(str | None, None) = None
    speculative: SpeculativeParameters | None = Field(None, description="our extension: how to speculate")
    provenance: bool = Field(False, description=_PROVENANCE)
    prediction: str | None = Field(
        None, description="our extension: " + _PREDICTION.replace("usage reports ", "details.speculative reports ")
    )
    cache_salt: CacheSalt | None = Field(None, description="our extension: " + _CACHE_SALT)

    @model_validator(mode="after")
    def _sampling_is_consistent(self) -> GenerateParameters:
        if self.do_sample and self.temperature == 0:
            raise ValueError(
                "temperature 0 means greedy decoding but do_sample is true: send a temperature > 0 "
                "(or none, for 1.0), or do_sample false"
            )
        return self

    def to_params(self, stream: bool) -> GenerationParams:
        """The engine's record of these parameters; the route sets what needs the server (the prompt's length, the
        draft's, the tenant). Every token's log-probability where tokens are returned (as TGI gives them: when
        `stream`ing, or with `details`), the prompt's with decoder_input_details: the engine computes them only
        then. Penalties in TGI's scope: frequency counts the prompt's tokens too."""
        shown = stream or self.details
        params = GenerationParams(
            stop=tuple(self.stop),
            penalties=PenaltyParams(
                1.0 if self.repetition_penalty is None else self.repetition_penalty,
                0.0,
                self.frequency_penalty or 0.0,
                count_prompt=True,
            ),
            logprobs=(self.top_n_tokens or 0) if shown else None,
            prompt_logprobs=0 if self.details and self.decoder_input_details and not stream else None,
            **(self.speculative or NO_SPECULATIVE).params(),
        )
        return self._sampled(params)

    def _sampled(self, params: GenerationParams) -> GenerationParams:
        """TGI's rule: `do_sample`, a temperature other than 1.0, `top_k`, or `top_p` below 1 asks for sampling
        (at temperature 1.0 unless given); temperature 0 is greedy whatever else is given (and then top_k, top_p
        and the seed are neutral)."""
        t, top_p = self.temperature, self.top_p
        asked = (
            self.do_sample
            or (t is not None and t != 1.0)
            or self.top_k is not None
            or (top_p is not None and top_p < 1.0)
        )
        if not asked or t == 0:
            return params
        return replace(
            params,
            temperature=1.0 if t is None else t,
            top_k=self.top_k or 0,
            top_p=1.0 if top_p is None else top_p,
            seed=self.seed,
        )


class GenerateRequest(BaseModel):
    """A TGI generation request. Fields of its top level that no field names are kept to be logged, as the OpenAI
    requests' (TGI ignores them)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    inputs: str = Field(description="the prompt, sent as is (no chat template)", json_schema_extra={"minLength": 1})
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = Field(False, description="only for `POST /`: answer as `/generate_stream` does")
    cache_salt: CacheSalt | None = Field(
        None, description="as `parameters.cache_salt`, where vLLM's clients send it; both: they must be the same"
    )

    @model_validator(mode="after")
    def _one_salt(self) -> GenerateRequest:
        top, inner = self.cache_salt, self.parameters.cache_salt
        if top is not None and inner is not None and top != inner:
            raise ValueError("cache_salt and parameters.cache_salt differ: send one of them")
        return self

    def salt(self) -> str | None:
        """The request's cache_salt, wherever it was sent."""
        return self.cache_salt if self.cache_salt is not None else self.parameters.cache_salt

    def ignored_fields(self) -> list[str]:
        """The top-level fields no field names: ignored, and logged (each name as `field_name` shows it)."""
        return [field_name(name) for name in sorted(self.model_extra or {})]


_LOGPROB = "log-probability under the target's raw distribution (log-softmax of its logits, temperature 1)"


class Token(BaseModel):
    id: int
    text: str = Field(
        description="the text this token added (in `tokens`; the texts of all tokens add up to generated_text), or "
        "its own text (in `top_tokens`)"
    )
    logprob: float | None = Field(None, description=_LOGPROB)
    special: bool


class InputToken(BaseModel):
    id: int
    text: str
    logprob: float | None = Field(None, description=f"{_LOGPROB}; null for the first token, which nothing predicts")


class Details(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken] = Field(description="the prompt's tokens when decoder_input_details, else empty")
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = Field(
        None, description="with top_n_tokens: per generated token, the most likely tokens at its position"
    )
    best_of_sequences: None = None
    speculative: SpeculativeDetails


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = Field(None, description="present when parameters.details")


class StreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None
    input_length: int
    speculative: SpeculativeDetails


class StreamResponse(BaseModel):
    """One SSE event of /generate_stream: one token; the last one also carries the text and details."""

    index: int = Field(description="position of the token among the generated ones, from 1")
    token: Token
    top_tokens: list[Token] | None = Field(None, description="with top_n_tokens: the most likely tokens here")
    generated_text: str | None = Field(None, description="the whole text, on the last event only")
    details: StreamDetails | None = Field(None, description="on the last event only, when parameters.details")
    provenance: Provenance | None = _provenance_field()


# --- OpenAI API --------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = _REQUEST

    include_usage: bool = Field(False, description="a last chunk with the usage and no choices")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: with include_usage, every chunk also carries the usage so far"
    )
    include_obfuscation: _neutral_only(bool | None, None, False) = None


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """Every prompt of a completion request, each a string or a list of token ids (one job each)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        if not prompt:
            raise ValueError("must not be empty")
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise ValueError("must not be empty: send a string, a list of strings, token ids or lists of token ids")
    for i, one in enumerate(prompt):
        if not one:
            raise ValueError(f"prompt {i} of the list must not be empty")
    return list(prompt)  # type: ignore[arg-type]


Prompt = Annotated[
    str | list[str] | list[_int()] | list[list[_int()]],
    AfterValidator(_prompts),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                    "minItems": 1,
                },
            ]
        }
    ),
]

# Most choices (prompts x n) of one request, whatever the server's limits; they also count against its places.
MAX_CHOICES = 256
# Most messages of a conversation and tools of a chat request: each is work before admission (every tool's
# schema is compiled to check it, every message rendered), which a 1 MiB body could otherwise multiply by
# thousands. Far above what agents send (OpenAI allows 128 tools).
MAX_MESSAGES = 1024
MAX_TOOLS = 128


# Fields of OpenAI's and vLLM's requests that change nothing in the text: accepted and not used.
OUTPUT_NEUTRAL_FIELDS = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "priority",
        "request_id",
        "include_reasoning",
        "prompt_cache_key",
        "safety_identifier",
    }
)


_GREEDY_N = (
    "n: {n} samples need sampling (temperature > 0); greedy decoding (temperature 0, sent or the server's "
    "default) would give the same text n times"
)

_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")


class _OpenAISampling(BaseModel):
    """The generation parameters both OpenAI endpoints share. Other fields are kept (`model_extra`) so that the
    route can log the ones it ignores, as vLLM does."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    # The most tokens when the request sends none (None: the server's default_max_new_tokens).
    default_max_tokens: ClassVar[int | None] = None

    model: str | None = Field(
        None, description="a served name (GET /v1/models), else 404; may be left out; answers report the served model"
    )
    temperature: Temperature | None = Field(
        None,
        description="> 0 samples, 0 decodes greedily; unset: the server's default (the model's generation config, "
        "else 1.0, as vLLM and OpenAI; see --default-temperature)",
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="nucleus sampling mass, in (0, 1]; only with temperature > 0"
    )
    top_k: _int(ge=1) | None = Field(
        None, description="vLLM's extension: the k most likely tokens; only with temperature > 0"
    )
    seed: _int(ge=-(2**63), le=2**63 - 1) | None = Field(
        None, description="seed of sampling (taken modulo 2**64): the same seed and parameters give the same text"
    )
    n: _int(ge=1, le=MAX_CHOICES) | None = Field(
        None,
        description="samples per prompt (default 1); more than 1 only with temperature > 0: sample i is seeded with "
        "seed + i",
    )
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(
        None, description="stop strings; the text ends before the first one"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: OpenAIPenalty | None = Field(
        None, description="in [-2, 2]: subtracted from the logit of every token already generated; 0: none"
    )
    frequency_penalty: OpenAIPenalty | None = Field(
        None, description="in [-2, 2]: subtracted from a token's logit once per time it was generated; 0: none"
    )
    logit_bias: _neutral_only(dict[str, float] | None, None, {}) = None
    user: str | None = None
    speculative: SpeculativeParameters | None = Field(None, description="our extension: how to speculate")
    provenance: bool = Field(False, description=_PROVENANCE)
    prediction: Prediction | None = Field(None, description=_PREDICTION)
    cache_salt: CacheSalt | None = Field(None, description=_CACHE_SALT)
    # vLLM's extra sampling parameters that are honoured
    ignore_eos: bool = Field(False, description="vLLM's: go on past the end-of-sequence token (to max_tokens)")
    min_tokens: _int(ge=0) = Field(
        0,
        description="vLLM's: until this many tokens were generated, end-of-sequence and stop tokens and stop strings "
        "end nothing",
    )
    stop_token_ids: list[_int(ge=0)] | None = Field(
        None, description="vLLM's: token ids that end the text (finish reason `stop`); their text is not returned"
    )
    include_stop_str_in_output: bool = Field(
        False, description="vLLM's: keep the stop string (or the stop token's text) at the end of the text"
    )
    skip_special_tokens: bool = Field(True, description="vLLM's: false: special tokens' text is part of the text")
    truncate_prompt_tokens: _int(ge=1) | None = Field(
        None, description="vLLM's: keep only the last this many tokens of the prompt"
    )
    prompt_logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None,
        description="vLLM's: each prompt token's log-probability and rank with this many alternatives, in "
        "`prompt_logprobs` (completions: of each choice); not when streaming",
    )
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM's: in log-probabilities, each token as `token_id:<id>` instead of its text"
    )
    # vLLM's parameters that would change the output and are not supported: refused unless neutral (never
    # dropped: a request that asks for them would get another text than it expects)
    repetition_penalty: RepetitionPenalty | None = None
    min_p: _neutral_only(float | None, None, 0.0) = None
    use_beam_search: _neutral_only(bool | None, None, False) = None
    length_penalty: _neutral_only(float | None, None, 1.0) = None
    spaces_between_special_tokens: _neutral_only(bool | None, None, True) = None
    allowed_token_ids: _neutral_only(list[Any] | None, None) = None
    bad_words: _neutral_only(list[Any] | None, None, []) = None
    add_special_tokens: _neutral_only(bool | None, None) = None
    response_format: ResponseFormat | None = Field(
        None,
        description="json_object: any JSON object; json_schema: JSON that follows `json_schema.schema`; TGI's "
        "forms with `value`: json or json_object (a schema), regex (a pattern)",
    )
    guided_json: dict[str, Any] | str | None = Field(
        None, description="vLLM's: the output follows this JSON schema (an object, or its JSON text)"
    )
    guided_regex: str | None = Field(None, description="vLLM's: the output matches this regex, whole")
    guided_choice: list[NonEmptyStr] | None = Field(
        None, min_length=1, description="vLLM's: the output is one of these strings"
    )
    guided_grammar: _neutral_only(Any, None) = None
    guided_decoding_backend: _neutral_only(Any, None) = None
    guided_whitespace_pattern: _neutral_only(Any, None) = None
    structural_tag: _neutral_only(Any, None) = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's newer form of the guided_* fields: one of json, regex, choice, json_object"
    )
    logits_processors: _neutral_only(Any, None) = None
    return_token_ids: _neutral_only(bool | None, None, False) = None
    vllm_xargs: _neutral_only(Any, None) = None
    kv_transfer_params: _neutral_only(Any, None) = None

    @model_validator(mode="after")
    def _n_needs_sampling(self) -> _OpenAISampling:
        if (self.n or 1) > 1 and self.temperature == 0:
            raise ValueError(_GREEDY_N.format(n=self.n))
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when streaming (as vLLM): send stream false")
        if self.provenance and not self.stream:
            raise ValueError("provenance: only for streamed answers: send stream true")
        constraints = [name for name in _CONSTRAINTS if self._constraint(name) is not None]
        if len(constraints) > 1:
            raise ValueError(f"{' and '.join(constraints)}: send one output constraint, not several")
        return self

    def _constraint(self, name: str) -> Any:
        value = getattr(self, name)
        return None if name == "response_format" and value is not None and value.type == "text" else value

    def grammar(self) -> Grammar | None:
        """The output constraint asked for, if any (the validator let one at most through)."""
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.grammar()
        if self.structured_outputs is not None:
            return self.structured_outputs.grammar_spec()
        if self.guided_json is not None:
            g = self.guided_json
            return Grammar("json_schema", g if isinstance(g, str) else json.dumps(g), "guided_json")
        if self.guided_regex is not None:
            return Grammar("regex", self.guided_regex, "guided_regex")
        if self.guided_choice is not None:
            return Grammar("choice", json.dumps(self.guided_choice), "guided_choice")
        return None

    def to_params(self, default_temperature: float) -> GenerationParams:
        """The engine's record of this request (what both OpenAI routes share; each route's class adds its
        log-probabilities); the route sets what needs the server (the prompt's length, the draft's, the tenant).
        Sampling at the request's temperature, or `default_temperature` (the server's) when it sends none;
        greedy at 0 (top_p, top_k and seed then change nothing). Penalties in vLLM's scopes: repetition over
        prompt and generated tokens, presence and frequency over generated ones. Raises ValueError for `n` > 1
        at temperature 0."""
        temperature = self.temperature if self.temperature is not None else default_temperature
        if (self.n or 1) > 1 and temperature == 0:
            raise ValueError(_GREEDY_N.format(n=self.n))
        params = GenerationParams(
            stop=tuple(self.stop_strings()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            penalties=PenaltyParams(
                1.0 if self.repetition_penalty is None else self.repetition_penalty,
                self.presence_penalty or 0.0,
                self.frequency_penalty or 0.0,
            ),
            **(self.speculative or NO_SPECULATIVE).params(),
        )
        if not temperature:
            return params
        return replace(
            params,
            temperature=temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=None if self.seed is None else self.seed & MAX_SEED,  # a negative seed, as two's complement
        )

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def usage_streamed(self) -> tuple[bool, bool]:
        """Whether a stream ends with a usage chunk, and whether every chunk carries the usage so far (vLLM's
        continuous_usage_stats, which it honours only beside include_usage)."""
        options = self.stream_options or StreamOptions()
        return options.include_usage, options.include_usage and options.continuous_usage_stats

    def ignored_fields(self) -> list[str]:
        """The fields of the request that no model field names and that are not known to change nothing (each
        name as `field_name` shows it: they go into a log line)."""
        return [field_name(name) for name in sorted(set(self.model_extra or {}) - OUTPUT_NEUTRAL_FIELDS)]


class CompletionRequest(_OpenAISampling):
    """An OpenAI completion request: the prompt is sent as is."""

    prompt: Prompt = Field(
        description="a string, token ids, or a list of either (several prompts: one choice each, times n)"
    )
    max_tokens: _int(ge=0) | None = Field(
        None,
        description="most tokens to generate (default 16, as OpenAI's, or the server's limit if lower); 0 only "
        "with echo: the prompt alone, with its log-probabilities when asked (lm-eval's loglikelihood)",
    )
    echo: bool = Field(False, description="prepend the prompt to the text (and its tokens to `logprobs`)")
    logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None,
        description=f"0..{MAX_LOGPROBS}: each token's log-probability, with this many most likely alternatives "
        "(and the chosen token) in `top_logprobs`",
    )
    suffix: _neutral_only(str | None, None) = None
    prompt_embeds: _neutral_only(Any, None) = None
    best_of: _int(ge=1, le=MAX_CHOICES) | None = Field(
        None, description="only n (every sample is returned): choosing the best of more samples is not supported"
    )

    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's (or the server's limit, if lower)

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 only with echo true (the prompt alone); otherwise at least 1")
        n = self.n or 1
        if self.best_of is not None and self.best_of != n:
            raise ValueError(
                f"best_of: only best_of = n ({n}) is supported (every sample is returned), got {self.best_of}; "
                "choosing the best of more samples is not"
            )
        return self

    def to_params(self, default_temperature: float) -> GenerationParams:
        """As the shared fields', with this route's log-probabilities: each token's with `logprobs` alternatives
        (0 with provenance alone, which reports each token's: the engine computes them only when asked); the
        prompt's with the most alternatives that echo with logprobs (the prompt's first) and prompt_logprobs ask."""
        echoed = self.logprobs if self.echo else None
        wanted = [n for n in (echoed, self.prompt_logprobs) if n is not None]
        return replace(
            super().to_params(default_temperature),
            logprobs=self.logprobs if self.logprobs is not None or not self.provenance else 0,
            prompt_logprobs=max(wanted) if wanted else None,
        )

    def max_new_tokens(self) -> tuple[int | None, str]:
        """The most tokens asked for (None: `default_max_tokens`) and the field that asked, for messages."""
        return self.max_tokens, "max_tokens"


class CalledFunction(BaseModel):
    model_config = _REQUEST

    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    model_config = _REQUEST

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = _REQUEST

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer` is rendered as `system`; `tool`: a tool's result"
    )
    content: str | list[ContentPart] | None = Field(None, description="text, or a list of text parts")
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant message's tool calls")
    tool_call_id: str | None = Field(None, description="a tool message's: the call it answers")
    # What an assistant message of OpenAI's own answers may carry when a client sends it back: only empty.
    refusal: _neutral_only(str | None, None) = None
    function_call: _neutral_only(Any, None) = None
    audio: _neutral_only(Any, None) = None
    annotations: _neutral_only(list[Any] | None, None, []) = None

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only on an assistant message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="letters, digits, _ . -, at most 64")]


class FunctionDefinition(BaseModel):
    model_config = _REQUEST

    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="the JSON schema of the arguments (default: an object with any properties)"
    )
    strict: bool | None = Field(
        None, description="true or false alike: a forced call's arguments always follow the schema"
    )


class ToolDefinition(BaseModel):
    """A function the model may call (OpenAI's `tools[i]`)."""

    model_config = _REQUEST

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _REQUEST

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the function the answer must call."""

    model_config = _REQUEST

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_OpenAISampling):
    """An OpenAI chat completion request: the messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(
        min_length=1, max_length=MAX_MESSAGES, description=f"the conversation, at most {MAX_MESSAGES} messages"
    )
    max_tokens: _int(ge=1) | None = Field(None, description="most tokens to generate (deprecated name)")
    max_completion_tokens: _int(ge=1) | None = Field(None, description="most tokens to generate")
    logprobs: bool | None = Field(None, description="each generated token's log-probability in `logprobs.content`")
    top_logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description=f"0..{MAX_LOGPROBS}: with logprobs, this many most likely alternatives of each token"
    )
    tools: list[ToolDefinition] | None = Field(
        None,
        max_length=MAX_TOOLS,
        description=f"at most {MAX_TOOLS} functions the model may call: rendered into the prompt, calls answered in "
        "`tool_calls`",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="`auto` (the default with tools): text or calls, as the model writes; `none`: text only; "
        "`required`: one call or more, decoded under a grammar of the tools; a named function: a call of it, its "
        "arguments decoded under its parameters' schema",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call (`required` is then one call, `auto` keeps the first)"
    )
    # vLLM's and OpenAI's chat fields that would change the output and are not supported
    echo: _neutral_only(bool | None, None, False) = None
    add_generation_prompt: _neutral_only(bool | None, None, True) = None
    continue_final_message: _neutral_only(bool | None, None, False) = None
    chat_template: _neutral_only(Any, None) = None
    chat_template_kwargs: _neutral_only(Any, None, {}) = None
    documents: _neutral_only(Any, None) = None
    mm_processor_kwargs: _neutral_only(Any, None) = None
    reasoning_effort: _neutral_only(Any, None) = None
    functions: _neutral_only(Any, None) = None
    function_call: _neutral_only(Any, None) = None
    audio: _neutral_only(Any, None) = None
    modalities: _neutral_only(list[Any] | None, None, ["text"]) = None
    web_search_options: _neutral_only(Any, None) = None
    verbosity: _neutral_only(Any, None) = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: only with logprobs true")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: each function's name must be unique")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice: only with tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice.function.name: {choice.function.name!r} is not one of the tools' functions")
        if self.forced_tool_call():
            constraints = [name for name in _CONSTRAINTS if self._constraint(name) is not None]
            if constraints:
                raise ValueError(
                    f"tool_choice and {constraints[0]}: a required or named tool call is decoded under the tools' "
                    "own grammar; send one output constraint, not several"
                )
        return self

    def to_params(self, default_temperature: float) -> GenerationParams:
        """As the shared fields', with this route's log-probabilities: each token's with `top_logprobs`
        alternatives when `logprobs` (0 with provenance alone, which reports each token's: the engine computes
        them only when asked), and the prompt's with prompt_logprobs."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else 0 if self.provenance else None
        return replace(super().to_params(default_temperature), logprobs=logprobs, prompt_logprobs=self.prompt_logprobs)

    def max_new_tokens(self) -> tuple[int | None, str]:
        """The most tokens asked for (None: the server's default) and the field that asked, for messages:
        max_tokens is the deprecated name, and the new one wins when both are given."""
        if self.max_completion_tokens:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def tool_mode(self) -> str:
        """`none`, `auto`, `required` or `named` (`none` also without tools)."""
        if not self.tools:
            return "none"
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        return choice or "auto"

    def forced_tool_call(self) -> bool:
        return self.tool_mode() in ("required", "named")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose keys and values came from the prefix cache")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(description="tokens of the prediction that were drafted and kept")
    rejected_prediction_tokens: int = Field(
        description="tokens of the prediction that were drafted and rejected (they cost rows, not tokens)"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(
        None, description="as OpenAI's: how many prompt tokens the prefix cache served (on final usage)"
    )
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="as OpenAI's: how much of the request's `prediction` the answers kept (0s without one)"
    )


class CompletionLogprobs(BaseModel):
    """The log-probabilities of a completion's tokens (the echoed prompt's first), as OpenAI's legacy format."""

    tokens: list[str] = Field(description="each token's own text (or `token_id:<id>`)")
    token_logprobs: list[float | None] = Field(description=f"{_LOGPROB}; null for the prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(
        description="per token, the `logprobs` most likely tokens and the chosen one: text -> log-probability"
    )
    text_offset: list[int] = Field(description="where each token's text begins in `text`")


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`."""

    logprob: float
    rank: int = Field(description="1: the most likely token at this position")
    decoded_token: str


# Per prompt token (null for the first): token id -> its entry, the prompt's token and the most likely ones.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = Field(None, description="when the request sent `logprobs`")
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's: when the request sent prompt_logprobs")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    seed: int | None = Field(
        None, description="our extension: the seed sampling used (the request's or a random one; null when greedy)"
    )
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: SpeculativeDetails | None = Field(None, description="our extension (on the last chunk too)")
    provenance: Provenance | None = _provenance_field()


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    id: str = Field(description="`call_` and 24 hex digits")
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="the text; null when the answer is tool calls alone")
    tool_calls: list[ToolCall] | None = Field(None, description="the functions the answer calls, when any")


class TopLogprob(BaseModel):
    token: str = Field(description="the token's own text (or `token_id:<id>`)")
    logprob: float = Field(description=_LOGPROB)
    bytes: list[int] | None = Field(description="the UTF-8 bytes of `token`")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the `top_logprobs` most likely tokens at this position")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = Field(None, description="with `logprobs: true`: one per generated token")
    finish_reason: Literal["stop", "length", "tool_calls"] = Field(
        description="`tool_calls` when the answer ended as it should with tool calls"
    )


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    seed: int | None = Field(
        None, description="our extension: the seed sampling used (the request's or a random one; null when greedy)"
    )
    choices: list[ChatChoice]
    usage: Usage
    speculative: SpeculativeDetails
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's: when the request sent prompt_logprobs")


class FunctionCallDelta(BaseModel):
    name: str | None = _delta_field("on a call's first delta only")
    arguments: str = Field(description="the next piece of the arguments' JSON text")


class ToolCallDelta(BaseModel):
    index: int = Field(description="which call of the answer this piece belongs to (one entry per call per chunk)")
    id: str | None = _delta_field("on a call's first delta only")
    type: Literal["function"] | None = _delta_field("on a call's first delta only")
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _delta_field("on each choice's first chunk only")
    content: str | None = _delta_field()
    tool_calls: list[ToolCallDelta] | None = _delta_field()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = Field(None, description="with `logprobs: true`: this chunk's tokens")
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE ``data:`` chunk of a streamed chat completion; the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    seed: int | None = Field(
        None, description="our extension: the seed sampling used (the request's or a random one; null when greedy)"
    )
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative: SpeculativeDetails | None = None
    provenance: Provenance | None = _provenance_field()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    root: str = Field(description="the target as the server was given it (catalog name or path), as vLLM's `root`")
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- operations --------------------------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok", "loading", "failed", "draining"]
    error: str | None = Field(None, description="why loading failed, or why the worker is gone")


class Info(BaseModel):
    """The served models and the limits requests are held to."""

    model_id: str
    served_model_name: str = Field(description="the model id the OpenAI answers report")
    served_model_names: list[str] = Field(
        description="every `model` the OpenAI routes accept: served_model_name, then its aliases"
    )
    model_dtype: str
    model_device_type: str
    model_weights: str = Field(
        description="what the target's weights run as: `bfloat16`, `float32`, or the GGUF formats computed on as "
        "the file's blocks (`Q8_0+Q4_1`; `+bfloat16` where some matrices are not), see --weights"
    )
    model_weight_bytes: int = Field(description="bytes the target's weights hold in memory")
    cpu_kernel: str = Field(
        description="what runs the target's products and attention: amxint8, amx, avx512vnni, avx512, avxvnni, "
        "avx2 or generic (specserve's kernels, each row independent of the batch), torch (oneDNN and SDPA), or the "
        "device type off the CPU"
    )
    batched_decoding: bool = Field(
        description="whether requests share target forwards; off where a row's bits would depend on the batch"
    )
    draft: str = Field(description="the default draft")
    available_drafts: list[str]
    num_draft_tokens: int = Field(description="k, tokens drafted per step by default")
    draft_schedule: str = Field(description="the default draft-length schedule")
    draft_p_min: float = Field(description="the default confidence cut-off of model drafts")
    max_input_tokens: int
    max_new_tokens: int
    max_total_tokens: int = Field(description="the model's context")
    max_stop_sequences: int
    max_concurrent_requests: int = Field(description="the most generations running at once")
    kv_cache_memory_bytes: int = Field(
        description="the KV-cache budget in bytes: requests are admitted while their caches fit in it together "
        "(kv_cache_memory; `auto` resolved at start-up)"
    )
    max_queue_size: int
    prefix_cache_bytes: int = Field(
        description="memory the automatic prefix cache may hold (--prefix-cache-mb); 0: off (or rows depend on the "
        "batch: torch's path, a device)"
    )
    prefix_cache_used_bytes: int | None = Field(
        description="memory the prefix cache holds now; null on a server with API keys (see suffix_index_answers)"
    )
    suffix_index_bytes: int = Field(
        0, description="memory the index of earlier answers may hold (--suffix-index-mb); 0: none kept"
    )
    suffix_index_used_bytes: int | None = Field(
        0, description="memory the index of earlier answers holds now; null on a server with API keys"
    )
    suffix_index_answers: int | None = Field(
        0,
        description="answers the index holds now, all tenants together; null on a server with API keys, where "
        "every key reads /info and the change between two reads would be another tenant's answers and their size "
        "(the totals are in /metrics, the operator's)",
    )
    request_timeout: float
    version: str


# --- vLLM's tokenizer routes ------------------------------------------------------------------------------


class TokenizeRequest(BaseModel):
    """vLLM's tokenize request: a `prompt`, or chat `messages` rendered with the model's chat template."""

    model_config = _REQUEST

    model: str | None = Field(None, description="a served name, or none")
    prompt: str | None = Field(None, description="the text to tokenize, as a completion's prompt")
    messages: list[ChatMessage] | None = Field(
        None,
        min_length=1,
        max_length=MAX_MESSAGES,
        description=f"a conversation (at most {MAX_MESSAGES} messages), as chat renders it",
    )
    add_special_tokens: bool | None = Field(
        None,
        description="the tokenizer's own special tokens (BOS where the model adds it); default: true for a prompt, "
        "false for messages (the template writes them), as vLLM",
    )
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's turn opening")
    return_token_strs: bool = Field(False, description="also each token's own text in `token_strs`")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send prompt or messages, one of them")
        return self


class TokenizeResponse(BaseModel):
    count: int = Field(description="how many tokens")
    max_model_len: int = Field(description="the model's context, in tokens")
    tokens: list[int]
    token_strs: list[str] | None = Field(None, description="with return_token_strs: each token's own text")


class DetokenizeRequest(BaseModel):
    """vLLM's detokenize request."""

    model_config = _REQUEST

    model: str | None = Field(None, description="a served name, or none")
    tokens: list[Annotated[int, Field(ge=0)]] = Field(description="token ids of the served model")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the text of the tokens (special tokens shown)")


class TokenizerInfo(BaseModel):
    """What vLLM's /tokenizer_info says of the tokenizer: its special tokens and chat template."""

    tokenizer_class: Literal["PreTrainedTokenizerFast"] = "PreTrainedTokenizerFast"
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    add_bos_token: bool
    chat_template: str | None
    model_max_length: int
    vocab_size: int
