"""Where training collapses: final J over staleness N × sequence length T, per recipe.

A map of the staleness experiment (:mod:`simkit.figures.staleness_curves`) over two axes:
the staleness N (rollout batch of N mini-batches updated in sequence, **zero lag**: the policy
age of mini-batch j is j) and the sequence length T, for each paper recipe
(:mod:`simkit.train.recipes`, with its mode) and the uncorrected loss (``naive``, the positive
control). Sequence-level weights multiply T token ratios, so their variance grows with T (like
(1+χ²)^T) while token-level corrections carry a bias that grows with T (rl-collapse); the map
shows where each recipe still learns.

Setting (full size): ``TokenMDP.answer_correct(V = 16, T ∈ {16, 64})`` (R = 1 iff the last
token is the answer: the task is equally hard at every T, and the T − 2 earlier positions only
add off-policy noise to the sequence ratio), tied parameters, N ∈ {4, 16}, no lag, Adam (lr
0.3, gradient norm clipped to 1), 16 sequences per update, 150 steps (a fixed budget, so that a
recipe slowed down by staleness shows), exact J every 15, seeds 0–7. The value of a cell is
the **normalised final gain** (J_final − J(π₀)) / (J* − J(π₀)) (1 = optimal, 0 = no progress,
< 0 = worse than the start), mean over seeds; ``×`` marks a cell where a run collapsed,
``s`` a cell where most runs stalled (never reached half of the achievable gain: such a
recipe is never called stable).

The grid is ``configs/train_collapse_map.toml`` (:func:`sweep_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from simkit.config import TrainSweepConfig
from simkit.figures import staleness_curves
from simkit.figures.staleness_curves import (
    claim_verdict,
    environment_dict,
    environment_note,
    ordering,
    run_grid,
    schedule_note,
    split_grid,
    training_sweep,
)
from simkit.train.analysis import (
    COLLAPSE_FRACTION,
    STALL_GAIN,
    TAIL_FRACTION,
    normalized_gain,
    optimal_J,
    run_summary,
)
from simkit.train.recipes import recipe_label

NAME = "collapse_map"
TITLE = "Final J over staleness N × length T, per recipe"
CAPTION = (
    "normalised final gain (J_final − J₀)/(J* − J₀) of each recipe (GRPO, VESPO, seq-MIS in "
    "bypass mode, token-TIS as decoupled PPO × TIS) and of the uncorrected naive loss (the "
    "positive control) after 150 Adam steps (lr 0.3, no lag: policy age of mini-batch j = j) "
    "on a token MDP (answer_correct, V = 16, tied parameters) over the staleness N (rows) and "
    "the sequence length T (columns), mean of 8 seeds; × marks a cell where a run collapsed, "
    "s a cell where most runs stalled. The notes give the ordering in the hardest cell (± SE, "
    "ties within 2 SE) and VESPO's claim there, judged only where the control collapsed."
)


@dataclass(frozen=True)
class Config:
    """Environment (``T`` is the tuple of lengths swept), recipes, staleness values, schedule
    and seeds (as :class:`simkit.figures.staleness_curves.Config`)."""

    constructor: str = "answer_correct"
    V: int = 16
    T: tuple[int, ...] = (16, 64)
    env_kwargs: tuple = ()
    scale: float = 1.0
    env_seed: int = 0
    parameterization: str = "tied"
    recipes: tuple[str, ...] = ("grpo", "vespo", "tis", "mis", "naive")
    staleness: tuple[int, ...] = (4, 16)
    lag_updates: int = 0
    minibatch_size: int = 16
    group_size: int = 8
    steps: int = 150
    lr: float = 0.3
    max_grad_norm: float | None = 1.0
    record_every: int = 15
    seeds: tuple[int, ...] = tuple(range(8))

    def __post_init__(self):
        staleness_curves.check_grid(
            self.recipes, staleness=self.staleness, T=self.T, seeds=self.seeds
        )


def config(small: bool = False) -> Config:
    if small:
        return Config(
            V=6,
            T=(4, 10),
            parameterization="tabular",
            recipes=("grpo", "vespo", "naive"),
            staleness=(1, 4),
            minibatch_size=16,
            steps=24,
            lr=0.05,
            record_every=4,
            seeds=(0,),
        )
    return Config()


def sweep_config(cfg: Config) -> TrainSweepConfig:
    """The training sweep of the figure (``configs/train_collapse_map.toml`` at full size):
    recipes × N × T × seeds at the lag ``cfg.lag_updates`` (optimizer updates)."""
    tables = {}
    if cfg.parameterization != "tabular":
        tables["parameterization"] = cfg.parameterization
    return training_sweep(
        cfg,
        NAME,
        minibatches=list(cfg.staleness),
        lr=cfg.lr,
        lag_updates=[cfg.lag_updates],
        environment=environment_dict(cfg),
        **tables,
    )


def cell_grid(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (recipe, N, T): mean ± SE over seeds of the normalised gain and of J_final, the
    number of collapsed runs and of ``collapse`` / ``stall`` labels
    (:func:`simkit.figures.staleness_curves.seed_means`)."""
    return staleness_curves.seed_means(runs, ["recipe", "N", "T"], ("gain",), ("J_final",))


