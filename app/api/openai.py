"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions and /v1/models.

A streamed answer is ``data:`` chunks, one per token that adds text, the last one with the finish reason,
then (with ``stream_options.include_usage``) a chunk with the usage and no choices, then ``data: [DONE]``.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from app.api import admission, jobs, tools
from app.api.deps import get_runtime, get_settings
from app.api.errors import APIError, cut, documented_errors
from app.api.logprobs import TokenNames, chat_logprobs, completion_logprobs, prompt_logprobs
from app.api.schemas import (
    MAX_SEED,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    Grammar,
    ModelCard,
    ModelList,
    OpenAIErrorResponse,
    PromptTokensDetails,
    SpeculativeDetails,
    Usage,
)
from app.engine.model.tokenizer import Tokenizer, TokenizerError
from app.engine.step import GenerationParams
from app.service.events import Finished, RequestFailed, StepEvent, TokenOut
from app.service.runtime import Runtime
from app.service.scheduler import Ticket
from app.service.settings import Settings

log = logging.getLogger(__name__)
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


# The names TGI's clients send when they are not told a model (TGI's server takes any): text-generation's
# chat() always sends "tgi", huggingface_hub's InferenceClient(base_url=...) "dummy". Accepted, never listed.
_TGI_CLIENT_MODELS = frozenset({"tgi", "dummy"})


def check_model(name: str | None, runtime: Runtime, tgi_client: bool = True) -> None:
    """Refuse a `model` this server does not serve, as vLLM does (404 NotFoundError); no `model` is fine, and so
    are the names TGI's client sends where `tgi_client` (on requests; they are no served name, so no model
    card answers to them)."""
    if name is None or name in runtime.info.served_model_names or (tgi_client and name in _TGI_CLIENT_MODELS):
        return
    # The name quoted cut short: a client may send a megabyte of it.
    raise APIError("model_not_found", f"The model `{cut(name, 80)}` does not exist.", param="model", code=404)


def _log_ignored(body: CompletionRequest | ChatCompletionRequest) -> None:
    # Fields no model field names and not known to change nothing: ignored, as vLLM ignores them, but said.
    ignored = body.ignored_fields()
    if ignored:
        log.warning("the request's fields %s are unknown and were ignored", ", ".join(ignored))


def _params(body: CompletionRequest | ChatCompletionRequest, runtime: Runtime) -> GenerationParams:
    """The engine's record of the request (its schema's `to_params`), at the server's default temperature when it
    sends none."""
    try:
        return body.to_params(runtime.info.default_temperature)
    except ValueError as exc:  # n > 1 at temperature 0 (the server's default)
        raise APIError("validation", str(exc), param="n") from exc


def _job(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    settings: Settings,
    params: GenerationParams,
    prompt: str | Sequence[int],
    prompt_field: str,
    grammar: Grammar | None,
) -> jobs.JobSpec:
    """The job of both routes: `prompt` (one of a completion's prompts, or the rendered conversation) is named
    `prompt_field` in messages; `grammar`: the output's constraint (a forced tool call's, or the request's)."""
    tenant, isolated = jobs.tenant(request, settings, body.cache_salt)
    max_new_tokens, max_new_tokens_field = body.max_new_tokens()
    return jobs.JobSpec(
        prompt=prompt,
        params=params,
        max_new_tokens=max_new_tokens,
        speculative=body.speculative,
        truncate=body.truncate_prompt_tokens,
        prompt_field=prompt_field,
        max_new_tokens_field=max_new_tokens_field,
        default_max_new_tokens=body.default_max_tokens,
        grammar=grammar,
        tenant=tenant,
        isolated=isolated,
        prediction=body.prediction.text() if body.prediction is not None else None,
    )


def _usage(prompt_tokens: int, results: Sequence[Finished]) -> Usage:
    """Usage of a request: each prompt's tokens once (as OpenAI and vLLM count them), every choice's output, and
    how much of a prediction the answers kept (0 without one), as OpenAI reports it."""
    completion = sum(f.generated_tokens for f in results)
    # Each of the n choices of a prompt prefills it, later ones finding more in the cache: the prompts' cached
    # tokens are counted once as their prompt tokens are, the mean over their choices.
    prefilled = sum(f.prompt_tokens for f in results)
    cached = sum(f.stats.cached_tokens for f in results) * prompt_tokens // prefilled if prefilled else 0
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=sum(f.stats.accepted_prediction_tokens for f in results),
            rejected_prediction_tokens=sum(f.stats.rejected_prediction_tokens for f in results),
        ),
    )


