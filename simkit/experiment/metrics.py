"""The metrics of an estimate against the exact gradient: one pure function per quantity.

``mean`` is E ĝ (D,), ``grad_J`` the exact ∇J (D,); :mod:`simkit.experiment` documents how the
exact and Monte Carlo paths feed them.
"""

from __future__ import annotations

import math

import numpy as np

#: metrics that carry ``*_lo``/``*_hi`` bounds on the Monte Carlo path
BOUNDED_METRICS = (
    "bias",
    "bias_dir",
    "cosine",
    "variance",
    "mse",
    "snr",
    "ess",
    "mse_scaled",
    "rel_mse_scaled",
    "kept",
    "kept_seq",
)
#: the scale-free error columns (:func:`scale_free`), in table order
SCALE_FREE_COLUMNS = ("mse_zero", "alpha_star", "mse_scaled", "rel_mse_scaled")
#: the kept-fraction columns (:func:`kept_fractions`)
KEPT_COLUMNS = ("kept", "kept_seq")


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
    (E W = 1, E W² = 1 + χ²; notation page section F), for naive (c = 1) it is n.
    """
    return n * abs_mean**2 / sq_mean if sq_mean > 0 else 0.0


def scale_free(mean, variance: float, grad_J) -> dict[str, float]:
    """The scale-free error of an estimator ĝ with E ĝ = ``mean`` (D,) and tr Var ĝ = ``variance``.

    An estimator that shrinks or drops samples can have a small MSE = E‖ĝ − ∇J‖² while carrying
    no signal: ĝ ≡ 0 has MSE ‖∇J‖². The error after the *best step size* (the one a
    learning-rate sweep would find) does not reward that:

        mse_zero       = ‖∇J‖²                                   (the error of ĝ ≡ 0)
        E‖ĝ‖²          = ‖E ĝ‖² + tr Var ĝ
        alpha_star     = ⟨E ĝ, ∇J⟩ / E‖ĝ‖²                       (argmin_α E‖αĝ − ∇J‖²)
        mse_scaled     = min_α E‖αĝ − ∇J‖² = ‖∇J‖² − ⟨E ĝ, ∇J⟩² / E‖ĝ‖²
        rel_mse_scaled = mse_scaled / mse_zero = 1 − cos²(E ĝ, ∇J) · snr / (1 + snr)  ∈ [0, 1]

    ``rel_mse_scaled`` is invariant to rescaling ĝ by any c ≠ 0, is 1 for an estimator no better
    than doing nothing (ĝ ≡ 0, or E ĝ ⟂ ∇J) and 0 only for a noiseless estimate along ∇J. It
    falls with n (snr ∝ n for a per-sample estimator) and with the alignment of E ĝ.
    ĝ ≡ 0 (E‖ĝ‖² = 0) gets alpha_star 0 and mse_scaled = mse_zero; ∇J = 0 gives
    rel_mse_scaled NaN. mse_scaled is clipped to [0, mse_zero] (rounding only).
    """
    mean, grad_J = _vectors(mean, grad_J)
    variance = float(variance)
    if not variance >= 0:
        raise ValueError(f"variance must be >= 0, got {variance!r}")
    zero = float(grad_J @ grad_J)
    inner = float(mean @ grad_J)
    second = float(mean @ mean) + variance
    if second > 0 and math.isfinite(second):
        alpha = inner / second
        scaled = min(max(zero - inner * alpha, 0.0), zero)
    else:  # ĝ ≡ 0, or an infinite second moment: no step size helps
        alpha, scaled = 0.0, zero
    return {
        "mse_zero": zero,
        "alpha_star": alpha,
        "mse_scaled": scaled,
        "rel_mse_scaled": scaled / zero if zero > 0 else math.nan,
    }


def kept_fractions(coefficients, mask, weights=None) -> dict[str, float]:
    """``kept`` and ``kept_seq``: how much of the data a mapping keeps.

    ``coefficients`` and ``mask`` (…, T) (the mapping's c and the valid tokens), ``weights``
    (…,) optional probabilities of the sequences (the atoms of an exact support; default: equal
    weights, a Monte Carlo batch):

        kept     = E_μ[#{t valid: c_t ≠ 0}] / E_μ[#{t valid}]   (share of valid tokens kept)
        kept_seq = P_μ(some valid c_t ≠ 0)                      (share of sequences kept)

    A ratio of expectations: the share of kept tokens in a large batch. 1 for mappings that
    never zero a coefficient; a mask or a rejection sampler keeps less (kl_rs that rejects every
    sequence has ``kept_seq`` = 0, and is ĝ ≡ 0). NaN when there is no valid token.
    """
    c = np.asarray(coefficients)
    m = np.asarray(mask, dtype=bool)
    if c.shape != m.shape or c.ndim < 1:
        raise ValueError(
            f"coefficients and mask must have the same shape (…, T), got {c.shape} and {m.shape}"
        )
    nonzero = (c != 0) & m
    kept_tok = nonzero.sum(axis=-1).astype(np.float64)
    valid = m.sum(axis=-1).astype(np.float64)
    any_kept = nonzero.any(axis=-1).astype(np.float64)
    if weights is None:
        w = np.full(valid.shape, 1.0 / max(valid.size, 1))
    else:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != valid.shape:
            raise ValueError(f"weights must have shape {valid.shape}, got {w.shape}")
    total = float(np.sum(w * valid))
    return {
        "kept": float(np.sum(w * kept_tok)) / total if total > 0 else math.nan,
        "kept_seq": float(np.sum(w * any_kept)) / float(np.sum(w)) if np.sum(w) > 0 else math.nan,
    }


def _vectors(mean, grad_J):
    mean = np.asarray(mean, dtype=np.float64)
    grad_J = np.asarray(grad_J, dtype=np.float64)
    if mean.ndim != 1 or mean.shape != grad_J.shape:
        raise ValueError(
            f"mean and grad_J must be vectors of the same shape (D,), got {mean.shape} and "
            f"{grad_J.shape}"
        )
    return mean, grad_J
