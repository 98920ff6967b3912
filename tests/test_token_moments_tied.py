"""simkit.envs.token_moments_tied: exact moments with tied parameters by DP.

Three independent references: the enumeration path (:func:`simkit.experiment.exact_moments`
with ``params="tied"``: every sequence's coefficients from ``Mapping.coefficients`` and its tied
gradient from ``env.accumulate`` summed over positions) at T ≤ 10 to 1e-10; a pairwise-occupancy
DP written here (every pair of positions u < t with the propagator between them, no message,
no rescaling) at T = 64; Monte Carlo draws at T = 64 within z·SE.
"""

import numpy as np
import pytest
from conftest import noisy_policy

from simkit import experiment, mappings
from simkit.envs import TokenMDP
from simkit.envs.token_moments import moments
from simkit.envs.token_moments_tied import (
    tied_composed_dp_applies,
    tied_composed_moments,
    tied_dp_applies,
    tied_moments,
)
from simkit.estimators import Estimator

TOL = 1e-10
MAPPINGS = ["naive", "is_token", "tis_token", "icepop", "mis_token", "ppo_clip", "sapo"]
MAPPINGS += ["is_seq", "power"]
AGGS = ("seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm")


def _envs():
    return {
        "markov-eos": TokenMDP.markov(3, 5, target=1, eos=2, seed=2, stationary=False),
        "answer_correct-T9": TokenMDP.answer_correct(2, 9, seed=3, stationary=False),
        "at_least_k": TokenMDP.at_least_k(3, 5, k=2, hit=0, seed=4, stationary=False),
        "iid": TokenMDP.iid(3, 6, seed=1, stationary=False),  # P = 1 < S = 2 classes
        "iid-eos": TokenMDP.iid(3, 6, eos=2, seed=1, stationary=False),
    }


CASES = [
    (env_name, agg)
    for env_name in _envs()
    for agg in AGGS
    if not (agg == "token-mean" and "eos" in env_name)
]


def _close(dp, ref, n):
    scale = max(1.0, float(np.abs(ref.mean).max()))
    np.testing.assert_allclose(dp.mean, ref.mean, rtol=0, atol=TOL * scale)
    assert dp.variance(n) == pytest.approx(ref.variance, rel=TOL, abs=TOL)
    assert dp.ess(n) == pytest.approx(ref.ess, rel=1e-9)


@pytest.mark.parametrize(("env_name", "agg"), CASES)
@pytest.mark.parametrize("name", MAPPINGS)
def test_tied_dp_equals_enumeration(name, env_name, agg):
    env = _envs()[env_name]
    mu = noisy_policy(env.logits, 11, 0.9)  # large enough that the masks drop tokens
    n = 3
    for advantage in ("oracle", "oracle_pi", "raw"):
        est = Estimator(mappings.get(name), aggregation=agg, advantage=advantage)
        b = experiment.oracle_baseline(env, mu, est)
        dp = tied_moments(env, mu, est.mapping, b, agg)
        ref = experiment.exact_moments(env, mu, est, n, params="tied")
        assert dp.mean.shape == (env.P * env.V,)
        _close(dp, ref, n)


def test_tied_differs_from_untied_by_the_cross_terms():
    """The test can fail: the tied second moment is not the untied one (cross terms ≠ 0)."""
    env = _envs()["markov-eos"]
    mu = noisy_policy(env.logits, 11, 0.6)
    for name in ("naive", "ppo_clip", "is_seq"):
        m = mappings.get(name)
        tied, untied = tied_moments(env, mu, m, 0.3), moments(env, mu, m, 0.3)
        assert abs(tied.second - untied.second) > 1e-3 * untied.second
        np.testing.assert_allclose(tied.mean, untied.mean.reshape(env.T, -1).sum(0), atol=1e-15)


COMBOS = [
    ("ppo_clip", "tis_token", "decoupled"),
    ("dapo", "icepop", "decoupled"),
    ("ppo_clip", "is_seq", "decoupled"),
    ("is_seq", "tis_token", "decoupled"),
    ("power", "power", "decoupled"),
    ("ppo_clip", "tis_token", "bypass"),
    ("is_seq", "icepop", "bypass"),
]


