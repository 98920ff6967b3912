"""simkit.estimators: advantages, aggregation weights, the Estimator and its token weights."""

import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simkit import mappings
from simkit.envs import Bandit
from simkit.estimators import (
    ADVANTAGES,
    AGGREGATIONS,
    GROUP_ADVANTAGES,
    Estimator,
    advantages,
    aggregation_weights,
    as_estimator,
)
from simkit.experiment import exact_moments

# --- advantages against straightforward loops ---------------------------------------------


def _loop_advantages(R, kind, J=None, G=None, eps=1e-6):
    out = []
    for i, r in enumerate(R):
        if kind in ("oracle", "oracle_pi"):  # the caller passes J(μ) resp. J(π)
            out.append(r - J)
            continue
        if kind == "raw":
            out.append(r)
            continue
        start = (i // G) * G
        group = list(R[start : start + G])
        mean = sum(group) / G
        if kind == "grpo":
            out.append((r - mean) / (statistics.stdev(group) + eps))
        elif kind == "dr_grpo":
            out.append(r - mean)
        elif kind == "maxrl":
            out.append((r - mean) / (mean + eps))
        else:  # rloo
            out.append(r - (sum(group) - r) / (G - 1))
    return np.array(out)


@settings(max_examples=60, deadline=None)
@given(
    # otb (per token) and opob (reads ratios and score norms): their own tests
    kind=st.sampled_from([a for a in ADVANTAGES if a not in ("otb", "opob")]),
    G=st.integers(2, 5),
    groups=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    binary=st.booleans(),
)
def test_advantages_match_loops(kind, G, groups, seed, binary):
    rng = np.random.default_rng(seed)
    N = G * groups
    R = rng.integers(0, 2, size=(3, N)).astype(float) if binary else rng.normal(size=(3, N))
    J = 0.3
    group_size = G if kind in ("grpo", "dr_grpo", "rloo", "maxrl") else None
    got = advantages(R, kind, J=J, group_size=group_size, eps=1e-4)
    assert got.shape == R.shape
    for r in range(3):
        expected = _loop_advantages(R[r], kind, J=J, G=G, eps=1e-4)
        np.testing.assert_allclose(got[r], expected, rtol=1e-12, atol=1e-12)


def test_grpo_uses_the_unbiased_std():
    # group (0, 1): mean 0.5, unbiased std = sqrt(0.5) (torch.std), not 0.5 (np.std default)
    A = advantages(np.array([0.0, 1.0]), "grpo", group_size=2, eps=0.0)
    np.testing.assert_allclose(A, [-0.5 / np.sqrt(0.5), 0.5 / np.sqrt(0.5)], rtol=1e-15)
    # a group of identical rewards gives A = 0 thanks to eps
    np.testing.assert_array_equal(advantages(np.ones(4), "grpo", group_size=4), np.zeros(4))


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((np.zeros(4), "gae"), {}, "unknown advantage 'gae'; valid advantages: oracle"),
        ((np.zeros(5), "grpo"), {"group_size": 2}, "N = 5 is not divisible by group_size G = 2"),
        ((np.zeros(4), "rloo"), {"group_size": 1}, "group_size must be an integer >= 2"),
        ((np.zeros(4), "dr_grpo"), {}, "needs a group_size"),
        ((np.zeros(4), "oracle"), {}, "needs the exact J"),
        ((np.zeros(4), "raw"), {"group_size": 2}, "group_size applies to the group advantages"),
        ((np.array([0.0, np.inf]), "raw"), {}, "non-finite"),
    ],
)
def test_advantages_bad_input(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        advantages(*args, **kwargs)


# --- aggregation weights on ragged masks --------------------------------------------------


def _loop_aggregation(mask, mode, max_length=None):
    N, T = mask.shape
    out = np.zeros((N, T))
    total = mask.sum()
    for i in range(N):
        length = mask[i].sum()
        for t in range(T):
            if not mask[i, t]:
                continue
            if mode == "token-mean":
                out[i, t] = 1 / total
            elif mode == "seq-mean-token-mean":
                out[i, t] = 1 / (N * length)
            elif mode == "seq-mean-token-sum":
                out[i, t] = 1 / N
            elif mode == "token-sum":
                out[i, t] = 1.0
            else:
                out[i, t] = 1 / (N * (T if max_length is None else max_length))
    return out


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_weights_on_ragged_masks(mode):
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 7, size=(4, 6))  # 4 batches of 6 sequences, T = 6, some empty
    mask = np.arange(6)[None, None, :] < lengths[..., None]
    mask[0, 2] = [True, False, True, False, False, True]  # not a prefix mask
    got = aggregation_weights(mask, mode)
    assert got.shape == mask.shape
    for b in range(4):
        np.testing.assert_allclose(got[b], _loop_aggregation(mask[b], mode), rtol=1e-15)
    if mode == "seq-mean-token-sum-norm":
        got = aggregation_weights(mask, mode, max_length=10)
        np.testing.assert_allclose(got[1], _loop_aggregation(mask[1], mode, 10), rtol=1e-15)
    if mode == "token-mean":  # each batch's weights sum to 1 over its valid tokens
        np.testing.assert_allclose(got.sum(axis=(1, 2)), 1.0, rtol=1e-14)