def _seeds(params: GenerationParams, n: int) -> list[int | None]:
    """The seed of each of the n samples of a prompt: the request's seed (or a random one) + i; None when greedy.
    Sample i of every prompt gets the same seed, so that it is what that prompt alone with that seed gives."""
    if params.temperature == 0:
        return [None] * n
    base = params.seed if params.seed is not None else secrets.randbits(63)
    return [(base + i) & MAX_SEED for i in range(n)]


def _check_choices(count: int, settings: Settings) -> None:
    places = settings.max_concurrent_requests + settings.max_queue_size
    if count > places:
        raise APIError(
            "validation",
            f"this request asks for {count} generations (prompts x n), more than the server holds at once "
            f"({places}: max_concurrent_requests + max_queue_size); send fewer per request",
        )


def _submit_all(runtime: Runtime, settings: Settings, runs: Sequence[jobs.Prepared]) -> list[Ticket]:
    """Admit every choice of a request, or none: on a 429 the ones admitted are given up."""
    tickets: list[Ticket] = []
    try:
        for run in runs:
            tickets.append(jobs.submit(runtime, settings, run))
    except APIError:
        for ticket in tickets:
            ticket.cancel()
        raise
    return tickets


def _speculative(runs: Sequence[jobs.Prepared], results: Sequence[Finished]) -> SpeculativeDetails:
    """`speculative` of a whole answer: with several choices, their statistics added up."""
    total = results[0].stats
    for finished in results[1:]:
        total = total + finished.stats
    return jobs.speculative_details(runs[0], total)


# chunk(index, text, finish_reason, tokens): one event of choice `index` (text None: the usage chunk's frame).
# None: nothing to send for this step (chat's text held back while it may begin a tool call).
_Chunk = Callable[[int, str | None, str | None, Sequence[TokenOut]], CompletionResponse | ChatCompletionChunk | None]


