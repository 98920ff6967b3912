"""The scale-free error and kept fractions of the exact rows of a table on a finite environment.

:func:`simkit.experiment.run` reports ``mse_zero``, ``alpha_star``, ``mse_scaled``,
``rel_mse_scaled``, ``kept`` and ``kept_seq`` on every row (the formulas:
:func:`simkit.experiment.metrics.scale_free` and :func:`simkit.experiment.metrics.kept_fractions`).
:func:`with_scale_free` makes sure a table of the LM layer's exact paths — the enumerated tree
of :func:`simkit.lm.exact.exact_study`, the replayed twin of :mod:`simkit.lm.twin_dist` — carries
them: the columns the table already has are kept as they are, missing ones are computed on the
exact rows from the exact moments (:func:`simkit.experiment.exact_moments`: E ĝ and tr Var ĝ,
against the environment's exact ∇J) and the enumerated support (μ's probability of every atom
and the mapping's coefficients on it); Monte Carlo rows get NaN.

numpy only.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkit.experiment.metrics import KEPT_COLUMNS, SCALE_FREE_COLUMNS, kept_fractions, scale_free

#: the columns :func:`with_scale_free` guarantees, and their bounds (NaN on exact rows)
COLUMNS = (*SCALE_FREE_COLUMNS, *KEPT_COLUMNS)
BOUNDED = ("mse_scaled", "rel_mse_scaled", "kept", "kept_seq")


def exact_row(env, mu, estimator, n: int) -> dict[str, float]:
    """The six columns of one per-sample ``estimator`` with an exact path on ``env``.

    ``mse_zero``, ``alpha_star``, ``mse_scaled``, ``rel_mse_scaled`` =
    :func:`~simkit.experiment.metrics.scale_free` (E ĝ, tr Var ĝ, ∇J) of n-sample batches;
    ``kept``, ``kept_seq`` = :func:`~simkit.experiment.metrics.kept_fractions` of the mapping's
    coefficients on the atoms of ``env.support`` weighted by their μ-probabilities.
    """
    from simkit.experiment import exact_moments
    from simkit.experiment.exact import oracle_baseline

    moments = exact_moments(env, mu, estimator, n)
    out = scale_free(moments.mean, moments.variance, env.grad_J())
    atoms = env.support(mu, oracle_baseline(env, mu, estimator))
    mask = np.asarray(atoms.mask, dtype=bool)
    from simkit import legs

    c = estimator.coefficients(
        atoms.log_ratio,
        mask,
        atoms.advantage_sign,
        log_prob=legs.log_prob_for(estimator, env, atoms),  # DPPO: log π
    )
    out.update(kept_fractions(np.where(mask, c, 0.0), mask, atoms.prob))
    return out


def with_scale_free(table: pd.DataFrame, env, mu, estimators, n: int) -> pd.DataFrame:
    """``table`` (one row per estimator of ``estimators``, by name, as
    :func:`simkit.experiment.run` returns it) with the :data:`COLUMNS` (and ``*_lo``/``*_hi``
    of :data:`BOUNDED`) present: values the table already has are kept, missing (absent or
    NaN) values of exact rows are filled (:func:`exact_row`), other rows get NaN."""
    from simkit.estimators import as_estimators

    out = table.copy()
    for c in [*COLUMNS, *(f"{k}_{s}" for k in BOUNDED for s in ("lo", "hi"))]:
        if c not in out.columns:
            out[c] = math.nan
    by_name = {e.name: e for e in as_estimators(estimators)}
    for i, row in zip(out.index, out.itertuples()):
        if not bool(row.exact) or not any(math.isnan(getattr(row, c)) for c in COLUMNS):
            continue
        got = exact_row(env, mu, by_name[row.estimator], n)
        for c in COLUMNS:
            if math.isnan(out.at[i, c]):
                out.at[i, c] = got[c]
    return out