def paper_verdict(grid: pd.DataFrame, runs: pd.DataFrame | None = None) -> list[str]:
    """Lines: the ordering in the hardest cell (± SE, ties within 2 SE), the lowest cell per
    recipe, the cells with a collapsed run and those where most runs stalled, and (given the
    per-run ``runs``) VESPO's claim in the hardest cell
    (:func:`simkit.figures.staleness_curves.claim_verdict`: judged only where the control
    collapsed)."""
    N_max, T_max = int(grid["N"].max()), int(grid["T"].max())
    hard = grid[(grid["N"] == N_max) & (grid["T"] == T_max)]
    lines = [f"Normalised final gain at N = {N_max}, T = {T_max} (mean ± SE): "
             f"{ordering(hard, 'gain', digits=2)}."]  # fmt: skip
    worst = grid.loc[grid.groupby("recipe", sort=False)["gain"].idxmin()]
    lines.append(
        "Lowest cell per recipe: "
        + "; ".join(
            f"{recipe_label(r)} {g:.2f} (N = {n}, T = {t})"
            for r, g, n, t in zip(
                worst["recipe"], worst["gain"], worst["N"], worst["T"], strict=True
            )
        )
        + "."
    )
    col = grid[grid["collapsed"] > 0]
    if len(col):
        lines.append(
            "Cells with a collapsed run: "
            + "; ".join(
                f"{recipe_label(r)} (N = {n}, T = {t})"
                for r, n, t in zip(col["recipe"], col["N"], col["T"], strict=True)
            )
            + "."
        )
    else:
        lines.append(
            f"No run collapsed (none lost more than {COLLAPSE_FRACTION:.0%} of its best gain)."
        )
    if "stall" in grid:
        stalled = grid[2 * grid["stall"] > grid["runs"]]
        lines.append(
            f"Cells where most runs stalled (never reached {STALL_GAIN:.0%} of the achievable "
            "gain: neither stable nor collapsed): "
            + (
                "; ".join(
                    f"{recipe_label(r)} (N = {n}, T = {t})"
                    for r, n, t in zip(stalled["recipe"], stalled["N"], stalled["T"], strict=True)
                )
                or "none"
            )
            + "."
        )
    if runs is not None:
        part = runs[(runs["N"] == N_max) & (runs["T"] == T_max)]
        lines.append(claim_verdict(part, f"N = {N_max}, T = {T_max}"))
    return lines


@dataclass(frozen=True)
class Data:
    """``table`` (every step), ``runs`` (per run, with ``J_star`` and the normalised
    ``gain``), ``grid`` (per recipe × N × T: :func:`cell_grid`), ``J_star`` and ``J_start``
    per T (dicts) and ``notes``."""

    config: Config
    table: pd.DataFrame
    runs: pd.DataFrame
    grid: pd.DataFrame
    J_star: dict
    J_start: dict
    notes: tuple[str, ...]


def compute(cfg: Config, workers: int | None = None) -> Data:
    sweep = sweep_config(cfg)
    table = run_grid(sweep, workers)
    envs = {T: sweep.environment.build(T) for T in cfg.T}
    J_star = {T: optimal_J(env) for T, env in envs.items()}
    J_start = {T: env.J() for T, env in envs.items()}
    runs = run_summary(table.assign(J_star=table["T"].map(J_star)), ["recipe", "N", "T", "seed"])
    runs["J_star"] = runs["T"].map(J_star)
    runs["gain"] = normalized_gain(runs["J_final"], runs["J_start"], runs["J_star"])
    grid = cell_grid(runs)
    notes = (
        environment_note(sweep, J_start, J_star),
        schedule_note(sweep),
        "Cell value: normalised final gain (J_final − J(π₀)) / (J* − J(π₀)), J_final = mean "
        f"exact J over the last {TAIL_FRACTION:.0%} of the steps; × = a run lost more than "
        f"{COLLAPSE_FRACTION:.0%} of its best gain after reaching {STALL_GAIN:.0%} of the "
        "achievable gain; s = most runs stalled (never reached it).",
        staleness_curves.age_note(table, ["N"]),
        staleness_curves.drift_note(runs, lambda row: f"at N = {row['N']}, T = {row['T']}"),
        *paper_verdict(grid, runs),
    )
    return Data(
        config=cfg,
        table=table,
        runs=runs,
        grid=grid,
        J_star=J_star,
        J_start=J_start,
        notes=notes,
    )


def draw(data: Data):
    recipes = list(dict.fromkeys(data.grid["recipe"]))
    Ns = sorted(data.grid["N"].unique())
    Ts = sorted(data.grid["T"].unique())
    fig, panels, axes, _ = split_grid(len(recipes), data.notes, (2.3, 2.0), (0.9, 0.4))
    image = None
    for ax, r in zip(axes, recipes, strict=False):
        part = data.grid[data.grid["recipe"] == r]

        def text(cell):
            stalled = "stall" in cell and 2 * cell["stall"] > cell["runs"]  # none without labels
            return (
                f"{cell['gain']:.2f}"
                + (" ×" if cell["collapsed"] > 0 else "")
                + (" s" if stalled else "")
            )

        image = staleness_curves.grid_panel(
            ax,
            part,
            Ns,
            Ts,
            "N",
            "T",
            lambda cell: cell["gain"],
            text,
            lambda cell: "white" if cell["gain"] < 0.55 else "black",
            cmap="viridis",
            vmin=0.0,
            vmax=1.0,
            fontsize=6,
        )
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("staleness N")
        ax.set_title(recipe_label(r), fontsize=7)
    if image is not None:
        panels.colorbar(image, ax=list(axes[: len(recipes)]), shrink=0.8, label="normalised gain")
    panels.suptitle(
        f"Final J over (N, T): {data.config.constructor} (V = {data.config.V}), "
        f"{data.config.steps} steps, mean of {len(data.config.seeds)} seed(s); × collapse, "
        "s most stalled",
        fontsize=8,
    )
    return fig
