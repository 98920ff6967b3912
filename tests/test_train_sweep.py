"""Training sweeps (kind = "train"): configs, validation before work, backends, resume, CLI."""

from __future__ import annotations

import argparse
import copy
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from simkit import config as C
from simkit import sweep
from simkit.cli import CLIError
from simkit.envs import TokenMDP
from simkit.figures import collapse_map, collapse_regimes, mismatch_curves, staleness_curves
from simkit.train import Mismatch, TrainConfig, config_dict, load_run, train
from simkit.train import cli as train_cli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

SMALL = {
    "kind": "train",
    "name": "tiny",
    "steps": 12,
    "minibatch_size": 8,
    "minibatches": [1, 4],
    "lr": 0.05,
    "record_every": 3,
    "seeds": [0, 1],
    "environment": {
        "kind": "token_mdp",
        "constructor": "at_least_k",
        "V": 5,
        "T": [6],
        "kwargs": {"k": 2},
    },
    "mismatch": [{}, {"precision": "bf16", "spike_prob": 0.3, "spike_strength": 3.0}],
    "estimators": [
        {"mapping": "ppo_clip", "advantages": ["grpo"], "group_size": 4},
        {"mapping": "vespo", "advantages": ["grpo"], "group_size": 4},
    ],
}


def small(**changes) -> dict:
    d = copy.deepcopy(SMALL)
    d.update(changes)
    return d


# --- the config -----------------------------------------------------------------------------------


def test_round_trips_and_expansion():
    cfg = C.config_from_dict(SMALL)
    assert isinstance(cfg, C.TrainSweepConfig)
    assert C.config_from_dict(cfg.to_dict()) == cfg
    assert C.SweepConfig.from_dict(SMALL) == cfg  # the experiment entry point dispatches on kind
    text = C.to_toml(cfg)
    assert C.config_from_dict(tomllib.loads(text)) == cfg
    cells = C.expand(cfg)
    # T × mismatch × lag × lr × N × estimator × seed
    assert len(cells) == 1 * 2 * 1 * 1 * 2 * 2 * 2
    assert len({c.key for c in cells}) == len(cells)
    first = cells[0].columns
    assert first["N"] == 1 and first["batch"] == 8 and first["mismatch"] == "none"
    assert [c.columns["seed"] for c in cells[:2]] == [0, 1]
    assert cells[-1].columns["mismatch"] == "bf16 + spikes p=0.3 s=3"
    assert cells[-1].columns["batch"] == 32  # N · minibatch_size
    # the key depends on the content only
    assert [c.key for c in C.expand(C.config_from_dict(cfg.to_dict()))] == [c.key for c in cells]


def test_fixed_rollout_batch_is_split_into_N():
    cfg = C.config_from_dict(small(minibatch_size=None, batch=16))
    assert {(c.columns["N"], c.columns["minibatch_size"]) for c in C.expand(cfg)} == {
        (1, 16),
        (4, 4),
    }


def test_experiment_configs_are_unchanged_by_the_kind_key():
    with (CONFIGS / "quick.toml").open("rb") as fh:
        d = tomllib.load(fh)
    plain = C.config_from_dict(d)
    assert isinstance(plain, C.SweepConfig)
    assert C.config_from_dict({**d, "kind": "experiment"}) == plain


