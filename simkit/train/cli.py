"""``simkit train``: one training run from options, or a grid of runs from a TOML config.

:func:`register` adds the subcommand to ``simkit``'s subparsers (``simkit.cli.SUBCOMMANDS``).
Two forms:

- ``simkit train CONFIG.toml [--out DIR] [--backend …]`` — a training sweep
  (``kind = "train"``, :class:`simkit.config.TrainSweepConfig`) run through the sweep machinery
  (:func:`simkit.sweep.run_sweep`: one parquet shard per run, resumable, serial / processes /
  Dask), then one summary line per run (:func:`simkit.train.analysis.run_summary`), also
  written to ``DIR/summary.csv``;
- ``simkit train [--env …] [--recipe … | --mapping …] [--N …] [--steps …] [--out DIR]`` — one
  run of :func:`simkit.train.train`; with ``--out`` it is checkpointed and the same command
  resumes it after an interruption.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from simkit.cli_common import (
    LAZY_HELP,
    add_backend_options,
    add_command,
    check_output_directory,
    check_table_file,
    run_sweep_command,
    save_table,
    table_text,
    usage_errors,
)
from simkit.cli_errors import CLIError

__all__ = ["register", "run"]

#: options of the single-run form, with their defaults (a config file excludes them)
RUN_DEFAULTS = {
    "env": "at_least_k",
    "V": 8,
    "T": 16,
    "env_arg": None,
    "env_seed": 0,
    "scale": 1.0,
    "eos": None,
    "recipe": None,
    "mapping": None,
    "param": None,
    "aggregation": "token-mean",
    "advantage": "grpo",
    "group_size": 8,
    "N": 1,
    "minibatch_size": 16,
    "lag": 0,
    "lag_updates": 0,
    "steps": 200,
    "optimizer": "adam",
    "lr": 0.05,
    "max_grad_norm": None,
    "gradient": "estimator",
    "record_every": 1,
    "parameterization": "tabular",
    "features": 256,
    "feature_rank": 16,
    "precision": None,
    "logit_noise": 0.0,
    "spike_prob": 0.0,
    "spike_strength": 0.0,
    "spike_tokens": 1,
    "relative_noise": 0.0,
    "sharpness_noise": 0.0,
    "seed": 0,
    "chunk_steps": 100,
    "stop_after": None,
    "table": None,
}
#: options of the config form (ignored by the single-run form)
SWEEP_ONLY = ("backend", "workers", "scheduler")

DESCRIPTION = """\
Train a tabular policy on a token MDP with the rollout/update schedule of real RL trainers
(simkit.train): a rollout batch from mu split into N mini-batches updated in sequence
(staleness N), an optional lag of k policy versions, an emulated inference engine (bf16/fp16
logits, logit noise, toxic-tail spikes), any mapping x aggregation x advantage. Every step
records the exact J, the true gradient and the estimator's cosine to it, chi2/KL between pi
and mu (token and sequence), ESS, clip/mask fraction and gradient norms.

Two forms:
  simkit train CONFIG.toml   a grid of runs (kind = "train" config), run like 'simkit sweep':
                             one shard per run in --out (default runs/<name>), resumable,
                             --backend serial|processes|dask; prints one line per run
                             (start, final, peak and mean J, collapse) and writes
                             DIR/summary.csv.
  simkit train [OPTIONS]     one run. --recipe grpo|gspo|sapo|vespo|tis|mis|geo_mask|naive
                             picks a paper's loss (mapping + aggregation, GRPO advantage),
                             --recipe ppo_tis verl's decoupled PPO x token TIS (three
                             policies: PPO clip on pi/pi_old, TIS on pi_old/mu);
                             --mapping NAME [--param k=v] [--aggregation] [--advantage] any
                             other. With --out DIR the run is checkpointed every
                             --chunk-steps steps: the same command resumes it.

