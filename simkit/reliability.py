"""When a Monte Carlo row cannot be trusted: the ``reliable`` column of ``experiment.run``.

With heavy-tailed importance weights the bootstrap intervals of the Monte Carlo path
under-cover without any warning: the variance and MSE are means over the reps of per-batch
squared errors whose own distribution has a heavy (or unseen) tail, so the sample — and every
resample of it — misses the rare batches that carry most of the expectation (issue 12 §4: on a
bandit with one arm at μ = 8e-4, n = 4, reps = 200, the variance intervals of sequence IS cover
0.60 of the time against a nominal 0.95, and the median estimate is ~80 % low). A row is
marked ``reliable = False`` when any of three checks fails:

1. **Tail of the per-batch squared errors** (draws only). The PSIS Pareto k̂
   (:func:`khat_of_weights`; Vehtari, Simpson, Gelman, Yao & Gabry, "Pareto
   smoothed importance sampling", JMLR 25 (2024), §3 and §6) of x_r = ‖ĝ_r − ḡ‖² and of
   x_r = ‖ĝ_r − ∇J‖² over the reps. Their means are the variance and MSE estimates. k̂ > 0.5
   would say that the x_r have infinite variance (the central limit theorem behind the
   bootstrap-t intervals fails), but k̂ is itself estimated from only M = 3√reps tail draws
   (standard error ≈ (1 + k)/√M ≈ 0.2 at reps = 200): on bounded, light-tailed settings it
   exceeded 0.5 in about one run in ten (measured: ``tests/test_reliability.py``'s light bandit).
   The threshold is therefore 0.7 (:data:`KHAT_MAX`), where Vehtari et al. (§3.2, Table 1) place
   the point beyond which the pre-asymptotic convergence of a Monte Carlo mean is too slow to
   be useful at any practical sample size. k̂ is NaN (no evidence, the check passes) when the
   x_r take too few distinct values to fit a tail.
2. **One batch carries the estimate** (draws only): the largest x_r exceeds half of Σ_r x_r
   (:data:`MAX_SHARE`) — the same symptom PSIS smooths, measured directly.
3. **Draws that cannot see the tail** (exact, where simkit can compute it). Draws alone cannot
   flag a tail they never sampled (the rare arm above is missed by about half the seeds at 800
   draws). simkit knows its environments, so it computes exactly, for the coefficient c̄ of one
   sample (Σ_t |c_t|/Z for a per-sample mapping, the sequence weight W for a batch-dependent
   one, whose coefficients are functions of the batch's W),

       ν = N·(E_μ c̄²)² / E_μ c̄⁴,      N = reps·n drawn samples,

   the number of draws expected in the part of the distribution that carries E c̄² (for a tail
   of probability q and size B ≫ the bulk, E c̄² ≈ qB², E c̄⁴ ≈ qB⁴, so ν ≈ N·q). The variance
   estimate is a mean of c̄²-sized terms whose relative variance is E c̄⁴/(E c̄²)² − 1 ≈ N/ν per
   draw-sum, so ν < :data:`MIN_TAIL_DRAWS` (10) means the draws have seen the tail only a few
   times or not at all: unreliable. Exact by enumeration of ``env.support`` (bandit, enumerable
   token MDP) and, beyond enumeration, by a product-form DP for sequence-level weights
   (E_μ[W^q], :func:`simkit.envs.token_moments.weight_moment`); for token-level mappings beyond
   enumeration ν is NaN and only checks 1–2 apply. A composed estimator (three policies,
   ``run(old=…)``) uses its composed coefficient, so a heavy π_old‖μ leg is seen.

Exact rows are always reliable (no sampling error). The coverage test
(``tests/test_reliability.py``, ≥ 60 seeds against exact truth on a light- and two
heavy-tailed settings) checks that the rows left reliable cover at their nominal rate within
binomial error.
"""

from __future__ import annotations

import math

import numpy as np

