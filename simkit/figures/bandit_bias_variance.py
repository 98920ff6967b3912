"""Bias, MSE, scale-free error and kept fraction of every mapping on a bandit, against χ²(π‖μ).

A K-armed Bernoulli bandit (seeded logits and reward means), the behaviour μ dialed by
:func:`simkit.shifts.dial` to each χ²(π‖μ) of a grid from 1e-4 (what trainers log per token)
to 10, batches of n = 64 and n = 1024 samples, oracle advantages A = R − J(μ), the mapping's
default hyperparameters and the ``seq-mean-token-sum`` aggregation (Z = n on the bandit: T = 1,
so every aggregation coincides). Per-sample mappings are exact (:func:`simkit.experiment.run`'s
exact path); batch-dependent ones (snis, psis, m2po) are Monte Carlo with bootstrap confidence
bounds, drawn as error bars.

MSE = bias² + variance rewards an estimator that shrinks: ĝ ≡ 0 has MSE ‖∇J‖² (drawn as a
grey line in the MSE row). The ranking metric is ``rel_mse_scaled`` = min_α E‖αĝ − ∇J‖² /
‖∇J‖² (the error after the best step size, relative to ĝ ≡ 0; 1 = no better than doing
nothing; :func:`simkit.experiment.metrics.scale_free`), drawn for both n; ``kept`` (the
μ-probability that a draw's coefficient is non-zero) shows what masks and rejection samplers
drop.

Rankings are not read off this one bandit: :func:`ensemble_table` repeats the per-sample
mappings (exact) on ``instances`` random bandits (:func:`simkit.envs.random_instances.
random_bandit`, logits N(0, 1), means U(0.05, 0.95)) with a random ``logit_noise`` direction at
each χ² of ``ensemble_chi2`` and each n, and the notes state, per (χ², n), the mapping of
lowest median ``rel_mse_scaled``, the fraction of instances where it is the best of all and
where it beats the runner-up (ties: within 0.1 %), and where the leader changes
(:mod:`simkit.figures._rankings`).

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

Data: the tidy DataFrame of :func:`simkit.experiment.run`, one row per (mapping, χ² target, n),
with the scale-free columns (:func:`simkit.figures._rankings.with_scale_free`), the extra
columns ``target_chi2``, ``arms``, ``family`` (the mapping's colour family), ``panel``,
``zero_fraction``, ``kept_exact`` (1 − zero_fraction) and ``outside_clip_range``
(:func:`zero_fractions`); ``data.attrs["ensemble"]`` (:func:`ensemble_table`) and
``data.attrs["notes"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment, legs, mappings, shifts
from simkit.envs import Bandit
from simkit.envs.random_instances import bandit_factory, behaviour_factory
from simkit.experiment.ensemble import ensemble
from simkit.figures import _claims, _common, _rankings, style
from simkit.figures.staleness_curves import split_figure

NAME = "bandit_bias_variance"
TITLE = "Bias, MSE, scale-free error and kept fraction vs χ² on a bandit"
CAPTION = (
    "every mapping of the catalogue (default hyperparameters, oracle advantage A = R − J(μ)) "
    "on a Bernoulli bandit whose behaviour μ is dialed to a grid of χ²(π‖μ) from 1e-4 to 10, "
    "n = 64 and 1024 samples per estimate; exact for per-sample mappings, Monte Carlo with "
    "95 % bootstrap bounds for batch-dependent ones; rows: bias, MSE with the ĝ ≡ 0 line "
    "‖∇J‖², the scale-free error rel_mse_scaled (error after the best step size, relative "
    "to ĝ ≡ 0) at both n, and the kept fraction; small multiples by family with naive and "
    "sequence IS as references. The notes give, from the data, the exactly unbiased mappings, "
    "GSPO's clip fraction, and the rankings by rel_mse_scaled over an ensemble of random "
    "bandits, with the fraction of instances that supports each."
)

#: a bias at most this fraction of the largest bias (exact rows) is an exact 0 in floating point
ZERO_BIAS_RTOL = 1e-9


@dataclass(frozen=True)
class Config:
    """Bandit, mismatch grid and estimator settings."""

    arms: int = 16
    ns: tuple[int, ...] = (64, 1024)
    chi2_min: float = 1e-4
    chi2_max: float = 10.0
    n_chi2: int = 11
    shift_family: str = "logit_noise"
    reps: int = 400
    n_boot: int = 400
    seed: int = 0
    mapping_names: tuple[str, ...] | None = None  # None: _common.figure_mappings()
    instances: int = 20  # random bandits of the ensemble behind the rankings (0: none)
    ensemble_chi2: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)

    def __post_init__(self):
        if self.arms < 2:
            raise ValueError(f"arms must be >= 2, got {self.arms}")
        if not self.ns or any(not isinstance(n, int) or n < 1 for n in self.ns):
            raise ValueError(f"ns must be batch sizes >= 1, got {self.ns}")
        if len(set(self.ns)) != len(self.ns):
            raise ValueError(f"ns must be distinct, got {self.ns}")
        if not isinstance(self.instances, int) or self.instances < 0:
            raise ValueError(f"instances must be an integer >= 0, got {self.instances!r}")
        if any(not c > 0 for c in self.ensemble_chi2):
            raise ValueError(f"ensemble_chi2 must be positive, got {self.ensemble_chi2}")
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
        return Config(
            arms=8,
            ns=(16, 256),
            n_chi2=4,
            chi2_min=1e-3,
            chi2_max=3.0,
            reps=40,
            n_boot=50,
            ensemble_chi2=(1e-3, 1.0),
        )
    return Config()


def make_bandit(arms: int, seed: int) -> Bandit:
    """The figure's bandit: logits ~ N(0, 1), Bernoulli means ~ U(0.05, 0.95), from ``seed``."""
    rng = np.random.default_rng(seed)
    return Bandit(logits=rng.normal(0.0, 1.0, arms), means=rng.uniform(0.05, 0.95, arms))


