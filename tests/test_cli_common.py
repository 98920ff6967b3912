"""simkit.cli_common: the helpers every command module shares."""

import argparse

import pandas as pd
import pytest

from simkit import cli_common as C
from simkit.cli_errors import CLIError


def test_usage_errors_report_the_message_and_let_other_errors_through():
    with pytest.raises(CLIError, match=r"^bad value$"):
        with C.usage_errors(ValueError):
            raise ValueError("bad value")
    with pytest.raises(CLIError, match=r"^-b x: bad$"):
        with C.usage_errors(ValueError, MemoryError, prefix="-b x: "):
            raise MemoryError("bad")
    with pytest.raises(CLIError, match=r"^--lr must be > 0$"):
        with C.usage_errors(ValueError, rename=lambda m: m.replace("TrainConfig.lr", "--lr")):
            raise ValueError("TrainConfig.lr must be > 0")
    with pytest.raises(CLIError) as err:  # a KeyError's message without str()'s quotes
        with C.usage_errors(KeyError):
            raise KeyError("unknown recipe 'x'")
    assert str(err.value) == "unknown recipe 'x'"
    with pytest.raises(TypeError):
        with C.usage_errors(ValueError):
            raise TypeError("not a usage error")


def test_at_least_names_the_option():
    assert C.at_least(2, "--reps", 2) == 2
    with pytest.raises(CLIError, match=r"^--reps must be >= 2, got 1$"):
        C.at_least(1, "--reps", 2)


def test_check_table_file_checks_the_suffix_then_the_directory(tmp_path):
    C.check_table_file(str(tmp_path / "t.parquet"), "--out")
    with pytest.raises(CLIError, match=r"^--table must end with \.csv or \.parquet, got 'x\.txt'$"):
        C.check_table_file("x.txt", "--table")
    missing = tmp_path / "no" / "t.csv"
    with pytest.raises(CLIError, match=r"^--out .*: directory .* does not exist$"):
        C.check_table_file(str(missing), "--out")
    existing = tmp_path / "t.csv"
    existing.touch()
    with pytest.raises(CLIError, match=r"^--out .* is an existing file, not a directory$"):
        C.check_output_directory(existing, "--out")


def test_save_table_writes_atomically_and_says_where(tmp_path, capsys):
    table = pd.DataFrame({"a": [1, 2], "b": [0.5, 0.25]})
    path = tmp_path / "sub" / "t.csv"  # the directory is created
    assert C.save_table(table, path, announce="wrote {path}") == path
    pd.testing.assert_frame_equal(pd.read_csv(path), table)
    assert capsys.readouterr().err == f"wrote {path}\n"
    C.save_table(table, str(tmp_path / "t.parquet"))
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "t.parquet"), table)
    assert capsys.readouterr().err == f"table written to {tmp_path / 't.parquet'}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub", "t.parquet"]  # no temporaries


def test_table_text_four_significant_digits_or_decimals():
    table = pd.DataFrame({"name": ["x", "y"], "v": [123456.789, 0.000123456], "n": [1, 2]})
    assert [line.split() for line in C.table_text(table).splitlines()] == [
        ["name", "v", "n"],
        ["x", "1.235e+05", "1"],
        ["y", "0.0001235", "2"],
    ]
    assert C.table_text(table, ["v", "missing", "name"]).splitlines()[0].split() == ["v", "name"]
    fixed = C.table_text(pd.DataFrame({"v": [1.23456789, 0.5]}), precision=4).split()
    assert fixed == ["v", "1.2346", "0.5000"]


def test_add_command_keeps_the_description_as_written(capsys):
    parser = argparse.ArgumentParser(prog="simkit")
    sub = parser.add_subparsers(dest="command")
    C.add_command(sub, "demo", help="a demo", description="line one\n  indented two", epilog="ex")
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--help"])
    out = capsys.readouterr().out
    assert "line one\n  indented two\n" in out and out.rstrip().endswith("ex")
