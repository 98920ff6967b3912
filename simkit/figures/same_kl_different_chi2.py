"""Same KL, different χ²: why a KL trust region does not control the variance of IS gradients.

KL ≤ log(1+χ²) (Jensen; notation page §F) goes one way only: at a fixed per-token
KL(π‖μ), χ²(π‖μ) can be anything above e^KL − 1 (heavy-tailed ratios on rare tokens), and
the variance of sequence IS follows χ², not KL (E_μ[W²] = Π_t (1+χ²_t)).

Setting: a token MDP of i.i.d. tokens (``TokenMDP.iid``: R = 1 iff the answer token appears),
π with seeded peaky logits (a rare token makes large χ² reachable), and at every position
μ = :func:`simkit.shifts.dial_pair` (π, kl, χ²) — the exponential ``tilt`` family solved for both
divergences — for a grid of χ² at one fixed KL. Every per-sample mapping of the registry
(defaults, oracle advantage, ``seq-mean-token-sum``) runs through
:func:`simkit.experiment.run`'s exact path (every sequence enumerated); batch-dependent
mappings (snis, psis, m2po) have no exact path and are left out.

Only estimators whose coefficient is unbounded in the ratio can grow with χ² at constant KL
(a bounded coefficient |c| ≤ M gives a variance ≤ M²·E‖score·A‖²/n whatever χ²); the notes
under the panels (:func:`notes`) say which ones do, with their numbers, and whether every one
that grows has an unbounded coefficient (:func:`simkit.figures._claims.coefficient_unbounded`).
Small multiples by family (:data:`simkit.figures._claims.PANELS`), naive and sequence IS drawn
as references in every panel, so that a flat curve is never hidden under a growing one.

Data: the tidy DataFrame of :func:`simkit.experiment.run`, one row per (mapping, χ² target),
with ``target_chi2``, ``target_kl``, ``family``, ``panel`` and ``unbounded`` (the mapping's
coefficient grows without bound in the ratio) columns; ``data.attrs["notes"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, shifts
from simkit.envs import TokenMDP
from simkit.figures import _claims, _common, style
from simkit.figures.staleness_curves import split_figure

NAME = "same_kl_different_chi2"
TITLE = "Same KL, different χ²: which variances follow χ²"
CAPTION = (
    "every per-sample mapping on a token MDP of T i.i.d. tokens whose behaviour μ has, at "
    "every position, the same KL(π‖μ) and a χ²(π‖μ) swept over three decades (shifts.dial_pair), "
    "in small multiples by family with naive and sequence IS as references in every panel: "
    "exact gradient variance and MSE (n samples). Which estimators grow with χ² at constant KL, "
    "and whether each of them has an unbounded coefficient, is stated in the notes under the "
    "panels, computed from the data."
)

#: a series "grows" when its last value is at least this multiple of its first
GROWTH_FACTOR = 2.0


@dataclass(frozen=True)
class Config:
    """Environment, the fixed KL, the χ² grid and estimator settings."""

    V: int = 8
    T: int = 3
    scale: float = 2.5
    kl: float = 0.05
    chi2_min: float = 0.1
    chi2_max: float = 60.0
    n_chi2: int = 9
    n: int = 16
    reps: int = 50
    seed: int = 0
    mapping_names: tuple[str, ...] | None = None  # None: every per-sample mapping

    def __post_init__(self):
        if self.V < 2 or self.T < 1:
            raise ValueError(f"need V >= 2 and T >= 1, got V={self.V}, T={self.T}")
        if self.V**self.T > 2**16:
            raise ValueError(f"V^T = {self.V**self.T} sequences: too many for a figure")
        if not self.kl > 0:
            raise ValueError(f"kl must be > 0, got {self.kl}")
        if not np.expm1(self.kl) < self.chi2_min < self.chi2_max:
            raise ValueError(
                f"need e^kl − 1 = {np.expm1(self.kl):.4g} < chi2_min < chi2_max (Jensen: "
                f"KL ≤ log(1+χ²)), got chi2_min={self.chi2_min}, chi2_max={self.chi2_max}"
            )
        if self.n_chi2 < 2 or self.n < 1 or self.reps < 2:
            raise ValueError("need n_chi2 >= 2, n >= 1 and reps >= 2")

    @property
    def chi2_grid(self) -> np.ndarray:
        return np.geomspace(self.chi2_min, self.chi2_max, self.n_chi2)


def config(small: bool = False) -> Config:
    if small:
        return Config(
            T=2,
            n_chi2=3,
            chi2_max=20.0,
            reps=10,
            mapping_names=_common.SMALL_EXACT_MAPPINGS,
        )
    return Config()


def compute(cfg: Config) -> pd.DataFrame:
    env = TokenMDP.iid(V=cfg.V, T=cfg.T, seed=cfg.seed, scale=cfg.scale)
    names = _common.chosen_mappings(cfg.mapping_names, _common.per_sample_mappings())
    ests = _common.oracle_estimators(names)
    frames = []
    for target in cfg.chi2_grid:
        mu = shifts.dial_pair(env.pi, kl=cfg.kl, chi2=float(target))
        frames.append(
            experiment.run(
                env,
                mu,
                ests,
                n=cfg.n,
                reps=cfg.reps,
                seed=cfg.seed,
                exact=True,
                progress=False,
                setting={"target_chi2": float(target), "target_kl": cfg.kl},
            )
        )
    data = pd.concat(frames, ignore_index=True)
    data["family"] = [style.family(m) for m in data.mapping]
    data["panel"] = [_claims.panel_of(m) for m in data.mapping]
    unbounded = {e.name: _claims.coefficient_unbounded(e.mapping) for e in ests}
    data["unbounded"] = data.mapping.map(unbounded).astype(bool)
    data.attrs["notes"] = notes(data)
    return data


def _pairs(table: pd.DataFrame, names) -> str:
    return ", ".join(
        f"{n} ({_claims.fmt(table.loc[n, 'first'])} → {_claims.fmt(table.loc[n, 'last'])})"
        for n in names
    )


def verdict(data: pd.DataFrame, metric: str = "variance") -> dict:
    """Which mappings' ``metric`` grows / stays flat / falls over the χ² grid, and how that
    lines up with unbounded coefficients: a dict of name lists and the growth table."""
    table = _claims.growth(data, metric, "target_chi2", factor=GROWTH_FACTOR)
    unbounded = data.groupby("mapping", sort=False).unbounded.first()
    table["unbounded"] = unbounded.reindex(table.index).to_numpy()
    grows = [n for n in table.index if table.loc[n, "verdict"] == "grows"]
    return {
        "table": table,
        "grows": grows,
        "not_growing": [n for n in table.index if table.loc[n, "verdict"] in ("flat", "falls")],
        "falls": [n for n in table.index if table.loc[n, "verdict"] == "falls"],
        "grows_bounded": [n for n in grows if not table.loc[n, "unbounded"]],
        "unbounded_flat": [n for n in table.index if table.loc[n, "unbounded"] and n not in grows],
    }


def headline(data: pd.DataFrame) -> str:
    """The figure's title verdict, from :func:`verdict` on the variance."""
    v = verdict(data)
    if v["grows"] and not v["grows_bounded"]:
        return "at fixed KL, only unbounded coefficients grow with χ²"
    if not v["grows"]:
        return "at fixed KL, no estimator's variance grows with χ² here"
    return "at fixed KL, variance grows with χ² (bounded coefficients included)"


