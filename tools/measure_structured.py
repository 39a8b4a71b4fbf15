"""Structured output with and without speculation: greedy JSON-schema answers on the default engine (bfloat16,
hybrid draft), tokens/s per configuration side by side in one process.

Run: .venv/bin/python tools/measure_structured.py
"""

import json
import statistics
import time

from app.bench.structured import STRUCTURED
from app.engine.decoding.grammar import GrammarSpec
from app.engine.factory import build_engine
from app.engine.step import GenerationParams


def main() -> None:
    """What the docstring says, when run as a script."""
    engine, _ = build_engine(dtype="bfloat16", device="cpu")
    tok = engine.tokenizer
    # The JSON-schema prompts of `specserve bench --structured` (its tool-call prompts came later).
    cases = STRUCTURED[:4]

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    def run(ids, schema, draft, constrained):
        g = GrammarSpec("json_schema", json.dumps(schema)) if constrained else None
        gen = engine.start(
            ids, GenerationParams(max_new_tokens=96, num_draft_tokens=engine.num_draft_tokens, grammar=g), draft
        )
        t = time.perf_counter()
        while not gen.finished:
            gen.step()
        return gen, time.perf_counter() - t

    prompts = [(chat(t), s) for t, s in cases]
    for ids, s in prompts[:1]:
        run(ids, s, "none", True)  # warm-up: llguidance's tokenizer view, kernels
    rows = {}
    for label, draft, constrained in [
        ("constrained, target-only", "none", True),
        ("constrained, hybrid", "default", True),
        ("unconstrained, target-only", "none", False),
        ("unconstrained, hybrid", "default", False),
    ]:
        rates, acc, tpp, outs = [], [], [], []
        for ids, s in prompts:
            gen, sec = run(ids, s, draft, constrained)
            rates.append(gen.stats.generated_tokens / sec)
            acc.append(gen.stats.acceptance_rate)
            tpp.append(gen.stats.tokens_per_target_pass)
            outs.append(gen.generated_ids)
        rows[label] = outs
        print(
            f"{label:28s} tok/s median {statistics.median(rates):6.1f}  acceptance {statistics.mean(acc):.3f}  "
            f"tokens/pass {statistics.mean(tpp):.2f}"
        )
    print("constrained hybrid == target-only:", rows["constrained, hybrid"] == rows["constrained, target-only"])
    for ids in rows["constrained, hybrid"]:  # an answer cut by max_new_tokens is unfinished JSON
        print(len(ids), repr(tok.decode(ids, skip_special_tokens=True)[:160]))


if __name__ == "__main__":
    main()
