"""configs/ reproduces the figures' data.

Every registered figure has a config in configs/ or a reason in configs/README.md. Each figure
config is the figure at full size: applying the figure's full ``config()`` to the shipped TOML
(through the dict API) changes nothing. A small version of it — the same TOML with the sizes of
the figure's ``config(small=True)`` — run by :func:`simkit.sweep.run_config` gives the numbers of
the figure's ``compute(config(small=True))``:

- exact rows (enumeration): every metric and divergence equal to 1e-10 (same formulas, same μ);
- Monte Carlo rows: the cells draw other random streams (a cell's seed comes from its key, the
  figure seeds ``experiment.run`` with its own seed), so the two tables are independent
  estimates of the same quantities. They agree within Z = 5 standard errors,
  |fig − sweep| ≤ Z·√(SE_fig² + SE_sweep²), each SE read off that table's own 95 % bootstrap
  interval as (hi − lo)/(2·z_0.975) (normal approximation, computed from the same draws).
  The divergence columns of Monte Carlo rows are exact functions of μ and compared to 1e-10.
  ``khat`` is always estimated from the drawn batches (no bounds) and is not compared.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import norm

from simkit import experiment
from simkit.config import SweepConfig
from simkit.figures import (
    FIGURES,
    _common,
    bandit_bias_variance,
    bias_variance_frontier,
    collapse_map,
    collapse_regimes,
    mismatch_curves,
    mse_vs_T,
    seq_tis_optimal_c,
    staleness_curves,
)
from simkit.sweep import run_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
README = CONFIGS / "README.md"

#: exact paths: same formulas on the same μ, so agreement to rounding
RTOL, ATOL = 1e-10, 1e-12
#: Monte Carlo agreement, in standard errors of the difference
Z = 5.0
#: metrics of an exact row (their bounds are NaN in both tables)
EXACT_METRICS = tuple(experiment.BOUNDED_METRICS)
#: metrics compared on Monte Carlo rows (bounds from the bootstrap; snr's are conservative)
MC_METRICS = ("bias", "bias_dir", "cosine", "variance", "mse", "ess")
DIVERGENCES = tuple(experiment.DIVERGENCE_COLUMNS)
AGG = ["seq-mean-token-sum"]


def assert_same_config(got, want, path="config"):
    """Equal, floats to 1e-12 relative: a figure computes grids with ``np.logspace``, whose
    last digit depends on the CPU's SIMD ``pow`` (0.056234132519034905 vs 0.05623413251903491
    on an AMD EPYC), while the TOML file holds the printed literal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{path}: keys differ"
        for k in want:
            assert_same_config(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), f"{path}: lengths differ"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_config(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-12, abs=0), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def shipped(file: str) -> dict:
    """The shipped TOML of ``configs/<file>`` as a plain dict."""
    with (CONFIGS / file).open("rb") as fh:
        return tomllib.load(fh)


# --- each figure's Config applied to its shipped TOML (every field the figure controls) --------


def bandit_bias_variance_dict(d: dict, cfg: bandit_bias_variance.Config) -> dict:
    """The bandit of ``make_bandit(arms, seed)``, μ = dial(π, χ², family) at every χ² of the
    grid, every mapping (or ``mapping_names``) with defaults, oracle, seq-mean-token-sum."""
    names = cfg.mapping_names if cfg.mapping_names is not None else _common.figure_mappings()
    d = copy.deepcopy(d)
    d.update(n=list(cfg.ns), reps=cfg.reps, n_boot=cfg.n_boot)
    d["environment"] = {"kind": "bandit", "K": cfg.arms, "seed": cfg.seed}
    d["behaviour"] = {
        "family": cfg.shift_family,
        "divergence": "chi2",
        "targets": [float(t) for t in cfg.chi2_grid],
    }
    d["estimators"] = [{"mapping": name, "aggregations": AGG} for name in names]
    return d