def test_aggregation_weights_bad_input():
    mask = np.ones((2, 3), dtype=bool)
    with pytest.raises(
        ValueError,
        match="unknown aggregation 'mean'; valid aggregations: token-mean, seq-mean-token-mean",
    ):
        aggregation_weights(mask, "mean")
    with pytest.raises(ValueError, match="shorter than the longest sequence"):
        aggregation_weights(mask, "seq-mean-token-sum-norm", max_length=2)
    with pytest.raises(ValueError, match="max_length applies to"):
        aggregation_weights(mask, "token-mean", max_length=4)
    with pytest.raises(ValueError, match=r"mask must have shape \(\.\.\., N, T\)"):
        aggregation_weights(np.ones(3, dtype=bool), "token-mean")


# --- the Estimator ------------------------------------------------------------------------


def test_estimator_validation_and_defaults():
    est = Estimator("is_seq")
    assert isinstance(est.mapping, mappings.Mapping) and est.mapping.name == "is_seq"
    assert est.aggregation == "token-mean" and est.advantage == "oracle"
    assert est.name == "is_seq"  # defaults: no hyperparameters, no bracket
    assert Estimator("naive", advantage="rloo", group_size=4).name == "naive [rloo, G=4]"
    assert (
        Estimator(mappings.get("ppo_clip", eps_high=0.28), aggregation="seq-mean-token-sum").name
        == "ppo_clip(eps_high=0.28) [seq-mean-token-sum]"
    )
    assert Estimator("naive", name="mine").name == "mine"
    assert as_estimator("naive") == Estimator("naive")
    assert as_estimator(mappings.get("naive")) == Estimator("naive")
    with pytest.raises(
        ValueError,
        match="unknown aggregation 'sum'; valid aggregations: "
        "token-mean, seq-mean-token-mean, seq-mean-token-sum, "
        "seq-mean-token-sum-norm",
    ):
        Estimator("naive", aggregation="sum")
    with pytest.raises(ValueError, match="unknown advantage 'gae'; valid advantages"):
        Estimator("naive", advantage="gae")
    with pytest.raises(ValueError, match="needs a group_size"):
        Estimator("naive", advantage="grpo")
    with pytest.raises(ValueError, match="group_size applies to the group advantages"):
        Estimator("naive", group_size=4)
    with pytest.raises(ValueError, match="max_length applies to"):
        Estimator("naive", max_length=4)
    with pytest.raises(ValueError, match="adv_eps"):
        Estimator("naive", adv_eps=-1.0)
    with pytest.raises(KeyError, match="unknown mapping"):
        Estimator("no_such_mapping")
    with pytest.raises(TypeError, match="mapping must be"):
        Estimator(3.0)
    with pytest.raises(TypeError, match="an estimator must be"):
        as_estimator(3.0)


def test_n_not_divisible_by_group_size_is_an_error_at_use():
    est = Estimator("naive", advantage="grpo", group_size=4)
    with pytest.raises(ValueError, match="n = 6 is not divisible by group_size G = 4"):
        est.token_weights(np.zeros((6, 1)), np.ones((6, 1), bool), np.zeros(6))


@pytest.mark.parametrize("name", mappings.available())
def test_per_sample_property(name):
    mapping = mappings.get(name)
    for adv in ADVANTAGES:
        G = 2 if adv in GROUP_ADVANTAGES else None
        if adv == "otb" and mapping.batch_dependent:
            with pytest.raises(ValueError, match="not batch dependent"):
                Estimator(mapping, advantage=adv, group_size=G)
            continue
        est = Estimator(mapping, advantage=adv, group_size=G)
        assert est.per_sample == (
            adv in ("oracle", "oracle_pi", "raw") and not mapping.batch_dependent
        )


