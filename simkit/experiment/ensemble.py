"""Ensembles of random instances: one :func:`~simkit.experiment.run` per instance, and the
fractions of instances on which one estimator beats another.

A ranking read off one random environment and one shift direction may be a property of that
instance. :func:`ensemble` draws ``instances`` environments and behaviours from two factories
(:mod:`simkit.envs.random_instances` has factories for random bandits, token MDPs and the
shift families) and runs the same estimators on each; :func:`summarize` reduces the table to
per-estimator quantiles over instances and, for every ordered pair (A, B), the fraction of
instances where A's metric is better than B's — "A beats B in 17/20 instances".

Seeds: ``SeedSequence(seed).spawn(instances)``; instance i's child spawns three streams, for
``make_env``, for ``make_behaviour`` and for ``run``'s seed (a 32-bit integer drawn from the
third stream, recorded in the ``run_seed`` column). The same seed gives the same table, and
instance i does not depend on how many instances are drawn after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit._validation import check_seed, int_at_least
from simkit.estimators import as_estimators
from simkit.experiment.runner import run

__all__ = ["Summary", "ensemble", "instance_seeds", "summarize"]

#: the run() arguments that ensemble sets itself
_OWN_ARGUMENTS = ("env", "behaviour", "estimators", "seed")


def instance_seeds(seed: int, instances: int) -> list[tuple]:
    """Per instance i: (env stream, behaviour stream, run seed) — two ``SeedSequence`` and an
    int, from ``SeedSequence(seed).spawn(instances)[i].spawn(3)`` (module docstring)."""
    out = []
    for child in np.random.SeedSequence(seed).spawn(instances):
        env_ss, beh_ss, run_ss = child.spawn(3)
        out.append((env_ss, beh_ss, int(run_ss.generate_state(1, np.uint32)[0])))
    return out


def ensemble(
    make_env, make_behaviour, estimators, n: int, instances: int = 20, seed: int = 0, **run_kwargs
) -> pd.DataFrame:
    """The :func:`~simkit.experiment.run` table of ``estimators`` on ``instances`` random
    instances, concatenated.

    Parameters
    ----------
    make_env : callable ``make_env(rng)`` → environment (``rng`` a ``numpy.random.Generator``;
        e.g. :func:`simkit.envs.random_instances.bandit_factory`).
    make_behaviour : callable ``make_behaviour(env, rng)`` → μ of ``env.pi``'s shape (e.g.
        :func:`simkit.envs.random_instances.behaviour_factory`).
    estimators : as for ``run`` (estimators, mappings or names); the same for every instance.
    n : batch size of each gradient estimate.
    instances : number of random instances (≥ 1).
    seed : seed of the ensemble (module docstring); the same seed gives the same table.
    run_kwargs : passed to ``run`` (``reps``, ``exact``, ``params``, ``setting``, …; not
        ``seed``: each instance has its own).

    Returns
    -------
    A tidy DataFrame: every column of ``run``'s table, preceded by ``instance`` (0 …
    instances − 1) and ``run_seed`` (the seed ``run`` got), one row per (instance, estimator).
    """
    if not callable(make_env):
        raise ValueError(f"make_env must be callable (rng -> env), got {type(make_env).__name__}")
    if not callable(make_behaviour):
        raise ValueError(
            "make_behaviour must be callable ((env, rng) -> behaviour), got "
            f"{type(make_behaviour).__name__}"
        )
    instances = int_at_least(instances, "instances", 1)
    seed = check_seed(seed)
    if not isinstance(seed, int):
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    n = int_at_least(n, "n", 1)
    clash = [k for k in run_kwargs if k in _OWN_ARGUMENTS]
    if clash:
        raise ValueError(f"run_kwargs may not set {clash}: ensemble sets them per instance")
    ests = as_estimators(estimators)
    frames = []
    for i, (env_ss, beh_ss, run_seed) in enumerate(instance_seeds(seed, instances)):
        env = make_env(np.random.default_rng(env_ss))
        mu = make_behaviour(env, np.random.default_rng(beh_ss))
        table = run(env, mu, ests, n, seed=run_seed, **run_kwargs)
        table.insert(0, "run_seed", run_seed)
        table.insert(0, "instance", i)
        frames.append(table)
    return pd.concat(frames, ignore_index=True)


@dataclass(frozen=True)
class Summary:
    """What :func:`summarize` returns.

    Attributes
    ----------
    metric : the summarised column; ``lower_is_better`` its direction.
    stats : DataFrame indexed by estimator: ``median``, ``q25``, ``q75``, ``iqr`` (= q75 − q25)
        of the metric over instances, ``instances`` (how many instances have a finite value).
    values : DataFrame, instance × estimator: the metric (NaN where not finite).
    tie_rtol : values within this relative distance are a tie (0: exactly equal only).
    pairs : DataFrame, one row per ordered pair (``a``, ``b``), a ≠ b: ``wins`` (instances where
        a is better than b beyond the tie tolerance), ``ties``, ``losses``, ``instances`` (those
        where both are finite), ``fraction`` = wins / instances (ties count as not winning),
        ``fraction_ties_half`` = (wins + ties/2) / instances.
    """

    metric: str
    lower_is_better: bool
    stats: pd.DataFrame
    values: pd.DataFrame
    pairs: pd.DataFrame
    tie_rtol: float = 0.0

    def pair(self, a: str, b: str) -> pd.Series:
        """The :attr:`pairs` row of (a, b)."""
        hit = self.pairs[(self.pairs.a == a) & (self.pairs.b == b)]
        if not len(hit):
            raise ValueError(f"no pair ({a!r}, {b!r}) in the summary of {self.metric!r}")
        return hit.iloc[0]

    def beats(self, a: str, b: str) -> str:
        """``"a beats b in 17/20 instances (2 ties)"``: a has the better metric (strictly)."""
        row = self.pair(a, b)
        ties = f" ({int(row.ties)} tie{'s' if row.ties != 1 else ''})" if row.ties else ""
        return f"{a} beats {b} in {int(row.wins)}/{int(row.instances)} instances{ties}"

    def best_fraction(self, name: str) -> tuple[int, int]:
        """(k, m): ``name`` is better than every other estimator (beyond the tie tolerance) in
        k of the m instances where all estimators have a finite metric."""
        return self._extreme(name, best=True)

    def worst_fraction(self, name: str) -> tuple[int, int]:
        """(k, m): ``name`` is worse than every other estimator (beyond the tie tolerance) in
        k of the m instances where all estimators have a finite metric."""
        return self._extreme(name, best=False)

    def _extreme(self, name: str, best: bool) -> tuple[int, int]:
        wide = self.values
        if name not in wide.columns:
            raise ValueError(f"unknown estimator {name!r} in the summary of {self.metric!r}")
        full = wide.dropna()
        values = full.to_numpy(dtype=float)
        signed = values if self.lower_is_better else -values
        if not best:
            signed = -signed
        j = list(full.columns).index(name)
        mine, others = signed[:, j][:, None], np.delete(signed, j, axis=1)
        scale = np.maximum(np.abs(values[:, j])[:, None], np.abs(np.delete(values, j, axis=1)))
        wins = np.all(others - mine > self.tie_rtol * scale, axis=1)
        return int(np.sum(wins)), len(full)


def summarize(
    table: pd.DataFrame,
    metric: str,
    by: str = "estimator",
    lower_is_better: bool = True,
    tie_rtol: float = 0.0,
) -> Summary:
    """Per estimator: median and inter-quartile range of ``metric`` over instances, and for
    every ordered pair (A, B) the number and fraction of instances where A's metric is better
    (lower, or higher when ``lower_is_better`` is False) than B's.

    ``table`` is an :func:`ensemble` table (columns ``instance``, ``by`` and ``metric``; one row
    per (instance, estimator)). Quantiles are numpy's (linear interpolation) over the finite
    values. Pairs are compared only on instances where both values are finite; **ties** are
    counted separately (``ties``) and are not wins: ``fraction`` = wins / instances, and
    ``fraction_ties_half`` counts a tie as half a win. Two values x, y tie when
    |x − y| ≤ ``tie_rtol``·max(|x|, |y|) (default 0: only equal values tie; a small tolerance
    stops rounding-level differences between near-identical estimators from counting as wins).
    Returns a :class:`Summary`.
    """
    if not isinstance(table, pd.DataFrame):
        raise ValueError(f"table must be a pandas DataFrame, got {type(table).__name__}")
    for name, column in (("metric", metric), ("by", by)):
        if not isinstance(column, str) or column not in table.columns:
            raise ValueError(f"{name} must be a column of table, got {column!r}")
    if "instance" not in table.columns:
        raise ValueError("table must have an 'instance' column (an ensemble table)")
    if not isinstance(lower_is_better, bool):
        raise ValueError(f"lower_is_better must be True or False, got {lower_is_better!r}")
    ok = isinstance(tie_rtol, int | float) and not isinstance(tie_rtol, bool)
    if not (ok and math.isfinite(tie_rtol) and 0 <= tie_rtol < 1):
        raise ValueError(f"tie_rtol must be a number in [0, 1), got {tie_rtol!r}")
    if table.duplicated(["instance", by]).any():
        raise ValueError(
            f"table has several rows per (instance, {by}); select one setting before summarize"
        )
    values = pd.to_numeric(table[metric], errors="coerce").astype(float)
    wide = (
        table.assign(_value=values)
        .pivot(index="instance", columns=by, values="_value")
        .reindex(columns=list(dict.fromkeys(table[by])))
    )
    wide = wide.where(np.isfinite(wide))
    rows = {}
    for name in wide.columns:
        v = wide[name].dropna().to_numpy()
        q25, median, q75 = np.quantile(v, [0.25, 0.5, 0.75]) if len(v) else (math.nan,) * 3
        rows[name] = {
            "median": float(median),
            "q25": float(q25),
            "q75": float(q75),
            "iqr": float(q75 - q25),
            "instances": len(v),
        }
    stats = pd.DataFrame.from_dict(rows, orient="index")
    stats.index.name = by
    pairs = []
    # the pairs on numpy columns (a pandas dropna per pair cost ~1.5 ms: 4 summaries of 31
    # estimators took 5.7 s, issue 28); a row counts where both values are finite, as dropna
    cols = list(wide.columns)
    W = wide.to_numpy(dtype=float)
    finite = np.isfinite(W)
    for i, a in enumerate(cols):
        for j, b in enumerate(cols):
            if i == j:
                continue
            both = finite[:, i] & finite[:, j]
            x, y = W[both, i], W[both, j]
            tie = np.abs(x - y) <= tie_rtol * np.maximum(np.abs(x), np.abs(y))
            better = ~tie & ((x < y) if lower_is_better else (x > y))
            m = len(x)
            wins, ties = int(better.sum()), int(tie.sum())
            losses = m - wins - ties
            pairs.append(
                {
                    "a": a,
                    "b": b,
                    "wins": wins,
                    "ties": ties,
                    "losses": losses,
                    "instances": m,
                    "fraction": wins / m if m else math.nan,
                    "fraction_ties_half": (wins + ties / 2) / m if m else math.nan,
                }
            )
    return Summary(metric, lower_is_better, stats, wide, pd.DataFrame(pairs), float(tie_rtol))