def compute(cfg: Config) -> pd.DataFrame:
    env = make_bandit(cfg.arms, cfg.seed)
    ests = _common.oracle_estimators(_common.chosen_mappings(cfg.mapping_names))
    mse_zero = float(env.grad_J() @ env.grad_J())
    frames = []
    for target in cfg.chi2_grid:
        mu = shifts.dial(env.pi, float(target), divergence="chi2", family=cfg.shift_family)
        zero, outside = zero_fractions(env, mu, ests)
        for n in cfg.ns:
            frame = experiment.run(
                env,
                mu,
                ests,
                n=n,
                reps=cfg.reps,
                seed=cfg.seed,
                n_boot=cfg.n_boot,
                progress=False,
                setting={"target_chi2": float(target)},
            )
            frame["zero_fraction"] = frame.mapping.map(zero).astype(float)
            frame["outside_clip_range"] = frame.mapping.map(outside).astype(float)
            frames.append(frame)
    data = _rankings.with_scale_free(pd.concat(frames, ignore_index=True), mse_zero)
    data["kept_exact"] = 1.0 - data.zero_fraction  # T = 1: kept = kept_seq = P_μ(c ≠ 0)
    data["family"] = [style.family(m) for m in data.mapping]
    data["arms"] = cfg.arms
    data["shift_family"] = cfg.shift_family
    data["panel"] = [_claims.panel_of(m) for m in data.mapping]
    data.attrs["ensemble"] = ensemble_table(cfg)
    data.attrs["notes"] = notes(data)
    return data


#: the columns of the ensemble table kept in ``data.attrs["ensemble"]``
ENSEMBLE_COLUMNS = (
    "instance",
    "estimator",
    "mapping",
    "target_chi2",
    "n",
    "chi2_tok",
    "bias",
    "variance",
    "mse",
    "mse_zero",
    "rel_mse_scaled",
    "kept",
    "cosine",
)


