"""The collapse_regimes figure (issue 16 §5, issue 23): failure labels over (lr × lag) and
(N × lag), the lag L in optimizer updates, drift a flag."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from simkit.figures import collapse_regimes as cr
from simkit.figures import style
from simkit.train.analysis import FAILURE_LABELS, KL_SEQ_EXPLOSION, failure_label


@pytest.fixture(scope="module")
def data():
    return cr.compute(cr.config(small=True))


def test_grid_covers_both_axes_for_every_recipe_and_seed(data):
    cfg = data.config
    assert data.recipes == cfg.recipes
    cells = cr.cells(cfg)
    assert len(cells) == len({*cells})
    for lr in cfg.lrs:
        for lag in cfg.lags:
            assert (cfg.N_fixed, lag, lr) in cells
    for N in cfg.Ns:
        for lag in cfg.lags:
            assert (N, lag, cfg.lr_fixed) in cells
    assert len(data.runs) == len(cfg.recipes) * len(cells) * len(cfg.seeds)
    assert len(data.grid) == len(cfg.recipes) * len(cells)
    assert (data.grid["runs"] == len(cfg.seeds)).all()


def test_labels_are_the_run_summaries(data):
    runs = data.runs
    for row in runs.itertuples():
        assert row.failure == failure_label(
            row.collapsed, row.determinism, row.length_blowup, row.stalled
        )
        assert row.drift == (row.kl_seq_max > KL_SEQ_EXPLOSION)
    for row in data.grid.itertuples():
        part = runs[(runs.recipe == row.recipe) & (runs.N == row.N) & (runs.lag == row.lag)]
        part = part[part.lr == row.lr]
        assert row.label == cr.majority(part.failure)
        assert row.kl_seq_max == part.kl_seq_max.max()
        assert row.drift == part.drift.sum()


def test_on_policy_cell_is_the_same_for_every_recipe(data):
    """N = 1, lag 0: on-policy REINFORCE for every recipe (same seeds): same J curve."""
    on = data.table[(data.table.N == 1) & (data.table.lag == 0)]
    curves = {r: g.sort_values(["seed", "step"])["J"].to_numpy() for r, g in on.groupby("recipe")}
    first = next(iter(curves.values()))
    for c in curves.values():
        np.testing.assert_allclose(c, first, rtol=1e-9)


def test_majority_ties_go_to_the_more_severe():
    assert cr.majority(["ok", "collapse"]) == "collapse"
    assert cr.majority(["ok", "ok", "stall"]) == "ok"
    assert cr.majority(["stall", "ok"]) == "stall"
    assert "divergence" not in cr.LABEL_COLORS  # drift is a flag, not a label


def synthetic_grid(labels: dict) -> pd.DataFrame:
    rows = []
    for (r, N), (label, kl) in labels.items():
        row = dict(recipe=r, N=N, lag=8, lr=0.3, label=label, count=3, runs=3, gain=0.5)
        row.update(J_final=0.5, kl_seq_max=kl, drift=3 * (kl > KL_SEQ_EXPLOSION))
        row.update({f"n_{lab}": 3 * (lab == label) for lab in FAILURE_LABELS})
        rows.append(row)
    return pd.DataFrame(rows)


def test_verdict_follows_the_measurements():
    cfg = cr.config(small=True)
    grid = synthetic_grid(
        {
            ("grpo", 1): ("ok", 1.0),
            ("grpo", 16): ("collapse", 200.0),
            ("vespo", 1): ("ok", 1.0),
            ("vespo", 16): ("stall", 50.0),
        }
    )
    text = "\n".join(cr.verdict(grid, cfg))
    assert (
        "Recipes separate (different labels) in 1 of 2 cells, most drift first: N = 16, L = 8"
        in text
    )
    assert "GRPO (bypass) collapse, VESPO (bypass) stall" in text
    assert "largest KL_seq(π‖μ) 200 nats" in text
    assert "Runs flagged drift (not a failure): 6 of 12." in text
    grid.loc[grid.recipe == "grpo", "label"] = "ok"
    grid.loc[grid.recipe == "vespo", "label"] = "ok"
    text = "\n".join(cr.verdict(grid, cfg))
    assert "Recipes never separate" in text


def test_gains_and_control_lines_follow_the_runs(data):
    text = "\n".join(data.notes)
    assert "Mean normalised final gain over all cells (mean ± SE over seeds" in text
    assert "(fewer than 8 seeds: ordering not claimed)" in text
    runs = data.runs
    for (N, lag, lr), g in runs.groupby(["N", "lag", "lr"]):
        c = int(((g.recipe == "naive") & (g.failure == "collapse")).sum())
        assert f"{c}/{int((g.recipe == 'naive').sum())} at N = {N}, L = {lag}, lr {lr:g}" in text
    assert "this map judges none" in text


def test_notes_state_environment_schedule_and_drift(data):
    text = "\n".join(data.notes)
    assert "TokenMDP.at_least_k(V = 6, T = 8, k = 3" in text
    assert f"J(π₀) = {data.J_start:.4f}" in text
    assert f"largest KL_seq(π‖μ) {data.grid.kl_seq_max.max():.3g} nats" in text
    assert "seeds 0, 1" in text


def test_composed_recipe_is_dropped_with_a_note_when_unavailable():
    cfg = cr.Config(**{**cr.config(small=True).__dict__, "recipes": ("grpo", "ppo_tis")})
    assert cr.recipe("ppo_tis").mapping.c_dual == 3.0
    used = cr.usable_recipes(cfg)
    from simkit.train.recipes import composed_available

    assert ("ppo_tis" in used) == composed_available()


def test_config_errors():
    with pytest.raises(ValueError, match="unknown recipe"):
        cr.Config(recipes=("nope",))
    with pytest.raises(ValueError, match="lags must be non-empty"):
        cr.Config(lags=())


def test_draw(data):
    with style.context():
        fig = cr.draw(data)
    maps = [ax for ax in fig.get_axes() if ax.images]
    assert len(maps) == 2 * len(data.recipes)
    cfg = data.config
    sizes = sorted({len(ax.texts) for ax in maps})
    assert sizes == sorted({len(cfg.lrs) * len(cfg.lags), len(cfg.Ns) * len(cfg.lags)})
