"""Figure lm_staleness_curves: the tiny Llama trained by simkit.lm.train under staleness N."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from simkit.figures import FIGURES
from simkit.figures import lm_staleness_curves as fig


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
    assert rec["J"].between(0, 1).all() and (rec["J_se"] >= 0).all()
    # the band is the SE over seeds of the recorded J
    c = data.curves.iloc[0]
    part = rec[(rec["recipe"] == c["recipe"]) & (rec["N"] == c["N"]) & (rec["step"] == c["step"])]
    assert c["J"] == pytest.approx(part["J"].mean())
    assert c["se"] == pytest.approx(part["J"].std() / np.sqrt(len(part)))
    # the simulator comparison is computed (same recipes and N)
    assert set(data.sim_summary["recipe"]) == set(cfg.recipes)
    assert set(data.sim_summary["N"]) == set(cfg.staleness)


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


def test_notes_follow_the_data(data):
    notes = "\n".join(data.notes)
    for recipe in ("GRPO", "VESPO", "token-TIS"):
        assert recipe in notes
    assert "seeds 0, 1" in notes and "Agreement at N = 4" in notes
    # LM and simulator final J at N = 4 set by recipe with tiny SEs: reversed, then agreeing
    recipes = list(data.config.recipes)
    up = {r: 0.1 + 0.4 * i for i, r in enumerate(recipes)}
    down = {r: 0.9 - 0.4 * i for i, r in enumerate(recipes)}

    def set_final(summary, values):
        out = summary.copy()
        at = out["N"] == 4
        out.loc[at, "J_final"] = out.loc[at, "recipe"].map(values)
        out.loc[at, "J_final_se"] = 1e-6
        return out

    s = set_final(data.summary, up)
    reversed_notes = fig.make_notes(data.config, s, data.table, set_final(data.sim_summary, down))
    assert reversed_notes != data.notes
    assert "of 3 recipe pairs, 0 ordered as in the simulator" in reversed_notes[-1]
    assert "3 reversed" in reversed_notes[-1]
    agreed = fig.make_notes(data.config, s, data.table, set_final(data.sim_summary, up))
    assert "3 ordered as in the simulator" in agreed[-1] and "0 reversed" in agreed[-1]
    # within 2 SE: not resolved
    wide = s.assign(J_final_se=1.0)
    tied = fig.make_notes(data.config, wide, data.table, set_final(data.sim_summary, up))
    assert "3 within 2 SE" in tied[-1]


def test_bad_config():
    with pytest.raises(ValueError, match="unknown recipe"):
        fig.Config(recipes=("nope",))
    with pytest.raises(ValueError, match="staleness"):
        fig.Config(staleness=(0,))
