"""What the index of earlier answers costs: filing an answer, a lookup, memory per token.

Fills a `TrafficIndex` with answers of the real target's tokenizer (the package's own texts, repeated with
variations as traffic repeats itself) and times, over the same contexts, the lookups a drafting step makes
(`_SuffixSession.proposals`: the request's own text, its prediction, the index). Prints medians.

    .venv/bin/python tools/measure_suffix.py [--answers 2000] [--budget-mb 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from app import store
from app.bench.workload_texts import SYSTEM_PROMPT, long_document
from app.engine.drafting.suffix import SuffixDrafter
from app.engine.drafting.suffix_index import TrafficIndex
from app.engine.model.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=2000)
    parser.add_argument("--budget-mb", type=float, default=64)
    args = parser.parse_args()
    tok = load_model(store.resolve("smollm2-135m-instruct"), "auto", "cpu", None, store.cache_dir(), "auto").tokenizer
    rng = random.Random(0)
    texts = [long_document(i, 12) for i in range(40)] + [SYSTEM_PROMPT]
    answers = []
    for _ in range(args.answers):
        words = rng.choice(texts).split()
        start = rng.randrange(max(1, len(words) - 200))
        answers.append(tok.encode(" ".join(words[start : start + rng.randint(60, 200)])))
    prompt = tok.encode("<|im_start|>assistant\n")
    traffic = TrafficIndex(int(args.budget_mb * 2**20))
    t0 = time.perf_counter()
    for a in answers:
        traffic.add(None, [*prompt, *a], len(prompt))
    filing = time.perf_counter() - t0
    tokens = sum(len(a) for a in answers)
    print(f"filed {len(answers)} answers, {tokens} tokens in {filing:.2f} s: {1e6 * filing / tokens:.2f} us/token")
    print(
        f"held: {traffic.sequences} answers, {traffic.tokens} tokens, {traffic.bytes / 2**20:.1f} MiB "
        f"({traffic.bytes / max(1, traffic.tokens):.0f} bytes/token) within {args.budget_mb:g} MiB"
    )
    session = SuffixDrafter("suffix", traffic).session(4096)
    session.start(len(prompt), None, answers[-1])
    times = []
    hits = 0
    for i in range(40, len(answers[-1])):
        ids = [*prompt, *answers[-1][:i]]
        t = time.perf_counter()
        found = session.proposals(ids, 16)
        times.append(time.perf_counter() - t)
        hits += bool(found)
    print(
        f"a drafting step's lookups (own text, prediction, index of {traffic.tokens} tokens): median "
        f"{1e6 * statistics.median(times):.1f} us, p90 {1e6 * sorted(times)[int(0.9 * len(times))]:.1f} us "
        f"({hits}/{len(times)} found a continuation)"
    )


if __name__ == "__main__":
    main()
