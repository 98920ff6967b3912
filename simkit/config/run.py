"""Running one cell: rebuild its environment, behaviour and estimators from the plain
parameters it carries, and compute its table.

:func:`run_cell` computes an experiment cell with :func:`simkit.experiment.run` (seeded by
:func:`simkit.config.cell_seed`, so the table depends on the cell only); a training cell
(``params["kind"] == "train"``) is run by :func:`simkit.train.config.run_train_cell`, reached by
name so that this layer does not import the trainer.
"""

from __future__ import annotations

import importlib

import numpy as np

from simkit import experiment
from simkit.estimator_specs import build_estimators

from .ref import RefConfig
from .schema import BanditConfig, BehaviourConfig, TokenMDPConfig

__all__ = [
    "build_behaviour",
    "build_environment",
    "build_estimators",
    "build_old",
    "run_cell",
]

_ENVIRONMENTS = {"bandit": BanditConfig, "token_mdp": TokenMDPConfig}
#: columns that :func:`simkit.experiment.run` adds itself (not passed as ``setting``)
_RUN_COLUMNS = ("T", "n")
#: cell kind -> "module:function" that computes such a cell
RUNNERS = {"train": "simkit.train.config:run_train_cell"}


def build_environment(spec: dict):
    """The environment of a cell's ``params["environment"]``."""
    spec = dict(spec)
    kind = spec.pop("kind")
    T = spec.pop("T")
    if kind == "token_mdp":
        spec["T"] = (T,)
    return _ENVIRONMENTS[kind](**spec).build(T)


def _behaviour_config(spec: dict) -> tuple[BehaviourConfig, float]:
    spec = dict(spec)
    target = float(spec.pop("target"))
    return BehaviourConfig(targets=(target,), **spec), target


def build_behaviour(env, spec: dict, old: np.ndarray | None = None) -> np.ndarray:
    """μ of a cell's ``params["behaviour"]`` for ``env`` (dialed; ValueError if unreachable;
    from π_old when the behaviour has an ``old`` table — ``old``: π_old if already built)."""
    config, target = _behaviour_config(spec)
    return config.build(env, target, old)


def build_old(env, spec: dict) -> np.ndarray | None:
    """π_old of a cell's ``params["behaviour"]`` for ``env`` (None: π_old = π)."""
    return _behaviour_config(spec)[0].build_old(env)


def _runner(kind: str):
    module, name = RUNNERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def run_cell(cell, progress: bool = False):
    """Compute one cell: :func:`simkit.experiment.run` on its environment, μ and estimators
    (a training cell: :func:`simkit.train.config.run_train_cell`).

    The seed is :func:`simkit.config.cell_seed` (config seed, cell key), so the table depends
    on the cell only. Returns the experiment table with the cell's columns, ``cell`` (the key)
    and ``simkit_version``.
    """
    from simkit import __version__

    p = cell.params
    if p.get("kind") in RUNNERS:
        return _runner(p["kind"])(cell, progress=progress)
    env = build_environment(p["environment"])
    old = build_old(env, p["behaviour"])
    mu = build_behaviour(env, p["behaviour"], old)
    ests = build_estimators(p["estimators"])
    setting = {k: v for k, v in cell.columns.items() if k not in _RUN_COLUMNS}
    extra = {} if old is None else {"old": old}  # no π_old: the call of before, bit for bit
    if p.get("ref") is not None:  # π_ref of the KL penalties (the [ref] table)
        extra["ref"] = RefConfig(**p["ref"]).build(env)
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
        **extra,
    )
    table["cell"] = cell.key
    table["simkit_version"] = __version__
    return table
