"""Training sweeps: a grid of :func:`simkit.train.train` runs from a TOML file (``kind = "train"``).

The schema of a training sweep (:class:`TrainSweepConfig`, a pydantic model like those of
:mod:`simkit.config.schema`) lives with the trainer; it reuses the environment and estimator
tables of an experiment sweep, and :func:`simkit.config.load_config` reads either kind. One cell
= one run (:meth:`TrainSweepConfig.cells`), computed by :func:`run_train_cell`.

**Adding a TrainConfig field to the sweep.** Declare it on :class:`TrainSweepConfig` with the
same name (type, range, and the :class:`~simkit.train.TrainConfig` default): every field whose
name is a ``TrainConfig`` field and is not swept (:data:`SWEPT`) is passed to every run
(:func:`_scalars`), written by :meth:`TrainSweepConfig.to_dict` and shown by ``simkit schema
train``. A swept field is a :func:`simkit.config.schema.one_or_more` list added to
:meth:`TrainSweepConfig.runs`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import Field, StrictFloat, StrictStr, model_validator

from simkit.config.cells import Cell
from simkit.config.errors import KeyPathError
from simkit.config.run import build_environment
from simkit.config.schema import (
    EstimatorConfig,
    Frozen,
    NonNegInt,
    PosInt,
    TokenMDPConfig,
    distinct_estimators,
    one_or_more,
)
from simkit.estimator_specs import plain
from simkit.train.core import GRADIENTS, TrainConfig
from simkit.train.hyperparameters import (
    ASYNC_DEFAULTS,
    LAG_DISTRIBUTIONS,
    OFF_POLICY_STRATEGIES,
    OLD_LOGPS,
    RECORD_LOGPS,
)
from simkit.train.mismatch import Mismatch
from simkit.train.optim import OPTIMIZERS
from simkit.train.params import PARAMETERIZATIONS

__all__ = [
    "MISMATCH_KEYS",
    "SWEPT",
    "SubGrid",
    "TrainSweepConfig",
    "mismatch_to_dict",
    "run_train_cell",
]

#: keys of a ``[[mismatch]]`` table (the fields of :class:`simkit.train.Mismatch`)
MISMATCH_KEYS = tuple(f.name for f in dataclasses.fields(Mismatch))
#: TrainConfig fields that a training sweep sets per run (swept, or derived from N)
SWEPT = ("estimator", "batch", "minibatches", "lag", "lag_updates", "lr", "mismatch")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
#: the parameterisation fields, written by ``to_dict`` only for a non-tabular policy
_FEATURE_KEYS = ("parameterization", "features", "feature_rank", "feature_seed")
_Positive = Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)]
_Unit = Annotated[StrictFloat, Field(gt=0.0, lt=1.0)]


def _scalars() -> tuple[str, ...]:
    """The TrainConfig fields a training sweep sets once for every run (its own fields of the
    same name that are not swept)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - set(SWEPT)
    return tuple(name for name in TrainSweepConfig.model_fields if name in fields)


def mismatch_to_dict(m: Mismatch) -> dict:
    """The non-default fields of a mismatch (TOML has no None; the defaults are implied)."""
    default = Mismatch()
    return plain({k: v for k, v in m.to_dict().items() if v != getattr(default, k)})


class SubGrid(Frozen):
    """One ``[[grids]]`` table of a training sweep: the ``lag``, ``lag_updates``, ``lr`` and
    ``minibatches`` lists of one sub-grid; a key it does not give is the sweep's own list."""

    lag: one_or_more(NonNegInt) | None = None
    lag_updates: one_or_more(NonNegInt) | None = None
    lr: one_or_more(_Positive) | None = None
    minibatches: one_or_more(PosInt) | None = None

    def to_dict(self) -> dict:
        return plain({k: list(v) for k, v in self.__dict__.items() if v is not None})


