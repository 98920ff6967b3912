"""The length trap: sequence MIS keeps nothing beyond T* = log C / log ρ̄, Geo-Mask keeps all.

rl-collapse (Liu, Li et al. 2025, part 3): when every token ratio is about ρ̄ > 1 (a systematic
training–inference mismatch), the sequence ratio grows like W ≈ ρ̄^T, so a one-sided sequence
mask 1[W ≤ C] (sequence MIS) rejects every sequence longer than
T* = log C / log ρ̄ (:func:`simkit.theory.length_trap_T`; C = 5, ρ̄ = 1.001 ⇒ T* ≈ 1610), while the
length-normalised Geo-Mask 1[lo ≤ s ≤ hi] on the geometric mean s = exp(mean_t log r_t) keeps
them whatever the length.

Model: token log-ratios i.i.d. N(log ρ̄, σ²). Then log W ~ N(T log ρ̄, T σ²) and
log s ~ N(log ρ̄, σ²/T), so the kept fractions have the closed forms

    P(W ≤ C)           = Φ((log C − T log ρ̄) / (σ √T)),
    P(lo ≤ s ≤ hi)     = Φ((log hi − log ρ̄) √T / σ) − Φ((log lo − log ρ̄) √T / σ),

drawn as curves; the Monte Carlo points apply the registered mappings ``mis_seq`` (c_high = C)
and ``geo_mask`` to sampled log-ratios (kept = non-zero coefficient) with binomial standard
errors.

Data (dict): ``curves`` (DataFrame: rho_bar, T, mapping, kept_exact), ``points`` (DataFrame:
rho_bar, T, mapping, kept_mc, se), ``t_star`` (dict ρ̄ → T*), ``config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.special import ndtr

from simkit import mappings, theory
from simkit.figures import _common, style

NAME = "length_trap"
TITLE = "The length trap: sequence MIS vs Geo-Mask"
CAPTION = (
    "fraction of sequences kept vs length T when every token log-ratio is N(log ρ̄, σ²): the "
    "sequence mask 1[W ≤ C] (mis_seq, C = 5) rejects everything beyond T* = log C / log ρ̄ "
    "(dotted), the length-normalised Geo-Mask [0.5, 2] keeps everything; curves exact, points "
    "Monte Carlo with ±2 SE."
)


@dataclass(frozen=True)
class Config:
    """Per-token log-ratio model, mask thresholds and the Monte Carlo size."""

    rho_bars: tuple[float, ...] = (1.001, 1.002, 1.005)
    sigma: float = 0.02
    c: float = 5.0
    geo_low: float = 0.5
    geo_high: float = 2.0
    t_min: int = 16
    t_max: int = 8192
    n_curve: int = 200
    n_points: int = 12
    n_seq: int = 1000
    seed: int = 0

    def __post_init__(self):
        if not self.rho_bars or any(not r > 1 for r in self.rho_bars):
            raise ValueError(
                f"rho_bars must be a non-empty tuple of values > 1, got {self.rho_bars}"
            )
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if not self.c > 1:
            raise ValueError(f"c (mask threshold on W) must be > 1, got {self.c}")
        if not 0 < self.geo_low < 1 < self.geo_high:
            raise ValueError(
                f"need 0 < geo_low < 1 < geo_high, got ({self.geo_low}, {self.geo_high})"
            )
        if not 1 <= self.t_min < self.t_max:
            raise ValueError(f"need 1 <= t_min < t_max, got t_min={self.t_min}, t_max={self.t_max}")
        if self.n_curve < 2 or self.n_points < 2 or self.n_seq < 2:
            raise ValueError("n_curve, n_points and n_seq must be >= 2")


def config(small: bool = False) -> Config:
    if small:
        return Config(rho_bars=(1.002, 1.005), t_max=4096, n_curve=50, n_points=6, n_seq=300)
    return Config()


def kept_fraction_mis_seq(T, rho_bar: float, sigma: float, c: float) -> np.ndarray:
    """P(W ≤ C) = Φ((log C − T log ρ̄)/(σ√T)) for T i.i.d. N(log ρ̄, σ²) token log-ratios.

    The exact kept fraction of the one-sided sequence mask (rl-collapse length trap). T: (K,).
    """
    t = np.asarray(T, dtype=np.float64)
    return ndtr((math.log(c) - t * math.log(rho_bar)) / (sigma * np.sqrt(t)))


def kept_fraction_geo_mask(T, rho_bar: float, sigma: float, low: float, high: float) -> np.ndarray:
    """P(lo ≤ s ≤ hi) with log s ~ N(log ρ̄, σ²/T): the exact kept fraction of Geo-Mask. T: (K,)."""
    t = np.asarray(T, dtype=np.float64)
    scale = np.sqrt(t) / sigma
    mean = math.log(rho_bar)
    return ndtr((math.log(high) - mean) * scale) - ndtr((math.log(low) - mean) * scale)


def compute(cfg: Config) -> dict:
    masks = {
        "mis_seq": mappings.get("mis_seq", c_low=0.0, c_high=cfg.c),
        "geo_mask": mappings.get("geo_mask", c_low=cfg.geo_low, c_high=cfg.geo_high),
    }
    t_curve = np.unique(np.geomspace(cfg.t_min, cfg.t_max, cfg.n_curve).round().astype(int))
    t_points = np.unique(np.geomspace(cfg.t_min, cfg.t_max, cfg.n_points).round().astype(int))
    rng = np.random.default_rng(cfg.seed)
    curves, points = [], []
    for rho in cfg.rho_bars:
        exact = {
            "mis_seq": kept_fraction_mis_seq(t_curve, rho, cfg.sigma, cfg.c),
            "geo_mask": kept_fraction_geo_mask(t_curve, rho, cfg.sigma, cfg.geo_low, cfg.geo_high),
        }
        for name, kept in exact.items():
            curves.append(
                pd.DataFrame({"rho_bar": rho, "T": t_curve, "mapping": name, "kept_exact": kept})
            )
        # one set of sequences of the largest length; shorter ones are their prefixes (masked)
        log_ratio = rng.normal(math.log(rho), cfg.sigma, size=(cfg.n_seq, int(t_points[-1])))
        positions = np.arange(log_ratio.shape[1])
        advantages = np.ones(cfg.n_seq)
        for T in t_points:
            mask = np.broadcast_to(positions < T, log_ratio.shape)
            for name, mapping in masks.items():
                kept = mapping.coefficients(log_ratio, mask, advantages)[:, 0] != 0
                p = float(kept.mean())
                points.append(
                    {
                        "rho_bar": rho,
                        "T": int(T),
                        "mapping": name,
                        "kept_mc": p,
                        "se": math.sqrt(p * (1 - p) / cfg.n_seq),
                    }
                )
    return {
        "curves": pd.concat(curves, ignore_index=True),
        "points": pd.DataFrame(points),
        "t_star": {rho: float(theory.length_trap_T(cfg.c, rho)) for rho in cfg.rho_bars},
        "config": cfg,
    }


_RHO_STYLES = ("-", "--", ":", "-.")


def draw(data: dict):
    cfg = data["config"]
    fig = _common.new_figure(6.0, 3.4)
    ax = fig.subplots()
    curves, points = data["curves"], data["points"]
    labels = {
        "mis_seq": f"sequence MIS, W ≤ {cfg.c:g}",
        "geo_mask": f"Geo-Mask, {cfg.geo_low:g} ≤ s ≤ {cfg.geo_high:g}",
    }
    for k, rho in enumerate(cfg.rho_bars):
        ls = _RHO_STYLES[k % len(_RHO_STYLES)]
        for name in ("mis_seq", "geo_mask"):
            c = curves[(curves.rho_bar == rho) & (curves.mapping == name)]
            p = points[(points.rho_bar == rho) & (points.mapping == name)]
            label = f"{labels[name]}, ρ̄ = {rho:g}" if name == "mis_seq" else None
            if name == "geo_mask" and k == 0:
                label = f"{labels[name]} (every ρ̄)"
            ax.plot(c["T"], c.kept_exact, color=style.color(name), linestyle=ls, label=label)
            ax.errorbar(
                p["T"],
                p.kept_mc,
                yerr=2 * p.se,
                fmt=style.marker(name),
                color=style.color(name),
                markersize=3,
                capsize=1.5,
                elinewidth=0.7,
            )
        t_star = data["t_star"][rho]
        ax.axvline(t_star, color="0.4", linestyle=":", linewidth=0.8)
        ax.annotate(
            f"T* = {t_star:.0f}",
            (t_star, 1.07),
            ha="center",
            va="center",
            fontsize=7,
            color="0.3",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5},
        )
    ax.set_xscale("log")
    ax.set_ylim(-0.04, 1.12)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("fraction of sequences kept")
    handles, names = ax.get_legend_handles_labels()
    order = sorted(range(len(names)), key=lambda i: names[i].startswith("Geo"))
    ax.legend([handles[i] for i in order], [names[i] for i in order], loc="lower left", fontsize=7)
    ax.set_title(
        f"Token log-ratios ~ N(log ρ̄, σ²), σ = {cfg.sigma:g}; T* = log C / log ρ̄ dotted; "
        f"{cfg.n_seq} sequences per point",
        fontsize=9,
    )
    return fig
