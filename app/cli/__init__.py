"""The ``specserve`` command line: one module per subcommand (models, generate, bench, serve, train-draft,
loadtest), each an ``add_parser(subparsers)`` that registers its arguments and sets ``func=run``, and a
``run(args) -> int`` that does the work. Heavy modules (torch, the engine, the server) are imported inside
``run`` so that ``specserve models ...`` stays fast. Errors meant for the user are raised as
:class:`~app.store.ModelStoreError` (or :class:`~app.cli.common.CliError`) and reported by :func:`main` as one
``error: ...`` line on stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app import __version__
from app.cli import bench, generate, loadtest, models, serve, train_draft
from app.cli.common import CliError
from app.store import ModelStoreError


def build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="Speculative-decoding text generation: a cheap draft proposes, the target verifies.",
    )
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    models.add_parser(subparsers)
    generate.add_parser(subparsers, serve_flags)
    bench.add_parser(subparsers, serve_flags)
    serve.add_parser(subparsers, serve_flags)
    train_draft.add_parser(subparsers)
    loadtest.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``specserve`` command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The flags read from the settings (pydantic-settings, a quarter of a second to import) are built only for the
    # commands that take them, so that `specserve models ...` stays fast.
    args = build_parser(serve_flags=bool({"serve", "generate", "bench"} & set(argv))).parse_args(argv)
    try:
        return int(args.func(args))
    except (ModelStoreError, CliError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