def notes(data: pd.DataFrame) -> tuple[str, ...]:
    """The sentences under the figure, each built from ``data``."""
    row = data.iloc[0]
    lo, hi = data.target_chi2.min(), data.target_chi2.max()
    lines = [
        f"Setting: TokenMDP.iid, T = {int(row['T'])}, KL(π‖μ) = {row.kl_tok:.3g} per token at "
        f"every position, χ²(π‖μ) per token from {lo:.3g} to {hi:.3g} (shifts.dial_pair, "
        f"{data.target_chi2.nunique()} points); n = {int(row.n)} sequences per estimate, "
        f"advantage {_claims.advantage_text(row.advantage)}, aggregation "
        f"'{row.aggregation}'; exact (every sequence "
        "enumerated). 'Grows': last/first ≥ "
        f"{GROWTH_FACTOR:g}; 'unbounded': |c(w)| → ∞ as the ratio w → ∞ for one sign of A."
    ]
    for metric in ("variance", "mse"):
        v = verdict(data, metric)
        t = v["table"]
        what = "Variance" if metric == "variance" else "MSE"
        if v["grows"]:
            text = f"{what} grows with χ² at constant KL for {_pairs(t, v['grows'])}"
            if v["grows_bounded"]:
                text += (
                    f" — including {_claims.name_list(v['grows_bounded'])}, whose coefficient "
                    "is bounded"
                )
            else:
                text += " — every one of them has an unbounded coefficient"
        else:
            text = f"{what} grows with χ² for no estimator"
        rest = ", ".join(f"{n} ×{t.loc[n, 'ratio']:.2g}" for n in v["not_growing"])
        text += f". It stays within ×{GROWTH_FACTOR:g} or falls for the others ({rest})"
        if v["unbounded_flat"]:
            text += f"; {_claims.name_list(v['unbounded_flat'])} " + (
                "has an unbounded coefficient but does not grow here"
                if len(v["unbounded_flat"]) == 1
                else "have unbounded coefficients but do not grow here"
            )
        lines.append(text + ".")
    return tuple(lines)


