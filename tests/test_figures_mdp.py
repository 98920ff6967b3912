"""Second-wave theory figures (issue 3): each compute(small) and what its data must satisfy."""

import dataclasses
import math

import numpy as np
import pytest

from simkit import figures, theory
from simkit.figures import (
    ess_khat_vs_T,
    gspo_length_conflation,
    length_trap,
    mse_vs_T,
    same_kl_different_chi2,
    seq_tis_optimal_c,
    seq_variance_vs_T,
    token_bias_vs_T,
    vespo_bound,
)

Z = 4.5  # stochastic checks: |estimate − truth| ≤ Z·SE, SE from the same draws

NEW_FIGURES = [
    "length_trap",
    "gspo_length_conflation",
    "vespo_bound",
    "ess_khat_vs_T",
    "seq_variance_vs_T",
]


@pytest.mark.parametrize("name", NEW_FIGURES)
def test_new_figures_are_registered_and_render(tmp_path, name):
    assert name in figures.available()
    module = figures.figure_module(name)
    assert module.NAME == name and module.TITLE and module.CAPTION
    png, pdf = figures.render(name, tmp_path, small=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 1000


# --- length_trap -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def length_trap_data():
    return length_trap.compute(length_trap.config(small=True))


def test_length_trap_data(length_trap_data):
    data = length_trap_data
    kept = data.kept
    assert set(kept.columns) >= {"T", "mask", "measure", "fraction"}
    assert set(kept["mask"]) == set(length_trap.MASKS)
    assert set(kept.measure) == set(length_trap.MEASURES)
    assert kept.fraction.between(0.0, 1.0 + 1e-12).all()
    cfg = data.config
    # V = 2: every length of the grid is exact (T + 1 count vectors)
    exact = kept[kept.method == "exact"]
    assert sorted(set(exact["T"])) == list(cfg.grid)
    # ρ̄ is defined under π: ρ̄ = exp(KL(π‖μ)), T* = log C / KL(π‖μ)
    assert data.kl_tok == pytest.approx(cfg.kl_tok, rel=1e-7)
    assert data.rho_bar == pytest.approx(math.exp(data.kl_tok), rel=1e-15)
    assert data.t_star == pytest.approx(math.log(cfg.c) / data.kl_tok, rel=1e-12)
    assert len(data.notes) == 4 and all(isinstance(n, str) and n for n in data.notes)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"kl_tok": 0.05}, {"kl_tok": 0.5, "c": 1.5}, {"V": 3, "kl_tok": 0.2, "c": 2.0}],
    ids=["kl0.002", "kl0.05", "kl0.5-c1.5", "V3"],
)
def test_length_trap_mu_samples_obey_markov_at_every_T(overrides):
    """P_μ(W ≤ C) ≥ 1 − 1/C at every T (E_μ[W] = 1, Markov): exact rows exactly, Monte Carlo
    rows within Z binomial SE (at the floor)."""
    base = {"lengths": (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597)}
    if overrides.get("V") == 3:
        base["lengths"] = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610)
    cfg = length_trap.Config(
        **base,
        report_lengths=(1, 55, base["lengths"][-1]),
        mc_lengths=(8, 89, 610),
        n_mc=400,
        **overrides,
    )
    data = length_trap.compute(cfg)
    k = data.kept
    one = k[(k["mask"] == "mis_seq_one_sided") & (k.measure == "mu_samples")]
    floor = 1 - 1 / cfg.c
    exact, mc = one[one.method == "exact"], one[one.method == "monte_carlo"]
    assert len(exact) == len(cfg.grid)
    assert (exact.fraction >= floor - 1e-12).all()
    se_floor = math.sqrt(floor * (1 - floor) / cfg.n_mc)
    assert (mc.fraction >= floor - Z * se_floor).all()
    # the π-mass of the same mask does fall: far below the μ-sample fraction at the longest T
    pi = k[(k["mask"] == "mis_seq_one_sided") & (k.measure == "pi_mass") & (k.method == "exact")]
    longest = pi["T"].max()
    assert pi[pi["T"] == longest].fraction.iloc[0] < exact[exact["T"] == longest].fraction.iloc[0]
    # the bound is not vacuous: under π (no E[W] = 1), the same mask falls below the floor
    assert pi[pi["T"] == longest].fraction.iloc[0] < floor


