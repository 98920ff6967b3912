"""Composed estimators (three policies, issue 15) in sweep configs: the ``correction``,
``correction_preset``, ``correction_params``, ``mode``, ``denominator`` and ``seed`` keys of an
``[[estimators]]`` entry, the spec round trip of :mod:`simkit.estimator_specs`, and the
``old`` table of the behaviour section (π_old for experiment sweeps)."""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path

import jsonschema
import numpy as np
import pandas as pd
import pytest

from simkit import composition, experiment, mappings, shifts
from simkit.cli import main
from simkit.config import ConfigError, SweepConfig, expand, run_cell, to_toml, validate
from simkit.envs import Bandit
from simkit.estimator_specs import build_estimators, estimator_params
from simkit.estimators import Estimator

ROOT = Path(__file__).resolve().parents[1]


def bandit_dict(estimators: list[dict]) -> dict:
    return {
        "name": "composed",
        "seed": 5,
        "n": [16],
        "reps": 40,
        "n_boot": 50,
        "environment": {"kind": "bandit", "K": 5, "seed": 2},
        "behaviour": {"family": "logit_noise", "targets": [0.1]},
        "estimators": estimators,
    }


COMPOSED = [
    Estimator("ppo_clip", correction="tis_token"),
    Estimator(
        "ppo_clip",
        correction=mappings.get("mis_seq", preset="trl"),
        mode="bypass",
        allow_same_ratio=True,  # the double count is refused unless asked for (issue 23)
    ),
    Estimator("ppo_clip", correction="tis_token", denominator="kept"),
    Estimator("vespo", correction="tis_token", mode="trl_vespo"),
    Estimator("clip_cov", correction="icepop", seed=3),
    Estimator("ppo_clip", mode="bypass"),
    Estimator("tis_token", aggregation="seq-mean-token-sum"),
]


@pytest.mark.parametrize("est", COMPOSED, ids=lambda e: e.name + "/" + e.mode)
def test_estimator_specs_round_trip_composed_estimators(est):
    spec = estimator_params(est)
    again = build_estimators([json.loads(json.dumps(spec))])[0]
    assert again == est
    assert again.name == est.name
    assert estimator_params(again) == spec


def test_single_ratio_specs_carry_no_composition_keys():
    spec = estimator_params(Estimator("ppo_clip"))
    assert not {"correction", "mode", "denominator", "seed"} & set(spec)


# --- [[estimators]] keys ----------------------------------------------------------------------


def test_composed_entries_build_the_composed_estimators_and_round_trip():
    entries = [
        {"mapping": "ppo_clip", "correction": "tis_token", "correction_params": {"c_high": 3}},
        {
            "mapping": "ppo_clip",
            "correction": "mis_seq",
            "correction_preset": "trl",
            "mode": "bypass",
            "denominator": "kept",
            "allow_same_ratio": True,
        },
        {"mapping": "vespo", "correction": "tis_token", "mode": "trl_vespo"},
        {"mapping": "clip_cov", "correction": "icepop", "seed": 3},
    ]
    config = SweepConfig.from_dict(bandit_dict(entries))
    built = [e for ec in config.estimators for e in ec.build()]
    assert built == [
        Estimator("ppo_clip", correction=mappings.get("tis_token", c_high=3.0)),
        Estimator(
            "ppo_clip",
            correction=mappings.get("mis_seq", preset="trl"),
            mode="bypass",
            denominator="kept",
            allow_same_ratio=True,
        ),
        Estimator("vespo", correction="tis_token", mode="trl_vespo"),
        Estimator("clip_cov", correction="icepop", seed=3),
    ]
    assert SweepConfig.from_dict(config.to_dict()) == config
    # TOML round trip, and defaults are not written back
    text = to_toml(config)
    assert SweepConfig.from_dict(tomllib.loads(text)) == config
    assert "denominator" not in config.to_dict()["estimators"][0]
    # the cell carries the composed specs
    cell = expand(config)[0]
    assert build_estimators(cell.params["estimators"]) == built


def test_a_composed_config_runs_and_equals_a_direct_run_bit_for_bit():
    entries = [
        {"mapping": "ppo_clip"},
        {"mapping": "ppo_clip", "correction": "tis_token"},
        {"mapping": "is_token", "correction": "mis_token", "denominator": "kept"},
    ]
    config = validate(SweepConfig.from_dict(bandit_dict(entries)))
    cell = expand(config)[0]
    table = run_cell(cell)
    rng = np.random.default_rng(2)
    env = Bandit(logits=rng.normal(0.0, 1.0, 5), means=rng.uniform(0.05, 0.95, 5))
    mu = shifts.dial(env.pi, 0.1, divergence="chi2", family="logit_noise")
    ests = [
        Estimator("ppo_clip"),
        Estimator("ppo_clip", correction="tis_token"),
        Estimator("is_token", correction="mis_token", denominator="kept"),
    ]
    setting = {"env": "bandit", "family": "logit_noise", "divergence": "chi2"}
    setting |= {"div_level": "token", "target": 0.1}
    direct = experiment.run(
        env, mu, ests, n=16, reps=40, seed=cell.run_seed, setting=setting, n_boot=50
    )
    pd.testing.assert_frame_equal(table[direct.columns], direct, check_exact=True)


