"""`specserve bench --workload NAME --learn N`: what the draft learning (app.distill.online) gains on a workload.

For each workload: N requests of it (episodes of seeds 1, 2, ..., turn by turn as a server gets them) are served
with the default draft in one tenant, whose finished answers the learner keeps; then rounds train that tenant's
adapter (each kept only where it agrees more often on held-back answers, as the server does). Then the workload's
unseen episodes (seed 0, other texts) run with the feature draft alone, each request twice, interleaved: with the
shipped weights and with the tenant's adapter, the prefix cache off (neither run reuses the other's prompt). The
table compares acceptance, tokens per target pass and tokens/s; every answer must equal target-only's. Also
reported: how long the worker waited for a training step in flight when it needed the CPU again (the latency a
request that arrives mid-training pays).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.bench.traffic import render_chat
from app.bench.workloads import Episode, episodes
from app.distill.online import DraftLearner, LearningConfig, feature_drafter
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.step import GenerationParams

_TENANT = "bench-learn"


@dataclass
class Figures:
    """One configuration's totals over the unseen requests."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0

    def add(self, tokens: int, seconds: float, drafted: int, accepted: int, passes: int) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.drafted += drafted
        self.accepted += accepted
        self.passes += passes

    def row(self) -> dict[str, float]:
        return {
            "tokens_per_second": self.tokens / self.seconds if self.seconds else 0.0,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "tokens_per_pass": self.tokens / self.passes if self.passes else 0.0,
        }


def _turns(eps: list[Episode], engine: Engine, limit: int) -> Iterator[tuple[Episode, int, list[int], list[str]]]:
    """(episode, turn, prompt ids, answers so far) of `eps` in order, at most `limit` turns; the caller appends each
    turn's answer to the list before asking for the next."""
    tok, n = engine.tokenizer, 0
    for ep in eps:
        answers: list[str] = []
        for turn in range(ep.turns):
            if n >= limit:
                return
            yield ep, turn, tok.encode(render_chat(tok, ep.messages(answers), ep.tools)), answers
            n += 1


def _train_episodes(name: str, wanted: int) -> list[Episode]:
    out: list[Episode] = []
    seed = 1
    while sum(e.turns for e in out) < wanted:
        out.extend(episodes(name, seed))
        seed += 1
    return out


def run_learning(
    engine: Engine, names: list[str], requests: int, rounds: int, num_draft_tokens: int, unseen: int | None = None
) -> list[dict[str, Any]]:
    """One row per workload (see the module docstring); `requests`: N, served before training; `rounds`: training
    rounds after them; `unseen`: the unseen episodes compared (default: every episode of seed 0)."""
    eagle = feature_drafter(engine)
    if eagle is None or eagle.draft.source is None:
        raise ValueError("--learn needs a feature draft (the default target's catalog draft is one)")
    rows = []
    for name in names:
        learner = DraftLearner(
            eagle.draft.source, engine.target, LearningConfig(min_answers=1, idle_seconds=0.0), directory=None
        )
        engine.on_answer, eagle.adapters = learner.observe, learner.adapter
        tok = engine.tokenizer
        t0 = time.perf_counter()
        served = 0
        for ep, _, ids, answers in _turns(_train_episodes(name, requests), engine, requests):
            params = GenerationParams(
                max_new_tokens=ep.max_new_tokens, num_draft_tokens=num_draft_tokens, cache_salt=f"{_TENANT}/{name}"
            )
            gen, _ = _complete(engine, ids, params)
            answers.append(tok.decode(gen.generated_ids))
            served += 1
        serve_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        history = []
        for _ in range(rounds):
            result = learner.train_round(f"{_TENANT}/{name}")
            if result is not None:
                history.append((result.before, result.after, result.kept))
        train_s = time.perf_counter() - t0
        waits = _mid_training_waits(learner, f"{_TENANT}/{name}")
        shipped, learned, differ = Figures(), Figures(), 0
        cache, engine.prefix_cache = engine.prefix_cache, None
        try:
            compared = 0
            for ep, _, ids, answers in _turns(episodes(name, 0, limit=unseen), engine, 10**9):
                texts = []
                # Each its own tenant: the engine keeps the draft's acceptance per tenant, and the shipped
                # weights' would otherwise be where the learnt adapter's requests start (and the reverse).
                for figures, adapters, tenant in (
                    (shipped, None, f"{_TENANT}/{name}/shipped"),
                    (learned, learner.adapter, f"{_TENANT}/{name}"),
                ):
                    eagle.adapters = adapters
                    params = GenerationParams(
                        max_new_tokens=ep.max_new_tokens, num_draft_tokens=num_draft_tokens, cache_salt=tenant
                    )
                    s0 = time.perf_counter()
                    gen, passes = _complete(engine, ids, params, eagle.name)
                    s = gen.stats
                    figures.add(len(gen.generated_ids), time.perf_counter() - s0, s.drafted, s.accepted, passes)
                    texts.append(gen.generated_ids)
                alone, _ = _complete(engine, ids, GenerationParams(max_new_tokens=ep.max_new_tokens), "none")
                target_only = alone.generated_ids
                differ += sum(t != target_only for t in texts)
                answers.append(tok.decode(target_only))
                compared += 1
        finally:
            engine.prefix_cache = cache
            engine.on_answer, eagle.adapters = None, None
        before, after = shipped.row(), learned.row()
        rows.append(
            {
                "workload": name,
                "served": served,
                "answers_kept": len(learner.traces.samples(f"{_TENANT}/{name}")),
                "serve_seconds": serve_s,
                "rounds": [{"before": b, "after": a, "kept": k} for b, a, k in history],
                "train_seconds": train_s,
                "unseen_requests": compared,
                "shipped": before,
                "learned": learned.row(),
                "acceptance_gain": after["acceptance"] - before["acceptance"],
                "tokens_per_pass_gain": after["tokens_per_pass"] - before["tokens_per_pass"],
                "speedup": after["tokens_per_second"] / before["tokens_per_second"]
                if before["tokens_per_second"]
                else None,
                "differ_from_target_only": differ,
                "mid_training_wait_ms": waits,
            }
        )
        print(
            f"{name}: served {served} in {serve_s:.0f} s, trained {train_s:.0f} s; acceptance "
            f"{before['acceptance']:.3f} -> {after['acceptance']:.3f}, tokens/pass {before['tokens_per_pass']:.2f} -> "
            f"{after['tokens_per_pass']:.2f}",
            file=sys.stderr,
        )
    return rows


