"""Sequence-level truncated IS: exact MSE vs the truncation level C, with C* = √(2(1+χ²)).

rl-collapse (Liu, Li et al. 2025, part 2), Seq-TIS with weight min(W, C) on one sample y ~ μ and
f(y) = A(y)·∇θ log π(y), ‖f‖ ≤ K: bias ≤ 2K(1+χ²)/C, variance ≤ K²C², so
MSE ≤ 4K²(1+χ²)²/C² + K²C² (:func:`simkit.theory.seq_tis_mse_bound`), minimised at
C* = √(2(1+χ²)) (:func:`simkit.theory.seq_tis_optimal_c`), χ² the sequence-level χ²(π‖μ).

Setting: a token MDP (``TokenMDP.answer_correct``: R = 1 iff the last token is the answer), μ
dialed by :func:`simkit.envs.behaviour.behaviour` to a sequence-level χ²_seq (one logit-noise
strength for every state), oracle advantage A = R − J(μ) (the exact value that group and batch
means of μ-drawn rewards estimate; E_μ[A] = 0). Every sequence is enumerated
(``env.support``), f(y) formed with ``env.accumulate``, and the coefficient min(W, C) comes from
the registered ``tis_seq`` mapping, so bias, variance and MSE of the one-sample estimator are
exact:

    E ĝ = Σ_y μ(y)·min(W, C)·f(y),   E‖ĝ‖² = Σ_y μ(y)·min(W, C)²·‖f(y)‖²,
    bias = ‖E ĝ − ∇J‖,  variance = E‖ĝ‖² − ‖E ĝ‖²,  MSE = bias² + variance.

The bound is a worst case over f: on a given problem the one-sample optimum can sit elsewhere
(here at small C: the variance of A·∇log π dominates), and with a batch of n samples the
variance is divided by n, which moves the optimum to larger C; both are drawn (``mse`` for
n = 1, ``mse_batch`` = bias² + variance/n for n = ``n_batch``, and the same at ``n_large``).

MSE rewards shrinking: a cap C → 1 shrinks every large weight, and ĝ ≡ 0 has MSE ‖∇J‖² (drawn
as a grey line). The scale-free error (:func:`simkit.experiment.metrics.scale_free`) of the
n-sample estimator, with E‖ĝ‖² = ‖E ĝ‖² + variance/n,

    rel_mse_scaled(C; n) = min_α E‖αĝ − ∇J‖² / ‖∇J‖²,

judges C after the best step size; it is drawn in a second row for each batch size, and the
notes (:func:`notes`) give, per χ²_seq and n, the C of lowest MSE and of lowest
rel_mse_scaled and say when either sits at the edge C = ``c_min`` of the grid (then the grid
does not bracket the optimum: caps below 1 would be a step size, not a correction). χ²_seq of
0.06 is about a per-token χ² of 1e-2 (what trainers log) over T = 6 tokens.

Data: DataFrame, one row per (chi2_seq, c) (plus one at C*, ``at_c_star``): bias, variance,
second_moment, mse, mse_batch, mse_large (bias² + variance/n_large), mse_zero (‖∇J‖²),
rel_mse_scaled, rel_mse_scaled_batch, rel_mse_scaled_large (n = 1, n_batch, n_large), bound
(the rl-collapse MSE bound with K = max_y ‖f(y)‖), K, c_star, is_mse (MSE of untruncated
sequence IS), w_max; ``data.attrs["notes"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import mappings, theory
from simkit.envs import TokenMDP
from simkit.envs.behaviour import behaviour
from simkit.experiment.metrics import scale_free
from simkit.figures import _common, style
from simkit.figures.staleness_curves import split_figure

NAME = "seq_tis_optimal_c"
TITLE = "Seq-TIS: MSE vs truncation level C"
CAPTION = (
    "exact bias² and MSE (one sample, and a batch of n) of sequence-level truncated IS "
    "min(W, C)·A·∇log π (oracle advantage A = R − J(μ)) "
    "on a token MDP (every sequence enumerated), against C, for three sequence-level χ²_seq "
    "(0.06 ≈ a per-token χ² of 1e-2 over 6 tokens); "
    "the rl-collapse bound 4K²(1+χ²)²/C² + K²C² (dashed) and its minimiser C* = √(2(1+χ²)) "
    "(dotted); the measured optimum (star), untruncated sequence IS (C → ∞, grey) and the MSE "
    "of ĝ ≡ 0 (‖∇J‖², thin grey). Bottom: the scale-free error rel_mse_scaled (error after the "
    "best step size / error of ĝ ≡ 0) at n = 64 and 1024; the notes say where each criterion "
    "puts the optimum and whether it is the edge C = 1 of the grid."
)


@dataclass(frozen=True)
class Config:
    """Environment, mismatch levels and the grid of truncation levels."""

    V: int = 4
    T: int = 6
    scale: float = 1.0
    chi2_seqs: tuple[float, ...] = (0.06, 1.0, 10.0)
    c_min: float = 1.0
    c_max: float = 100.0
    n_c: int = 61
    n_batch: int = 64
    n_large: int = 1024
    shift_family: str = "logit_noise"
    seed: int = 0

    def __post_init__(self):
        if self.V < 2 or self.T < 1:
            raise ValueError(f"need V >= 2 and T >= 1, got V={self.V}, T={self.T}")
        if self.V**self.T > 2**20:
            raise ValueError(f"V^T = {self.V**self.T} sequences exceed the budget 2^20")
        if not self.chi2_seqs or any(not c > 0 for c in self.chi2_seqs):
            raise ValueError(f"chi2_seqs must be positive, got {self.chi2_seqs}")
        if not 1 <= self.c_min < self.c_max or self.n_c < 2:
            raise ValueError(
                f"need 1 <= c_min < c_max (tis_seq needs C >= 1) and n_c >= 2, got "
                f"c_min={self.c_min}, c_max={self.c_max}, n_c={self.n_c}"
            )
        if not 1 <= self.n_batch < self.n_large:
            raise ValueError(
                f"need 1 <= n_batch < n_large, got n_batch={self.n_batch}, n_large={self.n_large}"
            )


def config(small: bool = False) -> Config:
    if small:
        return Config(V=3, T=4, n_c=25)
    return Config()


def make_env(cfg: Config) -> TokenMDP:
    """The figure's environment: ``answer_correct`` with seeded logits."""
    return TokenMDP.answer_correct(V=cfg.V, T=cfg.T, seed=cfg.seed, scale=cfg.scale)


