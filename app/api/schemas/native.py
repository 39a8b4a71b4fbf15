"""The native API's wire format, compatible with text-generation-inference: /generate's request and
response, /generate_stream's events, and its errors."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.api.errors import field_name
from app.api.schemas.common import (
    CACHE_SALT_HELP,
    LOGPROB_HELP,
    MAX_SEED,
    PREDICTION_HELP,
    REQUEST_CONFIG,
    CacheSalt,
    NonEmptyStr,
    OpenAIPenalty,
    RepetitionPenalty,
    Temperature,
    integer,
    neutral_only,
)
from app.api.schemas.extensions import (
    NO_SPECULATIVE,
    PROVENANCE_HELP,
    Provenance,
    SpeculativeDetails,
    SpeculativeParameters,
    provenance_field,
)
from app.api.schemas.structured import Grammar
from app.engine.decoding.penalties import PenaltyParams
from app.engine.defaults import MAX_LOGPROBS
from app.engine.step import GenerationParams


class TGIGrammar(BaseModel):
    """TGI's `parameters.grammar`."""

    model_config = REQUEST_CONFIG

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


class GenerateParameters(BaseModel):
    """Generation parameters, as TGI names them."""

    model_config = REQUEST_CONFIG

    max_new_tokens: integer(ge=1) | None = Field(
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
    top_k: integer(ge=1) | None = Field(
        None, description="sample from the k most likely tokens; asks for sampling (as in TGI)"
    )
    seed: integer(ge=0, le=MAX_SEED) | None = Field(
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
    top_n_tokens: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
        None,
        description=f"the most likely tokens at each generated position (0..{MAX_LOGPROBS}), with their "
        "log-probabilities: `details.top_tokens`, or each event's `top_tokens` when streaming",
    )
    truncate: integer(ge=1) | None = Field(None, description="keep only the last `truncate` tokens of the prompt")
    # Sent by TGI's client; only their neutral values can be honoured.
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: OpenAIPenalty | None = Field(
        None,
        description="in [-2, 2]: subtracted from a token's logit once per occurrence in the text so far, prompt "
        "included (TGI's scope; OpenAI's formula, without TGI's division by the length); 0: none",
    )
    typical_p: neutral_only(float | None, None) = None
    best_of: neutral_only(integer() | None, None, 1) = None
    watermark: neutral_only(bool, False) = False
    grammar: TGIGrammar | None = Field(None, description="the output follows this JSON schema or regex")
    adapter_id: neutral_only(str | None, None) = None
    speculative: SpeculativeParameters | None = Field(None, description="our extension: how to speculate")
    provenance: bool = Field(False, description=PROVENANCE_HELP)
    prediction: str | None = Field(
        None, description="our extension: " + PREDICTION_HELP.replace("usage reports ", "details.speculative reports ")
    )
    cache_salt: CacheSalt | None = Field(None, description="our extension: " + CACHE_SALT_HELP)

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


class Token(BaseModel):
    id: int
    text: str = Field(
        description="the text this token added (in `tokens`; the texts of all tokens add up to generated_text), or "
        "its own text (in `top_tokens`)"
    )
    logprob: float | None = Field(None, description=LOGPROB_HELP)
    special: bool


class InputToken(BaseModel):
    id: int
    text: str
    logprob: float | None = Field(None, description=f"{LOGPROB_HELP}; null for the first token, which nothing predicts")


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
    provenance: Provenance | None = provenance_field()
