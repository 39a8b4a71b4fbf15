"""`specserve bench`: side-by-side speed and acceptance over Spec-Bench-format prompts.

Every configuration runs on the same prompt before the next prompt starts (interleaved), so machine
noise hits all of them alike. Configurations: transformers' own `generate` on the target (`hf`), with
prompt-lookup assisted generation (`hf/ngram`, the same proposer as our n-gram draft) when `ngram` is
measured, our
engine target-only (`none`), and our engine with each draft under each draft-length schedule
(`DRAFT/SCHEDULE`). Decoding is greedy unless a temperature > 0 is given; greedy outputs of every draft
configuration are checked against our target-only output token for token. Sampled outputs are only equal
in distribution, so that check is not made (reported as null).

Next to the realised speedup over target-only, each draft configuration gets the theoretical one that its
measured acceptance a, mean draft length k and measured costs predict:
(1 - a^(k+1)) / (1 - a) tokens per pass, over (k draft steps + one verification) in units of a
target-only step. Their ratio shows what the loop loses outside the two models' forward passes.

`run_workloads` measures the traffic a server sees instead (app.bench.workloads: agent loops, chat, code edits,
extraction, RAG): episodes of turns, each turn built from target-only's earlier answers, every configuration its
own tenant, so that what it learns from its own traffic (prefix cache, index of earlier answers) counts and no
other configuration's does.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from app.bench.workloads import Episode
from app.engine import kernels
from app.engine.drafting.draft_length import expected_tokens
from app.engine.engine import Engine
from app.engine.model.loading import LoadedModel
from app.engine.model.tokenizer import Tokenizer
from app.engine.model.transformer import PackedLinear, Transformer
from app.engine.step import GenerationParams

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass
class Prompt:
    question_id: Any
    category: str
    text: str


@dataclass(frozen=True)
class Config:
    """One engine configuration: a draft (or `none`), its draft-length schedule and cut-off, and the sampler
    when sampling (the labels of rejection-sampler configurations end in `/rejection`)."""

    draft: str
    schedule: str | None = None
    p_min: float | None = None
    sampler: str = "gumbel"
    tree_rows: int | None = None  # rows of a tree verification (0: chains; None: the engine's default)
    # Workloads: the request carries its episode's prediction (a code edit's file), where it has one.
    prediction: bool = False

    @property
    def label(self) -> str:
        parts = [self.draft]
        if self.draft != "none":
            parts.append(self.schedule or "default")
            if self.p_min is not None:
                parts.append(f"p{self.p_min:g}")
            if self.tree_rows:
                parts.append(f"tree{self.tree_rows}")
        if self.sampler != "gumbel":
            parts.append(self.sampler)
        if self.prediction:
            parts.append("prediction")
        return "/".join(parts)


@dataclass
class Run:
    config: str
    question_id: Any
    category: str
    tokens: int
    seconds: float
    token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


def read_prompts(path: Path, per_category: int | None = None, limit: int | None = None) -> list[Prompt]:
    """First turns of a Spec-Bench-format JSONL file, optionally the first N of each category."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = defaultdict(int)
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        cat = row.get("category", "unknown")
        if per_category is not None and seen[cat] >= per_category:
            continue
        seen[cat] += 1
        prompts.append(Prompt(row.get("question_id"), cat, row["turns"][0]))
    return prompts[:limit] if limit is not None else prompts