def _stream(
    tickets: Sequence[Ticket],
    runs: Sequence[jobs.Prepared],
    chunk: _Chunk,
    include_usage: bool,
    prompt_tokens: int,
    first: Sequence[CompletionResponse] = (),
    lead: Callable[[int, StepEvent], Sequence[CompletionResponse]] | None = None,
    logprobs: bool = False,
    continuous_usage: bool = False,
    provenance: bool = False,
    keepalive: float = 0.0,
) -> StreamingResponse:
    """SSE of a request's generations: `chunk(index, text, finish_reason, tokens)` per step of choice `index` that
    adds text, or tokens whose `logprobs` were asked for (a speculative step's accepted tokens share one chunk, as
    vLLM sends them: one event to write and parse instead of one per token), each choice's last with the reason,
    its speculative figures and seed; the choices' chunks interleave as they come, after `lead(index, step)`'s
    events. A chat choice's finish reason comes in a chunk of its own (an empty delta), after its last piece, as
    OpenAI sends it: the openai SDK's stream helper closes a tool call (`.done`, its parsed arguments) only when a
    later chunk says so. Then the usage when asked, then ``[DONE]``. With `continuous_usage` (vLLM's
    `stream_options.continuous_usage_stats`) every chunk carries the usage so far. With `provenance` every step's
    tokens go too (a step's without text in the next chunk of its choice) and each chunk carries the provenance
    of the tokens and passes since the choice's previous one. With `keepalive`, a comment (``: queued``) at once
    while a request waits in the queue and after every `keepalive` seconds without an event (`jobs.merged_events`);
    a refusal by the queue deadline is an error event (`jobs.sse_error`), then ``[DONE]``."""
    generated = [0] * len(tickets)
    unsent = [jobs.ProvenanceBuffer() for _ in tickets]

    def with_provenance(
        index: int, event: CompletionResponse | ChatCompletionChunk
    ) -> CompletionResponse | ChatCompletionChunk:
        if provenance:
            event.provenance = unsent[index].take()
        return event

    def sent(event: CompletionResponse | ChatCompletionChunk) -> str:
        if continuous_usage:
            completion = sum(generated)
            event.usage = Usage(
                prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion
            )
        return jobs.sse(event)

    async def events() -> AsyncIterator[str]:
        done: list[Finished] = []
        try:
            for event in first:
                yield sent(event)
            async for index, step in jobs.merged_events(tickets, keepalive):
                if step is None:  # nothing for a while (or queued): a comment, so that everyone sees it live
                    yield jobs.sse_comment(tickets)
                    continue
                for event in lead(index, step) if lead is not None else ():
                    yield sent(event)
                generated[index] += len(step.tokens)
                if provenance:
                    unsent[index].add(step)
                text = "".join(tok.text for tok in step.tokens)
                if step.finished is not None:
                    event = chunk(index, text, _FINISH[step.finished.finish_reason], step.tokens)
                    assert event is not None  # a choice's last chunk always goes
                    if isinstance(event, ChatCompletionChunk):
                        choice = event.choices[0]
                        if choice.delta.model_dump() or choice.logprobs is not None:
                            last_piece = event.model_copy(deep=True)
                            last_piece.choices[0].finish_reason = None
                            yield sent(with_provenance(index, last_piece))
                            choice.delta, choice.logprobs = ChatDelta(), None
                    event.speculative = jobs.speculative_details(runs[index], step.finished.stats)
                    event.seed = step.finished.seed
                    yield sent(with_provenance(index, event))
                    done.append(step.finished)
                elif text or ((logprobs or provenance) and step.tokens):
                    event = chunk(index, text, None, step.tokens)
                    if event is not None:
                        yield sent(with_provenance(index, event))
            if include_usage:
                usage = chunk(0, None, None, ())
                assert usage is not None
                usage.choices, usage.usage = [], _usage(prompt_tokens, done)
                yield jobs.sse(usage)
        except RequestFailed as exc:
            yield jobs.sse_error(exc, openai=True)
        finally:
            for ticket in tickets:
                ticket.cancel()
        yield jobs.sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=jobs.SSE_HEADERS)


