"""The scale-free error and the kept fractions on every row of ``experiment.run``.

``mse_zero`` = ‖∇J‖², ``alpha_star`` = ⟨E ĝ, ∇J⟩ / E‖ĝ‖², ``mse_scaled`` = ‖∇J‖² −
⟨E ĝ, ∇J⟩² / E‖ĝ‖², ``rel_mse_scaled`` = mse_scaled / mse_zero, ``kept`` / ``kept_seq``:
exact rows equal an enumeration written here (independent of ``env.support``) to 1e-10;
Monte Carlo rows cover it within z·SE of the same draws; the planner's ``method`` and
``why_mc`` are on every row.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from simkit import experiment, shifts
from simkit.envs import Bandit, TokenMDP
from simkit.estimators import Estimator
from simkit.experiment.metrics import kept_fractions, scale_free
from simkit.figures.mse_vs_T import dialed_behaviour

PI = np.array([0.45, 0.25, 0.15, 0.1, 0.05])
MEANS = np.array([0.9, 0.2, 0.5, 0.1, 0.7])
BANDIT_MAPPINGS = ("naive", "is_seq", "ppo_clip", "icepop", "tis_token", "kl_rs", "vespo")
TOKEN_MAPPINGS = ("naive", "is_token", "ppo_clip", "icepop", "is_seq", "gspo", "tis_seq", "kl_rs")


def _scale_free_by_hand(mean, second, grad_J):
    """The formulas, written out: E‖ĝ‖² = ``second``."""
    zero = float(grad_J @ grad_J)
    inner = float(mean @ grad_J)
    alpha = inner / second if second > 0 else 0.0
    scaled = zero - inner * alpha
    return {"mse_zero": zero, "alpha_star": alpha, "mse_scaled": scaled}


def _bandit_enumeration(env: Bandit, mu, est: Estimator, n: int):
    """E ĝ, E‖ĝ‖², kept, kept_seq of an n-sample bandit estimator with Bernoulli rewards,
    enumerating (arm, reward) pairs: ĝ = (1/n) Σ_i c_i A_i (e_{y_i} − π)."""
    pi = env.pi
    b = experiment.oracle_baseline(env, mu, est)
    K = pi.size
    mean = np.zeros(K)
    sq = 0.0
    kept = 0.0
    for arm, reward in itertools.product(range(K), (0.0, 1.0)):
        p = mu[arm] * (MEANS[arm] if reward else 1.0 - MEANS[arm])
        if p == 0:
            continue
        A = reward - b
        lr = np.array([[math.log(pi[arm]) - math.log(mu[arm])]])
        c = float(est.mapping.coefficients(lr, np.ones((1, 1), bool), np.array([A]))[0, 0])
        score = -pi.copy()
        score[arm] += 1.0
        g = c * A * score
        mean += p * g
        sq += p * float(g @ g)
        kept += p * (c != 0)
    var = (sq - float(mean @ mean)) / n
    return mean, float(mean @ mean) + var, kept, kept


@pytest.mark.parametrize("name", BANDIT_MAPPINGS)
@pytest.mark.parametrize("chi2", [1e-3, 0.5])
def test_bandit_exact_rows_equal_enumeration(name, chi2):
    env = Bandit(logits=np.log(PI), means=MEANS)
    mu = shifts.dial(PI, chi2, divergence="chi2", family="temperature")
    est = Estimator(name)
    n = 32
    row = experiment.run(env, mu, [est], n=n, reps=20, seed=1).iloc[0]
    assert row.method == "enumeration" and row.why_mc == ""
    mean, second, kept, kept_seq = _bandit_enumeration(env, mu, est, n)
    want = _scale_free_by_hand(mean, second, env.grad_J())
    for key, value in want.items():
        assert row[key] == pytest.approx(value, rel=1e-10, abs=1e-14), key
    assert row.rel_mse_scaled == pytest.approx(want["mse_scaled"] / want["mse_zero"], rel=1e-10)
    assert row.kept == pytest.approx(kept, abs=1e-12)
    assert row.kept_seq == pytest.approx(kept_seq, abs=1e-12)
    assert 0.0 <= row.rel_mse_scaled <= 1.0
    assert row.mse_scaled <= row.mse + 1e-15  # α = 1 is one of the scales


def _token_enumeration(env: TokenMDP, mu, est: Estimator, n: int):
    """E ĝ, E‖ĝ‖², kept, kept_seq on a fixed-length token MDP (no EOS), untied parameters,
    ``seq-mean-token-sum``: every one of the V^T sequences walked through the automaton."""
    pi_tab, mu_tab = env.pi, np.asarray(mu)
    T, P, V = pi_tab.shape
    b = experiment.oracle_baseline(env, mu, est)
    mean = np.zeros((T, P, V))
    sq = 0.0
    kept_tok = kept_seq = 0.0
    for y in itertools.product(range(V), repeat=T):
        s = env.initial_state
        prob, lr, rows = 1.0, np.empty(T), []
        for t, v in enumerate(y):
            p = env.policy_index[s]
            prob *= mu_tab[t, p, v]
            lr[t] = math.log(pi_tab[t, p, v]) - math.log(mu_tab[t, p, v])
            rows.append(p)
            s = env.transition[s, v]
        if prob == 0:
            continue
        A = env.reward[s] - b
        c = est.mapping.coefficients(lr[None], np.ones((1, T), bool), np.array([A]))[0]
        g = np.zeros((T, P, V))
        for t, (v, p) in enumerate(zip(y, rows)):
            g[t, p] -= c[t] * A * pi_tab[t, p]
            g[t, p, v] += c[t] * A
        mean += prob * g
        sq += prob * float(np.sum(g * g))
        kept_tok += prob * np.count_nonzero(c) / T
        kept_seq += prob * bool(np.any(c != 0))
    mean = mean.ravel()
    var = (sq - float(mean @ mean)) / n
    return mean, float(mean @ mean) + var, kept_tok, kept_seq


@pytest.mark.parametrize("name", TOKEN_MAPPINGS)
def test_token_mdp_exact_rows_equal_enumeration(name):
    env = TokenMDP.answer_correct(V=3, T=4, seed=2, scale=1.0)
    mu = dialed_behaviour(env, 0.3, "logit_noise")
    est = Estimator(name, aggregation="seq-mean-token-sum")
    n = 16
    row = experiment.run(env, mu, [est], n=n, reps=20, seed=0).iloc[0]
    assert row.method == "enumeration"
    mean, second, kept, kept_seq = _token_enumeration(env, mu, est, n)
    want = _scale_free_by_hand(mean, second, env.grad_J())
    for key, value in want.items():
        assert row[key] == pytest.approx(value, rel=1e-10, abs=1e-14), key
    assert row.kept == pytest.approx(kept, abs=1e-12)
    assert row.kept_seq == pytest.approx(kept_seq, abs=1e-12)


@pytest.mark.parametrize("name", ("naive", "is_seq", "ppo_clip", "icepop", "kl_rs"))
def test_monte_carlo_rows_cover_the_exact_values(name):
    """exact=False on the same estimator: |MC − exact| ≤ z·SE, the SE read off the row's 99 %
    bootstrap interval (half-width / 2.576); kept within z·SE of a binomial proportion."""
    env = TokenMDP.answer_correct(V=3, T=4, seed=2, scale=1.0)
    mu = dialed_behaviour(env, 0.3, "logit_noise")
    est = Estimator(name)
    kw = dict(n=16, seed=3, n_boot=400, level=0.99)
    exact = experiment.run(env, mu, [est], reps=20, **kw).iloc[0]
    mc = experiment.run(env, mu, [est], reps=3000, exact=False, **kw).iloc[0]
    assert mc.method == "monte_carlo" and mc.why_mc == "exact=False was asked"
    assert exact.mse_zero == mc.mse_zero  # ∇J is exact on both paths
    z = 4.0
    for key in ("mse_scaled", "rel_mse_scaled"):
        se = (mc[f"{key}_hi"] - mc[f"{key}_lo"]) / (2 * 2.576)
        assert abs(mc[key] - exact[key]) <= z * se + 1e-12, (key, mc[key], exact[key], se)
    tokens = 3000 * 16 * 4
    for key, count in (("kept", tokens), ("kept_seq", 3000 * 16)):
        p = exact[key]
        se = math.sqrt(max(p * (1 - p), 1e-12) / count) * 4  # batches of 16·4 correlated tokens
        assert abs(mc[key] - p) <= z * se + 1e-12, (key, mc[key], p)
        assert mc[f"{key}_lo"] <= mc[key] <= mc[f"{key}_hi"]


def test_kl_rs_in_the_mse_vs_T_setting_is_the_zero_estimator():
    """answer_correct V = 2, χ² = 0.05 per token, n = 16: kl_rs rejects every sequence at
    T = 4, 8, 12 — rel_mse_scaled = 1 (to 1e-12), kept_seq = 0, and its MSE is ‖∇J‖²."""
    for T in (4, 8, 12):
        env = TokenMDP.answer_correct(V=2, T=T, seed=0, scale=1.0)
        mu = dialed_behaviour(env, 0.05, "logit_noise")
        row = experiment.run(env, mu, ["kl_rs", "naive"], n=16, reps=10, seed=0)
        kl, naive = row.iloc[0], row.iloc[1]
        assert kl.exact and kl.method == "enumeration"
        assert kl.rel_mse_scaled == pytest.approx(1.0, abs=1e-12)
        assert kl.kept_seq == 0.0 and kl.kept == 0.0
        assert kl.mse == pytest.approx(kl.mse_zero, rel=1e-12)
        assert naive.rel_mse_scaled < 1.0 and naive.kept_seq == 1.0


def test_scale_free_is_invariant_to_rescaling_and_rewards_no_shrinkage():
    rng = np.random.default_rng(0)
    grad = rng.normal(size=6)
    mean = grad + 0.3 * rng.normal(size=6)
    base = scale_free(mean, 0.7, grad)
    for c in (0.01, 0.5, -3.0, 40.0):
        scaled = scale_free(c * mean, c**2 * 0.7, grad)
        assert scaled["rel_mse_scaled"] == pytest.approx(base["rel_mse_scaled"], rel=1e-12)
        assert scaled["alpha_star"] * c == pytest.approx(base["alpha_star"], rel=1e-12)
    zero = scale_free(np.zeros(6), 0.0, grad)
    assert zero == {
        "mse_zero": pytest.approx(float(grad @ grad)),
        "alpha_star": 0.0,
        "mse_scaled": pytest.approx(float(grad @ grad)),
        "rel_mse_scaled": 1.0,
    }
    # closed form: 1 − cos²·snr/(1 + snr)
    cos = float(mean @ grad) / (np.linalg.norm(mean) * np.linalg.norm(grad))
    snr = float(mean @ mean) / 0.7
    assert base["rel_mse_scaled"] == pytest.approx(1 - cos**2 * snr / (1 + snr), rel=1e-12)
    assert math.isnan(scale_free(mean, 0.7, np.zeros(6))["rel_mse_scaled"])
    with pytest.raises(ValueError, match="variance"):
        scale_free(mean, -1.0, grad)


def test_kept_fractions_by_hand():
    c = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 5.0]])
    mask = np.array([[True, True, True], [True, True, False], [True, False, True]])
    out = kept_fractions(c, mask)
    assert out["kept"] == pytest.approx(3 / 7)
    assert out["kept_seq"] == pytest.approx(2 / 3)
    w = np.array([0.5, 0.25, 0.25])
    out = kept_fractions(c, mask, w)
    assert out["kept"] == pytest.approx((0.5 * 1 + 0.25 * 2) / (0.5 * 3 + 0.25 * 2 + 0.25 * 2))
    assert out["kept_seq"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="weights"):
        kept_fractions(c, mask, np.ones(2))
    with pytest.raises(ValueError, match="same shape"):
        kept_fractions(c, mask[:, :2])


def test_planner_answers_once_per_row_and_names_the_obstacle():
    env = TokenMDP.answer_correct(V=2, T=24, seed=0)
    mu = dialed_behaviour(env, 0.05, "logit_noise")
    table = experiment.run(
        env,
        mu,
        ["naive", "is_seq", "gspo", "snis", Estimator("naive", advantage="grpo", group_size=4)],
        n=8,
        reps=20,
        seed=0,
    )
    got = dict(zip(table.estimator, zip(table.method, table.why_mc)))
    assert got["naive"] == ("dp", "") and got["is_seq"] == ("dp", "")
    assert got["gspo"][0] == "monte_carlo" and "enumeration budget" in got["gspo"][1]
    assert got["snis"][0] == "monte_carlo" and "batch dependent" in got["snis"][1]
    grpo = next(k for k in got if k.startswith("naive") and k != "naive")
    assert "couples the samples" in got[grpo][1]
    assert set(table.method) <= set(experiment.METHODS)
    assert (table.exact == (table.method != "monte_carlo")).all()
    plan = experiment.plan("gspo", env)
    assert plan.why_mc == experiment.why_not_exact(Estimator("gspo"), env)
    with pytest.raises(ValueError, match="method"):
        experiment.Plan("nope")
