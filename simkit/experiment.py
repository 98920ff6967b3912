"""Bias / variance / MSE / cosine / ESS / k̂ tables of gradient estimators, exact or Monte Carlo.

:func:`run` measures, for each estimator, the n-sample gradient estimate ĝ against the exact
policy gradient ∇J of an environment (DESIGN.md, "Metrics"):

- ``bias`` = ‖E ĝ − ∇J‖;
- ``bias_dir`` = ‖E ĝ − α*∇J‖ with α* = ⟨E ĝ, ∇J⟩/‖∇J‖² (:func:`best_scale`): the distance
  from E ĝ to the *line* spanned by ∇J, i.e. the bias left after the best rescaling (a pure
  rescaling is only a step size). α* is unconstrained and may be negative (an estimator that
  points backwards has a small ``bias_dir`` but a negative ``cosine``);
- ``cosine`` = cos(E ĝ, ∇J) (NaN when either is 0);
- ``variance`` = E‖ĝ − E ĝ‖² (trace of the covariance of the n-sample estimator);
- ``mse`` = E‖ĝ − ∇J‖² = bias² + variance;
- ``snr`` = ‖E ĝ‖² / variance;
- ``ess`` = n·(E|c|)² / E[c²] over the effective coefficients c of the drawn tokens
  (:func:`effective_sample_size`; n/(1+χ²) for sequence IS, n for naive);
- ``khat`` = the PSIS Pareto k̂ of the coefficient magnitudes |c| (:func:`khat_of_weights`).

Two paths compute them.

**Exact** (estimators whose ĝ is a sum of independent per-sample terms,
``Estimator.per_sample``): ĝ = (1/Z) Σ_i g_i with g_i = c(y_i, sign A_i)·A_i·∇log π(y_i)
i.i.d. The coefficient c depends on the sample only through its log-ratio (a function of y)
and the sign of A (mapping contract), so E g and E‖g‖² are *finite sums* over the atoms
(y, sign A) of the environment's support (``env.support``), weighted by the exact partial
moments E[A·1{atom}] and E[A²·1{atom}] (closed forms for Bernoulli and Gaussian rewards). With
κ = 1/Z (every aggregation has a deterministic Z on fixed-length batches; Z = n on the bandit),
E ĝ = n·κ·E g and Var ĝ = n·κ²·(E‖g‖² − ‖E g‖²): no sampling error at all. On the token MDP
(T > 1) an atom is a whole sequence (its reward is deterministic) and Z may be per sequence
(seq-mean-token-mean: Z_i = n·|y_i|); only ``token-mean`` with varying lengths (EOS) has a
random Z shared by the batch and goes to Monte Carlo. Beyond the enumeration budget a token
MDP keeps an exact path for untied parameters by dynamic programming
(:mod:`simkit.envs.token_moments`: mean and variance of every token-level mapping and of the
product-form sequence mappings ``is_seq`` and ``power``, W²-weighted forward/backward sweeps,
any T); other estimators there go to Monte Carlo (:func:`has_exact_path`). ``ess`` is exact
too; ``khat`` has no closed form and is always estimated from draws.

**Monte Carlo** (everything else, or ``exact=False``): ``reps`` independent batches of n draws
(drawn at once), ĝ_r per batch; E ĝ ≈ ḡ, variance = trace of the sample covariance (ddof 1).
``bias``, ``bias_dir`` and ``snr``'s numerator are debiased for the noise of ḡ
(E‖ḡ − v‖² = ‖E ĝ − v‖² + variance/reps, so variance/reps is subtracted, clipped at 0): that
makes ``mse`` = bias² + variance equal to the unbiased mean of ‖ĝ_r − ∇J‖² (unless clipped),
and stops an unbiased estimator from showing a spurious bias of order √(variance/reps).
Confidence bounds (``*_lo``/``*_hi``, at ``level``) come from a seeded bootstrap over the reps:

- ``bias``, ``bias_dir``, ``cosine``: from one confidence *ball* for E ĝ, centred at ḡ with
  radius ρ = the ``level`` quantile of ‖ḡ* − ḡ‖ over bootstrap replicates ḡ*. For every point
  of the ball the three quantities lie in the reported intervals (triangle inequality and the
  angle subtended by the ball), so the bounds hold simultaneously and do not fail at the
  boundary (an unbiased estimator's bias interval starts at 0, its cosine interval reaches 1);
- ``variance``, ``mse``: studentized bootstrap (bootstrap-t, second-order accurate for these
  means of skewed per-rep values ‖ĝ_r − ḡ‖² and ‖ĝ_r − ∇J‖²; they cover slightly less than
  ``level`` when reps is small, e.g. ≈ 0.87–0.90 at level 0.9);
- ``ess``: percentile bootstrap;
- ``snr``: [‖·‖²-bounds of the ball] / [variance bounds] (conservative).

``khat`` has no bounds; it is computed from the coefficients of all reps·n drawn samples, on
exact rows too (NaN where no Pareto tail can be fitted, :func:`khat_of_weights`). Exact rows
have NaN bounds.

**Reliability.** These intervals assume that the reps have seen the distribution's tail. With
heavy-tailed weights they can under-cover badly and silently, so every Monte Carlo row carries
``reliable`` (and the exact ``tail_draws`` ν behind it): False when the per-batch squared errors
have a Pareto k̂ > 0.7, when one batch carries more than half of their sum, or when the exact
moments of the coefficients say that reps·n draws expect fewer than 10 draws in the tail that
carries the second moment (:mod:`simkit.reliability`, with the references). Exact rows are
always reliable.

Randomness: one ``SeedSequence(seed)`` spawns a stream for the batches and a stream for the
bootstrap. Every estimator is evaluated on the *same* batches (common random numbers) with the
same bootstrap resamples, so adding or removing an estimator never changes another's numbers,
differences between estimators are measured with less noise, and the same seed gives the same
table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import legs, reliability
from simkit._memory import check_samples
from simkit._validation import check_seed
from simkit.envs.token_moments import dp_applies
from simkit.envs.token_moments import moments as dp_moments
from simkit.estimators import ORACLE_ADVANTAGES, PER_SAMPLE_ADVANTAGES, Estimator, as_estimator
from simkit.reliability import KHAT_MIN_DISTINCT, khat_of_weights  # noqa: F401 (public here too)

#: metrics that carry ``*_lo``/``*_hi`` bounds on the Monte Carlo path
BOUNDED_METRICS = ("bias", "bias_dir", "cosine", "variance", "mse", "snr", "ess")
DIVERGENCE_COLUMNS = ("chi2_tok", "kl_tok", "tv_tok", "chi2_seq", "kl_seq", "tv_seq")
#: a progress bar is shown (``progress=None``) when the Monte Carlo work, counted in drawn
#: tokens times estimators, exceeds this
PROGRESS_THRESHOLD = 2_000_000


# --- metric functions (pure, one per quantity) ------------------------------------------------


def best_scale(mean, grad_J) -> float:
    """α* = ⟨E ĝ, ∇J⟩ / ‖∇J‖², the least-squares scale of ∇J closest to E ĝ (may be < 0).

    0 when ∇J = 0. ``mean``, ``grad_J``: (D,).
    """
    mean, grad_J = _vectors(mean, grad_J)
    norm2 = float(grad_J @ grad_J)
    return float(mean @ grad_J) / norm2 if norm2 > 0 else 0.0


def bias(mean, grad_J) -> float:
    """‖E ĝ − ∇J‖ for E ĝ = ``mean`` (D,) and ∇J = ``grad_J`` (D,)."""
    mean, grad_J = _vectors(mean, grad_J)
    return float(np.linalg.norm(mean - grad_J))


def bias_dir(mean, grad_J) -> float:
    """‖E ĝ − α*∇J‖: distance from E ĝ to the line through ∇J (see :func:`best_scale`)."""
    mean, grad_J = _vectors(mean, grad_J)
    return float(np.linalg.norm(mean - best_scale(mean, grad_J) * grad_J))


def cosine(mean, grad_J) -> float:
    """cos(E ĝ, ∇J) = ⟨E ĝ, ∇J⟩ / (‖E ĝ‖‖∇J‖); NaN when either vector is 0."""
    mean, grad_J = _vectors(mean, grad_J)
    denom = float(np.linalg.norm(mean) * np.linalg.norm(grad_J))
    return float(mean @ grad_J) / denom if denom > 0 else math.nan


def snr(mean_sq: float, variance: float) -> float:
    """Signal-to-noise ratio ‖E ĝ‖² / E‖ĝ − E ĝ‖² (inf for a noiseless non-zero signal)."""
    if variance > 0:
        return mean_sq / variance
    return math.inf if mean_sq > 0 else math.nan


def effective_sample_size(n: int, abs_mean: float, sq_mean: float) -> float:
    """ESS = n·(E|c|)² / E[c²] of the effective coefficients c (0 when every c is 0).

    The population form of Kish's (Σ|c|)²/Σc²: for sequence IS (c = W) it is n/(1 + χ²)
    (E W = 1, E W² = 1 + χ²; reference sheet section F), for naive (c = 1) it is n.
    """
    return n * abs_mean**2 / sq_mean if sq_mean > 0 else 0.0


def _vectors(mean, grad_J):
    mean = np.asarray(mean, dtype=np.float64)
    grad_J = np.asarray(grad_J, dtype=np.float64)
    if mean.ndim != 1 or mean.shape != grad_J.shape:
        raise ValueError(
            f"mean and grad_J must be vectors of the same shape (D,), got {mean.shape} and "
            f"{grad_J.shape}"
        )
    return mean, grad_J


# --- the two paths --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExactMoments:
    """Exact moments of an n-sample per-sample estimator: ``mean`` E ĝ (D,), ``variance``
    E‖ĝ − E ĝ‖², ``ess`` (see :func:`effective_sample_size`)."""

    mean: np.ndarray
    variance: float
    ess: float


def exact_moments(
    env, behaviour, estimator, n: int, params: str = "untied", old=None
) -> ExactMoments:
    """E ĝ, Var ĝ and ESS of an n-sample estimator by enumeration of the support (exact).

    Needs an exact path (:func:`has_exact_path`: a per-sample estimator, a deterministic Z and
    an enumerable environment). With the atoms of ``env.support(μ, b)`` (b = J(μ) for the
    ``oracle`` advantage, J(π) for ``oracle_pi``, 0 for raw: :func:`oracle_baseline`) — (y, sign
    A) on the bandit, whole sequences y on the token MDP —, c_t the mapping's coefficients on
    each atom (one (M, T) call) and a_t = n/Z_i the aggregation weight of one sample (the atom
    seen as a batch of one: 1/T for fixed-length token-mean, 1/|y| for seq-mean-token-mean, 1
    for seq-mean-token-sum, 1/L_max for seq-mean-token-sum-norm), each sample contributes h =
    A·Σ_t c_t a_t ∇log π(y_t|s_t) and
    ĝ = (1/n) Σ_i h_i with h_i i.i.d.:

        E h   = Σ_atoms E[A·1{atom}] · Σ_t c_t a_t ∇log π(y_t|s_t)       (one ``accumulate``)
        E‖h‖² = Σ_atoms E[A²·1{atom}] · ‖Σ_t c_t a_t ∇log π(y_t|s_t)‖²
        E ĝ = E h,   Var ĝ = (E‖h‖² − ‖E h‖²)/n

    The per-atom squared norms come from ``env.score_norms_sq`` when the environment has it,
    else from per-atom gradients in chunks (``env.accumulate`` on one atom per batch).
    ESS = n·(E Σ_t|c_t|)² / (E Σ_t c_t² · E|y|) (the population form of the Monte Carlo ESS
    over tokens; n·(E|c|)²/E c² when T = 1).

    ``params`` (:data:`PARAMS`): ``"untied"`` — θ has one block per position (the environment's
    own D = T·P·V parameters); ``"tied"`` — one table shared by every position, whose gradient
    is the sum of the per-position blocks (:func:`tie`): E h and ∇J are summed over positions
    and ‖h‖² is taken of the summed per-atom vector (cross-position terms included).

    ``old``: π_old (shape of ``behaviour``; None: π_old = π) for a composed estimator
    (:mod:`simkit.composition`): each atom's o_t = log π_old − log μ (:mod:`simkit.legs`) is
    known, so the exact path is unchanged.
    """
    est = as_estimator(estimator)
    params = _check_params(params)
    why = _why_not_exact(est, env, params)
    if why:
        kind = "is not per-sample" if not est.per_sample else "has no exact path"
        raise ValueError(f"estimator {est.name!r} {kind}: {why}")
    est.check_batch_size(n)
    mu = env.check_policy(behaviour, "behaviour")
    if not _enumerable(env):  # beyond enumeration: the moment DP (untied parameters, π_old = π)
        if old is not None:
            raise ValueError(
                "old (π_old) is not supported beyond enumeration: the moment DP handles one "
                f"ratio π/μ; the environment has {env.n_sequences} sequences"
            )
        return _dp_moments(env, mu, est, n)
    baseline = oracle_baseline(env, mu, est)
    atoms = env.support(mu, baseline)
    mask = np.asarray(atoms.mask, dtype=bool)  # (M, T)
    old_lr = _old_log_ratio(env, old, mu, atoms)
    c = est.coefficients(atoms.log_ratio, mask, atoms.advantage_sign, old_log_ratio=old_lr)
    bad = int(np.count_nonzero(~np.isfinite(c[mask])))
    if bad:
        raise ValueError(
            f"estimator {est.name!r}: mapping {est.mapping.name!r} returned non-finite "
            f"coefficients (NaN/inf) on {bad} tokens of the support"
        )
    per_token = c * _atom_weights(est, atoms, mask, old_lr)  # c_t·a_t, (M, T)
    first = env.accumulate(atoms.actions, per_token * atoms.adv_first[:, None])  # E h, (D,)
    if params == "tied":
        first = tie(first, env.T)
    norms = _atom_score_norms_sq(env, atoms.actions, per_token, params)
    second = float(np.sum(atoms.adv_second * norms))
    var_one = max(second - float(first @ first), 0.0)
    abs_c = np.abs(c) * mask
    mean_length = float(atoms.prob @ mask.sum(axis=1))
    ess = effective_sample_size(
        n, float(atoms.prob @ abs_c.sum(axis=1)), float(atoms.prob @ (abs_c**2).sum(axis=1))
    )
    ess = ess / mean_length if mean_length > 0 else 0.0
    return ExactMoments(mean=first, variance=var_one / n, ess=ess)


def _old_log_ratio(env, old, mu, draws):
    """o = log π_old − log μ on the tokens of a batch or support (None without ``old``)."""
    if old is None:
        return None
    states = getattr(draws, "states", None)
    return legs.old_log_ratio(env, old, mu, draws.actions, draws.mask, states)


def _atom_weights(est, atoms, mask, old_lr) -> np.ndarray:
    """a_t = n/Z_i of each atom seen as a batch of one, (M, T) (``denominator`` included)."""
    return est.kept_weights(
        atoms.log_ratio[:, None, :],
        mask[:, None, :],
        atoms.advantage_sign[:, None],
        None if old_lr is None else old_lr[:, None, :],
    )[:, 0, :]


def oracle_baseline(env, mu, estimator) -> float:
    """The exact baseline b of ``estimator``'s advantage A = R − b on ``env`` under μ = ``mu``.

    ``oracle``: J(μ) (``env.J(mu)``: what group and batch means of μ-drawn rewards estimate,
    so that E_μ[A] = 0); ``oracle_pi``: J(π) (``env.J()``); any other advantage: 0.
    """
    est = as_estimator(estimator)
    if est.advantage == "oracle":
        return float(env.J(mu))
    if est.advantage == "oracle_pi":
        return float(env.J())
    return 0.0


#: per-atom gradient vectors formed at once by :func:`_atom_score_norms_sq` (values)
_CHUNK_VALUES = 1 << 22


def _atom_score_norms_sq(env, actions, token_weights, params: str = "untied") -> np.ndarray:
    """‖Σ_t λ_t ∇log π(y_t|s_t)‖² per atom (M,), for ``actions`` (M, …) and λ (M, T).

    With ``params="tied"`` the norm is of the tied gradient (:func:`tie` of the vector)."""
    if hasattr(env, "score_norms_sq") and params == "untied":
        return env.score_norms_sq(actions, token_weights)
    M = token_weights.shape[0]
    out = np.empty(M)
    rows = max(1, _CHUNK_VALUES // max(env.D, 1))
    for start in range(0, M, rows):
        stop = min(start + rows, M)
        # every atom is its own batch of one sample: (m, 1, …) -> (m, D)
        grads = env.accumulate(actions[start:stop, None], token_weights[start:stop, None])
        if params == "tied":
            grads = tie(grads, env.T)
        out[start:stop] = np.sum(grads**2, axis=-1)
    return out


#: parameterisations of θ for the gradient: per-position blocks, or one table for all positions
PARAMS = ("untied", "tied")


def _check_params(params) -> str:
    if params not in PARAMS:
        raise ValueError(f"params must be one of {PARAMS}, got {params!r}")
    return params


def tie(vectors, T: int) -> np.ndarray:
    """Gradient w.r.t. *tied* parameters from gradients w.r.t. untied ones: (…, T·B) → (…, B).

    The untied θ has one block θ[t] of B = D/T parameters per position t (C order, position
    first: the token MDP's logits (T, P, V)); a tied policy uses one table θ_tied for every
    position, θ[t] = θ_tied (plus any fixed per-position offset), so by the chain rule
    ∂f/∂θ_tied = Σ_t ∂f/∂θ[t]: the sum of the per-position blocks. Linear, so E ĝ, ∇J and
    every ĝ_r are tied the same way (issue 12 §2: the growth laws of the bias change with it).
    """
    v = np.asarray(vectors, dtype=np.float64)
    D = v.shape[-1]
    if T < 1 or D % T:
        raise ValueError(f"cannot tie a gradient of dimension {D} over T = {T} positions")
    return v.reshape(*v.shape[:-1], T, D // T).sum(axis=-2)


def has_exact_path(env, estimator) -> bool:
    """True iff :func:`exact_moments` applies to ``estimator`` on ``env`` (see there)."""
    return not _why_not_exact(as_estimator(estimator), env)


def _dp_moments(env, mu, est: Estimator, n: int) -> ExactMoments:
    """Exact moments by the token-MDP DP (:mod:`simkit.envs.token_moments`), any T."""
    m = dp_moments(
        env, mu, est.mapping, oracle_baseline(env, mu, est), est.aggregation, est.max_length
    )
    return ExactMoments(mean=m.mean, variance=m.variance(n), ess=m.ess(n))


@dataclass(frozen=True)
class MonteCarloDraws:
    """Per-repetition results of an estimator on ``reps`` batches.

    ``gradients`` (reps, D) the estimates ĝ_r; ``coefficients`` (reps, n, T) the mapping's c;
    ``mask`` (reps, n, T).
    """

    gradients: np.ndarray
    coefficients: np.ndarray
    mask: np.ndarray


def sample_gradients(env, batch, estimator, old_log_ratio=None, rng=None) -> MonteCarloDraws:
    """ĝ_r = ``env.accumulate(actions_r, λ_r)`` for every batch r of ``batch`` (reps, n, …).

    ``old_log_ratio`` (reps, n, T): log π_old − log μ of the drawn tokens (composed
    estimators); ``rng``: the Generator of a stochastic mapping. Raises ``ValueError`` naming
    the estimator if its mapping returns a non-finite coefficient.
    """
    est = as_estimator(estimator)
    b = est.baseline(batch.J, batch.J_mu) if est.advantage in ORACLE_ADVANTAGES else None
    lam, c = est.token_weights(
        batch.log_ratio,
        batch.mask,
        batch.rewards,
        b,
        return_coefficients=True,
        old_log_ratio=old_log_ratio,
        rng=rng,
    )
    mask = np.asarray(batch.mask, dtype=bool)
    bad = int(np.count_nonzero(~np.isfinite(c[mask])))
    if bad:
        raise ValueError(
            f"estimator {est.name!r}: mapping {est.mapping.name!r} returned non-finite "
            f"coefficients (NaN/inf) on {bad} of {int(mask.sum())} drawn tokens"
        )
    states = getattr(batch, "states", None)  # token MDP batches carry them: no recomputation
    grads = (
        env.accumulate(batch.actions, lam)
        if states is None
        else env.accumulate(batch.actions, lam, states=states)
    )
    return MonteCarloDraws(gradients=grads, coefficients=c, mask=mask)


def _bootstrap_weights(reps: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot, reps) resampling weights (counts / reps) of a nonparametric bootstrap."""
    weights = np.empty((n_boot, reps))
    for b in range(n_boot):  # row by row: cache-friendly, ~10x faster than one big bincount
        weights[b] = np.bincount(rng.integers(0, reps, size=reps), minlength=reps)
    return weights / reps


def _ball_norm_bounds(norm: float, radius: float) -> tuple[float, float]:
    return max(norm - radius, 0.0), norm + radius


def _ball_cosine_bounds(mean, grad_J, radius: float) -> tuple[float, float]:
    """Range of cos(m, ∇J) over the ball ‖m − mean‖ ≤ radius."""
    norm = float(np.linalg.norm(mean))
    cos0 = cosine(mean, grad_J)
    if math.isnan(cos0) or radius >= norm:
        return (math.nan, math.nan) if np.linalg.norm(grad_J) == 0 else (-1.0, 1.0)
    angle = math.acos(min(max(cos0, -1.0), 1.0))
    half = math.asin(radius / norm)
    return math.cos(min(angle + half, math.pi)), math.cos(max(angle - half, 0.0))


def _studentized_bounds(x, W, level: float, scale: float = 1.0, shift=0.0) -> tuple[float, float]:
    """Bootstrap-t bounds for scale·E[x] from per-rep values ``x`` (R,), clipped at 0.

    Replicates m* = scale·(W@x − shift) with standard errors se* = scale·sd_W(x)/√R;
    t* = (m* − m)/se*, bounds [m − q_hi(t*)·se, m − q_lo(t*)·se]. ``shift`` (B,) corrects for
    statistics centred at the replicate's own mean (the variance: Σ w‖g − ḡ*‖² =
    W@‖g − ḡ‖² − ‖ḡ* − ḡ‖²). Studentizing makes the bounds second-order accurate for means
    of skewed per-rep values (Efron & Tibshirani 1993, ch. 12).
    """
    R = x.shape[0]
    m = scale * float(x.mean())
    se = scale * float(x.std()) / math.sqrt(R)
    if se == 0:
        return m, m
    m_b = scale * (W @ x - shift)
    se_b = scale * np.sqrt(np.maximum(W @ x**2 - (W @ x) ** 2, 0.0)) / math.sqrt(R)
    ok = se_b > 0
    if not ok.any():
        return m, m
    t = (m_b[ok] - m) / se_b[ok]
    tail = (1.0 - level) / 2.0
    t_lo, t_hi = np.quantile(t, [tail, 1.0 - tail])
    return max(m - float(t_hi) * se, 0.0), m - float(t_lo) * se


def monte_carlo_metrics(
    draws: MonteCarloDraws, grad_J, n: int, boot_weights: np.ndarray, level: float = 0.95
) -> dict[str, float]:
    """Metrics and bounds from Monte Carlo draws (module docstring: debiasing and bounds).

    ``boot_weights`` (B, reps) bootstrap resampling weights (rows sum to 1).
    """
    g = draws.gradients
    R = g.shape[0]
    if R < 2:
        raise ValueError(f"Monte Carlo metrics need reps >= 2, got {R}")
    grad_J = np.asarray(grad_J, dtype=np.float64)
    mean = g.mean(axis=0)
    err_sq = np.sum((g - grad_J) ** 2, axis=1)
    variance = float(np.sum(g.var(axis=0, ddof=1)))
    noise = variance / R  # E‖ḡ − E ĝ‖²
    bias2 = max(float(np.sum((mean - grad_J) ** 2)) - noise, 0.0)
    alpha = best_scale(mean, grad_J)
    gnorm2 = float(grad_J @ grad_J)
    u = grad_J / math.sqrt(gnorm2) if gnorm2 > 0 else np.zeros_like(grad_J)
    proj = g @ u
    noise_perp = noise - (float(proj.var(ddof=1)) / R if gnorm2 > 0 else 0.0)
    perp = mean - alpha * grad_J
    bias_dir2 = max(float(perp @ perp) - noise_perp, 0.0)
    mean_sq = max(float(mean @ mean) - noise, 0.0)

    c = np.abs(draws.coefficients) * draws.mask
    s1 = c.sum(axis=(1, 2))
    s2 = (c**2).sum(axis=(1, 2))
    tokens = draws.mask.sum(axis=(1, 2)).astype(np.float64)

    def ess_of(abs_sum, sq_sum, count):
        # n·(mean|c|)²/mean(c²) = n·(Σ|c|)²/(Σc²·count), 0 when every c is 0
        denom = sq_sum * count
        return n * np.divide(abs_sum**2, denom, out=np.zeros_like(denom), where=denom > 0)

    ess = float(ess_of(np.array(s1.sum()), np.array(s2.sum()), np.array(tokens.sum())))

    # bootstrap replicates (weights W: (B, R), rows sum to 1)
    W = boot_weights
    mean_b = W @ g
    dev_sq = np.sum((g - mean) ** 2, axis=1)  # variance = mean(dev_sq)·R/(R−1)
    ess_b = ess_of(W @ s1, W @ s2, W @ tokens)
    radius = float(np.quantile(np.linalg.norm(mean_b - mean, axis=1), level))
    tail = (1.0 - level) / 2.0

    def pct(x):
        lo, hi = np.quantile(x, [tail, 1.0 - tail])
        return float(lo), float(hi)

    out = {
        "bias": math.sqrt(bias2),
        "bias_dir": math.sqrt(bias_dir2),
        "cosine": cosine(mean, grad_J),
        "variance": variance,
        "mse": bias2 + variance,
        "snr": snr(mean_sq, variance),
        "ess": ess,
    }
    bounds = {
        "bias": _ball_norm_bounds(float(np.linalg.norm(mean - grad_J)), radius),
        "bias_dir": _ball_norm_bounds(float(np.linalg.norm(perp)), radius),
        "cosine": _ball_cosine_bounds(mean, grad_J, radius),
        "variance": _studentized_bounds(
            dev_sq, W, level, R / (R - 1), shift=np.sum((mean_b - mean) ** 2, axis=1)
        ),
        "mse": _studentized_bounds(err_sq, W, level),
        "ess": pct(ess_b),
    }
    num_lo, num_hi = (b**2 for b in _ball_norm_bounds(float(np.linalg.norm(mean)), radius))
    var_lo, var_hi = bounds["variance"]
    bounds["snr"] = (
        num_lo / var_hi if var_hi > 0 else math.nan,
        num_hi / var_lo if var_lo > 0 else math.inf,
    )
    for key, (lo, hi) in bounds.items():
        out[f"{key}_lo"], out[f"{key}_hi"] = lo, hi
    return out


def exact_metrics(moments: ExactMoments, grad_J) -> dict[str, float]:
    """Metrics of the exact path (bounds NaN)."""
    mean = moments.mean
    b = bias(mean, grad_J)
    out = {
        "bias": b,
        "bias_dir": bias_dir(mean, grad_J),
        "cosine": cosine(mean, grad_J),
        "variance": moments.variance,
        "mse": b**2 + moments.variance,
        "snr": snr(float(mean @ mean), moments.variance),
        "ess": moments.ess,
    }
    for key in BOUNDED_METRICS:
        out[f"{key}_lo"] = out[f"{key}_hi"] = math.nan
    return out


def _why_not_exact(est: Estimator, env=None, params: str = "untied") -> str:
    """Why ``est`` has no exact path on ``env`` ('' if it has one: enumeration or DP)."""
    reasons = []
    if est.mapping.batch_dependent:
        reasons.append(f"mapping {est.mapping.name!r} is batch dependent")
    if est.advantage not in PER_SAMPLE_ADVANTAGES:
        reasons.append(f"advantage {est.advantage!r} couples the samples of a group")
    reasons.extend(est.exact_obstacles())
    if env is not None:
        if est.aggregation == "token-mean" and not getattr(env, "fixed_length", True):
            reasons.append(
                "aggregation 'token-mean' divides by the batch's total number of tokens, which "
                "is random when lengths vary (eos)"
            )
        if not reasons and not _enumerable(env):
            if params != "untied":
                why_dp = "the moment DP is for untied parameters"
            elif est.correction is not None or est.denominator != "valid":
                why_dp = "the moment DP handles one ratio π/μ (no correction, denominator 'valid')"
            else:
                why_dp = dp_applies(env, est.mapping, est.aggregation)
            if why_dp:
                reasons.append(
                    f"the environment has {env.n_sequences} sequences, more than the enumeration "
                    f"budget, and {why_dp}"
                )
    return " and ".join(reasons)


def _enumerable(env) -> bool:
    enumerable = getattr(env, "enumerable", None)
    return enumerable is None or bool(enumerable())


# --- the runner -----------------------------------------------------------------------------

_RESERVED = (
    "estimator",
    "correction",
    "mode",
    "denominator",
    *legs.LEG_COLUMNS,
    "mapping",
    "aggregation",
    "advantage",
    "group_size",
    "adv_eps",
    "max_length",
    "T",
    "params",
    "n",
    "reps",
    *DIVERGENCE_COLUMNS,
    *BOUNDED_METRICS,
    "khat",
    "exact",
    "reliable",
    "tail_draws",
    *(f"{k}_{s}" for k in BOUNDED_METRICS for s in ("lo", "hi")),
)


def run(
    env,
    behaviour,
    estimators,
    n: int,
    reps: int = 1000,
    seed: int = 0,
    exact="auto",
    setting: dict | None = None,
    level: float = 0.95,
    n_boot: int = 1000,
    progress: bool | None = None,
    params: str = "untied",
    old=None,
) -> pd.DataFrame:
    """Bias / variance table of ``estimators`` for n-sample batches drawn from ``behaviour``.

    Parameters
    ----------
    env : environment (e.g. :class:`simkit.envs.Bandit`) with the target π and oracle ∇J.
    behaviour : (K,) probabilities, the behaviour policy μ (validated).
    estimators : list of :class:`~simkit.estimators.Estimator`, mappings or mapping names
        (a single one is accepted); their names must be distinct.
    n : batch size of the estimator (samples per gradient estimate).
    reps : Monte Carlo repetitions (independent batches, >= 2). Always drawn once: ``khat`` of
        exact rows is computed from these draws too.
    seed : seed of the ``SeedSequence`` (module docstring: common random numbers).
    exact : ``"auto"`` (exact for per-sample estimators, Monte Carlo for the others),
        ``True`` (exact for all; error naming those that cannot be), ``False`` (Monte Carlo).
    setting : dict of extra constant columns, e.g. ``{"divergence": "chi2", "target": 0.5}``.
    level : confidence level of the Monte Carlo bounds; ``n_boot``: bootstrap resamples.
    progress : show a tqdm bar over estimators (``None``: only when the work is long).
    params : ``"untied"`` (default: the gradient w.r.t. per-position parameters θ[t, …], the
        environment's D) or ``"tied"`` (w.r.t. one table shared by every position: every
        gradient — ĝ_r, E ĝ, ∇J — is the sum of its per-position blocks, :func:`tie`). The
        bandit has T = 1, where both are the same. Recorded in the ``params`` column.
    old : π_old's distribution (the shape of ``behaviour``), optional. Default None: π_old = π
        (no staleness; every table as without this argument). Composed estimators (an
        ``Estimator`` with a ``correction``) then see both legs, exactly wherever the path is
        exact; estimators without a correction ignore it. Adds the columns
        :data:`simkit.legs.LEG_COLUMNS` (χ²/KL of π‖π_old and π_old‖μ).

    Returns
    -------
    A tidy DataFrame, one row per estimator: ``estimator``, ``mapping``, ``aggregation``,
    ``advantage``, ``group_size``, ``adv_eps`` (grpo only), ``max_length`` (NaN where they do
    not apply), one column per mapping hyperparameter (NaN for mappings without it; prefixed
    ``hp_`` if the name clashes with a column), the ``setting`` columns, ``T``, ``params``,
    ``n``, ``reps``,
    ``chi2_tok`` … ``tv_seq``, the metrics (module docstring) with ``*_lo``/``*_hi`` bounds (NaN
    on exact rows), ``khat``, ``exact``, ``reliable`` (False when a Monte Carlo row's intervals
    cannot be trusted — heavy or unseen tails; always True on exact rows; the rule and its
    references are in :mod:`simkit.reliability`) and ``tail_draws`` (that rule's exact ν, the
    expected number of draws in the tail carrying E c̄²; NaN on exact rows and where it cannot
    be computed).
    """
    ests = _coerce_estimators(estimators)
    mu = env.check_policy(behaviour, "behaviour")
    n = _int_at_least(n, 1, "n")
    reps = _int_at_least(reps, 2, "reps")
    n_boot = _int_at_least(n_boot, 10, "n_boot")
    if not (isinstance(level, float | int) and 0 < level < 1):
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if exact not in ("auto", True, False):
        raise ValueError(f"exact must be 'auto', True or False, got {exact!r}")
    params = _check_params(params)
    setting = dict(setting or {})
    clash = sorted(set(setting) & set(_RESERVED))
    if clash:
        raise ValueError(f"setting keys {clash} clash with result columns; rename them")
    hp_names = {k for e in ests for k in e.mapping.hyperparameters}
    clash = sorted(set(setting) & hp_names)
    if clash:
        raise ValueError(f"setting keys {clash} clash with mapping hyperparameter columns")
    for est in ests:
        est.check_batch_size(n)
    if exact is True:
        why = {e.name: _why_not_exact(e, env, params) for e in ests}
        bad = [f"{name!r} ({reason})" for name, reason in why.items() if reason]
        if bad:
            raise ValueError(
                "exact=True but these estimators have no exact path: "
                + "; ".join(bad)
                + ". Use exact='auto' to run them by Monte Carlo."
            )
    use_exact = [exact is not False and not _why_not_exact(e, env, params) for e in ests]
    if old is not None and not _enumerable(env):  # the moment DP has no π_old leg
        use_exact = [False] * len(ests)

    check_samples(reps, n, env.T)  # the batches are drawn at once: refuse what cannot fit
    old_p = None if old is None else legs.check_old(env, old)
    # a third child for stochastic mappings (children 0 and 1 are those of spawn(2))
    draw_ss, boot_ss, coef_ss = np.random.SeedSequence(check_seed(seed)).spawn(3)
    batch = env.sample(mu, n, np.random.default_rng(draw_ss), reps=reps)
    old_lr = _old_log_ratio(env, old_p, mu, batch)
    leg_columns = {} if old_p is None else legs.leg_divergences(env, old_p, mu)
    boot_weights = None
    if not all(use_exact):
        boot_weights = _bootstrap_weights(reps, n_boot, np.random.default_rng(boot_ss))
    grad_J = env.grad_J()
    if params == "tied":
        grad_J = tie(grad_J, env.T)
    divergences = env.divergences(mu)

    if progress is None:
        work = reps * n * env.T * sum(not x for x in use_exact)
        progress = len(ests) > 1 and work > PROGRESS_THRESHOLD
    from tqdm.auto import tqdm

    rows = []
    for est, is_exact in tqdm(list(zip(ests, use_exact)), desc="estimators", disable=not progress):
        draws = sample_gradients(env, batch, est, old_lr, np.random.default_rng(coef_ss))
        if params == "tied":
            draws = MonteCarloDraws(tie(draws.gradients, env.T), draws.coefficients, draws.mask)
        if is_exact:
            metrics = exact_metrics(exact_moments(env, mu, est, n, params, old=old_p), grad_J)
            trusted, nu = True, math.nan
        else:
            metrics = monte_carlo_metrics(draws, grad_J, n, boot_weights, level)
            trusted, nu = _reliability(env, mu, est, draws.gradients, grad_J, n)
        coeff = np.abs(draws.coefficients[draws.mask])
        rows.append(
            {
                **_describe(est),
                **setting,
                "T": env.T,
                "params": params,
                "n": n,
                "reps": reps,
                **divergences,
                **leg_columns,
                **metrics,
                "khat": khat_of_weights(coeff),
                "exact": is_exact,
                "reliable": trusted,
                "tail_draws": nu,
            }
        )
    return _tidy(rows, ests, list(setting))


def _reliability(env, mu, est: Estimator, gradients, grad_J, n: int) -> tuple[bool, float]:
    """(``reliable``, ``tail_draws``) of a Monte Carlo row (:mod:`simkit.reliability`)."""
    g = np.asarray(gradients)
    dev_sq = np.sum((g - g.mean(axis=0)) ** 2, axis=1)
    err_sq = np.sum((g - grad_J) ** 2, axis=1)
    khat_err, share = reliability.draw_checks(dev_sq, err_sq)
    nu = reliability.tail_draws(env, mu, est, g.shape[0] * n, oracle_baseline(env, mu, est))
    return reliability.is_reliable(khat_err, share, nu), nu


def _coerce_estimators(estimators) -> list[Estimator]:
    if isinstance(estimators, Estimator | str) or not hasattr(estimators, "__iter__"):
        estimators = [estimators]
    ests = [as_estimator(e) for e in estimators]
    if not ests:
        raise ValueError("estimators is empty")
    names = [e.name for e in ests]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ValueError(f"estimator names must be distinct; repeated: {dup} (set name=...)")
    return ests


def _describe(est: Estimator) -> dict:
    return {
        "estimator": est.name,
        "mapping": est.mapping.name,
        "aggregation": est.aggregation,
        "advantage": est.advantage,
        "group_size": est.group_size if est.group_size is not None else math.nan,
        "adv_eps": est.adv_eps if est.advantage == "grpo" else math.nan,
        "max_length": est.max_length if est.max_length is not None else math.nan,
        **{("hp_" + k if k in _RESERVED else k): v for k, v in est.mapping.hyperparameters.items()},
        **_describe_composition(est),
    }


def _describe_composition(est: Estimator) -> dict:
    """``correction``, ``mode``, ``denominator`` columns, only for estimators that use them."""
    out = {}
    if est.correction is not None:
        out.update(correction=est.correction.label, mode=est.mode)
    if est.denominator != "valid":
        out["denominator"] = est.denominator
    return out


def _tidy(rows: list[dict], ests: list[Estimator], setting_cols: list[str]) -> pd.DataFrame:
    head = [
        "estimator",
        "mapping",
        "aggregation",
        "advantage",
        "group_size",
        "adv_eps",
        "max_length",
    ]
    hp_cols = []
    for est in ests:
        for k in est.mapping.hyperparameters:
            col = "hp_" + k if k in _RESERVED else k
            if col not in hp_cols:
                hp_cols.append(col)
    metric_cols = []
    for key in BOUNDED_METRICS:
        metric_cols += [key, f"{key}_lo", f"{key}_hi"]
    present = {k for row in rows for k in row}
    composition_cols = [k for k in ("correction", "mode", "denominator") if k in present]
    cols = [
        *head,
        *composition_cols,
        *hp_cols,
        *setting_cols,
        "T",
        "params",
        "n",
        "reps",
        *DIVERGENCE_COLUMNS,
        *[k for k in legs.LEG_COLUMNS if k in present],
        *metric_cols,
        "khat",
        "exact",
        "reliable",
        "tail_draws",
    ]
    return pd.DataFrame(rows).reindex(columns=cols)


def _int_at_least(value, low: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)
