"""The CPU thread count under contention (app/engine/threads.py), on a process whose clocks the test drives."""

from __future__ import annotations

from app.engine.threads import ThreadGovernor


class Clocks:
    """A process's wall and CPU clocks: each step takes `step` seconds and gets `share` CPUs."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def run(self, governor: ThreadGovernor, steps: int, share: float | None, step: float = 0.05) -> None:
        """`share` None: free cores, each thread gets a CPU."""
        for _ in range(steps):
            governor.before_step()
            self.wall += step
            self.cpu += (0.985 * governor.threads if share is None else share) * step
            governor.after_step()
            self.wall += 0.001  # between steps: no CPU counted toward the steps


def _governor(clocks: Clocks, most: int, calls: list[int]) -> ThreadGovernor:
    return ThreadGovernor(
        most, window=0.5, retry=10.0, set_threads=calls.append, wall=lambda: clocks.wall, cpu=lambda: clocks.cpu
    )


def test_free_cores_keep_every_thread() -> None:
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 2, calls)
    clocks.run(governor, 400, share=None)  # threads running or spinning: about one CPU each
    assert governor.threads == 2 and calls == []


def test_contended_cores_drop_to_the_share_and_try_all_again() -> None:
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 2, calls)
    clocks.run(governor, 10, share=1.3)  # one window: another process holds a core
    assert governor.threads == 1 and calls == [1]
    clocks.run(governor, 150, share=1.0)  # 7.6 s: still before the next try
    assert governor.threads == 1
    clocks.run(governor, 50, share=1.0)  # past 10 s: all threads again for a window, still contended
    assert calls[:2] == [1, 2]
    clocks.run(governor, 10, share=1.3)
    assert governor.threads == 1 and calls == [1, 2, 1]
    # The other process ends: the next try keeps every thread.
    clocks.run(governor, 400, share=None)
    assert governor.threads == 2 and calls == [1, 2, 1, 2]


def test_many_threads_drop_to_what_the_process_gets() -> None:
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 16, calls)
    clocks.run(governor, 10, share=9.6)
    assert governor.threads == 9 and calls == [9]
    clocks.run(governor, 10, share=8.9)  # at 9 threads, 8.9 CPUs: not contended
    assert governor.threads == 9


def test_one_thread_is_left_alone() -> None:
    clocks, calls = Clocks(), []
    governor = _governor(clocks, 1, calls)
    clocks.run(governor, 100, share=0.3)
    assert governor.threads == 1 and calls == []
