"""simkit.experiment: exact path vs Monte Carlo, bounds, metrics, the results table."""

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from simkit import divergence, mappings
from simkit.envs import Bandit
from simkit.estimators import AGGREGATIONS, Estimator
from simkit.experiment import (
    BOUNDED_METRICS,
    best_scale,
    bias,
    bias_dir,
    cosine,
    exact_moments,
    khat_of_weights,
    run,
    sample_gradients,
    snr,
)

Z = 5.0  # z-score of the stochastic checks

LOGITS = np.array([0.4, -0.3, 0.0, 0.9])
# ratios π/μ ≈ (0.75, 0.87, 0.59, 2.16): PPO-style clips at 1 ± 0.2 and truncations at 2 bind
MU = np.array([0.35, 0.15, 0.3, 0.2])
ENVS = {
    "bernoulli": Bandit(LOGITS, np.array([0.1, 0.8, 0.5, 0.3])),
    "gaussian": Bandit(
        LOGITS,
        np.array([-0.5, 1.0, 0.2, 0.0]),
        reward="gaussian",
        reward_std=np.array([0.5, 1.0, 1.5, 0.8]),
    ),
}
PER_SAMPLE = [n for n in mappings.available() if not mappings.mapping_class(n).batch_dependent]
BATCH_DEPENDENT = [n for n in mappings.available() if mappings.mapping_class(n).batch_dependent]


def _check_mc_against_exact(env, est, n, reps, seed, mu=MU):
    batch = env.sample(mu, n, np.random.default_rng(seed), reps=reps)
    g = sample_gradients(env, batch, est).gradients
    exact = exact_moments(env, mu, est, n)
    mean = g.mean(axis=0)
    se = g.std(axis=0, ddof=1) / math.sqrt(reps)
    assert np.all(np.abs(mean - exact.mean) <= Z * se + 1e-12), (mean, exact.mean, se)
    dev = np.sum((g - mean) ** 2, axis=1)
    var_hat = dev.sum() / (reps - 1)
    se_var = dev.std(ddof=1) / math.sqrt(reps)
    assert abs(var_hat - exact.variance) <= Z * se_var + 1e-12, (var_hat, exact.variance)


@pytest.mark.parametrize("reward", ["bernoulli", "gaussian"])
@pytest.mark.parametrize("name", PER_SAMPLE)
def test_monte_carlo_mean_and_variance_agree_with_exact(name, reward):
    _check_mc_against_exact(ENVS[reward], Estimator(name), n=8, reps=4000, seed=17)


@pytest.mark.parametrize("reward", ["bernoulli", "gaussian"])
@pytest.mark.parametrize(
    "est",
    [
        Estimator("naive", advantage="raw"),
        Estimator("is_token", aggregation="seq-mean-token-sum-norm", max_length=3),
        Estimator("is_seq", aggregation="seq-mean-token-mean", advantage="raw"),
    ],
    ids=lambda e: e.name,
)
def test_monte_carlo_agrees_with_exact_for_other_advantages_and_aggregations(est, reward):
    _check_mc_against_exact(ENVS[reward], est, n=6, reps=4000, seed=23)


@pytest.mark.parametrize("reward", ["bernoulli", "gaussian"])
def test_sequence_is_is_exactly_unbiased_off_policy(reward):
    env = ENVS[reward]
    for advantage in ("oracle", "raw"):
        for agg in AGGREGATIONS:
            est = Estimator("is_seq", aggregation=agg, advantage=advantage)
            m = exact_moments(env, MU, est, n=5)
            scale = 5 if agg == "token-sum" else 1  # Z = 1: the sum of n = 5 unbiased terms
            assert bias(m.mean, scale * env.grad_J()) < 1e-12
    # ESS of sequence IS = n/(1 + χ²) (docs/reference.md §F)
    m = exact_moments(env, MU, Estimator("is_seq"), n=5)
    assert m.ess == pytest.approx(5 / (1 + float(divergence.chi2(env.pi, MU))), rel=1e-12)


