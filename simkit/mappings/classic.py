"""Section A of the reference sheet: classic importance sampling (the endpoints)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkit.mappings.base import ScalarMapping, broadcast_seq, register, require, seq_log_ratio


@register
@dataclass(frozen=True)
class Naive(ScalarMapping):
    """On-policy REINFORCE, ``c = 1``: ignores the mismatch (biased, lowest variance)."""

    name = "naive"
    level = "token"

    def _coefficients(self, log_ratio, mask, advantages):
        return mask.astype(np.float64)

    def phi(self, w, positive=True):
        return np.ones_like(np.asarray(w, dtype=np.float64))

    def f(self, w, positive=True):
        """F(w) = log w (so that w·F'(w) = 1)."""
        with np.errstate(divide="ignore"):
            return np.log(np.asarray(w, dtype=np.float64))


@register
@dataclass(frozen=True)
class TokenIS(ScalarMapping):
    """Token importance sampling, ``c_t = r_t = exp(log_ratio_t)``.

    The "first-order" approximation of sequence IS (VESPO, arXiv 2602.10693, App. A); biased
    through the state distribution (bias ~ T²·TV, rl-collapse).

    ``max_log_ratio`` clamps each token log-ratio from above before exponentiating (default 80,
    e^80 ≈ 5.5e34) so that the output stays finite.
    """

    max_log_ratio: float = 80.0
    name = "is_token"
    level = "token"

    def __post_init__(self):
        require(self.max_log_ratio > 0, f"max_log_ratio must be > 0, got {self.max_log_ratio}")

    def _coefficients(self, log_ratio, mask, advantages):
        w = np.exp(np.minimum(log_ratio, self.max_log_ratio))
        return np.where(mask, w, 0.0)

    def phi(self, w, positive=True):
        return np.asarray(w, dtype=np.float64)

    def f(self, w, positive=True):
        return np.asarray(w, dtype=np.float64)


@register
@dataclass(frozen=True)
class SequenceIS(ScalarMapping):
    """Sequence importance sampling, ``c_t = W = exp(Σ_t log r_t)`` on every token.

    Unbiased for the sequence objective; Var grows like (1+χ²)^T (independent tokens:
    E_μ[W²] = Π_t (1+χ²_t)). ``max_log_ratio`` clamps log W from above (default 80).
    """

    max_log_ratio: float = 80.0
    name = "is_seq"
    level = "sequence"

    def __post_init__(self):
        require(self.max_log_ratio > 0, f"max_log_ratio must be > 0, got {self.max_log_ratio}")

    def _coefficients(self, log_ratio, mask, advantages):
        log_w = np.minimum(seq_log_ratio(log_ratio, mask), self.max_log_ratio)
        return broadcast_seq(np.exp(log_w), mask)

    def phi(self, w, positive=True):
        return np.asarray(w, dtype=np.float64)

    def f(self, w, positive=True):
        return np.asarray(w, dtype=np.float64)