@pytest.mark.parametrize("env_name", ["markov-eos", "at_least_k", "iid"])
@pytest.mark.parametrize(("name", "corr", "mode"), COMBOS, ids=str)
def test_tied_composed_dp_equals_enumeration(name, corr, mode, env_name):
    env = _envs()[env_name]
    old = noisy_policy(env.logits, 5, 0.4)
    mu = noisy_policy(np.log(old), 6, 0.6)
    for agg in AGGS:
        if agg == "token-mean" and not env.fixed_length:
            continue
        for advantage in ("oracle", "raw"):
            est = Estimator(
                mappings.get(name),
                aggregation=agg,
                advantage=advantage,
                correction=corr,
                mode=mode,
                allow_same_ratio=True,  # the bypass rows compose the one ratio on purpose
            )
            b = experiment.oracle_baseline(env, mu, est)
            dp = tied_composed_moments(env, mu, old, est.mapping, est.correction, mode, b, agg)
            ref = experiment.exact_moments(env, mu, est, 3, old=old, params="tied")
            _close(dp, ref, 3)


def test_tied_applies():
    env = TokenMDP.answer_correct(2, 3, eos=1)
    assert tied_dp_applies(env, mappings.get("ppo_clip"), "seq-mean-token-sum") == ""
    assert tied_dp_applies(env, mappings.get("is_seq"), "seq-mean-token-sum") == ""
    assert "product-form" in tied_dp_applies(env, mappings.get("tis_seq"), "seq-mean-token-sum")
    assert "random" in tied_dp_applies(env, mappings.get("naive"), "seq-mean-token-mean")
    with pytest.raises(ValueError, match="no tied moment DP"):
        tied_moments(env, env.pi, mappings.get("gspo"), 0.0)
    why = tied_composed_dp_applies(
        env, mappings.get("ppo_clip"), mappings.get("tis_seq"), "decoupled", "seq-mean-token-sum"
    )
    assert "tis_seq" in why
    with pytest.raises(ValueError, match="no tied moment DP"):
        tied_composed_moments(
            env, env.pi, None, mappings.get("vespo"), mappings.get("tis_token"), "decoupled", 0.0
        )


# --- an independent reference at T = 64: pairs of positions -----------------------------------


def _pair_dp(env, mu, mapping, b):
    """(E h (P·V,), E‖h‖²) of the tied h for seq-mean-token-sum, by pairs u < t.

    Under a kernel K_t(s, v) (μ for token-level c = φ^±, sign split; K¹ = μ·r^α for the mean
    and K² = μ·r^{2α} for the second moment of the product forms, c ≡ 1), with G_t the
    running-state transfer matrix, F_t = e_{s0} G_0…G_{t−1} and backward values Q_t of the
    terminal functions:

        E h    = Σ_t Σ_{s,v} F¹_t K¹_t c Q_t(A·1{±}) σ_t(s, v)
        E‖h‖²  = Σ_t Σ F² K² c² ‖σ‖² Q(A²1{±})
                 + 2 Σ_{u<t} Σ F²_u(s_u) K²_u c_u (G_{u+1}…G_{t−1})[trans[s_u, v_u], s]
                              · K²_t(s, v) c_t Q_t(A²1{±}) 1{p(s_u) = p(s)} ⟨σ_u, σ_t⟩.
    """
    T, S, V, P = env.T, env.S, env.V, env.P
    idx, trans, eos = env.policy_index, env.transition, env.eos
    Pi, Mu = env.pi[:, idx, :], mu[:, idx, :]
    R = Pi / Mu
    adv = env.reward - b
    pos = adv >= 0
    if mapping.level == "token":
        K1 = K2 = Mu
        parts = [(mapping.phi(R, True), pos), (mapping.phi(R, False), ~pos)]
    else:
        alpha = 1.0 if mapping.name == "is_seq" else mapping.alpha
        K1, K2 = Mu * R**alpha, Mu * R ** (2 * alpha)
        parts = [(np.ones_like(R), np.ones(S, dtype=bool))]

    def transfer(K):
        G = np.zeros((T, S, S))
        for t in range(T):
            for s in range(S):
                for v in range(V):
                    if v != eos:
                        G[t, s, trans[s, v]] += K[t, s, v]
        F = np.zeros((T, S))
        F[0, env.initial_state] = 1.0
        for t in range(T - 1):
            F[t + 1] = F[t] @ G[t]
        return G, F

    def values(K, g):
        Q = np.zeros((T, S, V))
        nxt = g
        for t in range(T - 1, -1, -1):
            Q[t] = nxt[trans]
            if eos is not None:
                Q[t][:, eos] = g[trans[:, eos]]
            nxt = np.einsum("sv,sv->s", K[t], Q[t])
        return Q

    _, F1 = transfer(K1)
    G2, F2 = transfer(K2)
    norm = 1.0 - 2.0 * Pi + np.einsum("tsv,tsv->ts", Pi, Pi)[..., None]
    same_class = idx[:, None] == idx[None, :]
    mean = np.zeros((P, V))
    second = 0.0
    for c, sign in parts:
        Q1 = values(K1, np.where(sign, adv, 0.0))
        Q2 = values(K2, np.where(sign, adv**2, 0.0))
        for t in range(T):
            lam = F1[t][:, None] * K1[t] * c[t] * Q1[t]
            block = lam - Pi[t] * lam.sum(axis=1, keepdims=True)
            np.add.at(mean, idx, block)
            second += float(np.sum(F2[t][:, None] * K2[t] * c[t] ** 2 * norm[t] * Q2[t]))
        for u in range(T - 1):
            left = F2[u][:, None] * K2[u] * c[u]  # (s_u, v_u)
            if eos is not None:
                left[:, eos] = 0.0
            prop = np.eye(S)
            for t in range(u + 1, T):
                if t > u + 1:
                    prop = prop @ G2[t - 1]
                right = K2[t] * c[t] * Q2[t]  # (s, v)
                inner = _inner(Pi[u], Pi[t])  # (s_u, v_u, s, v)
                reach = prop[trans]  # (s_u, v_u, s)
                pair = np.einsum("ab,abs,sv,as,absv->", left, reach, right, same_class, inner)
                second += 2.0 * float(pair)
    return mean.ravel(), second


