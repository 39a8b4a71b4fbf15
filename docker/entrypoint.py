"""Container entry point: fetch the models the server will load into the cache, then become `specserve serve`.

The arguments are `specserve serve` flags. The target and the draft are read as the server reads them: the
flag, else SPECSERVE_TARGET / SPECSERVE_DRAFT, else the defaults (the draft `default` is whatever the
server's default draft is). A catalog model already in the cache volume is only verified, so a restart
downloads nothing; a model given by path, `ngram` and `none` need nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

NOT_MODELS = ("none", "ngram")


def models_to_fetch(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The catalog names among the target and the draft `specserve serve argv` will load."""
    from app import store
    from app.service.settings import Settings

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    flags, _ = parser.parse_known_args(list(argv))
    target = flags.target or environ.get("SPECSERVE_TARGET") or Settings.model_fields["target"].default
    draft = flags.draft or environ.get("SPECSERVE_DRAFT") or Settings.model_fields["draft"].default
    if draft == "default":
        from app.engine.factory import DEFAULT_DRAFT

        draft = DEFAULT_DRAFT
    known = store.catalog()
    names = []
    for name in (target, draft):
        if name in NOT_MODELS or Path(name).expanduser().exists() or name not in known or name in names:
            continue  # not a catalog model: the server loads it as it is (or says what is wrong)
        names.append(name)
    return names


def main(argv: Sequence[str]) -> int:
    from app import store

    try:
        for name in models_to_fetch(argv, os.environ):
            store.fetch(name)  # prints "already fetched and verified" when the cache has it
    except store.ModelStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    os.execvp("specserve", ["specserve", "serve", *argv])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
