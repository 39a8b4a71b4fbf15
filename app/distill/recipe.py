"""`specserve train-draft`: the whole recipe, from a target to a shipped draft, resumable at every stage.

Stages, each skipped when its output already exists in the work directory:
1. corpus: the target answers instructions of the kinds chat traffic holds (round 1), then prompts built on
   its own answers (round 2: second turns of a conversation, summaries and questions over long articles made
   of several answers, translation, rewriting, extraction). Shards hold token ids (and the states beside
   them); a run with more instructions answers only the new ones;
2. vocabulary: the draft proposes only the target's most frequent answer tokens (FR-Spec), or the vocabulary
   of the draft it resumes from;
3. training: see `app.distill.training`, checkpointed; `resume` starts from a shipped draft or a checkpoint;
4. card: the measured acceptance on held-out instructions, written beside the weights, with each phase's wall
   time and rate.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from app import store
from app.distill import corpus, instructions, training
from app.engine.drafting.eagle import (
    EagleConfig,
    EagleDraft,
    EagleDrafter,
    EagleError,
    load_draft,
    read_draft,
    save_draft,
)
from app.engine.engine import Engine
from app.engine.model.loading import LoadedModel, load_model
from app.engine.model.transformer import Transformer
from app.engine.step import GenerationParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the draft; written into its card."""

    seed: int = 0
    first_round: int = 3200
    second_round: int = 400
    batch_size: int = 48
    max_new_tokens: int = 160
    temperatures: tuple[float, ...] = (0.0, 0.7)
    draft_vocab: int = 8192
    steps: int = 1200
    lr: float = 1e-3
    seq_len: int = 512
    tokens_per_batch: int = 4096
    held_out: int = 32
    unroll: int = 3


