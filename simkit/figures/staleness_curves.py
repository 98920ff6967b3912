"""Learning curves under staleness N: the synthetic counterpart of VESPO's Fig. 3.

VESPO (Shen et al., arXiv 2602.10693, §5 and Fig. 3) trains with a rollout batch split into N
mini-batches updated in sequence (staleness N = global batch / mini batch) and reports that
VESPO stays stable up to N = 64 while GRPO, GSPO and SAPO collapse. This figure runs the same
schedule in a world where J and ∇J are exact: a tabular policy on a token MDP
(:mod:`simkit.train`), each paper's recipe (:mod:`simkit.train.recipes`: mapping ×
aggregation, GRPO group advantage), N ∈ {1, 4, 8, 16, 32, 64}, several seeds.

Setting (full size): ``TokenMDP.at_least_k(V = 32, T = 64, k = 6)`` (R = 1 iff token 0 occurs
at least 6 times; J(π₀) ≈ 0.003, J* = 1), asynchronous lag of 8 policy versions, Adam (lr 0.3,
gradient norm clipped to 1) — a corner of the ``collapse_regimes`` map, whose notes list
from its data the cells where the recipes' labels differ (issue 16's review measured
KL_seq ≤ 5.4 nats at the earlier lag 0, lr 0.03), mini-batch
of m = 32 sequences (4 groups of G = 8) per update and rollout batch N·m, so that every N takes
the same 1000 updates on the same number of samples and only the staleness changes; J exact
every 10 steps; seeds 0, 1, 2 (a seed fixes the run's random streams; without lag — the small
test configuration — the N = 1 runs of every recipe are the on-policy REINFORCE curve, bit for
bit among recipes with the same aggregation, to rounding between token-mean and
seq-mean-token-mean, which give every token of these fixed-length sequences the same weight
1/(m·T) computed in another order).

The grid is a :class:`simkit.config.TrainSweepConfig` (:func:`sweep_config`;
``configs/train_staleness_curves.toml`` is the same grid, so ``simkit sweep`` reproduces the
data bit for bit) run on all cores. :func:`compute` returns :class:`Data`: the per-step table,
the curves with their min–max bands over seeds, one summary row per run
(:func:`simkit.train.analysis.run_summary`: final, peak and mean J, collapse) and per
(recipe, N), and ``notes``: the environment, sizes, seeds and the measured ordering against the
paper's claim, whichever way it goes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit.config import TrainSweepConfig
from simkit.figures import _common, style
from simkit.sweep import run_config
from simkit.train.analysis import (
    COLLAPSE_FRACTION,
    KL_SEQ_EXPLOSION,
    TAIL_FRACTION,
    band,
    optimal_J,
    run_summary,
)
from simkit.train.recipes import RECIPES, recipe_entry, recipe_label, recipe_of

NAME = "staleness_curves"
TITLE = "Learning curves under staleness N (synthetic VESPO Fig. 3)"
CAPTION = (
    "exact J(π) against the optimizer step for the GRPO, GSPO, SAPO, VESPO, token-TIS and "
    "seq-MIS recipes on a token MDP (at_least_k, V = 32, T = 64, J* = 1), one panel per "
    "staleness N (a rollout batch of N mini-batches of 32 sequences, updated in sequence; "
    "asynchronous lag 8, Adam, lr 0.3: a setting taken from the collapse_regimes map, whose "
    "notes list the cells where recipes separate), mean over 3 seeds with the min–max band. "
    "The notes state the drift reached and whether the "
    "paper's ordering (VESPO stable to N = 64 while GRPO, GSPO and SAPO collapse) is reproduced "
    "here, as measured."
)

#: the recipes whose collapse VESPO reports (Fig. 3), and VESPO itself
PAPER_COLLAPSING = ("grpo", "gspo", "sapo")
PAPER_STABLE = "vespo"
#: a grid with at least this many steps in total runs on a process pool
PARALLEL_STEPS = 20_000
#: the note line that defines final J and collapse (training curve figures)
FINAL_J_NOTE = (
    f"Final J = mean exact J over the last {TAIL_FRACTION:.0%} of the steps; a run "
    f"'collapsed' if it lost more than {COLLAPSE_FRACTION:.0%} of its best gain."
)


@dataclass(frozen=True)
class Config:
    """The environment (``constructor``, ``V``, ``T``, ``env_kwargs``, ``scale``,
    ``env_seed``: a :class:`~simkit.config.TokenMDPConfig`), the ``recipes``, the
    ``staleness`` values N, the mini-batch size m (rollout batch N·m), the GRPO
    ``group_size``, the asynchronous ``lag``, the optimizer (Adam, ``lr``, ``max_grad_norm``),
    ``steps``,
    ``record_every`` and the ``seeds``."""

    constructor: str = "at_least_k"
    V: int = 32
    T: int = 64
    env_kwargs: tuple = (("k", 6),)
    scale: float = 1.0
    env_seed: int = 0
    recipes: tuple[str, ...] = ("grpo", "gspo", "sapo", "vespo", "tis", "mis")
    staleness: tuple[int, ...] = (1, 4, 8, 16, 32, 64)
    minibatch_size: int = 32
    group_size: int = 8
    lag: int = 8
    steps: int = 1000
    lr: float = 0.3
    max_grad_norm: float | None = 1.0
    record_every: int = 10
    seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self):
        check_grid(self.recipes, staleness=self.staleness, seeds=self.seeds)


def check_grid(recipes, **axes) -> None:
    """Validate a training figure's grid: every recipe known (:data:`simkit.train.RECIPES`),
    ``recipes`` and every other axis (name=values) non-empty, and the ``staleness`` values N
    (when given) ≥ 1; shared by the training figures."""
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown}; available: {', '.join(RECIPES)}")
    empty = [name for name, values in {"recipes": recipes, **axes}.items() if not values]
    if empty:
        raise ValueError(f"{', '.join(empty)} must be non-empty")
    if "staleness" in axes and min(axes["staleness"]) < 1:
        raise ValueError(f"staleness values N must be >= 1, got {axes['staleness']}")


def config(small: bool = False) -> Config:
    if small:
        return Config(
            V=8,
            T=12,
            env_kwargs=(("k", 3),),
            recipes=("grpo", "vespo", "tis"),
            staleness=(1, 4),
            minibatch_size=16,
            steps=40,
            lr=0.05,
            lag=0,
            record_every=4,
            seeds=(0, 1),
        )
    return Config()


def environment_dict(cfg) -> dict:
    """The ``[environment]`` table of a figure config (token MDP at one or more T)."""
    T = list(cfg.T) if isinstance(cfg.T, tuple) else [cfg.T]
    d = {
        "kind": "token_mdp",
        "constructor": cfg.constructor,
        "V": cfg.V,
        "T": T,
        "seed": cfg.env_seed,
        "scale": cfg.scale,
    }
    if cfg.env_kwargs:
        d["kwargs"] = dict(cfg.env_kwargs)
    return d


def training_sweep(cfg, name: str, recipes=None, **tables) -> TrainSweepConfig:
    """The training sweep of a training figure's ``cfg``: its schedule (``steps``,
    ``minibatch_size``, Adam, ``record_every``, ``max_grad_norm`` unless None), ``seeds``,
    one estimator per recipe of ``recipes`` (default ``cfg.recipes``) with GRPO groups of
    ``cfg.group_size`` (:func:`simkit.train.recipes.recipe_entry`), and the keys in ``tables``
    (``environment``, ``lr``, ``minibatches``, ``lag``, ``mismatch``, ``grids`` …), named
    ``name``."""
    d = {
        "kind": "train",
        "name": name,
        "steps": cfg.steps,
        "minibatch_size": cfg.minibatch_size,
        **tables,
        "optimizer": "adam",
        "record_every": cfg.record_every,
        "seeds": list(cfg.seeds),
        "estimators": [
            recipe_entry(r, cfg.group_size) for r in (cfg.recipes if recipes is None else recipes)
        ],
    }
    if cfg.max_grad_norm is not None:
        d["max_grad_norm"] = cfg.max_grad_norm
    return TrainSweepConfig.from_dict(d)


def sweep_config(cfg: Config, name: str = NAME) -> TrainSweepConfig:
    """The training sweep of the figure (``configs/train_staleness_curves.toml`` at full size):
    recipes × staleness N × seeds on ``environment_dict(cfg)``. ``collapse_map`` reuses it
    (its Config has the same fields, with T swept) under its own ``name``."""
    return training_sweep(
        cfg,
        name,
        minibatches=list(cfg.staleness),
        lr=cfg.lr,
        lag=[cfg.lag],
        environment=environment_dict(cfg),
    )


def pool_size(runs: int, steps: int, workers: int | None = None) -> int | None:
    """How many worker processes a training figure's grid of ``runs`` runs of ``steps`` steps
    each runs on: ``workers`` (default: every core), at most one per run, when the grid has
    at least :data:`PARALLEL_STEPS` steps in total and more than one run and one worker;
    else None (serial)."""
    n = workers or os.cpu_count() or 1
    if n > 1 and runs > 1 and runs * steps >= PARALLEL_STEPS:
        return min(n, runs)
    return None


def run_grid(sweep: TrainSweepConfig, workers: int | None = None) -> pd.DataFrame:
    """Every run of ``sweep`` (:func:`simkit.sweep.run_config`), on a process pool of
    ``workers`` (default: every core) when the grid has at least :data:`PARALLEL_STEPS` steps
    in total, else serially — the table is identical either way. Adds the ``recipe`` column
    (:func:`simkit.train.recipes.recipe_of`, None for a non-recipe estimator)."""
    pool = pool_size(sum(1 for _ in sweep.runs()), sweep.steps, workers)
    table = run_config(
        sweep, progress=False, backend="processes" if pool else "serial", workers=pool
    )
    lookup = {}
    for ec in sweep.estimators:
        for est in ec.build():
            corr = None if est.correction is None else est.correction.name
            lookup[est.name] = recipe_of(est.mapping.name, est.aggregation, corr)
    table.insert(0, "recipe", table["estimator"].map(lookup))
    return table


def environment_note(sweep: TrainSweepConfig, J_start, J_star) -> str:
    """One line: the environment, its size, J(π₀) and J* (numbers, or {T: value} dicts when
    the sweep has several lengths)."""
    env = sweep.environment
    kwargs = ", ".join(f"{k} = {v}" for k, v in env.kwargs)
    Ts = ", ".join(str(T) for T in env.T)

    def fmt(value, spec):
        if isinstance(value, dict):
            return ", ".join(f"{format(v, spec)} (T = {T})" for T, v in value.items())
        return format(value, spec)

    return (
        f"Environment: TokenMDP.{env.constructor}(V = {env.V}, T = {Ts}"
        f"{', ' + kwargs if kwargs else ''}, seed = {env.seed}, scale = {env.scale:g}); "
        f"J(π₀) = {fmt(J_start, '.3f')}; J* = {fmt(J_star, '.3g')} (exact DP)."
    )


def schedule_note(sweep: TrainSweepConfig) -> str:
    """One line: optimizer, batch sizes, steps, recording and seeds."""
    size = (
        f"mini-batch of {sweep.minibatch_size} sequences per update, rollout batch N·"
        f"{sweep.minibatch_size}"
        if sweep.minibatch_size is not None
        else f"rollout batch {sweep.batch} split into N mini-batches"
    )
    clip = f", gradient norm clipped to {sweep.max_grad_norm:g}" if sweep.max_grad_norm else ""
    lrs = ", ".join(f"{lr:g}" for lr in sweep.lr)
    seeds = ", ".join(str(s) for s in sweep.seeds)
    return (
        f"{sweep.optimizer.capitalize()} (lr {lrs}{clip}); {size}; asynchronous lag "
        f"{', '.join(str(k) for k in sweep.lag)} rollout(s); {sweep.steps} steps, exact J "
        f"every {sweep.record_every}; seeds {seeds} (a seed fixes a run's random streams)."
    )


def drift_note(runs: pd.DataFrame, where) -> str:
    """One note line: the drift the runs reached — the largest KL_seq(π‖μ) at a recorded step
    (and its run: ``where(row)`` gives the setting, e.g. "at N = 64"), the median over runs of
    each run's largest, and how many runs exceeded :data:`KL_SEQ_EXPLOSION`."""
    row = runs.loc[runs["kl_seq_max"].idxmax()]
    over = int((runs["kl_seq_max"] > KL_SEQ_EXPLOSION).sum())
    return (
        f"Drift reached: largest KL_seq(π‖μ) at a recorded step {row['kl_seq_max']:.3g} nats "
        f"({recipe_label(row['recipe'])} {where(row)}); median of the runs' largest "
        f"{runs['kl_seq_max'].median():.3g} nats; {over} of {len(runs)} runs above "
        f"{KL_SEQ_EXPLOSION:g} nats."
    )


