"""Sweep configurations: TOML round trip, validation errors, expansion, stable keys, run_cell."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import simkit
from simkit import experiment, mappings, shifts
from simkit.config import (
    Cell,
    ConfigError,
    SweepConfig,
    cell_key,
    cell_seed,
    expand,
    load_config,
    run_cell,
    to_toml,
    validate,
)
from simkit.envs import Bandit, BehaviourSpec, TokenMDP
from simkit.estimators import Estimator

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
QUICK = ROOT / "configs" / "quick.toml"


def quick_dict() -> dict:
    with QUICK.open("rb") as fh:
        return tomllib.load(fh)


def token_dict() -> dict:
    return {
        "name": "token",
        "seed": 3,
        "n": [8],
        "reps": 20,
        "n_boot": 50,
        "environment": {
            "kind": "token_mdp",
            "constructor": "at_least_k",
            "V": 3,
            "T": [2, 3],
            "seed": 1,
            "kwargs": {"k": 2},
        },
        "behaviour": {"family": "logit_noise", "divergence": "chi2", "targets": [0.2]},
        "estimators": [
            {"mapping": "naive"},
            {"mapping": "tis_token", "aggregations": ["seq-mean-token-sum", "token-mean"]},
        ],
    }


def reorder(obj):
    """The same nested dict with every table's keys in reverse order."""
    if isinstance(obj, dict):
        return {k: reorder(obj[k]) for k in reversed(list(obj))}
    if isinstance(obj, list):
        return [reorder(v) for v in obj]
    return obj


# --- loading and round trips ------------------------------------------------------------------