def ensemble_table(cfg: Config) -> pd.DataFrame:
    """The per-sample (exact) mappings of ``cfg`` on ``cfg.instances`` random bandits
    (:func:`~simkit.envs.random_instances.random_bandit` with ``cfg.arms`` arms), μ =
    ``cfg.shift_family`` with a random direction dialed to each χ² of ``cfg.ensemble_chi2``,
    at each n of ``cfg.ns``. The same ensemble seed at every (χ², n): the same bandits and
    directions, so a change of ranking along χ² or n is measured on the same instances.
    Columns :data:`ENSEMBLE_COLUMNS`; empty when ``cfg.instances`` is 0."""
    names = [
        m
        for m in _common.chosen_mappings(cfg.mapping_names)
        if not mappings.mapping_class(m).batch_dependent
    ]
    if not cfg.instances or not names:
        return pd.DataFrame(columns=list(ENSEMBLE_COLUMNS))
    ests = _common.oracle_estimators(names)
    make_env = bandit_factory(cfg.arms)
    frames = []
    for target in cfg.ensemble_chi2:
        make_mu = behaviour_factory(float(target), "chi2", cfg.shift_family)
        for n in cfg.ns:
            table = ensemble(
                make_env,
                make_mu,
                ests,
                n,
                instances=cfg.instances,
                seed=cfg.seed,
                reps=2,
                exact=True,
                progress=False,
                setting={"target_chi2": float(target)},
            )
            frames.append(table)
    table = pd.concat(frames, ignore_index=True)
    return table[list(ENSEMBLE_COLUMNS)].reset_index(drop=True)


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
            kw = {"log_prob": legs.log_prob_for(est, env, support)} if m.requires_log_prob else {}
            c = m.coefficients(support.log_ratio, support.mask, support.advantage_sign, **kw)
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


def _chi2_text(value: float) -> str:
    return f"{value:.0e}".replace("e-0", "e-").replace("e+00", "") if value < 0.01 else f"{value:g}"


def notes(data: pd.DataFrame) -> tuple[str, ...]:
    """Sentences under the figure, built from ``data`` (and ``data.attrs["ensemble"]``)."""
    ns = sorted(int(n) for n in data.n.unique())
    one = data[data.n == ns[0]]  # the n-independent statements (bias, kept, clip fraction)
    row = data.iloc[0]
    zero_mse = float(data.mse_zero.iloc[0])
    lines = [
        f"Setting: {int(row.arms)}-armed Bernoulli bandit (seeded), μ = {row.shift_family} "
        f"shift of π dialed to χ²(π‖μ) from {data.chi2_tok.min():.3g} to "
        f"{data.chi2_tok.max():.3g} ({data.target_chi2.nunique()} points); n = "
        f"{' and '.join(map(str, ns))} draws per estimate, advantage "
        f"{_claims.advantage_text(row.advantage)}, default hyperparameters; exact rows "
        "for per-sample mappings, Monte Carlo (95 % bootstrap bounds) for batch-dependent ones."
    ]
    lo_chi, hi_chi = data.target_chi2.min(), data.target_chi2.max()
    parts = []
    for n in ns:
        at = data[data.n == n]
        counts = [int((at[at.target_chi2 == c].mse > zero_mse).sum()) for c in (lo_chi, hi_chi)]
        parts.append(
            f"n = {n}: {counts[0]} of {at.mapping.nunique()} mappings at χ² = "
            f"{_chi2_text(lo_chi)}, {counts[1]} at χ² = {_chi2_text(hi_chi)}"
        )
    lines.append(
        f"ĝ ≡ 0 has MSE ‖∇J‖² = {_claims.fmt(zero_mse)} (grey line); a larger MSE: "
        + "; ".join(parts)
        + ". MSE rewards shrinking, so the rankings use rel_mse_scaled (the error after the "
        "best step size over ‖∇J‖²; 1 = no better than ĝ ≡ 0)."
    )
    zero = exact_zero_bias(one)
    by_name = zero.groupby(one.mapping, sort=False)
    always = [n for n, z in by_name if z.all()]
    some = [n for n, z in by_name if z.any() and not z.all()]
    text = f"Exactly unbiased at every χ² of the grid: {_claims.name_list(always)}"
    if some:
        parts = []
        for n in some:
            chi = one.chi2_tok[(one.mapping == n) & zero]
            parts.append(f"{n} (χ² ≤ {chi.max():.3g})" if len(chi) else n)
        text += f"; at some χ² only: {', '.join(parts)}"
    lines.append(text + " (drawn as markers on the floor line).")
    if "reliable" in data:
        flags = data.reliable[~data.exact.astype(bool)]
        bad = int((flags.notna() & (flags == False)).sum())  # noqa: E712 (object column)
        if bad:
            lines.append(f"{bad} Monte Carlo rows: {_common.UNRELIABLE_NOTE}.")
    lines.extend(_kept_note(one))
    gspo = one[one.mapping == "gspo"]
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
    lines.extend(ensemble_notes(data.attrs.get("ensemble"), int(row.arms)))
    return tuple(lines)


#: a mapping "drops data" in the notes when it keeps less than this share of μ's draws somewhere
KEPT_NOTE_BELOW = 0.99


