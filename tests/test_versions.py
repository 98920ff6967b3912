"""Behaviours made of several policy versions (simkit.envs.versions) and their exact moments
(simkit.experiment.versions) against an enumeration written here: every sequence, its
probability under each component, its score vector and each estimator's per-sample term by
hand — to 1e-10. One version reproduces today's single-policy path bit for bit; dropping at
max_age ≥ the largest age is the identity; the log-linear π_old with α = 1 is the recomputed
π_old."""

import itertools

import numpy as np
import pytest
from conftest import noisy_policy

from simkit import experiment
from simkit.envs import TokenMDP
from simkit.envs import versions as V
from simkit.estimators import Estimator
from simkit.experiment.monte_carlo import sample_gradients
from simkit.experiment.versions import (
    mixture_divergences,
    sample_versioned,
    versioned_moments,
    versioned_monte_carlo,
)
from simkit.legs import LogLinearOld

TOL = 1e-10
N = 4
AGG = "seq-mean-token-sum"  # a_t = 1: the per-sample term is A·Σ_t c_t ∇log π(y_t)
ESTIMATORS = ("naive", "is_seq", "tis_token", "ppo_clip")


def _env():
    return TokenMDP.markov(2, 3, target=1, seed=2, stationary=False)


def _versions(env):
    """π (age 0) and two older versions (ages 1, 2)."""
    return [env.pi, noisy_policy(env.logits, 1, 0.5), noisy_policy(env.logits, 2, 0.9)]


def _sequences(env):
    """Every sequence: (y (T,), states (T,), R)."""
    out = []
    for y in itertools.product(range(env.V), repeat=env.T):
        s, states = env.initial_state, []
        for v in y:
            states.append(s)
            s = env.transition[s, v]
        out.append((np.array(y), np.array(states), float(env.reward[s])))
    return out


def _tok(env, table, y, states):
    """table(y_t | t, s_t) per position (T,)."""
    return np.array([table[t, env.policy_index[states[t]], y[t]] for t in range(env.T)])


def _score(env, y, states):
    """∇θ log π(y_t|t, s_t) per position, (T, D)."""
    out = np.zeros((env.T, env.T, env.P, env.V))
    for t in range(env.T):
        p = env.policy_index[states[t]]
        out[t, t, p] -= env.pi[t, p]
        out[t, t, p, y[t]] += 1.0
    return out.reshape(env.T, -1)


def _coef(name, w, A):
    """The mapping's coefficient per token from the token ratios w (T,) and the advantage."""
    if name == "naive":
        return np.ones_like(w)
    if name == "is_seq":
        return np.full_like(w, np.prod(w))
    if name == "tis_token":
        return np.minimum(w, 2.0)
    if name == "ppo_clip":  # ∂/∂θ of min(w·A, clip(w, 0.8, 1.2)·A): w where not clipped
        clipped = (w > 1.2) if A >= 0 else (w < 0.8)
        return np.where(clipped, 0.0, w)
    raise AssertionError(name)


def _by_hand(env, tables, weights, recorded, name, n=N):
    """(J(μ), E ĝ, Var ĝ) by enumeration: sample from component c (table tables[c], weight
    weights[c]); the trainer's ratio uses recorded[c](y) (T,) token probabilities."""
    seqs = _sequences(env)
    J_mu = sum(
        wc * np.prod(_tok(env, q, y, s)) * R for q, wc in zip(tables, weights) for y, s, R in seqs
    )
    first, second = 0.0, 0.0
    for q, wc, rec in zip(tables, weights, recorded):
        for y, s, R in seqs:
            p = np.prod(_tok(env, q, y, s))
            A = R - J_mu
            w = _tok(env, env.pi, y, s) / rec(y, s)
            h = A * (_coef(name, w, A) @ _score(env, y, s))
            first = first + wc * p * h
            second = second + wc * p * float(h @ h)
    return J_mu, first, (second - float(first @ first)) / n


def _true(env, q):
    return lambda y, s: _tok(env, q, y, s)


def _check(env, beh, tables, weights, recorded, record="true"):
    for name in ESTIMATORS:
        est = Estimator(name, aggregation=AGG)
        J_mu, mean, var = _by_hand(env, tables, weights, recorded, name)
        m = versioned_moments(env, beh, est, N, record=record)
        assert beh.J(env) == pytest.approx(J_mu, abs=TOL)
        np.testing.assert_allclose(m.mean, mean, atol=TOL, rtol=0)
        assert m.variance == pytest.approx(var, abs=TOL), name