def test_length_trap_pi_mass_equals_enumeration():
    """π-mass = E_μ[W·1{kept}] and μ-samples = E_μ[1{kept}] by enumerating every sequence of the
    token MDP (TokenMDP.support), for all three masks, at small T."""
    from simkit.envs import TokenMDP

    cfg = length_trap.Config(
        V=3, kl_tok=0.3, c=2.0, lengths=(1, 2, 3, 5, 8), report_lengths=(2, 5, 8), mc_lengths=()
    )
    data = length_trap.compute(cfg)
    pi_tok, mu_tok = length_trap._token_pair(cfg)
    masks = length_trap.mask_mappings(cfg)
    k = data.kept.set_index(["T", "mask", "measure"]).fraction
    for T in cfg.lengths:
        env = TokenMDP.iid(V=cfg.V, T=T, seed=cfg.seed, scale=cfg.scale)
        np.testing.assert_allclose(env.pi[0, 0], pi_tok, rtol=0, atol=0)
        support = env.support(np.broadcast_to(mu_tok, env.pi.shape))
        assert len(support.prob) == cfg.V**T
        log_w = support.log_ratio.sum(axis=1)
        w = np.exp(log_w)
        for mask, mapping in masks.items():
            # kept = a non-zero coefficient of the registered mapping (every W > 0 here)
            coef = mapping.coefficients(support.log_ratio, support.mask, np.ones(len(w)))
            keep = coef[:, 0] != 0
            np.testing.assert_array_equal(keep, length_trap.kept(mapping, log_w, T))
            assert k[(T, mask, "pi_mass")] == pytest.approx(support.prob @ (w * keep), abs=1e-12)
            assert k[(T, mask, "mu_samples")] == pytest.approx(support.prob @ keep, abs=1e-12)
    # the one-sided mask at these sizes really does lose π-mass (the test is not vacuous)
    assert k[(8, "mis_seq_one_sided", "pi_mass")] < 0.9


def test_length_trap_monte_carlo_agrees_with_exact(length_trap_data):
    k = length_trap_data.kept
    n = length_trap_data.config.n_mc
    exact = k[k.method == "exact"].set_index(["T", "mask", "measure"]).fraction
    mc = k[k.method == "monte_carlo"]
    assert len(mc) == len(length_trap_data.config.mc_lengths) * 6
    index = list(zip(mc["T"], mc["mask"], mc.measure, strict=True))
    truth = np.clip(exact.loc[index].to_numpy(), 0.0, 1.0)
    se = np.sqrt(truth * (1 - truth) / n)
    assert (np.abs(mc.fraction.to_numpy() - truth) <= Z * se + 1e-12).all()


def test_length_trap_kept_handles_underflow():
    m = length_trap.mask_mappings(length_trap.config(small=True))
    log_w = np.array([-2000.0, 0.0, 2000.0])
    np.testing.assert_array_equal(
        length_trap.kept(m["mis_seq_one_sided"], log_w, 100), [True, True, False]
    )
    np.testing.assert_array_equal(
        length_trap.kept(m["mis_seq_two_sided"], log_w, 100), [False, True, False]
    )
    np.testing.assert_array_equal(
        length_trap.kept(m["geo_mask"], log_w, 10_000), [True, True, True]
    )


def test_length_trap_config_validation():
    with pytest.raises(ValueError, match="kl_tok"):
        length_trap.Config(kl_tok=0.0)
    with pytest.raises(ValueError, match="c "):
        length_trap.Config(c=1.0)
    with pytest.raises(ValueError, match="two_sided"):
        length_trap.Config(two_sided=(1.5, 3.0))
    with pytest.raises(ValueError, match="report_lengths"):
        length_trap.Config(lengths=(1, 2), report_lengths=(3,))
    with pytest.raises(ValueError, match="V must"):
        length_trap.Config(V=1)


# --- gspo_length_conflation --------------------------------------------------------------------


