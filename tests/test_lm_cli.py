"""``simkit lm …`` (simkit.lm.cli), through its own parser, on the tiny model."""

import argparse

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit.cli import CLIError  # noqa: E402
from simkit.lm import cli as lm_cli  # noqa: E402
from simkit.lm import mismatch, models, tasks  # noqa: E402


def parser():
    p = argparse.ArgumentParser(prog="simkit")
    sub = p.add_subparsers(dest="command", required=True)
    lm_cli.register(sub)
    return p


def run(argv):
    args = parser().parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["lm", "--help"], ["mismatch", "study", "compare", "examples:"]),
        (["lm", "study", "--help"], ["temperature:1.3", "staleness:4", "--params", "examples:"]),
        (["lm", "mismatch", "--help"], ["top_p:0.9", "precision:bf16", "examples:"]),
        (["lm", "compare", "--help"], ["Spearman", "--plot", "examples:"]),
    ],
)
def test_help_texts_teach(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in expected:
        assert text in out, text


def test_mismatch_prints_and_writes_the_measurement(tmp_path, capsys):
    out = tmp_path / "mm.csv"
    argv = ["lm", "mismatch", "-b", "temperature:1.3", "-b", "on_policy", "-T", "3", "--n", "8"]
    assert run([*argv, "--out", str(out)]) == 0
    table = pd.read_csv(out)
    assert list(table.spec) == ["temperature:1.3", "on_policy"]
    assert table.chi2_tok.iloc[1] < 1e-12 and table.chi2_tok.iloc[0] > 0.01
    assert "temperature:1.3" in capsys.readouterr().out
    # the same numbers as the library call with the CLI's defaults (seed 0, token task)
    model = models.tiny_llama(dtype=torch.float64, init_std=1.0, seed=0)
    task = tasks.TokenTask(vocab_size=64, target=58, n_prompts=8)
    rep = mismatch.measure(model, "temperature:1.3", task, n=8, max_new_tokens=3, seed=0)
    assert table.chi2_tok.iloc[0] == pytest.approx(rep.chi2_tok, rel=1e-12)


def test_study_writes_the_tidy_table(tmp_path, capsys):
    out = tmp_path / "study.parquet"
    argv = ["lm", "study", "-b", "temperature:1.5", "--mappings", "naive,is_seq", "-T", "3"]
    argv += ["--n", "4", "--reps", "3", "--n-ref", "8", "--n-pilot", "8", "--out", str(out)]
    assert run(argv) == 0
    table = pd.read_parquet(out)
    assert list(table.mapping) == ["naive", "is_seq"]
    assert (table.behaviour == "temperature").all() and (table.strength == 1.5).all()
    for col in ("bias", "bias_lo", "variance", "cosine", "snr", "ess", "chi2_tok", "ref_se"):
        assert np.isfinite(table[col]).all(), col
    captured = capsys.readouterr()
    assert "J(pi) =" in captured.err and "is_seq" in captured.out


def test_compare_prints_agreement_and_draws(tmp_path, capsys):
    out, plot = tmp_path / "cmp.csv", tmp_path / "cmp.png"
    argv = ["lm", "compare", "-b", "temperature:1.4", "-T", "3", "--prompts", "4"]
    argv += ["--mappings", "naive,is_token,is_seq,ppo_clip,tis_seq", "--twin-v", "2"]
    argv += ["--n", "4", "--reps", "4", "--n-ref", "16", "--n-pilot", "8", "--twin-reps", "20"]
    assert run([*argv, "--out", str(out), "--plot", str(plot)]) == 0
    table = pd.read_csv(out)
    assert set(table.mapping) == {"naive", "is_token", "is_seq", "ppo_clip", "tis_seq"}
    assert table.loc[table.mapping == "naive", "measured_rel_variance"].iloc[0] == 1.0
    assert "rho" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["lm", "study", "--mappings", "naive,nope"], "unknown mapping"),
        (["lm", "study", "-b", "warp:2"], "available: temperature"),
        (["lm", "study", "-b", "temperature:-1"], "tau must be > 0"),
        (["lm", "study", "--task", "keyword"], "needs a tokenizer"),
        (["lm", "study", "--out", "x.txt"], r"\.csv or \.parquet"),
        (["lm", "study", "--reps", "1"], "--reps must be >= 2"),
        (["lm", "mismatch", "-b", "on_policy", "--target", "99"], r"token id in \[0, 64\)"),
        (["lm", "compare", "-b", "temperature:1.2", "--plot", "x.svg"], r"\.png or \.pdf"),
    ],
)
def test_bad_arguments_name_the_problem(argv, message):
    with pytest.raises(CLIError, match=message):
        run(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_device_is_a_clear_error():
    with pytest.raises(CLIError, match="no CUDA device"):
        run(["lm", "study", "--device", "cuda"])


@pytest.mark.parametrize(
    ("argv", "behaviour"),
    [
        (["lm", "study"], "on_policy"),
        (["lm", "dump", "--out", "d.parquet"], "temperature:1.3"),
        (["lm", "exact"], None),  # run_exact's default: temperature:1.3
        (
            ["lm", "compare", "-b", "top_p:0.9", "-b", "temperature:2"],
            ["top_p:0.9", "temperature:2"],
        ),
    ],
)
def test_behaviour_defaults_and_repeats(argv, behaviour):
    assert parser().parse_args(argv).behaviour == behaviour


@pytest.mark.parametrize("command", ["mismatch", "compare"])
def test_a_behaviour_is_required_where_there_is_no_default(command, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["lm", command])
    assert exc.value.code == 2 and "--behaviour" in capsys.readouterr().err


def test_study_size_options_name_study_arguments_and_comparison_fields():
    import dataclasses
    import inspect

    from simkit.figures import _lm_vs_sim_mc
    from simkit.lm import study

    arguments = inspect.signature(study.gradient_study).parameters
    fields = {f.name for f in dataclasses.fields(_lm_vs_sim_mc.config())}
    for command in ("study", "compare"):
        args = parser().parse_args(["lm", command, "-b", "on_policy"])
        for name in lm_cli.STUDY_SIZES:
            assert hasattr(args, name) and name in arguments and name in fields, (command, name)