def frontier_settings(name: str, small: bool) -> list[dict]:
    """The hyperparameter settings of one knob of the frontier figure (its KNOBS table)."""
    _, hp, full, reduced = bias_variance_frontier.KNOBS[name]
    return [hp(float(v)) for v in (reduced if small else full)]


def bias_variance_frontier_dict(d: dict, cfg: bias_variance_frontier.Config) -> dict:
    """Each knob of KNOBS as a zipped grid, then the endpoints; reps as the figure's compute
    (2 small, 10 full: only khat uses them on the exact path)."""
    d = copy.deepcopy(d)
    d.update(n=[cfg.n], reps=2 if cfg.small else 10)
    d["environment"] = {"kind": "bandit", "K": cfg.arms, "seed": cfg.seed}
    d["behaviour"] = {"family": cfg.shift_family, "divergence": "chi2", "targets": [cfg.chi2]}
    estimators = []
    for name in bias_variance_frontier.KNOBS:
        settings = frontier_settings(name, cfg.small)
        entry = {
            "mapping": name,
            "grid": {k: [s[k] for s in settings] for k in settings[0]},
            "aggregations": AGG,
        }
        if len(settings[0]) > 1:
            entry["grid_mode"] = "zip"
        estimators.append(entry)
    estimators += [
        {"mapping": name, "aggregations": AGG} for name in bias_variance_frontier.ENDPOINTS
    ]
    d["estimators"] = estimators
    return d


def _mse_vs_T_dict(d: dict, cfg: mse_vs_T.Config, lengths, reps: int) -> dict:
    names = _common.chosen_mappings(cfg.mapping_names, _common.per_sample_mappings())
    d = copy.deepcopy(d)
    d.update(n=[cfg.n], reps=reps)
    if "n_boot" in d or reps == cfg.mc_reps:
        d["n_boot"] = cfg.n_boot
    d["environment"] = {
        "kind": "token_mdp",
        "constructor": "answer_correct",
        "V": cfg.V,
        "T": list(lengths),
        "seed": cfg.seed,
        "scale": cfg.scale,
    }
    d["behaviour"] = {
        "family": cfg.shift_family,
        "divergence": "chi2",
        "level": "token",
        "targets": [cfg.chi2_tok],
    }
    d["estimators"] = [{"mapping": name, "aggregations": AGG} for name in names]
    return d


def mse_vs_T_exact_dict(d: dict, cfg: mse_vs_T.Config) -> dict:
    """The exact lengths (enumeration, ``reps`` batches for khat)."""
    return _mse_vs_T_dict(d, cfg, cfg.exact_lengths, cfg.reps)


def mse_vs_T_mc_dict(d: dict, cfg: mse_vs_T.Config) -> dict:
    """The Monte Carlo lengths (``mc_reps`` batches, ``n_boot`` resamples)."""
    return _mse_vs_T_dict(d, cfg, cfg.mc_lengths, cfg.mc_reps)


def seq_tis_optimal_c_dict(d: dict, cfg: seq_tis_optimal_c.Config) -> dict:
    """answer_correct (V, T), μ at each χ²_seq, tis_seq over the C grid and is_seq, n = 1,
    n_batch and n_large (the figure's batch MSEs and scale-free errors)."""
    d = copy.deepcopy(d)
    d["n"] = [1, cfg.n_batch, cfg.n_large]
    d["environment"] = {
        "kind": "token_mdp",
        "constructor": "answer_correct",
        "V": cfg.V,
        "T": [cfg.T],
        "seed": cfg.seed,
        "scale": cfg.scale,
    }
    d["behaviour"] = {
        "family": cfg.shift_family,
        "divergence": "chi2",
        "level": "sequence",
        "targets": [float(t) for t in cfg.chi2_seqs],
    }
    c_grid = np.geomspace(cfg.c_min, cfg.c_max, cfg.n_c)
    d["estimators"] = [
        {"mapping": "tis_seq", "grid": {"c": [float(c) for c in c_grid]}, "aggregations": AGG},
        {"mapping": "is_seq", "aggregations": AGG},
    ]
    return d