def test_two_version_segmented_equals_enumeration():
    env = _env()
    old, new = _versions(env)[1], env.pi
    beh = V.segmented(env, [new, old], [1, 1, 0], ages=[0, 1])
    table = np.stack([old[0], old[1], new[2]])  # positions 0, 1 by the old version
    assert np.array_equal(beh.table(0), table)
    _check(env, beh, [table], [1.0], [_true(env, table)])
    # the trainer believing the whole response came from the old (start) version
    _check(env, beh, [table], [1.0], [_true(env, old)], record="start")
    # ∇J and χ²_seq of the segmented behaviour (one deterministic schedule: a plain table)
    seqs = _sequences(env)
    grad = sum(np.prod(_tok(env, env.pi, y, s)) * R * _score(env, y, s).sum(0) for y, s, R in seqs)
    np.testing.assert_allclose(env.grad_J(), grad, atol=TOL, rtol=0)
    chi2 = sum(
        np.prod(_tok(env, env.pi, y, s)) ** 2 / np.prod(_tok(env, table, y, s)) for y, s, _ in seqs
    )
    assert mixture_divergences(env, beh)["chi2_seq"] == pytest.approx(chi2 - 1, abs=TOL)
    assert env.divergences(table)["chi2_seq"] == pytest.approx(chi2 - 1, abs=TOL)


def test_drawn_switch_points_equal_enumeration():
    """Switch points drawn with a hazard: the version joins the state; the components are
    every schedule with its probability, checked by listing them here."""
    env = _env()
    new, old = env.pi, _versions(env)[1]
    h = 0.3
    beh = V.switching(env, [new, old], [0.4, 0.6], h, ages=[0, 1])
    # start new (0.4): one schedule; start old (0.6): switch before 1, before 2, or never
    expected = {
        (0, 0, 0): 0.4,
        (1, 0, 0): 0.6 * h,
        (1, 1, 0): 0.6 * (1 - h) * h,
        (1, 1, 1): 0.6 * (1 - h) ** 2,
    }
    got = {tuple(c.schedule): c.weight for c in beh.components}
    assert got.keys() == expected.keys()
    for k, p in expected.items():
        assert got[k] == pytest.approx(p, abs=1e-15)
    vs = [new, old]
    tables = [np.stack([vs[k][t] for t, k in enumerate(s)]) for s in expected]
    _check(env, beh, tables, list(expected.values()), [_true(env, q) for q in tables])


def test_three_component_mixture_equals_enumeration():
    env = _env()
    vs = _versions(env)
    w = [0.5, 0.3, 0.2]
    beh = V.mixture(env, vs, w)
    _check(env, beh, vs, w, [_true(env, q) for q in vs])  # per-version IS
    _check(env, beh, vs, w, [_true(env, vs[1])] * 3, record=1)  # one assumed version

    def mix(y, s):  # the mixture's next-token law: Π_t r_t = Σ_c w_c q_c(y)
        cum = np.array([np.cumprod(_tok(env, q, y, s)) for q in vs])
        m = np.array(w) @ cum
        return m / np.concatenate([[1.0], m[:-1]])

    _check(env, beh, vs, w, [mix] * 3, record="mixture")
    # multiple IS at sequence level is unbiased
    m = versioned_moments(env, beh, Estimator("is_seq", aggregation=AGG), N, record="mixture")
    np.testing.assert_allclose(m.mean, env.grad_J(), atol=TOL, rtol=0)
    # χ²_seq of the mixture, and joint convexity against the per-version average
    seqs = _sequences(env)
    pis = np.array([np.prod(_tok(env, env.pi, y, s)) for y, s, _ in seqs])
    qs = np.array([[np.prod(_tok(env, q, y, s)) for y, s, _ in seqs] for q in vs])
    div = mixture_divergences(env, beh)
    assert div["chi2_seq"] == pytest.approx(np.sum(pis**2 / (np.array(w) @ qs)) - 1, abs=TOL)
    per = np.sum(pis**2 / qs, axis=1) - 1
    assert div["chi2_seq_versions"] == pytest.approx(float(np.array(w) @ per), abs=TOL)
    assert div["chi2_seq"] <= div["chi2_seq_versions"]