def test_configs_directory_has_the_examples():
    names = {p.stem for p in CONFIGS}
    assert {
        "quick",
        "bandit_bias_variance",
        "bias_variance_frontier",
        "token_mdp_mse_vs_T",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_example_loads_validates_and_round_trips(path):
    config = load_config(path)  # validates: every target dialed, exact paths checked
    assert SweepConfig.from_dict(config.to_dict()) == config
    assert SweepConfig.from_dict(tomllib.loads(to_toml(config))) == config
    assert SweepConfig.from_dict(reorder(config.to_dict())) == config
    cells = expand(config)
    if config.kind == "train":  # a training sweep (kind = "train"): one cell per run
        assert len(cells) == len(list(config.runs()))
    else:
        assert len(cells) == len(config.environment.lengths) * len(config.behaviour.targets) * len(
            config.n
        )
    assert len({c.key for c in cells}) == len(cells)
    json.dumps(cells[0].params)  # plain JSON


def test_to_dict_is_canonical_and_fills_defaults():
    d = quick_dict()
    config = SweepConfig.from_dict(d)
    out = config.to_dict()
    assert out["exact"] == "auto" and out["level"] == 0.95
    assert out["estimators"][0]["aggregations"] == ["token-mean"]
    assert SweepConfig.from_dict(out).to_dict() == out


def test_scalar_n_and_T_are_accepted_as_one_element_tuples():
    d = token_dict()
    d["n"] = 8
    d["environment"]["T"] = 2
    config = SweepConfig.from_dict(d)
    assert config.n == (8,) and config.environment.T == (2,)


# --- expansion ----------------------------------------------------------------------------------


def test_expansion_order_and_columns():
    config = load_config(QUICK)
    cells = expand(config)
    order = [(c.columns["target"], c.columns["n"]) for c in cells]
    assert order == [(0.1, 16), (0.1, 32), (1.0, 16), (1.0, 32)]
    assert [c.index for c in cells] == list(range(4))
    names = [e["name"] for e in cells[0].params["estimators"]]
    assert names == ["naive", "is_seq", "ppo_clip", "ppo_clip(eps_high=0.28)", "snis"]
    assert cells[0].columns == {
        "env": "bandit",
        "family": "logit_noise",
        "divergence": "chi2",
        "div_level": "token",
        "target": 0.1,
        "T": 1,
        "n": 16,
    }


def test_grid_product_zip_aggregations_advantages():
    d = quick_dict()
    d["estimators"] = [
        {
            "mapping": "tis_token",
            "grid": {"c_high": [2.0, 3.0, 5.0], "c_low": [0.0, 0.5]},
            "advantages": ["oracle", "grpo"],
            "group_size": 4,
        },
        {
            "mapping": "ppo_clip",
            "grid": {"eps_low": [0.1, 0.2], "eps_high": [0.1, 0.2]},
            "grid_mode": "zip",
            "aggregations": ["token-mean", "seq-mean-token-mean"],
        },
    ]
    cell = expand(SweepConfig.from_dict(d))[0]
    ests = cell.params["estimators"]
    assert len(ests) == 3 * 2 * 2 + 2 * 2
    tis = [(e["hyperparameters"]["c_high"], e["hyperparameters"]["c_low"]) for e in ests[:12:2]]
    assert tis == [(2.0, 0.0), (2.0, 0.5), (3.0, 0.0), (3.0, 0.5), (5.0, 0.0), (5.0, 0.5)]
    assert [e["group_size"] for e in ests[:2]] == [None, 4]  # only the group advantage
    ppo = [(e["hyperparameters"]["eps_low"], e["hyperparameters"]["eps_high"]) for e in ests[12:]]
    assert ppo == [(0.1, 0.1), (0.1, 0.1), (0.2, 0.2), (0.2, 0.2)]


def test_preset_is_folded_into_the_hyperparameters():
    d = quick_dict()
    d["estimators"] = [{"mapping": "cispo", "preset": "verl"}]
    ests = expand(SweepConfig.from_dict(d))[0].params["estimators"]
    assert ests[0]["hyperparameters"]["eps_low"] == 10.0


@settings(max_examples=30, deadline=None)
@given(
    n_targets=st.integers(1, 3),
    n_sizes=st.integers(1, 3),
    # caps on a 0.25 grid: distinct caps must stay distinct in the estimator names (a cap that
    # differs only in the 16th digit is rejected as a duplicate, see test below)
    caps=st.lists(st.integers(4, 200).map(lambda k: k / 4), min_size=1, max_size=4, unique=True),
)
def test_expansion_counts_and_distinct_keys(n_targets, n_sizes, caps):
    d = quick_dict()
    d["behaviour"]["targets"] = [0.05 * (i + 1) for i in range(n_targets)]
    d["n"] = [4 * (i + 1) for i in range(n_sizes)]
    d["estimators"] = [{"mapping": "tis_seq", "grid": {"c": caps}}]
    cells = expand(SweepConfig.from_dict(d))
    assert len(cells) == n_targets * n_sizes
    assert all(len(c.params["estimators"]) == len(caps) for c in cells)
    assert len({c.key for c in cells}) == len(cells)


# --- keys and seeds -------------------------------------------------------------------------


def test_keys_are_stable_across_processes():
    here = [c.key for c in expand(load_config(QUICK))]
    code = (
        "from simkit.config import expand, load_config;"
        f"print(','.join(c.key for c in expand(load_config({str(QUICK)!r}))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert out.stdout.strip().split(",") == here


def test_keys_do_not_depend_on_dict_order():
    a = expand(SweepConfig.from_dict(quick_dict()))
    b = expand(SweepConfig.from_dict(reorder(quick_dict())))
    assert [c.key for c in a] == [c.key for c in b]
    params = a[0].params
    assert cell_key(reorder(params), 0) == cell_key(params, 0) == a[0].key


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(seed=1),
        lambda d: d.update(reps=51),
        lambda d: d.update(n_boot=101),
        lambda d: d["environment"].update(seed=1),
        lambda d: d["behaviour"].update(family="temperature"),
        lambda d: d["estimators"][2].update(grid={"eps_high": [0.2, 0.3]}),
        lambda d: d["estimators"][0].update(aggregations=["seq-mean-token-sum"]),
    ],
)
def test_different_parameters_give_different_keys(change):
    base = {c.key for c in expand(SweepConfig.from_dict(quick_dict()))}
    d = quick_dict()
    change(d)
    changed = {c.key for c in expand(SweepConfig.from_dict(d))}
    assert not base & changed


def test_cell_seed_depends_on_seed_and_key_only():
    cells = expand(load_config(QUICK))
    seeds = [c.run_seed for c in cells]
    assert len(set(seeds)) == len(seeds)
    assert cell_seed(0, cells[0].key) == seeds[0]
    assert cell_seed(1, cells[0].key) != seeds[0]
    # expansion position does not enter: the same cell at another index has the same seed
    moved = Cell(cells[0].key, cells[0].params, cells[0].columns, cells[0].seed, index=7)
    assert moved.run_seed == seeds[0] and moved == cells[0]
    with pytest.raises(ValueError):
        cell_seed(0, "not hex")


