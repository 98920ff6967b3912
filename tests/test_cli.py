"""simkit.cli: the figures / info / list subcommands."""

import re
import subprocess
import sys

import numpy as np
import pytest

from simkit import cli, figures, mappings


def test_figures_subcommand_writes_files_and_gallery(tmp_path, capsys):
    rc = cli.main(["figures", "kernel_shapes", "--out", str(tmp_path), "--small"])
    assert rc == 0
    assert (tmp_path / "kernel_shapes.png").stat().st_size > 0
    assert (tmp_path / "kernel_shapes.pdf").stat().st_size > 0
    gallery = (tmp_path / "README.md").read_text()
    assert "kernel_shapes.png" in gallery
    err = capsys.readouterr().err
    assert "[1/1] kernel_shapes" in err  # progress per figure


def test_unknown_figure_is_an_error_listing_the_figures(tmp_path, capsys):
    rc = cli.main(["figures", "kernel_shapes", "no_such_figure", "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no_such_figure" in err
    for name in figures.available():
        assert name in err
    assert not (tmp_path / "kernel_shapes.png").exists()  # validated before any work


def test_info_reports_versions(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^\s+numpy\s+{re.escape(np.__version__)}$", out, re.MULTILINE)
    for dist in (
        "simkit",
        "scipy",
        "pandas",
        "matplotlib",
        "arviz-stats",
        "torch",
        "pyarrow",
        "jupytext",
        "distributed",
    ):
        assert dist in out
    report = cli.package_versions()
    assert report["core"]["numpy"] == np.__version__
    assert set(report) == {"core", "lm", "dist", "notebooks", "dev"}


@pytest.mark.parametrize("what", ["mappings", "figures", "shifts"])
def test_list(what, capsys):
    assert cli.main(["list", what]) == 0
    out = capsys.readouterr().out.splitlines()
    if what == "mappings":
        assert [line.split()[0] for line in out] == mappings.available()
    elif what == "figures":
        assert [line.split()[0] for line in out] == figures.available()
    else:
        from simkit import shifts

        assert [line.split()[0] for line in out] == shifts.available()


def test_summary_is_the_first_sentence_on_one_line():
    doc = """First sentence, over
    two lines. Second sentence.

    Another paragraph."""
    assert cli.summary(doc) == "First sentence, over two lines."
    assert cli.summary(None) == ""
    assert len(cli.summary("word " * 100, width=40)) <= 40


def test_usage_errors_and_help(capsys):
    assert cli.main([]) == 2  # a command is required
    assert cli.main(["list", "nothing"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert cli.main(["figures", "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--small" in out


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "simkit", "list", "figures"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kernel_shapes" in proc.stdout


@pytest.mark.parametrize("argv", [["list", "mappings"], ["sweep", "--help"], ["--help"]])
def test_slow_commands_are_imported_only_when_they_run(argv):
    """``simkit train`` and ``simkit diagnose`` import ≈ 1 s of modules: another command's
    parser gets placeholders with the same one-line help (``cli_common.LAZY_HELP``), and the
    full parser is built when the command runs or its --help is asked for."""
    code = (
        "import sys\nfrom simkit import cli\n"
        f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('simkit.train', 'simkit.diagnose') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    imported = out.strip().splitlines()[-1]
    if argv == ["--help"]:  # no command: every subcommand in full
        assert imported == "['simkit.diagnose', 'simkit.train']"
        assert "train     training dynamics" in out and "diagnose  how off-policy" in out
    else:
        assert imported == "[]"
    for name in ("train", "diagnose"):
        parser = cli.build_parser([name])
        sub = next(a for a in parser._actions if a.dest == "command").choices[name]
        assert sub.add_help and len(sub._actions) > 3  # the full parser, with its options
