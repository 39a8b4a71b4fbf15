"""The ``specserve`` command line.

Each subcommand is one ``_add_<name>_parser(subparsers)`` that registers its arguments and sets
``func=_cmd_<name>``; ``_cmd_<name>(args) -> int`` does the work. Import heavy modules (torch, the engine,
the server) inside the ``_cmd_`` function so that ``specserve models ...`` stays fast. Errors meant for the
user are raised as :class:`~app.store.ModelStoreError` (or :class:`CliError`) and reported by :func:`main`
as one ``error: ...`` line on stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app import __version__
from app.bench.synthetic import FORMATS as SYNTHETIC_FORMATS
from app.bench.synthetic import SHAPES as SYNTHETIC_SHAPES
from app.bench.workloads import WORKLOADS
from app.engine.defaults import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_SCHEDULE,
    SAMPLERS,
)
from app.store import ModelStoreError

if TYPE_CHECKING:
    from app.bench.specbench import Config
    from app.engine.engine import Engine
    from app.engine.model.loading import LoadedModel

# `specserve bench`'s default prompts: 13 of the project's own, one per Spec-Bench category, shipped in the
# package so that the command runs from any checkout or install; Spec-Bench files come in with --input.
BENCH_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.jsonl"


class CliError(Exception):
    """A user-facing error of any subcommand; :func:`main` prints it as one line and exits 1."""


def _human_size(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# --- specserve models -------------------------------------------------------------------------------------


def _add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list and fetch the models of the catalog",
        description="List the models of the catalog (model_store/catalog.json) and fetch them into the cache.",
    )
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION", required=True)
    actions.add_parser("list", help="show the catalog and which models are fetched")
    fetch = actions.add_parser(
        "fetch",
        help="download and verify a model; prints its local path as the last line",
        description="Download and verify a model into the cache (SPECSERVE_CACHE, default "
        "~/.cache/specserve). Progress goes to stderr; the local path is the last line of stdout.",
    )
    fetch.add_argument("name", help="catalog name, e.g. smollm2-135m-instruct")
    fetch.add_argument("--force", action="store_true", help="download again even if already present")
    fetch.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    parser.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace) -> int:
    from app import store

    if args.models_action == "fetch":
        path = store.fetch(args.name, progress=not args.quiet, force=args.force)
        print(path, flush=True)
        return 0

    fetched = {"ok": "yes", "missing": "no", "corrupt": "CORRUPT"}
    weights = os.environ.get("SPECSERVE_WEIGHTS", "auto")
    header = ("NAME", "ROLE", "FORMAT", "SIZE", "LICENSE", "FETCHED", f"RUNS AS (weights {weights})", "DESCRIPTION")
    rows = [header]
    for name, entry in store.catalog().items():
        state = store.status(name)
        rows.append(
            (
                name,
                entry.role,
                entry.format,
                _human_size(entry.size),
                entry.license,
                fetched[state],
                _runs_as(entry.local_path(), weights) if state == "ok" else "-",
                entry.description,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    widths[-1] = 0  # the last column is not padded
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    return 0


def _runs_as(path: Path, weights: str) -> str:
    """What a fetched model's weights run as on this CPU's kernels under `weights`, and their memory."""
    import torch

    from app.engine import kernels
    from app.engine.model.loading import auto_native
    from app.engine.model.weights import held_weights

    # The kernel SPECSERVE_KERNEL would select (not built here: listing compiles nothing).
    choice = kernels.setting()
    kernel = next(iter(kernels.available()), "torch") if choice == "auto" else choice
    native = weights == "native" or (weights == "auto" and auto_native(kernel))
    kind, size = held_weights(path, native, torch.float32 if weights == "float32" else torch.bfloat16)
    return f"{kind}, {_human_size(size)}"


# --- specserve generate -----------------------------------------------------------------------------------


def _add_generate_parser(subparsers: argparse._SubParsersAction, flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding and report what the draft bought",
        description="Generate from a prompt (or each line of a Spec-Bench-format JSONL file) with the target "
        "model, drafting with --draft, and print the text and the speculative figures.",
    )
    parser.add_argument("prompt", nargs="?", help="the user message (or raw prompt with --no-chat)")
    parser.add_argument("--input", metavar="FILE.jsonl", help="Spec-Bench-format lines; the first turn is used")
    parser.add_argument("--limit", type=_positive_int, default=None, help="only the first N prompts of --input")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    # The engine's flags as serve spells them, with its help and defaults (app.service.settings, one table).
    if flags:
        _add_setting_flags(
            parser,
            ["target", "draft", "num_draft_tokens", "draft_schedule", "draft_p_min", "dtype", "weights", "device"],
            {"num_draft_tokens": ["-k"], "draft_schedule": ["--schedule"], "draft_p_min": ["--p-min"]},
        )
    parser.add_argument("--max-new-tokens", "-n", type=int, default=128)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--compare", action="store_true", help="also run target-only and print the speedup")
    _add_sampling_arguments(parser)
    parser.set_defaults(func=_cmd_generate)


def _add_sampling_arguments(parser: argparse.ArgumentParser, samplers: bool = False) -> None:
    """The sampling flags; with `samplers` --sampler is repeatable (one configuration each, for bench)."""
    group = parser.add_argument_group("sampling", "greedy by default; --temperature > 0 samples")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    group.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="with --temperature > 0: sample from the k most likely tokens (default 0: all)",
    )
    group.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="with --temperature > 0: nucleus sampling mass in (0, 1] (default 1: all)",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=None,
        help="with --temperature > 0: seed of sampling (default: a random one, printed)",
    )
    group.add_argument(
        "--sampler",
        choices=list(SAMPLERS),
        action="append" if samplers else "store",
        default=None,
        help="with --temperature > 0: gumbel (default: the seed gives target-only sampling's tokens whatever the "
        "draft) or rejection (the rejection sampler: accepts a model draft more often)"
        + ("; repeatable: every configuration runs under each" if samplers else ""),
    )


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling fields of GenerationParams from the flags; raises CliError before any model loads."""
    import math

    from app.api.schemas import MAX_SEED, MIN_TEMPERATURE
    from app.engine.decoding.sampling import SamplingParams

    if not math.isfinite(args.temperature) or 0 < args.temperature < MIN_TEMPERATURE:
        raise CliError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    try:
        SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as exc:
        raise CliError(f"invalid sampling flags: {exc}") from exc
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        raise CliError(f"--seed must lie in [0, {MAX_SEED}]")
    kwargs = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    if isinstance(args.sampler, str):
        kwargs["sampler"] = args.sampler
    return kwargs


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (a --limit of 0 or -1 would silently drop prompts)."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _read_prompts(args: argparse.Namespace) -> list[str]:
    import json

    if args.input is None:
        if not args.prompt:
            raise CliError("give a PROMPT or --input FILE.jsonl")
        return [args.prompt]
    prompts = []
    try:
        with open(args.input, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    prompts.append(json.loads(line)["turns"][0])
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    raise CliError(f"{args.input}:{n}: not a Spec-Bench line with 'turns' ({exc})") from exc
    except OSError as exc:
        raise CliError(f"cannot read {args.input}: {exc.strerror}") from exc
    return prompts[: args.limit] if args.limit is not None else prompts


def _describe_stats(stats: dict, prefix: str = "") -> str:
    return (
        f"{prefix}{stats['generated_tokens']} tokens in {stats['total_seconds']:.2f} s "
        f"({stats['tokens_per_second']:.1f} tok/s); {stats['target_passes']} target passes, "
        f"{stats['tokens_per_target_pass']:.2f} tokens per pass; drafted {stats['drafted']}, "
        f"accepted {stats['accepted']} (acceptance {stats['acceptance_rate']:.1%}); "
        f"accepted by position {stats['accepted_per_position']}"
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from app.engine.drafting.base import DraftError
    from app.engine.factory import DEFAULT_TARGET, build_engine
    from app.engine.model.tokenizer import TokenizerError
    from app.engine.model.weights import WeightsError
    from app.engine.step import GenerationError, GenerationParams

    sampling = _sampling_kwargs(args)
    prompts = _read_prompts(args)
    if args.num_draft_tokens < 0 or args.max_new_tokens < 1:
        raise CliError("--num-draft-tokens must be >= 0 and --max-new-tokens >= 1")
    sampled = args.temperature > 0
    try:
        engine, loaded = build_engine(
            args.target or DEFAULT_TARGET,
            args.draft,
            args.num_draft_tokens,
            args.dtype,
            args.device,
            weights=args.weights,
        )
        tok = loaded.tokenizer
        params = GenerationParams(
            max_new_tokens=args.max_new_tokens,
            stop=tuple(args.stop),
            num_draft_tokens=args.num_draft_tokens,
            draft_schedule=args.draft_schedule,
            draft_p_min=args.draft_p_min,
            **sampling,
        )
        stream = not args.json and len(prompts) == 1
        for prompt in prompts:
            text = prompt if args.no_chat else tok.apply_chat_template([{"role": "user", "content": prompt}])
            prompt_ids = tok.encode(text)
            gen = engine.start(prompt_ids, params, args.draft)
            while not gen.finished:
                out = gen.step()
                if stream:
                    print(out.text, end="", flush=True)
            stats = gen.stats.to_dict()
            result: dict = {
                "text": gen.text,
                "prompt_token_ids": prompt_ids,
                "token_ids": gen.generated_ids,
                "finish_reason": gen.finish_reason,
                "seed": gen.seed if sampled else None,  # the seed used: --seed, or the one drawn
                "stats": stats,
            }
            if args.compare:
                # With the same seed, the gumbel sampler gives target-only's tokens; the rejection sampler consumes
                # randomness per drafted token, so its outputs are equal in distribution only (reported as null).
                # A tenant of its own: its answers are no draft for the next prompts' speculative runs.
                base = engine.start(prompt_ids, replace(params, seed=gen.seed, cache_salt="target-only"), "none")
                while not base.finished:
                    base.step()
                b = base.stats.to_dict()
                result["baseline"] = {"token_ids": base.generated_ids, "stats": b}
                comparable = not sampled or params.sampler == "gumbel"
                result["identical_to_target_only"] = base.generated_ids == gen.generated_ids if comparable else None
                result["speedup"] = round(stats["tokens_per_second"] / max(b["tokens_per_second"], 1e-9), 3)
            if args.json:
                print(json.dumps(result, ensure_ascii=False), flush=True)
                continue
            if not stream:
                print(gen.text)
            decoding = (
                f"temperature {args.temperature:g}, top-k {args.top_k}, top-p {args.top_p:g}, seed {gen.seed}"
                if sampled
                else "greedy"
            )
            print(
                f"\n\n[{engine.default_draft if args.draft == 'default' else args.draft} draft, "
                f"k={args.num_draft_tokens}, {loaded.model.dtype}, {decoding}] finish: {gen.finish_reason}"
            )
            print(_describe_stats(stats))
            if args.compare:
                print(_describe_stats(result["baseline"]["stats"], "target only: "))
                if result["identical_to_target_only"] is None:
                    print(f"speedup over target only: {result['speedup']:.2f}x")
                else:
                    same = "identical" if result["identical_to_target_only"] else "DIFFERENT"
                    print(f"speedup over target only: {result['speedup']:.2f}x (outputs {same})")
    except (GenerationError, DraftError, WeightsError, TokenizerError) as exc:
        raise CliError(str(exc)) from exc
    return 0


# --- specserve bench --------------------------------------------------------------------------------------


def _add_bench_parser(subparsers: argparse._SubParsersAction, flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure speed and acceptance side by side over Spec-Bench-format prompts",
        description="Run transformers' generate (target only), our engine target-only and our engine with each "
        "draft on every prompt, interleaved, and report tokens/s, speedups, acceptance and output equality.",
    )
    parser.add_argument(
        "--input",
        default=str(BENCH_PROMPTS),
        help="Spec-Bench-format JSONL (default: the package's 13 prompts, one per Spec-Bench category)",
    )
    parser.add_argument(
        "--per-category", type=_positive_int, default=None, help="only the first N prompts of each category"
    )
    parser.add_argument("--limit", type=_positive_int, default=None, help="only the first N prompts")
    parser.add_argument(
        "--workload",
        action="append",
        choices=["specbench", *WORKLOADS, "all"],
        default=None,
        help="specbench (the default): Spec-Bench-format prompts, as --input; or traffic a server sees, built from "
        f"the package's own texts: {', '.join(WORKLOADS)}, or all of them (repeatable; workloads.json and "
        "workloads.md): every turn of every episode target-only and with each draft, each configuration its own "
        "tenant, against target-only in the same run",
    )
    parser.add_argument(
        "--episodes", type=_positive_int, default=None, help="traffic workloads: only the first N episodes of each"
    )
    parser.add_argument("--target", default=None, help="catalog name or path (default: smollm2-135m-instruct)")
    parser.add_argument(
        "--draft", action="append", default=None, help="draft to measure (repeatable; default: default and ngram)"
    )
    parser.add_argument(
        "--draft-schedule",
        "--schedule",
        dest="schedule",
        action="append",
        choices=["adaptive", "heuristic", "fixed"],
        default=None,
        help="draft-length schedule of model drafts (repeatable: one configuration each; default: "
        f"{DEFAULT_DRAFT_SCHEDULE})",
    )
    parser.add_argument(
        "--draft-p-min",
        "--p-min",
        dest="p_min",
        type=float,
        default=None,
        help=f"confidence cut-off of model drafts (default: the engine's, {DEFAULT_DRAFT_P_MIN})",
    )
    parser.add_argument(
        "--tree-rows",
        type=int,
        action="append",
        default=None,
        help="rows of a tree verification (repeatable: one configuration each; 0: chains; default: the engine's)",
    )
    # As serve spells them (app.service.settings, one table).
    if flags:
        _add_setting_flags(parser, ["num_draft_tokens", "dtype", "weights"], {"num_draft_tokens": ["-k"]})
    parser.add_argument(
        "--max-new-tokens",
        "-n",
        type=int,
        default=None,
        help="tokens per answer (default 128; traffic workloads: each episode's own, 40 to 448)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    parser.add_argument(
        "--llama-cpp",
        action="append",
        choices=["gguf", "f32", "bf16", "lookup"],
        default=None,
        help="also run llama.cpp (pip install llama-cpp-python) on the target's GGUF as it is (gguf), "
        "dequantized to f32 / bf16, or as it is with the binding's prompt-lookup decoding (lookup, 10 tokens; "
        "gguf runs beside it) (repeatable; greedy only)",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="only time one target step per CPU kernel (1, 8 and 16 rows) against the memory-bandwidth limit",
    )
    parser.add_argument(
        "--rows",
        action="store_true",
        help="only time what 1-16 verification rows cost (one target forward and its head, 300 tokens cached) per "
        "CPU kernel and weight format (native and bf16; --weights picks one) beside the weights' read time "
        "(rows.json, rows.md)",
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="only the structured-output set: greedy answers to our own JSON-schema and tool-call prompts, "
        "constrained target-only and with each draft, without and with forced tokens, unconstrained beside; "
        "tokens/s and the grammar's own cost per token (structured.json, structured.md)",
    )
    parser.add_argument(
        "--synthetic",
        choices=list(SYNTHETIC_SHAPES),
        default=None,
        help="time decoding on a random-weight target of that model's shape (1.7b: SmolLM2-1.7B's), written "
        "once into the model store's cache: target-only and each draft (default ngram), to max-new-tokens on "
        "4 prompts unless --limit/--per-category, llama.cpp beside where installed; speed only (random weights "
        "show no acceptance); with --rows or --kernels, their timings on it",
    )
    parser.add_argument(
        "--synthetic-format",
        choices=list(SYNTHETIC_FORMATS),
        default="q8_0",
        help="the synthetic target's GGUF: q8_0, or q4_k_m (Q4_K with Q6_K where llama.cpp's Q4_K_M puts it)",
    )
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="bench_out", help="directory for results.json and results.md")
    _add_sampling_arguments(parser, samplers=True)
    parser.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    import json

    import torch

    from app.bench.specbench import Config, markdown, per_prompt_medians, plots, read_prompts, run_bench, summarize
    from app.engine.drafting.registry import lookup_names
    from app.engine.factory import DEFAULT_TARGET, HYBRID, build_engine, default_draft_name

    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = _bench_workload_names(args)
    if args.max_new_tokens is None and not workloads:
        args.max_new_tokens = 128
    sampling = _sampling_kwargs(args)
    if args.temperature > 0 and sampling["seed"] is None:
        sampling["seed"] = 0  # one seed for every configuration, so gumbel outputs can be compared to target-only
    synthetic = None
    if args.synthetic:
        if args.target:
            raise CliError("--synthetic makes its own target; leave out --target")
        if args.temperature > 0:
            raise CliError("--synthetic decodes greedily")
        synthetic = _synthetic_target(args.synthetic, args.synthetic_format)
    target = str(synthetic) if synthetic else args.target or DEFAULT_TARGET
    if args.rows:
        return _bench_rows(args, target)
    if args.kernels:
        from app import store
        from app.bench.specbench import kernel_steps

        bandwidth, weight_bytes, table = kernel_steps(store.resolve(target))
        floor = weight_bytes / bandwidth * 1e3
        print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; a step reads {weight_bytes / 1e6:.0f} MB of weights, ")
        print(f"so it cannot take less than {floor:.2f} ms ({1e3 / floor:.0f} tokens/s at 1 row)")
        print("| kernel | " + " | ".join(f"{m} rows" for m in next(iter(table.values()))) + " | 1 row: of the limit |")
        print("|---" * (len(next(iter(table.values()))) + 2) + "|")
        for name, times in table.items():
            cells = " | ".join(f"{ms:.1f} ms" for ms in times.values())
            print(f"| {name} | {cells} | {floor / times[min(times)]:.2f} |")
        return 0
    path = Path(args.input)
    if not workloads and not path.is_file():
        raise CliError(f"no prompts at {path}; give --input FILE.jsonl")
    limit = 4 if synthetic and args.limit is None and args.per_category is None else args.limit
    prompts = [] if workloads else read_prompts(path, args.per_category, limit)
    drafts = args.draft or (["ngram"] if synthetic else ["default", "ngram"])
    fallback = default_draft_name(target)
    lookups = {"none", *lookup_names()}  # drafts every target has: no model draft to load for them
    drafts = [(HYBRID if fallback not in lookups else fallback) if d == "default" else d for d in drafts]
    model_drafts = list(dict.fromkeys(d for d in drafts if d not in lookups and d != HYBRID))
    if len(model_drafts) > 1:
        raise CliError("one model draft per run (plus the lookups and hybrid)")
    if not model_drafts and HYBRID in drafts:
        model_drafts = [default_draft_name(target)]
    engine, loaded = build_engine(
        target, model_drafts[0] if model_drafts else "ngram", args.num_draft_tokens, args.dtype, weights=args.weights
    )
    if args.structured:
        from app.bench.specbench import run_structured, structured_markdown

        rows, runs = run_structured(engine, list(dict.fromkeys(drafts)), args.max_new_tokens, args.num_draft_tokens)
        _write_tables(Path(args.out), "structured", {"rows": rows, "runs": runs}, structured_markdown(rows))
        return 0
    schedules = args.schedule or [DEFAULT_DRAFT_SCHEDULE]
    configs = [
        Config(d, sched, args.p_min, sampler, rows)
        for sampler in dict.fromkeys(args.sampler or ["gumbel"])
        for d in dict.fromkeys(drafts)
        for sched in schedules
        for rows in (dict.fromkeys(args.tree_rows or [None]) if d != "ngram" else [None])
    ]
    threads = torch.get_num_threads()
    llama_cpp = args.llama_cpp or (["gguf"] if synthetic else None)
    if synthetic and llama_cpp and importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: not installed (pip install llama-cpp-python), not measured", file=sys.stderr)
        llama_cpp = None
    # A conversation's turns extend each other: llama.cpp keeps its cache between them as ours keeps the tenant's.
    baselines = _llama_cpp_baselines(args, loaded.source, llama_cpp, threads, reuse_prefix=bool(workloads))
    if workloads:
        return _bench_workloads(args, engine, loaded, workloads, configs, baselines, threads)
    runs = run_bench(
        engine,
        loaded,
        prompts,
        configs,
        args.max_new_tokens,
        args.num_draft_tokens,
        not args.no_hf and synthetic is None,
        **sampling,
        baselines=baselines,
        ignore_eos=synthetic is not None,
    )
    summary = summarize(runs, args.num_draft_tokens, sampled=args.temperature > 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "dtype": str(loaded.model.dtype),
        "weights": loaded.weights,
        "weight_bytes": loaded.weight_bytes,
        "target": loaded.source,
        "max_new_tokens": args.max_new_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "decoding": "sampling" if args.temperature > 0 else "greedy",
        **sampling,
        "prompts": len(prompts),
        "threads": threads,
        "kernel": engine.kernel,
    }
    if synthetic:
        meta["synthetic"] = f"{args.synthetic} {args.synthetic_format}: random weights, speed only"
        meta["llama_cpp"] = "measured" if baselines else "not installed"
    medians = per_prompt_medians(runs)
    (out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "summary": summary, "median_tokens_per_second": medians, "runs": [r.__dict__ for r in runs]},
            indent=1,
        )
    )
    table = markdown(summary)
    (out / "results.md").write_text(table + "\n")
    pictures = plots(summary, out)
    print(json.dumps(meta))
    print(table)
    print("median tokens/s per prompt: " + ", ".join(f"{c} {v:.1f}" for c, v in medians.items()))
    print("plots: " + (", ".join(map(str, pictures)) if pictures else "none (pip install 'specserve[bench]')"))
    return 0


