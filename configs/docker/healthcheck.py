"""Docker HEALTHCHECK of the pdserve image: exit 0 when GET /health answers 200, else 1.

The port is the one the container serves on: $PDSERVE_HEALTH_PORT, default 8000 (the router
and `pdserve serve`; set it to a worker's --port for a worker container). Kubernetes ignores
HEALTHCHECK and uses the probes of configs/k8s/ instead. Standard library only.
"""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("PDSERVE_HEALTH_PORT", "8000")
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("PDSERVE_HEALTH_TIMEOUT", "4"))) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