def per_sequence_gradients(env: TokenMDP, support) -> np.ndarray:
    """f(y) = A(y)·∇θ log π(y) for every atom of ``support``: (M, D).

    A = ``support.adv_first / support.prob`` (R − baseline); ∇ log π(y) = Σ_t ∇ log π(y_t|s_t)
    by ``env.accumulate`` with unit token weights.
    """
    adv = support.adv_first / support.prob
    weights = np.where(support.mask, adv[:, None], 0.0)
    return env.accumulate(
        support.actions[:, None, :], weights[:, None, :], states=support.states[:, None, :]
    )


def compute(cfg: Config) -> pd.DataFrame:
    env = make_env(cfg)
    grad_J = env.grad_J()
    mse_zero = float(grad_J @ grad_J)
    c_grid = np.geomspace(cfg.c_min, cfg.c_max, cfg.n_c)
    rows = []
    for target in cfg.chi2_seqs:
        mu = behaviour(env, target, "chi2", level="sequence", family=cfg.shift_family)
        chi2_seq = float(env.chi2_seq(mu))
        sup = env.support(mu, baseline=env.J(mu))
        f = per_sequence_gradients(env, sup)
        f_sq = np.einsum("md,md->m", f, f)
        K = float(np.sqrt(f_sq.max()))
        c_star = float(theory.seq_tis_optimal_c(chi2_seq))
        w = np.exp(sup.log_ratio.sum(axis=1))
        is_mean = (sup.prob * w) @ f
        is_mse = float(
            np.sum((is_mean - grad_J) ** 2) + sup.prob @ (w**2 * f_sq) - is_mean @ is_mean
        )
        for c in np.append(c_grid, c_star):
            coef = mappings.get("tis_seq", c=float(c)).coefficients(
                sup.log_ratio, sup.mask, sup.advantage_sign
            )[:, 0]
            mean = (sup.prob * coef) @ f
            bias = float(np.linalg.norm(mean - grad_J))
            variance = float(sup.prob @ (coef**2 * f_sq) - mean @ mean)
            rel = {
                k: scale_free(mean, variance / n, grad_J)["rel_mse_scaled"]
                for k, n in (("", 1), ("_batch", cfg.n_batch), ("_large", cfg.n_large))
            }
            rows.append(
                {
                    "chi2_seq": chi2_seq,
                    "chi2_seq_target": target,
                    "c": float(c),
                    "at_c_star": bool(c == c_star),
                    "bias": bias,
                    "variance": variance,
                    "mse": bias**2 + variance,
                    "mse_batch": bias**2 + variance / cfg.n_batch,
                    "mse_large": bias**2 + variance / cfg.n_large,
                    "mse_zero": mse_zero,
                    **{f"rel_mse_scaled{k}": v for k, v in rel.items()},
                    "second_moment": float(sup.prob @ (coef**2 * f_sq)),
                    "bound": float(theory.seq_tis_mse_bound(chi2_seq, c, K)),
                    "K": K,
                    "c_star": c_star,
                    "is_mse": is_mse,
                    "w_max": float(w.max()),
                }
            )
    data = pd.DataFrame(rows).sort_values(["chi2_seq", "c"], ignore_index=True)
    data.attrs.update(
        {"V": cfg.V, "T": cfg.T, "n_batch": cfg.n_batch, "n_large": cfg.n_large, "c_min": cfg.c_min}
    )
    data.attrs["notes"] = notes(data)
    return data