def test_gspo_length_conflation_data():
    cfg = gspo_length_conflation.config(small=True)
    data = gspo_length_conflation.compute(cfg)
    lines, cloud = data["lines"], data["cloud"]
    assert np.isfinite(lines[["gspo", "is_seq", "w_exact"]].to_numpy()).all()
    assert len(lines) == len(cfg.mean_log_ratios) * len(cfg.lengths)
    for m, part in lines.groupby("mean_log_ratio"):
        # VESPO Prop. E.1: equal mean log-ratio ⇒ equal GSPO weight s = e^m at every length
        np.testing.assert_allclose(part.gspo, np.exp(m), rtol=1e-12)
        # ... while the true weight is W = e^{T m} (registered is_seq mapping)
        np.testing.assert_allclose(part.is_seq, np.exp(part["T"] * m), rtol=1e-9)
        np.testing.assert_allclose(part.w_exact, np.exp(part["T"] * m), rtol=1e-15)
        longest = part[part["T"] == part["T"].max()].is_seq.iloc[0]
        assert abs(np.log(longest)) == pytest.approx(max(cfg.lengths) * abs(m), rel=1e-9)
    # the cloud: GSPO weight is e^{mean log-ratio}, W = e^{T·mean}; W spans decades at one s
    np.testing.assert_allclose(cloud.gspo, np.exp(cloud.mean_log_ratio), rtol=1e-12)
    np.testing.assert_allclose(cloud.is_seq, np.exp(cloud["T"] * cloud.mean_log_ratio), rtol=1e-9)
    near = cloud[(cloud.gspo > 1.005)]
    assert near.is_seq.max() / near.is_seq.min() > 10


def test_gspo_length_conflation_config_validation():
    with pytest.raises(ValueError, match="clip band"):
        gspo_length_conflation.Config(mean_log_ratios=(0.5,))


# --- vespo_bound -------------------------------------------------------------------------------


def test_vespo_count_vectors_enumerate_the_multinomial():
    counts = vespo_bound.count_vectors(5, 3)
    assert counts.shape == (math.comb(7, 2), 3)
    assert (counts.sum(axis=1) == 5).all() and (counts >= 0).all()
    assert len({tuple(c) for c in counts}) == len(counts)
    p = np.array([0.2, 0.3, 0.5])
    np.testing.assert_allclose(np.exp(vespo_bound.log_multinomial(counts, p)).sum(), 1, atol=1e-12)


def test_vespo_bound_data():
    cfg = vespo_bound.config(small=True)
    data = vespo_bound.compute(cfg)
    assert len(data) == cfg.n_chi2 * len(cfg.pairs)
    assert np.isfinite(data.drop(columns=[]).to_numpy(dtype=float)).all()
    # K from VESPO Prop. 3.1: K(2, 3) = e²/3, K(3, 2) = 1
    np.testing.assert_allclose(data[data.c1 == 2].K, math.e**2 / 3, rtol=1e-12)
    np.testing.assert_allclose(data[data.c1 == 3].K, 1.0, rtol=1e-12)
    # VESPO Prop. 3.1 holds at every point, exactly and on the empirical measure
    assert (data.second_moment <= data.bound * (1 + 1e-12)).all()
    assert (data.mc_second_moment <= data.mc_bound * (1 + 1e-12)).all()
    # the enumeration is exact: E_μ[W²] = (1 + χ²_tok)^T for i.i.d. tokens (docs/reference.md §F)
    np.testing.assert_allclose(data.w_second_moment, 1 + data.chi2_seq, rtol=1e-9)
    expected = theory.seq_is_second_moment(data.chi2_tok.to_numpy(), cfg.T)
    np.testing.assert_allclose(data.w_second_moment, expected, rtol=1e-9)
    # Monte Carlo agrees with the enumeration within Z·SE
    assert (np.abs(data.mc_second_moment - data.second_moment) <= Z * data.mc_se).all()
    # and φ's second moment stays bounded while sequence IS's grows
    assert data.second_moment.max() < 2 and data.w_second_moment.max() > 5


# --- ess_khat_vs_T -----------------------------------------------------------------------------


def test_ess_khat_vs_T_data():
    cfg = ess_khat_vs_T.config(small=True)
    data = ess_khat_vs_T.compute(cfg)
    assert len(data) == len(cfg.chi2_toks) * len(cfg.lengths)
    assert np.isfinite(data[["ess_frac", "ess_frac_se", "ess_frac_theory"]].to_numpy()).all()
    assert ((data.ess_frac <= 1) & (data.ess_frac >= 1 / cfg.n)).all()
    np.testing.assert_allclose(
        data.ess_frac_theory, 1 / (1 + data.chi2_tok) ** data["T"], rtol=1e-12
    )
    for chi2, part in data.groupby("chi2_tok"):
        part = part.sort_values("T")
        assert (np.diff(part.ess_frac.to_numpy()) < 0).all(), chi2  # ESS collapses with T
        # where χ²_seq ≤ 1 the Kish ratio estimates n/(1+χ²_seq): within Z·SE plus its O(1/n)
        # ratio-estimator bias (allowance 3/n)
        ok = part[part.chi2_seq <= 1]
        assert len(ok) >= 2
        gap = np.abs(ok.ess_frac - ok.ess_frac_theory)
        assert (gap <= Z * ok.ess_frac_se + 3 / cfg.n).all(), chi2
    # k̂ undefined where a batch has fewer distinct weights than the PSIS tail (T = 1 here)
    assert data[data["T"] == 1].khat.isna().all()
    defined = data.dropna(subset=["khat"])
    assert len(defined) >= 3
    big = defined[defined.chi2_tok == max(cfg.chi2_toks)]
    small = defined[defined.chi2_tok == min(cfg.chi2_toks)]
    assert big.khat.iloc[-1] > ess_khat_vs_T.KHAT_THRESHOLDS[1]  # unreliable at long T
    assert small.khat.iloc[0] < ess_khat_vs_T.KHAT_THRESHOLDS[0]  # fine at short T