@pytest.mark.parametrize("name", (*ESTIMATORS, "gspo", "cispo"))
def test_one_version_is_today_bit_for_bit(name):
    env = TokenMDP.markov(3, 4, target=1, eos=2, seed=5, stationary=False)
    mu = noisy_policy(env.logits, 7, 0.6)
    est = Estimator(name, aggregation="seq-mean-token-mean")
    today = experiment.exact_moments(env, mu, est, 8)
    for beh in (V.mixture(env, [mu], [1.0]), V.segmented(env, [mu], np.zeros(4, int))):
        got = versioned_moments(env, beh, est, 8)
        assert np.array_equal(got.mean, today.mean)
        assert (got.variance, got.ess) == (today.variance, today.ess)
        assert np.array_equal([got.kept, got.kept_seq], [today.kept, today.kept_seq], True)


def test_one_version_composed_is_today_bit_for_bit():
    env = _env()
    mu = noisy_policy(env.logits, 7, 0.6)
    old = noisy_policy(env.logits, 8, 0.3)
    est = Estimator("ppo_clip", correction="tis_token")
    today = experiment.exact_moments(env, mu, est, 8, old=old)
    got = versioned_moments(env, V.mixture(env, [mu], [1.0]), est, 8, old=old)
    assert np.array_equal(got.mean, today.mean) and got.variance == today.variance


def test_drop_at_largest_age_is_identity_and_drop_wait_reweight():
    env = _env()
    vs = _versions(env)
    beh = V.mixture(env, vs, [0.5, 0.3, 0.2])
    for a in (2, 3, 10):
        assert V.drop_stale(beh, a) is beh and V.wait_stale(beh, a) is beh
    dropped = V.drop_stale(beh, 1)
    assert dropped.age_distribution() == pytest.approx({0: 0.625, 1: 0.375})
    assert dropped.wasted == pytest.approx(0.2)
    waited = V.wait_stale(beh, 1)
    assert waited.age_distribution() == pytest.approx({0: 0.5, 1: 0.5})
    assert waited.waited == pytest.approx(0.2)
    # the dropped batch is exactly the two-component mixture
    est = Estimator("tis_token", aggregation=AGG)
    a = versioned_moments(env, dropped, est, N)
    b = versioned_moments(env, V.mixture(env, vs[:2], [0.625, 0.375]), est, N)
    np.testing.assert_allclose(a.mean, b.mean, atol=TOL, rtol=0)
    assert a.variance == pytest.approx(b.variance, abs=TOL)
    with pytest.raises(ValueError, match="max_age"):
        V.drop_stale(V.mixture(env, vs[1:], [0.5, 0.5], ages=[1, 2]), 0)


def test_loglinear_alpha_one_is_recomputed_old():
    env = _env()
    mu = noisy_policy(env.logits, 7, 0.6)
    est = Estimator("ppo_clip", correction="tis_token")
    recomputed = experiment.exact_moments(env, mu, est, 8, old=env.pi)
    approx = experiment.exact_moments(env, mu, est, 8, old=LogLinearOld(1.0))
    assert np.array_equal(recomputed.mean, approx.mean)
    assert recomputed.variance == approx.variance
    rollout = experiment.exact_moments(env, mu, est, 8, old=mu)  # α = 0: π_old = μ
    zero = experiment.exact_moments(env, mu, est, 8, old=LogLinearOld(0.0))
    np.testing.assert_allclose(zero.mean, rollout.mean, atol=1e-12, rtol=0)
    # α from the versions: every token one update old and π_old one update behind π: α = 0,
    # the approximation is exact (π_old = that version)
    vs = _versions(env)
    beh = V.mixture(env, vs[1:2], [1.0], ages=[1])
    a = versioned_moments(env, beh, est, 8, old="loglinear", proximal_age=1, theta_lead=0)
    b = versioned_moments(env, beh, est, 8, old=vs[1])
    np.testing.assert_allclose(a.mean, b.mean, atol=TOL, rtol=0)
    assert a.variance == pytest.approx(b.variance, abs=TOL)
    # with π_old = π (proximal_age 0) α = 1 on every token: the recomputed π_old = π
    mix = V.mixture(env, vs, [0.5, 0.3, 0.2])
    a = versioned_moments(env, mix, est, 8, old="loglinear", proximal_age=0, theta_lead=0)
    b = versioned_moments(env, mix, est, 8, old=env.pi)
    np.testing.assert_allclose(a.mean, b.mean, atol=TOL, rtol=0)
    assert a.variance == pytest.approx(b.variance, abs=TOL)
    np.testing.assert_allclose(V.loglinear_alpha([0, 1, 2, 4], 1, 0), [1.0, 0.0, 0.5, 0.75])
    np.testing.assert_allclose(V.loglinear_alpha([0, 1, 3]), [0.0, 0.5, 0.75])  # a/(a + 1)
    # AReaL's counter (lead 1) on on-policy tokens: α = 0, π_prox = μ = π
    on = versioned_moments(env, V.mixture(env, vs[:1], [1.0]), est, 8, old="loglinear")
    rec = versioned_moments(env, V.mixture(env, vs[:1], [1.0]), est, 8, old=env.pi)
    np.testing.assert_allclose(on.mean, rec.mean, atol=TOL, rtol=0)


