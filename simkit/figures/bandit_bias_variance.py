"""Bias, variance, MSE and cosine of every mapping on a bandit, against the mismatch χ²(π‖μ).

A K-armed Bernoulli bandit (seeded logits and reward means), the behaviour μ dialed by
:func:`simkit.shifts.dial` to each χ²(π‖μ) of a grid, batches of n samples, oracle advantages
A = R − J(π) and the mapping's default hyperparameters and the ``seq-mean-token-sum``
aggregation (Z = n on the bandit: T = 1, so every aggregation coincides). Per-sample mappings
are exact (:func:`simkit.experiment.run`'s exact path); batch-dependent ones (snis, psis, m2po)
are Monte Carlo with bootstrap confidence bounds, drawn as error bars.

Drawn as small multiples: one column per family (:data:`simkit.figures._claims.PANELS`:
classic IS; clipping; truncation and masking; smooth gates and VESPO), one row per metric, with
naive and sequence IS as references in every panel. A bias that is exactly 0 (to rounding: at
most 1e-9 of the largest bias, exact rows only) is a filled marker on the floor line, never a
line segment falling to it; unreliable Monte Carlo rows (column ``reliable``, where present)
are hollow (:func:`simkit.figures._common.mark_unreliable`).

``zero_fraction`` (exact, per-sample mappings; NaN for batch-dependent ones): the μ-probability
of a draw (arm, sign of A) whose coefficient is 0 — for PPO-style clipping the clip fraction.
GSPO at its default ε (the paper's, 3e-4 / 4e-4) clips s = r on a one-token bandit unless
|r − 1| ≤ ε, i.e. almost always; the notes (:func:`notes`) give the measured fraction.

Data: the tidy DataFrame of :func:`simkit.experiment.run`, one row per (mapping, χ² target),
with the extra columns ``target_chi2``, ``arms``, ``family`` (the mapping's colour family),
``panel``, ``zero_fraction`` and ``outside_clip_range`` (:func:`zero_fractions`);
``data.attrs["notes"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, shifts
from simkit.envs import Bandit
from simkit.figures import _claims, _common, style
from simkit.figures.staleness_curves import split_figure

NAME = "bandit_bias_variance"
TITLE = "Bias, variance, MSE and cosine vs χ² on a bandit"
CAPTION = (
    "every mapping of the catalogue (default hyperparameters, oracle advantage, n samples "
    "per estimate) on a Bernoulli bandit whose behaviour μ is dialed to a grid of "
    "χ²(π‖μ); exact for per-sample mappings, Monte Carlo with 95 % bootstrap bounds for "
    "batch-dependent ones; small multiples by family with naive and sequence IS as references "
    "in every panel, an exactly-zero bias drawn as a marker on the floor line. The notes under "
    "the panels give, from the data, which mappings are exactly unbiased and GSPO's measured "
    "clip fraction."
)

#: a bias at most this fraction of the largest bias (exact rows) is an exact 0 in floating point
ZERO_BIAS_RTOL = 1e-9


@dataclass(frozen=True)
class Config:
    """Bandit, mismatch grid and estimator settings."""

    arms: int = 16
    n: int = 64
    chi2_min: float = 0.01
    chi2_max: float = 10.0
    n_chi2: int = 13
    shift_family: str = "logit_noise"
    reps: int = 400
    n_boot: int = 400
    seed: int = 0
    mapping_names: tuple[str, ...] | None = None  # None: every registered mapping

    def __post_init__(self):
        if self.arms < 2:
            raise ValueError(f"arms must be >= 2, got {self.arms}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 < self.chi2_min < self.chi2_max:
            raise ValueError(
                f"need 0 < chi2_min < chi2_max, got chi2_min={self.chi2_min}, "
                f"chi2_max={self.chi2_max}"
            )
        if self.n_chi2 < 2:
            raise ValueError(f"n_chi2 must be >= 2, got {self.n_chi2}")
        if self.reps < 2 or self.n_boot < 10:
            raise ValueError(f"need reps >= 2 and n_boot >= 10, got {self.reps}, {self.n_boot}")

    @property
    def chi2_grid(self) -> np.ndarray:
        return np.geomspace(self.chi2_min, self.chi2_max, self.n_chi2)


def config(small: bool = False) -> Config:
    if small:
        return Config(arms=8, n=16, n_chi2=4, chi2_max=3.0, reps=40, n_boot=50)
    return Config()


def make_bandit(arms: int, seed: int) -> Bandit:
    """The figure's bandit: logits ~ N(0, 1), Bernoulli means ~ U(0.05, 0.95), from ``seed``."""
    rng = np.random.default_rng(seed)
    return Bandit(logits=rng.normal(0.0, 1.0, arms), means=rng.uniform(0.05, 0.95, arms))


