"""Building a realistic three-policy triple (π, π_old, μ) for ``experiment.run(..., old=…)``.

π is the environment's target (the policy being updated). π_old is the policy the rollout was
generated with, a few optimiser steps *behind* π: :func:`stale_policy` walks k exact
policy-gradient steps backwards from π (θ_old = θ − η·Σ ∇J along the way), and
:func:`dial_staleness` chooses the step size η so that χ²(π‖π_old) hits a target. μ is what
the inference engine samples when it serves π_old: :func:`served_policy` applies an engine
model to π_old's logits — any callable ``logits (T, P, V) -> log μ (T, P, V)``, e.g. the
``Mismatch`` generators of the training simulator::

    from functools import partial
    from simkit.train.mismatch import Mismatch, behaviour_log_probs
    engine = partial(behaviour_log_probs, mismatch=Mismatch(precision="bf16"), rng=rng)
    old = dial_staleness(env, chi2=0.05, steps=4)
    mu = served_policy(env, old, engine)

(the callable keeps this module free of ``simkit.train``: the numeric core does not import the
training simulator). Bandit policies are (K,) and are passed to the engine as (1, 1, K).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy.optimize import brentq

from simkit import divergence
from simkit._validation import int_at_least


def _logits_of(env) -> np.ndarray:
    return np.asarray(env.logits, dtype=np.float64)


def _with_logits(env, logits):
    if hasattr(env, "with_logits"):
        return env.with_logits(logits)
    return dataclasses.replace(env, logits=logits)


def stale_logits(env, steps: int = 1, step_size: float = 0.1) -> np.ndarray:
    """θ_old after ``steps`` exact gradient steps of size η = ``step_size`` *backwards* from θ:
    θ_{j+1} = θ_j − η·∇J(θ_j), so that ``steps`` ascent steps from θ_old lead (approximately)
    back to θ. Shape of ``env.logits``."""
    steps = int_at_least(steps, "steps", 1)
    if isinstance(step_size, bool) or not (isinstance(step_size, int | float) and step_size >= 0):
        raise ValueError(f"step_size must be a real number >= 0, got {step_size!r}")
    if not math.isfinite(step_size):
        raise ValueError(f"step_size must be finite, got {step_size!r}")
    theta = _logits_of(env)
    current = env
    for _ in range(steps):
        theta = theta - step_size * current.grad_J().reshape(theta.shape)
        current = _with_logits(env, theta)
    return theta


def stale_policy(env, steps: int = 1, step_size: float = 0.1) -> np.ndarray:
    """π_old = softmax(:func:`stale_logits`), the shape of a behaviour policy of ``env``."""
    return np.asarray(_with_logits(env, stale_logits(env, steps, step_size)).pi)


def staleness_chi2(env, old, level: str = "seq") -> float:
    """χ²(π‖π_old) at ``level`` ``"seq"`` (sequence, the environment's exact value) or
    ``"tok"`` (the token-level average of ``env.divergences``); the bandit has one level."""
    if level not in ("seq", "tok"):
        raise ValueError(f"level must be 'seq' or 'tok', got {level!r}")
    if env.T == 1 and not hasattr(env, "with_logits"):
        return float(divergence.chi2(env.pi, old))
    return float(env.divergences(old)[f"chi2_{level}"])


def dial_staleness(env, chi2: float, steps: int = 1, level: str = "seq") -> np.ndarray:
    """π_old = :func:`stale_policy` (``steps`` backward steps) with η chosen so that
    χ²(π‖π_old) = ``chi2`` (``scipy.optimize.brentq`` on η, relative tolerance 1e-10).
    ``ValueError`` when the target is not reached for η up to 1e4 (∇J = 0, or a bounded
    family)."""
    if isinstance(chi2, bool) or not (isinstance(chi2, int | float) and chi2 > 0):
        raise ValueError(f"chi2 must be a real number > 0, got {chi2!r}")
    steps = int_at_least(steps, "steps", 1)

    def gap(eta):
        return staleness_chi2(env, stale_policy(env, steps, eta), level) - chi2

    hi = 1e-3
    while gap(hi) < 0:
        hi *= 4
        if hi > 1e4:
            raise ValueError(
                f"chi2 = {chi2:g} is not reached by {steps} backward steps with step sizes up "
                f"to 1e4 (largest reached: {gap(1e4) + chi2:.6g})"
            )
    eta = brentq(gap, 0.0, hi, rtol=1e-10, xtol=1e-300, maxiter=500)
    return stale_policy(env, steps, eta)


def served_policy(env, old, engine) -> np.ndarray:
    """μ = exp(``engine``(log π_old)) renormalised: the inference engine serving π_old.

    ``engine``: callable logits (T, P, V) → log-probabilities (T, P, V) (see the module
    docstring); π_old's log-probabilities are the logits passed (finite where π_old > 0).
    """
    p = env.check_policy(old, "old")
    if not np.all(p > 0):
        raise ValueError("old has zero probabilities: its logits are not finite")
    logits = np.log(p)
    shape = logits.shape
    cube = logits.reshape(1, 1, -1) if logits.ndim == 1 else logits
    log_mu = np.asarray(engine(cube), dtype=np.float64).reshape(shape)
    mu = np.exp(log_mu - log_mu.max(axis=-1, keepdims=True))
    return mu / mu.sum(axis=-1, keepdims=True)
