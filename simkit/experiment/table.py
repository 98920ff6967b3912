"""The columns of :func:`simkit.experiment.run`'s table: the estimator's description, the
reserved names, and the tidy frame in its documented column order.
"""

from __future__ import annotations

import math

import pandas as pd

from simkit import legs
from simkit.estimators import Estimator
from simkit.experiment.metrics import BOUNDED_METRICS

DIVERGENCE_COLUMNS = ("chi2_tok", "kl_tok", "tv_tok", "chi2_seq", "kl_seq", "tv_seq")

#: column names of the table (a setting key or a hyperparameter may not take them)
RESERVED = (
    "estimator",
    "correction",
    "mode",
    "denominator",
    *legs.LEG_COLUMNS,
    "mapping",
    "aggregation",
    "advantage",
    "group_size",
    "adv_eps",
    "max_length",
    "T",
    "params",
    "n",
    "reps",
    *DIVERGENCE_COLUMNS,
    *BOUNDED_METRICS,
    "khat",
    "exact",
    "reliable",
    "tail_draws",
    *(f"{k}_{s}" for k in BOUNDED_METRICS for s in ("lo", "hi")),
)


def describe(est: Estimator) -> dict:
    return {
        "estimator": est.name,
        "mapping": est.mapping.name,
        "aggregation": est.aggregation,
        "advantage": est.advantage,
        "group_size": est.group_size if est.group_size is not None else math.nan,
        "adv_eps": est.adv_eps if est.advantage == "grpo" else math.nan,
        "max_length": est.max_length if est.max_length is not None else math.nan,
        **{("hp_" + k if k in RESERVED else k): v for k, v in est.mapping.hyperparameters.items()},
        **describe_composition(est),
    }


def describe_composition(est: Estimator) -> dict:
    """``correction``, ``mode``, ``denominator`` columns, only for estimators that use them."""
    out = {}
    if est.correction is not None:
        out.update(correction=est.correction.label, mode=est.mode)
    if est.denominator != "valid":
        out["denominator"] = est.denominator
    return out


def tidy(rows: list[dict], ests: list[Estimator], setting_cols: list[str]) -> pd.DataFrame:
    head = [
        "estimator",
        "mapping",
        "aggregation",
        "advantage",
        "group_size",
        "adv_eps",
        "max_length",
    ]
    hp_cols = []
    for est in ests:
        for k in est.mapping.hyperparameters:
            col = "hp_" + k if k in RESERVED else k
            if col not in hp_cols:
                hp_cols.append(col)
    metric_cols = []
    for key in BOUNDED_METRICS:
        metric_cols += [key, f"{key}_lo", f"{key}_hi"]
    present = {k for row in rows for k in row}
    composition_cols = [k for k in ("correction", "mode", "denominator") if k in present]
    cols = [
        *head,
        *composition_cols,
        *hp_cols,
        *setting_cols,
        "T",
        "params",
        "n",
        "reps",
        *DIVERGENCE_COLUMNS,
        *[k for k in legs.LEG_COLUMNS if k in present],
        *metric_cols,
        "khat",
        "exact",
        "reliable",
        "tail_draws",
    ]
    return pd.DataFrame(rows).reindex(columns=cols)