def test_khat_or_nan():
    rng = np.random.default_rng(0)
    assert math.isnan(ess_khat_vs_T.khat_or_nan(np.log(rng.integers(1, 4, size=400))))
    assert ess_khat_vs_T.psis_tail_size(1000) == math.ceil(3 * math.sqrt(1000))
    # exact Pareto tail with shape k = 1/α = 0.8 (Vehtari et al. 2024): k̂ estimates k (SE
    # of the fit ≈ (1+k)/√M with M the tail size ≈ 95 at n = 1000; z = 4.5 allowance)
    log_w = np.log(rng.pareto(1 / 0.8, size=1000) + 1)
    khat = ess_khat_vs_T.khat_or_nan(log_w)
    assert abs(khat - 0.8) <= 4.5 * 1.8 / math.sqrt(95)


# --- seq_variance_vs_T -------------------------------------------------------------------------


def test_seq_variance_vs_T_data():
    cfg = seq_variance_vs_T.config(small=True)
    data = seq_variance_vs_T.compute(cfg)
    curves, iid_mc, markov = data["curves"], data["iid_mc"], data["markov"]
    for frame in (curves, iid_mc, markov):
        assert np.isfinite(frame.to_numpy(dtype=float)).all()
    # exact curve: Var W = (1+χ²)^T − 1 (docs/reference.md §F, independent tokens)
    np.testing.assert_allclose(curves.exact, (1 + curves.chi2_tok) ** curves["T"] - 1, rtol=1e-10)
    # Monte Carlo within Z·SE of the exact value (χ²_seq ≤ ~1 here: light enough tails)
    truth = (1 + iid_mc.chi2_tok) ** iid_mc["T"] - 1
    assert (np.abs(iid_mc.value - truth) <= Z * iid_mc.se).all()
    # Markov env: occupancy-averaged per-token χ² hits the target (behaviour's solve, 1e-6)
    np.testing.assert_allclose(markov.chi2_tok_achieved, markov.chi2_tok, rtol=1e-6)
    # T = 1: one state (start), so χ²_seq = χ²_tok exactly
    one = markov[markov["T"] == 1]
    np.testing.assert_allclose(one.dp, one.chi2_tok, rtol=1e-6)
    # the DP's χ²_seq and the Monte Carlo from env.sample agree within Z·SE
    assert (np.abs(markov.value - markov.dp) <= Z * markov.se).all()
    # χ²_seq grows with T
    for _, part in markov.groupby("chi2_tok"):
        assert (np.diff(part.sort_values("T").dp.to_numpy()) > 0).all()
    # the dense Markov DP curve contains the DP values at the Monte Carlo lengths
    dense = data["markov_curve"].set_index(["chi2_tok", "T"]).dp
    np.testing.assert_allclose(dense.loc[list(zip(markov.chi2_tok, markov["T"]))], markov.dp)
    assert iid_mc.reliable.all() and markov.reliable.all()  # light tails here


def test_seq_variance_vs_T_flags_points_that_miss_the_tail():
    """χ² = 0.1 per token: at T = 64 the n = 4000 draws cannot see the tail carrying E W² (the
    estimate is far below the exact value) and the point is marked unreliable; at T = 4 not."""
    cfg = seq_variance_vs_T.Config(
        V=6, chi2_toks=(0.1,), lengths=(4, 64), markov_lengths=(4, 64), n=4000
    )
    data = seq_variance_vs_T.compute(cfg)
    for frame, truth in (
        (data["iid_mc"], lambda T: (1.1**T) - 1),
        (data["markov"], None),
    ):
        frame = frame.set_index("T")
        exact = frame.dp if truth is None else truth(frame.index.to_numpy())
        assert frame.reliable.loc[4] and not frame.reliable.loc[64]
        assert frame.tail_draws.loc[64] < 10 <= frame.tail_draws.loc[4]
        assert (frame.value / exact).loc[64] < 0.5  # what the flag is about