def seed_means(runs: pd.DataFrame, by, with_se, means=()) -> pd.DataFrame:
    """One row per group of ``by`` (in order of appearance) of the per-run table ``runs``:
    the mean over seeds of every column of ``with_se`` and of ``means``, the number of
    ``collapsed`` runs and of ``runs``, then ``<c>_se`` = sd/√runs for each c of ``with_se``
    (NaN with one seed)."""
    g = runs.groupby(list(by), sort=False)
    aggs = {}
    for c in with_se:
        aggs[c] = (c, "mean")
        aggs[f"{c}_sd"] = (c, "std")
    aggs.update({c: (c, "mean") for c in means})
    out = g.agg(**aggs, collapsed=("collapsed", "sum"), runs=(with_se[0], "size")).reset_index()
    for c in with_se:
        out[f"{c}_se"] = out.pop(f"{c}_sd") / np.sqrt(out["runs"])
    out["collapsed"] = out["collapsed"].astype(int)
    return out


def summarize(runs: pd.DataFrame, by) -> pd.DataFrame:
    """Per group of ``by``: mean and SE over seeds of J_final and J_mean, collapsed runs
    (:func:`seed_means`)."""
    return seed_means(runs, by, ("J_final", "J_mean"))


def ranking(summary: pd.DataFrame, column: str = "J_final", digits: int = 3) -> str:
    """``"A 0.990 ± 0.010 > B 0.950 ± 0.020 > …"``: the recipes of ``summary`` by ``column``
    (mean over seeds) ± ``<column>_se`` (left out where not finite), best first, ``digits``
    decimals."""
    rows = summary.sort_values(column, ascending=False)
    return " > ".join(
        f"{recipe_label(r)} {m:.{digits}f}" + (f" ± {s:.{digits}f}" if np.isfinite(s) else "")
        for r, m, s in zip(rows["recipe"], rows[column], rows[f"{column}_se"], strict=True)
    )


