"""Timing shared by the benchmark scripts (imported as ``timing`` when a script runs from
``benchmarks/``, which Python puts first on ``sys.path``)."""

from __future__ import annotations

import time


def best_time(fn, repeats: int, clock=time.perf_counter) -> float:
    """The smallest wall-clock time of ``repeats`` calls of ``fn()`` (seconds, perf_counter):
    the best of several runs, the usual estimate least disturbed by other load. ``clock``:
    another timer, e.g. ``time.thread_time`` (the calling thread's CPU time)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def interleaved_best(fn, baseline, repeats: int, clock=time.perf_counter) -> tuple[float, float]:
    """(best time of ``fn()``, best time of ``baseline()``) over ``repeats`` rounds that each
    time the baseline and then ``fn`` (seconds): both see the same load, so their ratio is
    less disturbed by other jobs than that of two separate best-ofs."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times, base = [], []
    for _ in range(repeats):
        start = clock()
        baseline()
        base.append(clock() - start)
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times), min(base)


#: prefix of the lines that state a target and whether it is met (``run_all.py`` collects them)
TARGET_PREFIX = "[target]"


def report_target(what: str, value: float, limit: float, unit: str = "x", above: bool = False):
    """Print one line ``[target] what: value unit (target <= limit unit) PASS|FAIL`` (``above``:
    the target is ``>= limit``) and return whether it is met. ``run_all.py`` (``make bench``)
    repeats every such line in its summary."""
    ok = value >= limit if above else value <= limit
    sign = ">=" if above else "<="
    print(
        f"{TARGET_PREFIX} {what}: {value:.3g} {unit} (target {sign} {limit:g} {unit}) "
        f"{'PASS' if ok else 'FAIL'}",
        flush=True,
    )
    return ok
