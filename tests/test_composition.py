"""Composed estimators (mapping on π/π_old × correction on π_old/μ) and experiment.run(old=…).

Exact checks: coefficient identities on random batches (on-policy in both legs, π_old = π,
μ = π_old, bypass, TRL's VESPO), unbiasedness of decoupled token IS × untruncated token TIS by
enumeration, and bit-identity of tables without a correction / without ``old``. Stochastic
checks: exact moments against Monte Carlo means within z·SE of the same draws.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pandas as pd
import pytest

from simkit import composition, experiment, legs
from simkit.envs import Bandit, TokenMDP
from simkit.envs.stale import dial_staleness, served_policy, stale_policy, staleness_chi2
from simkit.estimators import Estimator
from simkit.mappings import available, get, mapping_class
from simkit.train.mismatch import Mismatch, behaviour_log_probs

#: (mappings that need log π or carry an additive term are composed in test_mappings_2026.py:
#: these generic checks pass log-ratios only, and an additive mapping cannot be composed;
#: these checks also assume c = 1 on-policy)
MAPPINGS = [
    n
    for n in available()
    if not mapping_class(n).batch_dependent
    and not mapping_class(n).requires_log_prob
    and not get(n).has_additive
    and mapping_class(n).on_policy_identity  # luspo: c = |y| on-policy
]
#: detached-weight corrections without batch coupling (snis/psis need whole batches)
CORRECTIONS = [
    n
    for n in available()
    if n not in composition.SURROGATE_MAPPINGS and not mapping_class(n).batch_dependent
]


def batch(seed, N=16, T=7, scale=0.3):
    rng = np.random.default_rng(seed)
    lr = rng.normal(0, scale, (N, T))
    old = lr - rng.normal(0, scale, (N, T))  # log π_old − log μ
    lengths = rng.integers(1, T + 1, N)
    lengths[0] = 0
    mask = np.arange(T)[None, :] < lengths[:, None]
    adv = rng.normal(size=N)
    return lr, old, mask, adv


def test_surrogate_list_matches_the_torch_loss_forms():
    losses = pytest.importorskip("simkit.lm.losses")
    surrogates = {n for n, form in losses.FORMS.items() if form == "surrogate"}
    # is_token's c = r_t is also the detached (untruncated) token IS weight
    assert set(composition.SURROGATE_MAPPINGS) == surrogates - {"is_token"}


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_on_policy_in_both_legs_gives_one(mode):
    _, _, mask, adv = batch(1)
    zeros = np.zeros(mask.shape)
    for m in MAPPINGS:
        for corr in CORRECTIONS:
            # bypass with two ratio-carrying factors is refused by default (next test)
            est = Estimator(m, correction=corr, mode=mode, allow_same_ratio=True)
            c = est.coefficients(zeros, mask, adv, old_log_ratio=zeros)
            np.testing.assert_array_equal(c[mask], 1.0, err_msg=f"{m} × {corr}")
            np.testing.assert_array_equal(c[~mask], 0.0)


def test_bypass_double_count_is_refused_unless_allowed():
    """Bypass PPO clip × TIS would give c = r·min(r, 2) = 2.25 at r = 1.5, A < 0 (the ratio
    counted twice): refused with a message naming both; allowed explicitly it is that product;
    a mask correction or REINFORCE × TIS in bypass, and decoupled PPO × TIS, are accepted."""
    with pytest.raises(ValueError, match=r"'ppo_clip' and correction 'tis_token'.*twice"):
        Estimator("ppo_clip", correction="tis_token", mode="bypass")
    with pytest.raises(ValueError, match=r"'vespo' and correction 'mis_token'"):
        Estimator("vespo", correction="mis_token", mode="bypass")
    est = Estimator("ppo_clip", correction="tis_token", mode="bypass", allow_same_ratio=True)
    lr = np.full((1, 1), np.log(1.5))
    c = est.coefficients(lr, np.ones((1, 1), bool), np.array([-1.0]))
    np.testing.assert_allclose(c, 1.5 * 1.5, rtol=1e-15)  # r·min(r, 2): what is refused
    for ok in (
        Estimator("ppo_clip", correction="geo_mask", mode="bypass"),
        Estimator("naive", correction="tis_token", mode="bypass"),
        Estimator("ppo_clip", correction="tis_token", mode="decoupled"),
    ):
        assert ok.correction is not None
    assert not composition.carries_ratio(get("naive"))
    assert not composition.carries_ratio(get("geo_mask"))
    assert composition.carries_ratio(get("ppo_clip"))
    assert composition.carries_ratio(get("tis_token"))


def test_pi_old_equal_to_pi_gives_the_correction_alone():
    lr, _, mask, adv = batch(2)
    for m in MAPPINGS:
        for corr in CORRECTIONS:
            est = Estimator(m, correction=corr)
            expected = get(corr).coefficients(lr, mask, adv)
            # π_old = π: o = ℓ, explicitly and by default (old_log_ratio=None)
            np.testing.assert_array_equal(est.coefficients(lr, mask, adv, lr), expected)
            np.testing.assert_array_equal(est.coefficients(lr, mask, adv), expected)


def test_mu_equal_to_pi_old_gives_the_mapping_alone():
    lr, _, mask, adv = batch(3)
    zeros = np.zeros(mask.shape)
    for m in MAPPINGS:
        for corr in CORRECTIONS:
            est = Estimator(m, correction=corr)
            expected = get(m).coefficients(lr, mask, adv)
            np.testing.assert_array_equal(est.coefficients(lr, mask, adv, zeros), expected)


def test_decoupled_is_the_product_of_the_legs_and_bypass_of_one_ratio():
    lr, old, mask, adv = batch(4)
    ppo, tis = get("ppo_clip"), get("tis_token")
    est = Estimator(ppo, correction=tis)
    expected = ppo.coefficients(lr - old, mask, adv) * tis.coefficients(old, mask, adv)
    np.testing.assert_array_equal(est.coefficients(lr, mask, adv, old), expected)
    by = Estimator(get("naive"), correction=get("is_token"), mode="bypass")
    np.testing.assert_array_equal(
        by.coefficients(lr, mask, adv, old), get("is_token").coefficients(lr, mask, adv)
    )


def test_correction_none_ignores_pi_old():
    lr, old, mask, adv = batch(5)
    for m in MAPPINGS:
        est = Estimator(m)
        expected = get(m).coefficients(lr, mask, adv)
        np.testing.assert_array_equal(est.coefficients(lr, mask, adv, old), expected)


def test_trl_vespo_folds_the_token_correction_into_w():
    lr, old, mask, adv = batch(6)
    v, tis = get("vespo", preset="trl"), get("tis_token", preset="trl")
    est = Estimator(v, correction=tis, mode="trl_vespo")
    # TRL get_gamma_weights: log W = Σ clip(ℓ − o, ±20) + Σ clip(log min(e^o, 3), log 1e-8, 20)
    log_w = np.where(
        mask,
        np.clip(lr - old, -20, 20) + np.clip(np.minimum(old, np.log(3)), math.log(1e-8), 20),
        0,
    ).sum(1)
    log_w = np.clip(log_w, math.log(1e-8), 20)
    k = np.where(adv >= 0, 2.0, 3.0)
    lam = np.where(adv >= 0, 3.0, 2.0)
    phi = np.exp(k * log_w + lam * (1 - np.exp(log_w)))
    np.testing.assert_allclose(
        est.coefficients(lr, mask, adv, old), mask * phi[:, None], rtol=1e-12
    )
    # μ = π_old and an untruncated correction: VESPO alone
    inf = Estimator(v, correction=get("tis_token", c_high=math.inf), mode="trl_vespo")
    zeros = np.zeros(mask.shape)
    np.testing.assert_allclose(
        inf.coefficients(lr, mask, adv, zeros), v.coefficients(lr, mask, adv), rtol=1e-12
    )


def test_bad_composition_is_rejected_naming_the_option():
    with pytest.raises(ValueError, match="valid modes: decoupled, bypass, trl_vespo"):
        Estimator("ppo_clip", correction="tis_token", mode="coupled")
    with pytest.raises(ValueError, match="surrogate loss, not a detached weight"):
        Estimator("ppo_clip", correction="ppo_clip")
    with pytest.raises(ValueError, match="needs mapping 'vespo'"):
        Estimator("ppo_clip", correction="tis_token", mode="trl_vespo")
    with pytest.raises(ValueError, match="correction must be one of"):
        Estimator("vespo", correction="tis_seq", mode="trl_vespo")
    with pytest.raises(ValueError, match="needs a correction"):
        Estimator("vespo", mode="trl_vespo")
    with pytest.raises(ValueError, match="valid denominators: valid, kept"):
        Estimator("ppo_clip", denominator="surviving")
    with pytest.raises(TypeError, match="correction must be"):
        Estimator("ppo_clip", correction=3)
    assert Estimator("ppo_clip", correction="tis_token").name == "ppo_clip × tis_token"


# --- environments: exact vs Monte Carlo, unbiasedness, bit-identity --------------------------


def bandit():
    env = Bandit(
        logits=np.array([0.4, -0.3, 0.1, 0.9, -1.0]), means=np.array([0.2, 0.9, 0.5, 0.3, 0.7])
    )
    old = stale_policy(env, steps=2, step_size=0.8)
    engine = partial(
        behaviour_log_probs, mismatch=Mismatch(logit_noise=0.3), rng=np.random.default_rng(4)
    )
    mu = served_policy(env, old, engine)
    return env, old, mu


def token_mdp():
    env = TokenMDP.markov(3, 4, target=1, seed=2, stationary=False)
    old = stale_policy(env, steps=2, step_size=2.0)
    engine = partial(
        behaviour_log_probs, mismatch=Mismatch(logit_noise=0.4), rng=np.random.default_rng(5)
    )
    return env, old, served_policy(env, old, engine)


def test_decoupled_token_is_with_untruncated_tis_is_unbiased_by_enumeration():
    env, old, mu = bandit()  # T = 1: token IS is π/μ, unbiased
    est = Estimator("is_token", correction=get("tis_token", c_high=math.inf))
    mom = experiment.exact_moments(env, mu, est, n=8, old=old)
    np.testing.assert_allclose(mom.mean, env.grad_J(), rtol=0, atol=1e-13)
    # the same estimator with truncation is biased here (the check can fail)
    biased = experiment.exact_moments(
        env, mu, Estimator("is_token", correction=get("tis_token", c_high=1.05)), n=8, old=old
    )
    assert (old / mu).max() > 1.05
    assert np.linalg.norm(biased.mean - env.grad_J()) > 1e-6
    # ... and naive × untruncated TIS is not π/μ: biased by the staleness leg
    stale = experiment.exact_moments(
        env, mu, Estimator("naive", correction=get("tis_token", c_high=math.inf)), n=8, old=old
    )
    assert np.linalg.norm(stale.mean - env.grad_J()) > 1e-6


def test_decoupled_token_is_with_untruncated_tis_is_token_is_on_the_token_mdp():
    # c = (π/π_old)·(π_old/μ) = π/μ per token: exactly token IS on every atom (T > 1)
    env, old, mu = token_mdp()
    atoms = env.support(mu)
    o = legs.old_log_ratio(env, old, mu, atoms.actions, atoms.mask, atoms.states)
    est = Estimator("is_token", correction=get("tis_token", c_high=math.inf))
    c = est.coefficients(atoms.log_ratio, atoms.mask, atoms.advantage_sign, o)
    np.testing.assert_allclose(
        c,
        get("is_token").coefficients(atoms.log_ratio, atoms.mask, atoms.advantage_sign),
        rtol=1e-13,
    )
    a = experiment.exact_moments(env, mu, est, n=4, old=old)
    b = experiment.exact_moments(env, mu, Estimator("is_token"), n=4)
    np.testing.assert_allclose(a.mean, b.mean, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "est",
    [
        Estimator("ppo_clip", correction="tis_token"),
        Estimator("dapo", correction="mis_token", aggregation="seq-mean-token-sum"),
        Estimator("vespo", correction="tis_token", mode="trl_vespo"),
        Estimator(
            "gspo", correction="kl_rs", denominator="kept", aggregation="seq-mean-token-mean"
        ),
    ],
    ids=lambda e: e.name,
)
@pytest.mark.parametrize("make", [bandit, token_mdp], ids=["bandit", "token_mdp"])
def test_exact_moments_agree_with_monte_carlo_within_z_se(est, make):
    env, old, mu = make()
    n, reps = 4, 4000
    batch_ = env.sample(mu, n, np.random.default_rng(11), reps=reps)
    states = getattr(batch_, "states", None)
    old_lr = legs.old_log_ratio(env, old, mu, batch_.actions, batch_.mask, states)
    draws = experiment.sample_gradients(env, batch_, est, old_lr)
    exact = experiment.exact_moments(env, mu, est, n, old=old)
    g = draws.gradients
    se = g.std(axis=0, ddof=1) / math.sqrt(reps)
    z = 4.0
    assert np.all(np.abs(g.mean(axis=0) - exact.mean) <= z * se + 1e-12)
    # Var ĝ = E‖ĝ − E ĝ‖²: its estimate is the mean of the per-batch squared deviations, whose
    # standard error comes from the same draws (the exact mean is used, so no ddof correction)
    dev_sq = np.sum((g - exact.mean) ** 2, axis=1)
    var_mc, var_se = float(dev_sq.mean()), float(dev_sq.std(ddof=1) / math.sqrt(reps))
    assert abs(var_mc - exact.variance) <= z * var_se + 1e-12


def table(env, mu, ests, **kw):
    return experiment.run(env, mu, ests, n=4, reps=50, n_boot=20, seed=3, **kw)


def test_tables_without_correction_and_old_are_bit_identical():
    env, old, mu = bandit()
    ests = [Estimator("ppo_clip"), Estimator("tis_token"), Estimator("snis")]
    same = [
        Estimator("ppo_clip", correction=None),
        Estimator("tis_token", correction=None),
        Estimator("snis", correction=None),
    ]
    a = table(env, mu, ests)
    b = table(env, mu, same, old=None)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert not set(legs.LEG_COLUMNS) & set(a.columns)
    # with old: estimators without a correction ignore it; only the leg columns are added
    c = table(env, mu, ests, old=old)
    pd.testing.assert_frame_equal(c[a.columns], a, check_exact=True)
    assert set(legs.LEG_COLUMNS) <= set(c.columns)


def test_leg_columns_are_the_divergences_of_both_legs():
    env, old, mu = bandit()
    t = table(env, mu, [Estimator("ppo_clip", correction="tis_token")], old=old)
    from simkit import divergence

    assert t["chi2_seq_stale"].iloc[0] == pytest.approx(float(divergence.chi2(env.pi, old)))
    assert t["kl_tok_infer"].iloc[0] == pytest.approx(float(divergence.kl(old, mu)))
    assert t["correction"].iloc[0] == "tis_token" and t["mode"].iloc[0] == "decoupled"
    assert bool(t["exact"].iloc[0])


def test_kept_denominator_with_token_mean_goes_to_monte_carlo():
    env, old, mu = bandit()
    est = Estimator("ppo_clip", correction="kl_rs", denominator="kept")
    assert not experiment.has_exact_path(env, est)
    t = table(env, mu, [est], old=old)
    assert not bool(t["exact"].iloc[0]) and t["denominator"].iloc[0] == "kept"


def test_clip_cov_randomness_comes_from_the_run_seed():
    env, _, mu = bandit()
    est = Estimator(get("clip_cov", ratio=0.5, lb=-10.0, ub=10.0))
    a = table(env, mu, [est])
    b = table(env, mu, [est])
    pd.testing.assert_frame_equal(a, b, check_exact=True)


# --- behaviour tools -------------------------------------------------------------------------


def test_stale_policy_walks_backwards_and_dial_hits_the_target():
    env, _, _ = bandit()
    one = stale_policy(env, steps=1, step_size=0.5)
    np.testing.assert_allclose(
        np.log(one) - np.log(one).mean(),
        (env.logits - 0.5 * env.grad_J()) - (env.logits - 0.5 * env.grad_J()).mean(),
        rtol=1e-12,
    )
    # J(π_old) < J(π): π is ahead
    assert env.J(one) < env.J()
    old = dial_staleness(env, chi2=0.05, steps=3)
    assert staleness_chi2(env, old) == pytest.approx(0.05, rel=1e-8)
    with pytest.raises(ValueError, match="chi2 must be"):
        dial_staleness(env, chi2=0.0)
    with pytest.raises(ValueError, match="steps must be"):
        stale_policy(env, steps=0)


def test_served_policy_without_mismatch_is_pi_old():
    env, old, _ = bandit()
    engine = partial(behaviour_log_probs, mismatch=Mismatch())
    np.testing.assert_allclose(served_policy(env, old, engine), old, rtol=1e-12)
    bf16 = served_policy(
        env, old, partial(behaviour_log_probs, mismatch=Mismatch(precision="bf16"))
    )
    assert 0 < float(np.abs(bf16 - old).max()) < 1e-2


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_kept_denominator_of_a_single_rejection_matches_the_torch_loss(agg):
    torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")
    from simkit.estimators import aggregation_weights
    from simkit.lm import losses

    lr, _, mask, adv = batch(7, N=20, T=6, scale=0.4)
    m = get("kl_rs", criteria="token_k3", u=0.03)
    est = Estimator(m, aggregation=agg, advantage="raw", denominator="kept")
    lam = est.token_weights(lr, mask, adv)
    kept = m.kept_mask(lr, mask, adv)
    assert 0 < kept.sum() < mask.sum()
    expected = m.coefficients(lr, mask, adv) * adv[:, None] * aggregation_weights(kept, agg)
    np.testing.assert_allclose(lam, expected, rtol=1e-14)
    old = -np.ones(lr.shape)
    x = torch.tensor(old + lr, requires_grad=True)
    loss, _ = losses.policy_loss(
        m,
        x,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        agg=agg,
        denominator="kept",
    )
    loss.backward()
    np.testing.assert_allclose(-x.grad.numpy(), lam, rtol=1e-10, atol=1e-14)


def test_composed_kept_denominator_uses_both_rejections():
    lr, old, mask, adv = batch(8, N=20, T=6, scale=0.4)
    mapping = get("mis_token", c_low=0.8, c_high=1.25)
    correction = get("kl_rs", criteria="seq_max_k2", u=0.05)
    est = Estimator(mapping, correction=correction, denominator="kept", advantage="raw")
    kept = mapping.kept_mask(lr - old, mask, adv) & correction.kept_mask(old, mask, adv)
    from simkit.estimators import aggregation_weights

    c = est.coefficients(lr, mask, adv, old)
    np.testing.assert_array_equal(c != 0, kept)
    lam = est.token_weights(lr, mask, adv, old_log_ratio=old)
    np.testing.assert_allclose(lam, c * adv[:, None] * aggregation_weights(kept, "token-mean"))


def test_estimator_specs_round_trip_composed_estimators():
    from simkit.estimator_specs import build_estimators, estimator_params

    ests = [
        Estimator("ppo_clip"),
        Estimator(get("dapo", preset="verl"), correction=get("tis_token", c_high=3.0)),
        Estimator("vespo", correction="icepop", mode="trl_vespo", denominator="kept"),
        Estimator(get("kl_rs", criteria=("token_k2", "seq_max_k3"), u=(0.1, 0.2)), seed=4),
    ]
    specs = [estimator_params(e) for e in ests]
    assert set(specs[0]) == {
        "name",
        "mapping",
        "hyperparameters",
        "aggregation",
        "advantage",
        "group_size",
        "adv_eps",
        "max_length",
    }  # an estimator without composition keeps its spec
    assert build_estimators(specs) == ests