def build_data(loaded: LoadedModel, recipe: Recipe, data_dir: Path) -> list[Path]:
    """Stage 1: both rounds of the corpus in `data_dir`, adding to the shards there; returns every shard path."""
    first = instructions.traffic_instructions(recipe.first_round + recipe.held_out, recipe.seed)
    first = first[recipe.held_out :]  # the first `held_out` are kept for measuring acceptance
    t0 = time.perf_counter()
    paths = _round(loaded, recipe, first, data_dir, "r1")
    found = corpus.answers(paths, loaded)
    pairs = [(q, a) for q, a in ((q, found.get(corpus.prompt_key(q))) for q in first) if a is not None]
    texts = [a for _, a in pairs]
    n = recipe.second_round
    second: list[corpus.Prompt] = []
    second += instructions.follow_ups(pairs, n * 2 // 5, recipe.seed + 1)
    second += instructions.long_passage_tasks(texts, n * 3 // 10, recipe.seed + 2)
    second += instructions.text_tasks(texts, n - len(second), recipe.seed + 3)
    paths += _round(loaded, recipe, second, data_dir, "r2")
    log.info("corpus ready in %.0f s: %d shards", time.perf_counter() - t0, len(paths))
    return paths


def _round(
    loaded: LoadedModel, recipe: Recipe, prompts: list[corpus.Prompt], data_dir: Path, prefix: str
) -> list[Path]:
    with tqdm(total=len(prompts), desc=f"corpus {prefix}", unit="answer", dynamic_ncols=True) as bar:

        def progress(answers: int, tokens: int) -> None:
            bar.update(answers)
            elapsed = bar.format_dict["elapsed"] or 1e-9
            bar.set_postfix(tok_s=f"{tokens / elapsed:.0f}", tokens=tokens)

        paths = corpus.build_corpus(
            loaded,
            prompts,
            data_dir,
            recipe.batch_size,
            recipe.max_new_tokens,
            recipe.temperatures,
            recipe.seed,
            progress,
            prefix,
            rows=recipe.batch_size,
        )
        bar.update(len(prompts) - bar.n)  # what earlier runs answered
        return paths


def held_out_instructions(recipe: Recipe) -> list[str]:
    """Instructions never trained on, for the card's acceptance figure."""
    return instructions.traffic_instructions(recipe.first_round + recipe.held_out, recipe.seed)[: recipe.held_out]


def train_stage(
    target: Transformer,
    eos_ids: list[int],
    recipe: Recipe,
    samples: list[corpus.Sample],
    work: Path,
    name: str,
    resume: Path | None = None,
) -> tuple[EagleDraft, dict[str, float]]:
    """Stages 2 and 3: choose the draft vocabulary and train, from scratch or from `resume` (a draft directory,
    or a checkpoint a run wrote: its weights and vocabulary, in a new schedule of recipe.steps). A checkpoint
    in `work` (an interrupted run of this recipe) comes first. Returns the trained draft (float32) and figures:
    the vocabulary's coverage of answer tokens and the final running loss and top-1 agreements."""
    if resume is not None and not (work / "checkpoint.pt").exists():
        draft = _resumed(resume, target, name)
        vocab = draft.vocab_ids.cpu()
        log.info("resuming from %s (its vocabulary of %d tokens)", resume, len(vocab))
    else:
        vocab = training.choose_vocab(samples, recipe.draft_vocab, target.config.vocab_size, eos_ids)
        draft = EagleDraft(EagleConfig.for_target(target.config, len(vocab), name)).to(target.device)
        draft.vocab_ids.copy_(vocab)
    answer_tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
    covered = sum(int(torch.isin(s.tokens[s.prompt_len :].long(), vocab).sum()) for s in samples)
    coverage = covered / max(1, answer_tokens)
    log.info("draft vocabulary: %d tokens cover %.2f%% of answer tokens", len(vocab), 100 * coverage)
    draft.attach(target)
    cfg = training.TrainConfig(
        steps=recipe.steps,
        lr=recipe.lr,
        seq_len=recipe.seq_len,
        tokens_per_batch=recipe.tokens_per_batch,
        seed=recipe.seed,
        unroll=recipe.unroll,
    )
    with tqdm(total=cfg.steps, desc="train", unit="step", dynamic_ncols=True) as bar:

        def progress(step: int, running: dict[str, float]) -> None:
            bar.update(step - bar.n)
            bar.set_postfix(
                loss=f"{running['loss']:.3f}",
                top1="/".join(f"{v:.3f}" for k, v in running.items() if k.startswith("agree")),
                pos_s=f"{running['positions_per_s']:.0f}",
                refresh=False,
            )

        final = training.train(draft, target, samples, cfg, work / "checkpoint.pt", progress)
    return draft, {"vocab_coverage": round(coverage, 4), **{k: round(v, 4) for k, v in final.items()}}


def _resumed(path: Path, target: Transformer, name: str) -> EagleDraft:
    """The float32 draft to continue training from: a draft directory (`read_draft`) or a checkpoint file."""
    if path.is_dir():
        draft = read_draft(path)
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)["draft"]
            draft = EagleDraft(EagleConfig.for_target(target.config, len(state["vocab_ids"]), name))
            draft.load_state_dict(state)
        except (OSError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as exc:
            # A checkpoint of another target's draft fails here (its shapes), a draft directory below.
            raise EagleError(f"cannot resume from {path}: {exc}") from exc
    c = target.config
    if (draft.config.dim, draft.config.target_vocab_size) != (c.dim, c.vocab_size):
        raise EagleError(f"{path} was trained for another target")
    return draft.float().to(target.device)


def measure(loaded: LoadedModel, drafter: EagleDrafter, prompts: list[str], max_new_tokens: int) -> dict[str, Any]:
    """Greedy generation of `prompts` with the draft (fixed k and the default schedule) and without:
    acceptance, tokens per target pass, tokens/s, and whether every output equals target-only."""
    engine = Engine(
        loaded.model, loaded.tokenizer, {drafter.name: drafter}, drafter.name, 6, draft_p_min=0.0, prefill_chunk=0
    )
    configs = {"none": ("none", "fixed"), "fixed k=6": (drafter.name, "fixed"), "adaptive": (drafter.name, "adaptive")}
    totals = {c: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "passes": 0, "same": 0} for c in configs}
    for text in tqdm(prompts, desc="measure", unit="prompt", dynamic_ncols=True):
        ids = corpus.encode_prompt(loaded, text)
        outputs = {}
        for label, (draft, schedule) in configs.items():
            params = GenerationParams(max_new_tokens=max_new_tokens, num_draft_tokens=6, draft_schedule=schedule)
            gen = engine.start(ids, params, draft)
            while not gen.finished:
                gen.step()
            st, t = gen.stats, totals[label]
            t["tokens"] += st.generated_tokens
            t["seconds"] += st.total_seconds
            t["drafted"] += st.drafted
            t["accepted"] += st.accepted
            t["passes"] += st.target_passes
            outputs[label] = gen.generated_ids
            t["same"] += outputs[label] == outputs["none"]
    out: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": max_new_tokens}
    base = totals["none"]["tokens"] / max(totals["none"]["seconds"], 1e-9)
    for label, t in totals.items():
        rate = t["tokens"] / max(t["seconds"], 1e-9)
        out[label] = {
            "acceptance_rate": round(t["accepted"] / max(1, t["drafted"]), 4),
            "tokens_per_target_pass": round(t["tokens"] / max(1, t["passes"]), 3),
            "tokens_per_second": round(rate, 2),
            "speedup": round(rate / base, 3),
            "identical_to_target": f"{t['same']}/{len(prompts)}",
        }
    return out


def train_draft(
    target_name: str,
    out_dir: Path,
    work: Path,
    recipe: Recipe,
    name: str,
    device: str = "cpu",
    resume: Path | None = None,
    data_dir: Path | None = None,
) -> dict[str, Any]:
    """The whole recipe: corpus (in `data_dir`, default `work`/corpus), vocabulary, training (from `resume` when
    given: see `train_stage`), measurement, card, on `device` (`cpu`, `cuda`, `cuda:N` or `auto`). Returns the
    card's figures."""
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    path = store.resolve(target_name)
    # The target in bfloat16 (packed on a CPU kernel), a quantized GGUF dequantized: training borrows its
    # embedding and output rows, whose products must carry gradients back to the draft.
    loaded = load_model(path, "bfloat16", device, cache_dir=store.cache_dir(), weights="bf16")
    phases: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    shards = build_data(loaded, recipe, data_dir or work / "corpus")
    phases["corpus"] = {"seconds": round(time.perf_counter() - t0)}
    t0 = time.perf_counter()
    computed = corpus.compute_features(loaded, shards)  # shards that came without their states
    phases["features"] = {"seconds": round(time.perf_counter() - t0), "positions": computed}
    samples = corpus.load_shards(shards)
    t0 = time.perf_counter()
    draft, figures = train_stage(
        loaded.model, sorted(loaded.tokenizer.eos_token_ids), recipe, samples, work, name, resume
    )
    phases["training"] = {
        "seconds": round(time.perf_counter() - t0),
        "positions_per_s": figures.get("positions_per_s", 0.0),
    }
    save_draft(draft, out_dir)
    drafter = EagleDrafter(name, load_draft(out_dir, loaded.model), loaded)
    t0 = time.perf_counter()
    measured = measure(loaded, drafter, held_out_instructions(recipe), 128)
    phases["measurement"] = {"seconds": round(time.perf_counter() - t0)}
    log.info("phases: %s", _phases_text(phases))
    card = {
        "name": name,
        "target": target_name,
        "architecture": "EAGLE-style feature draft: fc(2d->d) + 1 decoder layer + norm, target's embedding and "
        "output layer (restricted to the draft vocabulary)",
        "parameters": sum(p.numel() for p in draft.parameters()),
        "recipe": asdict(recipe),
        # Its name (a draft's folder is named for it), not this machine's path to it.
        "resumed_from": resume.name if resume is not None else None,
        "corpus": {
            "sequences": len(samples),
            "positions": sum(s.features.shape[0] for s in samples),
            "answer_tokens": sum(len(s.tokens) - s.prompt_len for s in samples),
            "seconds": phases["corpus"]["seconds"],
        },
        "training": {"seconds": phases["training"]["seconds"], **figures},
        "phases": phases,
        "held_out_measurement": measured,
        "total_seconds": round(time.perf_counter() - started),
        "torch": torch.__version__,
        "device": str(loaded.model.device),
        "threads": torch.get_num_threads(),
    }
    (out_dir / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    (out_dir / "README.md").write_text(card_markdown(card))
    return card


_WHY = """\
## Why a feature draft

The draft reads the target's final hidden state at each position (EAGLE). Measured for the default target
before this draft existed: the target's own first 2 to 12 layers, as independent early-exit drafts, agreed
with its next token only 2 to 6 % of the time; a 2-layer independent 576-wide draft would cost 0.19 of a
target step with the full vocabulary. The hidden state already says most of what comes next, so one
decoder layer on top of it predicts the target far better than a separate small model of the same cost.
Its output layer is the target's own, restricted to the most frequent answer tokens (FR-Spec), which
makes a draft step cost about as much as one target layer plus a fifth of the target's output layer.
The price is portability: it needs an engine that hands it the target's states (specserve does; a plain
transformers assisted generation cannot load it).
"""


def _phases_text(phases: dict[str, dict[str, float]]) -> str:
    """Each phase's figures on one line: "corpus seconds 12; training seconds 300, positions_per_s 560"."""
    return "; ".join(f"{phase} " + ", ".join(f"{k} {v}" for k, v in figs.items()) for phase, figs in phases.items())


def card_markdown(card: dict[str, Any]) -> str:
    """The human-readable card written next to the weights."""
    m = card["held_out_measurement"]
    lines = [
        f"# {card['name']}",
        "",
        f"A feature-conditioned (EAGLE-style) draft for `{card['target']}`, trained by `specserve train-draft` on "
        "text the target itself wrote (self-distillation).",
        "",
        f"- architecture: {card['architecture']}; {card['parameters']:,} trained parameters",
        f"- corpus: {card['corpus']['sequences']} answers to the project's instructions and to prompts built on "
        "the target's answers (second turns, long articles, text tasks), "
        f"{card['corpus']['answer_tokens']:,} answer tokens, {card['corpus']['positions']:,} positions, "
        f"generated in {card['corpus']['seconds']} s",
        f"- training: {card['recipe']['steps']} steps of {card['recipe']['tokens_per_batch']} positions, "
        f"{card['training']['seconds']} s; final loss {card['training']['loss']}, top-1 agreement with the target "
        + " / ".join(str(v) for k, v in card["training"].items() if k.startswith("agree"))
        + " (reading true states, then its own guesses one, two, ... steps deep); "
        f"draft vocabulary covers {100 * card['training']['vocab_coverage']:.1f} % of answer tokens",
        f"- whole recipe: {card['total_seconds']} s with {card['threads']} threads on "
        f"{card.get('device', 'cpu')}, torch {card['torch']}"
        + (f"; training resumed from {card['resumed_from']}" if card.get("resumed_from") else ""),
        f"- phases: {_phases_text(card.get('phases', {}))}",
        "",
        f"## Measured on {m['prompts']} held-out instructions (greedy, {m['max_new_tokens']} new tokens, bfloat16)",
        "",
        "| configuration | acceptance | tokens per target pass | tok/s | speedup | identical to target-only |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in ("none", "fixed k=6", "adaptive"):
        e = m[label]
        lines.append(
            f"| {label} | {e['acceptance_rate']} | {e['tokens_per_target_pass']} | {e['tokens_per_second']} | "
            f"{e['speedup']}x | {e['identical_to_target']} |"
        )
    lines += ["", "Spec-Bench figures: see the README's Benchmarks section (`specserve bench`).", "", _WHY]
    lines += ["## Recipe", "", "```json", json.dumps(card["recipe"], indent=2), "```", ""]
    return "\n".join(lines)