def test_lag_weights_and_bad_input():
    np.testing.assert_allclose(V.lag_weights("geometric", 2, p=0.5), np.array([4, 2, 1]) / 7)
    np.testing.assert_allclose(V.lag_weights("uniform", 3), np.full(4, 0.25))
    np.testing.assert_allclose(V.lag_weights("given", 1, given=[3, 1]), [0.75, 0.25])
    env = _env()
    vs = _versions(env)
    with pytest.raises(ValueError, match="kind"):
        V.lag_weights("poisson", 2)
    with pytest.raises(ValueError, match="weights"):
        V.mixture(env, vs, [1.0, -1.0, 0.5])
    with pytest.raises(ValueError, match="switch"):
        V.segmented(env, vs, [0, 5, 1])
    with pytest.raises(ValueError, match="hazard"):
        V.switching(env, vs, [1, 0, 0], 1.5)
    with pytest.raises(ValueError, match="record"):
        versioned_moments(env, V.mixture(env, vs, [1, 1, 1]), "naive", 4, record="newest")
    with pytest.raises(ValueError, match="versions\\[1\\]"):
        V.mixture(env, [env.pi, np.ones(3)], [1, 1])


@pytest.mark.parametrize("record", ["true", "mixture", 1])
def test_monte_carlo_agrees_with_exact(record):
    """Draws from a drawn-switch behaviour: the mean gradient of 4000 batches is within 4.5
    SE of the exact mean on every coordinate (seeded), for each recorded behaviour."""
    env = _env()
    vs = _versions(env)
    beh = V.switching(env, vs, [0.3, 0.4, 0.3], 0.4)
    est = Estimator("tis_token", aggregation=AGG)
    exact = versioned_moments(env, beh, est, N, record=record)
    draws, comp = sample_versioned(env, beh, N, 4000, np.random.default_rng(1), record)
    g = sample_gradients(env, draws, est).gradients
    se = g.std(axis=0, ddof=1) / np.sqrt(g.shape[0])
    z = np.abs(g.mean(axis=0) - exact.mean) / np.where(se > 0, se, 1.0)
    assert z.max() < 4.5
    var_mc = float(np.sum(g.var(axis=0, ddof=1)))
    assert var_mc == pytest.approx(exact.variance, rel=0.1)
    # every component is drawn with its weight (binomial z-test)
    for c, w in enumerate(beh.weights):
        frac = np.mean(comp == c)
        assert abs(frac - w) < 4.5 * np.sqrt(w * (1 - w) / comp.size)


def test_monte_carlo_batch_dependent_estimator_has_bounds():
    env = _env()
    beh = V.mixture(env, _versions(env), [0.5, 0.3, 0.2])
    est = Estimator("tis_token", aggregation=AGG, advantage="grpo", group_size=4)
    m = versioned_monte_carlo(env, beh, est, 8, reps=300, seed=2, n_boot=200)
    assert m["bias_lo"] <= m["bias"] <= m["bias_hi"]
    assert np.isfinite(m["variance"]) and m["variance"] > 0
    again = versioned_monte_carlo(env, beh, est, 8, reps=300, seed=2, n_boot=200)
    assert again == m