@pytest.mark.parametrize("reward", ["bernoulli", "gaussian"])
def test_behaviour_missing_an_arm(reward):
    # μ_1 = 0 < π_1: χ² = inf and sequence IS loses the arm's term of ∇J (support mismatch)
    env = ENVS[reward]
    mu = np.array([0.5, 0.0, 0.3, 0.2])
    m = exact_moments(env, mu, Estimator("is_seq"), n=4)
    # oracle baseline b = J(μ): a missing arm makes sequence IS depend on b
    covered = env.pi * (env.means - env.J(mu)) * (mu > 0)
    expected = covered - env.pi * covered.sum()  # Σ_{k: μ_k > 0} π_k (m_k − J)(e_k − π)
    np.testing.assert_allclose(m.mean, expected, atol=1e-14)
    for name in ("naive", "is_seq"):
        _check_mc_against_exact(env, Estimator(name), n=4, reps=2000, seed=5, mu=mu)
    table = run(env, mu, ["naive", "is_seq"], n=4, reps=100, exact=False, n_boot=100)
    assert np.isinf(table["chi2_tok"]).all() and np.isfinite(table["bias"]).all()


@pytest.mark.parametrize("advantage", ["oracle", "oracle_pi"])
@pytest.mark.parametrize("reward", ["bernoulli", "gaussian"])
def test_naive_is_biased_off_policy(reward, advantage):
    env = ENVS[reward]
    # E_μ[(R − b)(e_y − π)] = μ ⊙ (m − b) − π·(J(μ) − b): the behaviour's own gradient
    # direction, not π ⊙ (m − J). They differ whenever μ ≠ π and the arms' rewards differ.
    # b = J(μ) (oracle) removes the second term; b = J(π) (oracle_pi) keeps it.
    b = env.J(MU) if advantage == "oracle" else env.J()
    closed_form = MU * (env.means - b) - env.pi * (env.J(MU) - b)
    m = exact_moments(env, MU, Estimator("naive", advantage=advantage), n=4)
    np.testing.assert_allclose(m.mean, closed_form, atol=1e-14)
    expected_bias = float(np.linalg.norm(closed_form - env.grad_J()))
    # the exact path is accurate to ~1e-12, so a bias this far above it is real, not rounding
    # (this setting's closed form gives 0.03 for Bernoulli rewards, more for Gaussian ones)
    assert expected_bias > 1e-2
    table = run(env, MU, [Estimator("naive", advantage=advantage)], n=4, reps=50)
    assert table["bias"].iloc[0] == pytest.approx(expected_bias, rel=1e-12)


@pytest.mark.parametrize("reward", ["bernoulli", "gaussian"])
def test_mse_is_bias_squared_plus_variance(reward):
    ests = ["naive", "is_token", "is_seq", Estimator("naive", advantage="rloo", group_size=2)]
    for exact in ("auto", False):
        table = run(ENVS[reward], MU, ests, n=8, reps=300, exact=exact, n_boot=200)
        np.testing.assert_allclose(table["mse"], table["bias"] ** 2 + table["variance"], rtol=1e-12)


def test_exact_column_and_exact_true_errors():
    env = ENVS["bernoulli"]
    grpo = Estimator("is_token", advantage="grpo", group_size=4)
    ests = ["naive", "is_seq", grpo, *BATCH_DEPENDENT]
    table = run(env, MU, ests, n=8, reps=100, n_boot=100)
    expected = [True, True, False] + [False] * len(BATCH_DEPENDENT)
    assert table["exact"].tolist() == expected
    exact_rows = table[table["exact"]]
    assert exact_rows[[f"bias_{s}" for s in ("lo", "hi")]].isna().all().all()
    assert table.loc[~table["exact"], "bias_hi"].notna().all()
    assert not run(env, MU, ["naive"], n=8, reps=100, exact=False)["exact"].iloc[0]
    with pytest.raises(ValueError, match=r"exact=True.*grpo.*couples the samples"):
        run(env, MU, ["naive", grpo], n=8, reps=100, exact=True)
    for name in BATCH_DEPENDENT:
        with pytest.raises(ValueError, match=f"mapping '{name}' is batch dependent"):
            run(env, MU, [name], n=8, reps=100, exact=True)
    with pytest.raises(ValueError, match="not per-sample"):
        exact_moments(env, MU, grpo, n=8)


@pytest.mark.parametrize("reward", ["bernoulli", "gaussian"])
def test_monte_carlo_bounds_cover_the_exact_values(reward):
    env = ENVS[reward]
    ests = ["naive", "is_token", "is_seq"]
    exact = run(env, MU, ests, n=8, reps=100, exact=True).set_index("estimator")
    mc = run(env, MU, ests, n=8, reps=3000, exact=False, level=0.99, seed=4).set_index("estimator")
    for metric in BOUNDED_METRICS:
        truth = exact[metric]
        slack = 1e-12 * truth.abs()  # rounding: naive's ESS is n in both paths
        assert (
            (mc[f"{metric}_lo"] <= truth + slack) & (truth - slack <= mc[f"{metric}_hi"])
        ).all(), metric


