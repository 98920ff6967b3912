"""Learning curves under train–inference mismatch: token-TIS vs seq-MIS vs Geo-Mask vs VESPO.

rl-collapse (Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from
the training–inference mismatch") reports that token-level corrections (token TIS) still
collapse when the inference engine's μ differs from the trainer's π, while sequence-level
masking (seq-MIS, Geo-Mask) keeps training stable. This figure trains with μ served by an
emulated inference engine (:class:`simkit.train.Mismatch`) and no staleness (N = 1, lag 0), so
that the mismatch is the only source of off-policyness, with mismatch models that **grow with
the policy** (the error grows as the logits sharpen): a kernel error proportional to the logit
(``relative_noise``) and a routing-like error that grows as a row becomes deterministic
(``sharpness_noise``) on bf16 logits, sized so that the per-token KL(π‖μ) stays in the range
trainers log (1e-4 to 1e-2; the notes print the range reached).

The uncorrected loss (``naive``) is the **positive control**: the claim is judged under a
mismatch only if the control collapsed there in at least 6 of 8 seeds
(:func:`simkit.figures.staleness_curves.control_verdict`); otherwise the verdict is "not
testable in this setting", with the control's count.

Setting (full size): ``TokenMDP.at_least_k(V = 16, T = 32, k = 6)`` with tied parameters (as
``staleness_curves``), Adam (lr 0.3, gradient norm clipped to 1), 16 sequences per update
(2 GRPO groups of 8), 150 steps, exact J every 15, seeds 0–7.

The grid is ``configs/train_mismatch_curves.toml`` (:func:`sweep_config`); :func:`compute`
returns :class:`Data` with the notes: environment, sizes, seeds, the per-token KL reached, the
control's collapse count and the verdict, as measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit.config import TrainSweepConfig, mismatch_to_dict
from simkit.figures.staleness_curves import (
    FINAL_J_NOTE,
    check_grid,
    control_verdict,
    drift_note,
    environment_dict,
    environment_note,
    label_counts,
    ordering,
    plot_curves,
    recipe_legend,
    run_curves,
    schedule_note,
    split_figure,
    training_sweep,
)
from simkit.train import Mismatch
from simkit.train.recipes import recipe_label

NAME = "mismatch_curves"
TITLE = "Learning curves under train–inference mismatch (token-TIS, seq-MIS, Geo-Mask, VESPO)"
CAPTION = (
    "exact J(π) against the optimizer step for token-TIS (decoupled PPO × TIS), seq-MIS, "
    "Geo-Mask, VESPO and the uncorrected naive loss (the positive control) on a token MDP "
    "(at_least_k, V = 16, T = 32, tied parameters) when the rollouts come from an emulated "
    "inference engine whose error grows with the policy (no staleness: N = 1): relative logit "
    "noise, and bf16 logits + sharpness noise, sized to a per-token KL in the range trainers "
    "log. Mean over 8 seeds with the min–max band. The notes give the per-token KL reached, "
    "the control's collapse count and rl-collapse's claim as measured where the control "
    "collapsed, 'not testable in this setting' elsewhere."
)

#: rl-collapse: token-level corrections collapse, sequence-level masks stay stable
PAPER_TOKEN_LEVEL = ("tis",)
PAPER_SEQUENCE_LEVEL = ("mis", "geo_mask")


@dataclass(frozen=True)
class Config:
    """Environment, recipes, the mismatch models (one panel each), the schedule and seeds.
    ``mismatches`` holds :class:`~simkit.train.Mismatch` objects."""

    constructor: str = "at_least_k"
    V: int = 16
    T: int = 32
    env_kwargs: tuple = (("k", 6),)
    scale: float = 1.0
    env_seed: int = 0
    parameterization: str = "tied"
    recipes: tuple[str, ...] = ("tis", "mis", "geo_mask", "vespo", "naive")
    mismatches: tuple[Mismatch, ...] = (
        Mismatch(relative_noise=0.03),
        Mismatch(precision="bf16", sharpness_noise=0.2),
    )
    minibatches: int = 1
    minibatch_size: int = 16
    group_size: int = 8
    steps: int = 150
    lr: float = 0.3
    max_grad_norm: float | None = 1.0
    record_every: int = 15
    seeds: tuple[int, ...] = tuple(range(8))

    def __post_init__(self):
        check_grid(self.recipes, mismatches=self.mismatches, seeds=self.seeds)


def config(small: bool = False) -> Config:
    if small:
        return Config(
            V=6,
            T=10,
            env_kwargs=(),
            constructor="answer_correct",
            scale=2.0,
            parameterization="tabular",
            recipes=("tis", "mis", "vespo", "naive"),
            mismatches=(
                Mismatch(),
                Mismatch(precision="bf16", spike_prob=0.2, spike_strength=4.0),
            ),
            minibatch_size=16,
            steps=30,
            lr=0.05,
            record_every=5,
            seeds=(0, 1),
        )
    return Config()


def sweep_config(cfg: Config) -> TrainSweepConfig:
    """The training sweep of the figure (``configs/train_mismatch_curves.toml`` at full size):
    recipes × mismatch models × seeds, no staleness."""
    tables = {}
    if cfg.parameterization != "tabular":
        tables["parameterization"] = cfg.parameterization
    return training_sweep(
        cfg,
        NAME,
        minibatches=[cfg.minibatches],
        lr=cfg.lr,
        environment=environment_dict(cfg),
        mismatch=[mismatch_to_dict(m) for m in cfg.mismatches],
        **tables,
    )


def claim_verdict(runs: pd.DataFrame, label: str) -> str:
    """rl-collapse's claim under one mismatch (``runs``: the per-run rows there), from the
    data: "not testable in this setting" unless the positive control collapsed
    (:func:`~simkit.figures.staleness_curves.control_verdict`); else REPRODUCED when token-TIS
    collapsed in at least half of its seeds and every sequence-level mask ended ``ok`` in at
    least 75 % of theirs, NOT reproduced otherwise — with every recipe's label counts."""
    present = list(dict.fromkeys(runs["recipe"]))
    token = [r for r in PAPER_TOKEN_LEVEL if r in present]
    seq = [r for r in PAPER_SEQUENCE_LEVEL if r in present]
    head = (
        "rl-collapse's claim (token-level TIS collapses under mismatch, sequence-level "
        f"{', '.join(recipe_label(r) for r in seq) or 'masks'} do not) under '{label}'"
    )
    if not token or not seq:
        return f"{head}: not testable here (token-TIS or the sequence-level masks not run)."
    testable, control = control_verdict(runs)
    counts = "; ".join(
        f"{recipe_label(r)}: {label_counts(runs[runs['recipe'] == r])}" for r in present
    )
    if not testable:
        return f"{head}: not testable in this setting — {control}. Labels: {counts}."
    falls = all((runs[runs["recipe"] == t]["failure"] == "collapse").mean() >= 0.5 for t in token)
    holds = all((runs[runs["recipe"] == r]["failure"] == "ok").mean() >= 0.75 for r in seq)
    reproduced = falls and holds
    return (
        f"{head}: {'REPRODUCED' if reproduced else 'NOT reproduced'} — {control}; token-TIS "
        f"{'collapsed' if falls else 'did not collapse'} in ≥ half its seeds; sequence-level "
        f"masks {'stable' if holds else 'not stable'} (ok in ≥ 75 % of seeds). Labels: {counts}."
    )