def collapse_line(summary: pd.DataFrame, where) -> str:
    """One note line: the summary rows with collapsed runs — "<recipe> <where(row)> (c/k seeds)"
    — or that no run collapsed. ``summary`` has ``recipe``, ``collapsed`` and ``runs`` columns
    (:func:`summarize`); ``where`` maps a row (namedtuple) to its setting, e.g. "at N = 64"."""
    col = summary[summary["collapsed"] > 0]
    if len(col):
        parts = [
            f"{recipe_label(row.recipe)} {where(row)} ({row.collapsed}/{row.runs} seeds)"
            for row in col.itertuples(index=False)
        ]
        return "Collapsed runs: " + "; ".join(parts) + "."
    return f"No run collapsed (none lost more than {COLLAPSE_FRACTION:.0%} of its best gain in J)."


def paper_verdict(summary: pd.DataFrame) -> list[str]:
    """Lines comparing the measured collapses and ordering with VESPO's claim."""
    Ns = sorted(summary["N"].unique())
    N_max = Ns[-1]
    present = set(summary["recipe"])
    lines = []
    at_max = summary[summary["N"] == N_max]
    lines.append(f"Final J at N = {N_max} (mean ± SE over seeds): {ranking(at_max)}.")
    lines.append(
        f"Mean J over the run (learning speed) at N = {N_max}: {ranking(at_max, 'J_mean')}."
    )
    lines.append(collapse_line(summary, lambda row: f"at N = {row.N}"))
    if PAPER_STABLE in present and present & set(PAPER_COLLAPSING):
        stable = summary[(summary["recipe"] == PAPER_STABLE)]["collapsed"].sum() == 0
        others = [r for r in PAPER_COLLAPSING if r in present]
        collapsing = {r: int(at_max[at_max["recipe"] == r]["collapsed"].sum()) > 0 for r in others}
        v = at_max[at_max["recipe"] == PAPER_STABLE].iloc[0]
        beats = []
        for r in others:
            o = at_max[at_max["recipe"] == r].iloc[0]
            se = math.hypot(v["J_final_se"], o["J_final_se"])
            beats.append(bool(v["J_final"] - o["J_final"] > 2 * se))
        reproduced = stable and all(collapsing.values())
        names = ", ".join(recipe_label(r) for r in others)
        lines.append(
            f"Paper's claim (VESPO stable to N = 64 while {names} collapse): "
            + ("REPRODUCED" if reproduced else "NOT reproduced")
            + f" here — VESPO {'never collapsed' if stable else 'collapsed'}; "
            + "; ".join(
                f"{recipe_label(r)} {'collapsed' if c else 'did not collapse'} at N = {N_max}"
                for r, c in collapsing.items()
            )
            + f"; VESPO's final J at N = {N_max} exceeds "
            + (
                ", ".join(recipe_label(r) for r, b in zip(others, beats, strict=True) if b)
                or "none of them"
            )
            + " by more than 2 SE."
        )
    return lines


