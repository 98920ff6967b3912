"""Shared input checks. Every error names the offending argument and what was expected."""

from __future__ import annotations

import numpy as np

PROB_ATOL = 1e-9


def as_prob(p, name: str) -> np.ndarray:
    """Return ``p`` as a float64 array of probabilities over the last axis.

    Raises ``ValueError`` if it has no last axis, contains negative / non-finite entries, or
    does not sum to one (within ``PROB_ATOL``) along the last axis.
    """
    arr = np.asarray(p, dtype=np.float64)
    if arr.ndim == 0:
        raise ValueError(
            f"{name} must have a last axis of categories (shape (..., V)), got a scalar"
        )
    if arr.shape[-1] == 0:
        raise ValueError(f"{name} has an empty last axis (V = 0)")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite entries")
    if np.any(arr < 0):
        raise ValueError(f"{name} contains negative probabilities (min {arr.min():.3g})")
    sums = arr.sum(axis=-1)
    bad = np.abs(sums - 1.0) > PROB_ATOL * max(1, arr.shape[-1])
    if np.any(bad):
        worst = sums.flat[int(np.argmax(np.abs(sums - 1.0)))]
        raise ValueError(
            f"{name} is not normalised over its last axis: a row sums to {worst:.12g}, expected 1"
        )
    return arr


def same_shape(a: np.ndarray, b: np.ndarray, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {name_a} has shape {a.shape}, {name_b} has {b.shape}")


def check_batch(log_ratio, mask, advantages):
    """Validate the (N, T) / (N, T) / (N,) triple that every mapping receives.

    Returns ``(log_ratio float64 (N,T), mask bool (N,T), advantages float64 (N,))``.
    """
    lr = np.asarray(log_ratio, dtype=np.float64)
    if lr.ndim != 2:
        raise ValueError(f"log_ratio must have shape (N, T), got shape {lr.shape}")
    m = np.asarray(mask)
    if m.shape != lr.shape:
        raise ValueError(f"shape mismatch: log_ratio has shape {lr.shape}, mask has {m.shape}")
    m = m.astype(bool, copy=False)
    adv = np.asarray(advantages, dtype=np.float64)
    if adv.shape != (lr.shape[0],):
        raise ValueError(
            f"advantages must have shape (N,) = ({lr.shape[0]},), got shape {adv.shape}"
        )
    return lr, m, adv
