"""`specserve models list|fetch`: the catalog and the model cache."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from app.cli.common import (
    human_size,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
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
    fetch.add_argument(
        "name", help="catalog name (smollm2-135m-instruct) or Hugging Face Hub id (owner/repo:QUANT, owner/repo)"
    )
    fetch.add_argument("--force", action="store_true", help="download again even if already present")
    fetch.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
                human_size(entry.size),
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
    return f"{kind}, {human_size(size)}"
