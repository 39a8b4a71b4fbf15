"""`specserve bench --structured`: greedy answers to the package's own JSON-schema and tool-call prompts,
constrained target-only and with each draft, with and without forced tokens, beside unconstrained; and what the
grammar itself costs per token."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from app.engine.engine import Engine
from app.engine.step import GenerationParams

# --- structured output ---------------------------------------------------------------------------------------

_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
    },
    "required": ["name", "age", "city", "role"],
    "additionalProperties": False,
}


_BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["title", "author", "year", "genres"],
    "additionalProperties": False,
}


# A tool call as a JSON object: which function, and its arguments.
_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_local_time"]},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


# `specserve bench --structured`'s set: chat prompts of our own, each with the JSON schema its answer follows.
STRUCTURED: list[tuple[str, dict[str, Any]]] = [
    ("Describe a fictional engineer from Paris as JSON.", _PERSON),
    ("Describe a doctor named Ana who is 41 and lives in Lisbon, as JSON.", _PERSON),
    ("Give a classic novel as JSON with its title, author, year and genres.", _BOOK),
    ("Give a science fiction book as JSON.", _BOOK),
    ("Call a function to get the weather in Oslo in celsius. Answer with the call as JSON.", _CALL),
    ("What time is it in Tokyo? Answer with a function call as JSON.", _CALL),
]


def grammar_cost(engine: Engine, schema: dict[str, Any], token_ids: list[int]) -> float:
    """Seconds per token the grammar itself costs target-only decoding of `token_ids` (an answer that follows
    `schema`): its mask at each position, applied to a row of logits, and the token consumed. The request's
    first mask, which builds llguidance's lexer caches (a millisecond or two), is left out."""
    from app.engine.decoding.grammar import GrammarSpec, mask_logits

    state = engine.grammars.start(GrammarSpec("json_schema", json.dumps(schema)))
    row = torch.zeros(1, engine.target.config.vocab_size)
    eos = engine.tokenizer.eos_token_ids
    tokens = [t for t in token_ids if t not in eos]
    state.masks()
    t0 = time.perf_counter()
    for t in tokens:
        mask_logits(row, state.masks()[0])
        state.accept([t])
    return (time.perf_counter() - t0) / max(1, len(tokens))


def run_structured(
    engine: Engine, drafts: list[str], max_new_tokens: int, num_draft_tokens: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Greedy answers to the `STRUCTURED` prompts, every configuration on a prompt before the next prompt:
    constrained by the prompt's schema target-only and with each draft, each without and with forced tokens,
    and unconstrained target-only and with each draft for reference. Returns (one row per configuration: tok/s,
    acceptance, tokens per target pass, forced tokens kept, grammar seconds per token and how many outputs equal
    target-only's (constrained or not, as the row), the runs)."""
    from app.engine.decoding.grammar import GrammarSpec

    tok = engine.tokenizer
    configs = [(d, True, False) for d in ["none", *drafts]]
    configs += [(d, True, True) for d in ["none", *drafts]]
    configs += [(d, False, True) for d in ["none", *drafts]]

    def label(draft: str, constrained: bool, forced: bool) -> str:
        if not constrained:
            return f"unconstrained/{draft}"
        return f"{draft}/forced" if forced else draft

    def params(schema: dict[str, Any], draft: str, constrained: bool, forced: bool, max_new: int) -> GenerationParams:
        spec = GrammarSpec("json_schema", json.dumps(schema)) if constrained else None
        return GenerationParams(
            max_new_tokens=max_new,
            num_draft_tokens=num_draft_tokens,
            grammar=spec,
            forced_tokens=forced,
            # Its own tenant per configuration: another's answer to the same prompt is no draft (see run_bench).
            cache_salt=f"structured/{label(draft, constrained, forced)}",
        )

    prompts = [(tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])), s) for t, s in STRUCTURED]
    for draft, constrained, forced in configs:  # warm-up: llguidance's view of the vocabulary, kernels, costs
        for _ in engine.generate(prompts[0][0], params(prompts[0][1], draft, constrained, forced, 24), draft):
            pass
    runs: list[dict[str, Any]] = []
    for i, (ids, schema) in enumerate(prompts):
        for draft, constrained, forced in configs:
            gen = engine.start(ids, params(schema, draft, constrained, forced, max_new_tokens), draft)
            t0 = time.perf_counter()
            while not gen.finished:
                gen.step()
            seconds = time.perf_counter() - t0
            runs.append(
                {
                    "config": label(draft, constrained, forced),
                    "prompt": i,
                    "seconds": seconds,
                    "token_ids": gen.generated_ids,
                    "finish_reason": gen.finish_reason,
                    "stats": gen.stats.to_dict(),
                }
            )
    costs = {
        i: grammar_cost(engine, s, next(r["token_ids"] for r in runs if r["prompt"] == i))
        for i, (_, s) in enumerate(prompts)
    }
    rows = []
    for draft, constrained, forced in configs:
        name = label(draft, constrained, forced)
        rs = [r for r in runs if r["config"] == name]
        base = label("none", constrained, False)
        reference = {r["prompt"]: r["token_ids"] for r in runs if r["config"] == base}
        tokens = sum(r["stats"]["generated_tokens"] for r in rs)
        drafted = sum(r["stats"]["drafted"] for r in rs)
        rows.append(
            {
                "config": name,
                "tokens": tokens,
                "tokens_per_second": tokens / sum(r["seconds"] for r in rs),
                "acceptance_rate": sum(r["stats"]["accepted"] for r in rs) / drafted if drafted else None,
                "tokens_per_target_pass": tokens / sum(r["stats"]["target_passes"] for r in rs),
                "forced": sum(r["stats"]["forced"] for r in rs),
                "grammar_seconds_per_token": statistics.mean(costs.values()) if constrained else None,
                "same_as_target_only": sum(r["token_ids"] == reference[r["prompt"]] for r in rs),
                "prompts": len(rs),
            }
        )
    return rows, runs


def structured_markdown(rows: list[dict[str, Any]]) -> str:
    """`run_structured`'s rows as a markdown table, speedups against constrained (or unconstrained) target-only."""
    rate = {r["config"]: r["tokens_per_second"] for r in rows}
    lines = [
        "| config | tok/s | vs target-only | acceptance | tokens/pass | forced kept | grammar us/token | same |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = rate["unconstrained/none" if r["config"].startswith("unconstrained/") else "none"]
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        cost = f"{r['grammar_seconds_per_token'] * 1e6:.0f}" if r["grammar_seconds_per_token"] is not None else "-"
        lines.append(
            f"| {r['config']} | {r['tokens_per_second']:.1f} | {r['tokens_per_second'] / base:.2f}x | {acc} | "
            f"{r['tokens_per_target_pass']:.2f} | {r['forced']} | {cost} | {r['same_as_target_only']}/{r['prompts']} |"
        )
    return "\n".join(lines)
