"""Weights on the rollout policy's ratio used by asynchronous trainers: SkyRL's ``rollout_is``
(an open-band token mask) and ROLL's segment-level IS (a geometric mean per segment).

- ``rollout_is``: SkyRL ``rollout_is_policy_loss``
  (``skyrl/backends/skyrl_train/utils/ppo_utils.py`` at NovaSky-AI/SkyRL a956457), loss
  −sg(f(r_t))·A·log π_t with r_t = exp(clip(log π_t − log μ_t, ±20)) (``safe_exp_delta``,
  ``skyrl/backends/skyrl_train/utils/torch_utils.py``) and f(r) = r·1[1 − ε_low < r < 1 + ε_high]
  (an *open* band: r on a bound is dropped), ε = ``eps_clip_low`` / ``eps_clip_high`` = 0.2
  (``skyrl/train/config/config.py``).
- ``segment_is``: ROLL's train–infer IS weight with ``weight_type="segment"``
  (``roll/utils/train_infer_corrections.py``, ``compute_segment_masked_mean`` in
  ``roll/pipeline/agentic/utils.py``, defaults in ``roll/configs/base_config.py``
  ``TrainInferISWeightConfig`` at alibaba/ROLL 8eb27cc): every maximal run of consecutive valid
  tokens of a row (a *segment*: one assistant turn of a multi-turn trajectory, tool output
  masked between them) gets the weight exp(mean of log r over the segment), clamped to
  [0, ``upper_bound``] (1.2), detached: c_t = min(exp(mean_{u ∈ seg(t)} log r_u), U). With one
  segment per row (every environment of simkit) that is min(s, U), s the geometric mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from simkit.mappings.base import (
    Mapping,
    ScalarMapping,
    as_ratio,
    check_max_log_ratio,
    check_real,
    map_blocks,
    register,
)

#: SkyRL's clamp of the log-ratio before the exponential (``safe_exp_delta``)
SKYRL_LOG_CLAMP = 20.0


@register
@dataclass(frozen=True)
class RolloutIS(ScalarMapping):
    """SkyRL ``rollout_is``: c_t = r_t·1[1 − ε_low < r_t < 1 + ε_high] (module docstring).

    ``eps_low`` ∈ [0, 1] (1: no lower bound), ``eps_high`` ≥ 0 (``inf``: none), both 0.2;
    ``max_log_ratio`` = 20 clamps log r to [−20, 20] before the exponential (SkyRL's
    ``safe_exp_delta``; ``phi`` is the exact formula without it). On-policy r = 1 is inside the
    open band (ε > 0) ⇒ c = 1. Surrogate F(w) = clip(w, lo, hi) − lo (F(0) = 0).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    max_log_ratio: float = SKYRL_LOG_CLAMP
    name = "rollout_is"
    rejects = True
    level = "token"
    ratio_kind = "token"
    presets: ClassVar[dict[str, dict]] = {"skyrl": {"eps_low": 0.2, "eps_high": 0.2}}

    def __post_init__(self):
        check_real(self, "eps_low", low=0.0, high=1.0, low_open=True)
        check_real(self, "eps_high", low=0.0, low_open=True, allow_inf=True)
        check_max_log_ratio(self)

    @property
    def bounds(self) -> tuple[float, float]:
        """(1 − ε_low, 1 + ε_high), the open band of kept ratios."""
        return 1.0 - self.eps_low, 1.0 + self.eps_high

    def phi(self, w, positive=True):
        w = as_ratio(w)
        lo, hi = self.bounds
        return np.where((w > lo) & (w < hi), w, 0.0)

    def f(self, w, positive=True):
        lo, hi = self.bounds
        return np.clip(as_ratio(w), lo, hi) - lo

    def _coefficients(self, log_ratio, mask, advantages):
        lo, hi = self.bounds
        log_lo = math.log(lo) if lo > 0 else -math.inf
        log_hi = math.log(hi)
        cap = float(self.max_log_ratio)

        def kernel(lr, out, tmp, rows):
            np.clip(lr, -cap, cap, out=out)
            np.exp(out, out=out)
            # the band on r as SkyRL computes it (on the clamped ratio), in log space
            np.copyto(out, 0.0, where=~((lr > log_lo) & (lr < log_hi)))

        return map_blocks(log_ratio, mask, kernel)


def segment_ids(mask: np.ndarray) -> np.ndarray:
    """Segment index of every position (N, T) int: runs of consecutive valid tokens of a row are
    numbered 0, 1, … across the whole batch (row-major); −1 on padding."""
    m = np.asarray(mask, dtype=bool)
    prev = np.zeros_like(m)
    prev[:, 1:] = m[:, :-1]
    starts = m & ~prev
    ids = np.cumsum(starts.reshape(-1)).reshape(m.shape) - 1
    return np.where(m, ids, -1)


def segment_mean_log_ratio(log_ratio: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean log-ratio of each token's segment (:func:`segment_ids`), (N, T); 0 on padding."""
    ids = segment_ids(mask)
    valid = ids >= 0
    n_seg = int(ids.max()) + 1 if valid.any() else 0
    sums = np.bincount(ids[valid], weights=log_ratio[valid], minlength=n_seg)
    counts = np.bincount(ids[valid], minlength=n_seg)
    out = np.zeros(log_ratio.shape)
    out[valid] = (sums / np.maximum(counts, 1))[ids[valid]]
    return out


@register
@dataclass(frozen=True)
class SegmentIS(Mapping):
    """ROLL segment-level IS: c_t = min(exp(mean log r over t's segment), U) (module docstring).

    ``upper_bound`` U ≥ 1 (1.2, ROLL's default; ``inf`` = ROLL's None, no clamp);
    ``max_log_ratio`` caps the exponentiated mean. On-policy ⇒ c = 1. Sequence level: the
    coefficient depends on the other tokens of the segment (a per-sample function: exact by
    enumeration; no token DP).
    """

    upper_bound: float = 1.2
    max_log_ratio: float = 80.0
    name = "segment_is"
    level = "sequence"
    presets: ClassVar[dict[str, dict]] = {"roll": {"upper_bound": 1.2}}

    def __post_init__(self):
        check_real(self, "upper_bound", low=1.0, allow_inf=True)
        check_max_log_ratio(self)

    def _coefficients(self, log_ratio, mask, advantages):
        cap = min(float(self.max_log_ratio), math.log(self.upper_bound))
        c = np.exp(np.minimum(segment_mean_log_ratio(log_ratio, mask), cap))
        return np.where(mask, c, 0.0)


__all__ = ["RolloutIS", "SegmentIS", "segment_ids", "segment_mean_log_ratio"]
