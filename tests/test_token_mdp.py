"""simkit.envs.TokenMDP: exact DP against brute-force enumeration, identities, experiment path."""

import itertools
import math

import numpy as np
import pytest
from conftest import noisy_policy

from simkit import divergence, mappings
from simkit.envs import TokenMDP, exact_token_level_mean
from simkit.estimators import Estimator
from simkit.experiment import exact_moments, has_exact_path, run, sample_gradients

Z = 5.0  # z-score of the stochastic checks
TOL = 1e-10

TOKEN_MAPPINGS = [
    name
    for name in mappings.available()
    if mappings.mapping_class(name).level == "token"
    and getattr(mappings.mapping_class(name), "ratio_kind", None) == "token"
]
PER_SAMPLE = [n for n in mappings.available() if not mappings.mapping_class(n).batch_dependent]


def _envs(eos):
    kw = {"eos": eos, "stationary": False}
    return {
        "iid": TokenMDP.iid(3, 4, answer=1, seed=1, **kw),
        "markov": TokenMDP.markov(3, 4, target=1, seed=2, **kw),
        "answer_correct": TokenMDP.answer_correct(3, 4, answer=0, seed=3, **kw),
        "at_least_k": TokenMDP.at_least_k(3, 4, k=2, hit=0, seed=4, **kw),
        "parity": TokenMDP.parity(3, 4, marked=[1], seed=5, **kw),
    }


CASES = [(name, eos) for eos in (None, 2) for name in _envs(None)]


def _behaviour(env, seed, scale=0.7):
    return noisy_policy(env.logits, seed, scale)


def _brute_force(env, mu):
    """Every sequence by itertools.product, walked through the automaton by hand.

    Returns a list of (tokens, classes, final_state, π(y), μ(y)) for distinct sequences (a
    sequence stops at its first EOS; the product's continuations after it are merged).
    """
    seen = {}
    for full in itertools.product(range(env.V), repeat=env.T):
        s = env.initial_state
        tokens, classes = [], []
        for _t, v in enumerate(full):
            tokens.append(v)
            classes.append(int(env.policy_index[s]))
            s = int(env.transition[s, v])
            if env.eos is not None and v == env.eos:
                break
        key = tuple(tokens)
        if key in seen:
            continue
        p_pi = math.prod(env.pi[t, c, v] for t, (c, v) in enumerate(zip(classes, tokens)))
        p_mu = math.prod(mu[t, c, v] for t, (c, v) in enumerate(zip(classes, tokens)))
        seen[key] = (tokens, classes, s, p_pi, p_mu)
    return list(seen.values())


def _score(env, tokens, classes, weights):
    """Σ_t w_t ∇θ log π(y_t | t, s_t) as a dense (T, P, V) array, flattened."""
    g = np.zeros(env.logits.shape)
    for t, (c, v) in enumerate(zip(classes, tokens)):
        g[t, c, :] -= weights[t] * env.pi[t, c, :]
        g[t, c, v] += weights[t]
    return g.ravel()


# --- DP against enumeration --------------------------------------------------------------------


