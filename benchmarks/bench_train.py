"""Training simulator throughput: optimizer steps per second, and the time of a 64-run grid.

    python benchmarks/bench_train.py [--steps 200 --repeats 3 --grid-steps 500]

Setting (issue 7): ``TokenMDP.answer_correct(V = 32, T = 256)``, the VESPO recipe (GRPO group
advantage, G = 8), rollout batch 512 split into N = 8 mini-batches of 64, Adam, one core
(BLAS pinned to one thread). Measured, best of ``--repeats``:

- steps/s with the exact columns (J, ∇J, cosine, χ²/KL by DP) every step and every 10 steps;
- the floor of a step measured in the same run: sampling the step's share of the rollout
  (64 sequences, :func:`simkit.envs.sample_tokens`) plus one gradient accumulation
  (:func:`simkit.envs.accumulate_tokens`) — the work no step can avoid; each mode is reported
  as a ratio to it;
- the full-size ``staleness_curves`` runs (V = 32, T = 64, m = 32, exact J every 10 steps):
  steps/s of one run at N = 1 and N = 64;
- a grid of 8 of those runs (``--grid-steps`` steps each) through
  :func:`simkit.sweep.run_config` serially and on 2 processes: the parallel speed-up.

Parameterisations (issue 16): steps/s of ``parameterization = "tied"`` and ``"features"``
(d = 256, token rank 16) against ``"tabular"`` at the benchmark setting (exact columns every 10
steps), measured in the same run. The ``collapse_regimes`` grid (issue 16): steps/s of one of
its runs at each N (lag 8, lr 0.3), from which the wall time of the whole grid on 2 cores is
estimated (target: under 30 minutes). ``--only-issue16`` runs just these two sections.

From these it estimates the wall time of a 64-configuration ``staleness_curves`` grid of 1000
steps each on 2 cores (issue 7's target: under 30 minutes), both at the benchmark setting
(V = 32, T = 256, batch 512, N = 8, exact columns every 10 steps) and at the figure's
setting. Results go to ``benchmarks/results/bench_train.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import numpy as np
from timing import best_time, report_target

from simkit.envs import TokenMDP, accumulate_tokens, sample_tokens
from simkit.sweep import run_config, single_threaded_blas
from simkit.train import TrainConfig, train
from simkit.train.recipes import recipe

TARGET_MINUTES = 30.0
GRID_RUNS = 64
GRID_STEPS = 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timings per case (best of)")
    parser.add_argument("--grid-steps", type=int, default=500, help="steps per run of the grid")
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_train.json")
    )
    parser.add_argument(
        "--only-issue16",
        action="store_true",
        help="only the parameterisation and collapse_regimes sections",
    )
    args, _ = parser.parse_known_args(argv)  # run_all.py passes every script the same args

    env = TokenMDP.answer_correct(V=32, T=256, seed=0)
    est = recipe("vespo", group_size=8)
    results: dict = {"setting": {"V": 32, "T": 256, "batch": 512, "N": 8, "recipe": "VESPO"}}
    with single_threaded_blas():
        results.update(issue16(env, est, args))
    if args.only_issue16:
        return write(results, args.out)
    with single_threaded_blas():
        # floor: the step's share of one rollout (512 sequences / 8) + one accumulation of 64
        rng = np.random.default_rng(0)
        pi = env.pi
        batch = sample_tokens(env, pi, 512, rng)
        rows = slice(0, 64)
        lam = np.full(batch.actions[rows].shape, 1.0 / batch.actions[rows].size)
        sample = best_time(lambda: sample_tokens(env, pi, 512, rng), max(args.repeats, 5))
        accumulate = best_time(
            lambda: accumulate_tokens(
                env, batch.actions[rows], lam, states=batch.states[rows], mask=batch.mask[rows]
            ),
            max(args.repeats, 5),
        )
        floor = sample / 8 + accumulate
        results["floor_step_s"] = floor
        steps_per_s = {}
        for every in (1, 10):
            cfg = TrainConfig(
                est, steps=args.steps, batch=512, minibatches=8, lr=0.03, record_every=every
            )
            sec = best_time(lambda c=cfg: train(env, c, seed=0), args.repeats)
            steps_per_s[every] = args.steps / sec
        results["steps_per_s"] = {f"record_every={k}": v for k, v in steps_per_s.items()}

        # the figure's runs
        from simkit.figures import staleness_curves

        fig_cfg = staleness_curves.config()
        fig_env = staleness_curves.sweep_config(fig_cfg).environment.build(fig_cfg.T)
        fig_rate = {}
        for N in (1, 64):
            cfg = TrainConfig(
                est,
                steps=args.steps,
                batch=N * fig_cfg.minibatch_size,
                minibatches=N,
                lr=fig_cfg.lr,
                max_grad_norm=fig_cfg.max_grad_norm,
                record_every=fig_cfg.record_every,
            )
            sec = best_time(lambda c=cfg: train(fig_env, c, seed=0), args.repeats)
            fig_rate[N] = args.steps / sec
        results["figure_steps_per_s"] = {f"N={k}": v for k, v in fig_rate.items()}

    # parallel speed-up on a real grid of 8 runs (4 recipes × N ∈ {1, 64})
    small = staleness_curves.Config(
        recipes=("grpo", "gspo", "sapo", "vespo"), staleness=(1, 64), seeds=(0,),
        steps=args.grid_steps,
    )  # fmt: skip
    sweep = staleness_curves.sweep_config(small)
    serial = best_time(lambda: run_config(sweep, progress=False), 1)
    workers = min(2, os.cpu_count() or 1)
    procs = best_time(
        lambda: run_config(sweep, progress=False, backend="processes", workers=workers), 1
    )
    speedup = serial / procs
    results["grid8"] = {
        "steps_per_run": args.grid_steps,
        "serial_s": serial,
        "processes_s": procs,
        "workers": workers,
        "speedup": speedup,
    }

    # estimates of the 64-configuration grid of 1000 steps on 2 cores, with the measured
    # speed-up (other processes on the machine lower it: the load average is reported) and
    # with the ideal one (2 x)
    bench_rate = steps_per_s[10]
    fig_mean = 2 / (1 / fig_rate[1] + 1 / fig_rate[64])  # harmonic mean over N
    estimates = {}
    for name, rate in (("bench_setting", bench_rate), ("figure_setting", fig_mean)):
        one_core = GRID_RUNS * GRID_STEPS / rate / 60
        estimates[name] = {"measured_speedup": one_core / speedup, "ideal_2x": one_core / 2}
    results["grid64_minutes_on_2_cores"] = estimates

    print(f"machine: {platform.platform()}, {os.cpu_count()} cores")
    print(
        f"V = 32, T = 256, batch 512, N = 8 (VESPO), one core; floor per step (1/8 of sampling "
        f"512 sequences + one accumulation of 64) {floor * 1e3:.2f} ms"
    )
    for every, rate in steps_per_s.items():
        print(
            f"  exact columns every {every:>2d} step(s): {rate:7.1f} steps/s   "
            f"{1 / rate / floor:5.1f} x floor"
        )
    print(
        f"staleness_curves runs (V = 32, T = 64, m = 32, exact J every 10): "
        f"N = 1 {fig_rate[1]:.0f} steps/s, N = 64 {fig_rate[64]:.0f} steps/s"
    )
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"grid of 8 runs x {args.grid_steps} steps: serial {serial:.1f} s, {workers} processes "
        f"{procs:.1f} s (speed-up {speedup:.2f} x; load average {load[0]:.1f} while measuring)"
        if load
        else f"grid of 8 runs: serial {serial:.1f} s, {workers} processes {procs:.1f} s"
    )
    for name, est in estimates.items():
        worst = max(est.values())
        verdict = "meets" if worst < TARGET_MINUTES else "MISSES"
        report_target(
            f"staleness_curves grid, {name.replace('_', ' ')}", worst, TARGET_MINUTES, "min"
        )
        print(
            f"64 runs x 1000 steps on 2 cores, {name.replace('_', ' ')}: "
            f"{est['measured_speedup']:.1f} min at the measured speed-up, "
            f"{est['ideal_2x']:.1f} min at 2 x ({verdict} the {TARGET_MINUTES:.0f} min target)"
        )
    return write(results, args.out)


def write(results: dict, path) -> int:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    results["machine"] = platform.platform()
    results["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    out.write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


def issue16(env, est, args) -> dict:
    """Parameterisations against tabular, and the collapse_regimes grid estimate."""
    from simkit.figures import collapse_regimes

    out: dict = {}
    rates = {}
    for kind in ("tabular", "tied", "features"):
        cfg = TrainConfig(
            est,
            steps=args.steps,
            batch=512,
            minibatches=8,
            lr=0.03,
            record_every=10,
            parameterization=kind,
            features=256,
            feature_rank=16,
        )
        sec = best_time(lambda c=cfg: train(env, c, seed=0), args.repeats)
        rates[kind] = args.steps / sec
    out["parameterization_steps_per_s"] = rates
    print("parameterisations (V = 32, T = 256, batch 512, N = 8, exact columns every 10):")
    for kind, rate in rates.items():
        print(f"  {kind:>8s}: {rate:7.1f} steps/s   {rates['tabular'] / rate:5.2f} x tabular time")

    cr = collapse_regimes.config()
    cr_env = collapse_regimes.environment(cr)
    per_N = {}
    for N in sorted({*cr.Ns, cr.N_fixed}):
        steps = min(args.steps, cr.steps)
        cfg = TrainConfig(
            recipe("grpo", cr.group_size),
            steps=steps,
            batch=N * cr.minibatch_size,
            minibatches=N,
            lag=max(cr.lags),
            lr=cr.lr_fixed,
            max_grad_norm=cr.max_grad_norm,
            record_every=cr.record_every,
        )
        sec = best_time(lambda c=cfg: train(cr_env, c, seed=0), 1)
        per_N[N] = steps / sec
    runs = len(cr.recipes) * len(cr.seeds)
    one_core = sum(runs * cr.steps / per_N[N] for N, _, _ in collapse_regimes.cells(cr))
    minutes = one_core / 2 / 60
    out["collapse_regimes"] = {
        "steps_per_s_by_N": per_N,
        "runs": runs * len(collapse_regimes.cells(cr)),
        "minutes_on_2_cores_ideal": minutes,
    }
    report_target("collapse_regimes grid on 2 cores at 2 x", minutes, TARGET_MINUTES, "min")
    print(
        f"collapse_regimes grid: {runs * len(collapse_regimes.cells(cr))} runs x {cr.steps} "
        "steps; steps/s by N "
        + ", ".join(f"N = {N}: {r:.0f}" for N, r in per_N.items())
        + f"; estimate {minutes:.1f} min on 2 cores at 2 x "
        + ("(meets" if minutes < TARGET_MINUTES else "(MISSES")
        + f" the {TARGET_MINUTES:.0f} min target)"
    )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
