"""Figure lm_staleness_curves: the tiny Llama trained by simkit.lm.train under staleness N."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from simkit.figures import FIGURES
from simkit.figures import lm_staleness_curves as fig

# one xdist worker runs this module: its `data` (≈ 15 s of training) is then computed once, not
# once on each worker that gets some of these tests (`make test` uses --dist loadgroup)
pytestmark = pytest.mark.xdist_group("lm_staleness_curves")


@pytest.fixture(scope="module")
def data():
    return fig.compute(fig.config(small=True))


def test_registered_after_collapse_regimes():
    names = list(FIGURES)
    assert names.index("lm_staleness_curves") == names.index("collapse_regimes") + 1


def test_small_compute_has_every_run(data):
    cfg = data.config
    runs = data.table.groupby(["recipe", "N", "seed"]).size()
    assert len(runs) == len(cfg.recipes) * len(cfg.staleness) * len(cfg.seeds)
    assert (runs == cfg.steps).all()
    assert set(data.summary["recipe"]) == set(cfg.recipes)
    rec = data.table[data.table["recorded"]]
    assert rec["J"].between(0, 1).all() and (rec["J_se"] == 0).all()  # exact J
    c = data.curves.iloc[0]
    part = rec[(rec["recipe"] == c["recipe"]) & (rec["N"] == c["N"]) & (rec["step"] == c["step"])]
    assert c["J"] == pytest.approx(part["J"].mean())
    assert c["se"] == pytest.approx(part["J"].std() / np.sqrt(len(part)))
    # the twin: same recipes, N and seeds; its J(π₀) is the LM's mean exact J(π₀)
    assert set(data.sim_summary["recipe"]) == set(cfg.recipes)
    assert set(data.sim_summary["N"]) == set(cfg.staleness)
    sim0 = data.sim_table[data.sim_table["step"] == 0]["J"]
    np.testing.assert_allclose(sim0, data.J0, rtol=1e-9)


def test_twin_has_the_lm_schedule():
    cfg = fig.config()
    tc = fig.twin_config(cfg, "tis", 8)
    lc = fig.lm_config(cfg, "tis", 8)
    assert tc.minibatches == lc.minibatches == 8
    assert tc.minibatch_size == lc.minibatch_size and tc.steps == lc.steps
    assert tc.lag_updates == lc.lag * 8 and tc.lr == lc.lr
    assert tc.max_grad_norm == lc.max_grad_norm and tc.mismatch.precision == lc.precision
    assert tc.estimator.correction.name == lc.correction == "tis_token"
    assert lc.mode == "decoupled" and lc.exact_J
    env = fig.twin_environment(cfg, 0.3)
    assert env.V == cfg.vocab_size and env.T == cfg.response_length
    assert env.J() == pytest.approx(0.3, abs=1e-9)
    assert len(cfg.seeds) >= 8


def test_recipes_use_the_simulators_losses():
    lc = fig.lm_config(fig.config(), "gspo", 8)
    assert lc.mapping == "gspo" and lc.aggregation == "seq-mean-token-mean"
    assert dict(lc.hyperparams)["eps_low"] == pytest.approx(3e-4)
    assert fig.lm_config(fig.config(), "vespo", 1).minibatches == 1


def test_reproducible_from_seeds(data):
    cfg = dataclasses.replace(data.config, recipes=("grpo",), staleness=(4,), seeds=(1,))
    again = fig.run_grid(cfg)
    ref = data.table[(data.table["recipe"] == "grpo") & (data.table["N"] == 4)]
    ref = ref[ref["seed"] == 1]
    np.testing.assert_array_equal(again["loss"].to_numpy(), ref["loss"].to_numpy())


def test_draw(data):
    f = fig.draw(data)
    assert len([ax for ax in f.get_axes() if ax.get_visible()]) >= len(data.config.staleness)


def per_seed(values: dict, N: int = 4, seeds=range(8), noise=1e-3) -> pd.DataFrame:
    """Made-up per-seed final J: recipe -> mean at N, plus a ± noise pattern over seeds."""
    rows = [
        {"recipe": r, "N": N, "seed": s, "J_final": m + noise * (-1) ** s, "collapsed": False}
        for r, m in values.items()
        for s in seeds
    ]
    return pd.DataFrame(rows)


def test_kendall_tau_and_resolved_pairs_follow_the_data():
    recipes = ["grpo", "vespo", "tis"]
    up = per_seed({"grpo": 0.1, "vespo": 0.5, "tis": 0.9})
    down = per_seed({"grpo": 0.9, "vespo": 0.5, "tis": 0.1})
    same = fig.compare(up, up, recipes, 4, 4)
    assert same["tau"] == pytest.approx(1.0) and same["lo"] == pytest.approx(1.0)
    assert same["resolved"] == same["agree"] == same["pairs"] == 3
    rev = fig.compare(up, down, recipes, 4, 4)
    assert rev["tau"] == pytest.approx(-1.0) and rev["resolved"] == 3 and rev["agree"] == 0
    flat = per_seed({"grpo": 0.5, "vespo": 0.5, "tis": 0.5}, noise=0.1)
    tied = fig.compare(up, flat, recipes, 4, 4)
    assert tied["resolved"] == 0 and tied["lo"] < tied["hi"]


def test_notes_follow_the_data(data):
    notes = "\n".join(data.notes)
    for fragment in ("GRPO", "VESPO", "token-TIS", "seeds 0, 1", "Kendall τ", "Trivial predictor",
                     "J exact on held-out prompts", f"J(π₀) = {data.J0:.3f}"):  # fmt: skip
        assert fragment in notes, fragment
    recipes = list(data.config.recipes)
    up = per_seed(dict(zip(recipes, (0.1, 0.5, 0.9), strict=True)), N=4)
    up = pd.concat([up, up.assign(N=1)])
    down = per_seed(dict(zip(recipes, (0.9, 0.5, 0.1), strict=True)), N=4)
    down = pd.concat([down, down.assign(N=1)])
    notes = fig.make_notes(data.config, up, down, data.table, data.J0)
    assert "Twin vs LM at N = 4: Kendall τ = -1.00" in notes[-2]
    assert "3 of 3 pairs resolved on both sides (> 2 SE), 0 of them agree" in notes[-2]
    assert "Kendall τ = 1.00" in notes[-1]  # the LM's N = 1 ordering equals its N = 4 one


def test_bad_config():
    with pytest.raises(ValueError, match="unknown recipe"):
        fig.Config(recipes=("nope",))
    with pytest.raises(ValueError, match="staleness"):
        fig.Config(staleness=(0,))
