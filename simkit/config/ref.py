"""π_ref of an experiment sweep: the ``[ref]`` table (:class:`RefConfig`), a reference policy
for the KL penalties of the ``[[estimators]]`` entries (their ``kl`` tables,
:class:`KLConfig`), built from the environment's π by a seeded logit perturbation."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, StrictFloat, model_validator
from scipy.optimize import brentq

from simkit.estimator_specs import plain
from simkit.kl import KL_CORRECTIONS, KL_ESTIMATORS, PLACEMENTS, KLPenalty

from .errors import KeyPathError
from .fields import Frozen, NonNeg, NonNegInt, _omit_none

__all__ = ["KLConfig", "RefConfig", "noisy_reference"]

#: the largest logit-noise scale σ the ``kl`` dial tries before calling a target unreachable
MAX_NOISE = 1024.0


class KLConfig(Frozen):
    """A KL penalty β·KL(π‖π_ref) of an ``[[estimators]]`` entry (:class:`simkit.kl.KLPenalty`):
    ``beta`` (β > 0), ``estimator`` (verl's per-token estimator: k1, k2, k3, abs, low_var_kl, and
    the "+" straight-through variants), ``where`` (``"loss"``: verl's ``use_kl_loss``;
    ``"reward"``: ``use_kl_in_reward``), ``correction`` (``"is"``: TRL's π/μ bias correction;
    absent: none). Every estimator of the entry gets the penalty; π_ref is the sweep's ``[ref]``.
    """

    table: ClassVar[str] = "estimators[?].kl"

    beta: Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)]
    estimator: Literal[KL_ESTIMATORS] = "k3"
    where: Literal[PLACEMENTS] = "loss"
    correction: Literal[tuple(c for c in KL_CORRECTIONS if c is not None)] | None = None

    def build(self) -> KLPenalty:
        try:
            return KLPenalty(self.beta, self.estimator, self.where, self.correction)
        except (ValueError, TypeError) as exc:
            raise KeyPathError("", str(exc)) from None

    def to_dict(self) -> dict:
        return plain(_omit_none(dict(self)))


def noisy_reference(env, noise: float, seed: int) -> np.ndarray:
    """π_ref = softmax(logits + σ·z) with z ~ N(0, 1) per logit (``np.random.default_rng(seed)``),
    the shape of a behaviour policy of ``env`` (a Bandit or a TokenMDP)."""
    z = np.random.default_rng(seed).standard_normal(np.shape(env.logits))
    logits = np.asarray(env.logits, dtype=np.float64) + float(noise) * z
    if hasattr(env, "with_logits"):
        return env.with_logits(logits).pi
    return dataclasses.replace(env, logits=logits).pi


def _kl_seq(env, ref) -> float:
    from simkit.kl import kl_seq_and_grad

    return float(kl_seq_and_grad(env, ref)[0])


class RefConfig(Frozen):
    """π_ref, the reference policy of the KL penalties: the environment's π with Gaussian
    noise of scale σ on every logit, z drawn with ``seed`` (:func:`noisy_reference`). Give
    exactly one of ``noise`` (σ) and ``kl`` (a target KL_seq(π‖π_ref) > 0: σ dialed by brentq
    to 1e-12 relative, for each length T). Every cell of the sweep gets it, and
    :func:`simkit.experiment.run` its ``ref=`` (the KL columns; rows with a ``kl`` penalty are
    measured against ∇(J − β·KL_seq))."""

    table: ClassVar[str] = "ref"

    noise: NonNeg | None = None
    kl: Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)] | None = None
    seed: NonNegInt = 0

    @model_validator(mode="after")
    def _check(self):
        if (self.noise is None) == (self.kl is None):
            raise KeyPathError(
                "",
                "give exactly one of noise (the logit-noise scale) and kl (a target "
                f"KL_seq(pi || ref)); got noise = {self.noise!r}, kl = {self.kl!r}",
            )
        return self

    def build(self, env) -> np.ndarray:
        """π_ref for ``env`` (ValueError if the ``kl`` target is out of reach)."""
        if self.noise is not None:
            return noisy_reference(env, self.noise, self.seed)
        target = float(self.kl)

        def gap(sigma: float) -> float:
            return _kl_seq(env, noisy_reference(env, sigma, self.seed)) - target

        hi, reached = 1.0, 0.0
        while True:
            try:
                g = gap(hi)
            except ValueError:  # π_ref underflows to 0 somewhere: KL infinite, no bracket
                g = None
            if g is not None and g > 0:
                break
            if g is None or hi >= MAX_NOISE:
                raise ValueError(
                    f"ref.kl = {target:g} is out of reach: KL_seq(pi || ref) reaches {reached:g} "
                    f"before the noise scale {hi:g} (π_ref underflows or σ hits {MAX_NOISE:g})"
                )
            reached = g + target
            hi *= 2.0
        sigma = brentq(gap, 0.0, hi, xtol=1e-14, rtol=1e-12)
        return noisy_reference(env, sigma, self.seed)

    def to_dict(self) -> dict:
        return plain(_omit_none(dict(self)))
