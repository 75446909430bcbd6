"""What every bench/ script shares: the command line and the JSON document."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any


def parser(doc: str | None, repeat: int = 5) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--providers", default="tcp;ofi_rxm,shm")
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--json", help="write results here as JSON")
    return ap


def emit(benchmark: str, results: list[dict[str, Any]], path: str | None) -> int:
    """Print the results document and, if asked, write it to ``path``."""
    doc = {"benchmark": benchmark, "machine": platform.platform(), "cpus": os.cpu_count(),
           "results": results}
    text = json.dumps(doc, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    return 0
