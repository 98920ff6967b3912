"""Run every ``benchmarks/bench_*.py`` script in turn (``make bench``).

Each script measures its own baseline in the same run and prints ratios against it; results are
written as JSON under ``benchmarks/results/`` (git-ignored). Extra arguments are passed through.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent
    scripts = sorted(here.glob("bench_*.py"))
    failures = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        rc = subprocess.call([sys.executable, str(script), *argv])
        if rc != 0:
            failures.append(script.name)
    if failures:
        print(f"\nfailed: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
