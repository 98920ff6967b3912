"""DRO / Kimi-1.5: REINFORCE plus a quadratic log-ratio penalty — an additive per-token term.

The loss of verl ``compute_policy_loss_dro`` (``verl/trainer/ppo/core_algos.py`` at
verl-project/verl 1dda039) and of ROLL's ``kimi15`` policy-gradient variant
(``roll/pipeline/agentic/agentic_actor_pg_worker.py``, ``_compute_kimi15_loss``, at
alibaba/ROLL 8eb27cc) is, per valid token,

    loss_t = −(A·log π_t − β/2·(log r_t)²),        log r_t = log π_t − log μ_t,

whose gradient w.r.t. log π_t is −(A − β·log r_t): the coefficient of A is 1 (naive) and the
penalty adds the term b_t = −β·log r_t, which is *not* proportional to A (see the contract in
:mod:`simkit.mappings.base`). Kimi k1.5 (arXiv 2501.12599, §2.3.2) writes the penalty as
τ/2·(log π/π_old)², so β = τ (ROLL's ``kimi15_tau``, 0.1 by default); prime-rl's
``kl_tau·(log r)²`` (``src/prime_rl/trainer/rl/loss.py`` at PrimeIntellect-ai/prime-rl 559b447)
is β = 2·kl_tau. β = 0 is REINFORCE exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from simkit._validation import check_batch
from simkit.mappings.base import Mapping, check_real, register


def log_ratio_penalty_term(log_ratio: np.ndarray, mask: np.ndarray, beta: float) -> np.ndarray:
    """b_t = −β·log r_t on valid tokens, 0 on padding (N, T): the gradient term of the penalty
    β/2·(log r_t)² w.r.t. log π_t, with the sign of a coefficient (g = (c·A + b)·∇log π)."""
    out = np.where(mask, log_ratio, 0.0)
    out *= -beta
    return out + 0.0  # −0.0 → 0.0


@register
@dataclass(frozen=True)
class DRO(Mapping):
    """DRO (verl ``dro``, ROLL ``kimi15``): c_t = 1 and the additive term b_t = −β·log r_t.

    Gradient weight of token t: A − β·log r_t (the module docstring). ``beta`` ≥ 0 (β; verl's
    ``policy_loss.dro_beta`` has no default and must be > 0 there; here the default is
    Kimi's τ = 0.1, preset ``kimi15``). β = 0 is ``naive`` exactly. On-policy log r = 0 ⇒
    c = 1, b = 0 (REINFORCE).
    """

    beta: float = 0.1
    name = "dro"
    presets: ClassVar[dict[str, dict]] = {"kimi15": {"beta": 0.1}}

    def __post_init__(self):
        check_real(self, "beta", low=0.0)

    @property
    def has_additive(self) -> bool:
        return self.beta > 0

    def _coefficients(self, log_ratio, mask, advantages):
        return mask.astype(np.float64)

    def phi_probs(self, p, q, positive: bool = True) -> np.ndarray:
        """c = 1 on probability tables p = π(y|s), q = μ(y|s) (any shape): the token DP's
        tables (:mod:`simkit.envs.token_moments`; the additive term is carried there)."""
        return np.ones(np.shape(p))

    def additive(self, log_ratio, mask, log_prob=None) -> np.ndarray:
        lr, m, _ = check_batch(log_ratio, mask, np.zeros(np.shape(log_ratio)[:1]))
        return log_ratio_penalty_term(lr, m, float(self.beta))


__all__ = ["DRO", "log_ratio_penalty_term"]