def test_moment_dp_equals_enumeration_and_runs_beyond_it():
    """record='true': each component's moment DP summed with the weights equals the
    enumeration to 1e-10 (mixture, drawn switch points, a composed estimator), and runs at
    T = 40 (2^40 sequences) where enumeration cannot."""
    env = _env()
    vs = _versions(env)
    old = noisy_policy(env.logits, 8, 0.3)
    for beh in (V.mixture(env, vs, [0.5, 0.3, 0.2]), V.switching(env, vs, [0.2, 0.3, 0.5], 0.3)):
        for est, o in (
            (Estimator("tis_token", aggregation=AGG), None),
            (Estimator("is_seq", aggregation=AGG), None),
            (Estimator("ppo_clip", correction="tis_token"), old),
        ):
            a = versioned_moments(env, beh, est, N, old=o, method="enumeration")
            b = versioned_moments(env, beh, est, N, old=o, method="dp")
            np.testing.assert_allclose(b.mean, a.mean, atol=TOL, rtol=0)
            assert b.variance == pytest.approx(a.variance, abs=TOL)
            assert b.ess == pytest.approx(a.ess, rel=1e-10)
            assert b.method == "dp"
    big = TokenMDP.markov(2, 40, target=1, seed=2, stationary=False)
    bvs = [big.pi, noisy_policy(big.logits, 1, 0.2)]
    beh = V.mixture(big, bvs, [0.6, 0.4])
    m = versioned_moments(big, beh, Estimator("is_seq", aggregation=AGG), 16)
    np.testing.assert_allclose(m.mean, big.grad_J(), atol=1e-10, rtol=0)  # per-version IS
    with pytest.raises(ValueError, match="record"):
        versioned_moments(big, beh, Estimator("is_seq", aggregation=AGG), 16, record="mixture")


def test_prompt_coverage_by_hand():
    f = [0.5, 0.5]
    lags = [[0.7, 0.2, 0.1], [0.2, 0.3, 0.5]]  # easy prompts young, hard prompts old
    drop = V.prompt_coverage(f, lags, 1, "drop")
    kept = np.array([0.5 * 0.9, 0.5 * 0.5])
    np.testing.assert_allclose(drop["share"], kept / kept.sum(), rtol=1e-15)
    assert drop["lost"] == pytest.approx(1 - kept.sum())
    wait = V.prompt_coverage(f, lags, 1, "wait")
    np.testing.assert_allclose(wait["share"], f)
    assert wait["lost"] == 0 and wait["waited"] == pytest.approx(drop["lost"])
    full = V.prompt_coverage(f, lags, 2, "drop")  # max_age ≥ the largest age: unchanged
    np.testing.assert_allclose(full["share"], f)
    assert full["lost"] == pytest.approx(0, abs=1e-15)
    with pytest.raises(ValueError, match="lags"):
        V.prompt_coverage(f, [[1, 0]], 1)


def test_run_takes_the_loglinear_old():
    """experiment.run(old=LogLinearOld(α)): the exact row is the enumeration with o = α·ℓ, the
    Monte Carlo row's bias bounds hold it, and π_old's divergence columns are NaN."""
    env = _env()
    mu = noisy_policy(env.logits, 7, 0.6)
    est = Estimator("ppo_clip", correction="tis_token")
    old = LogLinearOld(0.5)
    exact = experiment.run(env, mu, [est], n=8, reps=50, old=old, exact=True)
    mc = experiment.run(env, mu, [est], n=8, reps=2000, old=old, exact=False, seed=3)
    m = experiment.exact_moments(env, mu, est, 8, old=old)
    assert exact.bias.iloc[0] == pytest.approx(np.linalg.norm(m.mean - env.grad_J()), abs=1e-12)
    assert mc.bias_lo.iloc[0] <= exact.bias.iloc[0] <= mc.bias_hi.iloc[0]
    assert np.isnan(exact.chi2_seq_stale.iloc[0]) and np.isnan(exact.kl_tok_infer.iloc[0])
    with pytest.raises(ValueError, match="alpha"):
        LogLinearOld(float("nan"))


def test_switching_three_versions_lists_every_schedule():
    """Start at age 2 (T = 3): an update before position 1 and/or 2, each with probability h,
    moves the response one version newer."""
    env = _env()
    h = 0.3
    beh = V.switching(env, _versions(env), [0.0, 0.0, 1.0], h)
    got = {tuple(c.schedule): c.weight for c in beh.components}
    expected = {
        (2, 2, 2): (1 - h) ** 2,
        (2, 1, 1): h * (1 - h),
        (2, 2, 1): (1 - h) * h,
        (2, 1, 0): h * h,
    }
    assert got.keys() == expected.keys()
    for k, p in expected.items():
        assert got[k] == pytest.approx(p, abs=1e-15)
    assert beh.age_distribution() == pytest.approx({2: 1.0})
    np.testing.assert_array_equal(beh.token_ages(list(got).index((2, 1, 0))), [2, 1, 0])
