"""π_old of an experiment sweep: the ``[behaviour.old]`` table (:class:`OldConfig`), a policy a
few policy-gradient steps behind π built with :mod:`simkit.envs.stale`, and the environment that
serves it (:func:`served_environment`, from which μ is dialed)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, StrictFloat, model_validator

from simkit.estimator_specs import plain

from .errors import KeyPathError
from .fields import Frozen, NonNeg, PosInt, _omit_none

__all__ = ["OldConfig", "served_environment"]


class OldConfig(Frozen):
    """π_old, the policy that generated the rollout, a few optimiser steps behind π
    (:mod:`simkit.envs.stale`): ``steps`` exact policy-gradient steps backwards from π, with the
    step size ``step_size`` or — exactly one of the two — the step size dialed so that
    χ²(π‖π_old) = ``chi2`` at ``level`` (``"seq"``: sequence, ``"tok"``: token average;
    :func:`~simkit.envs.stale.dial_staleness`, brentq to 1e-10 relative).

    With this table the behaviour section describes the *inference mismatch* leg: μ is π_old
    served by an engine modelled by the shift ``family``, dialed to D(π_old‖μ) = each of the
    ``targets`` (a target 0 gives μ = π_old, verl's bypass situation). Without it μ is dialed
    from π and π_old = π (the tables of before, bit for bit).
    """

    table: ClassVar[str] = "behaviour.old"

    steps: PosInt = 1
    chi2: Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)] | None = None
    step_size: NonNeg | None = None
    level: Literal["seq", "tok"] = "seq"

    @model_validator(mode="after")
    def _check(self):
        if (self.chi2 is None) == (self.step_size is None):
            raise KeyPathError(
                "",
                "give exactly one of chi2 (a target χ²(π‖π_old)) and step_size (the size of "
                f"each backward step); got chi2 = {self.chi2!r}, step_size = {self.step_size!r}",
            )
        if self.step_size is not None and self.level != "seq":
            raise KeyPathError(".level", "applies with chi2 only (the dialed divergence)")
        return self

    def build(self, env) -> np.ndarray:
        """π_old for ``env`` (the shape of a behaviour policy; ValueError if unreachable)."""
        from simkit.envs import stale

        if self.chi2 is not None:
            return stale.dial_staleness(env, self.chi2, steps=self.steps, level=self.level)
        return stale.stale_policy(env, steps=self.steps, step_size=self.step_size)

    def to_dict(self) -> dict:
        d = _omit_none(dict(self))
        if self.step_size is not None:
            del d["level"]
        return plain(d)


def served_environment(env, old: np.ndarray):
    """``env`` with π_old in place of π (the policy the inference engine serves): its logits
    are log π_old (``TokenMDP.with_logits``; a bandit is a dataclass)."""
    logits = np.log(np.asarray(old, dtype=np.float64))
    if hasattr(env, "with_logits"):
        return env.with_logits(logits)
    return dataclasses.replace(env, logits=logits)
