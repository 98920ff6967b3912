"""Covariance-targeted PPO variants: Clip-Cov and KL-Cov (entropy-mechanism regularisers).

Cui et al., "The entropy mechanism of reinforcement learning for reasoning language models",
arXiv 2505.22617, §4: the entropy change is driven by the token covariance
cov_t = (A_t − mean A)·(log π_t − mean log π) (means over the batch's valid tokens); a few
high-covariance tokens are detached (Clip-Cov) or KL-penalised (KL-Cov). Formulas from verl
``verl/trainer/ppo/core_algos.py`` at commit b178a3c (``compute_policy_loss_clip_cov``,
``compute_policy_loss_kl_cov``, adapted there from PRIME-RL/Entropy-Mechanism-of-RL).

Both read more than the sign of A (the covariance uses its value) and, in a trainer, log π
itself: ``coefficients`` takes the optional keyword ``log_prob`` (N, T); without it the
log-ratio stands in for log π (the simulator's batches carry log π − log μ only; the centred
log π and the centred log-ratio differ by the centred log μ). Both are batch dependent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simkit._validation import check_batch
from simkit.mappings.base import (
    DEFAULT_MAX_LOG_RATIO,
    Mapping,
    check_max_log_ratio,
    check_real,
    positive_rows,
    register,
    safe_log,
)


def token_covariance(advantages, log_prob, mask) -> np.ndarray:
    """cov_t = (A_i − mean A)(log π_t − mean log π), means over valid tokens; −inf on padding.

    ``advantages`` (N,), ``log_prob`` (N, T), ``mask`` (N, T) bool (verl's ``cov_all``).
    """
    n = mask.sum(axis=1)
    total = int(n.sum())
    if total == 0:
        return np.full(mask.shape, -np.inf)
    mean_a = float(advantages @ n) / total
    mean_lp = float(np.add.reduce(log_prob, axis=None, where=mask, initial=0.0)) / total
    with np.errstate(invalid="ignore", over="ignore"):
        cov = (advantages - mean_a)[:, None] * (log_prob - mean_lp)
    return np.where(mask, cov, -np.inf)


def _inputs(log_ratio, mask, advantages, log_prob):
    lr, m, adv = check_batch(log_ratio, mask, advantages)
    if log_prob is None:
        return lr, m, adv, lr
    lp = np.asarray(log_prob, dtype=np.float64)
    if lp.shape != lr.shape:
        raise ValueError(f"log_prob must have the shape of log_ratio {lr.shape}, got {lp.shape}")
    return lr, m, adv, np.where(m, lp, 0.0)


def _as_rng(rng) -> np.random.Generator:
    if rng is None:
        return np.random.default_rng(0)
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, int | np.integer) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy Generator, an int seed or None, got {type(rng).__name__}")


def clip_cov_selection(cov, candidates, ratio: float, rng) -> np.ndarray:
    """Flat indices (row-major) of the tokens Clip-Cov detaches.

    verl: ``clip_num = max(int(ρ·#valid), 1)`` tokens drawn without replacement, uniformly,
    among the candidates (row-major order of ``torch.nonzero``; verl permutes them with
    ``torch.randperm``); here ``rng.choice(#candidates, min(clip_num, #candidates),
    replace=False)`` picks the positions in the candidate list (the same law). ``cov`` (−inf on
    padding) gives the number of valid tokens.
    """
    idx = np.flatnonzero(candidates)
    if idx.size == 0:
        return idx
    n_valid = int(np.count_nonzero(np.isfinite(cov)))
    return idx[draw_subset(rng, idx.size, max(int(ratio * n_valid), 1))]


def draw_subset(rng, n: int, k: int) -> np.ndarray:
    """min(k, n) distinct positions in [0, n), uniformly (``Generator.choice`` without
    replacement): the one random draw of Clip-Cov, shared by the numpy and torch versions."""
    return _as_rng(rng).choice(n, size=min(k, n), replace=False)


def top_k_first(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest ``values`` (1-D), ties at the k-th value broken by position
    (first first), in O(n): a partition for the k-th largest, then the ties in order."""
    n = values.size
    k = min(k, n)
    if k == 0:
        return np.zeros(0, dtype=np.intp)
    kth = np.partition(values, n - k)[n - k]
    above = np.flatnonzero(values > kth)
    ties = np.flatnonzero(values == kth)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


def kl_cov_selection(cov, mask, ratio: float) -> np.ndarray:
    """Flat indices of the k = max(1, ⌊ρ·#valid⌋) valid tokens of largest covariance.

    verl uses ``torch.topk``; ties at the k-th value here go to the first in row-major order
    (:func:`top_k_first`).
    """
    valid = np.flatnonzero(mask)
    if valid.size == 0:
        return valid
    k = max(1, int(valid.size * ratio))
    return valid[top_k_first(cov.reshape(-1)[valid], k)]


def _check_ratio(owner, field: str = "ratio") -> None:
    check_real(owner, field, low=0.0, high=1.0, low_open=True)


@register
@dataclass(frozen=True)
class ClipCov(Mapping):
    """Clip-Cov: PPO clip, plus a random fraction ρ of the high-covariance tokens detached.

    Cui et al. 2025 (arXiv 2505.22617), verl ``compute_policy_loss_clip_cov`` (b178a3c):
    candidates are the valid tokens PPO did not clip (verl's ``clip_by_origin``: A > 0 and
    r > 1+ε_high, or A < 0 and r < 1−ε_low) with lb < cov_t < ub; ``max(⌊ρ·#valid⌋, 1)`` of
    them, drawn uniformly without replacement, get c = 0; every other token has PPO's
    c = r·1[r in the band for the sign of A]. ρ = ``ratio`` ∈ (0, 1] (2e-4), lb = 1, ub = 5,
    ε = 0.2/0.2. Stochastic: ``coefficients(..., rng=Generator)`` (the estimator passes its
    seeded stream; without one a ``default_rng(0)`` is used, so repeated calls agree).
    ``log_prob`` as in the module docstring. On-policy (log r = 0, no ``log_prob``) cov = 0 ⇒
    c = 1.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    ratio: float = 2e-4
    lb: float = 1.0
    ub: float = 5.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "clip_cov"
    level = "batch"
    batch_dependent = True
    stochastic = True
    uses_log_prob = True

    def __post_init__(self):
        check_real(self, "eps_low", low=0.0, high=math.inf, allow_inf=True)
        check_real(self, "eps_high", low=0.0, high=math.inf, allow_inf=True)
        _check_ratio(self)
        lb = check_real(self, "lb")
        ub = check_real(self, "ub")
        if not lb < ub:
            raise ValueError(f"clip_cov: lb must be < ub, got lb = {lb}, ub = {ub}")
        check_max_log_ratio(self)

    def selected(self, log_ratio, mask, advantages, *, log_prob=None, rng=None) -> np.ndarray:
        """The detached tokens, (N, T) bool."""
        lr, m, adv, lp = _inputs(log_ratio, mask, advantages, log_prob)
        out = np.zeros(lr.shape, dtype=bool)
        out.flat[self._selection(lr, m, adv, lp, rng)] = True
        return out

    def _selection(self, lr, m, adv, lp, rng) -> np.ndarray:
        cov = token_covariance(adv, lp, m)
        hi, lo = math.log1p(self.eps_high), safe_log(1.0 - self.eps_low)
        clipped = ((adv > 0)[:, None] & (lr > hi)) | ((adv < 0)[:, None] & (lr < lo))
        cand = m & ~clipped & (cov > self.lb) & (cov < self.ub)
        return clip_cov_selection(cov, cand, self.ratio, rng)

    def coefficients(self, log_ratio, mask, advantages, *, log_prob=None, rng=None):
        lr, m, adv, lp = _inputs(log_ratio, mask, advantages, log_prob)
        pos = positive_rows(adv)
        lo = np.where(pos, -np.inf, safe_log(1.0 - self.eps_low))[:, None]
        hi = np.where(pos, math.log1p(self.eps_high), np.inf)[:, None]
        c = np.exp(np.minimum(lr, self.max_log_ratio))
        c[(lr < lo) | (lr > hi) | ~m] = 0.0
        c.flat[self._selection(lr, m, adv, lp, rng)] = 0.0
        return c


@register
@dataclass(frozen=True)
class KLCov(Mapping):
    """KL-Cov: unclipped r·A, plus κ·|log r| on the top-k covariance tokens.

    Cui et al. 2025 (arXiv 2505.22617), verl ``compute_policy_loss_kl_cov`` (b178a3c): loss
    −A·r_t on every valid token and −A·r_t + κ·|log r_t| on the k = max(1, ⌊ρ·#valid⌋) tokens
    of largest cov_t (ties: first in row-major order). ρ = ``ratio`` ∈ (0, 1] (2e-4),
    κ = ``kappa`` ≥ 0 (verl's ``ppo_kl_coef``, 1).

    Its gradient is *not* proportional to A on the selected tokens: ∂loss/∂log π_t =
    −A·r_t + κ·sign(log r_t). ``coefficients`` represents it as the c with c·A equal to that
    gradient weight, c_t = r_t − κ·sign(log r_t)/A on selected tokens (A ≠ 0), so c may be
    negative and depends on |A|; on a selected token of a row with A = 0 the penalty's
    gradient κ·sign(log r_t) has no c·A form and is dropped (c = r_t). Elsewhere c = r_t
    (capped at e^``max_log_ratio``). On-policy log r = 0 ⇒ c = 1.
    """

    ratio: float = 2e-4
    kappa: float = 1.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "kl_cov"
    level = "batch"
    batch_dependent = True
    uses_log_prob = True

    def __post_init__(self):
        _check_ratio(self)
        check_real(self, "kappa", low=0.0)
        check_max_log_ratio(self)

    def selected(self, log_ratio, mask, advantages, *, log_prob=None) -> np.ndarray:
        """The KL-penalised tokens, (N, T) bool."""
        lr, m, adv, lp = _inputs(log_ratio, mask, advantages, log_prob)
        out = np.zeros(lr.shape, dtype=bool)
        out.flat[kl_cov_selection(token_covariance(adv, lp, m), m, self.ratio)] = True
        return out

    def coefficients(self, log_ratio, mask, advantages, *, log_prob=None, rng=None):
        lr, m, adv, lp = _inputs(log_ratio, mask, advantages, log_prob)
        c = np.where(m, np.exp(np.minimum(lr, self.max_log_ratio)), 0.0)
        sel = kl_cov_selection(token_covariance(adv, lp, m), m, self.ratio)
        if sel.size and self.kappa > 0:
            rows = sel // max(lr.shape[1], 1)
            a = adv[rows]
            nz = a != 0
            penalty = self.kappa * np.sign(lr.reshape(-1)[sel[nz]]) / a[nz]
            c.reshape(-1)[sel[nz]] -= penalty
        return c


__all__ = [
    "ClipCov",
    "KLCov",
    "clip_cov_selection",
    "draw_subset",
    "kl_cov_selection",
    "token_covariance",
    "top_k_first",
]
