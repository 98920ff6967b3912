"""Section B of the notation page: hard clipping families (surrogate losses).

PPO / GRPO clip, dual clip, DAPO clip-higher (token level), GSPO (geometric-mean sequence ratio)
and GMPO (geometric mean of clipped token ratios). For a surrogate loss −F(r)·A the effective
coefficient is c = r·F'(r): r inside the clip band for the sign of A, 0 outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from simkit.mappings.base import (
    DEFAULT_MAX_LOG_RATIO,
    Mapping,
    ScalarMapping,
    as_ratio,
    band_mask_1d,
    band_phi,
    band_zeroing,
    banded_ratio_kernel,
    broadcast_seq,
    check_max_log_ratio,
    check_real,
    map_blocks,
    per_row,
    positive_rows,
    register,
    safe_log,
    seq_lengths,
    seq_mean_log_ratio,
)


class _ClipBand(ScalarMapping):
    """Shared PPO-style band: keep r ≤ 1+ε_high when A ≥ 0, r ≥ 1−ε_low when A < 0.

    Subclasses are dataclasses with fields ``eps_low``, ``eps_high``, ``max_log_ratio``;
    ``_neg_high`` is the upper end of the band for A < 0 (inf, or c_dual for dual clip).
    """

    def _validate_band(self):
        check_real(self, "eps_low", low=0.0, high=math.inf, allow_inf=True)
        check_real(self, "eps_high", low=0.0, high=math.inf, allow_inf=True)
        check_max_log_ratio(self)

    @property
    def _neg_high(self) -> float:
        return math.inf

    def _ratio_band(self, positive: bool) -> tuple[float, float]:
        """The band [low, high] of the ratio inside which c = ratio, for the sign of A."""
        if positive:
            return -math.inf, 1.0 + self.eps_high
        return 1.0 - self.eps_low, self._neg_high

    def _log_bands(self, advantages) -> tuple[np.ndarray, np.ndarray]:
        """Per-row log-space bands (lo, hi), each (N,)."""
        pos = positive_rows(advantages)
        lo = per_row(pos, -math.inf, safe_log(1.0 - self.eps_low))
        hi = per_row(pos, math.log1p(self.eps_high), safe_log(self._neg_high))
        return lo, hi

    def phi(self, w, positive=True):
        return band_phi(as_ratio(w), *self._ratio_band(positive))

    def f(self, w, positive=True):
        """The clipped surrogate: min(w, 1+ε_high) if A ≥ 0, max(w, 1−ε_low) if A < 0
        (capped at c_dual for dual clip)."""
        w = as_ratio(w)
        if positive:
            return np.minimum(w, 1.0 + self.eps_high)
        return np.minimum(np.maximum(w, 1.0 - self.eps_low), self._neg_high)


@register
@dataclass(frozen=True)
class PPOClip(_ClipBand):
    """PPO / GRPO clipped surrogate, token level.

    L = −min(r_t·A, clip(r_t, 1−ε_low, 1+ε_high)·A) ⇒ c_t = r_t if (A ≥ 0 and r_t ≤ 1+ε_high)
    or (A < 0 and r_t ≥ 1−ε_low), else 0 (Schulman et al. 2017, arXiv 1707.06347, Eq. 7; GRPO:
    Shao et al. 2024, arXiv 2402.03300). Defaults ε_low = ε_high = 0.2. Surrogate
    F = min(w, 1+ε_high) (A ≥ 0), max(w, 1−ε_low) (A < 0). Bounds are compared in log space
    (log r ≤ log1p(ε_high)); ``max_log_ratio`` (default 80) caps the exponentiated log-ratio.
    ε → ∞ (ε_low ≥ 1) gives token IS.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "ppo_clip"
    level = "token"
    ratio_kind = "token"

    def __post_init__(self):
        self._validate_band()

    def _coefficients(self, log_ratio, mask, advantages):
        lo, hi = self._log_bands(advantages)
        return map_blocks(log_ratio, mask, banded_ratio_kernel(lo, hi, self.max_log_ratio))


