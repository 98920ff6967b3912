"""Cells: one setting of a sweep each, with a content-hash key and a random stream of its own.

:func:`expand` turns a configuration into :class:`Cell` s — for an experiment sweep one per
(T, target, n), each with *every* expanded estimator so that :func:`simkit.experiment.run`
evaluates them on common random numbers; a training sweep gives one per run
(:meth:`simkit.train.config.TrainSweepConfig.cells`). A cell's ``key`` is a content hash of its
parameters and the configuration seed (:func:`cell_key`), and its random stream is derived from
(seed, key) through :class:`numpy.random.SeedSequence` (:func:`cell_seed`): the numbers of a
cell never depend on the order in which cells run, on the worker or on the machine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from simkit.estimator_specs import estimator_params, plain

__all__ = ["KEY_LENGTH", "Cell", "canonical_json", "cell_key", "cell_seed", "expand"]

#: hex characters of a cell key (64 bits of sha256)
KEY_LENGTH = 16


def canonical_json(obj) -> str:
    """The canonical JSON text of a plain object: sorted keys, no spaces, floats as repr."""
    return json.dumps(plain(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


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
    ``estimators``) from which :func:`simkit.config.run_cell` rebuilds everything; ``columns``:
    the setting's columns of the results table (``env``, ``family``, ``divergence``,
    ``div_level``, ``target``, ``T``, ``n``); ``seed``: the configuration seed; ``index``:
    position in the expansion order.
    """

    key: str
    params: dict
    columns: dict
    seed: int
    index: int = 0

    @classmethod
    def make(cls, params: dict, columns: dict, seed: int, index: int) -> Cell:
        """The cell of ``params`` (made plain exactly as hashed) and its key."""
        params = json.loads(canonical_json(params))
        return cls(cell_key(params, int(seed)), params, columns, int(seed), index)

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


def experiment_cells(config) -> list[Cell]:
    """The cells of an experiment sweep, in a deterministic order: T, then target, then n.

    Every cell holds all the expanded estimators (configuration order; inside an entry: grid
    settings × aggregations × advantages).
    """
    ests = [estimator_params(e) for ec in config.estimators for e in ec.build()]
    env_cfg = config.environment
    env_label = "bandit" if env_cfg.kind == "bandit" else env_cfg.constructor
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
                if config.ref is not None:  # absent otherwise: the cell keys of before
                    params["ref"] = config.ref.to_dict()
                columns = {
                    "env": env_label,
                    "family": config.behaviour.family,
                    "divergence": config.behaviour.divergence,
                    "div_level": config.behaviour.level,
                    "target": float(target),
                    "T": int(T),
                    "n": int(n),
                }
                cells.append(Cell.make(params, columns, config.seed, len(cells)))
    return cells


def expand(config) -> list[Cell]:
    """The cells of a configuration (:class:`~simkit.config.SweepConfig`: T, then target, then
    n; :class:`~simkit.train.config.TrainSweepConfig`: one per run), in a deterministic order."""
    if not callable(getattr(config, "cells", None)):
        raise TypeError(
            f"config must be a SweepConfig or a TrainSweepConfig, got {type(config).__name__}"
        )
    return config.cells()
