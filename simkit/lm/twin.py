"""The simulation twin of a gradient study, and the comparison of the two.

**The comparison** (:func:`simulation_twin`, :func:`predict`, :func:`compare`,
:func:`rank_agreement`). A state-independent token MDP (:meth:`simkit.envs.TokenMDP.iid`) with the
LM's response length T, its length distribution (an EOS with the LM's per-position stopping
hazard) and reward rate J, whose behaviour at position t is dialled (:func:`simkit.shifts.dial`)
to the LM's measured χ²(π_t‖μ_t) at that position, predicts each mapping's bias and variance
*relative to naive* (no correction) on the same setting; the measured relative numbers are
compared with the predicted ones (Spearman rank correlation with a bootstrap interval over
mappings). The ``lm_vs_sim`` figure (:mod:`simkit.figures.lm_vs_sim`) reports the outcome.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkit import experiment as _experiment
from simkit import shifts
from simkit._validation import int_at_least
from simkit.envs import TokenMDP

# --- comparison with the simulation ----------------------------------------------------------


def hazards_from_running(running) -> np.ndarray:
    """Per-position stopping probabilities h_t = P(length = t + 1 | length > t) from the
    fraction of responses still running at each position (``running`` (T,), running[0] = 1,
    non-increasing): h_t = 1 − running[t+1]/running[t] for t < T − 1; the last position (whose
    stop is not observed: responses are cut at T) repeats h_{T−2}. Positions no response
    reaches get h = 1. Clipped to [0, 1 − 1e-6] (a twin needs some mass on every token)."""
    r = np.asarray(running, dtype=np.float64)
    if r.ndim != 1 or r.size < 1 or not np.all(np.isfinite(r)) or np.any((r < 0) | (r > 1)):
        raise ValueError(f"running must be a non-empty 1-d array of fractions in [0, 1], got {r!r}")
    if r[0] <= 0 or np.any(np.diff(r) > 1e-12):
        raise ValueError("running must start > 0 and be non-increasing (fractions still running)")
    T = r.size
    h = np.ones(T)
    with np.errstate(invalid="ignore", divide="ignore"):
        h[:-1] = np.where(r[:-1] > 0, 1.0 - r[1:] / r[:-1], 1.0)
    h[-1] = h[-2] if T > 1 else 0.0
    return np.clip(h, 0.0, 1.0 - 1e-6)


def simulation_twin(
    chi2_profile,
    J: float,
    V: int = 2,
    shift_family: str = "logit_noise",
    running=None,
) -> tuple[TokenMDP, np.ndarray]:
    """A token MDP with the LM's length distribution, reward rate and per-position χ² profile.

    :meth:`simkit.envs.TokenMDP.iid` with T = len(``chi2_profile``) positions and reward
    R = 1{the answer token (0) appears}. Without ``running`` (or when every response runs to
    T) the length is T and the V tokens are: the answer with π(answer) = a at every position,
    1 − (1 − a)^T = J, and V − 1 others sharing 1 − a. With a ``running`` profile (the fraction
    of the LM's responses still running at each position, :attr:`StudyResult.profile`) token
    V − 1 is an EOS with π_t(EOS) = h_t (:func:`hazards_from_running`), so the twin's lengths
    follow the LM's; the answer has π_t(answer) = a·(1 − h_t) with a solved (``brentq``) so
    that J(π) = ``J``; V ≥ 3 then. μ_t = ``shifts.dial(π_t, χ²_t, "chi2",
    family=shift_family)``, so χ²(π_t‖μ_t) equals the LM's χ² at position t (positions without
    tokens, NaN in the profile, get μ_t = π_t); with an EOS, μ_t keeps π_t's EOS probability
    h_t (so μ's lengths, which the LM's profile measured, are the twin's too) and the
    continuation given "no EOS" is dialled to χ²_t/(1 − h_t), which gives χ²(π_t‖μ_t) = χ²_t.
    J must be in (0, 1) (a reward that never or always fires carries no gradient). Returns
    ``(env, mu)`` with mu (T, 1, V).

    V matters: with several "other" tokens the dialled μ can reshuffle mass among them, as an
    LM's mismatch mostly moves mass among reward-irrelevant tokens; with a single other token
    the only way to reach χ²_t is to move the answer's own probability, which changes the
    reward under μ (measured once on SmolLM2-135M-Instruct by the Monte Carlo comparison now
    in ``simkit lm compare``: 8 keyword questions, ≤ 12 tokens, 32 batches of 8 at τ = 1.3 and
    0.8, seeds 0 and 1 — the variance-rank agreement dropped from Spearman ρ = 0.83 / 0.75
    with V = 4 to 0.61 / 0.34 with V = 3; not re-measured by a test).

    The LM's profile and lengths are measured under μ (its responses); the twin uses them for
    π, an approximation of order the mismatch itself.
    """
    chi2 = np.asarray(chi2_profile, dtype=np.float64)
    if chi2.ndim != 1 or chi2.size < 1 or np.any(chi2[np.isfinite(chi2)] < 0):
        raise ValueError(f"chi2_profile must be a non-empty 1-d array of values >= 0, got {chi2!r}")
    if np.any(np.isinf(chi2)):
        raise ValueError(
            "chi2_profile has infinite values (μ misses tokens π emits, e.g. top-p): no twin "
            "μ can reach them; compare a behaviour with finite χ²"
        )
    chi2 = np.where(np.isnan(chi2), 0.0, chi2)
    if not 0 < J < 1:
        raise ValueError(f"J must be in (0, 1) to carry a gradient, got {J}")
    V = int_at_least(V, "V", 2)
    T = chi2.size
    h = None
    if running is not None:
        h = hazards_from_running(running)
        if h.shape != (T,):
            raise ValueError(f"running must have the length of chi2_profile ({T}), got {h.size}")
        if np.all(h[:-1] == 0):
            h = None  # every response runs to T: fixed length
    if h is None:
        a = -math.expm1(math.log1p(-J) / T)
        row = np.full(V, (1.0 - a) / (V - 1))
        row[0] = a
        logits = np.broadcast_to(np.log(row), (T, 1, V)).copy()
        env = TokenMDP.iid(V=V, T=T, answer=0, logits=logits)
    else:
        if V < 3:
            raise ValueError(
                f"a twin with variable length needs V >= 3 (answer, other, EOS), got {V}"
            )
        from scipy.optimize import brentq

        h = np.clip(h, 1e-9, None)  # finite logits: EOS is possible, if very rarely

        def build(a):
            rows = np.empty((T, 1, V))
            rows[:, 0, 0] = a * (1.0 - h)
            rows[:, 0, 1:-1] = ((1.0 - a) * (1.0 - h) / (V - 2))[:, None]
            rows[:, 0, -1] = h
            return TokenMDP.iid(V=V, T=T, answer=0, eos=V - 1, logits=np.log(rows))

        top = build(1.0 - 1e-12).J()
        if J >= top:
            raise ValueError(
                f"J = {J} is not reachable with this length profile (at most {top:.4g}: the "
                "answer must come before the first EOS)"
            )
        a = brentq(lambda x: build(x).J() - J, 1e-12, 1.0 - 1e-12, xtol=1e-14, rtol=1e-12)
        env = build(a)
    pi = env.pi[:, 0, :]
    mu = pi.copy()
    moved = chi2 > 0
    if moved.any() and env.eos is None:
        mu[moved] = shifts.dial(pi[moved], chi2[moved], "chi2", family=shift_family)
    elif moved.any():
        # μ keeps π's EOS hazard (the measured lengths are μ's) and moves the continuation:
        # χ²(π_t‖μ_t) = (1 − h_t)·χ²(π'_t‖μ'_t) for the conditionals π', μ' given "no EOS"
        stay = 1.0 - pi[moved, -1]
        cont = pi[moved, :-1] / stay[:, None]
        dialled = shifts.dial(cont, chi2[moved] / stay, "chi2", family=shift_family)
        mu[moved, :-1] = dialled * stay[:, None]
    return env, mu[:, None, :]


def predict(
    env: TokenMDP,
    mu,
    estimators,
    n: int,
    reps: int = 400,
    seed: int = 0,
    n_boot: int = 200,
) -> pd.DataFrame:
    """Each estimator's bias/variance on the simulation twin (:func:`simkit.experiment.run`,
    exact where the support is enumerable, Monte Carlo otherwise), with the scale-free columns
    (:func:`simkit.lm.scale_free.with_scale_free`: ``rel_mse_scaled``, ``kept``, … exact on
    exact rows)."""
    from simkit.lm.scale_free import with_scale_free

    table = _experiment.run(
        env, mu, estimators, n=n, reps=reps, seed=seed, n_boot=n_boot, progress=False
    )
    return with_scale_free(table, env, mu, estimators, n)


def relative_metrics(table: pd.DataFrame, reference: str = "naive") -> pd.DataFrame:
    """``rel_variance`` = variance / variance of the ``reference`` row (by ``mapping``),
    ``rel_bias`` = bias / bias of the reference, ``rel_mse`` likewise; one row per estimator."""
    if reference not in set(table["mapping"]):
        raise ValueError(f"the table has no {reference!r} row to normalise by")
    base = table[table["mapping"] == reference].iloc[0]
    out = table[["estimator", "mapping"]].copy()
    for key in ("variance", "bias", "mse"):
        denom = float(base[key])
        out[f"rel_{key}"] = table[key] / denom if denom > 0 else math.nan
    return out


def rank_agreement(measured, predicted, n_boot: int = 1000, level: float = 0.95, seed: int = 0):
    """Spearman rank correlation of ``measured`` vs ``predicted`` with a bootstrap interval.

    Pairs with a non-finite value are dropped. The interval is the percentile bootstrap over
    pairs (mappings) resampled with replacement (Efron & Tibshirani 1993, ch. 13). Returns
    ``(rho, lo, hi, k)`` with k the number of pairs used (NaNs when k < 3).
    """
    from scipy.stats import rankdata

    x = np.asarray(measured, dtype=np.float64)
    y = np.asarray(predicted, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(
            f"measured and predicted must be 1-d of equal length, got {x.shape}, {y.shape}"
        )
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    k = int(ok.sum())
    if k < 3:
        return math.nan, math.nan, math.nan, k

    def spearman(a, b):
        ra, rb = rankdata(a), rankdata(b)
        ra, rb = ra - ra.mean(), rb - rb.mean()
        den = math.sqrt(float(ra @ ra) * float(rb @ rb))
        return float(ra @ rb) / den if den > 0 else math.nan

    rho = spearman(x, y)
    rng = np.random.default_rng(seed)
    boot = np.array([spearman(x[i], y[i]) for i in rng.integers(0, k, size=(n_boot, k))])
    boot = boot[np.isfinite(boot)]
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [tail, 1.0 - tail]) if boot.size else (math.nan, math.nan)
    return rho, float(lo), float(hi), k


def compare(lm_table: pd.DataFrame, sim_table: pd.DataFrame, reference: str = "naive"):
    """Measured (LM) vs predicted (simulation) relative bias / variance / MSE per estimator.

    One row per estimator present in both tables: ``measured_rel_<m>``, ``predicted_rel_<m>``
    for m in variance, bias, mse (:func:`relative_metrics`).
    """
    a = relative_metrics(lm_table, reference).set_index("estimator")
    b = relative_metrics(sim_table, reference).set_index("estimator")
    common = [e for e in a.index if e in b.index]
    out = pd.DataFrame({"estimator": common, "mapping": a.loc[common, "mapping"].to_numpy()})
    for key in ("variance", "bias", "mse"):
        out[f"measured_rel_{key}"] = a.loc[common, f"rel_{key}"].to_numpy()
        out[f"predicted_rel_{key}"] = b.loc[common, f"rel_{key}"].to_numpy()
    return out
