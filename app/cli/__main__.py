"""`python -m app.cli`: the `specserve` command."""

import sys

from app.cli import main

sys.exit(main())
