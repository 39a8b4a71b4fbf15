"""How many threads the CPU products use while other processes share the cores.

The products split each matrix over OpenMP threads, and a decoding step has ~150 such parallel regions, each
ending at a barrier. libgomp's threads spin at a barrier for a while before they sleep: on cores of their own
that keeps a step fast (sleeping at every barrier made target-only decoding take 2x as long on the 2-core
EPYC), but beside another busy process a thread often waits at a barrier for one the scheduler has put aside,
and every region pays for it (measured there: 2 threads beside one busy-loop process took 48 ms a token,
one thread 22, against 14 on idle cores).

So the worker asks a `ThreadGovernor` around each step. Contention shows in two clocks: the time the process's
threads spent runnable but waiting for a CPU (Linux's schedstat run delay: near 0 on free cores, 0.6 s a second
beside one busy process on the 2-core EPYC), and the CPU time its steps got against their wall time (threads
that run or spin on free cores get about one CPU each; 1.3 of 2 there). Both must say so, since a step's
single-threaded Python lowers the share on free cores too (where schedstat cannot be read, the share alone
decides). It then drops to the threads the share says it really gets, and every `retry` seconds tries the full
count again for one window, keeping it if the cores have become free.

The clocks say the cores are shared, not that fewer threads are faster: beside a lighter process (a load
generator on the same 2 cores running its own engine now and then, seen to trigger drops to one thread) both
signals can fire while two threads still decode faster. So the count is judged by what the steps produce too:
where the steps only decoded, the window's tokens per second is kept per thread count, a drop whose window
decoded slower than the window before it is undone, and while that is fresh (`retry` seconds) the same drop is
not tried again.
"""

from __future__ import annotations

import glob
import logging
import math
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_WINDOW = 0.5  # seconds of steps per measurement
_RETRY = 10.0  # seconds between tries of the full thread count while contended
_SLACK = 0.4  # a share this far below the thread count may be contention
_WAITED = 0.2  # seconds a second the threads waited for a CPU, above which the cores are contended


def run_delay() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (Linux's schedstat), None
    where that cannot be read."""
    total, found = 0, False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[1])
            found = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if found else None


class ThreadGovernor:
    """The thread count of the CPU products, chosen from the CPU share the process gets while it steps.

    `threads`: the most (default: torch's count when made). `set_threads`, `wall`, `cpu` and `waited` are
    torch's setter and the process's clocks, replaceable in tests."""

    def __init__(
        self,
        threads: int | None = None,
        window: float = _WINDOW,
        retry: float = _RETRY,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        wall: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.process_time,
        waited: Callable[[], float | None] = run_delay,
    ) -> None:
        self.most = threads or torch.get_num_threads()
        self.threads = self.most
        self._window, self._retry = window, retry
        self._set, self._wall, self._cpu, self._waited = set_threads, wall, cpu, waited
        self._since = self._wall()  # when the thread count last changed
        self._start: tuple[float, float] | None = None
        self._new_window()
        self._rates: dict[int, tuple[float, float]] = {}  # thread count -> (tokens a second, when measured)

    def before_step(self) -> None:
        """A step begins; while contended, after `retry` seconds the full count is tried again."""
        if self.threads < self.most and self._wall() - self._since >= self._retry:
            self._change(self.most, "trying all threads again")
        self._start = (self._wall(), self._cpu())
        if self._opened is None:
            self._opened = (self._start[0], self._waited())

    def after_step(self, tokens: int | None = None) -> None:
        """A step ended: its wall and CPU time count toward the window, judged when it is full. `tokens`: what it
        generated, where it only decoded (None: it prefilled too, or failed): each thread count's speed."""
        if self._start is None:
            return
        wall, cpu = self._wall(), self._cpu()
        self._spent[0] += wall - self._start[0]
        self._spent[1] += cpu - self._start[1]
        if tokens is not None:
            self._decoded[0] += wall - self._start[0]
            self._decoded[1] += tokens
        self._start = None
        if self._spent[0] < self._window:
            return
        share = self._spent[1] / self._spent[0]
        assert self._opened is not None  # set by before_step
        opened, waited_then = self._opened
        waited_now = self._waited()
        waited = None if waited_then is None or waited_now is None else (waited_now - waited_then) / (wall - opened)
        # A window mostly of decoding steps measures this count's speed.
        rate = self._decoded[1] / self._decoded[0] if self._decoded[0] >= self._spent[0] / 2 else None
        self._new_window()
        if rate is not None:
            self._rates[self.threads] = (rate, wall)
        if self.threads < self.most:
            full = self._rate(self.most, wall)
            if rate is not None and full is not None and rate < full:
                why = f"{self.threads} threads decoded slower ({rate:.1f} against {full:.1f} tokens a second)"
                self._change(self.most, why)
                return
        if self.threads > 1 and share < self.threads - _SLACK and (waited is None or waited > _WAITED):
            fewer = max(1, int(share))
            known = self._rate(fewer, wall)
            if rate is not None and known is not None and known <= rate:
                return  # fewer threads decoded slower a moment ago, beside the same contention
            why = f"the process got {share:.2f} CPUs of {self.threads} threads"
            self._change(fewer, why + ("" if waited is None else f", waited {waited:.2f} s a second"))

    def _new_window(self) -> None:
        self._spent = [0.0, 0.0]  # wall and CPU seconds of the steps in this window
        self._opened: tuple[float, float | None] | None = None  # the window's start: wall, run delay
        self._decoded = [0.0, 0]  # wall seconds and tokens of this window's steps that only decoded

    def _rate(self, threads: int, now: float) -> float | None:
        """Tokens a second `threads` threads decoded in their last window, if within `retry` seconds."""
        rate, when = self._rates.get(threads, (0.0, -math.inf))
        return rate if now - when <= self._retry else None

    def _change(self, threads: int, why: str) -> None:
        if threads != self.threads:
            log.info("CPU threads %d -> %d: %s", self.threads, threads, why)
            self._set(threads)
            self.threads = threads
        self._since = self._wall()
        self._new_window()
