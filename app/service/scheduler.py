"""The scheduler and its worker thread: the one place where generations run.

Admission is by memory (app.service.admission: the policy, under the scheduler's lock). Every step batches all
running requests in one forward and chunked prefill takes the shortest prompt first, so a short request admitted
beside long ones gets its first token within a step or two. A request that does not fit waits in a queue of at
most ``max_waiting``; `Scheduler.submit` refuses one with :class:`Overloaded` (429) only when it can neither
start nor queue, and one that could never fit the budget alone at once with a ``validation`` RequestFailed
(4xx). The engine's prefix cache lives in what the admitted requests leave of the budget: the worker shrinks it
before it starts new generations (cached blocks are memory admission takes back, as vLLM reuses free cached
blocks). What the worker hands the routes (events, refusals) is in app.service.events.

One worker thread owns the engine. Each turn it starts the admitted requests, then steps every running
generation once: new ones prefill their prompts, and all the others draft and are verified together in one
batched target forward (`Engine.step_batch`), so that serving N requests costs far less than N times serving
one. Every step's tokens go back to the event loop with ``call_soon_threadsafe`` into the request's
``asyncio.Queue``. Cancelling (a client gone, a timeout) takes the request out of the queue at once and is a
flag the worker reads before each step (its memory counts until the worker drops its generation); an
exception in one generation ends that request alone.

The worker never waits for a client: it posts and goes on. A client that stops reading would leave its tokens
in that queue for as long as its generation runs, so a request whose consumer holds back more than
``max_backlog`` tokens, or has not come back for the next event within ``stall_timeout`` seconds (its route
stuck writing to a client that reads nothing), is cancelled as ``client_stalled``: its generation stops, its
memory is freed, and what waited is dropped for one error saying why.

A step that fails as a whole (the batch's shared planning or bookkeeping, the delivery of its tokens) ends
that step's requests with a 424 and the worker goes on with the next; should the thread end anyway,
`Scheduler.failure` says why, every request it held gets a 503 at once, and so does every later one. A
request whose context was long leaves its memory to the allocator's free lists; the worker hands it back to
the system (glibc's ``malloc_trim``) after such a request ends, so that RSS falls back to its idle level.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.memory import format_bytes
from app.engine.step import GenerationError, GenerationParams, StepOutput
from app.engine.threads import ThreadGovernor
from app.service.admission import MAX_OVERTAKES, Admission
from app.service.events import Finished, Overloaded, PassFigures, RequestFailed, StepEvent, TokenOut
from app.service.logs import current_request_id
from app.service.metrics import Metrics, RequestRecord

log = logging.getLogger(__name__)


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
    queue_deadline: float = float("inf")  # refused if not admitted by then (`Scheduler.queue_timeout`)
    admitted: bool = False  # set once, under the scheduler's lock: its memory counts, the worker may start it
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    # The HTTP request's id, read where the job is made (the request's task), for the worker's log records.
    request_id: str | None = field(default_factory=current_request_id)
    ended: bool = False  # set once, under the scheduler's lock: the place is free, the outcome counted
    kv_bytes: int = 0  # what its generation allocates when it starts (Engine.kv_bytes)
    overtaken: int = 0  # requests admitted past it while it waited
    gen: Generation | None = None
    last_delivery: float = 0.0
    # The event loop's side: tokens posted and not yet taken from `queue`, and since when the consumer has held the
    # event it took last without asking for the next (None: it is waiting for one).
    backlog: int = 0
    busy_since: float | None = None
    stalled: bool = False  # cancelled as client_stalled: what the worker still posts is dropped
    started: float | None = None  # the worker started its generation
    first_token: float | None = None  # its first tokens were delivered
    generated: int = 0
    passes: int = 0  # target passes that ended in tokens (or the end), the prefill's included
    drafted: int = 0
    accepted: int = 0

    @property
    def log_extra(self) -> dict[str, str | None]:
        return {"request_id": self.request_id}


class Ticket:
    """An admitted request, as the event loop sees it: its events, and a way to give it up."""

    def __init__(self, scheduler: Scheduler, job: _Job) -> None:
        self._scheduler = scheduler
        self._job = job

    @property
    def prompt_tokens(self) -> int:
        return len(self._job.prompt_ids)

    @property
    def state(self) -> str:
        """``queued`` (waiting for memory or a place), ``prefilling`` (admitted, no token yet) or ``running``."""
        job = self._job
        if not job.admitted:
            return "queued"
        return "prefilling" if job.first_token is None else "running"

    async def events(self) -> AsyncIterator[StepEvent]:
        """Each step's tokens until the last (which carries `finished`).

        Raises RequestFailed when the request fails or outlives its timeout, and ``queue_timeout`` (with
        `retry_after`) when it was not admitted within the scheduler's queue timeout. Leaving the iteration
        early (a disconnect, an error) cancels the request.
        """
        job = self._job
        try:
            while True:
                now = time.monotonic()
                queued = not job.admitted and job.queue_deadline < job.deadline
                remaining = (job.queue_deadline if queued else job.deadline) - now
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    item = await asyncio.wait_for(job.queue.get(), remaining)
                except asyncio.TimeoutError:
                    if queued:
                        refused = self._scheduler._refuse_late(job)
                        if refused is None:  # admitted meanwhile (or ended): on to its own deadline
                            continue
                        raise refused from None
                    if self._scheduler._end(job, "timeout"):  # else the worker ended it first, and logged it
                        log.warning("request %d: %s", job.id, _timeout_message(job), extra=job.log_extra)
                    raise RequestFailed("timeout", _timeout_message(job)) from None
                if isinstance(item, RequestFailed):
                    raise item
                job.backlog -= len(item.tokens)
                job.busy_since = time.monotonic()
                yield item
                # Back late (a write to a client that read nothing timed out): the request is its stalled client's.
                late = self._scheduler._stall_reason(job)
                job.busy_since = None
                if late is not None:
                    self._scheduler._stall(job, late)
                if item.finished is not None:
                    return
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Give the request up: its place is free at once, its generation stops before its next step. Counted as
        ``client_stalled`` when its consumer had held its last event past the stall timeout (a route that gave up
        writing to a client that read nothing), else ``cancelled``."""
        self._scheduler._give_up(self._job)


