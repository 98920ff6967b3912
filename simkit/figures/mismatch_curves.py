"""Learning curves under train–inference mismatch: token-TIS vs seq-MIS vs Geo-Mask vs VESPO.

rl-collapse (Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from
the training–inference mismatch") reports that token-level corrections (token TIS) still
collapse when the inference engine's μ differs from the trainer's π, while sequence-level
masking (seq-MIS, Geo-Mask) keeps training stable. This figure trains with μ served by an
emulated inference engine (:class:`simkit.train.Mismatch`: logits rounded to bf16, plus rare
"toxic-tail" spikes that starve the rarest tokens of a state) and no staleness (N = 1, lag 0),
so that the mismatch is the only source of off-policyness.

Setting (full size): ``TokenMDP.answer_correct(V = 32, T = 128, scale = 2, answer = 26)``
(R = 1 iff the last token is the answer; the initial logits are N(0, 4), so π is peaked as a
pretrained model's is, bf16 rounding is visible, and the answer token starts rare: J(π₀) ≈
0.002), Adam (lr 0.03, gradient norm clipped to 1), 32 sequences per update (4 GRPO groups of
8), 600 steps, exact J every 10, seeds 0, 1, 2. Panels: no mismatch (every recipe is then
on-policy REINFORCE: the curves coincide); bf16 + logit noise σ = 0.1 (a sequence's log-ratio
then spreads like σ·√T: the sequence-level weights feel the length); bf16 + toxic-tail spikes
(with probability 0.5 per state and rollout, the 8 rarest tokens of the state get μ × e^{−6}:
the rare correct answer is under-sampled and, when sampled, carries a ratio of e^6).

The grid is ``configs/train_mismatch_curves.toml`` (:func:`sweep_config`); :func:`compute`
returns :class:`~simkit.figures.staleness_curves.Data`-like :class:`Data` with the notes:
environment, sizes, seeds and whether the paper's ordering is reproduced, as measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit.config import TrainSweepConfig, mismatch_to_dict
from simkit.figures.staleness_curves import (
    FINAL_J_NOTE,
    check_grid,
    collapse_line,
    drift_note,
    environment_dict,
    environment_note,
    plot_curves,
    ranking,
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
    "exact J(π) against the optimizer step for token-TIS, seq-MIS, Geo-Mask, VESPO and the "
    "uncorrected (naive) loss on a token MDP (answer_correct, V = 32, T = 128, a rare answer "
    "token) when the rollouts come from an emulated inference engine (no staleness: N = 1): no "
    "mismatch, bf16 logits + logit noise, and bf16 + toxic-tail spikes that starve the rarest "
    "tokens (the answer among them at the start). Mean over 3 seeds with "
    "the min–max band. The notes state whether rl-collapse's ordering (token-level "
    "corrections collapse, sequence-level masking does not) is reproduced here, as measured."
)

#: the answer token of the full-size environment: under the initial logits (seed 0, scale 2) it
#: is among the 8 rarest of 32 tokens in two of the three states, so toxic-tail spikes on the 8
#: rarest tokens starve the correct answer in μ (the case where the engine's tail error matters)
ANSWER = 26
#: rl-collapse: token-level corrections collapse, sequence-level masks stay stable
PAPER_TOKEN_LEVEL = ("tis",)
PAPER_SEQUENCE_LEVEL = ("mis", "geo_mask")


@dataclass(frozen=True)
class Config:
    """Environment, recipes, the mismatch models (one panel each), the schedule and seeds.
    ``mismatches`` holds :class:`~simkit.train.Mismatch` objects."""

    constructor: str = "answer_correct"
    V: int = 32
    T: int = 128
    env_kwargs: tuple = (("answer", ANSWER),)
    scale: float = 2.0
    env_seed: int = 0
    recipes: tuple[str, ...] = ("tis", "mis", "geo_mask", "vespo", "naive")
    mismatches: tuple[Mismatch, ...] = (
        Mismatch(),
        Mismatch(precision="bf16", logit_noise=0.1),
        Mismatch(precision="bf16", spike_prob=0.5, spike_strength=6.0, spike_tokens=8),
    )
    minibatches: int = 1
    minibatch_size: int = 32
    group_size: int = 8
    steps: int = 600
    lr: float = 0.03
    max_grad_norm: float | None = 1.0
    record_every: int = 10
    seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self):
        check_grid(self.recipes, mismatches=self.mismatches, seeds=self.seeds)


def config(small: bool = False) -> Config:
    if small:
        return Config(
            V=6,
            T=10,
            env_kwargs=(),
            scale=2.0,
            recipes=("tis", "mis", "vespo"),
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
    return training_sweep(
        cfg,
        NAME,
        minibatches=[cfg.minibatches],
        lr=cfg.lr,
        environment=environment_dict(cfg),
        mismatch=[mismatch_to_dict(m) for m in cfg.mismatches],
    )


def paper_verdict(summary: pd.DataFrame, order: list[str]) -> list[str]:
    """Lines: the ranking under each mismatch and the comparison with rl-collapse's claim."""
    lines = []
    for label in order:
        part = summary[summary["mismatch"] == label]
        lines.append(f"Final J, mismatch '{label}' (mean ± SE over seeds): {ranking(part)}.")
    for label in order:
        if label != "none":
            part = summary[summary["mismatch"] == label]
            lines.append(
                f"Mean J over the run (learning speed), '{label}': {ranking(part, 'J_mean')}."
            )
    lines.append(collapse_line(summary, lambda row: f"under '{row.mismatch}'"))
    present = set(summary["recipe"])
    token = [r for r in PAPER_TOKEN_LEVEL if r in present]
    seq = [r for r in PAPER_SEQUENCE_LEVEL if r in present]
    if token and seq:
        worst = order[-1]
        at = summary[summary["mismatch"] == worst].set_index("recipe")
        token_collapses = bool(summary[summary["recipe"].isin(token)]["collapsed"].sum() > 0)
        seq_stable = bool(summary[summary["recipe"].isin(seq)]["collapsed"].sum() == 0)
        better = []
        for s in seq:
            for t in token:
                se = math.hypot(at.loc[s, "J_final_se"], at.loc[t, "J_final_se"])
                if at.loc[s, "J_final"] - at.loc[t, "J_final"] > 2 * se:
                    better.append(f"{recipe_label(s)} > {recipe_label(t)}")
        reproduced = token_collapses and seq_stable
        lines.append(
            "rl-collapse's claim (token-level TIS collapses under mismatch, sequence-level "
            f"{', '.join(recipe_label(s) for s in seq)} do not): "
            + ("REPRODUCED" if reproduced else "NOT reproduced")
            + " here — token-TIS "
            + ("collapsed" if token_collapses else "never collapsed")
            + "; sequence-level masks "
            + ("never collapsed" if seq_stable else "collapsed")
            + f"; under '{worst}', final J differs by more than 2 SE for: "
            + (", ".join(better) or "no sequence-over-token pair")
            + "."
        )
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
    spikes = [m for m in cfg.mismatches if m.spike_prob > 0 and m.spike_strength > 0]
    notes = [
        environment_note(sweep, grid["J_start"], grid["J_star"]),
        schedule_note(sweep) + f" Staleness N = {cfg.minibatches}, no lag.",
        "Mismatch: μ = softmax of the trainer's logits + N(0, σ²) noise, rounded to bf16 "
        "(8 significant bits, round to nearest even), then toxic-tail spikes (per state and "
        "rollout, with probability p the k rarest tokens get μ × e^{−s})"
        + (
            f"; e.g. p = {spikes[0].spike_prob:g}, s = {spikes[0].spike_strength:g}, "
            f"k = {spikes[0].spike_tokens}."
            if spikes
            else "."
        ),
        FINAL_J_NOTE,
        drift_note(grid["runs"], lambda row: f"under {row['mismatch']}"),
        *paper_verdict(grid["summary"], list(order)),
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
