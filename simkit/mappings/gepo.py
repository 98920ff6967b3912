"""GEPO: the group-expectation importance weight π(y)/Ê_group[μ(y)] (batch dependent).

Group Expectation Policy Optimization (Zhang et al. 2025, arXiv 2508.17850; reference code
github.com/yelurebajrang/HeteroRL_GEPO, README "Importance weight computation", built on TRL):
instead of the sequence ratio π(y_i)/μ(y_i), each sequence of a group of G responses to one
prompt gets

    w_i = π(y_i) / Ê_μ[μ],     Ê_μ[μ] = Σ_j μ(y_j)² / Σ_j μ(y_j)     (j over the group)

— the denominator is the group's self-normalised estimate of E_{y∼μ}[μ(y)], shared by the group,
and detached. The loss −w_i·A_i (w differentiated through π(y_i) = Π_t π_t) gives every token
of row i the coefficient c_t = w_i. Computed in log space: log w_i = log π(y_i) −
(logsumexp_j 2·log μ(y_j) − logsumexp_j log μ(y_j)), with log π(y_i) = Σ_t log π_t (so
``requires_log_prob``) and log μ(y_i) = log π(y_i) − log W_i. Only the weight is modelled (the
paper's clipping of it, if any, is not). Not 1 on-policy (π(y_i)/Ê_π[π] ≠ 1), and batch
dependent: Monte Carlo rows only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkit._validation import check_batch, like_log_ratio
from simkit.mappings.base import (
    DEFAULT_MAX_LOG_RATIO,
    Mapping,
    broadcast_seq,
    check_max_log_ratio,
    register,
    seq_log_ratio,
)


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    top = np.max(x, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - top), axis=axis)) + np.squeeze(top, axis=axis)


def gepo_log_weights(log_pi_seq: np.ndarray, log_mu_seq: np.ndarray, group_size) -> np.ndarray:
    """log w_i = log π(y_i) − log(Σ_j μ_j² / Σ_j μ_j) per group of ``group_size`` consecutive
    rows (None: the whole batch), (N,) from the (N,) sequence log-probabilities."""
    N = log_pi_seq.shape[0]
    G = N if group_size is None else int(group_size)
    if N == 0:
        return log_pi_seq.copy()
    if N % G:
        raise ValueError(f"gepo: the batch size N = {N} is not divisible by group_size = {G}")
    lm = log_mu_seq.reshape(N // G, G)
    log_e = _logsumexp(2.0 * lm, axis=1) - _logsumexp(lm, axis=1)
    return log_pi_seq - np.repeat(log_e, G)


@register
@dataclass(frozen=True)
class GEPO(Mapping):
    """GEPO (module docstring): c_t = w_i = π(y_i)/Ê_group[μ] on every token of row i.

    ``group_size``: G consecutive rows per prompt (None: the whole batch is one group, as a
    batch of one prompt); ``max_log_ratio`` caps log w. Needs ``log_prob`` (log π per token).
    """

    group_size: int | None = None
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "gepo"
    level = "batch"
    batch_dependent = True
    on_policy_identity = False
    uses_log_prob = True
    requires_log_prob = True

    def __post_init__(self):
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int | np.integer) or g < 1):
            raise ValueError(f"gepo: group_size must be a positive integer or None, got {g!r}")
        check_max_log_ratio(self)

    def coefficients(self, log_ratio, mask, advantages, *, log_prob=None, rng=None):
        lr, m, _ = check_batch(log_ratio, mask, advantages)
        if log_prob is None:
            raise ValueError(
                "mapping 'gepo' needs log_prob (log π of each token, shape (N, T)): its weight "
                "is π(y) over the group mean of μ(y), not a ratio"
            )
        lp = like_log_ratio(log_prob, lr, "log_prob")
        log_pi = np.add.reduce(np.where(m, lp, 0.0), axis=1)
        if not np.all(np.isfinite(log_pi)):
            raise ValueError("log_prob must be finite on valid tokens")
        log_mu = log_pi - seq_log_ratio(lr, m)
        log_w = gepo_log_weights(log_pi, log_mu, self.group_size)
        return broadcast_seq(np.exp(np.minimum(log_w, self.max_log_ratio)), m)


__all__ = ["GEPO", "gepo_log_weights"]
