"""The moment DP with an additive per-token term (issue 24): h = a·Σ_t (c_t·A + β_t)·∇log π
with β_t a KL penalty's slope in the loss and/or a mapping's b (DRO, DPPO with β > 0), exact at
any T — equal to enumeration to 1e-10 at T ≤ 8 and to Monte Carlo within z·SE at T = 64."""

from __future__ import annotations

import numpy as np
import pytest

from simkit import mappings
from simkit.envs import TokenMDP
from simkit.envs.token_moments import additive_moments
from simkit.estimators import Estimator
from simkit.experiment import run
from simkit.experiment.exact import exact_moments, oracle_baseline
from simkit.experiment.monte_carlo import sample_gradients
from simkit.experiment.plan import plan
from simkit.kl import KL_ESTIMATORS, KLPenalty, token_log_ratio_to_ref


def _world(T, eos=2, seed=0, V=3):
    env = TokenMDP.markov(V=V, T=T, seed=seed, eos=eos)
    rng = np.random.default_rng(seed + 1)
    mu = env.with_logits(env.logits + 0.4 * rng.standard_normal(env.logits.shape)).pi
    ref = env.with_logits(env.logits + 0.6 * rng.standard_normal(env.logits.shape)).pi
    return env, mu, ref


def _estimators():
    out = []
    for i, name in enumerate(KL_ESTIMATORS):
        corr = "is" if i % 2 else None
        out.append(
            Estimator("ppo_clip", "seq-mean-token-sum", kl=KLPenalty(0.2, name, "loss", corr))
        )
    out += [
        Estimator("is_token", "seq-mean-token-sum", kl=KLPenalty(0.1, "k3", "loss")),
        Estimator(mappings.get("dro"), "seq-mean-token-sum"),
        Estimator(mappings.get("dppo_tv", beta=0.05), "seq-mean-token-sum"),
        Estimator(
            mappings.get("dppo_kl", beta=0.1),
            "seq-mean-token-sum-norm",
            kl=KLPenalty(0.3, "k2", "loss"),
        ),
        Estimator("naive", "token-sum", kl=KLPenalty(0.1, "k1", "loss")),
    ]
    return out


def _dp(env, mu, ref, est, n=1):
    b = oracle_baseline(env, mu, est, ref)
    m = additive_moments(
        env,
        mu,
        est.mapping,
        b,
        "seq-mean-token-sum" if est.aggregation == "token-sum" else est.aggregation,
        est.max_length,
        kl=est.kl,
        ref=ref,
    )
    if est.aggregation == "token-sum":  # Z = 1: n times the twin
        return n * m.mean, n**2 * m.variance(n)
    return m.mean, m.variance(n)


@pytest.mark.parametrize(("T", "eos"), [(1, None), (4, 2), (6, None), (8, 2)])
def test_additive_dp_equals_enumeration(T, eos):
    env, mu, ref = _world(T, eos)
    assert env.enumerable()
    for est in _estimators():
        mean, var = _dp(env, mu, ref, est, n=3)
        want = exact_moments(env, mu, est, 3, ref=ref)
        scale = 1.0 + float(np.abs(want.mean).max())
        np.testing.assert_allclose(mean, want.mean, atol=1e-10 * scale, err_msg=est.name)
        assert var == pytest.approx(want.variance, rel=1e-10, abs=1e-12), est.name


def test_token_mean_with_fixed_length_equals_enumeration():
    env, mu, ref = _world(5, None, seed=3)
    for est in (
        Estimator("ppo_clip", "token-mean", kl=KLPenalty(0.2, "k3", "loss")),
        Estimator(mappings.get("dro"), "token-mean", kl=KLPenalty(0.1, "low_var_kl", "loss")),
    ):
        mean, var = _dp(env, mu, ref, est, n=2)
        want = exact_moments(env, mu, est, 2, ref=ref)
        np.testing.assert_allclose(mean, want.mean, atol=1e-12)
        assert var == pytest.approx(want.variance, rel=1e-10)


def test_planner_reports_dp_beyond_enumeration_and_says_why_not():
    env, _, _ = _world(64)
    assert not env.enumerable()
    for est in _estimators():
        assert plan(est, env).method == "dp", est.name
    k_reward = Estimator("ppo_clip", "seq-mean-token-sum", kl=KLPenalty(0.1, "k1", "reward"))
    assert "reward" in plan(k_reward, env).why_mc
    seq = Estimator("is_seq", "seq-mean-token-sum", kl=KLPenalty(0.1, "k3", "loss"))
    assert "sequence level" in plan(seq, env).why_mc
    tied = Estimator(mappings.get("dro"), "seq-mean-token-sum")
    assert "untied" in plan(tied, env, params="tied").why_mc


def test_additive_dp_matches_monte_carlo_at_T64():
    """Fixed seed, fixed length 64: the Monte Carlo mean projected on E ĝ (the DP's) and on four
    random directions within z·SE of the DP's projection, and the mean of ‖ĝ_r − ḡ‖² within
    z·SE of the DP's Var ĝ (z = 4)."""
    env, mu, ref = _world(64, eos=None, seed=5)
    ests = [
        Estimator("ppo_clip", "seq-mean-token-sum", kl=KLPenalty(0.2, "k3", "loss")),
        Estimator(mappings.get("dro"), "seq-mean-token-sum", kl=KLPenalty(0.1, "k2", "loss", "is")),
        Estimator(mappings.get("dppo_tv", beta=0.05), "seq-mean-token-sum"),
    ]
    n, reps, z = 4, 4000, 4.0
    batch = env.sample(mu, n, np.random.default_rng(11), reps=reps)
    ref_lr = token_log_ratio_to_ref(
        env, ref, mu, batch.actions, batch.mask, batch.log_ratio, batch.states
    )
    exact = run(env, mu, ests, n=n, reps=2, seed=0, ref=ref).set_index("estimator")
    assert (exact["method"] == "dp").all()
    for est in ests:
        b = oracle_baseline(env, mu, est, ref)
        m = additive_moments(env, mu, est.mapping, b, est.aggregation, kl=est.kl, ref=ref)
        assert exact.loc[est.name, "variance"] == pytest.approx(m.variance(n), rel=1e-12)
        g = sample_gradients(env, batch, est, ref_log_ratio=ref_lr, baseline=b).gradients
        g_bar = g.mean(axis=0)
        dirs = np.vstack([m.mean, np.random.default_rng(3).standard_normal((4, m.mean.size))])
        dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
        proj = g @ dirs.T  # (reps, 5)
        se = proj.std(axis=0, ddof=1) / np.sqrt(reps)
        assert np.all(np.abs(proj.mean(axis=0) - dirs @ m.mean) <= z * se), est.name
        q = ((g - g_bar) ** 2).sum(axis=1) * reps / (reps - 1)
        assert abs(q.mean() - m.variance(n)) <= z * q.std(ddof=1) / np.sqrt(reps), est.name
        # the additive term matters here: without it the mean is elsewhere
        plain = additive_moments(env, mu, est.mapping, b, est.aggregation)
        if est.kl is not None:
            assert abs(dirs[0] @ (plain.mean - m.mean)) > 10 * se[0], est.name
