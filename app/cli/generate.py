"""`specserve generate`: one prompt (or a Spec-Bench file) through the engine, with what the draft bought."""

from __future__ import annotations

import argparse

from app.cli.common import (
    CliError,
    add_sampling_arguments,
    add_setting_flags,
    describe_stats,
    positive_int,
    sampling_kwargs,
)


def add_parser(subparsers: argparse._SubParsersAction, flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding and report what the draft bought",
        description="Generate from a prompt (or each line of a Spec-Bench-format JSONL file) with the target "
        "model, drafting with --draft, and print the text and the speculative figures.",
    )
    parser.add_argument("prompt", nargs="?", help="the user message (or raw prompt with --no-chat)")
    parser.add_argument("--input", metavar="FILE.jsonl", help="Spec-Bench-format lines; the first turn is used")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N prompts of --input")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    # The engine's flags as serve spells them, with its help and defaults (app.service.settings, one table).
    if flags:
        add_setting_flags(
            parser,
            [
                "target",
                "draft",
                "num_draft_tokens",
                "draft_schedule",
                "draft_p_min",
                "dtype",
                "weights",
                "draft_weights",
                "device",
            ],
            {"num_draft_tokens": ["-k"], "draft_schedule": ["--schedule"], "draft_p_min": ["--p-min"]},
        )
    parser.add_argument("--max-new-tokens", "-n", type=int, default=128)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--compare", action="store_true", help="also run target-only and print the speedup")
    add_sampling_arguments(parser)
    parser.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from app.engine.drafting.base import DraftError
    from app.engine.factory import DEFAULT_TARGET, build_engine
    from app.engine.model.tokenizer import TokenizerError
    from app.engine.model.weights import WeightsError
    from app.engine.step import GenerationError, GenerationParams

    sampling = sampling_kwargs(args)
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
            draft_weights=args.draft_weights,
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
        if not args.no_chat and tok.chat_template is None:
            # A base model (Gemma 3 270M's GGUF): the user asked for a chat turn, which it cannot render.
            name = args.target or DEFAULT_TARGET
            raise CliError(f"{name} has no chat template (a base model): pass --no-chat to send the prompt as is")
        for prompt in prompts:
            # A chat turn as the server encodes one: special tokens' strings in the prompt stay text.
            chat = [{"role": "user", "content": prompt}]
            prompt_ids = tok.encode(prompt) if args.no_chat else tok.encode_chat(chat)
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
            print(describe_stats(stats))
            if args.compare:
                print(describe_stats(result["baseline"]["stats"], "target only: "))
                if result["identical_to_target_only"] is None:
                    print(f"speedup over target only: {result['speedup']:.2f}x")
                else:
                    same = "identical" if result["identical_to_target_only"] else "DIFFERENT"
                    print(f"speedup over target only: {result['speedup']:.2f}x (outputs {same})")
    except (GenerationError, DraftError, WeightsError, TokenizerError) as exc:
        raise CliError(str(exc)) from exc
    return 0
