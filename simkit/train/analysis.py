"""Reading training tables: the best achievable J, per-run summaries, collapse, bands over seeds.

These functions turn the per-step tables of :func:`simkit.train.train` (or of a training sweep,
:class:`simkit.config.TrainSweepConfig`) into the numbers a reader of a learning curve looks
at: where a run started and ended, its best value, its average over the run (the area under
the curve: how fast it learned), and how it **failed**, if it did (:func:`failure_label`):

- ``collapse``: it reached at least half of its achievable gain (normalised peak gain ≥
  :data:`STALL_GAIN`) and then lost more than half of its best gain (:func:`collapsed`);
- ``determinism``: premature determinism — its per-token entropy over the decision states it
  visits fell below :data:`DETERMINISM_ENTROPY` of the initial one while J stayed far below
  J* (normalised final gain < :data:`STALL_GAIN`): the policy locked into a wrong answer. The
  entropy is the table's ``entropy_decision`` column (occupancy-weighted over the states where
  some token leads elsewhere, :func:`simkit.train.records.decision_states`): absorbing states
  (a taken lure, a reached goal) are excluded, since their rows get no systematic gradient and
  keep their initial entropy — averaged in, they hid a policy that takes the lure at once
  (tests/test_train_failures.py builds such a case). Tables recorded before that column
  existed fall back to ``entropy`` (every visited state);
- ``length``: length blow-up — the expected length grew past :data:`LENGTH_BLOWUP` × its
  initial value (EOS environments);
- ``stall``: the run **never reached half of its achievable gain** (normalised peak gain <
  :data:`STALL_GAIN`): a run that never learns cannot collapse, and is never reported as
  "did not collapse";
- ``ok``: none of these.

**Drift** is a flag, not a failure: ``drift`` is True when KL_seq(π‖μ) exceeded
:data:`KL_SEQ_EXPLOSION` nats at a recorded step (typical sequence ratios beyond e^{10}); a run
may drift and learn well.

Each criterion is also a boolean column of :func:`run_summary` (a run may meet several; the
label is the first in the order above). They are used by the training figures and
``simkit train``.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkit.envs.token_mdp import TokenMDP

__all__ = [
    "COLLAPSE_FRACTION",
    "DETERMINISM_ENTROPY",
    "FAILURE_LABELS",
    "KL_SEQ_EXPLOSION",
    "LENGTH_BLOWUP",
    "STALL_GAIN",
    "SUMMARY_COLUMNS",
    "TAIL_FRACTION",
    "band",
    "collapsed",
    "failure_label",
    "normalized_gain",
    "optimal_J",
    "run_summary",
]

#: a run collapsed when it lost more than this fraction of its best gain (see :func:`collapsed`)
COLLAPSE_FRACTION = 0.5
#: the final J of a run is the mean recorded J over this last fraction of its steps
TAIL_FRACTION = 0.1
#: premature determinism: final per-token entropy below this fraction of the initial one …
DETERMINISM_ENTROPY = 0.2
#: … (and stall) while the normalised final gain (J_final − J₀)/(J* − J₀) is below this
STALL_GAIN = 0.5
#: length blow-up: the largest recorded E|y| exceeds this multiple of the initial E|y|
LENGTH_BLOWUP = 2.0
#: divergence explosion: the largest recorded KL_seq(π‖μ) exceeds this many nats
KL_SEQ_EXPLOSION = 10.0
#: the failure labels, in the order :func:`failure_label` checks them
FAILURE_LABELS = ("collapse", "determinism", "length", "stall", "ok")
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
    "kl_seq_max",
    "entropy_start",
    "entropy_final",
    "length_start",
    "length_max",
    "gain",
    "gain_peak",
    "determinism",
    "length_blowup",
    "drift",
    "stalled",
    "failure",
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


def failure_label(collapse: bool, determinism: bool, length_blowup: bool, stalled: bool) -> str:
    """The first failure met, in the order of :data:`FAILURE_LABELS` (``"ok"`` if none); a
    stalled run (it never reached half of its achievable gain) is never labelled
    ``"collapse"``."""
    flags = (collapse and not stalled, determinism, length_blowup, stalled)
    for label, flag in zip(FAILURE_LABELS, flags, strict=False):
        if flag:
            return label
    return "ok"


def normalized_gain(J, J_start, J_star):
    """(J − J_start) / (J* − J_start): the fraction of the achievable improvement obtained
    (1 = optimal, 0 = no progress, < 0 = worse than the start). NaN when J* = J_start."""
    J, J_start, J_star = (np.asarray(x, dtype=np.float64) for x in (J, J_start, J_star))
    room = J_star - J_start
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(room > 0, (J - J_start) / np.where(room > 0, room, 1.0), np.nan)
    return out if out.ndim else float(out)


def _tail_mean(rec: pd.DataFrame, column: str, tail: np.ndarray) -> float:
    values = rec[column].to_numpy(dtype=np.float64)
    return float(values[tail].mean()) if tail.any() else float(values[-1])


def _summarize(run: pd.DataFrame, tail_fraction: float, J_star: float) -> dict:
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
    columns = ("kl_seq", "entropy_decision", "entropy", "length")
    has = {c: c in rec.columns and rec[c].notna().any() for c in columns}
    kl_max = float(rec["kl_seq"].max()) if has["kl_seq"] else math.nan
    # the entropy of the determinism rule: over decision states (module docstring)
    h_col = "entropy_decision" if has["entropy_decision"] else "entropy"
    h0 = float(rec[h_col].iloc[0]) if has[h_col] else math.nan
    h1 = _tail_mean(rec, h_col, tail) if has[h_col] else math.nan
    l0 = float(rec["length"].iloc[0]) if has["length"] else math.nan
    l_max = float(rec["length"].max()) if has["length"] else math.nan
    gain = normalized_gain(J_final, J_start, J_star) if np.isfinite(J_star) else math.nan
    gain_peak = normalized_gain(J_peak, J_start, J_star) if np.isfinite(J_star) else math.nan
    low_gain = bool(np.isfinite(gain) and gain < STALL_GAIN)
    stalled = bool(np.isfinite(gain_peak) and gain_peak < STALL_GAIN)
    collapse = collapsed(J_start, J_peak, J_final)
    determinism = bool(low_gain and h1 < DETERMINISM_ENTROPY * h0)
    blowup = bool(l_max > LENGTH_BLOWUP * l0)
    drift = bool(kl_max > KL_SEQ_EXPLOSION)
    return {
        "steps": total,
        "J_start": J_start,
        "J_final": J_final,
        "J_peak": J_peak,
        "J_mean": float(J.mean()),
        "J_min_after_peak": float(J[peak:].min()),
        "collapsed": collapse,
        "cosine_mean": float(np.nanmean(rec["cosine"]))
        if rec["cosine"].notna().any()
        else math.nan,
        "zero_frac_mean": float(run["zero_frac"].mean()),
        "chi2_seq_max": float(rec["chi2_seq"].max()),
        "kl_seq_max": kl_max,
        "entropy_start": h0,
        "entropy_final": h1,
        "length_start": l0,
        "length_max": l_max,
        "gain": gain,
        "gain_peak": gain_peak,
        "determinism": determinism,
        "length_blowup": blowup,
        "drift": drift,
        "stalled": stalled,
        "failure": failure_label(collapse, determinism, blowup, stalled),
    }


def run_summary(
    table: pd.DataFrame, by, tail_fraction: float = TAIL_FRACTION, J_star=None
) -> pd.DataFrame:
    """One row per run of ``table`` (grouped by the columns ``by``), with
    :data:`SUMMARY_COLUMNS`:

    - ``J_start``: J of the first recorded step (the initial policy);
    - ``J_final``: mean recorded J over the last ``tail_fraction`` of the steps;
    - ``J_peak`` (its best recorded J), ``J_mean`` (mean recorded J: the area under the
      learning curve per step), ``J_min_after_peak``;
    - ``collapsed``: :func:`collapsed` (J_start, J_peak, J_final);
    - ``cosine_mean`` (mean recorded cosine of the estimator to ∇J), ``zero_frac_mean``
      (mean clip/mask fraction), ``chi2_seq_max`` / ``kl_seq_max`` (largest recorded
      χ²_seq / KL_seq(π‖μ));
    - ``entropy_start`` / ``entropy_final`` (per-token entropy of π over its decision states,
      column ``entropy_decision`` — ``entropy`` if the table has none —, first recorded / tail
      mean), ``length_start`` / ``length_max`` (E|y|, first / largest recorded);
    - ``gain`` / ``gain_peak``: :func:`normalized_gain` of J_final / J_peak against ``J_star``
      (NaN without J*);
    - the failure flags ``collapsed`` (lost > half of the best gain, whatever that gain),
      ``determinism``, ``length_blowup``, ``stalled`` (peak gain < :data:`STALL_GAIN`), the
      label ``failure`` (module docstring; ``determinism`` and ``stall`` need J*, and are False
      without it) and the drift flag ``drift`` (not a failure).

    ``J_star``: the optimum J* (:func:`optimal_J`), a number for every run, a dict from the
    first grouping column's value to J* (e.g. per T), or None: the table's ``J_star`` column
    if it has one, else NaN.

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
        if isinstance(J_star, dict):
            star = J_star[key[0]]
        elif J_star is not None:
            star = J_star
        else:
            star = run["J_star"].iloc[0] if "J_star" in run.columns else math.nan
        summary = _summarize(run, tail_fraction, float(star))
        rows.append({**dict(zip(by, key, strict=True)), **summary})
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