@dataclass(frozen=True)
class Data:
    """What :func:`compute` returns.

    ``table``: every step of every run (cell columns, ``recipe``, :data:`simkit.train.COLUMNS`);
    ``curves``: recorded J per (recipe, N, step): mean, min–max (``lo``/``hi``), SE over seeds;
    ``runs``: :func:`~simkit.train.analysis.run_summary` per (recipe, N, seed); ``summary``:
    per (recipe, N) mean ± SE of J_final and J_mean, collapsed runs; ``J_star``, ``J_start``;
    ``notes``: the lines printed under the figure.
    """

    config: Config
    table: pd.DataFrame
    curves: pd.DataFrame
    runs: pd.DataFrame
    summary: pd.DataFrame
    J_star: float
    J_start: float
    notes: tuple[str, ...]


def run_curves(sweep: TrainSweepConfig, T: int, by, workers: int | None = None) -> dict:
    """Run ``sweep`` (:func:`run_grid`; one length ``T``) and summarise it over the columns
    ``by`` (e.g. ``["recipe", "N"]``). Returns the fields that a learning-curve figure's
    ``Data`` (this module's, :class:`simkit.figures.mismatch_curves.Data`) takes from its runs:
    ``table``; ``curves``, the recorded J with its band over seeds
    (:func:`~simkit.train.analysis.band`); ``runs``, one row per run
    (:func:`~simkit.train.analysis.run_summary`); ``summary``, one per group
    (:func:`summarize`); ``J_star`` and ``J_start``, J* and J(π₀) of the environment
    (exact)."""
    table = run_grid(sweep, workers)
    env = sweep.environment.build(T)
    runs = run_summary(table, [*by, "seed"])
    return {
        "table": table,
        "curves": band(table, list(by)),
        "runs": runs,
        "summary": summarize(runs, by),
        "J_star": optimal_J(env),
        "J_start": env.J(),
    }


