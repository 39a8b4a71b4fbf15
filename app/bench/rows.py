"""`specserve bench --kernels` and `--rows`: one target step per CPU kernel against the memory read time, and
what each further verification row costs per kernel and weight format."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from app.engine import kernels
from app.engine.model.packing import PackedLinear
from app.engine.model.transformer import Transformer


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
    target: str | Path,
    rows: tuple[int, ...] = (1, 8, 16),
    context: int = 128,
    repeats: int = 7,
    on: Sequence[str] | None = None,
) -> tuple[float, int, dict[str, dict[int, float]]]:
    """Milliseconds of one cached target forward (the real model, bfloat16, `context` tokens already in the
    cache) per kernel this CPU runs, torch's path included (or those `on` names), and per row count: a plain
    step is 1 row, a verification k+1. Returns (read bandwidth in bytes/s, bytes of weights a step reads,
    {kernel: {rows: ms}}) (median of `repeats`)."""
    bandwidth = read_bandwidth()
    table: dict[str, dict[int, float]] = {}
    weight_bytes = 0
    for name in [*kernels.available(), "torch"] if on is None else on:
        model = _load_on(name, target, "bf16")
        weight_bytes = step_bytes(model)
        table[name] = step_times(model, rows, context, repeats)
        del model
    return bandwidth, weight_bytes, table


# --- what a verification's rows cost (`specserve bench --rows`) ----------------------------------------------

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


ROW_WEIGHTS = ("native", "bf16")


def draft_token_ms(
    model: Transformer, draft_dir: Path, draft_weights: str, context: int, repeats: int, warmup: int = 0
) -> tuple[str, float]:
    """What one token of the feature draft in `draft_dir` costs beside `model` (its target, loaded as the engine
    loads it, `draft_weights` as `load_draft` takes them), after `context` positions of the target's states: where
    the draft runs its greedy chain in one kernel call (`DraftChain`), an eighth of a chain of 8 tokens (each a
    forward over one position, the head over the draft vocabulary and the choice), else one forward, head and
    argmax; the median of `repeats` after `warmup` (milliseconds). Returns (what the draft's matrices run as, ms)."""
    from app.engine.drafting.eagle import load_draft

    draft = load_draft(draft_dir, model, draft_weights)
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=torch.Generator())
    chained = draft.__dict__["_chain"] is not None
    length = 8 if chained else 1
    times = []
    with torch.inference_mode():
        states = model.hidden(ids[:, :context])
        cache = draft.new_cache(context + length, model.dtype, model.device)
        draft(states[:, :-1], ids[:, 1:context], 0, cache)
        for _ in range(warmup + repeats):
            cache.truncate(context - 1)
            t0 = time.perf_counter()
            if chained:
                draft.chain(states[0, -1:], ids[0, context:].tolist(), context - 1, cache, length, 0.0)
            else:
                guess = draft(states[:, -1:], ids[:, context:], context - 1, cache)
                int(draft.draft_logits(guess[0, -1]).argmax())
            times.append((time.perf_counter() - t0) / length)
    return draft.runs_as, statistics.median(times[warmup:]) * 1e3


def row_costs(
    target: str | Path,
    rows: tuple[int, ...] = ROW_COUNTS,
    weights: tuple[str, ...] = ROW_WEIGHTS,
    context: int = 300,
    repeats: int = 9,
    warmup: int = 3,
    on: Sequence[str] | None = None,
    draft: Path | None = None,
    draft_weights: str = "auto",
) -> dict[str, Any]:
    """What 1..16 verification rows cost per CPU kernel this machine runs (or those `on` names) and weight
    format (`native` GGUF blocks, `bf16`): one target forward with its head over R new rows, `context` tokens in
    the cache, the median of `repeats` calls after `warmup`, beside the floor of a 1-row step (the bytes a step
    reads over the measured read bandwidth). Per (kernel, weights): ms by row count, each row's extra cost as a
    fraction of a 1-row step ((ms(R) - ms(1)) / (R - 1) / ms(1)) and the floor; with a feature `draft`
    directory, one draft token's ms (`draft_token_ms`, `draft_weights`) and its share of a 1-row step. `rows`
    must hold 1."""
    if 1 not in rows:
        raise ValueError("row costs are fractions of a 1-row step: rows must hold 1")
    rows = tuple(sorted(set(rows)))
    bandwidth = read_bandwidth()
    tables = []
    for name in kernels.available() if on is None else on:
        for w in weights:
            model = _load_on(name, target, w)
            nbytes = step_bytes(model)
            times = step_times(model, rows, context, repeats, warmup)
            floor = nbytes / bandwidth * 1e3
            drafted = None
            if draft is not None:
                runs_as, ms = draft_token_ms(model, draft, draft_weights, context, repeats * 4, warmup)
                drafted = {"runs_as": runs_as, "ms": ms, "of_step": ms / times[1]}
            tables.append(
                {
                    "draft_token": drafted,
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
        d = t.get("draft_token")
        if d is not None:
            lines += [
                "",
                f"A token of the feature draft ({d['runs_as']}): {d['ms']:.3f} ms, {d['of_step']:.3f} of a 1-row step.",
            ]
    return "\n".join(lines)
