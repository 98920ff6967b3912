"""The hyperparameters of a training run (:class:`TrainConfig`) and their plain-dict form.

:func:`config_dict` and :meth:`TrainConfig.from_dict` are inverse: a checkpointed run stores
its config as JSON (``run.json``) and a training sweep (:mod:`simkit.train.config`) builds
configs from TOML tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from simkit._validation import int_at_least
from simkit.estimator_specs import build_estimators, estimator_params
from simkit.estimators import Estimator, as_estimator
from simkit.train.mismatch import Mismatch
from simkit.train.optim import OPTIMIZERS, make_optimizer
from simkit.train.params import PARAMETERIZATIONS, Parameterization, parameterization

if TYPE_CHECKING:
    from simkit.envs.token_mdp import TokenMDP

#: where the update direction comes from
GRADIENTS = ("estimator", "exact")


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of a training run (the environment and the seed are passed to
    :func:`train`).

    Parameters
    ----------
    estimator : :class:`~simkit.estimators.Estimator`, mapping or mapping name (coerced with
        :func:`simkit.estimators.as_estimator`; a name gives token-mean, oracle advantage).
    steps : total optimizer steps (≥ 1).
    batch : sequences per rollout (the global batch, ≥ 1).
    minibatches : N ≥ 1 updates per rollout; ``batch`` must be a multiple of N. N = 1 is
        on-policy (up to lag and mismatch).
    lag_updates : L ≥ 0, the asynchronous lag **in optimizer updates**: rollout r (starting at
        step rN) is generated from θ_{max(rN − L, 0)}, the trainer's parameters L updates
        before the rollout starts (the first rollouts, while rN < L, use θ₀). Mini-batch j of
        the rollout is then updated by π_{rN+j} on samples of a policy
        ``policy_age`` = rN + j − max(rN − L, 0) updates old (L + j once rN ≥ L): lag and
        staleness N are separate axes.
    lag : k ≥ 0, the lag **in rollouts** (a generator k rollouts behind): the same as
        ``lag_updates = k·N``, so that at fixed k the policy age grows with N (kN + j) — lag
        and staleness confounded. Kept for older configs; give at most one of ``lag`` and
        ``lag_updates``.
    optimizer : ``"adam"`` or ``"sgd"``; ``lr``, ``beta1``, ``beta2``, ``adam_eps``: its
        hyperparameters (betas/eps for Adam only).
    max_grad_norm : clip the update direction to this Euclidean norm (None: no clipping).
    gradient : ``"estimator"`` (ĝ) or ``"exact"`` (∇J by DP; the estimator is still evaluated
        for the records).
    mismatch : the inference-mismatch model (:class:`~simkit.train.mismatch.Mismatch`).
    record_every : compute the exact columns every this many steps (≥ 1; also at the first and
        last step).
    parameterization : how θ gives the logits (:mod:`simkit.train.params`): ``"tabular"`` (θ is
        the (T, P, V) table), ``"tied"`` (one (P, V) table shared by all positions) or
        ``"features"`` (low-rank embeddings, d = ``features`` parameters, token-embedding
        rank ``feature_rank``, random features from ``feature_seed``). J, ∇J and the
        divergences stay exact for all three.
    """

    estimator: Estimator | str = "naive"
    steps: int = 100
    batch: int = 64
    minibatches: int = 1
    lag: int = 0
    lag_updates: int = 0
    optimizer: str = "adam"
    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float | None = None
    gradient: str = "estimator"
    mismatch: Mismatch = field(default_factory=Mismatch)
    record_every: int = 1
    parameterization: str = "tabular"
    features: int = 256
    feature_rank: int = 16
    feature_seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "estimator", as_estimator(self.estimator))
        for name, low in (
            ("steps", 1),
            ("batch", 1),
            ("minibatches", 1),
            ("lag", 0),
            ("lag_updates", 0),
            ("record_every", 1),
            ("features", 1),
            ("feature_rank", 1),
            ("feature_seed", 0),
        ):
            object.__setattr__(
                self, name, int_at_least(getattr(self, name), f"TrainConfig.{name}", low)
            )
        if self.lag and self.lag_updates:
            raise ValueError(
                f"TrainConfig: give at most one of lag (in rollouts, = {self.lag}) and "
                f"lag_updates (in optimizer updates, = {self.lag_updates}); lag = k is "
                "lag_updates = k·minibatches"
            )
        if self.batch % self.minibatches:
            raise ValueError(
                f"TrainConfig.batch = {self.batch} must be a multiple of minibatches = "
                f"{self.minibatches} (each mini-batch has batch / minibatches sequences)"
            )
        self.estimator.check_batch_size(self.batch)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"TrainConfig.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}"
            )
        make_optimizer(self.optimizer, self.lr, self.beta1, self.beta2, self.adam_eps)
        for name in ("lr", "beta1", "beta2", "adam_eps"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.max_grad_norm is not None:
            v = self.max_grad_norm
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not (math.isfinite(v) and v > 0)
            ):
                raise ValueError(
                    f"TrainConfig.max_grad_norm must be None or a finite number > 0, got {v!r}"
                )
            object.__setattr__(self, "max_grad_norm", float(v))
        if self.gradient not in GRADIENTS:
            raise ValueError(
                f"TrainConfig.gradient must be one of {GRADIENTS}, got {self.gradient!r}"
            )
        if not isinstance(self.mismatch, Mismatch):
            raise TypeError(
                f"TrainConfig.mismatch must be a Mismatch, got {type(self.mismatch).__name__}"
            )
        if self.parameterization not in PARAMETERIZATIONS:
            raise ValueError(
                f"TrainConfig.parameterization must be one of {PARAMETERIZATIONS}, got "
                f"{self.parameterization!r}"
            )
        if self.parameterization == "features" and self.features % self.feature_rank:
            raise ValueError(
                f"TrainConfig.features = {self.features} must be a multiple of feature_rank = "
                f"{self.feature_rank} (d = m·r: m context features × r token-embedding dims)"
            )

    @property
    def minibatch_size(self) -> int:
        """Sequences per optimizer step (batch / minibatches)."""
        return self.batch // self.minibatches

    @property
    def lag_in_updates(self) -> int:
        """The lag L in optimizer updates: ``lag_updates``, or ``lag``·N for a rollout lag."""
        return self.lag_updates + self.lag * self.minibatches

    @property
    def rollouts(self) -> int:
        """Number of rollouts (the last may be cut short by ``steps``)."""
        return -(-self.steps // self.minibatches)

    def make_optimizer(self):
        return make_optimizer(self.optimizer, self.lr, self.beta1, self.beta2, self.adam_eps)

    def parameterization_of(self, env: TokenMDP) -> Parameterization:
        """The map θ ↦ logits of this config on ``env`` (:mod:`simkit.train.params`)."""
        return parameterization(
            env.logits, self.parameterization, self.features, self.feature_rank, self.feature_seed
        )

    def to_dict(self) -> dict:
        """A plain JSON-able dict describing this config completely (:func:`config_dict`)."""
        return config_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The config of a :func:`config_dict` (``TrainConfig.from_dict(config_dict(c)) ==
        c``): the estimator is rebuilt from its parameters (mapping, hyperparameters,
        aggregation, advantage, group size, name), the mismatch from its fields."""
        if not isinstance(d, dict):
            raise TypeError(f"expected a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown TrainConfig key {unknown[0]!r}; valid keys: "
                f"{', '.join(cls.__dataclass_fields__)}"
            )
        kwargs = dict(d)
        if isinstance(kwargs.get("estimator"), dict):
            kwargs["estimator"] = build_estimators([kwargs["estimator"]])[0]
        if isinstance(kwargs.get("mismatch"), dict):
            kwargs["mismatch"] = Mismatch(**kwargs["mismatch"])
        return cls(**kwargs)


def config_dict(config: TrainConfig) -> dict:
    """A plain JSON-able dict describing ``config`` completely (estimator included); the
    inverse is :meth:`TrainConfig.from_dict`."""
    out = {}
    for name in TrainConfig.__dataclass_fields__:
        value = getattr(config, name)
        if name == "estimator":
            value = estimator_params(value)
        elif name == "mismatch":
            value = value.to_dict()
        out[name] = value
    return out
