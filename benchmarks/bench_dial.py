"""Cost of ``shifts.dial`` and ``shifts.dial_pair``, in units of one divergence evaluation.

    python benchmarks/bench_dial.py [--v 10,1000,32000 --rows 64 --repeats 3]

For each vocabulary size V: π = softmax of N(0, 2²) logits (seeded). Baseline measured in the
same run: one ``apply`` + one divergence evaluation (what each root-finding step costs). For
each (family, divergence): the best of ``--repeats`` timings of one ``dial`` call on one row, and
the ratio to the baseline (the number of evaluation-equivalents the solve costs). Then a batch
of ``--rows`` rows (the token-MDP use, dialed state by state) and ``dial_pair``. Results are
printed and written as JSON to ``benchmarks/results/bench_dial.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
from timing import best_time

from simkit import divergence, shifts

CASES = [
    ("temperature", "chi2", 0.5),
    ("temperature", "kl", 0.1),
    ("temperature", "tv", 0.1),
    ("logit_noise", "chi2", 0.5),
    ("mixture", "kl", 0.05),
    ("tail", "chi2", 0.5),
    ("tilt", "kl", 0.1),
    ("top_p", "tv", 0.1),
    ("top_k", "tv", 0.1),
]


def softmax(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--v", default="10,1000,32000", help="vocabulary sizes, comma-separated")
    parser.add_argument("--rows", type=int, default=64, help="rows of the batched dial (64)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per case (best of)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_dial.json")
    )
    args, _ = parser.parse_known_args(argv)  # run_all.py passes every script the same flags
    rng = np.random.default_rng(args.seed)
    records = []
    print(f"{'V':>6} {'case':<28} {'seconds':>10} {'× baseline':>11}")
    for V in (int(v) for v in args.v.split(",")):
        pi = softmax(rng.normal(0.0, 2.0, size=V))
        fam = shifts.get("temperature")
        baseline = best_time(
            lambda pi=pi, fam=fam: divergence.kl(pi, fam.apply(pi, 0.3)), max(args.repeats, 20)
        )
        print(f"{V:>6} {'baseline: apply + kl':<28} {baseline:>10.2e} {1.0:>11.1f}")
        for family, div, target in CASES:
            seconds = best_time(
                lambda pi=pi, family=family, div=div, target=target: shifts.dial(
                    pi, target, div, family
                ),
                args.repeats,
            )
            label = f"dial {family}/{div}"
            print(f"{V:>6} {label:<28} {seconds:>10.2e} {seconds / baseline:>11.1f}")
            records.append({"V": V, "case": label, "seconds": seconds, "ratio": seconds / baseline})
        pis = softmax(rng.normal(0.0, 2.0, size=(args.rows, V)))
        seconds = best_time(lambda pis=pis: shifts.dial(pis, 0.1, "kl", "temperature"), 1)
        label = f"dial {args.rows} rows, per row"
        per_row = seconds / args.rows
        print(f"{V:>6} {label:<28} {per_row:>10.2e} {per_row / baseline:>11.1f}")
        records.append({"V": V, "case": label, "seconds": per_row, "ratio": per_row / baseline})
        seconds = best_time(lambda pi=pi: shifts.dial_pair(pi, kl=0.05, chi2=0.3), 1)
        print(
            f"{V:>6} {'dial_pair kl=0.05 chi2=0.3':<28} {seconds:>10.2e} "
            f"{seconds / baseline:>11.1f}"
        )
        records.append(
            {"V": V, "case": "dial_pair", "seconds": seconds, "ratio": seconds / baseline}
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "python": platform.python_version(),
                "numpy": np.__version__,
                "records": records,
            },
            indent=2,
        )
    )
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
