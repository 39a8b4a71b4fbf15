"""How fast `train-draft` writes its corpus: the target (bfloat16, on the best CPU kernel) answers N traffic-like
instructions (seed 7, past the first 5,000, so never the recipe's), 160 new tokens at most, greedy and at 0.7,
48 at a time, into a temporary directory; prints answers, answer tokens, positions (prompt and answer, what
training reads) and their rates.

Run: .venv/bin/python tools/measure_corpus.py [N] [label]   (default: 96 corpus)
To compare two trees, import the other's `app` (the call is the same in both):
  PYTHONPATH=/path/to/other/tree .venv/bin/python tools/measure_corpus.py 96 before
"""

import sys
import tempfile
import time
from pathlib import Path

from app import store
from app.distill import corpus, instructions
from app.engine.model.loading import load_model


def main() -> None:
    """What the docstring says, when run as a script."""
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    label = sys.argv[2] if len(sys.argv) > 2 else "corpus"
    loaded = load_model(
        store.resolve("smollm2-135m-instruct"), "bfloat16", "cpu", cache_dir=store.cache_dir(), weights="bf16"
    )
    prompts: list[corpus.Prompt] = list(instructions.traffic_instructions(5000 + n, 7)[5000:])
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        paths = corpus.build_corpus(loaded, prompts, Path(d), 48, 160, (0.0, 0.7), 0)
        seconds = time.perf_counter() - t0
        samples = corpus.load_shards(paths)
    answer = sum(len(s.tokens) - s.prompt_len for s in samples)
    positions = sum(len(s.tokens) - 1 for s in samples)
    print(
        f"{label}: {len(samples)} answers, {answer} answer tokens, {positions} positions in {seconds:.1f} s: "
        f"{answer / seconds:.1f} answer tokens/s, {positions / seconds:.0f} positions/s",
        flush=True,
    )


if __name__ == "__main__":
    main()
