"""Rankings a figure may state: the scale-free error and ensemble fractions, as sentences.

A ranking by MSE = bias² + variance rewards estimators that shrink or drop samples: ĝ ≡ 0 has
MSE ‖∇J‖². simkit ranks by ``rel_mse_scaled`` (the error after the best step size, relative
to ĝ ≡ 0; :func:`simkit.experiment.metrics.scale_free`) and states a ranking only from an
ensemble of random instances (:mod:`simkit.experiment.ensemble`), with the fraction of
instances that support it. The figure modules build their sentences with these helpers, and
``tests/test_figure_claims.py`` feeds them perturbed data.

- :func:`with_scale_free`: the scale-free columns of a ``run`` table, taken from the table
  where it has them and otherwise computed from its ``variance``, ``snr``, ``cosine`` and
  ‖∇J‖²;
- :func:`leaders`: per setting of an ensemble table, the estimator of lowest median metric,
  the runner-up, and the fractions of instances where the leader is best of all and where it
  beats the runner-up;
- :func:`leader_sentence`, :func:`leader_changes`: those as sentences;
- :func:`zero_beats`: the fraction of instances where ĝ ≡ 0 has a lower MSE than an estimator.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkit.experiment.ensemble import summarize
from simkit.experiment.metrics import SCALE_FREE_COLUMNS, scale_free

#: an ensemble smaller than this states no ranking (DESIGN.md: "ensembles of ≥ 20")
MIN_INSTANCES = 20
#: two scale-free errors within this relative distance tie (near-identical mappings at small χ²)
TIE_RTOL = 1e-3


def _scale_free_of_row(variance: float, snr: float, cosine: float, mse_zero: float) -> dict:
    """metrics.scale_free from the row's scalars: E ĝ is rebuilt in the plane of (E ĝ, ∇J) from
    ‖E ĝ‖² = snr·variance and the angle cos(E ĝ, ∇J) (no cancellation: the bias, a difference
    of two nearly equal norms when E ĝ is small, is not used)."""
    if variance > 0 and math.isfinite(snr):
        mean_sq = snr * variance
    elif variance == 0 and math.isnan(snr):  # ĝ ≡ 0: E ĝ = 0 and no noise
        mean_sq = 0.0
    else:
        mean_sq = math.nan
    if mean_sq == 0:
        cosine = 0.0  # the angle of a zero vector is undefined; it contributes nothing
    if not (math.isfinite(mean_sq) and math.isfinite(cosine) and mse_zero > 0):
        return dict.fromkeys(SCALE_FREE_COLUMNS, math.nan)
    norm = math.sqrt(mean_sq)
    angle = math.acos(min(max(cosine, -1.0), 1.0))
    mean = norm * np.array([math.cos(angle), math.sin(angle)])
    return scale_free(mean, variance, np.array([math.sqrt(mse_zero), 0.0]))


def with_scale_free(table: pd.DataFrame, mse_zero: float) -> pd.DataFrame:
    """``table`` with ``mse_zero``, ``alpha_star``, ``mse_scaled``, ``rel_mse_scaled`` filled.

    Where ``run`` already reports them (finite values) they are kept; otherwise they are
    computed from ``variance``, ``snr`` and ``cosine`` of the row and ``mse_zero`` = ‖∇J‖²
    (E‖ĝ‖² = ‖E ĝ‖² + variance, ‖E ĝ‖² = snr·variance, ⟨E ĝ, ∇J⟩ = cosine·‖E ĝ‖·‖∇J‖).
    ``mse_zero`` may be a number or an array of the table's length (one ‖∇J‖² per row, e.g.
    per instance).
    """
    out = table.copy()
    zero = np.broadcast_to(np.asarray(mse_zero, dtype=float), (len(out),))
    have = all(c in out for c in SCALE_FREE_COLUMNS)
    missing = (
        np.ones(len(out), bool)
        if not have
        else ~np.isfinite(out[list(SCALE_FREE_COLUMNS)].to_numpy(float)).all(axis=1)
    )
    for c in SCALE_FREE_COLUMNS:
        if c not in out:
            out[c] = math.nan
    for k in np.flatnonzero(missing):
        row = out.iloc[k]
        values = _scale_free_of_row(
            float(row.variance), float(row.snr), float(row.cosine), float(zero[k])
        )
        for c, v in values.items():
            out.iloc[k, out.columns.get_loc(c)] = v
    return out


def leaders(
    table: pd.DataFrame,
    metric: str = "rel_mse_scaled",
    settings=("target_chi2", "n"),
    by: str = "estimator",
    tie_rtol: float = TIE_RTOL,
) -> pd.DataFrame:
    """Per setting (the distinct values of the ``settings`` columns) of an ensemble table:
    ``leader`` (lowest median ``metric`` over instances), ``median``, ``runner_up`` (second
    lowest median) and its ``runner_median``, ``best`` / ``beats`` (instances where the leader
    is better than every other estimator / than the runner-up, beyond ``tie_rtol``), ``ties``
    with the runner-up and ``instances``. One row per setting, in the table's order."""
    rows = []
    for key, part in table.groupby(list(settings), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        s = summarize(part, metric, by=by, tie_rtol=tie_rtol)
        order = s.stats["median"].sort_values(kind="stable")
        leader, runner = order.index[0], order.index[1] if len(order) > 1 else None
        best, m = s.best_fraction(leader)
        pair = s.pair(leader, runner) if runner is not None else None
        top = float(order.iloc[0])
        tied = [
            str(e) for e, v in order.items() if abs(v - top) <= tie_rtol * max(abs(v), abs(top))
        ]
        rows.append(
            {
                **dict(zip(settings, key, strict=True)),
                "leader": leader if len(tied) == 1 else f"a {len(tied)}-way tie",
                "tied": tuple(tied),
                "median": float(order.iloc[0]),
                "runner_up": runner,
                "runner_median": float(order.iloc[1]) if runner is not None else math.nan,
                "best": best,
                "beats": int(pair.wins) if pair is not None else m,
                "ties": int(pair.ties) if pair is not None else 0,
                "instances": int(s.stats.instances.max()),
            }
        )
    return pd.DataFrame(rows)


def leader_sentence(row, setting_text: str, max_names: int = 4) -> str:
    """``"χ² = 0.01: tis_seq (median 0.41; best of all in 12/20 instances, beats the
    runner-up naive (0.43) in 15/20)"``, or for a tie ``"χ² = 1e-4: 12 mappings tie at median
    0.602 (naive, is_token, is_seq, power, …)"``."""
    tied = list(row.tied)
    if len(tied) > 1:
        names = ", ".join(tied[:max_names]) + (", …" if len(tied) > max_names else "")
        return (
            f"{setting_text}: {len(tied)} mappings tie at median {row['median']:.3g} ({names}; "
            f"the first beats the second in {row.beats}/{row.instances} instances)"
        )
    ties = f", {row.ties} tie{'s' if row.ties != 1 else ''}" if row.ties else ""
    return (
        f"{setting_text}: {row.leader} (median {row['median']:.3g}; best of all in "
        f"{row.best}/{row.instances} instances, beats the runner-up {row.runner_up} "
        f"({row.runner_median:.3g}) in {row.beats}/{row.instances}{ties})"
    )


def leader_changes(frame: pd.DataFrame, along: str, fmt=lambda v: f"{v:.3g}") -> str:
    """Where the leader of :func:`leaders` changes along ``along`` (rows of one other setting):
    ``"naive up to χ² = 0.01, then tis_seq from 0.1"`` or ``"tis_seq at every χ²"``."""
    part = frame.sort_values(along)
    runs = []
    for value, leader in zip(part[along], part.leader, strict=True):
        if runs and runs[-1][0] == leader:
            runs[-1][2] = value
        else:
            runs.append([leader, value, value])
    if len(runs) == 1:
        return f"{runs[0][0]} at every value"
    pieces = []
    for leader, lo, hi in runs:
        pieces.append(
            f"{leader} at {fmt(lo)}" if lo == hi else f"{leader} from {fmt(lo)} to {fmt(hi)}"
        )
    return ", then ".join(pieces)


def zero_beats(table: pd.DataFrame, settings=("target_chi2", "n"), by="estimator") -> pd.DataFrame:
    """Per setting and estimator: ``zero_wins`` (instances where ĝ ≡ 0, MSE = ``mse_zero``, has
    a strictly lower MSE than the estimator) and ``instances``."""
    flag = table.mse > table.mse_zero
    grouped = table.assign(_zero=flag).groupby([*settings, by], sort=False)
    return grouped._zero.agg(zero_wins="sum", instances="size").reset_index()