@pytest.mark.parametrize(("name", "eos"), CASES)
def test_dp_agrees_with_brute_force_enumeration(name, eos):
    env = _envs(eos)[name]
    mu = _behaviour(env, 7)
    seqs = _brute_force(env, mu)
    assert len(seqs) == env.n_sequences
    assert sum(s[3] for s in seqs) == pytest.approx(1.0, abs=TOL)
    J = sum(p * env.reward[f] for _, _, f, p, _ in seqs)
    grad = sum(p * env.reward[f] * _score(env, y, c, np.ones(len(y))) for y, c, f, p, _ in seqs)
    chi2 = sum(p**2 / q for *_, p, q in seqs) - 1.0
    kl = sum(p * math.log(p / q) for *_, p, q in seqs)
    tv = 0.5 * sum(abs(p - q) for *_, p, q in seqs)
    assert abs(env.J() - J) < TOL
    assert abs(env.J(mu) - sum(q * env.reward[f] for _, _, f, _, q in seqs)) < TOL
    np.testing.assert_allclose(env.grad_J(), grad, rtol=0, atol=TOL)
    assert abs(env.chi2_seq(mu) - chi2) < TOL
    assert abs(env.kl_seq(mu) - kl) < TOL
    assert abs(env.tv_seq(mu) - tv) < TOL
    lo, hi = env.tv_seq_bounds(mu)
    assert lo - 1e-12 <= tv <= hi + 1e-12
    # the exact support holds the same sequences with their μ-probabilities and rewards
    sup = env.support(mu, baseline=0.3)
    assert sup.prob.sum() == pytest.approx(1.0, abs=TOL)
    by_key = {tuple(y): (f, q) for y, _, f, _, q in seqs}
    for row in range(sup.prob.shape[0]):
        key = tuple(sup.actions[row, : sup.lengths[row]].tolist())
        f, q = by_key[key]
        assert abs(sup.prob[row] - q) < TOL and sup.rewards[row] == env.reward[f]


@pytest.mark.parametrize(("name", "eos"), CASES)
def test_occupancy_and_divergence_profile_by_enumeration(name, eos):
    env = _envs(eos)[name]
    mu = _behaviour(env, 8)
    occ = np.zeros((env.T, env.S))
    for y, _, _, _, q in _brute_force(env, mu):
        s = env.initial_state
        for t, v in enumerate(y):
            occ[t, s] += q
            s = env.transition[s, v]
    np.testing.assert_allclose(env.occupancy(mu), occ, atol=TOL)
    prof = env.divergence_profile(mu)
    per_state = divergence.chi2(env.pi, mu)[:, env.policy_index]
    running = occ.sum(axis=1)
    expected = (occ * per_state).sum(axis=1) / running
    np.testing.assert_allclose(prof["chi2_tok"], expected, atol=TOL)
    assert np.all(prof["chi2_max"] >= prof["chi2_tok"] - TOL)
    np.testing.assert_allclose(prof["running"], running, atol=TOL)


@pytest.mark.parametrize(("name", "eos"), CASES)
@pytest.mark.parametrize("mapping", TOKEN_MAPPINGS)
def test_token_level_exact_mean_agrees_with_enumeration(mapping, name, eos):
    env = _envs(eos)[name]
    mu = _behaviour(env, 9)
    m = mappings.get(mapping)
    b = env.J(mu)  # the oracle baseline J(μ)
    expected = np.zeros(env.D)
    for y, c, f, _p, q in _brute_force(env, mu):
        A = env.reward[f] - b
        r = np.array(
            [p_t for p_t in (env.pi[t, k, v] / mu[t, k, v] for t, (k, v) in enumerate(zip(c, y)))]
        )
        coeff = m.phi(r, A >= 0)
        expected += q * A * _score(env, y, c, coeff)
    got = exact_token_level_mean(env, mu, m, b)
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
    if env.fixed_length:
        tm = exact_token_level_mean(env, mu, m, b, aggregation="token-mean")
        np.testing.assert_allclose(tm, expected / env.T, rtol=0, atol=TOL)
    # and the enumeration path of the experiment gives the same mean
    est = Estimator(m, aggregation="seq-mean-token-sum")
    np.testing.assert_allclose(exact_moments(env, mu, est, n=4).mean, got, atol=TOL)


def test_token_level_exact_mean_with_general_reward():
    """A reward that is not 0/1 and a baseline in its middle: the sign split is exact."""
    base = TokenMDP.answer_correct(3, 3, eos=2, seed=11, stationary=False)
    env = TokenMDP(base.logits, base.transition, base.policy_index, [-0.5, 1.3, 0.2], eos=2)
    mu = _behaviour(env, 12)
    m = mappings.get("ppo_clip")
    expected = np.zeros(env.D)
    for y, c, f, _p, q in _brute_force(env, mu):
        A = env.reward[f] - 0.1
        r = np.array([env.pi[t, k, v] / mu[t, k, v] for t, (k, v) in enumerate(zip(c, y))])
        expected += q * A * _score(env, y, c, m.phi(r, A >= 0))
    got = exact_token_level_mean(env, mu, m, 0.1)
    np.testing.assert_allclose(got, expected, atol=TOL)
    assert np.linalg.norm(got) > 1e-3


