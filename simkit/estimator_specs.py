"""Estimators as plain, JSON-able specs and back: the form in which sweeps and training runs
record an estimator (a cell's parameters, a run's config).

:func:`estimator_params` describes an :class:`~simkit.estimators.Estimator` completely (name,
mapping, hyperparameters, aggregation, advantage, group size, ``adv_eps``, ``max_length``);
:func:`build_estimators` rebuilds estimators from such specs (names as recorded). Both
:mod:`simkit.config` and :mod:`simkit.train` use them, so neither imports the other for it.
"""

from __future__ import annotations

import numpy as np

from simkit import estimators as _estimators
from simkit import mappings
from simkit.kl import KLPenalty

__all__ = ["build_estimators", "estimator_params", "plain"]


def plain(value):
    """A JSON/TOML-able version of a scalar or nested value (numpy scalars, tuples)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def estimator_params(est: _estimators.Estimator) -> dict:
    """Plain dict describing an estimator completely (cell parameters). The composition fields
    (``correction`` with its hyperparameters, ``mode``, ``denominator``, ``seed``) appear only
    when they differ from their defaults, so that the specs of other estimators are unchanged
    (``mode`` always with a correction). ``build_estimators([estimator_params(e)])[0] == e`` for
    every estimator, composed ones included (tests/test_config_composed.py)."""
    out = {
        "name": est.name,
        "mapping": est.mapping.name,
        "hyperparameters": est.mapping.hyperparameters,
        "aggregation": est.aggregation,
        "advantage": est.advantage,
        "group_size": est.group_size,
        "adv_eps": est.adv_eps,
        "max_length": est.max_length,
    }
    if est.correction is not None:
        out["correction"] = est.correction.name
        out["correction_hyperparameters"] = est.correction.hyperparameters
    if est.correction is not None or est.mode != "decoupled":
        out["mode"] = est.mode
    if est.denominator != "valid":
        out["denominator"] = est.denominator
    if est.allow_same_ratio:
        out["allow_same_ratio"] = True
    if est.seed != 0:
        out["seed"] = est.seed
    if est.scale_rewards != "group":
        out["scale_rewards"] = est.scale_rewards
    if est.otb_is_cap is not None:
        out["otb_is_cap"] = est.otb_is_cap
    if est.kl is not None:
        kl = est.kl
        out["kl"] = {
            "beta": kl.beta,
            "estimator": kl.estimator,
            "where": kl.where,
            "correction": kl.correction,
        }
    return plain(out)


def _correction(spec: dict):
    if spec.get("correction") is None:
        return None
    return mappings.get(spec["correction"], **spec.get("correction_hyperparameters", {}))


def build_estimators(specs: list[dict]) -> list[_estimators.Estimator]:
    """The estimators of a cell's ``params["estimators"]`` (names as recorded)."""
    return [
        _estimators.Estimator(
            mappings.get(s["mapping"], **s["hyperparameters"]),
            aggregation=s["aggregation"],
            advantage=s["advantage"],
            group_size=s["group_size"],
            adv_eps=s["adv_eps"],
            max_length=s["max_length"],
            name=s["name"],
            correction=_correction(s),
            mode=s.get("mode", "decoupled"),
            denominator=s.get("denominator", "valid"),
            allow_same_ratio=s.get("allow_same_ratio", False),
            seed=s.get("seed", 0),
            scale_rewards=s.get("scale_rewards", "group"),
            otb_is_cap=s.get("otb_is_cap"),
            kl=None if s.get("kl") is None else KLPenalty(**s["kl"]),
        )
        for s in specs
    ]
