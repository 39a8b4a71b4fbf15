"""Where a draft's steps go, in place: each decoding step of held-out Spec-Bench prompts timed whole (plan, draft,
verification, emit) and grouped by what it drafted (nothing, a lookup, the model draft), per draft, interleaved
prompt by prompt; with --inflate, the stale-cost check (the calibration's row costs multiplied, then the same
prompts three times: do lookups come back?).

    .venv/bin/python tools/measure_hybrid.py --draft default --draft suffix
    .venv/bin/python tools/measure_hybrid.py --draft default --inflate 1.0
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

from app.bench.specbench import _prompt_ids, read_prompts
from app.engine.factory import build_engine
from app.engine.step import GenerationParams


def timed_steps(engine, ids, draft: str, tokens: int, salt: str):
    """Each decoding step of one generation after its prefill, timed whole: (what drafted it, "none", "lookup" or
    "model"; its wall seconds; its StepOutput)."""
    gen = engine.start(ids, GenerationParams(max_new_tokens=tokens, cache_salt=salt), draft)
    gen.step()  # the prefill
    while not gen.finished:
        before = dict(gen.stats.draft_sources)
        t0 = time.perf_counter()
        out = gen.step()
        wall = time.perf_counter() - t0
        # What drafted this step: the source whose count of verified drafts grew (none: nothing drafted).
        grew = [s for s, n in gen.stats.draft_sources.items() if n > before.get(s, 0)]
        yield "none" if not grew else "model" if grew == ["model"] else "lookup", wall, out


def add_step(row: list, wall: float, out) -> None:
    """Count a step into `row`: [steps, wall seconds, tokens, draft seconds, verify seconds, drafted tokens]."""
    for i, value in enumerate((1, wall, len(out.token_ids), out.draft_seconds, out.verify_seconds, out.drafted)):
        row[i] += value


def _kinds(engine, prompts, drafts: list[str], tokens: int) -> None:
    tok = engine.tokenizer
    seen = {d: collections.defaultdict(lambda: [0, 0.0, 0, 0.0, 0.0, 0]) for d in drafts}
    for d in drafts:  # warm-up: each path's first call, and the schedule's first costs
        for _ in engine.generate(_prompt_ids(tok, "Hello, who are you?"), GenerationParams(max_new_tokens=16), d):
            pass
    for p in prompts:
        ids = _prompt_ids(tok, p.text)
        for d in drafts:
            for kind, wall, out in timed_steps(engine, ids, d, tokens, f"m/{d}"):
                add_step(seen[d][kind], wall, out)
    print("| draft | step | steps | tokens/step | drafted/step | ms/step | draft ms | verify ms | tok/s of these |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for d, kinds in seen.items():
        for kind in ("none", "lookup", "model"):
            n, wall, toks, draft, verify, drafted = kinds.get(kind, [0, 0.0, 0, 0.0, 0.0, 0])
            if n:
                print(
                    f"| {d} | {kind} | {n} | {toks / n:.2f} | {drafted / n:.2f} | {1e3 * wall / n:.2f} | "
                    f"{1e3 * draft / n:.2f} | {1e3 * verify / n:.2f} | {toks / wall:.0f} |"
                )
        n = sum(v[0] for v in kinds.values())
        toks = sum(v[2] for v in kinds.values())
        wall = sum(v[1] for v in kinds.values())
        print(f"| {d} | all | {n} | {toks / n:.2f} | | {1e3 * wall / n:.2f} | | | {toks / wall:.0f} |")


def _stale(engine, prompts, draft: str, inflate: float, tokens: int) -> None:
    seconds = engine.calibrate()
    engine._verify_costs.seed({r: seconds[1] * (1 + inflate * (r - 1)) for r in seconds}, 32)
    print(f"calibration's row costs replaced: each row after the first {inflate:.2f} of a 1-row step")
    for rnd in range(3):
        toks = passes = 0
        t0 = time.perf_counter()
        for p in prompts:
            gen = engine.start(_prompt_ids(engine.tokenizer, p.text), GenerationParams(max_new_tokens=tokens), draft)
            while not gen.finished:
                gen.step()
            toks += gen.stats.generated_tokens
            passes += gen.stats.target_passes
        print(f"round {rnd}: {toks / passes:.2f} tokens per pass, {toks / (time.perf_counter() - t0):.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", action="append", default=None)
    parser.add_argument("--input", default="../shared/bench/specbench-dev.jsonl")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--inflate", type=float, default=None)
    args = parser.parse_args()
    engine, _ = build_engine()
    prompts = read_prompts(Path(args.input), per_category=args.per_category)
    drafts = args.draft or ["default", "suffix"]
    if args.inflate is not None:
        _stale(engine, prompts[:6], drafts[0], args.inflate, args.max_new_tokens)
    else:
        _kinds(engine, prompts, drafts, args.max_new_tokens)


if __name__ == "__main__":
    main()
