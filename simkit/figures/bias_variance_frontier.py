"""The bias–variance frontier: each mapping's knob traced in the (bias², variance) plane.

At one fixed mismatch χ²(π‖μ) on the bandit of :mod:`~simkit.figures.bandit_bias_variance`,
each mapping's main hyperparameter is swept — PPO clip ε, truncated-IS cap C, masked-IS
threshold C, power α, VESPO λ (both λ's scaled together), SAPO τ (both τ's scaled together) —
and every setting is placed at (bias², variance) of its n-sample gradient estimate (exact path).
The two endpoints of the classical line are marked: naive (c = 1) and sequence IS (c = W:
unbiased). Several knobs (ε, C, α) run between them, like GAE-λ between Monte Carlo returns and
TD — "the GAE-λ of importance sampling"; others (VESPO's λ, SAPO's τ) do not, and the notes
(:func:`notes`) say, from the data, which path ends near which endpoint and where each knob's
MSE is lowest. Arrows on every path point in the direction of a growing knob; VESPO's λ path
turns back on itself, so its values are labelled along it. On the
bandit T = 1, so token- and sequence-level versions of a mapping coincide (only the sequence
ones are drawn). Dotted grey curves are iso-MSE lines bias² + variance = const.

Data: a tidy DataFrame with columns ``mapping``, ``knob`` (symbol), ``value`` (knob value, NaN
for the endpoints), ``bias``, ``bias2``, ``variance``, ``mse``, ``chi2_tok``, ``n``;
``data.attrs["notes"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, mappings, shifts
from simkit.estimators import Estimator
from simkit.figures import _claims, _common, style
from simkit.figures.bandit_bias_variance import make_bandit
from simkit.figures.staleness_curves import split_figure

NAME = "bias_variance_frontier"
TITLE = "Bias–variance frontier of the mapping knobs"
CAPTION = (
    "each mapping's knob (PPO ε, TIS/MIS cap C, power α, VESPO λ, SAPO τ) swept at a "
    "fixed χ²(π‖μ) on a bandit and placed at (bias², variance), arrows in the direction of a "
    "growing knob, VESPO's λ labelled along its path; naive and sequence IS marked as the "
    "classical endpoints. Which paths join them and where each knob's MSE is lowest is stated "
    "in the notes under the plot, computed from the data."
)

#: knob symbols as plain text for the notes
_PLAIN = {
    r"$\varepsilon$": "ε",
    r"$C$": "C",
    r"$\alpha$": "α",
    r"$\lambda$ scale": "λ scale",
    r"$\tau$ scale": "τ scale",
}
#: a path end is "near" an endpoint when bias² and variance are both within this factor
NEAR_FACTOR = 1.5


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
        ests += _common.oracle_estimators([name])
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
    data.attrs["notes"] = notes(data)
    return data


def _near(row, ref, floor: float) -> bool:
    """Both bias² (floored) and variance of ``row`` within NEAR_FACTOR of ``ref``'s."""
    b = max(row.bias2, floor), max(ref.bias2, floor)
    v = row.variance, ref.variance
    return all(max(x, y) <= NEAR_FACTOR * min(x, y) for x, y in (b, v))


def _floor(data: pd.DataFrame) -> float:
    positive = data.bias2[data.bias2 > 1e-12 * data.bias2.max()]
    return 10 ** np.floor(np.log10(positive.min() / 10)) if len(positive) else 1e-12