def compute(cfg: Config, workers: int | None = None) -> Data:
    sweep = sweep_config(cfg)
    grid = run_curves(sweep, cfg.T, ["recipe", "N"], workers)
    notes = (
        environment_note(sweep, grid["J_start"], grid["J_star"]),
        schedule_note(sweep),
        FINAL_J_NOTE,
        drift_note(grid["runs"], lambda row: f"at N = {row['N']}"),
        *paper_verdict(grid["summary"]),
    )
    return Data(config=cfg, notes=notes, **grid)


def recipe_style(recipe: str, **overrides) -> dict:
    """Line style of a recipe: the house style of its mapping, labelled with the recipe."""
    mapping = RECIPES[recipe].mapping
    kwargs = style.line_kwargs(mapping, **overrides)
    kwargs["label"] = recipe_label(recipe)
    return kwargs


def wrapped_notes(notes, width: int) -> str:
    """The notes wrapped at ``width`` characters, one paragraph per note."""
    import textwrap

    return "\n".join(textwrap.fill(line, width) for line in notes)


def split_figure(width: float, panels_height: float, notes):
    """A figure of two stacked subfigures: the panels, and under them the ``notes`` as small
    text (the notes' height is sized to their wrapped line count). Returns ``(fig, panels)``."""
    text = wrapped_notes(notes, int(width * 20))
    notes_height = 0.105 * (text.count("\n") + 1) + 0.1
    fig = _common.new_figure(width, panels_height + notes_height)
    panels, bottom = fig.subfigures(2, 1, height_ratios=[panels_height, notes_height])
    bottom.text(0.01, 0.98, text, ha="left", va="top", fontsize=5.6, color="0.2")
    return fig, panels


