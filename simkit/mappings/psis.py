"""Pareto-smoothed importance sampling (PSIS) of a batch of log-weights, via arviz-stats.

Vehtari, Simpson, Gelman, Yao & Gabry, "Pareto smoothed importance sampling", JMLR 25 (2024),
arXiv 1507.02646: the M largest weights (M = ⌊3√S⌋ when S > 225, ⌊S/5⌋ otherwise) are replaced
by the expected order statistics of a generalised Pareto distribution fitted to them; the fitted
shape k̂ diagnoses the tail (k̂ < 0.5: finite variance; 0.5–0.7: usable; > 0.7: unreliable).

The smoothing itself is arviz-stats' ``array_stats.psislw``. Careful: that function follows the
PSIS-LOO convention and smooths the weights exp(−ary) (its input is a log-*likelihood*), so the
log-weights are passed negated. arviz-stats is imported lazily (importing it takes ~1 s).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

#: fewest tail draws arviz-stats fits a generalised Pareto to
MIN_TAIL_DRAWS = 5


def psis_tail_length(n: int) -> int:
    """Number of largest weights PSIS smooths out of ``n`` draws (relative efficiency 1)."""
    return math.floor(3 * math.sqrt(n)) if n > 225 else n // 5


def _log_softmax(log_w: np.ndarray) -> np.ndarray:
    return log_w - (np.max(log_w) + np.log(np.sum(np.exp(log_w - np.max(log_w)))))


def _check_log_weights(log_w) -> np.ndarray:
    lw = np.asarray(log_w, dtype=np.float64)
    if lw.ndim != 1:
        raise ValueError(f"log_w must have shape (S,), got shape {lw.shape}")
    if lw.size == 0:
        raise ValueError("log_w is empty: PSIS needs at least one draw")
    if not np.all(np.isfinite(lw)):
        raise ValueError("log_w contains non-finite values")
    return lw


def psis_smooth(log_w) -> tuple[np.ndarray, float]:
    """Pareto-smoothed, normalised log-weights and the tail shape k̂.

    ``log_w`` (S,) finite log importance weights. Returns ``(log_w_smooth (S,), khat)`` with
    Σ exp(log_w_smooth) = 1. Where no tail can be fitted the weights are only normalised:
    fewer than 25 draws (under 5 tail draws) gives k̂ = +inf (unreliable, nothing to diagnose);
    a tail whose values are all equal (bounded weights, e.g. all equal on-policy) gives k̂ = −inf;
    a degenerate fit (non-finite smoothed weights, e.g. when one weight exceeds the rest of the
    tail by a factor e^1000) leaves the weights unsmoothed and gives k̂ = +inf.
    """
    lw = _check_log_weights(log_w)
    tail = psis_tail_length(lw.size)
    if tail < MIN_TAIL_DRAWS:
        return _log_softmax(lw), math.inf
    top = np.partition(lw, lw.size - tail)[lw.size - tail :]
    if top.max() - top.min() < np.finfo(float).tiny or np.ptp(np.exp(top - top.max())) == 0:
        return _log_softmax(lw), -math.inf
    from arviz_stats.base import array_stats  # lazy: importing arviz-stats takes ~1 s

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        smoothed, khat = array_stats.psislw(-lw, r_eff=1)
    smoothed = np.asarray(smoothed, dtype=np.float64)
    if not np.all(np.isfinite(smoothed)):
        # degenerate fit (e.g. the tail is one weight larger than the others by e^1000)
        return _log_softmax(lw), math.inf
    return smoothed, float(khat)


def psis_khat(log_w) -> float:
    """The PSIS Pareto k̂ of the weights exp(``log_w``) (S,); see :func:`psis_smooth`."""
    return psis_smooth(log_w)[1]
