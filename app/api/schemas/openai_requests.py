"""The OpenAI API's requests (/v1/completions, /v1/chat/completions), with vLLM's extra fields: each builds
the engine's record itself (`to_params`)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from app.api.errors import field_name
from app.api.schemas.common import (
    CACHE_SALT_HELP,
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
from app.api.schemas.extensions import NO_SPECULATIVE, PROVENANCE_HELP, SpeculativeParameters
from app.api.schemas.structured import Grammar, ResponseFormat, StructuredOutputs
from app.engine.decoding.penalties import PenaltyParams
from app.engine.defaults import MAX_LOGPROBS
from app.engine.step import GenerationParams


class ContentPart(BaseModel):
    """A text part of a message's (or a prediction's) content."""

    model_config = REQUEST_CONFIG

    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's predicted output: text the answer will mostly be (a file that a code edit rewrites)."""

    model_config = REQUEST_CONFIG

    type: Literal["content"]
    content: str | list[ContentPart] = Field(description="the predicted text, or its parts (joined)")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool = Field(False, description="a last chunk with the usage and no choices")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: with include_usage, every chunk also carries the usage so far"
    )
    include_obfuscation: neutral_only(bool | None, None, False) = None


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
    str | list[str] | list[integer()] | list[list[integer()]],
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
    top_k: integer(ge=1) | None = Field(
        None, description="vLLM's extension: the k most likely tokens; only with temperature > 0"
    )
    seed: integer(ge=-(2**63), le=2**63 - 1) | None = Field(
        None, description="seed of sampling (taken modulo 2**64): the same seed and parameters give the same text"
    )
    n: integer(ge=1, le=MAX_CHOICES) | None = Field(
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
    logit_bias: neutral_only(dict[str, float] | None, None, {}) = None
    user: str | None = None
    speculative: SpeculativeParameters | None = Field(None, description="our extension: how to speculate")
    provenance: bool = Field(False, description=PROVENANCE_HELP)
    prediction: Prediction | None = Field(None, description=PREDICTION_HELP)
    cache_salt: CacheSalt | None = Field(None, description=CACHE_SALT_HELP)
    # vLLM's extra sampling parameters that are honoured
    ignore_eos: bool = Field(False, description="vLLM's: go on past the end-of-sequence token (to max_tokens)")
    min_tokens: integer(ge=0) = Field(
        0,
        description="vLLM's: until this many tokens were generated, end-of-sequence and stop tokens and stop strings "
        "end nothing",
    )
    stop_token_ids: list[integer(ge=0)] | None = Field(
        None, description="vLLM's: token ids that end the text (finish reason `stop`); their text is not returned"
    )
    include_stop_str_in_output: bool = Field(
        False, description="vLLM's: keep the stop string (or the stop token's text) at the end of the text"
    )
    skip_special_tokens: bool = Field(True, description="vLLM's: false: special tokens' text is part of the text")
    truncate_prompt_tokens: integer(ge=1) | None = Field(
        None, description="vLLM's: keep only the last this many tokens of the prompt"
    )
    prompt_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
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
    min_p: neutral_only(float | None, None, 0.0) = None
    use_beam_search: neutral_only(bool | None, None, False) = None
    length_penalty: neutral_only(float | None, None, 1.0) = None
    spaces_between_special_tokens: neutral_only(bool | None, None, True) = None
    allowed_token_ids: neutral_only(list[Any] | None, None) = None
    bad_words: neutral_only(list[Any] | None, None, []) = None
    add_special_tokens: neutral_only(bool | None, None) = None
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
    guided_grammar: neutral_only(Any, None) = None
    guided_decoding_backend: neutral_only(Any, None) = None
    guided_whitespace_pattern: neutral_only(Any, None) = None
    structural_tag: neutral_only(Any, None) = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's newer form of the guided_* fields: one of json, regex, choice, json_object"
    )
    logits_processors: neutral_only(Any, None) = None
    return_token_ids: neutral_only(bool | None, None, False) = None
    vllm_xargs: neutral_only(Any, None) = None
    kv_transfer_params: neutral_only(Any, None) = None

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
    max_tokens: integer(ge=0) | None = Field(
        None,
        description="most tokens to generate (default 16, as OpenAI's, or the server's limit if lower); 0 only "
        "with echo: the prompt alone, with its log-probabilities when asked (lm-eval's loglikelihood)",
    )
    echo: bool = Field(False, description="prepend the prompt to the text (and its tokens to `logprobs`)")
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
        None,
        description=f"0..{MAX_LOGPROBS}: each token's log-probability, with this many most likely alternatives "
        "(and the chosen token) in `top_logprobs`",
    )
    suffix: neutral_only(str | None, None) = None
    prompt_embeds: neutral_only(Any, None) = None
    best_of: integer(ge=1, le=MAX_CHOICES) | None = Field(
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
    model_config = REQUEST_CONFIG

    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    model_config = REQUEST_CONFIG

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer` is rendered as `system`; `tool`: a tool's result"
    )
    content: str | list[ContentPart] | None = Field(None, description="text, or a list of text parts")
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant message's tool calls")
    tool_call_id: str | None = Field(None, description="a tool message's: the call it answers")
    # What an assistant message of OpenAI's own answers may carry when a client sends it back: only empty.
    refusal: neutral_only(str | None, None) = None
    function_call: neutral_only(Any, None) = None
    audio: neutral_only(Any, None) = None
    annotations: neutral_only(list[Any] | None, None, []) = None

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
    model_config = REQUEST_CONFIG

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

    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = REQUEST_CONFIG

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the function the answer must call."""

    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_OpenAISampling):
    """An OpenAI chat completion request: the messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(
        min_length=1, max_length=MAX_MESSAGES, description=f"the conversation, at most {MAX_MESSAGES} messages"
    )
    max_tokens: integer(ge=1) | None = Field(None, description="most tokens to generate (deprecated name)")
    max_completion_tokens: integer(ge=1) | None = Field(None, description="most tokens to generate")
    logprobs: bool | None = Field(None, description="each generated token's log-probability in `logprobs.content`")
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
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
    echo: neutral_only(bool | None, None, False) = None
    add_generation_prompt: neutral_only(bool | None, None, True) = None
    continue_final_message: neutral_only(bool | None, None, False) = None
    chat_template: neutral_only(Any, None) = None
    chat_template_kwargs: neutral_only(Any, None, {}) = None
    documents: neutral_only(Any, None) = None
    mm_processor_kwargs: neutral_only(Any, None) = None
    reasoning_effort: neutral_only(Any, None) = None
    functions: neutral_only(Any, None) = None
    function_call: neutral_only(Any, None) = None
    audio: neutral_only(Any, None) = None
    modalities: neutral_only(list[Any] | None, None, ["text"]) = None
    web_search_options: neutral_only(Any, None) = None
    verbosity: neutral_only(Any, None) = None

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
