"""Where a 1-row decoding step's time goes: the layers (`Transformer.hidden` for one token after a 300-token
prompt), the head (`logits`) and the greedy choice (the engine's float32 argmax), medians of N (default 25) on T
threads (default 2).

Run: .venv/bin/python tools/measure_step.py [MODEL]   (a catalog name, default gemma-3-270m-q4_k_m; W=native|bf16)
"""

import os
import statistics
import sys
import time

import torch

from app import store
from app.engine.decoding.sampling import argmax
from app.engine.model.loading import load_model


def main() -> None:
    """What the docstring says, when run as a script."""
    torch.set_num_threads(int(os.environ.get("T", "2")))
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma-3-270m-q4_k_m"
    weights = os.environ.get("W", "native")
    loaded = load_model(store.resolve(name), dtype="auto", weights=weights, cache_dir=store.cache_dir())
    model = loaded.model
    print(f"{name}: {loaded.weights}, {loaded.weight_bytes / 1e6:.0f} MB, kernel {model.kernel}")
    cache = model.new_cache(512)
    times: dict[str, list[float]] = {"layers": [], "head": [], "argmax": []}
    with torch.inference_mode():
        model.hidden(torch.randint(100, 1000, (1, 300), generator=torch.Generator().manual_seed(0)), 0, cache)
        token = torch.tensor([[500]])
        for _ in range(int(os.environ.get("N", "25"))):
            cache.length = 300
            t0 = time.perf_counter()
            hidden = model.hidden(token, 300, cache)
            t1 = time.perf_counter()
            logits = model.logits(hidden[:, -1])
            t2 = time.perf_counter()
            int(argmax(logits.float()))  # as the greedy chooser takes it
            t3 = time.perf_counter()
            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[key].append(dt)
    print("  ".join(f"{key} {statistics.median(v) * 1e3:.2f} ms" for key, v in times.items()))


if __name__ == "__main__":
    main()
