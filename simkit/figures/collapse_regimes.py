"""Regime map of training failures: the failure label per recipe over (lr × lag) and (N × lag).

With asynchronous lag, many mini-batches and a large step the recipes separate (issue 16: GRPO
collapses at a long lag, N = 16, Adam lr 0.3 while dual clip does not). This figure maps where:
for each recipe (GRPO, VESPO, seq-MIS in bypass mode; token-TIS as decoupled PPO × TIS; the
uncorrected naive loss as the positive control) and each cell of two grids, the **failure
label** of :func:`simkit.train.analysis.failure_label` (collapse, premature determinism,
length blow-up, stall, ok) of 4 seeds (the most frequent label, ties to the more severe), the
number of runs flagged ``drift`` (KL_seq(π‖μ) > 10 nats: a flag, not a failure) and the
largest KL_seq reached. The lag L is counted in **optimizer updates** (``lag_updates``):
rollout r is sampled from θ_{max(rN − L, 0)}, so lag and staleness are separate axes.

Setting (full size): ``TokenMDP.at_least_k(V = 16, T = 32, k = 6)`` (J(π₀) ≈ 0.0034, J* = 1),
tabular policy, GRPO group advantage (G = 8), mini-batches of 16 sequences (rollout batch
N·16), Adam with gradient norm clipped to 1, 300 steps, exact J every 20 steps, seeds 0–3.
Grid A: lr ∈ {0.03, 0.3} × L ∈ {0, 128} at N = 16; grid B: N ∈ {4, 16} × L at lr 0.3. With 4
seeds the figure claims no ordering (its notes print the mean gains with ± SE and say so); it
maps labels. The runs are direct :func:`simkit.train.train` calls (a seed fixes every random
stream: all recipes see the same first rollout), on a process pool for large grids; the same
grid is the training sweep :func:`sweep_config` (``configs/train_collapse_regimes.toml``, whose
every cell is the run of :func:`_run`).
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pandas as pd

from simkit.config import TrainSweepConfig
from simkit.envs.token_mdp import TokenMDP
from simkit.figures.staleness_curves import (
    CONTROL,
    MIN_SEEDS,
    grid_panel,
    ordering,
    pool_size,
    seed_means,
    split_figure,
    training_sweep,
)
from simkit.train import TrainConfig, train
from simkit.train.analysis import (
    COLLAPSE_FRACTION,
    DETERMINISM_ENTROPY,
    FAILURE_LABELS,
    KL_SEQ_EXPLOSION,
    LENGTH_BLOWUP,
    STALL_GAIN,
    optimal_J,
    run_summary,
)
from simkit.train.recipes import (
    COMPOSED_RECIPES,
    RECIPES,
    composed_available,
    recipe,
    recipe_label,
)

NAME = "collapse_regimes"
TITLE = "Where training fails: failure label per recipe over (lr × lag) and (N × lag)"
CAPTION = (
    "failure label (collapse, premature determinism, length blow-up, stall, ok; most frequent "
    "of 4 seeds) of each recipe (GRPO, VESPO, seq-MIS in bypass mode, token-TIS as decoupled "
    "PPO × TIS, and the uncorrected naive loss as the positive control) after 300 Adam steps "
    "on a token MDP (at_least_k, V = 16, T = 32, k = 6), over learning rate × lag L (in "
    "optimizer updates) at N = 16 mini-batches (left) and N × L at lr 0.3 (right); each cell "
    "also gives the runs flagged drift (KL_seq > 10 nats, not a failure) and the largest "
    "KL_seq(π‖μ) reached. The notes give where recipes separate, the control's collapse count "
    "per cell and the mean gains ± SE (4 seeds: no ordering claimed)."
)

#: colour of each failure label
LABEL_COLORS = {
    "collapse": "#b2182b",
    "determinism": "#762a83",
    "length": "#e08214",
    "stall": "#999999",
    "ok": "#4d9221",
}
#: short cell text of each label
LABEL_SHORT = {
    "collapse": "coll",
    "determinism": "det",
    "length": "len",
    "stall": "stall",
    "ok": "ok",
}


@dataclass(frozen=True)
class Config:
    """Environment (``at_least_k`` sizes, ``env_seed``), ``recipes`` (keys of
    :data:`~simkit.train.recipes.RECIPES` or :data:`~simkit.train.recipes.COMPOSED_RECIPES`;
    composed ones are dropped, with a note, when composed estimators are unavailable), the grids
    (``lrs`` × ``lags`` at ``N_fixed``; ``Ns`` × ``lags`` at ``lr_fixed``; ``lags`` are L in
    optimizer updates, the table's ``lag`` column), the schedule and
    the ``seeds``."""

    V: int = 16
    T: int = 32
    k: int = 6
    env_seed: int = 0
    recipes: tuple[str, ...] = ("grpo", "vespo", "tis", "mis", "naive")
    lrs: tuple[float, ...] = (0.03, 0.3)
    lags: tuple[int, ...] = (0, 128)
    Ns: tuple[int, ...] = (4, 16)
    N_fixed: int = 16
    lr_fixed: float = 0.3
    minibatch_size: int = 16
    group_size: int = 8
    steps: int = 300
    max_grad_norm: float | None = 1.0
    record_every: int = 20
    seeds: tuple[int, ...] = (0, 1, 2, 3)

    def __post_init__(self):
        known = set(RECIPES)
        unknown = [r for r in self.recipes if r not in known]
        if unknown:
            raise ValueError(f"unknown recipe(s) {unknown}; available: {', '.join(known)}")
        for name in ("recipes", "lrs", "lags", "Ns", "seeds"):
            if not getattr(self, name):
                raise ValueError(f"{name} must be non-empty")
        if self.minibatch_size % self.group_size:
            raise ValueError(
                f"minibatch_size = {self.minibatch_size} must be a multiple of group_size = "
                f"{self.group_size}"
            )


def config(small: bool = False) -> Config:
    if small:
        return Config(
            V=6,
            T=8,
            k=3,
            recipes=("grpo", "vespo", "naive"),
            lrs=(0.1, 0.3),
            lags=(0, 4),
            Ns=(1, 4),
            N_fixed=4,
            minibatch_size=8,
            group_size=4,
            steps=24,
            record_every=4,
            seeds=(0, 1),
        )
    return Config()


def environment(cfg: Config) -> TokenMDP:
    return TokenMDP.at_least_k(V=cfg.V, T=cfg.T, k=cfg.k, seed=cfg.env_seed)


def sweep_config(cfg: Config) -> TrainSweepConfig:
    """The figure's grid as a training sweep (``configs/train_collapse_regimes.toml`` at full
    size): :func:`usable_recipes` × the two sub-grids of :func:`cells` (``[[grids]]``: lr × lag
    at N_fixed, N × lag at lr_fixed) × seeds, every run the :func:`_run` of the figure (same
    environment, TrainConfig and seed)."""
    return training_sweep(
        cfg,
        NAME,
        usable_recipes(cfg),
        minibatches=list(cfg.Ns),
        lag_updates=list(cfg.lags),
        lr=list(cfg.lrs),
        environment={
            "kind": "token_mdp",
            "constructor": "at_least_k",
            "V": cfg.V,
            "T": [cfg.T],
            "seed": cfg.env_seed,
            "kwargs": {"k": cfg.k},
        },
        grids=[
            {"lr": list(cfg.lrs), "lag_updates": list(cfg.lags), "minibatches": [cfg.N_fixed]},
            {"minibatches": list(cfg.Ns), "lag_updates": list(cfg.lags), "lr": [cfg.lr_fixed]},
        ],
    )


def usable_recipes(cfg: Config) -> tuple[str, ...]:
    """The recipes that this build can run (composed ones need issue 15's estimators)."""
    return tuple(r for r in cfg.recipes if r not in COMPOSED_RECIPES or composed_available())


def cells(cfg: Config) -> list[tuple[str, int, int, float]]:
    """Unique (grid, N, lag, lr) cells: grid ``"lr"`` (lr × lag at N_fixed) and ``"N"``
    (N × lag at lr_fixed); a cell of both grids is run once and appears in both."""
    out = {(cfg.N_fixed, lag, lr) for lr in cfg.lrs for lag in cfg.lags}
    out |= {(N, lag, cfg.lr_fixed) for N in cfg.Ns for lag in cfg.lags}
    return sorted(out)


def _run(args) -> pd.DataFrame:
    cfg, r, N, lag, lr, seed = args
    est = recipe(r, cfg.group_size)
    tc = TrainConfig(
        est,
        steps=cfg.steps,
        batch=N * cfg.minibatch_size,
        minibatches=N,
        lag_updates=lag,
        lr=lr,
        max_grad_norm=cfg.max_grad_norm,
        record_every=cfg.record_every,
    )
    table = train(environment(cfg), tc, seed=seed)
    table = table[table["recorded"]].drop(columns="estimator")
    return table.assign(recipe=r, N=N, lag=lag, lr=lr, seed=seed)


def run_grid(cfg: Config, workers: int | None = None) -> pd.DataFrame:
    """The recorded rows of every run (recipes × :func:`cells` × seeds), identical serially or
    on a pool of ``workers`` processes (default: every core, for a grid of at least
    :data:`simkit.figures.staleness_curves.PARALLEL_STEPS` steps:
    :func:`~simkit.figures.staleness_curves.pool_size`)."""
    jobs = [
        (cfg, r, N, lag, lr, seed)
        for r in usable_recipes(cfg)
        for N, lag, lr in cells(cfg)
        for seed in cfg.seeds
    ]
    n = pool_size(len(jobs), cfg.steps, workers)
    if n:
        with ProcessPoolExecutor(max_workers=n) as pool:
            frames = list(pool.map(_run, jobs, chunksize=1))
    else:
        frames = [_run(job) for job in jobs]
    return pd.concat(frames, ignore_index=True)


def majority(labels) -> str:
    """Most frequent label; ties go to the one first in :data:`FAILURE_LABELS`."""
    labels = list(labels)
    return max(FAILURE_LABELS, key=lambda lab: (labels.count(lab), -FAILURE_LABELS.index(lab)))


def cell_grid(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (recipe, N, lag, lr): the majority label, its count, the runs, every label's count,
    mean gain and J_final, the largest KL_seq reached."""
    rows = []
    for (r, N, lag, lr), g in runs.groupby(["recipe", "N", "lag", "lr"], sort=False):
        label = majority(g["failure"])
        row = dict(
            recipe=r,
            N=N,
            lag=lag,
            lr=lr,
            label=label,
            count=int((g["failure"] == label).sum()),
            runs=len(g),
            gain=float(g["gain"].mean()),
            J_final=float(g["J_final"].mean()),
            kl_seq_max=float(g["kl_seq_max"].max()),
            drift=int(g["drift"].sum()),
        )
        row.update({f"n_{lab}": int((g["failure"] == lab).sum()) for lab in FAILURE_LABELS})
        rows.append(row)
    return pd.DataFrame(rows)


def _fmt_cell(row) -> str:
    return f"N = {row.N}, L = {row.lag}, lr {row.lr:g}"


def verdict(grid: pd.DataFrame, cfg: Config, runs: pd.DataFrame | None = None) -> list[str]:
    """Lines, from the measurements: failures per recipe, where recipes separate, the drift
    and the drift flags, and (given the per-run ``runs``) the mean gains ± SE (ties within
    2 SE; not claimed under 8 seeds) and the positive control's collapses per cell."""
    lines = []
    per = []
    for r in dict.fromkeys(grid["recipe"]):
        g = grid[grid["recipe"] == r]
        counts = {lab: int(g[f"n_{lab}"].sum()) for lab in FAILURE_LABELS}
        total = int(g["runs"].sum())
        per.append(
            f"{recipe_label(r)}: "
            + ", ".join(f"{lab} {n}" for lab, n in counts.items() if n)
            + f" (of {total} runs)"
        )
    lines.append("Failure labels per recipe over both grids: " + "; ".join(per) + ".")
    key = ["N", "lag", "lr"]
    split = grid.groupby(key, sort=True)["label"].nunique()
    sep = split[split > 1]
    if len(sep):
        parts = []
        drift = grid.groupby(key, sort=True)["kl_seq_max"].max()
        for N, lag, lr in sorted(sep.index, key=lambda c: -drift[c]):  # most drift first
            c = grid[(grid.N == N) & (grid.lag == lag) & (grid.lr == lr)]
            parts.append(
                f"N = {N}, L = {lag}, lr {lr:g} ("
                + ", ".join(
                    f"{recipe_label(r)} {lab}" for r, lab in zip(c.recipe, c.label, strict=True)
                )
                + f"; KL_seq up to {c.kl_seq_max.max():.3g})"
            )
        lines.append(
            f"Recipes separate (different labels) in {len(sep)} of {len(split)} cells, most "
            "drift first: "
            + "; ".join(parts[:4])
            + (f"; … ({len(parts) - 4} more)" if len(parts) > 4 else "")
            + "."
        )
    else:
        lines.append("Recipes never separate: every cell has the same label for all recipes.")
    calm = grid[grid["kl_seq_max"] <= KL_SEQ_EXPLOSION]
    lines.append(
        f"Drift reached: largest KL_seq(π‖μ) {grid.kl_seq_max.max():.3g} nats "
        f"({_fmt_cell(grid.loc[grid.kl_seq_max.idxmax()])}); {len(calm)} of {len(grid)} "
        f"recipe cells stay ≤ {KL_SEQ_EXPLOSION:g} nats."
    )
    lines.append(f"Runs flagged drift (not a failure): {int(grid['drift'].sum())} of "
                 f"{int(grid['runs'].sum())}.")  # fmt: skip
    if runs is not None:
        per_seed = runs.groupby(["recipe", "seed"], sort=False)["gain"].mean().reset_index()
        gains = seed_means(per_seed.assign(collapsed=False), ["recipe"], ("gain",))
        lines.append(
            "Mean normalised final gain over all cells (mean ± SE over seeds of each seed's "
            "mean): " + ordering(gains, "gain", digits=2) + "."
        )
        if CONTROL in set(runs["recipe"]):
            parts = []
            for (N, lag, lr), g in runs.groupby(["N", "lag", "lr"], sort=True):
                c = int(((g["recipe"] == CONTROL) & (g["failure"] == "collapse")).sum())
                parts.append(f"{c}/{int((g['recipe'] == CONTROL).sum())} at N = {N}, L = {lag}, "
                             f"lr {lr:g}")  # fmt: skip
            lines.append(
                f"Positive control ({recipe_label(CONTROL)}, uncorrected) collapses per cell: "
                + "; ".join(parts)
                + f". A claim needs the control collapsed in ≥ 75 % of ≥ {MIN_SEEDS} seeds; "
                "this map judges none (it has fewer seeds)."
                if len(cfg.seeds) < MIN_SEEDS
                else f"Positive control ({recipe_label(CONTROL)}) collapses per cell: "
                + "; ".join(parts)
                + "."
            )
    return lines


@dataclass(frozen=True)
class Data:
    """``table`` (recorded rows of every run), ``runs`` (per run: :func:`run_summary` with
    ``gain`` and ``failure``), ``grid`` (per recipe × cell: :func:`cell_grid`), ``J_star``,
    ``J_start``, ``recipes`` (those run) and ``notes``."""

    config: Config
    table: pd.DataFrame
    runs: pd.DataFrame
    grid: pd.DataFrame
    J_star: float
    J_start: float
    recipes: tuple[str, ...]
    notes: tuple[str, ...]


def compute(cfg: Config, workers: int | None = None) -> Data:
    env = environment(cfg)
    J_star, J_start = optimal_J(env), env.J()
    table = run_grid(cfg, workers)
    runs = run_summary(table, ["recipe", "N", "lag", "lr", "seed"], J_star=J_star)
    grid = cell_grid(runs)
    used = usable_recipes(cfg)
    dropped = [r for r in cfg.recipes if r not in used]
    notes = [
        f"Environment: TokenMDP.at_least_k(V = {cfg.V}, T = {cfg.T}, k = {cfg.k}, seed = "
        f"{cfg.env_seed}); J(π₀) = {J_start:.4f}; J* = {J_star:.3g} (exact DP); tabular policy.",
        f"Adam (gradient norm clipped to {cfg.max_grad_norm}), mini-batches of "
        f"{cfg.minibatch_size} sequences (rollout batch N·{cfg.minibatch_size}), GRPO groups of "
        f"{cfg.group_size}, {cfg.steps} steps, exact J every {cfg.record_every}; seeds "
        + ", ".join(map(str, cfg.seeds))
        + f". Left: lr × lag L (optimizer updates) at N = {cfg.N_fixed}; right: N × L at lr "
        f"{cfg.lr_fixed:g}. Rollout r is sampled from θ_max(rN − L, 0): policy age L + j once "
        "rN ≥ L (j the mini-batch), j at L = 0.",
        f"Labels: collapse = reached {STALL_GAIN:.0%} of the achievable gain, then lost > "
        f"{COLLAPSE_FRACTION:.0%} of the best gain; det = entropy < {DETERMINISM_ENTROPY:.0%} "
        f"of the initial with normalised final gain < {STALL_GAIN:g}; len = E|y| > "
        f"{LENGTH_BLOWUP:g}× initial; stall = never reached {STALL_GAIN:.0%} of the achievable "
        f"gain; cell = most frequent of the seeds (count shown), d = runs flagged drift "
        f"(KL_seq(π‖μ) > {KL_SEQ_EXPLOSION:g} nats: a flag, not a failure), KL = largest "
        "KL_seq reached.",
        *verdict(grid, cfg, runs),
    ]
    if dropped:
        notes.append(
            "Not run (composed estimators of issue 15 unavailable in this build): "
            + ", ".join(recipe_label(r) for r in dropped)
            + "."
        )
    return Data(
        config=cfg,
        table=table,
        runs=runs,
        grid=grid,
        J_star=J_star,
        J_start=J_start,
        recipes=used,
        notes=tuple(notes),
    )


def _panel(ax, part: pd.DataFrame, rows, cols, row_key, col_key, fmt_row):
    from matplotlib.colors import ListedColormap

    labels = list(FAILURE_LABELS)
    grid_panel(
        ax,
        part,
        rows,
        cols,
        row_key,
        col_key,
        lambda c: labels.index(c["label"]),
        lambda c: (
            f"{LABEL_SHORT[c['label']]} {c['count']}/{c['runs']}\n"
            f"d{c['drift']} KL {c['kl_seq_max']:.2g}"
        ),
        lambda c: "white" if c["label"] in ("collapse", "determinism") else "black",
        cmap=ListedColormap([LABEL_COLORS[lab] for lab in labels]),
        vmin=-0.5,
        vmax=len(labels) - 0.5,
        fontsize=4.8,
        tick_fontsize=5.5,
        row_format=fmt_row,
    )


def draw(data: Data):
    from matplotlib.patches import Patch

    cfg, grid = data.config, data.grid
    recipes = list(data.recipes)
    fig, panels = split_figure(5.4, 1.25 * len(recipes) + 0.6, data.notes)
    axes = panels.subplots(len(recipes), 2, squeeze=False)
    for i, r in enumerate(recipes):
        g = grid[grid.recipe == r]
        a = g[g.N == cfg.N_fixed]
        a = a[a.lr.isin(cfg.lrs)]
        _panel(axes[i, 0], a, list(cfg.lrs), list(cfg.lags), "lr", "lag", lambda v: f"{v:g}")
        b = g[g.lr == cfg.lr_fixed]
        b = b[b.N.isin(cfg.Ns)]
        _panel(axes[i, 1], b, list(cfg.Ns), list(cfg.lags), "N", "lag", str)
        axes[i, 0].set_ylabel(f"{recipe_label(r)}\nlr", fontsize=6.5)
        axes[i, 1].set_ylabel("N", fontsize=6.5)
    axes[0, 0].set_title(f"lr × lag (N = {cfg.N_fixed})", fontsize=7)
    axes[0, 1].set_title(f"N × lag (lr {cfg.lr_fixed:g})", fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("lag L (optimizer updates)", fontsize=6.5)
    handles = [Patch(color=LABEL_COLORS[lab], label=lab) for lab in FAILURE_LABELS]
    panels.legend(handles=handles, loc="outside right center", fontsize=6, title="label")
    panels.suptitle(
        f"Failure regimes: at_least_k (V = {cfg.V}, T = {cfg.T}, k = {cfg.k}), "
        f"{cfg.steps} steps, {len(cfg.seeds)} seeds per cell",
        fontsize=8,
    )
    return fig