def _bench_workload_names(args: argparse.Namespace) -> list[str]:
    """The traffic workloads `--workload` names (`all`: every one), none for Spec-Bench; refuses mixing them and
    the other bench modes."""
    names = list(dict.fromkeys(args.workload or ["specbench"]))
    if "all" in names:
        names = [n for n in names if n != "all"] + [n for n in WORKLOADS if n not in names]
    traffic = [n for n in names if n != "specbench"]
    if not traffic:
        if args.episodes is not None:
            raise CliError("--episodes is for the traffic workloads (--workload agent, ..., all)")
        return []
    if "specbench" in names:
        raise CliError("run --workload specbench and the traffic workloads in separate runs")
    modes = {"--structured": args.structured, "--rows": args.rows, "--kernels": args.kernels}
    modes["--synthetic"] = args.synthetic is not None
    if any(modes.values()) or args.temperature > 0:
        used = [flag for flag, on in modes.items() if on] + (["--temperature"] if args.temperature > 0 else [])
        raise CliError(f"--workload {traffic[0]} decodes greedily on its own: leave out {', '.join(used)}")
    return traffic


def _llama_cpp_baselines(
    args: argparse.Namespace, source: str, kinds: list[str] | None, threads: int, reuse_prefix: bool
) -> dict[str, Any]:
    """The llama.cpp runners `--llama-cpp` asks for (none without it), on the target's GGUF."""
    if not kinds:
        return {}
    from app import store
    from app.bench import llamacpp

    if args.temperature > 0:
        raise CliError("--llama-cpp runs greedy only")
    if not Path(source).is_file() or Path(source).suffix != ".gguf":
        raise CliError(f"--llama-cpp needs a GGUF target; {source} is not one")
    try:
        return llamacpp.runners(
            Path(source), list(dict.fromkeys(kinds)), store.cache_dir() / "gguf", threads, reuse_prefix
        )
    except RuntimeError as exc:
        raise CliError(str(exc)) from exc