def test_markov_dp_equals_the_product_formula_when_every_state_has_the_same_chi2():
    # if every state's μ row has χ² = c then E[r_t² | past] = 1 + c and E W² = (1+c)^T exactly
    from simkit.envs import TokenMDP
    from simkit.envs.behaviour import behaviour

    env = TokenMDP.markov(V=4, T=5, seed=1)
    mu = behaviour(env, 0.03, "chi2", level="token", family="logit_noise", aggregate="each")
    assert env.chi2_seq(mu) == pytest.approx(float(theory.seq_is_variance(0.03, 5)), rel=1e-7)


# --- seq_tis_optimal_c -------------------------------------------------------------------------


def test_seq_tis_optimal_c_data():
    cfg = seq_tis_optimal_c.config(small=True)
    data = seq_tis_optimal_c.compute(cfg)
    # the same setting with caps beyond the largest W of every χ²: there tis_seq is sequence IS
    wide = seq_tis_optimal_c.compute(dataclasses.replace(cfg, c_max=1e4, n_c=9))
    assert np.isfinite(data.drop(columns=["at_c_star"]).to_numpy(dtype=float)).all()
    for _, part in data.groupby("chi2_seq"):
        chi2 = part.chi2_seq.iloc[0]
        assert chi2 == pytest.approx(part.chi2_seq_target.iloc[0], rel=1e-6)
        # C* = √(2(1+χ²)) (rl-collapse, Seq-TIS) and it minimises the bound over the grid
        c_star = part.c_star.iloc[0]
        assert c_star == pytest.approx(math.sqrt(2 * (1 + chi2)), rel=1e-12)
        assert part[part.at_c_star].bound.iloc[0] <= part.bound.min() * (1 + 1e-12)
        # the rl-collapse bound holds at every C: MSE ≤ 4K²(1+χ²)²/C² + K²C² (one sample)
        assert (part.mse <= part.bound).all()
        # E min(W, C)²‖f‖² grows with C; beyond max W the estimator is sequence IS: unbiased
        assert (np.diff(part.second_moment.to_numpy()) >= -1e-12).all()
        w_max = part.w_max.iloc[0]
        beyond = wide[(wide.chi2_seq_target == part.chi2_seq_target.iloc[0]) & (wide.c >= w_max)]
        assert len(beyond) >= 1, f"the wide grid must reach max W = {w_max}"
        assert (beyond.bias < 1e-10).all()
        np.testing.assert_allclose(beyond.mse, part.is_mse.iloc[0], rtol=1e-9)
        # what the figure shows, asserted on this setting: with a batch (variance / n) the
        # measured optimum lies within a factor 2 of the bound's C*; with one sample the
        # variance dominates and the optimum sits at the smallest C of the grid
        grid = part[~part.at_c_star]
        best_batch = grid.loc[grid.mse_batch.idxmin()].c
        assert c_star / 2 <= best_batch <= 2 * c_star
        assert grid.loc[grid.mse.idxmin()].c == grid.c.min()


def test_seq_tis_per_sequence_gradients_average_to_grad_J():
    # Σ_y π(y) A(y) ∇log π(y) = ∇J (policy-gradient theorem, baseline J): the enumeration the
    # figure relies on, with μ = π (W = 1)
    cfg = seq_tis_optimal_c.config(small=True)
    env = seq_tis_optimal_c.make_env(cfg)
    sup = env.support(env.pi, baseline=env.J())
    f = seq_tis_optimal_c.per_sequence_gradients(env, sup)
    np.testing.assert_allclose(sup.prob @ f, env.grad_J(), atol=1e-12)


# --- same_kl_different_chi2 --------------------------------------------------------------------