def notes(data: pd.DataFrame) -> tuple[str, ...]:
    """Sentences under the plot, built from ``data``: per knob, which endpoints its path ends
    near (:data:`NEAR_FACTOR`) and the knob value of lowest MSE (interior or at an end)."""
    floor = _floor(data)
    ends = {n: data[data.mapping == n].iloc[0] for n in ENDPOINTS if (data.mapping == n).any()}
    row0 = data.iloc[0]
    lines = [
        f"Bandit of bandit_bias_variance, χ²(π‖μ) = {row0.chi2_tok:.3g}, n = {int(row0.n)}; "
        + ", ".join(
            f"{n}: bias² {_claims.fmt(r.bias2)}, variance {_claims.fmt(r.variance)}, "
            f"MSE {_claims.fmt(r.mse)}"
            for n, r in ends.items()
        )
        + f". 'Near' = bias² and variance within ×{NEAR_FACTOR:g}."
    ]
    joins, others = [], []
    best = []
    for name in KNOBS:
        part = data[data.mapping == name].sort_values("value")
        if not len(part):
            continue
        first, last = part.iloc[0], part.iloc[-1]
        near = [
            f"{'low' if r is first else 'high'} end ≈ {n}"
            for r in (first, last)
            for n, e in ends.items()
            if _near(r, e, floor)
        ]
        symbol = _PLAIN.get(part.knob.iloc[0], part.knob.iloc[0])
        if len(near) == 2 and {n.split("≈ ")[1] for n in near} == set(ends):
            joins.append(name)
        else:
            others.append(f"{name} ({', '.join(near) if near else 'near neither'})")
        i = int(np.argmin(part.mse.to_numpy()))
        where = "an end of the sweep" if i in (0, len(part) - 1) else "inside the sweep"
        best.append(
            f"{name} at {symbol} = {part.value.iloc[i]:.3g} (MSE {_claims.fmt(part.mse.iloc[i])}, "
            f"{where})"
        )
    lines.append(
        f"Paths from near naive to near sequence IS: {_claims.name_list(joins)}; the others: "
        f"{', '.join(others) if others else 'none'}."
    )
    lines.append("Lowest MSE per knob: " + "; ".join(best) + ".")
    return tuple(lines)


def _arrow(ax, start, end, color) -> None:
    """An arrowhead from ``start`` to ``end`` (data coordinates), no shrink: short segments of a
    log-log path keep their arrow."""
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops={
            "arrowstyle": "-|>",
            "color": color,
            "lw": 1.1,
            "mutation_scale": 11,
            "shrinkA": 0,
            "shrinkB": 0,
        },
        zorder=4,
    )


def _value_label(ax, x, y, text, color, offset=(4, -3)) -> None:
    ax.annotate(
        text,
        (x, y),
        xytext=offset,
        textcoords="offset points",
        fontsize=6.3,
        color=color,
        va="top",
        bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
    )


def draw(data: pd.DataFrame):
    fig, panels = split_figure(7.0, 4.8, data.attrs.get("notes", ()))
    ax = panels.subplots()
    floor = _floor(data)  # exact zeros (~1e-34 in floating point) are drawn on this floor
    x_all = np.maximum(data.bias2.to_numpy(), floor)
    # iso-MSE curves
    x_grid = np.geomspace(floor, x_all.max() * 3, 200)
    v_min, v_max = data.variance.min(), data.variance.max()
    for level in np.geomspace(data.mse.min(), data.mse.max(), 5):
        y = level - x_grid
        ok = y > v_min / 3
        ax.plot(x_grid[ok], y[ok], color="0.75", linestyle=":", linewidth=0.8, zorder=0)
    for name in KNOBS:
        part = data[data.mapping == name].sort_values("value")
        if not len(part):
            continue
        x = np.maximum(part.bias2.to_numpy(), floor)
        y = part.variance.to_numpy()
        color = style.color(name)
        symbol = part.knob.iloc[0]
        ax.plot(
            x,
            y,
            marker=style.marker(name),
            markersize=3,
            **style.line_kwargs(name, label=f"{name} ({symbol})"),
        )
        # arrowheads on about every third segment: the direction of a growing knob
        if len(part) >= 2:
            step = max(1, (len(part) - 1) // 3)
            for k in range(step // 2 + 1, len(part), step):
                _arrow(ax, (x[k - 1], y[k - 1]), (x[k], y[k]), color)
        # knob values: the start everywhere; VESPO (a path that turns back) at several points
        labelled = [0]
        if name == "vespo":
            best = int(np.argmin(part.mse.to_numpy()))
            labelled = sorted({0, len(part) // 4, best, (3 * len(part)) // 4, len(part) - 1})
        for k in labelled:
            text = f"{symbol} = {part.value.iloc[k]:.3g}" if k == 0 else f"{part.value.iloc[k]:.3g}"
            _value_label(ax, x[k], y[k], text, color, offset=(4, -3) if k == 0 else (5, 3))
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
            markeredgecolor="white",
            markeredgewidth=1.2,
            alpha=0.9,
            zorder=5,
            label=text,
        )
    _common.mark_x(
        ax,
        floor,
        "bias² = 0",
        0.02,
        (3, 0),
        linestyle="--",
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
        r"(arrows: knob increasing; dotted: iso-MSE)",
        fontsize=9,
    )
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    return fig