#: (column, batch size attribute or 1) of each criterion the notes compare
CRITERIA = (
    ("mse", None),
    ("mse_batch", "n_batch"),
    ("mse_large", "n_large"),
    ("rel_mse_scaled", None),
    ("rel_mse_scaled_batch", "n_batch"),
    ("rel_mse_scaled_large", "n_large"),
)


def optima(data: pd.DataFrame) -> pd.DataFrame:
    """Per χ²_seq and criterion of :data:`CRITERIA`: the C of the grid minimising it, its value,
    and ``at_edge`` (that C is the smallest of the grid)."""
    rows = []
    for chi2, part in data.groupby("chi2_seq", sort=True):
        grid = part[~part.at_c_star].sort_values("c")
        for column, n_key in CRITERIA:
            i = int(np.argmin(grid[column].to_numpy()))
            rows.append(
                {
                    "chi2_seq": chi2,
                    "criterion": column,
                    "n": 1 if n_key is None else int(data.attrs[n_key]),
                    "c": float(grid.c.iloc[i]),
                    "value": float(grid[column].iloc[i]),
                    "at_edge": i == 0,
                    "below_zero": column.startswith("mse")
                    and grid[column].iloc[i] < grid.mse_zero.iloc[i],
                }
            )
    return pd.DataFrame(rows)


def notes(data: pd.DataFrame) -> tuple[str, ...]:
    """Sentences under the figure, built from ``data``: per χ²_seq, the C that minimises the
    MSE and the C that minimises rel_mse_scaled at each batch size, with the edge of the grid
    and MSEs below ĝ ≡ 0's flagged."""
    opt = optima(data)
    c_min = data.attrs.get("c_min", float(data.c.min()))
    lines = [
        f"Token MDP answer_correct (V = {data.attrs['V']}, T = {data.attrs['T']}), exact; "
        f"ĝ ≡ 0 has MSE ‖∇J‖² = {data.mse_zero.iloc[0]:.3g}. Optimal C on the grid "
        f"[{c_min:g}, {data.c.max():g}] ('edge': the smallest C of the grid, so the grid does "
        "not bracket the optimum):"
    ]
    for chi2, part in opt.groupby("chi2_seq", sort=True):
        pieces = []
        for n, at in part.groupby("n", sort=True):
            mse = at[at.criterion.str.startswith("mse")].iloc[0]
            rel = at[at.criterion.str.startswith("rel")].iloc[0]
            flag_m = ", edge" if mse.at_edge else ""
            below = ", below ĝ ≡ 0's" if mse.below_zero else ""
            flag_r = ", edge" if rel.at_edge else ""
            pieces.append(
                f"n = {n}: MSE at C = {mse.c:.3g}{flag_m}{below}, rel_mse_scaled at C = "
                f"{rel.c:.3g}{flag_r} ({rel.value:.3g})"
            )
        c_star = float(data[data.chi2_seq == chi2].c_star.iloc[0])
        lines.append(f"χ²_seq = {chi2:.3g} (C* = {c_star:.3g}): " + "; ".join(pieces) + ".")
    return tuple(lines)


