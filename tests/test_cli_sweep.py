"""simkit run / sweep / report on the command line."""

import pandas as pd
import pytest
from conftest import bandit_toml

from simkit import cli, sweep

CONFIG = bandit_toml("cli", seed=4, targets=(0.3,), estimators=("naive", "snis"))


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "cli.toml"
    path.write_text(CONFIG)
    return path


def test_run_prints_the_summary_and_writes_the_table(config, tmp_path, capsys):
    out = tmp_path / "table.csv"
    assert cli.main(["run", str(config), "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    header = text.splitlines()[0].split()
    assert header == [
        "estimator",
        "n",
        "bias",
        "variance",
        "mse",
        "rel_mse_scaled",
        "kept",
        "cosine",
        "ess",
        "method",
    ]
    assert len(text.splitlines()) == 1 + 4
    table = pd.read_csv(out)
    expected = sweep.run_config(config, progress=False)
    assert list(table.columns) == list(expected.columns) and len(table) == 4
    assert table["bias"].tolist() == pytest.approx(expected["bias"].tolist(), rel=1e-15)


def test_run_rejects_a_bad_config_and_a_bad_out(config, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.replace('mapping = "snis"', 'mapping = "snsi"'))
    assert cli.main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "simkit: error:" in err and "estimators[1].mapping" in err and "snsi" in err
    assert "snis" in err  # the available mappings are listed
    assert cli.main(["run", str(config), "--out", str(tmp_path / "t.xlsx")]) == 2
    assert "--out must end with .csv or .parquet" in capsys.readouterr().err


def test_sweep_then_report(config, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["sweep", str(config), "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "2 cells: 0 done before, 2 ran, 0 failed" in err and f"simkit report {out}" in err
    assert cli.main(["sweep", str(config), "--out", str(out), "--no-progress"]) == 0
    assert "2 done before, 0 ran" in capsys.readouterr().err

    assert cli.main(["report", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[:2] == [str(out / "results.parquet"), str(out / "results.csv")]
    for metric in ("bias", "variance", "mse", "cosine"):
        assert (out / "report" / f"{metric}.png").stat().st_size > 0
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results.parquet"), sweep.load_results(out))


def test_sweep_with_processes_backend(config, tmp_path):
    out = tmp_path / "run"
    argv = ["sweep", str(config), "--out", str(out), "--backend", "processes", "--workers", "2"]
    assert cli.main([*argv, "--no-progress"]) == 0
    pd.testing.assert_frame_equal(
        sweep.load_results(out), sweep.run_config(config, progress=False), check_exact=True
    )


def test_sweep_errors_exit_2_before_any_work(config, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["sweep", str(config), "--out", str(out), "--scheduler", "tcp://h:8786"]) == 2
    assert "dask' only" in capsys.readouterr().err
    assert not out.exists()
    assert cli.main(["sweep", str(config), "--out", str(out), "--no-progress"]) == 0
    other = tmp_path / "other.toml"
    other.write_text(CONFIG.replace("reps = 20", "reps = 30"))
    assert cli.main(["sweep", str(other), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "different config (reps: was 20, now 30)" in err
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "not a simkit sweep directory" in capsys.readouterr().err


def test_a_sweep_with_failures_exits_1(config, tmp_path, monkeypatch, capsys):
    from simkit import config as simkit_config

    def broken(cell, progress=False):
        raise ValueError("no luck")

    monkeypatch.setattr(simkit_config, "run_cell", broken)
    out = tmp_path / "run"
    assert cli.main(["sweep", str(config), "--out", str(out), "--no-progress"]) == 1
    assert "2 failed" in capsys.readouterr().err
    assert cli.main(["report", str(out)]) == 2
    assert "--partial" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "sweep", "report"])
def test_help_texts_have_examples(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"simkit {command}" in out
    if command == "sweep":
        assert "dask scheduler" in out and "--scheduler" in out and "--workers" in out
