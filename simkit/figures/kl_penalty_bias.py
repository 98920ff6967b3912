"""Which KL estimator, in which place, gives the gradient of the KL penalty — exactly.

Every trainer can add β·KL(π‖π_ref) to its objective; the trainers differ in the per-token
estimator (verl ``kl_penalty``: k1, k2, k3/low_var_kl, abs and the straight-through "+"
variants), in where it goes (verl ``use_kl_loss``: in the loss, its gradient flowing through
π; ``use_kl_in_reward``: subtracted from the reward, detached) and in whether it carries the
importance weight π/μ of the sampling policy (TRL ``use_bias_correction_kl``). The objective
is J(π) − β·KL_seq(π‖π_ref) over whole sequences (:mod:`simkit.kl`).

Setting: a first-order Markov token MDP (``TokenMDP.markov``, V = ``V``; the policy class is
the previous token, so the KL of later tokens depends on the earlier ones), stationary random
logits; π_ref and the off-policy behaviour μ are π's logits plus seeded Gaussian noise of
scales ``ref_scale`` and ``mu_scale`` (the same table at every position). Every estimator is
``is_seq`` (sequence IS, unbiased for ∇J under any μ, so that the only bias left is the KL
term's) with ``seq-mean-token-sum`` and the oracle advantage, plus one :class:`KLPenalty`.
Every number is exact: :func:`simkit.experiment.run` enumerates every sequence (V^T ≤ 2^10),
the truth ∇KL_seq comes from the additive DP (:func:`simkit.kl.kl_seq_and_grad`).

Panels: the relative bias of the KL part alone, ``kl_bias``/(β‖∇KL_seq‖), against T, on-policy
(μ = π) and off-policy, in the loss and in the reward (solid: no correction; dashed: ×π/μ);
and the relative bias of the total gradient ‖E ĝ − ∇(J − β·KL)‖/‖∇(J − β·KL)‖ against β at
T = ``beta_T`` off-policy. Panels (a)–(d) are linear below ``SYMLOG_LINEAR`` (0 = unbiased)
and logarithmic above; (e) likewise below ``SYMLOG_LINEAR``/10.

Data: one row per (policy, T, β, KL estimator, placement, correction) with ``kl_bias``,
``kl_grad_norm``, ``rel_kl_bias``, ``bias``, ``total_grad_norm``, ``rel_bias``, ``chi2_tok``,
``kl_seq_ref``; ``data.attrs["notes"]`` (:func:`notes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment
from simkit.envs import TokenMDP
from simkit.estimators import Estimator
from simkit.figures.staleness_curves import split_figure
from simkit.kl import KLPenalty, kl_seq_and_grad

NAME = "kl_penalty_bias"
TITLE = "KL penalty: which estimator, in which place, gives ∇KL"
CAPTION = (
    "exact relative bias of the KL part of the gradient, ‖E ĝ_KL + β∇KL_seq‖/(β‖∇KL_seq‖), of "
    "verl's per-token KL estimators (k1, k2, k3, abs, and k3+ for the straight-through "
    "variants) placed in the loss (verl use_kl_loss) or in the reward (use_kl_in_reward), "
    "without (solid) or with (dashed) the sampling weight π/μ (TRL use_bias_correction_kl), "
    "against the length T on a first-order Markov token MDP, on-policy (top) and off-policy "
    "(bottom); right: the relative bias of the whole gradient of J − β·KL against β. Sequence "
    "IS carries the reward (unbiased for ∇J), so every bias is the KL term's. Every sequence "
    "enumerated; the truth by dynamic programming. Which pairs are unbiased is stated in the "
    "notes, computed from the data."
)

#: the KL estimators drawn (the other "+" variants carry k3+'s gradient; low_var_kl is k3
#: wherever its clamps are inactive, as here)
ESTIMATORS = ("k1", "k2", "k3", "abs", "k3+")
PLACEMENTS = ("loss", "reward")
#: the estimators of panel (e) (and of its note)
BETA_ESTIMATORS = ("k1", "k3", "k3+")
CORRECTIONS = ("none", "is")
#: relative biases below this are exact zeros up to rounding ("unbiased")
FLOOR = 1e-12
#: panels (a)–(d): linear below this relative bias (0 = unbiased), logarithmic above
SYMLOG_LINEAR = 0.01
COLORS = {"k1": "#1b9e77", "k2": "#d95f02", "k3": "#7570b3", "abs": "#e7298a", "k3+": "#66a61e"}

__all__ = ["CAPTION", "NAME", "TITLE", "Config", "compute", "config", "draw", "notes", "unbiased"]


@dataclass(frozen=True)
class Config:
    """Environment, policies, lengths and β grid."""

    V: int = 2
    lengths: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10)
    scale: float = 1.0
    ref_scale: float = 0.5
    mu_scale: float = 0.5
    beta: float = 0.1
    betas: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
    beta_T: int = 4
    seed: int = 0

    def __post_init__(self):
        if self.V < 2:
            raise ValueError(f"V must be >= 2, got {self.V}")
        if not self.lengths or min(self.lengths) < 1 or len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths must be distinct positive integers, got {self.lengths}")
        if self.V ** max(max(self.lengths), self.beta_T) > 2**12:
            raise ValueError("V^T exceeds 2^12 sequences: too many to enumerate for a figure")
        for name in ("scale", "ref_scale", "mu_scale", "beta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.betas or min(self.betas) <= 0:
            raise ValueError(f"betas must be positive, got {self.betas}")
        if self.beta_T < 1:
            raise ValueError(f"beta_T must be >= 1, got {self.beta_T}")


def config(small: bool = False) -> Config:
    if small:
        return Config(lengths=(1, 2, 3), betas=(0.1, 1.0, 10.0), beta_T=2)
    return Config()


def policies(cfg: Config, T: int):
    """(env, π_ref, μ) at length T (module docstring)."""
    env = TokenMDP.markov(V=cfg.V, T=T, seed=cfg.seed, scale=cfg.scale)
    rng = np.random.default_rng(cfg.seed + 1)
    table = env.logits[0]
    ref_noise, mu_noise = rng.standard_normal((2, *table.shape))

    def shifted(noise, scale):
        return env.with_logits(np.broadcast_to(table + scale * noise, env.logits.shape)).pi

    return env, shifted(ref_noise, cfg.ref_scale), shifted(mu_noise, cfg.mu_scale)


def estimators(beta: float) -> list[Estimator]:
    return [
        Estimator(
            "is_seq",
            aggregation="seq-mean-token-sum",
            kl=KLPenalty(beta, e, w, None if c == "none" else c),
            name=f"{e} | {w} | {c}",
        )
        for e in ESTIMATORS
        for w in PLACEMENTS
        for c in CORRECTIONS
    ]


def _rows(cfg, T, beta, which) -> pd.DataFrame:
    env, ref, mu = policies(cfg, T)
    behaviour = env.pi if which == "on-policy" else mu
    frame = experiment.run(
        env,
        behaviour,
        estimators(beta),
        n=1,
        reps=2,
        seed=cfg.seed,
        exact=True,
        ref=ref,
        progress=False,
    )
    if not (frame["method"] == "enumeration").all():
        raise RuntimeError("kl_penalty_bias expects every row enumerated")
    _, grad_kl = kl_seq_and_grad(env, ref)
    total = float(np.linalg.norm(env.grad_J() - beta * grad_kl))
    out = frame[
        [
            "kl_estimator",
            "kl_where",
            "kl_correction",
            "kl_beta",
            "kl_bias",
            "kl_grad_norm",
            "bias",
            "chi2_tok",
            "kl_seq_ref",
        ]
    ].rename(
        columns={
            "kl_estimator": "estimator",
            "kl_where": "where",
            "kl_correction": "correction",
            "kl_beta": "beta",
        }
    )
    out.insert(0, "policy", which)
    out.insert(1, "T", T)
    out["total_grad_norm"] = total
    return out


def compute(cfg: Config) -> pd.DataFrame:
    frames = []
    for which in ("on-policy", "off-policy"):
        for T in sorted(cfg.lengths):
            frames.append(_rows(cfg, int(T), cfg.beta, which).assign(sweep="T"))
    for beta in cfg.betas:
        frames.append(_rows(cfg, cfg.beta_T, float(beta), "off-policy").assign(sweep="beta"))
    data = pd.concat(frames, ignore_index=True)
    data["rel_kl_bias"] = data.kl_bias / data.kl_grad_norm
    data["rel_bias"] = data.bias / data.total_grad_norm
    data.attrs["notes"] = notes(data)
    return data


def unbiased(data: pd.DataFrame, which: str, T_min: int = 1) -> list[str]:
    """The ``"estimator | where | correction"`` pairs whose KL part is unbiased (relative bias
    < :data:`FLOOR`) at every T ≥ ``T_min`` of the T sweep, for policy ``which``."""
    part = data[(data.sweep == "T") & (data.policy == which) & (data["T"] >= T_min)]
    ok = part.groupby(["estimator", "where", "correction"]).rel_kl_bias.max() < FLOOR
    return [" | ".join(k) for k in ok.index[ok]]


def _names(pairs) -> str:
    return "; ".join(pairs) if pairs else "none"


def notes(data: pd.DataFrame) -> tuple[str, ...]:
    """The sentences under the figure, each built from ``data``."""
    tsweep = data[data.sweep == "T"]
    Ts = sorted(tsweep["T"].unique())
    long_from = min((t for t in Ts if t >= 2), default=Ts[-1])
    off = tsweep[tsweep.policy == "off-policy"]
    lines = [
        f"Setting: TokenMDP.markov, T = {Ts[0]}…{Ts[-1]}, β = {tsweep.beta.iloc[0]:g}, "
        f"KL_seq(π‖π_ref) = {tsweep.kl_seq_ref.min():.3g}…{tsweep.kl_seq_ref.max():.3g}, "
        f"off-policy χ²(π‖μ) = {off.chi2_tok.iloc[0]:.3g} per token; is_seq, "
        "seq-mean-token-sum, oracle advantage; exact (every sequence enumerated). 'Unbiased': "
        f"relative bias < {FLOOR:g} at every T of the range.",
    ]
    for which in ("on-policy", "off-policy"):
        every = unbiased(data, which, 1)
        longer = [p for p in unbiased(data, which, long_from) if p not in every]
        text = f"{which.capitalize()}, unbiased at every T: {_names(every)}"
        if longer:
            text += f"; unbiased for T ≥ {long_from} only: {_names(longer)}"
        short_only = [p for p in unbiased(data[data["T"] == Ts[0]], which, 1) if p not in every]
        if short_only:
            text += f"; unbiased at T = {Ts[0]} only: {_names(short_only)}"
        lines.append(text + ".")
    on = tsweep[tsweep.policy == "on-policy"]
    last = on[on["T"] == Ts[-1]].set_index(["estimator", "where", "correction"]).rel_kl_bias
    biased = last[last >= FLOOR].sort_values()
    if len(biased):
        lines.append(
            f"On-policy at T = {Ts[-1]} the biased pairs range from "
            f"{' | '.join(biased.index[0])} ({biased.iloc[0]:.3g} of β‖∇KL‖) to "
            f"{' | '.join(biased.index[-1])} ({biased.iloc[-1]:.3g})."
        )
    bsweep = data[(data.sweep == "beta") & data.estimator.isin(BETA_ESTIMATORS)]
    if len(bsweep):
        lo, hi = bsweep.beta.min(), bsweep.beta.max()
        keys = ["estimator", "where", "correction"]
        first = bsweep[bsweep.beta == lo].set_index(keys).rel_bias
        worst = bsweep[bsweep.beta == hi].set_index(keys).rel_bias
        lines.append(
            f"Whole gradient of J − β·KL, off-policy at T = {int(bsweep['T'].iloc[0])} "
            f"({', '.join(BETA_ESTIMATORS)}, panel e): the "
            f"largest relative bias is {first.max():.3g} at β = {lo:g} "
            f"({' | '.join(first.idxmax())}) and {worst.max():.3g} at β = {hi:g} "
            f"({' | '.join(worst.idxmax())}); the smallest at β = {hi:g} is {worst.min():.3g} "
            f"({' | '.join(worst.idxmin())})."
        )
    return tuple(lines)


def draw(data: pd.DataFrame):
    fig, sub = split_figure(8.6, 5.0, data.attrs.get("notes", ()))
    axes = sub.subplot_mosaic([["a", "b", "e"], ["c", "d", "e"]], width_ratios=[1, 1, 1.2])
    tsweep = data[data.sweep == "T"]
    top = float(tsweep.rel_kl_bias.max())
    for i, which in enumerate(("on-policy", "off-policy")):
        for j, where in enumerate(PLACEMENTS):
            ax = axes["abcd"[2 * i + j]]
            part = tsweep[(tsweep.policy == which) & (tsweep["where"] == where)]
            for (est, corr), line in part.groupby(["estimator", "correction"], sort=False):
                line = line.sort_values("T")
                ax.plot(
                    line["T"],
                    line.rel_kl_bias,
                    color=COLORS[est],
                    linestyle="-" if corr == "none" else "--",
                    marker="o" if corr == "none" else "s",
                    markersize=2.8,
                    linewidth=1.1,
                    label=f"{est}{' ×π/μ' if corr == 'is' else ''}",
                )
            ax.set_yscale("symlog", linthresh=SYMLOG_LINEAR, linscale=0.6)
            ax.axhline(0.0, color="0.6", linewidth=0.6, linestyle=":")
            ax.set_ylim(-0.2 * SYMLOG_LINEAR, 1.5 * top)
            ax.set_title(f"({'abcd'[2 * i + j]}) {which}, KL in the {where}", fontsize=8)
            ax.set_xlabel("T")
            if j == 0:
                ax.set_ylabel("‖E ĝ_KL + β∇KL‖ / (β‖∇KL‖)", fontsize=6.5)
            if i == 0 and j == 1:  # (b) is empty between its two levels: the shared legend
                ax.legend(fontsize=5.0, ncol=2, loc="center", bbox_to_anchor=(0.5, 0.42))
    ax = axes["e"]
    bsweep = data[data.sweep == "beta"]
    for (est, where, corr), line in bsweep.groupby(
        ["estimator", "where", "correction"], sort=False
    ):
        if est not in BETA_ESTIMATORS:
            continue
        line = line.sort_values("beta")
        ax.plot(
            line.beta,
            line.rel_bias,
            color=COLORS[est],
            linestyle="-" if corr == "none" else "--",
            marker="o" if where == "loss" else "^",
            markersize=3,
            linewidth=1.0,
            label=f"{est} in {where}{' ×π/μ' if corr == 'is' else ''}",
        )
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=SYMLOG_LINEAR / 10, linscale=0.6)
    ax.axhline(0.0, color="0.6", linewidth=0.6, linestyle=":")
    ax.set_ylim(-0.02 * SYMLOG_LINEAR, 1.5 * max(float(bsweep.rel_bias.max()), 1.0))
    ax.set_xlabel("β")
    ax.set_ylabel("‖E ĝ − ∇(J − β KL)‖ / ‖∇(J − β KL)‖", fontsize=7)
    if len(bsweep):
        ax.set_title(f"(e) whole gradient, off-policy, T = {int(bsweep['T'].iloc[0])}", fontsize=8)
    ax.legend(fontsize=5.0, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    sub.suptitle(TITLE, fontsize=9)
    return fig
