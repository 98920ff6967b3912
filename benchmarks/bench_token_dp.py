"""Exact dynamic programming on the token MDP: J, ∇J, χ²_seq, KL_seq, occupancy at scale.

    python benchmarks/bench_token_dp.py [--S 64 --V 64 --T 4096 --repeats 3]

Setting: a random automaton with S states, each its own policy class (P = S), vocabulary V,
length T, EOS = token V − 1, random non-stationary logits (T, P, V) and a behaviour μ = softmax of
perturbed logits. Target (issue 3): J, ∇J and χ²_seq together under 1 s on one core for
S = V = 64, T = 4096. Baseline measured in the same run: one softmax over the (T, P, V) logits
(the floor of building π).

Issue 12: the exact DP mean **and variance** (:mod:`simkit.envs.token_moments`) of sequence IS
and of a token-level mapping (PPO clip) at the same size, target < 2 s each on one core,
reported as a ratio to J + ∇J measured in the same run.

Issue 22: the same moments with **tied** parameters (:mod:`simkit.envs.token_moments_tied`: a
forward message of partial score sums, one (S × S)·(S × m·P·V) BLAS matmul per position, m = 1
message for sequence IS, 2 for PPO clip whose coefficient depends on the sign of A), target
< 5 s on one core, reported as a ratio to the untied DP of the same mapping in the same run
(wall clock and the calling thread's CPU time, which other load on the machine disturbs less).
Issue 28 (the exact paths of issues 24 and 26), each reported as a CPU-time ratio to the plain
DP of the same mapping in the same run:

- a KL penalty in the loss (k3, β = 0.1, π_ref a perturbed π) on PPO clip and DRO's additive
  term (:func:`simkit.envs.token_moments.additive_moments`): target ≤ 3× the DP of PPO clip
  without the penalty;
- a behaviour of three policy versions (a lag mixture 0.5 / 0.3 / 0.2,
  :func:`simkit.experiment.versions.versioned_moments` with ``method="dp"``, oracle baseline
  J(μ) of the mixture): one moment DP per version plus the baseline, target ≤ 1.5 × 3 DPs of
  the same mapping (is_seq and ppo_clip).

Every cell runs with one BLAS thread (``threadpoolctl``). Results (best of ``--repeats``,
seconds and ratios to the floor and to J + ∇J) are printed and written as JSON to
``benchmarks/results/bench_token_dp.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
from scipy.special import softmax
from threadpoolctl import threadpool_limits
from timing import best_time, report_target

from simkit import mappings
from simkit.envs import TokenMDP
from simkit.envs.token_moments import moments
from simkit.envs.token_moments_tied import tied_moments


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
    with threadpool_limits(limits=1):
        results, cpu, tied = _measure(env, mu, logits, args.repeats)
    floor = results.pop("floor")
    results["J + grad_J + chi2_seq"] = results["J"] + results["grad_J"] + results["chi2_seq"]
    j_grad = results["J"] + results["grad_J"]
    print(f"S = P = {S}, V = {V}, T = {T} (D = {env.D:,}); floor softmax(logits) {floor:.3f} s")
    for name, sec in results.items():
        print(
            f"  {name:<36s} {sec:8.3f} s   {sec / floor:6.1f} x floor   "
            f"{sec / j_grad:5.2f} x (J + grad_J)"
        )
    ratios = {}
    for name in tied:
        untied = f"moments {name} (mean + var)"
        key = f"tied_moments {name} (mean + var)"
        ratios[key] = {
            "wall": results[key] / results[untied],
            "cpu": cpu[key] / cpu[untied],
        }
        print(
            f"  {key}: {results[key]:.3f} s wall, {cpu[key]:.3f} s CPU = "
            f"{ratios[key]['wall']:.2f} x (wall) / {ratios[key]['cpu']:.2f} x (CPU) the untied DP"
        )
    report_target(
        "J + grad_J + chi2_seq (wall, one core)", results["J + grad_J + chi2_seq"], 1.0, "s"
    )
    for key, (plain, target) in NEW_PATHS.items():
        ratios[key] = {"cpu": cpu[key] / cpu[plain]}
        print(f"  {key}: {cpu[key]:.3f} s CPU = {ratios[key]['cpu']:.2f} x {plain}")
        report_target(f"{key} / {plain} (CPU, one core)", ratios[key]["cpu"], target)
    for name in tied:
        key = f"moments {name} (mean + var)"
        report_target(f"{key} (CPU, one core)", cpu[key], 2.0, "s")
    for name in tied:
        key = f"tied_moments {name} (mean + var)"
        report_target(f"{key} (CPU, one core)", cpu[key], 5.0, "s")
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
                "cpu_seconds": cpu,
                "tied_ratio_to_untied": ratios,
            },
            indent=2,
        )
    )
    return 0


def _measure(env, mu, logits, repeats: int):
    """Best wall-clock seconds of every cell (and ``"floor"``), the calling thread's CPU
    seconds of the moment cells, and the mappings timed tied."""
    tied = ("is_seq", "ppo_clip")
    cells = {
        "floor": lambda: softmax(logits, axis=-1),
        "J": lambda: env.J(),
        "grad_J": lambda: env.grad_J(),
        "chi2_seq": lambda: env.chi2_seq(mu),
        "kl_seq": lambda: env.kl_seq(mu),
        "occupancy(mu)": lambda: env.occupancy(mu),
    }
    moment_cells = {}
    for name in tied:
        m = mappings.get(name)
        moment_cells[f"moments {name} (mean + var)"] = lambda m=m: moments(env, mu, m, 0.5)
    for name in tied:
        m = mappings.get(name)
        moment_cells[f"tied_moments {name} (mean + var)"] = lambda m=m: tied_moments(
            env, mu, m, 0.5
        )
    results = {name: best_time(fn, repeats) for name, fn in cells.items()}
    moment_cells.update(_new_path_cells(env, mu, logits))
    cpu = {}
    for name, fn in moment_cells.items():
        results[name] = best_time(fn, repeats)
        cpu[name] = best_time(fn, repeats, clock=time.thread_time)
    return results, cpu, tied


#: issue 28's cells of the issue 24 / 26 exact paths: key -> (the plain cell it is divided
#: by, target ratio); the version mixtures are divided by one plain DP, so 3 × 1.5 = 4.5
NEW_PATHS = {
    "additive_moments ppo_clip + KL k3 in the loss (mean + var)": (
        "moments ppo_clip (mean + var)",
        3.0,
    ),
    "additive_moments dro (mean + var)": ("moments ppo_clip (mean + var)", 3.0),
    "versioned_moments is_seq, 3 versions (mean + var)": ("moments is_seq (mean + var)", 4.5),
    "versioned_moments ppo_clip, 3 versions (mean + var)": ("moments ppo_clip (mean + var)", 4.5),
}


def _new_path_cells(env, mu, logits) -> dict:
    """The cells of :data:`NEW_PATHS` (a KL penalty / an additive term; three versions)."""
    from simkit.envs import versions
    from simkit.envs.token_moments import additive_moments
    from simkit.estimators import Estimator
    from simkit.experiment.versions import versioned_moments
    from simkit.kl import KLPenalty

    rng = np.random.default_rng(1)
    ref = softmax(logits + 0.2 * rng.standard_normal(logits.shape), axis=-1)
    older = softmax(logits + 0.2 * rng.standard_normal(logits.shape), axis=-1)
    mixture = versions.mixture(env, [env.pi, mu, older], [0.5, 0.3, 0.2])
    kl = KLPenalty(0.1, "k3", "loss")
    keys = list(NEW_PATHS)
    return {
        keys[0]: lambda: additive_moments(env, mu, mappings.get("ppo_clip"), 0.5, kl=kl, ref=ref),
        keys[1]: lambda: additive_moments(env, mu, mappings.get("dro"), 0.5),
        keys[2]: lambda: versioned_moments(
            env, mixture, Estimator("is_seq", "seq-mean-token-sum", "oracle"), 8, method="dp"
        ),
        keys[3]: lambda: versioned_moments(
            env, mixture, Estimator("ppo_clip", "seq-mean-token-sum", "oracle"), 8, method="dp"
        ),
    }


if __name__ == "__main__":
    raise SystemExit(main())
