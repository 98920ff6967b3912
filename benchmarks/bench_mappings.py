"""Throughput of ``coefficients`` for every registered weight mapping.

    python benchmarks/bench_mappings.py [--n 4096 --t 4096 --repeats 5 --ragged --only a,b]

Input: N×T float64 log-ratios ~ N(0, 0.05²) (a realistic train/inference mismatch scale), a
mask of all ones (``--ragged``: each row keeps a random prefix of length in [T/2, T]) and
advantages ±1. Baseline measured in the same run: the streaming floor ``np.exp(x).sum()`` over
the same array, timed in rounds interleaved with each mapping's (floor, mapping, floor,
mapping, ...), so that both see the same load. For each mapping: the best of ``--repeats``
timings, tokens/s and the ratio to the best floor of its own rounds. Targets: token- and
sequence-level mappings within 4× of the floor; batch-level ones (``snis``, ``psis``,
``m2po``, ``clip_cov``, ``kl_cov``, issue 28) within 3×; ``kl_rs`` and the :data:`VARIANTS`
— kl_rs criteria and the batch-normalised TIS — within 2×. Every row prints its target and
whether it is met (and a ``[target]`` line for ``make bench``'s summary). Results are written as
JSON to ``benchmarks/results/bench_mappings.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
from timing import best_time, interleaved_best, report_target

from simkit import mappings

TARGET_RATIO = 4.0
#: batch-level mappings (issue 28)
BATCH_RATIO = 3.0
#: tighter target for divergence rejection and batch-normalised truncation (issue 15)
TIGHT_RATIO = 2.0
#: (name, hyperparameters) measured besides the defaults, all held to TIGHT_RATIO
VARIANTS = [
    ("kl_rs", {"criteria": "token_k2", "u": 0.01}),
    ("kl_rs", {"criteria": "token_k3", "u": 0.01}),
    ("kl_rs", {"criteria": "seq_sum_k3", "u": 0.5}),
    ("kl_rs", {"criteria": "seq_max_k2", "u": 0.01}),
    ("kl_rs", {"criteria": ("token_k3", "seq_mean_k2"), "u": 0.01}),
    ("tis_token", {"batch_normalize": True}),
    ("tis_seq", {"batch_normalize": True}),
]
TIGHT = {"kl_rs"}


def make_batch(n: int, t: int, ragged: bool, seed: int):
    rng = np.random.default_rng(seed)
    log_ratio = rng.normal(0.0, 0.05, size=(n, t))
    if ragged:
        lengths = rng.integers(t // 2, t + 1, size=n)
        mask = np.arange(t)[None, :] < lengths[:, None]
    else:
        mask = np.ones((n, t), dtype=bool)
    advantages = rng.choice([-1.0, 1.0], size=n)
    return log_ratio, mask, advantages


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="sequences N (default 4096)")
    parser.add_argument("--t", type=int, default=4096, help="tokens per sequence T (4096)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per mapping (best of)")
    parser.add_argument("--ragged", action="store_true", help="ragged mask instead of all ones")
    parser.add_argument("--only", default="", help="comma-separated mapping names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_mappings.json")
    )
    args = parser.parse_args(argv)

    log_ratio, mask, advantages = make_batch(args.n, args.t, args.ragged, args.seed)
    tokens = log_ratio.size
    names = [s for s in args.only.split(",") if s] or mappings.available()
    cases = [(name, {}) for name in names] + [(n, hp) for n, hp in VARIANTS if n in names]

    def floor_fn():
        return np.exp(log_ratio).sum()

    print(
        f"N={args.n} T={args.t} ({tokens / 1e6:.1f}M tokens, float64), mask "
        f"{'ragged' if args.ragged else 'all ones'}, best of {args.repeats} rounds "
        "interleaved with the floor np.exp(x).sum()"
    )
    print(f"{'mapping':<44} {'level':<9} {'ms':>7} {'floor ms':>8} {'x floor':>8} target  ok")
    rows = []
    failures = []
    floors = []
    for name, hp in cases:
        mapping = mappings.get(name, **hp)
        seconds, floor = interleaved_best(
            lambda m=mapping: m.coefficients(log_ratio, mask, advantages), floor_fn, args.repeats
        )
        floors.append(floor)
        ratio = seconds / floor
        tight = name in TIGHT or bool(hp)
        target = TIGHT_RATIO if tight else TARGET_RATIO
        if mapping.level == "batch" and not tight:
            target = BATCH_RATIO
        ok = ratio <= target
        name = mapping.label
        if not ok:
            failures.append(name)
        print(
            f"{name:<44} {mapping.level:<9} {seconds * 1e3:7.1f} {floor * 1e3:8.1f} "
            f"{ratio:8.2f} {target:5.1f}x  {'yes' if ok else 'NO'}"
        )
        rows.append(
            {
                "mapping": name,
                "level": mapping.level,
                "seconds": seconds,
                "floor_seconds": floor,
                "tokens_per_second": tokens / seconds,
                "ratio_to_floor": ratio,
                "target_ratio": target,
                "within_target": ok,
            }
        )
    floor = min(floors) if floors else best_time(floor_fn, args.repeats)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_mappings",
                "n": args.n,
                "t": args.t,
                "ragged": args.ragged,
                "repeats": args.repeats,
                "numpy": np.__version__,
                "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(),
                "floor_seconds": floor,
                "floor_tokens_per_second": tokens / floor,
                "target_ratio": {
                    "token_sequence": TARGET_RATIO,
                    "batch": BATCH_RATIO,
                    "tight": TIGHT_RATIO,
                },
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"written {out}")
    for row in rows:
        report_target(f"{row['mapping']} / floor", row["ratio_to_floor"], row["target_ratio"])
    if failures:
        print(f"above their target: {', '.join(failures)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
