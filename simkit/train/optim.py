"""Optimisers for gradient *ascent* on J: plain SGD and Adam, written out (no framework).

Both are frozen dataclasses of hyperparameters with a pure ``step``:

    theta_new, state_new = opt.step(theta, grad, state)

``state`` is a dict of numpy arrays / numbers (``opt.init(theta)``), so a checkpoint can save it
and a resumed run continues bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["OPTIMIZERS", "SGD", "Adam", "clip_grad_norm", "make_optimizer"]

OPTIMIZERS = ("sgd", "adam")


def _positive(owner: str, name: str, value, upper: float = math.inf, closed: bool = False):
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    v = float(value)
    ok = math.isfinite(v) and v > 0 and (v <= upper if closed else v < upper)
    if not ok:
        bound = f"(0, {upper:g}{']' if closed else ')'}" if math.isfinite(upper) else "> 0"
        raise ValueError(f"{owner}.{name} must be {bound} and finite, got {value!r}")
    return v


def clip_grad_norm(grad: np.ndarray, max_norm: float | None) -> np.ndarray:
    """``grad`` rescaled to Euclidean norm ``max_norm`` if it is longer (None: unchanged), as
    ``torch.nn.utils.clip_grad_norm_`` does for the whole parameter vector."""
    if max_norm is None:
        return grad
    norm = float(np.linalg.norm(grad))
    return grad * (max_norm / norm) if norm > max_norm else grad


@dataclass(frozen=True)
class SGD:
    """θ ← θ + lr·g (ascent on J). State: ``{"t": number of steps}``."""

    lr: float = 0.1

    def __post_init__(self):
        object.__setattr__(self, "lr", _positive("SGD", "lr", self.lr))

    def init(self, theta: np.ndarray) -> dict:
        return {"t": 0}

    def step(self, theta: np.ndarray, grad: np.ndarray, state: dict):
        return theta + self.lr * grad, {"t": state["t"] + 1}


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba 2015, Algorithm 1) for ascent on J:

        m ← β₁m + (1−β₁)g,  v ← β₂v + (1−β₂)g²,  m̂ = m/(1−β₁^t),  v̂ = v/(1−β₂^t),
        θ ← θ + lr·m̂/(√v̂ + ε).

    State: ``{"t", "m", "v"}`` (m, v of θ's shape).
    """

    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        object.__setattr__(self, "lr", _positive("Adam", "lr", self.lr))
        object.__setattr__(self, "beta1", _positive("Adam", "beta1", self.beta1, 1.0))
        object.__setattr__(self, "beta2", _positive("Adam", "beta2", self.beta2, 1.0))
        object.__setattr__(self, "eps", _positive("Adam", "eps", self.eps))

    def init(self, theta: np.ndarray) -> dict:
        return {"t": 0, "m": np.zeros_like(theta), "v": np.zeros_like(theta)}

    def step(self, theta: np.ndarray, grad: np.ndarray, state: dict):
        t = state["t"] + 1
        m = self.beta1 * state["m"] + (1.0 - self.beta1) * grad
        v = self.beta2 * state["v"] + (1.0 - self.beta2) * grad * grad
        m_hat = m / (1.0 - self.beta1**t)
        v_hat = v / (1.0 - self.beta2**t)
        return theta + self.lr * m_hat / (np.sqrt(v_hat) + self.eps), {"t": t, "m": m, "v": v}


def make_optimizer(
    name: str, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
):
    """``SGD(lr)`` for ``"sgd"``, ``Adam(lr, beta1, beta2, eps)`` for ``"adam"``."""
    if name == "sgd":
        return SGD(lr)
    if name == "adam":
        return Adam(lr, beta1, beta2, eps)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