#: figure -> {config file: function(shipped dict, figure Config) -> sweep dict}
FIGURE_CONFIGS = {
    "bandit_bias_variance": {"bandit_bias_variance.toml": bandit_bias_variance_dict},
    "bias_variance_frontier": {"bias_variance_frontier.toml": bias_variance_frontier_dict},
    "mse_vs_T": {"mse_vs_T.toml": mse_vs_T_exact_dict, "mse_vs_T_mc.toml": mse_vs_T_mc_dict},
    "seq_tis_optimal_c": {"seq_tis_optimal_c.toml": seq_tis_optimal_c_dict},
    # training grids: the figure's own sweep config (tests/test_train_sweep.py runs them small)
    "staleness_curves": {
        "train_staleness_curves.toml": lambda d, cfg: staleness_curves.sweep_config(cfg).to_dict()
    },
    "mismatch_curves": {
        "train_mismatch_curves.toml": lambda d, cfg: mismatch_curves.sweep_config(cfg).to_dict()
    },
    "collapse_map": {
        "train_collapse_map.toml": lambda d, cfg: collapse_map.sweep_config(cfg).to_dict()
    },
    "collapse_regimes": {
        "train_collapse_regimes.toml": lambda d, cfg: collapse_regimes.sweep_config(cfg).to_dict()
    },
}
CONFIG_CASES = [(fig, file) for fig, files in FIGURE_CONFIGS.items() for file in files]


