"""The scheduler and its worker thread: the one place where generations run.

Admission is bounded: at most ``max_running + max_waiting`` requests hold a place, and `Scheduler.submit`
refuses the next one at once with :class:`Overloaded`. One worker thread owns the engine. Each turn it
starts waiting requests while fewer than ``max_running`` run, then steps every running generation once:
new ones prefill their prompts, and all the others draft and are verified together in one batched target
forward (`Engine.step_batch`), so that serving N requests costs far less than N times serving one. Every
step's tokens go back to the event loop with ``call_soon_threadsafe`` into the request's
``asyncio.Queue``. Cancelling (a client gone, a timeout) frees the place at once and is a flag the worker
reads before each step; an exception in one generation ends that request alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.engine.generation import Engine, Generation, GenerationError, GenerationParams, StepOutput
from app.engine.tokenizer import Tokenizer
from app.logs import current_request_id
from app.metrics import Metrics

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Every place is taken; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailed(Exception):
    """A request that ended without a result; `kind` is ``validation``, ``generation``, ``timeout`` or
    ``unavailable``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class TokenOut:
    """One generated token and the part of the text it released (``""`` for a special token)."""

    id: int
    text: str
    special: bool


@dataclass(frozen=True)
class Finished:
    """How a generation ended."""

    finish_reason: str  # "eos", "stop" or "length"
    text: str
    prompt_tokens: int
    generated_tokens: int
    stats: dict[str, Any]
    seed: int | None = None  # the seed sampling used (the request's, or a random one); None for greedy decoding


@dataclass(frozen=True)
class StepEvent:
    """The tokens one step added; the last step of a request also carries `finished`."""

    tokens: tuple[TokenOut, ...]
    finished: Finished | None = None


class _TokenTexts:
    """Shares the text a step released among the step's tokens.

    The engine releases only safe text (whole characters, nothing of a stop string), per step. For one event
    per token, each token gets the part of that text up to where its own decoding ends, clamped to what was
    released; the last token of the step takes the rest. The pieces therefore always add up to exactly the
    released text.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._eos = tokenizer.eos_token_ids
        self._special = tokenizer.special_ids | tokenizer.eos_token_ids
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._decoded = 0  # characters decoded so far, as the engine's detokenizer counts them
        self._released = 0  # characters the engine released so far

    def _advance(self, token_id: int) -> None:
        # The same windowed decode as the engine's detokenizer, so that offsets line up with its text.
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._decoded += len(after) - len(before)
            self._prefix, self._read = self._read, len(self._ids)

    def split(self, token_ids: Sequence[int], text: str) -> tuple[TokenOut, ...]:
        start, end = self._released, self._released + len(text)
        cursor = start
        out = []
        for i, tid in enumerate(token_ids):
            if tid not in self._eos:
                self._advance(tid)
            cut = end if i == len(token_ids) - 1 else min(max(self._decoded, cursor), end)
            out.append(TokenOut(tid, text[cursor - start : cut - start], tid in self._special))
            cursor = cut
        self._released = end
        return tuple(out)


_ids = itertools.count(1)


@dataclass(eq=False)
class _Job:
    prompt_ids: list[int]
    params: GenerationParams
    draft: str | None
    loop: asyncio.AbstractEventLoop
    deadline: float
    timeout: float
    arrived: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    # The HTTP request's id, read where the job is made (the request's task), for the worker's log records.
    request_id: str | None = field(default_factory=current_request_id)
    ended: bool = False  # set once, under the scheduler's lock: the place is free, the outcome counted
    gen: Generation | None = None
    texts: _TokenTexts | None = None
    last_delivery: float = 0.0
    drafted: int = 0
    accepted: int = 0

    @property
    def log_extra(self) -> dict[str, str | None]:
        return {"request_id": self.request_id}

    def post(self, item: StepEvent | RequestFailed) -> None:
        # A closed loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Ticket:
    """An admitted request, as the event loop sees it: its events, and a way to give it up."""

    def __init__(self, scheduler: Scheduler, job: _Job) -> None:
        self._scheduler = scheduler
        self._job = job

    @property
    def prompt_tokens(self) -> int:
        return len(self._job.prompt_ids)

    async def events(self) -> AsyncIterator[StepEvent]:
        """Each step's tokens until the last (which carries `finished`).

        Raises RequestFailed when the request fails or outlives its timeout. Leaving the iteration early
        (a disconnect, an error) cancels the request.
        """
        job = self._job
        try:
            while True:
                remaining = job.deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    item = await asyncio.wait_for(job.queue.get(), remaining)
                except asyncio.TimeoutError:
                    self._scheduler._end(job, "timeout")
                    raise RequestFailed("timeout", _timeout_message(job)) from None
                if isinstance(item, RequestFailed):
                    raise item
                yield item
                if item.finished is not None:
                    return
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Give the request up: its place is free at once, its generation stops before its next step."""
        self._scheduler._end(self._job, "cancelled")


def _timeout_message(job: _Job) -> str:
    return f"the request did not finish within the timeout of {job.timeout:g} s"


