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
    Estimator("ppo_clip", correction=mappings.get("mis_seq", preset="trl"), mode="bypass"),
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
    for key in ("correction", "correction_params", "correction_preset", "denominator"):
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
