"""simkit.sweep: backends give identical tables, crash safety, resume, failures, validation."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import simkit
from simkit import config as simkit_config
from simkit import sweep
from simkit.config import ConfigError, SweepConfig

# A tiny bandit sweep: 2 targets x 2 batch sizes = 4 cells, exact and Monte Carlo rows
# (snis is batch dependent), a hyperparameter grid; well under a second per backend.
TINY = """
name = "tiny"
seed = 7
n = [8, 16]
reps = 30
n_boot = 50

[environment]
kind = "bandit"
K = 5
seed = 2

[behaviour]
family = "logit_noise"
divergence = "chi2"
targets = [0.2, 1.0]

[[estimators]]
mapping = "naive"

[[estimators]]
mapping = "tis_token"
grid = { c_high = [1.5, 3.0] }

[[estimators]]
mapping = "snis"
"""

# Monte Carlo cells that each take a noticeable time (~0.3 s): 8 cells.
SLOW = """
name = "slow"
seed = 3
n = [64]
reps = 1000
n_boot = 500
exact = false

[environment]
kind = "bandit"
K = 8
seed = 1

[behaviour]
family = "logit_noise"
divergence = "chi2"
targets = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]

[[estimators]]
mapping = "naive"

[[estimators]]
mapping = "is_seq"

[[estimators]]
mapping = "snis"
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write(tmp_path / "tiny.toml", TINY)


def shards(out_dir) -> list[Path]:
    return sorted((Path(out_dir) / "cells").glob("*.parquet"))


# --- identical tables ---------------------------------------------------------------------------


def test_serial_processes_and_dask_give_identical_tables(tiny, tmp_path):
    runs = {
        "serial": {},
        "processes": {"workers": 2},
        "dask": {"workers": 2},  # run_sweep's own LocalCluster of 2 worker processes
    }
    tables = {}
    for backend, kwargs in runs.items():
        out = tmp_path / backend
        summary = sweep.run_sweep(tiny, out, backend=backend, progress=False, **kwargs)
        assert (summary.total, summary.done_before, summary.ran, summary.failed) == (4, 0, 4, 0)
        assert summary.complete
        tables[backend] = sweep.load_results(out)
    serial = tables["serial"]
    for backend in ("processes", "dask"):
        pd.testing.assert_frame_equal(tables[backend], serial, check_exact=True)
    # in memory (simkit run) gives the same table too
    pd.testing.assert_frame_equal(sweep.run_config(tiny, progress=False), serial, check_exact=True)

    cells = simkit_config.expand(simkit_config.load_config(tiny))
    assert list(dict.fromkeys(serial["cell"])) == [c.key for c in cells]  # expansion order
    assert len(serial) == 4 * 4  # 4 cells x 4 estimators (naive, 2 tis_token, snis)
    assert set(serial["simkit_version"]) == {simkit.__version__}
    for col in ("env", "target", "n", "bias", "variance", "mse", "cosine", "exact"):
        assert col in serial.columns
    assert not serial["exact"].all() and serial["exact"].any()  # both paths present


def test_cell_tables_do_not_depend_on_which_cells_run_together(tiny, tmp_path):
    """A cell's numbers depend on (seed, key) only: running it alone gives the same rows."""
    full = sweep.load_results(_run(tiny, tmp_path / "full"))
    cells = simkit_config.expand(simkit_config.load_config(tiny))
    alone = sweep.execute_cell(cells[2])
    assert alone.exception is None
    rows = full[full["cell"] == cells[2].key].reset_index(drop=True)
    pd.testing.assert_frame_equal(sweep._parquet_roundtrip(alone.table), rows, check_exact=True)


def _run(config, out, **kwargs):
    sweep.run_sweep(config, out, progress=False, **kwargs)
    return out


# --- crash safety and resume --------------------------------------------------------------------


def test_sigkill_midway_then_resume_gives_the_uninterrupted_table(tmp_path):
    config = write(tmp_path / "slow.toml", SLOW)
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "simkit", "sweep", str(config), "--out", str(out), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    try:
        while len(shards(out)) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no shard written within 120 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    written = shards(out)
    assert 2 <= len(written) < 8, "the sweep must be killed midway"
    for path in written:  # every shard is complete and readable
        assert len(pd.read_parquet(path)) == 3
    assert sweep.finished_keys(out) == {p.stem for p in written}  # temporaries never count

    summary = sweep.run_sweep(config, out, progress=False)
    assert summary.done_before == len(written)
    assert summary.ran == 8 - len(written) and summary.failed == 0 and summary.complete
    assert not [p for p in (out / "cells").iterdir() if not p.name.endswith(".parquet")]
    resumed = sweep.load_results(out)

    uninterrupted = sweep.load_results(_run(config, tmp_path / "clean"))
    pd.testing.assert_frame_equal(resumed, uninterrupted, check_exact=True)
    assert len(resumed) == 8 * 3
    assert not resumed.duplicated(["cell", "estimator"]).any()