#: check 1: largest k̂ of the per-batch squared errors that still counts as reliable
KHAT_MAX = 0.7
#: check 2: largest share of Σ_r x_r one batch may carry
MAX_SHARE = 0.5
#: check 3: fewest expected draws in the tail that carries E c̄²
MIN_TAIL_DRAWS = 10.0


#: fewest distinct values among the tail draws to which a Pareto tail is fitted
KHAT_MIN_DISTINCT = 5
#: least share of distinct values among the M tail draws (a generalised Pareto is continuous)
KHAT_MIN_DISTINCT_SHARE = 0.5


def khat_of_weights(weights) -> float:
    """Pareto-smoothed importance-sampling k̂ of non-negative ``weights`` (S,), or NaN.

    Vehtari et al., "Pareto smoothed importance sampling", JMLR 2024: k̂ < 0.5 finite variance,
    0.5–0.7 usable, > 0.7 unreliable. Delegates to :func:`simkit.mappings.psis.psis_khat` (on
    log-weights; zero weights get the log-weight max − 1000, which PSIS treats exactly as a zero
    and which stays out of the fitted tail unless fewer than the tail's M draws are positive).

    NaN — never ±inf — where no Pareto tail can be fitted: every weight 0; fewer than 25 draws
    (under 5 tail draws); or a tail of ties — fewer than :data:`KHAT_MIN_DISTINCT` distinct
    values among the M largest draws, or fewer distinct values than half of M
    (:data:`KHAT_MIN_DISTINCT_SHARE`): a discrete support (a small bandit, a short token MDP,
    bounded weights whose tail is a few atoms). The generalised Pareto law is continuous; fitted
    to repeated atoms it describes their spacing, not a tail — it gave −inf, +inf, 22.6 or −5.2
    depending only on whether a rare atom happened to be drawn.
    """
    from simkit.mappings.psis import MIN_TAIL_DRAWS, psis_khat, psis_tail_length

    w = np.asarray(weights, dtype=np.float64).ravel()
    if w.size == 0 or np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError("khat_of_weights needs a non-empty array of finite non-negative weights")
    positive = w > 0
    if not positive.any():
        return math.nan
    tail = psis_tail_length(w.size)
    if tail < MIN_TAIL_DRAWS:
        return math.nan
    top = np.partition(w, w.size - tail)[w.size - tail :]
    distinct = np.unique(top).size
    if distinct < KHAT_MIN_DISTINCT or distinct < KHAT_MIN_DISTINCT_SHARE * tail:
        return math.nan
    log_w = np.empty_like(w)
    log_w[positive] = np.log(w[positive])
    log_w[~positive] = log_w[positive].max() - 1000.0
    k = float(psis_khat(log_w))
    return k if math.isfinite(k) else math.nan


def tail_draws(env, mu, estimator, n_draws: int, baseline: float, old=None) -> float:
    """ν = N·(E c̄²)²/E c̄⁴ (module docstring, check 3), exact, or NaN where not computable.

    ``mu`` the validated behaviour; ``baseline`` the advantage's b (signs of A pick the
    coefficients of sign-dependent mappings); ``n_draws`` N = reps·n. ``old``: π_old (None:
    π_old = π) for a composed estimator (a ``correction``): its c̄ is the composed coefficient
    c_mapping(π/π_old)·c_correction(π_old/μ) with the ``denominator``'s weights, so a heavy
    π_old‖μ leg counts (by enumeration; beyond enumeration a composed row that is not batch
    dependent gets NaN — composed rows the moment DP covers are exact, never checked here).
    """
    from simkit.envs.token_moments import PRODUCT_MAPPINGS, weight_moment

    mapping = estimator.mapping
    composed = estimator.correction is not None
    enumerable = getattr(env, "enumerable", None)
    if enumerable is None or enumerable():
        atoms = env.support(mu, baseline)
        mask = np.asarray(atoms.mask, dtype=bool)
        if estimator.batch_dependent:
            log_c = np.sum(np.where(mask, atoms.log_ratio, 0.0), axis=1)  # log W
        elif composed:
            log_c = _log_composed_coefficient(env, mu, estimator, atoms, mask, old)
        else:
            from simkit import legs

            kwargs = {}
            if mapping.requires_log_prob:  # DPPO: log π of the atoms' tokens
                kwargs["log_prob"] = legs.log_prob_for(estimator, env, atoms)
            c = mapping.coefficients(atoms.log_ratio, mask, atoms.advantage_sign, **kwargs)
            a = estimator.aggregation_weights(mask[:, None, :])[:, 0, :]
            with np.errstate(divide="ignore"):
                log_c = np.log(np.sum(np.abs(c) * a, axis=1))
        return _nu(n_draws, atoms.prob, log_c)
    if composed and not estimator.batch_dependent:
        return math.nan
    if estimator.batch_dependent or mapping.name in PRODUCT_MAPPINGS:
        alpha = float(getattr(mapping, "alpha", 1.0)) if mapping.name == "power" else 1.0
        log_m2 = weight_moment(env, mu, 2.0 * alpha, log=True)
        log_m4 = weight_moment(env, mu, 4.0 * alpha, log=True)
        return float(n_draws * math.exp(min(2.0 * log_m2 - log_m4, 0.0)))
    return math.nan


