"""Argument checks shared by the torch layer (errors name the argument as the user wrote it);
integers: :func:`simkit._validation.int_at_least`."""

from __future__ import annotations

import math

import numpy as np


def finite(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value
