"""simkit.envs.token_moments: exact mean and variance by DP, against enumeration (T ≤ 10).

The enumeration path (:func:`simkit.experiment.exact_moments` on ``env.support``) is an
independent computation: it forms every sequence's coefficients with ``Mapping.coefficients``
and its score norms with ``env.score_norms_sq``. Agreement is to 1e-10 (relative to the scale
of the moments, which are O(1) here).
"""

import numpy as np
import pytest
from conftest import noisy_policy

from simkit import experiment, mappings
from simkit.envs import TokenMDP
from simkit.envs.token_moments import dp_applies, moments
from simkit.estimators import Estimator

TOL = 1e-10
TOKEN_MAPPINGS = [
    n
    for n in mappings.available()
    if mappings.mapping_class(n).level == "token"
    and getattr(mappings.mapping_class(n), "ratio_kind", None) == "token"
]
DP_MAPPINGS = [*TOKEN_MAPPINGS, "is_seq", "power"]


def _behaviour(env, seed, scale=0.6, zero=False):
    """μ = softmax(π's logits + noise); ``zero``: a token μ never emits (π does), so sequence
    IS loses its mass."""
    return noisy_policy(env.logits, seed, scale, zero_last=zero)


def _envs():
    return {
        "answer_correct-T10": TokenMDP.answer_correct(2, 10, seed=3, stationary=False),
        "markov-eos": TokenMDP.markov(3, 5, target=1, eos=2, seed=2, stationary=False),
        "at_least_k": TokenMDP.at_least_k(3, 5, k=2, hit=0, seed=4, stationary=False),
        "parity-eos": TokenMDP.parity(3, 6, marked=[1], eos=0, seed=5, stationary=False),
    }


CASES = [
    (env_name, agg)
    for env_name in _envs()
    for agg in ("seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm")
    if not (agg == "token-mean" and "eos" in env_name)
]


@pytest.mark.parametrize(("env_name", "agg"), CASES)
@pytest.mark.parametrize("name", DP_MAPPINGS)
def test_dp_moments_equal_enumeration(name, env_name, agg):
    env = _envs()[env_name]
    mu = _behaviour(env, 11)
    n = 3
    for advantage in ("oracle", "oracle_pi", "raw"):
        est = Estimator(mappings.get(name), aggregation=agg, advantage=advantage)
        b = experiment.oracle_baseline(env, mu, est)
        dp = moments(env, mu, est.mapping, b, agg)
        ref = experiment.exact_moments(env, mu, est, n)
        scale = max(1.0, float(np.abs(ref.mean).max()))
        np.testing.assert_allclose(dp.mean, ref.mean, rtol=0, atol=TOL * scale)
        assert dp.variance(n) == pytest.approx(ref.variance, rel=TOL, abs=TOL)
        assert dp.ess(n) == pytest.approx(ref.ess, rel=1e-9)


@pytest.mark.parametrize("name", ["is_seq", "power", "ppo_clip", "is_token"])
def test_dp_with_unreachable_tokens(name):
    env = TokenMDP.answer_correct(3, 6, seed=8, stationary=False)
    mu = _behaviour(env, 12, zero=True)
    est = Estimator(mappings.get(name), aggregation="seq-mean-token-sum")
    b = env.J(mu)
    dp = moments(env, mu, est.mapping, b)
    ref = experiment.exact_moments(env, mu, est, 2)
    np.testing.assert_allclose(dp.mean, ref.mean, rtol=0, atol=TOL)
    assert dp.variance(2) == pytest.approx(ref.variance, rel=TOL, abs=TOL)


def test_dp_second_moment_of_sequence_is_grows_like_one_plus_chi2_to_the_T():
    """E_μ[W²] for i.i.d. tokens is (1 + χ²)^T: the W²-weighted sweep gives
    sq_sum = E_μ[W²·|y|] = T·(1 + χ²)^T at fixed length (closed form, no enumeration)."""
    env = TokenMDP.iid(2, 64, logits=np.array([0.3, -0.2]))
    mu = np.broadcast_to(np.array([0.45, 0.55]), env.logits.shape).copy()
    chi2 = float(np.sum(env.pi[0, 0] ** 2 / mu[0, 0]) - 1.0)
    dp = moments(env, mu, mappings.get("is_seq"), 0.0)
    assert dp.sq_sum == pytest.approx(64 * (1 + chi2) ** 64, rel=1e-12)
    assert dp.abs_sum == pytest.approx(64.0, rel=1e-12)  # E[W·|y|] = E_π|y| = T