def _complete(
    engine: Engine, ids: list[int], params: GenerationParams, draft: str | None = None
) -> tuple[Generation, int]:
    """One request run to its end as the server steps it (its failure raised), and its target passes."""
    gen = engine.start(ids, params, draft)
    passes = 0
    while not gen.finished:
        out = engine.step_batch([gen]).outputs[0]
        if isinstance(out, Exception):
            raise out
        passes += 1
    return gen, passes


def _mid_training_waits(learner: DraftLearner, tenant: str, samples: int = 20) -> dict[str, float]:
    """Milliseconds `worker_busy` waited, `samples` times, called at random moments while a round trains under
    the gate as the server's trainer runs it: what a request arriving mid-training waits before its first step."""
    import random

    stop = threading.Event()
    learner.worker_idle()

    def train() -> None:
        gate = learner._gate  # the server trainer's own gate
        while not stop.is_set():
            learner.train_round(tenant, gate=gate)

    waits = []
    rng = random.Random(0)
    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        for _ in range(samples):
            time.sleep(rng.uniform(0.02, 0.08))
            t0 = time.perf_counter()
            learner.worker_busy()
            waits.append((time.perf_counter() - t0) * 1e3)
            learner.worker_idle()
    finally:
        stop.set()
        learner.stop()  # ends the gate the round waits at
        thread.join(timeout=30)
    return {"median": statistics.median(waits), "max": max(waits)}


def learning_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    head = (
        "| workload | served | unseen | acceptance shipped -> learnt | tokens/pass | tok/s | speedup | rounds kept |"
        " wait for a step (median / max ms) | differ from target-only |\n|---|---:|---:|---|---|---|---:|---:|---|---:|"
    )
    lines = [head]
    for r in rows:
        s, lr = r["shipped"], r["learned"]
        kept = sum(x["kept"] for x in r["rounds"])
        lines.append(
            f"| {r['workload']} | {r['served']} | {r['unseen_requests']} | {s['acceptance']:.3f} -> "
            f"{lr['acceptance']:.3f} | {s['tokens_per_pass']:.2f} -> {lr['tokens_per_pass']:.2f} | "
            f"{s['tokens_per_second']:.1f} -> {lr['tokens_per_second']:.1f} | {r['speedup']:.2f}x | "
            f"{kept}/{len(r['rounds'])} | {r['mid_training_wait_ms']['median']:.1f} / "
            f"{r['mid_training_wait_ms']['max']:.1f} | {r['differ_from_target_only']} |"
        )
    return "\n".join(lines) + "\n"
