"""A KL penalty to a reference policy π_ref: its per-token estimators, placements and truth.

Every trainer can add β·KL(π‖π_ref) to the policy loss. The objective is then

    J_β(π) = J(π) − β·KL_seq(π‖π_ref),   KL_seq = E_π[Σ_t log π(y_t|s_t)/π_ref(y_t|s_t)],

and the question is which per-token estimator k_t, placed where, gives ∇KL_seq. With
x_t = log π(y_t|s_t) − log π_ref(y_t|s_t) (on tokens drawn from the sampling policy μ) the
estimators are those of verl ``verl/trainer/ppo/core_algos.py`` (``kl_penalty`` and
``kl_penalty_forward``, verl-project/verl at 1dda039; J. Schulman, "Approximating KL
divergence", 2020):

=============  =====================================  ======================================
estimator      value k(x)                             d k / d log π (the gradient it carries)
=============  =====================================  ======================================
``k1``         x                                      1
``k2``         x²/2                                   x
``k3``         e^{−x} + x − 1                         1 − e^{−x}
``abs``        |x|                                    sign x
``low_var_kl`` k3 with u = −x clamped to [−20, 20]    (1 − e^{u}) where −20 ≤ u ≤ 20 and the
               and the result clamped to [−10, 10]    value ≤ 10, else 0 (verl's clamps; verl
                                                      computes ``k3`` the same way)
``k1+`` …      the value of ``k1`` (``k3``, ``abs``,  x: the gradient of k2 by the straight
               ``low_var_kl``)                        through k2 − sg(k2) + sg(k) of verl
=============  =====================================  ======================================

Placement (:class:`KLPenalty` ``where``):

- ``"loss"`` (verl ``use_kl_loss``, ``verl/workers/utils/losses.py`` @1dda039; TRL
  ``GRPOTrainer``'s ``beta``): β·k_t is added to each token's loss and aggregated like the
  policy loss; its gradient flows through log π, so it adds the per-token weight
  λ^KL_t = −β·a_t·∂(w_t k_t)/∂log π (a_t = 1/Z the aggregation weight) to the ascent direction.
- ``"reward"`` (verl ``use_kl_in_reward``, ``apply_kl_penalty`` in
  ``verl/trainer/ppo/ray_trainer.py`` @1dda039): the detached value is subtracted from the
  reward, R'_i = R_i − β·Σ_t w_t k_t (the sequence sum that GRPO's outcome advantage takes of
  verl's token-level rewards), and R' goes through the estimator's advantage and mapping.

``correction="is"`` multiplies k_t by w_t = π(y_t|s_t)/μ(y_t|s_t), the importance weight of the
sampling policy (TRL ``use_bias_correction_kl``, ``trl/trainer/grpo_trainer.py`` @f2cd577: k3
times ``coef_1`` = exp(log π − log π_old), gradient not detached), so
∂(w k)/∂log π = w·(k + k'). For k3 this is w·x: the token's contribution to the gradient of
the *per-state* KL, unbiased for it whatever μ. ``None``: w = 1.

The truth is exact: :func:`kl_seq_and_grad` (the additive DP of :mod:`simkit.envs.additive`).
Shapes: per-token arrays (L..., N, T); ``x`` and ``log_ratio`` = log π − log μ alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simkit.envs._checks import safe_log
from simkit.envs.additive import additive_expectation, additive_value_and_grad

#: the base estimators of verl's ``kl_penalty_forward`` (``kl``/``mse`` are verl's aliases of
#: ``k1``/``k2`` and are not repeated here)
BASE_ESTIMATORS = ("k1", "k2", "k3", "abs", "low_var_kl")
#: every estimator: the bases and the straight-through ``+`` variants (value of the base,
#: gradient of k2)
KL_ESTIMATORS = (*BASE_ESTIMATORS, "k1+", "k3+", "abs+", "low_var_kl+")
#: where the estimate goes: the loss (gradient through π) or the reward (detached)
PLACEMENTS = ("loss", "reward")
#: the importance weight on k: none, or π/μ of the sampling policy (TRL's bias correction)
KL_CORRECTIONS = (None, "is")
#: verl's clamps in ``low_var_kl`` (and its ``k3``): u = log π_ref − log π to [−20, 20], k to
#: [−10, 10]
LOW_VAR_KL_LOG_CLAMP = 20.0
LOW_VAR_KL_VALUE_CLAMP = 10.0


@dataclass(frozen=True)
class KLPenalty:
    """β·KL(π‖π_ref) estimated per token by ``estimator``, placed in the ``loss`` or the
    ``reward``, with the sampling policy's importance weight (``correction="is"``) or not.

    Parameters
    ----------
    beta : float
        β ≥ 0 (verl ``kl_loss_coef`` / ``kl_ctrl.kl_coef``, TRL ``beta``).
    estimator : str
        One of :data:`KL_ESTIMATORS` (module docstring: values and gradients). Default ``"k3"``
        (TRL's estimator; verl's default ``kl_loss_type`` is ``low_var_kl``, the same k3 with
        clamps).
    where : str
        ``"loss"`` (default) or ``"reward"`` (:data:`PLACEMENTS`).
    correction : None or ``"is"``
        Multiply k_t by π/μ of the drawn token (gradient not detached in the loss).
    """

    beta: float
    estimator: str = "k3"
    where: str = "loss"
    correction: str | None = None

    def __post_init__(self):
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float | np.floating):
            raise TypeError(f"beta must be a number, got {type(self.beta).__name__}")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"beta must be finite and >= 0, got {self.beta}")
        object.__setattr__(self, "beta", float(self.beta))
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"unknown KL estimator {self.estimator!r}; valid: {', '.join(KL_ESTIMATORS)}"
            )
        if self.where not in PLACEMENTS:
            raise ValueError(f"where must be one of {PLACEMENTS}, got {self.where!r}")
        if self.correction not in KL_CORRECTIONS:
            raise ValueError(f"correction must be None or 'is', got {self.correction!r}")

    @property
    def label(self) -> str:
        """Short description, e.g. ``"0.1·k3 in loss, is"``."""
        corr = ", is" if self.correction == "is" else ""
        return f"{self.beta:g}·{self.estimator} in {self.where}{corr}"

    def values(self, x, log_ratio=None, mask=None) -> np.ndarray:
        """The detached per-token penalty w_t·k(x_t) (0 on padding); ``log_ratio`` = log π −
        log μ is needed with ``correction="is"``."""
        x = np.asarray(x, dtype=np.float64)
        k = kl_estimate(x, self.estimator)
        if self.correction == "is":
            k = _weight(self, log_ratio, x.shape) * k
        return _masked(k, mask)

    def slopes(self, x, log_ratio=None, mask=None) -> np.ndarray:
        """∂(w_t·k_t)/∂log π(y_t|s_t) per token (0 on padding): k'(x) without the correction,
        w·(k(x) + k'(x)) with it (w = π/μ carries the gradient as TRL's ``coef_1``)."""
        x = np.asarray(x, dtype=np.float64)
        slope = kl_slope(x, self.estimator)
        if self.correction == "is":
            w = _weight(self, log_ratio, x.shape)
            if self.estimator == "k3":  # k3 + k3' = x exactly (no cancellation of e^{−x})
                slope = w * x
            else:
                slope = w * (kl_estimate(x, self.estimator) + slope)
        return _masked(slope, mask)


def _weight(kl: KLPenalty, log_ratio, shape) -> np.ndarray:
    if log_ratio is None:
        raise ValueError("correction='is' needs log_ratio = log pi - log mu of the tokens")
    lr = np.asarray(log_ratio, dtype=np.float64)
    if lr.shape != shape:
        raise ValueError(f"log_ratio must have the shape of x {shape}, got {lr.shape}")
    return np.exp(lr)


def _masked(values: np.ndarray, mask) -> np.ndarray:
    if mask is None:
        return values
    m = np.asarray(mask, dtype=bool)
    if m.shape != values.shape:
        raise ValueError(f"mask must have shape {values.shape}, got {m.shape}")
    return np.where(m, values, 0.0)


def check_estimator(estimator: str) -> str:
    """``estimator`` if it is one of :data:`KL_ESTIMATORS` (``ValueError`` naming it else)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return estimator