def test_same_kl_different_chi2_data():
    cfg = same_kl_different_chi2.config(small=True)
    data = same_kl_different_chi2.compute(cfg)
    assert len(data) == len(cfg.mapping_names) * cfg.n_chi2
    assert np.isfinite(data[["bias", "variance", "mse", "kl_tok", "chi2_tok"]]).all().all()
    assert data.exact.all()
    # the KL column is constant (dial_pair solves to 1e-8), χ² hits its targets
    np.testing.assert_allclose(data.kl_tok, cfg.kl, rtol=1e-8)
    np.testing.assert_allclose(data.chi2_tok, data.target_chi2, rtol=1e-8)
    assert data.chi2_tok.max() / data.chi2_tok.min() > 100
    # independent tokens: 1 + χ²_seq = (1 + χ²)^T, KL_seq = T·KL
    np.testing.assert_allclose(data.chi2_seq, (1 + data.chi2_tok) ** cfg.T - 1, rtol=1e-8)
    np.testing.assert_allclose(data.kl_seq, cfg.T * cfg.kl, rtol=1e-8)
    # sequence IS: unbiased, and its variance grows with χ² although KL is fixed
    is_seq = data[data.mapping == "is_seq"].sort_values("chi2_tok")
    assert (is_seq.bias < 1e-10).all()
    assert (np.diff(is_seq.variance.to_numpy()) > 0).all()
    assert is_seq.variance.iloc[-1] / is_seq.variance.iloc[0] > 10


# --- mse_vs_T and token_bias_vs_T --------------------------------------------------------------


@pytest.fixture(scope="module")
def mse_vs_T_data():
    cfg = mse_vs_T.config(small=True)
    return cfg, mse_vs_T.compute(cfg)


def test_mse_vs_T_data(mse_vs_T_data):
    cfg, data = mse_vs_T_data
    exact = data[data.exact]
    mc = data[~data.exact]
    dp_names = mse_vs_T.dp_mappings(cfg.mapping_names)
    assert set(dp_names) == {"naive", "is_token", "is_seq", "ppo_clip"}  # not tis_seq, vespo
    n_exact = len(cfg.mapping_names) * len(cfg.exact_lengths) + len(dp_names) * len(cfg.dp_lengths)
    assert len(exact) == n_exact
    assert len(mc) == len(cfg.mapping_names) * len(cfg.mc_lengths)
    assert set(exact.method) == {"enumeration", "dp"} and set(mc.method) == {"monte_carlo"}
    assert (exact[exact.method == "dp"]["T"] > 12).all()  # beyond V^T = 2^12 sequences
    assert mc.reliable.isin([True, False]).all() and exact.reliable.all()
    assert np.isfinite(data[["bias", "variance", "mse", "cosine"]]).all().all()
    np.testing.assert_allclose(exact.mse, exact.bias**2 + exact.variance, rtol=1e-9)
    # every state dialed to the same χ²: the occupancy average is that χ², and
    # 1 + χ²_seq = (1 + χ²)^T (E[r_t² | past] = 1 + χ² at every step)
    np.testing.assert_allclose(data.chi2_tok, cfg.chi2_tok, rtol=1e-7)
    np.testing.assert_allclose(data.chi2_seq, (1 + cfg.chi2_tok) ** data["T"] - 1, rtol=1e-6)
    is_seq = exact[exact.mapping == "is_seq"].sort_values("T")
    assert (is_seq.bias < 1e-10).all() and (is_seq.cosine > 1 - 1e-10).all()
    # T = 1: token IS is sequence IS (one ratio), same MSE
    one = exact[exact["T"] == 1].set_index("mapping")
    assert one.loc["is_token", "mse"] == pytest.approx(one.loc["is_seq", "mse"], rel=1e-10)
    # Monte Carlo rows carry ordered bounds around their estimate
    for key in ("mse", "variance"):
        assert (mc[f"{key}_lo"] <= mc[key]).all() and (mc[key] <= mc[f"{key}_hi"]).all()


def test_mse_vs_T_monte_carlo_agrees_with_enumeration(mse_vs_T_data):
    """Where a T has both paths, the MC estimate is within Z·SE of the exact value; SE from
    the same draws: the half-width of the 95% bootstrap interval / 1.96."""
    cfg, data = mse_vs_T_data
    both = sorted(set(cfg.exact_lengths + cfg.dp_lengths) & set(cfg.mc_lengths))
    assert len(both) >= 2, "the small config must have T computed both ways (enum and DP)"
    for T in both:
        at = data[data["T"] == T]
        exact = at[at.exact].set_index("mapping")
        mc = at[~at.exact].set_index("mapping").loc[exact.index]
        for key in ("mse", "variance"):
            se = (mc[f"{key}_hi"] - mc[f"{key}_lo"]) / (2 * 1.96)
            assert (se > 0).all()
            err = (mc[key] - exact.loc[mc.index, key]).abs()
            assert (err <= Z * se).all(), (T, key, (err / se).to_dict())


