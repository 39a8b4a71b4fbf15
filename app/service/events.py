"""What the scheduler hands the routes: each step's tokens (`StepEvent`, `TokenOut`, `PassFigures`), how a
generation ended (`Finished`), and why a request was refused or failed (`Overloaded`, `RequestFailed`).

Plain values, made on the worker thread and read on the event loop; the routes import them from here, and the
worker that makes them lives in app.service.scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.decoding.logprobs import TokenLogprob
from app.engine.step import GenerationStats


class Overloaded(Exception):
    """The request can neither start nor wait (memory and the queue are full); the client should retry after
    `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailed(Exception):
    """A request that ended without a result; `kind` is ``validation``, ``generation``, ``timeout``,
    ``unavailable`` or ``queue_timeout`` (not started within the queue deadline: the client should retry after
    `retry_after` seconds)."""

    def __init__(self, kind: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class TokenOut:
    """One generated token and the part of the text it released (``""`` for a special token)."""

    id: int
    text: str
    special: bool
    logprob: TokenLogprob | None = None  # when the request asked for log-probabilities
    # What proposed it (app.engine.generation.SOURCES), and which of the request's target passes kept it (from 1).
    source: str = "target"
    target_pass: int = 0


@dataclass(frozen=True)
class Finished:
    """How a generation ended."""

    finish_reason: str  # "eos", "stop" or "length"
    text: str
    prompt_tokens: int
    generated_tokens: int
    stats: GenerationStats  # the engine's record of the request (no longer updated: it finished)
    seed: int | None = None  # the seed sampling used (the request's, or a random one); None for greedy decoding


@dataclass(frozen=True)
class PassFigures:
    """What one target pass of a request did: the playground's per-pass figures (provenance, docs/service.md)."""

    target_pass: int  # from 1: the pass that ended the prefill is the first
    drafted: int  # tokens the draft proposed for this pass to verify (0: none, as after the prefill)
    accepted: int  # of them, those the target kept
    draft_seconds: float
    verify_seconds: float  # in a batch, the whole batch's forward


@dataclass(frozen=True)
class StepEvent:
    """The tokens one step added; the last step of a request also carries `finished`."""

    tokens: tuple[TokenOut, ...]
    finished: Finished | None = None
    # When asked, on the request's first event: one per prompt token (None for the first, which nothing predicts).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    figures: PassFigures | None = None  # the target pass this step was (None for events not made by a step)
