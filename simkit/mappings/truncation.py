"""Section C of the notation page: truncated and masked importance weights (detached).

CISPO (clipped token weight, never zero), truncated IS (token and sequence), masked IS (token
and sequence, one- or two-sided) and IcePop. For a detached-weight loss −sg(w)·A·log π the
effective coefficient is c = w.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from simkit.mappings.base import (
    DEFAULT_MAX_LOG_RATIO,
    ScalarMapping,
    as_ratio,
    band_f,
    band_mask_1d,
    band_phi,
    banded_ratio_kernel,
    broadcast_seq,
    check_bool,
    check_max_log_ratio,
    check_real,
    clamp_ratio_f,
    clamp_ratio_phi,
    clamped_ratio_kernel,
    map_blocks,
    register,
    safe_log,
    seq_log_ratio,
)

#: verl skips the batch normalisation when the mean weight is at most this (division guard)
BATCH_NORM_EPS = 1e-8


def _batch_normalize_flags(m) -> None:
    """Validate ``batch_normalize``; a normalised instance is batch dependent (level "batch")."""
    if check_bool(m, "batch_normalize"):
        object.__setattr__(m, "batch_dependent", True)
        object.__setattr__(m, "level", "batch")


def _normalise(c: np.ndarray, count: int) -> None:
    """Divide token coefficients c (0 on padding) in place by their mean over ``count`` valid
    tokens, unless that mean is at most :data:`BATCH_NORM_EPS` (verl's guard)."""
    if count:
        mean = float(c.sum()) / count
        if mean > BATCH_NORM_EPS:
            np.divide(c, mean, out=c)


def _check_ratio_band(m) -> None:
    """Validate a ratio band c_low ∈ [0, 1], c_high ∈ [1, ∞] and ``max_log_ratio``."""
    check_real(m, "c_low", low=0.0, high=1.0)
    check_real(m, "c_high", low=1.0, high=math.inf, allow_inf=True)
    check_max_log_ratio(m)


class _ClampedRatioCurves:
    """φ and F of a clamped weight clip(w, low, high), (low, high) = ``self.bounds``."""

    def phi(self, w, positive=True):
        return clamp_ratio_phi(as_ratio(w), *self.bounds)

    def f(self, w, positive=True):
        return clamp_ratio_f(as_ratio(w), *self.bounds)


class _MaskedRatioCurves:
    """φ and F of a masked weight w·1[c_low ≤ w ≤ c_high]."""

    def phi(self, w, positive=True):
        return band_phi(as_ratio(w), self.c_low, self.c_high)

    def f(self, w, positive=True):
        return band_f(as_ratio(w), self.c_low, self.c_high)


def _clamped_token_ratio(log_ratio, mask, low: float, high: float, max_log_ratio: float):
    """c_t = clip(r_t, low, high) computed as exp(clip(log r_t, log low, min(log high, cap)))."""
    N = log_ratio.shape[0]
    lo = np.full(N, safe_log(low))
    hi = np.full(N, min(safe_log(high), max_log_ratio))
    return map_blocks(log_ratio, mask, clamped_ratio_kernel(lo, hi))


@register
@dataclass(frozen=True)
class CISPO(_ClampedRatioCurves, ScalarMapping):
    """CISPO: detached clipped token weight c_t = clip(r_t, 1−ε_low, 1+ε_high), never zero.

    MiniMax, "MiniMax-M1: scaling test-time compute efficiently with lightning attention",
    arXiv 2506.13585, Eq. 4 (loss −sg(r̂)·A·log π, token-mean). The paper imposes no lower bound
    (ε_low = ∞; it tunes ε_high only and does not publish the value); defaults ε_low = ∞,
    ε_high = 0.2. Presets: ``paper`` (∞, 0.2), ``verl`` (verl's example: ε_low = 10, i.e. no
    lower bound, ε_high = 0.2), ``trl`` (TRL caps r at an absolute ``epsilon_high``, docs
    recommend 5.0 ⇒ ε_high = 4.0 here). The trap: TRL (``grpo_trainer.py`` at f2cd577,
    ``torch.clamp(coef_1, max=self.epsilon_high)``) reads ``epsilon_high`` as an *absolute*
    cap and falls back to ``epsilon`` = 0.2 when it is unset, so TRL's CISPO without
    ``epsilon_high`` has c = min(r, 0.2): c(1) = 0.2 on-policy, every token down-weighted 5×
    and no token above r = 0.2 distinguished — not a CISPO at all, and not representable here
    (ε_high ≥ 0 keeps the cap ≥ 1).
    Surrogate F(w) = 1 + ∫_1^w φ(u)/u du (F(1) = 1; = ∫_0^w when there is no lower bound).
    """

    eps_low: float = math.inf
    eps_high: float = 0.2
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "cispo"
    level = "token"
    ratio_kind = "token"
    presets: ClassVar[dict[str, dict]] = {
        "paper": {"eps_low": math.inf, "eps_high": 0.2},
        "verl": {"eps_low": 10.0, "eps_high": 0.2},
        "trl": {"eps_low": math.inf, "eps_high": 4.0},
    }

    def __post_init__(self):
        check_real(self, "eps_low", low=0.0, high=math.inf, allow_inf=True)
        check_real(self, "eps_high", low=0.0, high=math.inf, allow_inf=True)
        check_max_log_ratio(self)

    @property
    def bounds(self) -> tuple[float, float]:
        """The clamp (low, high) of the ratio."""
        return max(1.0 - self.eps_low, 0.0), 1.0 + self.eps_high

    def _coefficients(self, log_ratio, mask, advantages):
        return _clamped_token_ratio(log_ratio, mask, *self.bounds, self.max_log_ratio)


@register
@dataclass(frozen=True)
class TokenTIS(_ClampedRatioCurves, ScalarMapping):
    """Token truncated IS, c_t = clip(r_t, c_low, c_high) (default [0, 2]: min(r_t, 2)).

    Yao, Liu et al., "Your efficient RL framework secretly brings you off-policy RL training"
    (2025, arXiv 2508.10687): a detached correction for the inference/training mismatch.
    Presets: ``verl`` [0, 2], ``trl`` [0, 3] (``token_truncate``, clip_max 3), ``openrlhf``
    [0.5, 5] (clamp from both sides), ``slime`` [0, 2]. Requires c_low ≤ 1 ≤ c_high (c(1) = 1);
    c_high = ∞ gives token IS. Surrogate F(w) = 1 + ∫_1^w φ(u)/u du (F(1) = 1; = ∫_0^w when
    c_low = 0).

    ``batch_normalize=True`` (verl ``rollout_is_batch_normalize``, ``rollout_corr_helper.py``
    ``compute_rollout_correction_weights`` at b178a3c): the truncated weights are divided by
    their mean over the batch's valid tokens (skipped when that mean is ≤ 1e-8), so the
    instance is batch dependent (``level`` "batch", Monte Carlo only); ``phi`` / ``f`` then
    describe the weight before the normalisation.
    """

    c_low: float = 0.0
    c_high: float = 2.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    batch_normalize: bool = False
    name = "tis_token"
    quiet_defaults = ("batch_normalize",)
    level = "token"
    ratio_kind = "token"
    presets: ClassVar[dict[str, dict]] = {
        "verl": {"c_low": 0.0, "c_high": 2.0},
        "trl": {"c_low": 0.0, "c_high": 3.0},
        "openrlhf": {"c_low": 0.5, "c_high": 5.0},
        "slime": {"c_low": 0.0, "c_high": 2.0},
    }

    def __post_init__(self):
        _check_ratio_band(self)
        _batch_normalize_flags(self)

    def _coefficients(self, log_ratio, mask, advantages):
        c = _clamped_token_ratio(log_ratio, mask, self.c_low, self.c_high, self.max_log_ratio)
        if self.batch_normalize:
            _normalise(c, np.count_nonzero(mask))
        return c

    @property
    def bounds(self) -> tuple[float, float]:
        """The clamp (low, high) of the ratio."""
        return self.c_low, self.c_high


@register
@dataclass(frozen=True)
class SequenceTIS(_ClampedRatioCurves, ScalarMapping):
    """Sequence truncated IS, c_t = min(W, c) on every token (default c = 2).

    Liu, Li et al. 2025 ("rl-collapse": when speed kills stability, training-inference
    mismatch): bias ≤ 2K(1+χ²)/C, Var ≤ K²C², best C* = √(2(1+χ²)). c = ∞ gives sequence IS;
    ``max_log_ratio`` caps log W. Surrogate F(w) = min(w, c) + c·log(max(w, c)/c) (F(0) = 0).

    ``batch_normalize=True`` (verl ``rollout_is_batch_normalize``, sequence level, b178a3c):
    min(W_i, c) is divided by its mean over the batch's non-empty rows (skipped when ≤ 1e-8);
    the instance is then batch dependent (``level`` "batch").
    """

    c: float = 2.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    batch_normalize: bool = False
    name = "tis_seq"
    quiet_defaults = ("batch_normalize",)
    level = "sequence"
    ratio_kind = "sequence"

    def __post_init__(self):
        check_real(self, "c", low=1.0, high=math.inf, allow_inf=True)
        check_max_log_ratio(self)
        _batch_normalize_flags(self)

    def _coefficients(self, log_ratio, mask, advantages):
        cap = min(safe_log(self.c), self.max_log_ratio)
        w = np.exp(np.minimum(seq_log_ratio(log_ratio, mask), cap))
        if self.batch_normalize:
            nonempty = mask.any(axis=1)
            count = int(np.count_nonzero(nonempty))
            if count:
                mean = float(np.sum(w, where=nonempty)) / count
                if mean > BATCH_NORM_EPS:
                    w = w / mean
        return broadcast_seq(w, mask)

    @property
    def bounds(self) -> tuple[float, float]:
        """The clamp (low, high) of the sequence ratio."""
        return 0.0, self.c


@register
@dataclass(frozen=True)
class TokenMIS(_MaskedRatioCurves, ScalarMapping):
    """Token masked IS, c_t = r_t·1[c_low ≤ r_t ≤ c_high] (default [0.5, 5], IcePop's band).

    Two-sided token mask: tokens whose ratio leaves the band are dropped. Presets ``icepop``
    [0.5, 5] (Ling team, "Every step evolves", arXiv 2510.18855) and ``trl`` [0, 3] (TRL's
    ``token_mask`` mode, clip_max 3, clip_min unset). Requires c_low ≤ 1 ≤ c_high; c_low = 0,
    c_high = ∞ gives token IS. ``max_log_ratio`` caps the exponentiated log-ratio.
    Surrogate F(w) = clip(w, c_low, c_high) − c_low (F(0) = 0).
    """

    c_low: float = 0.5
    c_high: float = 5.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "mis_token"
    rejects = True
    level = "token"
    ratio_kind = "token"
    presets: ClassVar[dict[str, dict]] = {
        "icepop": {"c_low": 0.5, "c_high": 5.0},
        "trl": {"c_low": 0.0, "c_high": 3.0},
    }

    def __post_init__(self):
        _check_ratio_band(self)

    def _coefficients(self, log_ratio, mask, advantages):
        N = log_ratio.shape[0]
        lo = np.full(N, safe_log(self.c_low))
        hi = np.full(N, safe_log(self.c_high))
        return map_blocks(log_ratio, mask, banded_ratio_kernel(lo, hi, self.max_log_ratio))


@register
@dataclass(frozen=True)
class SequenceMIS(_MaskedRatioCurves, ScalarMapping):
    """Sequence masked IS, c_t = W·1[c_low ≤ W ≤ c_high] on every token (default [0, 2]).

    Presets ``rl_collapse`` (one-sided, W·1[W ≤ 2]; Liu, Li et al. 2025) and ``trl``
    ([0, 3]: TRL's ``sequence_mask`` mode, clip_max 3, clip_min unset — so TRL's preset is
    effectively *one-sided*: with clip_min unset TRL masks only W > 3, never a small W).
    Length trap: a per-token ratio ρ̄ gives W = ρ̄^T, so every sequence longer than
    T* = log c_high / log ρ̄ is rejected (c_high = 5, ρ̄ = 1.001 ⇒ T* ≈ 1610).
    c_low = 0, c_high = ∞ gives sequence IS; ``max_log_ratio`` caps log W.
    Surrogate F(w) = clip(w, c_low, c_high) − c_low (F(0) = 0).
    """

    c_low: float = 0.0
    c_high: float = 2.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "mis_seq"
    rejects = True
    level = "sequence"
    ratio_kind = "sequence"
    presets: ClassVar[dict[str, dict]] = {
        "rl_collapse": {"c_low": 0.0, "c_high": 2.0},
        "trl": {"c_low": 0.0, "c_high": 3.0},
    }

    def __post_init__(self):
        _check_ratio_band(self)

    def _coefficients(self, log_ratio, mask, advantages):
        log_w = seq_log_ratio(log_ratio, mask)
        keep = band_mask_1d(log_w, safe_log(self.c_low), safe_log(self.c_high))
        w = np.exp(np.minimum(log_w, self.max_log_ratio))
        return broadcast_seq(np.where(keep, w, 0.0), mask)


@register
@dataclass(frozen=True)
class IcePop(TokenMIS):
    """IcePop: token masking of the training/inference mismatch ratio to [0.5, 5].

    Ling team, "Every step evolves: scaling reinforcement learning for trillion-scale thinking
    model" (Ring-1T), arXiv 2510.18855: c_t = r_t·1[α ≤ r_t ≤ β], (α, β) = (0.5, 5). The same
    formula as :class:`TokenMIS` (presets ``icepop``, ``trl`` and ``verl``: verl 1dda039's
    ``decoupled_token_icepop`` / ``bypass_pg_token_icepop``, a ``"lower_upper"`` threshold string
    "0.5_5.0" that zeroes the token IS weight outside [0.5, 5]).
    """

    name = "icepop"
    presets: ClassVar[dict[str, dict]] = {
        "icepop": {"c_low": 0.5, "c_high": 5.0},
        "trl": {"c_low": 0.0, "c_high": 3.0},
        # verl 1dda039: RolloutCorrectionConfig.decoupled_token_icepop / bypass_pg_token_icepop,
        # rollout_is="token", rollout_is_threshold "0.5_5.0" (zero outside [0.5, 5])
        "verl": {"c_low": 0.5, "c_high": 5.0},
    }
