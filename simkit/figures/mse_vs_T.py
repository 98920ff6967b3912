"""Every mapping's MSE and cosine to ∇J vs the sequence length T at a fixed per-token χ².

Token-level corrections (token IS, PPO clip, CISPO, TIS…) are biased through the state
distribution, with a bias that grows with T (rl-collapse, Liu, Li et al. 2025: O(T²·Δ_max));
sequence-level IS is unbiased but its variance grows like (1+χ²)^T. Where the MSE curves cross
is the practical answer to "token or sequence?".

Setting: ``TokenMDP.answer_correct`` (R = 1 iff the last token is the answer; the policy depends
on whether the last token was correct; stationary random logits), μ dialed so that every
state's next-token distribution has χ²(π‖μ) = ``chi2_tok`` (``shift_family``, default logit
noise; :func:`dialed_behaviour`), for each T of two grids. Every per-sample mapping (defaults,
oracle advantage, ``seq-mean-token-sum``) runs through :func:`simkit.experiment.run`:

- ``exact_lengths``: the exact path (all V^T sequences enumerated; V^T ≤ 2^16);
- ``dp_lengths``: the exact path beyond enumeration for the mappings with a moment DP (every
  token-level mapping, sequence IS and ``power``: :mod:`simkit.envs.token_moments`, mean *and*
  variance), so their curves are exact at every T;
- ``mc_lengths``: Monte Carlo (``mc_reps`` independent batches of n sequences, common random
  numbers across mappings, 95% bootstrap bounds ``*_lo``/``*_hi``, the ``reliable`` flag of
  :mod:`simkit.reliability`) for every mapping, drawn only where no exact value exists (the
  sequence-level mappings without a DP). The grids may overlap (the tests compare the paths).

The batch-dependent mappings (snis, psis, m2po) have no exact path and are left out.

Data: the tidy DataFrame of :func:`simkit.experiment.run`, one row per (mapping, T, path),
plus ``method`` (``"enumeration"``, ``"dp"`` or ``"monte_carlo"``), ``family`` and
``delta_max`` (the largest per-state TV(π, μ), for the rl-collapse bias shape) and
``grad_norm`` (‖∇J‖); ``data.attrs["claims"]`` the sentences of :func:`claims`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, mappings, shifts
from simkit.envs import TokenMDP
from simkit.envs.behaviour import behaviour
from simkit.figures import _common, style

NAME = "mse_vs_T"
TITLE = "MSE and cosine of every mapping vs T"
CAPTION = (
    "every per-sample mapping on a token MDP (answer_correct, V = 2) at a fixed per-token "
    "χ²(π‖μ) in every state, against the sequence length T (oracle advantage A = R − J(μ), "
    "seq-mean-token-sum, untied parameters): MSE (a) and cosine to ∇J (b). Solid lines, filled "
    "markers: exact — by enumeration of all V^T sequences (T ≤ 12) and, beyond, by the moment "
    "dynamic programme (mean and variance) for every token-level mapping, sequence IS and "
    "power. Dashed with 95% bootstrap bands: Monte Carlo, only for the sequence-level mappings "
    "without a DP; hollow markers are Monte Carlo points marked unreliable (heavy or unseen "
    "tails, simkit.reliability). The sentence under the figure (where sequence IS's MSE "
    "crosses above every token-level mapping) is computed from the drawn data."
)

#: mappings drawn with a thick line (the comparison the figure is about)
HIGHLIGHT = ("is_seq", "is_token")


@dataclass(frozen=True)
class Config:
    """Environment, mismatch, lengths and estimator settings.

    ``exact_lengths``: T values computed exactly (enumeration); ``mc_lengths``: T values
    computed by Monte Carlo with ``mc_reps`` batches and ``n_boot`` bootstrap resamples.
    ``reps`` is the number of batches drawn on the exact path (only ``khat`` uses them).
    """

    V: int = 2
    exact_lengths: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10, 12)
    dp_lengths: tuple[int, ...] = (16, 24, 32, 48, 64, 96, 128)
    mc_lengths: tuple[int, ...] = (16, 24, 32, 48, 64, 96, 128)
    chi2_tok: float = 0.05
    scale: float = 1.0
    n: int = 16
    reps: int = 20
    mc_reps: int = 800
    n_boot: int = 400
    shift_family: str = "logit_noise"
    seed: int = 0
    mapping_names: tuple[str, ...] | None = None  # None: every per-sample mapping

    def __post_init__(self):
        if self.V < 2:
            raise ValueError(f"V must be >= 2, got {self.V}")
        if not (self.exact_lengths or self.dp_lengths or self.mc_lengths):
            raise ValueError(
                "exact_lengths, dp_lengths and mc_lengths are all empty: no T to compute"
            )
        for name in ("exact_lengths", "dp_lengths", "mc_lengths"):
            lengths = getattr(self, name)
            if lengths and min(lengths) < 1:
                raise ValueError(f"{name} must be positive integers, got {lengths}")
        if self.exact_lengths and self.V ** max(self.exact_lengths) > 2**16:
            raise ValueError(
                f"exact_lengths: V^T = {self.V ** max(self.exact_lengths)} sequences at "
                f"T = {max(self.exact_lengths)}: too many to enumerate (2^16 max); put the "
                "longer lengths in mc_lengths"
            )
        if not self.chi2_tok > 0:
            raise ValueError(f"chi2_tok must be > 0, got {self.chi2_tok}")
        if self.n < 1 or self.reps < 2 or self.mc_reps < 2:
            raise ValueError("need n >= 1, reps >= 2 and mc_reps >= 2")
        if self.n_boot < 10:
            raise ValueError(f"n_boot must be >= 10, got {self.n_boot}")

    @property
    def lengths(self) -> tuple[int, ...]:
        """Every T of the figure (all grids), sorted, without repeats."""
        return tuple(sorted(set(self.exact_lengths) | set(self.dp_lengths) | set(self.mc_lengths)))


def config(small: bool = False) -> Config:
    if small:
        return Config(
            exact_lengths=(1, 2, 4, 6),
            dp_lengths=(16, 24),
            mc_lengths=(6, 16),
            reps=5,
            mc_reps=400,
            n_boot=100,
            mapping_names=_common.SMALL_EXACT_MAPPINGS,
        )
    return Config()


def dialed_behaviour(env: TokenMDP, chi2_tok: float, family: str) -> np.ndarray:
    """μ (T, P, V) with χ²(π_{t,p}‖μ_{t,p}) = ``chi2_tok`` in every row (t, p).

    The same μ as ``behaviour(env, chi2_tok, "chi2", level="token", family=family)``: when
    π is the same at every position (stationary logits) only the P rows of position 0 are
    dialed (:func:`simkit.shifts.dial`) and broadcast over T — the dial is row by row and
    deterministic, so the result is identical, in O(P) instead of O(T·P) root solves.
    """
    pi = env.pi
    if not np.array_equal(pi, np.broadcast_to(pi[:1], pi.shape)):
        return behaviour(env, chi2_tok, "chi2", level="token", family=family)
    first = shifts.dial(pi[0], chi2_tok, "chi2", family=family)
    return np.array(np.broadcast_to(first, pi.shape))


def dp_mappings(names) -> list[str]:
    """The mappings of ``names`` with a moment DP (exact at any T)."""
    from simkit.envs.token_moments import dp_applies

    env = TokenMDP.answer_correct(V=2, T=1)
    return [n for n in names if not dp_applies(env, mappings.get(n), "seq-mean-token-sum")]


def sweep_lengths(cfg: Config, names, lengths, exact: bool) -> pd.DataFrame:
    """``experiment.run`` of the mappings ``names`` at every T of ``lengths`` (exact: by
    enumeration where V^T fits the budget, else by DP; or Monte Carlo)."""
    ests = _common.oracle_estimators(names)
    frames = []
    for T in lengths:
        env = TokenMDP.answer_correct(V=cfg.V, T=int(T), seed=cfg.seed, scale=cfg.scale)
        mu = dialed_behaviour(env, cfg.chi2_tok, cfg.shift_family)
        frame = experiment.run(
            env,
            mu,
            ests,
            n=cfg.n,
            reps=cfg.reps if exact else cfg.mc_reps,
            seed=cfg.seed,
            exact=exact,
            n_boot=cfg.n_boot,
            progress=False,
        )
        frame["method"] = ("enumeration" if env.enumerable() else "dp") if exact else "monte_carlo"
        frame["delta_max"] = float(np.nanmax(env.divergence_profile(mu)["tv_max"]))
        frame["grad_norm"] = float(np.linalg.norm(env.grad_J()))
        frames.append(frame)
    data = pd.concat(frames, ignore_index=True)
    data["family"] = [style.family(m) for m in data.mapping]
    return data


def compute(cfg: Config) -> pd.DataFrame:
    names = _common.chosen_mappings(cfg.mapping_names, _common.per_sample_mappings())
    grids = ((names, cfg.exact_lengths, True), (dp_mappings(names), cfg.dp_lengths, True))
    parts = [
        sweep_lengths(cfg, subset, lengths, exact)
        for subset, lengths, exact in (*grids, (names, cfg.mc_lengths, False))
        if lengths and subset
    ]
    data = pd.concat(parts, ignore_index=True)
    data.attrs["claims"] = claims(data)
    return data


def crossing(data: pd.DataFrame):
    """(T, MSE) of the first length at which sequence IS's exact MSE exceeds the exact MSE of
    every token-level mapping drawn, or None; also the token-level mapping with the largest MSE
    there."""
    exact = data[data.exact]
    token = [n for n in dict.fromkeys(exact.mapping) if mappings.mapping_class(n).level == "token"]
    for T in sorted(exact["T"].unique()):
        at = exact[exact["T"] == T].set_index("mapping")
        if "is_seq" not in at.index or not all(n in at.index for n in token):
            continue
        worst = at.loc[token, "mse"].idxmax()
        if at.loc["is_seq", "mse"] > at.loc[worst, "mse"]:
            return int(T), float(at.loc["is_seq", "mse"]), worst, float(at.loc[worst, "mse"])
    return None


def claims(data: pd.DataFrame) -> list[str]:
    """The measured sentences printed under the figure, built from the exact rows."""
    found = crossing(data)
    exact = data[data.exact]
    if found is None:
        T_max = int(exact["T"].max()) if len(exact) else 0
        return [f"Sequence IS's exact MSE stays below some token-level mapping up to T = {T_max}."]
    T, mse, worst, worst_mse = found
    lines = [
        f"Sequence IS's exact MSE first exceeds every token-level mapping's at T = {T} "
        f"({mse:.3g} against {worst}'s {worst_mse:.3g})."
    ]
    mc = data[~data.exact]
    if "reliable" in mc and len(mc):
        bad = mc[mc["reliable"] == False]  # noqa: E712
        lines.append(
            f"Monte Carlo rows marked unreliable: {len(bad)} of {len(mc)}"
            + (f" ({', '.join(sorted(set(bad.mapping)))})." if len(bad) else ".")
        )
    return lines


def _curve(data: pd.DataFrame, name: str) -> pd.DataFrame:
    """One mapping's points, exact ones first where a T has both paths (one point per T)."""
    part = data[data.mapping == name].sort_values(["T", "exact"], ascending=[True, False])
    return part.drop_duplicates("T")


