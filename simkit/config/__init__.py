"""Sweep configurations: TOML files ⇄ frozen pydantic models, validation, grid expansion, one cell.

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
    [behaviour.old] steps, chi2 | step_size, level ("seq" | "tok"): π_old behind π; the
                    targets are then D(π_old‖μ) (:class:`OldConfig`)
    [[estimators]]  mapping, preset, params = {...}, grid = {name = [values]}, grid_mode
                    ("product" | "zip"), aggregations, advantages, group_size, adv_eps,
                    max_length, correction, correction_preset, correction_params = {...},
                    mode ("decoupled" | "bypass" | "trl_vespo"), denominator ("valid" |
                    "kept"), seed

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
out-of-range sizes, unknown mappings / families / aggregations / advantages (the valid names
are listed), invalid hyperparameters (each mapping is built with :func:`simkit.mappings.get`,
its own message is prefixed by the key path), batch sizes that do not split into groups,
``exact = true`` with an estimator that has no exact path, and every divergence target, which
is dialed once per environment (an unreachable one reports the largest reachable value).
``simkit schema [experiment|train]`` prints the JSON Schema of a kind (:func:`json_schema`),
which editors use to complete and check TOML files.

One idea per module:

- :mod:`simkit.config.schema` — the pydantic models of an experiment sweep's tables;
- :mod:`simkit.config.errors` — :class:`ConfigError` and pydantic's errors as key-path messages;
- :mod:`simkit.config.cells` — :class:`Cell`, content-hash keys, per-cell seeds, :func:`expand`;
- :mod:`simkit.config.run` — rebuilding a cell's objects and :func:`run_cell`;
- :mod:`simkit.config.tomlio` — kinds, :func:`load_config`, :func:`validate`, :func:`to_toml`,
  :func:`json_schema`.

The training-sweep schema (``kind = "train"``) is :mod:`simkit.train.config`; its names
(:class:`~simkit.train.config.TrainSweepConfig`, ``run_train_cell``, ``mismatch_to_dict``,
``MISMATCH_KEYS``) are also reachable from here, imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from simkit.estimator_specs import build_estimators, estimator_params

from .cells import KEY_LENGTH, Cell, canonical_json, cell_key, cell_seed, expand
from .errors import ConfigError, KeyPathError
from .run import build_behaviour, build_environment, build_old, run_cell
from .schema import (
    EXACT_CHOICES,
    GRID_MODES,
    TOKEN_MDP_CONSTRUCTORS,
    BanditConfig,
    BehaviourConfig,
    EnvironmentConfig,
    EstimatorConfig,
    OldConfig,
    SweepConfig,
    TokenMDPConfig,
)
from .tomlio import (
    CONFIG_KINDS,
    SCHEMAS,
    config_from_dict,
    json_schema,
    load_config,
    to_toml,
    validate,
)
from .tomlio import _toml_key as _toml_key
from .tomlio import _toml_value as _toml_value

if TYPE_CHECKING:
    from simkit.train.config import TrainSweepConfig

__all__ = [
    "CONFIG_KINDS",
    "EXACT_CHOICES",
    "GRID_MODES",
    "KEY_LENGTH",
    "SCHEMAS",
    "TOKEN_MDP_CONSTRUCTORS",
    "BanditConfig",
    "BehaviourConfig",
    "Cell",
    "ConfigError",
    "EnvironmentConfig",
    "EstimatorConfig",
    "KeyPathError",
    "OldConfig",
    "SweepConfig",
    "TokenMDPConfig",
    "TrainSweepConfig",
    "build_behaviour",
    "build_environment",
    "build_estimators",
    "build_old",
    "canonical_json",
    "cell_key",
    "cell_seed",
    "config_from_dict",
    "estimator_params",
    "expand",
    "json_schema",
    "load_config",
    "run_cell",
    "to_toml",
    "validate",
]

#: names that live with the trainer (:mod:`simkit.train.config`, which builds on this package)
_TRAIN_NAMES = ("TrainSweepConfig", "MISMATCH_KEYS", "mismatch_to_dict", "run_train_cell")


def __getattr__(name: str):
    if name in _TRAIN_NAMES:
        return getattr(importlib.import_module("simkit.train.config"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