def kl_tok_note(table: pd.DataFrame, order) -> str:
    """One note line: per mismatch, the per-token KL(π‖μ) reached (median and largest of the
    recorded values), against the range trainers log (1e-4 to 1e-2)."""
    rec = table[table["recorded"]]
    parts = []
    for label in order:
        kl = rec[rec["mismatch"] == label]["kl_tok"]
        inside = 1e-4 <= kl.median() and kl.max() <= 1e-2
        parts.append(
            f"'{label}' median {kl.median():.2g}, largest {kl.max():.2g}"
            + ("" if inside or label == "none" else " (outside that range)")
        )
    return "Per-token KL(π‖μ) reached (trainers log 1e-4 to 1e-2): " + "; ".join(parts) + "."


def paper_verdict(summary: pd.DataFrame, runs: pd.DataFrame, order: list[str]) -> list[str]:
    """Lines: the ordering under each mismatch (± SE, ties within 2 SE) and rl-collapse's
    claim under each mismatch with a non-zero error (:func:`claim_verdict`)."""
    lines = []
    for label in order:
        part = summary[summary["mismatch"] == label]
        lines.append(f"Final J, mismatch '{label}' (mean ± SE over seeds): {ordering(part)}.")
    for label in order:
        if label != "none":
            lines.append(claim_verdict(runs[runs["mismatch"] == label], label))
    return lines


@dataclass(frozen=True)
class Data:
    """``table`` (every step), ``curves`` (recorded J per recipe × mismatch × step: mean,
    min–max band, SE over seeds), ``runs`` (per run), ``summary`` (per recipe × mismatch),
    ``mismatch_order`` (panel order: the labels of ``config.mismatches``), ``J_star``,
    ``J_start`` and ``notes``."""

    config: Config
    table: pd.DataFrame
    curves: pd.DataFrame
    runs: pd.DataFrame
    summary: pd.DataFrame
    mismatch_order: tuple[str, ...]
    J_star: float
    J_start: float
    notes: tuple[str, ...]


def compute(cfg: Config, workers: int | None = None) -> Data:
    sweep = sweep_config(cfg)
    grid = run_curves(sweep, cfg.T, ["recipe", "mismatch"], workers)
    order = tuple(m.label for m in cfg.mismatches)
    notes = [
        environment_note(sweep, grid["J_start"], grid["J_star"]),
        schedule_note(sweep) + f" Staleness N = {cfg.minibatches}, no lag.",
        "Mismatch: μ = softmax of the trainer's logits θ + σ·ε + ρ·|θ − mean θ|·ε′ + σ_s·(1 − "
        "H/log V)·ε″ (fresh N(0, 1) draws every rollout; the last two grow as the policy "
        "sharpens), rounded to bf16 where stated, then toxic-tail spikes if any.",
        FINAL_J_NOTE,
        kl_tok_note(grid["table"], order),
        drift_note(grid["runs"], lambda row: f"under {row['mismatch']}"),
        *paper_verdict(grid["summary"], grid["runs"], list(order)),
    ]
    return Data(config=cfg, mismatch_order=order, notes=tuple(notes), **grid)


def draw(data: Data):
    order = list(data.mismatch_order)
    cols = len(order)
    fig, panels = split_figure(2.6 * cols + 1.3, 2.4, data.notes)
    axes = np.atleast_1d(panels.subplots(1, cols, sharey=True, squeeze=False)).ravel()
    for ax, label in zip(axes, order, strict=True):
        plot_curves(ax, data.curves, data.J_star, mismatch=label)
        ax.set_title("no mismatch" if label == "none" else label, fontsize=7)
        ax.set_xlabel("optimizer step")
    axes[0].set_ylabel("J(π) (exact)")
    recipe_legend(panels, axes[0])
    panels.suptitle(
        f"Inference mismatch: {data.config.constructor} (V = {data.config.V}, "
        f"T = {data.config.T}), N = {data.config.minibatches}, mean of "
        f"{len(data.config.seeds)} seeds, min–max band; dotted: J*",
        fontsize=8,
    )
    return fig
