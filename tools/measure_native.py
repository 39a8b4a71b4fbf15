"""Native GGUF weights against bf16 and llama.cpp, paired in one process on 1 thread: greedy, 64 new tokens, the
package's first P prompts (default 6), R rounds (default 2), every system in turn on each prompt; tokens per
CPU-second (process time: what a busy machine's other work takes least away from) and per wall second.

Run: .venv/bin/python tools/measure_native.py   (needs llama-cpp-python, see README's Benchmarks)
"""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app import store
from app.bench.llamacpp import LlamaCppRunner
from app.engine.factory import build_engine
from app.engine.step import GenerationParams


def main() -> None:
    """What the docstring says, when run as a script."""
    torch.set_num_threads(1)
    lines = [json.loads(line) for line in (Path(__file__).parents[1] / "app/bench/prompts.jsonl").open()]
    engines = {w: build_engine(dtype="auto", device="cpu", weights=w)[0] for w in ("native", "bf16")}
    tok = engines["native"].tokenizer
    chat = [[{"role": "user", "content": d["turns"][0]}] for d in lines[: int(os.environ.get("P", "6"))]]
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in chat]
    llama = LlamaCppRunner(store.resolve("smollm2-135m-instruct"), threads=1)
    params = GenerationParams(max_new_tokens=64, num_draft_tokens=4)

    def ours(engine, draft: str) -> Callable[[list[int]], list[int]]:
        def run(prompt: list[int]) -> list[int]:
            gen = engine.start(prompt, params, draft)
            while not gen.finished:
                gen.step()
            return gen.generated_ids

        return run

    systems = {"llama.cpp Q4_1": lambda p: llama.run(p, 64)[0]}
    for weights, engine in engines.items():
        systems[f"{weights} target-only"] = ours(engine, "none")
        systems[f"{weights} hybrid"] = ours(engine, "default")
    cpu = dict.fromkeys(systems, 0.0)
    wall = dict.fromkeys(systems, 0.0)
    tokens = dict.fromkeys(systems, 0)
    for run in systems.values():
        run(prompts[0])  # warm up
    for _ in range(int(os.environ.get("R", "2"))):
        for prompt in prompts:
            for name, run in systems.items():
                c0, w0 = time.process_time(), time.perf_counter()
                tokens[name] += len(run(prompt))
                cpu[name] += time.process_time() - c0
                wall[name] += time.perf_counter() - w0
    for name in systems:
        rate, wall_rate = tokens[name] / cpu[name], tokens[name] / wall[name]
        print(f"{name:22s} {rate:6.1f} tokens per CPU-second ({wall_rate:5.1f} tok/s wall)")


if __name__ == "__main__":
    main()
