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

Computation, exact at every T: the bias ‖E ĝ − ∇J‖ (oracle advantage A = R − J(μ), the value a
group or batch mean estimates, ``seq-mean-token-sum``) of the token-level mappings (naive, token
IS, PPO clip) by the dynamic programme :func:`simkit.envs.exact_token_level_mean` (any T), and
∇J by :meth:`TokenMDP.grad_J`, for two parameterisations (``params``, issue 12 §2): ``"untied"``
— one logit table per position θ[t, state, token], the environment's own D — and ``"tied"`` —
one table shared by every position (closer to an LM), whose gradient is the sum of the
per-position blocks (:func:`simkit.experiment.tie`, applied to E ĝ and to ∇J). Where V^T ≤
2^``enum_max_log2`` the same biases are also computed by enumeration of every sequence
(:func:`simkit.experiment.run`, ``exact=True``) into ``bias_enum`` (the tests check both agree
to 1e-10), and sequence IS's bias is enumerated too; beyond, sequence IS's bias is 0 by theory
(E_μ[W·g] = E_π[g] for W = π(y)/μ(y)), not computed.

Growth laws (:func:`growth_laws`, :func:`claims`): the slope of log(bias) against log(T) fitted
over T ≥ ``fit_from``; the sentences under the figure are built from these fits (and tested),
including whether any curve reaches the T² growth of the rl-collapse bound shape.

Data: one row per (params, env, mapping, T) with ``bias``, ``bias_enum`` (NaN where not enumerated),
``method`` (``"dp"``, ``"enumeration"`` or ``"theory"``), ``grad_norm`` ‖∇J‖,
``relative_bias`` = bias/‖∇J‖, ``J``,
``delta_max`` (largest per-state TV), ``chi2_tok`` (occupancy-averaged per-token χ², exact),
and ``bound_shape`` (the scaled K·T²·Δ_max, one K per (params, env), same on every row of a
(params, env, T)). ``data.attrs["anchor_T"]``: {(params, env): the T at which the shape is
matched}.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, mappings, theory
from simkit.envs import TokenMDP, exact_token_level_mean
from simkit.figures import _common, style
from simkit.figures.mse_vs_T import dialed_behaviour

NAME = "token_bias_vs_T"
TITLE = "Token-IS and PPO-clip bias vs T"
CAPTION = (
    "exact bias ‖E ĝ − ∇J‖ of token IS and PPO clip (naive for reference; oracle advantage "
    "A = R − J(μ), seq-mean-token-sum) against T up to 256, on two token MDPs (V = 2) at the "
    "same per-token χ²(π‖μ) in every state: answer_correct, whose reward reads only the last "
    "token, and a majority vote (at_least_k, k = ⌈T/2⌉, π uniform), whose reward reads the whole "
    "sequence. Top row (a–c): untied parameters, one logit table per position (the gradient "
    "w.r.t. θ[t, state, token]); bottom row (d–f): tied parameters, one table shared by every "
    "position (the gradient is the sum of the per-position blocks). Grey dotted: ‖∇J‖ in the "
    "same parameterisation; right column: the bias relative to ‖∇J‖. Token-level curves: exact "
    "dynamic programme at every T, equal to the enumeration of all sequences (to 1e-10) for "
    "T ≤ 12. Sequence IS: 0 by enumeration (filled, T ≤ 12) and by theory beyond (open). "
    "Dashed: the rl-collapse O(T²·Δ_max) shape, scaled to token IS's first non-zero bias (shape "
    "only, not a bound's constant). The growth laws printed under the figure are fitted slopes "
    "of log bias against log T, computed from the drawn data."
)

MAPPINGS = ("naive", "is_token", "ppo_clip", "is_seq")
#: the mappings computed by the dynamic programme (token level, per-token phi)
TOKEN_MAPPINGS = ("naive", "is_token", "ppo_clip")
ENVS = ("answer_correct", "at_least_k")
PARAMS = ("untied", "tied")

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
    params: tuple[str, ...] = PARAMS
    fit_from: int = 32

    def __post_init__(self):
        _common.check_token_grid(self.V, lengths=self.lengths)
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
        if not self.params or any(p not in PARAMS for p in self.params):
            raise ValueError(f"params must be a non-empty subset of {PARAMS}, got {self.params}")


def config(small: bool = False) -> Config:
    if small:
        return Config(lengths=(1, 2, 4, 6, 24, 48), enum_max_log2=6, fit_from=24)
    return Config()


def build_env(cfg: Config, kind: str, T: int) -> TokenMDP:
    """The token MDP ``kind`` (one of :data:`ENVS`) at length T, as in the module docstring."""
    if kind == "answer_correct":
        return TokenMDP.answer_correct(V=cfg.V, T=T, seed=cfg.seed, scale=cfg.scale)
    if kind == "at_least_k":
        k = max(1, math.ceil(cfg.k_fraction * T))
        return TokenMDP.at_least_k(V=cfg.V, T=T, k=k, logits=np.zeros(cfg.V))
    raise ValueError(f"env kind must be one of {ENVS}, got {kind!r}")


