"""The model draft in place, three ways, on held-out Spec-Bench prompts (greedy, one process, nothing else running):

# its greedy chain in one C call against token by token: two engines, interleaved prompt by prompt, each
# decoding step timed whole and grouped by what it drafted
.venv/bin/python tools/measure_draft.py chain
# how well its confidence predicts the target: each position of the target's own answers drafted 8 deep,
# agreement with the target by depth and by the draft's top probability
.venv/bin/python tools/measure_draft.py calibration
# draft lengths: the model draft fixed at 1-3 tokens and adaptive, beside no draft, suffix and hybrid
.venv/bin/python tools/measure_draft.py schedules
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch
from measure_hybrid import add_step, timed_steps  # tools/, beside this script

from app.bench.specbench import _prompt_ids, read_prompts
from app.engine.drafting.eagle import EagleDrafter
from app.engine.drafting.tree import TreeShape
from app.engine.factory import build_engine
from app.engine.kernels import DraftChain
from app.engine.step import GenerationParams

_BINS = ((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 0.9), (0.9, 1.01))


def _eagle(engine) -> tuple[str, EagleDrafter]:
    for name, drafter in engine.drafters.items():
        if isinstance(drafter, EagleDrafter):
            return name, drafter
    raise SystemExit("the engine has no feature draft")


def _chain(prompts, tokens: int) -> None:
    loop, _ = build_engine()
    name, drafter = _eagle(loop)
    drafter.draft.__dict__["_chain"] = None  # token by token: the loop's forward, head and choice per token
    chain, _ = build_engine()
    engines = {"chain": chain, "loop": loop}
    calls: list[tuple[int, int, float]] = []  # the chain's calls: (rows caught up, tokens, seconds)
    run = DraftChain.__call__

    def timed(self, states, embeds, *args):
        t0 = time.perf_counter()
        out = run(self, states, embeds, *args)
        calls.append((len(embeds), len(out[0]), time.perf_counter() - t0))
        return out

    DraftChain.__call__ = timed
    drafts = ["default", name]
    seen = {(e, d): collections.defaultdict(lambda: [0, 0.0, 0, 0.0, 0.0, 0]) for e in engines for d in drafts}
    for engine in engines.values():  # each path's first call, and the schedule's first costs
        for d in drafts:
            for _ in engine.generate(_prompt_ids(engine.tokenizer, "Hello!"), GenerationParams(max_new_tokens=16), d):
                pass
    for i, p in enumerate(prompts):
        for d in drafts:
            for label, engine in list(engines.items())[:: 1 if i % 2 else -1]:
                ids = _prompt_ids(engine.tokenizer, p.text)
                for kind, wall, out in timed_steps(engine, ids, d, tokens, f"m/{d}"):
                    add_step(seen[(label, d)][kind], wall, out)
    print("| path | draft | step | steps | tokens/step | drafted/step | ms/step | draft ms | draft ms/token | tok/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (label, d), kinds in seen.items():
        for kind in ("none", "lookup", "model", "all"):
            row = [sum(v[i] for v in kinds.values()) for i in range(6)] if kind == "all" else kinds.get(kind)
            if not row or not row[0]:
                continue
            n, wall, toks, draft, _, drafted = row
            per = f"{1e3 * draft / drafted:.3f}" if drafted else ""
            print(
                f"| {label} | {d} | {kind} | {n} | {toks / n:.2f} | {drafted / n:.2f} | {1e3 * wall / n:.2f} | "
                f"{1e3 * draft / n:.2f} | {per} | {toks / wall:.0f} |"
            )
    print("\n| rows caught up | chain calls | tokens a call | ms a call |\n|---|---:|---:|---:|")
    for lo, hi in ((1, 1), (2, 2), (3, 4), (5, 16), (17, 1 << 20)):
        these = [(n, s) for t, n, s in calls if lo <= t <= hi]
        if these:
            span = f"{lo}" if lo == hi else f"{lo}-{hi}" if hi < 1 << 20 else f"{lo}+"
            tokens, seconds = sum(n for n, _ in these), sum(s for _, s in these)
            print(f"| {span} | {len(these)} | {tokens / len(these):.2f} | {1e3 * seconds / len(these):.3f} |")


def _calibration(prompts, tokens: int, depth: int) -> None:
    engine, _ = build_engine()
    _, drafter = _eagle(engine)
    seen: list[list[tuple[float, bool]]] = []  # per position: the chain's (top probability, agrees) by depth
    for p in prompts:
        ids = _prompt_ids(engine.tokenizer, p.text)
        steps = engine.generate(ids, GenerationParams(max_new_tokens=tokens), "none")
        text = list(ids) + [t for out in steps for t in out.token_ids]
        with torch.inference_mode():
            states = drafter.target.hidden(torch.tensor([text]))[0]
        session = drafter.session(len(text) + depth + 1)
        session.features[: len(text)] = states
        for pos in range(len(ids) - 1, len(text) - 1):
            found = session.propose_candidates(text[: pos + 1], TreeShape(depth, 1))
            truth = text[pos + 1 : pos + 1 + depth]
            seen.append([(pr, tok == want) for tok, pr, want in zip(found.tokens, found.probs, truth, strict=False)])
    bins = " | ".join(f"p {lo:.1f}-{min(hi, 1):.1f}: n, agree" for lo, hi in _BINS)
    print(f"| depth | tried | agree | {bins} |")
    print("|---:|---:|---:|" + "---:|" * len(_BINS))
    for d in range(depth):
        # A token counts where every token before it in its chain agreed: what verification would reach.
        tried = [chain[d] for chain in seen if len(chain) > d and all(ok for _, ok in chain[:d])]
        if not tried:
            continue
        cells = []
        for lo, hi in _BINS:
            inside = [ok for pr, ok in tried if lo <= pr < hi]
            cells.append(f"{len(inside)}, {sum(inside) / len(inside):.2f}" if inside else "0")
        print(f"| {d + 1} | {len(tried)} | {sum(ok for _, ok in tried) / len(tried):.2f} | " + " | ".join(cells) + " |")


def _schedules(prompts, tokens: int) -> None:
    engine, _ = build_engine()
    name, _ = _eagle(engine)
    configs = {
        "none": ("none", {}),
        f"{name} adaptive": (name, {"draft_schedule": "adaptive", "num_draft_tokens": 8}),
        **{f"{name} fixed {k}": (name, {"draft_schedule": "fixed", "num_draft_tokens": k}) for k in (1, 2, 3)},
        "hybrid (default)": ("default", {}),
        "suffix": ("suffix", {}),
    }
    for d, kw in configs.values():
        for _ in engine.generate(_prompt_ids(engine.tokenizer, "Hello!"), GenerationParams(max_new_tokens=16, **kw), d):
            pass
    seen = collections.defaultdict(lambda: [0, 0.0, 0, []])
    for i, p in enumerate(prompts):
        ids = _prompt_ids(engine.tokenizer, p.text)
        for label, (d, kw) in list(configs.items())[:: 1 if i % 2 else -1]:
            gen = engine.start(ids, GenerationParams(max_new_tokens=tokens, cache_salt=label, **kw), d)
            gen.step()  # the prefill
            t0 = time.perf_counter()
            while not gen.finished:
                gen.step()
            wall = time.perf_counter() - t0
            n = gen.stats.generated_tokens - 1
            row = seen[label]
            row[0] += n
            row[1] += wall
            row[2] += gen.stats.target_passes - 1
            row[3].append(n / wall)
    base = seen["none"][0] / seen["none"][1]
    print("| draft | tok/s | x no draft | median tok/s of a prompt | tokens per pass |")
    print("|---|---:|---:|---:|---:|")
    for label, (n, wall, passes, rates) in seen.items():
        rates.sort()
        median = rates[len(rates) // 2]
        print(f"| {label} | {n / wall:.1f} | {n / wall / base:.3f} | {median:.1f} | {n / max(passes, 1):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["chain", "calibration", "schedules"])
    parser.add_argument("--input", default="../shared/bench/specbench-dev.jsonl")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=8, help="calibration: the chain's depth")
    args = parser.parse_args()
    prompts = read_prompts(Path(args.input), per_category=args.per_category)
    if args.what == "chain":
        _chain(prompts, args.max_new_tokens)
    elif args.what == "calibration":
        _calibration(prompts, args.max_new_tokens, args.depth)
    else:
        _schedules(prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
