"""Prefill speed, native GGUF blocks against bf16, side by side in one process: one forward over a random prompt of
64, 256 and 1024 tokens into an empty cache (plus the last row's logits), median of 3 after a warm-up, 2 threads.

Run: .venv/bin/python tools/measure_prefill.py   (SPECSERVE_KERNEL picks the kernel, as for the server)
"""

import statistics
import time

import torch

from app.engine.factory import build_engine


def main() -> None:
    """What the docstring says, when run as a script."""
    torch.set_num_threads(2)
    models = {w: build_engine(dtype="auto", device="cpu", weights=w)[0].target for w in ("native", "bf16")}
    for n in (64, 256, 1024):
        ids = torch.randint(0, 40000, (1, n))
        cells = []
        for weights, model in models.items():
            times = []
            for _ in range(4):
                cache = model.new_cache(2048)
                t0 = time.perf_counter()
                model.logits(model.hidden(ids, 0, cache)[0, -1:])
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times[1:])
            cells.append(f"{weights}: {seconds * 1e3:.0f} ms ({n / seconds:.0f} tok/s)")
        print(f"{n:5d} tokens  " + "  ".join(cells))


if __name__ == "__main__":
    main()
