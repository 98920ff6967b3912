"""Cost of ``simkit.experiment.run`` on the bandit, per mapping, exact and Monte Carlo.

    python benchmarks/bench_experiment.py [--K 10 --n 64 --reps 2000 --repeats 3 --only a,b]

Setting: a K-armed Bernoulli bandit with random logits and behaviour μ ~ Dirichlet(5) (χ²
printed), batches of n samples, ``reps`` Monte Carlo repetitions. Baseline measured in the same
run: the floor of any Monte Carlo row, i.e. drawing the reps×n batch and accumulating one
gradient per rep (``env.sample`` + ``env.accumulate``). For each mapping, a whole ``run`` with one
estimator (best of ``--repeats``): the exact path (per-sample mappings), the Monte Carlo path
(``exact=False``) and Monte Carlo with GRPO advantages (G = 8), in seconds and as a ratio to the
floor. Mappings that fail are listed with their error. Results are printed and written as JSON to
``benchmarks/results/bench_experiment.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from simkit import mappings
from simkit.envs import Bandit
from simkit.estimators import Estimator
from simkit.experiment import run


def best_time(fn, repeats: int) -> float | str:
    """Best of ``repeats`` timings of ``fn()``, or the error message if it raises."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            fn()
        except ValueError as err:
            return f"error: {err}"
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--K", type=int, default=10, help="arms (default 10)")
    parser.add_argument("--n", type=int, default=64, help="batch size n (default 64)")
    parser.add_argument("--reps", type=int, default=2000, help="Monte Carlo reps (2000)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per cell (best of)")
    parser.add_argument("--only", default="", help="comma-separated mapping names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_experiment.json")
    )
    args, _ = parser.parse_known_args(argv)  # run_all.py passes every script the same args

    rng = np.random.default_rng(args.seed)
    env = Bandit(rng.normal(size=args.K), rng.random(args.K))
    mu = rng.dirichlet(np.full(args.K, 5.0))
    names = [s for s in args.only.split(",") if s] or mappings.available()
    common = {"n": args.n, "reps": args.reps, "progress": False}

    def floor_fn():
        batch = env.sample(mu, args.n, np.random.default_rng(0), reps=args.reps)
        env.accumulate(batch.actions, np.ones(batch.actions.shape))

    run(env, mu, ["naive", "snis"], exact=False, n=args.n, reps=10)  # warm-up: lazy imports
    floor = best_time(floor_fn, args.repeats)
    print(
        f"bandit K={args.K}, n={args.n}, reps={args.reps} "
        f"(chi2 = {env.divergences(mu)['chi2_tok']:.3f}), best of {args.repeats}"
    )
    print(f"floor (sample + accumulate): {floor * 1e3:.1f} ms")
    print(
        f"{'mapping':<12} {'exact s':>9} {'x floor':>8} {'MC s':>9} {'x floor':>8} "
        f"{'GRPO s':>9} {'x floor':>8}"
    )
    rows, errors = [], []
    for name in names:
        cells = {
            "exact": best_time(
                lambda name=name: run(env, mu, [name], exact=True, **common), args.repeats
            )
            if not mappings.mapping_class(name).batch_dependent
            else None,
            "monte_carlo": best_time(
                lambda name=name: run(env, mu, [name], exact=False, **common), args.repeats
            ),
            "monte_carlo_grpo": best_time(
                lambda name=name: run(
                    env, mu, [Estimator(name, advantage="grpo", group_size=8)], **common
                ),
                args.repeats,
            ),
        }
        line = f"{name:<12}"
        for key, value in cells.items():
            if isinstance(value, float):
                line += f" {value:9.3f} {value / floor:8.1f}"
            else:
                line += f" {'—':>9} {'':>8}"
                if isinstance(value, str):
                    errors.append(f"{name} ({key}): {value}")
        print(line)
        rows.append(
            {
                "mapping": name,
                **{k: (v if isinstance(v, float) else None) for k, v in cells.items()},
            }
        )
    for line in errors:
        print(line)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_experiment",
                "K": args.K,
                "n": args.n,
                "reps": args.reps,
                "repeats": args.repeats,
                "numpy": np.__version__,
                "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(),
                "floor_seconds": floor,
                "results": rows,
                "errors": errors,
            },
            indent=2,
        )
    )
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