def draw(data: pd.DataFrame):
    fig = _common.new_figure(7.6, 4.8)
    axes = fig.subplots(1, 2, sharex=True)
    names = list(dict.fromkeys(data.mapping))
    enum = data.method == "enumeration"
    t_exact_max = data.loc[enum, "T"].max() if enum.any() else None
    for ax, (metric, label, scale) in zip(
        axes,
        (
            ("mse", r"MSE $\mathbb{E}\|\hat g - \nabla J\|^2$", "log"),
            ("cosine", r"cosine $\cos(\mathbb{E}\hat g, \nabla J)$", "linear"),
        ),
        strict=True,
    ):
        for name in names:
            part = _curve(data, name)
            T = part["T"].to_numpy(dtype=float)
            y = part[metric].to_numpy(dtype=float)
            lo = part[f"{metric}_lo"].to_numpy(dtype=float)
            hi = part[f"{metric}_hi"].to_numpy(dtype=float)
            if scale == "log":
                y, lo, hi = (_common.finite_positive(v) for v in (y, lo, hi))
            width = 2.0 if name in HIGHLIGHT else 1.0
            kwargs = style.line_kwargs(name, linewidth=width)
            exact = part.exact.to_numpy(dtype=bool)
            (line,) = ax.plot(
                T[exact], y[exact], marker=style.marker(name), markersize=2.8, **kwargs
            )
            mc = ~exact
            if mc.any():
                ax.plot(
                    T[mc],
                    y[mc],
                    linestyle="--",
                    linewidth=width * 0.8,
                    marker=style.marker(name),
                    markersize=3.0,
                    color=line.get_color(),
                )
                band = mc & np.isfinite(lo) & np.isfinite(hi)
                if band.any():
                    ax.fill_between(
                        T[band], lo[band], hi[band], color=line.get_color(), alpha=0.12, linewidth=0
                    )
                if "reliable" in part:
                    _common.mark_unreliable(
                        ax,
                        T[mc],
                        y[mc],
                        part["reliable"].to_numpy()[mc],
                        line.get_color(),
                        style.marker(name),
                        4.0,
                    )
        if t_exact_max is not None and (~enum).any():
            _common.mark_x(
                ax,
                t_exact_max,
                "enumeration ← | → DP (exact) and Monte Carlo",
                0.0,
                (0, 3),
                ha="center",
                va="bottom",
                fontsize=6.5,
                color="0.35",
            )
        ax.set_xscale("log")
        ax.set_yscale(scale)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(label)
        ax.set_title("MSE" if metric == "mse" else "cosine to ∇J")
    cos = data.cosine.to_numpy(dtype=float)
    axes[1].set_ylim(max(float(np.nanmin(cos[np.isfinite(cos)])) - 0.05, -1.02), 1.02)
    _common.panel_label(axes[0], "a")
    _common.panel_label(axes[1], "b")
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside right center",
        fontsize=6,
        title="mapping",
        title_fontsize=7.5,
    )
    mc = data[~data.exact]
    reps = f", {int(mc.reps.iloc[0])} MC batches" if len(mc) else ""
    notes = data.attrs.get("claims") or claims(data)
    fig.supxlabel("\n".join(notes), x=0.01, ha="left", fontsize=6, color="0.2")
    fig.suptitle(
        f"Token MDP (answer_correct), χ²(π‖μ) = {float(data.chi2_tok.iloc[0]):.3g} in every "
        f"state, n = {int(data.n.iloc[0])}{reps}"
    )
    return fig