def split_grid(n: int, notes, panel_size, margins, max_cols: int = 3, **subplot_kw):
    """:func:`split_figure` with ``n`` panels on a grid of at most ``max_cols`` columns:
    ``panel_size`` = (width, height) of a panel and ``margins`` = (width, height) added to the
    panels' area, in inches; the axes beyond ``n`` are hidden. Returns ``(fig, panels, axes,
    (rows, cols))`` with ``axes`` flat, row by row."""
    cols = min(max_cols, n)
    rows = math.ceil(n / cols)
    width = panel_size[0] * cols + margins[0]
    fig, panels = split_figure(width, panel_size[1] * rows + margins[1], notes)
    axes = panels.subplots(rows, cols, squeeze=False, **subplot_kw).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, panels, axes, (rows, cols)


def plot_band(ax, recipe: str, x, mean, lo, hi) -> None:
    """A recipe's learning curve: ``mean`` against ``x`` in the recipe's style
    (:func:`recipe_style`, width 1.2) over a band from ``lo`` to ``hi`` of the same colour."""
    (line,) = ax.plot(x, mean, **recipe_style(recipe, linewidth=1.2))
    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, lw=0)


def plot_curves(ax, curves: pd.DataFrame, J_star: float, **where) -> None:
    """Every recipe's mean J with its min–max band (:func:`plot_band`) from the rows of
    ``curves`` (:func:`simkit.train.analysis.band`) where each column of ``where`` has the
    given value, in the order the recipes first appear; a dotted line at ``J_star``."""
    for r in dict.fromkeys(curves["recipe"]):
        keep = curves["recipe"] == r
        for column, value in where.items():
            keep &= curves[column] == value
        part = curves[keep]
        plot_band(ax, r, part["step"].to_numpy(float), part["mean"], part["lo"], part["hi"])
    ax.axhline(J_star, color="0.4", linewidth=0.6, linestyle=":")


def recipe_legend(panels, ax) -> None:
    """The legend of the recipes drawn in ``ax``, outside ``panels`` on the right."""
    panels.legend(
        *ax.get_legend_handles_labels(),
        loc="outside right center",
        fontsize=6.5,
        title="recipe",
        title_fontsize=7,
    )


def draw(data: Data):
    Ns = list(dict.fromkeys(sorted(data.curves["N"].unique())))
    fig, panels, axes, (rows, cols) = split_grid(
        len(Ns), data.notes, (2.6, 2.0), (1.2, 0.4), sharex=True, sharey=True
    )
    for ax, N in zip(axes, Ns, strict=False):
        plot_curves(ax, data.curves, data.J_star, N=N)
        ax.set_title(f"N = {N}" + (" (on-policy)" if N == 1 else ""))
    for ax in axes[(rows - 1) * cols :]:
        ax.set_xlabel("optimizer step")
    for ax in axes[::cols]:
        ax.set_ylabel("J(π) (exact)")
    recipe_legend(panels, axes[0])
    seeds = len(data.config.seeds)
    panels.suptitle(
        f"Staleness N: {data.config.constructor} (V = {data.config.V}, T = {data.config.T}), "
        f"mean of {seeds} seeds, min–max band; dotted: J*",
        fontsize=8,
    )
    return fig
