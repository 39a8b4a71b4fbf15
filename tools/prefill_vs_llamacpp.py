"""Prefill beside llama.cpp on the same GGUF file, in one process: N random prompt ids (default 512) into an empty
cache, ours in the engine's 512-token chunks with native weights (plus the last row's logits), llama.cpp's `eval`
with n_batch 512, alternating, median of 3, 2 threads. Needs llama-cpp-python (see docs/bench).

Run: .venv/bin/python tools/prefill_vs_llamacpp.py [MODEL] [N]   (a catalog name or a GGUF path; default the
default target; the synthetic 1.7B: ~/.cache/specserve/synthetic/smollm2-1.7b-random.q4_k_m.gguf after
`specserve bench --synthetic 1.7b --synthetic-format q4_k_m`)
"""

import statistics
import sys
import time

import torch
from llama_cpp import Llama

from app import store
from app.engine.factory import build_engine

CHUNK = 512


def main() -> None:
    """What the docstring says, when run as a script."""
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    path = store.resolve(name)
    gguf = path if path.suffix == ".gguf" else next(path.glob("*.gguf"))
    torch.set_num_threads(2)
    target = build_engine(target=str(path), draft="none", dtype="auto", device="cpu", weights="native")[0].target
    llm = Llama(str(gguf), n_threads=2, n_threads_batch=2, n_ctx=n + 64, n_batch=CHUNK, verbose=False)
    ids = torch.randint(100, 40000, (1, n))
    ours, theirs = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        cache = target.new_cache(n + 64)
        for start in range(0, n, CHUNK):
            hidden = target.hidden(ids[:, start : start + CHUNK], start, cache)
        target.logits(hidden[0, -1:])
        ours.append(time.perf_counter() - t0)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[0].tolist())
        theirs.append(time.perf_counter() - t0)
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"{gguf.name}, {n} tokens: ours {n / o:.1f} tok/s, llama.cpp {n / t:.1f} tok/s, {t / o:.2f}x")


if __name__ == "__main__":
    main()
