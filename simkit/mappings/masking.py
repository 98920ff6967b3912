"""Section C of the notation page, continued: sequence masks and tapered weights.

Geo-Mask (geometric-mean band), OPSM (DeepSeek-V3.2 off-policy sequence mask), token veto,
M2PO (batch second-moment token mask) and TOPR (tapered off-policy REINFORCE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from simkit._validation import check_batch
from simkit.mappings.base import (
    BLOCK_ELEMENTS,
    DEFAULT_MAX_LOG_RATIO,
    Mapping,
    ScalarMapping,
    as_ratio,
    band_mask_1d,
    broadcast_seq,
    check_bool,
    check_choice,
    check_max_log_ratio,
    check_real,
    log_of,
    map_blocks,
    positive_rows,
    register,
    safe_log,
    seq_log_ratio,
    seq_mean_log_ratio,
)


@register
@dataclass(frozen=True)
class GeoMask(ScalarMapping):
    """Geo-Mask: keep a sequence iff c_low ≤ s ≤ c_high, s the geometric-mean ratio, × a base.

    Liu, Li et al. 2025 (rl-collapse, training-inference mismatch, part 3): a length-invariant
    sequence rejection filter, c_t = 1[c_low ≤ s ≤ c_high] × base_t, with base ``"one"``
    (default, c = the mask) or ``"tis"`` (token TIS min(r_t, ``tis_c``), default 2). Presets:
    ``rl_collapse`` (0.5, 2), ``verl`` (0.999, 1.001: the band as verl's
    ``decoupled_geo_rs`` documents it), ``verl_head`` (1/1.001, 1/0.999): what verl HEAD
    (b178a3c, ``rollout_corr_helper.py`` ``compute_rollout_rejection_mask``, option
    ``seq_mean_k1`` with threshold "0.999_1.001") actually computes — it compares its
    "lower_upper" bounds with the mean of k1 = log(μ/π) = −log s, i.e. keeps
    log 0.999 ≤ −log s ≤ log 1.001, s ∈ [1/upper, 1/lower]. That is verl's behaviour, kept
    here as a preset; the two bands differ by O(1e-6) at these bounds but swap roles for
    asymmetric ones. ``phi`` (of s) exists for base "one"
    only; its surrogate F(w) = log(clip(w, c_low, c_high)/c_low) (F(0) = 0). An empty sequence
    has s = 1. ``max_log_ratio`` caps the exponentiated token log-ratio of the TIS base.
    """

    c_low: float = 0.5
    c_high: float = 2.0
    base: str = "one"
    tis_c: float = 2.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "geo_mask"
    rejects = True
    level = "sequence"
    ratio_kind = "geometric"
    presets: ClassVar[dict[str, dict]] = {
        "rl_collapse": {"c_low": 0.5, "c_high": 2.0},
        "verl": {"c_low": 0.999, "c_high": 1.001},
        "verl_head": {"c_low": 1.0 / 1.001, "c_high": 1.0 / 0.999},
    }

    def __post_init__(self):
        check_real(self, "c_low", low=0.0, high=1.0, low_open=True)
        check_real(self, "c_high", low=1.0, high=math.inf, allow_inf=True)
        check_choice(self, "base", ("one", "tis"))
        check_real(self, "tis_c", low=1.0, high=math.inf, allow_inf=True)
        check_max_log_ratio(self)

    def _coefficients(self, log_ratio, mask, advantages):
        log_s = seq_mean_log_ratio(log_ratio, mask)
        keep = band_mask_1d(log_s, math.log(self.c_low), safe_log(self.c_high)).astype(float)
        if self.base == "one":
            return broadcast_seq(keep, mask)
        cap = min(safe_log(self.tis_c), self.max_log_ratio)

        def kernel(lr, out, tmp, rows):
            np.minimum(lr, cap, out=out)
            np.exp(out, out=out)
            np.multiply(out, keep[rows, None], out=out)

        return map_blocks(log_ratio, mask, kernel)

    def _require_scalar(self):
        if self.base != "one":
            raise ValueError(
                "geo_mask: phi and f exist for base='one' only (with base='tis' "
                "the coefficient also depends on each token ratio)"
            )

    def phi(self, w, positive=True):
        self._require_scalar()
        w = as_ratio(w)
        return ((w >= self.c_low) & (w <= self.c_high)).astype(float)

    def f(self, w, positive=True):
        self._require_scalar()
        return np.log(np.clip(as_ratio(w), self.c_low, self.c_high) / self.c_low)


@register
@dataclass(frozen=True)
class OPSM(ScalarMapping):
    """Off-policy sequence masking (DeepSeek-V3.2): drop negative sequences that drifted.

    DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556: c_t = 0 if A < 0 and
    (1/|y|) Σ_t log(μ/π) > δ, else 1 (× the base loss; base 1 here). With s the geometric-mean
    ratio this is c = 1 for A ≥ 0 and 1[s ≥ e^{−δ}] for A < 0. Presets ``slime`` (δ = 1e-4,
    the default) and ``trl`` (δ = 0.5, TRL's suggested ``off_policy_mask_threshold``).
    Surrogate: A ≥ 0: F = 1 + log w (F(1) = 1); A < 0: F = log(max(w, e^{−δ})) + δ (F(0) = 0).
    """

    delta: float = 1e-4
    name = "opsm"
    rejects = True
    level = "sequence"
    ratio_kind = "geometric"
    presets: ClassVar[dict[str, dict]] = {"slime": {"delta": 1e-4}, "trl": {"delta": 0.5}}

    def __post_init__(self):
        check_real(self, "delta", low=0.0)

    def _coefficients(self, log_ratio, mask, advantages):
        drifted = seq_mean_log_ratio(log_ratio, mask) < -self.delta
        dropped = drifted & ~positive_rows(advantages)
        return broadcast_seq((~dropped).astype(float), mask)

    def phi(self, w, positive=True):
        w = as_ratio(w)
        if positive:
            return np.ones_like(w)
        return (w >= math.exp(-self.delta)).astype(float)

    def f(self, w, positive=True):
        w = as_ratio(w)
        if positive:
            return 1.0 + log_of(w)
        return np.log(np.maximum(w, math.exp(-self.delta))) + self.delta


@register
@dataclass(frozen=True)
class TokenVeto(Mapping):
    """Token veto: a sequence is dropped (c = 0) if any of its valid tokens has r_t < τ.

    The "rollout token veto" of verl's rollout-correction helpers (τ = 1e-4, ``tau``): one
    catastrophically unlikely token vetoes the whole sequence; otherwise c = 1 (base 1).
    τ = 0 never vetoes.
    """

    tau: float = 1e-4
    name = "token_veto"
    rejects = True
    level = "sequence"

    def __post_init__(self):
        check_real(self, "tau", low=0.0, high=1.0)

    def _coefficients(self, log_ratio, mask, advantages):
        smallest = np.minimum.reduce(log_ratio, axis=1, where=mask, initial=np.inf)
        vetoed = smallest < safe_log(self.tau)
        return broadcast_seq((~vetoed).astype(float), mask)


@register
@dataclass(frozen=True)
class M2PO(Mapping):
    """M2PO: mask the tokens with the largest (log r_t)² until the batch mean of the rest ≤ τ.

    Zheng et al., "Prosperity before collapse: how far can off-policy RL reach with stale data
    on LLMs?", arXiv 2510.01161, §5.2 and Algorithm 1 (τ_M2 = 0.04). The candidates are the
    "trust-region" tokens where PPO's clip could act (A ≥ 0 and r_t > 1, or A < 0 and r_t < 1;
    ``trust_region_only`` = False uses every valid token, the notation page's shorthand):
    while the mean of (log r_t)² over the remaining candidates exceeds τ, the largest is masked
    (ties broken by position, first in row-major order). The objective is the unclipped r_t·A on
    the kept tokens, so c_t = r_t·M_t. Batch dependent. ``max_log_ratio`` caps the exponent.
    """

    tau: float = 0.04
    trust_region_only: bool = True
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "m2po"
    level = "batch"
    batch_dependent = True

    def __post_init__(self):
        check_real(self, "tau", low=0.0)
        check_bool(self, "trust_region_only")
        check_max_log_ratio(self)

    def _candidates(self, log_ratio, mask, positive) -> np.ndarray:
        """Tokens M2PO may mask: valid and (trust-region only) on the clipped side of PPO."""
        if not self.trust_region_only:
            return mask
        side = np.where(positive[:, None], log_ratio > 0, log_ratio < 0)
        return mask & side

    def masked_tokens(self, log_ratio, mask, advantages) -> np.ndarray:
        """The M2PO mask: True where a token is removed, (N, T) bool (Algorithm 1)."""
        lr, m, adv = check_batch(log_ratio, mask, advantages)
        total, n = self._stream(lr, m, adv, None)
        removed = self._removed(lr, m, adv, total, n)
        return np.zeros(lr.shape, dtype=bool) if removed is None else removed

    def _second_moment(self, log_ratio, mask, advantages) -> tuple[float, int]:
        """Σ (log r)² over the candidate tokens and their number."""
        return self._stream(log_ratio, mask, advantages, None)

    def _stream(self, log_ratio, mask, advantages, out) -> tuple[float, int]:
        """One pass over row blocks: Σ (log r)² over the candidates and their number, and,
        when ``out`` (N, T) is given, c = exp(min(log r, ``max_log_ratio``)) (0 on padding)
        written into it. The sum adds the blocks' pairwise sums of (log r)²·1[candidate]."""
        N, T = log_ratio.shape
        rows = max(1, BLOCK_ELEMENTS // max(T, 1))
        sign = np.where(positive_rows(advantages), 1.0, -1.0)
        size = (min(rows, N), T)
        tmp, flags = np.empty(size), np.empty(size, dtype=bool)
        total, count = 0.0, 0
        for start in range(0, N, rows):
            stop = min(start + rows, N)
            lr, mb, r = log_ratio[start:stop], mask[start:stop], stop - start
            full = bool(mb.all())
            if out is not None:
                block = out[start:stop]
                if lr.max(initial=-np.inf) > self.max_log_ratio:
                    np.minimum(lr, self.max_log_ratio, out=block)
                    np.exp(block, out=block)
                else:  # exp(min(log r, cap)) without the minimum
                    np.exp(lr, out=block)
                if not full:
                    np.copyto(block, 0.0, where=~mb)
            sq, cand = tmp[:r], flags[:r]
            with np.errstate(over="ignore"):  # (log r)² of absurd padding values
                if self.trust_region_only:
                    # x = ±log r (the row's sign of A): a candidate iff x > 0, and
                    # max(x, 0)² is (log r)² there and 0 elsewhere
                    np.multiply(lr, sign[start:stop, None], out=sq)
                    np.greater(sq, 0.0, out=cand)
                    np.maximum(sq, 0.0, out=sq)
                    np.square(sq, out=sq)
                else:
                    np.square(lr, out=sq)
                    cand[...] = True
            if not full:
                cand &= mb
                np.copyto(sq, 0.0, where=~mb)
            total += float(sq.sum())
            count += int(np.count_nonzero(cand))
        return total, count

    def _removed(self, log_ratio, mask, advantages, total, n) -> np.ndarray | None:
        """The removed tokens (N, T) bool, or None when nothing is removed, given Σ (log r)²
        over the candidates (``total``) and their number ``n``."""
        if n == 0 or total <= self.tau * n:
            return None
        removed = np.zeros(log_ratio.shape, dtype=bool)
        cand = self._candidates(log_ratio, mask, positive_rows(advantages))
        with np.errstate(over="ignore"):
            sq = np.where(cand, np.square(log_ratio), 0.0)
        k, threshold = _smallest_removal(sq[cand], total, self.tau)
        above = cand & (sq > threshold)
        removed |= above
        extra = k - int(np.count_nonzero(above))
        if extra > 0:
            ties = np.flatnonzero(cand & (sq == threshold))[:extra]
            removed.flat[ties] = True
        return removed

    def _coefficients(self, log_ratio, mask, advantages):
        c = np.empty(log_ratio.shape)
        total, n = self._stream(log_ratio, mask, advantages, c)
        removed = self._removed(log_ratio, mask, advantages, total, n)
        if removed is not None:
            c[removed] = 0.0
        return c


def _smallest_removal(values: np.ndarray, total: float, tau: float) -> tuple[int, float]:
    """Smallest k such that the mean of ``values`` without its k largest is ≤ tau.

    Returns (k, the k-th largest value). The mean of an empty remainder counts as 0. Only the
    top of the distribution is sorted (doubling the sorted part until k is found).
    """
    n = values.size
    top = min(n, 1024)
    while True:
        part = np.partition(values, n - top)[n - top :] if top < n else values.copy()
        part = np.sort(part)[::-1]
        removed_sum = np.cumsum(part)
        k = np.arange(1, top + 1)
        remaining = n - k
        with np.errstate(divide="ignore", invalid="ignore"):
            mean_rest = np.where(remaining > 0, (total - removed_sum) / remaining, 0.0)
        ok = np.flatnonzero(mean_rest <= tau)
        if ok.size:
            i = int(ok[0])
            return i + 1, float(part[i])
        top = min(n, top * 4)


@register
@dataclass(frozen=True)
class TOPR(ScalarMapping):
    """TOPR, tapered off-policy REINFORCE: c = 1 if A ≥ 0, c = clip(W, 0, 1) if A < 0.

    Le Roux et al., "Tapered off-policy REINFORCE", arXiv 2503.14286, Eq. 8: an SFT-like update
    for positive sequences and a truncated-IS update for negative ones (sequence level, true
    product W). No hyperparameters. Surrogate: A ≥ 0: F = 1 + log w (F(1) = 1); A < 0:
    F = min(w, 1) + log(max(w, 1)) (F(0) = 0).
    """

    name = "topr"
    level = "sequence"
    ratio_kind = "sequence"

    def _coefficients(self, log_ratio, mask, advantages):
        w = np.exp(np.minimum(seq_log_ratio(log_ratio, mask), 0.0))
        return broadcast_seq(np.where(positive_rows(advantages), 1.0, w), mask)

    def phi(self, w, positive=True):
        w = as_ratio(w)
        return np.ones_like(w) if positive else np.minimum(w, 1.0)

    def f(self, w, positive=True):
        w = as_ratio(w)
        if positive:
            return 1.0 + log_of(w)
        return np.minimum(w, 1.0) + np.log(np.maximum(w, 1.0))
