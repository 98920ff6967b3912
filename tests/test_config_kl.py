"""KL penalties from a sweep config (issue 24): the ``[ref]`` table (π_ref by a seeded logit
perturbation of π, or dialed to a target KL_seq) and the ``kl`` table of ``[[estimators]]``."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

from simkit import experiment
from simkit.config import ConfigError, SweepConfig, expand, run_cell, to_toml
from simkit.config.ref import RefConfig, noisy_reference
from simkit.estimators import Estimator
from simkit.kl import KLPenalty, kl_seq_and_grad


def kl_dict(ref=None) -> dict:
    return {
        "name": "kl",
        "seed": 2,
        "n": [4],
        "reps": 20,
        "n_boot": 50,
        "environment": {"kind": "token_mdp", "constructor": "markov", "V": 3, "T": [3], "seed": 1},
        "behaviour": {"family": "logit_noise", "divergence": "chi2", "targets": [0.0, 0.3]},
        "estimators": [
            {"mapping": "is_token", "aggregations": ["seq-mean-token-sum"]},
            {
                "mapping": "is_token",
                "aggregations": ["seq-mean-token-sum"],
                "kl": {"beta": 0.1, "estimator": "k3", "where": "loss", "correction": "is"},
            },
            {
                "mapping": "naive",
                "aggregations": ["seq-mean-token-sum"],
                "kl": {"beta": 0.2, "estimator": "k1", "where": "reward"},
            },
        ],
        "ref": {"noise": 0.5, "seed": 7} if ref is None else ref,
    }


def test_kl_config_round_trips_and_runs_as_run_with_ref():
    config = SweepConfig.from_dict(kl_dict()).validate()
    assert SweepConfig.from_dict(config.to_dict()) == config
    assert SweepConfig.from_dict(tomllib.loads(to_toml(config))) == config
    ests = [e for ec in config.estimators for e in ec.build()]
    assert ests[1].kl == KLPenalty(0.1, "k3", "loss", "is")
    assert ests[2].kl == KLPenalty(0.2, "k1", "reward")
    cells = expand(config)
    assert len(cells) == 2 and all(c.params["ref"] == {"noise": 0.5, "seed": 7} for c in cells)
    cell = cells[1]
    table = run_cell(cell)
    # the same table by hand: the environment, μ, π_ref = softmax(logits + 0.5·z), z seeded 7
    env = config.environment.build(3)
    mu = config.behaviour.build(env, 0.3)
    ref = noisy_reference(env, 0.5, 7)
    z = np.random.default_rng(7).standard_normal(env.logits.shape)
    np.testing.assert_array_equal(ref, env.with_logits(env.logits + 0.5 * z).pi)
    want = experiment.run(env, mu, ests, n=4, reps=20, seed=cell.run_seed, ref=ref, n_boot=50)
    for col in ("bias", "variance", "kl_bias", "kl_grad_norm", "kl_seq_ref"):
        np.testing.assert_allclose(table[col].to_numpy(), want[col].to_numpy(), rtol=1e-12)
    assert table["kl_estimator"].isna().tolist() == [True, False, False]
    assert table["kl_estimator"].tolist()[1:] == ["k3", "k1"]


def test_ref_dialed_to_a_target_kl():
    config = SweepConfig.from_dict(kl_dict({"kl": 0.05, "seed": 3}))
    env = config.environment.build(3)
    ref = config.ref.build(env)
    assert kl_seq_and_grad(env, ref)[0] == pytest.approx(0.05, rel=1e-10)
    # the bandit too
    from simkit.envs import Bandit

    bandit = Bandit(np.array([0.3, -1.0, 0.5, 2.0, 0.0]), np.array([0.1, 0.9, 0.4, 0.2, 0.6]))
    ref_b = RefConfig(kl=0.2, seed=1).build(bandit)
    assert kl_seq_and_grad(bandit, ref_b)[0] == pytest.approx(0.2, rel=1e-10)


def test_bad_kl_configs_name_the_key():
    d = kl_dict()
    del d["ref"]
    with pytest.raises(ConfigError, match=r"estimators\[1\]\.kl.*\[ref\]"):
        SweepConfig.from_dict(d)
    with pytest.raises(ConfigError, match="exactly one of noise"):
        SweepConfig.from_dict(kl_dict({"noise": 0.5, "kl": 0.1}))
    bad = kl_dict()
    bad["estimators"][1]["kl"]["estimator"] = "k4"
    with pytest.raises(ConfigError, match=r"estimators\[1\]\.kl\.estimator"):
        SweepConfig.from_dict(bad)
    bad = kl_dict()
    bad["estimators"][1]["kl"]["beta"] = 0.0
    with pytest.raises(ConfigError, match=r"estimators\[1\]\.kl\.beta"):
        SweepConfig.from_dict(bad)
    with pytest.raises(ConfigError, match=r"ref .*out of reach"):
        SweepConfig.from_dict(kl_dict({"kl": 1e6})).validate()


def test_without_ref_the_cells_are_those_of_before():
    d = kl_dict()
    del d["ref"]
    d["estimators"] = d["estimators"][:1]
    assert all("ref" not in c.params for c in expand(SweepConfig.from_dict(d)))
    assert Estimator("is_token", "seq-mean-token-sum").kl is None
