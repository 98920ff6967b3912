"""Cost of composed estimators (mapping on π/π_old × correction on π_old/μ) against their parts.

    python benchmarks/bench_composition.py [--n 2048 --t 2048 --repeats 3]

Input: N×T float64 log-ratios ℓ = log π − log μ and o = log π_old − log μ ~ N(0, 0.05²) each
leg, a mask of all ones and advantages ±1. For each pair (mapping, correction, mode) the same
run times (best of ``--repeats`` interleaved rounds): the composed
``Estimator.coefficients(ℓ, mask, A, o)``, and
the parts run separately from the same inputs — forming the staleness leg ℓ − o (one
subtraction; none in bypass mode), ``mapping.coefficients(ℓ − o)``,
``correction.coefficients(o)`` and one multiply of the two (N, T) results. Target: composed ≤
that sum × 1.10 (timing noise on a shared machine). ``trl_vespo`` is compared with VESPO + the
token correction run separately (its W sums both legs in log space instead of multiplying).
Results go to ``benchmarks/results/bench_composition.json`` (git-ignored).

``--dp``: instead, the exact moment DP of composed estimators
(:func:`simkit.envs.token_moments.composed_moments`, mean + variance) against the single-ratio
DP of the mapping alone (:func:`~simkit.envs.token_moments.moments`) in the same run, on the
automaton of ``bench_token_dp.py`` (S = V = 64 random states and tokens, EOS = V − 1,
T = 4096: ``--dp-S``, ``--dp-T``), π_old and μ random perturbations of the logits; CPU time
of one thread (``time.thread_time``, robust to other jobs on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
from scipy.special import softmax
from timing import best_time, report_target

from simkit.estimators import Estimator
from simkit.mappings import get

TARGET_RATIO = 1.10
PAIRS = [
    ("ppo_clip", "tis_token", "decoupled"),
    ("dapo", "mis_token", "decoupled"),
    ("gspo", "kl_rs", "decoupled"),
    ("naive", "tis_seq", "bypass"),
    ("vespo", "tis_token", "trl_vespo"),
]


def time_pair(est, m, c, mode, lr, old, stale, mask, adv, repeats) -> dict[str, float]:
    """Best times of the composed estimator and of its parts, interleaved rounds."""
    leg = lr if mode == "bypass" else stale
    inner = lr if mode == "bypass" else old
    cm = m.coefficients(leg, mask, adv)
    cc = c.coefficients(inner, mask, adv)
    cases = {
        "composed": lambda: est.coefficients(lr, mask, adv, old),
        "mapping": lambda: m.coefficients(leg, mask, adv),
        "correction": lambda: c.coefficients(inner, mask, adv),
        "multiply": lambda: cm * cc,
        "subtract": (lambda: None) if mode == "bypass" else (lambda: lr - old),
    }
    best = dict.fromkeys(cases, math.inf)
    for _ in range(repeats):  # interleaved rounds: every case sees the same load
        for key, fn in cases.items():
            best[key] = min(best[key], best_time(fn, 1))
    if mode == "bypass":
        best["subtract"] = 0.0
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--t", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_composition.json")
    )
    parser.add_argument("--dp", action="store_true", help="time the composed moment DP")
    parser.add_argument("--dp-S", type=int, default=64, help="--dp: automaton states (= V)")
    parser.add_argument("--dp-T", type=int, default=4096, help="--dp: length T")
    args, _ = parser.parse_known_args(argv)
    if args.dp:
        return time_dp(args)
    rng = np.random.default_rng(args.seed)
    shape = (args.n, args.t)
    old = rng.normal(0.0, 0.05, shape)
    lr = old + rng.normal(0.0, 0.05, shape)
    stale = lr - old
    mask = np.ones(shape, dtype=bool)
    adv = rng.choice([-1.0, 1.0], size=args.n)
    print(f"N={args.n} T={args.t} float64, best of {args.repeats}")
    print(f"{'estimator':<34} {'composed ms':>12} {'parts ms':>13} {'ratio':>7}  ok")
    rows, failures = [], []
    for mapping, correction, mode in PAIRS:
        m, c = get(mapping), get(correction)
        est = Estimator(m, correction=c, mode=mode)
        best = time_pair(est, m, c, mode, lr, old, stale, mask, adv, args.repeats)
        composed, t_map, t_corr = best["composed"], best["mapping"], best["correction"]
        t_mul, t_sub = best["multiply"], best["subtract"]
        parts = t_sub + t_map + t_corr + t_mul
        ratio = composed / parts
        ok = report_target(f"{est.name} composed / parts", ratio, TARGET_RATIO)
        if not ok:
            failures.append(est.name)
        print(
            f"{est.name:<34} {composed * 1e3:12.1f} {parts * 1e3:13.1f} {ratio:7.2f}  "
            f"{'yes' if ok else 'NO'}"
        )
        rows.append(
            {
                "estimator": est.name,
                "mode": mode,
                "composed_seconds": composed,
                "mapping_seconds": t_map,
                "correction_seconds": t_corr,
                "multiply_seconds": t_mul,
                "subtract_seconds": t_sub,
                "ratio_to_parts": ratio,
                "within_target": ok,
            }
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_composition",
                "n": args.n,
                "t": args.t,
                "repeats": args.repeats,
                "numpy": np.__version__,
                "python": platform.python_version(),
                "target_ratio": TARGET_RATIO,
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"written {out}")
    if failures:
        print(f"above {TARGET_RATIO:g}x the parts: {', '.join(failures)}")
    return 0


#: (mapping, correction, mode) of the --dp section; the single-ratio DP of the mapping is the
#: baseline of each
DP_PAIRS = [
    ("ppo_clip", "tis_token", "decoupled"),
    ("is_seq", "is_seq", "decoupled"),
    ("ppo_clip", "is_seq", "decoupled"),
]


def time_dp(args) -> int:
    """The --dp section (module docstring)."""
    from simkit.envs import TokenMDP
    from simkit.envs.token_moments import composed_moments, moments

    rng = np.random.default_rng(args.seed)
    S = V = args.dp_S
    T = args.dp_T
    logits = rng.standard_normal((T, S, V))
    env = TokenMDP(
        logits, rng.integers(0, S, size=(S, V)), np.arange(S), rng.random(S).round(), eos=V - 1
    )
    old = softmax(logits + 0.1 * rng.standard_normal(logits.shape), axis=-1)
    mu = softmax(np.log(old) + 0.1 * rng.standard_normal(logits.shape), axis=-1)

    def cpu_best(fn):
        return best_time(fn, args.repeats, clock=time.thread_time)

    print(f"S = V = {S}, T = {T}; CPU time of one thread, best of {args.repeats}")
    rows = []
    for mapping, correction, mode in DP_PAIRS:
        m, c = get(mapping), get(correction)
        single = cpu_best(lambda m=m: moments(env, mu, m, 0.5))
        composed = cpu_best(
            lambda m=m, c=c, mode=mode: composed_moments(env, mu, old, m, c, mode, 0.5)
        )
        name = f"{mapping} × {correction} ({mode})"
        print(
            f"{name:<36} composed {composed:6.2f} s  {mapping} alone {single:6.2f} s  "
            f"ratio {composed / single:5.2f}"
        )
        rows.append({"estimator": name, "composed_seconds": composed, "single_seconds": single})
    out = Path(args.out).with_name("bench_composition_dp.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"S": S, "V": V, "T": T, "results": rows}, indent=2))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
