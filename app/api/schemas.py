"""The wire formats: requests and responses of the native (TGI) API, the OpenAI API and the operations routes.

Requests are validated strictly (a string is not a number, NaN is not a temperature) so that a wrong type is
a 4xx naming the field, never a guess. Fields that TGI's and OpenAI's clients always send are accepted at
their neutral values and refused, with a message, at any value we cannot honour. Unknown fields are ignored,
as TGI and OpenAI ignore them, except inside our own ``speculative`` object.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_DRAFT_TOKENS = 16

_REQUEST = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class ErrorResponse(BaseModel):
    """An error of the native API, as text-generation-inference gives it."""

    error: str = Field(description="what is wrong, in one line")
    error_type: str = Field(
        description="validation, overloaded, generation, timeout, unavailable, not_found, too_large, "
        "unsupported_media_type, method_not_allowed or internal"
    )


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(BaseModel):
    """An error of the OpenAI API, as OpenAI gives it."""

    error: OpenAIErrorDetail


# --- our extension -----------------------------------------------------------------------------------------


class SpeculativeParameters(BaseModel):
    """How to speculate for this request (our extension of both APIs)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    num_draft_tokens: int | None = Field(
        None, ge=0, le=MAX_DRAFT_TOKENS, description="tokens drafted per step (0: target only); default: the server's"
    )
    draft: str | None = Field(
        None, description="`default`, `none` (target only), `ngram` (prompt lookup) or the name of the loaded draft"
    )


class SpeculativeDetails(BaseModel):
    """What speculation did for this request."""

    draft: str = Field(description="the draft that proposed (`none`: target only)")
    num_draft_tokens: int = Field(description="tokens drafted per step at most")
    drafted: int = Field(description="tokens the draft proposed")
    accepted: int = Field(description="drafted tokens the target accepted")
    target_passes: int = Field(description="target forward passes, prefill included")
    verify_passes: int = Field(description="target passes that verified at least one drafted token")
    acceptance_rate: float = Field(description="accepted / drafted (0 when nothing was drafted)")
    tokens_per_target_pass: float = Field(description="generated tokens / target passes")
    accepted_per_position: list[int] = Field(description="accepted drafted tokens at each draft position")


# --- native (TGI) API --------------------------------------------------------------------------------------


class GenerateParameters(BaseModel):
    """Generation parameters, as TGI names them."""

    model_config = _REQUEST

    max_new_tokens: int | None = Field(
        None, ge=1, description="most tokens to generate (default: the server's default_max_new_tokens)"
    )
    do_sample: bool = Field(False, description="sample instead of greedy decoding (not supported yet)")
    temperature: float | None = Field(None, ge=0, description="> 0 asks for sampling (not supported yet)")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling mass, in (0, 1]")
    top_k: int | None = Field(None, ge=1, description="sample from the k most likely tokens")
    seed: int | None = Field(None, ge=0, le=2**64 - 1, description="random seed of sampling")
    stop: list[str] = Field(default_factory=list, description="stop strings; the text ends before the first one")
    details: bool = Field(False, description="add `details` to the response")
    return_full_text: bool = Field(False, description="prepend the prompt to `generated_text`")
    decoder_input_details: bool = Field(False, description="add the prompt's tokens to `details.prefill`")
    truncate: int | None = Field(None, ge=1, description="keep only the last `truncate` tokens of the prompt")
    # Sent by TGI's client; only their neutral values can be honoured.
    repetition_penalty: float | None = Field(None, description="only null or 1.0 (not supported)")
    frequency_penalty: float | None = Field(None, description="only null or 0.0 (not supported)")
    typical_p: float | None = Field(None, description="only null (not supported)")
    best_of: int | None = Field(None, description="only null or 1 (not supported)")
    watermark: bool = Field(False, description="only false (not supported)")
    top_n_tokens: int | None = Field(None, description="only null or 0 (not supported)")
    grammar: dict[str, Any] | None = Field(None, description="only null (not supported)")
    adapter_id: str | None = Field(None, description="only null (not supported)")
    speculative: SpeculativeParameters | None = Field(None, description="our extension: how to speculate")

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop


