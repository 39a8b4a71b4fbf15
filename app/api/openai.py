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

_NOT_SERVED: dict[int | str, dict[str, Any]] = {
    404: {"model": OpenAIErrorResponse, "description": "`model` is not a served name (as vLLM: type NotFoundError)"}
}
_ERRORS = {**documented_errors(OpenAIErrorResponse, 400), **_NOT_SERVED}


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


def check_model(name: str | None, runtime: Runtime) -> None:
    """Refuse a `model` this server does not serve, as vLLM does (404 NotFoundError); no `model` is fine."""
    if name is not None and name not in runtime.info.served_model_names:
        raise APIError("model_not_found", f"The model `{name}` does not exist.", param="model", code=404)


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
                    event.seed = step.finished.seed
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
    check_model(body.model, runtime)
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
    result.seed = finished.seed
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
    check_model(body.model, runtime)
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
        seed=finished.seed,
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


def _card(name: str, runtime: Runtime) -> ModelCard:
    info = runtime.info
    return ModelCard(id=name, created=0, root=info.model_id, max_model_len=info.context_length)


@router.get("/models", response_model=ModelList, summary="The served model's names (OpenAI models)")
async def models(runtime: Runtime_) -> ModelList:
    """The one model this server serves, once per name a request may give it (as vLLM lists its
    --served-model-name): the name answers report first, then the aliases."""
    return ModelList(data=[_card(name, runtime) for name in runtime.info.served_model_names])


@router.get(
    "/models/{model_id:path}",
    response_model=ModelCard,
    responses=_NOT_SERVED,
    summary="One served model name (OpenAI models)",
)
async def model(model_id: str, runtime: Runtime_) -> ModelCard:
    """The model under one of its served names; any other name is 404, as in `POST` requests."""
    check_model(model_id, runtime)
    return _card(model_id, runtime)
