"""Ensembles of random instances (simkit.experiment.ensemble) and their random-instance
factories (simkit.envs.random_instances)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from simkit import divergence, experiment
from simkit.envs import Bandit, TokenMDP
from simkit.envs import random_instances as ri
from simkit.envs.behaviour import sequence_divergence
from simkit.experiment.ensemble import ensemble, instance_seeds, summarize

ESTS = ["naive", "is_seq", "tis_seq", "vespo"]


def small_ensemble(seed=0, instances=4, **kw):
    return ensemble(
        ri.bandit_factory(6),
        ri.behaviour_factory(0.5),
        ESTS,
        n=8,
        instances=instances,
        seed=seed,
        reps=4,
        n_boot=10,
        **kw,
    )


# --- ensemble ---------------------------------------------------------------------------------


def test_ensemble_is_reproducible_from_its_seed():
    a, b = small_ensemble(seed=3), small_ensemble(seed=3)
    pd.testing.assert_frame_equal(a, b)
    c = small_ensemble(seed=4)
    assert not np.allclose(a.mse.to_numpy(), c.mse.to_numpy())


def test_ensemble_instance_column_and_every_run_column():
    table = small_ensemble(instances=3)
    assert list(table.columns[:2]) == ["instance", "run_seed"]
    assert table.instance.tolist() == [i for i in range(3) for _ in ESTS]
    # instance i is exactly run() on the env/behaviour drawn from its own streams
    for i, (env_ss, beh_ss, run_seed) in enumerate(instance_seeds(0, 3)):
        env = ri.random_bandit(np.random.default_rng(env_ss), 6)
        mu = ri.random_behaviour(env, np.random.default_rng(beh_ss), 0.5)
        alone = experiment.run(env, mu, ESTS, 8, reps=4, seed=run_seed, n_boot=10)
        part = table[table.instance == i].drop(columns=["instance", "run_seed"])
        pd.testing.assert_frame_equal(part.reset_index(drop=True), alone)
        assert (table.run_seed[table.instance == i] == run_seed).all()


def test_ensemble_instances_do_not_depend_on_how_many_follow():
    three, five = small_ensemble(instances=3), small_ensemble(instances=5)
    pd.testing.assert_frame_equal(three, five[five.instance < 3].reset_index(drop=True))
    # the instances differ from each other (their own env streams)
    np.testing.assert_allclose(five.chi2_tok, 0.5, rtol=1e-8)  # all dialed to 0.5
    assert five.groupby("instance").mse.first().nunique() == 5


def test_ensemble_passes_run_kwargs():
    table = small_ensemble(instances=2, setting={"label": "x"}, exact=False)
    assert (table.label == "x").all() and not table.exact.any()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"instances": 0}, "instances"),
        ({"instances": 2.5}, "instances"),
        ({"make_env": 3}, "make_env"),
        ({"make_behaviour": "temperature"}, "make_behaviour"),
        ({"n": 0}, "n"),
        ({"seed": -1}, "seed"),
    ],
)
def test_ensemble_bad_input(kwargs, name):
    args = {
        "make_env": ri.bandit_factory(4),
        "make_behaviour": ri.behaviour_factory(0.5),
        "estimators": ["naive"],
        "n": 4,
        **kwargs,
    }
    with pytest.raises(ValueError, match=name):
        ensemble(**args)


def test_ensemble_refuses_its_own_run_arguments():
    with pytest.raises(ValueError, match="behaviour"):
        ensemble(ri.bandit_factory(4), ri.behaviour_factory(0.5), ["naive"], 4, behaviour=None)


# --- summarize --------------------------------------------------------------------------------

#: a made-up ensemble table: 5 instances × 3 estimators, with a tie and a NaN
MADE_UP = {
    "a": [1.0, 2.0, 3.0, 4.0, 0.5],
    "b": [2.0, 2.0, 1.0, 5.0, 0.1],
    "c": [3.0, 1.0, np.nan, 6.0, 0.2],
}


def made_up_table():
    rows = [
        {"instance": i, "estimator": name, "err": v}
        for name, values in MADE_UP.items()
        for i, v in enumerate(values)
    ]
    return pd.DataFrame(rows).sample(frac=1.0, random_state=0)  # order must not matter


def test_summarize_fractions_equal_a_hand_count():
    s = summarize(made_up_table(), "err")
    # a vs b: a < b at instances 0, 3; tie at 1; a > b at 2, 4
    ab = s.pair("a", "b")
    assert (ab.wins, ab.ties, ab.losses, ab.instances) == (2, 1, 2, 5)
    assert ab.fraction == pytest.approx(2 / 5) and ab.fraction_ties_half == pytest.approx(2.5 / 5)
    ba = s.pair("b", "a")
    assert (ba.wins, ba.ties, ba.losses) == (2, 1, 2)
    # a vs c: instance 2 has no c; a < c at 0, 3; a > c at 1, 4
    ac = s.pair("a", "c")
    assert (ac.wins, ac.ties, ac.losses, ac.instances) == (2, 0, 2, 4)
    # b vs c: b < c at 0, 3, 4; b > c at 1
    assert (s.pair("b", "c").wins, s.pair("c", "b").wins) == (3, 1)
    assert s.beats("b", "c") == "b beats c in 3/4 instances"
    assert s.beats("a", "b") == "a beats b in 2/5 instances (1 tie)"
    assert len(s.pairs) == 6
    # best of all three (strictly), on the 4 instances where all are finite: 0 → a, 1 → c,
    # 3 → a, 4 → b
    assert s.best_fraction("a") == (2, 4)
    assert s.best_fraction("b") == (1, 4) and s.best_fraction("c") == (1, 4)
    assert s.worst_fraction("c") == (2, 4)  # 0 and 3


def test_summarize_tie_tolerance():
    table = pd.DataFrame(
        {
            "instance": [0, 0, 0, 1, 1, 1],
            "estimator": list("xyz") * 2,
            "err": [1.0, 1.0005, 2.0, 1.0, 0.9, 2.0],
        }
    )
    exact, loose = summarize(table, "err"), summarize(table, "err", tie_rtol=1e-3)
    assert (exact.pair("x", "y").wins, exact.pair("x", "y").ties) == (1, 0)
    assert (loose.pair("x", "y").wins, loose.pair("x", "y").ties) == (0, 1)
    assert exact.best_fraction("x") == (1, 2) and loose.best_fraction("x") == (0, 2)
    assert loose.best_fraction("y") == (1, 2)  # instance 1: 0.9 vs 1.0, beyond 0.1 %
    with pytest.raises(ValueError, match="tie_rtol"):
        summarize(table, "err", tie_rtol=-0.1)


def test_summarize_higher_is_better_reverses_the_count():
    s = summarize(made_up_table(), "err", lower_is_better=False)
    assert (s.pair("b", "c").wins, s.pair("c", "b").wins) == (1, 3)
    assert s.best_fraction("c") == (2, 4)


def test_summarize_quantiles_equal_numpy():
    s = summarize(made_up_table(), "err")
    for name, values in MADE_UP.items():
        v = np.asarray(values)
        v = v[np.isfinite(v)]
        row = s.stats.loc[name]
        assert row["median"] == np.median(v)
        assert row.q25 == np.quantile(v, 0.25) and row.q75 == np.quantile(v, 0.75)
        assert row.iqr == pytest.approx(np.quantile(v, 0.75) - np.quantile(v, 0.25))
        assert row.instances == len(v)
    assert list(s.stats.index) == list(dict.fromkeys(made_up_table().estimator))


def test_summarize_on_a_real_ensemble():
    table = small_ensemble(instances=5)
    s = summarize(table, "mse")
    for name in ESTS:
        v = table.mse[table.estimator == name].to_numpy()
        assert s.stats.loc[name, "median"] == pytest.approx(np.median(v), rel=1e-15)
    for _, row in s.pairs.iterrows():
        assert row.wins + row.ties + row.losses == row.instances == 5


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"metric": "nope"}, "metric"),
        ({"by": "nope"}, "by"),
        ({"lower_is_better": "yes"}, "lower_is_better"),
        ({"table": [1, 2]}, "table"),
    ],
)
def test_summarize_bad_input(kwargs, name):
    args = {"table": made_up_table(), "metric": "err", **kwargs}
    with pytest.raises(ValueError, match=name):
        summarize(**args)


def test_summarize_refuses_several_rows_per_instance():
    table = pd.concat([made_up_table(), made_up_table()])
    with pytest.raises(ValueError, match="several rows"):
        summarize(table, "err")
    with pytest.raises(ValueError, match="instance"):
        summarize(made_up_table().drop(columns="instance"), "err")
    with pytest.raises(ValueError, match="no pair"):
        summarize(made_up_table(), "err").pair("a", "zz")


# --- random instances -------------------------------------------------------------------------


def test_random_bandit_draws_from_its_rng():
    a = ri.random_bandit(np.random.default_rng(5), 7, logit_scale=2.0)
    rng = np.random.default_rng(5)
    logits, means = 2.0 * rng.standard_normal(7), rng.uniform(0.05, 0.95, 7)
    np.testing.assert_array_equal(a.logits, logits)
    np.testing.assert_array_equal(a.means, means)
    g = ri.random_bandit(np.random.default_rng(5), 7, reward="gaussian", reward_std=0.5)
    assert g.reward == "gaussian" and np.all(g.reward_std == 0.5)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"arms": 1}, "arms"),
        ({"reward": "poisson"}, "reward"),
        ({"logit_scale": -1.0}, "logit_scale"),
        ({"mean_low": 0.9, "mean_high": 0.1}, "mean_low"),
        ({"mean_high": 1.5}, "Bernoulli"),
        ({"reward": "gaussian", "reward_std": 0.0}, "reward_std"),
    ],
)
def test_bandit_factory_bad_options(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ri.bandit_factory(**kwargs)


def test_random_token_mdp_uses_a_drawn_seed():
    env = ri.random_token_mdp(np.random.default_rng(1), "at_least_k", V=3, T=4, k=2)
    seed = int(np.random.default_rng(1).integers(ri.SEED_HIGH))
    same = TokenMDP.at_least_k(V=3, T=4, k=2, seed=seed)
    np.testing.assert_array_equal(env.pi, same.pi)
    make = ri.token_mdp_factory("parity", V=3, T=3, scale=2.0)
    a, b = make(np.random.default_rng(0)), make(np.random.default_rng(1))
    assert not np.allclose(a.pi, b.pi)
    with pytest.raises(ValueError, match="kind"):
        ri.token_mdp_factory("maze")
    with pytest.raises(ValueError, match="seed"):
        ri.token_mdp_factory("iid", seed=3)


@pytest.mark.parametrize("family", ["logit_noise", "temperature", "tilt", "tail", "toxic_tail"])
def test_random_behaviour_on_a_bandit_hits_the_target(family):
    env = ri.random_bandit(np.random.default_rng(0), 8)
    make = ri.behaviour_factory(0.01, "chi2", family)
    mus = [make(env, np.random.default_rng(s)) for s in range(4)]
    for mu in mus:
        assert divergence.chi2(env.pi, mu) == pytest.approx(0.01, rel=1e-6)
    if family in ("logit_noise", "tilt"):  # a random direction
        assert not np.allclose(mus[0], mus[1])


def test_random_behaviour_target_range_is_log_uniform():
    env = ri.random_bandit(np.random.default_rng(0), 8)
    make = ri.behaviour_factory((1e-4, 1e-2), "kl")
    got = [divergence.kl(env.pi, make(env, np.random.default_rng(s))) for s in range(40)]
    assert min(got) >= 1e-4 * (1 - 1e-6) and max(got) <= 1e-2 * (1 + 1e-6)
    logs = np.log10(got)  # log-uniform on [-4, -2]: mean -3, sd 0.577
    assert abs(logs.mean() + 3) <= 4 * 0.577 / math.sqrt(40)


def test_random_behaviour_on_token_mdps():
    env = ri.random_token_mdp(np.random.default_rng(0), "answer_correct", V=4, T=4)
    mu = ri.behaviour_factory(0.01)(env, np.random.default_rng(0))
    np.testing.assert_allclose(divergence.chi2(env.pi, mu), 0.01, rtol=1e-6)
    seq = ri.behaviour_factory(0.5, family="toxic_tail", level="sequence")
    mu = seq(env, np.random.default_rng(0))
    assert sequence_divergence(env, mu) == pytest.approx(0.5, rel=1e-5)
    conc = ri.behaviour_factory(0.5, family="concentrated", level="sequence", fraction=0.3)
    a, b = conc(env, np.random.default_rng(0)), conc(env, np.random.default_rng(1))
    for mu in (a, b):
        assert sequence_divergence(env, mu) == pytest.approx(0.5, rel=1e-5)
        untouched = np.all(np.isclose(mu, env.pi), axis=-1)
        assert untouched.any() and not untouched.all()  # only some rows shifted
    assert not np.allclose(a, b)


def test_behaviour_factory_bad_input():
    with pytest.raises(ValueError, match="target"):
        ri.behaviour_factory(-1.0)
    with pytest.raises(ValueError, match="target"):
        ri.behaviour_factory((0.1, 0.01))
    with pytest.raises(ValueError, match="divergence"):
        ri.behaviour_factory(0.1, "hellinger")
    with pytest.raises(ValueError, match="family"):
        ri.behaviour_factory(0.1, family="warp")
    with pytest.raises(ValueError, match="level"):
        ri.behaviour_factory(0.1, level="batch")
    env = Bandit(logits=np.zeros(4), means=np.full(4, 0.5))
    with pytest.raises(ValueError, match="concentrated"):
        ri.behaviour_factory(0.1, family="concentrated")(env, np.random.default_rng(0))
    with pytest.raises(ValueError, match="rng"):
        ri.random_behaviour(env, 0, 0.1)
