"""Divergences between categorical distributions, sequence-level closed forms, Monte Carlo.

Conventions (``shared/DESIGN.md``): the *target* ``pi`` comes first, the *behaviour* ``mu``
second, and every divergence is ``D(π‖μ)`` with the ratio ``w = π/μ``:

- ``chi2(pi, mu)``  = Σ π²/μ − 1 = Var_μ(w)                        (Pearson χ²)
- ``kl(pi, mu)``    = Σ π log(π/μ) = E_μ[w log w]                   (forward KL, the project's)
- ``tv(pi, mu)``    = ½ Σ |π − μ| = ½ E_μ|w − 1|
- ``renyi(pi, mu, alpha)`` = log(Σ π^α μ^{1−α}) / (α − 1)          (Rényi 1961)
- ``hellinger(pi, mu)`` = H with H² = ½ Σ (√π − √μ)² = 1 − Σ √(π μ), so H ∈ [0, 1]

Exact functions take arrays of shape (…, V) (probabilities over the last axis, broadcasting
allowed over the leading axes) and return shape (…). ``μ = 0`` where ``π > 0`` gives ``inf``
(never NaN) for χ², KL and Rényi of order α ≥ 1; ``0·log 0 = 0``.

Sequence-level closed forms (``*_seq``) combine per-position values of *independent* positions
(product distributions π = ⊗π_t, μ = ⊗μ_t) along an axis. The Monte Carlo estimators (``*_mc``)
take log-ratios ``log_ratio = log π(y) − log μ(y)`` of samples ``y ~ μ`` along the last axis and
return an :class:`MCEstimate` (value and standard error from the same draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import kl_div, logsumexp

from simkit._validation import as_prob, as_real

__all__ = [
    "MCEstimate",
    "bhattacharyya",
    "chi2",
    "chi2_mc",
    "chi2_seq",
    "ess",
    "ess_fraction",
    "hellinger",
    "hellinger_seq",
    "kl",
    "kl_mc",
    "kl_seq",
    "renyi",
    "renyi_seq",
    "tv",
    "tv_mc",
    "tv_seq_bounds",
]

# |d| below which the KL term μ·h(d), h(d) = (1+d)log(1+d) − d, is summed as a power series
_KL_SERIES_CUTOFF = 0.1
# coefficients (−1)^k / (k(k−1)) of d^k, k = 2..21 (truncation error < 0.1^20/420 relative)
_KL_SERIES = np.array([(-1.0) ** k / (k * (k - 1)) for k in range(2, 22)])


# --- input checks ---------------------------------------------------------------------------


def _prob_pair(pi, mu) -> tuple[np.ndarray, np.ndarray]:
    """Validate ``pi`` and ``mu`` (…, V) and broadcast their leading axes together."""
    p = as_prob(pi, "pi")
    q = as_prob(mu, "mu")
    if p.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"shape mismatch: pi has {p.shape[-1]} categories (shape {p.shape}), "
            f"mu has {q.shape[-1]} (shape {q.shape}); the last axes must be equal"
        )
    try:
        shape = np.broadcast_shapes(p.shape, q.shape)
    except ValueError:
        raise ValueError(
            f"shape mismatch: pi has shape {p.shape} and mu has shape {q.shape}, whose leading "
            "axes do not broadcast"
        ) from None
    return np.broadcast_to(p, shape), np.broadcast_to(q, shape)


def _as_per_position(values, name: str, upper: float = np.inf) -> np.ndarray:
    """Per-position divergences: a float array with entries in [0, upper] (inf allowed)."""
    arr = as_real(values, name)
    if arr.ndim == 0:
        raise ValueError(f"{name} must have an axis of positions (shape (..., T)), got a scalar")
    if np.any(np.isnan(arr)):
        raise ValueError(f"{name} contains NaN")
    if np.any(arr < 0):
        raise ValueError(f"{name} must be >= 0, got a minimum of {arr.min():.6g}")
    if np.any(arr > upper):
        raise ValueError(f"{name} must be <= {upper:g}, got a maximum of {arr.max():.6g}")
    return arr


def _as_log_ratio(log_ratio, name: str = "log_ratio") -> np.ndarray:
    """Sample log-ratios (…, n), n ≥ 2; NaN and +inf rejected, −inf (ratio 0) allowed."""
    lr = as_real(log_ratio, name)
    if lr.ndim == 0:
        raise ValueError(f"{name} must have a last axis of samples (shape (..., n)), got a scalar")
    if lr.shape[-1] < 2:
        raise ValueError(
            f"{name} needs at least 2 samples along its last axis for a standard error, "
            f"got shape {lr.shape}"
        )
    if np.any(np.isnan(lr)):
        raise ValueError(f"{name} contains NaN")
    if np.any(lr == np.inf):
        raise ValueError(f"{name} contains +inf: a sample y ~ μ with μ(y) = 0 is impossible")
    return lr


# --- exact divergences ----------------------------------------------------------------------


def chi2(pi, mu) -> np.ndarray:
    """Pearson χ² divergence χ²(π‖μ) = Σ π²/μ − 1 = Var_μ(π/μ) over the last axis.

    Computed as Σ (π − μ)²/μ (equal for normalised inputs), which keeps tiny divergences
    accurate to relative rounding error. ``inf`` when μ = 0 where π > 0.
    Reference: Pearson (1900); the IS variance identity E_μ[w²] = 1 + χ² (e.g. Owen, "Monte
    Carlo theory, methods and examples", ch. 9).

    pi, mu: (…, V) probabilities (leading axes broadcast). Returns (…).
    """
    return _chi2_raw(*_prob_pair(pi, mu))


def _chi2_raw(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """χ² of already validated, same-shape arrays (the kernel of :func:`chi2`)."""
    diff = p - q
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        terms = np.where(q > 0, diff * diff / q, np.where(p > 0, np.inf, 0.0))
    return terms.sum(axis=-1)


def _kl_terms(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Per-category π log(π/μ) − π + μ ≥ 0 (their sum is KL for normalised inputs).

    With d = (π − μ)/μ the term is μ·h(d), h(d) = (1+d)·log(1+d) − d = Σ_{k≥2} (−1)^k d^k/(k(k−1));
    the series is used for |d| < 0.1, where the closed form would cancel.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = np.where(q > 0, (p - q) / q, 0.0)
    small = (q > 0) & (np.abs(d) < _KL_SERIES_CUTOFF)
    d = np.where(small, d, 0.0)
    series = np.zeros_like(d)
    for c in _KL_SERIES[::-1]:  # Horner on h(d)/d² = Σ c_k d^{k-2}
        series = series * d + c
    series = q * d * d * series
    return np.where(small, series, kl_div(p, q))  # kl_div: inf if μ = 0 < π, 0 if both are 0


def kl(pi, mu) -> np.ndarray:
    """Kullback–Leibler divergence KL(π‖μ) = Σ π log(π/μ) over the last axis (nats).

    ``0·log 0 = 0``; ``inf`` when μ = 0 where π > 0. Summed as Σ [π log(π/μ) − π + μ] with
    non-negative terms (the −π + μ parts add to zero), each evaluated without cancellation, so
    tiny divergences are accurate (KL ≈ χ²/2). Reference: Kullback & Leibler (1951).

    pi, mu: (…, V) probabilities (leading axes broadcast). Returns (…).
    """
    return _kl_raw(*_prob_pair(pi, mu))


def _kl_raw(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL of already validated, same-shape arrays (the kernel of :func:`kl`)."""
    return _kl_terms(p, q).sum(axis=-1)


def tv(pi, mu) -> np.ndarray:
    """Total variation distance TV(π, μ) = ½ Σ |π − μ| ∈ [0, 1] over the last axis.

    pi, mu: (…, V) probabilities (leading axes broadcast). Returns (…).
    """
    return _tv_raw(*_prob_pair(pi, mu))


def _tv_raw(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """TV of already validated, same-shape arrays (the kernel of :func:`tv`)."""
    return 0.5 * np.abs(p - q).sum(axis=-1)


def bhattacharyya(pi, mu) -> np.ndarray:
    """Bhattacharyya coefficient (Hellinger affinity) BC(π, μ) = Σ √(π μ) ∈ [0, 1].

    BC = 1 − H² with the Hellinger normalisation of :func:`hellinger`. Reference:
    Bhattacharyya (1943). pi, mu: (…, V). Returns (…).
    """
    p, q = _prob_pair(pi, mu)
    return np.sqrt(p * q).sum(axis=-1)


def hellinger(pi, mu) -> np.ndarray:
    """Hellinger distance H(π, μ) with H² = ½ Σ (√π − √μ)² = 1 − BC, so H ∈ [0, 1].

    With this normalisation H² ≤ TV ≤ H·√(2 − H²) ≤ √2·H (Le Cam 1973; Tsybakov,
    "Introduction to nonparametric estimation", Lemma 2.3). Each (√π − √μ) is evaluated as
    (π − μ)/(√π + √μ) so that small distances are accurate.

    pi, mu: (…, V) probabilities (leading axes broadcast). Returns (…).
    """
    p, q = _prob_pair(pi, mu)
    denom = np.sqrt(p) + np.sqrt(q)
    with np.errstate(divide="ignore", invalid="ignore"):
        root_diff = np.where(denom > 0, (p - q) / denom, 0.0)
    return np.sqrt(0.5 * np.sum(root_diff * root_diff, axis=-1))


def renyi(pi, mu, alpha: float) -> np.ndarray:
    """Rényi divergence of order α: D_α(π‖μ) = log(Σ π^α μ^{1−α}) / (α − 1)  (Rényi 1961).

    - α ∈ [0, ∞] (α = 0: −log μ(supp π)); D_α is non-decreasing in α (van Erven & Harremoës,
      "Rényi divergence and Kullback–Leibler divergence", IEEE T-IT 2014, Thm 3).
    - α = 1 is the limit KL(π‖μ) (computed by :func:`kl`); α = 2 gives log(1 + χ²);
      α = ∞ gives log max_{π>0} π/μ.
    - ``inf`` for α ≥ 1 when μ = 0 where π > 0 (for α < 1 such categories contribute nothing).

    The sum is evaluated by log-sum-exp over the support of π, so its absolute accuracy is
    about 1e-16/|α − 1|: relative accuracy degrades for divergences below ~1e-8 (the result
    is clipped at 0, below which only rounding noise lies).

    pi, mu: (…, V) probabilities (leading axes broadcast); alpha: a scalar. Returns (…).
    """
    alpha = float(alpha)
    if np.isnan(alpha) or alpha < 0:
        raise ValueError(f"alpha must be in [0, inf], got {alpha}")
    if alpha == 1.0:
        return kl(pi, mu)
    p, q = _prob_pair(pi, mu)
    support = p > 0
    with np.errstate(divide="ignore"):
        log_p = np.log(p)
        log_q = np.log(q)
    if alpha == np.inf:
        with np.errstate(invalid="ignore"):
            log_ratio = np.where(support, log_p - log_q, -np.inf)
        return np.maximum(np.max(log_ratio, axis=-1), 0.0)
    if alpha == 0.0:
        return np.maximum(-logsumexp(np.where(support, log_q, -np.inf), axis=-1), 0.0)
    with np.errstate(invalid="ignore"):
        # α log π + (1−α) log μ on the support of π; (1−α)·(−inf) is ±inf as it should be
        exponent = np.where(support, alpha * log_p + (1.0 - alpha) * log_q, -np.inf)
    # D_α ≥ 0 for normalised inputs: clip the rounding noise of log-sum-exp at π = μ
    return np.maximum(logsumexp(exponent, axis=-1) / (alpha - 1.0), 0.0)


# --- sequence-level closed forms for independent positions -----------------------------------


def chi2_seq(chi2_tok, axis: int = -1) -> np.ndarray:
    """χ² of a product of independent positions: 1 + χ²_seq = Π_t (1 + χ²_t).

    Because E_μ[W²] = Π_t E_{μ_t}[w_t²] for W = Π_t w_t with independent factors (reference
    sheet §A/§F; rl-collapse, Liu, Li et al. 2025). Computed as expm1(Σ log1p(χ²_t)).

    chi2_tok: (…, T, …) per-position χ² ≥ 0 (inf allowed); reduced along ``axis``.
    """
    c = _as_per_position(chi2_tok, "chi2_tok")
    with np.errstate(over="ignore"):
        return np.expm1(np.log1p(c).sum(axis=axis))


def kl_seq(kl_tok, axis: int = -1) -> np.ndarray:
    """KL of a product of independent positions: KL_seq = Σ_t KL_t (chain rule; Cover & Thomas,
    "Elements of information theory", Thm 2.5.3).

    kl_tok: (…, T, …) per-position KL ≥ 0 (inf allowed); reduced along ``axis``.
    """
    return _as_per_position(kl_tok, "kl_tok").sum(axis=axis)


def renyi_seq(renyi_tok, axis: int = -1) -> np.ndarray:
    """Rényi divergence (one order α for all positions) of a product: D_α,seq = Σ_t D_α,t
    (additivity; van Erven & Harremoës 2014, Thm 28).

    renyi_tok: (…, T, …) per-position D_α ≥ 0 (inf allowed); reduced along ``axis``.
    """
    return _as_per_position(renyi_tok, "renyi_tok").sum(axis=axis)


def hellinger_seq(hellinger_tok, axis: int = -1) -> np.ndarray:
    """Hellinger distance of a product: the affinity is multiplicative, BC_seq = Π_t BC_t, so
    H_seq = √(1 − Π_t (1 − H_t²)) (normalisation H² = 1 − BC of :func:`hellinger`; Le Cam &
    Yang, "Asymptotics in statistics", §2.4).

    hellinger_tok: (…, T, …) per-position H ∈ [0, 1]; reduced along ``axis``.
    """
    h = _as_per_position(hellinger_tok, "hellinger_tok", upper=1.0)
    with np.errstate(divide="ignore"):
        log_bc = np.log1p(-(h * h)).sum(axis=axis)
    return np.sqrt(-np.expm1(log_bc))


def tv_seq_bounds(
    tv_tok, hellinger_tok=None, kl_tok=None, chi2_tok=None, axis: int = -1
) -> tuple[np.ndarray, np.ndarray]:
    """Bounds ``(lo, hi)`` on the TV distance between products of independent positions.

    TV of a product has no closed form in the per-position TVs; these inequalities hold for any
    product π = ⊗π_t, μ = ⊗μ_t (H² = 1 − BC as in :func:`hellinger`):

    lower bounds
      - max_t TV_t: data processing, the marginal of position t is a function of the sequence.
      - 1 − Π_t √(1 − TV_t²): TV_seq ≥ H²_seq = 1 − Π_t BC_t (Le Cam 1973) and
        BC_t ≤ √(1 − TV_t²) (Le Cam's inequality TV ≤ √(1 − BC²); Tsybakov 2009, Lemma 2.3).
      - 1 − Π_t BC_t itself when ``hellinger_tok`` is given.
    upper bounds
      - 1 − Π_t (1 − TV_t) ≤ min(1, Σ_t TV_t): couple each position maximally and
        independently; the sequences differ only if some position does (coupling inequality,
        Lindvall, "Lectures on the coupling method", §I.2). Note that 1 − Π(1 − TV_t) is an
        *upper* bound, not a lower one (two Bernoulli(0.5) vs Bernoulli(0.6) positions: TV_t =
        0.1, 1 − 0.9² = 0.19 > TV_seq = 0.11).
      - √(1 − BC_seq²) with BC_seq = Π_t BC_t (Le Cam), when ``hellinger_tok`` is given.
      - min(√(KL_seq/2), √(1 − exp(−KL_seq))) with KL_seq = Σ_t KL_t (Pinsker; Bretagnolle &
        Huber 1979), when ``kl_tok`` is given.
      - √(1 − 1/(1 + χ²_seq)) with 1 + χ²_seq = Π_t(1 + χ²_t) (Bretagnolle–Huber with
        KL ≤ log(1 + χ²)), when ``chi2_tok`` is given.

    tv_tok (and the optional per-position arrays, same shape): (…, T, …), reduced along
    ``axis``. Returns two arrays of the reduced shape with lo ≤ TV_seq ≤ hi.
    """
    t = _as_per_position(tv_tok, "tv_tok", upper=1.0)
    lo = np.max(t, axis=axis)
    with np.errstate(divide="ignore"):
        log_bc_from_tv = 0.5 * np.log1p(-(t * t)).sum(axis=axis)
        lo = np.maximum(lo, -np.expm1(log_bc_from_tv))
        hi = np.minimum(1.0, -np.expm1(np.log1p(-t).sum(axis=axis)))

    def _same(values, name, upper=np.inf):
        arr = _as_per_position(values, name, upper=upper)
        if arr.shape != t.shape:
            raise ValueError(f"shape mismatch: tv_tok has shape {t.shape}, {name} has {arr.shape}")
        return arr

    if hellinger_tok is not None:
        h = _same(hellinger_tok, "hellinger_tok", upper=1.0)
        with np.errstate(divide="ignore"):
            log_bc = np.log1p(-(h * h)).sum(axis=axis)
        lo = np.maximum(lo, -np.expm1(log_bc))
        hi = np.minimum(hi, np.sqrt(-np.expm1(2.0 * log_bc)))
    if kl_tok is not None:
        k = _same(kl_tok, "kl_tok").sum(axis=axis)
        hi = np.minimum(hi, np.sqrt(0.5 * k))
        hi = np.minimum(hi, np.sqrt(-np.expm1(-k)))
    if chi2_tok is not None:
        log1p_chi2 = np.log1p(_same(chi2_tok, "chi2_tok")).sum(axis=axis)
        hi = np.minimum(hi, np.sqrt(-np.expm1(-log1p_chi2)))
    return lo, hi


# --- Monte Carlo estimators from log-ratios of samples y ~ μ -----------------------------------


@dataclass(frozen=True)
class MCEstimate:
    """A Monte Carlo estimate: ``value`` (sample mean) and its standard error ``se`` (sample
    standard deviation / √n, from the same draws). Scalars or arrays of the same shape."""

    value: float | np.ndarray
    se: float | np.ndarray

    def ci(self, z: float = 1.96) -> tuple[float | np.ndarray, float | np.ndarray]:
        """Normal-approximation interval (value − z·se, value + z·se)."""
        if not z >= 0:
            raise ValueError(f"z must be >= 0, got {z}")
        return self.value - z * self.se, self.value + z * self.se


def _mean_se(samples: np.ndarray) -> MCEstimate:
    """Mean and standard error over the last axis; rows holding +inf give (inf, inf)."""
    n = samples.shape[-1]
    infinite = np.any(np.isposinf(samples), axis=-1)
    finite = np.where(np.isposinf(samples), 0.0, samples)
    value = finite.mean(axis=-1)
    se = finite.std(axis=-1, ddof=1) / np.sqrt(n)
    value = np.where(infinite, np.inf, value)
    se = np.where(infinite, np.inf, se)
    if value.ndim == 0:
        return MCEstimate(float(value), float(se))
    return MCEstimate(value, se)


def chi2_mc(log_ratio) -> MCEstimate:
    """Unbiased Monte Carlo estimate of χ²(π‖μ) = E_μ[w²] − 1 from ``y ~ μ``.

    Samples w_i² = exp(2·log_ratio_i) are averaged after factoring out their largest value
    (log-space scaling), so the result overflows only when the estimate itself exceeds the
    float range (then ``inf``). SE = sd(w²)/√n from the same draws.

    log_ratio: (…, n) log π(y) − log μ(y), samples along the last axis. Returns values of shape (…).
    """
    lr = _as_log_ratio(log_ratio)
    n = lr.shape[-1]
    two_lr = 2.0 * lr
    peak = np.max(two_lr, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)  # every sample −inf: all w² are 0
    scaled = np.exp(two_lr - peak)
    scale = np.squeeze(peak, axis=-1)
    with np.errstate(over="ignore"):
        factor = np.exp(scale)
        value = factor * scaled.mean(axis=-1) - 1.0
        se = factor * scaled.std(axis=-1, ddof=1) / np.sqrt(n)
    if np.ndim(value) == 0:
        return MCEstimate(float(value), float(se))
    return MCEstimate(value, se)


_KL_ESTIMATORS = ("k1", "k2", "k3")
_KL_DIRECTIONS = ("forward", "reverse")


def kl_mc(log_ratio, estimator: str = "k3", direction: str = "forward") -> MCEstimate:
    """Monte Carlo KL estimates from log-ratios ``log w = log π(y) − log μ(y)`` with ``y ~ μ``.

    ``direction="forward"`` estimates KL(π‖μ) = E_μ[w log w], the project's convention
    (:func:`kl`). ``direction="reverse"`` estimates KL(μ‖π) = E_μ[−log w], the quantity RL
    trainers log. Per-sample terms (Schulman 2020, "Approximating KL divergence"; its
    r = π/μ is our w, and its estimators with y ~ μ target KL(μ‖π)):

    ============  ======================  ==============================================
    estimator     reverse, KL(μ‖π)        forward, KL(π‖μ) (the same, importance weighted
                                          with w and applied to the ratio μ/π = 1/w)
    ============  ======================  ==============================================
    ``"k1"``      −log w                  w log w
    ``"k2"``      ½ (log w)²              ½ w (log w)²
    ``"k3"``      (w − 1) − log w         w log w − w + 1   (control variate E_μ[w − 1] = 0)
    ============  ======================  ==============================================

    k1 and k3 are unbiased (k3 has non-negative samples and usually less variance near
    μ = π); k2 is *biased*: it is unbiased for E_μ[½(log w)²] (reverse) or
    E_π[½(log w)²] (forward), which agree with the KL to second order in log w.
    Forward terms with log w > ~709 overflow to ``inf`` (then value and se are ``inf``).

    log_ratio: (…, n), samples along the last axis. Returns values of shape (…).
    """
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {_KL_ESTIMATORS}, got {estimator!r}")
    if direction not in _KL_DIRECTIONS:
        raise ValueError(
            f"direction must be 'forward' (KL(π‖μ)) or 'reverse' (KL(μ‖π)), got {direction!r}"
        )
    lr = _as_log_ratio(log_ratio)
    with np.errstate(over="ignore", invalid="ignore"):
        if direction == "reverse":
            if estimator == "k1":
                samples = -lr
            elif estimator == "k2":
                samples = 0.5 * lr * lr
            else:  # (w − 1) − log w = expm1(lr) − lr; −inf (w = 0) gives +inf
                samples = np.where(np.isneginf(lr), np.inf, np.expm1(lr) - lr)
        else:
            w = np.exp(lr)
            finite_lr = np.where(np.isneginf(lr), 0.0, lr)  # w = 0 ⇒ w·log w = 0
            w_log_w = np.where(np.isneginf(lr), 0.0, w * finite_lr)
            if estimator == "k1":
                samples = w_log_w
            elif estimator == "k2":
                samples = np.where(np.isneginf(lr), 0.0, 0.5 * w * finite_lr * finite_lr)
            else:  # w log w − w + 1 = w (log w − 1) + 1, ≥ 0
                samples = np.where(np.isposinf(w_log_w), np.inf, w_log_w - np.expm1(lr))
    return _mean_se(samples)


def tv_mc(log_ratio) -> MCEstimate:
    """Unbiased Monte Carlo estimate of TV(π, μ) = ½ E_μ|w − 1| from ``y ~ μ``.

    log_ratio: (…, n), samples along the last axis. Returns values of shape (…).
    """
    lr = _as_log_ratio(log_ratio)
    with np.errstate(over="ignore"):
        samples = 0.5 * np.abs(np.expm1(lr))
    return _mean_se(samples)


def ess(log_w) -> np.ndarray:
    """Kish effective sample size ESS = (Σ w)² / Σ w² ∈ [1, n] of importance weights.

    Computed in log space as exp(2·logsumexp(log w) − logsumexp(2 log w)), so unnormalised
    and huge log-weights are fine. For independent weights with E[w] = 1, ESS ≈ n/(1 + χ²)
    (Kish 1965; notation page §F). A row whose weights are all zero gives 0.

    log_w: (…, n) log-weights along the last axis (−inf allowed). Returns (…).
    """
    lw = _as_log_ratio(log_w, "log_w")
    all_zero = np.all(np.isneginf(lw), axis=-1)
    safe = np.where(all_zero[..., None], 0.0, lw)
    value = np.exp(2.0 * logsumexp(safe, axis=-1) - logsumexp(2.0 * safe, axis=-1))
    value = np.where(all_zero, 0.0, value)
    return float(value) if np.ndim(value) == 0 else value


def ess_fraction(log_w) -> np.ndarray:
    """ESS / n ∈ [1/n, 1] (0 when every weight is zero). log_w: (…, n). Returns (…)."""
    lw = _as_log_ratio(log_w, "log_w")
    return ess(lw) / lw.shape[-1]