def compute(cfg: Config) -> pd.DataFrame:
    env = make_bandit(cfg.arms, cfg.seed)
    ests = _common.oracle_estimators(_common.chosen_mappings(cfg.mapping_names))
    frames = []
    for target in cfg.chi2_grid:
        mu = shifts.dial(env.pi, float(target), divergence="chi2", family=cfg.shift_family)
        zero, outside = zero_fractions(env, mu, ests)
        frame = experiment.run(
            env,
            mu,
            ests,
            n=cfg.n,
            reps=cfg.reps,
            seed=cfg.seed,
            n_boot=cfg.n_boot,
            progress=False,
            setting={"target_chi2": float(target)},
        )
        frame["zero_fraction"] = frame.mapping.map(zero).astype(float)
        frame["outside_clip_range"] = frame.mapping.map(outside).astype(float)
        frames.append(frame)
    data = pd.concat(frames, ignore_index=True)
    data["family"] = [style.family(m) for m in data.mapping]
    data["arms"] = cfg.arms
    data["shift_family"] = cfg.shift_family
    data["panel"] = [_claims.panel_of(m) for m in data.mapping]
    data.attrs["notes"] = notes(data)
    return data


def zero_fractions(env: Bandit, mu, ests) -> tuple[dict, dict]:
    """Two dicts by estimator name, exact over the atoms (arm, sign of A) of ``env.support``
    (signs of A = R − J(μ); for Bernoulli rewards any baseline in (0, 1) gives the same signs):

    - P_μ(coefficient = 0) (NaN for batch-dependent mappings, whose coefficient depends on the
      batch);
    - for mappings with a clip range (``eps_low``, ``eps_high``), P_μ(r ∉ [1 − ε_low,
      1 + ε_high]) — on the bandit (T = 1) r = W = s; NaN otherwise.
    """
    support = env.support(mu, baseline=env.J(mu))
    r = np.exp(support.log_ratio[:, 0])
    zero, outside = {}, {}
    for est in ests:
        m = est.mapping
        zero[est.name] = outside[est.name] = float("nan")
        if not m.batch_dependent:
            c = m.coefficients(support.log_ratio, support.mask, support.advantage_sign)
            zero[est.name] = float(support.prob @ (np.asarray(c)[:, 0] == 0))
        if hasattr(m, "eps_low") and hasattr(m, "eps_high"):
            out = (r < 1 - m.eps_low) | (r > 1 + m.eps_high)
            outside[est.name] = float(support.prob @ out)
    return zero, outside


def exact_zero_bias(data: pd.DataFrame) -> pd.Series:
    """Boolean per row: an exact row whose bias is 0 to rounding (≤ ZERO_BIAS_RTOL·max bias)."""
    scale = float(data.bias.max()) if len(data) else 0.0
    return data.exact.astype(bool) & (data.bias <= ZERO_BIAS_RTOL * scale)


def _span(lo: float, hi: float, spec: str) -> str:
    a, b = format(lo, spec), format(hi, spec)
    return a if a == b else f"{a}–{b}"


def notes(data: pd.DataFrame) -> tuple[str, ...]:
    """Sentences under the figure, built from ``data``."""
    row = data.iloc[0]
    lines = [
        f"Setting: {int(row.arms)}-armed Bernoulli bandit (seeded), μ = {row.shift_family} "
        f"shift of π dialed to χ²(π‖μ) from {data.chi2_tok.min():.3g} to "
        f"{data.chi2_tok.max():.3g} ({data.target_chi2.nunique()} points); n = {int(row.n)} "
        f"draws per estimate, advantage {_claims.advantage_text(row.advantage)}, default "
        "hyperparameters; exact rows "
        "for per-sample mappings, Monte Carlo (95 % bootstrap bounds) for batch-dependent ones."
    ]
    zero = exact_zero_bias(data)
    by_name = zero.groupby(data.mapping, sort=False)
    always = [n for n, z in by_name if z.all()]
    some = [n for n, z in by_name if z.any() and not z.all()]
    text = f"Exactly unbiased at every χ² of the grid: {_claims.name_list(always)}"
    if some:
        parts = []
        for n in some:
            chi = data.chi2_tok[(data.mapping == n) & zero]
            parts.append(f"{n} (χ² ≤ {chi.max():.3g})" if len(chi) else n)
        text += f"; at some χ² only: {', '.join(parts)}"
    lines.append(text + " (drawn as markers on the floor line).")
    if "reliable" in data:
        flags = data.reliable[~data.exact.astype(bool)]
        bad = int((flags.notna() & (flags == False)).sum())  # noqa: E712 (object column)
        if bad:
            lines.append(f"{bad} Monte Carlo rows: {_common.UNRELIABLE_NOTE}.")
    gspo = data[data.mapping == "gspo"]
    if len(gspo) and gspo.outside_clip_range.notna().all():
        lo, hi = float(gspo.outside_clip_range.min()), float(gspo.outside_clip_range.max())
        z_lo, z_hi = float(gspo.zero_fraction.min()), float(gspo.zero_fraction.max())
        how = "almost always" if lo >= 0.9 else "on most draws" if lo >= 0.5 else "rarely"
        lines.append(
            f"GSPO at its default ε (the paper's 3e-4 / 4e-4) is clipped {how} on this "
            f"one-token bandit, where s = r: r lies outside [1 − ε_low, 1 + ε_high] on "
            f"{_span(lo, hi, '.1%')} of μ's draws across the χ² grid, and the coefficient is "
            f"exactly 0 (the clipped side for the advantage's sign) on {_span(z_lo, z_hi, '.0%')} "
            "— its curves "
            "say little about GSPO on long sequences."
        )
    return tuple(lines)


