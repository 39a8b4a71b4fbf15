"""RSS of a server's worker before and after max-length requests, with and without the worker's malloc_trim.

A measurement, not a test (pytest does not collect it). Run it as

    .venv/bin/python tools/measure_rss.py --trim off     # then malloc_trim(0) by hand, at the end
    .venv/bin/python tools/measure_rss.py --trim on      # the worker trims after each long request

It loads the target and the draft as `specserve serve` does, runs the scheduler's worker thread, sends one
short request (warm-up), then `--requests` requests of the model's whole context (a prompt of context - 16
tokens of Spec-Bench text, 16 new tokens), one after the other, and prints VmRSS (and the peak, VmHWM) in MB
after each, once the worker is idle.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import time
from pathlib import Path

from app.engine.factory import build_engine
from app.engine.step import GenerationParams
from app.service.scheduler import Scheduler, Ticket

SPECBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "bench" / "specbench-dev.jsonl"


def _status(field: str) -> float:
    """A VmXXX line of /proc/self/status, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _report(label: str) -> None:
    print(f"{label:<44} RSS {_status('VmRSS'):7.0f} MB   peak {_status('VmHWM'):7.0f} MB", flush=True)


async def _finish(ticket: Ticket) -> None:
    async for event in ticket.events():
        if event.finished is not None:
            return


async def _idle(scheduler: Scheduler) -> None:
    while scheduler.holding:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the worker's end of step (release, trim) after the last event


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trim", choices=["on", "off"], required=True)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft", default="default")
    args = parser.parse_args()

    engine, _ = build_engine(draft=args.draft, num_draft_tokens=6, dtype=args.dtype)
    context = engine.target.config.max_seq_len
    scheduler = Scheduler(engine, 4, 16, trim_after_tokens=2048 if args.trim == "on" else 0)
    scheduler.start()
    _report(f"loaded ({args.dtype}, draft {args.draft}, trim {args.trim})")
    turns = [json.loads(line)["turns"][0] for line in SPECBENCH.read_text().splitlines() if line.strip()]
    ids = engine.tokenizer.encode("\n\n".join(turns))
    while len(ids) < context:
        ids += ids
    short = engine.tokenizer.encode(turns[0])
    await _finish(scheduler.submit(short, GenerationParams(max_new_tokens=16, num_draft_tokens=4), None, 600))
    await _idle(scheduler)
    _report("after a short request")
    new = 16
    for i in range(args.requests):
        await _finish(
            scheduler.submit(ids[: context - new], GenerationParams(max_new_tokens=new, num_draft_tokens=4), None, 600)
        )
        await _idle(scheduler)
        _report(f"after max-length request {i + 1} ({context - new}+{new})")
    if args.trim == "off":
        t0 = time.perf_counter()
        ctypes.CDLL(None).malloc_trim(0)
        seconds = time.perf_counter() - t0
        _report(f"after malloc_trim(0) by hand ({seconds * 1000:.0f} ms)")
    scheduler.stop()


if __name__ == "__main__":
    asyncio.run(main())
