"""From a request's fields to a running generation and back, the same for the native and the OpenAI routes.

`prepare` tokenizes (off the event loop) and holds the request to every limit, so that a request the
engine would refuse is a 4xx before anything is queued; `submit` asks the scheduler for a place; `run_to_end`
collects a generation for a non-streaming answer and gives it up if the client leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from app.api import admission
from app.api.errors import APIError, error_body, shown
from app.api.schemas import (
    Grammar,
    Provenance,
    ProvenancePass,
    ProvenanceToken,
    SpeculativeDetails,
    SpeculativeParameters,
    closed_grammar,
)
from app.api.security import key_name
from app.engine.decoding.grammar import GrammarError, GrammarSpec
from app.engine.decoding.logprobs import TokenLogprob
from app.engine.step import GenerationError, GenerationParams, GenerationStats, check_request
from app.service.events import Finished, Overloaded, PassFigures, RequestFailed, StepEvent, TokenOut
from app.service.runtime import Runtime
from app.service.scheduler import Ticket
from app.service.settings import Settings


class ClientGone(Exception):
    """The client disconnected before the answer was ready; there is nobody to answer."""


@dataclass(frozen=True)
class JobSpec:
    """What a request asks for, in terms both APIs share: `params` is the engine's record as the request's schema
    built it (`to_params`), the rest what needs the server to resolve (the prompt's tokens, the default length, the
    draft, the tenant, the grammar's compilation); `*_field` name the fields in error messages."""

    prompt: str | Sequence[int]
    params: GenerationParams
    max_new_tokens: int | None  # None: the default (`default_max_new_tokens`, else the server's), within the context
    speculative: SpeculativeParameters | None  # its draft and length (the rest is in `params`)
    truncate: int | None = None
    prompt_field: str = "inputs"
    max_new_tokens_field: str = "max_new_tokens"
    default_max_new_tokens: int | None = None
    grammar: Grammar | None = None  # what the output is constrained to (structured output)
    tenant: str | None = None  # of the prefix cache and the index of earlier answers (`tenant`)
    isolated: bool = False  # a tenant of its own: nothing read from earlier requests, nothing kept for later
    prediction: str | None = None  # text the answer will mostly be (a lookup source)
    prediction_field: str = "prediction"


@dataclass(frozen=True)
class Prepared:
    """A request that passed every check, ready for the scheduler."""

    prompt_ids: list[int]
    params: GenerationParams
    draft: str
    num_draft_tokens: int


# The longest prediction, in tokens, per token a request may generate.
PREDICTION_TOKENS_PER_NEW_TOKEN = 4


def tenant(request: Request, settings: Settings, salt: str | None) -> tuple[str | None, bool]:
    """The engine's tenant of a request, and whether it is isolated (a tenant of its own).

    A request's tenant is its API key's (by name), refined by its `cache_salt` within that key: two keys never
    share one, whatever salts their clients send. Without a salt it is the key's own (without keys: the one
    shared tenant, None), or, with ``isolation: strict``, a tenant of its own. Key names hold no ``|``, so no
    two (key, salt) pairs compose the same string."""
    name = key_name(request.scope)
    if salt is None:
        if settings.isolation == "strict":
            return None, True
        return (None if name is None else f"key:{name}"), False
    return (f"salt:{salt}" if name is None else f"key:{name}|salt:{salt}"), False


def _invalid(message: str) -> APIError:
    return APIError("validation", message)


async def prepare(runtime: Runtime, settings: Settings, spec: JobSpec) -> Prepared:
    """Tokenize the prompt and check the request against every limit; raises APIError (4xx)."""
    info = runtime.info
    check_room(runtime)  # a full server answers 429 before tokenizing or compiling anything
    stop = spec.params.stop
    if len(stop) > settings.max_stop_sequences:
        raise _invalid(f"at most {settings.max_stop_sequences} stop strings are allowed, got {len(stop)}")
    check_max_new_tokens(spec.max_new_tokens, spec.max_new_tokens_field, settings)
    draft, k = _speculation(runtime, spec.speculative)
    if isinstance(spec.prompt, str):
        if not spec.prompt:
            raise _invalid(f"{spec.prompt_field} must not be empty")
        # A long prompt takes a while to tokenize: in the bounded pre-admission pool, not on the event loop.
        ids = await admission.run(runtime.tokenizer.encode, spec.prompt)
    else:
        ids = list(spec.prompt)
    if spec.truncate is not None:
        ids = ids[-spec.truncate :]
    if len(ids) > info.max_input_tokens:
        raise _invalid(
            f"the prompt is {len(ids)} tokens, over the limit of {info.max_input_tokens} tokens (max_input_tokens)"
        )
    room = info.context_length - len(ids)
    max_new = spec.max_new_tokens
    if max_new is None:
        max_new = min(spec.default_max_new_tokens or settings.default_max_new_tokens, settings.max_new_tokens, room)
    prediction: tuple[int, ...] = ()
    if spec.prediction:
        # The answer's text, not a prompt: no BOS in front of it.
        prediction = tuple(await admission.run(runtime.tokenizer.encode, spec.prediction, False))
        # The worker indexes a prediction whole, and the answer can follow at most max_new tokens of it: beyond a
        # few times that, more prediction buys nothing and costs memory and the worker's time.
        most = PREDICTION_TOKENS_PER_NEW_TOKEN * max(max_new, 1)
        if len(prediction) > most:
            raise _invalid(
                f"{spec.prediction_field} is {len(prediction)} tokens, over the limit of {most} tokens "
                f"({PREDICTION_TOKENS_PER_NEW_TOKEN} times {spec.max_new_tokens_field}, {max_new}): send less of it, "
                f"or ask for more tokens"
            )
    params = replace(
        spec.params,
        max_new_tokens=max_new,
        num_draft_tokens=k,
        cache_salt=spec.tenant,
        isolated=spec.isolated,
        prediction=prediction,
    )
    try:  # the engine's own checks, before anything is queued (the schemas already hold requests to most)
        names = {"prompt": spec.prompt_field, "max_new_tokens": spec.max_new_tokens_field}
        check_request(ids, params, info.vocab_size, info.context_length, names)
    except GenerationError as exc:
        raise _invalid(str(exc)) from exc
    grammar = spec.grammar
    if grammar is not None:
        if settings.closed_response_schemas:
            # JSON schemas closed as vLLM compiles them, whichever API sent them (a forced tool call's are closed
            # already, and stay as they are); in the pool, since a large schema takes a while to parse.
            grammar = await admission.run(closed_grammar, grammar)
        params = replace(params, grammar=await check_grammar(runtime, grammar))
    return Prepared(ids, params, draft, k if draft != "none" else 0)


def check_room(runtime: Runtime) -> None:
    """Raise APIError 429 (with Retry-After) when the server could neither start nor queue any request now: the
    cheap check that goes before a request's costly work (rendering, tokenizing, compiling its grammars)."""
    try:
        runtime.scheduler.check_room()
    except Overloaded as exc:
        raise APIError("overloaded", str(exc), {"Retry-After": str(exc.retry_after)}) from exc


async def check_grammar(runtime: Runtime, grammar: Grammar) -> GrammarSpec:
    """The engine's spec of an output constraint, compiled once here (in the bounded pre-admission pool) so that
    one the engine cannot compile or run is a 4xx naming its field before anything is queued; the spec carries
    its compiled matcher to the worker, which starts the request from it without compiling again."""
    try:
        return await admission.run(runtime.grammars.check, GrammarSpec(grammar.kind, grammar.spec))
    except GrammarError as exc:
        raise _invalid(f"{grammar.field}: {exc}") from exc


def check_max_new_tokens(value: int | None, field: str, settings: Settings) -> None:
    """Refuse a request for more new tokens than the server allows (`field` names it in the message)."""
    if value is not None and value > settings.max_new_tokens:
        raise _invalid(f"{field} must be at most {settings.max_new_tokens}, got {shown(value)}")


def _speculation(runtime: Runtime, spec: SpeculativeParameters | None) -> tuple[str, int]:
    info = runtime.info
    draft = spec.draft if spec is not None and spec.draft is not None else "default"
    if draft not in info.drafts:
        raise _invalid(f"unknown speculative.draft {shown(draft)}; available: {', '.join(info.drafts)}")
    if draft == "default":
        draft = info.default_draft
    k = spec.num_draft_tokens if spec is not None and spec.num_draft_tokens is not None else info.num_draft_tokens
    return draft, k


def submit(runtime: Runtime, settings: Settings, prepared: Prepared) -> Ticket:
    """Hand the request to the scheduler; raises APIError: 429 (with Retry-After) when it can neither start nor
    queue, a validation error when its KV cache alone exceeds the budget (it could never run), 503 while the
    server stops."""
    try:
        return runtime.scheduler.submit(prepared.prompt_ids, prepared.params, prepared.draft, settings.request_timeout)
    except Overloaded as exc:
        raise APIError("overloaded", str(exc), {"Retry-After": str(exc.retry_after)}) from exc
    except RequestFailed as exc:
        raise APIError(exc.kind, exc.message) from exc


def failure(exc: RequestFailed) -> APIError:
    """The APIError answering a request that failed in the worker (a refusal by the queue deadline carries its
    Retry-After)."""
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return APIError(exc.kind, exc.message, headers)


async def _client_disconnect(request: Request) -> None:
    # The body was read before the route ran, so the next message is the client leaving.
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Outcome:
    """A whole generation: its tokens, how it ended, and its prompt's log-probabilities when asked."""

    tokens: list[TokenOut]
    finished: Finished
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


async def run_to_end(ticket: Ticket, request: Request) -> Outcome:
    """Every token and the end of a generation; raises APIError when it fails, ClientGone when the client left."""
    return (await run_all_to_end([ticket], request))[0]


async def run_all_to_end(tickets: Sequence[Ticket], request: Request) -> list[Outcome]:
    """Each of a request's generations, in order; the first failure (APIError) or the client leaving
    (ClientGone) gives them all up."""

    async def consume(ticket: Ticket) -> Outcome:
        tokens: list[TokenOut] = []
        prompt = None
        async for event in ticket.events():
            tokens.extend(event.tokens)
            prompt = event.prompt_logprobs if event.prompt_logprobs is not None else prompt
            if event.finished is not None:
                return Outcome(tokens, event.finished, prompt)
        raise AssertionError("the event stream ended without a finished event")

    work = [asyncio.ensure_future(consume(ticket)) for ticket in tickets]
    gone = asyncio.ensure_future(_client_disconnect(request))
    try:
        pending = set(work)
        while pending:
            done, _ = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                raise ClientGone
            for task in done:
                task.result()  # raises the generation's RequestFailed
            pending -= done
        return [task.result() for task in work]
    except RequestFailed as exc:
        raise failure(exc) from exc
    finally:
        for task in (*work, gone):
            task.cancel()
        for ticket in tickets:
            ticket.cancel()


async def merged_events(
    tickets: Sequence[Ticket], keepalive: float = 0.0
) -> AsyncIterator[tuple[int, StepEvent | None]]:
    """The events of several generations as they come, each with the index of its ticket, until every one has
    finished; the first failure is raised (RequestFailed), and leaving early gives them all up.

    Each ticket's next event is taken only once its last one was handled (sent): what a client has not read
    waits in its ticket, whose scheduler bounds it (a client that does not keep up is cut off, `Scheduler`).

    With `keepalive` (> 0), ``(-1, None)`` whenever no event came for that many seconds, and once at the start
    while a ticket waits in the queue: the stream's cue to send a comment (`sse_comment`) that tells the client
    and every proxy between that the request is alive."""
    streams = [ticket.events() for ticket in tickets]
    pending: dict[asyncio.Future[StepEvent], int] = {}

    def pull(index: int) -> None:
        pending[asyncio.ensure_future(anext(streams[index]))] = index

    for index in range(len(streams)):
        pull(index)
    try:
        if keepalive > 0 and any(ticket.state == "queued" for ticket in tickets):
            yield -1, None
        while pending:
            done, _ = await asyncio.wait(
                pending, timeout=keepalive if keepalive > 0 else None, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                yield -1, None
                continue
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                event = task.result()  # raises its request's RequestFailed
                yield index, event
                if event.finished is None:
                    pull(index)
    finally:
        for task in pending:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: a second failure is not logged as never retrieved
        for ticket in tickets:
            ticket.cancel()


def sse_comment(tickets: Sequence[Ticket]) -> str:
    """An SSE comment saying where the stream's requests are: ``: queued`` while one waits for a place,
    ``: prefilling`` while a prompt is read in, ``: running`` between tokens (clients skip comments)."""
    states = {ticket.state for ticket in tickets}
    state = next((s for s in ("queued", "prefilling") if s in states), "running")
    return f": {state}\n\n"


def sse_error(exc: RequestFailed, openai: bool) -> str:
    """The error event that ends a stream whose 200 headers went already; a refusal by the queue deadline is
    preceded by SSE's ``retry:`` field, its Retry-After in milliseconds."""
    event = sse(error_body(exc.kind, exc.message, openai=openai))
    return f"retry: {exc.retry_after * 1000}\n{event}" if exc.retry_after is not None else event


def speculative_details(prepared: Prepared, stats: GenerationStats) -> SpeculativeDetails:
    """The speculative figures of a finished request (or of several choices' stats added up), for
    `details.speculative`: every field the engine's statistics share with the schema, by name, so that a new
    counter needs only its field here and there."""
    shared = {name: getattr(stats, name) for name in SpeculativeDetails.model_fields if hasattr(stats, name)}
    rounded = {name: round(v, 4) if isinstance(v, float) else v for name, v in shared.items()}
    return SpeculativeDetails(
        draft=prepared.draft,
        num_draft_tokens=prepared.num_draft_tokens,
        sampler="greedy" if prepared.params.temperature == 0 else prepared.params.sampler,  # type: ignore[arg-type]
        **rounded,
    )


def provenance(tokens: Sequence[TokenOut], passes: Sequence[PassFigures]) -> Provenance:
    """The `provenance` of a streamed event carrying `tokens`, and `passes`, the target passes that began in it."""
    return Provenance(
        tokens=[
            ProvenanceToken(
                id=t.id,
                text=t.text,
                source=t.source,  # type: ignore[arg-type]  # one of SOURCES
                target_pass=t.target_pass,
                logprob=t.logprob.logprob if t.logprob is not None else None,
            )
            for t in tokens
        ],
        passes=[
            ProvenancePass(
                target_pass=f.target_pass,
                drafted=f.drafted,
                accepted=f.accepted,
                draft_ms=round(f.draft_seconds * 1000, 3),
                verify_ms=round(f.verify_seconds * 1000, 3),
            )
            for f in passes
        ],
    )


class ProvenanceBuffer:
    """A stream's tokens and passes not yet sent in an event's `provenance` (a chunk may hold several steps' tokens,
    or none when its text is held back)."""

    def __init__(self) -> None:
        self.tokens: list[TokenOut] = []
        self.passes: list[PassFigures] = []

    def add(self, step: StepEvent) -> None:
        """Keep `step`'s tokens and its pass for the next event."""
        self.tokens.extend(step.tokens)
        if step.figures is not None:
            self.passes.append(step.figures)

    def take(self) -> Provenance | None:
        """Everything kept so far, emptied; None when nothing was."""
        if not self.tokens and not self.passes:
            return None
        out = provenance(self.tokens, self.passes)
        self.tokens, self.passes = [], []
        return out


def sse(data: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event carrying `data` (JSON, or a literal like ``[DONE]``)."""
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_item_schema(data: dict[str, Any], literal: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.2 ``itemSchema`` of an event stream whose ``data`` is JSON matching `data` (or `literal`)."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    return {
        "type": "object",
        "properties": {
            "data": {"anyOf": [json_data, {"const": literal}]} if literal is not None else json_data,
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
        "required": ["data"],
    }


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
