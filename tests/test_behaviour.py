"""Tests of simkit.envs.behaviour: behaviour policies μ of a TokenMDP dialed from π."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simkit import divergence, shifts
from simkit.envs import TokenMDP
from simkit.envs import behaviour as bh

DIV = {"chi2": divergence.chi2, "kl": divergence.kl, "tv": divergence.tv}


def _envs():
    """Small environments of each kind: iid, Markov with EOS, a task with EOS (non-stationary
    logits), parity."""
    return {
        "iid": TokenMDP.iid(4, 5, seed=1),
        "markov_eos": TokenMDP.markov(3, 4, eos=2, seed=2),
        "answer_eos": TokenMDP.answer_correct(4, 4, eos=3, seed=3, stationary=False),
        "parity": TokenMDP.parity(4, 5, seed=4),
    }


ENVS = _envs()


def _seq(env, mu, div):
    return {"chi2": env.chi2_seq, "kl": env.kl_seq, "tv": env.tv_seq}[div](mu)


def _assert_rel(value, target, rtol):
    assert abs(value - target) <= rtol * target, (value, target)


def _assert_policy(env, mu):
    assert mu.shape == env.pi.shape
    assert np.all(mu >= 0)
    np.testing.assert_allclose(mu.sum(axis=-1), 1.0, atol=1e-12)


# --- sequence level -----------------------------------------------------------------------------


@pytest.mark.parametrize("env_name", list(ENVS))
@pytest.mark.parametrize("family", ["temperature", "logit_noise", "mixture", "tail", "tilt"])
@pytest.mark.parametrize("div", ["chi2", "kl"])
def test_sequence_level_hits_target(env_name, family, div):
    env = ENVS[env_name]
    target = 0.2
    mu, s = bh.behaviour(env, target, div, "sequence", family, return_strength=True)
    _assert_policy(env, mu)
    _assert_rel(_seq(env, mu, div), target, 1e-6)  # the env's exact DP is the truth
    assert s > 0
    # one strength shared by every row: μ is the family applied at s
    np.testing.assert_array_equal(mu, bh.shift_rows(env, s, family))


@pytest.mark.parametrize("target", [1e-4, 0.05, 3.0])
def test_sequence_level_chi2_across_magnitudes(target):
    env = TokenMDP.at_least_k(5, 6, 2, eos=4, seed=7)
    mu = bh.behaviour(env, target, "chi2", "sequence", "tail", n_tokens=2)
    _assert_rel(env.chi2_seq(mu), target, 1e-6)


@pytest.mark.parametrize("env_name", ["markov_eos", "answer_eos"])
def test_sequence_level_tv_where_exact(env_name):
    env = ENVS[env_name]
    mu = bh.behaviour(env, 0.15, "tv", "sequence", "temperature")
    _assert_rel(env.tv_seq(mu), 0.15, 1e-6)


@pytest.mark.parametrize("family", ["top_p", "top_k"])
def test_truncation_families_dial_tv(family):
    """Support-cutting families reach TV_seq and the average per-token TV (continuous in the
    strength with fractional=True); a discontinuous one is refused at the jump."""
    env = ENVS["markov_eos"]
    _assert_rel(env.tv_seq(bh.behaviour(env, 0.2, "tv", "sequence", family)), 0.2, 1e-6)
    mu = bh.behaviour(env, 0.1, "tv", "token", family, aggregate="average")
    _assert_rel(env.divergences_tok(mu)["tv_tok"], 0.1, 1e-6)
    with pytest.raises(ValueError, match=r"cannot be hit .* discontinuous"):
        bh.behaviour(env, 0.2, "tv", "sequence", family, fractional=False)


def test_sequence_level_sharpen_and_instance():
    env = ENVS["markov_eos"]
    fam = shifts.get("temperature", direction="sharpen")
    mu = bh.behaviour(env, 0.3, "kl", "sequence", fam)
    _assert_rel(env.kl_seq(mu), 0.3, 1e-6)
    np.testing.assert_array_equal(
        mu, bh.behaviour(env, 0.3, "kl", "sequence", "temperature", direction="sharpen")
    )


@settings(max_examples=25, deadline=None)
@given(
    target=st.floats(1e-3, 2.0),
    seed=st.integers(0, 1000),
    family=st.sampled_from(
        [shifts.get("temperature", direction="sharpen"), shifts.get("logit_noise"), "tail"]
    ),
)
def test_sequence_level_property(target, seed, family):
    env = TokenMDP.answer_correct(3, 4, eos=2, seed=seed, scale=1.5)
    mu = bh.behaviour(env, target, "chi2", "sequence", family)
    _assert_rel(env.chi2_seq(mu), target, 1e-6)


def test_iid_sequence_target_closed_form():
    """iid env (π the same at every position, fixed length T): 1 + χ²_seq = (1 + χ²_tok)^T, so
    a sequence target c gives every row χ²_tok = (1 + c)^{1/T} − 1 (docs/reference.md §F), and
    KL_seq = T·KL_tok (chain rule)."""
    T = 6
    env = TokenMDP.iid(5, T, seed=11)
    c = 0.5
    mu = bh.behaviour(env, c, "chi2", "sequence", "temperature")
    per_token = (1.0 + c) ** (1.0 / T) - 1.0
    np.testing.assert_allclose(divergence.chi2(env.pi, mu), per_token, rtol=1e-8)
    # the token-level dial at the closed-form per-token target gives the same μ
    mu_tok = bh.behaviour(env, per_token, "chi2", "token", "temperature")
    np.testing.assert_allclose(mu_tok, mu, rtol=1e-7, atol=1e-12)
    # KL: KL_seq = T·KL_tok
    mu_kl = bh.behaviour(env, 0.3, "kl", "sequence", "logit_noise")
    np.testing.assert_allclose(divergence.kl(env.pi, mu_kl), 0.3 / T, rtol=1e-8)


# --- token level --------------------------------------------------------------------------------


@pytest.mark.parametrize("env_name", ["markov_eos", "answer_eos", "parity"])
@pytest.mark.parametrize("div", ["chi2", "kl", "tv"])
def test_token_each_row_hits_target(env_name, div):
    env = ENVS[env_name]
    mu, s = bh.behaviour(env, 0.07, div, "token", "logit_noise", return_strength=True)
    _assert_policy(env, mu)
    np.testing.assert_allclose(DIV[div](env.pi, mu), 0.07, rtol=shifts.DIAL_RTOL)
    assert s.shape == env.pi.shape[:2]
    assert np.all(s > 0)


def test_token_each_row_own_target():
    env = ENVS["markov_eos"]
    T, P = env.pi.shape[:2]
    targets = np.linspace(0.01, 0.2, T * P).reshape(T, P)
    mu = bh.behaviour(env, targets, "chi2", "token", "tilt")
    np.testing.assert_allclose(divergence.chi2(env.pi, mu), targets, rtol=shifts.DIAL_RTOL)


@pytest.mark.parametrize("env_name", ["markov_eos", "answer_eos", "parity"])
@pytest.mark.parametrize("div", ["chi2", "kl", "tv"])
def test_token_average_hits_target(env_name, div):
    env = ENVS[env_name]
    mu, s = bh.behaviour(
        env, 0.05, div, "token", "logit_noise", aggregate="average", return_strength=True
    )
    # truth: the env's per-token divergence averaged over μ's emitted tokens
    _assert_rel(env.divergences(mu)[f"{div}_tok"], 0.05, 1e-6)
    np.testing.assert_array_equal(mu, bh.shift_rows(env, s, "logit_noise"))
    # a shared strength, so the rows do not all sit at the target
    assert not np.allclose(DIV[div](env.pi, mu), 0.05, rtol=1e-4, atol=0)


def test_token_average_differs_from_pi_weighting():
    """The average is over μ's state occupancy, which moves with the strength: re-weighting the
    same per-row divergences by π's occupancy gives another number."""
    env = TokenMDP.answer_correct(4, 5, seed=5, scale=2.0)
    mu = bh.behaviour(env, 0.3, "chi2", "token", "tail", aggregate="average")
    per_row = divergence.chi2(env.pi, mu)
    w_pi = bh.row_weights(env, env.pi)
    w_mu = bh.row_weights(env, mu)
    _assert_rel(np.sum(w_mu * per_row) / np.sum(w_mu), 0.3, 1e-6)
    assert abs(np.sum(w_pi * per_row) / np.sum(w_pi) - 0.3) > 1e-3


