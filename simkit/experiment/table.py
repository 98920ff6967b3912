"""The columns of :func:`simkit.experiment.run`'s table: the estimator's description, the
reserved names, and the tidy frame in its documented column order.

:func:`describe` and the column tuples are shared with the LM gradient study
(:func:`simkit.lm.study.gradient_study`), whose table has the same layout.
"""

from __future__ import annotations

import math

import pandas as pd

from simkit import legs
from simkit.estimators import Estimator
from simkit.experiment.metrics import BOUNDED_METRICS, SCALE_FREE_COLUMNS

DIVERGENCE_COLUMNS = ("chi2_tok", "kl_tok", "tv_tok", "chi2_seq", "kl_seq", "tv_seq")
#: the columns that describe an estimator, first in the table
ESTIMATOR_COLUMNS = (
    "estimator",
    "mapping",
    "aggregation",
    "advantage",
    "group_size",
    "adv_eps",
    "max_length",
)
#: the columns of a composed estimator (present only when one is in the table)
COMPOSITION_COLUMNS = ("correction", "mode", "denominator")
#: every bounded metric followed by its bounds: ``bias``, ``bias_lo``, ``bias_hi``, …, then
#: the unbounded scale-free columns ``mse_zero`` (exact) and ``alpha_star``
METRIC_COLUMNS = (
    *(c for k in BOUNDED_METRICS for c in (k, f"{k}_lo", f"{k}_hi")),
    *(k for k in SCALE_FREE_COLUMNS if k not in BOUNDED_METRICS),
)

#: the columns of a KL penalty to π_ref (present only when ``run(..., ref=...)``), after the
#: divergences: the penalty's description, KL_seq(π‖π_ref), β‖∇KL_seq‖ and the bias of the
#: KL part alone with its Monte Carlo bounds
KL_COLUMNS = (
    "kl_estimator",
    "kl_where",
    "kl_correction",
    "kl_beta",
    "kl_seq_ref",
    "kl_grad_norm",
    "kl_bias",
    "kl_bias_lo",
    "kl_bias_hi",
)

#: the size of the experiment, after the setting columns
SIZE_COLUMNS = ("T", "params", "n", "reps")
#: the last columns: k̂, the path (``exact``; the planner's ``method`` and ``why_mc``), the
#: reliability of a Monte Carlo row
TAIL_COLUMNS = ("khat", "exact", "method", "why_mc", "reliable", "tail_draws")

#: column names of the table (a setting key or a hyperparameter may not take them)
RESERVED = (
    *ESTIMATOR_COLUMNS,
    *COMPOSITION_COLUMNS,
    *legs.LEG_COLUMNS,
    *KL_COLUMNS,
    *SIZE_COLUMNS,
    *DIVERGENCE_COLUMNS,
    *METRIC_COLUMNS,
    *TAIL_COLUMNS,
)


def hyperparameter_column(name: str, reserved=RESERVED) -> str:
    """The column of mapping hyperparameter ``name``: ``hp_<name>`` if ``name`` is reserved."""
    return "hp_" + name if name in reserved else name


def describe(est: Estimator, reserved=RESERVED, composition: bool = True) -> dict:
    """The columns of ``est``: :data:`ESTIMATOR_COLUMNS` (``group_size``, ``adv_eps`` and
    ``max_length`` NaN where they do not apply), one per mapping hyperparameter
    (:func:`hyperparameter_column` against ``reserved``) and, with ``composition``, those of
    :func:`describe_composition`."""
    return {
        "estimator": est.name,
        "mapping": est.mapping.name,
        "aggregation": est.aggregation,
        "advantage": est.advantage,
        "group_size": est.group_size if est.group_size is not None else math.nan,
        "adv_eps": est.adv_eps if est.advantage == "grpo" else math.nan,
        "max_length": est.max_length if est.max_length is not None else math.nan,
        **{hyperparameter_column(k, reserved): v for k, v in est.mapping.hyperparameters.items()},
        **(describe_composition(est) if composition else {}),
    }


def describe_composition(est: Estimator) -> dict:
    """``correction``, ``mode``, ``denominator`` columns, only for estimators that use them."""
    out = {}
    if est.correction is not None:
        out.update(correction=est.correction.label, mode=est.mode)
    if est.denominator != "valid":
        out["denominator"] = est.denominator
    return out


def kl_describe(est: Estimator) -> dict:
    """``kl_estimator``, ``kl_where``, ``kl_correction`` (``"none"`` or ``"is"``), ``kl_beta``
    of ``est``'s KL penalty (None/NaN without one)."""
    kl = est.kl
    if kl is None:
        return {"kl_estimator": None, "kl_where": None, "kl_correction": None, "kl_beta": math.nan}
    return {
        "kl_estimator": kl.estimator,
        "kl_where": kl.where,
        "kl_correction": kl.correction or "none",
        "kl_beta": kl.beta,
    }


def tidy(rows: list[dict], ests: list[Estimator], setting_cols: list[str]) -> pd.DataFrame:
    """The rows of :func:`simkit.experiment.run` as a DataFrame in the documented column order
    (composition and π_old-leg columns only where present)."""
    hp_cols = list(
        dict.fromkeys(hyperparameter_column(k) for est in ests for k in est.mapping.hyperparameters)
    )
    present = {k for row in rows for k in row}
    cols = [
        *ESTIMATOR_COLUMNS,
        *[k for k in COMPOSITION_COLUMNS if k in present],
        *hp_cols,
        *setting_cols,
        *SIZE_COLUMNS,
        *DIVERGENCE_COLUMNS,
        *[k for k in legs.LEG_COLUMNS if k in present],
        *[k for k in KL_COLUMNS if k in present],
        *METRIC_COLUMNS,
        *TAIL_COLUMNS,
    ]
    return pd.DataFrame(rows).reindex(columns=cols)
