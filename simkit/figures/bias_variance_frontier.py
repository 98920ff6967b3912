"""The bias–variance frontier: each mapping's knob traced in the (bias², variance) plane.

At one fixed mismatch χ²(π‖μ) on the bandit of :mod:`~simkit.figures.bandit_bias_variance`,
each mapping's main hyperparameter is swept — PPO clip ε, truncated-IS cap C, masked-IS
threshold C, power α, VESPO λ (both λ's scaled together), SAPO τ (both τ's scaled together) —
and every setting is placed at (bias², variance) of its n-sample gradient estimate (exact path).
The two endpoints of the classical line are marked: naive (c = 1) and sequence IS (c = W:
unbiased). Several knobs (ε, C, α) run between them, like GAE-λ between Monte Carlo returns and
TD — "the GAE-λ of importance sampling"; others (VESPO's λ, SAPO's τ) do not, and the notes
(:func:`notes`) say, from the data, which path ends near which endpoint and where each knob is
best.

"Best" is judged by the scale-free error ``rel_mse_scaled`` (the error after the best step
size, relative to ĝ ≡ 0; :func:`simkit.experiment.metrics.scale_free`), not by the MSE: a knob
that shrinks every coefficient (SAPO's τ → ∞, a cap C → 1 on a mild mismatch) lowers the MSE
towards and below that of ĝ ≡ 0, ‖∇J‖², without adding any signal. The iso-MSE line of
ĝ ≡ 0 is drawn (dashed); the notes give, per knob, the setting of lowest rel_mse_scaled, say
whether it is at an end of the sweep (then the sweep does not bracket the optimum), and where
the MSE-best setting differs from it.

A second panel (``data.attrs["regimes"]``) follows each knob's best rel_mse_scaled over its
sweep, divided by naive's, across χ² from 1e-4 (what trainers log per token) to 10 and at
n = 64 and 1024, on the same bandit (one instance: no ranking between knobs is stated from it;
the bandit figure's ensemble does that).

Arrows on every path point in the direction of a growing knob; VESPO's λ path turns back on
itself, so its values are labelled along it. On the bandit T = 1, so token- and sequence-level
versions of a mapping coincide (only the sequence ones are drawn). Dotted grey curves are
iso-MSE lines bias² + variance = const.

Data: a tidy DataFrame with columns ``mapping``, ``knob`` (symbol), ``value`` (knob value, NaN
for the endpoints), ``bias``, ``bias2``, ``variance``, ``mse``, ``mse_zero``,
``rel_mse_scaled``, ``kept``, ``chi2_tok``, ``n``; ``data.attrs["regimes"]`` (the same
columns with ``target_chi2``, one row per (setting, χ², n)) and ``data.attrs["notes"]``.
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
    "classical endpoints, the MSE of ĝ ≡ 0 (‖∇J‖²) dashed. Right: each knob's best scale-free "
    "error rel_mse_scaled (error after the best step size / error of ĝ ≡ 0) relative to "
    "naive's, for χ² from 1e-4 to 10 and n = 64 and 1024. Which paths join the endpoints and "
    "where each knob is best (by rel_mse_scaled, and where MSE disagrees) is stated in the "
    "notes, computed from the data."
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
    regime_chi2: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
    regime_ns: tuple[int, ...] = (64, 1024)

    def __post_init__(self):
        if any(not c > 0 for c in self.regime_chi2) or any(n < 1 for n in self.regime_ns):
            raise ValueError(
                f"regime_chi2 must be positive and regime_ns >= 1, got {self.regime_chi2}, "
                f"{self.regime_ns}"
            )
        if self.arms < 2:
            raise ValueError(f"arms must be >= 2, got {self.arms}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.chi2 > 0:
            raise ValueError(f"chi2 must be > 0, got {self.chi2}")


def config(small: bool = False) -> Config:
    if small:
        return Config(arms=8, n=16, small=True, regime_chi2=(1e-3, 1.0), regime_ns=(16, 256))
    return Config()


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


def _frame(meta: list[dict], table: pd.DataFrame, n: int) -> pd.DataFrame:
    data = pd.DataFrame(meta)
    data["bias"] = table.bias.to_numpy()
    data["bias2"] = data.bias**2
    for col in ("variance", "mse", "mse_zero", "rel_mse_scaled", "kept", "chi2_tok"):
        data[col] = table[col].to_numpy()
    data["n"] = n
    return data


def compute(cfg: Config) -> pd.DataFrame:
    env = make_bandit(cfg.arms, cfg.seed)
    ests, meta = knob_estimators(cfg.small)
    reps = 2 if cfg.small else 10

    def at(chi2: float, n: int) -> pd.DataFrame:
        mu = shifts.dial(env.pi, chi2, divergence="chi2", family=cfg.shift_family)
        table = experiment.run(
            env, mu, ests, n=n, reps=reps, seed=cfg.seed, exact=True, progress=False
        )
        return _frame(meta, table, n)

    data = at(cfg.chi2, cfg.n)
    regimes = []
    for chi2 in cfg.regime_chi2:
        for n in cfg.regime_ns:
            frame = at(float(chi2), int(n))
            frame["target_chi2"] = float(chi2)
            regimes.append(frame)
    data.attrs["regimes"] = pd.concat(regimes, ignore_index=True)
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


def _best(part: pd.DataFrame, column: str) -> tuple[int, str]:
    """(position of the lowest ``column`` in the value-sorted ``part``, where it sits)."""
    i = int(np.argmin(part[column].to_numpy()))
    return i, "an end of the sweep" if i in (0, len(part) - 1) else "inside the sweep"


def notes(data: pd.DataFrame) -> tuple[str, ...]:
    """Sentences under the plot, built from ``data``: per knob, which endpoints its path ends
    near (:data:`NEAR_FACTOR`), the knob value of lowest rel_mse_scaled (interior or at an end
    of the sweep) and, where it differs, the value of lowest MSE and whether that MSE is below
    ĝ ≡ 0's; and from ``data.attrs["regimes"]``, per knob, its best rel_mse_scaled relative to
    naive's across χ² and n."""
    floor = _floor(data)
    ends = {n: data[data.mapping == n].iloc[0] for n in ENDPOINTS if (data.mapping == n).any()}
    row0 = data.iloc[0]
    zero = float(row0.mse_zero)
    lines = [
        f"Bandit of bandit_bias_variance, χ²(π‖μ) = {row0.chi2_tok:.3g}, n = {int(row0.n)}; "
        + ", ".join(
            f"{n}: bias² {_claims.fmt(r.bias2)}, variance {_claims.fmt(r.variance)}, "
            f"MSE {_claims.fmt(r.mse)}, rel_mse_scaled {r.rel_mse_scaled:.3g}"
            for n, r in ends.items()
        )
        + f"; ĝ ≡ 0 has MSE ‖∇J‖² = {_claims.fmt(zero)}. 'Near' = bias² and variance within "
        f"×{NEAR_FACTOR:g}."
    ]
    joins, others = [], []
    best, disagree = [], []
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
        i, where = _best(part, "rel_mse_scaled")
        best.append(
            f"{name} at {symbol} = {part.value.iloc[i]:.3g} (rel_mse_scaled "
            f"{part.rel_mse_scaled.iloc[i]:.3g}, {where})"
        )
        k, _ = _best(part, "mse")
        if k != i:
            below = "below" if part.mse.iloc[k] < zero else "above"
            disagree.append(
                f"{name} at {symbol} = {part.value.iloc[k]:.3g} (MSE "
                f"{_claims.fmt(part.mse.iloc[k])}, {below} ĝ ≡ 0's; rel_mse_scaled "
                f"{part.rel_mse_scaled.iloc[k]:.3g})"
            )
    lines.append(
        f"Paths from near naive to near sequence IS: {_claims.name_list(joins)}; the others: "
        f"{', '.join(others) if others else 'none'}."
    )
    lines.append("Lowest rel_mse_scaled per knob: " + "; ".join(best) + ".")
    lines.append(
        "The MSE would pick another setting: " + "; ".join(disagree) + "."
        if disagree
        else "The MSE picks the same setting for every knob."
    )
    lines.extend(regime_notes(data.attrs.get("regimes")))
    return tuple(lines)


