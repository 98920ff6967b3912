"""Training sweeps: a grid of :func:`simkit.train.train` runs from a TOML file (``kind = "train"``).

The schema of a training sweep (:class:`TrainSweepConfig`) lives with the trainer; it reuses the
environment and estimator tables of an experiment sweep (:mod:`simkit.config`), and
:func:`simkit.config.load_config` reads either kind. One cell = one run
(:meth:`TrainSweepConfig.cells`), computed by :func:`run_train_cell`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar

from simkit.config import (
    Cell,
    EstimatorConfig,
    TokenMDPConfig,
    _check_keys,
    _distinct,
    _distinct_estimators,
    _environment_from_dict,
    _estimator_configs,
    _estimator_from_dict,
    _fail,
    _float,
    _int,
    _message,
    _plain,
    _str,
    _toml_key,
    _toml_value,
    _tuple,
    _type_name,
    build_environment,
    canonical_json,
    cell_key,
)
from simkit.train.core import GRADIENTS, TrainConfig
from simkit.train.mismatch import Mismatch
from simkit.train.optim import OPTIMIZERS

__all__ = ["MISMATCH_KEYS", "TrainSweepConfig", "mismatch_to_dict", "run_train_cell"]

CONFIG_KINDS = ("experiment", "train")
#: keys of a ``[[mismatch]]`` table (the fields of :class:`simkit.train.Mismatch`)
MISMATCH_KEYS = tuple(f.name for f in dataclasses.fields(Mismatch))
#: TrainConfig fields that a training sweep sets once for every run (scalars)
_TRAIN_SCALARS = (
    "steps",
    "optimizer",
    "beta1",
    "beta2",
    "adam_eps",
    "max_grad_norm",
    "gradient",
    "record_every",
)
_TRAIN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def _mismatch_from_dict(d, path: str) -> Mismatch:
    _check_keys(d, path, MISMATCH_KEYS)
    try:
        return Mismatch(**d)
    except (ValueError, TypeError) as exc:
        _fail(path, _message(exc))


def mismatch_to_dict(m: Mismatch) -> dict:
    """The non-default fields of a mismatch (TOML has no None; the defaults are implied)."""
    default = Mismatch()
    return _plain({k: v for k, v in m.to_dict().items() if v != getattr(default, k)})


@dataclass(frozen=True)
class TrainSweepConfig:
    """A grid of training runs (:func:`simkit.train.train`): ``kind = "train"`` in TOML.

    One cell = one run: environment length ``T`` × ``mismatch`` × ``lag`` × ``lr`` ×
    ``minibatches`` (N) × estimator × ``seeds`` (that expansion order, every list swept).

    ``environment`` is a ``kind = "token_mdp"`` table (:class:`TokenMDPConfig`, ``T`` swept);
    ``estimators`` are ``[[estimators]]`` tables as in an experiment sweep
    (:class:`EstimatorConfig`: mapping × grid × aggregations × advantages); ``mismatch`` is a
    list of ``[[mismatch]]`` tables (:class:`simkit.train.Mismatch` fields: ``logit_noise``,
    ``precision``, ``spike_prob``, ``spike_strength``, ``spike_tokens``; none given: no
    mismatch). The rollout size is set by exactly one of ``minibatch_size`` (m sequences per
    update: the rollout batch is N·m, so that every N makes the same updates on the same number
    of samples and only the staleness changes) or ``batch`` (a fixed rollout batch B split
    into N mini-batches of B/N). ``steps``, ``optimizer``, ``beta1``, ``beta2``, ``adam_eps``,
    ``max_grad_norm``, ``gradient`` and ``record_every`` are the
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

    name: str
    environment: TokenMDPConfig
    estimators: tuple[EstimatorConfig, ...]
    steps: int
    minibatches: tuple[int, ...] = (1,)
    minibatch_size: int | None = None
    batch: int | None = None
    lag: tuple[int, ...] = (0,)
    mismatch: tuple[Mismatch, ...] = (Mismatch(),)
    lr: tuple[float, ...] = (_TRAIN_DEFAULTS["lr"],)
    optimizer: str = _TRAIN_DEFAULTS["optimizer"]
    beta1: float = _TRAIN_DEFAULTS["beta1"]
    beta2: float = _TRAIN_DEFAULTS["beta2"]
    adam_eps: float = _TRAIN_DEFAULTS["adam_eps"]
    max_grad_norm: float | None = None
    gradient: str = _TRAIN_DEFAULTS["gradient"]
    record_every: int = _TRAIN_DEFAULTS["record_every"]
    seeds: tuple[int, ...] = (0,)

    kind: ClassVar[str] = "train"

    def __post_init__(self):
        _str(self.name, "name")
        if not self.name:
            _fail("name", "must not be empty")
        if not isinstance(self.environment, TokenMDPConfig):
            _fail(
                "environment",
                "a training sweep needs a token MDP environment (kind = 'token_mdp'), got "
                f"{_type_name(self.environment)}",
            )
        object.__setattr__(self, "estimators", _estimator_configs(self.estimators))
        object.__setattr__(self, "steps", _int(self.steps, "steps", low=1))
        for name, low in (("minibatches", 1), ("lag", 0), ("seeds", 0)):
            values = _tuple(getattr(self, name), name, lambda v, q, lo=low: _int(v, q, low=lo))
            _distinct(values, name)
            object.__setattr__(self, name, values)
        lrs = _tuple(self.lr, "lr", lambda v, q: _float(v, q))
        _distinct(lrs, "lr")
        object.__setattr__(self, "lr", lrs)
        sizes = [k for k in ("minibatch_size", "batch") if getattr(self, k) is not None]
        if len(sizes) != 1:
            _fail(
                "minibatch_size",
                "give exactly one of minibatch_size (sequences per update; rollout batch = "
                f"N·minibatch_size) or batch (rollout batch, split into N); got {sizes or 'none'}",
            )
        object.__setattr__(self, sizes[0], _int(getattr(self, sizes[0]), sizes[0], low=1))
        mm = self.mismatch
        if isinstance(mm, Mismatch) or not isinstance(mm, list | tuple) or not mm:
            _fail("mismatch", "expected a non-empty list of mismatch tables ([[mismatch]])")
        for i, m in enumerate(mm):
            if not isinstance(m, Mismatch):
                _fail(f"mismatch[{i}]", f"expected a simkit.train.Mismatch, got {_type_name(m)}")
        object.__setattr__(self, "mismatch", tuple(mm))
        labels = [m.label for m in self.mismatch]
        _distinct(tuple(labels), "mismatch")
        for m in self.mismatch:
            if m.spike_prob > 0 and m.spike_strength > 0 and m.spike_tokens >= self.environment.V:
                i = self.mismatch.index(m)
                _fail(
                    f"mismatch[{i}].spike_tokens",
                    f"must be < V = {self.environment.V} (a spike starves the rarest tokens of "
                    f"a row, not all of them), got {m.spike_tokens}",
                )
        _str(self.optimizer, "optimizer", OPTIMIZERS, "optimizer")
        _str(self.gradient, "gradient", GRADIENTS, "gradient")
        for i, lr in enumerate(self.lr):
            if not lr > 0:
                _fail(f"lr[{i}]" if len(self.lr) > 1 else "lr", f"must be > 0, got {lr!r}")
        for name in ("beta1", "beta2"):
            value = _float(getattr(self, name), name)
            if not 0.0 < value < 1.0:
                _fail(name, f"must be in (0, 1), got {value!r}")
            object.__setattr__(self, name, value)
        eps = _float(self.adam_eps, "adam_eps")
        if not eps > 0:
            _fail("adam_eps", f"must be > 0, got {eps!r}")
        object.__setattr__(self, "adam_eps", eps)
        if self.max_grad_norm is not None:
            value = _float(self.max_grad_norm, "max_grad_norm")
            if not value > 0:
                _fail("max_grad_norm", f"must be > 0 (or absent: no clipping), got {value!r}")
            object.__setattr__(self, "max_grad_norm", value)
        object.__setattr__(self, "record_every", _int(self.record_every, "record_every", low=1))
        _distinct_estimators(self.estimators)
        self.validate()

    # --- construction --------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict) -> TrainSweepConfig:
        """Build (and check) a training sweep from a plain dict, e.g. parsed TOML."""
        if not isinstance(d, dict):
            _fail("config", f"expected a table (dict), got {_type_name(d)}")
        top = ("kind", *(f.name for f in dataclasses.fields(cls)))
        _check_keys(d, "", top, ("name", "environment", "estimators", "steps"))
        if d.get("kind", "train") != "train":
            _fail("kind", f"a training sweep has kind = 'train', got {d['kind']!r}")
        env = d["environment"]
        if isinstance(env, dict) and env.get("kind") != "token_mdp":
            _fail(
                "environment.kind",
                f"a training sweep needs kind = 'token_mdp', got {env.get('kind')!r}",
            )
        raw = d["estimators"]
        if not isinstance(raw, list | tuple) or not raw:
            _fail("estimators", "expected a non-empty list of estimator tables ([[estimators]])")
        kwargs = {k: v for k, v in d.items() if k != "kind"}
        kwargs["environment"] = _environment_from_dict(env)
        kwargs["estimators"] = tuple(_estimator_from_dict(e, i) for i, e in enumerate(raw))
        if "mismatch" in d:
            mm = d["mismatch"]
            if not isinstance(mm, list | tuple) or not mm:
                _fail("mismatch", "expected a non-empty list of mismatch tables ([[mismatch]])")
            kwargs["mismatch"] = tuple(
                _mismatch_from_dict(m, f"mismatch[{i}]") for i, m in enumerate(mm)
            )
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The canonical plain dict (``from_dict(to_dict(c)) == c``; TOML-writable)."""
        d = {"kind": "train", "name": self.name, "steps": self.steps}
        d["minibatches"] = list(self.minibatches)
        for key in ("minibatch_size", "batch"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        d["lag"] = list(self.lag)
        d["lr"] = list(self.lr)
        for key in ("optimizer", "beta1", "beta2", "adam_eps", "max_grad_norm", "gradient"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        d["record_every"] = self.record_every
        d["seeds"] = list(self.seeds)
        d["environment"] = self.environment.to_dict()
        d["mismatch"] = [mismatch_to_dict(m) for m in self.mismatch]
        d["estimators"] = [e.to_dict() for e in self.estimators]
        return _plain(d)

    # --- the runs ------------------------------------------------------------------------

    def rollout_batch(self, N: int) -> int:
        """Sequences per rollout at N mini-batches: N·minibatch_size, or ``batch``."""
        return N * self.minibatch_size if self.minibatch_size is not None else self.batch

    def train_config(
        self, estimator, N: int, lag: int = 0, lr: float | None = None, mismatch=None
    ) -> TrainConfig:
        """The :class:`~simkit.train.TrainConfig` of one run."""
        return TrainConfig(
            estimator=estimator,
            steps=self.steps,
            batch=self.rollout_batch(N),
            minibatches=N,
            lag=lag,
            optimizer=self.optimizer,
            lr=self.lr[0] if lr is None else lr,
            beta1=self.beta1,
            beta2=self.beta2,
            adam_eps=self.adam_eps,
            max_grad_norm=self.max_grad_norm,
            gradient=self.gradient,
            mismatch=Mismatch() if mismatch is None else mismatch,
            record_every=self.record_every,
        )

    def runs(self):
        """Yield ``(T, TrainConfig, seed)`` for every run, in expansion order."""
        ests = [e for ec in self.estimators for e in ec.build()]
        for T in self.environment.lengths:
            for mismatch in self.mismatch:
                for lag in self.lag:
                    for lr in self.lr:
                        for N in self.minibatches:
                            for est in ests:
                                cfg = self.train_config(est, N, lag, lr, mismatch)
                                for seed in self.seeds:
                                    yield T, cfg, seed

    def validate(self) -> TrainSweepConfig:
        """Build every run's :class:`~simkit.train.TrainConfig` (batch sizes that do not
        split into N mini-batches or into advantage groups, bad optimizer settings…), each
        error naming the run. Returns ``self``."""
        ests = [e for ec in self.estimators for e in ec.build()]
        for N in self.minibatches:
            for est in ests:
                for lag in self.lag:
                    for lr in self.lr:
                        try:
                            self.train_config(est, N, lag, lr)
                        except (ValueError, TypeError) as exc:
                            where = "minibatch_size" if self.minibatch_size else "batch"
                            _fail(
                                where,
                                f"run (estimator {est.name!r}, N = {N}, lag = {lag}, "
                                f"lr = {lr!r}): {_message(exc)}",
                            )
        return self

    def cells(self) -> list[Cell]:
        """One :class:`Cell` per run, in the order of :meth:`runs`.

        ``params``: ``kind = "train"``, the environment at its T, the run's
        :func:`simkit.train.config_dict` and the seed; ``columns``: ``env``, ``T``, ``V``,
        ``estimator``, ``mapping``, ``aggregation``, ``advantage``, ``N``, ``minibatch_size``,
        ``batch``, ``lag``, ``mismatch`` (its label), ``lr``, ``seed``.
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
            params = json.loads(canonical_json(params))
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
                "mismatch": cfg.mismatch.label,
                "lr": cfg.lr,
                "seed": int(seed),
            }
            cells.append(
                Cell(
                    key=cell_key(params, int(seed)),
                    params=params,
                    columns=columns,
                    seed=int(seed),
                    index=len(cells),
                )
            )
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


def _train_toml(config: TrainSweepConfig) -> str:
    d = config.to_dict()
    lines = []
    for key, value in d.items():
        if key in ("environment", "mismatch", "estimators"):
            continue
        lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    lines += ["", "[environment]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d["environment"].items()]
    for table in ("mismatch", "estimators"):
        for entry in d[table]:
            lines += ["", f"[[{table}]]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"