# --- concentrated and toxic-tail profiles -------------------------------------------------------


def test_concentrated_fraction():
    env = TokenMDP.at_least_k(4, 6, 2, seed=8)
    mu, s = bh.concentrated(env, 0.5, "chi2", "sequence", fraction=0.25, return_strength=True)
    _assert_rel(env.chi2_seq(mu), 0.5, 1e-6)
    mask = bh.random_states(env, 0.25, 0)
    reachable = bh.row_weights(env, env.pi) > 0
    assert mask.sum() == round(0.25 * reachable.sum())
    assert np.all(reachable[mask])
    np.testing.assert_array_equal(mu[~mask], env.pi[~mask])  # untouched rows exactly π
    assert np.all(np.any(mu[mask] != env.pi[mask], axis=-1))
    np.testing.assert_array_equal(mu, bh.shift_rows(env, s, states=mask))
    # concentrating the same χ²_seq on fewer rows moves each of them further
    _, s_spread = bh.behaviour(env, 0.5, "chi2", "sequence", return_strength=True)
    assert s > s_spread
    # another seed selects other rows, same seed the same ones
    np.testing.assert_array_equal(mask, bh.random_states(env, 0.25, 0))
    assert any(not np.array_equal(mask, bh.random_states(env, 0.25, seed)) for seed in range(1, 6))