def kl_estimate(x, estimator: str) -> np.ndarray:
    """The value k(x) of ``estimator`` at x = log π − log π_ref (module docstring's table)."""
    check_estimator(estimator)
    x = np.asarray(x, dtype=np.float64)
    base = estimator.rstrip("+")
    if base == "k1":
        return x.copy()
    if base == "k2":
        return 0.5 * x**2
    if base == "abs":
        return np.abs(x)
    if base == "k3":
        return np.expm1(-x) + x
    u = np.clip(-x, -LOW_VAR_KL_LOG_CLAMP, LOW_VAR_KL_LOG_CLAMP)
    return np.clip(np.expm1(u) - u, -LOW_VAR_KL_VALUE_CLAMP, LOW_VAR_KL_VALUE_CLAMP)


def kl_slope(x, estimator: str) -> np.ndarray:
    """dk/d log π of the expression that carries ``estimator``'s gradient (module docstring).

    ``low_var_kl``: 0 where a clamp is active (torch's ``clamp`` passes the gradient on the
    closed interval, so the bounds themselves keep it)."""
    check_estimator(estimator)
    x = np.asarray(x, dtype=np.float64)
    if estimator.endswith("+") or estimator == "k2":
        return x.copy()
    if estimator == "k1":
        return np.ones_like(x)
    if estimator == "abs":
        return np.sign(x)
    if estimator == "k3":
        return -np.expm1(-x)
    u = -x
    inside = np.abs(u) <= LOW_VAR_KL_LOG_CLAMP
    uc = np.clip(u, -LOW_VAR_KL_LOG_CLAMP, LOW_VAR_KL_LOG_CLAMP)
    inside &= np.expm1(uc) - uc <= LOW_VAR_KL_VALUE_CLAMP
    return np.where(inside, -np.expm1(uc), 0.0)


