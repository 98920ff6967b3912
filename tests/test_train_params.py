"""simkit.train parameterisations (issue 16 §1): tabular bit for bit, tied and features exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkit.envs import TokenMDP
from simkit.train import Mismatch, TrainConfig, policy_logits, train
from simkit.train.params import parameterization
from simkit.train.recipes import RECIPES, recipe

REFERENCE = Path(__file__).parent / "data" / "train_tabular_reference.parquet"
PARAMS = ("tabular", "tied", "features")


def reference_cases():
    """The runs of ``tests/data/make_train_reference.py`` (tables saved before the
    parameterisations existed)."""
    env = TokenMDP.at_least_k(V=4, T=6, k=2, seed=1, scale=0.5)
    env_eos = TokenMDP.at_least_k(V=4, T=6, k=2, eos=3, seed=1, scale=0.5)
    yield (
        "grpo_N4_lag2",
        env,
        dict(estimator=recipe("grpo", 4), steps=24, batch=32, minibatches=4, lag=2, lr=0.3),
        dict(record_every=3),
    )
    yield (
        "vespo_eos_mism",
        env_eos,
        dict(estimator=recipe("vespo", 4), steps=16, batch=16, minibatches=2, lag=1, lr=0.1),
        dict(
            mismatch=Mismatch(
                logit_noise=0.1, precision="bf16", spike_prob=0.2, spike_strength=4.0
            ),
            max_grad_norm=1.0,
        ),
    )
    yield (
        "tis_sgd_exact",
        env,
        dict(estimator=recipe("tis", 4), steps=10, batch=8, optimizer="sgd", lr=0.5),
        dict(gradient="exact"),
    )
    yield (
        "mis_N2",
        env_eos,
        dict(estimator=recipe("mis", 4), steps=12, batch=16, minibatches=2, lr=0.2),
        {},
    )


def test_tabular_reproduces_the_reference_tables_bit_for_bit():
    ref = pd.read_parquet(REFERENCE)
    for name, env, kw, extra in reference_cases():
        table = train(env, TrainConfig(**kw, **extra, parameterization="tabular"), seed=5)
        expected = ref[ref["case"] == name].drop(columns="case").reset_index(drop=True)
        assert len(expected) == len(table), name
        for col in expected.columns:  # every column the trainer had then
            # bit for bit on the CPU type that wrote the reference; to rounding elsewhere
            # (numpy's SIMD exp/log/sums depend on the CPU; see tests/test_config_reference.py)
            exact = not pd.api.types.is_float_dtype(expected[col])
            pd.testing.assert_series_equal(
                table[col],
                expected[col],
                check_exact=exact,
                rtol=1e-9,
                atol=1e-12,
                check_names=False,
                obj=col,
            )


def small_env(eos=None):
    return TokenMDP.at_least_k(V=4, T=5, k=2, eos=eos, seed=2, scale=0.7)


def config(kind, **kw):
    base = dict(steps=6, batch=8, lr=0.1, parameterization=kind, features=8, feature_rank=2)
    base.update(kw)
    return TrainConfig(**base)


def exact_J(env, cfg, theta):
    return env.with_logits(policy_logits(env, cfg, theta)).J()


@pytest.mark.parametrize("eos", [None, 3])
@pytest.mark.parametrize("kind", ["tied", "features"])
def test_grad_J_equals_finite_differences_of_exact_J(kind, eos):
    env = small_env(eos)
    cfg = config(kind)
    param = cfg.parameterization_of(env)
    rng = np.random.default_rng(0)
    theta = rng.normal(scale=0.8, size=param.shape)
    env_theta = env.with_logits(param.logits(theta))
    grad = param.pullback(env_theta.grad_J())
    assert grad.shape == (param.dim,)
    h = 1e-5
    fd = np.empty(param.dim)
    for i in range(param.dim):
        e = np.zeros(param.dim)
        e[i] = h
        e = e.reshape(param.shape)
        fd[i] = (exact_J(env, cfg, theta + e) - exact_J(env, cfg, theta - e)) / (2 * h)
    assert np.abs(grad).max() > 1e-3  # not vacuous
    np.testing.assert_allclose(grad, fd, rtol=0, atol=1e-6)


def enumerated_J(env, logits):
    env_l = env.with_logits(logits)
    support = env_l.support(env_l.pi)
    return float(support.prob @ support.rewards)


@pytest.mark.parametrize("eos", [None, 3])
@pytest.mark.parametrize("kind", ["tied", "features"])
def test_logged_J_equals_enumeration_of_the_logged_policy(kind, eos):
    env = small_env(eos)
    cfg = config(kind, steps=12, batch=16, minibatches=2, lag=1, lr=0.3)
    thetas = {}
    table = train(env, cfg, seed=1, callback=lambda s, th: thetas.__setitem__(s, th.copy()))
    assert thetas[0].shape == cfg.parameterization_of(env).shape
    assert table["J"].iloc[-1] != table["J"].iloc[0]
    for s in (0, 5, 11):
        logits = policy_logits(env, cfg, thetas[s])
        assert abs(table["J"].iloc[s] - enumerated_J(env, logits)) < 1e-12
        env_l = env.with_logits(logits)
        support = env_l.support(env_l.pi)
        length = float(support.prob @ support.lengths)
        assert abs(table["length"].iloc[s] - length) < 1e-12


def test_tied_update_moves_every_position_and_tabular_only_visited_rows():
    env = small_env()
    for kind in PARAMS:
        cfg = config(kind, steps=2, batch=8)
        thetas = []
        train(env, cfg, seed=0, callback=lambda s, th, out=thetas: out.append(th.copy()))
        L0, L1 = (policy_logits(env, cfg, th) for th in thetas)
        moved = np.abs(L1 - L0).max(axis=-1) > 0  # (T, P)
        if kind == "tabular":
            # class 2 (k reached) is unreachable at t = 0, 1: its rows never move
            assert not moved[:2, 2].any()
        else:
            assert moved.all(), kind  # shared parameters move unvisited (t, p) too
        if kind == "tied":
            np.testing.assert_allclose((L1 - L0)[0], (L1 - L0)[-1], atol=1e-15)


@pytest.mark.parametrize("eos", [None, 3])
def test_on_policy_every_parameterization_is_reinforce_and_recipes_coincide(eos):
    """N = 1, no lag, no mismatch: log π − log μ = 0.0 exactly, every recipe's coefficients
    are 1, and recipes with the same aggregation give the same table bit for bit (token-mean
    vs seq-mean-token-mean: the same weights computed in another order, equal to rounding
    without EOS)."""
    env = small_env(eos)
    for kind in PARAMS:
        tables = {
            r: train(env, config(kind, estimator=recipe(r, 4), steps=8, lr=0.2), seed=4)
            for r in RECIPES
        }
        ref = tables["naive"]
        assert (ref["max_abs_log_ratio"] == 0).all()
        assert ref["J"].iloc[-1] != ref["J"].iloc[0]
        cols = [c for c in ref.columns if c != "estimator"]
        for r, t in tables.items():
            assert (t["coef_mean"] == 1.0).all(), (kind, r)
            if RECIPES[r].aggregation == RECIPES["naive"].aggregation:
                assert t[cols].equals(ref[cols]), (kind, r)
            elif eos is None:
                np.testing.assert_allclose(t["J"], ref["J"], rtol=1e-12)


def test_parameterizations_differ_off_policy_start_equal():
    env = small_env()
    tables = [train(env, config(k, steps=6, lr=0.3), seed=0) for k in PARAMS]
    for t in tables[1:]:
        assert t["J"].iloc[0] == tables[0]["J"].iloc[0]  # same π₀
        assert t["J"].iloc[-1] != tables[0]["J"].iloc[-1]


def test_features_map_is_documented_low_rank():
    env = small_env()
    p = parameterization(env.logits, "features", features=8, feature_rank=2, feature_seed=3)
    rng = np.random.default_rng(3)
    X = rng.standard_normal((env.T * env.P, 4)) / 2.0
    E = rng.standard_normal((env.V, 2))
    np.testing.assert_array_equal(p.context, X)
    np.testing.assert_array_equal(p.tokens, E)
    W = np.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(p.logits(W), env.logits + (X @ W @ E.T).reshape(env.logits.shape))


def test_resume_with_shared_parameters(tmp_path):
    env = small_env(3)
    cfg = config("features", steps=10, batch=8, minibatches=2, lag=1)
    full = train(env, cfg, seed=2)
    train(env, cfg, seed=2, out_dir=tmp_path, chunk_steps=3, stop_after=5)
    resumed = train(env, cfg, seed=2, out_dir=tmp_path, chunk_steps=3)
    pd.testing.assert_frame_equal(resumed, full)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(parameterization="dense"), "parameterization must be one of"),
        (dict(parameterization="features", features=10, feature_rank=4), "multiple of"),
        (dict(features=0), "features must be an integer >= 1"),
    ],
)
def test_parameterization_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_config_round_trip():
    cfg = config("features", feature_seed=4)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_training_sweep_carries_the_parameterization():
    from simkit.config import ConfigError, TrainSweepConfig

    d = {
        "kind": "train",
        "name": "p",
        "steps": 4,
        "minibatch_size": 8,
        "parameterization": "features",
        "features": 8,
        "feature_rank": 2,
        "environment": {"kind": "token_mdp", "constructor": "at_least_k", "V": 4, "T": 5,
                        "kwargs": {"k": 2}},
        "estimators": [{"mapping": "ppo_clip", "advantages": ["grpo"], "group_size": 4}],
    }  # fmt: skip
    sweep = TrainSweepConfig.from_dict(d)
    assert TrainSweepConfig.from_dict(sweep.to_dict()) == sweep
    (_, cfg, _), *_ = list(sweep.runs())
    assert (cfg.parameterization, cfg.features, cfg.feature_rank) == ("features", 8, 2)
    with pytest.raises(ConfigError, match="parameterization"):
        TrainSweepConfig.from_dict({**d, "parameterization": "dense"})
    with pytest.raises(ConfigError, match="features"):
        TrainSweepConfig.from_dict({**d, "features": 9})


def test_cli_parameterization_and_growing_mismatch(capsys):
    from simkit.cli import main

    rc = main(
        ["train", "--recipe", "grpo", "--N", "2", "--steps", "4", "--parameterization", "tied",
         "--relative-noise", "0.1", "--sharpness-noise", "0.2", "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "relative noise 0.1 + sharpness noise 0.2" in out and "failure label" in out
    argv = ["train", "--parameterization", "features", "--features", "10", "--feature-rank", "4"]
    assert main(argv) == 2
    assert "--features = 10 must be a multiple" in capsys.readouterr().err