def _kept(part: pd.DataFrame) -> np.ndarray:
    """The kept fraction of the rows: run's ``kept`` where finite, else ``kept_exact``."""
    exact = part.kept_exact.to_numpy(float)
    if "kept" not in part:
        return exact
    reported = part.kept.to_numpy(float)
    return np.where(np.isfinite(reported), reported, exact)


def _kept_note(one: pd.DataFrame) -> list[str]:
    parts = []
    for name, part in one.groupby("mapping", sort=False):
        kept = _kept(part)
        kept = kept[np.isfinite(kept)]
        if len(kept) and kept.min() < KEPT_NOTE_BELOW:
            parts.append(f"{name} {_span(float(kept.min()), float(kept.max()), '.0%')}")
    if not parts:
        return [f"Every mapping keeps at least {KEPT_NOTE_BELOW:.0%} of μ's draws (c ≠ 0)."]
    return [
        "Kept fraction P_μ(c ≠ 0) below "
        f"{KEPT_NOTE_BELOW:.0%} somewhere on the grid (min–max over χ²): " + ", ".join(parts) + "."
    ]


def ensemble_notes(ens: pd.DataFrame | None, arms: int) -> list[str]:
    """The ranking sentences, from the ensemble table (:func:`ensemble_table`): per n, where
    the leader by median rel_mse_scaled changes along χ², and per (χ², n) the leader with the
    fractions of instances where it is best of all and beats the runner-up; and how many
    mappings ĝ ≡ 0 beats by MSE in at least half of the instances. Fewer than
    :data:`~simkit.figures._rankings.MIN_INSTANCES` instances: no ranking is stated."""
    if ens is None or not len(ens):
        return ["Rankings: none stated (no ensemble was computed)."]
    m = int(ens.instance.nunique())
    if m < _rankings.MIN_INSTANCES:
        return [
            f"Rankings: none stated (an ensemble of {m} < {_rankings.MIN_INSTANCES} instances)."
        ]
    lead = _rankings.leaders(ens, "rel_mse_scaled", ("target_chi2", "n"))
    lines = [
        f"Rankings by rel_mse_scaled over {m} random {arms}-armed bandits (logits N(0, 1), "
        "means U(0.05, 0.95), random logit_noise direction; the "
        f"{ens.mapping.nunique()} per-sample mappings, exact; ties within "
        f"{_rankings.TIE_RTOL:.1%}). Lowest median, by n:"
    ]
    for n, part in lead.groupby("n", sort=True):
        details = "; ".join(
            _rankings.leader_sentence(r, f"χ² = {_chi2_text(r.target_chi2)}")
            for _, r in part.sort_values("target_chi2").iterrows()
        )
        change = _rankings.leader_changes(part, "target_chi2", _chi2_text)
        lines.append(f"n = {int(n)}, leader along χ²: {change}. {details}.")
    flips = [c for c, part in lead.groupby("target_chi2", sort=True) if part.leader.nunique() > 1]
    lines.append(
        "The leader depends on n at χ² = " + ", ".join(_chi2_text(c) for c in flips) + "."
        if flips
        else "The leader is the same at every n for each χ²."
    )
    beaten = _rankings.zero_beats(ens)
    beaten["half"] = beaten.zero_wins >= beaten.instances / 2
    counts = beaten.groupby(["n", "target_chi2"], sort=True).half.sum()
    total = ens.mapping.nunique()
    pieces = [
        f"n = {int(n)}: "
        + ", ".join(
            f"{int(counts[(n, c)])}/{total} at χ² = {_chi2_text(c)}"
            for c in sorted(ens.target_chi2.unique())
        )
        for n in sorted(ens.n.unique())
    ]
    lines.append(
        "By MSE, ĝ ≡ 0 beats this many mappings in at least half of the instances — "
        + "; ".join(pieces)
        + "."
    )
    return lines


METRICS = (
    ("bias", "first", r"bias $\|\mathbb{E}\hat g - \nabla J\|$", "log"),
    ("mse", "first", r"MSE $\mathbb{E}\|\hat g - \nabla J\|^2$", "log"),
    ("rel_mse_scaled", "first", r"rel_mse_scaled", "log"),
    ("rel_mse_scaled", "last", r"rel_mse_scaled", "log"),
    ("kept", "first", r"kept $P_\mu(c \neq 0)$", "linear"),
)


