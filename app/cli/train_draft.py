"""`specserve train-draft`: distil a feature draft for a target (app/distill)."""

from __future__ import annotations

import argparse
from pathlib import Path

from app.cli.common import (
    CliError,
    positive_int,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-draft",
        help="distil a feature draft (EAGLE-style) for a target from the target's own answers",
        description="Generate a self-distillation corpus (the target answering the project's seed instructions), "
        "train a one-layer feature draft on the target's distributions, measure it on held-out instructions and "
        "write model.safetensors, config.json and card.json into --out. Every stage resumes from --work.",
    )
    parser.add_argument("--target", default=None, help="catalog name or path (default: smollm2-135m-instruct)")
    parser.add_argument(
        "--out",
        default=None,
        help="directory for the draft (model_store/drafts/NAME to ship it; default: where the catalog keeps the "
        "draft it names for --target to be trained on this machine, e.g. gemma-3-270m-q4_k_m-eagle)",
    )
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
    parser.add_argument("--instructions", type=positive_int, default=None, help="first-round instructions (3200)")
    parser.add_argument("--text-tasks", type=positive_int, default=None, help="second-round instructions (400)")
    parser.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (1200)")
    parser.add_argument("--draft-vocab", type=positive_int, default=None, help="tokens the draft proposes (8192)")
    parser.add_argument("--seed", type=int, default=None, help="seed of everything (0)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (1e-3; lower to fine-tune)")
    parser.add_argument(
        "--unroll", type=positive_int, default=None, help="passes per batch reading the draft's own guesses (3)"
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
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
    target = args.target or DEFAULT_TARGET
    if args.out:
        out = Path(args.out)
    else:
        trained = [e for e in store.catalog().values() if e.source == "trained" and e.draft_for == target]
        if not trained:
            raise CliError(f"--out is needed: the catalog names no draft of {target!r} to be trained here")
        out = trained[0].local_path()
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
    card = train_draft(target, out, work, recipe, name, args.device, resume, data_dir)
    print(json.dumps(card["held_out_measurement"], indent=2))
    print(f"draft written to {out} (card: {out / 'card.json'})")
    return 0
