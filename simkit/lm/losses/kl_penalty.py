"""The KL penalty to a reference policy in the torch loss (``policy_loss(..., ref_log_prob=,
kl=KLPenalty(...))``): the same estimators, placements and correction as :mod:`simkit.kl`,
written with torch autograd so that the gradient is the one a trainer gets.

With x = log π − log π_ref and w = π/μ (μ: ``rollout_log_prob`` when given, else
``old_log_prob``; the importance weight of the sampling policy, carrying its gradient as TRL's
``coef_1``; 1 without ``correction="is"``):

- ``where="loss"``: loss += β·Σ_{i,t} (1/Z_i)·mask·w·k(x) with 1/Z_i the aggregation over valid
  tokens (verl adds ``agg_loss(kld)·kl_loss_coef``, ``verl/workers/utils/losses.py`` @1dda039);
  ∂loss/∂log π = β·(1/Z)·∂(w k)/∂log π = −λ^KL
  (:meth:`simkit.estimators.Estimator.kl_loss_weights`);
- ``where="reward"``: A_i ← A_i − β·Σ_t mask·w·k (detached) before the mapping sees it.

k(x) as verl ``kl_penalty`` (``verl/trainer/ppo/core_algos.py`` @1dda039): k1 = x,
k2 = x²/2, k3 = e^{−x} + x − 1, abs = |x|, low_var_kl = k3 with u = −x clamped to [−20, 20] and
the value to [−10, 10]; "+" = k2 − sg(k2) + sg(k).
"""

from __future__ import annotations

import torch

from simkit.kl import LOW_VAR_KL_LOG_CLAMP, LOW_VAR_KL_VALUE_CLAMP, KLPenalty
from simkit.lm.losses.inputs import _as_tensor


def kl_values(x: torch.Tensor, estimator: str) -> torch.Tensor:
    """k(x) of ``estimator`` (:data:`simkit.kl.KL_ESTIMATORS`) with its autograd graph."""
    base = estimator.rstrip("+")
    if base == "k1":
        value = x
    elif base == "k2":
        value = 0.5 * x.square()
    elif base == "abs":
        value = x.abs()
    elif base == "k3":
        value = torch.expm1(-x) + x
    else:
        u = torch.clamp(-x, min=-LOW_VAR_KL_LOG_CLAMP, max=LOW_VAR_KL_LOG_CLAMP)
        value = torch.clamp(
            torch.expm1(u) - u, min=-LOW_VAR_KL_VALUE_CLAMP, max=LOW_VAR_KL_VALUE_CLAMP
        )
    if estimator.endswith("+"):
        back = 0.5 * x.square()
        value = back - back.detach() + value.detach()
    return value


def check_kl(kl, ref_log_prob, log_prob: torch.Tensor, mask: torch.Tensor, dtype):
    """log π_ref (compute dtype, detached, 0 on padding) for ``kl``; errors name the argument:
    ``kl`` without ``ref_log_prob`` (or the reverse), a wrong type or shape, a non-finite x on
    a valid token."""
    if kl is None:
        if ref_log_prob is not None:
            raise ValueError("ref_log_prob was given without kl: pass kl=KLPenalty(...)")
        return None
    if not isinstance(kl, KLPenalty):
        raise TypeError(f"kl must be a simkit.kl.KLPenalty, got {type(kl).__name__}")
    if ref_log_prob is None:
        raise ValueError("kl needs ref_log_prob = log pi_ref of the sampled tokens")
    ref = _as_tensor(ref_log_prob, "ref_log_prob", log_prob.device)
    if tuple(ref.shape) != tuple(log_prob.shape):
        raise ValueError(
            f"shape mismatch: log_prob has shape {tuple(log_prob.shape)}, ref_log_prob has "
            f"{tuple(ref.shape)}"
        )
    ref = ref.detach().to(dtype)
    x = torch.where(mask, log_prob.detach().to(dtype) - ref, 0.0)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            "log_prob - ref_log_prob is not finite on a valid token (a zero probability under "
            "pi_ref makes KL(pi || pi_ref) infinite)"
        )
    return torch.where(mask, ref, 0.0)


def _penalty(kl: KLPenalty, lp, sampling, ref, mask) -> torch.Tensor:
    """mask·w·k per token, with lp's graph (lp, sampling and ref of the compute dtype)."""
    x = torch.where(mask, lp - ref, 0.0)
    value = kl_values(x, kl.estimator)
    if kl.correction == "is":
        value = value * torch.exp(torch.where(mask, lp - sampling, 0.0))
    return torch.where(mask, value, 0.0)


def reward_penalty(kl: KLPenalty, lp, sampling, ref, mask) -> torch.Tensor:
    """β·Σ_t mask·w·k per row (N,), detached: what ``where="reward"`` subtracts from A."""
    with torch.no_grad():
        return kl.beta * _penalty(kl, lp.detach(), sampling, ref, mask).sum(dim=1)


def loss_term(kl: KLPenalty, lp, sampling, ref, mask, inv_z) -> torch.Tensor:
    """β·Σ_{i,t} (1/Z_i)·mask·w·k, 0-d, differentiable through ``lp`` (``where="loss"``)."""
    return kl.beta * (_penalty(kl, lp, sampling, ref, mask) * inv_z[:, None]).sum()
