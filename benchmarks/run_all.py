"""Run every ``benchmarks/bench_*.py`` script in turn (``make bench``), then summarise.

Each script measures its own baseline in the same run and prints ratios against it; results are
written as JSON under ``benchmarks/results/`` (git-ignored). Extra arguments are passed through.
Every line a script prints with the prefix ``[target]`` (:func:`timing.report_target`: a
measured value, its target and PASS or FAIL) is repeated in a summary at the end, script by
script. Exit status 1 when a script fails or a target is missed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from timing import TARGET_PREFIX


def run(script: Path, argv: list[str]) -> tuple[int, list[str]]:
    """Run one script, echoing its output; (exit status, its ``[target]`` lines)."""
    proc = subprocess.Popen(
        [sys.executable, "-u", str(script), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    targets = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith(TARGET_PREFIX):
            targets.append(line.rstrip("\n")[len(TARGET_PREFIX) :].strip())
    return proc.wait(), targets


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent
    scripts = sorted(here.glob("bench_*.py"))
    failures, summary = [], []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        rc, targets = run(script, argv)
        if rc != 0:
            failures.append(script.name)
        summary.append((script.name, rc, targets))
    print("\n=== summary: every target ===")
    missed = 0
    for name, rc, targets in summary:
        print(f"{name}" + ("" if rc == 0 else f"  (exit status {rc})"))
        for line in targets:
            print(f"  {line}")
            missed += line.endswith("FAIL")
        if not targets:
            print("  (no target stated)")
    met = sum(len(t) for _, _, t in summary) - missed
    print(f"{met} targets met, {missed} missed")
    if failures:
        print(f"\nfailed: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures or missed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