BAD = {
    "misspelt correction": (
        {"correction": "tis_tokn"},
        ["estimators[0].correction", "'tis_tokn'", "tis_token", "mis_seq", "icepop"],
    ),
    "surrogate as correction": (
        {"correction": "ppo_clip"},
        ["estimators[0].correction", "'ppo_clip'", "valid:", "tis_token"],
    ),
    "misspelt mode": (
        {"correction": "tis_token", "mode": "decoupeld"},
        ["estimators[0].mode", "'decoupeld'", "decoupled, bypass, trl_vespo"],
    ),
    "misspelt denominator": (
        {"denominator": "kep"},
        ["estimators[0].denominator", "'kep'", "valid, kept"],
    ),
    "trl_vespo without correction": (
        {"mode": "trl_vespo"},
        ["estimators[0].mode", "needs a correction"],
    ),
    "trl_vespo on another mapping": (
        {"correction": "tis_token", "mode": "trl_vespo"},
        ["estimators[0].mode", "needs mapping 'vespo'", "'ppo_clip'"],
    ),
    "bad correction hyperparameter": (
        {"correction": "tis_token", "correction_params": {"c_high": -1}},
        ["estimators[0].correction_params", "c_high", "-1"],
    ),
    "unknown correction preset": (
        {"correction": "mis_seq", "correction_preset": "verl2"},
        ["estimators[0].correction_preset", "'verl2'", "trl"],
    ),
    "correction params without correction": (
        {"correction_params": {"c_high": 3}},
        ["estimators[0].correction_params", "correction only"],
    ),
    "negative seed": ({"seed": -1}, ["estimators[0].seed", ">= 0", "-1"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_composition_keys_are_refused_naming_key_and_value(case):
    keys, fragments = BAD[case]
    d = bandit_dict([{"mapping": "ppo_clip", **keys}])
    with pytest.raises(ConfigError) as info:
        SweepConfig.from_dict(d)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_json_schema_lists_the_composition_keys(capsys):
    assert main(["schema", "experiment"]) == 0
    schema = json.loads(capsys.readouterr().out)
    text = json.dumps(schema)
    for key in ("correction", "correction_params", "correction_preset", "denominator", "step_size"):
        assert f'"{key}"' in text, key
    for name in (*composition.MODES, *composition.DENOMINATORS):
        assert f'"{name}"' in text, name
    validator = jsonschema.Draft202012Validator(schema)
    good = bandit_dict([{"mapping": "ppo_clip", "correction": "tis_token", "mode": "bypass"}])
    assert list(validator.iter_errors(good)) == []
    bad = copy.deepcopy(good)
    bad["estimators"][0]["mode"] = "decoupeld"
    assert list(validator.iter_errors(bad))
    bad["estimators"][0]["mode"] = "bypass"
    bad["estimators"][0]["correction"] = "ppo_clip"  # a surrogate is not in the enum
    assert list(validator.iter_errors(bad))


# --- [behaviour.old]: π_old for experiment sweeps ---------------------------------------------


def token_old_dict(old: dict) -> dict:
    return {
        "name": "old",
        "seed": 1,
        "n": [8],
        "reps": 30,
        "n_boot": 50,
        "environment": {
            "kind": "token_mdp",
            "constructor": "at_least_k",
            "V": 2,
            "T": [3],
            "seed": 0,
            "kwargs": {"k": 2},
        },
        "behaviour": {"family": "logit_noise", "targets": [0.0, 0.1], "old": old},
        "estimators": [
            {"mapping": "ppo_clip"},
            {"mapping": "ppo_clip", "correction": "tis_token"},
            {"mapping": "is_seq", "correction": "is_seq"},
            {"mapping": "snis", "correction": "tis_token"},  # Monte Carlo
        ],
    }


@pytest.mark.parametrize(
    "old", [{"chi2": 0.05, "steps": 3}, {"step_size": 0.4, "steps": 2}], ids=["chi2", "step"]
)
def test_an_old_config_runs_and_equals_a_direct_run_with_old_bit_for_bit(old):
    from simkit.envs import BehaviourSpec, TokenMDP, stale

    config = validate(SweepConfig.from_dict(token_old_dict(old)))
    assert SweepConfig.from_dict(config.to_dict()) == config
    assert SweepConfig.from_dict(tomllib.loads(to_toml(config))) == config
    cell = expand(config)[1]
    table = run_cell(cell)

    env = TokenMDP.at_least_k(V=2, T=3, k=2, seed=0)
    if "chi2" in old:
        pi_old = stale.dial_staleness(env, 0.05, steps=3)
    else:
        pi_old = stale.stale_policy(env, steps=2, step_size=0.4)
    served = env.with_logits(np.log(pi_old))
    mu = BehaviourSpec(target=0.1, divergence="chi2", family="logit_noise").build(served)
    ests = [
        Estimator("ppo_clip"),
        Estimator("ppo_clip", correction="tis_token"),
        Estimator("is_seq", correction="is_seq"),
        Estimator("snis", correction="tis_token"),
    ]
    setting = {"env": "at_least_k", "family": "logit_noise", "divergence": "chi2"}
    setting |= {"div_level": "token", "target": 0.1}
    direct = experiment.run(
        env, mu, ests, n=8, reps=30, seed=cell.run_seed, setting=setting, n_boot=50, old=pi_old
    )
    pd.testing.assert_frame_equal(table[direct.columns], direct, check_exact=True)
    # both legs as configured: D(π_old‖μ) = the target, χ²_seq(π‖π_old) = 0.05
    np.testing.assert_allclose(table.chi2_tok_infer, 0.1, rtol=1e-8)
    if "chi2" in old:
        np.testing.assert_allclose(table.chi2_seq_stale, 0.05, rtol=1e-8)
    assert table.exact.tolist() == [True, True, True, False]
    # sequence IS on both legs is W(π/μ): unbiased in direction
    assert table.bias_dir[2] < 1e-12 and table.cosine[2] == pytest.approx(1.0, abs=1e-12)


def test_target_zero_serves_pi_old_itself():
    config = validate(SweepConfig.from_dict(token_old_dict({"chi2": 0.05, "steps": 3})))
    table = run_cell(expand(config)[0])
    np.testing.assert_allclose(table.chi2_tok_infer, 0.0, atol=1e-14)
    np.testing.assert_allclose(table.chi2_seq, 0.05, rtol=1e-8)  # μ = π_old: D(π‖μ) = staleness


def test_without_old_the_cell_parameters_and_table_are_those_of_before():
    d = token_old_dict({"chi2": 0.05})
    del d["behaviour"]["old"]
    config = SweepConfig.from_dict(d)
    assert "old" not in expand(config)[0].params["behaviour"]
    table = run_cell(expand(config)[0])
    assert not any(c.endswith(("_stale", "_infer")) for c in table.columns)


BAD_OLD = {
    "both chi2 and step_size": (
        {"chi2": 0.05, "step_size": 0.1},
        ["behaviour.old", "exactly one of chi2", "step_size"],
    ),
    "neither": ({"steps": 2}, ["behaviour.old", "exactly one of chi2"]),
    "misspelt key": ({"chi": 0.05}, ["behaviour.old.chi", "unknown key", "chi2", "step_size"]),
    "zero steps": ({"chi2": 0.05, "steps": 0}, ["behaviour.old.steps", ">= 1", "0"]),
    "non-positive chi2": ({"chi2": 0.0}, ["behaviour.old.chi2", "> 0", "0"]),
    "unknown level": ({"chi2": 0.05, "level": "token"}, ["behaviour.old.level", "'token'", "seq"]),
    "level without chi2": ({"step_size": 0.1, "level": "tok"}, ["behaviour.old.level", "chi2"]),
}


@pytest.mark.parametrize("case", list(BAD_OLD), ids=list(BAD_OLD))
def test_bad_old_tables_are_refused_naming_key_and_value(case):
    old, fragments = BAD_OLD[case]
    with pytest.raises(ConfigError) as info:
        SweepConfig.from_dict(token_old_dict(old))
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_an_unreachable_staleness_is_refused_before_work():
    # a bandit whose arms all pay the same has ∇J = 0: no backward step moves π
    d = bandit_dict([{"mapping": "ppo_clip"}])
    d["environment"]["means"] = [0.5] * 5
    d["behaviour"]["old"] = {"chi2": 0.05}
    with pytest.raises(ConfigError, match=r"^behaviour\.old: chi2 = 0\.05 is not reached"):
        validate(SweepConfig.from_dict(d))


def test_the_example_config_runs_with_both_legs():
    from simkit.config import load_config

    config = load_config(ROOT / "configs" / "three_policies.toml")
    assert config.behaviour.old is not None
    assert {e.correction is not None for ec in config.estimators for e in ec.build()} == {
        True,
        False,
    }
    table = run_cell(expand(config)[-1])
    np.testing.assert_allclose(table.chi2_seq_stale, 0.05, rtol=1e-8)
    assert table.exact.all()