def _inner(pi_u, pi_t):
    """⟨e_{v_u} − π_u(·|s_u), e_v − π_t(·|s)⟩ for every (s_u, v_u, s, v): (S, V, S, V)."""
    eye = np.eye(pi_u.shape[1])[None, :, None, :]  # δ(v_u, v)
    a = -pi_t.T[None, :, :, None]  # −π_t(v_u | s)
    b = -pi_u[:, None, None, :]  # −π_u(v | s_u)
    c = (pi_u @ pi_t.T)[:, None, :, None]  # ⟨π_u(s_u), π_t(s)⟩
    return eye + a + b + c


@pytest.mark.parametrize("env_name", ["markov-eos", "iid-eos"])
@pytest.mark.parametrize("name", ["ppo_clip", "icepop", "is_seq", "power"])
def test_tied_dp_equals_pair_dp_at_T_64(name, env_name):
    env = {
        "markov-eos": TokenMDP.markov(3, 64, target=1, eos=2, seed=2, stationary=False),
        "iid-eos": TokenMDP.iid(3, 64, eos=2, seed=1, stationary=False),
    }[env_name]
    mu = noisy_policy(env.logits, 11, 0.3)
    m = mappings.get(name)
    b = env.J(mu)
    mean, second = _pair_dp(env, mu, m, b)
    dp = tied_moments(env, mu, m, b)
    np.testing.assert_allclose(dp.mean, mean, rtol=0, atol=TOL * max(1.0, np.abs(mean).max()))
    assert dp.second == pytest.approx(second, rel=TOL)


@pytest.mark.parametrize("T", [512, 4096])
def test_tied_dp_is_finite_at_long_T(T):
    """Rescaled sweeps: no overflow or underflow; sequence IS is unbiased (E h = tie(∇J))."""
    env = TokenMDP.answer_correct(3, T, seed=1)
    mu = noisy_policy(env.logits, 3, 0.05)
    b = env.J(mu)
    grad = env.grad_J().reshape(T, -1).sum(axis=0)
    for name in ("is_seq", "ppo_clip", "power"):
        dp = tied_moments(env, mu, mappings.get(name), b)
        assert np.all(np.isfinite(dp.mean)) and np.isfinite(dp.second) and dp.second > 0
        assert dp.variance(4) > 0
        if name == "is_seq":
            np.testing.assert_allclose(dp.mean, grad, rtol=0, atol=1e-9 * np.abs(grad).max())