def regime_ratios(regimes: pd.DataFrame) -> pd.DataFrame:
    """Per (knob mapping, χ², n): the knob's lowest rel_mse_scaled over its sweep divided by
    naive's (< 1: the best setting of the knob beats naive), and that setting's value."""
    rows = []
    for (chi2, n), part in regimes.groupby(["target_chi2", "n"], sort=True):
        naive = float(part[part.mapping == "naive"].rel_mse_scaled.iloc[0])
        for name in KNOBS:
            knob = part[part.mapping == name].sort_values("value")
            if not len(knob):
                continue
            i, where = _best(knob, "rel_mse_scaled")
            rows.append(
                {
                    "mapping": name,
                    "target_chi2": chi2,
                    "n": n,
                    "ratio": float(knob.rel_mse_scaled.iloc[i]) / naive,
                    "value": float(knob.value.iloc[i]),
                    "where": where,
                }
            )
    return pd.DataFrame(rows)


def regime_notes(regimes: pd.DataFrame | None) -> list[str]:
    """Per n: each knob's best rel_mse_scaled relative to naive's at the smallest and the
    largest χ² of the regimes (one bandit: a property of this instance, not a ranking)."""
    if regimes is None or not len(regimes):
        return []
    ratios = regime_ratios(regimes)
    lo, hi = ratios.target_chi2.min(), ratios.target_chi2.max()
    lines = []
    for n, part in ratios.groupby("n", sort=True):
        at = part.set_index(["mapping", "target_chi2"])
        pieces = [
            f"{name} {at.loc[(name, lo), 'ratio']:.3f} → {at.loc[(name, hi), 'ratio']:.3f}"
            for name in dict.fromkeys(part.mapping)
        ]
        lines.append(
            f"Best rel_mse_scaled over the sweep / naive's, χ² = {lo:.3g} → {hi:.3g}, n = "
            f"{int(n)} (this bandit): " + ", ".join(pieces) + "."
        )
    return lines


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
    regimes = data.attrs.get("regimes")
    with_regimes = regimes is not None and len(regimes) > 0
    fig, panels = split_figure(11.0 if with_regimes else 7.0, 4.8, data.attrs.get("notes", ()))
    if with_regimes:
        ax, *side = panels.subplots(
            1,
            1 + regimes.n.nunique(),
            gridspec_kw={"width_ratios": [2.4] + [1] * regimes.n.nunique()},
        )
    else:
        ax, side = panels.subplots(), []
    floor = _floor(data)  # exact zeros (~1e-34 in floating point) are drawn on this floor
    x_all = np.maximum(data.bias2.to_numpy(), floor)
    # iso-MSE curves
    x_grid = np.geomspace(floor, x_all.max() * 3, 200)
    v_min, v_max = data.variance.min(), data.variance.max()
    for level in np.geomspace(data.mse.min(), data.mse.max(), 5):
        y = level - x_grid
        ok = y > v_min / 3
        ax.plot(x_grid[ok], y[ok], color="0.75", linestyle=":", linewidth=0.8, zorder=0)
    zero = float(data.mse_zero.iloc[0])  # the error of ĝ ≡ 0: bias² + variance = ‖∇J‖²
    y = zero - x_grid
    ok = y > v_min / 3
    ax.plot(
        x_grid[ok],
        y[ok],
        color="0.3",
        linestyle="--",
        linewidth=1.0,
        zorder=1,
        label="MSE of ĝ ≡ 0",
    )
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
            best = int(np.argmin(part.rel_mse_scaled.to_numpy()))
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
    if side:
        _draw_regimes(side, regimes)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=6.5, ncol=3)
    else:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    return fig


def _draw_regimes(axes, regimes: pd.DataFrame) -> None:
    """One panel per n: each knob's best rel_mse_scaled / naive's against χ²."""
    ratios = regime_ratios(regimes)
    for ax, (n, part) in zip(axes, ratios.groupby("n", sort=True), strict=True):
        for name in dict.fromkeys(part.mapping):
            line = part[part.mapping == name].sort_values("target_chi2")
            ax.plot(
                line.target_chi2,
                line.ratio,
                marker=style.marker(name),
                markersize=3,
                **style.line_kwargs(name),
            )
        ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_xlabel(r"$\chi^2(\pi\|\mu)$")
        ax.set_title(f"best over the knob / naive, n = {int(n)}", fontsize=8)
    axes[0].set_ylabel("rel_mse_scaled (best setting) / naive's")
    lo = min(a.get_ylim()[0] for a in axes)
    hi = max(a.get_ylim()[1] for a in axes)
    for a in axes:
        a.set_ylim(lo, hi)