BAD = {
    "unknown top-level key": (small(stepz=3), "stepz"),
    "unknown kind": (small(kind="training"), "kind"),
    "unknown mapping": (
        small(estimators=[{"mapping": "nope", "advantages": ["grpo"], "group_size": 4}]),
        "estimators[0].mapping",
    ),
    "bad mismatch key": (small(mismatch=[{"precison": "bf16"}]), "mismatch[0].precison"),
    "bad precision": (small(mismatch=[{"precision": "int8"}]), "mismatch[0]"),
    "spike tokens >= V": (
        small(mismatch=[{"spike_prob": 0.1, "spike_strength": 1.0, "spike_tokens": 5}]),
        "mismatch[0].spike_tokens",
    ),
    "both batch sizes": (small(batch=32), "exactly one of minibatch_size"),
    "groups do not split the batch": (small(minibatch_size=6), "not divisible by group_size"),
    "negative lag": (small(lag=[-1]), "lag[0]"),
    "zero lr": (small(lr=0.0), "lr"),
    "negative steps": (small(steps=-5), "steps"),
    "bandit environment": (small(environment={"kind": "bandit", "K": 3}), "environment.kind"),
    "bad optimizer": (small(optimizer="rmsprop"), "optimizer"),
    "repeated seed": (small(seeds=[0, 0]), "seeds[1]"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_configs_fail_before_any_work(tmp_path, case):
    d, fragment = BAD[case]
    with pytest.raises(C.ConfigError, match=None) as info:
        C.config_from_dict(d)
    assert fragment in str(info.value), str(info.value)
    # from a file, through the sweep: nothing is created
    path = tmp_path / "bad.toml"
    path.write_text(_toml_of_raw(d), "utf-8")
    out = tmp_path / "out"
    with pytest.raises(C.ConfigError, match=r"bad\.toml"):
        sweep.run_sweep(path, out, progress=False)
    assert not out.exists()


def _toml_of_raw(d: dict) -> str:
    """TOML text of a raw (possibly invalid) dict: the writer of simkit.config, unchecked."""
    lines = []
    for key, value in d.items():
        if not isinstance(value, dict) and not (
            isinstance(value, list) and value and isinstance(value[0], dict)
        ):
            lines.append(f"{key} = {C._toml_value(value)}")
    for key, value in d.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {C._toml_value(v)}" for k, v in value.items())]
    for key, value in d.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            for entry in value:
                lines += [f"[[{key}]]", *(f"{k} = {C._toml_value(v)}" for k, v in entry.items())]
    return "\n".join(lines) + "\n"


# --- cells are runs of simkit.train.train ---------------------------------------------------------


def test_a_cell_is_one_train_call_with_its_seed():
    cfg = C.config_from_dict(SMALL)
    cell = C.expand(cfg)[-1]
    table = C.run_cell(cell)
    p = cell.params
    env = TokenMDP.at_least_k(V=5, T=6, k=2)
    direct = train(env, TrainConfig.from_dict(p["train"]), seed=cell.columns["seed"])
    pd.testing.assert_frame_equal(
        table[list(direct.columns)].drop(columns="estimator"),
        direct.drop(columns="estimator"),
        check_exact=True,
    )
    assert (table["cell"] == cell.key).all()
    assert list(table.columns[:4]) == ["env", "T", "V", "estimator"]


def test_train_config_dict_round_trip():
    cfg = TrainConfig(
        C.build_estimators(
            [C.estimator_params(C.config_from_dict(SMALL).estimators[0].build()[0])]
        )[0],
        steps=7,
        batch=8,
        minibatches=2,
        lag=1,
        mismatch=Mismatch(precision="fp16", logit_noise=0.1),
        max_grad_norm=2.0,
    )
    assert TrainConfig.from_dict(config_dict(cfg)) == cfg
    with pytest.raises(ValueError, match="unknown TrainConfig key 'stepz'"):
        TrainConfig.from_dict({**config_dict(cfg), "stepz": 1})


# --- backends, shards, resume ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def serial_and_processes(tmp_path_factory):
    base = tmp_path_factory.mktemp("train_sweeps")
    cfg = C.config_from_dict(SMALL)
    serial = sweep.run_sweep(cfg, base / "serial", progress=False)
    procs = sweep.run_sweep(cfg, base / "procs", backend="processes", workers=2, progress=False)
    return cfg, base, serial, procs


def test_serial_and_processes_give_identical_tables(serial_and_processes):
    cfg, base, serial, procs = serial_and_processes
    assert serial.complete and procs.complete and serial.total == len(C.expand(cfg))
    a = sweep.load_results(base / "serial")
    b = sweep.load_results(base / "procs")
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert len(a) == serial.total * cfg.steps
    # one shard per run
    assert sweep.finished_keys(base / "serial") == {c.key for c in C.expand(cfg)}
    # in memory, serial and processes: the same numbers
    pd.testing.assert_frame_equal(sweep.run_config(cfg, progress=False), a, check_exact=True)
    pd.testing.assert_frame_equal(
        sweep.run_config(cfg, progress=False, backend="processes", workers=2), a, check_exact=True
    )


def test_resume_runs_only_the_missing_runs(serial_and_processes):
    cfg, base, _, _ = serial_and_processes
    out = base / "serial"
    whole = sweep.load_results(out)
    lost = C.expand(cfg)[3].key
    sweep.shard_path(out, lost).unlink()
    with pytest.raises(sweep.SweepError, match="1 of 16 cells have no results"):
        sweep.load_results(out)
    again = sweep.run_sweep(cfg, out, progress=False)
    assert (again.done_before, again.ran) == (len(whole) // cfg.steps - 1, 1)
    pd.testing.assert_frame_equal(sweep.load_results(out), whole, check_exact=True)
    other = C.config_from_dict(small(steps=13))
    with pytest.raises(sweep.SweepError, match="different config"):
        sweep.run_sweep(other, out, progress=False)


# --- shipped configs are the figures' grids -------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [staleness_curves, mismatch_curves, collapse_map, collapse_regimes],
    ids=lambda m: m.NAME,
)
def test_shipped_config_is_the_full_size_figure(module):
    path = CONFIGS / f"train_{module.NAME}.toml"
    shipped = C.load_config(path)
    assert shipped == module.sweep_config(module.config())
    assert f"`{module.NAME}`" in path.read_text("utf-8").split("\n", 1)[0]


def _regime_runs(sweep_cfg) -> list[tuple]:
    """(recipe, N, lag_updates, lr, seed) of every run of a training sweep, in expansion
    order."""
    from simkit.train.recipes import recipe_of

    out = []
    for _, tc, seed in sweep_cfg.runs():
        est = tc.estimator
        corr = None if est.correction is None else est.correction.name
        out.append((recipe_of(est.mapping.name, est.aggregation, corr), tc.minibatches,
                    tc.lag_updates, tc.lr, seed))  # fmt: skip
    return out


@pytest.mark.parametrize("small", [False, True], ids=["full", "small"])
def test_collapse_regimes_config_cells_are_the_figure_grid(small):
    """The sweep's runs are exactly the figure's: usable recipes (decoupled PPO × TIS included)
    × the cells of its two grids (shared cells once) × seeds — 5 × 6 × 4 = 120 runs at full
    size, 3 × 6 × 2 = 36 small."""
    cfg = collapse_regimes.config(small=small)
    runs = _regime_runs(collapse_regimes.sweep_config(cfg))
    jobs = [
        (r, N, lag, lr, seed)
        for r in collapse_regimes.usable_recipes(cfg)
        for N, lag, lr in collapse_regimes.cells(cfg)
        for seed in cfg.seeds
    ]
    assert len(runs) == len(set(runs)) == len(jobs)
    assert set(runs) == set(jobs)
    assert len(runs) == (120 if not small else 36)
    if not small:
        assert "tis" in {r for r, *_ in runs}  # decoupled PPO × TIS


def test_collapse_regimes_config_cell_is_the_figure_run():
    """A cell of the sweep (C.run_cell) gives the figure's run (collapse_regimes._run) bit for
    bit on its exact columns, for a plain and for the composed recipe (small grid, lag 4)."""
    cfg = collapse_regimes.config(small=True)
    cfg = collapse_regimes.Config(**{**cfg.__dict__, "recipes": ("grpo", "ppo_tis")})
    sweep_cfg = collapse_regimes.sweep_config(cfg)
    cells = C.expand(sweep_cfg)
    keys = _regime_runs(sweep_cfg)
    for want in [("grpo", 4, 4, 0.3, 1), ("ppo_tis", 4, 4, 0.3, 1)]:
        cell = cells[keys.index(want)]
        table = C.run_cell(cell)
        table = table[table["recorded"]].reset_index(drop=True)
        fig = collapse_regimes._run((cfg, *want)).reset_index(drop=True)
        for col in ("step", "J", "kl_seq", "kl_seq_old_mu", "grad_norm", "entropy_decision"):
            assert table[col].tolist() == fig[col].tolist(), (want, col)


def test_sub_grids_are_a_union_in_first_appearance_order(tmp_path):
    cfg = C.config_from_dict(
        small(
            minibatches=[1, 4],
            lag=[0, 1],
            lr=[0.05, 0.1],
            seeds=[0],
            mismatch=[{}],
            grids=[{"lr": [0.05, 0.1], "minibatches": [4]}, {"minibatches": [1, 4], "lr": [0.1]}],
        )
    )
    assert cfg.schedules() == [(0, 0.05, 4, 0), (0, 0.1, 4, 0), (1, 0.05, 4, 0), (1, 0.1, 4, 0),
                               (0, 0.1, 1, 0), (1, 0.1, 1, 0)]  # fmt: skip
    assert len(C.expand(cfg)) == 6 * 2  # 2 estimators
    path = tmp_path / "g.toml"
    path.write_text(C.to_toml(cfg), "utf-8")
    assert "[[grids]]" in path.read_text("utf-8") and C.load_config(path) == cfg
    plain = C.config_from_dict(small(lag=[0, 1], lr=[0.05, 0.1]))
    assert plain.schedules() == [(lag, lr, N, 0) for lag in (0, 1) for lr in (0.05, 0.1)
                                 for N in (1, 4)]  # fmt: skip
    lagged = C.config_from_dict(small(lag_updates=[0, 3], minibatches=[4]))
    assert lagged.schedules() == [(0, lr, 4, L) for L in (0, 3) for lr in lagged.lr]
    assert {c.columns["lag_updates"] for c in lagged.cells()} == {0, 3}
    assert "grids" not in plain.to_dict()
    with pytest.raises(C.ConfigError, match=r"grids\[0\]\.steps"):
        C.config_from_dict(small(grids=[{"steps": 3}]))
    with pytest.raises(C.ConfigError, match=r"grids\[0\]\.lr"):
        C.config_from_dict(small(grids=[{"lr": [-1.0]}]))


def test_quick_config_loads():
    cfg = C.load_config(CONFIGS / "train_quick.toml")
    assert isinstance(cfg, C.TrainSweepConfig) and len(C.expand(cfg)) == 8


# --- simkit train ---------------------------------------------------------------------------------


def cli(argv) -> int:
    parser = argparse.ArgumentParser(prog="simkit")
    train_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CLIError as err:
        raise SystemExit(f"error: {err}") from None


def test_cli_help_teaches(capsys):
    with pytest.raises(SystemExit) as info:
        cli(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for fragment in (
        "examples:",
        "simkit train --recipe vespo",
        "--recipe ppo_tis",
        "configs/train_quick.toml",
        "--spike-prob",
    ):
        assert fragment in out


def test_cli_one_run_resumes_to_the_uninterrupted_table(tmp_path, capsys):
    opts = ["train", "--recipe", "vespo", "--V", "5", "--T", "6", "--env-arg", "k=2", "--N", "4",
            "--minibatch-size", "8", "--steps", "20", "--precision", "bf16", "--seed", "3",
            "--no-progress", "--chunk-steps", "5"]  # fmt: skip
    assert cli([*opts, "--out", str(tmp_path / "whole")]) == 0
    assert cli([*opts, "--out", str(tmp_path / "part"), "--stop-after", "10"]) == 0
    assert len(load_run(tmp_path / "part")) == 10
    assert cli([*opts, "--out", str(tmp_path / "part")]) == 0
    pd.testing.assert_frame_equal(
        load_run(tmp_path / "part"), load_run(tmp_path / "whole"), check_exact=True
    )
    out = capsys.readouterr()
    assert "resuming" in out.err and "VESPO: N = 4" in out.out and "J start" in out.out


def test_cli_recipe_ppo_tis_trains_the_composed_recipe(tmp_path, capsys):
    """--recipe ppo_tis is verl's decoupled PPO × token TIS: the table of simkit.train.train
    with recipes.recipe("ppo_tis") on the same environment, config and seed; it resumes."""
    from simkit.train.recipes import recipe

    opts = ["train", "--recipe", "ppo_tis", "--V", "5", "--T", "6", "--env-arg", "k=2", "--N",
            "4", "--minibatch-size", "8", "--lag", "2", "--lr", "0.3", "--steps", "12",
            "--seed", "3", "--no-progress", "--chunk-steps", "4"]  # fmt: skip
    assert cli([*opts, "--out", str(tmp_path / "whole")]) == 0
    assert cli([*opts, "--out", str(tmp_path / "part"), "--stop-after", "4"]) == 0
    assert cli([*opts, "--out", str(tmp_path / "part")]) == 0
    whole = load_run(tmp_path / "whole")
    pd.testing.assert_frame_equal(load_run(tmp_path / "part"), whole, check_exact=True)
    env = TokenMDP.at_least_k(V=5, T=6, k=2, seed=0)
    est = recipe("ppo_tis", 8)
    cfg = TrainConfig(est, steps=12, batch=32, minibatches=4, lag=2, lr=0.3)
    direct = train(env, cfg, seed=3)
    assert whole["estimator"].iloc[0] == "dual-clip PPO × TIS"
    for col in ("J", "kl_seq_old_mu", "grad_norm", "zero_frac"):
        assert whole[col].tolist() == direct[col].tolist()
    assert "dual-clip PPO × TIS: N = 4" in capsys.readouterr().out


def test_cli_config_form(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(C.to_toml(C.config_from_dict(small(minibatches=[2], seeds=[0]))), "utf-8")
    assert cli(["train", str(path), "--out", str(tmp_path / "s"), "--no-progress"]) == 0
    summary = pd.read_csv(tmp_path / "s" / "summary.csv")
    assert len(summary) == 4 and {"J_final", "collapsed", "mismatch"} <= set(summary.columns)
    assert "J_final" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--recipe", "nope"], "unknown recipe 'nope'.*ppo_tis"),
        (["train", "--recipe", "grpo", "--mapping", "naive"], "not both"),
        (["train", "--V", "1"], "--V: must be an integer >= 2"),
        (["train", "--N", "3", "--minibatch-size", "6"], "not divisible by group_size"),
        (["train", "--backend", "processes"], "applies to a config file"),
        (["train", "--table", "x.txt"], "--table must end with"),
        (["train", str(CONFIGS / "quick.toml")], "experiment sweep"),
        (
            ["train", str(CONFIGS / "train_quick.toml"), "--steps", "5"],
            "--steps is a one-run option",
        ),
    ],
)
def test_cli_errors_name_the_problem(argv, message):
    with pytest.raises(SystemExit, match=message):
        cli(argv)


def test_simkit_sweep_runs_a_training_config(tmp_path):
    """`simkit sweep CONFIG` takes a kind = "train" config like any other (one shard per run)."""
    from simkit.cli import main

    cfg = C.config_from_dict(small(minibatches=[2], seeds=[0], mismatch=[{}]))
    path = tmp_path / "c.toml"
    path.write_text(C.to_toml(cfg), "utf-8")
    out = tmp_path / "s"
    assert main(["sweep", str(path), "--out", str(out), "--no-progress"]) == 0
    assert sweep.finished_keys(out) == {c.key for c in C.expand(cfg)}
    pd.testing.assert_frame_equal(
        sweep.load_results(out), sweep.run_config(cfg, progress=False), check_exact=True
    )
