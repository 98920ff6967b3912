"""Sweep configurations: TOML files ⇄ frozen dataclasses, validation, grid expansion, one cell.

A sweep is a grid of :func:`simkit.experiment.run` calls. Its configuration names

- an **environment**: a K-armed bandit (:class:`BanditConfig`) or a token MDP
  (:class:`TokenMDPConfig`, one of the :class:`~simkit.envs.TokenMDP` constructors, with a
  tuple of lengths ``T`` to sweep);
- a **behaviour** (:class:`BehaviourConfig`): a :mod:`simkit.shifts` family that moves μ away
  from π, the divergence it is dialed on (χ², KL, TV; per token or per sequence) and the
  ``targets`` to sweep;
- the **estimators** (:class:`EstimatorConfig`): a mapping, an optional preset, fixed
  hyperparameters, a hyperparameter ``grid`` (cartesian product, or ``zip`` for linked knobs),
  the aggregations and advantages to cross it with;
- the batch sizes ``n`` (swept), ``reps``, ``seed``, ``exact``, the confidence ``level`` and
  ``n_boot`` of :func:`simkit.experiment.run`.

Keys (``[table]`` by table; every other key is an error)::

    name, seed, n (int or list: swept), reps, exact ("auto" | true | false), level, n_boot
    [environment]   kind = "bandit":    K, logits, means, reward, reward_std, seed
                    kind = "token_mdp": constructor, V, T (int or list: swept), eos, seed,
                                        scale, stationary, kwargs = {constructor arguments}
    [behaviour]     targets (swept), family, family_params = {...}, divergence, level,
                    aggregate, fraction, select_seed
    [[estimators]]  mapping, preset, params = {...}, grid = {name = [values]}, grid_mode
                    ("product" | "zip"), aggregations, advantages, group_size, adv_eps,
                    max_length

An example (a shortened ``configs/quick.toml``)::

    name = "quick"
    seed = 0
    n = [16, 32]
    reps = 50

    [environment]
    kind = "bandit"
    K = 6

    [behaviour]
    family = "logit_noise"
    divergence = "chi2"
    targets = [0.1, 1.0]

    [[estimators]]
    mapping = "naive"

    [[estimators]]
    mapping = "ppo_clip"
    grid = { eps_high = [0.2, 0.28] }

:func:`load_config` reads a TOML file and :func:`validate` checks *everything* before any work
starts: unknown keys (the error names the key path and lists the valid keys), wrong types,
non-positive sizes, unknown mappings / families / aggregations / advantages (the valid names
are listed), invalid hyperparameters (each mapping is built with :func:`simkit.mappings.get`,
its own message is prefixed by the key path), batch sizes that do not split into groups,
``exact = true`` with an estimator that has no exact path, and every divergence target, which
is dialed once per environment (an unreachable one reports the largest reachable value).

:func:`expand` turns a configuration into :class:`Cell` s — one per (T, target, n), each with
*every* expanded estimator so that :func:`simkit.experiment.run` evaluates them on common
random numbers — and :func:`run_cell` computes one cell. A cell's ``key`` is a content hash of
its parameters and the configuration seed, and its random stream is derived from
(seed, key) through :class:`numpy.random.SeedSequence` (:func:`cell_seed`): the numbers of a
cell never depend on the order in which cells run, on the worker or on the machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from simkit import estimators as _estimators
from simkit import experiment, mappings, shifts
from simkit.envs import Bandit, TokenMDP
from simkit.envs.bandit import REWARD_KINDS
from simkit.envs.behaviour import AGGREGATES, LEVELS, BehaviourSpec
from simkit.estimator_specs import build_estimators, estimator_params
from simkit.estimator_specs import plain as _plain

if TYPE_CHECKING:
    from simkit.train.config import TrainSweepConfig

__all__ = [
    "CONFIG_KINDS",
    "EXACT_CHOICES",
    "GRID_MODES",
    "KEY_LENGTH",
    "TOKEN_MDP_CONSTRUCTORS",
    "BanditConfig",
    "BehaviourConfig",
    "Cell",
    "ConfigError",
    "EnvironmentConfig",
    "EstimatorConfig",
    "SweepConfig",
    "TokenMDPConfig",
    "TrainSweepConfig",
    "build_behaviour",
    "build_environment",
    "build_estimators",
    "canonical_json",
    "cell_key",
    "cell_seed",
    "config_from_dict",
    "estimator_params",
    "expand",
    "load_config",
    "run_cell",
    "to_toml",
    "validate",
]

#: TokenMDP constructors a config can name
TOKEN_MDP_CONSTRUCTORS = ("iid", "markov", "answer_correct", "at_least_k", "parity")
#: values of ``exact`` (as in :func:`simkit.experiment.run`)
EXACT_CHOICES = ("auto", True, False)
#: hex characters of a cell key (64 bits of sha256)
KEY_LENGTH = 16
#: columns that :func:`simkit.experiment.run` adds itself (not passed as ``setting``)
_RUN_COLUMNS = ("T", "n")


class ConfigError(ValueError):
    """An invalid sweep configuration; the message starts with the offending key path."""


def _fail(path: str, message: str):
    raise ConfigError(f"{path}: {message}" if path else message)


# --- small typed readers (each names the key path) -------------------------------------------


def _type_name(value) -> str:
    return type(value).__name__


def _check_keys(d, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
    if not isinstance(d, dict):
        _fail(path or "config", f"expected a table (dict), got {_type_name(d)} {d!r}")
    unknown = [k for k in d if k not in allowed]
    if unknown:
        where = f"{path}." if path else ""
        _fail(
            f"{where}{unknown[0]}",
            f"unknown key {unknown[0]!r}; valid keys{' in ' + path if path else ''}: "
            f"{', '.join(allowed)}",
        )
    for key in required:
        if key not in d:
            _fail(f"{path}.{key}" if path else key, "missing required key")


def _int(value, path: str, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        _fail(path, f"expected an integer, got {_type_name(value)} {value!r}")
    if low is not None and value < low:
        _fail(path, f"must be an integer >= {low}, got {value!r}")
    return int(value)


def _float(value, path: str, low: float | None = None, finite: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        _fail(path, f"expected a number, got {_type_name(value)} {value!r}")
    value = float(value)
    if finite and not math.isfinite(value):
        _fail(path, f"must be finite, got {value!r}")
    if low is not None and not value >= low:
        _fail(path, f"must be >= {low:g}, got {value!r}")
    return value


def _str(value, path: str, choices=None, what: str = "value") -> str:
    if not isinstance(value, str):
        _fail(path, f"expected a string, got {_type_name(value)} {value!r}")
    if choices is not None and value not in choices:
        _fail(path, f"unknown {what} {value!r}; valid: {', '.join(map(str, choices))}")
    return value


def _tuple(value, path: str, item, allow_scalar: bool = True) -> tuple:
    """A non-empty tuple from a list (or a single scalar when ``allow_scalar``)."""
    if isinstance(value, list | tuple):
        if not value:
            _fail(path, "must not be empty")
        return tuple(item(v, f"{path}[{i}]") for i, v in enumerate(value))
    if allow_scalar:
        return (item(value, path),)
    _fail(path, f"expected a list, got {_type_name(value)} {value!r}")


def _distinct(values: tuple, path: str) -> None:
    seen = set()
    for i, v in enumerate(values):
        if v in seen:
            _fail(f"{path}[{i}]", f"repeated value {v!r}")
        seen.add(v)


def _param_value(value, path: str):
    """A hyperparameter value: bool, int, float or str (kept as written)."""
    if isinstance(value, bool | int | float | str | np.generic):
        return _plain(value)
    _fail(path, f"expected a number, string or boolean, got {_type_name(value)} {value!r}")


def _like_default(defaults, name: str, value):
    """``value`` as a float when the hyperparameter's default is a float and ``value`` an int
    (TOML ``c = 2`` and ``c = 2.0`` are one configuration, one key, one column dtype)."""
    default = getattr(defaults, name, None)
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _pairs(value, path: str) -> tuple:
    """A table of scalar parameters as sorted (name, value) pairs (hashable, order-free)."""
    if isinstance(value, tuple):
        value = dict(value)
    if not isinstance(value, dict):
        _fail(path, f"expected a table (dict), got {_type_name(value)} {value!r}")
    return tuple(sorted((str(k), _param_value(v, f"{path}.{k}")) for k, v in value.items()))


# --- environments ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BanditConfig:
    """A K-armed bandit (:class:`simkit.envs.Bandit`), T = 1.

    ``logits`` and ``means`` are given (each a list of K numbers), or drawn from ``seed`` as in
    the first-wave bandit figures (:mod:`simkit.figures.bandit_bias_variance`):
    ``rng = default_rng(seed)``, logits = rng.normal(0, 1, K), then means = rng.uniform(0.05,
    0.95, K) (a given array replaces its draw; the other is still drawn in that order).
    ``reward``: ``"bernoulli"`` or ``"gaussian"`` (``reward_std`` > 0, Gaussian only).
    """

    K: int
    logits: tuple[float, ...] | None = None
    means: tuple[float, ...] | None = None
    reward: str = "bernoulli"
    reward_std: float | None = None
    seed: int = 0

    kind: ClassVar[str] = "bandit"

    def __post_init__(self):
        p = "environment"
        object.__setattr__(self, "K", _int(self.K, f"{p}.K", low=1))
        for name in ("logits", "means"):
            arr = getattr(self, name)
            if arr is not None:
                arr = _tuple(arr, f"{p}.{name}", _float, allow_scalar=False)
                if len(arr) != self.K:
                    _fail(f"{p}.{name}", f"expected K = {self.K} numbers, got {len(arr)}")
                object.__setattr__(self, name, arr)
        _str(self.reward, f"{p}.reward", REWARD_KINDS, "reward kind")
        if self.reward_std is not None:
            object.__setattr__(
                self, "reward_std", _float(self.reward_std, f"{p}.reward_std", low=0.0)
            )
        object.__setattr__(self, "seed", _int(self.seed, f"{p}.seed", low=0))
        try:
            self.build()
        except (ValueError, TypeError) as exc:
            _fail(p, str(exc))

    @property
    def lengths(self) -> tuple[int, ...]:
        return (1,)

    def build(self, T: int = 1) -> Bandit:
        """The bandit (``T`` must be 1)."""
        if T != 1:
            raise ValueError(f"a bandit has T = 1, got T = {T}")
        from simkit._memory import check_bandit  # (issue 13 §5: before the (K,) draws)

        check_bandit(self.K)
        rng = np.random.default_rng(self.seed)
        logits = rng.normal(0.0, 1.0, self.K)
        means = rng.uniform(0.05, 0.95, self.K)
        if self.logits is not None:
            logits = np.array(self.logits)
        if self.means is not None:
            means = np.array(self.means)
        return Bandit(logits=logits, means=means, reward=self.reward, reward_std=self.reward_std)

    def spec(self, T: int = 1) -> dict:
        """Plain dict describing the environment at length ``T`` (cell parameters)."""
        out = {"kind": self.kind, **_omit_none(dataclasses.asdict(self))}
        out["T"] = 1
        return _plain(out)

    def to_dict(self) -> dict:
        return _plain({"kind": self.kind, **_omit_none(dataclasses.asdict(self))})


@dataclass(frozen=True)
class TokenMDPConfig:
    """A token MDP built by ``TokenMDP.<constructor>(V=V, T=T, eos=eos, seed=seed,
    scale=scale, stationary=stationary, **kwargs)`` for every length of ``T`` (swept).

    ``constructor``: one of :data:`TOKEN_MDP_CONSTRUCTORS`; ``kwargs``: the constructor's own
    arguments (``answer``, ``target``, ``k``, ``hit``, ``marked``...) as a table.
    """

    constructor: str
    V: int
    T: tuple[int, ...]
    eos: int | None = None
    seed: int = 0
    scale: float = 1.0
    stationary: bool = True
    kwargs: tuple = ()

    kind: ClassVar[str] = "token_mdp"

    def __post_init__(self):
        p = "environment"
        _str(self.constructor, f"{p}.constructor", TOKEN_MDP_CONSTRUCTORS, "TokenMDP constructor")
        object.__setattr__(self, "V", _int(self.V, f"{p}.V", low=2))
        Ts = _tuple(self.T, f"{p}.T", lambda v, q: _int(v, q, low=1))
        _distinct(Ts, f"{p}.T")
        object.__setattr__(self, "T", Ts)
        if self.eos is not None:
            object.__setattr__(self, "eos", _int(self.eos, f"{p}.eos", low=0))
        object.__setattr__(self, "seed", _int(self.seed, f"{p}.seed", low=0))
        object.__setattr__(self, "scale", _float(self.scale, f"{p}.scale", low=0.0))
        if not isinstance(self.stationary, bool):
            _fail(f"{p}.stationary", f"expected a boolean, got {self.stationary!r}")
        kwargs = self.kwargs
        if isinstance(kwargs, tuple):
            kwargs = dict(kwargs)
        if not isinstance(kwargs, dict):
            _fail(f"{p}.kwargs", f"expected a table (dict), got {_type_name(kwargs)}")
        reserved = sorted(set(kwargs) & {"V", "T", "eos", "seed", "scale", "stationary", "logits"})
        if reserved:
            _fail(
                f"{p}.kwargs.{reserved[0]}",
                f"{reserved[0]!r} is set at the environment level (or not configurable), not "
                "in kwargs",
            )
        items = tuple(sorted((str(k), _freeze(_plain(v))) for k, v in kwargs.items()))
        object.__setattr__(self, "kwargs", items)
        for T in self.T:
            try:
                self.build(T)
            except (ValueError, TypeError) as exc:
                _fail(f"{p} (T = {T})", str(exc))

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.T

    def build(self, T: int) -> TokenMDP:
        """The token MDP of length ``T``."""
        make = getattr(TokenMDP, self.constructor)
        kwargs = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.kwargs}
        return make(
            V=self.V,
            T=int(T),
            eos=self.eos,
            seed=self.seed,
            scale=self.scale,
            stationary=self.stationary,
            **kwargs,
        )

    def spec(self, T: int) -> dict:
        out = self.to_dict()
        out["T"] = int(T)
        return out

    def to_dict(self) -> dict:
        d = _omit_none(dataclasses.asdict(self))
        d["kwargs"] = dict(self.kwargs)
        if not d["kwargs"]:
            del d["kwargs"]
        return _plain({"kind": self.kind, **d})


EnvironmentConfig = BanditConfig | TokenMDPConfig
_ENVIRONMENTS = {"bandit": BanditConfig, "token_mdp": TokenMDPConfig}


def _freeze(value):
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _omit_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _environment_from_dict(d) -> EnvironmentConfig:
    p = "environment"
    if not isinstance(d, dict):
        _fail(p, f"expected a table (dict), got {_type_name(d)}")
    kind = _str(d.get("kind"), f"{p}.kind", tuple(_ENVIRONMENTS), "environment kind")
    cls = _ENVIRONMENTS[kind]
    required = tuple(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    _check_keys(d, p, ("kind", *_fields(cls)), required)
    kwargs = {k: v for k, v in d.items() if k != "kind"}
    return cls(**kwargs)


# --- behaviour ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BehaviourConfig:
    """How μ is moved away from π, and the divergence ``targets`` to sweep.

    ``family`` (a :mod:`simkit.shifts` name) with its hyperparameters ``family_params``;
    ``divergence``: ``"chi2"``, ``"kl"`` or ``"tv"`` (D(π‖μ)); ``level``: ``"token"`` or
    ``"sequence"`` (token MDP; on the bandit T = 1 and both coincide: μ =
    ``shifts.dial(π, target, ...)``). Token MDP only: ``aggregate`` (``"each"``/``"average"``),
    ``fraction`` and ``select_seed`` (a concentrated profile), as in
    :class:`simkit.envs.BehaviourSpec`.
    """

    targets: tuple[float, ...]
    family: str = "temperature"
    family_params: tuple = ()
    divergence: str = "chi2"
    level: str = "token"
    aggregate: str | None = None
    fraction: float | None = None
    select_seed: int = 0

    def __post_init__(self):
        p = "behaviour"
        targets = _tuple(self.targets, f"{p}.targets", lambda v, q: _float(v, q, low=0.0))
        _distinct(targets, f"{p}.targets")
        object.__setattr__(self, "targets", targets)
        _str(self.family, f"{p}.family", shifts.available(), "shift family")
        params = _pairs(self.family_params, f"{p}.family_params")
        defaults = shifts.get(self.family)
        params = tuple((k, _like_default(defaults, k, v)) for k, v in params)
        object.__setattr__(self, "family_params", params)
        try:
            shifts.get(self.family, **dict(self.family_params))
        except (ValueError, TypeError, KeyError) as exc:
            _fail(f"{p}.family_params", _message(exc))
        _str(self.divergence, f"{p}.divergence", tuple(shifts.DIVERGENCES), "divergence")
        _str(self.level, f"{p}.level", LEVELS, "level")
        if self.aggregate is not None:
            _str(self.aggregate, f"{p}.aggregate", AGGREGATES, "aggregate")
        if self.fraction is not None:
            fraction = _float(self.fraction, f"{p}.fraction")
            if not 0.0 < fraction <= 1.0:
                _fail(f"{p}.fraction", f"must be in (0, 1], got {fraction!r}")
            object.__setattr__(self, "fraction", fraction)
        object.__setattr__(self, "select_seed", _int(self.select_seed, f"{p}.select_seed", 0))
        try:  # the remaining cross-field checks of the token-MDP recipe
            self.spec(self.targets[0])
        except (ValueError, TypeError) as exc:
            _fail(p, _message(exc))

    def spec(self, target: float) -> BehaviourSpec:
        """The :class:`~simkit.envs.BehaviourSpec` of one target (token MDP)."""
        return BehaviourSpec(
            target=target,
            divergence=self.divergence,
            level=self.level,
            family=self.family,
            aggregate=self.aggregate,
            fraction=self.fraction,
            select_seed=self.select_seed,
            family_params=self.family_params,
        )

    def params(self, target: float) -> dict:
        """Plain dict of the behaviour at one target (cell parameters)."""
        d = self.to_dict()
        del d["targets"]
        d["target"] = float(target)
        return d

    def to_dict(self) -> dict:
        d = _omit_none(dataclasses.asdict(self))
        d["family_params"] = dict(self.family_params)
        if not d["family_params"]:
            del d["family_params"]
        return _plain(d)


def _behaviour_from_dict(d) -> BehaviourConfig:
    _check_keys(d, "behaviour", _fields(BehaviourConfig), ("targets",))
    d = dict(d)
    if "family_params" in d and isinstance(d["family_params"], dict):
        d["family_params"] = _pairs(d["family_params"], "behaviour.family_params")
    return BehaviourConfig(**d)


# --- estimators -----------------------------------------------------------------------------

GRID_MODES = ("product", "zip")


@dataclass(frozen=True)
class EstimatorConfig:
    """A family of estimators: one mapping, crossed with a hyperparameter grid, aggregations
    and advantages.

    ``mapping`` (a :func:`simkit.mappings.available` name), ``preset`` (a named preset of the
    mapping), ``params`` (fixed hyperparameters), ``grid`` ({hyperparameter: [values]}):
    ``grid_mode = "product"`` takes the cartesian product of the lists (in the order of the
    sorted hyperparameter names), ``"zip"`` pairs them element by element (lists of one length:
    linked knobs such as PPO's ε_low = ε_high). Each hyperparameter setting is crossed with
    ``aggregations`` × ``advantages``; ``group_size`` applies to the group advantages (grpo,
    dr_grpo, rloo), ``adv_eps`` to grpo, ``max_length`` to seq-mean-token-sum-norm.
    """

    mapping: str
    preset: str | None = None
    params: tuple = ()
    grid: tuple = ()
    grid_mode: str = "product"
    aggregations: tuple[str, ...] = ("token-mean",)
    advantages: tuple[str, ...] = ("oracle",)
    group_size: int | None = None
    adv_eps: float = _estimators.DEFAULT_ADV_EPS
    max_length: int | None = None
    #: key path in error messages (set by :meth:`SweepConfig.__post_init__`)
    path: str = field(default="estimators[?]", compare=False, repr=False)

    def __post_init__(self):
        p = self.path
        _str(self.mapping, f"{p}.mapping", mappings.available(), "mapping")
        if self.preset is not None:
            presets = tuple(mappings.mapping_class(self.mapping).presets)
            _str(self.preset, f"{p}.preset", presets or ("(none)",), "preset")
        defaults = mappings.get(self.mapping)
        params = _pairs(self.params, f"{p}.params")
        params = tuple((k, _like_default(defaults, k, v)) for k, v in params)
        object.__setattr__(self, "params", params)
        grid = self.grid
        if isinstance(grid, tuple):
            grid = dict(grid)
        if not isinstance(grid, dict):
            _fail(f"{p}.grid", f"expected a table {{hyperparameter: [values]}}, got {grid!r}")
        grid = tuple(
            sorted(
                (str(k), _tuple(v, f"{p}.grid.{k}", _param_value, allow_scalar=False))
                for k, v in grid.items()
            )
        )
        grid = tuple((k, tuple(_like_default(defaults, k, v) for v in vs)) for k, vs in grid)
        object.__setattr__(self, "grid", grid)
        both = sorted(set(dict(self.params)) & set(dict(grid)))
        if both:
            _fail(f"{p}.grid.{both[0]}", f"{both[0]!r} is both in params and in grid")
        _str(self.grid_mode, f"{p}.grid_mode", GRID_MODES, "grid mode")
        if self.grid_mode == "zip" and len({len(v) for _, v in grid}) > 1:
            lengths = {k: len(v) for k, v in grid}
            _fail(f"{p}.grid", f"grid_mode 'zip' needs lists of one length, got {lengths}")
        for name in ("aggregations", "advantages"):
            choices = _estimators.AGGREGATIONS if name == "aggregations" else _estimators.ADVANTAGES
            what = name[:-1]
            values = _tuple(
                getattr(self, name), f"{p}.{name}", lambda v, q, c=choices, w=what: _str(v, q, c, w)
            )
            _distinct(values, f"{p}.{name}")
            object.__setattr__(self, name, values)
        if self.group_size is not None:
            object.__setattr__(self, "group_size", _int(self.group_size, f"{p}.group_size", 2))
            if not set(self.advantages) & set(_estimators.GROUP_ADVANTAGES):
                _fail(
                    f"{p}.group_size",
                    f"applies to the group advantages {_estimators.GROUP_ADVANTAGES} only; "
                    f"advantages are {list(self.advantages)}",
                )
        object.__setattr__(self, "adv_eps", _float(self.adv_eps, f"{p}.adv_eps", low=0.0))
        if self.max_length is not None:
            object.__setattr__(self, "max_length", _int(self.max_length, f"{p}.max_length", 1))
        self.build()  # every hyperparameter setting and estimator, with key-path errors

    def settings(self) -> list[dict]:
        """The hyperparameter dicts of the grid (fixed ``params`` included), in grid order."""
        names = [k for k, _ in self.grid]
        lists = [v for _, v in self.grid]
        combos = zip(*lists) if self.grid_mode == "zip" else itertools.product(*lists)
        if not names:
            combos = [()]
        return [{**dict(self.params), **dict(zip(names, combo))} for combo in combos]

    def build(self) -> list[_estimators.Estimator]:
        """Every estimator of this entry: settings × aggregations × advantages (that order)."""
        p = self.path
        try:  # the fixed part first, so that its errors point at params / preset
            mappings.get(self.mapping, preset=self.preset, **dict(self.params))
        except (ValueError, TypeError, KeyError) as exc:
            _fail(f"{p}.params" if self.params else f"{p}.preset", _message(exc))
        out = []
        grid_names = [k for k, _ in self.grid]
        for hp in self.settings():
            where = f"{p}.grid ({_short({k: hp[k] for k in grid_names})})"
            try:
                mapping = mappings.get(self.mapping, preset=self.preset, **hp)
            except (ValueError, TypeError, KeyError) as exc:
                _fail(where, _message(exc))
            for aggregation in self.aggregations:
                for advantage in self.advantages:
                    group = advantage in _estimators.GROUP_ADVANTAGES
                    if group and self.group_size is None:
                        _fail(
                            f"{p}.group_size",
                            f"advantage {advantage!r} needs a group_size G >= 2",
                        )
                    try:
                        out.append(
                            _estimators.Estimator(
                                mapping,
                                aggregation=aggregation,
                                advantage=advantage,
                                group_size=self.group_size if group else None,
                                adv_eps=self.adv_eps,
                                max_length=(
                                    self.max_length
                                    if aggregation == "seq-mean-token-sum-norm"
                                    else None
                                ),
                            )
                        )
                    except (ValueError, TypeError) as exc:
                        _fail(p, _message(exc))
        return out

    def to_dict(self) -> dict:
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "path" and getattr(self, f.name) is not None
        }
        d["params"] = dict(self.params)
        d["grid"] = {k: list(v) for k, v in self.grid}
        for key in ("params", "grid"):
            if not d[key]:
                del d[key]
        if d["grid_mode"] == "product":
            del d["grid_mode"]
        if d["adv_eps"] == _estimators.DEFAULT_ADV_EPS:
            del d["adv_eps"]
        return _plain(d)


def _short(hp: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in hp.items())


def _message(exc: BaseException) -> str:
    # KeyError's str() adds quotes around the message
    return exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)


def _estimator_configs(ests) -> tuple:
    """``estimators`` as a tuple of :class:`EstimatorConfig`: a non-empty list is required."""
    if isinstance(ests, EstimatorConfig) or not isinstance(ests, list | tuple) or not ests:
        _fail("estimators", "expected a non-empty list of estimator tables")
    for i, e in enumerate(ests):
        if not isinstance(e, EstimatorConfig):
            _fail(f"estimators[{i}]", f"expected an EstimatorConfig, got {_type_name(e)}")
    return tuple(ests)


def _distinct_estimators(configs) -> list[tuple[int, _estimators.Estimator]]:
    """Every (index of its config entry, estimator) expanded from ``configs``; an estimator name
    produced twice is an error naming both entries."""
    names: dict[str, int] = {}
    out = []
    for i, e in enumerate(configs):
        for est in e.build():
            if est.name in names:
                _fail(
                    f"estimators[{i}]",
                    f"estimator {est.name!r} is already produced by "
                    f"estimators[{names[est.name]}]; every expanded estimator must be distinct",
                )
            names[est.name] = i
            out.append((i, est))
    return out


def _estimator_from_dict(d, i: int) -> EstimatorConfig:
    path = f"estimators[{i}]"
    allowed = tuple(f for f in _fields(EstimatorConfig) if f != "path")
    _check_keys(d, path, allowed, ("mapping",))
    return EstimatorConfig(**d, path=path)


# --- the sweep ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepConfig:
    """A whole sweep: environment × behaviour targets × (T) × n, with the estimators.

    ``name`` (a label), ``seed`` (≥ 0; the root of every cell's random stream), ``n`` (batch
    sizes, swept), ``reps`` (≥ 2), ``exact`` (``"auto"``, true, false), ``level`` (confidence
    level of the Monte Carlo bounds) and ``n_boot`` (bootstrap resamples) as in
    :func:`simkit.experiment.run`. Build it from a dict with :meth:`from_dict` or from a TOML
    file with :func:`load_config`; :meth:`to_dict` gives the canonical dict back (round trip).
    The constructor checks each field; :func:`validate` adds the checks that need the built
    environments (divergence targets reachable, exact paths, group sizes).
    """

    name: str
    environment: EnvironmentConfig
    behaviour: BehaviourConfig
    estimators: tuple[EstimatorConfig, ...]
    n: tuple[int, ...]
    seed: int = 0
    reps: int = 1000
    exact: str | bool = "auto"
    level: float = 0.95
    n_boot: int = 1000

    kind: ClassVar[str] = "experiment"

    def __post_init__(self):
        _str(self.name, "name")
        if not self.name:
            _fail("name", "must not be empty")
        object.__setattr__(self, "seed", _int(self.seed, "seed", low=0))
        if not isinstance(self.environment, BanditConfig | TokenMDPConfig):
            _fail("environment", f"expected an environment config, got {self.environment!r}")
        if not isinstance(self.behaviour, BehaviourConfig):
            _fail("behaviour", f"expected a BehaviourConfig, got {self.behaviour!r}")
        object.__setattr__(self, "estimators", _estimator_configs(self.estimators))
        ns = _tuple(self.n, "n", lambda v, q: _int(v, q, low=1))
        _distinct(ns, "n")
        object.__setattr__(self, "n", ns)
        object.__setattr__(self, "reps", _int(self.reps, "reps", low=2))
        if not isinstance(self.exact, bool) and not (
            isinstance(self.exact, str) and self.exact == "auto"
        ):
            _fail("exact", f"must be 'auto', true or false, got {self.exact!r}")
        level = _float(self.level, "level")
        if not 0.0 < level < 1.0:
            _fail("level", f"must be in (0, 1), got {level!r}")
        object.__setattr__(self, "level", level)
        object.__setattr__(self, "n_boot", _int(self.n_boot, "n_boot", low=10))
        env = self.environment
        if isinstance(env, BanditConfig):
            b = self.behaviour
            for key in ("aggregate", "fraction"):
                if getattr(b, key) is not None:
                    _fail(f"behaviour.{key}", "applies to a token MDP environment only")
        for i, est in _distinct_estimators(self.estimators):
            for n in self.n:
                try:
                    est.check_batch_size(n)
                except ValueError as exc:
                    _fail(f"estimators[{i}].group_size", str(exc))

    @classmethod
    def from_dict(cls, d: dict) -> SweepConfig | TrainSweepConfig:
        """Build (and check) a configuration from a plain dict, e.g. parsed TOML.

        A dict with ``kind = "train"`` is a training sweep: the result is then a
        :class:`TrainSweepConfig` (:func:`config_from_dict`); ``kind = "experiment"`` (the
        default) is this class.
        """
        if isinstance(d, dict) and "kind" in d:
            kind = _str(d["kind"], "kind", CONFIG_KINDS, "config kind")
            if kind == "train":
                return _train().TrainSweepConfig.from_dict(d)
            d = {k: v for k, v in d.items() if k != "kind"}
        top = ("name", *(f.name for f in dataclasses.fields(cls) if f.name != "name"))
        _check_keys(d, "", top, ("name", "environment", "behaviour", "estimators", "n"))
        raw = d["estimators"]
        if not isinstance(raw, list | tuple) or not raw:
            _fail("estimators", "expected a non-empty list of estimator tables ([[estimators]])")
        return cls(
            **{
                **d,
                "environment": _environment_from_dict(d["environment"]),
                "behaviour": _behaviour_from_dict(d["behaviour"]),
                "estimators": tuple(_estimator_from_dict(e, i) for i, e in enumerate(raw)),
            }
        )

    def to_dict(self) -> dict:
        """The canonical plain dict (``from_dict(to_dict(c)) == c``; TOML-writable)."""
        return {
            "name": self.name,
            "seed": self.seed,
            "n": list(self.n),
            "reps": self.reps,
            "exact": self.exact,
            "level": self.level,
            "n_boot": self.n_boot,
            "environment": self.environment.to_dict(),
            "behaviour": self.behaviour.to_dict(),
            "estimators": [e.to_dict() for e in self.estimators],
        }


# --- configuration kinds ------------------------------------------------------------------------

#: values of the top-level ``kind`` key: experiment sweeps (the default) and training sweeps
CONFIG_KINDS = ("experiment", "train")
#: names that live with the trainer (:mod:`simkit.train.config`, which builds on this module)
_TRAIN_NAMES = ("TrainSweepConfig", "MISMATCH_KEYS", "mismatch_to_dict", "run_train_cell")


def _train():
    """:mod:`simkit.train.config`, imported when a training sweep is used (it imports this
    module: the experiment-sweep layer does not depend on the trainer)."""
    import importlib

    return importlib.import_module("simkit.train.config")


def __getattr__(name: str):
    if name in _TRAIN_NAMES:
        return getattr(_train(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_train(config) -> bool:
    return getattr(config, "kind", None) == "train" and not isinstance(config, SweepConfig)


def config_from_dict(d: dict) -> SweepConfig | TrainSweepConfig:
    """A sweep configuration from a plain dict: ``kind = "train"`` gives a
    :class:`TrainSweepConfig`, ``"experiment"`` or no ``kind`` a :class:`SweepConfig`."""
    return SweepConfig.from_dict(d)


def load_config(path, check: bool = True) -> SweepConfig | TrainSweepConfig:
    """Read a TOML sweep configuration and :func:`validate` it (unless ``check=False``).

    The top-level ``kind`` selects the schema: ``"experiment"`` (default,
    :class:`SweepConfig`) or ``"train"`` (:class:`TrainSweepConfig`). Raises
    :class:`ConfigError` naming the file and the offending key path.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        config = SweepConfig.from_dict(data)
        if check:
            validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config


def validate(config: SweepConfig | TrainSweepConfig):
    """Every check that needs the built environments, before any work starts.

    For each length T: the environment is built, μ is dialed at every target (an unreachable
    target raises with the largest reachable value), ``exact = true`` is checked against each
    estimator's exact path. A :class:`TrainSweepConfig` is checked by
    :meth:`TrainSweepConfig.validate`. Returns ``config``.
    """
    if _is_train(config):
        return config.validate()
    if not isinstance(config, SweepConfig):
        raise TypeError(
            f"config must be a SweepConfig or a TrainSweepConfig, got {_type_name(config)}"
        )
    ests = [e for ec in config.estimators for e in ec.build()]
    for T in config.environment.lengths:
        env = config.environment.build(T)
        for target in config.behaviour.targets:
            try:
                build_behaviour(env, config.behaviour.params(target))
            except ValueError as exc:
                at = f"behaviour.targets (T = {T})" if len(config.environment.lengths) > 1 else ""
                _fail(at or "behaviour.targets", str(exc))
        if config.exact is True:
            bad = [e.name for e in ests if not experiment.has_exact_path(env, e)]
            if bad:
                _fail(
                    "exact",
                    f"exact = true but these estimators have no exact path at T = {T}: "
                    f'{", ".join(bad)} (use exact = "auto")',
                )
    return config


# --- cells ----------------------------------------------------------------------------------


def canonical_json(obj) -> str:
    """The canonical JSON text of a plain object: sorted keys, no spaces, floats as repr."""
    return json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def cell_key(params: dict, seed: int) -> str:
    """First :data:`KEY_LENGTH` hex characters of sha256(canonical JSON of {params, seed})."""
    text = canonical_json({"params": params, "seed": int(seed)})
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:KEY_LENGTH]