def _seeded(prepared: jobs.Prepared, seed: int | None) -> jobs.Prepared:
    return replace(prepared, params=replace(prepared.params, seed=seed))


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses={**_ok(CompletionResponse, CompletionResponse, "completion"), **_ERRORS},
    summary="Complete a prompt (OpenAI completions)",
)
async def completions(request: Request, body: CompletionRequest, runtime: Runtime_, settings: Settings_) -> Response:
    """Continue each `prompt`, sent as is (no chat template): greedily unless temperature > 0. Several prompts
    and `n` samples of each are one generation each, answered as `choices[prompt * n + sample]`."""
    check_model(body.model, runtime)
    _log_ignored(body)
    prompts: list[str | list[int]] = body.prompt  # type: ignore[assignment]  # a list, by its validator
    n = body.n or 1
    _check_choices(len(prompts) * n, settings)
    params = _params(body, runtime)
    # echo with logprobs: the prompt's log-probabilities come first, with as many alternatives.
    echoed = body.logprobs if body.echo else None
    grammar = body.grammar()
    prepared = []
    for i, prompt in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        spec = _job(request, body, settings, params, prompt, field, grammar)
        prepared.append(await jobs.prepare(runtime, settings, spec))
    runs = [_seeded(p, seed) for p in prepared for seed in _seeds(params, n)]
    tickets = _submit_all(runtime, settings, runs)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), runtime.info.served_model_name
    # echo: each choice starts with its prompt (token ids decoded).
    echo = [(p if isinstance(p, str) else runtime.tokenizer.decode(p)) if body.echo else "" for p in prompts]
    prompt_tokens = sum(len(p.prompt_ids) for p in prepared)
    names = TokenNames(runtime.tokenizer, bool(body.return_tokens_as_token_ids))
    # Where each choice's next generated text begins in its text (the log-probabilities' text_offset).
    offsets = [len(echo[i // n]) for i in range(len(runs))]

    def chunk(index: int, text: str | None, finish: str | None, tokens: Sequence[TokenOut] = ()) -> CompletionResponse:
        choice = CompletionChoice(index=index, text=text or "", finish_reason=finish)  # type: ignore[arg-type]
        if body.logprobs is not None and text is not None:
            choice.logprobs = completion_logprobs(names, tokens, offset=offsets[index])
            offsets[index] += len(text)
        return CompletionResponse(
            id=rid, created=created, model=model, system_fingerprint=_FINGERPRINT, choices=[choice]
        )

    if body.stream:
        include_usage, continuous = body.usage_streamed()
        if echoed is None:
            # Each echoed prompt goes first, as a chunk of its own.
            first = [chunk(i, echo[i // n], None) for i in range(len(runs)) if echo[i // n]]
            return _stream(
                tickets,
                runs,
                chunk,
                include_usage,
                prompt_tokens,
                first,
                logprobs=body.logprobs is not None,
                continuous_usage=continuous,
                provenance=body.provenance,
                keepalive=settings.stream_keepalive,
            )
        pending = set(range(len(runs)))

        def lead(index: int, step: StepEvent) -> list[CompletionResponse]:
            # With logprobs, each echoed prompt goes as a chunk of its own once its log-probabilities came.
            if index not in pending:
                return []
            pending.discard(index)
            echo_chunk = chunk(index, None, None)  # text None: no generated text, nothing moves the offsets
            choice = echo_chunk.choices[0]
            choice.text = echo[index // n]
            ids = prepared[index // n].prompt_ids
            choice.logprobs = completion_logprobs(names, (), step.prompt_logprobs, ids, n=echoed)
            return [echo_chunk]

        return _stream(
            tickets,
            runs,
            chunk,
            include_usage,
            prompt_tokens,
            lead=lead,
            logprobs=True,
            continuous_usage=continuous,
            provenance=body.provenance,
            keepalive=settings.stream_keepalive,
        )

    def answer(outcomes: list[jobs.Outcome]) -> CompletionResponse:
        results = [o.finished for o in outcomes]
        choices = []
        for i, o in enumerate(outcomes):
            choice = CompletionChoice(
                index=i, text=echo[i // n] + o.finished.text, finish_reason=_FINISH[o.finished.finish_reason]
            )  # type: ignore[arg-type]
            ids = prepared[i // n].prompt_ids
            if body.logprobs is not None:
                prompt = o.prompt_logprobs if echoed is not None else None
                choice.logprobs = completion_logprobs(names, o.tokens, prompt, ids, len(echo[i // n]), echoed)
            if body.prompt_logprobs is not None and o.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs(names, o.prompt_logprobs, body.prompt_logprobs)
            choices.append(choice)
        return CompletionResponse(
            id=rid,
            created=created,
            model=model,
            system_fingerprint=_FINGERPRINT,
            seed=results[0].seed,
            choices=choices,
            usage=_usage(prompt_tokens, results),
            speculative=_speculative(runs, results),
        )

    return await _answer(request, tickets, answer)


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
    temperature > 0; `n` samples are one generation each, answered as `choices[i]`."""
    check_model(body.model, runtime)
    _log_ignored(body)
    jobs.check_max_new_tokens(body.max_tokens, "max_tokens", settings)
    n = body.n or 1
    _check_choices(n, settings)
    jobs.check_room(runtime)  # a full server answers 429 before rendering or compiling anything
    # Rendered and encoded as ids here, so that special tokens' strings in the client's text stay text
    # (Tokenizer.encode_chat); in the pre-admission pool, as a long prompt's tokenizing is.
    try:
        prompt = await admission.run(_conversation, runtime.tokenizer, body)
    except TokenizerError as exc:
        raise APIError("validation", f"messages: {exc}") from exc
    for parameters in tools.parameter_grammars(body):
        await jobs.check_grammar(runtime, parameters)
    params = _params(body, runtime)
    spec = _job(request, body, settings, params, prompt, "messages", tools.grammar(body) or body.grammar())
    prepared = await jobs.prepare(runtime, settings, spec)
    runs = [_seeded(prepared, seed) for seed in _seeds(params, n)]
    readers = [tools.ToolCallReader(body) for _ in runs]  # each choice's text read into content and tool calls
    tickets = _submit_all(runtime, settings, runs)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), runtime.info.served_model_name
    names = TokenNames(runtime.tokenizer, bool(body.return_tokens_as_token_ids))

    def logprobs(tokens: Sequence[TokenOut]) -> ChatLogprobs | None:
        return ChatLogprobs(content=chat_logprobs(names, tokens)) if body.logprobs else None

    started: set[int] = set()  # the choices whose first chunk (the one naming the role) went

    def chunk(
        index: int, text: str | None, finish: str | None, tokens: Sequence[TokenOut] = ()
    ) -> ChatCompletionChunk | None:
        delta = ChatDelta()
        if text is not None:
            reader = readers[index]
            parts = [reader.feed(text), *([reader.finish()] if finish is not None else [])]
            delta.content = "".join(p.content for p in parts) or None
            delta.tool_calls = tools.merged([c for p in parts for c in p.calls]) or None
            if finish is not None:
                finish = tools.finish_reason(reader, finish)
            elif delta.content is None and delta.tool_calls is None and not (body.logprobs and tokens):
                return None  # text held back until it is known to be content or a call
            if index not in started:
                started.add(index)
                delta.role = "assistant"
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish)  # type: ignore[arg-type]
        if text is not None:
            choice.logprobs = logprobs(tokens)
        return ChatCompletionChunk(
            id=rid, created=created, model=model, system_fingerprint=_FINGERPRINT, choices=[choice]
        )

    if body.stream:
        include_usage, continuous = body.usage_streamed()
        return _stream(
            tickets,
            runs,
            chunk,
            include_usage,
            len(prepared.prompt_ids),
            logprobs=bool(body.logprobs),
            continuous_usage=continuous,
            provenance=body.provenance,
            keepalive=settings.stream_keepalive,
        )

    def answer(outcomes: list[jobs.Outcome]) -> ChatCompletionResponse:
        results = [o.finished for o in outcomes]
        prompt = outcomes[0].prompt_logprobs
        result = ChatCompletionResponse(
            id=rid,
            created=created,
            model=model,
            system_fingerprint=_FINGERPRINT,
            seed=results[0].seed,
            choices=[_chat_choice(i, readers[i], o, logprobs(o.tokens)) for i, o in enumerate(outcomes)],
            usage=_usage(len(prepared.prompt_ids), results),
            speculative=_speculative(runs, results),
        )
        if body.prompt_logprobs is not None and prompt is not None:
            result.prompt_logprobs = prompt_logprobs(names, prompt, body.prompt_logprobs)
        return result

    return await _answer(request, tickets, answer)


def _conversation(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The prompt of a chat request: its messages, and its tools as the template takes them, rendered with the
    chat template and encoded."""
    if tokenizer.takes_tools:
        messages, functions = tools.template_messages(body)
        return tokenizer.encode_chat(messages, True, functions)
    return tokenizer.encode_chat(tools.render_messages(body), True)


async def _answer(
    request: Request, tickets: Sequence[jobs.Ticket], build: Callable[[list[jobs.Outcome]], BaseModel]
) -> Response:
    """The non-streamed answer of both routes: every choice run to its end, then `build` of their outcomes as
    JSON; 499 when the client left first (its generations are given up)."""
    try:
        outcomes = await jobs.run_all_to_end(tickets, request)
    except jobs.ClientGone:
        return Response(status_code=499)
    # Every token's alternatives named and written out is megabytes of JSON for a long answer: built in a
    # thread (anyio's, at most 40 at once), not on the event loop every stream shares.
    text = await anyio.to_thread.run_sync(lambda: build(outcomes).model_dump_json())
    return Response(text, media_type="application/json")


def _chat_choice(
    index: int, reader: tools.ToolCallReader, outcome: jobs.Outcome, logprobs: ChatLogprobs | None
) -> ChatChoice:
    content, calls = tools.message_parts(reader, outcome.finished.text)
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=content, tool_calls=calls),
        logprobs=logprobs,
        finish_reason=tools.finish_reason(reader, _FINISH[outcome.finished.finish_reason]),  # type: ignore[arg-type]
    )


def _card(name: str, runtime: Runtime) -> ModelCard:
    info = runtime.info
    return ModelCard(id=name, created=info.created, root=info.model_id, max_model_len=info.context_length)


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
    check_model(model_id, runtime, tgi_client=False)
    return _card(model_id, runtime)