# --- run_cell -----------------------------------------------------------------------------------


def test_run_cell_table_is_deterministic_and_equals_a_direct_run():
    cell = expand(load_config(QUICK))[0]
    table = run_cell(cell)
    again = run_cell(cell)
    pd.testing.assert_frame_equal(table, again)
    for col, value in cell.columns.items():
        assert (table[col] == value).all(), col
    assert (table["cell"] == cell.key).all()
    assert (table["simkit_version"] == simkit.__version__).all()
    assert list(table.estimator) == [e["name"] for e in cell.params["estimators"]]

    # the same numbers from the building blocks, without simkit.config
    rng = np.random.default_rng(0)
    env = Bandit(logits=rng.normal(0.0, 1.0, 6), means=rng.uniform(0.05, 0.95, 6))
    mu = shifts.dial(env.pi, 0.1, divergence="chi2", family="logit_noise")
    ests = [
        Estimator("naive"),
        Estimator("is_seq"),
        Estimator("ppo_clip"),
        Estimator(mappings.get("ppo_clip", eps_high=0.28)),
        Estimator("snis"),
    ]
    setting = {"env": "bandit", "family": "logit_noise", "divergence": "chi2"}
    setting |= {"div_level": "token", "target": 0.1}
    direct = experiment.run(
        env, mu, ests, n=16, reps=50, seed=cell.run_seed, setting=setting, n_boot=100
    )
    pd.testing.assert_frame_equal(table[direct.columns], direct)
    assert table.exact.tolist() == [True, True, True, True, False]
    # χ²(π‖μ) was dialed to the target (exactly, as shifts.dial guarantees 1e-8 relative)
    np.testing.assert_allclose(table.chi2_tok, 0.1, rtol=1e-8)


def test_run_cell_on_a_token_mdp_matches_a_direct_run():
    config = SweepConfig.from_dict(token_dict())
    validate(config)
    cells = expand(config)
    assert [c.columns["T"] for c in cells] == [2, 3]
    cell = cells[1]
    table = run_cell(cell)
    env = TokenMDP.at_least_k(V=3, T=3, k=2, seed=1)
    mu = BehaviourSpec(target=0.2, divergence="chi2", family="logit_noise").build(env)
    ests = [
        Estimator("naive"),
        Estimator("tis_token", aggregation="seq-mean-token-sum"),
        Estimator("tis_token"),
    ]
    setting = {"env": "at_least_k", "family": "logit_noise", "divergence": "chi2"}
    setting |= {"div_level": "token", "target": 0.2}
    direct = experiment.run(
        env, mu, ests, n=8, reps=20, seed=cell.run_seed, setting=setting, n_boot=50
    )
    pd.testing.assert_frame_equal(table[direct.columns], direct)
    assert (table["T"] == 3).all()


def test_sequence_level_target_is_hit_in_the_cell():
    d = token_dict()
    d["behaviour"] = {"family": "logit_noise", "level": "sequence", "targets": [0.5]}
    d["estimators"] = [{"mapping": "naive"}]
    config = load_config_from(d)
    table = run_cell(expand(config)[0])
    # 1 + χ²_seq = E_μ[W²] by the environment's exact DP: dialed to SEQ_RTOL = 1e-6
    np.testing.assert_allclose(table.chi2_seq, 0.5, rtol=1e-6)


def load_config_from(d: dict) -> SweepConfig:
    return validate(SweepConfig.from_dict(d))


# --- bad configs ----------------------------------------------------------------------------


def _set(path, value):
    def change(d):
        *head, last = path
        target = d
        for k in head:
            target = target[k]
        target[last] = value

    return change