def draw(data: pd.DataFrame):
    groups = list(data.groupby("chi2_seq", sort=True))
    fig, sub = split_figure(3.6 * len(groups) + 1.8, 6.2, data.attrs.get("notes", ()))
    axes = sub.subplots(2, len(groups), sharex=True, sharey="row", squeeze=False)
    color = style.color("tis_seq")
    n_batch, n_large = data.attrs["n_batch"], data.attrs["n_large"]
    for k, ((chi2, part), letter) in enumerate(zip(groups, "abcdef", strict=False)):
        ax = axes[0, k]
        grid = part[~part.at_c_star]
        ax.plot(grid.c, grid.mse, color=color, label="MSE, n = 1")
        ax.plot(grid.c, grid.bias**2, color=color, linestyle=":", linewidth=1.0, label="bias²")
        ax.plot(
            grid.c,
            grid.mse_batch,
            color=style.color("is_seq"),
            linestyle="-.",
            label=f"MSE, n = {n_batch} (variance / n)",
        )
        ax.plot(grid.c, grid.bound, color="#d95f02", linestyle="--", label="rl-collapse bound")
        ax.axhline(part.is_mse.iloc[0], color="0.55", linewidth=0.8, label="sequence IS, n = 1")
        ax.axhline(part.mse_zero.iloc[0], color="0.3", linewidth=0.6, label="ĝ ≡ 0: ‖∇J‖²")
        c_star = part.c_star.iloc[0]
        _common.mark_x(
            ax,
            c_star,
            f"C* = {c_star:.2f}",
            0.97,
            (3, 0),
            linewidth=0.9,
            line_color="0.3",
            fontsize=7,
            va="top",
        )
        for col in ("mse", "mse_batch"):
            best = grid.loc[grid[col].idxmin()]
            ax.plot(
                [best.c],
                [best[col]],
                marker="*",
                color="k",
                markersize=7,
                linestyle="none",
                label="measured optimum" if col == "mse" else None,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"χ²_seq = {chi2:.3g}, K = {part.K.iloc[0]:.2f}")
        _common.panel_label(ax, letter)
        low = axes[1, k]
        for col, n, style_ in (
            ("rel_mse_scaled_batch", n_batch, "-"),
            ("rel_mse_scaled_large", n_large, "--"),
        ):
            low.plot(
                grid.c, grid[col], color=color, linestyle=style_, label=f"rel_mse_scaled, n = {n}"
            )
            best = grid.loc[grid[col].idxmin()]
            low.plot([best.c], [best[col]], marker="*", color="k", markersize=7, linestyle="none")
        low.axhline(1.0, color="0.4", linewidth=0.8, linestyle=":")
        low.set_xscale("log")
        low.set_yscale("log")
        low.set_xlabel("truncation level C")
    axes[0, 0].set_ylabel(r"MSE $\mathbb{E}\|\hat g-\nabla J\|^2$ and bias²")
    axes[1, 0].set_ylabel("rel_mse_scaled\n(error after best step / ĝ ≡ 0)")
    positive = _common.finite_positive(data[["mse_batch", "bias"]].to_numpy() ** [1, 2])
    axes[0, 0].set_ylim(max(float(np.nanmin(positive)) / 3, 1e-6), float(data.bound.max()) * 2)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    more, more_labels = axes[1, 0].get_legend_handles_labels()
    sub.legend(handles + more, labels + more_labels, loc="outside right center", fontsize=6.5)
    sub.suptitle(
        f"Seq-TIS min(W, C), token MDP (V = {data.attrs['V']}, T = {data.attrs['T']}), "
        "exact; C* = √(2(1+χ²)) minimises the bound"
    )
    return fig
