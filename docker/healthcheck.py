"""Container health check: exit 0 when the server's /health answers 200 (models loaded), else 1.

Python's standard library only: the slim image has no curl. The port is the server's, SPECSERVE_PORT.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('SPECSERVE_PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
