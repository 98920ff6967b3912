"""Bias of token-level IS and PPO clip vs T, against the O(T²·Δ_max) shape of rl-collapse.

rl-collapse (Liu, Li et al. 2025, part 2): token-level corrections reweight each token by its own
ratio r_t but sample the states from μ, so their bias grows with the length, bounded by
O(T²·Δ_max) with Δ_max the largest per-state TV(π, μ)
(:func:`simkit.theory.token_is_bias_bound_shape`). The source gives the order, not a constant:
the curve drawn is K·T²·Δ_max with K chosen so that it passes through token IS's bias at the
first length where that bias is non-zero (SHAPE ONLY, as the figure says).

Setting and computation: those of :mod:`simkit.figures.mse_vs_T` (``answer_correct`` token
MDP, every state at per-token χ²(π‖μ) = ``chi2_tok``, exact ``experiment.run``), for naive,
token IS, PPO clip and sequence IS (unbiased: drawn on a floor).

Data: the tidy DataFrame of :func:`simkit.experiment.run` (one row per (mapping, T)) with
``delta_max``, ``grad_norm`` and ``bound_shape`` (the scaled K·T²·Δ_max, same on every row of a T).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simkit import theory
from simkit.figures import _common, mse_vs_T, style
from simkit.figures.mse_vs_T import Config

NAME = "token_bias_vs_T"
TITLE = "Token-IS and PPO-clip bias vs T"
CAPTION = (
    "exact bias ‖E ĝ − ∇J‖ of token IS and PPO clip (naive for reference, sequence IS = 0) "
    "on a token MDP at a fixed per-token χ² in every state, against T, with the rl-collapse "
    "O(T²·Δ_max) shape (dashed; shape only, scaled to token IS's first non-zero bias)."
)

MAPPINGS = ("naive", "is_token", "ppo_clip", "is_seq")

__all__ = ["Config", "compute", "config", "draw"]


def config(small: bool = False) -> Config:
    if small:
        return Config(lengths=(1, 2, 4, 6), reps=5, mapping_names=MAPPINGS)
    return Config(mapping_names=MAPPINGS)


def compute(cfg: Config) -> pd.DataFrame:
    names = list(cfg.mapping_names) if cfg.mapping_names is not None else list(MAPPINGS)
    data = mse_vs_T.sweep_lengths(cfg, names)
    shape = np.asarray(
        theory.token_is_bias_bound_shape(data["T"].to_numpy(float), data.delta_max.to_numpy())
    )
    token = data[(data.mapping == "is_token") & (data.bias > 1e-12)].sort_values("T")
    if len(token) == 0:
        raise ValueError("token IS is unbiased at every length: nothing to scale the shape to")
    anchor = token.iloc[0]
    scale = anchor.bias / float(theory.token_is_bias_bound_shape(anchor["T"], anchor.delta_max))
    data["bound_shape"] = scale * shape
    data.attrs["anchor_T"] = int(anchor["T"])
    return data


def draw(data: pd.DataFrame):
    fig = _common.new_figure(5.6, 3.6)
    ax = fig.subplots()
    positive = data.bias[data.bias > 1e-12]
    floor = 10 ** np.floor(np.log10(positive.min() / 3))
    for name in dict.fromkeys(data.mapping):
        part = data[data.mapping == name].sort_values("T")
        y = np.where(part.bias <= floor, floor, part.bias)
        ax.plot(part["T"], y, marker=style.marker(name), **style.line_kwargs(name))
    shape = data[data.mapping == data.mapping.iloc[0]].sort_values("T")
    ax.plot(
        shape["T"],
        shape.bound_shape,
        color="0.35",
        linestyle="--",
        linewidth=1.0,
        label=f"∝ T²·Δ_max (rl-collapse; shape only, matched at T = {data.attrs['anchor_T']})",
    )
    ax.axhline(floor, color="0.5", linewidth=0.6, linestyle=":")
    ax.annotate(
        "0 (unbiased)",
        (1.0, floor),
        xycoords=("axes fraction", "data"),
        xytext=(-2, 2),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=7,
        color="0.35",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, float(data.bias.max()) * 20)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(r"bias $\|\mathbb{E}\hat g - \nabla J\|$")
    ax.legend(fontsize=6.5, loc="upper left")
    ax.set_title(
        f"answer_correct token MDP, χ²(π‖μ) = {float(data.chi2_tok.iloc[0]):.3g} per state (exact)"
    )
    return fig