def _group(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


class _HFRunner:
    """transformers' target-only generate on the same checkpoint and dtype, greedy or sampling alike."""

    def __init__(self, source: str, dtype: torch.dtype, eos: list[int]) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(source)
        if path.is_file():
            self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        self.model.eval()
        self.eos = eos

    @torch.inference_mode()
    def run(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: GenerationParams | None = None,
        prompt_lookup: int | None = None,
    ) -> tuple[list[int], float]:
        """transformers' generate; with `prompt_lookup`, its assisted generation by prompt lookup (the same
        proposer as our n-gram draft) drafting that many tokens."""
        ids = torch.tensor([prompt_ids])
        sampling: dict[str, Any] = {"do_sample": False}
        if prompt_lookup:
            sampling["prompt_lookup_num_tokens"] = prompt_lookup
        if params is not None and params.temperature > 0:
            # top_k=0 and top_p=1.0 switch transformers' warpers off, as they do ours.
            sampling = {
                "do_sample": True,
                "temperature": params.temperature,
                "top_k": params.top_k,
                "top_p": params.top_p,
            }
            if params.seed is not None:
                torch.manual_seed(params.seed)
        t0 = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos,
            pad_token_id=self.eos[0],
            **sampling,
        )
        return out[0, len(prompt_ids) :].tolist(), time.perf_counter() - t0


def run_bench(
    engine: Engine,
    loaded: LoadedModel,
    prompts: list[Prompt],
    configs: list[Config],
    max_new_tokens: int,
    num_draft_tokens: int,
    with_hf: bool,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    baselines: dict[str, Any] | None = None,
    ignore_eos: bool = False,
) -> list[Run]:
    """All configurations on every prompt, interleaved; returns one Run per (prompt, configuration).

    Greedy by default; temperature > 0 samples every configuration with `seed` (0 when None), so that the
    gumbel sampler's outputs can be checked against target-only's token for token.
    `baselines`: other engines by name (greedy), each with `run(prompt_ids, max_new_tokens) -> (ids, seconds)`,
    such as `llamacpp.LlamaCppRunner`. `ignore_eos`: our configurations decode every prompt to `max_new_tokens`
    (a synthetic target's end-of-sequence token means nothing; the baselines still stop at theirs)."""
    from tqdm import tqdm

    hf = None
    if with_hf:
        hf = _HFRunner(loaded.source, loaded.model.dtype, sorted(loaded.tokenizer.eos_token_ids))
    tok = loaded.tokenizer
    runs: list[Run] = []
    if temperature > 0 and seed is None:
        seed = 0
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    samplers = list(dict.fromkeys(c.sampler for c in configs)) if temperature > 0 else ["gumbel"]
    configs = [
        *[Config("none", sampler=s) for s in samplers],
        *[c for c in configs if c.draft != "none" and (temperature > 0 or c.sampler == "gumbel")],
    ]

    def params_of(c: Config, max_new: int) -> GenerationParams:
        return GenerationParams(
            max_new_tokens=max_new,
            num_draft_tokens=num_draft_tokens,
            draft_schedule=c.schedule,
            draft_p_min=c.p_min,
            sampler=c.sampler,
            tree_rows=c.tree_rows,
            ignore_eos=ignore_eos,
            # Each configuration its own tenant: the index of earlier answers would otherwise hold target-only's
            # answer to this very prompt, and every draft would copy it (its own earlier prompts' answers count).
            cache_salt=f"specbench/{c.label}",
            **sampling,
        )

    # Warm up every path (and the adaptive schedules' cost measurements) so first-call costs do not land on
    # the first prompt.
    warm = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello, who are you?"}]))
    for c in configs:
        for _ in engine.generate(warm, params_of(c, 16), c.draft):
            pass
    if hf is not None:
        hf.run(warm, 8, params_of(configs[0], 8))
        hf.run(warm, 8, params_of(configs[0], 8), num_draft_tokens)
    baselines = baselines or {}
    for runner in baselines.values():
        runner.run(warm, 8)
    for p in tqdm(prompts, desc="bench", unit="prompt", file=sys.stderr):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}]))
        if hf is not None:
            out, secs = hf.run(ids, max_new_tokens, params_of(configs[0], max_new_tokens))
            runs.append(Run("hf", p.question_id, p.category, len(out), secs, out))
            if any(c.draft == "ngram" for c in configs):
                out, secs = hf.run(ids, max_new_tokens, params_of(configs[0], max_new_tokens), num_draft_tokens)
                runs.append(Run("hf/ngram", p.question_id, p.category, len(out), secs, out))
        for name, runner in baselines.items():
            out, secs = runner.run(ids, max_new_tokens)
            runs.append(Run(name, p.question_id, p.category, len(out), secs, out))
        for c in configs:
            gen = engine.start(ids, params_of(c, max_new_tokens), c.draft)
            t0 = time.perf_counter()
            while not gen.finished:
                gen.step()
            secs = time.perf_counter() - t0
            runs.append(
                Run(
                    c.label,
                    p.question_id,
                    p.category,
                    len(gen.generated_ids),
                    secs,
                    gen.generated_ids,
                    gen.stats.to_dict(),
                )
            )
    return runs


