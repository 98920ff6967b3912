"""Vectorised token-MDP sampling and streaming gradient accumulation (simkit.envs.token_sampling).

Stochastic checks use a fixed seed and |estimate − truth| ≤ z·SE with SE computed from the same
draws; exact comparisons use enumeration or explicit loops written here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from simkit.envs import TokenMDP
from simkit.envs.token_sampling import (
    TokenBatch,
    accumulate_tokens,
    padding_mask,
    sample_tokens,
    token_states,
)
from simkit.estimators import Estimator
from simkit.experiment import exact_moments

Z = 5.0  # z-score of every stochastic check (many cells are checked at once)


def automaton_env(eos: int | None = 2, T: int = 3, seed: int = 0) -> TokenMDP:
    """S = 4 states, P = 2 policy classes (states 0, 2 -> class 0; 1, 3 -> class 1), V = 3."""
    rng = np.random.default_rng(seed)
    transition = np.array([[1, 2, 3], [0, 3, 2], [3, 1, 0], [2, 2, 1]])
    return TokenMDP(
        logits=rng.normal(size=(T, 2, 3)),
        transition=transition,
        policy_index=np.array([0, 1, 0, 1]),
        reward=np.array([0.0, 1.0, 0.3, 1.0]),
        eos=eos,
    )


def behaviour(env: TokenMDP, seed: int = 1, zero: bool = True) -> np.ndarray:
    """A behaviour μ (T, P, V) away from π, optionally with one token of probability 0."""
    mu = np.random.default_rng(seed).dirichlet(np.full(env.V, 3.0), size=(env.T, env.P))
    if zero:
        mu[1, 0, 1] = 0.0  # token 1 impossible at t = 1 in class 0
        mu[1, 0] /= mu[1, 0].sum()
    return mu


def final_states(env: TokenMDP, actions, mask) -> np.ndarray:
    """Automaton state after the last valid token, by an explicit per-sequence loop."""
    out = []
    for y, m in zip(actions.reshape(-1, env.T), mask.reshape(-1, env.T)):
        s = env.initial_state
        for t in range(env.T):
            if m[t]:
                s = env.transition[s, y[t]]
        out.append(s)
    return np.array(out).reshape(actions.shape[:-1])


# --- structure of a batch --------------------------------------------------------------------


@pytest.mark.parametrize("eos", [None, 2])
def test_batch_structure_log_ratio_padding_and_rewards(eos):
    env = automaton_env(eos=eos, T=4)
    mu = behaviour(env)
    b = sample_tokens(env, mu, 50, np.random.default_rng(3), reps=4)
    assert isinstance(b, TokenBatch)
    assert (b.n, b.reps, b.T) == (50, 4, 4)
    assert b.actions.shape == b.mask.shape == b.log_ratio.shape == b.states.shape == (4, 50, 4)
    assert b.rewards.shape == b.lengths.shape == (4, 50)
    assert np.issubdtype(b.actions.dtype, np.integer) and b.mask.dtype == bool
    # states: the automaton run on the actions, at each emitted token
    expected_states = env.states_of(b.actions)
    np.testing.assert_array_equal(b.states[b.mask], expected_states[b.mask])
    # log-ratio = log π − log μ at the sampled (t, class, token), 0 on padding
    t_idx = np.broadcast_to(np.arange(env.T), b.actions.shape)
    cls = env.policy_index[b.states]
    lr = np.log(env.pi[t_idx, cls, b.actions]) - np.log(mu[t_idx, cls, b.actions])
    np.testing.assert_allclose(b.log_ratio[b.mask], lr[b.mask], rtol=0, atol=1e-12)
    assert np.all(b.log_ratio[~b.mask] == 0) and np.all(b.actions[~b.mask] == 0)
    # the mask is a prefix; lengths count it; EOS ends a sequence and only EOS does
    np.testing.assert_array_equal(b.lengths, b.mask.sum(axis=-1))
    np.testing.assert_array_equal(b.mask, np.arange(env.T) < b.lengths[..., None])
    if eos is None:
        assert b.mask.all()
    else:
        last = np.take_along_axis(b.actions, (b.lengths - 1)[..., None], axis=-1)[..., 0]
        short = b.lengths < env.T
        assert short.any() and np.all(last[short] == eos)
        assert np.all(b.actions[b.mask & (np.arange(env.T) < b.lengths[..., None] - 1)] != eos)
        np.testing.assert_array_equal(padding_mask(env, b.actions), b.mask)
    # reward of the final automaton state; J is the exact J(π)
    np.testing.assert_array_equal(b.rewards, env.reward[final_states(env, b.actions, b.mask)])
    assert b.J == pytest.approx(env.J(), abs=1e-12)
    np.testing.assert_allclose(b.grad_J, env.grad_J(), atol=1e-12)
    # a token of μ-probability 0 is never drawn
    at_zero = (t_idx == 1) & (cls == 0) & b.mask
    assert at_zero.any() and not np.any(b.actions[at_zero] == 1)


def test_unbatched_shapes_and_env_delegation():
    env = automaton_env()
    mu = behaviour(env)
    b = sample_tokens(env, mu, 7, np.random.default_rng(0))
    assert b.reps is None and b.actions.shape == (7, 3) and b.rewards.shape == (7,)
    b2 = env.sample(mu, 7, np.random.default_rng(0))
    np.testing.assert_array_equal(b.actions, b2.actions)


def test_same_seed_same_batch_and_different_seed_differs():
    env = automaton_env(T=5)
    mu = behaviour(env)
    a = sample_tokens(env, mu, 200, np.random.default_rng(11), reps=3)
    b = sample_tokens(env, mu, 200, np.random.default_rng(11), reps=3)
    for name in ("actions", "mask", "rewards", "log_ratio", "lengths", "states"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    c = sample_tokens(env, mu, 200, np.random.default_rng(12), reps=3)
    assert not np.array_equal(a.actions, c.actions)


def test_long_sequences_cross_block_boundaries():
    """T larger than the internal block of positions: states/log-ratios stay consistent."""
    env = TokenMDP.markov(V=4, T=150, eos=3, seed=2, stationary=False)
    mu = np.random.default_rng(0).dirichlet(np.full(4, 20.0), size=env.logits.shape[:2])
    mu[:, :, 3] *= 0.02  # rare EOS: many sequences longer than one block of 64
    mu /= mu.sum(axis=-1, keepdims=True)
    b = sample_tokens(env, mu, 300, np.random.default_rng(1))
    assert b.lengths.max() > 64
    np.testing.assert_array_equal(b.states[b.mask], env.states_of(b.actions)[b.mask])
    t_idx = np.broadcast_to(np.arange(env.T), b.actions.shape)
    cls = env.policy_index[b.states]
    lr = np.log(env.pi[t_idx, cls, b.actions]) - np.log(mu[t_idx, cls, b.actions])
    np.testing.assert_allclose(b.log_ratio[b.mask], lr[b.mask], atol=1e-12)
    np.testing.assert_array_equal(b.rewards, env.reward[final_states(env, b.actions, b.mask)])


# --- distribution ----------------------------------------------------------------------------


def test_token_frequencies_per_position_and_state_match_mu():
    env = automaton_env(eos=2, T=3)
    mu = behaviour(env)
    b = sample_tokens(env, mu, 40_000, np.random.default_rng(5))
    checked = 0
    for t in range(env.T):
        for s in range(env.S):
            here = b.mask[:, t] & (b.states[:, t] == s)
            count = int(here.sum())
            if count < 500:
                continue
            p = mu[t, env.policy_index[s]]
            freq = np.bincount(b.actions[here, t], minlength=env.V) / count
            se = np.sqrt(freq * (1 - freq) / count)  # binomial SE from the same draws
            zero = p == 0
            assert np.all(freq[zero] == 0)
            assert np.all(np.abs(freq - p)[~zero] <= Z * se[~zero] + 1e-15)
            checked += 1
    assert checked >= 5


def test_sequence_frequencies_match_enumerated_probabilities():
    env = automaton_env(eos=2, T=3)
    mu = behaviour(env, zero=False)
    atoms = env.support(mu)  # every sequence with its exact μ-probability
    N = 60_000
    b = sample_tokens(env, mu, N, np.random.default_rng(8))
    key_base = env.V ** np.arange(env.T)
    # sequences are identified by their tokens (padding is 0, lengths disambiguate)
    sample_key = (b.actions @ key_base) * (env.T + 1) + b.lengths
    atom_key = (atoms.actions @ key_base) * (env.T + 1) + atoms.mask.sum(axis=1)
    assert len(set(atom_key)) == len(atom_key)
    assert np.isin(sample_key, atom_key).all()
    assert atoms.prob.min() * N > 50
    for key, p in zip(atom_key, atoms.prob):
        hit = sample_key == key
        freq = hit.mean()
        se = hit.std() / math.sqrt(N)
        assert abs(freq - p) <= Z * se, (key, freq, p, se)


# --- accumulation ----------------------------------------------------------------------------


def explicit_accumulate(env, actions, lam, mask) -> np.ndarray:
    """Σ over valid tokens of λ·(e_v − π[t, p, :]) in block (t, p), one token at a time."""
    out = []
    for y_b, lam_b, m_b in zip(
        actions.reshape(-1, *actions.shape[-2:]),
        lam.reshape(-1, *lam.shape[-2:]),
        mask.reshape(-1, *mask.shape[-2:]),
    ):
        G = np.zeros(env.logits.shape)
        for y, w, m in zip(y_b, lam_b, m_b):
            s = env.initial_state
            for t in range(env.T):
                if not m[t]:
                    break
                p = env.policy_index[s]
                grad_log = -env.pi[t, p].copy()
                grad_log[y[t]] += 1.0
                G[t, p] += w[t] * grad_log
                s = env.transition[s, y[t]]
        out.append(G.ravel())
    return np.array(out).reshape(*actions.shape[:-2], env.D)


@pytest.mark.parametrize("eos", [None, 2])
def test_accumulate_equals_explicit_per_token_sum_with_reps(eos):
    env = automaton_env(eos=eos, T=4, seed=3)
    mu = behaviour(env)
    b = sample_tokens(env, mu, 30, np.random.default_rng(2), reps=3)
    lam = np.random.default_rng(4).normal(size=b.actions.shape)  # non-zero on padding too
    expected = explicit_accumulate(env, b.actions, lam, b.mask)
    assert expected.shape == (3, env.D)
    for states in (b.states, None):  # given, or recomputed from the actions
        got = accumulate_tokens(env, b.actions, lam, states=states)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(env.accumulate(b.actions, lam), expected, atol=1e-12)
    # one batch (no leading axis) -> (D,)
    np.testing.assert_allclose(
        accumulate_tokens(env, b.actions[1], lam[1]), expected[1], rtol=0, atol=1e-12
    )


def test_accumulate_explicit_mask_overrides_default():
    env = automaton_env(eos=None, T=3)
    b = sample_tokens(env, behaviour(env), 20, np.random.default_rng(0))
    lam = np.ones(b.actions.shape)
    mask = np.random.default_rng(1).random(b.actions.shape) < 0.5
    got = accumulate_tokens(env, b.actions, lam, mask=mask)
    np.testing.assert_allclose(got, accumulate_tokens(env, b.actions, lam * mask), atol=1e-12)


def test_token_states_matches_env_states_on_valid_tokens():
    env = automaton_env(eos=2, T=5)
    b = sample_tokens(env, behaviour(env), 100, np.random.default_rng(6), reps=2)
    states = token_states(env, b.actions)
    np.testing.assert_array_equal(states[b.mask], env.states_of(b.actions)[b.mask])
    np.testing.assert_array_equal(states, b.states)  # frozen final state on padding as well


# --- Monte Carlo against the exact path ------------------------------------------------------


@pytest.mark.parametrize(
    ("eos", "estimator"),
    [
        (2, Estimator("is_seq", aggregation="seq-mean-token-sum")),
        (2, Estimator("tis_token", aggregation="seq-mean-token-sum")),
        (None, Estimator("tis_token")),
        (None, Estimator("ppo_clip", advantage="raw")),
    ],
    ids=["is_seq-eos", "tis_token-eos", "tis_token-fixed", "ppo_clip-raw-fixed"],
)
def test_monte_carlo_mean_and_variance_match_exact(eos, estimator):
    env = automaton_env(eos=eos, T=3, seed=7)
    mu = behaviour(env, seed=9, zero=False)
    n, reps = 8, 20_000
    exact = exact_moments(env, mu, estimator, n)
    b = sample_tokens(env, mu, n, np.random.default_rng(10), reps=reps)
    lam = estimator.token_weights(b.log_ratio, b.mask, b.rewards, b.J_mu)  # oracle: J(μ)
    g = accumulate_tokens(env, b.actions, lam, states=b.states)  # (reps, D)
    mean = g.mean(axis=0)
    se = g.std(axis=0, ddof=1) / math.sqrt(reps)
    assert np.all(np.abs(mean - exact.mean) <= Z * se + 1e-12)
    dev_sq = np.sum((g - mean) ** 2, axis=1)
    variance = dev_sq.mean() * reps / (reps - 1)
    assert abs(variance - exact.variance) <= Z * dev_sq.std() / math.sqrt(reps)
    if estimator.mapping.name == "is_seq":  # unbiased: E ĝ = ∇J
        assert np.all(np.abs(mean - env.grad_J()) <= Z * se + 1e-12)


# --- input checks ----------------------------------------------------------------------------


def test_bad_inputs_name_the_argument():
    env = automaton_env()
    mu = behaviour(env)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="mu must have the shape"):
        sample_tokens(env, mu[:, :, :2] / mu[:, :, :2].sum(-1, keepdims=True), 3, rng)
    with pytest.raises(ValueError, match="mu"):
        sample_tokens(env, mu * 2, 3, rng)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        sample_tokens(env, mu, 0, rng)
    with pytest.raises(ValueError, match="reps must be a positive integer"):
        sample_tokens(env, mu, 3, rng, reps=1.5)
    with pytest.raises(TypeError, match="rng"):
        sample_tokens(env, mu, 3, 0)
    b = sample_tokens(env, mu, 4, rng)
    with pytest.raises(ValueError, match="token_weights"):
        accumulate_tokens(env, b.actions, np.ones((4, 2)))
    with pytest.raises(ValueError, match="actions must lie"):
        accumulate_tokens(env, b.actions + 5, np.ones((4, 3)))
    with pytest.raises(ValueError, match="actions must have shape"):
        accumulate_tokens(env, b.actions[:, :2], np.ones((4, 2)))
    with pytest.raises(ValueError, match="integer token"):
        accumulate_tokens(env, b.actions.astype(float), np.ones((4, 3)))
    with pytest.raises(ValueError, match="states"):
        accumulate_tokens(env, b.actions, np.ones((4, 3)), states=b.states[:2])
    with pytest.raises(ValueError, match="mask"):
        accumulate_tokens(env, b.actions, np.ones((4, 3)), mask=b.mask[:2])


def test_inverse_cdf_boundaries_skip_zero_probability_tokens():
    """u exactly on a CDF step gives the next token of positive probability (never μ = 0)."""
    from simkit.envs.token_sampling import _cdf_tables, _inverse_cdf, _search_levels

    mu = np.array([[[0.0, 0.25, 0.0, 0.0, 0.5, 0.25]]])  # (1, P = 1, V = 6), V_pad = 8
    cdf = _cdf_tables(mu, 8).reshape(1, 8)
    u = np.array([0.0, 0.1, 0.25, 0.5, 0.75, 0.999999])
    k = _inverse_cdf(_search_levels(cdf, 8), np.zeros(6, dtype=np.intp), u)
    np.testing.assert_array_equal(k, [1, 1, 4, 4, 5, 5])
    # a second row is addressed through its row index: flat index = row·V_pad + token
    mu2 = np.array([[[1.0, 0.0], [0.0, 1.0]]])  # (1, P = 2, V = 2)
    cdf2 = _cdf_tables(mu2, 2).reshape(2, 2)
    rows = np.array([0, 1, 1])
    k2 = _inverse_cdf(_search_levels(cdf2, 2), rows, np.array([0.0, 0.0, 0.99]))
    np.testing.assert_array_equal(k2 - 2 * rows, [0, 1, 1])
    # V = 1 (V_pad = 1, no level): the only token, whatever u
    k3 = _inverse_cdf(_search_levels(np.ones((3, 1)), 1), np.array([2, 0]), np.array([0.3, 0.9]))
    np.testing.assert_array_equal(k3, [2, 0])


@pytest.mark.parametrize("V", [1, 3, 5, 8, 13])
def test_inverse_cdf_equals_searchsorted_on_every_row(V):
    """The level search returns row·V_pad + searchsorted(F_row, u, 'right'), ties included."""
    from simkit.envs.token_sampling import _cdf_tables, _inverse_cdf, _search_levels

    rng = np.random.default_rng(V)
    mu = rng.dirichlet(np.full(V, 0.3), size=(1, 4))  # (1, P = 4, V), some tiny probabilities
    mu[0, 1, : V // 2] = 0.0  # flat steps
    mu /= mu.sum(axis=-1, keepdims=True)
    V_pad = 1 << max(V - 1, 0).bit_length()
    cdf = _cdf_tables(mu, V_pad).reshape(4, V_pad)
    rows = rng.integers(0, 4, size=2000)
    u = np.concatenate([rng.random(1000), cdf[rows[1000:], rng.integers(0, V, 1000)]])  # ties
    u = np.minimum(u, np.nextafter(1.0, 0.0))
    k = _inverse_cdf(_search_levels(cdf, V_pad), rows, u)
    expect = [r * V_pad + np.searchsorted(cdf[r, :V], x, side="right") for r, x in zip(rows, u)]
    np.testing.assert_array_equal(k, expect)


@pytest.mark.parametrize(("B", "P", "V"), [(16, 65, 64), (2, 1, 7), (16, 40, 3)])
def test_cdf_tables_column_sums_are_the_cumsum_bit_for_bit(B, P, V, monkeypatch):
    """Both ways of summing the CDF (per-row cumsum, column by column) give the same bits."""
    import simkit.envs.token_sampling as ts

    mu = np.random.default_rng(B * P * V).dirichlet(np.ones(V), size=(B, P))
    V_pad = 1 << max(V - 1, 0).bit_length()
    monkeypatch.setattr(ts, "_COLUMN_CUMSUM_ROWS_PER_TOKEN", 0)  # always by columns
    by_columns = ts._cdf_tables(mu, V_pad)
    monkeypatch.setattr(ts, "_COLUMN_CUMSUM_ROWS_PER_TOKEN", 10**9)  # always np.cumsum
    by_rows = ts._cdf_tables(mu, V_pad)
    assert by_columns.tobytes() == by_rows.tobytes()
    expect = np.cumsum(mu, axis=-1)
    expect /= expect[..., -1:]
    np.testing.assert_array_equal(by_rows.reshape(B, P, V_pad)[..., :V], expect)


def reference_sample(env, mu, n, rng):
    """sample_tokens written out sequence by sequence, with the same uniforms (N per position,
    drawn while any sequence is alive) and the same floating-point operations per row:
    y = searchsorted(F, u, 'right') on the row's CDF F = cumsum(μ) / total,
    log-ratio = (logits − max) − log Σ exp(logits − max) − log μ."""
    T = env.logits.shape[0]
    lg = np.asarray(env.logits)
    actions = np.zeros((n, T), dtype=np.int32)
    states = np.zeros((n, T), dtype=np.int32)
    log_ratio = np.zeros((n, T))
    mask = np.zeros((n, T), dtype=bool)
    s = np.full(n, env.initial_state)
    alive = np.ones(n, dtype=bool)
    for t in range(T):
        if not alive.any():
            states[:, t:] = s[:, None]
            break
        u = rng.random(n)
        for i in range(n):
            states[i, t] = s[i]
            if not alive[i]:
                continue
            p = env.policy_index[s[i]]
            F = np.cumsum(mu[t, p])
            F /= F[-1]
            y = int(np.searchsorted(F, u[i], side="right"))
            row = lg[t, p] - lg[t, p].max()
            log_ratio[i, t] = row[y] - np.log(np.exp(row).sum()) - np.log(mu[t, p, y])
            actions[i, t], mask[i, t] = y, True
            s[i] = env.transition[s[i], y]
            if env.eos is not None and y == env.eos:
                alive[i] = False
    return actions, states, log_ratio, mask, env.reward[s]


@pytest.mark.parametrize(
    ("kind", "eos", "per_state", "columns"),
    [
        ("markov", None, True, True),  # per-state rows, identity policy index, column CDFs
        ("markov", 2, True, False),
        ("iid", None, True, False),  # per-state rows copied from one policy class
        ("iid", 4, False, True),  # per-class rows (tables too large for per-state ones)
        ("automaton", 2, False, False),
        ("automaton", None, True, True),
    ],
)
def test_sample_tokens_equals_sequence_by_sequence_reference(
    kind, eos, per_state, columns, monkeypatch
):
    """Every output bit for bit against :func:`reference_sample` (T crosses a block of 16)."""
    import simkit.envs.token_sampling as ts

    if kind == "automaton":
        env = automaton_env(eos=eos, T=19, seed=3)
    else:
        env = getattr(TokenMDP, kind)(V=6, T=19, eos=eos, seed=4, stationary=False)
    mu = np.random.default_rng(5).dirichlet(np.full(env.V, 0.7), size=env.logits.shape[:2])
    mu[3, :, 1] = 0.0  # a never-drawn token at one position
    mu /= mu.sum(axis=-1, keepdims=True)
    if not per_state:
        monkeypatch.setattr(ts, "_STATE_TABLE_BYTES", 0)
    monkeypatch.setattr(ts, "_COLUMN_CUMSUM_ROWS_PER_TOKEN", 0 if columns else 10**9)
    b = sample_tokens(env, mu, 37, np.random.default_rng(8))
    actions, states, log_ratio, mask, rewards = reference_sample(
        env, mu, 37, np.random.default_rng(8)
    )
    np.testing.assert_array_equal(b.actions, actions)
    np.testing.assert_array_equal(b.states, states)
    np.testing.assert_array_equal(b.mask, mask)
    np.testing.assert_array_equal(b.lengths, mask.sum(-1))
    np.testing.assert_array_equal(b.rewards, rewards)
    np.testing.assert_array_equal(b.log_ratio, log_ratio)  # padding: 0 (or −0.0)
    assert b.log_ratio[mask].tobytes() == log_ratio[mask].tobytes()