def test_grad_J_matches_finite_differences():
    env = TokenMDP.at_least_k(3, 3, k=2, eos=1, seed=13, stationary=False)
    h = 1e-5
    fd = np.empty(env.D)
    for i in range(env.D):
        step = np.zeros(env.D)
        step[i] = h
        plus = TokenMDP(
            env.logits + step.reshape(env.logits.shape),
            env.transition,
            env.policy_index,
            env.reward,
            eos=env.eos,
        )
        minus = TokenMDP(
            env.logits - step.reshape(env.logits.shape),
            env.transition,
            env.policy_index,
            env.reward,
            eos=env.eos,
        )
        fd[i] = (plus.J() - minus.J()) / (2 * h)
    np.testing.assert_allclose(env.grad_J(), fd, atol=1e-9)


# --- identities for independent tokens -----------------------------------------------------


@pytest.mark.parametrize("T", [1, 2, 5, 30])
def test_iid_sequence_divergences_are_products(T):
    env = TokenMDP.iid(4, T, seed=3, scale=1.5)
    mu_tok = np.array([0.1, 0.2, 0.3, 0.4])
    mu = np.broadcast_to(mu_tok, env.logits.shape)
    d = env.divergences(mu)
    chi2_tok = float(divergence.chi2(env.pi[0, 0], mu_tok))
    kl_tok = float(divergence.kl(env.pi[0, 0], mu_tok))
    assert d["chi2_tok"] == pytest.approx(chi2_tok, rel=1e-12)
    assert d["chi2_seq"] == pytest.approx((1 + chi2_tok) ** T - 1, rel=1e-10)
    assert d["kl_seq"] == pytest.approx(T * kl_tok, rel=1e-12)
    lo, hi = env.tv_seq_bounds(mu)
    assert lo <= hi
    if T <= 5:
        assert lo - 1e-12 <= d["tv_seq"] <= hi + 1e-12
    else:
        assert math.isnan(d["tv_seq"])  # 4^30 sequences: beyond the enumeration budget


def test_chi2_seq_survives_long_sequences():
    """Log-space rescaling: (1 + χ²_tok)^T for T = 3000 without overflow or underflow, and inf
    (not an error) once E_μ[W²] exceeds the float range."""
    env = TokenMDP.iid(4, 3000, seed=3)
    for mix, finite in [(0.97, True), (0.3, False)]:
        mu_tok = mix * env.pi[0, 0] + (1 - mix) / 4
        mu = np.broadcast_to(mu_tok, env.logits.shape)
        log_expected = 3000 * math.log1p(float(divergence.chi2(env.pi[0, 0], mu_tok)))
        assert env._log1p_chi2_seq(mu) == pytest.approx(log_expected, rel=1e-10)
        if finite:
            assert env.chi2_seq(mu) == pytest.approx(math.expm1(log_expected), rel=1e-9)
        else:
            assert log_expected > 710 and env.chi2_seq(mu) == math.inf


@pytest.mark.parametrize("T", [1, 2, 3, 6])
def test_sequence_is_exactly_unbiased_and_token_is_biased(T):
    env = TokenMDP.iid(3, T, seed=5)
    mu = np.broadcast_to(np.array([0.5, 0.3, 0.2]), env.logits.shape)
    ests = [Estimator(m, aggregation="seq-mean-token-sum", name=m) for m in ("is_seq", "is_token")]
    # token-mean (Z = n·T) estimates ∇J/T: a pure rescaling, visible as bias but not bias_dir
    ests.append(Estimator("is_seq", name="is_seq token-mean"))
    table = run(env, mu, ests, n=4, reps=50, n_boot=20).set_index("estimator")
    assert table["exact"].all()
    assert table.loc["is_seq", "bias"] < 1e-12
    assert table.loc["is_seq token-mean", "bias_dir"] < 1e-12
    if T == 1:
        assert table.loc["is_token", "bias"] < 1e-12
        assert table.loc["is_seq token-mean", "bias"] < 1e-12
    else:
        assert table.loc["is_token", "bias"] > 1e-3
        # here (stationary iid, reward "answer seen") every position's block is scaled by the
        # same P_μ(no hit elsewhere)/P_π(no hit elsewhere): the bias is a pure rescaling
        assert table.loc["is_token", "bias_dir"] < 1e-12
        assert table.loc["is_seq token-mean", "bias"] > 1e-3


