"""experiment.run(params="tied"): the gradient w.r.t. one table shared by every position.

Checked against an independent brute force: every sequence enumerated, its tied score vector
Σ_t λ_t (e_{y_t} − π_t(·|s_t)) formed in block p_t = policy_index[s_t] of a (P, V) table by
loops, and the tied ∇J by central finite differences of J in the tied parameters.
"""

import itertools

import numpy as np
import pytest

from simkit import experiment, mappings
from simkit.envs import TokenMDP
from simkit.estimators import Estimator
from simkit.figures.mse_vs_T import dialed_behaviour

TOL = 1e-11
NAMES = ("naive", "is_token", "ppo_clip", "is_seq", "tis_seq")


def _env(T=5):
    env = TokenMDP.answer_correct(V=2, T=T, seed=3, scale=1.0)
    return env, dialed_behaviour(env, 0.1, "logit_noise")


def _brute(env, mu, mapping, b):
    """E h and E‖h‖² of one sample, tied parameters, by explicit enumeration and loops."""
    T, P, V = env.logits.shape
    mean = np.zeros((P, V))
    second = 0.0
    for y in itertools.product(range(V), repeat=T):
        s, q, lr, cls = env.initial_state, 1.0, [], []
        for t, v in enumerate(y):
            k = env.policy_index[s]
            q *= mu[t, k, v]
            lr.append(np.log(env.pi[t, k, v]) - np.log(mu[t, k, v]))
            cls.append((k, s))
            s = env.transition[s, v]
        A = env.reward[s] - b
        c = mapping.coefficients(np.array([lr]), np.ones((1, T), bool), np.array([A]))[0]
        h = np.zeros((P, V))
        for t, v in enumerate(y):
            k, _ = cls[t]
            score = -env.pi[t, k].copy()
            score[v] += 1.0
            h[k] += c[t] * A * score
        mean += q * h
        second += q * float(np.sum(h**2))
    return mean.ravel(), second


def _tied_grad_J(env, h=1e-5):
    _, P, V = env.logits.shape
    base = np.asarray(env.logits)
    grad = np.zeros((P, V))
    for k in range(P):
        for v in range(V):
            d = np.zeros((P, V))
            d[k, v] = h
            plus = env.with_logits(base + d).J()
            minus = env.with_logits(base - d).J()
            grad[k, v] = (plus - minus) / (2 * h)
    return grad.ravel()


def test_tie_is_the_sum_of_blocks():
    v = np.arange(24.0).reshape(2, 12)
    np.testing.assert_array_equal(experiment.tie(v, 3), v.reshape(2, 3, 4).sum(axis=1))
    with pytest.raises(ValueError, match="cannot tie"):
        experiment.tie(np.zeros(5), 2)


def test_tied_grad_J_is_the_sum_of_blocks_of_untied():
    env, _ = _env()
    np.testing.assert_allclose(
        experiment.tie(env.grad_J(), env.T), _tied_grad_J(env), rtol=0, atol=1e-9
    )


@pytest.mark.parametrize("name", NAMES)
def test_tied_exact_rows_equal_brute_force(name):
    env, mu = _env()
    n = 3
    est = Estimator(mappings.get(name), aggregation="seq-mean-token-sum", name=name)
    row = experiment.run(env, mu, est, n=n, reps=2, exact=True, params="tied").iloc[0]
    mean, second = _brute(env, mu, est.mapping, env.J(mu))
    grad = experiment.tie(env.grad_J(), env.T)
    assert row.params == "tied"
    assert row.bias == pytest.approx(float(np.linalg.norm(mean - grad)), abs=TOL)
    assert row.variance == pytest.approx((second - mean @ mean) / n, abs=TOL)
    # and tied ≠ untied (the cross-position terms matter), so the test can fail
    untied = experiment.run(env, mu, est, n=n, reps=2, exact=True).iloc[0]
    assert untied.params == "untied"
    if name != "is_seq":
        assert abs(untied.bias - row.bias) > 1e-6


def test_tied_monte_carlo_agrees_with_exact():
    env, mu = _env()
    ests = [Estimator(m, aggregation="seq-mean-token-sum", name=m) for m in ("naive", "ppo_clip")]
    ex = experiment.run(env, mu, ests, n=4, reps=2, exact=True, params="tied")
    mc = experiment.run(env, mu, ests, n=4, reps=3000, exact=False, params="tied", seed=4)
    for col in ("variance", "bias"):
        lo, hi = mc[f"{col}_lo"].to_numpy(), mc[f"{col}_hi"].to_numpy()
        truth = ex[col].to_numpy()
        assert np.all((lo - 1e-9 <= truth) & (truth <= hi + 1e-9)), (col, lo, truth, hi)


def test_params_validation():
    env, mu = _env(3)
    with pytest.raises(ValueError, match="params must be one of"):
        experiment.run(env, mu, "naive", n=2, reps=2, params="shared")
