"""The figure async_tolerance: its data on the small config (exact values checked against
hand computations of the lag distributions) and its notes following the data (perturbed data
changes the sentences)."""

import numpy as np
import pandas as pd
import pytest

from simkit.envs import versions as V
from simkit.figures import async_tolerance as A


@pytest.fixture(scope="module")
def small():
    cfg = A.config(small=True)
    return cfg, A.compute(cfg)


def test_data_shape_and_exact_parts(small):
    cfg, data = small
    labels = list(A.strategies(cfg.max_age))
    cur = data[data.part == "curves"]
    assert sorted(cur.strategy.unique()) == sorted(labels)
    assert len(cur) == len(labels) * len(cfg.p_grid)
    ens = data[data.part == "ensemble"]
    assert ens.instance.nunique() == cfg.ensemble and len(ens) == cfg.ensemble * len(labels)
    # the dropped mass is P(age > max_age) of the truncated geometric lag, by hand
    for p in cfg.p_grid:
        w = (1 - p) ** np.arange(cfg.max_lag + 1)
        w /= w.sum()
        row = cur[(cur.p == p) & cur.strategy.str.startswith("drop")].iloc[0]
        assert row.wasted == pytest.approx(w[cfg.max_age + 1 :].sum(), abs=1e-12)
        assert row.mean_age == pytest.approx(w @ np.arange(cfg.max_lag + 1), abs=1e-12)
        waited = cur[(cur.p == p) & cur.strategy.str.startswith("wait")].iloc[0]
        assert waited.waited == pytest.approx(row.wasted, abs=1e-12)
    # coverage: drop at the largest age keeps the share; wait always does
    cov = data[data.part == "coverage"]
    drop = cov[cov.strategy == "drop"].set_index("max_age")
    assert drop.hard_share.iloc[-1] == pytest.approx(cfg.hard_share)
    assert (cov[cov.strategy == "wait"].hard_share == cfg.hard_share).all()
    e = V.lag_weights("geometric", cfg.max_lag, p=cfg.p_easy)[: cfg.max_age + 1].sum()
    h = V.lag_weights("geometric", cfg.max_lag, p=cfg.p_hard)[: cfg.max_age + 1].sum()
    f = cfg.hard_share
    assert drop.loc[cfg.max_age, "hard_share"] == pytest.approx(f * h / (f * h + (1 - f) * e))
    # decoupled PPO with π_old = π is keep + per-version IS (PPO ratio 1 inside the clip)
    piv = cur.pivot(index="p", columns="strategy", values="rel_bias")
    np.testing.assert_allclose(
        piv["PPO, recomputed π_old"], piv["keep, per-version IS"], rtol=1e-10, atol=1e-12
    )
    assert np.isfinite(data.attrs["notes"][0].count("exact"))


def _perturbed(data: pd.DataFrame, strategy: str, factor: float) -> pd.DataFrame:
    out = data.copy()
    sel = (out.part == "ensemble") & (out.strategy == strategy)
    out.loc[sel, "rel_mse_scaled"] *= factor
    return out


def test_notes_follow_the_data(small):
    cfg, data = small
    notes = A.notes(data, cfg)
    k, n = A.ranking(data, "keep, MIS", "keep, per-version IS")
    assert f"keep, MIS < keep, per-version IS in {k}/{n}" in notes[2]
    worse = A.notes(_perturbed(data, "keep, MIS", 1e6), cfg)
    assert f"keep, MIS < keep, per-version IS in 0/{n}" in worse[2]
    better = A.notes(_perturbed(data, "keep, MIS", 1e-6), cfg)
    assert f"keep, MIS < keep, per-version IS in {n}/{n}" in better[2]
    # the bias ranking at the largest mean age is read from the data
    cur = data[data.part == "curves"]
    last = cur[cur.p == cur.p.min()]
    first = last.sort_values("rel_bias").strategy.iloc[0]
    assert notes[1].startswith(f"At mean age {last.mean_age.iloc[0]:.2f}, relative bias: {first}")


