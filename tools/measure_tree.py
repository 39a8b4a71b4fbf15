"""Tree verification's shape: tokens per target pass of chains and of trees of several sizes, a fixed draft
length, the default engine (bfloat16, hybrid draft), one Spec-Bench prompt per category; acceptance by depth,
and how many accepted tokens came from the tree's first line (the lookup's branch or the draft's chain) and
how many from the other nodes. No timing: these counts do not depend on the machine's load (greedy, fixed k,
no pruning by measured costs), and every output is checked against the chain's.

Run: .venv/bin/python tools/measure_tree.py [k] [rows,rows,...] [max_new_tokens]   (default: 6 0,8,16 128)
"""

import collections
import sys
from pathlib import Path

from app.bench.specbench import read_prompts
from app.engine import generation
from app.engine.factory import build_engine
from app.engine.step import GenerationParams


def main() -> None:
    """What the docstring says, when run as a script."""
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    configs = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0, 8, 16]
    max_new = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    engine, loaded = build_engine(dtype="bfloat16", device="cpu")
    tok = loaded.tokenizer
    prompts = read_prompts(
        Path(__file__).resolve().parents[2] / "shared" / "bench" / "specbench-dev.jsonl", per_category=1
    )
    log = []
    accept = generation.accept_tree

    def spy(tree, logits, params, noise, position):
        path, nxt = accept(tree, logits, params, noise, position)
        log.append((tree, path))
        return path, nxt

    generation.accept_tree = spy
    generation.row_value = lambda *args: 0.0  # whole trees
    out: dict[int, collections.Counter] = {}
    base = {}
    for p in prompts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}]))
        for rows in configs:
            log.clear()
            params = GenerationParams(
                max_new_tokens=max_new, num_draft_tokens=k, draft_schedule="fixed", tree_rows=rows
            )
            gen = engine.start(ids, params, "hybrid")
            while not gen.finished:
                gen.step()
            assert base.setdefault(p.question_id, gen.generated_ids) == gen.generated_ids, (p.question_id, rows)
            o = out.setdefault(rows, collections.Counter())
            o["tokens"] += gen.stats.generated_tokens
            o["passes"] += gen.stats.target_passes
            o["steps"] += gen.stats.verify_passes
            for i, a in enumerate(gen.stats.accepted_per_position):
                o[i] += a
            for tree, path in log:
                line = 0  # the first line: rows 1..L, row i at depth i
                while line + 1 < tree.rows and tree.parents[line + 1] == line:
                    line += 1
                o["first line"] += sum(r <= line for r in path)
                o["other nodes"] += sum(r > line for r in path)
                o["rows"] += tree.rows
    print(f"k={k}, {len(prompts)} prompts, {max_new} new tokens; outputs equal: yes")
    print(
        "| rows | tokens per target pass | rows per step | acceptance by depth | accepted: first line / other nodes |"
    )
    print("|---:|---:|---:|---|---:|")
    for rows, o in out.items():
        depth = ", ".join(f"{o[i] / o['steps']:.3f}" for i in range(k))
        per_step = f"{o['rows'] / o['steps']:.1f}" if rows else f"<= {k + 1}"
        print(
            f"| {rows or 'chain'} | {o['tokens'] / o['passes']:.3f} | {per_step} | {depth} | "
            f"{o['first line']} / {o['other nodes']} |"
        )


if __name__ == "__main__":
    main()
