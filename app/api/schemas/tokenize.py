"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from app.api.schemas.common import REQUEST_CONFIG
from app.api.schemas.openai_requests import MAX_MESSAGES, ChatMessage


class TokenizeRequest(BaseModel):
    """vLLM's tokenize request: a `prompt`, or chat `messages` rendered with the model's chat template."""

    model_config = REQUEST_CONFIG

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

    model_config = REQUEST_CONFIG

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
