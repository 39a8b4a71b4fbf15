"""The CPU thread count under contention (app/engine/threads.py), on a process whose clocks the test drives."""

from __future__ import annotations

import sys

from app.engine.threads import ThreadGovernor, run_delay


class Clocks:
    """A process's wall, CPU and run-delay clocks: each step takes `step` seconds, gets `share` CPUs (None:
    one per thread, free cores) and waits `delay` seconds a second for a CPU."""

    def __init__(self, schedstat: bool = True) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.delay = 0.0
        self.schedstat = schedstat

    def waited(self) -> float | None:
        return self.delay if self.schedstat else None

    def run(
        self,
        governor: ThreadGovernor,
        steps: int,
        share: float | None,
        delay: float = 0.0,
        tokens: dict[int, int] | None = None,
    ) -> None:
        """`tokens`: what a decoding step generates at each thread count (None: steps that say nothing)."""
        for _ in range(steps):
            governor.before_step()
            self.wall += 0.05
            self.cpu += (0.985 * governor.threads if share is None else share) * 0.05
            self.delay += delay * 0.05
            governor.after_step(None if tokens is None else tokens[governor.threads])
            self.wall += 0.001  # between steps: no CPU counted toward the steps


def _governor(clocks: Clocks, most: int, calls: list[int]) -> ThreadGovernor:
    return ThreadGovernor(
        most,
        window=0.5,
        retry=10.0,
        set_threads=calls.append,
        wall=lambda: clocks.wall,
        cpu=lambda: clocks.cpu,
        waited=clocks.waited,
    )


def test_free_cores_keep_every_thread() -> None:
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 2, calls)
    clocks.run(governor, 400, share=None)  # threads running or spinning: about one CPU each
    # Steps with long single-threaded Python stretches: a low share, but no thread waited for a CPU.
    clocks.run(governor, 400, share=1.3, delay=0.01)
    assert governor.threads == 2 and calls == []


def test_contended_cores_drop_to_the_share_and_try_all_again() -> None:
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 2, calls)
    clocks.run(governor, 10, share=1.3, delay=0.6)  # one window: another process holds a core
    assert governor.threads == 1 and calls == [1]
    clocks.run(governor, 150, share=1.0, delay=0.05)  # 7.6 s: still before the next try
    assert governor.threads == 1
    clocks.run(governor, 50, share=1.0, delay=0.05)  # past 10 s: all threads again for a window, still contended
    assert calls[:2] == [1, 2]
    clocks.run(governor, 10, share=1.3, delay=0.6)
    assert governor.threads == 1 and calls == [1, 2, 1]
    # The other process ends: the next try keeps every thread.
    clocks.run(governor, 400, share=None)
    assert governor.threads == 2 and calls == [1, 2, 1, 2]


def test_without_schedstat_the_share_decides() -> None:
    clocks, calls = Clocks(schedstat=False), []
    governor = _governor(clocks, 2, calls)
    clocks.run(governor, 100, share=None)
    assert calls == []
    clocks.run(governor, 25, share=1.3)  # at least one whole window
    assert governor.threads == 1 and calls == [1]


def test_many_threads_drop_to_what_the_process_gets() -> None:
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 16, calls)
    clocks.run(governor, 10, share=9.6, delay=3.0)
    assert governor.threads == 9 and calls == [9]
    clocks.run(governor, 10, share=8.9, delay=0.5)  # at 9 threads, 8.9 CPUs: not contended
    assert governor.threads == 9


def test_one_thread_is_left_alone() -> None:
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 1, calls)
    clocks.run(governor, 100, share=0.3, delay=0.9)
    assert governor.threads == 1 and calls == []


def test_run_delay_reads_this_process() -> None:
    # Linux: the threads' schedstat run delay, a count of seconds that never goes back.
    first = run_delay()
    if sys.platform != "linux":
        assert first is None  # elsewhere the governor decides by the CPU share alone
        return
    assert first is not None and first >= 0 and (run_delay() or 0.0) >= first


def test_a_drop_that_decodes_slower_is_undone_and_not_tried_again_while_fresh() -> None:
    # A light process beside (a load generator, the server's own event loop): the clocks say contended, but
    # two threads still decode more tokens a second than one.
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 2, calls)
    light = {2: 3, 1: 2}
    clocks.run(governor, 10, share=1.5, delay=0.6, tokens=light)  # one window at 2: contended, 60 tokens/s
    assert calls == [1]
    clocks.run(governor, 10, share=1.0, delay=0.3, tokens=light)  # one window at 1: 40 tokens/s
    assert governor.threads == 2 and calls == [1, 2]
    clocks.run(governor, 150, share=1.5, delay=0.6, tokens=light)  # 7.6 s: the slower drop is not tried again
    assert governor.threads == 2 and calls == [1, 2]
    clocks.run(governor, 100, share=1.5, delay=0.6, tokens=light)  # past 10 s it is stale: tried, undone again
    assert calls == [1, 2, 1, 2] and governor.threads == 2


def test_a_drop_that_decodes_faster_is_kept() -> None:
    # A busy process beside: every barrier waits for a thread the scheduler put aside; one thread is faster.
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 2, calls)
    busy = {2: 1, 1: 2}
    clocks.run(governor, 10, share=1.3, delay=0.6, tokens=busy)
    assert calls == [1]
    clocks.run(governor, 150, share=1.0, delay=0.05, tokens=busy)  # faster: kept
    assert governor.threads == 1 and calls == [1]
    clocks.run(governor, 60, share=1.3, delay=0.6, tokens=busy)  # past 10 s: all threads again, slower: dropped
    assert calls == [1, 2, 1] and governor.threads == 1
