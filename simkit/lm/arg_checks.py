"""Argument checks shared by the torch-layer modules (:mod:`simkit.lm.models`,
:mod:`simkit.lm.gguf_convert`): ints, float dtypes, (N, T) batches, 0/1 masks, a model's device."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def _check_positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float_dtype(dtype, name: str = "dtype") -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}"
        )
    return dtype


def _check_batch_2d(x, name: str, *, shape=None, integer: bool = False) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape (N, T), got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"shape mismatch: {name} has shape {tuple(x.shape)}, expected {shape}")
    if integer and (x.dtype.is_floating_point or x.dtype.is_complex):
        raise TypeError(f"{name} must hold integer token ids, got dtype {x.dtype}")
    return x


def _as_mask(x, name: str, shape) -> Tensor:
    _check_batch_2d(x, name, shape=shape)
    if x.dtype.is_floating_point:
        if not bool(((x == 0) | (x == 1)).all()):
            raise ValueError(f"{name} must hold only 0/1 values")
    return x.bool()


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
