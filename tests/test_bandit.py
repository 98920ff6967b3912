"""simkit.envs.Bandit: oracle quantities, gradient accumulation, sampling, exact support."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate

from simkit import divergence
from simkit.envs import Bandit, BanditBatch

Z = 5.0  # z-score of the stochastic checks


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _fd_grad(f, theta, h=1e-6):
    grad = np.zeros_like(theta)
    for k in range(theta.size):
        step = np.zeros_like(theta)
        step[k] = h
        grad[k] = (f(theta + step) - f(theta - step)) / (2 * h)
    return grad


@settings(max_examples=50, deadline=None)
@given(
    logits=st.lists(st.floats(-3, 3), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
    gaussian=st.booleans(),
)
def test_J_and_grad_J_match_finite_differences(logits, seed, gaussian):
    theta = np.array(logits)
    rng = np.random.default_rng(seed)
    if gaussian:
        means = rng.normal(size=theta.size)
        env = Bandit(theta, means, reward="gaussian", reward_std=0.7)
    else:
        means = rng.random(theta.size)
        env = Bandit(theta, means)
    np.testing.assert_allclose(env.pi, _softmax(theta), atol=1e-15)
    assert env.J() == pytest.approx(float(_softmax(theta) @ means), abs=1e-14)
    fd = _fd_grad(lambda t: float(_softmax(t) @ means), theta)
    np.testing.assert_allclose(env.grad_J(), fd, atol=1e-8)


def test_J_of_another_policy_and_log_ratio():
    env = Bandit(np.array([0.0, 1.0, -1.0]), np.array([0.1, 0.5, 0.9]))
    mu = np.array([0.5, 0.5, 0.0])
    assert env.J(mu) == pytest.approx(0.3, abs=1e-15)
    lr = env.log_ratio(mu)
    np.testing.assert_allclose(lr[:2], np.log(env.pi[:2] / 0.5), atol=1e-14)
    assert lr[2] == np.inf


def test_accumulate_matches_explicit_per_sample_sum():
    rng = np.random.default_rng(0)
    env = Bandit(rng.normal(size=5), rng.random(5))
    actions = rng.integers(0, 5, size=(3, 7))
    lam = rng.normal(size=(3, 7, 1))
    got = env.accumulate(actions, lam)
    assert got.shape == (3, 5)
    for r in range(3):
        explicit = sum(lam[r, i, 0] * (np.eye(5)[actions[r, i]] - env.pi) for i in range(7))
        np.testing.assert_allclose(got[r], explicit, atol=1e-13)
    # one batch, weights given without the T axis
    np.testing.assert_allclose(env.accumulate(actions[1], lam[1, :, 0]), got[1], atol=1e-15)


def test_accumulate_rejects_bad_input():
    env = Bandit(np.zeros(3), np.full(3, 0.5))
    with pytest.raises(ValueError, match="token_weights must have shape"):
        env.accumulate(np.array([0, 1]), np.ones((3, 1)))
    with pytest.raises(ValueError, match=r"actions must lie in \[0, K\)"):
        env.accumulate(np.array([0, 3]), np.ones(2))
    with pytest.raises(ValueError, match="integer"):
        env.accumulate(np.array([0.0, 1.0]), np.ones(2))


@pytest.mark.parametrize("reward", ["bernoulli", "gaussian"])
def test_sampling_frequencies_and_reward_means(reward):
    env = Bandit(np.array([0.3, -0.2, 0.1]), np.array([0.2, 0.6, 0.9]), reward=reward)
    mu = np.array([0.15, 0.35, 0.5])
    batch = env.sample(mu, 500, np.random.default_rng(1), reps=40)
    assert isinstance(batch, BanditBatch)
    assert batch.actions.shape == (40, 500) and batch.rewards.shape == (40, 500)
    assert batch.log_ratio.shape == (40, 500, 1) and batch.mask.shape == (40, 500, 1)
    assert batch.mask.all() and batch.reps == 40 and batch.n == 500 and batch.T == 1
    np.testing.assert_allclose(
        batch.log_ratio[..., 0], np.log(env.pi / mu)[batch.actions], atol=1e-14
    )
    assert batch.J == env.J() and np.array_equal(batch.grad_J, env.grad_J())
    S = batch.actions.size
    freq = np.bincount(batch.actions.ravel(), minlength=3) / S
    se = np.sqrt(mu * (1 - mu) / S)
    assert np.all(np.abs(freq - mu) <= Z * se)
    for k in range(3):
        r = batch.rewards[batch.actions == k]
        assert abs(r.mean() - env.means[k]) <= Z * np.sqrt(env.reward_variance[k] / r.size)
    if reward == "bernoulli":
        assert set(np.unique(batch.rewards)) <= {0.0, 1.0}


def test_sampling_is_seeded_and_skips_zero_probability_arms():
    env = Bandit(np.zeros(3), np.full(3, 0.5))
    mu = np.array([0.5, 0.0, 0.5])
    a = env.sample(mu, 200, np.random.default_rng(3))
    b = env.sample(mu, 200, np.random.default_rng(3))
    assert a.reps is None and a.actions.shape == (200,)
    np.testing.assert_array_equal(a.actions, b.actions)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    assert not np.any(a.actions == 1)
    assert np.all(np.isfinite(a.log_ratio))


@pytest.mark.parametrize("baseline", [0.0, 0.37])
def test_bernoulli_support_moments(baseline):
    env = Bandit(np.array([0.2, -0.4, 0.0]), np.array([0.0, 0.3, 1.0]))
    mu = np.array([0.2, 0.5, 0.3])
    sup = env.support(mu, baseline)
    # arm 0 never pays, arm 2 always does: one atom each, arm 1 two atoms
    assert sup.actions.shape == (4,)
    np.testing.assert_allclose(sup.prob.sum(), 1.0, atol=1e-15)
    np.testing.assert_allclose(sup.adv_first.sum(), mu @ (env.means - baseline), atol=1e-15)
    second = mu @ (env.reward_variance + (env.means - baseline) ** 2)
    np.testing.assert_allclose(sup.adv_second.sum(), second, atol=1e-15)
    values = sup.adv_first / sup.prob  # A is constant on a Bernoulli atom
    np.testing.assert_array_equal(sup.positive, values >= 0)
    np.testing.assert_allclose(sup.log_ratio[:, 0], np.log(env.pi / mu)[sup.actions], atol=1e-14)


def test_gaussian_support_partial_moments_match_quadrature():
    std = np.array([0.5, 1.0, 2.0])
    env = Bandit(np.zeros(3), np.array([-0.3, 0.4, 1.5]), reward="gaussian", reward_std=std)
    mu = np.array([0.3, 0.3, 0.4])
    b = 0.2
    sup = env.support(mu, b)
    assert sup.actions.shape == (6,)
    for y, pos, p, m1, m2 in zip(
        sup.actions, sup.positive, sup.prob, sup.adv_first, sup.adv_second
    ):
        m, s = env.means[y], std[y]

        def density(r, m=m, s=s):
            return np.exp(-0.5 * ((r - m) / s) ** 2) / (s * np.sqrt(2 * np.pi))

        lo, hi = (b, np.inf) if pos else (-np.inf, b)
        for k, target in ((0, p), (1, m1), (2, m2)):
            val = integrate.quad(
                lambda r, k=k: (r - b) ** k * density(r), lo, hi, epsabs=1e-13, epsrel=1e-12
            )[0]
            assert target == pytest.approx(mu[y] * val, abs=1e-10)


def test_divergences_use_simkit_divergence():
    env = Bandit(np.array([1.0, 0.0]), np.array([0.2, 0.7]))
    mu = np.array([0.5, 0.5])
    d = env.divergences(mu)
    assert d["chi2_tok"] == d["chi2_seq"] == pytest.approx(float(divergence.chi2(env.pi, mu)))
    assert d["kl_tok"] == d["kl_seq"] == pytest.approx(float(divergence.kl(env.pi, mu)))
    assert d["tv_tok"] == d["tv_seq"] == pytest.approx(float(divergence.tv(env.pi, mu)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logits": np.zeros((2, 2)), "means": np.zeros(2)}, "logits must have shape"),
        ({"logits": np.array([0.0, np.nan]), "means": np.zeros(2)}, "non-finite"),
        ({"logits": np.zeros(3), "means": np.zeros(2)}, r"means must have shape \(K,\) = \(3,\)"),
        ({"logits": np.zeros(2), "means": np.array([0.5, 1.5])}, r"in \[0, 1\]"),
        ({"logits": np.zeros(2), "means": np.zeros(2), "reward": "poisson"}, "reward must be"),
        ({"logits": np.zeros(2), "means": np.zeros(2), "reward_std": 1.0}, "Gaussian rewards only"),
        (
            {"logits": np.zeros(2), "means": np.zeros(2), "reward": "gaussian", "reward_std": 0.0},
            "> 0",
        ),
        (
            {
                "logits": np.zeros(2),
                "means": np.zeros(2),
                "reward": "gaussian",
                "reward_std": np.ones(3),
            },
            "reward_std must be a scalar or have shape",
        ),
    ],
)
def test_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Bandit(**kwargs)


def test_bad_behaviour_and_sampling_arguments():
    env = Bandit(np.zeros(3), np.full(3, 0.5))
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="not normalised"):
        env.sample(np.array([0.5, 0.5, 0.5]), 4, rng)
    with pytest.raises(ValueError, match=r"behaviour must have shape \(K,\) = \(3,\)"):
        env.sample(np.array([0.5, 0.5]), 4, rng)
    with pytest.raises(ValueError, match="negative"):
        env.support(np.array([1.5, -0.5, 0.0]))
    with pytest.raises(ValueError, match="n must be a positive integer"):
        env.sample(np.full(3, 1 / 3), 0, rng)
    with pytest.raises(ValueError, match="reps must be a positive integer"):
        env.sample(np.full(3, 1 / 3), 4, rng, reps=2.5)
    with pytest.raises(TypeError, match=r"numpy\.random\.Generator"):
        env.sample(np.full(3, 1 / 3), 4, 0)


def test_parameters_are_frozen_and_read_only():
    env = Bandit([0.0, 1.0], [0.1, 0.2])
    with pytest.raises(AttributeError):
        env.means = np.zeros(2)
    with pytest.raises(ValueError):
        env.means[0] = 1.0
