"""specserve: speculative-decoding text generation."""

import os

__version__ = "0.1.0"

# OpenMP threads that wait at a barrier sleep rather than spin (libgomp spins for a while by default). Spinning
# pays on cores nobody else wants; beside other busy processes a spinning thread burns the time slice the
# thread it waits for needs, and each of a decoding step's ~150 parallel regions waits for the scheduler:
# a generation beside one busy process ran at 484 ms a token spinning, 34 ms sleeping (2-core EPYC, docs/deploy.md).
# libgomp reads this once, when it is loaded (by `import torch`): here, before any module of the package imports
# torch. An operator's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
