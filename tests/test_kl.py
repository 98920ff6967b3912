"""The KL penalty to a reference policy (issue 24, item 2): estimators against the upstream
formulas, the exact KL_seq and its gradient against finite differences, and, by enumeration,
which estimator in which place gives the KL's gradient on- and off-policy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simkit.envs import Bandit, TokenMDP
from simkit.envs.additive import additive_expectation, additive_value_and_grad
from simkit.estimators import Estimator
from simkit.experiment import run
from simkit.experiment.exact import exact_moments, oracle_baseline, penalised_support
from simkit.kl import (
    KL_ESTIMATORS,
    KLPenalty,
    expected_penalty,
    kl_estimate,
    kl_seq_and_grad,
    kl_slope,
)


def _markov(T=3, eos=None, seed=1):
    env = TokenMDP.markov(V=3, T=T, seed=seed, eos=eos)
    rng = np.random.default_rng(seed + 10)
    ref = env.with_logits(env.logits + 0.6 * rng.standard_normal(env.logits.shape)).pi
    mu = env.with_logits(env.logits + 0.4 * rng.standard_normal(env.logits.shape)).pi
    return env, ref, mu


def _bandit():
    env = Bandit(logits=np.array([0.3, -0.2, 0.5, -0.7]), means=np.array([0.2, 0.7, 0.4, 0.9]))
    ref = np.array([0.1, 0.4, 0.3, 0.2])
    mu = np.array([0.3, 0.2, 0.25, 0.25])
    return env, ref, mu


def _fd_kl(env, ref, eps=1e-6):
    theta = env.logits.ravel().copy()
    out = np.empty(theta.size)
    for i in range(theta.size):
        step = np.zeros_like(theta)
        step[i] = eps
        if hasattr(env, "with_logits"):
            up = env.with_logits((theta + step).reshape(env.logits.shape))
            down = env.with_logits((theta - step).reshape(env.logits.shape))
        else:
            up = Bandit(logits=theta + step, means=env.means)
            down = Bandit(logits=theta - step, means=env.means)
        out[i] = (kl_seq_and_grad(up, ref)[0] - kl_seq_and_grad(down, ref)[0]) / (2 * eps)
    return out


# --- the truth --------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: _markov(4, eos=2), lambda: _markov(3), _bandit])
def test_exact_kl_gradient_equals_finite_differences_of_the_exact_kl(make):
    env, ref, _ = make()
    value, grad = kl_seq_and_grad(env, ref)
    assert value == pytest.approx(env.divergences(ref)["kl_seq"], abs=1e-12)
    np.testing.assert_allclose(grad, _fd_kl(env, ref), atol=2e-9)


def test_additive_dp_equals_enumeration():
    env, _, mu = _markov(4, eos=2)
    g = np.random.default_rng(0).standard_normal(env.logits.shape)
    atoms = env.support(mu)
    per_token = np.where(atoms.mask, g[np.arange(env.T), atoms.states, atoms.actions], 0.0)
    assert additive_expectation(env, g, mu) == pytest.approx(
        float(atoms.prob @ per_token.sum(1)), abs=1e-13
    )
    # E_π[Σ g] with g held fixed, and its gradient, against enumeration under π
    pi_atoms = env.support(env.pi)
    per_pi = np.where(pi_atoms.mask, g[np.arange(env.T), pi_atoms.states, pi_atoms.actions], 0.0)
    value, grad = additive_value_and_grad(env, g)
    assert value == pytest.approx(float(pi_atoms.prob @ per_pi.sum(1)), abs=1e-13)
    weights = pi_atoms.mask * (per_pi.sum(1) * pi_atoms.prob)[:, None]
    np.testing.assert_allclose(grad, env.accumulate(pi_atoms.actions, weights), atol=1e-13)


# --- the estimators against verl 1dda039 and TRL f2cd577 ----------------------------------


def _verl_kl_penalty_forward(logprob, ref_logprob, kind):
    """verl-project/verl@1dda039, verl/trainer/ppo/core_algos.py, kl_penalty_forward, restated."""
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "abs":
        return np.abs(logprob - ref_logprob)
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob) ** 2
    kl = np.clip(ref_logprob - logprob, -20, 20)  # "low_var_kl" and "k3" alike in verl
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


def test_values_match_verl_1dda039_kl_penalty_forward():
    rng = np.random.default_rng(0)
    lp = np.log(rng.dirichlet(np.ones(5), 40)).ravel()
    ref = np.log(rng.dirichlet(np.ones(5), 40)).ravel()
    x = lp - ref
    for name in ("k1", "k2", "abs", "low_var_kl"):
        want = _verl_kl_penalty_forward(lp, ref, name)
        np.testing.assert_allclose(kl_estimate(x, name), want, rtol=1e-12, atol=1e-14)
        if name != "k2":  # verl treats "k2+" as k2; simkit does not list it
            np.testing.assert_allclose(kl_estimate(x, name + "+"), want, rtol=1e-12, atol=1e-14)
    # simkit's "k3" is Schulman's k3 without verl's clamps: equal where no clamp is active
    small = np.abs(x) < 2
    np.testing.assert_allclose(
        kl_estimate(x, "k3")[small], _verl_kl_penalty_forward(lp, ref, "k3")[small], rtol=1e-12
    )
    big = np.array([-30.0, 3.0, 25.0])  # u = 30 (clamped to 20, kld > 10), u = −3, u = −25
    assert kl_estimate(big, "low_var_kl").tolist() == pytest.approx([10.0, 2.049787068, 10.0])
    assert kl_estimate(big, "k3")[0] == pytest.approx(math.exp(30) - 31)


def test_slopes_match_torch_autograd_of_the_upstream_expressions():
    torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(0, 1.5, 50), [-30.0, -3.0, 0.0, 3.0, 30.0]])
    lr = rng.normal(0, 0.3, x.size)
    for name in KL_ESTIMATORS:
        lp = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        ref = torch.zeros_like(lp)
        base = name.rstrip("+")
        if base in ("k3", "low_var_kl"):
            u = ref - lp
            if base == "low_var_kl":
                u = torch.clamp(u, min=-20, max=20)
            value = torch.exp(u) - u - 1
            if base == "low_var_kl":
                value = torch.clamp(value, min=-10, max=10)
        elif base == "k1":
            value = lp - ref
        elif base == "k2":
            value = 0.5 * (lp - ref).square()
        else:
            value = (lp - ref).abs()
        if name.endswith("+"):  # verl 1dda039 kl_penalty: straight through to k2
            back = 0.5 * (lp - ref).square()
            value = back - back.detach() + value.detach()
        # TRL f2cd577 use_bias_correction_kl: per_token_kl * coef_1, coef_1 not detached
        coef = torch.exp(lp - torch.tensor(x - lr, dtype=torch.float64))
        for corr, expr in ((None, value), ("is", value * coef)):
            (grad,) = torch.autograd.grad(expr.sum(), lp, retain_graph=True)
            pen = KLPenalty(1.0, name, correction=corr)
            # torch's w·(e^{−x} + x − 1) loses digits to cancellation at |x| = 30 (simkit: w·x)
            ok = np.abs(x) < 20 if (name, corr) == ("k3", "is") else np.ones(x.size, bool)
            np.testing.assert_allclose(
                pen.slopes(x, lr)[ok], grad.numpy()[ok], rtol=1e-12, atol=1e-14, err_msg=name
            )
            np.testing.assert_allclose(
                pen.values(x, lr), expr.detach().numpy(), rtol=1e-12, atol=1e-14
            )


def test_on_policy_identities_of_the_slopes():
    x = np.linspace(-2, 2, 41)
    zero = np.zeros_like(x)
    k2 = kl_slope(x, "k2")
    # straight-through variants carry k2's gradient; k3·(π/π_old) at π_old = π carries k1·score
    for name in ("k1+", "k3+", "abs+", "low_var_kl+"):
        np.testing.assert_array_equal(kl_slope(x, name), k2)
    np.testing.assert_allclose(KLPenalty(1, "k3", correction="is").slopes(x, zero), k2, atol=1e-15)
    np.testing.assert_allclose(KLPenalty(1, "k1", correction="is").slopes(x, zero), 1 + x)


# --- which estimator in which place gives ∇KL: by enumeration ------------------------------


def _kl_table(env, ref, mu, estimators=KL_ESTIMATORS, mapping="is_seq", beta=0.1):
    ests = [
        Estimator(
            mapping,
            aggregation="seq-mean-token-sum",
            kl=KLPenalty(beta, e, w, c),
            name=f"{e}|{w}|{c or 'none'}",
        )
        for e in estimators
        for w in ("loss", "reward")
        for c in (None, "is")
    ]
    df = run(env, mu, ests, n=4, reps=2, seed=0, ref=ref)
    assert df["exact"].all() and (df["method"] == "enumeration").all()
    return df.set_index("estimator")


def _unbiased(df):
    rel = df["kl_bias"] / df["kl_grad_norm"]
    return sorted(rel.index[rel < 1e-12])


def test_on_policy_only_k1_in_the_reward_is_unbiased_for_sequences():
    # token MDP whose states depend on the previous token: the KL of later tokens depends on
    # the earlier ones, which no per-token loss term sees
    env, ref, _ = _markov(3)
    df = _kl_table(env, ref, env.pi)
    assert _unbiased(df) == ["k1+|reward|is", "k1+|reward|none", "k1|reward|is", "k1|reward|none"]
    rel = df["kl_bias"] / df["kl_grad_norm"]
    assert rel["k1|loss|none"] == pytest.approx(1.0, abs=1e-12)  # E[score] = 0: no gradient
    # k2, every "+" and k3·(π/π_old) give the same (per-state) gradient in the loss
    same = ["k2|loss|none", "k3+|loss|none", "k1+|loss|none", "k3|loss|is", "k1|loss|is"]
    assert np.ptp(rel[same].to_numpy()) < 1e-12
    assert 0.01 < rel["k2|loss|none"] < 0.9
    # the total's bias is the KL part's bias: is_seq on-policy is unbiased for ∇J
    np.testing.assert_allclose(df["bias"], df["kl_bias"], atol=1e-12)


def test_on_the_bandit_every_per_state_gradient_is_unbiased():
    env, ref, mu = _bandit()
    on = _unbiased(_kl_table(env, ref, env.pi))
    per_state = ["k1+", "k2", "k3+", "abs+", "low_var_kl+"]
    want = sorted(
        [f"{e}|loss|none" for e in per_state]
        + [f"{e}|loss|is" for e in ("k1", "k3", "low_var_kl")]
        + ["k1|reward|none", "k1|reward|is", "k1+|reward|none", "k1+|reward|is"]
    )
    assert on == want
    # off-policy (μ ≠ π): the sampling weight π/μ is what keeps the loss placement unbiased;
    # in the reward the sequence ratio of is_seq already does, and the extra π/μ breaks it
    off_df = _kl_table(env, ref, mu)
    off = _unbiased(off_df)
    assert off == sorted(
        [f"{e}|loss|is" for e in ("k1", "k3", "low_var_kl")] + ["k1|reward|none", "k1+|reward|none"]
    )
    rel = off_df["kl_bias"] / off_df["kl_grad_norm"]
    assert rel["k2|loss|none"] > 0.05 and rel["k1|reward|is"] > 0.05


def test_reward_placement_baseline_centres_the_penalised_advantage():
    for env, ref, mu in (_markov(3, eos=2), _bandit()):
        for corr in (None, "is"):
            est = Estimator("naive", kl=KLPenalty(0.3, "k3", "reward", corr))
            b = oracle_baseline(env, mu, est, ref)
            assert b == pytest.approx(env.J(mu) - 0.3 * expected_penalty(env, ref, mu, est.kl))
            atoms = penalised_support(env, mu, ref, est.kl, b, env.support(mu, b))
            assert float(atoms.adv_first.sum()) == pytest.approx(0.0, abs=1e-13)
            assert float(atoms.prob.sum()) == pytest.approx(1.0, abs=1e-13)


def test_monte_carlo_kl_bias_bounds_cover_the_exact_value():
    env, ref, mu = _markov(3, eos=2)
    ests = [
        Estimator("is_seq", "seq-mean-token-sum", kl=KLPenalty(0.5, e, w, c), name=f"{e}{w}{c}")
        for e, w, c in (("k1", "loss", None), ("k3", "loss", "is"), ("k2", "reward", None))
    ]
    exact = run(env, mu, ests, n=4, reps=2, seed=0, ref=ref).set_index("estimator")
    mc = run(env, mu, ests, n=4, reps=4000, seed=3, ref=ref, exact=False).set_index("estimator")
    for name in exact.index:
        lo, hi = mc.loc[name, "kl_bias_lo"], mc.loc[name, "kl_bias_hi"]
        assert lo <= exact.loc[name, "kl_bias"] <= hi
        assert mc.loc[name, "bias_lo"] <= exact.loc[name, "bias"] <= mc.loc[name, "bias_hi"]


def test_variance_of_a_loss_penalty_by_enumeration_equals_monte_carlo():
    env, ref, mu = _markov(3)
    est = Estimator("is_token", "seq-mean-token-sum", kl=KLPenalty(0.7, "k3", "loss", "is"))
    exact = exact_moments(env, mu, est, 4, ref=ref)
    draws = env.sample(mu, 4, np.random.default_rng(0), reps=20000)
    from simkit.experiment.monte_carlo import sample_gradients
    from simkit.kl import token_log_ratio_to_ref

    x = token_log_ratio_to_ref(
        env, ref, mu, draws.actions, draws.mask, draws.log_ratio, draws.states
    )
    g = sample_gradients(env, draws, est, ref_log_ratio=x).gradients
    var = float(np.sum(g.var(axis=0, ddof=1)))
    # the sample variance's relative SE is about sqrt(2/reps)·(kurtosis factor): 5 % is > 4 SE
    assert var == pytest.approx(exact.variance, rel=0.05)
    se = np.sqrt(g.var(axis=0, ddof=1) / g.shape[0])
    assert np.all(np.abs(g.mean(axis=0) - exact.mean) <= 5 * se + 1e-15)


def test_rows_without_a_penalty_are_unchanged_by_ref():
    env, ref, mu = _markov(3)
    ests = [Estimator("is_token"), Estimator("naive", advantage="raw")]
    a = run(env, mu, ests, n=4, reps=20, seed=0)
    b = run(env, mu, ests, n=4, reps=20, seed=0, ref=ref)
    for col in ("bias", "variance", "cosine"):
        np.testing.assert_array_equal(a[col], b[col])
    assert b["kl_bias"].isna().all() and (b["kl_seq_ref"] > 0).all()


# --- bad input ------------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="beta must be finite and >= 0"):
        KLPenalty(-0.1)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        KLPenalty(0.1, "k4")
    with pytest.raises(ValueError, match="where must be one of"):
        KLPenalty(0.1, where="advantage")
    with pytest.raises(ValueError, match="correction must be None or 'is'"):
        KLPenalty(0.1, correction="tis")
    with pytest.raises(TypeError, match="kl must be a KLPenalty"):
        Estimator("naive", kl=0.1)
    env, _, mu = _bandit()
    est = Estimator("naive", kl=KLPenalty(0.1))
    with pytest.raises(ValueError, match="have a KL penalty: pass ref"):
        run(env, mu, [est], n=4, reps=2)
    with pytest.raises(ValueError, match="ref gives probability 0"):
        run(env, mu, [est], n=4, reps=2, ref=np.array([0.5, 0.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="pass ref_log_ratio"):
        est.token_weights(np.zeros((2, 1)), np.ones((2, 1), bool), np.zeros(2), J=0.0)


def test_kl_rows_beyond_enumeration_go_to_monte_carlo_with_the_reason():
    from simkit.experiment import plan

    env = TokenMDP.markov(V=3, T=16, seed=0)
    est = Estimator("is_token", "seq-mean-token-sum", kl=KLPenalty(0.1, "k1", "reward"))
    p = plan(est, env)
    assert p.method == "monte_carlo" and "KL penalty in the reward" in p.why_mc
    # in the loss, on a token-level mapping: the additive moment DP (untied), exact
    loss = Estimator("is_token", "seq-mean-token-sum", kl=KLPenalty(0.1, "k1", "loss"))
    assert plan(loss, env).method == "dp"
    assert "untied parameters only" in plan(loss, env, params="tied").why_mc


def test_tied_parameters_exact_kl_rows_lie_in_the_monte_carlo_bounds():
    env, ref, mu = _markov(3, eos=2)
    ests = [
        Estimator("is_token", "seq-mean-token-sum", kl=KLPenalty(0.5, e, w), name=f"{e}{w}")
        for e, w in (("k3", "loss"), ("k1", "reward"))
    ]
    kw = {"n": 4, "ref": ref, "params": "tied"}
    exact = run(env, mu, ests, reps=2, seed=0, **kw).set_index("estimator")
    mc = run(env, mu, ests, reps=4000, seed=5, exact=False, **kw).set_index("estimator")
    for name in exact.index:
        for col in ("kl_bias", "bias", "variance"):
            lo, hi = mc.loc[name, f"{col}_lo"], mc.loc[name, f"{col}_hi"]
            assert lo <= exact.loc[name, col] <= hi, (name, col)


def test_off_policy_numbers_and_identities_by_enumeration():
    env, ref, mu = _markov(3)
    df = _kl_table(env, ref, mu)
    rel = df["kl_bias"] / df["kl_grad_norm"]
    # k1·w and k3·w in the loss differ by w·score, whose mean under μ is E_π[score] = 0
    assert rel["k1|loss|is"] == pytest.approx(rel["k3|loss|is"], abs=1e-12)
    # k2 and every "+" carry the same slope x: the same mean (without π/μ, whose product rule
    # brings in each one's own value: w·(k + x))
    same = [f"{e}|loss|none" for e in ("k2", "k1+", "k3+", "abs+", "low_var_kl+")]
    assert np.ptp(rel[same].to_numpy()) < 1e-12
    assert rel["k1+|loss|is"] > rel["k3+|loss|is"] + 0.1
    # only k1 in the reward (uncorrected: is_seq already reweights) is unbiased off-policy
    assert _unbiased(df) == ["k1+|reward|none", "k1|reward|none"]
    # the extra π/μ on the reward's k1 biases it; the per-state loss terms miss the future KL
    assert 0.01 < rel["k1|reward|is"] < 1 and 0.05 < rel["k3|loss|is"] < 1
    assert rel["k1|loss|none"] > 0.5  # without π/μ, k1 in the loss is all bias


def test_reward_placement_is_verls_apply_kl_penalty_summed_by_the_outcome_advantage():
    # verl-project/verl@1dda039: ray_trainer.apply_kl_penalty sets token_level_rewards =
    # token_level_scores − β·kl_penalty(old_log_probs, ref_log_prob)·mask, and
    # compute_grpo_outcome_advantage scores each row by token_level_rewards.sum(-1)
    rng = np.random.default_rng(7)
    N, T, beta = 6, 5, 0.2
    mask = np.arange(T)[None] < rng.integers(1, T + 1, N)[:, None]
    lr = np.where(mask, rng.normal(0, 0.3, (N, T)), 0.0)
    x = np.where(mask, rng.normal(0, 0.5, (N, T)), 0.0)
    R = rng.integers(0, 2, N).astype(float)
    scores = np.zeros((N, T))
    scores[np.arange(N), mask.sum(1) - 1] = R  # the verifiable reward on the last token
    for name in ("k1", "k2", "low_var_kl"):
        old_lp = rng.normal(-1.0, 0.3, (N, T))
        kld = _verl_kl_penalty_forward(old_lp, old_lp - x, name) * mask
        verl_rows = (scores - beta * kld).sum(-1)
        est = Estimator("naive", "seq-mean-token-sum", "raw", kl=KLPenalty(beta, name, "reward"))
        lam = est.token_weights(lr, mask, R, ref_log_ratio=x)
        np.testing.assert_allclose(lam, mask * verl_rows[:, None] / N, rtol=1e-12, atol=1e-15)
