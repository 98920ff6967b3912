"""Variance of sequence-level IS vs length T: (1+χ²)^T − 1, exactly, by DP and by Monte Carlo.

The sequence ratio W = Π_t π(y_t|s_t)/μ(y_t|s_t) has E_μ[W] = 1, so Var_μ(W) = E_μ[W²] − 1 =
χ²_seq(π‖μ). For T independent tokens with per-token χ², E_μ[W²] = (1+χ²)^T exactly (reference
sheet §A/§F; rl-collapse, Liu, Li et al. 2025: Seq-IS variance O((1+χ²_max)^T);
:func:`simkit.theory.seq_is_variance`): exponential in T.

Three sources per per-token χ²:

- exact curve (1+χ²)^T − 1 (independent tokens, π a seeded softmax over V symbols, μ dialed by
  :func:`simkit.shifts.dial` to χ²(π‖μ) = χ²);
- Monte Carlo points: n sequences from μ, Var(W) estimated by :func:`simkit.divergence.chi2_mc`
  (mean of W² − 1, SE from the same draws), drawn with ±2 SE;
- a first-order Markov :class:`~simkit.envs.TokenMDP` (``TokenMDP.markov``: the policy depends on
  the previous token) whose μ has one ``logit_noise`` strength for every state, dialed so that
  the per-token χ² *averaged over μ's state occupancy* equals χ²
  (:func:`simkit.envs.behaviour.behaviour`, ``aggregate="average"``): its exact
  χ²_seq = ``env.chi2_seq(mu)`` (transfer-matrix DP) differs from (1+χ̄²)^T because the
  per-state χ² vary (Markov points: Monte Carlo from ``env.sample``).

The Markov exact curve is the DP at every length of a dense grid (``markov_curve``), not only
at the Monte Carlo lengths.

At large χ²_seq the Monte Carlo estimate falls below the truth: E_μ[W²] is carried by rare
sequences that n draws do not contain (the SE from the same draws does not see them either).
Every Monte Carlo point therefore carries ``reliable`` (:mod:`simkit.reliability`): False when
the exact tail visibility ν = n·(E W²)²/E W⁴ is below 10 (E W⁴ exact: (Σ π⁴/μ³)^T for
independent tokens, the product-form DP :func:`simkit.envs.token_moments.weight_moment` on the
Markov MDP) or when the draws' own W² have k̂ > 0.7 or one draw carries half their sum; such
points are drawn hollow. ``tail_draws`` is ν.

Data (dict): ``curves`` (chi2_tok, T, exact), ``markov_curve`` (chi2_tok, T, dp), ``iid_mc`` and
``markov`` (chi2_tok, T, value, se, reliable, tail_draws [, dp, chi2_tok_achieved]),
``config``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import divergence, reliability, theory
from simkit.envs import TokenMDP
from simkit.envs.behaviour import behaviour
from simkit.envs.token_moments import weight_moment
from simkit.figures import _common
from simkit.figures.vespo_bound import policy_pair

NAME = "seq_variance_vs_T"
TITLE = "Variance of sequence IS vs length T"
CAPTION = (
    "Var_μ(W) = χ²_seq of the sequence ratio vs T for several per-token χ²(π‖μ): exact "
    "(1+χ²)^T − 1 for independent tokens (lines), Monte Carlo ±2 SE (circles), and the exact "
    "transfer-matrix DP of a first-order Markov token MDP whose occupancy-averaged per-token χ² "
    "is the same (dashed, at every T of the grid; squares: Monte Carlo); log scale. Hollow "
    "markers: Monte Carlo points marked unreliable — fewer than 10 of the n draws are expected "
    "in the tail that carries E_μ[W²] (exact E_μ[W⁴]), or the draws' own tail is too heavy — "
    "where the estimate falls far below the exact value."
)


@dataclass(frozen=True)
class Config:
    """Alphabet, mismatch levels, lengths and Monte Carlo size."""

    V: int = 6
    chi2_toks: tuple[float, ...] = (0.005, 0.02, 0.1)
    lengths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    markov_lengths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    n: int = 20000
    scale: float = 1.0
    shift_family: str = "logit_noise"
    seed: int = 0

    def __post_init__(self):
        _common.check_token_grid(
            self.V, self.chi2_toks, lengths=self.lengths, markov_lengths=self.markov_lengths
        )
        if self.n < 2:
            raise ValueError(f"n must be >= 2, got {self.n}")


def config(small: bool = False) -> Config:
    if small:
        return Config(
            V=4, chi2_toks=(0.01, 0.05), lengths=(1, 4, 16), markov_lengths=(1, 4, 8), n=4000
        )
    return Config()


def _reliable(log_w: np.ndarray, nu: float) -> bool:
    """:func:`simkit.reliability.is_reliable` for a Monte Carlo mean of W² (draws: W²)."""
    w2 = np.exp(2.0 * (log_w - log_w.max()))  # scale-free: k̂ and shares do not need the scale
    khat, share = reliability.draw_checks(w2, w2)
    return reliability.is_reliable(khat, share, nu)


def _markov_env(cfg: Config, chi2_tok: float, T: int):
    env = TokenMDP.markov(V=cfg.V, T=int(T), seed=cfg.seed, scale=cfg.scale)
    mu = behaviour(
        env, chi2_tok, "chi2", level="token", family=cfg.shift_family, aggregate="average"
    )
    return env, mu


def compute(cfg: Config) -> dict:
    rng = np.random.default_rng(cfg.seed)
    t_curve = np.unique(np.geomspace(1, max(cfg.lengths), 100).round())
    t_markov = np.unique(
        np.concatenate([np.geomspace(1, max(cfg.lengths), 24).round(), cfg.markov_lengths])
    ).astype(int)
    curves, iid_mc, markov, markov_curve = [], [], [], []
    for chi2_tok in cfg.chi2_toks:
        curves.append(
            pd.DataFrame(
                {
                    "chi2_tok": chi2_tok,
                    "T": t_curve,
                    "exact": theory.seq_is_variance(chi2_tok, t_curve),
                }
            )
        )
        pi, mu = policy_pair(cfg.V, chi2_tok, cfg.shift_family, cfg.seed)
        log_ratio = np.log(pi) - np.log(mu)
        # exact E W² = m2^T and E W⁴ = m4^T for independent tokens: ν = n·(m2²/m4)^T
        m2, m4 = float(np.sum(pi**2 / mu)), float(np.sum(pi**4 / mu**3))
        for T in cfg.lengths:
            log_w = rng.multinomial(int(T), mu, size=cfg.n) @ log_ratio
            est = divergence.chi2_mc(log_w)
            nu = cfg.n * (m2**2 / m4) ** int(T)
            iid_mc.append(
                {
                    "chi2_tok": chi2_tok,
                    "T": int(T),
                    "value": est.value,
                    "se": est.se,
                    "reliable": _reliable(log_w, nu),
                    "tail_draws": nu,
                }
            )
        for T in t_markov:
            env, mu_env = _markov_env(cfg, chi2_tok, int(T))
            markov_curve.append(
                {"chi2_tok": chi2_tok, "T": int(T), "dp": float(env.chi2_seq(mu_env))}
            )
        for T in cfg.markov_lengths:
            env, mu_env = _markov_env(cfg, chi2_tok, int(T))
            batch = env.sample(mu_env, cfg.n, rng)
            log_w = batch.log_ratio.sum(axis=-1)
            est = divergence.chi2_mc(log_w)
            log_m2 = weight_moment(env, mu_env, 2.0, log=True)
            nu = cfg.n * float(
                np.exp(min(2 * log_m2 - weight_moment(env, mu_env, 4.0, log=True), 0))
            )
            markov.append(
                {
                    "chi2_tok": chi2_tok,
                    "T": int(T),
                    "dp": float(env.chi2_seq(mu_env)),
                    "chi2_tok_achieved": float(env.divergences_tok(mu_env)["chi2_tok"]),
                    "value": est.value,
                    "se": est.se,
                    "reliable": _reliable(log_w, nu),
                    "tail_draws": nu,
                }
            )
    return {
        "curves": pd.concat(curves, ignore_index=True),
        "markov_curve": pd.DataFrame(markov_curve),
        "iid_mc": pd.DataFrame(iid_mc),
        "markov": pd.DataFrame(markov),
        "config": cfg,
    }


def _log_yerr(value, se) -> list[np.ndarray]:
    """±2 SE error bars for a log axis: the lower bar stops at 5 % of the value."""
    value = np.asarray(value, dtype=float)
    two_se = 2 * np.asarray(se, dtype=float)
    return [np.minimum(two_se, 0.95 * value), two_se]


_COLORS = ("#6baed6", "#2171b5", "#08306b", "#084594")


def _mc_points(ax, part, color, marker: str) -> None:
    """Monte Carlo estimates of ``part`` (columns ``T``, ``value``, ``se``, ``reliable``)
    against T with ±2 SE bars, the unreliable ones hollow."""
    value = _common.finite_positive(part.value)
    ax.errorbar(
        part["T"],
        value,
        yerr=_log_yerr(part.value, part.se),
        fmt=marker,
        color=color,
        markersize=3,
        capsize=1.5,
        elinewidth=0.7,
    )
    _common.mark_unreliable(ax, part["T"], value, part.reliable, color, marker, 4.5)


def draw(data: dict):
    cfg = data["config"]
    fig = _common.new_figure(6.0, 3.8)
    ax = fig.subplots()
    curves, iid_mc, markov = data["curves"], data["iid_mc"], data["markov"]
    for k, chi2 in enumerate(cfg.chi2_toks):
        color = _COLORS[k % len(_COLORS)]
        c = curves[curves.chi2_tok == chi2]
        ax.plot(c["T"], c.exact, color=color, label=f"χ² per token = {chi2:g}")
        _mc_points(ax, iid_mc[iid_mc.chi2_tok == chi2], color, "o")
        mc_curve = data["markov_curve"]
        c = mc_curve[mc_curve.chi2_tok == chi2]
        ax.plot(c["T"], c.dp, color=color, linestyle="--", linewidth=1.0)
        _mc_points(ax, markov[markov.chi2_tok == chi2], color, "s")
    ax.plot([], [], color="0.3", label="independent tokens, exact")
    ax.plot([], [], color="0.3", linestyle="--", label="Markov token MDP, exact DP")
    ax.errorbar([], [], yerr=[], fmt="o", color="0.3", markersize=3, label="Monte Carlo ±2 SE")
    ax.plot(
        [], [], "o", color="0.3", markerfacecolor="white", label="Monte Carlo, unreliable (hollow)"
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(r"$\mathrm{Var}_\mu(W) = \chi^2_{seq}(\pi\,\|\,\mu)$")
    ax.legend(fontsize=6.5, loc="upper left")
    ax.set_title(
        f"Sequence IS variance vs T (V = {cfg.V}, n = {cfg.n} draws per MC point)", fontsize=9
    )
    return fig