def _bench_workloads(
    args: argparse.Namespace,
    engine: Engine,
    loaded: LoadedModel,
    names: list[str],
    configs: list[Config],
    baselines: dict[str, Any],
    threads: int,
) -> int:
    """`specserve bench --workload NAME`: every episode of each traffic workload, interleaved configurations;
    workloads.json (meta, summary, runs) and workloads.md."""
    import json

    from app.bench import workloads
    from app.bench.specbench import run_workloads, summarize_workloads, workloads_markdown

    episodes = [e for name in names for e in workloads.episodes(name, limit=args.episodes)]
    runs = run_workloads(engine, episodes, configs, args.num_draft_tokens, args.max_new_tokens, baselines)
    summary = summarize_workloads(runs)
    meta = {
        "target": loaded.source,
        "dtype": str(loaded.model.dtype),
        "weights": loaded.weights,
        "workloads": names,
        "episodes": {name: sum(e.workload == name for e in episodes) for name in names},
        "max_new_tokens": args.max_new_tokens or "each episode's own",
        "num_draft_tokens": args.num_draft_tokens,
        "decoding": "greedy",
        "threads": threads,
        "kernel": engine.kernel,
        "speedup": "total tokens / total seconds, over target-only's",
    }
    print(json.dumps(meta))
    data = {"meta": meta, "summary": summary, "runs": [r.__dict__ for r in runs]}
    _write_tables(Path(args.out), "workloads", data, workloads_markdown(summary))
    return 0


