"""Exact dynamic programming on the token MDP: J, ∇J, χ²_seq, KL_seq, occupancy at scale.

    python benchmarks/bench_token_dp.py [--S 64 --V 64 --T 4096 --repeats 3]

Setting: a random automaton with S states, each its own policy class (P = S), vocabulary V,
length T, EOS = token V − 1, random non-stationary logits (T, P, V) and a behaviour μ = softmax of
perturbed logits. Target (issue 3): J, ∇J and χ²_seq together under 1 s on one core for
S = V = 64, T = 4096. Baseline measured in the same run: one softmax over the (T, P, V) logits
(the floor of building π).

Issue 12: the exact DP mean **and variance** (:mod:`simkit.envs.token_moments`) of sequence IS
and of a token-level mapping (PPO clip) at the same size, target < 2 s each on one core,
reported as a ratio to J + ∇J measured in the same run. Results (best of ``--repeats``,
seconds and ratios to the floor and to J + ∇J) are printed and written as JSON to
``benchmarks/results/bench_token_dp.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
from scipy.special import softmax
from timing import best_time

from simkit import mappings
from simkit.envs import TokenMDP
from simkit.envs.token_moments import moments


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--S", type=int, default=64, help="automaton states = policy classes")
    parser.add_argument("--V", type=int, default=64, help="vocabulary size")
    parser.add_argument("--T", type=int, default=4096, help="maximum length")
    parser.add_argument("--repeats", type=int, default=3, help="timings per cell (best of)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_token_dp.json")
    )
    args, _ = parser.parse_known_args(argv)  # run_all.py passes every script the same args

    rng = np.random.default_rng(args.seed)
    S, V, T = args.S, args.V, args.T
    logits = rng.standard_normal((T, S, V))
    env = TokenMDP(
        logits,
        rng.integers(0, S, size=(S, V)),
        np.arange(S),
        rng.random(S).round(),
        eos=V - 1,
    )
    mu = softmax(logits + 0.1 * rng.standard_normal(logits.shape), axis=-1)
    floor = best_time(lambda: softmax(logits, axis=-1), args.repeats)
    cells = {
        "J": lambda: env.J(),
        "grad_J": lambda: env.grad_J(),
        "chi2_seq": lambda: env.chi2_seq(mu),
        "kl_seq": lambda: env.kl_seq(mu),
        "occupancy(mu)": lambda: env.occupancy(mu),
        "moments is_seq (mean + var)": lambda: moments(env, mu, mappings.get("is_seq"), 0.5),
        "moments ppo_clip (mean + var)": lambda: moments(env, mu, mappings.get("ppo_clip"), 0.5),
    }
    results = {name: best_time(fn, args.repeats) for name, fn in cells.items()}
    results["J + grad_J + chi2_seq"] = results["J"] + results["grad_J"] + results["chi2_seq"]
    j_grad = results["J"] + results["grad_J"]
    print(f"S = P = {S}, V = {V}, T = {T} (D = {env.D:,}); floor softmax(logits) {floor:.3f} s")
    for name, sec in results.items():
        print(
            f"  {name:<30s} {sec:8.3f} s   {sec / floor:6.1f} x floor   "
            f"{sec / j_grad:5.2f} x (J + grad_J)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "setting": {"S": S, "V": V, "T": T, "D": env.D},
                "machine": platform.platform(),
                "floor_softmax_s": floor,
                "ratio_to_J_plus_grad_J": {k: v / j_grad for k, v in results.items()},
                "seconds": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
