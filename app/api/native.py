"""The native API, compatible with text-generation-inference: /generate, /generate_stream and POST /.

``POST /`` is where TGI's own client sends both kinds of request: ``stream: false`` answers a list holding
one /generate response, ``stream: true`` answers as /generate_stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from app.api import jobs
from app.api.deps import get_runtime, get_settings
from app.api.errors import APIError, documented_errors
from app.api.logprobs import TokenNames, tgi_top_tokens
from app.api.schemas import (
    Details,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    InputToken,
    StreamDetails,
    StreamResponse,
    Token,
)
from app.service.events import Finished, RequestFailed, TokenOut
from app.service.runtime import Runtime
from app.service.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(tags=["native (TGI-compatible)"])

# Engine finish reasons as TGI names them.
_FINISH = {"eos": "eos_token", "stop": "stop_sequence", "length": "length"}

_ERRORS = documented_errors(ErrorResponse, 422)
# An event of a stream: a token, or the error that ended the stream.
_EVENT = jobs.sse_item_schema(
    {"anyOf": [{"$ref": "#/components/schemas/StreamResponse"}, {"$ref": "#/components/schemas/ErrorResponse"}]}
)
_SSE_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "server-sent events: one `data:` event per token, the last carrying `generated_text` "
        "and `details`; an error after the stream began is one event with `error` and `error_type`",
        "content": {"text/event-stream": {"itemSchema": _EVENT}},
        "model": StreamResponse,
    }
}

Runtime_ = Annotated[Runtime, Depends(get_runtime)]
Settings_ = Annotated[Settings, Depends(get_settings)]


async def _prepare(
    request: Request, runtime: Runtime, settings: Settings, body: GenerateRequest, stream: bool
) -> jobs.Prepared:
    ignored = body.ignored_fields()
    if ignored:  # ignored, as TGI ignores them, but said
        log.warning("the request's fields %s are unknown and were ignored", ", ".join(ignored))
    p = body.parameters
    if stream and p.decoder_input_details:
        raise APIError("validation", "parameters.decoder_input_details: not supported when streaming (as TGI)")
    if not stream and p.provenance:
        raise APIError("validation", "parameters.provenance: only for streamed answers (/generate_stream)")
    try:
        params = p.to_params(stream)
    except ValueError as exc:  # what the schema let through and the engine's record refuses
        raise APIError("validation", f"parameters: {exc}") from exc
    tenant, isolated = jobs.tenant(request, settings, body.salt())
    spec = jobs.JobSpec(
        prompt=body.inputs,
        params=params,
        max_new_tokens=p.max_new_tokens,
        speculative=p.speculative,
        truncate=p.truncate,
        prompt_field="inputs",
        max_new_tokens_field="parameters.max_new_tokens",
        grammar=p.grammar.grammar() if p.grammar is not None else None,
        tenant=tenant,
        isolated=isolated,
        prediction=p.prediction,
        prediction_field="parameters.prediction",
    )
    return await jobs.prepare(runtime, settings, spec)


def _token(t: TokenOut) -> Token:
    return Token(id=t.id, text=t.text, logprob=t.logprob.logprob if t.logprob else None, special=t.special)


def _full_text(body: GenerateRequest, finished: Finished) -> str:
    return body.inputs + finished.text if body.parameters.return_full_text else finished.text


async def _generate(request: Request, body: GenerateRequest, runtime: Runtime, settings: Settings) -> Response:
    prepared = await _prepare(request, runtime, settings, body, stream=False)
    ticket = jobs.submit(runtime, settings, prepared)
    try:
        outcome = await jobs.run_to_end(ticket, request)
    except jobs.ClientGone:
        return Response(status_code=499)
    # Each prompt token named with decoder_input_details, each token's alternatives with top_n_tokens: for a long
    # prompt, megabytes of JSON, built in a thread (anyio's, at most 40 at once), not on the event loop.
    text = await anyio.to_thread.run_sync(_answer, body, runtime, prepared, outcome)
    return Response(text, media_type="application/json")


def _answer(body: GenerateRequest, runtime: Runtime, prepared: jobs.Prepared, outcome: jobs.Outcome) -> str:
    """The JSON of a /generate answer."""
    tokens, finished = outcome.tokens, outcome.finished
    details = None
    if body.parameters.details:
        prefill = []
        names = TokenNames(runtime.tokenizer)
        if body.parameters.decoder_input_details:
            prompt = outcome.prompt_logprobs or (None,) * len(prepared.prompt_ids)
            prefill = [
                InputToken(id=i, text=names(i), logprob=lp.logprob if lp else None)
                for i, lp in zip(prepared.prompt_ids, prompt, strict=True)
            ]
        top = [tgi_top_tokens(names, t.logprob) for t in tokens] if body.parameters.top_n_tokens else None
        details = Details(
            finish_reason=_FINISH[finished.finish_reason],  # type: ignore[arg-type]
            generated_tokens=finished.generated_tokens,
            seed=finished.seed,
            prefill=prefill,
            tokens=[_token(t) for t in tokens],
            top_tokens=top,
            speculative=jobs.speculative_details(prepared, finished.stats),
        )
    return GenerateResponse(generated_text=_full_text(body, finished), details=details).model_dump_json()


async def _stream(request: Request, body: GenerateRequest, runtime: Runtime, settings: Settings) -> StreamingResponse:
    prepared = await _prepare(request, runtime, settings, body, stream=True)
    ticket = jobs.submit(runtime, settings, prepared)
    names = TokenNames(runtime.tokenizer) if body.parameters.top_n_tokens else None
    provenance = body.parameters.provenance

    async def events() -> AsyncIterator[str]:
        index = 0
        try:
            async for _, step in jobs.merged_events([ticket], settings.stream_keepalive):
                if step is None:  # nothing for a while (or queued): a comment, so that everyone sees it live
                    yield jobs.sse_comment([ticket])
                    continue
                for n, tok in enumerate(step.tokens, 1):
                    index += 1
                    event = StreamResponse(index=index, token=_token(tok))
                    if names is not None:
                        event.top_tokens = tgi_top_tokens(names, tok.logprob)
                    if provenance:  # the step's pass goes with its first token
                        passes = [step.figures] if n == 1 and step.figures is not None else []
                        event.provenance = jobs.provenance([tok], passes)
                    if step.finished is not None and n == len(step.tokens):
                        f = step.finished
                        event.generated_text = _full_text(body, f)
                        if body.parameters.details:
                            event.details = StreamDetails(
                                finish_reason=_FINISH[f.finish_reason],  # type: ignore[arg-type]
                                generated_tokens=f.generated_tokens,
                                seed=f.seed,
                                input_length=f.prompt_tokens,
                                speculative=jobs.speculative_details(prepared, f.stats),
                            )
                    yield jobs.sse(event)
        except RequestFailed as exc:
            yield jobs.sse_error(exc, openai=False)
        finally:
            ticket.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers=jobs.SSE_HEADERS)


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses=_ERRORS,
    summary="Generate text (TGI /generate)",
)
async def generate(request: Request, body: GenerateRequest, runtime: Runtime_, settings: Settings_) -> Response:
    """Generate from `inputs` (greedily unless sampling is asked for) and answer the whole text at once."""
    return await _generate(request, body, runtime, settings)


@router.post(
    "/generate_stream",
    response_class=StreamingResponse,
    responses={**_SSE_OK, **_ERRORS},
    summary="Generate text as server-sent events (TGI /generate_stream)",
)
async def generate_stream(
    request: Request, body: GenerateRequest, runtime: Runtime_, settings: Settings_
) -> StreamingResponse:
    """Generate from `inputs` as /generate does, one event per token even when one target pass accepts several."""
    return await _stream(request, body, runtime, settings)


@router.post(
    "/",
    response_class=Response,
    responses={
        200: {
            "description": "`stream: false`: a list holding one /generate response; `stream: true`: the events "
            "of /generate_stream",
            "content": {
                "application/json": {
                    "schema": {"type": "array", "items": {"$ref": "#/components/schemas/GenerateResponse"}}
                },
                "text/event-stream": {"itemSchema": _EVENT},
            },
        },
        **_ERRORS,
    },
    summary="TGI's compatibility route, where its client sends generate and generate_stream",
)
async def compat_generate(request: Request, body: GenerateRequest, runtime: Runtime_, settings: Settings_) -> Response:
    """As /generate (answered as a one-element list) or, with `stream: true`, as /generate_stream."""
    if body.stream:
        return await _stream(request, body, runtime, settings)
    single = await _generate(request, body, runtime, settings)
    if single.status_code != 200:
        return single
    return Response(b"[" + bytes(single.body) + b"]", media_type="application/json")
