"""``make figures`` wall time: cold (empty cache) and warm (everything cached), per figure.

    python benchmarks/bench_figures.py [--small] [--jobs N] [NAME ...]

Runs ``python -m simkit figures`` as a fresh process (start-up included), into a temporary
output directory with a temporary cache: once cold, then warm (nothing changed: every figure
comes from the cache). Reports both wall times, each figure's compute and draw time (from the
cold run's log), and the sum of the per-figure times — what a serial run would take — as the
baseline measured in the same run: ``speed-up = sum / cold wall``. Targets (issue 18), full
size on 2 cores: cold < 10 min, warm < 30 s. ``--small`` uses the reduced sizes (a quick check;
the targets apply to full size). Results go to ``benchmarks/results/bench_figures[_small].json``
(git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import report_target

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(
    r"\[\d+/\d+\] (?P<name>\S+) \.\.\. done \((?:computed in (?P<compute>[\d.]+) s, drawn in "
    r"(?P<draw>[\d.]+) s|cached data, drawn in (?P<redraw>[\d.]+) s|cached files)\)"
)


def run(names, out: Path, cache: Path, small: bool, jobs: int | None) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "simkit", "figures", *names, "--out", str(out)]
    cmd += ["--cache-dir", str(cache)] + (["--small"] if small else [])
    cmd += ["--jobs", str(jobs)] if jobs else []
    env = {**os.environ, "MPLBACKEND": "Agg", "SIMKIT_PROGRESS_SECONDS": "60"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"simkit figures failed:\n{proc.stderr[-4000:]}")
    return wall, proc.stderr


def per_figure(log: str) -> dict[str, dict]:
    out = {}
    for m in LINE.finditer(log):
        out[m["name"]] = {
            "compute_s": float(m["compute"] or 0.0),
            "draw_s": float(m["draw"] or m["redraw"] or 0.0),
            "cached": m["compute"] is None,
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="figures (default: all)")
    parser.add_argument("--small", action="store_true", help="reduced sizes (quick check)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes")
    args, _ = parser.parse_known_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        out, cache = Path(tmp) / "figures", Path(tmp) / "cache"
        cold, cold_log = run(args.names, out, cache, args.small, args.jobs)
        warm, warm_log = run(args.names, out, cache, args.small, args.jobs)
    figures = per_figure(cold_log)
    warm_figures = per_figure(warm_log)
    serial = sum(f["compute_s"] + f["draw_s"] for f in figures.values())
    result = {
        "small": args.small,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "jobs": args.jobs,
        "python": platform.python_version(),
        "cold_wall_s": round(cold, 2),
        "warm_wall_s": round(warm, 2),
        "warm_all_cached": all(f["cached"] for f in warm_figures.values()),
        "sum_of_figure_times_s": round(serial, 2),
        "parallel_speedup": round(serial / cold, 2) if cold else None,
        "cold_over_warm": round(cold / warm, 1) if warm else None,
        "targets": {"cold_s": 600, "warm_s": 30, "apply_to": "full size, 2 cores"},
        "figures": figures,
    }
    width = max(map(len, figures), default=10)
    for name, f in sorted(figures.items(), key=lambda kv: -kv[1]["compute_s"]):
        print(f"{name:<{width}}  compute {f['compute_s']:7.1f} s  draw {f['draw_s']:5.1f} s")
    print(
        f"cold {cold:.1f} s (sum of figure times {serial:.1f} s, speed-up "
        f"{result['parallel_speedup']}×), warm {warm:.1f} s ({result['cold_over_warm']}× faster)"
        + ("" if args.small else "; targets: cold < 600 s, warm < 30 s")
    )
    if not args.small:
        report_target("make figures cold (2 cores)", cold, 600, "s")
        report_target("make figures warm (2 cores)", warm, 30, "s")
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"bench_figures{'_small' if args.small else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
