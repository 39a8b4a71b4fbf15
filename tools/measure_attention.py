"""What the cached attention of a step costs on a CPU kernel, by context length and query rows: a model's layers'
calls (SHAPE=heads,kv_heads,head_dim,layers; default SmolLM2-135M's 9,3,64,30; Gemma 3 270M's 4,1,256,18), each
layer over its own cache, so the keys and values stream from memory as in a forward; medians of N (default 9) on
T threads (default 2).

Run: .venv/bin/python tools/measure_attention.py [KERNEL]   (default: the one `auto` selects; CTX=300,2000
ROWS=1,8 to choose the grid)
"""

import os
import statistics
import sys
import time

import torch

from app.engine import kernels


def main() -> None:
    """What the docstring says, when run as a script."""
    torch.set_num_threads(int(os.environ.get("T", "2")))
    kern = kernels.load(sys.argv[1]) if len(sys.argv) > 1 else kernels.kernel()
    assert kern is not None, "no CPU kernel here"
    heads, kv, d, layers = (int(x) for x in os.environ.get("SHAPE", "9,3,64,30").split(","))
    contexts = [int(c) for c in os.environ.get("CTX", "300,2000").split(",")]
    grid_rows = [int(r) for r in os.environ.get("ROWS", "1,8").split(",")]
    capacity = max(contexts) + max(grid_rows)
    g = torch.Generator().manual_seed(0)
    caches = [
        (torch.randn(kv, capacity, d, generator=g).bfloat16(), torch.randn(kv, capacity, d, generator=g).bfloat16())
        for _ in range(layers)
    ]
    print(f"kernel {kern.name}, {torch.get_num_threads()} threads")
    for ctx in contexts:
        for rows in grid_rows:
            q = torch.randn(1, rows, heads, d, generator=g).bfloat16()
            k = torch.randn(1, rows, kv, d, generator=g).bfloat16()
            v = torch.randn(1, rows, kv, d, generator=g).bfloat16()
            times = []
            for _ in range(int(os.environ.get("N", "9"))):
                t0 = time.perf_counter()
                for kc, vc in caches:
                    kern.attention(q, k, v, [(0, rows, kc, vc, ctx)])
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            print(f"context {ctx:5d}, {rows:2d} rows: {ms:.2f} ms ({layers} layers)", flush=True)


if __name__ == "__main__":
    main()