def test_bounds_have_their_nominal_coverage():
    # coverage frequency over independent seeds: at least level − Z·SE of a binomial proportion
    env = ENVS["bernoulli"]
    ests = ["naive", "is_seq"]
    level, runs = 0.9, 150
    exact = run(env, MU, ests, n=8, reps=10, exact=True).set_index("estimator")
    hits = {m: 0 for m in BOUNDED_METRICS}
    for seed in range(runs):
        mc = run(
            env, MU, ests, n=8, reps=200, seed=seed, exact=False, level=level, n_boot=200
        ).set_index("estimator")
        for m in BOUNDED_METRICS:
            slack = 1e-12 * exact[m].abs()
            hits[m] += int(
                ((mc[f"{m}_lo"] <= exact[m] + slack) & (exact[m] - slack <= mc[f"{m}_hi"])).sum()
            )
    floor = level - Z * math.sqrt(level * (1 - level) / (runs * len(ests)))
    coverage = {m: h / (runs * len(ests)) for m, h in hits.items()}
    assert all(c >= floor for c in coverage.values()), coverage


def test_same_seed_same_numbers_and_estimators_do_not_interfere():
    env = ENVS["gaussian"]
    grpo = Estimator("naive", advantage="grpo", group_size=4)
    a = run(env, MU, ["is_token", grpo], n=8, reps=200, seed=3, exact=False, n_boot=100)
    b = run(env, MU, ["is_token", grpo], n=8, reps=200, seed=3, exact=False, n_boot=100)
    pd.testing.assert_frame_equal(a, b)
    c = run(env, MU, ["naive", grpo, "is_seq"], n=8, reps=200, seed=3, exact=False, n_boot=100)
    row_a = a[a["estimator"] == grpo.name].reset_index(drop=True)
    row_c = c[c["estimator"] == grpo.name].reset_index(drop=True)
    pd.testing.assert_frame_equal(
        row_a[row_c.columns.intersection(row_a.columns)],
        row_c[row_c.columns.intersection(row_a.columns)],
    )
    d = run(env, MU, ["is_token", grpo], n=8, reps=200, seed=4, exact=False, n_boot=100)
    assert d["variance"].iloc[0] != a["variance"].iloc[0]


def test_table_columns():
    env = ENVS["bernoulli"]
    table = run(
        env, MU, ["naive", "is_seq"], n=8, reps=50, setting={"divergence": "chi2", "target": 0.5}
    )
    for col in (
        "estimator",
        "mapping",
        "aggregation",
        "advantage",
        "divergence",
        "target",
        "T",
        "n",
        "reps",
        "chi2_tok",
        "kl_tok",
        "tv_tok",
        "chi2_seq",
        "kl_seq",
        "tv_seq",
        "khat",
        "exact",
        *BOUNDED_METRICS,
        *(f"{m}_{s}" for m in BOUNDED_METRICS for s in ("lo", "hi")),
    ):
        assert col in table.columns, col
    assert len(table) == 2
    assert table["max_log_ratio"].isna().tolist() == [True, False]  # naive has no such field
    assert (table["T"] == 1).all() and (table["target"] == 0.5).all()
    assert table["chi2_tok"].iloc[0] == pytest.approx(float(divergence.chi2(env.pi, MU)))
    assert table["chi2_seq"].iloc[0] == table["chi2_tok"].iloc[0]  # T = 1


def test_progress_bar_only_when_asked(capsys):
    env = ENVS["bernoulli"]
    run(env, MU, ["naive", "is_seq"], n=4, reps=20, progress=True)
    assert "estimators" in capsys.readouterr().err
    run(env, MU, ["naive", "is_seq"], n=4, reps=20)
    assert capsys.readouterr().err == ""


