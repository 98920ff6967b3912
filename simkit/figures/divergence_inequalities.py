"""The chain TV² ≤ ½KL ≤ ½log(1+χ²) ≤ ½χ² on random pairs, and "same KL, growing χ²".

Panel (a): for many random pairs (π, μ) — independent Dirichlet draws with several
concentrations, plus "perturbed" pairs μ ∝ π·exp(σz) close to π — each member of the chain
against χ²(π‖μ) on log axes (½KL and ½log(1+χ²) in nats; TV² and ½χ² are dimensionless, so
the y axis reads "value", not "nats"). ½χ² and ½log(1+χ²) are functions of χ² (lines); TV² and ½KL
(points) stay below them on every pair (Pinsker; Jensen; notation page F).

Panel (b): the two-parameter shift family (:func:`simkit.shifts.dial_pair`), applied to a
geometric π (π_k ∝ 0.5^k), holds KL(π‖μ) fixed while χ² grows by orders of magnitude: a KL
trust region does not bound χ², hence not the variance (1+χ²)^T of sequence IS.

Data: :class:`Data` with ``pairs`` (one row per random pair: ``kind``, ``concentration``,
``chi2``, ``kl``, ``tv``, ``tv_sq``, ``half_kl``, ``half_log1p_chi2``, ``half_chi2``, ``holds``)
and ``same_kl`` (one row per point of the fixed-KL line: ``kl_target`` and the same columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.ticker import NullFormatter

from simkit import divergence, shifts, theory
from simkit.figures import _common, style

NAME = "divergence_inequalities"
TITLE = "TV² ≤ ½KL ≤ ½log(1+χ²) ≤ ½χ², and same KL with growing χ²"
CAPTION = (
    "the Pinsker–Jensen chain on random categorical pairs (Dirichlet draws), each member "
    "against χ²; and a two-parameter shift family holding KL fixed while χ² grows — a KL "
    "trust region does not bound χ². Units: KL and log(1+χ²) are in nats; TV² and χ² are "
    "dimensionless (a squared probability difference and a variance of π/μ), so the chain "
    "compares numbers, not quantities in one unit."
)

#: y-axis label: the four members do not share a unit
UNITS_LABEL = "value\n(½KL, ½log(1+χ²) in nats; TV², ½χ² unitless)"

CHAIN = (
    ("tv_sq", r"$\mathrm{TV}^2$"),
    ("half_kl", r"$\frac{1}{2}\mathrm{KL}$"),
    ("half_log1p_chi2", r"$\frac{1}{2}\log(1+\chi^2)$"),
    ("half_chi2", r"$\frac{1}{2}\chi^2$"),
)


@dataclass(frozen=True)
class Config:
    vocab: int = 10
    pairs_per_setting: int = 300
    concentrations: tuple[float, ...] = (0.5, 1.0, 3.0, 10.0)
    perturbations: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0)
    chi2_plot_max: float = 1e6
    same_kl: tuple[float, ...] = (0.02, 0.2)
    same_kl_points: int = 16
    same_kl_chi2_max: float = 1e3
    same_kl_decay: float = 0.5
    seed: int = 0

    def __post_init__(self):
        if self.vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {self.vocab}")
        if self.pairs_per_setting < 1:
            raise ValueError(f"pairs_per_setting must be >= 1, got {self.pairs_per_setting}")
        if any(c <= 0 for c in self.concentrations + self.perturbations):
            raise ValueError("concentrations and perturbations must be > 0")
        if not self.chi2_plot_max > 0:
            raise ValueError(f"chi2_plot_max must be > 0, got {self.chi2_plot_max}")
        if any(k <= 0 for k in self.same_kl):
            raise ValueError(f"same_kl values must be > 0, got {self.same_kl}")
        if not 0 < self.same_kl_decay < 1:
            raise ValueError(f"same_kl_decay must be in (0, 1), got {self.same_kl_decay}")
        if self.same_kl_points < 2:
            raise ValueError(f"same_kl_points must be >= 2, got {self.same_kl_points}")


@dataclass(frozen=True)
class Data:
    pairs: pd.DataFrame
    same_kl: pd.DataFrame
    vocab: int
    chi2_plot_max: float


def config(small: bool = False) -> Config:
    if small:
        return Config(pairs_per_setting=20, same_kl=(0.2,), same_kl_points=4, same_kl_chi2_max=50.0)
    return Config()


def _chain_frame(pi, mu) -> pd.DataFrame:
    chain = theory.pinsker_chain(pi, mu)
    return pd.DataFrame(
        {
            "chi2": divergence.chi2(pi, mu),
            "kl": divergence.kl(pi, mu),
            "tv": divergence.tv(pi, mu),
            "tv_sq": chain.tv_sq,
            "half_kl": chain.half_kl,
            "half_log1p_chi2": chain.half_log1p_chi2,
            "half_chi2": chain.half_chi2,
            "holds": theory.pinsker_chain_holds(chain).all(axis=-1),
        }
    )


def random_pairs(cfg: Config) -> pd.DataFrame:
    """Seeded random pairs (V = ``vocab``), ``pairs_per_setting`` per setting:

    - ``independent``: π, μ ~ Dirichlet(α·1) independently, for each α in ``concentrations``;
    - ``perturbed``: π ~ Dirichlet(1), μ ∝ π·exp(σ·z) with z ~ N(0, I_V), for each σ in
      ``perturbations`` (close pairs: χ² ≈ σ²·Var_π(z) for small σ).
    """
    rng = np.random.default_rng(cfg.seed)
    frames = []
    m, V = cfg.pairs_per_setting, cfg.vocab
    for alpha in cfg.concentrations:
        pi = rng.dirichlet(np.full(V, alpha), size=m)
        mu = rng.dirichlet(np.full(V, alpha), size=m)
        frames.append(_chain_frame(pi, mu).assign(kind="independent", concentration=alpha))
    for sigma in cfg.perturbations:
        pi = rng.dirichlet(np.ones(V), size=m)
        mu = pi * np.exp(sigma * rng.standard_normal((m, V)))
        mu /= mu.sum(axis=1, keepdims=True)
        frames.append(_chain_frame(pi, mu).assign(kind="perturbed", concentration=sigma))
    data = pd.concat(frames, ignore_index=True)
    return data[
        ["kind", "concentration", *[c for c in data.columns if c not in ("kind", "concentration")]]
    ]


def same_kl_line(cfg: Config) -> pd.DataFrame:
    """Points of :func:`simkit.shifts.dial_pair` with KL fixed and χ² on a geometric grid.

    π is geometric, π_k ∝ decay^k (k = 0…V−1): its rare tail lets the tilt family reach a
    χ² many orders of magnitude above the Jensen minimum e^KL − 1 at the same KL.
    """
    pi = cfg.same_kl_decay ** np.arange(cfg.vocab)
    pi /= pi.sum()
    frames = []
    for kl in cfg.same_kl:
        # the smallest χ² compatible with this KL: KL ≤ log(1+χ²) ⇒ χ² ≥ e^KL − 1 (with margin)
        lo = 1.5 * np.expm1(kl)
        targets = np.geomspace(lo, cfg.same_kl_chi2_max, cfg.same_kl_points)
        mus, kept = [], []
        for chi2 in targets:
            try:
                mus.append(shifts.dial_pair(pi, kl=kl, chi2=float(chi2)))
                kept.append(chi2)
            except ValueError:  # outside the family's feasible region for this π: skip
                continue
        if mus:
            frame = _chain_frame(np.tile(pi, (len(mus), 1)), np.stack(mus))
            frames.append(frame.assign(kl_target=kl, chi2_target=kept))
    return pd.concat(frames, ignore_index=True)


def compute(cfg: Config) -> Data:
    return Data(
        pairs=random_pairs(cfg),
        same_kl=same_kl_line(cfg),
        vocab=cfg.vocab,
        chi2_plot_max=cfg.chi2_plot_max,
    )


def draw(data: Data):
    fig = _common.new_figure(7.2, 3.6)
    ax_a, ax_b = fig.subplots(1, 2)
    shown = (data.pairs.chi2 > 0) & (data.pairs.chi2 <= data.chi2_plot_max)
    pairs = data.pairs[shown]
    x = np.geomspace(pairs.chi2.min(), pairs.chi2.max(), 300)
    for key, label in CHAIN[:2]:
        ax_a.scatter(
            pairs.chi2,
            _common.finite_positive(pairs[key]),
            s=3,
            alpha=0.35,
            color=style.SERIES_COLORS[key],
            label=label,
            linewidths=0,
            rasterized=False,
        )
    ax_a.plot(x, 0.5 * np.log1p(x), color=style.SERIES_COLORS["half_log1p_chi2"], label=CHAIN[2][1])
    ax_a.plot(x, 0.5 * x, color=style.SERIES_COLORS["half_chi2"], label=CHAIN[3][1])
    ax_a.set_xscale("log")
    ax_a.set_yscale("log")
    ax_a.set_xlabel(r"$\chi^2(\pi\,\|\,\mu)$")
    ax_a.set_ylabel(UNITS_LABEL)
    n_pairs = len(data.pairs)
    ok = int(data.pairs.holds.sum())
    ax_a.set_title(f"random pairs: chain holds on {ok}/{n_pairs}")
    hidden = n_pairs - int(shown.sum())
    if hidden:
        ax_a.text(
            0.98,
            0.02,
            f"{hidden} pairs with χ² > {data.chi2_plot_max:.0e} not drawn",
            transform=ax_a.transAxes,
            ha="right",
            va="bottom",
            fontsize=7,
            color="0.35",
        )
    ax_a.legend(loc="upper left", markerscale=3)
    _common.panel_label(ax_a, "a")

    for kl, part in data.same_kl.groupby("kl_target"):
        part = part.sort_values("chi2")
        for key, label in CHAIN:
            ax_b.plot(
                part.chi2,
                _common.finite_positive(part[key]),
                color=style.SERIES_COLORS[key],
                marker="o",
                markersize=2,
                linestyle="-" if kl == max(data.same_kl.kl_target) else "--",
                label=label if kl == max(data.same_kl.kl_target) else None,
            )
        ax_b.annotate(
            f"KL = {kl:g}",
            (part.chi2.iloc[-1], 0.5 * kl),
            xytext=(-2, 4),
            textcoords="offset points",
            ha="right",
            fontsize=7,
            color=style.SERIES_COLORS["half_kl"],
        )
    ax_b.set_xscale("log")
    ax_b.set_yscale("log")
    ax_b.set_xlabel(r"$\chi^2(\pi\,\|\,\mu)$ (KL held fixed)")
    ax_b.xaxis.set_minor_formatter(NullFormatter())
    ax_b.set_ylabel(UNITS_LABEL)
    ax_b.set_title(r"tilt shift: same KL, growing $\chi^2$")
    ax_b.legend(loc="upper left")
    _common.panel_label(ax_b, "b")
    fig.suptitle(
        r"$\mathrm{TV}^2 \leq \frac{1}{2}\mathrm{KL} \leq \frac{1}{2}\log(1+\chi^2) "
        rf"\leq \frac{{1}}{{2}}\chi^2$ on categorical pairs, V = {data.vocab}"
    )
    return fig