def cell_seed(seed: int, key: str) -> int:
    """The seed of a cell's :func:`simkit.experiment.run`: the first 64-bit word of
    ``SeedSequence([seed, *32-bit words of key])`` (depends on (seed, key) only)."""
    value = int(key, 16)
    words = [(value >> (32 * i)) & 0xFFFFFFFF for i in range((len(key) * 4 + 31) // 32)]
    state = np.random.SeedSequence([int(seed), *words]).generate_state(1, dtype=np.uint64)
    return int(state[0])


@dataclass(frozen=True, eq=False)
class Cell:
    """One setting of a sweep — environment (with its T) × behaviour target × n — with every
    expanded estimator.

    ``key``: :func:`cell_key` of (``params``, ``seed``); ``params``: a plain JSON-able dict
    (``environment``, ``behaviour``, ``n``, ``reps``, ``exact``, ``level``, ``n_boot``,
    ``estimators``) from which :func:`run_cell` rebuilds everything; ``columns``: the setting's
    columns of the results table (``env``, ``family``, ``divergence``, ``div_level``,
    ``target``, ``T``, ``n``); ``seed``: the configuration seed; ``index``: position in the
    expansion order.
    """

    key: str
    params: dict
    columns: dict
    seed: int
    index: int = 0

    @property
    def run_seed(self) -> int:
        """The seed passed to :func:`simkit.experiment.run` (:func:`cell_seed`)."""
        return cell_seed(self.seed, self.key)

    def __eq__(self, other):
        if not isinstance(other, Cell):
            return NotImplemented
        return (self.key, self.params, self.columns, self.seed) == (
            other.key,
            other.params,
            other.columns,
            other.seed,
        )

    def __hash__(self):
        return hash(self.key)


def expand(config: SweepConfig | TrainSweepConfig) -> list[Cell]:
    """The cells of a configuration, in a deterministic order: T, then target, then n
    (a training sweep: :meth:`TrainSweepConfig.cells`).

    Every cell holds all the expanded estimators (configuration order; inside an entry: grid
    settings × aggregations × advantages).
    """
    if _is_train(config):
        return config.cells()
    if not isinstance(config, SweepConfig):
        raise TypeError(
            f"config must be a SweepConfig or a TrainSweepConfig, got {_type_name(config)}"
        )
    ests = [estimator_params(e) for ec in config.estimators for e in ec.build()]
    env_cfg = config.environment
    env_label = "bandit" if isinstance(env_cfg, BanditConfig) else env_cfg.constructor
    cells = []
    for T in env_cfg.lengths:
        for target in config.behaviour.targets:
            for n in config.n:
                params = {
                    "environment": env_cfg.spec(T),
                    "behaviour": config.behaviour.params(target),
                    "n": int(n),
                    "reps": config.reps,
                    "exact": config.exact,
                    "level": config.level,
                    "n_boot": config.n_boot,
                    "estimators": ests,
                }
                params = json.loads(canonical_json(params))  # plain, exactly as hashed
                columns = {
                    "env": env_label,
                    "family": config.behaviour.family,
                    "divergence": config.behaviour.divergence,
                    "div_level": config.behaviour.level,
                    "target": float(target),
                    "T": int(T),
                    "n": int(n),
                }
                cells.append(
                    Cell(
                        key=cell_key(params, config.seed),
                        params=params,
                        columns=columns,
                        seed=config.seed,
                        index=len(cells),
                    )
                )
    return cells


def build_environment(spec: dict):
    """The environment of a cell's ``params["environment"]``."""
    spec = dict(spec)
    kind = spec.pop("kind")
    T = spec.pop("T")
    cls = _ENVIRONMENTS[kind]
    if kind == "token_mdp":
        spec["T"] = (T,)
        spec["kwargs"] = tuple(sorted(spec.get("kwargs", {}).items()))
    return cls(**spec).build(T)


def build_behaviour(env, spec: dict) -> np.ndarray:
    """μ of a cell's ``params["behaviour"]`` for ``env`` (dialed; ValueError if unreachable)."""
    spec = dict(spec)
    target = float(spec.pop("target"))
    family_params = dict(spec.pop("family_params", {}))
    if isinstance(env, Bandit):
        return shifts.dial(
            env.pi, target, divergence=spec["divergence"], family=spec["family"], **family_params
        )
    b = BehaviourConfig(targets=(target,), family_params=family_params, **spec)
    return b.spec(target).build(env)


def run_cell(cell: Cell, progress: bool = False):
    """Compute one cell: :func:`simkit.experiment.run` on its environment, μ and estimators
    (a training cell: :func:`run_train_cell`).

    The seed is :func:`cell_seed` (config seed, cell key), so the table depends on the cell
    only. Returns the experiment table with the cell's columns, ``cell`` (the key) and
    ``simkit_version``.
    """
    from simkit import __version__

    p = cell.params
    if p.get("kind") == "train":
        return _train().run_train_cell(cell, progress=progress)
    env = build_environment(p["environment"])
    mu = build_behaviour(env, p["behaviour"])
    ests = build_estimators(p["estimators"])
    setting = {k: v for k, v in cell.columns.items() if k not in _RUN_COLUMNS}
    table = experiment.run(
        env,
        mu,
        ests,
        n=p["n"],
        reps=p["reps"],
        seed=cell.run_seed,
        exact=p["exact"],
        setting=setting,
        level=p["level"],
        n_boot=p["n_boot"],
        progress=progress,
    )
    table["cell"] = cell.key
    table["simkit_version"] = __version__
    return table


# --- TOML writing ---------------------------------------------------------------------------


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
        )
    raise TypeError(f"cannot write {_type_name(value)} {value!r} as TOML")


def _toml_key(key: str) -> str:
    bare = key and all(c.isalnum() or c in "_-" for c in key) and key.isascii()
    return key if bare else json.dumps(key)


def to_toml(config: SweepConfig | TrainSweepConfig) -> str:
    """The canonical TOML text of a configuration (``load`` of it gives ``config`` back)."""
    if _is_train(config):
        return _train()._train_toml(config)
    d = config.to_dict()
    lines = []
    for key, value in d.items():
        if not isinstance(value, dict | list) or key == "n":
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for table in ("environment", "behaviour"):
        lines += ["", f"[{table}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d[table].items()]
    for est in d["estimators"]:
        lines += ["", "[[estimators]]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in est.items()]
    return "\n".join(lines) + "\n"
