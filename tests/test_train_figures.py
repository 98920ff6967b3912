"""The training figures (staleness_curves, mismatch_curves, collapse_map) and simkit.train's
analysis and recipes: compute() data at small size, notes, verdicts, drawing."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from simkit import mappings
from simkit.envs import TokenMDP
from simkit.figures import collapse_map, mismatch_curves, staleness_curves, style
from simkit.train import recipes
from simkit.train.analysis import (
    band,
    collapsed,
    normalized_gain,
    optimal_J,
    run_summary,
)


@pytest.fixture(scope="module")
def stale():
    return staleness_curves.compute(staleness_curves.config(small=True))


@pytest.fixture(scope="module")
def mism():
    return mismatch_curves.compute(mismatch_curves.config(small=True))


@pytest.fixture(scope="module")
def cmap():
    return collapse_map.compute(collapse_map.config(small=True))


def J_by(table: pd.DataFrame, **where) -> dict:
    """recipe -> the recorded J column (seed-major) of the rows matching ``where``."""
    part = table[table["recorded"]]
    for k, v in where.items():
        part = part[part[k] == v]
    return {r: g.sort_values(["seed", "step"])["J"].to_numpy() for r, g in part.groupby("recipe")}


# --- staleness_curves -----------------------------------------------------------------------------


def test_staleness_N1_curves_coincide_and_stale_ones_do_not(stale):
    cfg = stale.config
    on = J_by(stale.table, N=1, lag_updates=0)
    assert set(on) == set(cfg.recipes)
    first = on[cfg.recipes[0]]
    assert first[-1] > first[0] + 0.1  # it learns
    by_aggregation = {}
    for r in cfg.recipes:
        by_aggregation.setdefault(recipes.RECIPES[r].aggregation, []).append(r)
        # on-policy REINFORCE: token-mean and seq-mean-token-mean give every token of these
        # fixed-length sequences the weight 1/(n·T), computed in another order (to rounding)
        np.testing.assert_allclose(on[r], first, rtol=1e-10, atol=0)
    assert max(len(v) for v in by_aggregation.values()) > 1
    for group in by_aggregation.values():
        for r in group:  # same aggregation: the same floating-point operations, bit for bit
            np.testing.assert_array_equal(on[r], on[group[0]])
    stale_J = J_by(stale.table, N=max(cfg.staleness), lag_updates=0)
    assert len({tuple(v) for v in stale_J.values()}) > 1  # staleness separates the recipes
    at = stale.table[(stale.table["N"] == max(cfg.staleness)) & (stale.table["lag_updates"] == 0)]
    assert (at.loc[at["minibatch"] > 0, "chi2_seq"].dropna() > 0).all()


def test_staleness_bands_are_over_seeds(stale):
    cfg, curves = stale.config, stale.curves
    assert (curves["runs"] == len(cfg.seeds)).all()
    assert (curves["lo"] <= curves["mean"] + 1e-15).all()
    assert (curves["mean"] <= curves["hi"] + 1e-15).all()
    rec = stale.table[stale.table["recorded"]]
    key = ["recipe", "N", "lag_updates", "step"]
    expected = rec.groupby(key)["J"].agg(["mean", "min", "max"])
    got = curves.set_index(key).loc[expected.index]
    np.testing.assert_allclose(got["mean"], expected["mean"], rtol=1e-14)
    np.testing.assert_array_equal(got["lo"], expected["min"])
    np.testing.assert_array_equal(got["hi"], expected["max"])
    # the seeds really differ (a band, not a line) where the runs are stochastic
    assert (curves["hi"] - curves["lo"]).max() > 0
    assert len(stale.runs) == len(cfg.recipes) * len(cfg.panels) * len(cfg.seeds)
    key = ["recipe", "N", "lag_updates"]
    np.testing.assert_allclose(
        stale.summary.set_index(key)["J_final"],
        stale.runs.groupby(key)["J_final"].mean().loc[stale.summary.set_index(key).index],
        rtol=1e-14,
    )


def test_staleness_notes_state_environment_sizes_seeds_and_verdict(stale):
    text = "\n".join(stale.notes)
    for fragment in (
        "TokenMDP.at_least_k(V = 8, T = 12, k = 3, seed = 0",
        "mini-batch of 16 sequences per update, rollout batch N·16",
        "lag 0, 8 optimizer update(s)",
        "40 steps, exact J every 4",
        "seeds 0, 1",
        "Final J at N = 4, L = 0",
        "Final J at N = 4, L = 8",
        "N = 4, L = 8: age 0–11 (mean 8.3), 12 of 40 steps on θ₀'s samples",
        "VESPO's claim",
        "(fewer than 8 seeds: ordering not claimed)",
    ):
        assert fragment in text, fragment
    # two seeds cannot show the control: every verdict is "not testable", from the data
    assert "REPRODUCED" not in text and "NOT reproduced" not in text
    assert text.count("not testable in this setting") == 2


def made_up_runs(counts: dict, **columns) -> pd.DataFrame:
    """Per-run rows: ``counts[recipe]`` = {label: number of seeds}; drift False."""
    rows = [
        {"recipe": r, "failure": lab, "drift": False, **columns}
        for r, labels in counts.items()
        for lab, n in labels.items()
        for _ in range(n)
    ]
    return pd.DataFrame(rows)


def test_staleness_claim_needs_the_positive_control():
    paper = {"vespo": {"ok": 8}, "grpo": {"collapse": 5, "ok": 3}, "sapo": {"collapse": 8}}
    yes = staleness_curves.claim_verdict(
        made_up_runs({**paper, "naive": {"collapse": 6, "ok": 2}}), "x"
    )
    assert "REPRODUCED" in yes and "collapsed in 6 of 8 seeds" in yes
    weak = staleness_curves.claim_verdict(
        made_up_runs({**paper, "naive": {"collapse": 5, "ok": 3}}), "x"
    )
    assert "not testable in this setting" in weak and "collapsed in 5 of 8 seeds (< 6" in weak
    assert "REPRODUCED" not in weak
    missing = staleness_curves.claim_verdict(made_up_runs(paper), "x")
    assert "not testable" in missing and "no uncorrected control" in missing
    control = {"naive": {"collapse": 8}}
    stalled = {**paper, **control, "vespo": {"stall": 7, "ok": 1}}  # never learned: not stable
    assert "NOT reproduced" in staleness_curves.claim_verdict(made_up_runs(stalled), "x")
    held = {**paper, **control, "grpo": {"collapse": 3, "ok": 5}}
    text = staleness_curves.claim_verdict(made_up_runs(held), "x")
    assert "NOT reproduced" in text and "GRPO (bypass) collapsed in fewer than half" in text
    assert "VESPO (bypass): ok 8" in text


def test_ordering_prints_ties_within_2_se_and_non_finite_se():
    frame = pd.DataFrame(
        {"recipe": ["grpo", "vespo", "tis", "naive"], "J_final": [0.9, 0.85, 0.5, 0.1],
         "J_final_se": [0.02, 0.02, 0.01, np.nan], "runs": 8}
    )  # fmt: skip
    text = staleness_curves.ordering(frame)
    assert text == (
        "GRPO (bypass) 0.900 ± 0.020 ≈ VESPO (bypass) 0.850 ± 0.020 > token-TIS (decoupled) "
        "0.500 ± 0.010 ≈ naive (bypass) 0.100 ± n/a (2 of 6 pairs apart by > 2 SE)"
    )
    assert "not claimed" in staleness_curves.ordering(frame.assign(runs=4))


def test_staleness_draw(stale):
    with style.context():
        fig = staleness_curves.draw(stale)
    assert isinstance(fig, Figure)
    axes = [ax for ax in fig.get_axes() if ax.get_visible() and ax.lines]
    assert len(axes) == len(stale.config.panels)
    assert axes[0].get_title().startswith("N = 1, L = 0")
    assert axes[-1].get_title() == "N = 4, L = 8"
    assert any("VESPO's claim" in t.get_text() for sub in fig.subfigs for t in sub.texts)


def test_figure_config_errors():
    with pytest.raises(ValueError, match="unknown recipe"):
        staleness_curves.Config(recipes=("grpo", "ppo"))
    with pytest.raises(ValueError, match="staleness values N must be >= 1"):
        staleness_curves.Config(staleness=(0, 4))
    with pytest.raises(ValueError, match="lags >= 0"):
        staleness_curves.Config(lags=(-1,))
    with pytest.raises(ValueError, match="non-empty"):
        mismatch_curves.Config(mismatches=())
    with pytest.raises(ValueError, match="non-empty"):
        collapse_map.Config(T=())


# --- mismatch_curves ------------------------------------------------------------------------------


def test_mismatch_none_panel_coincides_and_mismatch_separates(mism):
    none = J_by(mism.table, mismatch="none")
    first = next(iter(none.values()))
    for v in none.values():  # N = 1, no mismatch: c = 1 for every recipe, to rounding
        np.testing.assert_allclose(v, first, rtol=1e-10)
    label = mism.mismatch_order[-1]
    assert label.startswith("bf16 + spikes")
    spiked = mism.table[mism.table["mismatch"] == label]
    assert (spiked["max_abs_log_ratio"] > 0).all()  # μ ≠ π on every mini-batch
    assert len({tuple(v) for v in J_by(mism.table, mismatch=label).values()}) > 1
    assert (mism.curves["runs"] == len(mism.config.seeds)).all()


def test_mismatch_notes_and_verdict(mism):
    text = "\n".join(mism.notes)
    for fragment in ("answer_correct(V = 6, T = 10", "seeds 0, 1", "Staleness N = 1, no lag",
                     "rounded to bf16", "rl-collapse's claim", "Per-token KL(π‖μ) reached",
                     "not testable in this setting"):  # fmt: skip
        assert fragment in text, fragment
    kl = mism.table[mism.table.recorded & (mism.table.mismatch == mism.mismatch_order[-1])]
    assert f"largest {kl['kl_tok'].max():.2g}" in text
    assert ("outside that range" in text) == (
        kl["kl_tok"].max() > 1e-2 or kl["kl_tok"].median() < 1e-4
    )
    seq = {"mis": {"ok": 8}, "geo_mask": {"ok": 7, "stall": 1}}
    yes = mismatch_curves.claim_verdict(
        made_up_runs({"tis": {"collapse": 4, "ok": 4}, **seq, "naive": {"collapse": 7, "ok": 1}}),
        "m",
    )
    assert "REPRODUCED" in yes
    no_control = mismatch_curves.claim_verdict(
        made_up_runs({"tis": {"collapse": 8}, **seq, "naive": {"ok": 8}}), "m"
    )
    assert "not testable in this setting" in no_control and "collapsed in 0 of 8" in no_control
    held = mismatch_curves.claim_verdict(
        made_up_runs({"tis": {"ok": 8}, **seq, "naive": {"collapse": 8}}), "m"
    )
    assert "NOT reproduced" in held and "did not collapse" in held


def test_mismatch_draw(mism):
    with style.context():
        fig = mismatch_curves.draw(mism)
    axes = [ax for ax in fig.get_axes() if ax.lines]
    assert [ax.get_title() for ax in axes] == ["no mismatch", mism.mismatch_order[1]]


# --- collapse_map ---------------------------------------------------------------------------------


def test_collapse_map_grid(cmap):
    cfg, grid = cmap.config, cmap.grid
    expected = set(itertools.product(cfg.recipes, cfg.staleness, cfg.T))
    assert set(zip(grid.recipe, grid.N, grid["T"], strict=True)) == expected
    runs = cmap.runs
    manual = (runs.J_final - runs["T"].map(cmap.J_start)) / (
        runs["T"].map(cmap.J_star) - runs["T"].map(cmap.J_start)
    )
    np.testing.assert_allclose(runs.gain, manual, rtol=1e-12)
    on = grid[grid.N == 1].pivot(index="T", columns="recipe", values="gain")
    for r in cfg.recipes:  # N = 1: on-policy REINFORCE (aggregations agree to rounding)
        np.testing.assert_allclose(on[r], on[cfg.recipes[0]], rtol=1e-9)
    assert (grid.gain > 0).all()  # every cell learned something in the small setting
    for T in cfg.T:
        env = TokenMDP.answer_correct(V=cfg.V, T=T)
        assert cmap.J_start[T] == env.J() and cmap.J_star[T] == 1.0
    text = "\n".join(cmap.notes)
    assert "Normalised final gain at N = 4, T = 10" in text and "VESPO's claim" in text


def test_collapse_map_draw(cmap):
    with style.context():
        fig = collapse_map.draw(cmap)
    heatmaps = [ax for ax in fig.get_axes() if ax.images]
    assert len(heatmaps) == len(cmap.config.recipes)
    cells = len(cmap.config.staleness) * len(cmap.config.T)
    assert all(len(ax.texts) == cells for ax in heatmaps)


# --- analysis -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        TokenMDP.at_least_k(V=3, T=5, k=3, seed=1),
        TokenMDP.at_least_k(V=4, T=5, k=2, eos=3, seed=2),
        TokenMDP.markov(V=3, T=4, target=2, eos=1, seed=0),
        TokenMDP.parity(V=4, T=4, seed=3),
        TokenMDP.answer_correct(V=3, T=4, seed=4),
    ],
    ids=["at_least_k", "at_least_k_eos", "markov_eos", "parity", "answer_correct"],
)
def test_optimal_J_is_the_best_sequence_by_enumeration(env):
    """Every automaton state is its own policy class: a deterministic policy can emit any
    single sequence, so J* = the largest reward over all sequences (enumerated)."""
    support = env.support(env.pi)
    assert optimal_J(env) == support.rewards.max()


def test_optimal_J_of_shared_classes_is_an_upper_bound():
    env = TokenMDP.iid(V=3, T=4, answer=1, seed=0)
    assert optimal_J(env) == 1.0 >= env.J()


def test_collapsed_and_gain():
    assert collapsed(0.1, 0.9, 0.3)  # lost 0.6 of a 0.8 gain
    assert not collapsed(0.1, 0.9, 0.6)  # lost 0.3 < 0.4
    assert not collapsed(0.5, 0.5, 0.1)  # never improved: stalled, not collapsed
    assert collapsed(0.2, 0.4, 0.1)  # ends below its start
    with pytest.raises(ValueError, match="fraction"):
        collapsed(0, 1, 0, fraction=0)
    np.testing.assert_allclose(normalized_gain([0.2, 1.0, 0.0], 0.2, 1.0), [0.0, 1.0, -0.25])
    assert np.isnan(normalized_gain(0.5, 1.0, 1.0))


def test_run_summary_and_band_on_a_known_table():
    steps = np.arange(20)
    J = np.concatenate([np.linspace(0.1, 0.9, 10), np.linspace(0.9, 0.2, 10)])
    table = pd.DataFrame(
        {
            "run": np.repeat([0, 1], 20),
            "step": np.tile(steps, 2),
            "recorded": True,
            "J": np.concatenate([J, np.linspace(0.1, 0.5, 20)]),
            "cosine": 0.5,
            "zero_frac": 0.25,
            "chi2_seq": np.tile(steps, 2) * 0.1,
        }
    )
    s = run_summary(table, "run").set_index("run")
    assert s.loc[0, "J_peak"] == pytest.approx(0.9) and bool(s.loc[0, "collapsed"])
    assert s.loc[0, "J_final"] == pytest.approx(J[-2:].mean())  # last 10% of 20 steps
    assert s.loc[1, "J_final"] == pytest.approx(np.linspace(0.1, 0.5, 20)[-2:].mean())
    assert not bool(s.loc[1, "collapsed"])
    assert s.loc[1, "J_mean"] == pytest.approx(0.3) and s.loc[0, "chi2_seq_max"] == pytest.approx(
        1.9
    )
    b = band(table.assign(g="x"), "g")
    assert (b["runs"] == 2).all() and len(b) == 20
    np.testing.assert_allclose(b["mean"], (J + np.linspace(0.1, 0.5, 20)) / 2)
    with pytest.raises(KeyError, match="no column"):
        run_summary(table, "nope")


# --- recipes --------------------------------------------------------------------------------------


def test_recipes():
    for name, r in recipes.RECIPES.items():
        est = recipes.recipe(name, group_size=4)
        assert est.name == r.label and est.mapping == mappings.get(r.mapping, preset=r.preset)
        assert est.aggregation == r.aggregation and est.advantage == "grpo"
        assert est.group_size == 4
        assert recipes.recipe_of(r.mapping, r.aggregation, r.correction) == name
        entry = recipes.recipe_entry(name, 4)
        assert entry["mapping"] == r.mapping and entry["aggregations"] == [r.aggregation]
        assert recipes.recipe_label(name).endswith(f"({r.mode})")
        if r.mode == "bypass":  # one ratio π/μ: no correction
            assert est.correction is None and "correction" not in entry
        else:  # mapping on π/π_old × correction on π_old/μ
            assert est.correction.name == r.correction and est.mode == "decoupled"
    assert recipes.recipe("gspo").mapping.eps_low == 3e-4  # the paper's band, not the libraries'
    # token-TIS is Yao et al.'s decoupled PPO × TIS, not REINFORCE × min(π/μ, 2)
    tis = recipes.recipe("tis")
    assert tis.mapping.name == "ppo_clip" and tis.correction.name == "tis_token"
    # ppo_tis: verl's vanilla PPO loss, whose dual clip clip_ratio_c = 3 is always on
    assert recipes.recipe("ppo_tis").mapping.name == "dual_clip"
    assert recipes.recipe("ppo_tis").mapping.c_dual == 3.0
    assert recipes.recipe_of("ppo_clip", "token-mean") is None
    with pytest.raises(ValueError, match="decoupled recipe has a correction"):
        recipes.Recipe("x", "ppo_clip", None, "token-mean", "bypass", "tis_token")


def test_decoupled_ppo_tis_first_update_is_reinforce():
    """N = 1, no lag, no mismatch: π = π_old = μ, so decoupled PPO × TIS has c = 1·1 and its
    first update equals on-policy REINFORCE's (same seed, same batch) to 1e-6."""
    from simkit.train import TrainConfig, train

    env = TokenMDP.at_least_k(V=4, T=6, k=2, seed=1, scale=0.5)
    thetas = {}
    for name in ("tis", "naive"):
        seen = []
        cfg = TrainConfig(recipes.recipe(name, 4), steps=2, batch=16, lr=0.1)
        train(env, cfg, seed=3, callback=lambda s, th, seen=seen: seen.append(np.array(th)))
        thetas[name] = seen[1]
    assert np.abs(thetas["tis"] - env.logits).max() > 1e-3  # it moved
    np.testing.assert_allclose(thetas["tis"], thetas["naive"], rtol=0, atol=1e-6)
    with pytest.raises(KeyError, match="available recipes: grpo"):
        recipes.recipe("ppo")


# --- drift notes (issue 16: every training figure states the drift it reached) -------------------


def test_training_figures_state_the_drift_reached(stale, mism, cmap):
    for data in (stale, mism, cmap):
        text = "\n".join(data.notes)
        largest = data.runs["kl_seq_max"].max()
        assert f"largest KL_seq(π‖μ) at a recorded step {largest:.3g} nats" in text
        assert largest == data.table.loc[data.table["recorded"], "kl_seq"].max()


def test_every_recipe_is_drawn_distinctly():
    """Two recipes on one plot never share colour and line style (token-TIS is decoupled PPO
    clip × TIS: its mapping is GRPO's, so it takes TIS's colour)."""
    looks = {
        name: (
            staleness_curves.recipe_style(name)["color"],
            staleness_curves.recipe_style(name)["linestyle"],
        )
        for name in recipes.RECIPES
    }
    assert len(set(looks.values())) == len(looks), looks
    assert looks["tis"][0] == style.color("tis_token") != looks["grpo"][0]