def _timeout_message(job: _Job) -> str:
    return f"the request did not finish within the timeout of {job.timeout:g} s"


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class IdleListener(Protocol):
    """What wants to know when the worker has nothing to do (app.distill.online.DraftLearner)."""

    def worker_idle(self) -> None:
        """The worker waits for work (called with the scheduler's lock held: return at once)."""

    def worker_busy(self) -> None:
        """The worker has work again; return once the worker may step (nothing else computing)."""


class Scheduler:
    """Admission, queueing and the worker thread that steps every generation.

    `max_running`: the most requests admitted at once; `kv_budget`: the bytes of KV cache they may hold together
    (default: what `max_running` requests of the model's full context hold, with the largest draft);
    `max_waiting`: the most that wait for room; `max_overtakes`: see app.service.admission.
    `queue_timeout`: seconds a request may wait in the queue; one not admitted by then is refused
    (RequestFailed ``queue_timeout``, with a Retry-After from the measured service rate; None: it waits until
    its own timeout). `trim_after_tokens`: once a request whose prompt plus max_new_tokens reached this many
    tokens has ended, the worker returns the heap's free memory to the system (0: never). `threads`: what sets
    the CPU products' thread count around each step (default: a `ThreadGovernor` of torch's count).
    `max_backlog`: the most tokens a request's events may hold that its consumer has not taken; `stall_timeout`:
    the longest its consumer may hold one event before asking for the next while more wait (None: no bound);
    past either the request is cancelled as ``client_stalled`` (module docstring). `idle`: told when the worker
    starts waiting for work and when it has work again, before its next step (the draft learner trains between).
    """

    def __init__(
        self,
        engine: Engine,
        max_running: int,
        max_waiting: int,
        metrics: Metrics | None = None,
        retry_after: int = 1,
        trim_after_tokens: int = 2048,
        threads: ThreadGovernor | None = None,
        kv_budget: int | None = None,
        max_overtakes: int = MAX_OVERTAKES,
        queue_timeout: float | None = None,
        max_backlog: int | None = None,
        stall_timeout: float | None = None,
        idle: IdleListener | None = None,
    ) -> None:
        if max_running < 1 or max_waiting < 0 or max_overtakes < 0:
            raise ValueError("need max_running >= 1, max_waiting >= 0 and max_overtakes >= 0")
        if queue_timeout is not None and queue_timeout <= 0:
            raise ValueError("the queue timeout must be positive (None: none)")
        if (max_backlog is not None and max_backlog < 1) or (stall_timeout is not None and stall_timeout <= 0):
            raise ValueError("the backlog bound and the stall timeout must be positive (None: none)")
        if kv_budget is not None and kv_budget < 1:
            raise ValueError("the KV-cache budget must be positive")
        self.engine = engine
        self._idle = idle
        # Tokens whose events say `special` (their text is left out unless asked for).
        self._special = engine.tokenizer.special_ids | engine.tokenizer.eos_token_ids
        budget = kv_budget if kv_budget is not None else max_running * largest_request_bytes(engine)
        self._admission: Admission[_Job] = Admission(
            budget, max_running, max_waiting, max_overtakes, retry_after, queue_timeout
        )
        # The least a request can hold (one token of prompt, one new, no draft): whether any request at all could
        # start now, before the next one's size is known (`check_room`).
        self._smallest = engine.kv_bytes(1, 1, "none")
        self.metrics = metrics
        self.max_backlog = max_backlog
        self.stall_timeout = stall_timeout
        self.trim_after_tokens = trim_after_tokens
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # The admission's own queue, the bytes each admitted request holds (until the worker drops its generation,
        # or until it ends before the worker took it) and when admitted ones ended; read and changed under the lock.
        self._waiting = self._admission.waiting
        self._reserved = self._admission.reserved
        self._ended_at = self._admission.ended_at
        self._admitted: deque[_Job] = deque()  # admitted, not yet taken by the worker to start
        self._running: list[_Job] = []  # only the worker thread changes it
        # Every request holding a place (submitted, not ended), wherever it is: the worker moves a request from
        # `_admitted` to `_running` outside the lock, and `stop` must find it in between too.
        self._held: set[_Job] = set()
        self._draining = False
        self._stopping = False
        self._failure: str | None = None  # why the worker thread ended, when it ended while serving
        self._thread: threading.Thread | None = None
        self._trim = _malloc_trim() if trim_after_tokens else None
        self._trim_due = False  # a large request ended since the last trim
        # Fewer CPU threads while other processes hold the cores (app.engine.threads).
        self._threads = threads or ThreadGovernor()

    @property
    def kv_budget(self) -> int:
        """The bytes of KV cache the admitted requests may hold together."""
        return self._admission.kv_budget

    @kv_budget.setter
    def kv_budget(self, value: int) -> None:
        self._admission.kv_budget = value

    @property
    def max_running(self) -> int:
        return self._admission.max_running

    @property
    def max_waiting(self) -> int:
        return self._admission.max_waiting

    @property
    def max_overtakes(self) -> int:
        return self._admission.max_overtakes

    @property
    def retry_after(self) -> int:
        """The least Retry-After a refusal says."""
        return self._admission.retry_after

    @property
    def queue_timeout(self) -> float | None:
        return self._admission.queue_timeout

    @property
    def holding(self) -> int:
        """Requests holding a place (running or waiting)."""
        return len(self._held)

    @property
    def admitted(self) -> int:
        """Requests admitted whose memory counts: starting, running, or ended and not yet dropped by the worker."""
        return len(self._reserved)

    @property
    def waiting(self) -> int:
        """Requests queued until they fit."""
        return len(self._waiting)

    @property
    def kv_held(self) -> int:
        """Bytes of KV cache the admitted requests hold (or are about to allocate)."""
        return self._admission.held_bytes

    @property
    def failure(self) -> str | None:
        """Why the worker thread is gone; None while it serves (and before `start`, and after `stop`)."""
        if self._failure is not None:
            return self._failure
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping:
            return "the worker thread ended"
        return None

    def start(self) -> None:
        """Start the worker thread."""
        if self._thread is not None:
            raise RuntimeError("the scheduler is already started")
        self._thread = threading.Thread(target=self._work, name="specserve-worker", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Admit nothing more (`submit` raises RequestFailed ``unavailable``); the requests held run on."""
        with self._lock:
            self._draining = True

    def stop(self, timeout: float = 10.0, message: str = "the server is shutting down") -> None:
        """Fail every request still held with `message` at once, and stop the worker after its current step,
        waiting up to `timeout` seconds for it (0: not at all)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
            held = list(self._held)
        # Failed before the join: a step can take seconds (a long prefill), and the clients hear now. The worker
        # sends nothing more to a request that has ended.
        for job in held:
            self._fail(job, "error", "unavailable", message)
        if self._thread is not None and timeout > 0:
            self._thread.join(timeout)

    def check_room(self) -> None:
        """Raise Overloaded when the queue is full and not even the smallest request could start now, as `submit`
        would refuse any: a request's work before admission (tokenizing, compiling its grammar) is then not done
        for nothing. `submit` checks again, with the request's own size."""
        with self._lock:
            if len(self._waiting) >= self.max_waiting and not self._admission.may_start(self._smallest):
                raise self._overloaded()

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams, draft: str | None, timeout: float) -> Ticket:
        """Admit or queue a request, or raise Overloaded at once when it can do neither. Call from the event loop
        that will read its events.

        Raises RequestFailed at once: ``validation`` for a request whose KV cache alone exceeds the budget (or
        that names an unknown draft), ``unavailable`` while the server drains or stops, or when the worker is
        gone."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        job = _Job(list(prompt_ids), params, draft, loop, deadline=now + timeout, timeout=timeout, arrived=now)
        if self.queue_timeout is not None:
            job.queue_deadline = now + self.queue_timeout
        with self._lock:
            if self._stopping or self._draining:
                raise RequestFailed("unavailable", "the server is shutting down")
            failure = self.failure
            if failure is not None:
                if self.metrics is not None:
                    self.metrics.request_ended("error")
                raise RequestFailed("unavailable", f"{failure}; the server needs a restart")
            job.kv_bytes = self._request_bytes(job)
            self._waiting.append(job)
            self._admit_waiting()
            if job in self._waiting and len(self._waiting) > self.max_waiting:
                self._waiting.remove(job)
                raise self._overloaded()
            self._held.add(job)
            self._publish_load()
        return Ticket(self, job)

    def _request_bytes(self, job: _Job) -> int:
        """What `job` will hold; RequestFailed (``validation``) when that alone exceeds the budget."""
        try:
            need = self.engine.kv_bytes(
                len(job.prompt_ids),
                job.params.max_new_tokens,
                job.draft,
                job.params.num_draft_tokens,
                len(job.params.prediction),
            )
        except GenerationError as exc:
            raise RequestFailed("validation", str(exc)) from None
        if need > self.kv_budget:
            n = len(job.params.prediction)
            predicted = f", with the index of a prediction of {n} tokens" if n else ""
            raise RequestFailed(
                "validation",
                f"this request needs {format_bytes(need)} of KV cache (a prompt of {len(job.prompt_ids)} tokens "
                f"and up to {job.params.max_new_tokens} new ones{predicted}), more than the server's whole KV-cache "
                f"budget of {format_bytes(self.kv_budget)}: it could never run; send a shorter prompt or ask for fewer "
                "tokens",
            )
        return need

    def _overloaded(self) -> Overloaded:
        """The refusal of a request that can neither start nor queue, counted; under the lock."""
        if self.metrics is not None:
            self.metrics.request_ended("overloaded")
            self.metrics.request_refused("queue_full")
        retry = self._retry_after(len(self._waiting) + 1)
        return Overloaded(
            f"the server is at capacity ({len(self._reserved)} running of at most {self.max_running}, "
            f"{format_bytes(self._admission.held_bytes)} of its {format_bytes(self.kv_budget)} KV-cache budget held, "
            f"{len(self._waiting)} queued of {self.max_waiting}); retry after {retry} s",
            retry,
        )

    def _retry_after(self, ahead: int) -> int:
        """Seconds until about `ahead` more requests could start (`Admission.retry_after_for`). Under the lock."""
        return self._admission.retry_after_for(ahead, time.monotonic())

    def retry_after_now(self) -> int:
        """The Retry-After a request refused now would be told (`_retry_after` for one more than those queued)."""
        with self._lock:
            return self._retry_after(len(self._waiting) + 1)

    def _refuse_late(self, job: _Job) -> RequestFailed | None:
        """Refuse `job`, still queued at its queue deadline (the event loop's side, `Ticket.events`); None when it
        was admitted (or ended) meanwhile."""
        with self._lock:
            if job.ended or job.admitted or job not in self._waiting:
                return None
            retry = self._retry_after(self._waiting.index(job) + 1)
            message = (
                f"the request was not started within the queue timeout of {self.queue_timeout:g} s "
                f"({len(self._reserved)} running, {len(self._waiting)} queued); retry after {retry} s"
            )
        if not self._end(job, "overloaded", queued_only=True):
            return None
        if self.metrics is not None:
            self.metrics.request_refused("queue_timeout")
        log.warning("request %d: %s", job.id, message, extra=job.log_extra)
        return RequestFailed("queue_timeout", message, retry)

    # --- admission, under the lock ------------------------------------------------------------------

    def _admit_waiting(self) -> None:
        """Admit the waiting requests that may start (`Admission.admit_waiting`) and wake the worker for them;
        after every change that could let one start (an arrival, memory freed, a request leaving the queue)."""
        if self._stopping or self._failure is not None:
            return
        for job in self._admission.admit_waiting():
            self._admitted.append(job)
            self._wake.notify()

    def _unreserve(self, job: _Job) -> None:
        """`job`'s memory is free (its generation dropped, or never made): admit whom it makes room for."""
        if self._admission.release(job):
            self._admit_waiting()

    # --- shared by both threads ---------------------------------------------------------------------

    def _end(self, job: _Job, outcome: str, finish_reason: str | None = None, queued_only: bool = False) -> bool:
        """End `job` once: free its place and count how it ended. False when it had already ended (or, with
        `queued_only`, when it is no longer queued)."""
        with self._lock:
            if job.ended or (queued_only and job not in self._waiting):
                return False
            job.ended = True
            if job.admitted:
                self._ended_at.append(time.monotonic())
            self._held.discard(job)
            # Out of the queue at once. Admitted but not yet taken by the worker: its cache was never allocated.
            # Taken by the worker: its memory counts until the worker drops its generation (`_release`).
            if job in self._waiting:
                self._waiting.remove(job)
                self._admit_waiting()  # it may have been the request the others could not pass
            elif job in self._admitted:
                self._admitted.remove(job)
                self._unreserve(job)
            elif job.admitted:
                self._admit_waiting()  # its place is free (its memory when the worker drops it)
            self._publish_load()
        if self.metrics is not None:
            self.metrics.request_ended(outcome, finish_reason)
            record = RequestRecord(
                arrived=job.arrived,
                ended=time.monotonic(),
                started=job.started,
                first_token=job.first_token,
                prompt_tokens=len(job.prompt_ids),
                generated_tokens=job.generated,
                max_tokens=job.params.max_new_tokens,
                drafted=job.drafted,
                accepted=job.accepted,
            )
            self.metrics.generation_ended(record, outcome, finish_reason)
        return True

    def _fail(self, job: _Job, outcome: str, kind: str, message: str) -> bool:
        """End `job` as `outcome` and tell its client why, unless it had already ended (then False)."""
        if self._end(job, outcome):
            self._post(job, RequestFailed(kind, message))
            return True
        return False

    def _post(self, job: _Job, item: StepEvent | RequestFailed) -> None:
        """Hand `item` to `job`'s event loop; never waits (the worker serves everyone)."""
        # A closed loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            job.loop.call_soon_threadsafe(self._arrived, job, item)

    # --- slow clients, on the event loop ------------------------------------------------------------

    def _arrived(self, job: _Job, item: StepEvent | RequestFailed) -> None:
        """`item` reaches `job`'s queue; a client that fell too far behind is cut off (`_stall`)."""
        if job.stalled:
            return  # posted before the worker saw the request end: nobody will read it
        job.queue.put_nowait(item)
        if isinstance(item, StepEvent):
            job.backlog += len(item.tokens)
        reason = self._stall_reason(job)
        if reason is not None:
            self._stall(job, reason)

    def _stall_reason(self, job: _Job) -> str | None:
        """Why `job`'s client counts as stalled now, or None while it keeps up."""
        if self.max_backlog is not None and job.backlog > self.max_backlog:
            return f"{job.backlog} generated tokens were not sent yet, more than a stream may hold ({self.max_backlog})"
        if self.stall_timeout is not None and job.busy_since is not None:
            held = time.monotonic() - job.busy_since
            if held >= self.stall_timeout:
                return f"the client read nothing for {held:.1f} s (the send timeout is {self.stall_timeout:g} s)"
        return None

    def _stall(self, job: _Job, reason: str) -> None:
        """Cancel `job`, whose client does not keep up: its generation stops and its memory is freed as a
        disconnected client's; what waited for the client is dropped for one error saying why, which the client
        reads should it come back (a stream ends with it)."""
        if not self._end(job, "client_stalled"):
            return  # it ended otherwise (finished, timed out) first
        log.warning("request %d: cancelled, its client does not keep up: %s", job.id, reason, extra=job.log_extra)
        job.stalled = True
        while not job.queue.empty():
            job.queue.get_nowait()
        job.backlog = 0
        job.queue.put_nowait(RequestFailed("client_stalled", f"the request was cancelled: {reason}"))

    def _give_up(self, job: _Job) -> None:
        """Its route gave `job` up (`Ticket.cancel`)."""
        reason = self._stall_reason(job)
        if reason is not None:
            self._stall(job, reason)
        else:
            self._end(job, "cancelled")

    def _publish_load(self) -> None:
        if self.metrics is not None:
            self.metrics.load(len(self._reserved), len(self._waiting), self._kv_cache_usage())

    def _kv_cache_usage(self) -> float:
        """The bytes of KV cache the admitted requests hold over the budget (a generation allocates its whole
        cache when it starts)."""
        return self._admission.held_bytes / self.kv_budget

    # --- the worker thread --------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # whatever ended the thread, the requests it held must hear of it
            self._died(exc)

    def _serve(self) -> None:
        waited = False
        while True:
            with self._lock:
                while not self._stopping and not self._admitted and not self._running:
                    if self._idle is not None and not waited:
                        self._idle.worker_idle()
                    waited = True
                    self._wake.wait()
                if self._stopping:
                    return
                # From here the worker owns their memory: it gives it back as it drops each one (`_release`).
                admitted = list(self._admitted)
                self._admitted.clear()
                room = self.kv_budget - self._admission.held_bytes
            if waited and self._idle is not None:
                # Outside the lock: this waits for a training step in flight, and submissions must not.
                self._idle.worker_busy()
            waited = False
            try:
                # The prefix cache keeps what the admitted requests leave of the budget: its blocks are memory
                # admission takes back, evicted here (the worker's thread owns them) before new caches are made.
                if self.engine.prefix_cache is not None:
                    self.engine.prefix_cache.bound(room)
                for job in admitted:
                    if self._begin(job):
                        self._running.append(job)
                    else:
                        self._release(job)
                with self._lock:
                    self._publish_load()
                if self._stopping:
                    return
                self._step_running()
            except Exception as exc:
                self._step_failed(exc, admitted)
            self._release_memory()
            with self._lock:
                self._publish_load()

    def _step_failed(self, exc: Exception, admitted: list[_Job]) -> None:
        """A step failed outside any one request's part of it: fail the requests it held, go on with the next."""
        jobs = list(dict.fromkeys([*self._running, *admitted]))
        self._running = []
        live = [job for job in jobs if not job.ended]
        log.error(
            "a step of %d requests failed; they end with an error and the worker goes on", len(live), exc_info=exc
        )
        for job in live:
            log.warning("request %d: ended by the failed step", job.id, extra=job.log_extra)
            self._fail(job, "error", "generation", _shared_failure(exc))
        for job in jobs:  # the ended ones' memory too
            self._release(job)

    def _died(self, exc: BaseException) -> None:
        """The thread is ending on `exc`: every request held, and every later one, gets a 503 at once."""
        # Clients (and /health, open to anyone) hear the exception's type only; the log has its text.
        reason = f"the worker stopped ({type(exc).__name__})"
        log.critical("%s: %s; every request is refused until the server restarts", reason, exc, exc_info=exc)
        with self._lock:
            self._failure = reason
            held = list(self._held)
            self._waiting.clear()
            self._admitted.clear()
            self._reserved.clear()
            self._admission.held_bytes = 0
            self._running = []
            with contextlib.suppress(Exception):  # the gauges read 0 before anyone hears
                self._publish_load()
        for job in held:
            self._fail(job, "error", "unavailable", f"{reason}; the server needs a restart")

    def _step_running(self) -> None:
        """One step of every running request; those past their prefill share one target forward."""
        live = []
        for job in self._running:
            if self._live(job):
                live.append(job)
            else:
                self._release(job)
        self._running = live
        if not live:
            return
        gens: list[Generation] = []
        for job in live:
            assert job.gen is not None  # every running request has started
            gens.append(job.gen)
        firsts = [gen.needs_prefill for gen in gens]
        self._threads.before_step()
        outcomes = None
        try:
            outcomes = self.engine.step_batch(gens)
        finally:
            # What the thread count is judged by: the tokens of a step that only decoded.
            decoded = None
            if outcomes is not None and not any(firsts):
                decoded = sum(len(out.token_ids) for out in outcomes if not isinstance(out, Exception))
            self._threads.after_step(decoded)
        together = len(outcomes.together)
        if self.metrics is not None:
            for _ in range(len(gens) - together):
                self.metrics.forward(1)
            if together:
                self.metrics.forward(together)
        # One exception ending several requests is a failure of what they shared (the batched forward, a batched
        # draft): its text may quote any of them, so none hears it.
        shared = collections.Counter(id(out) for out in outcomes if isinstance(out, Exception))
        running = []
        for job, first, out in zip(live, firsts, outcomes, strict=True):
            try:
                goes_on = self._deliver(job, first, out)
            except Exception as exc:
                trace = (type(exc), exc, exc.__traceback__)
                log.error("request %d: generation failed", job.id, exc_info=trace, extra=job.log_extra)
                if shared[id(exc)] > 1:
                    message = _shared_failure(exc)
                else:
                    message = f"generation failed: {type(exc).__name__}: {exc}"
                self._fail(job, "error", "generation", message)
                goes_on = False
            if goes_on:
                running.append(job)
            else:
                self._release(job)
        self._running = running

    def _release(self, job: _Job) -> None:
        """Drop `job`'s generation (its KV cache) as it leaves the worker, rather than when its route lets the
        ticket go, and give its memory back to admission; after a large one the heap is trimmed once the step is
        over."""
        if job.gen is not None:
            job.gen.cancel()  # a no-op for a finished one; a drafter hears that an unfinished one was given up
            job.gen = None
            if self.trim_after_tokens and len(job.prompt_ids) + job.params.max_new_tokens >= self.trim_after_tokens:
                self._trim_due = True
        with self._lock:
            self._unreserve(job)

    def _release_memory(self) -> None:
        # glibc keeps what a long prefill's activations and a cache freed in its arenas for the next allocation.
        # Measured (tools/measure_rss.py, float32): RSS 945 MB idle, 1,089-1,172 MB after each max-length
        # request without this, 933-942 MB with it; one malloc_trim(0) took 19 ms.
        if self._trim_due:
            self._trim_due = False
            if self._trim is not None:
                self._trim(0)

    def _begin(self, job: _Job) -> bool:
        if job.ended:
            return False
        try:
            job.gen = self.engine.start(job.prompt_ids, job.params, job.draft)
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
        job.started = now
        if self.metrics is not None:
            self.metrics.request_started(now - job.arrived, len(job.prompt_ids))
        return True

    def _live(self, job: _Job) -> bool:
        """Whether `job` still runs; one past its deadline is failed here."""
        if job.ended:
            return False
        if time.monotonic() >= job.deadline:
            if self._fail(job, "timeout", "timeout", _timeout_message(job)):  # else its route ended it, and logged it
                log.warning("request %d: %s", job.id, _timeout_message(job), extra=job.log_extra)
            return False
        return True

    def _deliver(self, job: _Job, first: bool, out: StepOutput | Exception) -> bool:
        """Send one step's tokens to `job`'s client; False when the request is over. Raises what ended it when
        the step failed for this request (`out` is an exception) or its delivery did."""
        assert job.gen is not None
        if isinstance(out, Exception):
            raise out
        if not out.token_ids and out.finish_reason is None:
            return not job.ended  # a step that prefilled part of the prompt: nothing to send yet
        job.passes += 1
        tokens = tuple(
            TokenOut(
                tid,
                out.pieces[i] if i < len(out.pieces) else "",
                tid in self._special,
                out.logprobs[i] if out.logprobs is not None else None,
                out.sources[i] if i < len(out.sources) else "target",
                job.passes,
            )
            for i, tid in enumerate(out.token_ids)
        )
        if job.ended:  # cancelled or timed out while its step ran: the client is gone
            return False
        now = time.monotonic()
        job.drafted += out.drafted
        job.accepted += out.accepted
        job.generated += len(tokens)
        if job.first_token is None and tokens:
            job.first_token = now
            if self.metrics is not None and self.engine.prefix_cache is not None:
                self.metrics.prefix_cache(len(job.prompt_ids), job.gen.stats.cached_tokens)
        if self.metrics is not None:
            self.metrics.step(out, len(tokens), first)
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
                gen.stats,
                seed=gen.seed,
            )
        if finished is not None:
            # Counted before the event leaves: the route gives the ticket up as soon as it has read it.
            self._end(job, "success", finished.finish_reason)
        prompt = tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None
        figures = PassFigures(job.passes, out.drafted, out.accepted, out.draft_seconds, out.verify_seconds)
        self._post(job, StepEvent(tokens, finished, prompt, figures))
        return finished is None


def _shared_failure(exc: Exception) -> str:
    """What each request of a step hears when the step's shared part failed: the exception's type, never its
    text, which may quote another request's prompt or grammar (the log has it whole)."""
    return f"generation failed: the step this request shared with others failed ({type(exc).__name__}); retry it"


def largest_request_bytes(engine: Engine) -> int:
    """What the largest request `engine` can run holds: the model's whole context, with its largest draft."""
    context = engine.target.config.max_seq_len
    return max(engine.kv_bytes(context, 0, name, 1) for name in ("none", *engine.drafters))