class Scheduler:
    """Admission, queueing and the worker thread that steps every generation."""

    def __init__(
        self,
        engine: Engine,
        max_running: int,
        max_waiting: int,
        metrics: Metrics | None = None,
        retry_after: int = 1,
    ) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("need max_running >= 1 and max_waiting >= 0")
        self.engine = engine
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[_Job] = deque()
        self._running: list[_Job] = []  # only the worker thread changes it
        self._holding = 0  # requests holding a place: admitted and not ended
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def holding(self) -> int:
        """Requests holding a place (running or waiting)."""
        return self._holding

    def start(self) -> None:
        """Start the worker thread."""
        if self._thread is not None:
            raise RuntimeError("the scheduler is already started")
        self._thread = threading.Thread(target=self._work, name="specserve-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail every request still held and stop the worker (after its current step)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        for job in [*self._waiting, *self._running]:
            self._fail(job, "error", "unavailable", "the server is shutting down")

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams, draft: str | None, timeout: float) -> Ticket:
        """Admit a request, or raise Overloaded at once. Call from the event loop that will read its events."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        job = _Job(list(prompt_ids), params, draft, loop, deadline=now + timeout, timeout=timeout, arrived=now)
        with self._lock:
            if self._stopping:
                raise RequestFailed("unavailable", "the server is shutting down")
            if self._holding >= self.max_running + self.max_waiting:
                if self.metrics is not None:
                    self.metrics.request_ended("overloaded")
                raise Overloaded(
                    f"the server is at capacity ({self.max_running} running, {self.max_waiting} queued); retry later",
                    self.retry_after,
                )
            self._holding += 1
            self._waiting.append(job)
            self._wake.notify()
            self._publish_load()
        return Ticket(self, job)

    # --- shared by both threads ---------------------------------------------------------------------

    def _end(self, job: _Job, outcome: str, finish_reason: str | None = None) -> bool:
        """End `job` once: free its place and count how it ended. False when it had already ended."""
        with self._lock:
            if job.ended:
                return False
            job.ended = True
            self._holding -= 1
        if self.metrics is not None:
            self.metrics.request_ended(outcome, finish_reason)
            self.metrics.generation_ended(time.monotonic() - job.arrived, job.drafted, job.accepted)
        return True

    def _fail(self, job: _Job, outcome: str, kind: str, message: str) -> None:
        """End `job` as `outcome` and tell its client why, unless it had already ended."""
        if self._end(job, outcome):
            job.post(RequestFailed(kind, message))

    def _publish_load(self) -> None:
        if self.metrics is not None:
            self.metrics.load(len(self._running), len(self._waiting))

    # --- the worker thread --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    return
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.max_running:
                    admitted.append(self._waiting.popleft())
            for job in admitted:
                if self._begin(job):
                    self._running.append(job)
            with self._lock:
                self._publish_load()
            if self._stopping:
                return
            self._step_running()
            with self._lock:
                self._publish_load()

    def _step_running(self) -> None:
        """One step of every running request; those past their prefill share one target forward."""
        live = [job for job in self._running if self._live(job)]
        self._running = live
        if not live:
            return
        gens = [job.gen for job in live if job.gen is not None]
        firsts = [gen.needs_prefill for gen in gens]
        together = len(self.engine.together(gens))
        outcomes = self.engine.step_batch(gens)
        if self.metrics is not None:
            for _ in range(len(gens) - together):
                self.metrics.forward(1)
            if together:
                self.metrics.forward(together)
        self._running = [
            job for job, first, out in zip(live, firsts, outcomes, strict=True) if self._deliver(job, first, out)
        ]

    def _begin(self, job: _Job) -> bool:
        if job.ended:
            return False
        try:
            job.gen = self.engine.start(job.prompt_ids, job.params, job.draft)
            job.texts = _TokenTexts(self.engine.tokenizer)
        except GenerationError as exc:
            log.warning("request %d: the engine refused it: %s", job.id, exc, extra=job.log_extra)
            self._fail(job, "invalid", "validation", str(exc))
            return False
        except Exception as exc:
            log.exception("request %d: the generation could not start", job.id, extra=job.log_extra)
            self._fail(job, "error", "generation", f"the generation could not start: {type(exc).__name__}: {exc}")
            return False
        now = time.monotonic()
        job.last_delivery = job.arrived
        if self.metrics is not None:
            self.metrics.request_started(now - job.arrived, len(job.prompt_ids))
        return True

    def _live(self, job: _Job) -> bool:
        """Whether `job` still runs; one past its deadline is failed here."""
        if job.ended:
            return False
        if time.monotonic() >= job.deadline:
            log.warning("request %d: timed out after %g s", job.id, job.timeout, extra=job.log_extra)
            self._fail(job, "timeout", "timeout", _timeout_message(job))
            return False
        return True

    def _deliver(self, job: _Job, first: bool, out: StepOutput | Exception) -> bool:
        """Send one step's tokens to `job`'s client; False when the request is over."""
        assert job.gen is not None and job.texts is not None
        if not isinstance(out, Exception) and not out.token_ids and out.finish_reason is None:
            return not job.ended  # a step that prefilled part of the prompt: nothing to send yet
        try:
            if isinstance(out, Exception):
                raise out
            tokens = job.texts.split(out.token_ids, out.text)
        except Exception as exc:
            trace = (type(exc), exc, exc.__traceback__)
            log.error("request %d: generation failed", job.id, exc_info=trace, extra=job.log_extra)
            self._fail(job, "error", "generation", f"generation failed: {type(exc).__name__}: {exc}")
            return False
        if job.ended:  # cancelled or timed out while its step ran: the client is gone
            return False
        now = time.monotonic()
        job.drafted += out.drafted
        job.accepted += out.accepted
        if self.metrics is not None:
            self.metrics.step(len(tokens), out.drafted, out.accepted, out.draft_seconds, out.verify_seconds, first)
            self.metrics.tokens_delivered(now - job.last_delivery, len(tokens), first)
        job.last_delivery = now
        finished = None
        if out.finish_reason is not None:
            gen = job.gen
            finished = Finished(
                out.finish_reason,
                gen.text,
                len(job.prompt_ids),
                gen.stats.generated_tokens,
                gen.stats.to_dict(),
                seed=gen.seed,
            )
        if finished is not None:
            # Counted before the event leaves: the route gives the ticket up as soon as it has read it.
            self._end(job, "success", finished.finish_reason)
        job.post(StepEvent(tokens, finished))
        return finished is None