# --- exact path of the experiment ---------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("mapping", ["is_seq", "ppo_clip", "tis_token", "gspo", "vespo"])
def test_exact_moments_agree_with_monte_carlo_with_eos(mapping, aggregation):
    env = TokenMDP.answer_correct(3, 4, eos=2, seed=21, stationary=False)
    mu = _behaviour(env, 22, scale=0.4)
    est = Estimator(mapping, aggregation=aggregation)
    n, reps = 4, 4000
    batch = env.sample(mu, n, np.random.default_rng(23), reps=reps)
    g = sample_gradients(env, batch, est).gradients
    exact = exact_moments(env, mu, est, n)
    mean = g.mean(axis=0)
    se = g.std(axis=0, ddof=1) / math.sqrt(reps)
    assert np.all(np.abs(mean - exact.mean) <= Z * se + 1e-12)
    dev = np.sum((g - mean) ** 2, axis=1)
    assert abs(dev.sum() / (reps - 1) - exact.variance) <= Z * dev.std(ddof=1) / math.sqrt(reps)


def test_exact_variance_by_brute_force():
    env = TokenMDP.parity(2, 3, eos=0, seed=31, stationary=False)
    mu = _behaviour(env, 32)
    est = Estimator("is_token", aggregation="seq-mean-token-mean")
    b, n = env.J(mu), 3  # the oracle baseline J(μ)
    terms, probs = [], []
    for y, c, f, _p, q in _brute_force(env, mu):
        r = np.array([env.pi[t, k, v] / mu[t, k, v] for t, (k, v) in enumerate(zip(c, y))])
        terms.append((env.reward[f] - b) * _score(env, y, c, r / len(y)))
        probs.append(q)
    terms, probs = np.array(terms), np.array(probs)
    mean = probs @ terms
    var = (probs @ np.sum(terms**2, axis=1) - mean @ mean) / n
    got = exact_moments(env, mu, est, n)
    np.testing.assert_allclose(got.mean, mean, atol=TOL)
    assert abs(got.variance - var) < TOL


def test_length_normalisation_bias_on_policy():
    """On-policy (μ = π) naive REINFORCE: seq-mean-token-sum is unbiased with EOS;
    seq-mean-token-mean with a fixed length is exactly ∇J/T (bias > 0, bias_dir = 0: only the
    scale is off); with varying lengths it also changes the direction (bias_dir > 0)."""
    fixed = TokenMDP.answer_correct(3, 4, seed=41, stationary=False)
    varying = TokenMDP.answer_correct(3, 4, eos=2, seed=41, stationary=False)
    ests = [
        Estimator("naive", aggregation=a) for a in ("seq-mean-token-sum", "seq-mean-token-mean")
    ]
    for env in (fixed, varying):
        t = run(env, env.pi, ests, n=4, reps=20, n_boot=20).set_index("aggregation")
        assert t["exact"].all()
        assert t.loc["seq-mean-token-sum", "bias"] < 1e-12
        assert t.loc["seq-mean-token-mean", "bias"] > 1e-3
    smtm = exact_moments(fixed, fixed.pi, ests[1], 4).mean
    np.testing.assert_allclose(smtm, fixed.grad_J() / fixed.T, atol=TOL)
    t_fixed = run(fixed, fixed.pi, ests[1], n=4, reps=20, n_boot=20)
    t_var = run(varying, varying.pi, ests[1], n=4, reps=20, n_boot=20)
    assert t_fixed["bias_dir"].iloc[0] < 1e-12
    assert t_var["bias_dir"].iloc[0] > 1e-4


