"""What the subcommands share: the user-facing error, the sampling flags, and the serve flags read from the
settings (which `generate` and `bench` take as serve spells them)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.engine.defaults import SAMPLERS

# `specserve bench`'s default prompts: 13 of the project's own, one per Spec-Bench category, shipped in the
# package so that the command runs from any checkout or install; Spec-Bench files come in with --input.
BENCH_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.jsonl"


class CliError(Exception):
    """A user-facing error of any subcommand; :func:`main` prints it as one line and exits 1."""


def human_size(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def add_sampling_arguments(parser: argparse.ArgumentParser, samplers: bool = False) -> None:
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


def sampling_kwargs(args: argparse.Namespace) -> dict:
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


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (a --limit of 0 or -1 would silently drop prompts)."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def describe_stats(stats: dict, prefix: str = "") -> str:
    return (
        f"{prefix}{stats['generated_tokens']} tokens in {stats['total_seconds']:.2f} s "
        f"({stats['tokens_per_second']:.1f} tok/s); {stats['target_passes']} target passes, "
        f"{stats['tokens_per_target_pass']:.2f} tokens per pass; drafted {stats['drafted']}, "
        f"accepted {stats['accepted']} (acceptance {stats['acceptance_rate']:.1%}); "
        f"accepted by position {stats['accepted_per_position']}"
    )


def serve_default(value: object) -> str | None:
    """A setting's default as the serve help shows it; None where the description says what unset means."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != "" else "empty"


def serve_flags() -> list[tuple[str, str, dict[str, Any]]]:
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
        default = serve_default(info.default)
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


# More spellings of a setting's flag, on every command that takes it: `--model` as vLLM's users type it.
FLAG_ALIASES: dict[str, list[str]] = {"target": ["--model"]}


def add_setting_flags(
    parser: argparse.ArgumentParser, fields: Sequence[str], aliases: dict[str, list[str]] | None = None
) -> None:
    """Flags for the settings `fields` as serve has them (`serve_flags`: name, help, type), for a command that
    runs the engine itself: with the settings' defaults as values (no environment to fall back on), checked
    by argparse where the setting lists its choices. `aliases`: more spellings of a flag (older ones)."""
    import typing

    from app.service.settings import Settings

    table = {field: (flag, kwargs) for flag, field, kwargs in serve_flags()}
    for field in fields:
        flag, kwargs = table[field]
        info = Settings.model_fields[field]
        default = info.default
        kwargs = {**kwargs, "default": default}
        annotation = info.annotation
        if typing.get_origin(annotation) is typing.Literal:
            kwargs.pop("metavar", None)
            kwargs["choices"] = list(typing.get_args(annotation))
        parser.add_argument(flag, *FLAG_ALIASES.get(field, []), *(aliases or {}).get(field, []), **kwargs)
