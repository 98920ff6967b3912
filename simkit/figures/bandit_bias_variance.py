"""Bias, variance, MSE and cosine of every mapping on a bandit, against the mismatch χ²(π‖μ).

A K-armed Bernoulli bandit (seeded logits and reward means), the behaviour μ dialed by
:func:`simkit.shifts.dial` to each χ²(π‖μ) of a grid, batches of n samples, oracle advantages
A = R − J(π) and the mapping's default hyperparameters and the ``seq-mean-token-sum``
aggregation (Z = n on the bandit: T = 1, so every aggregation coincides). Per-sample mappings
are exact (:func:`simkit.experiment.run`'s exact path); batch-dependent ones (snis, psis, m2po)
are Monte Carlo with bootstrap confidence bounds, drawn as error bars.

Data: the tidy DataFrame of :func:`simkit.experiment.run`, one row per (mapping, χ² target),
with the extra columns ``target_chi2``, ``arms`` and ``family`` (the mapping's colour family).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, mappings, shifts
from simkit.envs import Bandit
from simkit.estimators import Estimator
from simkit.figures import _common, style

NAME = "bandit_bias_variance"
TITLE = "Bias, variance, MSE and cosine vs χ² on a bandit"
CAPTION = (
    "every mapping of the catalogue (default hyperparameters, oracle advantage, n samples "
    "per estimate) on a Bernoulli bandit whose behaviour μ is dialed to a grid of "
    "χ²(π‖μ); exact for per-sample mappings, Monte Carlo with 95 % bootstrap bounds for "
    "batch-dependent ones."
)


@dataclass(frozen=True)
class Config:
    """Bandit, mismatch grid and estimator settings."""

    arms: int = 16
    n: int = 64
    chi2_min: float = 0.01
    chi2_max: float = 10.0
    n_chi2: int = 13
    shift_family: str = "logit_noise"
    reps: int = 400
    n_boot: int = 400
    seed: int = 0
    mapping_names: tuple[str, ...] | None = None  # None: every registered mapping

    def __post_init__(self):
        if self.arms < 2:
            raise ValueError(f"arms must be >= 2, got {self.arms}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 < self.chi2_min < self.chi2_max:
            raise ValueError(
                f"need 0 < chi2_min < chi2_max, got chi2_min={self.chi2_min}, "
                f"chi2_max={self.chi2_max}"
            )
        if self.n_chi2 < 2:
            raise ValueError(f"n_chi2 must be >= 2, got {self.n_chi2}")
        if self.reps < 2 or self.n_boot < 10:
            raise ValueError(f"need reps >= 2 and n_boot >= 10, got {self.reps}, {self.n_boot}")

    @property
    def chi2_grid(self) -> np.ndarray:
        return np.geomspace(self.chi2_min, self.chi2_max, self.n_chi2)


def config(small: bool = False) -> Config:
    if small:
        return Config(arms=8, n=16, n_chi2=4, chi2_max=3.0, reps=40, n_boot=50)
    return Config()


def make_bandit(arms: int, seed: int) -> Bandit:
    """The figure's bandit: logits ~ N(0, 1), Bernoulli means ~ U(0.05, 0.95), from ``seed``."""
    rng = np.random.default_rng(seed)
    return Bandit(logits=rng.normal(0.0, 1.0, arms), means=rng.uniform(0.05, 0.95, arms))


def estimators(names) -> list[Estimator]:
    """One estimator per mapping: defaults, seq-mean-token-sum aggregation, oracle advantage."""
    return [
        Estimator(
            mappings.get(name), aggregation="seq-mean-token-sum", advantage="oracle", name=name
        )
        for name in names
    ]


