"""The pool that runs a request's work before admission: reading its JSON body, rendering and tokenizing its
prompt, compiling its grammar.

That work is the client's to size (a megabyte of prompt, a regex of 400 KB), and it happens before the
request holds a place, so nothing else bounds it. On the event loop it would stall every stream; in
unbounded threads, eight such requests at once take the cores from the worker that steps the running
generations. Here it runs in `THREADS` threads at a lower scheduling priority (`NICENESS`, on Linux), so the
worker keeps most of the CPU however many such requests arrive: they wait for each other, not the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# Two threads: one hostile request does not hold up every other request's admission, and two nice threads
# take a small share of the cores beside the worker's own.
THREADS = 2
# Niceness of the pool's threads: at +10 a thread weighs 110 against a normal thread's 1,024 in Linux's
# scheduler, so a worker thread keeps about 90% of its core while both pool threads are busy.
NICENESS = 10
THREAD_NAME = "specserve-admission"


def _lower_priority() -> None:
    # Linux gives each thread a niceness of its own (setpriority on its thread id); elsewhere the call would
    # name the whole process, so it is left alone.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)


_POOL = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix=THREAD_NAME, initializer=_lower_priority)


async def run(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the pre-admission pool, awaited without blocking the event loop (at most `THREADS` such
    calls run at once; the others wait their turn)."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))
