"""The bias–variance frontier: each mapping's knob traced in the (bias², variance) plane.

At one fixed mismatch χ²(π‖μ) on the bandit of :mod:`~simkit.figures.bandit_bias_variance`,
each mapping's main hyperparameter is swept — PPO clip ε, truncated-IS cap C, masked-IS
threshold C, power α, VESPO λ (both λ's scaled together), SAPO τ (both τ's scaled together) —
and every setting is placed at (bias², variance) of its n-sample gradient estimate (exact path).
The two endpoints of the classical line are marked: naive (c = 1: biased, lowest variance) and
sequence IS (c = W: unbiased, highest variance). Every knob interpolates between them, like
GAE-λ does between Monte Carlo returns and TD — "the GAE-λ of importance sampling". On the
bandit T = 1, so token- and sequence-level versions of a mapping coincide (only the sequence
ones are drawn). Dotted grey curves are iso-MSE lines bias² + variance = const.

Data: a tidy DataFrame with columns ``mapping``, ``knob`` (symbol), ``value`` (knob value, NaN
for the endpoints), ``bias``, ``bias2``, ``variance``, ``mse``, ``chi2_tok``, ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, mappings, shifts
from simkit.estimators import Estimator
from simkit.figures import _common, style
from simkit.figures.bandit_bias_variance import make_bandit

NAME = "bias_variance_frontier"
TITLE = "Bias–variance frontier of the mapping knobs"
CAPTION = (
    "each mapping's knob (PPO ε, TIS/MIS cap C, power α, VESPO λ, SAPO τ) swept at a "
    "fixed χ²(π‖μ) on a bandit and placed at (bias², variance); naive and sequence IS "
    "are the endpoints — the GAE-λ of importance sampling."
)


def _ppo(v):
    return {"eps_low": v, "eps_high": v}


def _cap(v):
    return {"c": v}


def _mask(v):
    return {"c_high": v}


def _power(v):
    return {"alpha": v}


def _vespo(v):
    return {"lambda_pos": 3.0 * v, "lambda_neg": 2.0 * v}


def _sapo(v):
    return {"tau_pos": 1.0 * v, "tau_neg": 1.05 * v}


#: mapping -> (knob symbol, hyperparameters from a knob value, knob values (full), (small))
KNOBS = {
    "ppo_clip": (r"$\varepsilon$", _ppo, np.geomspace(0.01, 100.0, 17), np.geomspace(0.05, 20, 4)),
    "tis_seq": (r"$C$", _cap, np.geomspace(1.0, 100.0, 17), np.geomspace(1.0, 20.0, 4)),
    "mis_seq": (r"$C$", _mask, np.geomspace(1.0, 100.0, 17), np.geomspace(1.0, 20.0, 4)),
    "power": (r"$\alpha$", _power, np.linspace(0.0, 1.0, 11), np.linspace(0.0, 1.0, 4)),
    "vespo": (r"$\lambda$ scale", _vespo, np.geomspace(0.2, 2.0, 13), np.geomspace(0.2, 2.0, 4)),
    "sapo": (r"$\tau$ scale", _sapo, np.geomspace(0.05, 50.0, 17), np.geomspace(0.1, 10, 4)),
}
ENDPOINTS = ("naive", "is_seq")


@dataclass(frozen=True)
class Config:
    arms: int = 16
    n: int = 64
    chi2: float = 1.0
    shift_family: str = "logit_noise"
    seed: int = 0
    small: bool = False

    def __post_init__(self):
        if self.arms < 2:
            raise ValueError(f"arms must be >= 2, got {self.arms}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.chi2 > 0:
            raise ValueError(f"chi2 must be > 0, got {self.chi2}")


def config(small: bool = False) -> Config:
    return Config(arms=8, n=16, small=True) if small else Config()


def knob_estimators(small: bool) -> tuple[list[Estimator], list[dict]]:
    """The swept estimators (seq-mean-token-sum, oracle advantage) and their (mapping, knob)."""
    ests, meta = [], []
    for name, (symbol, hp, full, reduced) in KNOBS.items():
        for value in reduced if small else full:
            ests.append(
                Estimator(
                    mappings.get(name, **hp(float(value))),
                    aggregation="seq-mean-token-sum",
                    advantage="oracle",
                    name=f"{name}[{value:.6g}]",
                )
            )
            meta.append({"mapping": name, "knob": symbol, "value": float(value)})
    for name in ENDPOINTS:
        ests.append(
            Estimator(
                mappings.get(name), aggregation="seq-mean-token-sum", advantage="oracle", name=name
            )
        )
        meta.append({"mapping": name, "knob": "", "value": np.nan})
    return ests, meta


def compute(cfg: Config) -> pd.DataFrame:
    env = make_bandit(cfg.arms, cfg.seed)
    mu = shifts.dial(env.pi, cfg.chi2, divergence="chi2", family=cfg.shift_family)
    ests, meta = knob_estimators(cfg.small)
    table = experiment.run(
        env,
        mu,
        ests,
        n=cfg.n,
        reps=2 if cfg.small else 10,
        seed=cfg.seed,
        exact=True,
        progress=False,
    )
    data = pd.DataFrame(meta)
    data["bias"] = table.bias.to_numpy()
    data["bias2"] = data.bias**2
    data["variance"] = table.variance.to_numpy()
    data["mse"] = table.mse.to_numpy()
    data["chi2_tok"] = table.chi2_tok.to_numpy()
    data["n"] = cfg.n
    return data


def draw(data: pd.DataFrame):
    fig = _common.new_figure(6.4, 4.6)
    ax = fig.subplots()
    # exact zeros come out as ~1e-34 in floating point: anything 1e-12 below the largest is 0
    positive = data.bias2[data.bias2 > 1e-12 * data.bias2.max()]
    floor = 10 ** np.floor(np.log10(positive.min() / 10)) if len(positive) else 1e-12
    x_all = np.maximum(data.bias2.to_numpy(), floor)  # zeros drawn on the floor line
    # iso-MSE curves
    x_grid = np.geomspace(floor, x_all.max() * 3, 200)
    v_min, v_max = data.variance.min(), data.variance.max()
    for level in np.geomspace(data.mse.min(), data.mse.max(), 5):
        y = level - x_grid
        ok = y > v_min / 3
        ax.plot(x_grid[ok], y[ok], color="0.75", linestyle=":", linewidth=0.8, zorder=0)
    for name in KNOBS:
        part = data[data.mapping == name].sort_values("value")
        x = np.maximum(part.bias2.to_numpy(), floor)
        ax.plot(
            x,
            part.variance,
            marker=style.marker(name),
            markersize=3,
            **style.line_kwargs(name, label=f"{name} ({part.knob.iloc[0]})"),
        )
        # arrow on the middle segment: direction of a growing knob; start value labelled
        if len(part) >= 2:
            i = len(part) // 2
            ax.annotate(
                "",
                xy=(x[i], part.variance.iloc[i]),
                xytext=(x[i - 1], part.variance.iloc[i - 1]),
                arrowprops={
                    "arrowstyle": "-|>",
                    "color": style.color(name),
                    "lw": 1.0,
                    "mutation_scale": 9,
                },
            )
        ax.annotate(
            f"{part.knob.iloc[0]} = {part.value.iloc[0]:.3g}",
            (x[0], part.variance.iloc[0]),
            xytext=(4, -3),
            textcoords="offset points",
            fontsize=6.5,
            color=style.color(name),
            va="top",
            bbox={
                "boxstyle": "round,pad=0.1",
                "facecolor": "white",
                "alpha": 0.75,
                "edgecolor": "none",
            },
        )
    for name, text in (("naive", "naive (c = 1)"), ("is_seq", "sequence IS (c = W)")):
        row = data[data.mapping == name].iloc[0]
        x = max(row.bias2, floor)
        ax.plot(
            [x],
            [row.variance],
            marker=style.marker(name),
            markersize=9,
            linestyle="none",
            color=style.color(name),
            markerfacecolor="white",
            markeredgewidth=1.8,
            zorder=5,
            label=text,
        )
    ax.axvline(floor, color="0.5", linewidth=0.6, linestyle="--")
    ax.annotate(
        "bias² = 0",
        (floor, 0.02),
        xycoords=("data", "axes fraction"),
        xytext=(3, 0),
        textcoords="offset points",
        fontsize=7,
        color="0.35",
        rotation=90,
        va="bottom",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(v_min / 2, v_max * 2)
    ax.set_xlabel(r"squared bias $\|\mathbb{E}\hat g - \nabla J\|^2$")
    ax.set_ylabel(r"variance $\mathbb{E}\|\hat g - \mathbb{E}\hat g\|^2$")
    chi2 = float(data.chi2_tok.iloc[0])
    ax.set_title(
        rf"Knob sweeps at $\chi^2(\pi\|\mu) = {chi2:.3g}$, n = {int(data.n.iloc[0])} "
        r"(arrows: knob increasing; dotted: iso-MSE)"
    )
    fig.legend(loc="outside right center", fontsize=7)
    return fig
