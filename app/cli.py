"""The ``specserve`` command line.

Each subcommand is one ``_add_<name>_parser(subparsers)`` that registers its arguments and sets
``func=_cmd_<name>``; ``_cmd_<name>(args) -> int`` does the work. Import heavy modules (torch, the engine,
the server) inside the ``_cmd_`` function so that ``specserve models ...`` stays fast. Errors meant for the
user are raised as :class:`~app.store.ModelStoreError` (or :class:`CliError`) and reported by :func:`main`
as one ``error: ...`` line on stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app import __version__
from app.store import ModelStoreError


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
        description="List the models of the catalog (model_store/catalog.json) and fetch them "
        "into the cache.",
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
    header = ("NAME", "ROLE", "FORMAT", "SIZE", "LICENSE", "FETCHED", "DESCRIPTION")
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
                entry.description,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    widths[-1] = 0  # the last column is not padded
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    return 0


# --- entry point --------------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="Speculative-decoding text generation: a cheap draft proposes, the target verifies.",
    )
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_models_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``specserve`` command line; returns the exit status."""
    args = _build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ModelStoreError, CliError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
