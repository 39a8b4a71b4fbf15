"""What a verification's rows cost: one target forward plus its head over R new rows (300 tokens in the cache),
native GGUF blocks and bf16 side by side in one process, median of 9 after 3 warm-up calls, in ms.

Run: .venv/bin/python tests/_measure_rows.py [threads]   (SPECSERVE_KERNEL picks the kernel, as for the server)
"""

import statistics
import sys
import time

import torch

from app.engine.factory import build_engine

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
ROWS = (1, 2, 3, 4, 5, 6, 8)
for weights in ("native", "bf16"):
    model = build_engine(dtype="auto", device="cpu", weights=weights)[0].target
    cache = model.new_cache(1024)
    model.hidden(torch.randint(0, 40000, (1, 300)), 0, cache)
    cells = []
    for rows in ROWS:
        x = torch.randint(0, 40000, (1, rows))
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            model.logits(model.hidden(x, 300, cache)[0])
            times.append(time.perf_counter() - t0)
            cache.truncate(300)
        cells.append(f"{rows}: {statistics.median(times[3:]) * 1e3:.1f}")
    print(f"{weights:6s} ms by rows  " + "  ".join(cells))
