"""Every mapping's MSE and cosine to ∇J vs the sequence length T at a fixed per-token χ².

Token-level corrections (token IS, PPO clip, CISPO, TIS…) are biased through the state
distribution, with a bias that grows with T (rl-collapse, Liu, Li et al. 2025: O(T²·Δ_max));
sequence-level IS is unbiased but its variance grows like (1+χ²)^T. Where the MSE curves cross
is the practical answer to "token or sequence?".

Setting: ``TokenMDP.answer_correct`` (R = 1 iff the last token is the answer; the policy depends
on whether the last token was correct), μ dialed by :func:`simkit.envs.behaviour.behaviour` so
that every state's next-token distribution has χ²(π‖μ) = ``chi2_tok`` (logit noise), for each
T of a grid. Every per-sample mapping (defaults, oracle advantage, ``seq-mean-token-sum``) runs
through :func:`simkit.experiment.run`'s exact path (all V^T sequences enumerated); the
batch-dependent mappings (snis, psis, m2po) have no exact path and are left out.

Data: the tidy DataFrame of :func:`simkit.experiment.run`, one row per (mapping, T), plus
``family`` and ``delta_max`` (the largest per-state TV(π, μ), for the rl-collapse bias shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, mappings
from simkit.envs import TokenMDP
from simkit.envs.behaviour import behaviour
from simkit.estimators import Estimator
from simkit.figures import _common, style

NAME = "mse_vs_T"
TITLE = "MSE and cosine of every mapping vs T"
CAPTION = (
    "every per-sample mapping on a token MDP (answer_correct, V = 2) at a fixed per-token "
    "χ²(π‖μ) in every state, against the sequence length T: MSE (a) and cosine to ∇J (b), "
    "exact by enumeration of all sequences; where sequence IS's MSE crosses the token-level "
    "ones is the practical answer to 'token or sequence?'."
)


@dataclass(frozen=True)
class Config:
    """Environment, mismatch, lengths and estimator settings."""

    V: int = 2
    lengths: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10, 12, 14)
    chi2_tok: float = 0.05
    scale: float = 1.0
    n: int = 16
    reps: int = 20
    shift_family: str = "logit_noise"
    seed: int = 0
    mapping_names: tuple[str, ...] | None = None  # None: every per-sample mapping

    def __post_init__(self):
        if self.V < 2:
            raise ValueError(f"V must be >= 2, got {self.V}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive integers, got {self.lengths}")
        if self.V ** max(self.lengths) > 2**16:
            raise ValueError(f"V^T = {self.V ** max(self.lengths)} sequences: too many (2^16 max)")
        if not self.chi2_tok > 0:
            raise ValueError(f"chi2_tok must be > 0, got {self.chi2_tok}")
        if self.n < 1 or self.reps < 2:
            raise ValueError("need n >= 1 and reps >= 2")


def config(small: bool = False) -> Config:
    if small:
        return Config(
            lengths=(1, 2, 4, 6),
            reps=5,
            mapping_names=("naive", "is_token", "is_seq", "ppo_clip", "tis_seq", "vespo"),
        )
    return Config()


def per_sample_mappings() -> list[str]:
    """Registered mappings with an exact per-sample path (not batch dependent)."""
    return [n for n in mappings.available() if not mappings.mapping_class(n).batch_dependent]


def sweep_lengths(cfg: Config, names) -> pd.DataFrame:
    """Exact ``experiment.run`` of the mappings ``names`` at every T of ``cfg.lengths``."""
    ests = [
        Estimator(mappings.get(n), aggregation="seq-mean-token-sum", advantage="oracle", name=n)
        for n in names
    ]
    frames = []
    for T in cfg.lengths:
        env = TokenMDP.answer_correct(V=cfg.V, T=int(T), seed=cfg.seed, scale=cfg.scale)
        mu = behaviour(env, cfg.chi2_tok, "chi2", level="token", family=cfg.shift_family)
        frame = experiment.run(
            env, mu, ests, n=cfg.n, reps=cfg.reps, seed=cfg.seed, exact=True, progress=False
        )
        frame["delta_max"] = float(np.nanmax(env.divergence_profile(mu)["tv_max"]))
        frame["grad_norm"] = float(np.linalg.norm(env.grad_J()))
        frames.append(frame)
    data = pd.concat(frames, ignore_index=True)
    data["family"] = [style.family(m) for m in data.mapping]
    return data


def compute(cfg: Config) -> pd.DataFrame:
    names = list(cfg.mapping_names) if cfg.mapping_names is not None else per_sample_mappings()
    return sweep_lengths(cfg, names)


def draw(data: pd.DataFrame):
    fig = _common.new_figure(7.2, 4.4)
    axes = fig.subplots(1, 2, sharex=True)
    names = list(dict.fromkeys(data.mapping))
    for ax, (metric, label, scale) in zip(
        axes,
        (
            ("mse", r"MSE $\mathbb{E}\|\hat g - \nabla J\|^2$", "log"),
            ("cosine", r"cosine $\cos(\mathbb{E}\hat g, \nabla J)$", "linear"),
        ),
        strict=True,
    ):
        for name in names:
            part = data[data.mapping == name].sort_values("T")
            y = part[metric].to_numpy(dtype=float)
            if scale == "log":
                y = _common.finite_positive(y)
            ax.plot(
                part["T"],
                y,
                marker=style.marker(name),
                markersize=2.5,
                **style.line_kwargs(name, linewidth=1.1),
            )
        ax.set_yscale(scale)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(label)
        ax.set_title("MSE" if metric == "mse" else "cosine to ∇J")
    axes[1].set_ylim(float(np.nanmin(data.cosine)) - 0.05, 1.02)
    _common.panel_label(axes[0], "a")
    _common.panel_label(axes[1], "b")
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside right center",
        fontsize=6,
        title="mapping",
        title_fontsize=7.5,
    )
    fig.suptitle(
        f"Token MDP (answer_correct), χ²(π‖μ) = {float(data.chi2_tok.iloc[0]):.3g} in every "
        f"state, n = {int(data.n.iloc[0])}: MSE and cosine vs T (exact)"
    )
    return fig
