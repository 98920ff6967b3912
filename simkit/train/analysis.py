"""Reading training tables: the best achievable J, per-run summaries, collapse, bands over seeds.

These functions turn the per-step tables of :func:`simkit.train.train` (or of a training sweep,
:class:`simkit.config.TrainSweepConfig`) into the numbers a reader of a learning curve looks
at: where a run started and ended, its best value, its average over the run (the area under
the curve: how fast it learned), and whether it **collapsed** — lost most of what it had
gained. They are used by the training figures and ``simkit train``.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkit.envs.token_mdp import TokenMDP

__all__ = [
    "COLLAPSE_FRACTION",
    "SUMMARY_COLUMNS",
    "TAIL_FRACTION",
    "band",
    "collapsed",
    "normalized_gain",
    "optimal_J",
    "run_summary",
]

#: a run collapsed when it lost more than this fraction of its best gain (see :func:`collapsed`)
COLLAPSE_FRACTION = 0.5
#: the final J of a run is the mean recorded J over this last fraction of its steps
TAIL_FRACTION = 0.1
#: columns of :func:`run_summary` (after the grouping columns)
SUMMARY_COLUMNS = (
    "steps",
    "J_start",
    "J_final",
    "J_peak",
    "J_mean",
    "J_min_after_peak",
    "collapsed",
    "cosine_mean",
    "zero_frac_mean",
    "chi2_seq_max",
)


def optimal_J(env: TokenMDP) -> float:
    """max over policies of J, by dynamic programming over (position, automaton state).

    V_T(s) = R(s); V_t(s) = max_v [V_end(s') if v = EOS else V_{t+1}(s')] with s' =
    transition[s, v] (a sequence ends at its EOS or after T tokens), J* = V_0(s_0). Exact when
    every automaton state is its own policy class (``markov``, ``answer_correct``,
    ``at_least_k``, ``parity``); an upper bound when states share a class (``iid``), since the
    maximum then ignores that constraint. Shapes: O(T·S·V).
    """
    if not isinstance(env, TokenMDP):
        raise TypeError(f"env must be a TokenMDP, got {type(env).__name__}")
    reward = np.asarray(env.reward, dtype=np.float64)
    trans = np.asarray(env.transition)
    value = reward.copy()  # V_T
    for _ in range(env.T):
        cont = value[trans]  # (S, V): continue after token v
        if env.eos is not None:
            cont[:, env.eos] = reward[trans[:, env.eos]]
        value = cont.max(axis=1)
    return float(value[env.initial_state])


def collapsed(J_start: float, J_peak: float, J_final: float, fraction: float = COLLAPSE_FRACTION):
    """True when a run lost more than ``fraction`` of its best gain:
    J_peak − J_final > fraction · (J_peak − J_start), with a real gain (J_peak > J_start).

    A run that never improved is not "collapsed" (it stalled); a run that ends below where it
    started after improving always is (for fraction ≤ 1).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    gain = J_peak - J_start
    return bool(gain > 0 and (J_peak - J_final) > fraction * gain)


def normalized_gain(J, J_start, J_star):
    """(J − J_start) / (J* − J_start): the fraction of the achievable improvement obtained
    (1 = optimal, 0 = no progress, < 0 = worse than the start). NaN when J* = J_start."""
    J, J_start, J_star = (np.asarray(x, dtype=np.float64) for x in (J, J_start, J_star))
    room = J_star - J_start
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(room > 0, (J - J_start) / np.where(room > 0, room, 1.0), np.nan)
    return out if out.ndim else float(out)


def _summarize(run: pd.DataFrame, tail_fraction: float) -> dict:
    run = run.sort_values("step")
    rec = run[run["recorded"].astype(bool)]
    J = rec["J"].to_numpy(dtype=np.float64)
    steps = rec["step"].to_numpy()
    total = int(run["step"].max()) + 1
    if J.size == 0:
        raise ValueError("a run has no recorded step (no exact J to summarize)")
    tail = steps >= total - max(1, math.ceil(tail_fraction * total))
    J_final = float(J[tail].mean()) if tail.any() else float(J[-1])
    peak = int(np.argmax(J))
    J_start, J_peak = float(J[0]), float(J[peak])
    return {
        "steps": total,
        "J_start": J_start,
        "J_final": J_final,
        "J_peak": J_peak,
        "J_mean": float(J.mean()),
        "J_min_after_peak": float(J[peak:].min()),
        "collapsed": collapsed(J_start, J_peak, J_final),
        "cosine_mean": float(np.nanmean(rec["cosine"]))
        if rec["cosine"].notna().any()
        else math.nan,
        "zero_frac_mean": float(run["zero_frac"].mean()),
        "chi2_seq_max": float(rec["chi2_seq"].max()),
    }


def run_summary(table: pd.DataFrame, by, tail_fraction: float = TAIL_FRACTION) -> pd.DataFrame:
    """One row per run of ``table`` (grouped by the columns ``by``), with
    :data:`SUMMARY_COLUMNS`:

    - ``J_start``: J of the first recorded step (the initial policy);
    - ``J_final``: mean recorded J over the last ``tail_fraction`` of the steps;
    - ``J_peak`` (its best recorded J), ``J_mean`` (mean recorded J: the area under the
      learning curve per step), ``J_min_after_peak``;
    - ``collapsed``: :func:`collapsed` (J_start, J_peak, J_final);
    - ``cosine_mean`` (mean recorded cosine of the estimator to ∇J), ``zero_frac_mean``
      (mean clip/mask fraction), ``chi2_seq_max`` (largest recorded χ²_seq(π‖μ)).

    Rows in the order of first appearance of each group.
    """
    by = [by] if isinstance(by, str) else list(by)
    missing = [c for c in (*by, "step", "recorded", "J") if c not in table.columns]
    if missing:
        raise KeyError(f"table has no column(s) {missing}; columns: {list(table.columns)}")
    if not 0 < tail_fraction <= 1:
        raise ValueError(f"tail_fraction must be in (0, 1], got {tail_fraction}")
    rows = []
    for key, run in table.groupby(by, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key, strict=True)), **_summarize(run, tail_fraction)})
    return pd.DataFrame(rows, columns=[*by, *SUMMARY_COLUMNS])


def band(table: pd.DataFrame, by, x: str = "step", y: str = "J") -> pd.DataFrame:
    """Mean, min, max and standard error of ``y`` over the runs of each ``by`` group at each
    ``x`` (recorded rows only): the curve and its band over seeds.

    Returns columns ``*by, x, mean, lo, hi, se, runs`` (``lo``/``hi`` the min/max over the
    runs, ``se`` the standard error of the mean, ddof = 1; NaN with one run).
    """
    by = [by] if isinstance(by, str) else list(by)
    rec = table[table["recorded"].astype(bool)] if "recorded" in table else table
    grouped = rec.groupby([*by, x], sort=False)[y]
    out = grouped.agg(["mean", "min", "max", "std", "count"]).reset_index()
    out = out.rename(columns={"min": "lo", "max": "hi", "count": "runs"})
    out["se"] = out["std"] / np.sqrt(out["runs"])
    return out.drop(columns="std")[[*by, x, "mean", "lo", "hi", "se", "runs"]]