@pytest.mark.parametrize("name", ["ppo_clip", "is_seq"])
def test_tied_dp_inside_monte_carlo_at_T_64(name):
    """20 000 draws at T = 64: the sample mean of ‖h‖² and of each coordinate of the tied h
    within 4.5 SE (of the same draws) of the DP."""
    env = TokenMDP.markov(3, 64, target=1, eos=2, seed=2, stationary=False)
    mu = noisy_policy(env.logits, 11, 0.2)
    m = mappings.get(name)
    b = env.J(mu)
    dp = tied_moments(env, mu, m, b)
    batch = env.sample(mu, 20000, np.random.default_rng(0))
    adv = batch.rewards - b
    c = m.coefficients(batch.log_ratio, batch.mask, adv)
    lam = (c * adv[:, None])[:, None, :]  # every draw its own batch of one
    h = env.accumulate(batch.actions[:, None, :], lam, batch.states[:, None, :])
    h = h.reshape(h.shape[0], env.T, -1).sum(axis=1)  # tied: (N, P·V)
    sq = np.sum(h**2, axis=1)
    z = 4.5
    se = sq.std(ddof=1) / np.sqrt(sq.size)
    assert abs(sq.mean() - dp.second) <= z * se, (sq.mean(), dp.second, se)
    se_mean = h.std(axis=0, ddof=1) / np.sqrt(h.shape[0])
    assert np.all(np.abs(h.mean(axis=0) - dp.mean) <= z * se_mean + 1e-12)


@pytest.mark.parametrize("name", ["ppo_clip", "naive", "is_seq"])
def test_blocked_and_per_step_sweeps_agree(name):
    """The two sweeps of the cross sum (one propagation per block of 16 positions, or per
    position) on a T = 70 env (blocks of 16 and a partial one), with EOS, to 1e-12."""
    from simkit.envs.token_moments import _product_kernels, _ratio, _rows
    from simkit.envs.token_moments_tied import _cross_sum

    env = TokenMDP.markov(3, 70, target=1, eos=2, seed=2, stationary=False)
    mu = noisy_policy(env.logits, 11, 0.5)
    m = mappings.get(name)

    def tables(t0, t1):
        P, M = _rows(env, env.pi, t0, t1), _rows(env, mu, t0, t1)
        if m.level != "token":
            return P, _product_kernels(env, mu, 1.0, t0, t1)[2], None
        R = _ratio(P, M, 1.0)
        return P, M, (m.phi(R, True), m.phi(R, False))

    adv = env.reward - env.J(mu)
    blocked = _cross_sum(env, tables, adv, blocked=True)
    per_step = _cross_sum(env, tables, adv, blocked=False)
    assert blocked == pytest.approx(per_step, rel=1e-12)


def test_tied_second_moment_beyond_the_float_range_is_inf():
    """Sequence IS at T = 4096 under a large mismatch: E W² overflows; inf, not NaN."""
    env = TokenMDP.answer_correct(3, 4096, seed=1)
    mu = noisy_policy(env.logits, 3, 3.0)
    dp = tied_moments(env, mu, mappings.get("is_seq"), 0.5)
    assert dp.second == np.inf
    assert np.all(np.isfinite(dp.mean))


@pytest.mark.parametrize("T", [64, 512])
def test_run_with_tied_params_is_exact_beyond_enumeration(T):
    """experiment.run(params="tied") plans the tied DP beyond enumeration: ``exact`` rows with
    ``method = "dp"``; at T = 64 their variance and bias equal the pairwise DP written above
    (to 1e-10), at T = 512 they are finite and sequence IS is unbiased."""
    env = TokenMDP.markov(3, T, target=1, eos=2, seed=2, stationary=False)
    mu = noisy_policy(env.logits, 11, 0.3)
    names = ("naive", "ppo_clip", "is_seq")
    ests = [Estimator(mappings.get(m), aggregation="seq-mean-token-sum", name=m) for m in names]
    n = 8
    table = experiment.run(env, mu, ests, n=n, reps=3, exact=True, params="tied", progress=False)
    assert table.exact.all() and (table.method == "dp").all()
    rows = table.set_index("estimator")
    assert rows.loc["is_seq", "bias"] < 1e-10 * max(1.0, rows.loc["is_seq", "mse_zero"] ** 0.5)
    assert np.isfinite(rows[["variance", "mse_scaled", "rel_mse_scaled"]].to_numpy()).all()
    if T == 64:
        grad = experiment.tie(env.grad_J(), env.T)
        for name in ("naive", "ppo_clip"):
            m = mappings.get(name)
            mean, second = _pair_dp(env, mu, m, env.J(mu))
            var = (second - float(mean @ mean)) / n
            assert rows.loc[name, "variance"] == pytest.approx(var, rel=1e-10)
            assert rows.loc[name, "bias"] == pytest.approx(np.linalg.norm(mean - grad), rel=1e-10)
