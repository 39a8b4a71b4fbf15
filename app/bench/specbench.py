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
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.engine.drafting.draft_length import expected_tokens
from app.engine.engine import Engine
from app.engine.model.loading import LoadedModel
from app.engine.model.tokenizer import Tokenizer
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


def _prompt_ids(tok: Tokenizer, text: str) -> list[int]:
    """One user turn through the target's chat template, or the text itself where it has none (a base model,
    as Gemma 3 270M's GGUF: Spec-Bench's questions are then continued as written)."""
    if tok.chat_template is None:
        return tok.encode(text)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


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
    if tok.chat_template is None:
        print("the target has no chat template (a base model): the prompts go as plain text", file=sys.stderr)
    warm = _prompt_ids(tok, "Hello, who are you?")
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
        ids = _prompt_ids(tok, p.text)
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