METRICS = (
    ("bias", r"bias $\|\mathbb{E}\hat g - \nabla J\|$", "log"),
    ("variance", r"variance $\mathbb{E}\|\hat g - \mathbb{E}\hat g\|^2$", "log"),
    ("mse", r"MSE $\mathbb{E}\|\hat g - \nabla J\|^2$", "log"),
    ("cosine", r"cosine $\cos(\mathbb{E}\hat g, \nabla J)$", "linear"),
)


def _bias_floor(data: pd.DataFrame) -> float:
    positive = data.bias[~exact_zero_bias(data) & (data.bias > 0)]
    return 10 ** np.floor(np.log10(positive.min() / 3)) if len(positive) else 1e-6


def _draw_series(ax, part: pd.DataFrame, name: str, metric: str, floor: float, zero_all, **kw):
    """One mapping's curve on one panel: exact zeros (bias) as hollow markers on the floor,
    never joined by a segment; Monte Carlo rows with their bootstrap bounds."""
    x = part.chi2_tok.to_numpy()
    y = part[metric].to_numpy(dtype=float)
    zero = zero_all.loc[part.index].to_numpy() if metric == "bias" else np.zeros(len(y), bool)
    line = np.where(zero, np.nan, y)
    if metric == "bias":
        line = np.where(line <= floor, np.nan, line)
    kw = {**style.line_kwargs(name), "markersize": 2.6, "marker": style.marker(name), **kw}
    if not part.exact.all():
        lo = part[f"{metric}_lo"].to_numpy(dtype=float)
        hi = part[f"{metric}_hi"].to_numpy(dtype=float)
        if ax.get_yscale() == "log":
            lo = np.maximum(lo, floor if metric == "bias" else y * 1e-3)
        ax.errorbar(
            x,
            line,
            yerr=[np.maximum(line - lo, 0), np.maximum(hi - line, 0)],
            capsize=1.2,
            elinewidth=0.6,
            **kw,
        )
        if "reliable" in part:
            _common.mark_unreliable(
                ax,
                x,
                line,
                part.reliable.to_numpy(),
                color=style.color(name),
                marker=style.marker(name),
            )
    else:
        ax.plot(x, line, **kw)
    if zero.any():  # filled (hollow markers mean "unreliable Monte Carlo" in every figure)
        ax.plot(
            x[zero],
            np.full(int(zero.sum()), floor),
            linestyle="none",
            marker=style.marker(name),
            markersize=4,
            color=style.color(name),
            clip_on=False,
            zorder=4,
        )


def draw(data: pd.DataFrame):
    panel_names = [p for p in _claims.PANELS if (data.panel == p).any()]
    fig, sub = split_figure(7.6, 8.8, data.attrs.get("notes", ()))
    axes = sub.subplots(len(METRICS), len(panel_names), sharex=True, sharey="row", squeeze=False)
    floor = _bias_floor(data)
    zero_all = exact_zero_bias(data)  # one scale for every row: the largest bias of the figure
    refs = [r for r in _claims.REFERENCES if (data.mapping == r).any()]
    for i, (metric, label, scale) in enumerate(METRICS):
        for j, panel in enumerate(panel_names):
            ax = axes[i, j]
            ax.set_xscale("log")
            ax.set_yscale(scale)
            members = list(dict.fromkeys(data.mapping[data.panel == panel]))
            for name in refs:
                if name not in members:
                    part = data[data.mapping == name].sort_values("chi2_tok")
                    _draw_series(
                        ax,
                        part,
                        name,
                        metric,
                        floor,
                        zero_all,
                        linestyle=":",
                        linewidth=0.9,
                        alpha=0.75,
                        label=f"{name} (reference)",
                    )
            for name in members:
                part = data[data.mapping == name].sort_values("chi2_tok")
                _draw_series(ax, part, name, metric, floor, zero_all, linewidth=1.1)
            if metric == "bias":
                last = j == len(panel_names) - 1
                _common.mark_floor(ax, floor, "0 (exactly unbiased)" if last else None, fontsize=6)
            if metric == "cosine":
                ax.set_ylim(min(-0.05, float(np.nanmin(data.cosine)) - 0.05), 1.05)
            if j == 0:
                ax.set_ylabel(label, fontsize=7.5)
            if i == 0:
                ax.set_title(panel, fontsize=8.5)
            if i == len(METRICS) - 1:
                ax.set_xlabel(r"$\chi^2(\pi\,\|\,\mu)$")
                ax.legend(
                    fontsize=5.2,
                    loc="upper center",
                    bbox_to_anchor=(0.5, -0.32),
                    handlelength=2.2,
                    ncol=2,
                    columnspacing=0.8,
                )
    n = int(data.n.iloc[0])
    arms = int(data.arms.iloc[0])
    sub.suptitle(
        f"Every mapping on a {arms}-armed Bernoulli bandit, n = {n} samples per gradient "
        "estimate, by family",
        fontsize=9.5,
    )
    return fig
