"""The weight-mapping contract and the registry.

A *weight mapping* turns token log-ratios ``log_ratio = log π(y_t|s_t) − log μ(y_t|s_t)`` into the
effective coefficient ``c_{i,t}`` that multiplies ``A_i · ∇θ log π(y_{i,t}|s_{i,t})`` in the policy
gradient (see ``shared/reference/weight-mappings.md``)::

    g = (1/Z) Σ_i Σ_t c_{i,t} · A_i · ∇θ log πθ(y_{i,t} | s_{i,t}),    y_i ~ μ

Every mapping is a frozen dataclass whose fields are its hyperparameters (validated in
``__post_init__``) and which implements::

    coefficients(log_ratio, mask, advantages) -> c      # (N, T), (N, T), (N,) -> (N, T)

with ``c == 0`` on padded positions (``mask == False``). Mappings whose coefficient is a scalar
function of one ratio (a token ratio ``r_t``, the sequence ratio ``W`` or the geometric mean
``s``) subclass :class:`ScalarMapping` and also expose ``phi(w, positive=True)`` (the
coefficient as a function of the ratio; ``positive`` is the sign of the advantage, ``A >= 0``)
and ``f(w, positive=True)`` (a surrogate ``F`` with ``w · F'(w) = phi(w)``).

Class attributes describe each mapping for the test battery and the experiment runner:

- ``level``: ``"token"`` (c_t depends on r_t), ``"sequence"`` (one value per sequence, from W or s
  or the whole row) or ``"batch"`` (depends on other sequences of the batch).
- ``batch_dependent``: ``True`` when c_i depends on other rows (snis, psis, m2po); such estimators
  have no exact per-sample mean and the experiment falls back to Monte Carlo.
- ``on_policy_identity``: ``True`` when ``log_ratio == 0`` must give ``c == 1`` on every valid
  token (the reference sheet's "on-policy ⇒ REINFORCE" rule).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from simkit._validation import check_batch

_REGISTRY: dict[str, type[Mapping]] = {}


class Mapping:
    """Base class of every weight mapping (subclasses are frozen dataclasses)."""

    name: ClassVar[str] = ""
    level: ClassVar[str] = "token"
    batch_dependent: ClassVar[bool] = False
    on_policy_identity: ClassVar[bool] = True
    #: named presets: preset name -> dict of hyperparameters (see ``get(name, preset=...)``)
    presets: ClassVar[dict[str, dict]] = {}

    def coefficients(self, log_ratio, mask, advantages) -> np.ndarray:
        """Effective coefficients c of shape (N, T); 0 where ``mask`` is False."""
        lr, m, adv = check_batch(log_ratio, mask, advantages)
        return self._coefficients(lr, m, adv)

    def _coefficients(self, log_ratio, mask, advantages) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    @property
    def hyperparameters(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def label(self) -> str:
        """Short human-readable label, e.g. ``ppo_clip(eps_low=0.2, eps_high=0.2)``."""
        hp = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in self.hyperparameters.items())
        return f"{self.name}({hp})" if hp else self.name


class ScalarMapping(Mapping):
    """A mapping whose coefficient is ``phi`` of one ratio (token r_t, sequence W or geometric s).

    ``phi(w, positive)`` is the coefficient as a function of the ratio, ``f(w, positive)`` the
    surrogate ``F`` with ``w·F'(w) = phi(w)``.
    """

    def phi(self, w, positive: bool = True) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def f(self, w, positive: bool = True) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError


def register(cls: type[Mapping]) -> type[Mapping]:
    """Class decorator: add a mapping class to the registry under ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no registry name")
    if cls.name in _REGISTRY:
        raise TypeError(f"mapping name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names of every registered mapping, in registry order."""
    return list(_REGISTRY)


def mapping_class(name: str) -> type[Mapping]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown mapping {name!r}; available mappings: {', '.join(available())}"
        ) from None


def get(name: str, preset: str | None = None, **hyperparams) -> Mapping:
    """Build mapping ``name`` with its defaults, an optional named ``preset``, then overrides.

    >>> get("ppo_clip", eps_high=0.28)
    >>> get("cispo", preset="trl")
    """
    cls = mapping_class(name)
    kwargs: dict = {}
    if preset is not None:
        if preset not in cls.presets:
            known = ", ".join(cls.presets) or "none"
            raise ValueError(f"mapping {name!r} has no preset {preset!r}; presets: {known}")
        kwargs.update(cls.presets[preset])
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(hyperparams) - fields
    if unknown:
        raise TypeError(
            f"mapping {name!r} has no hyperparameter {sorted(unknown)}; "
            f"its hyperparameters are {sorted(fields) or 'none'}"
        )
    kwargs.update(hyperparams)
    return cls(**kwargs)


# --- helpers shared by the mapping modules ---------------------------------------------------

def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` (hyperparameter validation)."""
    if not condition:
        raise ValueError(message)


def seq_log_ratio(log_ratio: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Σ_t log r_t over valid tokens, shape (N,)."""
    return np.einsum("nt,nt->n", log_ratio, mask, optimize=False) if mask.dtype != bool \
        else np.where(mask, log_ratio, 0.0).sum(axis=1)


def broadcast_seq(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Put one value per sequence (N,) on every valid token, 0 on padding: (N, T)."""
    return np.where(mask, values[:, None], 0.0)
