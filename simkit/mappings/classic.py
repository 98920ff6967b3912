"""Section A of the notation page: classic importance sampling (the endpoints of the line).

naive REINFORCE (c = 1), token IS (c = r_t), sequence IS (c = W), power / tempered IS (W^α),
self-normalised IS, Pareto-smoothed IS and soft shrinkage (Metelli et al. 2021).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkit._validation import check_batch
from simkit.mappings.base import (
    DEFAULT_MAX_LOG_RATIO,
    Mapping,
    ScalarMapping,
    as_ratio,
    broadcast_seq,
    check_max_log_ratio,
    check_real,
    clamped_exp,
    log_of,
    map_blocks,
    register,
    seq_log_ratio,
)
from simkit.mappings.psis import psis_smooth


class _UnitRatioCurves:
    """φ(w) = F(w) = w: the curves of plain importance sampling."""

    def phi(self, w, positive=True):
        return as_ratio(w).copy()

    def f(self, w, positive=True):
        return as_ratio(w).copy()


@register
@dataclass(frozen=True)
class Naive(ScalarMapping):
    """On-policy REINFORCE (Williams 1992), ``c = 1``: ignores the mismatch (biased, lowest
    variance).

    Surrogate F(w) = 1 + log w (anchored at F(1) = 1: φ(u)/u = 1/u is not integrable at 0).
    """

    name = "naive"
    level = "token"
    ratio_kind = "token"

    def _coefficients(self, log_ratio, mask, advantages):
        return mask.astype(np.float64)

    def phi(self, w, positive=True):
        return np.ones_like(as_ratio(w))

    def f(self, w, positive=True):
        return 1.0 + log_of(as_ratio(w))


@register
@dataclass(frozen=True)
class TokenIS(_UnitRatioCurves, ScalarMapping):
    """Token importance sampling, ``c_t = r_t = exp(log_ratio_t)``; surrogate F(w) = w.

    The "first-order" approximation of sequence IS (VESPO, arXiv 2602.10693, App. A); biased
    through the state distribution (bias ~ T²·TV, Liu, Li et al. 2025 "rl-collapse").

    ``max_log_ratio`` (default 80, e^80 ≈ 5.5e34) clamps each token log-ratio from above before
    exponentiating so that the output stays finite.
    """

    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "is_token"
    level = "token"
    ratio_kind = "token"

    def __post_init__(self):
        check_max_log_ratio(self)

    def _coefficients(self, log_ratio, mask, advantages):
        cap = self.max_log_ratio

        def kernel(lr, out, tmp, rows):
            np.minimum(lr, cap, out=out)
            np.exp(out, out=out)

        return map_blocks(log_ratio, mask, kernel)


@register
@dataclass(frozen=True)
class SequenceIS(_UnitRatioCurves, ScalarMapping):
    """Sequence importance sampling, ``c_t = W = exp(Σ_t log r_t)`` on every token; F(w) = w.

    Unbiased for the sequence objective; Var grows like (1+χ²)^T (independent tokens:
    E_μ[W²] = Π_t (1+χ²_t)). ``max_log_ratio`` (default 80) clamps log W from above.
    """

    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "is_seq"
    level = "sequence"
    ratio_kind = "sequence"

    def __post_init__(self):
        check_max_log_ratio(self)

    def _coefficients(self, log_ratio, mask, advantages):
        return broadcast_seq(clamped_exp(seq_log_ratio(log_ratio, mask), self.max_log_ratio), mask)


@register
@dataclass(frozen=True)
class PowerIS(ScalarMapping):
    """Power (tempered) sequence IS, ``c_t = W^α``, α ∈ [0, 1].

    The classical knob between naive REINFORCE (α = 0) and full sequence IS (α = 1); computed
    as exp(α·min(log W, max_log_ratio)). Surrogate F(w) = w^α/α (F(0) = 0) for α > 0 and
    1 + log w (F(1) = 1) for α = 0. Default α = 0.5.
    """

    alpha: float = 0.5
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "power"
    level = "sequence"
    ratio_kind = "sequence"

    def __post_init__(self):
        check_real(self, "alpha", low=0.0, high=1.0)
        check_max_log_ratio(self)

    def _coefficients(self, log_ratio, mask, advantages):
        log_w = np.minimum(seq_log_ratio(log_ratio, mask), self.max_log_ratio)
        return broadcast_seq(np.exp(self.alpha * log_w), mask)

    def phi(self, w, positive=True):
        return np.power(as_ratio(w), self.alpha)

    def f(self, w, positive=True):
        w = as_ratio(w)
        if self.alpha == 0:
            return 1.0 + log_of(w)
        return np.power(w, self.alpha) / self.alpha


@register
@dataclass(frozen=True)
class SelfNormalisedIS(Mapping):
    """Self-normalised sequence IS, ``c_i = W_i / mean_j W_j`` (j over the N rows of the batch).

    The classical ratio estimator (e.g. Owen, "Monte Carlo theory, methods and examples", 2013,
    §9.2); no hyperparameters.

    Computed in log space: c_i = N·exp(log W_i − logsumexp_j log W_j), finite for any finite
    log-ratios. Bias O(1/N); the effective sample size collapse is visible as a few c_i ≈ N.
    A row without valid tokens is a sample with W = 1 and takes part in the mean.
    """

    name = "snis"
    level = "batch"
    batch_dependent = True

    def _coefficients(self, log_ratio, mask, advantages):
        N = log_ratio.shape[0]
        if N == 0:
            return np.zeros(log_ratio.shape)
        log_w = seq_log_ratio(log_ratio, mask)
        w = np.exp(log_w - log_w.max())
        return broadcast_seq(N * w / w.sum(), mask)


@register
@dataclass(frozen=True)
class ParetoSmoothedIS(Mapping):
    """Pareto-smoothed sequence IS: ``c_i = N·w̃_i`` with w̃ the PSIS-smoothed normalised W.

    Vehtari et al., "Pareto smoothed importance sampling", JMLR 2024 (arXiv 1507.02646); the
    smoothing is arviz-stats' (:func:`simkit.mappings.psis.psis_smooth`). The scale N·w̃ makes
    it a self-normalised estimator like :class:`SelfNormalisedIS` (c = 1 on-policy), with the
    largest ⌊3√N⌋ (N > 225) or ⌊N/5⌋ weights replaced by generalised-Pareto order statistics.
    Batches of fewer than 25 rows have no tail to fit and reduce to SNIS. The tail diagnostic
    k̂ of a batch is :meth:`khat` (or :func:`simkit.mappings.psis.psis_khat` of log W).
    """

    name = "psis"
    level = "batch"
    batch_dependent = True

    def _coefficients(self, log_ratio, mask, advantages):
        N = log_ratio.shape[0]
        if N == 0:
            return np.zeros(log_ratio.shape)
        log_smooth, _ = psis_smooth(seq_log_ratio(log_ratio, mask))
        return broadcast_seq(N * np.exp(log_smooth), mask)

    def khat(self, log_ratio, mask) -> float:
        """The PSIS Pareto k̂ of the batch's sequence weights W_i (see ``psis_smooth``).

        ``log_ratio``, ``mask`` (N, T) as for :meth:`coefficients`.
        """
        lr = np.asarray(log_ratio, dtype=np.float64)
        lr, m, _ = check_batch(lr, mask, np.zeros(lr.shape[0] if lr.ndim else 0))
        return psis_smooth(seq_log_ratio(lr, m))[1]


@register
@dataclass(frozen=True)
class SoftShrinkage(ScalarMapping):
    """Soft shrinkage of the sequence ratio, ``c = W / (1 − λ + λW)``, λ = ``lam`` ∈ [0, 1].

    Metelli, Russo & Restelli, "Subgaussian and differentiable importance sampling for
    off-policy evaluation and learning", NeurIPS 2021 (the "sub-Gaussian IPW" of the Open Bandit
    Pipeline). λ = 0 is sequence IS, λ = 1 naive REINFORCE; c ≤ 1/λ. The paper tunes λ ∝
    1/√(n·d₂); the default here is λ = 0.1. Computed stably in log space with log W clamped above
    at ``max_log_ratio``. Surrogate F(w) = log(1 + λw/(1−λ))/λ (F(0) = 0); F = w at λ = 0 and
    1 + log w (F(1) = 1) at λ = 1.
    """

    lam: float = 0.1
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "soft_shrink"
    level = "sequence"
    ratio_kind = "sequence"

    def __post_init__(self):
        check_real(self, "lam", low=0.0, high=1.0)
        check_max_log_ratio(self)

    def _shrink_log(self, log_w: np.ndarray) -> np.ndarray:
        lam = self.lam
        if lam == 1:
            return np.ones_like(log_w)
        e = np.exp(-np.abs(log_w))  # in [0, 1]
        # log W >= 0: 1 / (λ + (1−λ)e^{−log W});  log W < 0: e^{log W} / (λ e^{log W} + 1 − λ)
        with np.errstate(divide="ignore"):  # the branch not taken may divide by 0
            return np.where(log_w >= 0, 1.0 / (lam + (1.0 - lam) * e), e / (lam * e + 1.0 - lam))

    def _coefficients(self, log_ratio, mask, advantages):
        log_w = np.minimum(seq_log_ratio(log_ratio, mask), self.max_log_ratio)
        return broadcast_seq(self._shrink_log(log_w), mask)

    def phi(self, w, positive=True):
        w = as_ratio(w)
        return self._shrink_log(log_of(w)) if self.lam > 0 else w.copy()

    def f(self, w, positive=True):
        w = as_ratio(w)
        lam = self.lam
        if lam == 0:
            return w.copy()
        if lam == 1:
            return 1.0 + log_of(w)
        return np.log1p(lam * w / (1.0 - lam)) / lam