class GenerateRequest(BaseModel):
    """A TGI generation request."""

    model_config = _REQUEST

    inputs: str = Field(description="the prompt, sent as is (no chat template)")
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = Field(False, description="only for `POST /`: answer as `/generate_stream` does")


class Token(BaseModel):
    id: int
    text: str = Field(description="the text this token added; the texts of all tokens add up to generated_text")
    logprob: float | None = Field(None, description="not computed (always null)")
    special: bool


class InputToken(BaseModel):
    id: int
    text: str
    logprob: float | None = Field(None, description="not computed (always null)")


class Details(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken] = Field(description="the prompt's tokens when decoder_input_details, else empty")
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None
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
    top_tokens: list[Token] | None = None
    generated_text: str | None = Field(None, description="the whole text, on the last event only")
    details: StreamDetails | None = Field(None, description="on the last event only, when parameters.details")


# --- OpenAI API --------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = _REQUEST

    include_usage: bool = False


class _OpenAISampling(BaseModel):
    """The generation parameters both OpenAI endpoints share."""

    model_config = _REQUEST

    model: str | None = Field(None, description="any name is accepted; responses report the served model")
    temperature: float | None = Field(None, ge=0, le=2, description="> 0 asks for sampling (not supported yet)")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, description="vLLM's extension")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int | None = Field(None, ge=1, le=1, description="only 1")
    stop: str | list[str] | None = Field(None, description="stop strings; the text ends before the first one")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="only 0 (not supported)")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="only 0 (not supported)")
    logit_bias: dict[str, float] | None = Field(None, description="only null or empty (not supported)")
    user: str | None = None
    speculative: SpeculativeParameters | None = Field(None, description="our extension: how to speculate")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_OpenAISampling):
    """An OpenAI completion request: the prompt is sent as is."""

    prompt: str | list[str] | list[int] = Field(
        description="a string, a list holding one string, or a list of token ids"
    )
    max_tokens: int | None = Field(16, ge=1, description="most tokens to generate (OpenAI's default: 16)")
    echo: bool = Field(False, description="prepend the prompt to the text")
    logprobs: int | None = Field(None, description="only null (not supported)")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1")
    suffix: str | None = Field(None, description="only null (not supported)")


class ContentPart(BaseModel):
    model_config = _REQUEST

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _REQUEST

    role: Literal["system", "developer", "user", "assistant"] = Field(description="`developer` is rendered as `system`")
    content: str | list[ContentPart] | None = Field(None, description="text, or a list of text parts")
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAISampling):
    """An OpenAI chat completion request: the messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate (deprecated name)")
    max_completion_tokens: int | None = Field(None, ge=1, description="most tokens to generate")
    logprobs: bool | None = Field(None, description="only null or false (not supported)")
    top_logprobs: int | None = Field(None, description="only null (not supported)")
    tools: list[Any] | None = Field(None, description="only null or empty (not supported)")
    tool_choice: Any = Field(None, description="only null or `none` (not supported)")
    response_format: dict[str, Any] | None = Field(None, description="only null or {type: text}")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: SpeculativeDetails | None = Field(None, description="our extension (on the last chunk too)")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: SpeculativeDetails


class ChatDelta(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE ``data:`` chunk of a streamed chat completion; the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative: SpeculativeDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- operations --------------------------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok", "loading", "failed"]
    error: str | None = Field(None, description="why loading failed")


class Info(BaseModel):
    """The served models and the limits requests are held to."""

    model_id: str
    served_model_name: str
    model_dtype: str
    model_device_type: str
    draft: str = Field(description="the default draft")
    available_drafts: list[str]
    num_draft_tokens: int = Field(description="k, tokens drafted per step by default")
    max_input_tokens: int
    max_new_tokens: int
    max_total_tokens: int = Field(description="the model's context")
    max_stop_sequences: int
    max_concurrent_requests: int
    max_queue_size: int
    request_timeout: float
    version: str
