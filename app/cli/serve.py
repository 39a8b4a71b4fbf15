"""`specserve serve`: the settings from flags and environment, checked before the port opens, then the server."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from app.cli.common import (
    CliError,
    serve_flags,
)

if TYPE_CHECKING:
    pass


def add_parser(subparsers: argparse._SubParsersAction, flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the TGI- and OpenAI-compatible HTTP API",
        description="Serve generation over HTTP (TGI-compatible /generate, OpenAI-compatible /v1/...). Each flag "
        "can also be set by its SPECSERVE_* environment variable (--max-queue-size: SPECSERVE_MAX_QUEUE_SIZE); "
        "a flag wins over the environment.",
    )
    # The flags come from the settings (pydantic-settings, a quarter of a second to import): only built when the
    # command line names serve, so that `specserve models ...` stays fast.
    for flag, _, kwargs in serve_flags() if flags else ():
        parser.add_argument(flag, **kwargs)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