class TrainSweepConfig(Frozen):
    """A grid of training runs (:func:`simkit.train.train`): ``kind = "train"`` in TOML.

    One cell = one run: environment length ``T`` × ``mismatch`` × ``lag`` × ``lr`` ×
    ``minibatches`` (N) × estimator × ``seeds`` (that expansion order, every list swept).

    ``environment`` is a ``kind = "token_mdp"`` table (:class:`TokenMDPConfig`, ``T`` swept);
    ``estimators`` are ``[[estimators]]`` tables as in an experiment sweep
    (:class:`EstimatorConfig`: mapping × grid × aggregations × advantages); ``mismatch`` is a
    list of ``[[mismatch]]`` tables (:class:`simkit.train.Mismatch` fields: ``logit_noise``,
    ``precision``, ``spike_prob``, ``spike_strength``, ``spike_tokens``; none given: no
    mismatch). ``grids`` (optional ``[[grids]]`` tables, :class:`SubGrid`) replaces the one product
    lag × lr × N by the union of several products, each table overriding some of ``lag``, ``lr``,
    ``minibatches`` (a run in two sub-grids is run once, at its first place): e.g. lr × lag at N =
    16 plus N × lag at lr = 0.3 (``configs/train_collapse_regimes.toml``). The rollout size is set
    by exactly one of ``minibatch_size`` (m sequences per update: the rollout batch is N·m, so that
    every N makes the same updates on the same number of samples and only the staleness changes) or
    ``batch`` (a fixed rollout batch B split into N mini-batches of B/N). ``steps``, ``optimizer``,
    ``beta1``, ``beta2``, ``adam_eps``, ``max_grad_norm``, ``gradient``, ``record_every``,
    ``parameterization``, ``features``, ``feature_rank`` and ``feature_seed`` are the
    :class:`~simkit.train.TrainConfig` fields, the same for every run.

    **Seeds.** A run's random streams are ``SeedSequence(seed)`` of its entry of ``seeds``,
    exactly as ``simkit.train.train(env, config, seed=seed)``: runs that differ only in the
    mapping or N share their random numbers (common random numbers; with N = 1 and no
    mismatch every mapping then gives the same curve), and any cell is reproduced by one call
    of :func:`simkit.train.train` or ``simkit train``.

    An example (``configs/train_quick.toml``)::

        kind = "train"
        name = "train_quick"
        steps = 200
        minibatch_size = 16
        minibatches = [1, 8]
        lr = 0.05
        seeds = [0, 1]

        [environment]
        kind = "token_mdp"
        constructor = "at_least_k"
        V = 8
        T = 16
        kwargs = { k = 3 }

        [[estimators]]
        mapping = "ppo_clip"
        advantages = ["grpo"]
        group_size = 8
    """

    kind: Literal["train"] = Field("train", description="the kind of sweep")
    name: Annotated[StrictStr, Field(min_length=1)]
    environment: TokenMDPConfig
    estimators: Annotated[tuple[EstimatorConfig, ...], Field(min_length=1)]
    steps: PosInt
    minibatches: one_or_more(PosInt) = (1,)
    minibatch_size: PosInt | None = None
    batch: PosInt | None = None
    lag: one_or_more(NonNegInt) = (0,)
    lag_updates: one_or_more(NonNegInt) = (0,)
    mismatch: Annotated[tuple[Mismatch, ...], Field(min_length=1)] = (Mismatch(),)
    lr: one_or_more(_Positive) = (_DEFAULTS["lr"],)
    optimizer: Literal[OPTIMIZERS] = _DEFAULTS["optimizer"]
    beta1: _Unit = _DEFAULTS["beta1"]
    beta2: _Unit = _DEFAULTS["beta2"]
    adam_eps: _Positive = _DEFAULTS["adam_eps"]
    max_grad_norm: _Positive | None = None
    gradient: Literal[GRADIENTS] = _DEFAULTS["gradient"]
    record_every: PosInt = _DEFAULTS["record_every"]
    parameterization: Literal[PARAMETERIZATIONS] = _DEFAULTS["parameterization"]
    features: PosInt = _DEFAULTS["features"]
    feature_rank: PosInt = _DEFAULTS["feature_rank"]
    feature_seed: NonNegInt = _DEFAULTS["feature_seed"]
    lag_distribution: Literal[LAG_DISTRIBUTIONS] = _DEFAULTS["lag_distribution"]
    lag_rollouts_max: NonNegInt = _DEFAULTS["lag_rollouts_max"]
    lag_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = _DEFAULTS["lag_p"]
    partial_hazard: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] = _DEFAULTS["partial_hazard"]
    max_off_policy: NonNegInt | None = None
    off_policy_strategy: Literal[OFF_POLICY_STRATEGIES] = _DEFAULTS["off_policy_strategy"]
    old_logp: Literal[OLD_LOGPS] = _DEFAULTS["old_logp"]
    prompt_lag_p: tuple[Annotated[StrictFloat, Field(gt=0.0, le=1.0)], ...] | None = None
    record_logp: Literal[RECORD_LOGPS] = _DEFAULTS["record_logp"]
    seeds: one_or_more(NonNegInt) = (0,)
    grids: tuple[SubGrid, ...] = ()

    @model_validator(mode="after")
    def _check(self):
        sizes = [k for k in ("minibatch_size", "batch") if getattr(self, k) is not None]
        if len(sizes) != 1:
            raise KeyPathError(
                "minibatch_size",
                "give exactly one of minibatch_size (sequences per update; rollout batch = "
                f"N·minibatch_size) or batch (rollout batch, split into N); got {sizes or 'none'}",
            )
        seen: dict[str, int] = {}
        for i, m in enumerate(self.mismatch):
            if m.label in seen:
                raise KeyPathError(f"mismatch[{i}]", f"repeated value {m.label!r}")
            seen[m.label] = i
            if m.spike_prob > 0 and m.spike_strength > 0 and m.spike_tokens >= self.environment.V:
                raise KeyPathError(
                    f"mismatch[{i}].spike_tokens",
                    f"must be < V = {self.environment.V} (a spike starves the rarest tokens of "
                    f"a row, not all of them), got {m.spike_tokens}",
                )
        distinct_estimators(self.estimators)
        self.validate()
        return self

    # --- construction --------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict) -> TrainSweepConfig:
        """Build (and check) a training sweep from a plain dict, e.g. parsed TOML."""
        return cls.validated(d)

    def to_dict(self) -> dict:
        """The canonical plain dict (``from_dict(to_dict(c)) == c``; TOML-writable)."""
        d = {"kind": "train", "name": self.name, "steps": self.steps}
        d["minibatches"] = list(self.minibatches)
        for key in ("minibatch_size", "batch"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        d["lag"] = list(self.lag)
        if tuple(self.lag_updates) != (0,):
            d["lag_updates"] = list(self.lag_updates)
        d["lr"] = list(self.lr)
        for key in _scalars():
            if key in _FEATURE_KEYS and self.parameterization == "tabular":
                continue  # the tabular default: no parameterisation keys (older files agree)
            if key in ASYNC_DEFAULTS and getattr(self, key) == ASYNC_DEFAULTS[key]:
                continue  # synchronous defaults: no asynchronous keys (older files agree)
            if key != "steps" and getattr(self, key) is not None:
                d[key] = getattr(self, key)
        d["seeds"] = list(self.seeds)
        d["environment"] = self.environment.to_dict()
        d["mismatch"] = [mismatch_to_dict(m) for m in self.mismatch]
        d["estimators"] = [e.to_dict() for e in self.estimators]
        if self.grids:
            d["grids"] = [g.to_dict() for g in self.grids]
        return plain(d)

    def toml_tables(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The keys written as ``[table]`` and as ``[[array of tables]]`` in TOML."""
        return ("environment",), ("mismatch", "estimators", *(("grids",) if self.grids else ()))

    # --- the runs ------------------------------------------------------------------------

    def rollout_batch(self, N: int) -> int:
        """Sequences per rollout at N mini-batches: N·minibatch_size, or ``batch``."""
        return N * self.minibatch_size if self.minibatch_size is not None else self.batch

    def train_config(
        self,
        estimator,
        N: int,
        lag: int = 0,
        lr: float | None = None,
        mismatch=None,
        lag_updates: int = 0,
    ) -> TrainConfig:
        """The :class:`~simkit.train.TrainConfig` of one run."""
        return TrainConfig(
            estimator=estimator,
            batch=self.rollout_batch(N),
            minibatches=N,
            lag=lag,
            lag_updates=lag_updates,
            lr=self.lr[0] if lr is None else lr,
            mismatch=Mismatch() if mismatch is None else mismatch,
            **{name: getattr(self, name) for name in _scalars()},
        )

    def schedules(self) -> list[tuple[int, float, int, int]]:
        """The (lag, lr, N, lag_updates) of the runs, in expansion order: the product lag ×
        lag_updates × lr × N, or with ``grids`` the union of the sub-grids' products (first
        appearance kept)."""
        grids = self.grids or (SubGrid(),)
        out: dict[tuple, None] = {}
        for g in grids:
            for lag in g.lag or self.lag:
                for lag_u in g.lag_updates or self.lag_updates:
                    for lr in g.lr or self.lr:
                        for N in g.minibatches or self.minibatches:
                            out[(lag, lr, N, lag_u)] = None
        return list(out)

    def runs(self):
        """Yield ``(T, TrainConfig, seed)`` for every run, in expansion order."""
        ests = [e for ec in self.estimators for e in ec.build()]
        schedules = self.schedules()
        for T in self.environment.lengths:
            for mismatch in self.mismatch:
                for lag, lr, N, lag_u in schedules:
                    for est in ests:
                        cfg = self.train_config(est, N, lag, lr, mismatch, lag_u)
                        for seed in self.seeds:
                            yield T, cfg, seed

    def validate(self) -> TrainSweepConfig:
        """Build every run's :class:`~simkit.train.TrainConfig` (batch sizes that do not
        split into N mini-batches or into advantage groups, bad optimizer settings…), each
        error naming the run. Returns ``self``."""
        from simkit.config.errors import ConfigError

        ests = [e for ec in self.estimators for e in ec.build()]
        for lag, lr, N, lag_u in self.schedules():
            for est in ests:
                try:
                    self.train_config(est, N, lag, lr, lag_updates=lag_u)
                except (ValueError, TypeError) as exc:
                    where = "minibatch_size" if self.minibatch_size else "batch"
                    message = exc.args[0] if isinstance(exc, KeyError) else str(exc)
                    raise ConfigError(
                        f"{where}: run (estimator {est.name!r}, N = {N}, lag = {lag}, "
                        f"lag_updates = {lag_u}, "
                        f"lr = {lr!r}): {message}"
                    ) from None
        return self

    def cells(self) -> list[Cell]:
        """One :class:`Cell` per run, in the order of :meth:`runs`.

        ``params``: ``kind = "train"``, the environment at its T, the run's
        :func:`simkit.train.config_dict` and the seed; ``columns``: ``env``, ``T``, ``V``,
        ``estimator``, ``mapping``, ``aggregation``, ``advantage``, ``N``, ``minibatch_size``,
        ``batch``, ``lag``, ``lag_updates``, ``mismatch`` (its label), ``lr``, ``seed``.
        """
        from simkit.train import config_dict

        env_cfg = self.environment
        cells = []
        for T, cfg, seed in self.runs():
            params = {
                "kind": "train",
                "environment": env_cfg.spec(T),
                "train": config_dict(cfg),
                "seed": int(seed),
            }
            est = cfg.estimator
            columns = {
                "env": env_cfg.constructor,
                "T": int(T),
                "V": env_cfg.V,
                "estimator": est.name,
                "mapping": est.mapping.name,
                "aggregation": est.aggregation,
                "advantage": est.advantage,
                "N": cfg.minibatches,
                "minibatch_size": cfg.minibatch_size,
                "batch": cfg.batch,
                "lag": cfg.lag,
                "lag_updates": cfg.lag_updates,
                "mismatch": cfg.mismatch.label,
                "lr": cfg.lr,
                "seed": int(seed),
            }
            cells.append(Cell.make(params, columns, int(seed), len(cells)))
        return cells


def run_train_cell(cell: Cell, progress: bool = False):
    """Compute one training cell: :func:`simkit.train.train` of its environment, config and
    seed. Returns the per-step table (:data:`simkit.train.COLUMNS`) preceded by the cell's
    columns, with ``cell`` (the key) and ``simkit_version``."""
    import pandas as pd

    from simkit import __version__
    from simkit.train import TrainConfig, train

    p = cell.params
    env = build_environment(p["environment"])
    table = train(env, TrainConfig.from_dict(p["train"]), seed=int(p["seed"]), progress=progress)
    front = pd.DataFrame({k: [v] * len(table) for k, v in cell.columns.items()})
    table = pd.concat([front, table.drop(columns=[c for c in cell.columns if c in table])], axis=1)
    table["cell"] = cell.key
    table["simkit_version"] = __version__
    return table
