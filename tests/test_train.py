"""simkit.train: the training-dynamics simulator (issue 7)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simkit import mappings
from simkit.envs import TokenMDP
from simkit.estimators import Estimator
from simkit.shifts import get as get_shift
from simkit.train import (
    COLUMNS,
    Adam,
    Mismatch,
    TrainConfig,
    TrainError,
    behaviour_log_probs,
    load_checkpoint,
    load_run,
    log_softmax,
    round_bf16,
    round_fp16,
    train,
)

NON_NAME = [c for c in COLUMNS if c != "estimator"]


def small_env(eos=None) -> TokenMDP:
    return TokenMDP.at_least_k(V=4, T=6, k=2, eos=eos, seed=1, scale=0.5)


def grpo(name: str, **hp) -> Estimator:
    return Estimator(mappings.get(name, **hp), advantage="grpo", group_size=4)


# --- N = 1, no lag, no mismatch: every mapping is on-policy REINFORCE ---------------------------

#: mappings whose on-policy learning curve is NOT bit-identical to REINFORCE, with the reason.
#: (Found by running the loop below: every other registered mapping matches exactly.)
ON_POLICY_EXCEPTIONS = {
    "psis": "its coefficients are n·softmax(log W) over the batch: with all log W = 0 that is "
    "n·(1/n), which rounds to 1 ± 1 ulp for some n (e.g. n = 8, not n = 16): the curve "
    "matches REINFORCE to rounding, not bit for bit",
}


NOT_ON_POLICY_IDENTITY = {"luspo", "gepo"}


@pytest.mark.parametrize("eos", [None, 3])
def test_on_policy_every_mapping_is_reinforce_bit_for_bit(eos):
    env = small_env(eos)

    def run(name, aggregation="token-mean"):
        est = Estimator(name, aggregation=aggregation, advantage="grpo", group_size=4)
        cfg = TrainConfig(est, steps=12, batch=8, minibatches=1, lr=0.1, record_every=4)
        return train(env, cfg, seed=3)

    reference = run("naive")
    assert reference["J"].dropna().iloc[-1] != reference["J"].iloc[0]  # it does learn
    mismatched = []
    for name in mappings.available():
        if not mappings.mapping_class(name).on_policy_identity:
            # luspo (c = |y|), gepo (c = π(y)/Ê[π]): documented non-unit on-policy weights,
            # checked in closed form in tests/test_mappings.py
            assert name in NOT_ON_POLICY_IDENTITY, name
            continue
        table = run(name)
        same = table[NON_NAME].equals(reference[NON_NAME])
        if name in ON_POLICY_EXCEPTIONS:
            assert np.allclose(table["J"], reference["J"], rtol=1e-9, equal_nan=True), name
            continue
        if not same:
            mismatched.append(name)
    assert mismatched == []
    # the equality is not vacuous: with a second aggregation the curves change
    other = run("naive", aggregation="seq-mean-token-sum")
    assert not other[NON_NAME].equals(reference[NON_NAME])


def test_on_policy_log_ratios_are_exactly_zero_whatever_the_logits_layout():
    """A constructor broadcasts stationary logits, leaving θ laid out with T fastest; log π and
    log μ must still be computed in the same order (regression: V = 8 gave |log r| = 4e-16)."""
    env = TokenMDP.at_least_k(V=8, T=12, k=3, seed=0)
    assert not env.logits.flags["C_CONTIGUOUS"]  # the layout that exposed it
    tables = [
        train(env, TrainConfig(grpo(n), steps=6, batch=16, lr=0.05), seed=0)
        for n in ("naive", "tis_token", "vespo")
    ]
    for table in tables:
        assert (table["max_abs_log_ratio"] == 0.0).all()
        assert table[NON_NAME].equals(tables[0][NON_NAME])
    theta = np.asarray(env.logits)
    np.testing.assert_array_equal(log_softmax(theta), log_softmax(np.ascontiguousarray(theta)))


def test_on_policy_exceptions_are_really_exceptions():
    env = small_env()
    runs = [
        train(env, TrainConfig(grpo(n), steps=12, batch=8, lr=0.1), seed=3)
        for n in ("naive", *ON_POLICY_EXCEPTIONS)
    ]
    for table in runs[1:]:
        assert not table[NON_NAME].equals(runs[0][NON_NAME])


def test_staleness_makes_mappings_differ():
    env = small_env()
    tables = [
        train(env, TrainConfig(grpo(n), steps=16, batch=32, minibatches=8, lr=0.3), seed=0)
        for n in ("naive", "ppo_clip", "vespo")
    ]
    assert not tables[0]["J"].equals(tables[1]["J"])
    assert not tables[1]["J"].equals(tables[2]["J"])
    # mini-batch 0 of a rollout is on-policy, later ones are not
    t = tables[1]
    assert (t.loc[t.minibatch == 0, "max_abs_log_ratio"] == 0).all()
    assert (t.loc[t.minibatch > 0, "max_abs_log_ratio"] > 0).all()


# --- exact-gradient mode -------------------------------------------------------------------------


def enumerated_J(env: TokenMDP, theta: np.ndarray) -> float:
    """J(π_θ) by enumerating every sequence (independent of the DP)."""
    env_theta = env.with_logits(theta)
    support = env_theta.support(env_theta.pi)
    return float(support.prob @ support.rewards)


@pytest.mark.parametrize("eos", [None, 3])
def test_exact_gradient_ascent_is_monotone_and_J_matches_enumeration(eos):
    env = small_env(eos)
    thetas = {}
    cfg = TrainConfig("naive", steps=30, batch=8, optimizer="sgd", lr=0.5, gradient="exact")
    table = train(env, cfg, seed=0, callback=lambda s, th: thetas.__setitem__(s, th.copy()))
    J = table["J"].to_numpy()
    assert table["recorded"].all()
    assert np.all(np.diff(J) > 0)  # strictly increasing for a small step
    for s in (0, 7, 29):
        assert abs(J[s] - enumerated_J(env, thetas[s])) < 1e-12
        # the recorded gradient norm is that of the logged policy's exact gradient
        g = env.with_logits(thetas[s]).grad_J()
        assert abs(table["grad_J_norm"].iloc[s] - np.linalg.norm(g)) < 1e-12
    # the update used is ∇J: the next θ is θ + lr ∇J
    g0 = env.with_logits(thetas[0]).grad_J().reshape(thetas[0].shape)
    np.testing.assert_allclose(thetas[1], thetas[0] + 0.5 * g0, rtol=0, atol=1e-14)


def test_adam_matches_its_formula():
    rng = np.random.default_rng(0)
    theta, opt = rng.normal(size=5), Adam(lr=0.1, beta1=0.8, beta2=0.9, eps=1e-3)
    state = opt.init(theta)
    m = v = np.zeros(5)
    th = theta.copy()
    for t in range(1, 4):
        g = rng.normal(size=5)
        theta, state = opt.step(theta, g, state)
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g**2
        th = th + 0.1 * (m / (1 - 0.8**t)) / (np.sqrt(v / (1 - 0.9**t)) + 1e-3)
        np.testing.assert_allclose(theta, th, rtol=1e-14)


# --- recorded divergences are those of π_s against the μ that generated its batch ----------------


def test_divergences_follow_minibatch_staleness_and_lag():
    env = small_env()
    thetas = {}
    N, lag = 2, 1
    cfg = TrainConfig(grpo("naive"), steps=10, batch=16, minibatches=N, lag=lag, lr=0.2)
    table = train(env, cfg, seed=5, callback=lambda s, th: thetas.__setitem__(s, th.copy()))
    for s in range(10):
        behaviour_step = max(s // N - lag, 0) * N  # θ at the start of rollout r − lag
        assert table["staleness"].iloc[s] == s - behaviour_step
        mu = np.exp(log_softmax(thetas[behaviour_step]))
        pi_env = env.with_logits(thetas[s])
        expected = pi_env.divergences_tok(mu)["chi2_tok"]
        assert abs(table["chi2_tok"].iloc[s] - expected) <= 1e-12 * max(1.0, expected)
        assert abs(table["kl_seq"].iloc[s] - pi_env.kl_seq(mu)) < 1e-12
    assert table["chi2_tok"].iloc[0] < 1e-12 and table["chi2_tok"].iloc[3] > 1e-6


def test_record_every_leaves_exact_columns_nan_in_between():
    env = small_env()
    table = train(env, TrainConfig(grpo("ppo_clip"), steps=11, batch=8, record_every=5), seed=0)
    assert table["recorded"].tolist() == [s % 5 == 0 or s == 10 for s in range(11)]
    assert table.loc[~table.recorded, "J"].isna().all()
    assert table.loc[table.recorded, "J"].notna().all()
    assert table["reward_mean"].notna().all()
    assert list(table.columns) == list(COLUMNS)


# --- reproducibility and resume ---------------------------------------------------------------


def mismatch_config(**kw) -> TrainConfig:
    base = dict(
        estimator=grpo("vespo"),
        steps=23,
        batch=16,
        minibatches=4,
        lag=1,
        lr=0.05,
        mismatch=Mismatch(logit_noise=0.05, precision="bf16", spike_prob=0.2, spike_strength=4.0),
        record_every=3,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_bit_reproducible_from_seed():
    env = small_env(eos=3)
    a = train(env, mismatch_config(), seed=11)
    b = train(env, mismatch_config(), seed=11)
    c = train(env, mismatch_config(), seed=12)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert not a["reward_mean"].equals(c["reward_mean"])


def test_interrupted_run_resumes_to_the_uninterrupted_table(tmp_path):
    env = small_env(eos=3)
    cfg = mismatch_config()
    memory = train(env, cfg, seed=4)
    whole = train(env, cfg, seed=4, out_dir=tmp_path / "whole", chunk_steps=5)
    pd.testing.assert_frame_equal(whole, memory, check_exact=True)
    part = tmp_path / "part"
    first = train(env, cfg, seed=4, out_dir=part, chunk_steps=5, stop_after=10)  # mid-rollout
    assert len(first) == 10 and load_checkpoint(part)[0] == 10
    resumed = train(env, cfg, seed=4, out_dir=part, chunk_steps=5)
    pd.testing.assert_frame_equal(resumed, whole, check_exact=True)
    again = train(env, cfg, seed=4, out_dir=part)  # finished: nothing to do
    pd.testing.assert_frame_equal(again, whole, check_exact=True)


def test_killed_process_resumes(tmp_path):
    """A process killed hard (os._exit in the middle of step 13, after the chunk of steps 5–9
    was checkpointed) resumes to the uninterrupted table."""
    out = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import os
        from simkit.envs import TokenMDP
        from tests.test_train import mismatch_config, small_env
        from simkit.train import train

        def die(step, theta):
            if step == 13:
                os._exit(17)

        train(small_env(eos=3), mismatch_config(), seed=4, out_dir={str(out)!r},
              chunk_steps=5, callback=die)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(_repo_root()), check=False)
    assert proc.returncode == 17
    assert load_checkpoint(out)[0] == 10
    assert len(load_run(out)) == 10
    env = small_env(eos=3)
    resumed = train(env, mismatch_config(), seed=4, out_dir=out, chunk_steps=5)
    pd.testing.assert_frame_equal(resumed, train(env, mismatch_config(), seed=4), check_exact=True)


def _repo_root():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


def test_resume_refuses_another_run(tmp_path):
    env = small_env()
    cfg = TrainConfig(grpo("naive"), steps=4, batch=8)
    train(env, cfg, seed=0, out_dir=tmp_path / "r")
    with pytest.raises(TrainError, match=r"another training run.*seed"):
        train(env, cfg, seed=1, out_dir=tmp_path / "r")
    with pytest.raises(TrainError, match="config"):
        train(env, TrainConfig(grpo("naive"), steps=5, batch=8), seed=0, out_dir=tmp_path / "r")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(TrainError, match="not empty"):
        train(env, cfg, seed=0, out_dir=tmp_path / "other")


# --- configuration errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch": 10, "minibatches": 4}, "multiple of minibatches"),
        (
            {"estimator": Estimator("naive", advantage="grpo", group_size=3), "batch": 8},
            "not divisible by group_size",
        ),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"lag": -1}, "lag must be an integer >= 0"),
        ({"optimizer": "rmsprop"}, "optimizer must be one of"),
        ({"lr": -1.0}, "lr must be"),
        ({"gradient": "true"}, "gradient must be one of"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"estimator": "no_such_mapping"}, "unknown mapping"),
    ],
)
def test_config_errors_name_the_problem(kwargs, message):
    with pytest.raises((ValueError, KeyError), match=message):
        TrainConfig(**kwargs)


def test_mismatch_errors():
    with pytest.raises(ValueError, match="precision must be None or one of"):
        Mismatch(precision="int8")
    with pytest.raises(ValueError, match="spike_prob must be in"):
        Mismatch(spike_prob=1.5)
    with pytest.raises(ValueError, match="logit_noise must be finite and >= 0"):
        Mismatch(logit_noise=-0.1)
    with pytest.raises(ValueError, match="spike_tokens"):
        train(
            small_env(),
            TrainConfig(mismatch=Mismatch(spike_prob=0.5, spike_strength=1, spike_tokens=4)),
        )


# --- the mismatch model --------------------------------------------------------------------------


def test_round_bf16_known_values():
    # bf16 keeps 8 significant bits: spacing 2^-7 at 1. Ties go to the even neighbour.
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-7, -2.5, 3.0e-3, 0.0])
    expected = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.5, 0.0030059814453125, 0.0])
    np.testing.assert_array_equal(round_bf16(x), expected)
    with pytest.raises(ValueError, match="non-finite"):
        round_bf16([np.inf])


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False))
def test_rounding_error_is_within_half_an_ulp(x):
    # relative error ≤ 2^-8 (bf16: 8 significant bits) and ≤ 2^-11 (fp16), in the normal ranges
    # (bf16 shares float32's exponent range: normal from 2^-126; fp16 from 2^-14)
    if abs(x) >= 2**-126:
        assert abs(round_bf16(x) - x) <= 2**-8 * abs(x)
    if abs(x) >= 2**-14:
        assert abs(round_fp16(x) - x) <= 2**-11 * abs(x)
    assert round_bf16(round_bf16(x)) == round_bf16(x)  # idempotent


def test_behaviour_without_mismatch_is_exactly_log_softmax():
    theta = np.random.default_rng(0).normal(size=(3, 2, 5))
    np.testing.assert_array_equal(behaviour_log_probs(theta, Mismatch()), log_softmax(theta))


def test_behaviour_spikes_are_the_tail_family():
    theta = np.random.default_rng(1).normal(size=(3, 2, 5))
    mm = Mismatch(spike_prob=1.0, spike_strength=3.0, spike_tokens=2)
    log_mu = behaviour_log_probs(theta, mm, np.random.default_rng(0))
    pi = np.exp(log_softmax(theta))
    expected = get_shift("tail", n_tokens=2).apply(pi, 3.0)
    np.testing.assert_allclose(np.exp(log_mu), expected, rtol=1e-12)
    # the starved tokens get ratio π/μ > e^3·(1 − m) (heavy tail); the others < 1
    ratio = pi / np.exp(log_mu)
    assert ratio.max() > np.exp(3.0) * 0.5 and np.sort(ratio, axis=-1)[..., :3].max() < 1


def test_behaviour_noise_and_precision():
    theta = np.random.default_rng(2).normal(size=(4, 3, 6)) * 3
    for mm in (Mismatch(logit_noise=0.1), Mismatch(precision="bf16"), Mismatch(precision="fp16")):
        log_mu = behaviour_log_probs(theta, mm, np.random.default_rng(0))
        np.testing.assert_allclose(np.exp(log_mu).sum(-1), 1.0, rtol=1e-12)
        assert 0 < np.abs(log_mu - log_softmax(theta)).max() < (0.5 if mm.logit_noise else 0.05)
    # fp16 is closer to π than bf16 (3 more mantissa bits)
    err = {
        p: np.abs(behaviour_log_probs(theta, Mismatch(precision=p)) - log_softmax(theta)).max()
        for p in ("bf16", "fp16")
    }
    assert err["fp16"] < err["bf16"]
    with pytest.raises(TypeError, match="needs rng"):
        behaviour_log_probs(theta, Mismatch(logit_noise=0.1))


# --- lag in optimizer updates and the policy age (issue 23) -------------------------------------

#: policy age of steps 0..11 counted by hand: rollout r starts at step rN and is sampled from
#: θ_b, b = max(rN − L, 0); mini-batch j of it is updated by π_{rN+j}: age rN + j − b
HAND_AGES = {
    (1, 0): [0] * 12,
    (1, 3): [0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3],
    (4, 0): [0, 1, 2, 3] * 3,
    (4, 3): [0, 1, 2, 3, 3, 4, 5, 6, 3, 4, 5, 6],  # b = 0, 1, 5
}


@pytest.mark.parametrize(("N", "L"), list(HAND_AGES))
def test_policy_age_equals_a_hand_count(N, L):
    cfg = TrainConfig(grpo("ppo_clip"), steps=12, batch=4 * N, minibatches=N, lag_updates=L)
    t = train(small_env(), cfg, seed=0)
    for col in ("policy_age_min", "policy_age_max", "staleness"):
        assert t[col].tolist() == HAND_AGES[(N, L)], col
    assert t["policy_age_mean"].tolist() == [float(a) for a in HAND_AGES[(N, L)]]
    if L == 0:  # no lag: the age of mini-batch j is j
        assert (t["policy_age_max"] == t["minibatch"]).all()


def test_lag_updates_samples_from_theta_L_updates_before_the_rollout():
    """N = 2, L = 3: rollout r is drawn from θ_{max(2r − 3, 0)}; the exact KL(π_s‖μ) column is
    the KL between π_s and that θ's policy, computed here from the callback's parameters."""
    env = small_env()
    thetas = []
    cfg = TrainConfig(grpo("naive"), steps=10, batch=8, minibatches=2, lag_updates=3, lr=0.1)
    t = train(env, cfg, seed=2, callback=lambda s, th: thetas.append(np.array(th)))
    for s in range(10):
        b = max((s // 2) * 2 - 3, 0)
        mu = np.exp(log_softmax(thetas[b]))
        expected = env.with_logits(thetas[s]).kl_seq(mu)
        np.testing.assert_allclose(t["kl_seq"].iloc[s], expected, rtol=1e-12, atol=1e-15)


def test_rollout_lag_is_lag_updates_k_times_N():
    env = small_env()
    base = dict(steps=12, batch=12, minibatches=3, lr=0.1)
    a = train(env, TrainConfig(grpo("ppo_clip"), lag=2, **base), seed=1)
    b = train(env, TrainConfig(grpo("ppo_clip"), lag_updates=6, **base), seed=1)
    pd.testing.assert_frame_equal(a, b)
    with pytest.raises(ValueError, match="at most one of lag"):
        TrainConfig(grpo("ppo_clip"), lag=1, lag_updates=2, **base)
    with pytest.raises(ValueError, match=r"TrainConfig\.lag_updates"):
        TrainConfig(grpo("ppo_clip"), lag_updates=-1, **base)