def test_concentrated_explicit_states():
    env = ENVS["answer_eos"]
    rows = [(0, 0), (2, 1)]
    mu = bh.concentrated(env, 0.1, "kl", "sequence", "tilt", states=rows)
    _assert_rel(env.kl_seq(mu), 0.1, 1e-6)
    mask = np.zeros(env.pi.shape[:2], dtype=bool)
    mask[0, 0] = mask[2, 1] = True
    np.testing.assert_array_equal(mu[~mask], env.pi[~mask])
    # a boolean mask is the same selection; per-row dialing leaves the other rows alone too
    np.testing.assert_array_equal(mu, bh.behaviour(env, 0.1, "kl", "sequence", "tilt", states=mask))
    mu_tok, s_tok = bh.behaviour(env, 0.02, "chi2", "token", states=rows, return_strength=True)
    np.testing.assert_array_equal(mu_tok[~mask], env.pi[~mask])
    np.testing.assert_allclose(divergence.chi2(env.pi, mu_tok)[mask], 0.02, rtol=1e-8)
    assert np.all(s_tok[~mask] == 0.0)


def test_toxic_tail_starves_only_rare_tokens():
    env = ENVS["parity"]
    n_tokens = 2
    mu = bh.toxic_tail(env, 0.4, "chi2", "sequence", n_tokens=n_tokens)
    _assert_rel(env.chi2_seq(mu), 0.4, 1e-6)
    ratio = mu / env.pi
    order = np.argsort(env.pi, axis=-1)
    rare = np.take_along_axis(ratio, order[..., :n_tokens], axis=-1)
    common = np.take_along_axis(ratio, order[..., n_tokens:], axis=-1)
    # the other tokens keep their relative probabilities (one common factor per row) ...
    np.testing.assert_allclose(common, np.broadcast_to(common[..., :1], common.shape), rtol=1e-12)
    # ... and the rare ones are under-sampled by e^{-s} relative to them
    assert np.all(rare < common[..., :1])
    # restricted to some rows: the others are exactly π
    mu_rows = bh.toxic_tail(env, 0.4, "chi2", "sequence", states=[(0, 0), (1, 1)])
    keep = np.ones(env.pi.shape[:2], dtype=bool)
    keep[0, 0] = keep[1, 1] = False
    np.testing.assert_array_equal(mu_rows[keep], env.pi[keep])


