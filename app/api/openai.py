"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions and /v1/models.

A streamed answer is ``data:`` chunks, one per token that adds text, the last one with the finish reason,
then (with ``stream_options.include_usage``) a chunk with the usage and no choices, then ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from app.api import jobs
from app.api.deps import get_runtime, get_settings
from app.api.errors import APIError, documented_errors, error_body
from app.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIErrorResponse,
    Usage,
)
from app.engine.tokenizer import TokenizerError
from app.runtime import Runtime
from app.settings import Settings
from app.worker import Finished, RequestFailed, Ticket

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])

_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
_FINGERPRINT = "specserve"

_ERRORS = documented_errors(OpenAIErrorResponse, 400)


def _ok(model: type, chunk: type, what: str) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": f"the {what}; with `stream: true`, server-sent `data:` events each holding a "
            f"{chunk.__name__}, ending with `data: [DONE]`",
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}},
                "text/event-stream": {
                    "itemSchema": jobs.sse_item_schema(
                        {
                            "anyOf": [
                                {"$ref": f"#/components/schemas/{chunk.__name__}"},
                                {"$ref": "#/components/schemas/OpenAIErrorResponse"},
                            ]
                        },
                        literal="[DONE]",
                    )
                },
            },
        }
    }


Runtime_ = Annotated[Runtime, Depends(get_runtime)]
Settings_ = Annotated[Settings, Depends(get_settings)]


def _usage(finished: Finished) -> Usage:
    return Usage(
        prompt_tokens=finished.prompt_tokens,
        completion_tokens=finished.generated_tokens,
        total_tokens=finished.prompt_tokens + finished.generated_tokens,
    )


def _stream(
    ticket: Ticket,
    prepared: jobs.Prepared,
    chunk: Callable[[str | None, str | None], CompletionResponse | ChatCompletionChunk],
    include_usage: bool,
    first: CompletionResponse | None = None,
) -> StreamingResponse:
    """SSE of one generation: `chunk(text, finish_reason)` per step that adds text (a speculative step's
    accepted tokens share one chunk, as vLLM sends them: one event to write and parse instead of one per
    token), the last with the reason and the speculative figures, then the usage when asked, then ``[DONE]``."""

    async def events() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield jobs.sse(first)
            async for step in ticket.events():
                text = "".join(tok.text for tok in step.tokens)
                if step.finished is not None:
                    event = chunk(text, _FINISH[step.finished.finish_reason])
                    event.speculative = jobs.speculative_details(prepared, step.finished)
                    yield jobs.sse(event)
                    if include_usage:
                        usage = chunk(None, None)
                        usage.choices, usage.usage = [], _usage(step.finished)
                        yield jobs.sse(usage)
                elif text:
                    yield jobs.sse(chunk(text, None))
        except RequestFailed as exc:
            yield jobs.sse(error_body(exc.kind, exc.message, openai=True))
        finally:
            ticket.cancel()
        yield jobs.sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=jobs.SSE_HEADERS)


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses={**_ok(CompletionResponse, CompletionResponse, "completion"), **_ERRORS},
    summary="Complete a prompt (OpenAI completions)",
)
async def completions(request: Request, body: CompletionRequest, runtime: Runtime_, settings: Settings_) -> Response:
    """Continue `prompt`, sent as is (no chat template): greedily unless temperature > 0."""
    prompt: str | list[int] = body.prompt  # type: ignore[assignment]  # one prompt, by its validator
    spec = jobs.JobSpec(
        prompt=prompt,
        max_new_tokens=body.max_tokens,
        stop=body.stop_strings(),
        speculative=body.speculative,
        prompt_field="prompt",
        max_new_tokens_field="max_tokens",
        default_max_new_tokens=16,
        sampling=body.sampling(),
    )
    prepared = await jobs.prepare(runtime, settings, spec)
    ticket = jobs.submit(runtime, settings, prepared)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), runtime.info.served_model_name
    echo = prompt if body.echo and isinstance(prompt, str) else ""

    def chunk(text: str | None, finish: str | None) -> CompletionResponse:
        choice = CompletionChoice(text=text or "", finish_reason=finish)  # type: ignore[arg-type]
        return CompletionResponse(
            id=rid, created=created, model=model, system_fingerprint=_FINGERPRINT, choices=[choice]
        )

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # The echoed prompt goes first, as a chunk of its own.
        return _stream(ticket, prepared, chunk, include_usage, first=chunk(echo, None) if echo else None)
    try:
        _, finished = await jobs.run_to_end(ticket, request)
    except jobs.ClientGone:
        return Response(status_code=499)
    result = chunk(echo + finished.text, _FINISH[finished.finish_reason])
    result.usage = _usage(finished)
    result.speculative = jobs.speculative_details(prepared, finished)
    return Response(result.model_dump_json(), media_type="application/json")


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**_ok(ChatCompletionResponse, ChatCompletionChunk, "chat completion"), **_ERRORS},
    summary="Answer a conversation (OpenAI chat completions)",
)
async def chat_completions(
    request: Request, body: ChatCompletionRequest, runtime: Runtime_, settings: Settings_
) -> Response:
    """Render `messages` with the model's chat template and answer as the assistant: greedily unless
    temperature > 0."""
    jobs.check_max_new_tokens(body.max_tokens, "max_tokens", settings)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        prompt = runtime.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TokenizerError as exc:
        raise APIError("validation", f"messages: {exc}") from exc
    spec = jobs.JobSpec(
        prompt=prompt,
        # max_tokens is the deprecated name: the new one wins when both are given.
        max_new_tokens=body.max_completion_tokens or body.max_tokens,
        stop=body.stop_strings(),
        speculative=body.speculative,
        prompt_field="messages",
        max_new_tokens_field="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        sampling=body.sampling(),
    )
    prepared = await jobs.prepare(runtime, settings, spec)
    ticket = jobs.submit(runtime, settings, prepared)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), runtime.info.served_model_name

    def chunk(text: str | None, finish: str | None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=ChatDelta(content=text), finish_reason=finish)  # type: ignore[arg-type]
        return ChatCompletionChunk(
            id=rid, created=created, model=model, system_fingerprint=_FINGERPRINT, choices=[choice]
        )

    if body.stream:
        return _stream(ticket, prepared, chunk, bool(body.stream_options and body.stream_options.include_usage))
    try:
        _, finished = await jobs.run_to_end(ticket, request)
    except jobs.ClientGone:
        return Response(status_code=499)
    result = ChatCompletionResponse(
        id=rid,
        created=created,
        model=model,
        system_fingerprint=_FINGERPRINT,
        choices=[
            ChatChoice(
                message=AssistantMessage(content=finished.text),
                finish_reason=_FINISH[finished.finish_reason],  # type: ignore[arg-type]
            )
        ],
        usage=_usage(finished),
        speculative=jobs.speculative_details(prepared, finished),
    )
    return Response(result.model_dump_json(), media_type="application/json")


@router.get("/models", response_model=ModelList, summary="The served model (OpenAI models)")
async def models(runtime: Runtime_) -> ModelList:
    """The one model this server serves, under the name the OpenAI API reports."""
    info = runtime.info
    return ModelList(data=[ModelCard(id=info.served_model_name, created=0, max_model_len=info.context_length)])
