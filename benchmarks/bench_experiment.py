"""Benchmark of simkit.experiment.run on the bandit (plain script, no assertions).

    .venv/bin/python benchmarks/bench_experiment.py [--reps 2000] [--n 64] [--K 10]

Times, for every registered mapping, a whole ``run`` with one estimator: the exact path
(per-sample mappings), the Monte Carlo path (forced) and a group-advantage (GRPO) Monte Carlo
run. Mappings that fail are listed with their error.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from simkit import mappings
from simkit.envs import Bandit
from simkit.estimators import Estimator
from simkit.experiment import run


def _seconds(fn) -> float | str:
    start = time.perf_counter()
    try:
        fn()
    except ValueError as err:  # report and carry on with the other mappings
        return f"error: {err}"
    return time.perf_counter() - start


def _cell(value) -> str:
    return f"{value:10.3f}" if isinstance(value, float) else f"{'—':>10s}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--K", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    env = Bandit(rng.normal(size=args.K), rng.random(args.K))
    mu = rng.dirichlet(np.full(args.K, 5.0))
    print(f"bandit K={args.K}, n={args.n}, reps={args.reps} "
          f"(chi2 = {env.divergences(mu)['chi2_tok']:.3f}); seconds per estimator")
    run(env, mu, ["naive"], n=args.n, reps=10)  # warm-up: imports (arviz-stats ~1 s)
    print(f"{'mapping':<14s} {'exact':>10s} {'MC':>10s} {'MC grpo':>10s}")
    errors = []
    common = {"n": args.n, "reps": args.reps, "progress": False}
    for name in mappings.available():
        cells = [
            _seconds(lambda name=name: run(env, mu, [name], exact=True, **common))
            if not mappings.mapping_class(name).batch_dependent else None,
            _seconds(lambda name=name: run(env, mu, [name], exact=False, **common)),
            _seconds(lambda name=name: run(
                env, mu, [Estimator(name, advantage="grpo", group_size=8)], **common)),
        ]
        errors += [f"{name}: {c}" for c in cells if isinstance(c, str)]
        print(f"{name:<14s} " + " ".join(_cell(c) for c in cells))
    samples = args.reps * args.n
    print(f"({samples} drawn samples per run; each run also draws them and fits k̂)")
    for line in dict.fromkeys(errors):
        print(line)


if __name__ == "__main__":
    main()