def test_mse_vs_T_claims_follow_the_data(mse_vs_T_data):
    """The sentence under the figure is the first T where is_seq's exact MSE tops every
    token-level mapping; recomputed here by hand from the rows."""
    _, data = mse_vs_T_data
    found = mse_vs_T.crossing(data)
    assert found is not None
    T = found[0]
    exact = data[data.exact]
    token = ["naive", "is_token", "ppo_clip"]
    for t in sorted(exact["T"].unique()):
        at = exact[exact["T"] == t].set_index("mapping")
        above = at.loc["is_seq", "mse"] > at.loc[token, "mse"].max()
        if t <= T:
            assert above == (t == T), (t, T)
    assert f"at T = {T}" in data.attrs["claims"][0]


def test_mse_vs_T_monte_carlo_can_fail():
    """The comparison above detects a wrong truth: a 30% larger MSE is far outside Z·SE."""
    cfg = mse_vs_T.Config(
        exact_lengths=(6,),
        dp_lengths=(),
        mc_lengths=(6,),
        mc_reps=400,
        n_boot=100,
        reps=5,
        mapping_names=("is_token",),
    )
    data = mse_vs_T.compute(cfg)
    exact, mc = data[data.exact].iloc[0], data[~data.exact].iloc[0]
    se = (mc.mse_hi - mc.mse_lo) / (2 * 1.96)
    assert abs(mc.mse - 1.3 * exact.mse) > Z * se


def test_mse_vs_T_config_validation():
    with pytest.raises(ValueError, match="exact_lengths"):
        mse_vs_T.Config(exact_lengths=(20,))
    with pytest.raises(ValueError, match="all empty"):
        mse_vs_T.Config(exact_lengths=(), dp_lengths=(), mc_lengths=())
    with pytest.raises(ValueError, match="mc_reps"):
        mse_vs_T.Config(mc_reps=1)
    cfg = mse_vs_T.Config(exact_lengths=(1, 4), dp_lengths=(64,), mc_lengths=(4, 32))
    assert cfg.lengths == (1, 4, 32, 64)


def test_dialed_behaviour_equals_the_row_by_row_dial():
    from simkit.envs import TokenMDP
    from simkit.envs.behaviour import behaviour

    env = TokenMDP.answer_correct(V=3, T=5, seed=1)
    fast = mse_vs_T.dialed_behaviour(env, 0.1, "logit_noise")
    slow = behaviour(env, 0.1, "chi2", level="token", family="logit_noise")
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-14)
    # non-stationary logits: falls back to the row-by-row dial
    moving = TokenMDP.answer_correct(V=3, T=4, seed=1, stationary=False)
    np.testing.assert_array_equal(
        mse_vs_T.dialed_behaviour(moving, 0.1, "logit_noise"),
        behaviour(moving, 0.1, "chi2", level="token", family="logit_noise"),
    )


@pytest.fixture(scope="module")
def token_bias_data():
    cfg = token_bias_vs_T.config(small=True)
    return cfg, token_bias_vs_T.compute(cfg)


def test_token_bias_vs_T_data(token_bias_data):
    cfg, data = token_bias_data
    assert set(data.mapping) == set(token_bias_vs_T.MAPPINGS)
    assert set(data.env) == set(cfg.envs)
    assert set(data.params) == set(cfg.params) == {"untied", "tied"}
    n_rows = len(cfg.envs) * len(cfg.lengths) * len(token_bias_vs_T.MAPPINGS) * len(cfg.params)
    assert len(data) == n_rows
    assert np.isfinite(data[["bias", "bound_shape", "delta_max", "grad_norm"]]).all().all()
    np.testing.assert_allclose(data.chi2_tok, cfg.chi2_tok, rtol=1e-7)
    np.testing.assert_allclose(data.relative_bias, data.bias / data.grad_norm, rtol=1e-12)
    for params in cfg.params:
        for kind in cfg.envs:
            part = data[(data.env == kind) & (data.params == params)]
            token = part[part.mapping == "is_token"].set_index("T").sort_index()
            # one token: token IS is sequence IS, unbiased; longer: biased through the states
            assert token.bias.loc[1] < 1e-12
            assert (token.bias.loc[2:] > 1e-4).all()
            # the shape is K·T²·Δ_max (theory.token_is_bias_bound_shape) matched at the anchor
            anchor = data.attrs["anchor_T"][params, kind]
            assert anchor == 2
            assert token.bound_shape.loc[anchor] == pytest.approx(token.bias.loc[anchor], rel=1e-12)
            ratio = token.bound_shape / (token.index.to_numpy() ** 2 * token.delta_max)
            np.testing.assert_allclose(ratio, ratio.iloc[0], rtol=1e-12)
            # observed on these settings: beyond the anchor the bias stays below the T² shape
            assert (token.bias.loc[anchor:] <= token.bound_shape.loc[anchor:] * (1 + 1e-12)).all()
    # sequence IS: 0 by enumeration where V^T is within the budget, by theory beyond
    is_seq = data[data.mapping == "is_seq"]
    enumerable = cfg.V ** is_seq["T"] <= 2**cfg.enum_max_log2
    assert (is_seq.method == np.where(enumerable, "enumeration", "theory")).all()
    assert (is_seq.bias < 1e-10).all()
    assert (data[data.mapping.isin(token_bias_vs_T.TOKEN_MAPPINGS)].method == "dp").all()


