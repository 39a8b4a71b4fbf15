"""How many threads the CPU products use while other processes share the cores.

The products split each matrix over OpenMP threads, and a decoding step has ~150 such parallel regions, each
ending at a barrier. libgomp's threads spin at a barrier for a while before they sleep: on cores of their own
that keeps a step fast (sleeping at every barrier made target-only decoding take 2x as long on the 2-core
EPYC), but beside another busy process a thread often waits at a barrier for one the scheduler has put aside,
and every region pays for it (measured there: 2 threads beside one busy-loop process took 48 ms a token,
one thread 22, against 14 on idle cores).

So the worker asks a `ThreadGovernor` around each step. It compares the CPU time the process got with the
wall time of its steps: threads that run or spin on free cores get about one second of CPU per thread per
second, while a share well below the thread count means the cores are contended. It then drops to the threads
the share says it really gets, and every `retry` seconds tries the full count again for one window, keeping
it if the cores have become free. Linux and every other platform: `time.process_time` counts all threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_WINDOW = 0.5  # seconds of steps per measurement
_RETRY = 10.0  # seconds between tries of the full thread count while contended
_SLACK = 0.4  # a share this far below the thread count is contention, not Python's own single-threaded moments


class ThreadGovernor:
    """The thread count of the CPU products, chosen from the CPU share the process gets while it steps.

    `threads`: the most (default: torch's count when made). `set_threads`, `wall` and `cpu` are torch's
    setter and the process's clocks, replaceable in tests."""

    def __init__(
        self,
        threads: int | None = None,
        window: float = _WINDOW,
        retry: float = _RETRY,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        wall: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.most = threads or torch.get_num_threads()
        self.threads = self.most
        self._window, self._retry = window, retry
        self._set, self._wall, self._cpu = set_threads, wall, cpu
        self._spent = [0.0, 0.0]  # wall and CPU seconds of the steps in this window
        self._since = self._wall()  # when the thread count last changed
        self._start: tuple[float, float] | None = None

    def before_step(self) -> None:
        """A step begins; while contended, after `retry` seconds the full count is tried again."""
        if self.threads < self.most and self._wall() - self._since >= self._retry:
            self._change(self.most, "trying all threads again")
        self._start = (self._wall(), self._cpu())

    def after_step(self) -> None:
        """A step ended: its wall and CPU time count toward the window, judged when it is full."""
        if self._start is None:
            return
        wall, cpu = self._wall(), self._cpu()
        self._spent[0] += wall - self._start[0]
        self._spent[1] += cpu - self._start[1]
        self._start = None
        if self._spent[0] < self._window:
            return
        share = self._spent[1] / self._spent[0]
        self._spent = [0.0, 0.0]
        if self.threads > 1 and share < self.threads - _SLACK:
            self._change(max(1, int(share)), f"the process got {share:.2f} CPUs of {self.threads} threads")

    def _change(self, threads: int, why: str) -> None:
        if threads != self.threads:
            log.info("CPU threads %d -> %d: %s", self.threads, threads, why)
            self._set(threads)
            self.threads = threads
        self._since = self._wall()
        self._spent = [0.0, 0.0]