class _DualClipped(PPOClip):
    """PPO clip with a dual clip: the band for A < 0 ends at ``c_dual`` (> 1, or ∞: none).

    Subclasses are dataclasses with a ``c_dual`` field.
    """

    def __post_init__(self):
        self._validate_band()
        check_real(self, "c_dual", low=1.0, high=math.inf, low_open=True, allow_inf=True)

    @property
    def _neg_high(self) -> float:
        return self.c_dual


@register
@dataclass(frozen=True)
class DualClip(_DualClipped):
    """Dual-clip PPO: as PPO, and c_t = 0 when A < 0 and r_t > c_dual.

    Ye et al., "Mastering complex control in MOBA games with deep RL", AAAI 2020
    (arXiv 1912.09729): L = −max(min(r·A, clip(r)·A), c_dual·A) for A < 0, whose gradient
    vanishes above c_dual. Surrogate for A < 0: F = min(max(w, 1−ε_low), c_dual). verl applies
    it to every A < 0 token in its vanilla PPO loss (``clip_ratio_c`` = 3.0) and clamps the
    log-ratio to ±20 first. Presets: ``paper`` (ε = 0.2, c_dual = 3), ``verl`` (the same with
    max_log_ratio = 20). c_dual → ∞ gives :class:`PPOClip`.
    """

    c_dual: float = 3.0
    name = "dual_clip"
    presets: ClassVar[dict[str, dict]] = {
        "paper": {"eps_low": 0.2, "eps_high": 0.2, "c_dual": 3.0},
        "verl": {"eps_low": 0.2, "eps_high": 0.2, "c_dual": 3.0, "max_log_ratio": 20.0},
    }