def test_dp_at_T_4096_is_finite_and_scaled():
    """Long sequences: rescaled sweeps, no overflow, sequence IS unbiased (E h = ∇J)."""
    env = TokenMDP.answer_correct(4, 4096, seed=1)
    mu = _behaviour(env, 3, scale=0.05)
    dp = moments(env, mu, mappings.get("is_seq"), env.J(mu))
    assert np.isfinite(dp.second) and dp.second > 0
    np.testing.assert_allclose(dp.mean, env.grad_J(), rtol=0, atol=1e-10)


def test_dp_applies():
    env = TokenMDP.answer_correct(2, 3, eos=1)
    assert dp_applies(env, mappings.get("ppo_clip"), "seq-mean-token-sum") == ""
    assert "random" in dp_applies(env, mappings.get("ppo_clip"), "token-mean")
    assert "random" in dp_applies(env, mappings.get("ppo_clip"), "seq-mean-token-mean")
    assert "product-form" in dp_applies(env, mappings.get("tis_seq"), "seq-mean-token-sum")
    with pytest.raises(ValueError, match="no moment DP"):
        moments(env, env.pi, mappings.get("tis_seq"), 0.0)


def test_experiment_run_is_exact_at_T_64_by_dp():
    """Beyond enumeration (2^64 sequences) experiment.run uses the DP: exact = True, and the
    DP rows equal what the enumeration gives at small T (above) — here inside the Monte Carlo
    99 % bootstrap intervals (4000 batches)."""
    env = TokenMDP.answer_correct(2, 64, seed=0)
    mu = _behaviour(env, 5, scale=0.08)
    names = ["naive", "is_token", "ppo_clip", "is_seq", "power"]
    ests = [Estimator(mappings.get(m), aggregation="seq-mean-token-sum", name=m) for m in names]
    ex = experiment.run(env, mu, ests, n=4, reps=2, exact=True, progress=False)
    assert ex.exact.all()
    assert ex.set_index("estimator").loc["is_seq", "bias"] < 1e-10
    mc = experiment.run(
        env, mu, ests, n=4, reps=4000, exact=False, progress=False, seed=7, level=0.99
    )
    for col in ("variance", "mse"):
        inside = (mc[f"{col}_lo"] <= ex[col]) & (ex[col] <= mc[f"{col}_hi"])
        assert inside.all(), (col, ex[col].tolist(), mc[[f"{col}_lo", f"{col}_hi"]])
    # tied parameters: exact by the tied moment DP (tests/test_token_moments_tied.py checks it
    # against enumeration and a pairwise DP); here the run rows are planned and filled from it
    tied = experiment.run(env, mu, ests, n=4, reps=5, exact=True, params="tied", progress=False)
    assert tied.exact.all() and (tied.method == "dp").all()
    assert tied.set_index("estimator").loc["is_seq", "bias"] < 1e-10


@pytest.mark.parametrize("distinct", [3, 9])
@pytest.mark.parametrize("name", ["ppo_clip", "is_token", "is_seq"])
def test_dp_with_general_rewards(name, distinct):
    """Rewards with 3 (indicator rows) and 9 (sign-split rows) distinct advantage values."""
    # at_least_k with k + 1 automaton states, each its own reward value (9: S = 9)
    k = 4 if distinct == 3 else 8
    base = TokenMDP.at_least_k(3, k + 1, k=k, hit=0, seed=4, stationary=False)
    reward = np.array([0.0, 1.0, 1.0, 3.0, 3.0]) if distinct == 3 else np.linspace(-1, 2, 9)
    env = TokenMDP(base.logits, base.transition, base.policy_index, reward)
    assert np.unique(reward).size == distinct
    mu = _behaviour(env, 13)
    est = Estimator(mappings.get(name), aggregation="seq-mean-token-sum")
    b = env.J(mu)
    dp = moments(env, mu, est.mapping, b)
    ref = experiment.exact_moments(env, mu, est, 3)
    np.testing.assert_allclose(dp.mean, ref.mean, rtol=0, atol=TOL)
    assert dp.variance(3) == pytest.approx(ref.variance, rel=TOL, abs=TOL)
    assert dp.ess(3) == pytest.approx(ref.ess, rel=1e-9)
