"""The server loads its models in a thread that ends with the loading, taking torch's OpenMP helpers with it.

libgomp keeps a pool of helper threads for every thread that ran parallel code until that thread exits; a
loader pool left alive made libgomp manage more threads than the CPUs and stop spinning between parallel
regions, which slowed every decoding step of the worker by a third (see `app.api.server._in_own_thread`).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from app.api.server import _in_own_thread


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settle(target: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while _threads() > target and time.monotonic() < deadline:
        time.sleep(0.02)
    return _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_loading_leaves_no_threads_behind() -> None:
    def parallel_work() -> int:
        x = torch.ones(4_000_000)
        return int((x * 2).sum())  # parallel regions in the loading thread: its OpenMP pool starts

    async def main() -> tuple[int, int, int]:
        await asyncio.to_thread(lambda: None)  # the loop's executor thread exists before counting
        before = _threads()
        result = await _in_own_thread(parallel_work)
        # Counted while the loop still runs, as the server's does. With `asyncio.to_thread(parallel_work)`
        # the executor thread's OpenMP helpers stay: torch.get_num_threads() - 1 threads more.
        return result, before, _settle(before)

    result, before, after = asyncio.run(main())
    assert result == 8_000_000
    assert after == before, "the loading thread or its OpenMP helpers outlived the loading"


def test_a_loading_failure_reaches_the_caller() -> None:
    def fail() -> None:
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        asyncio.run(_in_own_thread(fail))