# --- the reference policy and the truth -----------------------------------------------------


def check_ref(env, ref) -> np.ndarray:
    """π_ref validated as a policy of ``env`` (its shape, normalised) with π_ref > 0 wherever
    π > 0, so that KL(π‖π_ref) is finite (``ValueError`` naming ``ref`` otherwise)."""
    if not (hasattr(env, "pi") and (hasattr(env, "K") or hasattr(env, "transition"))):
        raise ValueError(
            f"ref (a KL penalty) needs a Bandit or a TokenMDP environment, got {type(env).__name__}"
        )
    p = env.check_policy(ref, "ref")
    if np.any((p <= 0) & (env.pi > 0)):
        raise ValueError(
            "ref gives probability 0 to a token that pi can emit: KL(pi || ref) is infinite"
        )
    return p


def log_ratio_table(env, ref) -> np.ndarray:
    """x = log π − log π_ref per (t, p, v) ((K,) for a bandit), finite (:func:`check_ref`)."""
    p = check_ref(env, ref)
    return np.log(env.pi) - np.log(p)


def kl_seq_and_grad(env, ref) -> tuple[float, np.ndarray]:
    """(KL_seq(π‖π_ref), ∇θ KL_seq), exact for any T, shape (D,).

    KL_seq = E_π[Σ_t x_t] by the additive DP of :mod:`simkit.envs.additive` with g = x; the
    gradient is that DP's gradient holding g fixed (the score term of g's own dependence on θ
    has mean zero).
    """
    return additive_value_and_grad(env, log_ratio_table(env, ref))


def penalty_table(env, ref, mu, kl: KLPenalty) -> np.ndarray:
    """The penalty w·k per (t, p, v) of the table layout (w = π/μ with ``correction="is"``,
    +inf where μ = 0 there; such tokens are never drawn)."""
    x = log_ratio_table(env, ref)
    lr = np.log(env.pi) - safe_log(env.check_policy(mu, "behaviour"))
    return kl.values(x, lr if kl.correction == "is" else None)


def expected_penalty(env, ref, mu, kl: KLPenalty, policy=None) -> float:
    """E_p[Σ_t w_t k_t] under ``policy`` p (default μ, the sampling law), exact (the forward
    DP of :func:`simkit.envs.additive.additive_expectation`): the mean of the penalty that
    ``where="reward"`` subtracts from R, before β."""
    p = env.check_policy(mu, "behaviour") if policy is None else policy
    table = penalty_table(env, ref, mu, kl)
    return additive_expectation(env, np.where(p > 0, table, 0.0), p)


def token_log_ratio_to_ref(env, ref, mu, actions, mask, log_ratio, states=None) -> np.ndarray:
    """x_t = log π − log π_ref on drawn tokens, shape of ``mask`` (0 on padding), from the
    tokens' log π − log μ (``log_ratio``) and the table of log π_ref − log μ."""
    from simkit import legs

    ref_mu = legs.old_log_ratio(env, ref, mu, actions, mask, states)  # log π_ref − log μ
    m = np.asarray(mask, dtype=bool)
    with np.errstate(invalid="ignore"):
        return np.where(m, np.asarray(log_ratio, dtype=np.float64) - ref_mu, 0.0)
