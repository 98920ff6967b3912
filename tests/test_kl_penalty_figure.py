"""The ``kl_penalty_bias`` figure: its data are exact, and the sentences under it follow them."""

from __future__ import annotations

import numpy as np
import pytest

from simkit.figures import kl_penalty_bias as fig
from simkit.kl import kl_seq_and_grad


@pytest.fixture(scope="module")
def data():
    return fig.compute(fig.config(small=True))


def test_data_are_exact_and_complete(data):
    cfg = fig.config(small=True)
    pairs = len(fig.ESTIMATORS) * len(fig.PLACEMENTS) * len(fig.CORRECTIONS)
    assert len(data) == pairs * (2 * len(cfg.lengths) + len(cfg.betas))
    assert data.rel_kl_bias.notna().all() and data.rel_bias.notna().all()
    # β‖∇KL_seq‖ in the table is the DP's
    env, ref, _ = fig.policies(cfg, cfg.lengths[-1])
    _, grad = kl_seq_and_grad(env, ref)
    row = data[(data.sweep == "T") & (data["T"] == cfg.lengths[-1])].iloc[0]
    assert row.kl_grad_norm == pytest.approx(cfg.beta * np.linalg.norm(grad), rel=1e-12)


def test_the_unbiased_pairs_stated_from_enumeration(data):
    # on-policy only k1 in the reward (with or without π/μ = 1) gives ∇KL_seq at every T;
    # the per-state gradients (k2, "+", k3·π/μ, k1·π/μ in the loss) only at T = 1
    assert fig.unbiased(data, "on-policy") == ["k1 | reward | is", "k1 | reward | none"]
    assert fig.unbiased(data, "off-policy") == ["k1 | reward | none"]
    notes = data.attrs["notes"]
    assert notes[1].startswith("On-policy, unbiased at every T: k1 | reward | is; k1 | reward")
    assert "unbiased at T = 1 only: k1 | loss | is; k2 | loss | none; k3 | loss | is" in notes[1]
    assert "unbiased at T = 1 only: k1 | loss | is; k3 | loss | is." in notes[2]
    # the total's bias is the KL part's (is_seq is unbiased for ∇J), relative to another norm
    t = data[data.sweep == "T"]
    np.testing.assert_allclose(t.bias, t.kl_bias, atol=1e-14)


def test_notes_change_when_the_data_stop_supporting_them(data):
    broken = data.copy()
    hit = (broken.estimator == "k1") & (broken["where"] == "reward") & (broken["T"] == 2)
    broken.loc[hit & (broken.correction == "none"), "rel_kl_bias"] = 0.1
    lines = fig.notes(broken)
    assert "k1 | reward | none" not in lines[2].split("unbiased at every T: ")[1].split(";")[0]
    assert lines[2].startswith("Off-policy, unbiased at every T: none")
    fixed = data.copy()
    fixed.loc[(fixed.estimator == "k2") & (fixed["where"] == "loss"), "rel_kl_bias"] = 0.0
    assert "k2 | loss | none" in fig.notes(fixed)[1].split(";")[0] + fig.notes(fixed)[1]
    assert fig.unbiased(fixed, "on-policy").count("k2 | loss | none") == 1


def test_draw(data, tmp_path):
    figure = fig.draw(data)
    figure.savefig(tmp_path / "kl.png", dpi=40)
    assert (tmp_path / "kl.png").stat().st_size > 0


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="lengths must be distinct"):
        fig.Config(lengths=(1, 1))
    with pytest.raises(ValueError, match="beta must be > 0"):
        fig.Config(beta=0.0)
    with pytest.raises(ValueError, match="too many to enumerate"):
        fig.Config(lengths=(20,))
