"""simkit.figures.report: merged table (parquet + CSV) and standard plots of a sweep."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import bandit_toml

from simkit import sweep
from simkit.figures import report as report_mod

CONFIG = bandit_toml(
    "report",
    seed=1,
    targets=(0.1, 0.5, 1.0),
    estimators=("naive", ("ppo_clip", "grid = { eps_high = [0.2, 0.28] }"), "snis"),
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _sweep(tmp_path, text=CONFIG, name="out") -> Path:
    config = tmp_path / f"{name}.toml"
    config.write_text(text)
    out = tmp_path / name
    summary = sweep.run_sweep(config, out, progress=False)
    assert summary.complete
    return out


def test_report_writes_the_table_and_the_plots(tmp_path):
    out = _sweep(tmp_path)
    table, paths = report_mod.report(out)
    pd.testing.assert_frame_equal(table, sweep.load_results(out), check_exact=True)
    assert paths[:2] == [out / "results.parquet", out / "results.csv"]
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results.parquet"), table)
    csv = pd.read_csv(out / "results.csv")
    assert list(csv.columns) == list(table.columns) and len(csv) == len(table) == 6 * 4
    metrics = ("bias", "variance", "mse", "cosine", "rel_mse_scaled", "kept")
    pngs = [out / "report" / f"{m}.png" for m in metrics]
    assert paths[2:] == pngs
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 5000


def test_mse_plot_draws_the_zero_estimator_line(tmp_path):
    """The MSE plot carries ĝ ≡ 0's MSE, ‖∇J‖² (the table's mse_zero), as a labelled line."""
    out = _sweep(tmp_path)
    table = sweep.load_results(out)
    swept = report_mod.swept_columns(table, report_mod.setting_columns(out))
    (fig,) = report_mod.draw_metric(table, "mse", "MSE", "log", swept)
    lines = [
        ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == report_mod.ZERO_LABEL
    ]
    assert lines
    ys = np.concatenate([ln.get_ydata() for ln in lines])
    assert set(np.round(ys, 14)) <= set(np.round(table["mse_zero"].to_numpy(), 14))


def test_swept_columns_put_the_x_axis_first(tmp_path):
    table = pd.DataFrame(
        {"env": ["a"] * 4, "n": [8, 8, 16, 16], "target": [0.1, 0.5, 0.1, 0.5], "T": [1] * 4}
    )
    assert report_mod.swept_columns(table, ["env", "n", "target", "T"]) == ["target", "n"]
    assert report_mod.swept_columns(table, ["env", "T"]) == []
    out = _sweep(tmp_path)
    assert report_mod.setting_columns(out)[:3] == ["env", "family", "divergence"]
    assert {"target", "T", "n"} <= set(report_mod.setting_columns(out))


def test_one_figure_per_metric_with_a_panel_per_other_setting(tmp_path):
    table = sweep.load_results(_sweep(tmp_path))
    (fig,) = report_mod.draw_metric(table, "bias", "bias", "log", ["target", "n"])
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["n = 8", "n = 16"]
    assert len(visible[0].get_lines()) >= 4  # one line per estimator (+ error bar parts)
    # many panels are split over several figures
    many = pd.concat([table.assign(seed_col=i) for i in range(report_mod.MAX_PANELS + 1)])
    figs = report_mod.draw_metric(many, "mse", "mse", "log", ["target", "seed_col"])
    assert len(figs) == 2


def test_estimators_of_one_mapping_get_distinct_styles(tmp_path):
    table = sweep.load_results(_sweep(tmp_path))
    styles = report_mod.estimator_styles(table)
    assert list(styles) == list(dict.fromkeys(table["estimator"]))
    clip = [s for name, s in styles.items() if name.startswith("ppo_clip")]
    assert len(clip) == 2 and clip[0]["color"] != clip[1]["color"]
    assert clip[0]["marker"] != clip[1]["marker"]


def test_a_single_setting_is_drawn_as_bars(tmp_path):
    text = CONFIG.replace("n = [8, 16]", "n = [8]").replace("[0.1, 0.5, 1.0]", "[0.5]")
    out = _sweep(tmp_path, text, "single")
    table, paths = report_mod.report(out)
    assert len(table) == 4 and all(p.exists() for p in paths)
    (fig,) = report_mod.draw_metric(table, "variance", "variance", "log", [])
    assert len(fig.axes[0].patches) == 4  # one bar per estimator


def test_an_unfinished_sweep_needs_partial(tmp_path):
    out = _sweep(tmp_path)
    next(iter((out / "cells").glob("*.parquet"))).unlink()
    with pytest.raises(sweep.SweepError, match="1 of 6 cells have no results"):
        report_mod.report(out)
    table, _ = report_mod.report(out, partial=True)
    assert table["cell"].nunique() == 5


def test_report_of_a_directory_that_is_not_a_sweep(tmp_path):
    with pytest.raises(sweep.SweepError, match="not a simkit sweep directory"):
        report_mod.report(tmp_path)


def test_report_of_a_training_sweep_draws_learning_curves(tmp_path):
    config = Path(__file__).resolve().parents[1] / "configs" / "train_quick.toml"
    out = tmp_path / "train"
    sweep.run_sweep(config, out, backend="serial", progress=False)
    table, paths = report_mod.report(out)
    names = sorted(p.name for p in paths)
    assert {"results.parquet", "results.csv", "summary.csv", "J.png", "cosine.png"} <= set(names)
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_SIGNATURE
    summary = pd.read_csv(out / "summary.csv")
    runs = table.groupby(["estimator", "N", "seed"]).ngroups
    assert len(summary) == runs
    # the summary's J_start is the first recorded J of each run
    first = table[table.recorded].sort_values("step").groupby(["estimator", "N", "seed"]).J.first()
    merged = summary.set_index(["estimator", "N", "seed"]).J_start
    pd.testing.assert_series_equal(merged.sort_index(), first.sort_index(), check_names=False)