def test_rerun_skips_finished_cells(tiny, tmp_path):
    out = _run(tiny, tmp_path / "out")
    mtimes = {p: p.stat().st_mtime_ns for p in shards(out)}
    again = sweep.run_sweep(tiny, out, progress=False)
    assert (again.done_before, again.ran, again.failed) == (4, 0, 0)
    assert {p: p.stat().st_mtime_ns for p in shards(out)} == mtimes  # nothing rewritten


def test_missing_shard_is_recomputed_identically(tiny, tmp_path):
    out = _run(tiny, tmp_path / "out")
    before = sweep.load_results(out)
    shards(out)[1].unlink()
    summary = sweep.run_sweep(tiny, out, progress=False)
    assert (summary.done_before, summary.ran) == (3, 1)
    pd.testing.assert_frame_equal(sweep.load_results(out), before, check_exact=True)


def test_stale_temporary_shards_are_ignored_and_cleaned(tiny, tmp_path):
    out = tmp_path / "out"
    summary = sweep.run_sweep(tiny, out, progress=False)
    key = sweep.load_results(out)["cell"].iloc[0]
    sweep.shard_path(out, key).unlink()
    stale = out / "cells" / f"{key}.parquet.tmp-deadbeef0000"
    stale.write_bytes(b"PAR1 half written")  # what a kill during a write leaves behind
    assert key not in sweep.finished_keys(out)
    with pytest.raises(sweep.SweepError, match="1 of 4 cells have no results"):
        sweep.load_results(out)
    summary = sweep.run_sweep(tiny, out, progress=False)
    assert summary.ran == 1
    assert not stale.exists()


def test_write_shard_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    table = pd.DataFrame({"cell": ["k"], "x": [1.0]})

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(sweep.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        sweep.write_shard(table, tmp_path, "k")
    assert list((tmp_path / "cells").iterdir()) == []  # neither the shard nor a temporary
    monkeypatch.undo()
    path = sweep.write_shard(table, tmp_path, "k")
    pd.testing.assert_frame_equal(pd.read_parquet(path), table)


# --- failures -----------------------------------------------------------------------------------


def _failing_on(key, real_run_cell):
    def run_cell(cell, progress=False):
        if cell.key == key:
            raise RuntimeError(f"boom in cell {cell.key}")
        return real_run_cell(cell)

    return run_cell


def test_a_failing_cell_is_recorded_and_retried(tiny, tmp_path, monkeypatch):
    cells = simkit_config.expand(simkit_config.load_config(tiny))
    bad = cells[1].key
    monkeypatch.setattr(simkit_config, "run_cell", _failing_on(bad, simkit_config.run_cell))
    out = tmp_path / "out"
    summary = sweep.run_sweep(tiny, out, progress=False)
    assert (summary.ran, summary.failed, summary.failed_keys) == (3, 1, (bad,))
    assert not summary.complete and "failures.jsonl" in str(summary)
    assert {p.stem for p in shards(out)} == {c.key for c in cells} - {bad}

    (record,) = sweep.load_failures(out)
    assert record["key"] == bad
    assert record["params"] == cells[1].params and record["columns"] == cells[1].columns
    assert record["exception"] == f"RuntimeError: boom in cell {bad}"
    assert "Traceback (most recent call last)" in record["traceback"]
    assert "in run_cell" in record["traceback"]
    with pytest.raises(sweep.SweepError, match="1 failed"):
        sweep.load_results(out)
    assert len(sweep.load_results(out, partial=True)) == 3 * 4

    monkeypatch.undo()  # the cause is fixed: a re-run retries the failed cell only
    summary = sweep.run_sweep(tiny, out, progress=False)
    assert (summary.done_before, summary.ran, summary.failed) == (3, 1, 0)
    assert sweep.load_failures(out) == []
    assert len(sweep.read_failures(out)) == 1  # the log keeps the history
    clean = sweep.load_results(_run(tiny, tmp_path / "clean"))
    pd.testing.assert_frame_equal(sweep.load_results(out), clean, check_exact=True)


def test_a_failing_cell_on_dask_is_recorded_and_the_sweep_continues(tiny, tmp_path, monkeypatch):
    """Through a user-supplied Client; threads (processes=False) see the patched run_cell."""
    from distributed import Client, LocalCluster

    cells = simkit_config.expand(simkit_config.load_config(tiny))
    bad = cells[3].key
    monkeypatch.setattr(simkit_config, "run_cell", _failing_on(bad, simkit_config.run_cell))
    out = tmp_path / "out"
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        summary = sweep.run_sweep(tiny, out, backend="dask", scheduler=client, progress=False)
    assert (summary.ran, summary.failed) == (3, 1)
    (record,) = sweep.load_failures(out)
    assert record["key"] == bad and "boom" in record["traceback"]


def test_a_torn_failure_line_is_skipped(tmp_path):
    log = tmp_path / sweep.FAILURES_FILE
    log.write_text(json.dumps({"key": "a", "exception": "E: x"}) + "\n" + '{"key": "b", "exc')
    assert [r["key"] for r in sweep.read_failures(tmp_path)] == ["a"]


# --- validation before any work -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("reps = 30", "reps = 30\nrepz = 3"), "repz"),
        (lambda t: t.replace("reps = 30", 'reps = "many"'), "reps"),
        (lambda t: t.replace("n = [8, 16]", "n = [8, -16]"), "n"),
        (lambda t: t.replace('mapping = "naive"', 'mapping = "ppo"'), "ppo_clip"),
        (
            lambda t: t.replace('divergence = "chi2"', 'divergence = "tv"').replace(
                "targets = [0.2, 1.0]", "targets = [0.2, 0.9999]"
            ),
            "largest reachable",
        ),
    ],
    ids=["unknown-key", "wrong-type", "negative-n", "unknown-mapping", "unreachable-target"],
)
def test_bad_config_fails_before_any_work(tmp_path, edit, message):
    config = write(tmp_path / "bad.toml", edit(TINY))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=message) as info:
        sweep.run_sweep(config, out, progress=False)
    assert "bad.toml" in str(info.value)  # names the file too
    assert not out.exists()  # nothing written: no directory, no config, no shard