def _ragged_batch(rng, lead, N, T):
    lengths = rng.integers(1, T + 1, size=(*lead, N))
    mask = np.arange(T) < lengths[..., None]
    log_ratio = np.where(mask, rng.normal(scale=0.4, size=(*lead, N, T)), 0.0)
    return log_ratio, mask


@pytest.mark.parametrize("name", mappings.available())
def test_coefficients_with_leading_axes_equal_per_batch_calls(name):
    rng = np.random.default_rng(11)
    est = Estimator(name)
    log_ratio, mask = _ragged_batch(rng, (3,), 8, 5)
    adv = rng.normal(size=(3, 8))
    kw = {}
    if est.mapping.requires_log_prob:  # dppo, gepo: log π = log r + log 0.3
        kw = {"log_prob": log_ratio + np.log(0.3)}
    got = est.coefficients(log_ratio, mask, adv, **kw)
    for b in range(3):
        kw_b = {k: v[b] for k, v in kw.items()}
        expected = est.mapping.coefficients(log_ratio[b], mask[b], adv[b], **kw_b)
        np.testing.assert_allclose(got[b], expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize(("advantage", "G"), [("oracle", None), ("grpo", 4), ("rloo", 2)])
def test_token_weights_compose_coefficient_advantage_and_aggregation(aggregation, advantage, G):
    rng = np.random.default_rng(2)
    log_ratio, mask = _ragged_batch(rng, (2,), 8, 4)
    rewards = rng.integers(0, 2, size=(2, 8)).astype(float)
    est = Estimator("is_token", aggregation=aggregation, advantage=advantage, group_size=G)
    lam, c = est.token_weights(log_ratio, mask, rewards, J=0.4, return_coefficients=True)
    for b in range(2):
        A = _loop_advantages(rewards[b], advantage, J=0.4, G=G)
        inv_z = _loop_aggregation(mask[b], aggregation)
        c_b = np.where(mask[b], np.exp(log_ratio[b]), 0.0)  # token IS: c = r_t
        np.testing.assert_allclose(c[b], c_b, rtol=1e-14)
        np.testing.assert_allclose(lam[b], c_b * A[:, None] * inv_z, rtol=1e-12, atol=1e-15)


def test_token_weights_shape_errors():
    est = Estimator("naive")
    with pytest.raises(ValueError, match=r"rewards must have shape log_ratio.shape\[:-1\]"):
        est.token_weights(np.zeros((4, 1)), np.ones((4, 1), bool), np.zeros(3), J=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        est.coefficients(np.zeros((4, 1)), np.ones((4, 2), bool), np.zeros(4))


# --- on-policy: every on-policy-identity mapping is REINFORCE, unbiased ------------------


def _envs():
    logits = np.array([0.4, -0.3, 0.0, 0.9])
    return [
        Bandit(logits, np.array([0.1, 0.8, 0.5, 0.3])),
        Bandit(
            logits,
            np.array([-0.5, 1.0, 0.2, 0.0]),
            reward="gaussian",
            reward_std=np.array([0.5, 1.0, 1.5, 0.8]),
        ),
    ]


ON_POLICY_IDENTITY = [n for n in mappings.available() if mappings.get(n).on_policy_identity]


@pytest.mark.parametrize("name", ON_POLICY_IDENTITY)
def test_on_policy_oracle_estimator_is_exactly_unbiased(name):
    mapping = mappings.get(name)
    for env in _envs():
        if mapping.batch_dependent:
            # no exact path: on-policy the coefficients are all 1, so the estimate equals the
            # naive (REINFORCE) one on the same draws, whose exact mean is ∇J (checked below)
            batch = env.sample(env.pi, 16, np.random.default_rng(0), reps=20)
            g = Estimator(mapping).gradient(env, batch)
            g_naive = Estimator("naive").gradient(env, batch)
            np.testing.assert_allclose(g, g_naive, rtol=1e-12, atol=1e-15)
            mapping = mappings.get("naive")
        for agg in AGGREGATIONS:
            m = exact_moments(env, env.pi, Estimator(mapping, aggregation=agg), n=8)
            scale = 8 if agg == "token-sum" else 1  # Z = 1: the sum of n = 8 unbiased terms
            np.testing.assert_allclose(m.mean, scale * env.grad_J(), rtol=0, atol=1e-12)
