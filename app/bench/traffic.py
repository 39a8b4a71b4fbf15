"""`specserve bench --workload NAME`: the traffic a server sees (app.bench.workloads: agent loops, chat, code
edits, extraction, RAG): episodes of turns, each turn built from target-only's earlier answers, every configuration
its own tenant, so that what it learns from its own traffic (prefix cache, index of earlier answers) counts and no
other configuration's does."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

from app.bench.specbench import Config, Run
from app.bench.workloads import Episode
from app.engine.engine import Engine
from app.engine.model.tokenizer import Tokenizer
from app.engine.step import GenerationParams

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
