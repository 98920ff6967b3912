"""GSPO conflates lengths: equal mean log-ratio ⇒ equal GSPO weight, whatever the true weight W.

VESPO (Shen et al., arXiv 2602.10693 v3), Prop. E.1: GSPO's weight is the geometric mean
s = exp((1/T) Σ_t log r_t), so two sequences with the same mean log-ratio m get the same weight
s = e^m whatever their lengths, while the true sequence ratio W = Π_t r_t = e^{T·m} differs by
orders of magnitude (e^{T m} grows or decays exponentially in T).

Sequences of each length T with i.i.d. N(m, σ²) token log-ratios recentred to have mean exactly m
are fed to the registered ``gspo`` mapping (library clip band ε = 0.2, so that s stays inside it
and the coefficient is s itself) and to ``is_seq`` (coefficient W). Panel (b) scatters random
sequences of random lengths: W is not a function of s.

Data (dict): ``lines`` (DataFrame: mean_log_ratio, T, gspo, is_seq, w_exact) and ``cloud``
(DataFrame: T, mean_log_ratio, gspo, is_seq), ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import mappings
from simkit.figures import _common, style

NAME = "gspo_length_conflation"
TITLE = "GSPO conflates lengths (VESPO Prop. E.1)"
CAPTION = (
    "(a) sequences with the same mean token log-ratio m get the same GSPO weight s = e^m at "
    "every length T, while the true sequence ratio W = e^{T·m} explodes or vanishes; (b) random "
    "sequences of random lengths: W against the GSPO weight s, coloured by T — W is not a "
    "function of s. Coefficients from the registered gspo (ε = 0.2) and is_seq mappings."
)


@dataclass(frozen=True)
class Config:
    """Mean log-ratios, lengths, token noise and the random cloud of panel (b)."""

    mean_log_ratios: tuple[float, ...] = (-0.01, -0.003, 0.003, 0.01)
    lengths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    sigma: float = 0.1
    eps: float = 0.2
    n_cloud: int = 600
    cloud_t_max: int = 2048
    cloud_m_max: float = 0.01
    seed: int = 0

    def __post_init__(self):
        if not self.mean_log_ratios:
            raise ValueError("mean_log_ratios must be non-empty")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive integers, got {self.lengths}")
        if not self.sigma >= 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")
        if not 0 < self.eps < 1:
            raise ValueError(f"eps must be in (0, 1), got {self.eps}")
        if max(abs(m) for m in self.mean_log_ratios) >= np.log1p(self.eps):
            raise ValueError(
                "every |mean_log_ratio| must be < log(1 + eps) so that s stays in the clip band"
            )
        if self.n_cloud < 1 or self.cloud_t_max < 1:
            raise ValueError("n_cloud and cloud_t_max must be >= 1")
        if not 0 < self.cloud_m_max < np.log1p(self.eps):
            raise ValueError(f"cloud_m_max must be in (0, log(1 + eps)), got {self.cloud_m_max}")


def config(small: bool = False) -> Config:
    if small:
        return Config(lengths=(1, 4, 16, 64, 256), n_cloud=100, cloud_t_max=256)
    return Config()


def sequences_with_mean(mean: float, T: int, n: int, sigma: float, rng) -> np.ndarray:
    """(n, T) token log-ratios, i.i.d. N(0, σ²) recentred per row, plus ``mean``: every row's
    mean log-ratio is exactly ``mean`` (up to rounding)."""
    noise = rng.normal(0.0, sigma, size=(n, T))
    return noise - noise.mean(axis=1, keepdims=True) + mean


def _coefficient(mapping, log_ratio: np.ndarray) -> np.ndarray:
    """The per-sequence coefficient (first token) of a sequence-level mapping, A > 0."""
    mask = np.ones(log_ratio.shape, dtype=bool)
    return mapping.coefficients(log_ratio, mask, np.ones(log_ratio.shape[0]))[:, 0]


def compute(cfg: Config) -> dict:
    gspo = mappings.get("gspo", eps_low=cfg.eps, eps_high=cfg.eps)
    is_seq = mappings.get("is_seq")
    rng = np.random.default_rng(cfg.seed)
    rows = []
    for m in cfg.mean_log_ratios:
        for T in cfg.lengths:
            lr = sequences_with_mean(m, int(T), 1, cfg.sigma, rng)
            rows.append(
                {
                    "mean_log_ratio": m,
                    "T": int(T),
                    "gspo": float(_coefficient(gspo, lr)[0]),
                    "is_seq": float(_coefficient(is_seq, lr)[0]),
                    "w_exact": float(np.exp(T * m)),
                }
            )
    cloud = []
    lengths = np.unique(np.geomspace(1, cfg.cloud_t_max, 24).round().astype(int))
    t_draw = rng.choice(lengths, size=cfg.n_cloud)
    m_draw = rng.uniform(-cfg.cloud_m_max, cfg.cloud_m_max, size=cfg.n_cloud)
    for T in np.unique(t_draw):
        idx = np.flatnonzero(t_draw == T)
        noise = rng.normal(0.0, cfg.sigma, size=(len(idx), int(T)))
        lr = noise - noise.mean(axis=1, keepdims=True) + m_draw[idx, None]
        for i, g, w in zip(idx, _coefficient(gspo, lr), _coefficient(is_seq, lr), strict=True):
            cloud.append({"T": int(T), "mean_log_ratio": m_draw[i], "gspo": g, "is_seq": w})
    return {
        "lines": pd.DataFrame(rows),
        "cloud": pd.DataFrame(cloud).sort_values("T", kind="stable", ignore_index=True),
        "config": cfg,
    }


def draw(data: dict):
    from matplotlib.colors import LogNorm

    lines, cloud = data["lines"], data["cloud"]
    fig = _common.new_figure(7.2, 3.2)
    ax_a, ax_b = fig.subplots(1, 2)
    shades = ("-", "--", "-.", ":")
    for k, (m, part) in enumerate(lines.groupby("mean_log_ratio", sort=True)):
        ls = shades[k % len(shades)]
        labels = {
            "is_seq": f"true W = e^(T·m), m = {m:+g}",
            "gspo": "GSPO s = e^m (every m, ≈ 1)" if k == 0 else None,
        }
        for name, label in labels.items():
            ax_a.plot(
                part["T"],
                part[name],
                color=style.color(name),
                linestyle=ls,
                marker=style.marker(name),
                markersize=2.5,
                label=label,
            )
    ax_a.set_xscale("log", base=2)
    ax_a.set_yscale("log")
    ax_a.set_xlabel("sequence length T")
    ax_a.set_ylabel("weight")
    ax_a.set_title("same mean log-ratio m, growing length")
    ax_a.legend(fontsize=6.5, loc="lower left")
    sc = ax_b.scatter(
        cloud.gspo,
        cloud.is_seq,
        c=cloud["T"],
        s=5,
        cmap="viridis",
        norm=LogNorm(vmin=1, vmax=cloud["T"].max()),
        linewidths=0,
    )
    ax_b.set_yscale("log")
    ax_b.set_xlabel("GSPO weight s (geometric mean)")
    ax_b.set_ylabel("true sequence ratio W")
    ax_b.set_title("random sequences: W is not a function of s")
    fig.colorbar(sc, ax=ax_b, label="length T")
    _common.panel_label(ax_a, "a")
    _common.panel_label(ax_b, "b")
    return fig