def draw(data: pd.DataFrame):
    panel_names = [p for p in _claims.PANELS if (data.panel == p).any()]
    fig, sub = split_figure(7.4, 4.4, data.attrs.get("notes", ()))
    axes = sub.subplots(2, len(panel_names), sharex=True, sharey="row", squeeze=False)
    metrics = (
        ("variance", r"variance $\mathbb{E}\|\hat g - \mathbb{E}\hat g\|^2$"),
        ("mse", r"MSE $\mathbb{E}\|\hat g - \nabla J\|^2$"),
    )
    refs = [r for r in _claims.REFERENCES if (data.mapping == r).any()]
    for j, panel in enumerate(panel_names):
        members = list(dict.fromkeys(data.mapping[data.panel == panel]))
        for i, (metric, label) in enumerate(metrics):
            ax = axes[i, j]
            for name in refs:
                if name in members:
                    continue
                part = data[data.mapping == name].sort_values("chi2_tok")
                ax.plot(
                    part.chi2_tok,
                    _common.finite_positive(part[metric]),
                    color=style.color(name),
                    linestyle=":",
                    linewidth=0.9,
                    alpha=0.7,
                    label=f"{name} (reference)",
                )
            for k, name in enumerate(members):
                part = data[data.mapping == name].sort_values("chi2_tok")
                unb = bool(part.unbounded.iloc[0])
                ax.plot(
                    part.chi2_tok,
                    _common.finite_positive(part[metric]),
                    marker=style.marker(name),
                    markersize=3.2,
                    markevery=(k % 3, 3),  # members stagger markers: coinciding curves show
                    **style.line_kwargs(
                        name, linewidth=1.2, label=f"{name}{' (unbounded c)' if unb else ''}"
                    ),
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            if j == 0:
                ax.set_ylabel(label)
            if i == 0:
                ax.set_title(panel, fontsize=8.5)
                ax.legend(fontsize=5.2, loc="upper left", handlelength=2.2)
            if i == 1:
                ax.set_xlabel(r"per-token $\chi^2(\pi\|\mu)$")
    row = data.iloc[0]
    sub.suptitle(
        f"KL(π‖μ) = {row.kl_tok:.3g} per token everywhere, T = {int(row['T'])}, "
        f"n = {int(row.n)}: {headline(data)}",
        fontsize=9,
    )
    return fig
