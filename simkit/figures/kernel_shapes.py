"""VESPO Fig. 2, regenerated: surrogate f(W) and coefficient φ(W) = W·f'(W) of three kernels.

VESPO (Shen et al., arXiv 2602.10693 v3), Fig. 2: f and φ for A > 0 and A < 0 on W ∈ [0, 3] for
SAPO (τ_pos = 1.0, τ_neg = 1.05), VESPO ((k, λ) = (2, 3) for A ≥ 0, (3, 2) for A < 0, drawn
peak-normalised: φ/φ_max and f/φ_max so that W·f'(W) = φ still holds for the drawn pair) and the
hard clip of PPO/GRPO (ε = 0.2), with the identity φ = W (plain IS) dashed. Rows: f, φ;
columns: A > 0, A < 0.

Data: a tidy DataFrame with columns ``curve``, ``mapping``, ``advantage`` (``"A>0"``/``"A<0"``),
``quantity`` (``"f"``/``"phi"``), ``w``, ``value``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import mappings, theory
from simkit.figures import _common, style

NAME = "kernel_shapes"
TITLE = "Reshaping kernels f(W) and φ(W) (VESPO Fig. 2)"
CAPTION = (
    "surrogate f and coefficient φ = W·f′ for SAPO, peak-normalised VESPO and the PPO hard "
    "clip (ε = 0.2), for positive and negative advantages, against plain IS (φ = W)."
)

#: curve label -> mapping registry name (for colours)
CURVES = {
    "SAPO": "sapo",
    "VESPO (peak-normalised)": "vespo",
    "hard clip": "ppo_clip",
    "IS (φ = W)": "is_seq",
}


@dataclass(frozen=True)
class Config:
    """Grid and kernel hyperparameters (defaults = the paper's Fig. 2)."""

    w_max: float = 3.0
    n_points: int = 601
    clip_eps: float = 0.2
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self):
        _common.check_ratio_grid(self.w_max, self.n_points)
        for field in (
            "clip_eps",
            "sapo_tau_pos",
            "sapo_tau_neg",
            "vespo_lambda_pos",
            "vespo_lambda_neg",
        ):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        for field in ("vespo_k_pos", "vespo_k_neg"):
            if not getattr(self, field) >= 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


def config(small: bool = False) -> Config:
    """Default configuration; ``small`` uses a coarser grid."""
    return Config(n_points=121) if small else Config()


def compute(cfg: Config) -> pd.DataFrame:
    """Evaluate f and φ of every curve on W ∈ [0, w_max] for both advantage signs."""
    w = np.linspace(0.0, cfg.w_max, cfg.n_points)
    clip = mappings.get("ppo_clip", eps_low=cfg.clip_eps, eps_high=cfg.clip_eps)
    sapo = mappings.get("sapo", tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg)
    rows = []

    def add(curve, sign, f_values, phi_values):
        for quantity, values in (("f", f_values), ("phi", phi_values)):
            rows.append(
                pd.DataFrame(
                    {
                        "curve": curve,
                        "mapping": CURVES[curve],
                        "advantage": sign,
                        "quantity": quantity,
                        "w": w,
                        "value": np.asarray(values, dtype=np.float64),
                    }
                )
            )

    for positive, sign in ((True, "A>0"), (False, "A<0")):
        k = cfg.vespo_k_pos if positive else cfg.vespo_k_neg
        lam = cfg.vespo_lambda_pos if positive else cfg.vespo_lambda_neg
        phi_max, _ = theory.vespo_phi_max(k, lam)
        add("SAPO", sign, sapo.f(w, positive), sapo.phi(w, positive))
        add(
            "VESPO (peak-normalised)",
            sign,
            theory.vespo_f(w, k, lam) / phi_max,
            theory.vespo_phi(w, k, lam) / phi_max,
        )
        add("hard clip", sign, clip.f(w, positive), clip.phi(w, positive))
        add("IS (φ = W)", sign, w, w)
    return pd.concat(rows, ignore_index=True)


def draw(data: pd.DataFrame):
    """2×2 panels: rows f(W), φ(W); columns A > 0, A < 0."""
    fig = _common.new_figure(7.0, 5.0)
    axes = fig.subplots(2, 2, sharex=True)
    ylabels = {"f": r"surrogate $f(W)$", "phi": r"coefficient $\varphi(W) = W f'(W)$"}
    for i, quantity in enumerate(("f", "phi")):
        for j, sign in enumerate(("A>0", "A<0")):
            ax = axes[i, j]
            part = data[(data.quantity == quantity) & (data.advantage == sign)]
            for curve, name in CURVES.items():
                line = part[part.curve == curve]
                if name == "is_seq":
                    kw = {
                        "color": style.SERIES_COLORS["identity"],
                        "linestyle": "--",
                        "linewidth": 1.0,
                    }
                else:
                    kw = {"color": style.color(name), "linestyle": "-", "linewidth": 1.8}
                ax.plot(line.w, line.value, label=curve, **kw)
            ax.axvline(1.0, color="0.6", linewidth=0.6, linestyle=":")
            ax.set_xlim(0, float(data.w.max()))
            shown = data[(data.quantity == quantity) & (data.mapping != "is_seq")].value
            ax.set_ylim(-0.05, 1.06 * float(np.nanmax(shown)))
            if i == 0:
                ax.set_title(r"$A > 0$" if sign == "A>0" else r"$A < 0$")
            if i == 1:
                ax.set_xlabel(r"sequence / token ratio $W = \pi/\mu$")
            if j == 0:
                ax.set_ylabel(ylabels[quantity])
            _common.panel_label(ax, "abcd"[2 * i + j])
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4)
    fig.suptitle("Reshaping kernels (after VESPO, arXiv 2602.10693, Fig. 2)")
    return fig
