"""Argument checks and read-only arrays shared by the environments (:mod:`simkit.envs`).

Every check raises ``ValueError`` naming the argument as the caller wrote it, before any work.
"""

from __future__ import annotations

import math

import numpy as np

from simkit._validation import positive_int


def readonly(a, dtype=np.float64) -> np.ndarray:
    """A read-only copy of ``a`` as ``dtype``."""
    a = np.array(a, dtype=dtype, copy=True)
    a.setflags(write=False)
    return a


def softmax_readonly(logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis, computed in place in one new array (no large temporaries),
    read-only."""
    out = logits - logits.max(axis=-1, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    out.setflags(write=False)
    return out


def safe_log(p: np.ndarray) -> np.ndarray:
    """log p with log 0 = −inf (no warning)."""
    with np.errstate(divide="ignore"):
        return np.log(p)


def int_array(value, name: str, shape_doc: str) -> np.ndarray:
    """``value`` as an int64 array (integral floats accepted); ``ValueError`` naming ``name``
    and the expected ``shape_doc`` otherwise."""
    arr = np.asarray(value)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        if arr.size and np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
            return arr.astype(np.int64)
        raise ValueError(f"{name} must be an integer array of shape {shape_doc}, got {arr.dtype}")
    return arr.astype(np.int64)


def check_index(value, name: str, upper: int, what: str) -> int:
    """An integer ``what`` (a token, a state…) in [0, ``upper``)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer {what} in [0, {upper}), got {value!r}")
    if not 0 <= value < upper:
        raise ValueError(f"{name} must be {what} in [0, {upper}), got {value}")
    return int(value)


def baseline_and_scale(T: int, baseline, aggregation: str, max_length) -> tuple[float, float]:
    """The checked baseline b and the aggregation's 1/Z on sequences of at most ``T`` tokens:
    1/T (``token-mean``), 1/``max_length`` (or 1/T when None; ``seq-mean-token-sum-norm``),
    else 1."""
    b = float(baseline)
    if not math.isfinite(b):
        raise ValueError(f"baseline must be finite, got {baseline}")
    if max_length is not None and aggregation != "seq-mean-token-sum-norm":
        raise ValueError("max_length applies to aggregation 'seq-mean-token-sum-norm' only")
    if aggregation == "token-mean":
        return b, 1.0 / T
    if aggregation == "seq-mean-token-sum-norm":
        return b, 1.0 / (T if max_length is None else positive_int(max_length, "max_length"))
    return b, 1.0