def _log_composed_coefficient(env, mu, estimator, atoms, mask, old) -> np.ndarray:
    """log c̄ = log Σ_t |c_t|·a_t of every atom for a composed estimator (c of both legs with
    o = log π_old − log μ on the atom's tokens, a the ``denominator``'s aggregation weights)."""
    from simkit import legs

    old_lr = None
    if old is not None:
        states = getattr(atoms, "states", None)
        old_lr = legs.old_log_ratio(env, old, mu, atoms.actions, mask, states)
    sign = atoms.advantage_sign
    c = estimator.coefficients(
        atoms.log_ratio,
        mask,
        sign,
        old_log_ratio=old_lr,
        log_prob=legs.log_prob_for(estimator, env, atoms),
    )
    a = estimator.kept_weights(
        atoms.log_ratio[:, None, :],
        mask[:, None, :],
        sign[:, None],
        None if old_lr is None else old_lr[:, None, :],
    )[:, 0, :]
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.abs(c) * a, axis=1))


def _nu(n_draws: int, prob: np.ndarray, log_c: np.ndarray) -> float:
    """N·(Σ p c²)²/Σ p c⁴ from log c (in log space: W can be e^80)."""
    ok = (prob > 0) & np.isfinite(log_c)
    if not ok.any():
        return math.inf  # every coefficient is 0: nothing heavy to miss
    lp, lc = np.log(prob[ok]), log_c[ok]
    log_m2 = _logsumexp(lp + 2.0 * lc)
    log_m4 = _logsumexp(lp + 4.0 * lc)
    return float(n_draws * math.exp(min(2.0 * log_m2 - log_m4, 0.0)))


def _logsumexp(x: np.ndarray) -> float:
    top = float(np.max(x))
    return top + math.log(float(np.sum(np.exp(x - top))))


def draw_checks(dev_sq: np.ndarray, err_sq: np.ndarray) -> tuple[float, float]:
    """(k̂, largest share) of the per-batch squared errors (checks 1 and 2; k̂ may be NaN).

    ``dev_sq`` = ‖ĝ_r − ḡ‖², ``err_sq`` = ‖ĝ_r − ∇J‖², both (reps,). The larger value of the
    two series is returned for each check.
    """
    khats, shares = [], []
    for x in (dev_sq, err_sq):
        x = np.asarray(x, dtype=np.float64)
        total = float(x.sum())
        shares.append(float(x.max()) / total if total > 0 else 0.0)
        khats.append(khat_of_weights(x))
    finite = [k for k in khats if not math.isnan(k)]
    return (max(finite) if finite else math.nan), max(shares)


def is_reliable(khat_err: float, max_share: float, nu: float) -> bool:
    """The rule of the module docstring: all three checks pass (NaN checks pass)."""
    if not math.isnan(khat_err) and khat_err > KHAT_MAX:
        return False
    if max_share > MAX_SHARE:
        return False
    return not (not math.isnan(nu) and nu < MIN_TAIL_DRAWS)
