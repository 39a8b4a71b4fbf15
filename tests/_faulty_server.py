"""`specserve` with a fault a test can inject into the worker's step: the same command line, run as
`python tests/_faulty_server.py serve ...`.

`Engine.step_batch` checks the file named by FAULTY_SERVER_TRIGGER before each step. When it exists, the step
removes it and raises: ``step`` raises a RuntimeError (a failure of the batch's shared part, which the worker
must survive), ``fatal`` raises an exception that is no Exception (one that ends the worker thread).
Nothing of this is in the server's own code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from app.cli import main
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.step import StepOutput

TRIGGER = Path(os.environ["FAULTY_SERVER_TRIGGER"])


class InjectedFatal(BaseException):
    """What ends the worker thread: past its `except Exception`."""


_step_batch = Engine.step_batch


def step_batch(self: Engine, gens: Sequence[Generation]) -> list[StepOutput | Exception]:
    try:
        fault = TRIGGER.read_text().strip()
    except FileNotFoundError:
        return _step_batch(self, gens)
    if not fault:
        # write_text truncates before it writes: an empty file is one the test is still writing.
        return _step_batch(self, gens)
    TRIGGER.unlink()
    if fault == "fatal":
        raise InjectedFatal("injected fatal fault")
    raise RuntimeError("injected step fault")


Engine.step_batch = step_batch  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