def test_training_runs_and_their_note(small):
    cfg, data = small
    runs = data[data.part == "training"]
    assert len(runs) == len(A.train_recipes(cfg)) * cfg.train_seeds
    sync = runs[runs.strategy.str.startswith("synchronous")]
    assert (sync.dropped_frac == 0).all() and (sync.waited_frac == 0).all()
    assert (runs[runs.strategy.str.startswith("wait")].dropped_frac == 0).all()
    # coverage: keep and wait train both prompts' groups (round-robin: exactly one half);
    # drop evicts whole groups, refilled from the stream, never favouring the hard prompt
    kind = runs.strategy.str.split(" ").str[0].str.rstrip(",")
    assert (runs[kind.isin(["keep", "wait", "synchronous"])].hard_share == 0.5).all()
    assert (runs[kind == "drop"].hard_share <= 0.5 + 1e-12).all()
    note = A.training_note(data, cfg)
    # perturbed: one recipe far ahead of every other becomes the untied best
    out = data.copy()
    sel = (out.part == "training") & (out.strategy == f"drop > {cfg.train_max_off}, no IS")
    out.loc[sel, "J_final"] = 10.0 + out.loc[sel, "seed"] * 1e-3
    changed = A.training_note(out, cfg)
    assert f"Best: drop > {cfg.train_max_off}, no IS, no tie within 2 SE" in changed
    assert changed != note
    # the coverage sentence follows the data: drop's share moved to keep's
    c = A.coverage_share(runs)
    assert f"drop {c.loc['drop', 'mean']:.3f} ± {c.loc['drop', 'se']:.3f}" in note
    same = data.copy()
    sel = (same.part == "training") & same.strategy.str.startswith("drop")
    same.loc[sel, "hard_share"] = 0.5
    assert "drop's share is within 2 SE of keep's" in A.training_note(same, cfg)
    low = data.copy()
    low.loc[sel, "hard_share"] = 0.2 + low.loc[sel, "seed"] * 1e-3
    assert "less of the hard prompt than keep" in A.training_note(low, cfg)


def test_training_coverage_limit_by_hand():
    """The stream limit of drop: f_h P_h(e ≤ m) / Σ_k f_k P_k(e ≤ m), f = (1/2, 1/2), P_k the
    truncated geometric law over rollouts, m = ⌊max_off / N⌋."""
    cfg = A.Config()
    m = cfg.train_max_off // cfg.train_N
    kept = []
    for p in (cfg.p_easy, cfg.p_hard):
        w = (1 - p) ** np.arange(cfg.train_lag_max + 1)
        kept.append(w[: m + 1].sum() / w.sum())
    assert A.train_coverage_exact(cfg) == pytest.approx(kept[1] / sum(kept), abs=1e-12)


def test_config_checks_and_draw(small):
    with pytest.raises(ValueError, match="max_age"):
        A.Config(max_age=7)
    with pytest.raises(ValueError, match="p_grid"):
        A.Config(p_grid=(0.0,))
    with pytest.raises(ValueError, match="sequences"):
        A.Config(V=8, T=5)
    fig = A.draw(small[1])
    assert len(fig.axes) >= 3


def test_ppo_recomputed_note_says_coincides_or_the_gap(small):
    """PPO with the recomputed π_old equals keep + per-version IS: the note says so, and it
    prints the gap instead when the data stop supporting it."""
    cfg, data = small
    assert any("coincides with keep, per-version IS" in line for line in A.notes(data, cfg))
    moved = data.copy()
    sel = (moved.part == "curves") & (moved.strategy == "PPO, recomputed π_old")
    moved.loc[sel, "rel_bias"] += 0.01
    lines = A.notes(moved, cfg)
    assert not any("coincides" in line for line in lines)
    assert any("by at most 0.01 in relative bias" in line for line in lines)