def _enumerated_biases(env, mu, params: str = "untied") -> dict[str, float]:
    """Bias of every mapping of :data:`MAPPINGS` by enumeration (``experiment.run`` exact)."""
    ests = _common.oracle_estimators(MAPPINGS)
    frame = experiment.run(env, mu, ests, n=1, reps=2, exact=True, progress=False, params=params)
    return dict(zip(frame.mapping, frame.bias, strict=True))


def compute(cfg: Config) -> pd.DataFrame:
    rows = []
    for kind in cfg.envs:
        for T in sorted(cfg.lengths):
            env = build_env(cfg, kind, int(T))
            mu = dialed_behaviour(env, cfg.chi2_tok, cfg.shift_family)
            J_mu = env.J(mu)
            grad_untied = env.grad_J()
            means = {
                name: exact_token_level_mean(env, mu, mappings.get(name), J_mu)
                for name in TOKEN_MAPPINGS
            }
            enumerable = env.enumerable(budget=2**cfg.enum_max_log2)
            base = {
                "env": kind,
                "T": int(T),
                "J": env.J(),
                "delta_max": float(np.nanmax(env.divergence_profile(mu)["tv_max"])),
                "chi2_tok": env.divergences(mu)["chi2_tok"],
            }
            for params in cfg.params:
                T_env = env.T
                tie = (
                    (lambda v, T_env=T_env: experiment.tie(v, T_env))
                    if params == "tied"
                    else (lambda v: v)
                )
                grad = tie(grad_untied)
                enum = _enumerated_biases(env, mu, params) if enumerable else {}
                common = {**base, "params": params, "grad_norm": float(np.linalg.norm(grad))}
                for name in MAPPINGS:
                    if name in TOKEN_MAPPINGS:
                        bias, method = float(np.linalg.norm(tie(means[name]) - grad)), "dp"
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
    for params in cfg.params:
        for kind in cfg.envs:
            here = (data.env == kind) & (data.params == params)
            token = data[here & (data.mapping == "is_token") & (data.bias > 1e-12)]
            if len(token) == 0:
                raise ValueError(
                    f"{kind} ({params}): token IS is unbiased at every length: nothing to scale to"
                )
            anchor = token.sort_values("T").iloc[0]
            scale = anchor.bias / anchor.bound_shape
            data.loc[here, "bound_shape"] *= scale
            anchors[params, kind] = int(anchor["T"])
    data.attrs["anchor_T"] = anchors
    data.attrs["fit_from"] = cfg.fit_from
    return data


#: fitted slope bands and the words used for them
GROWTH_WORDS = (
    (-math.inf, -0.15, "falls"),
    (-0.15, 0.15, "saturates (flat)"),
    (0.35, 0.65, "grows like √T"),
    (0.85, 1.15, "grows ∝ T"),
    (1.85, 2.15, "grows like T²"),
)
#: the curves whose growth law the figure states
STATED = ("naive", "is_token", "ppo_clip")


def growth_word(slope: float) -> str:
    """Words for a fitted log-log slope (:data:`GROWTH_WORDS`; else "grows like T^s")."""
    for lo, hi, word in GROWTH_WORDS:
        if lo <= slope < hi:
            return word
    return f"grows like T^{slope:.2f}" if slope > 0 else f"falls like T^{slope:.2f}"


def growth_laws(data: pd.DataFrame, fit_from: int | None = None) -> pd.DataFrame:
    """Least-squares slope of log(bias) on log(T) over T ≥ ``fit_from`` per (params, env,
    mapping) of :data:`STATED`: columns ``slope``, ``points``, ``T_min``, ``T_max``, ``bias_min``
    and ``bias_max`` (the bias at T_min and T_max) and ``law`` (:func:`growth_word`)."""
    start = data.attrs.get("fit_from", 32) if fit_from is None else fit_from
    rows = []
    for (params, kind, name), part in data.groupby(["params", "env", "mapping"], sort=False):
        if name not in STATED:
            continue
        part = part[(part["T"] >= start) & (part.bias > 0)].sort_values("T")
        if len(part) < 2:
            continue
        x, y = np.log(part["T"].to_numpy(float)), np.log(part.bias.to_numpy(float))
        slope = float(np.polyfit(x, y, 1)[0])
        rows.append(
            {
                "params": params,
                "env": kind,
                "mapping": name,
                "slope": slope,
                "points": len(part),
                "T_min": int(part["T"].iloc[0]),
                "T_max": int(part["T"].iloc[-1]),
                "bias_min": float(part.bias.iloc[0]),
                "bias_max": float(part.bias.iloc[-1]),
                "law": growth_word(slope),
            }
        )
    return pd.DataFrame(rows)