def _bias_floor(data: pd.DataFrame) -> float:
    positive = data.bias[~exact_zero_bias(data) & (data.bias > 0)]
    return 10 ** np.floor(np.log10(positive.min() / 3)) if len(positive) else 1e-6


def _draw_series(ax, part: pd.DataFrame, name: str, metric: str, floor: float, zero_all, **kw):
    """One mapping's curve on one panel: exact zeros (bias) as filled markers on the floor,
    never joined by a segment; Monte Carlo rows with their bootstrap bounds where they have
    them."""
    x = part.chi2_tok.to_numpy()
    y = _kept(part) if metric == "kept" else part[metric].to_numpy(dtype=float)
    zero = zero_all.loc[part.index].to_numpy() if metric == "bias" else np.zeros(len(y), bool)
    line = np.where(zero, np.nan, y)
    if metric == "bias":
        line = np.where(line <= floor, np.nan, line)
    kw = {**style.line_kwargs(name), "markersize": 2.6, "marker": style.marker(name), **kw}
    bounded = metric != "kept" and f"{metric}_lo" in part
    lo = part[f"{metric}_lo"].to_numpy(dtype=float) if bounded else None
    hi = part[f"{metric}_hi"].to_numpy(dtype=float) if bounded else None
    if bounded and not part.exact.all() and np.isfinite(lo).any():
        if ax.get_yscale() == "log":
            lo = np.maximum(lo, floor if metric == "bias" else y * 1e-3)
        ax.errorbar(
            x,
            line,
            yerr=[np.nan_to_num(np.maximum(line - lo, 0)), np.nan_to_num(np.maximum(hi - line, 0))],
            capsize=1.2,
            elinewidth=0.6,
            **kw,
        )
    else:
        ax.plot(x, line, **kw)
    if not part.exact.all() and "reliable" in part:
        _common.mark_unreliable(
            ax,
            x,
            line,
            part.reliable.to_numpy(),
            color=style.color(name),
            marker=style.marker(name),
        )
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
    ns = sorted(int(n) for n in data.n.unique())
    fig, sub = split_figure(7.6, 10.4, data.attrs.get("notes", ()))
    axes = sub.subplots(len(METRICS), len(panel_names), sharex=True, sharey="row", squeeze=False)
    first = data[data.n == ns[0]]
    floor = _bias_floor(first)
    zero_all = exact_zero_bias(data)  # one scale for every row: the largest bias of the figure
    refs = [r for r in _claims.REFERENCES if (data.mapping == r).any()]
    mse_zero = float(data.mse_zero.iloc[0])
    for i, (metric, which, label, scale) in enumerate(METRICS):
        n = ns[0] if which == "first" else ns[-1]
        rows = data[data.n == n]
        for j, panel in enumerate(panel_names):
            ax = axes[i, j]
            ax.set_xscale("log")
            ax.set_yscale(scale)
            members = list(dict.fromkeys(rows.mapping[rows.panel == panel]))
            for name in refs:
                if name not in members:
                    part = rows[rows.mapping == name].sort_values("chi2_tok")
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
                part = rows[rows.mapping == name].sort_values("chi2_tok")
                _draw_series(ax, part, name, metric, floor, zero_all, linewidth=1.1)
            last = j == len(panel_names) - 1
            if metric == "bias":
                _common.mark_floor(ax, floor, "0 (exactly unbiased)" if last else None, fontsize=6)
            if metric == "mse":
                ax.axhline(mse_zero, color="0.45", linewidth=1.0, zorder=0)
                if last:
                    ax.annotate(
                        "ĝ ≡ 0: ‖∇J‖²",
                        (1.0, mse_zero),
                        xycoords=("axes fraction", "data"),
                        xytext=(-2, 2),
                        textcoords="offset points",
                        ha="right",
                        va="bottom",
                        fontsize=6,
                        color="0.35",
                    )
            if metric == "rel_mse_scaled":
                ax.axhline(1.0, color="0.45", linewidth=0.8, linestyle="--", zorder=0)
            if metric == "kept":
                ax.set_ylim(-0.05, 1.05)
            if j == 0:
                ax.set_ylabel(f"{label}\nn = {n}" if metric != "bias" else label, fontsize=7.5)
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
    arms = int(data.arms.iloc[0])
    sub.suptitle(
        f"Every mapping on a {arms}-armed Bernoulli bandit, n = {' and '.join(map(str, ns))}, "
        "by family",
        fontsize=9.5,
    )
    return fig