BAD = {
    "unknown top-level key": (_set(["sede"], 1), ["sede", "valid keys", "seed"]),
    "unknown nested key": (
        _set(["behaviour", "target"], [0.1]),
        ["behaviour.target", "unknown key", "targets"],
    ),
    "unknown estimator key": (
        _set(["estimators", 2, "gird"], {}),
        ["estimators[2].gird", "grid"],
    ),
    "unknown environment key": (
        _set(["environment", "arms"], 4),
        ["environment.arms", "valid keys in environment", "K"],
    ),
    "wrong type (reps)": (_set(["reps"], "many"), ["reps", "integer", "'many'"]),
    "wrong type (n element)": (_set(["n"], [16, 2.5]), ["n[1]", "integer"]),
    "wrong type (targets)": (_set(["behaviour", "targets"], ["big"]), ["behaviour.targets[0]"]),
    "wrong type (table)": (_set(["behaviour"], [1, 2]), ["behaviour", "table"]),
    "negative n": (_set(["n"], [-16]), ["n[0]", ">= 1", "-16"]),
    "zero reps": (_set(["reps"], 0), ["reps", ">= 2"]),
    "negative target": (_set(["behaviour", "targets"], [-1.0]), ["behaviour.targets[0]", ">= 0"]),
    "unknown mapping": (
        _set(["estimators", 1, "mapping"], "ppo"),
        ["estimators[1].mapping", "'ppo'", "naive", "ppo_clip", "vespo"],
    ),
    "bad hyperparameter": (
        _set(["estimators", 2, "grid"], {"eps_high": [0.2, -1.0]}),
        ["estimators[2].grid", "eps_high=-1.0", "eps_high"],
    ),
    "unknown hyperparameter": (
        _set(["estimators", 2, "params"], {"epsilon": 0.1}),
        ["estimators[2].params", "no hyperparameter", "epsilon"],
    ),
    "unknown preset": (
        _set(["estimators", 2, "preset"], "verl"),
        ["estimators[2].preset", "'verl'"],
    ),
    "unknown family": (_set(["behaviour", "family"], "warp"), ["behaviour.family", "temperature"]),
    "unknown divergence": (
        _set(["behaviour", "divergence"], "js"),
        ["behaviour.divergence", "'js'", "chi2", "kl", "tv"],
    ),
    "unknown aggregation": (
        _set(["estimators", 0, "aggregations"], ["mean"]),
        ["estimators[0].aggregations[0]", "'mean'", "seq-mean-token-sum"],
    ),
    "unknown advantage": (
        _set(["estimators", 0, "advantages"], ["ppo"]),
        ["estimators[0].advantages[0]", "grpo", "rloo"],
    ),
    "group advantage without G": (
        _set(["estimators", 0, "advantages"], ["grpo"]),
        ["estimators[0].group_size", "'grpo'"],
    ),
    "n not a multiple of G": (
        lambda d: d["estimators"][0].update(advantages=["rloo"], group_size=3),
        ["estimators[0].group_size", "n = 16", "G = 3"],
    ),
    "zip of unequal lists": (
        lambda d: d["estimators"][2].update(
            grid={"eps_low": [0.1], "eps_high": [0.2, 0.3]}, grid_mode="zip"
        ),
        ["estimators[2].grid", "zip"],
    ),
    "duplicate estimator": (
        _set(["estimators", 1], {"mapping": "naive"}),
        ["estimators[1]", "'naive'", "estimators[0]"],
    ),
    "family cuts support for chi2": (
        _set(["behaviour", "family"], "top_k"),
        ["behaviour", "top_k", "tv"],
    ),
    "aggregate on a bandit": (
        _set(["behaviour", "aggregate"], "average"),
        ["behaviour.aggregate", "token MDP"],
    ),
    "exact true with a batch-dependent mapping": (
        _set(["exact"], True),
        ["exact", "snis"],
    ),
    "exact not a choice": (_set(["exact"], "yes"), ["exact", "'yes'"]),
    "unknown environment kind": (
        _set(["environment", "kind"], "gridworld"),
        ["environment.kind", "bandit", "token_mdp"],
    ),
    "bandit means of the wrong size": (
        _set(["environment", "means"], [0.5, 0.5]),
        ["environment.means", "K = 6"],
    ),
    "unreachable target": (
        lambda d: d["behaviour"].update(family="mixture", targets=[0.1, 1e6]),
        ["behaviour.targets", "1e+06", "largest reachable value is"],
    ),
    "no estimators": (_set(["estimators"], []), ["estimators", "non-empty"]),
    "missing key": (lambda d: d.pop("n"), ["n", "missing"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_config_fails_naming_the_problem(case, tmp_path):
    change, fragments = BAD[case]
    d = copy.deepcopy(quick_dict())
    change(d)
    with pytest.raises(ConfigError) as info:
        validate(SweepConfig.from_dict(d))
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_unreachable_target_reports_the_largest_reachable_value():
    d = quick_dict()
    d["behaviour"] = {"family": "mixture", "divergence": "chi2", "targets": [1e6]}
    config = SweepConfig.from_dict(d)  # the field checks pass; the dial happens in validate
    with pytest.raises(ConfigError) as info:
        validate(config)
    # the largest reachable χ² of the mixture family is at λ = 1 (μ uniform): V·Σπ² − 1
    env = config.environment.build()
    best = float(len(env.pi) * np.sum(env.pi**2) - 1.0)
    assert f"largest reachable value is {best:.6g}" in str(info.value)


def test_token_mdp_errors_name_the_key():
    d = token_dict()
    d["environment"]["kwargs"] = {"k": 5}
    with pytest.raises(ConfigError, match=r"environment \(T = 2\): k must be <= T = 2"):
        SweepConfig.from_dict(d)
    d = token_dict()
    d["environment"]["constructor"] = "tree"
    with pytest.raises(ConfigError, match=r"environment\.constructor.*answer_correct"):
        SweepConfig.from_dict(d)
    d = token_dict()
    d["environment"]["T"] = [2, 2]
    with pytest.raises(ConfigError, match=r"environment.T\[1\]: repeated"):
        SweepConfig.from_dict(d)
    d = token_dict()
    d["behaviour"] = {"family": "mixture", "level": "sequence", "targets": [1e6]}
    with pytest.raises(ConfigError, match=r"behaviour.targets \(T = 2\).*largest reachable"):
        validate(SweepConfig.from_dict(d))


def test_load_config_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("surprise = 1\n" + QUICK.read_text())
    with pytest.raises(ConfigError, match=r"bad.toml: surprise: unknown key"):
        load_config(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("name = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_integer_and_float_hyperparameters_are_one_configuration():
    a, b = quick_dict(), quick_dict()
    a["estimators"][2]["grid"] = {"eps_high": [1, 0.28]}
    b["estimators"][2]["grid"] = {"eps_high": [1.0, 0.28]}
    a["behaviour"]["family"] = b["behaviour"]["family"] = "tilt"
    a["behaviour"]["family_params"] = {"angle": 0}
    b["behaviour"]["family_params"] = {"angle": 0.0}
    ca, cb = SweepConfig.from_dict(a), SweepConfig.from_dict(b)
    assert ca == cb and ca.to_dict() == cb.to_dict()
    assert [c.key for c in expand(ca)] == [c.key for c in expand(cb)]
    # integer hyperparameters stay integers
    d = quick_dict()
    d["behaviour"]["family"] = "tail"
    d["behaviour"]["family_params"] = {"n_tokens": 2}
    assert SweepConfig.from_dict(d).to_dict()["behaviour"]["family_params"] == {"n_tokens": 2}


def test_cells_pickle_for_worker_processes():
    cell = expand(load_config(QUICK))[3]
    clone = pickle.loads(pickle.dumps(cell))
    assert clone == cell and clone.key == cell.key and clone.run_seed == cell.run_seed
    assert hash(clone) == hash(cell)


def test_token_config_with_list_kwargs_round_trips_through_toml():
    d = token_dict()
    d["environment"].update(constructor="parity", kwargs={"marked": [1, 2]}, eos=0)
    d["behaviour"].update(level="sequence", family_params={"seed": 4})
    config = validate(SweepConfig.from_dict(d))
    assert SweepConfig.from_dict(tomllib.loads(to_toml(config))) == config
    cell = expand(config)[0]
    assert cell.params["environment"]["kwargs"] == {"marked": [1, 2]}
    table = run_cell(cell)  # eos: token-mean has a random Z, so those rows are Monte Carlo
    assert table.exact.tolist() == [False, True, False]
    np.testing.assert_allclose(table.chi2_seq, 0.2, rtol=1e-6)


def test_caps_that_print_the_same_are_rejected_as_duplicates():
    d = quick_dict()
    d["estimators"] = [{"mapping": "tis_seq", "grid": {"c": [1.0, 1.0 + 2e-16]}}]
    with pytest.raises(ConfigError, match="already produced"):
        SweepConfig.from_dict(d)
