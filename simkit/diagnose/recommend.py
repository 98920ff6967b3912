"""The answer: for each correction family that acts on π_old‖μ, the threshold that minimises the
scale-free error on the user's data, with its interval and kept fractions, and the user's
current setting beside it.

Families and grids (:data:`FAMILIES`): token TIS cap ``c_high``, sequence TIS cap ``c``,
sequence MIS cap ``c_high``, IcePop band [1/c, c], geo-mask band [1/c, c] on the geometric-mean
ratio, k-rejection threshold ``u`` (seq-mean k3). Every grid point is an estimator (the user's
batch size, aggregation, advantage) evaluated on the distribution-matched twin of the dump
(:func:`simkit.lm.twin_dist.predict`): its ``rel_mse_scaled`` = min_α E‖αĝ − ∇J‖² / ‖∇J‖²
(:func:`simkit.experiment.metrics.scale_free`; relative to the signal ‖∇J‖², not to naive;
ĝ ≡ 0 scores 1) and its kept fractions. The recommended threshold is the grid argmin of the
point prediction; ``n_boot`` bootstrap refits of the twin (resampled responses) give

- ``value_lo``/``value_hi``: the 5–95% range of the refits' argmins (the threshold's interval);
- ``rel_mse_scaled_lo``/``_hi``: the 90% spread of the refits' error at the recommended
  threshold, placed around the point prediction (as :func:`simkit.lm.twin_dist.
  predict_with_intervals` does).

``current`` (``--current tis_token:c_high=2``): a mapping spec ``name:k=v,...`` evaluated on the
same twin; the report prints its error, kept fractions and the excess over its family's best.

numpy / pandas.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd

from simkit.diagnose.readers import RolloutError

#: family → (mapping, parameter shown, grid, grid value → mapping hyperparameters)
FAMILIES = {
    "tis_token": ("tis_token", "c_high", (1.2, 1.5, 2.0, 3.0, 5.0, 10.0), lambda c: {"c_high": c}),
    "tis_seq": ("tis_seq", "c", (1.2, 1.5, 2.0, 3.0, 5.0, 10.0), lambda c: {"c": c}),
    "mis_seq": (
        "mis_seq",
        "c_high",
        (1.2, 1.5, 2.0, 3.0, 5.0, 10.0),
        lambda c: {"c_low": 0.0, "c_high": c},
    ),
    "icepop": (
        "icepop",
        "c (band [1/c, c])",
        (1.2, 1.5, 2.0, 3.0, 5.0, 10.0),
        lambda c: {"c_low": 1.0 / c, "c_high": c},
    ),
    "geo_mask": (
        "geo_mask",
        "c (band [1/c, c])",
        (1.01, 1.05, 1.1, 1.2, 1.5, 2.0),
        lambda c: {"c_low": 1.0 / c, "c_high": c},
    ),
    "kl_rs": ("kl_rs", "u (seq-mean k3)", (0.001, 0.003, 0.01, 0.03, 0.1, 0.3), lambda u: {"u": u}),
}


#: a family whose predicted errors over the grid span less than this is reported as flat (the
#: threshold does not matter on this data; the resolution of the validation, 0.5% of ‖∇J‖²)
FLAT = 0.005


def parse_setting(spec: str):
    """``"tis_token:c_high=2"`` → the mapping (:func:`simkit.mappings.get`); errors name the
    spec as written."""
    from simkit import mappings

    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in mappings.available():
        raise RolloutError(
            f"--current {spec!r}: unknown mapping {name!r}; available: "
            f"{', '.join(mappings.available())}"
        )
    params = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise RolloutError(f"--current {spec!r}: expected key=value, got {part!r}")
        try:
            params[key.strip()] = float(value)
        except ValueError:
            params[key.strip()] = value.strip()
    try:
        return mappings.get(name, **params)
    except (TypeError, ValueError) as err:
        raise RolloutError(f"--current {spec!r}: {err}") from None


def _estimators(aggregation, advantage, group, current):
    from simkit import mappings
    from simkit.estimators import GROUP_ADVANTAGES, Estimator

    kw = {"aggregation": aggregation, "advantage": advantage}
    if advantage in GROUP_ADVANTAGES:
        kw["group_size"] = group
    ests, index = [Estimator("naive", name="naive", **kw)], []
    for fam, (mname, _, grid, params) in FAMILIES.items():
        for v in grid:
            name = f"{fam}@{v:g}"
            ests.append(Estimator(mappings.get(mname, **params(v)), name=name, **kw))
            index.append((fam, v, name))
    if current is not None:
        ests.append(Estimator(current, name="current", **kw))
    return ests, index


def recommend(
    log_num,
    log_den,
    mask,
    rewards,
    *,
    n: int,
    aggregation: str = "seq-mean-token-sum",
    advantage: str = "oracle_pi",
    group: int | None = None,
    current: str | None = None,
    n_boot: int = 10,
    seed: int = 0,
    level: float = 0.9,
) -> tuple[pd.DataFrame, pd.DataFrame, dict | None]:
    """(answer, curves, current) for the leg ``log_num`` − ``log_den`` (module docstring).

    ``answer``: one row per family — ``family``, ``parameter``, ``value`` (recommended),
    ``value_lo``, ``value_hi``, ``rel_mse_scaled`` (+ ``_lo``/``_hi``), ``kept``,
    ``kept_seq``, ``naive`` (naive's rel_mse_scaled), ``flat`` (the family's predicted errors
    span less than :data:`FLAT`: the threshold does not matter here). ``curves``: every grid point's
    ``rel_mse_scaled``, ``kept``, ``kept_seq``. ``current``: the user's setting's numbers and
    its excess over the best of its family (None without ``current``)."""
    from simkit.lm import twin_dist

    cur = None if current is None else parse_setting(current)
    ests, index = _estimators(aggregation, advantage, group, cur)
    logs = twin_dist.Rollouts(log_num, log_den, mask, rewards)
    kw = {"reps": 100, "seed": seed}
    point = twin_dist.predict(logs, ests, n, **kw).set_index("estimator")
    rng = np.random.default_rng(seed)
    names = [e.name for e in ests]
    boots = []
    for _ in range(n_boot):
        rows = rng.integers(0, logs.N, size=logs.N)
        b = twin_dist.predict(logs.take(rows), ests, n, **kw).set_index("estimator")
        boots.append(b.loc[names, "rel_mse_scaled"].to_numpy(dtype=float))
    boots = np.array(boots) if boots else np.full((1, len(names)), np.nan)
    col = {name: i for i, name in enumerate(names)}
    tail = (1.0 - level) / 2.0
    curves = pd.DataFrame(
        [
            {
                "family": fam,
                "value": v,
                **{k: float(point.loc[name, k]) for k in ("rel_mse_scaled", "kept", "kept_seq")},
            }
            for fam, v, name in index
        ]
    )

    def spread(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lo, med, hi = np.nanquantile(boots[:, col[name]], [tail, 0.5, 1.0 - tail])
        v = float(point.loc[name, "rel_mse_scaled"])
        return max(v - (med - lo), 0.0), min(v + (hi - med), 1.0)

    naive = float(point.loc["naive", "rel_mse_scaled"])
    rows = []
    for fam, (_, pname, grid, _) in FAMILIES.items():
        names_f = [f"{fam}@{v:g}" for v in grid]
        vals = point.loc[names_f, "rel_mse_scaled"].to_numpy(dtype=float)
        k = int(np.nanargmin(vals))
        arg = np.array(grid)[np.nanargmin(boots[:, [col[x] for x in names_f]], axis=1)]
        lo, hi = spread(names_f[k])
        rows.append(
            {
                "family": fam,
                "parameter": pname,
                "value": float(grid[k]),
                "value_lo": float(np.quantile(arg, tail, method="lower")),
                "value_hi": float(np.quantile(arg, 1.0 - tail, method="higher")),
                "rel_mse_scaled": float(vals[k]),
                "rel_mse_scaled_lo": lo,
                "rel_mse_scaled_hi": hi,
                "kept": float(point.loc[names_f[k], "kept"]),
                "kept_seq": float(point.loc[names_f[k], "kept_seq"]),
                "naive": naive,
                "flat": bool(np.nanmax(vals) - np.nanmin(vals) < FLAT),
            }
        )
    answer = pd.DataFrame(rows).sort_values("rel_mse_scaled", kind="stable")
    cur_out = None
    if cur is not None:
        lo, hi = spread("current")
        v = float(point.loc["current", "rel_mse_scaled"])
        fam = cur.name if cur.name in FAMILIES else None
        best = answer.set_index("family").loc[fam] if fam else answer.iloc[0]
        cur_out = {
            "spec": current,
            "rel_mse_scaled": v,
            "rel_mse_scaled_lo": lo,
            "rel_mse_scaled_hi": hi,
            "kept": float(point.loc["current", "kept"]),
            "kept_seq": float(point.loc["current", "kept_seq"]),
            "best_family": fam or str(best["family"]),
            "best_value": float(best["value"]),
            "best_rel_mse_scaled": float(best["rel_mse_scaled"]),
            "excess": (v - float(best["rel_mse_scaled"])) / float(best["rel_mse_scaled"])
            if float(best["rel_mse_scaled"]) > 0
            else math.nan,
        }
    return answer.reset_index(drop=True), curves, cur_out


def answer_lines(answer: pd.DataFrame, current: dict | None) -> list[str]:
    """Markdown lines of the answer (report.md)."""
    lines = [
        "Per correction family, the threshold with the lowest predicted `rel_mse_scaled` on "
        "this dump (grid in `simkit.diagnose.recommend.FAMILIES`), the 90% range of the "
        "bootstrap refits' best thresholds, the error at the recommended threshold "
        "[90% CI], and its predicted kept fractions. Errors are relative to the signal "
        "‖∇J‖² (1 = ĝ ≡ 0), not to naive.",
        "",
        "| family | parameter | recommended | range | rel. scaled MSE | kept | kept seq | naive |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in answer.itertuples():
        rec = f"{r.value:g}" + (f" (flat: the grid spans < {FLAT:g})" if r.flat else "")
        lines.append(
            f"| {r.family} | {r.parameter} | {rec} | [{r.value_lo:g}, {r.value_hi:g}] "
            f"| {r.rel_mse_scaled:.3g} [{r.rel_mse_scaled_lo:.3g}, {r.rel_mse_scaled_hi:.3g}] "
            f"| {r.kept:.3g} | {r.kept_seq:.3g} | {r.naive:.3g} |"
        )
    lines.append("")
    if current is not None:
        c = current
        lines += [
            f"Your setting `{c['spec']}`: rel. scaled MSE {c['rel_mse_scaled']:.3g} "
            f"[{c['rel_mse_scaled_lo']:.3g}, {c['rel_mse_scaled_hi']:.3g}], kept {c['kept']:.3g} "
            f"(sequences {c['kept_seq']:.3g}); the best {c['best_family']} threshold "
            f"({c['best_value']:g}) predicts {c['best_rel_mse_scaled']:.3g}: excess "
            f"{c['excess']:+.1%}.",
            "",
        ]
    return lines