A run's random streams come from --seed alone: the same seed gives the same table, bit for
bit, from the CLI, from a sweep or from simkit.train.train."""

EPILOG = """\
examples:
  simkit train --recipe vespo --N 8 --steps 300
  simkit train --env answer_correct --V 16 --T 64 --recipe tis --precision bf16 \\
               --spike-prob 0.02 --spike-strength 6 --out runs/tis_bf16
  simkit train --recipe ppo_tis --N 16 --lag 8 --lr 0.3 --max-grad-norm 1
  simkit train --mapping ppo_clip --param eps_high=0.28 --aggregation seq-mean-token-mean \\
               --N 16 --lag 1 --table ppo.csv
  simkit train configs/train_quick.toml --out runs/train_quick --backend processes
  simkit train configs/train_staleness_curves.toml --backend processes --workers 2
"""


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``train`` to ``simkit``'s subparsers; returns its parser."""
    p = add_command(
        subparsers,
        "train",
        help=LAZY_HELP["train"],
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    p.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help='a training sweep config (TOML, kind = "train"); omit it for one run',
    )
    g = p.add_argument_group("config form (simkit train CONFIG.toml)")
    add_backend_options(g)

    g = p.add_argument_group("environment (one run)")
    g.add_argument(
        "--env",
        default=RUN_DEFAULTS["env"],
        metavar="CONSTRUCTOR",
        help="TokenMDP constructor: iid, markov, answer_correct, at_least_k, parity "
        "(default %(default)s)",
    )
    g.add_argument(
        "--V", type=int, default=RUN_DEFAULTS["V"], help="vocabulary (default %(default)s)"
    )
    g.add_argument("--T", type=int, default=RUN_DEFAULTS["T"], help="length (default %(default)s)")
    g.add_argument(
        "--env-arg",
        action="append",
        metavar="KEY=VALUE",
        help="constructor argument, e.g. k=3 (at_least_k; default k = T // 4)",
    )
    g.add_argument("--env-seed", type=int, default=0, help="seed of the random initial logits")
    g.add_argument("--scale", type=float, default=1.0, help="scale of the initial logits")
    g.add_argument("--eos", type=int, help="EOS token (variable lengths)")

    g = p.add_argument_group("estimator (one run)")
    g.add_argument(
        "--recipe",
        metavar="NAME",
        help="a paper's loss: grpo, gspo, sapo, vespo, tis, mis, geo_mask, naive, or the "
        "composed ppo_tis (decoupled PPO x token TIS) (default grpo unless --mapping)",
    )
    g.add_argument(
        "--mapping", metavar="NAME", help="any registered mapping ('simkit list mappings')"
    )
    g.add_argument(
        "--param",
        action="append",
        metavar="KEY=VALUE",
        help="mapping hyperparameter (with --mapping), e.g. eps_high=0.28",
    )
    g.add_argument(
        "--aggregation",
        default=RUN_DEFAULTS["aggregation"],
        help="with --mapping (default %(default)s)",
    )
    g.add_argument(
        "--advantage",
        default=RUN_DEFAULTS["advantage"],
        help="with --mapping: oracle (R - J(mu)), oracle_pi (R - J(pi)), grpo, dr_grpo, rloo, "
        "raw (default %(default)s)",
    )
    g.add_argument(
        "--group-size",
        type=int,
        default=RUN_DEFAULTS["group_size"],
        help="G of the group advantages (default %(default)s)",
    )

    g = p.add_argument_group("schedule and optimizer (one run)")
    g.add_argument(
        "--N", type=int, default=1, help="mini-batches per rollout: staleness (default 1)"
    )
    g.add_argument(
        "--minibatch-size",
        type=int,
        default=RUN_DEFAULTS["minibatch_size"],
        help="sequences per update; rollout batch = N x this (default %(default)s)",
    )
    g.add_argument("--lag", type=int, default=0, help="rollouts behind (asynchronous RL)")
    g.add_argument(
        "--lag-updates",
        type=int,
        default=0,
        help="optimizer updates behind: rollout r is sampled from θ_max(rN − L, 0) (lag and "
        "staleness N separate; give --lag or --lag-updates)",
    )
    g.add_argument("--steps", type=int, default=RUN_DEFAULTS["steps"], help="optimizer steps")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=RUN_DEFAULTS["lr"], help="learning rate")
    g.add_argument("--max-grad-norm", type=float, help="clip the update's norm")
    g.add_argument(
        "--gradient",
        choices=["estimator", "exact"],
        default="estimator",
        help="'exact': ascend the true gradient (the estimator is still recorded)",
    )
    g.add_argument("--record-every", type=int, default=1, help="exact columns every K steps")
    g.add_argument(
        "--parameterization",
        choices=["tabular", "tied", "features"],
        default="tabular",
        help="policy parameters: per-position table, one table for all positions, or low-rank "
        "random features (default %(default)s)",
    )
    g.add_argument("--features", type=int, default=256, help="features: dimension d")
    g.add_argument("--feature-rank", type=int, default=16, help="features: token-embedding rank")

    g = p.add_argument_group("inference mismatch (one run)")
    g.add_argument("--precision", choices=["bf16", "fp16"], help="round mu's logits")
    g.add_argument("--logit-noise", type=float, default=0.0, help="sigma of logit noise")
    g.add_argument("--spike-prob", type=float, default=0.0, help="toxic-tail spike probability")
    g.add_argument("--spike-strength", type=float, default=0.0, help="spike: mu x e^-s")
    g.add_argument("--spike-tokens", type=int, default=1, help="rarest tokens starved per spike")
    g.add_argument("--relative-noise", type=float, default=0.0, help="noise rho*|logit - row mean|")
    g.add_argument(
        "--sharpness-noise", type=float, default=0.0, help="noise s*(1 - H/log V) per row"
    )

    g = p.add_argument_group("output")
    g.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    g.add_argument(
        "--out",
        metavar="DIR",
        help="one run: checkpointed run directory (resumed if it exists); "
        "a config: the sweep directory (default runs/<name>)",
    )
    g.add_argument("--chunk-steps", type=int, default=100, help="one run: steps per checkpoint")
    g.add_argument(
        "--stop-after",
        type=int,
        metavar="STEPS",
        help="one run: stop after this many steps in total (resume later with --out)",
    )
    g.add_argument("--table", metavar="FILE", help="one run: write the table (.csv or .parquet)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _error(message: str):
    raise CLIError(message)


#: integer options of the single-run form and their smallest value (checked before any work,
#: so that the message names the option typed, not an internal field; --V is checked, and
#: named, by the environment's config)
INT_OPTIONS = {
    "T": 1,
    "env_seed": 0,
    "group_size": 1,
    "N": 1,
    "minibatch_size": 1,
    "lag": 0,
    "lag_updates": 0,
    "steps": 1,
    "record_every": 1,
    "spike_tokens": 1,
    "features": 1,
    "feature_rank": 1,
    "seed": 0,
    "chunk_steps": 1,
    "stop_after": 1,
}

#: internal names in library messages -> the options a user typed (longest names first)
OPTION_NAMES = {
    "TrainConfig.batch": "--N x --minibatch-size",
    "TrainConfig.minibatches": "--N",
    "TrainConfig.steps": "--steps",
    "TrainConfig.lag_updates": "--lag-updates",
    "TrainConfig.lag": "--lag",
    "TrainConfig.lr": "--lr",
    "TrainConfig.max_grad_norm": "--max-grad-norm",
    "TrainConfig.record_every": "--record-every",
    "TrainConfig.optimizer": "--optimizer",
    "TrainConfig.gradient": "--gradient",
    "TrainConfig.parameterization": "--parameterization",
    "TrainConfig.features": "--features",
    "TrainConfig.feature_rank": "--feature-rank",
    "Mismatch.relative_noise": "--relative-noise",
    "Mismatch.sharpness_noise": "--sharpness-noise",
    "train.chunk_steps": "--chunk-steps",
    "train.stop_after": "--stop-after",
    "Adam.lr": "--lr",
    "SGD.lr": "--lr",
    "Mismatch.logit_noise": "--logit-noise",
    "Mismatch.spike_prob": "--spike-prob",
    "Mismatch.spike_strength": "--spike-strength",
    "Mismatch.spike_tokens": "--spike-tokens",
    "Mismatch.precision": "--precision",
    "mismatch.spike_tokens": "--spike-tokens",
    "environment.constructor": "--env",
    "environment.seed": "--env-seed",
    "environment.scale": "--scale",
    "environment.eos": "--eos",
    "environment.V": "--V",
    "environment.T[0]": "--T",
    "environment.kwargs.": "--env-arg ",
}


def _as_typed(message: str) -> str:
    """``message`` with internal field names replaced by the options of ``simkit train``."""
    import re

    for internal, option in sorted(OPTION_NAMES.items(), key=lambda kv: -len(kv[0])):
        message = message.replace(internal, option)
    # "environment (T = 16): …" is a constructor's own check (e.g. k of --env-arg)
    return re.sub(r"\benvironment \(T = (\d+)\)", r"--env with --T \1", message)


def _check_int_options(args) -> None:
    for name, low in INT_OPTIONS.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            option = "--" + name.replace("_", "-")
            _error(f"{option} must be an integer >= {low}, got {value}")


def _key_values(items, option: str) -> dict:
    """``["k=3", "x=0.5"]`` → ``{"k": 3, "x": 0.5}`` (ints, floats, booleans, else strings)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            _error(f"{option} expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        out[key] = _parse_value(value.strip())
    return out


def _parse_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def run(args) -> int:
    """Entry point of ``simkit train`` (the subparser's ``func``)."""
    if args.config is not None:
        return _run_config(args)
    used = [k for k in SWEEP_ONLY if getattr(args, k) not in (None, "serial")]
    if used:
        _error(f"--{used[0]} applies to a config file (simkit train CONFIG.toml --{used[0]} …)")
    return _run_one(args)


# --- one run -----------------------------------------------------------------------------------


def _estimator(args):
    from simkit import mappings
    from simkit.estimators import Estimator
    from simkit.train.recipes import recipe

    if args.recipe is not None and args.mapping is not None:
        _error("give --recipe or --mapping, not both")
    if args.mapping is None:
        if args.param:
            _error("--param applies to --mapping (a recipe fixes its hyperparameters)")
        name = args.recipe or "grpo"
        with usage_errors(KeyError):
            return recipe(name, group_size=args.group_size)
    with usage_errors(KeyError, TypeError, ValueError):
        mapping = mappings.get(args.mapping, **_key_values(args.param, "--param"))
        group = args.advantage in ("grpo", "dr_grpo", "rloo")
        return Estimator(
            mapping,
            aggregation=args.aggregation,
            advantage=args.advantage,
            group_size=args.group_size if group else None,
        )


def _environment(args):
    from simkit.config import ConfigError, TokenMDPConfig

    kwargs = _key_values(args.env_arg, "--env-arg")
    if args.env == "at_least_k" and "k" not in kwargs:
        kwargs["k"] = max(1, args.T // 4)
    with usage_errors(ConfigError, rename=_as_typed):
        cfg = TokenMDPConfig(
            constructor=args.env,
            V=args.V,
            T=(args.T,),
            eos=args.eos,
            seed=args.env_seed,
            scale=args.scale,
            kwargs=kwargs,
        )
    return cfg.build(args.T)


def _train_config(args):
    from simkit.train import Mismatch, TrainConfig

    with usage_errors(TypeError, ValueError, rename=_as_typed):
        mismatch = Mismatch(
            logit_noise=args.logit_noise,
            precision=args.precision,
            spike_prob=args.spike_prob,
            spike_strength=args.spike_strength,
            spike_tokens=args.spike_tokens,
            relative_noise=args.relative_noise,
            sharpness_noise=args.sharpness_noise,
        )
        return TrainConfig(
            estimator=_estimator(args),
            steps=args.steps,
            batch=args.N * args.minibatch_size,
            minibatches=args.N,
            lag=args.lag,
            lag_updates=args.lag_updates,
            optimizer=args.optimizer,
            lr=args.lr,
            max_grad_norm=args.max_grad_norm,
            gradient=args.gradient,
            mismatch=mismatch,
            record_every=args.record_every,
            parameterization=args.parameterization,
            features=args.features,
            feature_rank=args.feature_rank,
        )


def _run_one(args) -> int:
    from simkit.train import TrainError, checkpoint_step, train
    from simkit.train.analysis import optimal_J

    if args.table is not None:
        check_table_file(args.table, "--table")
    if args.stop_after is not None and args.out is None:
        _error("--stop-after needs --out (the partial run is checkpointed there)")
    _check_int_options(args)
    if args.out is not None:
        check_output_directory(args.out, "--out")
    env = _environment(args)
    config = _train_config(args)
    if args.out is not None and Path(args.out).exists():
        try:
            done = checkpoint_step(args.out) if (Path(args.out) / "run.json").exists() else 0
        except TrainError:  # damaged: train() warns, resumes from an earlier one or restarts
            done = 0
        if done:
            print(f"resuming {args.out} from step {done}", file=sys.stderr)
    with usage_errors(TrainError, ValueError, FloatingPointError, rename=_as_typed):
        with _warnings_as_lines():  # a damaged checkpoint's fallback, as one line each
            table = train(
                env,
                config,
                seed=args.seed,
                out_dir=args.out,
                chunk_steps=args.chunk_steps,
                stop_after=args.stop_after,
                progress=not args.no_progress,
            )
    if args.table is not None:
        save_table(table, args.table)
    print(_run_report(table, config, env.J(), optimal_J(env)))
    return 0


def _warnings_as_lines():
    """A context in which warnings print as ``simkit: warning: …`` lines (no source line)."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def context():
        with warnings.catch_warnings():
            warnings.simplefilter("always", RuntimeWarning)
            warnings.showwarning = lambda message, *_, **__: print(
                f"simkit: warning: {message}", file=sys.stderr
            )
            yield

    return context()


def _run_report(table, config, J_start: float, J_star: float) -> str:
    """A few recorded rows (about ten, evenly spaced) and the run's summary."""
    import numpy as np

    from simkit.train.analysis import run_summary

    rec = table[table["recorded"]]
    lines = [
        f"{config.estimator.name}: N = {config.minibatches}, lag = {config.lag_in_updates} "
        f"updates, mismatch "
        f"{config.mismatch.label}; J(pi_0) = {J_start:.4f}, J* = {J_star:.4g}"
    ]
    if len(rec):
        idx = np.unique(np.linspace(0, len(rec) - 1, min(len(rec), 11)).round().astype(int))
        cols = ["step", "J", "cosine", "chi2_seq", "ess", "zero_frac", "grad_norm"]
        lines.append(table_text(rec.iloc[idx][cols]))
        s = run_summary(table.assign(run=0), "run", J_star=J_star).iloc[0]
        lines.append(
            f"steps {int(s.steps)}: J start {s.J_start:.4f}, final {s.J_final:.4f}, peak "
            f"{s.J_peak:.4f}, mean {s.J_mean:.4f}; "
            + ("COLLAPSED (lost more than half of its best gain)" if s.collapsed else "no collapse")
            + f"; failure label {s.failure} (largest KL_seq {s.kl_seq_max:.3g} nats)"
        )
    return "\n".join(lines)


# --- a config ----------------------------------------------------------------------------------


def _run_config(args) -> int:
    from simkit import config as _config
    from simkit import sweep
    from simkit.train.analysis import run_summary

    explicit = [
        k
        for k, default in RUN_DEFAULTS.items()
        if getattr(args, k, default) != default and k != "seed"
    ]
    if args.seed != 0:
        explicit.append("seed")
    if explicit:
        _error(
            f"--{explicit[0].replace('_', '-')} is a one-run option; a config file sets the "
            "runs itself (edit the config, or omit CONFIG for one run)"
        )
    with usage_errors(_config.ConfigError):
        cfg = _config.load_config(args.config)
    if not isinstance(cfg, _config.TrainSweepConfig):
        _error(
            f'{args.config} is an experiment sweep (no kind = "train"): run it with '
            "'simkit sweep' or 'simkit run'"
        )
    out = Path(args.out) if args.out is not None else Path("runs") / cfg.name
    summary = run_sweep_command(cfg, out, args)
    print(f"train: {summary}", file=sys.stderr)
    table = sweep.load_results(out, partial=True)
    if table.empty:
        return 1
    cells = _config.expand(cfg)
    setting = [k for k in cells[0].columns if len({c.columns[k] for c in cells}) > 1]
    by = ["cell", *setting] if setting else ["cell"]
    runs = run_summary(table, by)
    sweep.write_table(runs, out / "summary.csv")
    print(table_text(runs.drop(columns=["cell", "steps", "J_min_after_peak"])))
    print(f"summary written to {out / 'summary.csv'}", file=sys.stderr)
    return 0 if summary.failed == 0 else 1