def _bench_rows(args: argparse.Namespace, target: str) -> int:
    """`specserve bench --rows`: what 1-16 verification rows cost per kernel and weight format."""
    from app import store
    from app.bench.specbench import ROW_WEIGHTS, row_costs, rows_markdown

    if args.weights not in ("auto", *ROW_WEIGHTS):
        raise CliError(f"--rows times {' and '.join(ROW_WEIGHTS)} weights (--weights auto: both)")
    weights = ROW_WEIGHTS if args.weights == "auto" else (args.weights,)
    result = row_costs(store.resolve(target), weights=weights)
    _write_tables(Path(args.out), "rows", result, rows_markdown(result))
    return 0


def _write_tables(out: Path, name: str, data: Any, table: str) -> None:
    """A bench mode's results: `data` as out/NAME.json, the markdown `table` as out/NAME.md, and printed."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    (out / f"{name}.md").write_text(table + "\n")
    print(table)


def _synthetic_target(shape: str, fmt: str) -> Path:
    """The synthetic target's GGUF in the model store's cache (written the first time, with the default
    target's tokenizer)."""
    from app import store
    from app.bench import synthetic
    from app.engine.factory import DEFAULT_TARGET

    path = synthetic.synthetic_path(store.cache_dir(), shape, fmt)
    if not path.exists():
        print(f"writing {path} (once; random weights)", file=sys.stderr)
    return synthetic.ensure(shape, fmt, store.cache_dir(), store.resolve(DEFAULT_TARGET))


# --- specserve serve --------------------------------------------------------------------------------------


def _serve_default(value: object) -> str | None:
    """A setting's default as the serve help shows it; None where the description says what unset means."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != "" else "empty"


def _serve_flags() -> list[tuple[str, str, dict[str, Any]]]:
    """(flag, Settings field, add_argument keywords) for every field of `app.service.settings.Settings`, read from
    it: the flag is the field's name with dashes, the help its description and default, the type its annotation.

    Every flag defaults to None, so that the SPECSERVE_* variables apply unless a flag is given. Values are
    checked by the settings, not by argparse (a `Literal`'s choices are only shown), so that a value out of
    range or not among the choices is the same one-line `invalid settings` error whichever flag it came by.
    """
    import types
    import typing

    from pydantic import SecretStr

    from app.service.settings import Settings

    flags = []
    for field, info in Settings.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            (annotation,) = (a for a in typing.get_args(annotation) if a is not type(None))  # X | None
        help_ = (info.description or field).replace("%", "%%")
        default = _serve_default(info.default)
        if default is not None:
            help_ += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": field, "default": None, "help": help_}
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if annotation is bool:  # --metrics-public / --no-metrics-public
            kwargs["action"] = argparse.BooleanOptionalAction
        elif extra.get("several"):  # --served-model-name a b (as vLLM's); the setting holds them comma-separated
            kwargs.update(nargs="+", metavar="NAME")
        elif typing.get_origin(annotation) is typing.Literal:
            kwargs["metavar"] = "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
        elif annotation in (int, float):
            kwargs["type"] = annotation
        elif annotation not in (str, SecretStr):
            raise TypeError(f"Settings.{field}: no serve flag for a {annotation!r}")
        flags.append(("--" + field.replace("_", "-"), field, kwargs))
    return flags


def _add_setting_flags(
    parser: argparse.ArgumentParser, fields: Sequence[str], aliases: dict[str, list[str]] | None = None
) -> None:
    """Flags for the settings `fields` as serve has them (`_serve_flags`: name, help, type), for a command that
    runs the engine itself: with the settings' defaults as values (no environment to fall back on), checked
    by argparse where the setting lists its choices. `aliases`: more spellings of a flag (older ones)."""
    import typing

    from app.service.settings import Settings

    table = {field: (flag, kwargs) for flag, field, kwargs in _serve_flags()}
    for field in fields:
        flag, kwargs = table[field]
        info = Settings.model_fields[field]
        default = info.default
        kwargs = {**kwargs, "default": default}
        annotation = info.annotation
        if typing.get_origin(annotation) is typing.Literal:
            kwargs.pop("metavar", None)
            kwargs["choices"] = list(typing.get_args(annotation))
        parser.add_argument(flag, *(aliases or {}).get(field, []), **kwargs)


def _add_serve_parser(subparsers: argparse._SubParsersAction, flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the TGI- and OpenAI-compatible HTTP API",
        description="Serve generation over HTTP (TGI-compatible /generate, OpenAI-compatible /v1/...). Each flag "
        "can also be set by its SPECSERVE_* environment variable (--max-queue-size: SPECSERVE_MAX_QUEUE_SIZE); "
        "a flag wins over the environment.",
    )
    # The flags come from the settings (pydantic-settings, a quarter of a second to import): only built when the
    # command line names serve, so that `specserve models ...` stays fast.
    for flag, _, kwargs in _serve_flags() if flags else ():
        parser.add_argument(flag, **kwargs)
    parser.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from app import store
    from app.service.logs import configure_logging
    from app.service.server import serve
    from app.service.settings import Settings

    overrides = {field: getattr(args, field) for field in Settings.model_fields if getattr(args, field) is not None}
    overrides.update({f: ",".join(v) for f, v in overrides.items() if isinstance(v, list)})
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise CliError(f"invalid settings: {problems}") from exc
    # A model that is not there fails here, with what to run, before the port opens.
    store.resolve(settings.target)
    from app.engine.drafting.registry import REGISTRY

    if settings.draft not in ("default", "none", *REGISTRY):
        store.resolve(settings.draft)
    configure_logging(settings.log_format, settings.log_level)
    # 3 is uvicorn's own status for a server that did not start (the port taken, say).
    return 0 if serve(settings) else 3


# --- specserve train-draft --------------------------------------------------------------------------------


def _add_train_draft_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-draft",
        help="distil a feature draft (EAGLE-style) for a target from the target's own answers",
        description="Generate a self-distillation corpus (the target answering the project's seed instructions), "
        "train a one-layer feature draft on the target's distributions, measure it on held-out instructions and "
        "write model.safetensors, config.json and card.json into --out. Every stage resumes from --work.",
    )
    parser.add_argument("--target", default=None, help="catalog name or path (default: smollm2-135m-instruct)")
    parser.add_argument("--out", required=True, help="directory for the draft (model_store/drafts/NAME to ship it)")
    parser.add_argument("--name", default=None, help="the draft's name in its card (default: the --out folder)")
    parser.add_argument(
        "--work", default=None, help="corpus and checkpoints (default: $SPECSERVE_CACHE/train-draft/NAME)"
    )
    parser.add_argument(
        "--corpus",
        default=None,
        help="directory of corpus shards to use and extend (default: WORK/corpus); a shard without its states "
        "(NAME.features.pt) gets them from one forward of the target",
    )
    parser.add_argument("--instructions", type=_positive_int, default=None, help="first-round instructions (3200)")
    parser.add_argument("--text-tasks", type=_positive_int, default=None, help="second-round instructions (400)")
    parser.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (1200)")
    parser.add_argument("--draft-vocab", type=_positive_int, default=None, help="tokens the draft proposes (8192)")
    parser.add_argument("--seed", type=int, default=None, help="seed of everything (0)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (1e-3; lower to fine-tune)")
    parser.add_argument(
        "--unroll", type=_positive_int, default=None, help="passes per batch reading the draft's own guesses (3)"
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="DRAFT_OR_CHECKPOINT",
        help="start training from this draft (a directory or catalog name, e.g. the shipped one) or checkpoint.pt "
        "of an earlier run: its weights and vocabulary, in a new schedule of --steps (an interrupted run in --work "
        "resumes by itself)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where the target answers and the draft trains: cpu (default), cuda, cuda:N"
    )
    parser.set_defaults(func=_cmd_train_draft)


def _cmd_train_draft(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    import logging

    import torch

    from app import store
    from app.distill.recipe import Recipe, train_draft
    from app.engine.drafting.eagle import is_eagle_dir
    from app.engine.factory import DEFAULT_TARGET

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise CliError(f"--device {args.device!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {args.device}: torch sees no CUDA device here (torch {torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device {args.device}: choose cpu, cuda or cuda:N")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    name = args.name or out.name
    work = Path(args.work) if args.work else store.cache_dir() / "train-draft" / name
    changes = {
        field: value
        for field, value in (
            ("first_round", args.instructions),
            ("second_round", args.text_tasks),
            ("steps", args.steps),
            ("draft_vocab", args.draft_vocab),
            ("seed", args.seed),
            ("unroll", args.unroll),
            ("lr", args.lr),
        )
        if value is not None
    }
    recipe = dataclasses.replace(Recipe(), **changes)
    resume = None
    if args.resume:
        resume = Path(args.resume)
        if not resume.exists():
            try:
                resume = store.resolve(args.resume)
            except store.ModelStoreError as exc:
                raise CliError(f"--resume {args.resume}: no such file, directory or catalog draft") from exc
        if not (resume.is_file() or is_eagle_dir(resume)):
            raise CliError(f"--resume {args.resume}: neither a checkpoint file nor a feature draft's directory")
    data_dir = Path(args.corpus) if args.corpus else None
    card = train_draft(args.target or DEFAULT_TARGET, out, work, recipe, name, args.device, resume, data_dir)
    print(json.dumps(card["held_out_measurement"], indent=2))
    print(f"draft written to {out} (card: {out / 'card.json'})")
    return 0


# --- specserve loadtest -----------------------------------------------------------------------------------


def _add_loadtest_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "loadtest",
        help="N concurrent streaming clients against a running server: throughput, TTFT, ITL, errors",
        description="For each draft (speculation on and off) and each client count, send streamed greedy requests "
        "and report tokens/s, time to first token and inter-token latency (p50/p95/p99), errors by kind and 429s; "
        "every response is checked for completeness and against the text its prompt got alone. --workload "
        "multiturn adds TTFT per turn and the prompts' growth; --workload mixed reports short requests beside long "
        "prompts apart. Every level reports the server's prefix-cache hit rate where its /metrics has one.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--input",
        default=str(BENCH_PROMPTS),
        help="Spec-Bench-format JSONL (default: the package's 13 prompts, one per Spec-Bench category, as bench's)",
    )
    parser.add_argument("--prompts", type=_positive_int, default=16, help="distinct prompts (first turns) to send")
    parser.add_argument(
        "--clients",
        default=None,
        help="comma-separated concurrency levels (default: 1,2,4,8,16; 1 with --rates); multiturn: users (4)",
    )
    parser.add_argument(
        "--rates",
        default=None,
        help="comma-separated request rates per second: open-loop levels, Poisson arrivals (after the client levels)",
    )
    parser.add_argument("--requests", type=_positive_int, default=16, help="requests per level (at least the clients)")
    parser.add_argument(
        "--draft", action="append", default=None, help="speculative.draft values (default: default, none)"
    )
    parser.add_argument("--max-new-tokens", "-n", type=_positive_int, default=128)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per level before clients stop")
    parser.add_argument("--api", choices=["chat", "tgi"], default="chat", help="chat: OpenAI chat API (chat template)")
    parser.add_argument("--api-key", default=None, help="bearer key, if the server requires one")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="also run the one-client requests straight on an engine in this process (the server's models and "
        "settings, read from /info), to measure what HTTP and streaming cost",
    )
    parser.add_argument(
        "--workload",
        choices=["prompts", "multiturn", "mixed"],
        default="prompts",
        help="prompts: independent one-turn prompts from --input (closed loop, or --rates); multiturn: --clients "
        "users, each a conversation of --turns turns with a shared system prompt (chat API); mixed: --long-prompts "
        "prompts near the server's max input, and short requests sent one after another beside them",
    )
    parser.add_argument("--turns", type=_positive_int, default=10, help="multiturn: turns per conversation (10)")
    parser.add_argument("--seed", type=int, default=0, help="multiturn and mixed: the texts' seed; --rates: arrivals")
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="prompts workload: skip sending each prompt once before the levels (the warm-up fills the server's "
        "prefix cache, so that no level, the first one included, pays cold prefills that the others do not)",
    )
    parser.add_argument("--long-prompts", type=_positive_int, default=4, help="mixed: long prompts sent at once (4)")
    parser.add_argument(
        "--long-tokens",
        type=_positive_int,
        default=None,
        help="mixed: tokens per long prompt (default: the most /info's max_input_tokens and context allow)",
    )
    parser.add_argument("--short-requests", type=_positive_int, default=4, help="mixed: short requests, in turn (4)")
    parser.add_argument(
        "--short-tokens", type=_positive_int, default=4, help="mixed: max new tokens of a short one (4)"
    )
    parser.add_argument(
        "--short-delay",
        type=float,
        default=1.5,
        help="mixed: seconds after the long prompts before the first short (1.5)",
    )
    parser.add_argument("--out", default="bench_out", help="directory for loadtest.json and loadtest.md")
    parser.set_defaults(func=_cmd_loadtest)


def _loadtest_engine(url: str, headers: dict[str, str]):
    """An engine with the models and draft settings the server at `url` reports in /info."""
    import httpx

    from app.engine.factory import build_engine

    try:
        info = httpx.get(f"{url}/info", headers=headers, timeout=10).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CliError(f"no /info at {url}: {exc}") from exc
    dtype = str(info["model_dtype"]).removeprefix("torch.")
    engine, _ = build_engine(
        info["model_id"],
        info["draft"],
        info["num_draft_tokens"],
        dtype,
        draft_schedule=info["draft_schedule"],
        draft_p_min=info["draft_p_min"],
    )
    return engine


def _cmd_loadtest(args: argparse.Namespace) -> int:
    import json

    import httpx

    from app.bench import loadtest

    try:
        rates = [float(x) for x in args.rates.split(",") if x.strip()] if args.rates else []
    except ValueError as exc:
        raise CliError("--rates takes comma-separated numbers, e.g. 0.5,1,2") from exc
    if args.rates is not None and (not rates or min(rates) <= 0):
        raise CliError("--rates needs at least one rate > 0")
    if args.workload != "prompts" and (args.rates is not None or args.in_process):
        raise CliError(f"--rates and --in-process are for --workload prompts, not {args.workload}")
    if args.workload == "multiturn" and args.api != "chat":
        raise CliError("--workload multiturn sends conversations: it needs --api chat")
    if args.workload == "mixed" and args.clients is not None:
        raise CliError("--workload mixed sends --long-prompts at once and --short-requests in turn: no --clients")
    default_clients = {"prompts": "1" if rates else "1,2,4,8,16", "multiturn": "4", "mixed": "1"}[args.workload]
    clients = args.clients if args.clients is not None else default_clients
    try:
        levels = [int(x) for x in clients.split(",") if x.strip()]
    except ValueError as exc:
        raise CliError("--clients takes comma-separated integers, e.g. 1,2,4,8") from exc
    if not levels or min(levels) < 1:
        raise CliError("--clients needs at least one level >= 1")
    headers = loadtest.auth_headers(args.api_key)
    try:
        model = httpx.get(f"{args.url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise CliError(f"no specserve answering at {args.url}: {exc}") from exc
    if args.workload == "multiturn":
        rows = _loadtest_multiturn(args, levels, model, headers)
        table = loadtest.markdown_multiturn(rows)
    elif args.workload == "mixed":
        rows = _loadtest_mixed(args, model, headers)
        table = loadtest.markdown_mixed(rows)
    else:
        rows = _loadtest_prompts(args, levels, rates, model, headers)
        table = loadtest.markdown(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest.json").write_text(json.dumps(rows, indent=1))
    (out / "loadtest.md").write_text(table + "\n")
    print(table)
    return 0


def _measured(args: argparse.Namespace, headers: dict[str, str], level: Coroutine[Any, Any, Any]) -> tuple[Any, dict]:
    """What the `level` run in a new event loop returns, and the server's prefix-cache hit rate over it (its
    /metrics before and after)."""
    import asyncio

    from app.bench import loadtest

    before = loadtest.read_metrics(args.url, headers)
    answer = asyncio.run(level)
    return answer, loadtest.prefix_cache_hit_rate(before, loadtest.read_metrics(args.url, headers))


def _loadtest_prompts(
    args: argparse.Namespace, levels: list[int], rates: list[float], model: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """The one-turn workload: every draft at every client count (closed loop), then every rate (open loop)."""
    import json

    from app.bench import loadtest
    from app.bench.specbench import read_prompts

    path = Path(args.input)
    if not path.is_file():
        raise CliError(f"no prompts at {path}; give --input FILE.jsonl")
    prompts = [p.text for p in read_prompts(path, None, None)][: args.prompts]
    engine = _loadtest_engine(args.url, headers) if args.in_process else None
    rows: list[dict[str, Any]] = []
    # Greedy text is the target's own whatever the draft: the first level's answers are every level's reference.
    reference: dict[int, str] | None = None
    drafts = args.draft or ["default", "none"]

    def options_for(draft: str) -> dict[str, Any]:
        options = {"max_new_tokens": args.max_new_tokens, "speculative": {"draft": draft}, "model": model}
        if args.api == "tgi":
            options.pop("model")
        return options

    if args.warmup:
        level = loadtest.run_level(
            args.url, prompts, 1, len(prompts), options_for(drafts[0]), args.time_limit, args.api, args.api_key
        )
        (results, _), prefix = _measured(args, headers, level)
        reference = {r.prompt_index: r.text for r in results if r.ok}
        print(
            f"warm-up: {len(prompts)} prompts sent once, not reported (prefix cache "
            f"{loadtest.prefix_cache_summary(prefix)})",
            flush=True,
        )
    for draft in drafts:
        if engine is not None:  # the server is idle meanwhile: nothing else competes for the cores
            results, wall = loadtest.run_in_process(
                engine, prompts, max(args.requests, 1), args.max_new_tokens, draft, args.api == "chat"
            )
            if reference is None:
                reference = {r.prompt_index: r.text for r in results}
            row = {"speculative": draft, "via": "in-process", "clients": 1}
            row.update(loadtest.summarize_level(results, wall, reference, True))
            rows.append(row)
            print(json.dumps(row), flush=True)
        options = options_for(draft)
        for clients in levels:
            (results, wall), prefix = _measured(
                args,
                headers,
                loadtest.run_level(
                    args.url,
                    prompts,
                    clients,
                    max(args.requests, clients),
                    options,
                    args.time_limit,
                    args.api,
                    args.api_key,
                ),
            )
            if reference is None:
                reference = {r.prompt_index: r.text for r in results if r.ok}
            row = {"speculative": draft, "via": "http", "clients": clients}
            row.update(loadtest.summarize_level(results, wall, reference, True))
            row["prefix_cache"] = prefix
            rows.append(row)
            print(json.dumps(row), flush=True)
        for rate in rates:
            (results, wall), prefix = _measured(
                args,
                headers,
                loadtest.run_rate(
                    args.url,
                    prompts,
                    rate,
                    args.requests,
                    options,
                    args.time_limit,
                    args.api,
                    args.api_key,
                    None,
                    args.seed,
                ),
            )
            row = {"speculative": draft, "via": "http", "clients": None, "rate": rate}
            row.update(loadtest.summarize_level(results, wall, reference, True))
            row["prefix_cache"] = prefix
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _loadtest_multiturn(
    args: argparse.Namespace, levels: list[int], model: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """The multi-turn workload: every draft at every user count, one conversation of --turns turns per user."""

    from app.bench import loadtest

    rows: list[dict[str, Any]] = []
    for draft in args.draft or ["default", "none"]:
        options = {"max_new_tokens": args.max_new_tokens, "speculative": {"draft": draft}, "model": model}
        for users in levels:
            (results, wall), prefix = _measured(
                args,
                headers,
                loadtest.run_conversations(
                    args.url, users, args.turns, options, args.time_limit, args.api_key, seed=args.seed
                ),
            )
            # Conversations differ in every answer: no text to compare with a request sent alone.
            row: dict[str, Any] = {"speculative": draft, "via": "http", "workload": "multiturn", "clients": users}
            row.update(loadtest.summarize_level(results, wall, None, True))
            row["multiturn"] = loadtest.summarize_turns(results, args.turns)
            row["prefix_cache"] = prefix
            rows.append(row)
            m = row["multiturn"]
            print(
                f"{draft}, {users} users: TTFT p50 turn 1 {m['per_turn'][0]['ttft_p50_ms'] if m['per_turn'] else '-'} "
                f"ms, last turn x{m['ttft_last_over_first']}, prompts grew {m['prompts_grew']}, "
                f"prefix cache {loadtest.prefix_cache_summary(prefix)}, answers {m['answers_sha256']}",
                flush=True,
            )
    return rows


def _loadtest_mixed(args: argparse.Namespace, model: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """The mixed workload: for every draft, --long-prompts near-max-length prompts at once and the short
    requests one after another beside them."""
    import json

    import httpx

    from app.bench import loadtest
    from app.bench.workloads import SHORT_PROMPTS, long_prompt

    target = args.long_tokens
    if target is None:
        try:
            info = httpx.get(f"{args.url}/info", headers=headers, timeout=10).json()
            # The prompt leaves room for the answer; a few tokens spare, as the count may differ by a token or two.
            target = min(info["max_input_tokens"], info["max_total_tokens"] - args.max_new_tokens) - 8
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise CliError(f"no limits in {args.url}/info ({exc}); give --long-tokens N") from exc
        if target < 1:
            raise CliError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a long prompt")
    count = loadtest.token_counter(args.url, headers, model if args.api == "chat" else None, args.api)
    longs = [long_prompt(i, target, count, args.seed) for i in range(args.long_prompts)]
    rows: list[dict[str, Any]] = []
    for draft in args.draft or ["default", "none"]:
        options = {"max_new_tokens": args.max_new_tokens, "speculative": {"draft": draft}, "model": model}
        if args.api == "tgi":
            options.pop("model")
        (results, wall), prefix = _measured(
            args,
            headers,
            loadtest.run_mixed(
                args.url,
                longs,
                SHORT_PROMPTS,
                args.short_requests,
                options,
                args.short_tokens,
                args.short_delay,
                args.time_limit,
                args.api,
                args.api_key,
            ),
        )
        row: dict[str, Any] = {"speculative": draft, "via": "http", "workload": "mixed"}
        row["clients"] = args.long_prompts + 1
        row.update(loadtest.summarize_level(results, wall, None, True))
        row["mixed"] = loadtest.summarize_mixed(results)
        row["mixed"]["long"]["target_tokens"] = target
        row["prefix_cache"] = prefix
        rows.append(row)
        print(json.dumps(row["mixed"]), flush=True)
    return rows


# --- entry point --------------------------------------------------------------------------------------------


def _build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="Speculative-decoding text generation: a cheap draft proposes, the target verifies.",
    )
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_models_parser(subparsers)
    _add_generate_parser(subparsers, serve_flags)
    _add_bench_parser(subparsers, serve_flags)
    _add_serve_parser(subparsers, serve_flags)
    _add_train_draft_parser(subparsers)
    _add_loadtest_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``specserve`` command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The flags read from the settings (pydantic-settings, a quarter of a second to import) are built only for the
    # commands that take them, so that `specserve models ...` stays fast.
    args = _build_parser(serve_flags=bool({"serve", "generate", "bench"} & set(argv))).parse_args(argv)
    try:
        return int(args.func(args))
    except (ModelStoreError, CliError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130