def test_token_bias_vs_T_dp_equals_enumeration(token_bias_data):
    """The DP bias (exact_token_level_mean, tied: summed blocks) equals experiment.run's
    enumeration (params='untied' and 'tied') to 1e-10."""
    cfg, data = token_bias_data
    token = data[data.mapping.isin(token_bias_vs_T.TOKEN_MAPPINGS)]
    both = token[token.bias_enum.notna()]
    n_min = 2 * len(token_bias_vs_T.TOKEN_MAPPINGS) * len(cfg.envs) * len(cfg.params)
    assert len(both) >= n_min
    np.testing.assert_allclose(both.bias, both.bias_enum, rtol=0, atol=1e-10)
    assert token[cfg.V ** token["T"] > 2**cfg.enum_max_log2].bias_enum.isna().all()


def test_token_bias_vs_T_majority_bias_grows_relative_to_grad_J():
    """The point of the majority panels: token IS's bias grows relative to ∇J with T (a
    whole-sequence reward), while on answer_correct it has saturated by T = 16."""
    cfg = token_bias_vs_T.Config(lengths=(16, 64, 128), params=("untied",))
    data = token_bias_vs_T.compute(cfg).set_index(["env", "mapping", "T"]).sort_index()
    majority = data.loc[("at_least_k", "is_token")].relative_bias
    assert majority.is_monotonic_increasing and majority.loc[128] > 2 * majority.loc[16]
    last = data.loc[("answer_correct", "is_token")].bias
    np.testing.assert_allclose(last, last.loc[16], rtol=1e-6)


def test_token_bias_vs_T_growth_laws_follow_the_data():
    """The sentences under the figure are fitted slopes; these are the laws they state on the
    default setting (oracle baseline J(μ)). If the data stop supporting them, this fails."""
    cfg = token_bias_vs_T.Config(lengths=(32, 64, 128, 256))
    data = token_bias_vs_T.compute(cfg)
    laws = token_bias_vs_T.growth_laws(data).set_index(["params", "env", "mapping"]).law
    assert laws["untied", "answer_correct", "naive"] == "saturates (flat)"
    assert laws["untied", "answer_correct", "is_token"] == "saturates (flat)"
    assert laws["untied", "answer_correct", "ppo_clip"] == "grows like √T"
    assert laws["untied", "at_least_k", "ppo_clip"] == "saturates (flat)"
    assert laws["tied", "answer_correct", "ppo_clip"] == "grows ∝ T"
    assert laws["tied", "answer_correct", "is_token"] == "saturates (flat)"
    text = " ".join(token_bias_vs_T.claims(data))
    assert "No measured curve reaches the T² growth" in text
    # and the words follow the slope (so a different slope gives a different sentence)
    assert token_bias_vs_T.growth_word(0.0) == "saturates (flat)"
    assert token_bias_vs_T.growth_word(2.0) == "grows like T²"
    assert token_bias_vs_T.growth_word(0.25) == "grows like T^0.25"


def test_token_bias_vs_T_config_validation():
    with pytest.raises(ValueError, match="envs"):
        token_bias_vs_T.Config(envs=("parity",))
    with pytest.raises(ValueError, match="k_fraction"):
        token_bias_vs_T.Config(k_fraction=0.0)
    with pytest.raises(ValueError, match="lengths"):
        token_bias_vs_T.Config(lengths=(0, 4))
    with pytest.raises(ValueError, match="env kind"):
        token_bias_vs_T.build_env(token_bias_vs_T.Config(), "parity", 4)
    assert token_bias_vs_T.build_env(token_bias_vs_T.Config(), "at_least_k", 7).S == 5