def summarize(runs: list[Run], num_draft_tokens: int, sampled: bool = False) -> dict[str, Any]:
    """Per group (mt_bench, then each other category, then overall) and configuration: the figures.

    `identical_to_target_only` counts the prompts whose output equals our target-only output token for token;
    None where that is not promised: sampled outputs of other engines and of the rejection sampler are equal
    in distribution only (the gumbel sampler's, with one seed, are equal token for token).
    """
    by_prompt: dict[Any, dict[str, Run]] = defaultdict(dict)
    for r in runs:
        by_prompt[r.question_id][r.config] = r
    groups: dict[str, list[Any]] = defaultdict(list)
    for qid, configs in by_prompt.items():
        groups[_group(next(iter(configs.values())).category)].append(qid)
    groups["overall"] = list(by_prompt)
    configs = list(dict.fromkeys(r.config for r in runs))
    summary: dict[str, Any] = {}
    for g, qids in groups.items():
        row: dict[str, Any] = {}
        for c in configs:
            rs = [by_prompt[q][c] for q in qids if c in by_prompt[q]]
            tokens = sum(r.tokens for r in rs)
            secs = sum(r.seconds for r in rs)
            entry: dict[str, Any] = {"prompts": len(rs), "tokens": tokens, "tokens_per_second": tokens / secs}
            same = sum(by_prompt[q][c].token_ids == by_prompt[q]["none"].token_ids for q in qids)
            if not any(by_prompt[q][c].stats for q in qids if c in by_prompt[q]):
                # Other engines (transformers, llama.cpp) are checked against ours too: the same weights, greedy.
                entry["identical_to_target_only"] = None if sampled else same
            else:
                drafted = sum(r.stats["drafted"] for r in rs)
                accepted = sum(r.stats["accepted"] for r in rs)
                passes = sum(r.stats["target_passes"] for r in rs)
                entry["acceptance_rate"] = accepted / drafted if drafted else 0.0
                entry["tokens_per_target_pass"] = tokens / passes if passes else 0.0
                # Target-only runs draft nothing: their accepted_per_position is empty.
                per_pos = [
                    sum(r.stats["accepted_per_position"][i] for r in rs if i < len(r.stats["accepted_per_position"]))
                    for i in range(num_draft_tokens)
                ]
                verify = sum(r.stats["verify_passes"] for r in rs)
                entry["acceptance_by_position"] = [round(x / verify, 4) if verify else 0.0 for x in per_pos]
                entry["identical_to_target_only"] = None if sampled and c.endswith("/rejection") else same
                entry["mean_draft_length"] = drafted / verify if verify else 0.0
                entry["_costs"] = {
                    "draft": sum(r.stats["draft_seconds"] for r in rs) / drafted if drafted else 0.0,
                    "verify": sum(r.stats["verify_seconds"] for r in rs) / verify if verify else 0.0,
                    # Seconds per decoding step (the prefill excluded) of target-only decoding.
                    "step": sum(r.stats["verify_seconds"] for r in rs) / max(1, passes - len(rs)),
                }
            row[c] = entry
        step = row["none"]["_costs"]["step"]
        for entry in row.values():
            if "hf" in row:
                entry["speedup_vs_hf"] = entry["tokens_per_second"] / row["hf"]["tokens_per_second"]
            entry["speedup_vs_target_only"] = entry["tokens_per_second"] / row["none"]["tokens_per_second"]
            costs = entry.pop("_costs", None)
            if costs and step > 0 and entry["mean_draft_length"] > 0:
                k = entry["mean_draft_length"]
                per_pass = expected_tokens(min(entry["acceptance_rate"], 0.9999), k)
                theory = per_pass * step / (k * costs["draft"] + costs["verify"])
                entry["theoretical_speedup"] = theory
                entry["realised_of_theoretical"] = entry["speedup_vs_target_only"] / theory
        summary[g] = row
    return summary


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a markdown table, one row per (group, configuration)."""
    lines = [
        "| group | config | prompts | tok/s | vs hf | vs target-only | theoretical | acceptance | mean k | "
        "tokens/pass | same as ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g, row in summary.items():
        for c, e in row.items():
            acc = f"{e['acceptance_rate']:.3f}" if "acceptance_rate" in e else "-"
            tpp = f"{e['tokens_per_target_pass']:.2f}" if "tokens_per_target_pass" in e else "-"
            same = (
                f"{e['identical_to_target_only']}/{e['prompts']}"
                if e.get("identical_to_target_only") is not None
                else "-"
            )
            vs_hf = f"{e['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in e else "-"
            theory = f"{e['theoretical_speedup']:.2f}x" if "theoretical_speedup" in e else "-"
            mean_k = f"{e['mean_draft_length']:.2f}" if e.get("mean_draft_length") else "-"
            lines.append(
                f"| {g} | {c} | {e['prompts']} | {e['tokens_per_second']:.1f} | {vs_hf} | "
                f"{e['speedup_vs_target_only']:.2f}x | {theory} | {acc} | {mean_k} | {tpp} | {same} |"
            )
    return "\n".join(lines)


def plots(summary: dict[str, Any], out: Path) -> list[Path]:
    """speedup.png (speedup over target-only per group and configuration) and acceptance_by_position.png
    (overall), written into `out`; none when matplotlib is missing (`pip install specserve[bench]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    groups = list(summary)
    configs = [c for c in summary["overall"] if c != "none"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups)), 4))
    width = 0.8 / max(1, len(configs))
    for i, c in enumerate(configs):
        xs = [g + (i - (len(configs) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [summary[g].get(c, {}).get("speedup_vs_target_only", 0.0) for g in groups], width, label=c)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel("speedup over our target-only")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "speedup.png", out / "acceptance_by_position.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in configs:
        by_pos = summary["overall"][c].get("acceptance_by_position") or []
        if by_pos:
            ax.plot(range(1, len(by_pos) + 1), by_pos, marker="o", label=c)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of verifications accepting it")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def per_prompt_medians(runs: list[Run]) -> dict[str, float]:
    """Median over prompts of each configuration's tokens/s (robust to a noisy prompt)."""
    by_config: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        by_config[r.config].append(r.tokens / r.seconds)
    return {c: statistics.median(v) for c, v in by_config.items()}


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second this machine reads with torch's threads (best of `repeats` sums over a buffer far
    larger than any cache): what bounds a decoding step, which reads every weight once."""
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    buf.sum()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def step_bytes(model: Transformer) -> int:
    """Bytes of weights one cached forward of `model` reads, whatever its row count: every layer's products (as
    laid out for what runs them: GGUF blocks, a kernel's bf16 layout, oneDNN's or plain) and norms, and the
    output layer (a tied embedding once, as the head; the embedding lookup reads a row per token, left out)."""
    total = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            if module.quantized is not None:
                total += module.quantized.nbytes
                continue
            fused = module.fused.weight if isinstance(module.fused, kernels.KernelLinear) else None
            weight = next(t for t in (fused, module.packed, module.weight) if t is not None)
            total += weight.numel() * weight.element_size()
        elif isinstance(module, torch.nn.RMSNorm | torch.nn.Linear) and module is not model.lm_head:
            # the norms, and the layers' products where nothing packed them
            total += module.weight.numel() * module.weight.element_size()
    if model._packed_head is None:  # unpacked: the head is the plain (or tied embedding's) weight
        head = model._head_weight()
        assert isinstance(head, torch.Tensor), "quantized weights run packed"
        total += head.numel() * head.element_size()
    return total


def _load_on(kernel: str, target: str | Path, weights: str) -> Transformer:
    """The target in bfloat16 (`weights` as `load_model` takes them), packed for CPU kernel `kernel`."""
    from app import store
    from app.engine.model.loading import load_model

    with kernels.selected(kernel):
        return load_model(target, "bfloat16", "cpu", cache_dir=store.cache_dir(), weights=weights).model


def step_times(
    model: Transformer, rows: tuple[int, ...], context: int, repeats: int, warmup: int = 0
) -> dict[int, float]:
    """Milliseconds of one cached forward of `model` and its head over each row count of `rows` (`context` random
    tokens already in the cache, truncated back to them before every call): the median of `repeats` calls after
    `warmup` more. A plain decoding step is 1 row, a verification of k drafted tokens k+1."""
    ids = torch.randint(0, model.config.vocab_size, (1, context + max(rows)), generator=torch.Generator())
    table: dict[int, float] = {}
    with torch.inference_mode():
        cache = model.new_cache(context + max(rows))
        model.hidden(ids[:, :context], 0, cache)
        for m in rows:
            times = []
            for _ in range(warmup + repeats):
                cache.truncate(context)
                t0 = time.perf_counter()
                model.logits(model.hidden(ids[:, context : context + m], context, cache)[0])
                times.append(time.perf_counter() - t0)
            table[m] = statistics.median(times[warmup:]) * 1e3
    return table


def kernel_steps(
    target: str | Path, rows: tuple[int, ...] = (1, 8, 16), context: int = 128, repeats: int = 7
) -> tuple[float, int, dict[str, dict[int, float]]]:
    """Milliseconds of one cached target forward (the real model, bfloat16, `context` tokens already in the
    cache) per kernel this CPU runs, torch's path included, and per row count: a plain step is 1 row, a
    verification k+1. Returns (read bandwidth in bytes/s, bytes of weights a step reads, {kernel: {rows: ms}})
    (median of `repeats`)."""
    bandwidth = read_bandwidth()
    table: dict[str, dict[int, float]] = {}
    weight_bytes = 0
    for name in [*kernels.available(), "torch"]:
        model = _load_on(name, target, "bf16")
        weight_bytes = step_bytes(model)
        table[name] = step_times(model, rows, context, repeats)
        del model
    return bandwidth, weight_bytes, table


# --- what a verification's rows cost (`specserve bench --rows`) ----------------------------------------------

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
ROW_WEIGHTS = ("native", "bf16")


def row_costs(
    target: str | Path,
    rows: tuple[int, ...] = ROW_COUNTS,
    weights: tuple[str, ...] = ROW_WEIGHTS,
    context: int = 300,
    repeats: int = 9,
    warmup: int = 3,
) -> dict[str, Any]:
    """What 1..16 verification rows cost per CPU kernel this machine runs and weight format (`native` GGUF
    blocks, `bf16`): one target forward with its head over R new rows, `context` tokens in the cache, the
    median of `repeats` calls after `warmup`, beside the floor of a 1-row step (the bytes a step reads over the
    measured read bandwidth). Per (kernel, weights): ms by row count, each row's extra cost as a fraction of a
    1-row step ((ms(R) - ms(1)) / (R - 1) / ms(1)) and the floor. `rows` must hold 1."""
    if 1 not in rows:
        raise ValueError("row costs are fractions of a 1-row step: rows must hold 1")
    rows = tuple(sorted(set(rows)))
    bandwidth = read_bandwidth()
    tables = []
    for name in kernels.available():
        for w in weights:
            model = _load_on(name, target, w)
            nbytes = step_bytes(model)
            times = step_times(model, rows, context, repeats, warmup)
            floor = nbytes / bandwidth * 1e3
            tables.append(
                {
                    "kernel": name,
                    "weights": w,
                    "runs_as": model.weights()[0],
                    "step_bytes": nbytes,
                    "floor_ms": floor,
                    "rows": [
                        {
                            "rows": r,
                            "ms": ms,
                            "extra_per_row": (ms - times[1]) / (r - 1) / times[1] if r > 1 else None,
                            "floor_of_ms": floor / ms,
                        }
                        for r, ms in times.items()
                    ],
                }
            )
            del model
    return {
        "target": str(target),
        "threads": torch.get_num_threads(),
        "context": context,
        "repeats": repeats,
        "warmup": warmup,
        "read_bandwidth": bandwidth,
        "tables": tables,
    }


def rows_markdown(result: dict[str, Any]) -> str:
    """`row_costs`' result as markdown: a line of what was measured, then one table per kernel and weights."""
    lines = [
        f"{result['target']}: one forward and its head over R new rows, {result['context']} tokens cached, "
        f"{result['threads']} threads, median of {result['repeats']} after {result['warmup']} warm-up calls; "
        f"read bandwidth {result['read_bandwidth'] / 1e9:.1f} GB/s.",
    ]
    for t in result["tables"]:
        cells = t["rows"]
        lines += [
            "",
            f"{t['kernel']}, {t['weights']} ({t['runs_as']}): a step reads {t['step_bytes'] / 1e6:.1f} MB, so a "
            f"1-row step cannot take less than {t['floor_ms']:.2f} ms",
            "",
            "| rows | " + " | ".join(str(c["rows"]) for c in cells) + " |",
            "|---" + "|---:" * len(cells) + "|",
            "| ms | " + " | ".join(f"{c['ms']:.1f}" for c in cells) + " |",
            "| extra per row, of a 1-row step | "
            + " | ".join("-" if c["extra_per_row"] is None else f"{c['extra_per_row']:.2f}" for c in cells)
            + " |",
            "| read floor / ms | " + " | ".join(f"{c['floor_of_ms']:.2f}" for c in cells) + " |",
        ]
    return "\n".join(lines)


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


# --- the traffic a server sees (`specserve bench --workload`) ------------------------------------------------


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """`messages` (and OpenAI `tools`) as the chat route renders them: through the template where it renders
    tools itself, else in the Hermes format the server writes (app.api.tools)."""
    from app.api import tools as chat_tools
    from app.api.schemas import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})
    if tokenizer.takes_tools:
        turns, functions = chat_tools.template_messages(body)
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tools=functions)
    return tokenizer.apply_chat_template(chat_tools.render_messages(body), add_generation_prompt=True)


def workload_configs(configs: list[Config], with_prediction: bool) -> list[Config]:
    """Target-only first, then each draft configuration; with `with_prediction`, each configuration of a draft
    that reads predictions (the hybrid and the suffix lookup) followed by its variant that sends one."""
    from app.engine.factory import HYBRID

    out = [Config("none")]
    for c in configs:
        if c.draft == "none" or c.prediction:
            continue
        out.append(c)
        if with_prediction and c.draft in (HYBRID, "suffix"):
            out.append(replace(c, prediction=True))
    return out


def run_workloads(
    engine: Engine,
    episodes: list[Episode],
    configs: list[Config],
    num_draft_tokens: int,
    max_new_tokens: int | None = None,
    baselines: dict[str, Any] | None = None,
) -> list[Run]:
    """Every episode's turns in order, every configuration on a turn before the next turn (interleaved, as
    `run_bench`), greedy; one Run per (turn, configuration), `question_id` WORKLOAD/EPISODE/TURN.

    Every configuration sees the same prompts: the next turn's history is built from target-only's answer.
    Each configuration is its own tenant per workload (`cache_salt` WORKLOAD/LABEL), so that one configuration's
    answers never speed up another's while its own earlier requests do (its prefix cache, its index of earlier
    answers: what a server learns from its traffic). Requests run as the server runs them (`step_batch`, which
    keeps their caches). `max_new_tokens`: every turn's (default: the episode's own). `baselines`: other engines
    by name, `run(prompt_ids, max_new_tokens) -> (ids, seconds)` (llama.cpp), run first on every turn."""
    from tqdm import tqdm

    tok = engine.tokenizer
    configs = workload_configs(configs, any(e.prediction for e in episodes))
    baselines = baselines or {}

    def params(c: Config, workload: str, max_new: int, prediction: tuple[int, ...]) -> GenerationParams:
        return GenerationParams(
            max_new_tokens=max_new,
            num_draft_tokens=num_draft_tokens,
            draft_schedule=c.schedule,
            draft_p_min=c.p_min,
            tree_rows=c.tree_rows,
            cache_salt=f"{workload}/{c.label}",
            prediction=prediction if c.prediction else (),
        )

    warm = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello, who are you?"}]))
    for c in configs:  # first-call costs and the adaptive schedules' measurements, in a tenant of their own
        for _ in engine.generate(warm, params(c, "warm-up", 16, tuple(warm)), c.draft):
            pass
    for runner in baselines.values():
        runner.run(warm, 8)
    runs: list[Run] = []
    progress = tqdm(total=sum(e.turns for e in episodes), desc="workloads", unit="turn", file=sys.stderr)
    for ep in episodes:
        prediction = tuple(tok.encode(ep.prediction)) if ep.prediction else ()
        max_new = max_new_tokens or ep.max_new_tokens
        answers: list[str] = []
        for turn in range(ep.turns):
            ids = tok.encode(render_chat(tok, ep.messages(answers), ep.tools))
            qid = f"{ep.workload}/{ep.index}/{turn}"
            for name, runner in baselines.items():
                out, secs = runner.run(ids, max_new)
                runs.append(Run(name, qid, ep.workload, len(out), secs, out, {"prompt_tokens": len(ids)}))
            for c in configs:
                if c.prediction and not prediction:
                    continue
                t0 = time.perf_counter()
                gen = engine.start(ids, params(c, ep.workload, max_new, prediction), c.draft)
                while not gen.finished:
                    out = engine.step_batch([gen]).outputs[0]
                    if isinstance(out, Exception):
                        raise out
                secs = time.perf_counter() - t0
                runs.append(
                    Run(c.label, qid, ep.workload, len(gen.generated_ids), secs, gen.generated_ids, gen.stats.to_dict())
                )
                if c.draft == "none":
                    answers.append(tok.decode(gen.generated_ids))
            progress.update()
    progress.close()
    return runs


def _own_target_only(config: str, configs: list[str]) -> str:
    """The configuration whose outputs `config`'s greedy outputs must equal: llama.cpp's prompt lookup its own
    target-only (`llama.cpp/gguf`), everything else ours (`none`)."""
    if config.startswith("llama.cpp/") and config != "llama.cpp/gguf" and "llama.cpp/gguf" in configs:
        return "llama.cpp/gguf"
    return "none"


def _speedup(entry: dict[str, Any], runs: list[Run], mine: list[Run], base: str) -> float | None:
    """`entry`'s tokens/s over configuration `base`'s on the very requests `mine` holds (a prediction variant
    runs only where there is a prediction)."""
    asked = {r.question_id for r in mine}
    theirs = [r for r in runs if r.config == base and r.question_id in asked]
    seconds = sum(r.seconds for r in theirs)
    rate = sum(r.tokens for r in theirs) / seconds if seconds > 0 else 0.0
    return entry["tokens_per_second"] / rate if rate else None


def summarize_workloads(runs: list[Run]) -> dict[str, Any]:
    """Per workload (then `overall` where there are several) and configuration: requests, tokens, tokens/s as
    total tokens over total seconds, the speedup over target-only as the ratio of those (target-only's over the
    same requests), tokens per target pass, acceptance, the share of draft steps each source won (None where
    the engine reports no sources) and how many outputs equal their target-only's (`_own_target_only`) token
    for token; llama.cpp's prompt lookup also gets its speedup over llama.cpp's target-only."""
    by_workload: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_workload[r.category].append(r)
    if len(by_workload) > 1:
        by_workload["overall"] = list(runs)
    summary: dict[str, Any] = {}
    for workload, rs in by_workload.items():
        configs = list(dict.fromkeys(r.config for r in rs))
        outputs = {(r.config, r.question_id): r.token_ids for r in rs}
        row: dict[str, Any] = {}
        for c in configs:
            mine = [r for r in rs if r.config == c]
            tokens, seconds = sum(r.tokens for r in mine), sum(r.seconds for r in mine)
            reference = _own_target_only(c, configs)
            entry: dict[str, Any] = {
                "requests": len(mine),
                "tokens": tokens,
                "seconds": round(seconds, 4),
                "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
                "prompt_tokens": sum(r.stats.get("prompt_tokens", 0) for r in mine),
                "same_as": reference,
                "identical_to_target_only": sum(r.token_ids == outputs.get((reference, r.question_id)) for r in mine),
            }
            if any("target_passes" in r.stats for r in mine):  # ours: the engine's counters
                drafted = sum(r.stats["drafted"] for r in mine)
                passes = sum(r.stats["target_passes"] for r in mine)
                entry["cached_tokens"] = sum(r.stats.get("cached_tokens", 0) for r in mine)
                entry["acceptance_rate"] = sum(r.stats["accepted"] for r in mine) / drafted if drafted else None
                entry["tokens_per_target_pass"] = tokens / passes if passes else 0.0
                sources: dict[str, int] = defaultdict(int)
                for r in mine:
                    for source, steps in (r.stats.get("draft_sources") or {}).items():
                        sources[source] += steps
                reported = any("draft_sources" in r.stats for r in mine)
                steps = sum(sources.values())
                entry["draft_sources"] = (
                    {s: round(n / steps, 4) for s, n in sorted(sources.items())}
                    if reported and steps
                    else ({} if reported else None)
                )
            entry["speedup_vs_target_only"] = _speedup(entry, rs, mine, "none")
            if reference != "none":
                entry["speedup_vs_own_target_only"] = _speedup(entry, rs, mine, reference)
            row[c] = entry
        summary[workload] = row
    return summary


def workloads_markdown(summary: dict[str, Any]) -> str:
    """`summarize_workloads`' result as a markdown table, one row per (workload, configuration)."""
    lines = [
        "| workload | config | requests | tok/s | vs target-only | tokens/pass | acceptance | draft sources (share of "
        "steps) | same as target-only |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for workload, row in summary.items():
        for c, e in row.items():
            speedup = f"{e['speedup_vs_target_only']:.2f}x" if e.get("speedup_vs_target_only") else "-"
            if e.get("speedup_vs_own_target_only"):
                speedup += f" ({e['speedup_vs_own_target_only']:.2f}x of {e['same_as']})"
            tpp = f"{e['tokens_per_target_pass']:.2f}" if "tokens_per_target_pass" in e else "-"
            acc = f"{e['acceptance_rate']:.3f}" if e.get("acceptance_rate") is not None else "-"
            if "draft_sources" not in e or c == "none":
                sources = "-"
            elif e["draft_sources"] is None:
                sources = "n/a"
            else:
                sources = ", ".join(f"{s} {share:.2f}" for s, share in e["draft_sources"].items()) or "-"
            same = f"{e['identical_to_target_only']}/{e['requests']}"
            if e["same_as"] != "none":
                same += f" (of {e['same_as']})"
            lines.append(
                f"| {workload} | {c} | {e['requests']} | {e['tokens_per_second']:.1f} | {speedup} | {tpp} | {acc} | "
                f"{sources} | {same} |"
            )
    return "\n".join(lines)