def compute(cfg: Config) -> pd.DataFrame:
    env = make_bandit(cfg.arms, cfg.seed)
    names = list(cfg.mapping_names) if cfg.mapping_names is not None else mappings.available()
    ests = estimators(names)
    frames = []
    for target in cfg.chi2_grid:
        mu = shifts.dial(env.pi, float(target), divergence="chi2", family=cfg.shift_family)
        frame = experiment.run(
            env,
            mu,
            ests,
            n=cfg.n,
            reps=cfg.reps,
            seed=cfg.seed,
            n_boot=cfg.n_boot,
            progress=False,
            setting={"target_chi2": float(target)},
        )
        frames.append(frame)
    data = pd.concat(frames, ignore_index=True)
    data["family"] = [style.family(m) for m in data.mapping]
    data["arms"] = cfg.arms
    return data


METRICS = (
    ("bias", r"bias $\|\mathbb{E}\hat g - \nabla J\|$", "log"),
    ("variance", r"variance $\mathbb{E}\|\hat g - \mathbb{E}\hat g\|^2$", "log"),
    ("mse", r"MSE $\mathbb{E}\|\hat g - \nabla J\|^2$", "log"),
    ("cosine", r"cosine $\cos(\mathbb{E}\hat g, \nabla J)$", "linear"),
)


def draw(data: pd.DataFrame):
    fig = _common.new_figure(7.2, 6.4)
    axes = fig.subplots(2, 2, sharex=True)
    names = list(dict.fromkeys(data.mapping))
    # log axes cannot show an exact 0 (is_seq is unbiased): draw it on a floor, marked
    # an exact 0 comes out as ~1e-17 in floating point: 1e-9 below the largest bias counts as 0
    positive_bias = data.bias[data.bias > 1e-9 * data.bias.max()]
    bias_floor = 10 ** np.floor(np.log10(positive_bias.min() / 3)) if len(positive_bias) else 1e-6
    for ax, (metric, label, scale) in zip(axes.flat, METRICS, strict=True):
        for name in names:
            part = data[data.mapping == name].sort_values("chi2_tok")
            x = part.chi2_tok.to_numpy()
            y = part[metric].to_numpy(dtype=float)
            if metric == "bias":
                y = np.where(y <= bias_floor, bias_floor, y)
            kw = style.line_kwargs(name, linewidth=1.2, markersize=2.5, marker=style.marker(name))
            if not part.exact.all():
                lo = part[f"{metric}_lo"].to_numpy(dtype=float)
                hi = part[f"{metric}_hi"].to_numpy(dtype=float)
                if scale == "log":
                    lo = np.maximum(lo, bias_floor if metric == "bias" else y * 1e-3)
                ax.errorbar(
                    x,
                    y,
                    yerr=[np.maximum(y - lo, 0), np.maximum(hi - y, 0)],
                    capsize=1.5,
                    elinewidth=0.7,
                    **kw,
                )
            else:
                ax.plot(x, y, **kw)
        ax.set_xscale("log")
        ax.set_yscale(scale)
        ax.set_ylabel(label)
        if metric == "bias":
            ax.axhline(bias_floor, color="0.5", linewidth=0.6, linestyle=":")
            ax.annotate(
                "0 (unbiased)",
                (1.0, bias_floor),
                xycoords=("axes fraction", "data"),
                xytext=(-2, 2),
                textcoords="offset points",
                ha="right",
                va="bottom",
                fontsize=7,
                color="0.35",
            )
        if metric == "cosine":
            ax.set_ylim(min(-0.05, float(np.nanmin(data.cosine)) - 0.05), 1.05)
    for ax in axes[1]:
        ax.set_xlabel(r"mismatch $\chi^2(\pi\,\|\,\mu)$")
    for ax, letter in zip(axes.flat, "abcd", strict=True):
        _common.panel_label(ax, letter)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    by_label = dict(zip(labels, handles, strict=True))
    ordered = [name for name in names if name in by_label]  # registry order (errorbars last)
    fig.legend(
        [by_label[n] for n in ordered],
        ordered,
        loc="outside right center",
        ncol=1,
        fontsize=6.5,
        handlelength=2.4,
        title="mapping",
        title_fontsize=7.5,
    )
    n = int(data.n.iloc[0])
    arms = int(data.arms.iloc[0])
    fig.suptitle(
        f"Every mapping on a {arms}-armed Bernoulli bandit, n = {n} samples per gradient estimate"
    )
    return fig
