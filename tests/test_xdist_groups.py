"""``make test`` runs ``pytest -n 2 --dist loadgroup``: the tests of one ``xdist_group`` must
run on one worker (the "site" group executes the notebooks, then builds the website once for
the browser tests; split over two workers, the site is built twice). pytest-xdist 3.8 marks
the group in ``item._nodeid``, which pytest 9.1+ ignores, so the groups were silently lost;
pyproject.toml pins ``pytest<9.1``. This test runs a small grouped suite in a subprocess and
fails whenever the grouping does not take effect."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("xdist", reason="needs pytest-xdist (the dev extra)")

GROUPED = """
import os
from pathlib import Path

import pytest


@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    out = Path(os.environ["GROUP_OUT"]) / f"worker-{i}.txt"
    out.write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
"""


PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist"]


def test_one_group_runs_on_one_worker(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_grouped.py").write_text(GROUPED)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [*PYTEST, "-n", "2", "--dist", "loadgroup", str(suite)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "GROUP_OUT": str(out), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(out.glob("worker-*.txt"))
    workers = {p.read_text() for p in files}
    assert len(files) == 6 and "none" not in workers, workers
    assert len(workers) == 1, (
        f"the xdist_group ran on workers {sorted(workers)}: --dist loadgroup did not group "
        f"(pytest {pytest.__version__})"
    )
