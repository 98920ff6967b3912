"""Sentences that state a measured result follow the data (issue 12 §5).

Each figure of sci-figs builds its verdict sentences (notes, title verdicts) from its data. For
each one: the sentence on the real (small) data says what the data shows, and the same builder
fed *perturbed* data — data that no longer supports the sentence — says something else.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from simkit import mappings
from simkit.figures import (
    _claims,
    _common,
    bandit_bias_variance,
    bias_variance_frontier,
    collapse_map,
    ess_khat_vs_T,
    length_trap,
    same_kl_different_chi2,
    vespo_bound,
)

# one xdist worker runs this module, so that
# bandit_small_data (session fixture, shared with tests/test_figures.py) is computed once
pytestmark = pytest.mark.xdist_group("bandit_small_data")

# --- shared helpers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "unbounded"),
    [
        ("naive", False),
        ("is_token", True),
        ("is_seq", True),
        ("power", True),
        ("ppo_clip", True),  # A < 0 branch: c = r for r > 1 − ε
        ("dual_clip", False),
        ("tis_seq", False),
        ("mis_seq", False),
        ("vespo", False),
        ("geo_mask", False),
    ],
)
def test_coefficient_unbounded(name, unbounded):
    assert _claims.coefficient_unbounded(mappings.get(name)) is unbounded


def test_growth_verdicts():
    import pandas as pd

    frame = pd.DataFrame(
        {
            "mapping": ["a", "a", "b", "b", "c", "c", "d", "d"],
            "x": [1, 2] * 4,
            "v": [1.0, 3.0, 1.0, 1.5, 1.0, 0.2, 0.0, 1.0],
        }
    )
    table = _claims.growth(frame, "v", "x")
    assert table.verdict.to_dict() == {"a": "grows", "b": "flat", "c": "falls", "d": "undefined"}
    with pytest.raises(ValueError, match="factor"):
        _claims.growth(frame, "v", "x", factor=1.0)


def test_every_family_has_a_panel():
    from simkit.figures import style

    families = {s.family for s in style.MAPPING_STYLES.values()} - {"reference"}
    drawn = {f for fams in _claims.PANELS.values() for f in fams}
    assert families <= drawn
    assert _claims.panel_of("naive") is None  # a reference, drawn in every panel


# --- length_trap --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trap():
    return length_trap.compute(length_trap.config(small=True))


def _with_kept(data, mask, measure, T, value):
    k = data.kept.copy()
    sel = (k["mask"] == mask) & (k.measure == measure) & (k["T"] == T)
    assert sel.any()
    k.loc[sel, "fraction"] = value
    return dataclasses.replace(data, kept=k)


def test_length_trap_one_sided_note_follows_the_markov_floor(trap):
    note = length_trap.one_sided_note(trap)
    assert "never below the Markov floor" in note
    mu = trap.kept[
        (trap.kept["mask"] == "mis_seq_one_sided")
        & (trap.kept.measure == "mu_samples")
        & (trap.kept.method == "exact")
    ].set_index("T")
    for T in trap.config.report_lengths:  # the quoted numbers are the data's
        assert f"{mu.fraction[T]:.3f}" in note
    bad = _with_kept(trap, "mis_seq_one_sided", "mu_samples", 256, 0.5)
    changed = length_trap.one_sided_note(bad)
    assert "BELOW the Markov floor" in changed and "never below" not in changed


def test_length_trap_pi_mass_trend_follows_the_data(trap):
    assert "falls" in length_trap.one_sided_note(trap)
    lengths = trap.config.report_lengths
    bumped = _with_kept(trap, "mis_seq_one_sided", "pi_mass", lengths[-1], 0.99)
    assert "not monotone" in length_trap.one_sided_note(bumped)


def test_length_trap_two_sided_note_names_the_rejecting_bound(trap):
    assert "through its lower bound" in length_trap.two_sided_note(trap)
    rej = trap.rejected.copy()
    sel = (rej["mask"] == "mis_seq_two_sided") & (rej.measure == "mu_samples")
    low = rej.loc[sel & (rej.side == "low"), "fraction"].to_numpy()
    high = rej.loc[sel & (rej.side == "high"), "fraction"].to_numpy()
    rej.loc[sel & (rej.side == "low"), "fraction"] = high
    rej.loc[sel & (rej.side == "high"), "fraction"] = low
    swapped = dataclasses.replace(trap, rejected=rej)
    assert "through its upper bound" in length_trap.two_sided_note(swapped)


def test_length_trap_geo_note_follows_the_data(trap):
    assert "all but" in length_trap.geo_note(trap)
    low = _with_kept(trap, "geo_mask", "pi_mass", 64, 0.42)
    assert "at least 0.420" in length_trap.geo_note(low)


# --- same_kl_different_chi2 ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def same_kl():
    return same_kl_different_chi2.compute(same_kl_different_chi2.config(small=True))


def test_same_kl_verdict_on_the_data(same_kl):
    v = same_kl_different_chi2.verdict(same_kl)
    assert "is_seq" in v["grows"] and "vespo" not in v["grows"]
    assert not v["grows_bounded"]
    assert same_kl_different_chi2.headline(same_kl).startswith("at fixed KL, only unbounded")
    assert "every one of them has an unbounded coefficient" in same_kl.attrs["notes"][1]


def test_same_kl_verdict_changes_when_a_bounded_coefficient_grows(same_kl):
    data = same_kl.copy()
    sel = (data.mapping == "vespo") & (data.target_chi2 == data.target_chi2.max())
    data.loc[sel, "variance"] *= 100
    v = same_kl_different_chi2.verdict(data)
    assert v["grows_bounded"] == ["vespo"]
    assert "including vespo, whose coefficient is bounded" in same_kl_different_chi2.notes(data)[1]
    assert "bounded coefficients included" in same_kl_different_chi2.headline(data)


def test_same_kl_verdict_changes_when_nothing_grows(same_kl):
    data = same_kl.copy()
    first = data.groupby("mapping").variance.transform(
        lambda v: v.iloc[np.argmin(data.loc[v.index, "target_chi2"].to_numpy())]
    )
    data["variance"] = first  # every curve flat
    assert same_kl_different_chi2.verdict(data)["grows"] == []
    assert "no estimator" in same_kl_different_chi2.headline(data)


# --- bandit_bias_variance -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bandit(bandit_small_data):  # conftest: computed once for this module and test_figures'
    return bandit_small_data


def test_bandit_gspo_clip_note_follows_the_data(bandit):
    gspo = bandit[bandit.mapping == "gspo"]
    assert (gspo.outside_clip_range > 0.9).all()  # paper's ε on a one-token bandit
    note = next(n for n in bandit.attrs["notes"] if n.startswith("GSPO"))
    assert "clipped almost always" in note
    data = bandit.copy()
    data.loc[data.mapping == "gspo", "outside_clip_range"] = 0.2
    changed = next(n for n in bandit_bias_variance.notes(data) if n.startswith("GSPO"))
    assert "clipped rarely" in changed and "20.0%" in changed


def test_bandit_zero_fraction_is_exact():
    """P_μ(c = 0) of mis_seq equals the μ-mass of the arms outside its band (both signs)."""
    env = bandit_bias_variance.make_bandit(8, 0)
    from simkit import shifts

    mu = shifts.dial(env.pi, 3.0, divergence="chi2", family="logit_noise")
    est = _common.oracle_estimators(["mis_seq", "gspo"])
    zero, outside = bandit_bias_variance.zero_fractions(env, mu, est)
    m = est[0].mapping
    r = env.pi / mu
    assert zero["mis_seq"] == pytest.approx(float(mu @ ((r < m.c_low) | (r > m.c_high))), abs=1e-14)
    g = est[1].mapping
    assert outside["gspo"] == pytest.approx(
        float(mu @ ((r < 1 - g.eps_low) | (r > 1 + g.eps_high))), abs=1e-14
    )
    assert np.isnan(outside["mis_seq"])


def test_bandit_unbiased_note_follows_the_data(bandit):
    note = next(n for n in bandit.attrs["notes"] if n.startswith("Exactly unbiased"))
    assert "is_seq" in note.split(";")[0]
    data = bandit.copy()
    sel = (data.mapping == "is_seq") & (data.chi2_tok == data.chi2_tok.max())
    data.loc[sel, "bias"] = 0.05
    changed = next(n for n in bandit_bias_variance.notes(data) if n.startswith("Exactly unbiased"))
    assert "is_seq" not in changed.split(";")[0]
    assert "is_seq (χ²" in changed


def _ranking_lines(notes):
    return [n for n in notes if n.startswith(("Rankings", "n = ", "The leader", "By MSE"))]


def test_bandit_ranking_notes_follow_the_ensemble(bandit):
    ens = bandit.attrs["ensemble"]
    assert ens.instance.nunique() >= 20
    lines = _ranking_lines(bandit.attrs["notes"])
    assert lines[0].startswith(f"Rankings by rel_mse_scaled over {ens.instance.nunique()} random")
    # make vespo the best of all by far at one setting: the note names it with 20/20
    chi2, n = float(ens.target_chi2.max()), int(ens.n.min())
    moved = bandit.copy()
    e = ens.copy()
    sel = (e.mapping == "vespo") & (e.target_chi2 == chi2) & (e.n == n)
    e.loc[sel, "rel_mse_scaled"] = 1e-6
    moved.attrs["ensemble"] = e
    m = e.instance.nunique()
    line = next(x for x in bandit_bias_variance.notes(moved) if x.startswith(f"n = {n}, leader"))
    assert f"vespo (median 1e-06; best of all in {m}/{m} instances" in line
    assert "vespo at " in line.split(".")[0]  # the leader along χ² changes to vespo at the end
    # and worst of all: it is not named as a leader anywhere
    e.loc[sel, "rel_mse_scaled"] = 1.0
    worst = next(x for x in bandit_bias_variance.notes(moved) if x.startswith(f"n = {n}, leader"))
    assert "vespo (median" not in worst


def test_bandit_ranking_needs_twenty_instances(bandit):
    small = bandit.copy()
    ens = bandit.attrs["ensemble"]
    small.attrs["ensemble"] = ens[ens.instance < 19]
    lines = _ranking_lines(bandit_bias_variance.notes(small))
    assert lines == ["Rankings: none stated (an ensemble of 19 < 20 instances)."]


def test_bandit_zero_estimator_and_kept_notes_follow_the_data(bandit):
    note = next(n for n in bandit.attrs["notes"] if n.startswith("ĝ ≡ 0 has MSE"))
    data = bandit.copy()
    data["mse"] = data.mse_zero * 2  # every mapping worse than doing nothing
    total = data.mapping.nunique()
    changed = next(n for n in bandit_bias_variance.notes(data) if n.startswith("ĝ ≡ 0 has MSE"))
    assert changed != note and changed.count(f"{total} of {total} mappings") == len(data.n.unique())
    kept = next(n for n in bandit.attrs["notes"] if n.startswith("Kept fraction"))
    assert "gspo" in kept and "naive" not in kept
    data = bandit.copy()
    data.loc[data.mapping == "naive", "kept_exact"] = 0.5
    if "kept" in data:
        data.loc[data.mapping == "naive", "kept"] = 0.5
    changed = next(n for n in bandit_bias_variance.notes(data) if n.startswith("Kept fraction"))
    assert "naive 50%" in changed


def test_leaders_equal_a_hand_count():
    from simkit.figures import _rankings

    rows = []
    values = {"a": [0.1, 0.5, 0.2, 0.3], "b": [0.2, 0.4, 0.3, 0.4], "c": [0.9, 0.9, 0.9, 0.05]}
    for name, vs in values.items():
        for i, v in enumerate(vs):
            rows.append({"instance": i, "estimator": name, "x": 1.0, "rel_mse_scaled": v})
    lead = _rankings.leaders(pd.DataFrame(rows), settings=("x",)).iloc[0]
    # medians: a 0.25, b 0.35, c 0.9; a best of all at 0 and 2; a beats b at 0, 2, 3
    assert (lead.leader, lead.runner_up, lead.best, lead.beats, lead.instances) == (
        "a",
        "b",
        2,
        3,
        4,
    )
    assert lead["median"] == pytest.approx(0.25)
    text = _rankings.leader_sentence(lead, "x = 1")
    assert text == (
        "x = 1: a (median 0.25; best of all in 2/4 instances, beats the runner-up b (0.35) in 3/4)"
    )


def test_with_scale_free_equals_the_vector_formula():
    """The row-level reconstruction equals metrics.scale_free on the vectors themselves."""
    from simkit.experiment.metrics import scale_free
    from simkit.figures import _rankings

    rng = np.random.default_rng(0)
    rows, want = [], []
    for _ in range(5):
        mean, grad = rng.normal(size=6), rng.normal(size=6)
        variance = float(rng.uniform(0.1, 2.0))
        bias = float(np.linalg.norm(mean - grad))
        cosine = mean @ grad / np.linalg.norm(mean) / np.linalg.norm(grad)
        rows.append(
            {"bias": bias, "variance": variance, "snr": mean @ mean / variance, "cosine": cosine}
        )
        want.append(scale_free(mean, variance, grad))
        rows[-1]["zero"] = float(grad @ grad)
    table = pd.DataFrame(rows)
    got = _rankings.with_scale_free(table, table.zero.to_numpy())
    for k, w in enumerate(want):
        for key, value in w.items():
            assert got[key].iloc[k] == pytest.approx(value, rel=1e-10, abs=1e-14), key
    zero = _rankings.with_scale_free(
        pd.DataFrame([{"bias": 2.0, "variance": 0.0, "snr": np.nan, "cosine": np.nan}]), 4.0
    )
    assert zero.rel_mse_scaled.iloc[0] == 1.0 and zero.alpha_star.iloc[0] == 0.0
    # a tiny signal (a rejection sampler that keeps almost nothing) stays near 1, no cancellation
    tiny = _rankings.with_scale_free(
        pd.DataFrame([{"bias": 2.0, "variance": 1e-40, "snr": 1e-3, "cosine": 1.0}]), 4.0
    )
    assert tiny.rel_mse_scaled.iloc[0] == pytest.approx(1 - 1e-3 / (1 + 1e-3), rel=1e-12)


# --- vespo_bound, ess_khat_vs_T, bias_variance_frontier ------------------------------------------


def test_vespo_note_attributes_the_fall_to_z_only_when_z_falls():
    data = vespo_bound.compute(vespo_bound.config(small=True))
    assert all("mainly because φ(W) → 0" in n for n in data.attrs["notes"][1:])
    flat_z = data.copy()
    flat_z["Z"] = 0.9
    assert all("mostly at fixed Z" in n for n in vespo_bound.notes(flat_z)[1:])


def test_ess_khat_note_follows_the_data():
    data = ess_khat_vs_T.compute(ess_khat_vs_T.config(small=True))
    note = data.attrs["notes"][1]
    big = data[data.chi2_tok == data.chi2_tok.max()].sort_values("T")
    first = int(big[big.khat > 0.5]["T"].min())
    assert f"χ² = {big.chi2_tok.iloc[0]:g}: mean k̂ first exceeds 0.5 at T = {first}" in note
    low = data.copy()
    low["khat"] = 0.1
    assert ess_khat_vs_T.notes(low)[1].count("stays ≤ 0.5") == data.chi2_tok.nunique()
    assert "infinite variance" not in " ".join(data.attrs["notes"])


def test_frontier_notes_follow_the_data():
    data = bias_variance_frontier.compute(bias_variance_frontier.config(small=True))
    joins = data.attrs["notes"][1]
    assert "vespo" not in joins.split(";")[0]
    moved = data.copy()
    vespo = moved.index[moved.mapping == "vespo"]
    order = moved.loc[vespo].sort_values("value").index
    for row, end in ((order[0], "naive"), (order[-1], "is_seq")):
        ref = moved[moved.mapping == end].iloc[0]
        moved.loc[row, ["bias2", "variance"]] = [ref.bias2, ref.variance]
    assert "vespo" in bias_variance_frontier.notes(moved)[1].split(";")[0]
    # the best setting is judged by rel_mse_scaled: inside vs at an end
    best = moved.copy()
    best.loc[order[-1], "rel_mse_scaled"] = 0.0
    assert (
        "vespo at λ scale = 2 (rel_mse_scaled 0, an end of the sweep)"
        in bias_variance_frontier.notes(best)[2]
    )
    # where MSE picks another setting, the notes say so, and whether it is below ĝ ≡ 0's MSE
    shrink = data.copy()
    sapo = shrink.loc[shrink.mapping == "sapo"].sort_values("value").index
    shrink.loc[sapo[-1], "mse"] = 0.5 * shrink.mse_zero.iloc[0]
    shrink.loc[sapo[-1], "rel_mse_scaled"] = 0.99
    line = bias_variance_frontier.notes(shrink)[3]
    assert line.startswith("The MSE would pick another setting") and "sapo at τ scale" in line
    assert "below ĝ ≡ 0's; rel_mse_scaled 0.99" in line
    same = data.copy()
    same["mse"] = same.rel_mse_scaled  # the two criteria agree everywhere
    assert bias_variance_frontier.notes(same)[3] == "The MSE picks the same setting for every knob."


def test_frontier_regime_notes_follow_the_data():
    data = bias_variance_frontier.compute(bias_variance_frontier.config(small=True))
    regimes = data.attrs["regimes"]
    ratios = bias_variance_frontier.regime_ratios(regimes)
    # hand check of one ratio: tis_seq's best rel_mse_scaled over its sweep / naive's
    chi2, n = regimes.target_chi2.max(), regimes.n.max()
    at = regimes[(regimes.target_chi2 == chi2) & (regimes.n == n)]
    want = (
        at[at.mapping == "tis_seq"].rel_mse_scaled.min()
        / at[at.mapping == "naive"].iloc[0].rel_mse_scaled
    )
    got = ratios[(ratios.mapping == "tis_seq") & (ratios.target_chi2 == chi2) & (ratios.n == n)]
    assert got.ratio.iloc[0] == pytest.approx(want, rel=1e-12)
    moved = regimes.copy()
    sel = (moved.mapping == "tis_seq") & (moved.target_chi2 == chi2) & (moved.n == n)
    moved.loc[sel, "rel_mse_scaled"] = 2.0 * at[at.mapping == "naive"].iloc[0].rel_mse_scaled
    line = bias_variance_frontier.regime_notes(moved)[-1]
    assert "→ 2.000" in line.split("tis_seq")[1].split(",")[0]


def test_bandit_unreliable_rows_are_hollow_and_noted(bandit):
    """Where Monte Carlo rows carry ``reliable`` = False, the notes say so and the draw marks
    them hollow (``_common.mark_unreliable``)."""
    from simkit.figures import _common, style

    data = bandit.copy()
    data["reliable"] = np.where(data.exact, None, False)
    notes = bandit_bias_variance.notes(data)
    mc_rows = int((~data.exact.astype(bool)).sum())
    assert any(n.startswith(f"{mc_rows} Monte Carlo rows") for n in notes)
    data.attrs["notes"] = notes
    with style.context():
        fig = bandit_bias_variance.draw(data)
    hollow = [
        line
        for ax in fig.axes
        for line in ax.get_lines()
        if line.get_linestyle() == "None" and line.get_markerfacecolor() == "white"
    ]
    assert hollow
    assert not any(n.startswith("Monte Carlo rows") for n in bandit.attrs["notes"])
    assert any(_common.UNRELIABLE_NOTE in n for n in notes)


# --- collapse_map ---------------------------------------------------------------------------------


def collapse_grid(gains: dict, collapsed: set, stalled: set = frozenset()) -> pd.DataFrame:
    """A made-up collapse_map grid at N ∈ {1, 64}, T = 16 (8 seeds per cell): ``gains[recipe]``
    is the gain at N = 64 (1.0 at N = 1), ``collapsed`` the (recipe, N) cells with a collapsed
    run, ``stalled`` those where 5 of 8 runs stalled."""
    rows = [
        {"recipe": r, "N": N, "T": 16, "gain": g if N == 64 else 1.0, "gain_se": 0.01,
         "collapsed": int((r, N) in collapsed), "stall": 5 * ((r, N) in stalled), "runs": 8}
        for r, g in gains.items()
        for N in (1, 64)
    ]  # fmt: skip
    return pd.DataFrame(rows)


def collapse_runs(labels: dict) -> pd.DataFrame:
    """Per-run rows of the hardest cell (N = 64, T = 16): ``labels[recipe]`` = {label: n}."""
    rows = [
        {"recipe": r, "N": 64, "T": 16, "failure": lab, "drift": False}
        for r, counts in labels.items()
        for lab, n in counts.items()
        for _ in range(n)
    ]
    return pd.DataFrame(rows)


GAINS = {"grpo": 0.1, "gspo": 0.3, "sapo": 0.2, "vespo": 0.9, "tis": 0.5, "mis": 0.7}


def test_collapse_map_verdict_follows_the_data():
    """The ordering (ties within 2 SE), the lowest cells, the collapsed and stalled cells and
    VESPO's claim are read off the grid and the runs: the claim is judged only where the
    uncorrected control collapsed in ≥ 6 of 8 seeds, "not testable in this setting" elsewhere;
    a VESPO that stalled is not stable."""
    paper = {("grpo", 64), ("gspo", 64), ("sapo", 64)}
    text = "\n".join(collapse_map.paper_verdict(collapse_grid(GAINS, paper)))
    order = ["VESPO (bypass) 0.90", "seq-MIS (bypass) 0.70", "token-TIS (decoupled) 0.50",
             "GSPO (bypass) 0.30", "SAPO (bypass) 0.20", "GRPO (bypass) 0.10"]  # fmt: skip
    assert "N = 64, T = 16 (mean ± SE): " + " ± 0.01 > ".join(order) + " ± 0.01 (15 of 15" in text
    assert "Lowest cell per recipe: GRPO (bypass) 0.10 (N = 64, T = 16);" in text
    assert "Cells with a collapsed run: GRPO (bypass) (N = 64, T = 16); GSPO" in text
    assert "most runs stalled (never reached 50% of the achievable gain: neither stable nor " \
        "collapsed): none." in text  # fmt: skip
    close = "\n".join(collapse_map.paper_verdict(collapse_grid(GAINS | {"mis": 0.88}, paper)))
    assert "VESPO (bypass) 0.90 ± 0.01 ≈ seq-MIS (bypass) 0.88 ± 0.01 > token-TIS" in close
    calm = "\n".join(collapse_map.paper_verdict(collapse_grid(GAINS, set())))
    assert "No run collapsed (none lost more than 50% of its best gain)." in calm
    stall = "\n".join(collapse_map.paper_verdict(collapse_grid(GAINS, paper, {("vespo", 64)})))
    assert "stalled (never reached" in stall and "VESPO (bypass) (N = 64, T = 16)." in stall

    grid = collapse_grid(GAINS, paper)
    control = {"naive": {"collapse": 7, "ok": 1}}
    claim = {"vespo": {"ok": 8}, "grpo": {"collapse": 8}, "gspo": {"collapse": 6, "ok": 2},
             "sapo": {"collapse": 4, "ok": 4}}  # fmt: skip
    yes = "\n".join(collapse_map.paper_verdict(grid, collapse_runs({**claim, **control})))
    assert "at N = 64, T = 16: REPRODUCED" in yes
    untestable = collapse_runs({**claim, "naive": {"collapse": 2, "ok": 6}})
    no = "\n".join(collapse_map.paper_verdict(grid, untestable))
    assert "not testable in this setting" in no and "collapsed in 2 of 8 seeds" in no
    stalled_vespo = collapse_runs({**claim, **control, "vespo": {"stall": 8}})
    assert "NOT reproduced" in "\n".join(collapse_map.paper_verdict(grid, stalled_vespo))


# --- seq_tis_optimal_c ----------------------------------------------------------------------------


def test_seq_tis_notes_follow_the_data():
    from simkit.figures import seq_tis_optimal_c

    data = seq_tis_optimal_c.compute(seq_tis_optimal_c.config(small=True))
    opt = seq_tis_optimal_c.optima(data)
    # hand check: the C of lowest rel_mse_scaled at n_large, per χ²_seq
    for chi2, part in data[~data.at_c_star].groupby("chi2_seq"):
        want = part.loc[part.rel_mse_scaled_large.idxmin(), "c"]
        got = opt[(opt.chi2_seq == chi2) & (opt.criterion == "rel_mse_scaled_large")]
        assert got.c.iloc[0] == want
    moved = data.copy()
    top = moved.chi2_seq.max()
    sel = (moved.chi2_seq == top) & (moved.c == moved.c.max())
    moved.loc[sel, "rel_mse_scaled_large"] = 1e-9
    moved.loc[(moved.chi2_seq == top) & (moved.c == moved.c.min()), "mse_large"] = 0.0
    line = seq_tis_optimal_c.notes(moved)[-1]
    n = data.attrs["n_large"]
    assert f"n = {n}: MSE at C = 1, edge, below ĝ ≡ 0's, rel_mse_scaled at C = 100 (1e-09)" in line