@register
@dataclass(frozen=True)
class DAPOClip(_DualClipped):
    """DAPO clip-higher: PPO clip with decoupled ε_low = 0.2, ε_high = 0.28.

    Yu et al., "DAPO: an open-source LLM RL system at scale", arXiv 2503.14476, §3.1 (DAPO also
    means token-mean aggregation, chosen separately in simkit). ``c_dual`` (default ∞: none)
    is the dual clip of A < 0 tokens. Preset ``verl``: verl has no separate DAPO loss — DAPO is
    ``compute_policy_loss_vanilla`` (``core_algos.py`` at b178a3c) with clip_ratio_high 0.28,
    and that loss *always* applies the dual clip ``clip_ratio_c`` = 3 to A < 0 tokens and
    clamps log r to ±20, so ``dapo(preset="verl")`` = ε (0.2, 0.28), c_dual = 3,
    max_log_ratio = 20. Preset ``paper``: no dual clip.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    c_dual: float = math.inf
    name = "dapo"
    quiet_defaults = ("c_dual",)
    presets: ClassVar[dict[str, dict]] = {
        "paper": {"eps_low": 0.2, "eps_high": 0.28, "c_dual": math.inf},
        "verl": {"eps_low": 0.2, "eps_high": 0.28, "c_dual": 3.0, "max_log_ratio": 20.0},
    }


@register
@dataclass(frozen=True)
class GSPO(_ClipBand):
    """GSPO: clipped geometric-mean sequence ratio, the same on every token of the sequence.

    Zheng et al., "Group sequence policy optimization", arXiv 2507.18071: s = exp((1/|y|)
    Σ_t log r_t) over the valid tokens; c_t = s·1[s ≤ 1+ε_high] (A ≥ 0) or s·1[s ≥ 1−ε_low]
    (A < 0); its aggregation is seq-mean-token-mean. Length invariant (VESPO, arXiv 2602.10693,
    Prop. E.1: two sequences with the same mean log-ratio get the same weight). Defaults =
    the paper's ε_low = 3e-4, ε_high = 4e-4 (preset ``paper``); preset ``libraries`` uses the
    0.2/0.2 default of verl and TRL. ``max_log_ratio`` caps log s. An empty sequence has s = 1.

    verl's ``compute_policy_loss_gspo`` (``core_algos.py`` at b178a3c) also applies
    ``torch.clamp(log s, max=10)`` before exponentiating. That is not a value cap: the clamp's
    derivative is 0 above 10, so a sequence with log s > 10 gets *zero gradient* in verl — a
    hidden dual clip, which matters for A < 0 rows (PPO's band alone keeps them). Here it is
    ``grad_log_cap`` (default ∞): c = 0 when log s > grad_log_cap; preset ``verl`` = ε
    0.2/0.2 with grad_log_cap = 10. ``max_log_ratio`` caps the value only.
    """

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    grad_log_cap: float = math.inf
    name = "gspo"
    level = "sequence"
    ratio_kind = "geometric"
    quiet_defaults = ("grad_log_cap",)
    presets: ClassVar[dict[str, dict]] = {
        "paper": {"eps_low": 3e-4, "eps_high": 4e-4},
        "libraries": {"eps_low": 0.2, "eps_high": 0.2},
        "verl": {"eps_low": 0.2, "eps_high": 0.2, "grad_log_cap": 10.0},
    }

    def __post_init__(self):
        self._validate_band()
        check_real(self, "grad_log_cap", low=0.0, high=math.inf, low_open=True, allow_inf=True)

    @property
    def _neg_high(self) -> float:
        return math.exp(self.grad_log_cap) if self.grad_log_cap < 700 else math.inf

    def _log_bands(self, advantages):
        lo, hi = super()._log_bands(advantages)
        return lo, np.minimum(hi, self.grad_log_cap)

    def _coefficients(self, log_ratio, mask, advantages):
        log_s = seq_mean_log_ratio(log_ratio, mask)
        lo, hi = self._log_bands(advantages)
        s = np.exp(np.minimum(log_s, self.max_log_ratio))
        return broadcast_seq(np.where(band_mask_1d(log_s, lo, hi), s, 0.0), mask)


@register
@dataclass(frozen=True)
class GMPO(Mapping):
    """GMPO: geometric mean of token ratios clipped in log space on the pessimistic side.

    Zhao et al., "Geometric-mean policy optimization", arXiv 2507.20673: log r_t is clipped to
    min(log r_t, ε_high) when A ≥ 0 and max(log r_t, −ε_low) when A < 0; R = exp(mean over the
    valid tokens of the clipped log-ratios); the objective R·A gives c_t = R·1[token t not
    clipped] (with seq-mean-token-mean aggregation). ``eps_low``, ``eps_high`` are log-space
    (default 0.4 each, the paper's (e^−0.4, e^0.4)); ``max_log_ratio`` caps log R.
    """

    eps_low: float = 0.4
    eps_high: float = 0.4
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "gmpo"
    level = "sequence"

    def __post_init__(self):
        check_real(self, "eps_low", low=0.0, high=math.inf, allow_inf=True)
        check_real(self, "eps_high", low=0.0, high=math.inf, allow_inf=True)
        check_max_log_ratio(self)

    def _coefficients(self, log_ratio, mask, advantages):
        pos = positive_rows(advantages)
        lo = per_row(pos, -math.inf, -self.eps_low)
        hi = per_row(pos, self.eps_high, math.inf)
        N, T = log_ratio.shape
        clipped_sum = np.zeros(N)
        rows = max(1, (1 << 16) // max(T, 1))
        tmp = np.empty((min(rows, N), T))
        for start in range(0, N, rows):
            stop = min(start + rows, N)
            t = tmp[: stop - start]
            np.clip(log_ratio[start:stop], lo[start:stop, None], hi[start:stop, None], out=t)
            np.add.reduce(
                t, axis=1, where=mask[start:stop], initial=0.0, out=clipped_sum[start:stop]
            )
        n = seq_lengths(mask)
        log_R = np.divide(clipped_sum, n, out=np.zeros(N), where=n > 0)
        R = np.exp(np.minimum(log_R, self.max_log_ratio))
        zero_outside = band_zeroing(lo, hi)

        def kernel(lr, out, tmp, rows):
            out[...] = R[rows, None]
            zero_outside(lr, out, rows)

        return map_blocks(log_ratio, mask, kernel)