def test_padding_never_changes_a_result():
    env = TokenMDP.markov(3, 5, eos=1, seed=51, stationary=False)
    mu = _behaviour(env, 52)
    batch = env.sample(mu, 16, np.random.default_rng(53), reps=3)
    pad = ~batch.mask
    rng = np.random.default_rng(54)
    actions = np.where(pad, rng.integers(0, env.V, batch.actions.shape), batch.actions)
    log_ratio = np.where(pad, rng.normal(size=pad.shape), batch.log_ratio)
    for name in ["is_token", "ppo_clip", "is_seq", "gspo", "vespo"]:
        for agg in ["seq-mean-token-sum", "seq-mean-token-mean", "token-mean"]:
            est = Estimator(name, aggregation=agg)
            lam = est.token_weights(batch.log_ratio, batch.mask, batch.rewards, batch.J)
            lam2 = est.token_weights(log_ratio, batch.mask, batch.rewards, batch.J)
            np.testing.assert_array_equal(lam, lam2)
            a = env.accumulate(batch.actions, lam)
            b = env.accumulate(actions, lam2, states=None)
            np.testing.assert_allclose(a, b, atol=1e-12)
            np.testing.assert_allclose(
                env.score_norms_sq(batch.actions, lam),
                env.score_norms_sq(actions, lam2),
                atol=1e-12,
            )


def test_token_mean_with_eos_is_monte_carlo():
    env = TokenMDP.iid(3, 3, eos=2, seed=61)
    mu = _behaviour(env, 62)
    assert not has_exact_path(env, "naive")
    assert has_exact_path(env, Estimator("naive", aggregation="seq-mean-token-sum"))
    t = run(env, mu, ["naive"], n=4, reps=50, n_boot=20)
    assert not t["exact"].iloc[0]
    with pytest.raises(ValueError, match=r"token-mean.*random"):
        run(env, mu, ["naive"], n=4, reps=50, exact=True)
    with pytest.raises(ValueError, match="token-mean"):
        exact_token_level_mean(env, mu, mappings.get("naive"), 0.5, aggregation="token-mean")


@pytest.mark.parametrize("name", PER_SAMPLE)
def test_every_per_sample_mapping_runs_exactly(name):
    env = TokenMDP.at_least_k(2, 3, k=2, eos=1, seed=71, stationary=False)
    mu = _behaviour(env, 72, scale=0.3)
    t = run(env, mu, [Estimator(name, aggregation="seq-mean-token-mean")], n=4, reps=20, n_boot=20)
    assert t["exact"].iloc[0] and np.isfinite(t["variance"].iloc[0])


# --- constructors and bad input ------------------------------------------------------------


def test_constructors_shapes_and_rewards():
    env = TokenMDP.markov(4, 6, target=2, eos=3, seed=1)
    assert (env.T, env.P, env.V, env.S, env.D) == (6, 5, 4, 5, 6 * 5 * 4)
    np.testing.assert_allclose(env.pi.sum(axis=-1), 1.0)
    assert np.all(env.logits == env.logits[:1])  # stationary by default
    assert TokenMDP.iid(3, 2, logits=[0.0, 1.0, 2.0]).logits.shape == (2, 1, 3)
    # deterministic policies give known rewards
    big = np.array([50.0, -50.0, -50.0])  # (V,): broadcast to every position and class
    assert TokenMDP.at_least_k(3, 4, k=4, hit=0, logits=big).J() == pytest.approx(1.0)
    assert TokenMDP.parity(3, 3, marked=[0], logits=np.tile([50.0, 0, 0], (2, 1))).J() == (
        pytest.approx(1.0)
    )
    assert TokenMDP.parity(3, 4, marked=[0], logits=np.tile([50.0, 0, 0], (2, 1))).J() == (
        pytest.approx(0.0)
    )
    assert TokenMDP.iid(3, 4, eos=2, seed=0).length_distribution().sum() == pytest.approx(1.0)
    assert TokenMDP.iid(3, 4, seed=0) is not TokenMDP.iid(3, 4, seed=0)
    np.testing.assert_array_equal(
        TokenMDP.iid(3, 4, seed=9).logits, TokenMDP.iid(3, 4, seed=9).logits
    )


