"""LUSPO: GSPO's clipped geometric-mean ratio with each sequence's loss scaled by its length.

Length-Unbiased Sequence Policy Optimization (arXiv 2602.05261), as TRL implements it
(``loss_type="luspo"`` in ``trl/trainer/grpo_trainer.py`` at huggingface/trl f2cd577, with
``importance_sampling_level="sequence"``): the per-sequence loss −min(s·A, clip(s, 1−ε, 1+ε)·A)
of GSPO, s = exp(mean_t log r_t), is multiplied by |y| before the batch mean
(``(per_token_loss * mask.sum(1, keepdim=True)).mean()``). GSPO's loss per sequence has the
gradient s·A/|y| per token (the geometric mean spreads it over |y| tokens); LUSPO's |y| undoes
that, so each token of the sequence gets s·A — no 1/|y| length penalty.

In simkit's convention λ = c·A/Z the coefficient is c_t = |y|·s·1[s in GSPO's band for the sign
of A] (the GSPO coefficient of :class:`simkit.mappings.clipping.GSPO` times the row's number of
valid tokens); with ``seq-mean-token-mean`` (1/Z = 1/(N·|y|)) the gradient is TRL's,
(1/N)·Σ_i s_i·A_i·Σ_t ∇log π_t. ε = TRL's ``epsilon`` (0.2; ``epsilon_high`` defaults to it).
On-policy s = 1 ⇒ c = |y| (not 1: LUSPO is REINFORCE with per-token weights A, i.e. seq-mean-
token-sum, under a token-mean aggregation), so ``on_policy_identity`` is False.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from simkit.mappings.base import (
    DEFAULT_MAX_LOG_RATIO,
    Mapping,
    check_max_log_ratio,
    check_real,
    register,
    seq_lengths,
)
from simkit.mappings.clipping import GSPO


@register
@dataclass(frozen=True)
class LUSPO(Mapping):
    """LUSPO (module docstring): c_t = |y|·s·1[s ≤ 1+ε_high] (A ≥ 0) or |y|·s·1[s ≥ 1−ε_low]
    (A < 0). ``eps_low``, ``eps_high`` ≥ 0 (0.2 each, TRL), ``max_log_ratio`` caps log s."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "luspo"
    level = "sequence"
    on_policy_identity = False
    presets: ClassVar[dict[str, dict]] = {"trl": {"eps_low": 0.2, "eps_high": 0.2}}

    def __post_init__(self):
        check_real(self, "eps_low", low=0.0, high=math.inf, allow_inf=True)
        check_real(self, "eps_high", low=0.0, high=math.inf, allow_inf=True)
        check_max_log_ratio(self)

    @property
    def gspo(self) -> GSPO:
        """The GSPO mapping whose coefficient LUSPO scales by |y|."""
        return GSPO(eps_low=self.eps_low, eps_high=self.eps_high, max_log_ratio=self.max_log_ratio)

    def _coefficients(self, log_ratio, mask, advantages):
        c = self.gspo._coefficients(log_ratio, mask, advantages)
        c *= seq_lengths(mask)[:, None]
        return c


__all__ = ["LUSPO"]
