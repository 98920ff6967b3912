"""Section B of the notation page, continued: smooth gates and reshaped token ratios.

SAPO (soft sigmoid gate), LUFFY policy shaping (r/(r+γ)) and ASPO (flipped ratio for positive
advantages with a soft dual clip). All are token level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy.special import expit

from simkit.mappings.base import (
    DEFAULT_MAX_LOG_RATIO,
    ScalarMapping,
    as_ratio,
    band_f,
    band_phi,
    band_zeroing,
    check_bool,
    check_max_log_ratio,
    check_real,
    map_blocks,
    per_row,
    positive_rows,
    register,
    safe_log,
)


@register
@dataclass(frozen=True)
class SAPO(ScalarMapping):
    """SAPO soft-gated surrogate F(r) = (4/τ)·σ(τ(r − 1)) ⇒ c_t = 4σ(1−σ)·r_t, σ = σ(τ(r_t − 1)).

    Gao et al. (Qwen team), "Soft adaptive policy optimization", arXiv 2511.20347: a smooth
    trust region, c(1) = 1, never exactly zero, with τ = ``tau_pos`` = 1.0 for A ≥ 0 and
    ``tau_neg`` = 1.05 for A < 0 (the paper's defaults). Computed as 4r·e/(1+e)² with
    e = exp(−τ|r−1|) (no overflow); ``max_log_ratio`` caps the exponentiated log-ratio.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "sapo"
    level = "token"
    ratio_kind = "token"

    def __post_init__(self):
        check_real(self, "tau_pos", low=0.0, low_open=True)
        check_real(self, "tau_neg", low=0.0, low_open=True)
        check_max_log_ratio(self)

    def _coefficients(self, log_ratio, mask, advantages):
        neg_tau = -per_row(positive_rows(advantages), self.tau_pos, self.tau_neg)
        cap = self.max_log_ratio

        def kernel(lr, out, tmp, rows):
            np.minimum(lr, cap, out=out)
            np.exp(out, out=out)  # r
            np.subtract(out, 1.0, out=tmp)
            np.abs(tmp, out=tmp)
            np.multiply(tmp, neg_tau[rows, None], out=tmp)
            np.exp(tmp, out=tmp)  # e = exp(−τ|r − 1|)
            np.multiply(out, tmp, out=out)  # r·e
            np.add(tmp, 1.0, out=tmp)
            np.multiply(tmp, tmp, out=tmp)
            np.divide(out, tmp, out=out)  # r·e/(1+e)²
            np.multiply(out, 4.0, out=out)

        return map_blocks(log_ratio, mask, kernel)

    def _tau(self, positive: bool) -> float:
        return self.tau_pos if positive else self.tau_neg

    def phi(self, w, positive=True):
        w = as_ratio(w)
        e = np.exp(-self._tau(positive) * np.abs(w - 1.0))
        with np.errstate(invalid="ignore"):
            c = 4.0 * w * e / (1.0 + e) ** 2
        return np.where(np.isinf(w), 0.0, c)

    def f(self, w, positive=True):
        tau = self._tau(positive)
        return 4.0 / tau * expit(tau * (as_ratio(w) - 1.0))


@register
@dataclass(frozen=True)
class LUFFY(ScalarMapping):
    """LUFFY policy shaping F(r) = r/(r + γ) ⇒ c_t = γ·r_t/(r_t + γ)², token level.

    Yan et al., "Learning to reason under off-policy guidance", arXiv 2504.14945 (γ = 0.1):
    a continuous, differentiable reshaping that up-weights low-probability tokens. The paper's F
    gives c(1) = γ/(1+γ)² ≈ 0.083 on-policy, a constant step-size factor; with ``normalize``
    (default True) F and c are multiplied by (1+γ)²/γ so that c(1) = 1 like every other
    mapping. Preset ``paper`` sets ``normalize=False`` (then on-policy c ≠ 1).
    ``max_log_ratio`` caps the exponentiated log-ratio.
    """

    gamma: float = 0.1
    normalize: bool = True
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "luffy"
    level = "token"
    ratio_kind = "token"
    presets: ClassVar[dict[str, dict]] = {
        "paper": {"gamma": 0.1, "normalize": False},
        "normalized": {"gamma": 0.1, "normalize": True},
    }

    def __post_init__(self):
        check_real(self, "gamma", low=0.0, low_open=True)
        check_bool(self, "normalize")
        check_max_log_ratio(self)

    @property
    def scale(self) -> float:
        """The constant multiplying the paper's F: (1+γ)²/γ if ``normalize`` else 1."""
        return (1.0 + self.gamma) ** 2 / self.gamma if self.normalize else 1.0

    def _coefficients(self, log_ratio, mask, advantages):
        gamma, cap = self.gamma, self.max_log_ratio
        factor = self.scale * gamma

        def kernel(lr, out, tmp, rows):
            np.minimum(lr, cap, out=out)
            np.exp(out, out=out)  # r
            np.add(out, gamma, out=tmp)
            np.multiply(tmp, tmp, out=tmp)
            np.divide(out, tmp, out=out)  # r/(r+γ)²
            np.multiply(out, factor, out=out)

        return map_blocks(log_ratio, mask, kernel)

    def phi(self, w, positive=True):
        w = as_ratio(w)
        g = self.gamma
        with np.errstate(divide="ignore"):
            return self.scale * g / (w + 2.0 * g + g * g / w)

    def f(self, w, positive=True):
        w = as_ratio(w)
        return self.scale * (1.0 - self.gamma / (w + self.gamma))


@register
@dataclass(frozen=True)
class ASPO(ScalarMapping):
    """ASPO: flipped token ratio for A ≥ 0, PPO band, soft dual clip on the flipped weight.

    Wang et al., "ASPO: asymmetric importance sampling policy optimization" (Archer 2.0),
    arXiv 2510.06062. For A ≥ 0 the ratio is replaced by π_old·π/sg(π²), whose gradient weight
    is 1/r_t; tokens with r_t > 1+ε_high stay masked as in PPO, and the flipped weight is
    soft-clipped (value capped at ``c_dual``, gradient kept, as CISPO does):
    c = min(1/r_t, c_dual)·1[r_t ≤ 1+ε_high]. For A < 0 the PPO ratio is kept with the usual
    (hard) dual clip: c = r_t·1[1−ε_low ≤ r_t ≤ c_dual]. Defaults ε_low = ε_high = 0.2,
    c_dual = 3. Every value is ≤ c_dual, so no exponent can overflow.
    Surrogate: A ≥ 0: F(w) = 1 + ∫_1^w φ(u)/u du (F(1) = 1: φ(u)/u ~ c_dual/u near 0);
    A < 0: F(w) = clip(w, 1−ε_low, c_dual) − (1−ε_low) (F(0) = 0).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    c_dual: float = 3.0
    name = "aspo"
    level = "token"
    ratio_kind = "token"

    def __post_init__(self):
        check_real(self, "eps_low", low=0.0, high=math.inf, allow_inf=True)
        check_real(self, "eps_high", low=0.0, high=math.inf, allow_inf=True)
        check_real(self, "c_dual", low=1.0, low_open=True)

    def _coefficients(self, log_ratio, mask, advantages):
        pos = positive_rows(advantages)
        sign = per_row(pos, -1.0, 1.0)
        lo = per_row(pos, -math.inf, safe_log(1.0 - self.eps_low))
        hi = per_row(pos, math.log1p(self.eps_high), math.log(self.c_dual))
        log_cap = math.log(self.c_dual)
        zero_outside = band_zeroing(lo, hi)

        def kernel(lr, out, tmp, rows):
            np.multiply(lr, sign[rows, None], out=out)  # −log r (A ≥ 0), log r (A < 0)
            np.minimum(out, log_cap, out=out)
            np.exp(out, out=out)
            zero_outside(lr, out, rows)

        return map_blocks(log_ratio, mask, kernel)

    def phi(self, w, positive=True):
        w = as_ratio(w)
        if positive:
            with np.errstate(divide="ignore"):
                flipped = np.minimum(1.0 / w, self.c_dual)
            return np.where(w <= 1.0 + self.eps_high, flipped, 0.0)
        return band_phi(w, 1.0 - self.eps_low, self.c_dual)

    def f(self, w, positive=True):
        w = as_ratio(w)
        if not positive:
            return band_f(w, 1.0 - self.eps_low, self.c_dual)
        c = self.c_dual
        with np.errstate(divide="ignore", invalid="ignore"):
            upper = 1.0 - 1.0 / np.minimum(w, 1.0 + self.eps_high)  # ∫_1^w u⁻² du, w ≥ 1/c
            lower = 1.0 - c + c * np.log(w * c)  # w < 1/c: c/u below 1/c
        return 1.0 + np.where(w >= 1.0 / c, upper, lower)