def claims(data: pd.DataFrame) -> list[str]:
    """The measured sentences printed under the figure, built from :func:`growth_laws`."""
    laws = growth_laws(data)
    if laws.empty:
        return ["Too few lengths beyond the fit start to state a growth law."]
    lines = []
    for params in dict.fromkeys(laws.params):
        part = laws[laws.params == params]
        items = [
            f"{r.mapping} on {ENV_SHORT.get(r.env, r.env)} {r.law} (slope {r.slope:.2f}; "
            f"{r.bias_min:.3g} → {r.bias_max:.3g})"
            for r in part.itertuples(index=False)
        ]
        t0, t1 = int(part.T_min.min()), int(part.T_max.max())
        lines.append(f"{params.capitalize()}, fitted over T = {t0}…{t1}: " + "; ".join(items) + ".")
    top = laws.loc[laws.slope.idxmax()]
    reach = laws[laws.slope >= 1.85]
    if len(reach):
        names = ", ".join(
            f"{r.mapping} ({r.params}, {ENV_SHORT.get(r.env, r.env)})"
            for r in reach.itertuples(index=False)
        )
        lines.append(f"Curves that grow like the T² bound shape: {names}.")
    else:
        lines.append(
            "No measured curve reaches the T² growth of the rl-collapse O(T²·Δ_max) shape: the "
            f"steepest is {top.mapping} ({top.params}, {ENV_SHORT.get(top.env, top.env)}), "
            f"slope {top.slope:.2f}."
        )
    return lines


PANEL_TITLES = {
    "answer_correct": "answer_correct: R reads the last token",
    "at_least_k": "majority: at_least_k, k = ⌈T/2⌉",
}


#: line style of each environment on the relative-bias panel
ENV_LINESTYLES = {"answer_correct": ":", "at_least_k": "-"}
ENV_SHORT = {"answer_correct": "answer_correct", "at_least_k": "majority"}


def _draw_relative(ax, data: pd.DataFrame, kinds, letter: str, title="bias relative to ‖∇J‖"):
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
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6, loc="lower right")
    _common.panel_label(ax, letter)


def _draw_bias_panel(ax, data: pd.DataFrame, kind: str, anchor: int, floor, top) -> None:
    """Bias of every mapping on one environment (one parameterisation), with ‖∇J‖ and the
    scaled T² shape."""
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
    grad_label = r"$\|\nabla J\|$ (scale of the signal)"
    bound_label = "∝ T²·Δ_max (rl-collapse; shape only, matched at token IS's first bias)"
    for column, kwargs in (  # the two reference curves
        ("grad_norm", dict(color="0.45", linestyle=":", linewidth=1.2, label=grad_label)),
        ("bound_shape", dict(color="0.35", linestyle="--", linewidth=1.0, label=bound_label)),
    ):
        ax.plot(ref["T"], ref[column], **kwargs)
    _common.mark_floor(ax, floor)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, top)
    ax.set_xlabel("sequence length T")
    ax.text(
        0.02,
        0.98,
        f"matched at T = {anchor}",
        transform=ax.transAxes,
        fontsize=6,
        va="top",
        color="0.35",
    )


def draw(data: pd.DataFrame):
    kinds = list(dict.fromkeys(data.env))
    params_list = list(dict.fromkeys(data.params))
    notes = [textwrap.fill(line, 175) for line in claims(data)]
    n_note_lines = sum(line.count("\n") + 1 for line in notes)
    fig = _common.new_figure(3.6 * (len(kinds) + 1), 3.2 * len(params_list) + 1.0)
    gs = fig.add_gridspec(
        len(params_list) + 1,
        len(kinds) + 1,
        height_ratios=[1.0] * len(params_list) + [0.07 * n_note_lines + 0.08],
    )
    positive = data.bias[data.bias > 1e-12]
    floor = 10 ** np.floor(np.log10(positive.min() / 3))
    top = float(max(data.bias.max(), data.grad_norm.max())) * 8
    letters = iter("abcdefghijkl")
    first_ax = None
    for r, params in enumerate(params_list):
        sub = data[data.params == params]
        axes = [fig.add_subplot(gs[r, c], sharey=first_ax) for c in range(len(kinds))]
        first_ax = first_ax or axes[0]
        for ax, kind in zip(axes, kinds, strict=True):
            _draw_bias_panel(ax, sub, kind, data.attrs["anchor_T"][params, kind], floor, top)
            ax.set_title(f"{ENV_SHORT.get(kind, kind)}, {params} parameters", fontsize=8)
            _common.panel_label(ax, next(letters))
        axes[0].set_ylabel(f"bias ({params})")
        rel_ax = fig.add_subplot(gs[r, -1])
        _draw_relative(rel_ax, sub, kinds, next(letters), f"bias / ‖∇J‖, {params}")
    note_ax = fig.add_subplot(gs[-1, :])
    note_ax.axis("off")
    note_ax.text(0.0, 1.0, "\n".join(notes), fontsize=6, va="top", ha="left")
    fig.legend(
        *first_ax.get_legend_handles_labels(),
        loc="outside lower center",
        ncol=3,
        fontsize=6.5,
    )
    fig.suptitle(
        f"Token-level bias ‖E ĝ − ∇J‖ vs T, χ²(π‖μ) = {float(data.chi2_tok.iloc[0]):.3g} in every "
        "state, oracle baseline J(μ) (exact: DP, enumeration, theory)",
        fontsize=9,
    )
    return fig