def test_resuming_with_a_different_config_is_an_error(tiny, tmp_path):
    out = _run(tiny, tmp_path / "out")
    other = write(tmp_path / "other.toml", TINY.replace("seed = 7", "seed = 8"))
    with pytest.raises(sweep.SweepError, match=r"different config \(seed: was 7, now 8\)"):
        sweep.run_sweep(other, out, progress=False)
    assert len(shards(out)) == 4
    # the same config as a SweepConfig object resumes fine
    same = SweepConfig.from_dict(simkit_config.load_config(tiny).to_dict())
    assert sweep.run_sweep(same, out, progress=False).done_before == 4


def test_a_non_sweep_directory_is_refused(tiny, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    with pytest.raises(sweep.SweepError, match="not a simkit sweep directory"):
        sweep.run_sweep(tiny, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


def test_a_config_object_writes_a_loadable_config_toml(tiny, tmp_path):
    config = simkit_config.load_config(tiny)
    out = _run(config, tmp_path / "out")
    assert simkit_config.load_config(out / "config.toml").to_dict() == config.to_dict()


def test_two_sweeps_cannot_share_a_directory(tiny, tmp_path):
    fcntl = pytest.importorskip("fcntl")
    out = _run(tiny, tmp_path / "out")
    fd = os.open(out / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(sweep.SweepError, match="in use by another running sweep"):
            sweep.run_sweep(tiny, out, progress=False)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"backend": "threads"}, ValueError, "backend must be one of"),
        ({"backend": "processes", "workers": 0}, ValueError, "workers must be >= 1"),
        ({"backend": "processes", "workers": 1.5}, TypeError, "workers must be"),
        ({"backend": "serial", "workers": 2}, ValueError, "not 'serial'"),
        ({"backend": "processes", "scheduler": "tcp://x:8786"}, ValueError, "dask' only"),
        (
            {"backend": "dask", "scheduler": "tcp://x:8786", "workers": 2},
            ValueError,
            "dask worker",
        ),
    ],
)
def test_backend_arguments_are_checked(tiny, tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        sweep.run_sweep(tiny, tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_cells_do_not_depend_on_the_number_of_blas_threads(tmp_path):
    """Multi-threaded BLAS changes the last bits of the bootstrap sums; cells pin it to one
    thread so that a serial run (all cores' threads) equals a Dask worker (one thread)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    config = write(tmp_path / "slow.toml", SLOW)
    cell = simkit_config.expand(simkit_config.load_config(config))[0]
    outcomes = []
    for threads in (1, max(os.cpu_count() or 1, 2)):
        with threadpoolctl.threadpool_limits(limits=threads):
            outcomes.append(sweep.execute_cell(cell))
    pd.testing.assert_frame_equal(outcomes[0].table, outcomes[1].table, check_exact=True)


def test_a_local_dask_cluster_leaves_the_environment_as_it_was(tiny, tmp_path):
    before = dict(os.environ)
    sweep.run_sweep(tiny, tmp_path / "out", backend="dask", workers=1, progress=False)
    assert dict(os.environ) == before
