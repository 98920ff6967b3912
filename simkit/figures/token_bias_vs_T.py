"""Bias of token-level IS and PPO clip vs T, against the O(T²·Δ_max) shape of rl-collapse.

rl-collapse (Liu, Li et al. 2025, part 2): token-level corrections reweight each token by its own
ratio r_t but sample the states from μ, so their bias grows with the length, bounded by
O(T²·Δ_max) with Δ_max the largest per-state TV(π, μ)
(:func:`simkit.theory.token_is_bias_bound_shape`). The source gives the order, not a constant:
the curve drawn is K·T²·Δ_max with K chosen so that it passes through token IS's bias at the
first length where that bias is non-zero (SHAPE ONLY, as the figure says).

Two token MDPs (V = 2), every state's next-token distribution at χ²(π‖μ) = ``chi2_tok``
(:func:`simkit.figures.mse_vs_T.dialed_behaviour`):

- ``answer_correct`` — the setting of :mod:`simkit.figures.mse_vs_T` (R = 1 iff the last token
  is the answer): the reward only looks at the end of the sequence, so the state-distribution
  error of token IS stops growing once the automaton has mixed;
- ``at_least_k`` with k = ⌈``k_fraction``·T⌉ and π uniform (a majority vote: R = 1 iff at least
  half the tokens are hits): the reward depends on the whole sequence and the count state never
  mixes, so μ's drift of the count keeps feeding token IS's bias.

Computation, exact at every T: the bias ‖E ĝ − ∇J‖ (oracle advantage A = R − J(μ),
``seq-mean-token-sum``) of the token-level mappings (naive, token IS, PPO clip) by the dynamic
programme :func:`simkit.envs.exact_token_level_mean` (any T), and ∇J by
:meth:`TokenMDP.grad_J`. Where V^T ≤ 2^``enum_max_log2`` the same biases are also computed by
enumeration of every sequence (:func:`simkit.experiment.run`, ``exact=True``) into
``bias_enum`` (the tests check both agree to 1e-10), and sequence IS's bias is enumerated too;
beyond, sequence IS's bias is 0 by theory (E_μ[W·g] = E_π[g] for W = π(y)/μ(y)), not computed.

Data: one row per (env, mapping, T) with ``bias``, ``bias_enum`` (NaN where not enumerated),
``method`` (``"dp"``, ``"enumeration"`` or ``"theory"``), ``grad_norm`` ‖∇J‖,
``relative_bias`` = bias/‖∇J‖, ``J``,
``delta_max`` (largest per-state TV), ``chi2_tok`` (occupancy-averaged per-token χ², exact),
and ``bound_shape`` (the scaled K·T²·Δ_max, one K per env, same on every row of a (env, T)).
``data.attrs["anchor_T"]``: {env: the T at which the shape is matched}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, mappings, theory
from simkit.envs import TokenMDP, exact_token_level_mean
from simkit.estimators import Estimator
from simkit.figures import _common, style
from simkit.figures.mse_vs_T import dialed_behaviour

NAME = "token_bias_vs_T"
TITLE = "Token-IS and PPO-clip bias vs T"
CAPTION = (
    "exact bias ‖E ĝ − ∇J‖ of token IS and PPO clip (naive for reference) against T up to "
    "256, on two token MDPs (V = 2) at the same per-token χ²(π‖μ) in every state: (a) "
    "answer_correct, whose reward reads only the last token — token IS's bias saturates once "
    "the automaton mixes; (b) a majority vote (at_least_k, k = ⌈T/2⌉, π uniform), whose reward "
    "reads the whole sequence — token IS's bias grows until it is as large as ∇J itself (grey "
    "dotted: ‖∇J‖, which shrinks with T), then follows it; (c) the bias relative to ‖∇J‖, "
    "which for token IS keeps growing with T on the majority vote (→ 1: the correction no "
    "longer points along ∇J) and is flat on answer_correct. PPO clip and naive are biased at "
    "every position (E_μ[φ(r)·score] ≠ 0 for φ ≠ r) and grow like √T on both. Token-level "
    "curves: exact dynamic programme at every T, equal to the enumeration of all sequences "
    "(to 1e-10) for T ≤ 12. Sequence IS: 0 by enumeration (filled, T ≤ 12) and by theory "
    "beyond (open). Dashed: the rl-collapse O(T²·Δ_max) shape, scaled to token IS's first "
    "non-zero bias (shape only, not a bound's constant): the measured bias stays far below it."
)

MAPPINGS = ("naive", "is_token", "ppo_clip", "is_seq")
#: the mappings computed by the dynamic programme (token level, per-token phi)
TOKEN_MAPPINGS = ("naive", "is_token", "ppo_clip")
ENVS = ("answer_correct", "at_least_k")

__all__ = ["Config", "build_env", "compute", "config", "draw"]


@dataclass(frozen=True)
class Config:
    """Environments, mismatch and lengths.

    ``lengths``: the T grid (any size: the token-level biases are exact by DP at every T);
    ``enum_max_log2``: enumerate every sequence (second, independent exact path, and sequence
    IS) where V^T ≤ 2^enum_max_log2; ``k_fraction``: k = ⌈k_fraction·T⌉ for ``at_least_k``;
    ``scale``, ``seed``: the random logits of ``answer_correct``.
    """

    V: int = 2
    lengths: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    envs: tuple[str, ...] = ENVS
    chi2_tok: float = 0.05
    k_fraction: float = 0.5
    scale: float = 1.0
    shift_family: str = "logit_noise"
    enum_max_log2: int = 12
    seed: int = 0

    def __post_init__(self):
        if self.V < 2:
            raise ValueError(f"V must be >= 2, got {self.V}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive integers, got {self.lengths}")
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths has repeats: {self.lengths}")
        if not self.envs or any(e not in ENVS for e in self.envs):
            raise ValueError(f"envs must be a non-empty subset of {ENVS}, got {self.envs}")
        if not self.chi2_tok > 0:
            raise ValueError(f"chi2_tok must be > 0, got {self.chi2_tok}")
        if not 0 < self.k_fraction <= 1:
            raise ValueError(f"k_fraction must be in (0, 1], got {self.k_fraction}")
        if not 1 <= self.enum_max_log2 <= 16:
            raise ValueError(f"enum_max_log2 must be in [1, 16], got {self.enum_max_log2}")


def config(small: bool = False) -> Config:
    if small:
        return Config(lengths=(1, 2, 4, 6, 24), enum_max_log2=6)
    return Config()


def build_env(cfg: Config, kind: str, T: int) -> TokenMDP:
    """The token MDP ``kind`` (one of :data:`ENVS`) at length T, as in the module docstring."""
    if kind == "answer_correct":
        return TokenMDP.answer_correct(V=cfg.V, T=T, seed=cfg.seed, scale=cfg.scale)
    if kind == "at_least_k":
        k = max(1, math.ceil(cfg.k_fraction * T))
        return TokenMDP.at_least_k(V=cfg.V, T=T, k=k, logits=np.zeros(cfg.V))
    raise ValueError(f"env kind must be one of {ENVS}, got {kind!r}")


def _enumerated_biases(env, mu) -> dict[str, float]:
    """Bias of every mapping of :data:`MAPPINGS` by enumeration (``experiment.run`` exact)."""
    ests = [
        Estimator(mappings.get(n), aggregation="seq-mean-token-sum", advantage="oracle", name=n)
        for n in MAPPINGS
    ]
    frame = experiment.run(env, mu, ests, n=1, reps=2, exact=True, progress=False)
    return dict(zip(frame.mapping, frame.bias, strict=True))


def compute(cfg: Config) -> pd.DataFrame:
    rows = []
    for kind in cfg.envs:
        for T in sorted(cfg.lengths):
            env = build_env(cfg, kind, int(T))
            mu = dialed_behaviour(env, cfg.chi2_tok, cfg.shift_family)
            J = env.J()
            grad = env.grad_J()
            common = {
                "env": kind,
                "T": int(T),
                "J": J,
                "grad_norm": float(np.linalg.norm(grad)),
                "delta_max": float(np.nanmax(env.divergence_profile(mu)["tv_max"])),
                "chi2_tok": env.divergences(mu)["chi2_tok"],
            }
            enum = (
                _enumerated_biases(env, mu) if env.enumerable(budget=2**cfg.enum_max_log2) else {}
            )
            for name in MAPPINGS:
                if name in TOKEN_MAPPINGS:
                    mean = exact_token_level_mean(env, mu, mappings.get(name), env.J(mu))
                    bias, method = float(np.linalg.norm(mean - grad)), "dp"
                elif enum:
                    bias, method = enum[name], "enumeration"
                else:
                    bias, method = 0.0, "theory"
                rows.append(
                    {
                        **common,
                        "mapping": name,
                        "bias": bias,
                        "bias_enum": enum.get(name, math.nan),
                        "method": method,
                    }
                )
    data = pd.DataFrame(rows)
    data["relative_bias"] = data.bias / data.grad_norm
    data["bound_shape"] = np.asarray(
        theory.token_is_bias_bound_shape(data["T"].to_numpy(float), data.delta_max.to_numpy())
    )
    anchors = {}
    for kind in cfg.envs:
        token = data[(data.env == kind) & (data.mapping == "is_token") & (data.bias > 1e-12)]
        if len(token) == 0:
            raise ValueError(f"{kind}: token IS is unbiased at every length: nothing to scale to")
        anchor = token.sort_values("T").iloc[0]
        scale = anchor.bias / anchor.bound_shape
        data.loc[data.env == kind, "bound_shape"] *= scale
        anchors[kind] = int(anchor["T"])
    data.attrs["anchor_T"] = anchors
    return data


PANEL_TITLES = {
    "answer_correct": "answer_correct: R reads the last token",
    "at_least_k": "majority: at_least_k, k = ⌈T/2⌉",
}


#: line style of each environment on the relative-bias panel
ENV_LINESTYLES = {"answer_correct": ":", "at_least_k": "-"}
ENV_SHORT = {"answer_correct": "answer_correct", "at_least_k": "majority"}


def _draw_relative(ax, data: pd.DataFrame, kinds, letter: str) -> None:
    """Panel: bias/‖∇J‖ of the token-level mappings, one line per (env, mapping)."""
    for kind in kinds:
        for name in ("is_token", "ppo_clip"):
            part = data[(data.env == kind) & (data.mapping == name) & (data.bias > 1e-12)]
            part = part.sort_values("T")
            ax.plot(
                part["T"],
                part.relative_bias,
                marker=style.marker(name),
                markersize=3,
                **style.line_kwargs(
                    name,
                    linestyle=ENV_LINESTYLES.get(kind, "-"),
                    label=f"{name}, {ENV_SHORT.get(kind, kind)}",
                ),
            )
    ax.axhline(1.0, color="0.45", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(r"relative bias $\|\mathbb{E}\hat g - \nabla J\| / \|\nabla J\|$")
    ax.set_title("bias relative to ‖∇J‖", fontsize=8.5)
    ax.legend(fontsize=6, loc="lower right")
    _common.panel_label(ax, letter)


def draw(data: pd.DataFrame):
    kinds = list(dict.fromkeys(data.env))
    fig = _common.new_figure(3.6 * (len(kinds) + 1), 4.0)
    all_axes = fig.subplots(1, len(kinds) + 1)
    axes, rel_ax = all_axes[:-1], all_axes[-1]
    for ax in axes[1:]:
        ax.sharey(axes[0])
    positive = data.bias[data.bias > 1e-12]
    floor = 10 ** np.floor(np.log10(positive.min() / 3))
    top = float(max(data.bias.max(), data.grad_norm.max())) * 8
    for ax, kind, letter in zip(axes, kinds, "abcdefgh", strict=False):
        part_env = data[data.env == kind]
        for name in dict.fromkeys(part_env.mapping):
            part = part_env[part_env.mapping == name].sort_values("T")
            T = part["T"].to_numpy(dtype=float)
            y = np.maximum(part.bias.to_numpy(dtype=float), floor)
            kwargs = style.line_kwargs(name)
            theory_pts = (part.method == "theory").to_numpy()
            (line,) = ax.plot(
                T,
                y,
                marker=style.marker(name),
                markersize=3.5,
                markevery=list(~theory_pts),
                **kwargs,
            )
            if theory_pts.any():
                ax.plot(
                    T[theory_pts],
                    y[theory_pts],
                    linestyle="none",
                    marker=style.marker(name),
                    markersize=3.5,
                    markerfacecolor="white",
                    color=line.get_color(),
                    label=f"{name}: 0 by theory (T beyond enumeration)",
                )
        ref = part_env[part_env.mapping == "is_token"].sort_values("T")
        ax.plot(
            ref["T"],
            ref.grad_norm,
            color="0.45",
            linestyle=":",
            linewidth=1.2,
            label=r"$\|\nabla J\|$ (scale of the signal)",
        )
        anchor = data.attrs["anchor_T"][kind]
        ax.plot(
            ref["T"],
            ref.bound_shape,
            color="0.35",
            linestyle="--",
            linewidth=1.0,
            label=f"∝ T²·Δ_max (rl-collapse; shape only, matched at T = {anchor})",
        )
        ax.axhline(floor, color="0.5", linewidth=0.6, linestyle=":")
        ax.annotate(
            "0 (unbiased)",
            (1.0, floor),
            xycoords=("axes fraction", "data"),
            xytext=(-2, 2),
            textcoords="offset points",
            ha="right",
            va="bottom",
            fontsize=7,
            color="0.35",
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, top)
        ax.set_xlabel("sequence length T")
        ax.set_title(PANEL_TITLES.get(kind, kind), fontsize=8.5)
        _common.panel_label(ax, letter)
    axes[0].set_ylabel(r"bias $\|\mathbb{E}\hat g - \nabla J\|$")
    _draw_relative(rel_ax, data, kinds, "abcdefgh"[len(kinds)])
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside lower center",
        ncol=3,
        fontsize=6.5,
    )
    fig.suptitle(
        f"Token-level bias vs T, χ²(π‖μ) = {float(data.chi2_tok.iloc[0]):.3g} in every state "
        "(exact: DP, enumeration, theory)"
    )
    return fig