def run_small(figure: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the figure's small compute, the small sweeps of its configs concatenated)."""
    module = FIGURES[figure]
    cfg = module.config(small=True)
    tables = [
        run_config(SweepConfig.from_dict(resize(shipped(file), cfg)), progress=False)
        for file, resize in FIGURE_CONFIGS[figure].items()
    ]
    return module.compute(cfg), pd.concat(tables, ignore_index=True)


@pytest.fixture(scope="module")
def small_runs() -> dict:
    """Each (a) figure's small compute and small sweep, computed once for the module."""
    cache: dict = {}

    def get(figure: str):
        if figure not in cache:
            cache[figure] = run_small(figure)
        return cache[figure]

    return get


# --- comparisons ---------------------------------------------------------------------------------


def assert_close(merged: pd.DataFrame, columns, what: str, fig="_f", sweep="_s") -> None:
    """Exact agreement (rtol 1e-10) of ``col + fig`` and ``col + sweep`` for every column."""
    for col in columns:
        np.testing.assert_allclose(
            merged[col + sweep].to_numpy(float),
            merged[col + fig].to_numpy(float),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"{what}: column {col!r}",
        )


def standard_error(table: pd.DataFrame, metric: str, level: float, suffix: str) -> np.ndarray:
    """SE of ``metric`` from its ``level`` bootstrap interval: (hi − lo)/(2·z_{(1+level)/2})."""
    q = norm.ppf(0.5 + level / 2)
    lo = table[f"{metric}_lo{suffix}"].to_numpy(float)
    hi = table[f"{metric}_hi{suffix}"].to_numpy(float)
    return (hi - lo) / (2 * q)


def mc_z_scores(merged: pd.DataFrame, metric: str, level: float = 0.95) -> np.ndarray:
    """|fig − sweep| / √(SE_fig² + SE_sweep²) of a metric on merged Monte Carlo rows."""
    se = np.hypot(
        standard_error(merged, metric, level, "_f"), standard_error(merged, metric, level, "_s")
    )
    assert np.all(np.isfinite(se) & (se >= 0)), f"{metric}: invalid bootstrap intervals"
    diff = np.abs(merged[f"{metric}_f"].to_numpy(float) - merged[f"{metric}_s"].to_numpy(float))
    # A zero-width interval (e.g. ESS of weights that are all equal) leaves no noise to
    # compare against: then the two values must agree exactly (z = 0), otherwise z = inf.
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(se > 0, diff / np.where(se > 0, se, 1.0), np.where(diff == 0, 0.0, np.inf))


def assert_mc_agree(merged: pd.DataFrame, what: str) -> None:
    assert len(merged) > 0, f"{what}: no Monte Carlo rows to compare"
    for metric in MC_METRICS:
        z = mc_z_scores(merged, metric)
        worst = int(np.argmax(z))
        assert z[worst] <= Z, (
            f"{what}: {metric} differs by {z[worst]:.2f} SE (> {Z}) for "
            f"{merged.iloc[worst]['mapping']}: figure {merged.iloc[worst][metric + '_f']!r}, "
            f"sweep {merged.iloc[worst][metric + '_s']!r}"
        )


def merge_one_to_one(fig: pd.DataFrame, sweep: pd.DataFrame, **keys) -> pd.DataFrame:
    """Inner merge that must pair every figure row with exactly one sweep row."""
    merged = fig.merge(sweep, validate="one_to_one", suffixes=("_f", "_s"), **keys)
    assert len(merged) == len(fig), f"{len(fig) - len(merged)} figure rows have no sweep row"
    return merged


# --- every figure is covered -------------------------------------------------------------------


def readme_table() -> dict[str, tuple[list[str], str]]:
    """configs/README.md's figure table: figure -> (config files, text of the last column)."""
    rows = {}
    for line in README.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`[\w.-]+`", cells[0]):
            continue
        figure = cells[0].strip("`")
        assert figure not in rows, f"configs/README.md lists {figure!r} twice"
        rows[figure] = (re.findall(r"`([\w.-]+\.toml)`", cells[1]), cells[2])
    return rows


def test_every_figure_has_a_config_or_a_reason():
    table = readme_table()
    missing = sorted(set(FIGURES) - set(table))
    assert not missing, f"figures without a row in configs/README.md: {missing}"
    unknown = sorted(set(table) - set(FIGURES))
    assert not unknown, f"configs/README.md lists figures that are not registered: {unknown}"
    for figure, (files, text) in table.items():
        assert len(text) >= 20, f"{figure}: say what the config gives or why there is none"
        for file in files:
            assert (CONFIGS / file).is_file(), f"{figure}: configs/{file} does not exist"


def test_the_readme_table_lists_the_tested_configs():
    """A figure with a config has a reproduction test here, and the other way round."""
    table = readme_table()
    with_config = {fig: sorted(files) for fig, (files, _) in table.items() if files}
    assert with_config == {fig: sorted(files) for fig, files in FIGURE_CONFIGS.items()}


def test_every_shipped_config_is_documented():
    text = README.read_text(encoding="utf-8")
    undocumented = [p.name for p in sorted(CONFIGS.glob("*.toml")) if f"`{p.name}`" not in text]
    assert not undocumented, f"configs/README.md does not mention {undocumented}"


# --- the shipped configs are the figures at full size --------------------------------------------


@pytest.mark.parametrize(("figure", "file"), CONFIG_CASES, ids=[f for _, f in CONFIG_CASES])
def test_shipped_config_is_the_full_size_figure(figure, file):
    d = shipped(file)
    full = FIGURE_CONFIGS[figure][file](d, FIGURES[figure].config())
    assert_same_config(SweepConfig.from_dict(full).to_dict(), SweepConfig.from_dict(d).to_dict())
    header = (CONFIGS / file).read_text(encoding="utf-8").split("\n", 1)[0]
    assert f"`{figure}`" in header, f"{file}: the first line must name the figure `{figure}`"


# --- small configs reproduce compute(config(small=True)) -----------------------------------------


def test_bandit_bias_variance_exact_rows(small_runs):
    fig, sweep = small_runs("bandit_bias_variance")
    fig = fig.drop(columns=["family"])  # the figure's colour family, not the shift family
    merged = merge_one_to_one(
        fig, sweep, left_on=["mapping", "target_chi2", "n"], right_on=["mapping", "target", "n"]
    )
    assert (merged.exact_f == merged.exact_s).all()
    assert merged.exact_f.sum() > 0 and (~merged.exact_f).sum() > 0
    assert_close(merged, DIVERGENCES, "bandit_bias_variance, every row")
    bounds = [f"{m}_{s}" for m in EXACT_METRICS for s in ("lo", "hi")]
    assert_close(
        merged[merged.exact_f], (*EXACT_METRICS, *bounds), "bandit_bias_variance, exact rows"
    )


def test_bandit_bias_variance_monte_carlo_rows(small_runs):
    fig, sweep = small_runs("bandit_bias_variance")
    fig = fig.drop(columns=["family"])
    merged = merge_one_to_one(
        fig, sweep, left_on=["mapping", "target_chi2", "n"], right_on=["mapping", "target", "n"]
    )
    assert_mc_agree(merged[~merged.exact_f], "bandit_bias_variance, Monte Carlo rows")


def test_monte_carlo_comparison_detects_a_different_setting(small_runs):
    """Negative control: the figure's Monte Carlo rows at one χ² against the sweep's at the next
    χ² of the grid differ by more than Z SE (the check has the power to fail)."""
    fig, sweep = small_runs("bandit_bias_variance")
    fig = fig[~fig.exact].drop(columns=["family"])
    targets = sorted(fig.target_chi2.unique())
    shifted = sweep[~sweep.exact].copy()
    shifted["target"] = shifted.target.map(dict(zip(targets[1:], targets[:-1], strict=True)))
    merged = merge_one_to_one(
        fig[fig.target_chi2 < targets[-1]],
        shifted.dropna(subset=["target"]),
        left_on=["mapping", "target_chi2", "n"],
        right_on=["mapping", "target", "n"],
    )
    assert max(mc_z_scores(merged, m).max() for m in MC_METRICS) > Z


def frontier_key(mapping: str, hp: dict) -> tuple:
    return (mapping, tuple(sorted(hp.items())))


def test_bias_variance_frontier_rows(small_runs):
    fig, sweep = small_runs("bias_variance_frontier")
    assert sweep.exact.all()
    keys = []
    for name, value in zip(fig.mapping, fig.value, strict=True):
        hp = bias_variance_frontier.KNOBS[name][1](float(value)) if name in KNOBS else {}
        keys.append(frontier_key(name, hp))
    fig = fig.assign(key=keys)
    sweep_keys = []
    for _, row in sweep.iterrows():
        names = KNOBS[row.mapping][1](1.0) if row.mapping in KNOBS else {}
        sweep_keys.append(frontier_key(row.mapping, {k: row[k] for k in names}))
    sweep = sweep.assign(key=sweep_keys)
    merged = merge_one_to_one(fig, sweep, on="key")
    assert (merged.n_f == merged.n_s).all()
    assert_close(merged, ("bias", "variance", "mse", "chi2_tok"), "bias_variance_frontier")
    np.testing.assert_allclose(merged.bias2, merged.bias_s**2, rtol=RTOL, atol=ATOL)


KNOBS = bias_variance_frontier.KNOBS


def _mse_vs_T_swept_rows(fig: pd.DataFrame) -> pd.DataFrame:
    """The figure's rows a shipped sweep reproduces: enumeration at ``exact_lengths`` and Monte
    Carlo at ``mc_lengths`` (the moment-DP rows at ``dp_lengths`` have no sweep config: the
    sweep's exact path is the same ``experiment.run``, tested in test_token_moments.py)."""
    cfg = mse_vs_T.config(small=True)
    return fig[~fig.exact | fig["T"].isin(cfg.exact_lengths) & (fig.method == "enumeration")]


def test_mse_vs_T_exact_rows(small_runs):
    fig, sweep = small_runs("mse_vs_T")
    fig = _mse_vs_T_swept_rows(fig)
    merged = merge_one_to_one(fig, sweep, on=["mapping", "T", "exact"])
    assert_close(merged, DIVERGENCES, "mse_vs_T, every row")
    exact = merged[merged.exact]
    assert set(exact["T"]) == set(mse_vs_T.config(small=True).exact_lengths)
    assert_close(exact, EXACT_METRICS, "mse_vs_T, exact rows")


def test_mse_vs_T_monte_carlo_rows(small_runs):
    fig, sweep = small_runs("mse_vs_T")
    fig = _mse_vs_T_swept_rows(fig)
    merged = merge_one_to_one(fig, sweep, on=["mapping", "T", "exact"])
    mc = merged[~merged.exact]
    assert set(mc["T"]) == set(mse_vs_T.config(small=True).mc_lengths)
    assert_mc_agree(mc, "mse_vs_T, Monte Carlo rows")


def test_seq_tis_optimal_c_rows(small_runs):
    fig, sweep = small_runs("seq_tis_optimal_c")
    cfg = seq_tis_optimal_c.config(small=True)
    assert sweep.exact.all()
    fig = fig[~fig.at_c_star]  # C* = √(2(1+χ²_seq)) of the achieved χ²_seq: a closed form
    tis = sweep[sweep.mapping == "tis_seq"]
    keys = {"left_on": ["chi2_seq_target", "c"], "right_on": ["target", "c"]}
    one = merge_one_to_one(fig, tis[tis.n == 1], **keys)
    assert_close(one, ("bias", "variance", "mse", "chi2_seq"), "seq_tis_optimal_c, n = 1")
    np.testing.assert_allclose(one.rel_mse_scaled_f, one.rel_mse_scaled_s, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(one.mse_zero_f, one.mse_zero_s, rtol=RTOL, atol=ATOL)
    for n, suffix in ((cfg.n_batch, "batch"), (cfg.n_large, "large")):
        batch = merge_one_to_one(fig, tis[tis.n == n], **keys)
        assert_close(batch, ("bias",), f"seq_tis_optimal_c, n = {n}")
        np.testing.assert_allclose(batch[f"mse_{suffix}"], batch.mse_s, rtol=RTOL, atol=ATOL)
        # the figure's hand-written scale-free error equals run()'s at the same n
        np.testing.assert_allclose(
            batch[f"rel_mse_scaled_{suffix}"], batch.rel_mse_scaled_s, rtol=1e-9, atol=1e-12
        )
    is_seq = sweep[(sweep.mapping == "is_seq") & (sweep.n == 1)]
    is_mse = merge_one_to_one(
        fig[["chi2_seq_target", "is_mse"]].drop_duplicates(),
        is_seq,
        left_on="chi2_seq_target",
        right_on="target",
    )
    np.testing.assert_allclose(is_mse.is_mse, is_mse.mse, rtol=RTOL, atol=ATOL)


if __name__ == "__main__":  # rewrite the experiment configs from the figures' full-size Configs
    # (after a figure's config changes on purpose, e.g. new mappings in the catalogue); each
    # file keeps its leading comment block. Training configs are written by their figures'
    # sweep_config and are not touched here.
    from simkit.config import to_toml

    for figure, files in FIGURE_CONFIGS.items():
        for file in files:
            if file.startswith("train_"):
                continue
            path = CONFIGS / file
            text = path.read_text(encoding="utf-8")
            header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
            full = FIGURE_CONFIGS[figure][file](shipped(file), FIGURES[figure].config())
            body = to_toml(SweepConfig.from_dict(full))
            new = header + body
            if new != text:
                path.write_text(new, encoding="utf-8")
                print("rewrote", path)
