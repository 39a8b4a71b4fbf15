"""Admission by memory: which waiting requests may start, and how long a refused one should wait.

A generation allocates its whole KV cache when it starts (the target's and its draft's, for its prompt plus
max_new_tokens: `Engine.kv_bytes`), so a request is admitted (may start) while the bytes the admitted requests
hold plus its own fit `kv_budget`, and fewer than ``max_running`` admitted ones have not ended (one that ended
frees its place at once, its memory when it is released).

The queue is FIFO with bounded overtaking. Whenever memory is freed (or a request arrives), the waiting
requests are considered in arrival order: each that fits is admitted, and one that does not fit is passed
over, so that a short request is not held behind a long one waiting for memory; a request passed over gains
one overtake per request admitted past it. Once a waiting request has been overtaken `max_overtakes` times,
nothing behind it is admitted until it is (the memory freed then goes to it first): no request waits behind
more than `max_overtakes` later ones, however steady a stream of short requests, and it always fits once the
requests ahead of it end (it fits the budget alone).

The policy alone: no thread, no lock, no clock (the caller says what time it is), no engine. The scheduler
(app.service.scheduler) owns one and calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Protocol, TypeVar

# How many later requests may be admitted past a waiting one before it blocks the queue (module docstring).
MAX_OVERTAKES = 8
# Retry-After is the requests ahead over the rate at which admitted requests ended in the last RATE_WINDOW
# seconds, at most MAX_RETRY_AFTER.
RATE_WINDOW = 60.0
MAX_RETRY_AFTER = 600


class Claim(Protocol):
    """What admission reads and writes of a request (the scheduler's job)."""

    kv_bytes: int  # what it holds once admitted
    overtaken: int  # requests admitted past it while it waited
    admitted: bool  # set by `Admission.admit_waiting`: its memory counts
    ended: bool  # set by its owner: its place is free (its memory counts until `release`)


C = TypeVar("C", bound=Claim)


class Admission(Generic[C]):
    """The queue of waiting requests and the memory and places the admitted ones hold.

    `kv_budget`: the bytes of KV cache the admitted requests may hold together; `max_running`: the most admitted
    ones that have not ended; `max_waiting`: the most that may wait (the caller refuses past it);
    `max_overtakes`: see the module docstring. `retry_after`: the least Retry-After a refusal says;
    `queue_timeout`: what it says while too few requests have ended to measure a rate (None: RATE_WINDOW).
    """

    def __init__(
        self,
        kv_budget: int,
        max_running: int,
        max_waiting: int,
        max_overtakes: int = MAX_OVERTAKES,
        retry_after: int = 1,
        queue_timeout: float | None = None,
    ) -> None:
        self.kv_budget = kv_budget
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_overtakes = max_overtakes
        self.retry_after = retry_after
        self.queue_timeout = queue_timeout
        self.waiting: deque[C] = deque()  # requests that did not fit yet, in arrival order
        # The bytes each admitted request holds (from admission until `release`), and their sum: what admission
        # weighs against `kv_budget`.
        self.reserved: dict[C, int] = {}
        self.held_bytes = 0
        # When admitted requests ended (any outcome) in the last RATE_WINDOW seconds: the service rate.
        self.ended_at: deque[float] = deque()

    def fits(self, need: int) -> bool:
        """Whether `need` more bytes fit the budget beside what the admitted requests hold: the one place admission
        asks about memory (where a cache of its own, such as a prefix cache's pool, would give some back)."""
        return self.held_bytes + need <= self.kv_budget

    def places_taken(self) -> int:
        """Admitted requests that have not ended: what `max_running` bounds. One that ended keeps its memory
        until it is released, but not its place: its client may already have sent the next request, which must
        not wait on the worker for a place that is free."""
        return sum(1 for claim in self.reserved if not claim.ended)

    def may_start(self, need: int) -> bool:
        """Whether a request of `need` bytes arriving now would be admitted at once."""
        if self.places_taken() >= self.max_running:
            return False
        if any(claim.overtaken >= self.max_overtakes for claim in self.waiting):
            return False
        return self.fits(need)

    def admit_waiting(self) -> list[C]:
        """Admit the waiting requests that may start, in arrival order with bounded overtaking (module docstring):
        each leaves the queue, is marked admitted and holds its bytes. Returns them, in the order admitted. Call
        after every change that could let one start (an arrival, memory freed, a request leaving the queue)."""
        admitted: list[C] = []
        passed: list[C] = []  # waiting requests the scan went past
        blocked = False
        for claim in list(self.waiting):
            if blocked or self.places_taken() >= self.max_running:
                break
            if self.fits(claim.kv_bytes):
                self.waiting.remove(claim)
                for earlier in passed:
                    earlier.overtaken += 1
                blocked = any(earlier.overtaken >= self.max_overtakes for earlier in passed)
                claim.admitted = True
                self.reserved[claim] = claim.kv_bytes
                self.held_bytes += claim.kv_bytes
                admitted.append(claim)
            else:
                passed.append(claim)
                blocked = claim.overtaken >= self.max_overtakes
        return admitted

    def release(self, claim: C) -> bool:
        """`claim`'s memory is free (its generation dropped, or never made); False when it held none. The caller
        then admits whom it makes room for (`admit_waiting`)."""
        if claim not in self.reserved:
            return False
        self.held_bytes -= self.reserved.pop(claim)
        return True

    def retry_after_for(self, ahead: int, now: float) -> int:
        """Seconds until about `ahead` more requests could start: `ahead` over the rate at which admitted requests
        ended in the RATE_WINDOW seconds before `now` (the queue timeout, or the window, when fewer than two did);
        at least `retry_after`, at most MAX_RETRY_AFTER."""
        ended = self.ended_at
        while ended and now - ended[0] > RATE_WINDOW:
            ended.popleft()
        if len(ended) >= 2:
            seconds = ahead * max(now - ended[0], 1.0) / len(ended)
        else:
            seconds = self.queue_timeout or RATE_WINDOW
        return max(self.retry_after, min(MAX_RETRY_AFTER, round(seconds)))
