"""The metrics of an estimate against the exact gradient: one pure function per quantity.

``mean`` is E ĝ (D,), ``grad_J`` the exact ∇J (D,); :mod:`simkit.experiment` documents how the
exact and Monte Carlo paths feed them.
"""

from __future__ import annotations

import math

import numpy as np

#: metrics that carry ``*_lo``/``*_hi`` bounds on the Monte Carlo path
BOUNDED_METRICS = ("bias", "bias_dir", "cosine", "variance", "mse", "snr", "ess")


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
