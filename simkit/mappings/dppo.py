"""DPPO: a direction-gated trust region on the token *probability*, not on the ratio.

Divergence PPO (arXiv 2602.04879, §4, Eqs. 13–14): a token is kept unless its probability moved
too far in the direction its advantage pushes it. With p = π(y_t|s_t), q = μ(y_t|s_t) (the
sampling policy's probability, π_old in a decoupled estimator) and the binary divergences

    TV:  D_t = p − q                                       (signed)
    KL:  D_t = q·log(q/p) + (1 − q)·log((1 − q + ε)/(1 − p + ε))   (binary KL, ε = 1e-8)

the kept tokens are, for A ≥ 0, D_t ≤ ε_high (TV) or D_t ≤ ε_high ∨ p ≤ q (KL), and for A < 0,
D_t ≥ −ε_low (TV) or D_t ≤ ε_low ∨ p ≥ q (KL); a kept token has the TIS coefficient
min(r_t, C), r_t = exp(clip(log r_t, ±L)), and a dropped one 0:

    c_t = min(r_t, C) · 1[token kept]        (loss −A·sg(c_t)·log π_t, verl)

Formulas and defaults from verl ``compute_policy_loss_dppo_tv`` / ``compute_policy_loss_dppo_kl``
(``verl/trainer/ppo/core_algos.py`` at verl-project/verl 1dda039): ε = ``clip_ratio_low`` /
``clip_ratio_high`` (0.2), C = ``clip_ratio_c`` — 3.0 in ``verl/trainer/config/actor/actor.yaml``
and ``verl/workers/config/actor.py`` (the default, preset ``verl``), 20 only when the key is
absent from the config (``config.get("clip_ratio_c", 20.0)``, preset ``verl_fallback``) —,
L = 20 (verl clamps log r to [−20, 20] before the exponential). SkyRL's ``dppo``
(``skyrl/backends/skyrl_train/utils/ppo_utils.py`` at NovaSky-AI/SkyRL a956457) and prime-rl's
default loss (``src/prime_rl/trainer/rl/loss.py`` at PrimeIntellect-ai/prime-rl 559b447) use the
un-truncated ratio (C = ∞); prime-rl adds ``kl_tau·(log r)²`` (kl_tau = 1e-3), the additive
term b_t = −β·log r_t with β = 2·kl_tau (:mod:`simkit.mappings.dro`), field ``beta``.

Sign convention: simkit's A ≥ 0 rule picks the band of a row with A = 0; verl, SkyRL and
prime-rl gate such a row with the A < 0 rule (``advantages > 0``). Its c·A is 0 either way
(only the kept-token counts of A = 0 rows can differ).

The coefficient needs p and q, not only r = p/q: ``requires_log_prob`` (the contract in
:mod:`simkit.mappings.base`): ``coefficients(..., log_prob=log π)``, log q = log π − log r.
It is still per token (c_t depends on the token's own log π and log μ only), so the exact path
and the token DP apply (:meth:`DPPO.phi_probs`: c from the probability tables of π and μ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from simkit._validation import check_batch, like_log_ratio
from simkit.mappings.base import (
    Mapping,
    check_max_log_ratio,
    check_real,
    positive_rows,
    register,
)
from simkit.mappings.dro import log_ratio_penalty_term

#: ε of verl's binary KL, log((1 − q + ε)/(1 − p + ε))
BINARY_KL_EPS = 1e-8


def binary_kl(log_p: np.ndarray, log_q: np.ndarray, eps: float = BINARY_KL_EPS) -> np.ndarray:
    """q·(log q − log p) + (1 − q)·log((1 − q + ε)/(1 − p + ε)) (verl's DPPO-Binary-KL), any
    broadcastable shapes; 1 − p computed as −expm1(log p) (no cancellation near p = 0)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        q = np.exp(log_q)
        first = np.where(q > 0, q * (log_q - log_p), 0.0)
        second = (1.0 - q) * np.log((-np.expm1(log_q) + eps) / (-np.expm1(log_p) + eps))
    return first + second


def dppo_coefficient(log_p, log_q, positive, divergence, eps_low, eps_high, c, clamp, kl_eps):
    """c = min(exp(clip(log p − log q, ±clamp)), c)·1[kept] elementwise (module docstring);
    ``positive`` (bool, broadcastable) is A ≥ 0. −inf log-probabilities are allowed."""
    with np.errstate(invalid="ignore"):
        lr = log_p - log_q
    r = np.exp(np.clip(lr, -clamp, clamp))
    if math.isfinite(c):
        np.minimum(r, c, out=r)
    with np.errstate(over="ignore"):  # log π > 709 (not a log-probability) gives p = inf
        p, q = np.exp(log_p), np.exp(log_q)
    if divergence == "tv":
        diff = p - q
        kept = np.where(positive, diff <= eps_high, diff >= -eps_low)
    else:
        kl = binary_kl(log_p, log_q, kl_eps)
        kept = np.where(positive, (kl <= eps_high) | (p <= q), (kl <= eps_low) | (p >= q))
    return np.where(kept, r, 0.0)


class DPPO(Mapping):
    """DPPO-Binary-TV / -KL (module docstring): c_t = min(r_t, C)·1[kept], b_t = −β·log r_t.

    ``eps_low``, ``eps_high`` ≥ 0 (the divergence thresholds, 0.2), ``c`` ≥ 1 (the TIS cap C,
    ``inf`` for none; 3.0 = verl's default), ``beta`` ≥ 0 (prime-rl's penalty, 0),
    ``max_log_ratio`` (L, the symmetric clamp of log r before the exponential, 20 as verl),
    ``kl_eps`` (binary KL only, 1e-8). On-policy (p = q) every token is kept and c = 1.
    """

    divergence: ClassVar[str] = "tv"
    uses_log_prob = True
    requires_log_prob = True

    def __post_init__(self):
        check_real(self, "eps_low", low=0.0, allow_inf=True)
        check_real(self, "eps_high", low=0.0, allow_inf=True)
        check_real(self, "c", low=1.0, allow_inf=True)
        check_real(self, "beta", low=0.0)
        check_max_log_ratio(self)
        check_real(self, "kl_eps", low=0.0, high=1.0)

    @property
    def has_additive(self) -> bool:
        return self.beta > 0

    def _inputs(self, log_ratio, mask, advantages, log_prob):
        lr, m, adv = check_batch(log_ratio, mask, advantages)
        if log_prob is None:
            raise ValueError(
                f"mapping {self.name!r} needs log_prob (log π of each token, shape (N, T)): "
                "its trust region acts on the probabilities π and μ, not only on their ratio"
            )
        lp = like_log_ratio(log_prob, lr, "log_prob")
        with np.errstate(invalid="ignore"):
            lp = np.where(m, lp, 0.0)
        if np.isnan(lp).any():
            raise ValueError("log_prob is NaN on a valid token")
        return lr, m, adv, lp

    def coefficients(self, log_ratio, mask, advantages, *, log_prob=None, rng=None):
        lr, m, adv, lp = self._inputs(log_ratio, mask, advantages, log_prob)
        with np.errstate(invalid="ignore"):
            log_q = np.where(m, lp - lr, 0.0)
        c = self._phi(lp, log_q, positive_rows(adv)[:, None])
        return np.where(m, c, 0.0)

    def kept_mask(self, log_ratio, mask, advantages, log_prob=None) -> np.ndarray:
        _, m, _ = check_batch(log_ratio, mask, advantages)
        return m.copy()

    def phi_probs(self, p, q, positive: bool = True) -> np.ndarray:
        """c as a function of the probabilities p = π(y|s), q = μ(y|s) (arrays, any shape): the
        token DP's tables (:mod:`simkit.envs.token_moments`)."""
        with np.errstate(divide="ignore"):
            return self._phi(np.log(p), np.log(q), positive)

    def _phi(self, log_p, log_q, positive):
        return dppo_coefficient(
            log_p,
            log_q,
            positive,
            self.divergence,
            float(self.eps_low),
            float(self.eps_high),
            float(self.c),
            float(self.max_log_ratio),
            float(self.kl_eps),
        )

    def additive(self, log_ratio, mask, log_prob=None) -> np.ndarray:
        lr, m, _ = check_batch(log_ratio, mask, np.zeros(np.shape(log_ratio)[:1]))
        return log_ratio_penalty_term(lr, m, float(self.beta))


_VERL = {"c": 3.0}
_VERL_FALLBACK = {"c": 20.0}
_SKYRL = {"c": math.inf}


@register
@dataclass(frozen=True)
class DPPOBinaryTV(DPPO):
    """DPPO-Binary-TV: c_t = min(r_t, C)·1[p − q ≤ ε_high] (A ≥ 0), min(r_t, C)·1[p − q ≥ −ε_low]
    (A < 0), with p = π(y_t|s_t), q = μ(y_t|s_t); b_t = −β·log r_t.

    DPPO (arXiv 2602.04879, Eq. 13), verl ``compute_policy_loss_dppo_tv``
    (``verl/trainer/ppo/core_algos.py`` @ 1dda039). Defaults ε = 0.2/0.2, C = 3 (verl's
    ``clip_ratio_c``), β = 0, log r clamped to ±20; presets ``verl`` (C = 3), ``verl_fallback``
    (C = 20), ``skyrl`` (C = ∞) and ``prime_rl`` (C = ∞, β = 2·kl_tau = 2e-3). Needs
    ``log_prob`` (module docstring); on-policy p = q ⇒ c = 1.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    c: float = 3.0
    beta: float = 0.0
    max_log_ratio: float = 20.0
    kl_eps: float = BINARY_KL_EPS
    name = "dppo_tv"
    divergence = "tv"
    quiet_defaults = ("kl_eps",)
    presets: ClassVar[dict[str, dict]] = {
        "verl": _VERL,
        "verl_fallback": _VERL_FALLBACK,
        "skyrl": _SKYRL,
        # prime-rl: DPPO-Binary-TV 0.2/0.2, the plain ratio, + kl_tau·(log r)², kl_tau = 1e-3
        "prime_rl": {"c": math.inf, "beta": 2e-3, "max_log_ratio": 80.0},
    }


@register
@dataclass(frozen=True)
class DPPOBinaryKL(DPPO):
    """DPPO-Binary-KL: c_t = min(r_t, C)·1[KL_bin ≤ ε_high ∨ p ≤ q] (A ≥ 0),
    min(r_t, C)·1[KL_bin ≤ ε_low ∨ p ≥ q] (A < 0), KL_bin = q·log(q/p) +
    (1 − q)·log((1 − q + ε)/(1 − p + ε)); b_t = −β·log r_t.

    DPPO (arXiv 2602.04879, Eq. 14), verl ``compute_policy_loss_dppo_kl``
    (``verl/trainer/ppo/core_algos.py`` @ 1dda039; ε = ``kl_eps`` = 1e-8). Defaults ε = 0.2/0.2
    (the paper suggests 0.05 for KL), C = 3; presets ``verl``, ``verl_fallback`` (C = 20),
    ``skyrl`` (C = ∞). Needs ``log_prob``; on-policy p = q ⇒ c = 1.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    c: float = 3.0
    beta: float = 0.0
    max_log_ratio: float = 20.0
    kl_eps: float = BINARY_KL_EPS
    name = "dppo_kl"
    divergence = "kl"
    quiet_defaults = ("kl_eps",)
    presets: ClassVar[dict[str, dict]] = {
        "verl": _VERL,
        "verl_fallback": _VERL_FALLBACK,
        "skyrl": _SKYRL,
    }


__all__ = ["DPPO", "DPPOBinaryKL", "DPPOBinaryTV", "binary_kl", "dppo_coefficient"]
