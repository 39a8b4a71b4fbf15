"""`specserve serve`: the settings from flags and environment, checked before the port opens, then the server."""

from __future__ import annotations

import argparse

from app.cli.common import (
    FLAG_ALIASES,
    CliError,
    serve_flags,
)


def add_parser(subparsers: argparse._SubParsersAction, flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the TGI- and OpenAI-compatible HTTP API",
        description="Serve generation over HTTP (TGI-compatible /generate, OpenAI-compatible /v1/...). Each flag "
        "can also be set by its SPECSERVE_* environment variable (--max-queue-size: SPECSERVE_MAX_QUEUE_SIZE); "
        "a flag wins over the environment.",
    )
    # `vllm serve MODEL`'s spelling: the target as the one positional argument.
    parser.add_argument(
        "model", nargs="?", default=None, metavar="MODEL", help="the target model, as --target (or --model) names it"
    )
    # The flags come from the settings (pydantic-settings, a quarter of a second to import): only built when the
    # command line names serve, so that `specserve models ...` stays fast.
    for flag, field, kwargs in serve_flags() if flags else ():
        parser.add_argument(flag, *FLAG_ALIASES.get(field, []), **kwargs)
    parser.set_defaults(func=run)


def overrides(args: argparse.Namespace) -> dict[str, object]:
    """The settings the command line gives (the rest come from SPECSERVE_* or the defaults): every flag given,
    and the positional MODEL as the target; raises CliError when MODEL and --target/--model disagree."""
    from app.service.settings import Settings

    given = {field: getattr(args, field) for field in Settings.model_fields if getattr(args, field) is not None}
    given.update({f: ",".join(v) for f, v in given.items() if isinstance(v, list)})
    if args.model is not None:
        if given.get("target", args.model) != args.model:
            raise CliError(f"two targets given: MODEL {args.model!r} and --target/--model {given['target']!r}")
        given["target"] = args.model
    return given


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from app import store
    from app.api.server import serve
    from app.service.logs import configure_logging
    from app.service.settings import Settings

    try:
        settings = Settings(**overrides(args))
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
