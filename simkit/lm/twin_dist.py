"""A distribution-matched twin of an LM's off-policy setting, fitted only from what a trainer logs.

Inputs (:class:`Rollouts`): N responses sampled from the behaviour μ with, per token, the
trainer's log π(y_t|…) and the rollout engine's log μ(y_t|…), the response mask and the
sequence rewards — the columns verl and TRL log (``old_log_probs``/``rollout_log_probs``,
``old_per_token_logps``/``sampling_per_token_logps``). No vocabulary, no gradients, no model.

The twin (:func:`replay_twin`) *replays* the logged sequences as the atoms of a finite
environment (:class:`simkit.lm.leaves.LeafEnv`):

- μ_twin(i) = 1/N (the empirical distribution of μ's draws); per-token log-ratios
  r_{i,t} = log π − log μ exactly as logged, shifted by the self-normalisation constant
  c_i = log(mean_j w_j)/|y_i| with w_i = exp(Σ_t r_{i,t}), so that π_twin(i) = w_i/Σ_j w_j
  (self-normalised importance sampling, Kong 1992) and the twin's sequence ratio is π_twin/μ_twin;
- rewards as logged (their association with *which* tokens carry the mismatch is kept, sequence
  by sequence: this is what clipping and masking react to and what the χ²-profile twin of
  :func:`simkit.lm.twin.simulation_twin` loses);
- per-token score vectors of a tabular policy over *mismatch atoms*: token t of sequence i
  falls in atom a = (segment g(t), bin of r_{i,t}, bin of log π(y_{i,t})) — G position
  segments, B quantile bins of the pooled log-ratios, B_p quantile bins of the pooled token
  log-probabilities (a softmax's score e_y − π is small for probable tokens and large for rare
  ones; this also keeps the scores alive when there is no mismatch) — and its score is
  S = e_a − π̂_g, with π̂_g the twin-π frequencies of the atoms of segment g (the score of a
  softmax over atoms, centred under π so E_π S = 0 per segment). D = G·B·B_p. Defaults
  G = 8, B = 4, B_p = 4 (B_p = 2 before 2026-12-06: four bins rank the π_old‖μ corrections
  of the token-MDP validation better and one SmolLM2 case worse — the numbers of both
  settings are on the diagnose page of the site, ``docs/diagnose.md`` §6, guarded by
  ``tests/test_diagnose_answer.py``). Values equal up to rounding are snapped together before
  binning (:func:`_snap`).

:func:`predict` runs :func:`simkit.experiment.run` on the twin (exact by enumeration of the N
atoms for per-sample mappings, Monte Carlo for batch-dependent ones) and returns each mapping's
bias, variance and MSE relative to naive; :func:`predict_with_intervals` adds percentile
bootstrap intervals over the logged sequences (refit on each resample).

Caveats (stated by ``simkit diagnose``): the twin's score vectors are a model (a softmax over
mismatch atoms), not the LM's gradients, so absolute bias and variance are not predicted, only
their ratios to naive; π_twin is a self-normalised IS estimate whose quality degrades with the
sequence χ² (ESS = N/(1 + χ²)); tokens μ never sampled are absent (support mismatch is
invisible in logs).

numpy only.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import experiment as _experiment
from simkit.lm.leaves import LeafEnv
from simkit.lm.scale_free import with_scale_free

METRICS = ("variance", "bias", "mse")
#: the scale-free columns :func:`predict_with_intervals` bounds (shares in [0, 1])
SCALE_FREE_BOUNDED = ("rel_mse_scaled", "kept", "kept_seq")


@dataclass(frozen=True)
class Rollouts:
    """Logged responses from μ: ``log_pi`` and ``log_mu`` (N, T) per-token log-probabilities
    (any value on padding), ``mask`` (N, T) bool, ``rewards`` (N,). Validated: shapes agree,
    at least 2 rows, every row has a token, log-probs finite and ≤ 0 on valid tokens (up to
    1e-6), rewards finite."""

    log_pi: np.ndarray
    log_mu: np.ndarray
    mask: np.ndarray
    rewards: np.ndarray

    def __post_init__(self):
        lp = np.asarray(self.log_pi, dtype=np.float64)
        lq = np.asarray(self.log_mu, dtype=np.float64)
        m = np.asarray(self.mask, dtype=bool)
        r = np.asarray(self.rewards, dtype=np.float64)
        if lp.ndim != 2 or lq.shape != lp.shape or m.shape != lp.shape:
            raise ValueError(
                f"log_pi, log_mu and mask must share a shape (N, T), got {lp.shape}, {lq.shape}, "
                f"{m.shape}"
            )
        if r.shape != (lp.shape[0],):
            raise ValueError(f"rewards must have shape ({lp.shape[0]},), got {r.shape}")
        if lp.shape[0] < 2:
            raise ValueError(f"need at least 2 responses, got {lp.shape[0]}")
        if not m.any(axis=1).all():
            raise ValueError(f"{int((~m.any(axis=1)).sum())} responses have no valid token")
        for name, x in (("log_pi", lp), ("log_mu", lq)):
            bad = ~np.isfinite(x) & m
            if bad.any():
                i, t = np.argwhere(bad)[0]
                raise ValueError(f"{name} is not finite at row {i}, token {t} ({bad.sum()} tokens)")
            if np.any(x[m] > 1e-6):
                raise ValueError(f"{name} has positive log-probabilities (max {x[m].max():.3g})")
        if not np.all(np.isfinite(r)):
            raise ValueError("rewards must be finite")
        object.__setattr__(self, "log_pi", np.where(m, lp, 0.0))
        object.__setattr__(self, "log_mu", np.where(m, lq, 0.0))
        object.__setattr__(self, "mask", m)
        object.__setattr__(self, "rewards", r)

    @property
    def log_ratio(self) -> np.ndarray:
        return self.log_pi - self.log_mu

    @property
    def N(self) -> int:
        return int(self.mask.shape[0])

    def take(self, rows) -> Rollouts:
        return Rollouts(self.log_pi[rows], self.log_mu[rows], self.mask[rows], self.rewards[rows])


def replay_twin(
    rollouts: Rollouts, bins: int = 4, segments: int = 8, prob_bins: int = 4
) -> LeafEnv:
    """The replay twin of the logged ``rollouts`` (module docstring): a LeafEnv with N atoms."""
    ro = rollouts
    if bins < 1 or segments < 1 or prob_bins < 1:
        raise ValueError(
            f"bins, segments and prob_bins must be >= 1, got {bins}, {segments}, {prob_bins}"
        )
    N, T = ro.mask.shape
    m = ro.mask
    r = np.where(m, ro.log_ratio, 0.0)
    lengths = m.sum(axis=1)
    logw = r.sum(axis=1)
    shift = logw.max()
    log_mean_w = shift + math.log(np.mean(np.exp(logw - shift)))
    r_tok = np.where(m, r - (log_mean_w / lengths)[:, None], 0.0)
    # atoms: segment × quantile bin of the pooled log-ratios
    G = min(segments, T)
    seg = np.minimum((np.arange(T) * G) // T, G - 1)
    b_r, B_r = _quantile_bins(r, m, bins)
    b_p, B_p = _quantile_bins(ro.log_pi, m, prob_bins)
    B = B_r * B_p
    atom = seg[None, :] * B + b_r * B_p + b_p
    pi_w = np.exp(logw - shift)
    pi_w = pi_w / pi_w.sum()
    counts = np.zeros(G * B)
    np.add.at(counts, atom[m], np.broadcast_to(pi_w[:, None], m.shape)[m])
    seg_tot = counts.reshape(G, B).sum(axis=1, keepdims=True)
    pi_hat = np.divide(counts.reshape(G, B), seg_tot, out=np.zeros((G, B)), where=seg_tot > 0)
    D = G * B
    scores = np.zeros((D + 1, D))
    for g in range(G):
        for bb in range(B):
            row = g * B + bb
            scores[row, g * B : (g + 1) * B] = -pi_hat[g]
            scores[row, row] += 1.0
    edges = np.where(m, atom, D)
    return LeafEnv(
        edges=edges.astype(np.int64),
        mask=m,
        log_pi_tok=r_tok,
        log_mu_tok=np.zeros((N, T)),
        weight=np.full(N, 1.0 / N),
        rewards=ro.rewards,
        scores=scores,
        node_weight_mu=np.ones(1),
        node_divergences={k: np.zeros(1) for k in ("chi2", "kl", "tv")},
    )


#: values of a binned quantity closer than this (× max(1, |x|)) are one value (:func:`_snap`)
SNAP_TOL = 1e-6


def _snap(x, mask, tol: float = SNAP_TOL) -> np.ndarray:
    """``x`` with each run of valid values whose sorted neighbours are within
    ``tol``·max(1, |x|) replaced by the run's smallest value (padding untouched).

    Logged log-probabilities of a discrete support repeat: every token drawn at the same
    (state, action) has the same log π − log μ up to rounding. A quantile edge then falls on
    such a value, and whether a token lands below or above it depends on the last bit of its
    logged float (float32 logging, another CPU's ``log``): one ulp moved whole groups of tokens
    between atoms and Spearman ρ of the validation from 0.71 to −0.12. Snapping makes equal
    values bitwise equal before the edges are taken, so the binning is a function of the
    values, not of their rounding."""
    v = x[mask]
    if v.size == 0:
        return x
    order = np.argsort(v, kind="stable")
    vs = v[order]
    gap = np.diff(vs) > tol * np.maximum(1.0, np.abs(vs[1:]))
    starts = np.r_[True, gap]
    rep = np.empty_like(v)
    rep[order] = vs[np.maximum.accumulate(np.where(starts, np.arange(vs.size), 0))]
    out = np.array(x, dtype=np.float64, copy=True)
    out[mask] = rep
    return out


def _quantile_bins(x, mask, bins: int):
    """Bin index of every value of ``x`` (N, T) by the pooled quantiles of its valid entries
    (values equal up to :data:`SNAP_TOL` are one value, :func:`_snap`), and the number of bins
    (ties merge bins)."""
    if bins <= 1:
        return np.zeros(x.shape, dtype=np.int64), 1
    x = _snap(x, mask)
    edges = np.unique(np.quantile(x[mask], np.linspace(0, 1, bins + 1)[1:-1]))
    return np.searchsorted(edges, x, side="right"), len(edges) + 1


def relative(table: pd.DataFrame, reference: str = "naive") -> pd.DataFrame:
    """``rel_<m>`` = metric / the reference mapping's (m in variance, bias, mse), per estimator."""
    base = table[table["mapping"] == reference]
    if base.empty:
        raise ValueError(f"the table has no {reference!r} row to normalise by")
    base = base.iloc[0]
    out = table[["estimator", "mapping"]].copy()
    for key in METRICS:
        d = float(base[key])
        out[f"rel_{key}"] = table[key].to_numpy() / d if d > 0 else math.nan
    return out.reset_index(drop=True)


def predict(
    rollouts: Rollouts,
    estimators,
    n: int,
    *,
    reps: int = 200,
    seed: int = 0,
    bins: int = 4,
    segments: int = 8,
    prob_bins: int = 4,
) -> pd.DataFrame:
    """Each estimator's bias / variance / MSE on the replay twin (:func:`simkit.experiment.run`
    table) with ``rel_<m>`` columns (relative to naive, which must be among the estimators),
    and the scale-free columns (:func:`simkit.lm.scale_free.with_scale_free`): the twin's
    ``rel_mse_scaled`` is already scale-free (its own ‖∇J‖² the unit), so it is a prediction
    in itself, not a ratio to naive; ``kept``, ``kept_seq`` the shares the mapping keeps of the
    logged tokens and sequences (the twin's atoms are the logged sequences)."""
    env = replay_twin(rollouts, bins=bins, segments=segments, prob_bins=prob_bins)
    table = _experiment.run(
        env, "mu", estimators, n=n, reps=reps, seed=seed, n_boot=50, progress=False
    )
    table = with_scale_free(table, env, "mu", estimators, n)
    rel = relative(table)
    return table.assign(**{c: rel[c].to_numpy() for c in rel.columns if c.startswith("rel_")})


def predict_with_intervals(
    rollouts: Rollouts,
    estimators,
    n: int,
    *,
    n_boot: int = 20,
    level: float = 0.9,
    reps: int = 100,
    seed: int = 0,
    bins: int = 4,
    segments: int = 8,
    prob_bins: int = 4,
) -> pd.DataFrame:
    """:func:`predict` plus ``rel_<m>_lo``/``_hi``: intervals at ``level`` from ``n_boot``
    bootstrap resamples of the logged sequences (the twin refitted on each): the spread of the
    refits around their median, [q_tail − q_50, q_{1−tail} − q_50], placed around the point
    prediction (a resample repeats sequences, which shifts the refitted twin; the shift is not
    carried into the interval). Lower bounds are clipped at 0. The same intervals for the
    twin's ``rel_mse_scaled``, ``kept`` and ``kept_seq`` (:data:`SCALE_FREE_BOUNDED`; upper
    bounds clipped at 1)."""
    kw = dict(reps=reps, seed=seed, bins=bins, segments=segments, prob_bins=prob_bins)
    point = predict(rollouts, estimators, n, **kw)
    rng = np.random.default_rng(seed)
    columns = [f"rel_{k}" for k in METRICS] + list(SCALE_FREE_BOUNDED)
    boots = {c: [] for c in columns}
    for _ in range(n_boot):
        rows = rng.integers(0, rollouts.N, size=rollouts.N)
        b = predict(rollouts.take(rows), estimators, n, **kw)  # the same twin, refitted
        for c in columns:
            boots[c].append(b[c].to_numpy(dtype=np.float64))
    tail = (1.0 - level) / 2.0
    for c in columns:
        arr = np.array(boots[c])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (0/0 bias)
            lo, med, hi = np.nanquantile(arr, [tail, 0.5, 1.0 - tail], axis=0)
        v = point[c].to_numpy(dtype=np.float64)
        low, high = np.maximum(v - (med - lo), 0.0), v + (hi - med)
        if c in SCALE_FREE_BOUNDED:  # shares: [0, 1]
            high = np.minimum(high, 1.0)
        point[f"{c}_lo"], point[f"{c}_hi"] = low, high
    return point