def test_toxic_tail_heavier_than_temperature_at_equal_kl():
    """Same KL_seq, much larger χ²_seq: the tail family's ratios π/μ are heavy-tailed
    (per row 1 + χ² ≈ m·e^{s} while KL ≈ m·s, shifts.Tail)."""
    pi_row = np.array([0.4, 0.3, 0.2, 0.09, 0.01])
    env = TokenMDP.iid(5, 8, logits=np.log(pi_row))
    toxic = bh.toxic_tail(env, 0.2, "kl", "sequence")
    temp = bh.behaviour(env, 0.2, "kl", "sequence", "temperature")
    _assert_rel(env.kl_seq(toxic), 0.2, 1e-6)
    _assert_rel(env.kl_seq(temp), 0.2, 1e-6)
    chi2_toxic, chi2_temp = env.chi2_seq(toxic), env.chi2_seq(temp)
    assert chi2_toxic > 2.0 * chi2_temp, (chi2_toxic, chi2_temp)


# --- BehaviourSpec --------------------------------------------------------------------------


def test_spec_builds_what_behaviour_builds():
    env = ENVS["markov_eos"]
    spec = bh.BehaviourSpec(0.2, "chi2", "sequence", "tail", family_params={"n_tokens": 1})
    assert spec.family_params == (("n_tokens", 1),)
    assert hash(spec) == hash(
        bh.BehaviourSpec(0.2, "chi2", "sequence", "tail", None, None, 0, (("n_tokens", 1),))
    )
    np.testing.assert_array_equal(
        spec.build(env), bh.behaviour(env, 0.2, "chi2", "sequence", "tail", n_tokens=1)
    )
    _, s = spec.build(env, return_strength=True)
    assert isinstance(s, float)
    token = bh.BehaviourSpec(0.05, "kl", "token")
    assert token.aggregate == "each"
    np.testing.assert_array_equal(token.build(env), bh.behaviour(env, 0.05, "kl", "token"))
    conc = bh.BehaviourSpec(0.3, level="sequence", fraction=0.5, select_seed=3)
    np.testing.assert_array_equal(
        conc.build(env), bh.concentrated(env, 0.3, level="sequence", fraction=0.5, select_seed=3)
    )
    # a family hyperparameter named like a spec field does not collide
    noisy = bh.BehaviourSpec(
        0.3, level="sequence", family="logit_noise", fraction=0.5, family_params={"seed": 4}
    )
    _assert_rel(env.chi2_seq(noisy.build(env)), 0.3, 1e-6)


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"target": -1.0}, ValueError, "target must be a finite scalar >= 0"),
        ({"target": [0.1, 0.2]}, ValueError, "target must be a finite scalar"),
        ({"target": 0.1, "divergence": "hellinger"}, ValueError, "divergence must be one of"),
        ({"target": 0.1, "level": "batch"}, ValueError, "level must be one of"),
        ({"target": 0.1, "aggregate": "max"}, ValueError, "aggregate must be one of"),
        (
            {"target": 0.1, "level": "sequence", "aggregate": "each"},
            ValueError,
            "aggregate applies to level='token' only",
        ),
        ({"target": 0.1, "family": "tempreature"}, KeyError, "unknown shift family"),
        ({"target": 0.1, "family_params": {"bogus": 1}}, TypeError, "has no hyperparameter"),
        ({"target": 0.1, "family": "top_p"}, ValueError, "cuts π's support"),
        ({"target": 0.1, "fraction": 0.0}, ValueError, "fraction must be"),
        ({"target": 0.1, "fraction": True}, ValueError, "fraction must be"),
        ({"target": 0.1, "select_seed": -2}, ValueError, "select_seed must be"),
    ],
)
def test_spec_validation(kwargs, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        bh.BehaviourSpec(**kwargs)


# --- errors -----------------------------------------------------------------------------------


def _largest_in(message: str) -> float:
    return float(re.search(r"largest reachable value is ([0-9.e+-]+)", message).group(1))


def test_unreachable_sequence_target_names_largest():
    env = ENVS["markov_eos"]
    with pytest.raises(ValueError, match="is not reachable with family 'mixture'") as info:
        bh.behaviour(env, 1e6, "chi2", "sequence", "mixture")
    # mixture's range ends at λ = 1 (μ uniform in every row), where χ²_seq is largest
    largest = env.chi2_seq(bh.shift_rows(env, 1.0, "mixture"))
    assert math.isclose(_largest_in(str(info.value)), largest, rel_tol=1e-5)
    with pytest.raises(ValueError, match="largest reachable value is"):
        bh.behaviour(env, 0.9, "tv", "sequence", "temperature")
    with pytest.raises(ValueError, match="largest reachable value is"):
        bh.behaviour(env, 50.0, "kl", "token", "mixture", aggregate="average")
    with pytest.raises(ValueError, match="largest reachable value is"):
        bh.behaviour(env, 50.0, "kl", "token", "mixture")  # per row, from shifts.dial


def test_argument_errors():
    env = ENVS["markov_eos"]
    with pytest.raises(KeyError, match="unknown shift family 'gaussian'"):
        bh.behaviour(env, 0.1, family="gaussian")
    with pytest.raises(ValueError, match="level must be one of"):
        bh.behaviour(env, 0.1, level="trajectory")
    with pytest.raises(ValueError, match="divergence must be one of"):
        bh.behaviour(env, 0.1, "js")
    with pytest.raises(ValueError, match="aggregate must be one of"):
        bh.behaviour(env, 0.1, aggregate="median")
    with pytest.raises(ValueError, match="aggregate applies to level='token' only"):
        bh.behaviour(env, 0.1, level="sequence", aggregate="average")
    with pytest.raises(ValueError, match="cuts π's support"):
        bh.behaviour(env, 0.1, "kl", "sequence", "top_k")
    with pytest.raises(ValueError, match="target must be finite and >= 0"):
        bh.behaviour(env, -0.1, level="sequence")
    with pytest.raises(ValueError, match="concentrated needs exactly one of"):
        bh.concentrated(env, 0.1)
    with pytest.raises(ValueError, match="fraction must be"):
        bh.concentrated(env, 0.1, fraction=1.5)
    with pytest.raises(TypeError, match="TokenMDP-like"):
        bh.behaviour(object(), 0.1)


def test_shape_errors():
    env = ENVS["markov_eos"]
    T, P = env.pi.shape[:2]
    with pytest.raises(ValueError, match=re.escape(f"of shape (T, P) = {(T, P)} (one per row)")):
        bh.behaviour(env, np.full((T, P + 1), 0.1), level="token")
    with pytest.raises(ValueError, match="target must be a scalar for level='sequence'"):
        bh.behaviour(env, np.full((T, P), 0.1), level="sequence")
    with pytest.raises(ValueError, match=re.escape(f"mask must have shape (T, P) = {(T, P)}")):
        bh.behaviour(env, 0.1, states=np.ones((T + 1, P), dtype=bool))
    with pytest.raises(ValueError, match=r"outside 0 <= t < T"):
        bh.behaviour(env, 0.1, states=[(T, 0)])
    with pytest.raises(ValueError, match="integer \\(t, p\\) pairs"):
        bh.behaviour(env, 0.1, states=[0.5, 1.5])
    with pytest.raises(ValueError, match="selects no row"):
        bh.behaviour(env, 0.1, states=np.zeros((T, P), dtype=bool))
    with pytest.raises(ValueError, match=re.escape(f"shape (T, P) = {(T, P)}")):
        bh.shift_rows(env, np.ones(T + 3), "temperature")


def test_tv_seq_not_exact_is_refused():
    env = TokenMDP.iid(16, 8, seed=0)  # 16^8 sequences: above the enumeration budget
    assert math.isnan(env.tv_seq(env.pi))
    with pytest.raises(ValueError, match="not computed exactly for this environment"):
        bh.behaviour(env, 0.1, "tv", "sequence")
    # χ² and KL still dial on it (transfer-matrix DP)
    _assert_rel(env.chi2_seq(bh.behaviour(env, 0.1, "chi2", "sequence")), 0.1, 1e-6)


def test_zero_target_is_pi():
    env = ENVS["answer_eos"]
    for level in ("token", "sequence"):
        mu, s = bh.behaviour(env, 0.0, level=level, return_strength=True)
        np.testing.assert_array_equal(mu, env.pi)
        assert np.all(np.asarray(s) == 0.0)
