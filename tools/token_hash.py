"""A fingerprint of what the engine decodes: hashes of greedy and seeded tokens over prompts of every category.

Run before and after a change that must not change a token (a restructuring, a new kernel); the hashes must
match. Each kernel runs in its own process (the kernel is chosen once per process):

    python tools/token_hash.py                  # every kernel this CPU runs, then torch
    python tools/token_hash.py --kernel avx2    # one

Greedy: target-only, prompt lookup, the feature draft, the hybrid (adaptive draft length: the lengths vary
with measured costs, the tokens may not), a tree of 8 rows, and the hybrid batched over all prompts at once.
Seeded: the Gumbel sampler with the hybrid (adaptive), the rejection sampler with a fixed k=4 (what its seed
gives depends on the draft lengths). Prints one JSON object per kernel: configuration -> sha256 prefix.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "app" / "bench" / "prompts.jsonl"


def _digest(tokens: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def _one_kernel(max_new_tokens: int, limit: int, dtype: str) -> dict[str, str]:
    from app.engine.factory import build_engine
    from app.engine.step import GenerationParams

    engine, loaded = build_engine(dtype=dtype)
    tok = loaded.tokenizer
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][:limit]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}])) for r in rows]
    draft = next(name for name in engine.drafters if name not in ("ngram", "hybrid"))
    greedy = GenerationParams(max_new_tokens=max_new_tokens, num_draft_tokens=6, draft_schedule="adaptive")
    configs = {
        "greedy/none": (greedy, "none"),
        "greedy/ngram": (greedy, "ngram"),
        f"greedy/{draft}": (greedy, draft),
        "greedy/hybrid": (greedy, "hybrid"),
        "greedy/tree8": (GenerationParams(max_new_tokens=max_new_tokens, num_draft_tokens=6, tree_rows=8), draft),
        "gumbel/hybrid": (
            GenerationParams(max_new_tokens=max_new_tokens, num_draft_tokens=6, temperature=0.8, top_p=0.95, seed=7),
            "hybrid",
        ),
        "rejection/hybrid-k4": (
            GenerationParams(
                max_new_tokens=max_new_tokens,
                num_draft_tokens=4,
                draft_schedule="fixed",
                temperature=0.7,
                top_k=40,
                seed=11,
                sampler="rejection",
            ),
            "hybrid",
        ),
    }
    out: dict[str, str] = {}
    for name, (params, drafter) in configs.items():
        tokens = []
        for ids in prompts:
            gen = engine.start(ids, params, drafter)
            while not gen.finished:
                gen.step()
            tokens.append(gen.generated_ids)
        out[name] = _digest(tokens)
        if name == "greedy/none":
            out["greedy/none-tokens"] = str(sum(len(t) for t in tokens))
            baseline = tokens
        if name.startswith("greedy/") and tokens != baseline:
            out[name] += " DIFFERS FROM TARGET-ONLY"
        if name == "gumbel/hybrid":
            alone = []
            for ids in prompts:
                gen = engine.start(ids, params, "none")
                while not gen.finished:
                    gen.step()
                alone.append(gen.generated_ids)
            out[name] += "" if alone == tokens else " DIFFERS FROM TARGET-ONLY SAMPLING"
    gens = [engine.start(ids, greedy, "hybrid") for ids in prompts]
    while any(not g.finished for g in gens):
        live = [g for g in gens if not g.finished]
        for result in engine.step_batch(live):
            if isinstance(result, Exception):
                raise result
    batched = [g.generated_ids for g in gens]
    out["greedy/hybrid-batched"] = _digest(batched) + ("" if batched == baseline else " DIFFERS FROM TARGET-ONLY")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", help="one kernel (default: every kernel this CPU runs, then torch)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--limit", type=int, default=13, help="prompts (one per category, app/bench/prompts.jsonl)")
    # Pinned: `auto` on the torch path times bf16 against float32 at load, and a busy machine can flip the choice.
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if args.kernel:
        os.environ["SPECSERVE_KERNEL"] = args.kernel
        out = _one_kernel(args.max_new_tokens, args.limit, args.dtype)
        print(json.dumps({"kernel": args.kernel, "dtype": args.dtype, **out}), flush=True)
        return
    from app.engine import kernels

    for name in [*kernels.available(), "torch"]:
        cmd = [sys.executable, __file__, "--kernel", name, "--max-new-tokens", str(args.max_new_tokens)]
        subprocess.run([*cmd, "--limit", str(args.limit), "--dtype", args.dtype], check=True)


if __name__ == "__main__":
    main()
