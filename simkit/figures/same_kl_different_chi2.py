"""Same KL, different χ²: why a KL trust region does not control the variance of IS gradients.

KL ≤ log(1+χ²) (Jensen; reference sheet §F) goes one way only: at a fixed per-token
KL(π‖μ), χ²(π‖μ) can be anything above e^KL − 1 (heavy-tailed ratios on rare tokens), and
the variance of importance-weighted gradients follows χ², not KL (E_μ[W²] = Π_t (1+χ²_t)).

Setting: a token MDP of i.i.d. tokens (``TokenMDP.iid``: R = 1 iff the answer token appears),
π with seeded peaky logits (a rare token makes large χ² reachable), and at every position
μ = :func:`simkit.shifts.dial_pair` (π, kl, χ²) — the exponential ``tilt`` family solved for both
divergences — for a grid of χ² at one fixed KL. Every per-sample mapping of the registry
(defaults, oracle advantage, ``seq-mean-token-sum``) runs through
:func:`simkit.experiment.run`'s exact path (every sequence enumerated); batch-dependent
mappings (snis, psis, m2po) have no exact path and are left out.

Data: the tidy DataFrame of :func:`simkit.experiment.run`, one row per (mapping, χ² target),
with ``target_chi2``, ``target_kl`` and ``family`` columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, mappings, shifts
from simkit.envs import TokenMDP
from simkit.estimators import Estimator
from simkit.figures import _common, style

NAME = "same_kl_different_chi2"
TITLE = "Same KL, different χ²: variance follows χ²"
CAPTION = (
    "every per-sample mapping on a token MDP of T i.i.d. tokens whose behaviour μ has, at "
    "every position, the same KL(π‖μ) and a χ²(π‖μ) swept over three decades (shifts.dial_pair): "
    "gradient variance and MSE (exact, n samples) grow with χ² at constant KL — a KL trust "
    "region does not bound the variance."
)


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
            mapping_names=("naive", "is_token", "is_seq", "ppo_clip", "tis_seq", "vespo"),
        )
    return Config()


def per_sample_mappings() -> list[str]:
    """Registered mappings with an exact per-sample path (not batch dependent)."""
    return [n for n in mappings.available() if not mappings.mapping_class(n).batch_dependent]


def compute(cfg: Config) -> pd.DataFrame:
    env = TokenMDP.iid(V=cfg.V, T=cfg.T, seed=cfg.seed, scale=cfg.scale)
    names = list(cfg.mapping_names) if cfg.mapping_names is not None else per_sample_mappings()
    ests = [
        Estimator(mappings.get(n), aggregation="seq-mean-token-sum", advantage="oracle", name=n)
        for n in names
    ]
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
    return data


def draw(data: pd.DataFrame):
    fig = _common.new_figure(7.2, 4.4)
    axes = fig.subplots(1, 2, sharex=True)
    names = list(dict.fromkeys(data.mapping))
    for ax, (metric, label) in zip(
        axes,
        (
            ("variance", r"variance $\mathbb{E}\|\hat g - \mathbb{E}\hat g\|^2$"),
            ("mse", r"MSE $\mathbb{E}\|\hat g - \nabla J\|^2$"),
        ),
        strict=True,
    ):
        for name in names:
            part = data[data.mapping == name].sort_values("chi2_tok")
            ax.plot(
                part.chi2_tok,
                _common.finite_positive(part[metric]),
                marker=style.marker(name),
                markersize=2.5,
                **style.line_kwargs(name, linewidth=1.1),
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(r"per-token $\chi^2(\pi\,\|\,\mu)$ at fixed KL")
        ax.set_ylabel(label)
        ax.set_title(metric if metric == "variance" else "MSE (bias² + variance)")
    _common.panel_label(axes[0], "a")
    _common.panel_label(axes[1], "b")
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside right center",
        fontsize=6,
        title="mapping",
        title_fontsize=7.5,
    )
    kl = float(data.kl_tok.iloc[0])
    fig.suptitle(
        f"KL(π‖μ) = {kl:.3g} per token everywhere, T = {int(data['T'].iloc[0])}, "
        f"n = {int(data.n.iloc[0])}: variance follows χ², not KL"
    )
    return fig
