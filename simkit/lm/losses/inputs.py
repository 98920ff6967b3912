"""Input checks of :func:`simkit.lm.losses.policy_loss`: tensors, devices, shapes, dtypes and
the (N,) or (N, T) advantages."""

from __future__ import annotations

import math

import torch


def _as_tensor(x, name: str, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.device != device:
            raise ValueError(
                f"{name} is on device {x.device}, log_prob on {device}: put them on one device"
            )
        return x
    try:
        return torch.as_tensor(x, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name} must be a tensor (or array-like), got {type(x).__name__}") from err


def _check_inputs(log_prob, old_log_prob, advantages, response_mask):
    """Validate shapes/dtypes; return (log_prob, old_log_prob (compute dtype, detached),
    mask (bool), advantages (N,) compute dtype, compute dtype)."""
    if not isinstance(log_prob, torch.Tensor):
        raise TypeError(f"log_prob must be a torch.Tensor, got {type(log_prob).__name__}")
    if log_prob.ndim != 2:
        raise ValueError(f"log_prob must have shape (N, T), got shape {tuple(log_prob.shape)}")
    if not log_prob.is_floating_point():
        raise ValueError(f"log_prob must be a floating-point tensor, got dtype {log_prob.dtype}")
    shape = tuple(log_prob.shape)
    device = log_prob.device
    dtype = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    old = _as_tensor(old_log_prob, "old_log_prob", device)
    if tuple(old.shape) != shape:
        raise ValueError(
            f"shape mismatch: log_prob has shape {shape}, old_log_prob has {tuple(old.shape)}"
        )
    if not old.is_floating_point():
        raise ValueError(f"old_log_prob must be floating point, got dtype {old.dtype}")
    mask = _as_tensor(response_mask, "response_mask", device)
    if tuple(mask.shape) != shape:
        raise ValueError(
            f"shape mismatch: log_prob has shape {shape}, response_mask has {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("response_mask must be boolean (or 0/1)")
        mask = mask != 0
    adv = _as_tensor(advantages, "advantages", device)
    if not (adv.is_floating_point() or adv.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"advantages must be real numbers, got dtype {adv.dtype}")
    adv = adv.detach().to(dtype)
    N = shape[0]
    if tuple(adv.shape) == (N,):
        if not bool(torch.isfinite(adv).all()):
            raise ValueError("advantages contains non-finite values")
    elif tuple(adv.shape) == shape:
        adv = _row_advantages(adv, mask)
    else:
        raise ValueError(
            f"advantages must have shape (N,) = ({N},) or (N, T) = {shape}, "
            f"got shape {tuple(adv.shape)}"
        )
    return log_prob, old.detach().to(dtype), mask, adv, dtype


def _row_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) token advantages that are constant over each row's valid tokens → (N,)."""
    hi = torch.where(mask, adv, -math.inf).amax(dim=1) if adv.shape[1] else adv.new_zeros(0)
    lo = torch.where(mask, adv, math.inf).amin(dim=1) if adv.shape[1] else adv.new_zeros(0)
    if adv.shape[1] == 0:
        return adv.new_zeros(adv.shape[0])
    nonempty = mask.any(dim=1)
    if not bool(torch.isfinite(torch.where(nonempty, hi, 0.0)).all()):
        raise ValueError("advantages contains non-finite values on valid tokens")
    differs = nonempty & (hi != lo)
    if bool(differs.any()):
        row = int(torch.nonzero(differs)[0, 0])
        raise ValueError(
            f"advantages of shape (N, T) must be constant over each row's valid tokens (one "
            f"sequence advantage); row {row} ranges from {float(lo[row]):g} to "
            f"{float(hi[row]):g}. Pass the sequence advantages, shape (N,)"
        )
    return torch.where(nonempty, hi, 0.0)