def test_bad_input():
    env = ENVS["bernoulli"]
    with pytest.raises(ValueError, match="behaviour is not normalised"):
        run(env, np.array([0.4, 0.3, 0.2, 0.2]), ["naive"], n=4)
    with pytest.raises(ValueError, match=r"behaviour must have shape \(K,\) = \(4,\)"):
        run(env, np.array([0.5, 0.5]), ["naive"], n=4)
    with pytest.raises(ValueError, match="n = 6 is not divisible by group_size G = 4"):
        run(env, MU, [Estimator("naive", advantage="grpo", group_size=4)], n=6)
    with pytest.raises(ValueError, match="unknown aggregation"):
        run(env, MU, [Estimator("naive", aggregation="token-total")], n=4)
    with pytest.raises(ValueError, match="unknown advantage"):
        run(env, MU, [Estimator("naive", advantage="ppo")], n=4)
    with pytest.raises(KeyError, match="unknown mapping"):
        run(env, MU, ["not_a_mapping"], n=4)
    with pytest.raises(ValueError, match="reps must be an integer >= 2"):
        run(env, MU, ["naive"], n=4, reps=1)
    with pytest.raises(ValueError, match="exact must be"):
        run(env, MU, ["naive"], n=4, exact="yes")
    with pytest.raises(ValueError, match="names must be distinct"):
        run(env, MU, ["naive", "naive"], n=4)
    with pytest.raises(ValueError, match="clash"):
        run(env, MU, ["naive"], n=4, setting={"bias": 1})
    with pytest.raises(ValueError, match="level"):
        run(env, MU, ["naive"], n=4, level=1.5)


def test_metric_functions():
    grad = np.array([1.0, 2.0, -1.0])
    assert best_scale(-grad, grad) == pytest.approx(-1.0)  # α* may be negative
    assert bias_dir(-grad, grad) == pytest.approx(0.0, abs=1e-15)
    assert cosine(-grad, grad) == pytest.approx(-1.0)
    assert bias(-grad, grad) == pytest.approx(2 * np.linalg.norm(grad))
    ortho = np.array([2.0, -1.0, 0.0])
    assert bias_dir(grad + ortho, grad) == pytest.approx(np.linalg.norm(ortho))
    assert math.isnan(cosine(grad, np.zeros(3)))
    assert best_scale(grad, np.zeros(3)) == 0.0
    assert snr(2.0, 0.5) == 4.0 and snr(1.0, 0.0) == math.inf and math.isnan(snr(0.0, 0.0))
    with pytest.raises(ValueError, match="same shape"):
        bias(grad, grad[:2])


def test_khat_of_weights():
    rng = np.random.default_rng(0)
    S, k = 40_000, 0.5
    w = rng.random(S) ** (-k)  # Pareto tail with shape parameter k
    khat = khat_of_weights(w)
    # SE of the generalised-Pareto shape fit on M ≈ 3√S tail draws is about (1 + k)/√M
    M = 3 * math.sqrt(S)
    assert abs(khat - k) <= Z * (1 + k) / math.sqrt(M)
    # zero weights (clipped samples) stay at the bottom, out of the tail
    assert khat_of_weights(np.concatenate([w, np.zeros(1000)])) == pytest.approx(
        khat_of_weights(np.concatenate([w, np.full(1000, 1e-300)])), abs=1e-12
    )
    # no Pareto tail can be fitted: NaN, never ±inf
    assert math.isnan(khat_of_weights(np.ones(100)))  # bounded, all equal
    assert math.isnan(khat_of_weights(np.zeros(100)))
    assert math.isnan(khat_of_weights(w[:20]))  # fewer than 25 draws
    # a discrete support (4 atoms, one rare): NaN whether or not the rare atom was drawn
    atoms = rng.choice([0.5, 0.9, 1.3], size=800)
    assert math.isnan(khat_of_weights(atoms))
    assert math.isnan(khat_of_weights(np.append(atoms, 60.0)))
    with pytest.raises(ValueError, match="non-negative"):
        khat_of_weights(np.array([1.0, -1.0]))


def test_non_finite_coefficients_name_the_estimator_on_both_paths():
    @dataclass(frozen=True)
    class Infinite(mappings.ScalarMapping):
        name = "inf_everywhere"

        def _coefficients(self, log_ratio, mask, advantages):
            return np.where(mask, np.inf, 0.0)

    env = ENVS["bernoulli"]
    est = Estimator(Infinite(), advantage="raw")
    with pytest.raises(ValueError, match=r"'inf_everywhere'.*\(NaN/inf\) on 8 tokens of the sup"):
        exact_moments(env, MU, est, 4)  # 4 arms × sign of A = 8 atoms
    batch = env.sample(MU, 4, reps=3, rng=np.random.default_rng(0))
    with (
        np.errstate(invalid="ignore"),  # inf·0 in the per-token weights before the check
        pytest.raises(ValueError, match=r"'inf_everywhere'.*\(NaN/inf\) on 12 of 12 drawn tok"),
    ):
        sample_gradients(env, batch, est)
