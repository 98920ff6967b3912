"""VESPO: variational sequence-level soft policy optimisation (the reshaping kernel).

"VESPO: variational sequence-level soft policy optimization", arXiv 2602.10693 v3.
The variational problem min_Q KL(Q‖μ) − α·E_Q[log W] s.t. E_Q[W] ≤ C has the solution
Q* ∝ μ·W^α·e^{−λW}, which reweights each sequence by the detached coefficient

    φ(W) = W^{c1} · exp(c2·(1 − W)),      (c1, c2) = (k, λ),

with its surrogate f(W) = e^{c2}·c2^{−c1}·γ(c1, c2·W) (γ the lower incomplete gamma), so that
W·f'(W) = φ(W), f(0) = 0, and f saturates at e^{c2}·c2^{−c1}·Γ(c1). φ(1) = 1 (on-policy
REINFORCE); sup φ = (c1/c2)^{c1}·e^{c2−c1} at W = c1/c2 (Prop. C.1).

:func:`vespo_phi` and :func:`vespo_f` are the pure kernels (used by ``simkit.theory``);
:class:`VESPO` is the registered mapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy.special import gammainc, gammaln

from simkit.mappings.base import (
    ScalarMapping,
    as_ratio,
    broadcast_seq,
    check_real,
    log_of,
    positive_rows,
    register,
)


def _check_shape_params(k, lam) -> tuple[float, float]:
    k, lam = float(k), float(lam)
    if not (math.isfinite(k) and k > 0):
        raise ValueError(f"k (c1) must be finite and > 0, got {k}")
    if not (math.isfinite(lam) and lam > 0):
        raise ValueError(f"lam (c2) must be finite and > 0, got {lam}")
    return k, lam


def vespo_phi(w, k, lam) -> np.ndarray:
    """VESPO coefficient φ(w) = w^k·exp(λ(1 − w)) of the sequence ratio ``w`` (any shape, ≥ 0).

    VESPO (arXiv 2602.10693 v3), §3: computed as exp(k·log w + λ(1 − w)); φ(0) = φ(∞) = 0.
    ``k`` = c1 > 0, ``lam`` = λ = c2 > 0.
    """
    k, lam = _check_shape_params(k, lam)
    w = as_ratio(w)
    with np.errstate(invalid="ignore"):
        log_phi = k * log_of(w) + lam * (1.0 - w)
    return np.where(np.isinf(w), 0.0, np.exp(log_phi))


def vespo_f(w, k, lam) -> np.ndarray:
    """VESPO surrogate f(w) = e^λ·λ^{−k}·γ(k, λw), with w·f'(w) = :func:`vespo_phi` and f(0) = 0.

    VESPO (arXiv 2602.10693 v3), §3; γ(a, x) = Γ(a)·P(a, x) with P the regularised lower
    incomplete gamma (``scipy.special.gammainc``). ``w`` any shape, ≥ 0.
    """
    k, lam = _check_shape_params(k, lam)
    w = as_ratio(w)
    scale = math.exp(lam - k * math.log(lam) + gammaln(k))
    return scale * gammainc(k, lam * w)


@register
@dataclass(frozen=True)
class VESPO(ScalarMapping):
    """VESPO sequence-level detached weight c_t = φ(W) = W^k·exp(λ(1 − W)) on every token.

    VESPO, arXiv 2602.10693 v3: (k, λ) = (``k_pos``, ``lambda_pos``) = (2, 3) for A ≥ 0
    and (``k_neg``, ``lambda_neg``) = (3, 2) for A < 0 (the paper's defaults); W is the true
    sequence product (no length normalisation), aggregation token-mean. As in the release,
    token log-ratios are clamped to ±``max_log_ratio_tok`` (20) before the sum and log W to
    [``min_log_ratio_seq``, ``max_log_ratio_seq``] after it (default [−20, 20]), and NaN/inf
    coefficients are set to 0. Presets ``release`` and ``trl``: the lower clamp of log W at
    log(1e-8) ≈ −18.42 of the VESPO release and of TRL (``GRPOTrainer.get_gamma_weights``,
    ``grpo_trainer.py`` at f2cd577: ``lower_clamp = math.log(1e-8)``); the difference to
    −20 only touches φ(W) < 1e-15. Surrogate f = :func:`vespo_f` (f(0) = 0).
    """

    presets: ClassVar[dict[str, dict]] = {
        "release": {"min_log_ratio_seq": math.log(1e-8)},
        "trl": {"min_log_ratio_seq": math.log(1e-8)},
    }

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0
    max_log_ratio_tok: float = 20.0
    max_log_ratio_seq: float = 20.0
    min_log_ratio_seq: float = -20.0
    name = "vespo"
    quiet_defaults = ("min_log_ratio_seq",)
    level = "sequence"
    ratio_kind = "sequence"

    def __post_init__(self):
        for field in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            check_real(self, field, low=0.0, low_open=True)
        check_real(self, "max_log_ratio_tok", low=0.0, high=700.0, low_open=True)
        check_real(self, "max_log_ratio_seq", low=0.0, high=700.0, low_open=True)
        check_real(self, "min_log_ratio_seq", low=-700.0, high=0.0, high_open=True)

    def _params(self, positive: bool) -> tuple[float, float]:
        return (self.k_pos, self.lambda_pos) if positive else (self.k_neg, self.lambda_neg)

    def _coefficients(self, log_ratio, mask, advantages):
        N, T = log_ratio.shape
        log_w = np.zeros(N)
        rows = max(1, (1 << 16) // max(T, 1))
        tmp = np.empty((min(rows, N), T))
        cap = self.max_log_ratio_tok
        for start in range(0, N, rows):
            stop = min(start + rows, N)
            t = tmp[: stop - start]
            np.clip(log_ratio[start:stop], -cap, cap, out=t)
            np.add.reduce(t, axis=1, where=mask[start:stop], initial=0.0, out=log_w[start:stop])
        return self._phi_of_log_w(log_w, mask, advantages)

    def coefficients_from_log_w(self, log_w, mask, advantages) -> np.ndarray:
        """c = φ(W) on every valid token from a given log W (N,) (clamped to the sequence
        bounds here): the entry point of TRL's composition, which folds a token correction
        into W (:mod:`simkit.composition`, mode ``trl_vespo``). ``mask`` (N, T), ``advantages``
        (N,)."""
        return self._phi_of_log_w(np.array(log_w, dtype=np.float64), mask, advantages)

    def _phi_of_log_w(self, log_w, mask, advantages):
        np.clip(log_w, self.min_log_ratio_seq, self.max_log_ratio_seq, out=log_w)
        pos = positive_rows(advantages)
        k = np.where(pos, self.k_pos, self.k_neg)
        lam = np.where(pos, self.lambda_pos, self.lambda_neg)
        with np.errstate(invalid="ignore", over="ignore"):
            phi = np.exp(k * log_w + lam * (1.0 - np.exp(log_w)))
        phi = np.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
        return broadcast_seq(phi, mask)

    def phi(self, w, positive=True):
        return vespo_phi(w, *self._params(positive))

    def f(self, w, positive=True):
        return vespo_f(w, *self._params(positive))