def test_bad_input():
    logits = np.zeros((2, 1, 3))
    trans = np.zeros((2, 3), dtype=int)
    with pytest.raises(ValueError, match=r"logits must have shape \(T, P, V\)"):
        TokenMDP(np.zeros((1, 3)), trans, [0, 0], [0.0, 1.0])
    with pytest.raises(ValueError, match="non-finite"):
        TokenMDP(np.full((2, 1, 3), np.nan), trans, [0, 0], [0.0, 1.0])
    with pytest.raises(ValueError, match=r"transition must have shape \(S, V\)"):
        TokenMDP(logits, np.zeros((2, 4), dtype=int), [0, 0], [0.0, 1.0])
    with pytest.raises(ValueError, match=r"transition\[1, 2\] = 5"):
        TokenMDP(logits, [[0, 0, 0], [0, 1, 5]], [0, 0], [0.0, 1.0])
    with pytest.raises(ValueError, match="transition must be an integer"):
        TokenMDP(logits, np.full((2, 3), 0.5), [0, 0], [0.0, 1.0])
    with pytest.raises(ValueError, match="policy_index"):
        TokenMDP(logits, trans, [0, 1], [0.0, 1.0])
    with pytest.raises(ValueError, match=r"reward must have shape \(S,\)"):
        TokenMDP(logits, trans, [0, 0], [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="eos"):
        TokenMDP(logits, trans, [0, 0], [0.0, 1.0], eos=3)
    with pytest.raises(ValueError, match="initial_state"):
        TokenMDP(logits, trans, [0, 0], [0.0, 1.0], initial_state=2)
    with pytest.raises(ValueError, match="answer must differ from eos"):
        TokenMDP.iid(3, 2, answer=1, eos=1)
    with pytest.raises(ValueError, match="k must be <= T"):
        TokenMDP.at_least_k(3, 2, k=3)
    with pytest.raises(
        TypeError,
        match=r"'sead': neither an argument .* logit options logits, seed, scale, stationary",
    ):
        TokenMDP.markov(3, 2, sead=1)
    with pytest.raises(ValueError, match="scale must be a finite number >= 0"):
        TokenMDP.parity(3, 2, scale=-1.0)
    env = TokenMDP.iid(3, 2, seed=0)
    with pytest.raises(ValueError, match=r"behaviour must have shape \(T, P, V\)"):
        env.chi2_seq(np.full((3, 1, 3), 1 / 3))
    with pytest.raises(ValueError, match="not normalised"):
        env.kl_seq(np.full((2, 1, 3), 0.3))
    with pytest.raises(ValueError, match="negative"):
        env.divergences(np.broadcast_to([1.2, -0.1, -0.1], (2, 1, 3)))
    big = TokenMDP.iid(4, 11, seed=0)
    with pytest.raises(ValueError, match=r"needs 4194304 sequences.*budget of 1048576"):
        big.support(big.pi)
    with pytest.raises(ValueError, match=r"needs 9 sequences.*budget of 5"):
        env.support(env.pi, budget=5)
    with pytest.raises(ValueError, match="token-level mapping"):
        exact_token_level_mean(env, env.pi, mappings.get("is_seq"), 0.5)
    with pytest.raises(ValueError, match="actions must be tokens"):
        env.states_of(np.array([[0, 3]]))


def test_divergences_with_behaviour_missing_tokens():
    env = TokenMDP.iid(3, 3, seed=0)
    mu = np.broadcast_to([0.5, 0.5, 0.0], env.logits.shape)
    d = env.divergences(mu)
    assert d["chi2_seq"] == math.inf and d["kl_seq"] == math.inf
    assert d["chi2_tok"] == math.inf
    assert 0 < d["tv_seq"] < 1
