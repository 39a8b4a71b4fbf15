"""The OpenAI API's responses: completions, chat completions and their streamed chunks, the models, and its
errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.api.schemas.common import LOGPROB_HELP, omitted_if_none
from app.api.schemas.extensions import Provenance, SpeculativeDetails, provenance_field


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = Field(None, description="our error_type; 404 (as vLLM) for an unknown model")


class OpenAIErrorResponse(BaseModel):
    """An error of the OpenAI API, as OpenAI gives it."""

    error: OpenAIErrorDetail


def _delta_field(description: str | None = None) -> Any:
    """A field of a streamed delta that is left out of the JSON when None, as OpenAI sends deltas: clients add
    each field of a delta to what they have (the openai SDK copies a `type` even when it is null)."""
    return omitted_if_none(description)


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
    token_logprobs: list[float | None] = Field(description=f"{LOGPROB_HELP}; null for the prompt's first token")
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
    provenance: Provenance | None = provenance_field()


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
    logprob: float = Field(description=LOGPROB_HELP)
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
    provenance: Provenance | None = provenance_field()


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
