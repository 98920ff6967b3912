"""Grids of experiments: serial, multi-process or Dask execution, crash-safe shards, resume.

A sweep is a :class:`simkit.config.SweepConfig` expanded into cells (:func:`simkit.config.expand`:
one cell = one setting with all of its estimators, keyed by a stable content hash), or a
:class:`simkit.config.TrainSweepConfig` (``kind = "train"``: one cell = one training run of
:func:`simkit.train.train`, its per-step table as the shard). Each cell
is computed by :func:`simkit.config.run_cell`, whose random stream depends only on the cell
((config seed, cell key), or a training run's own seed), so that the table is bit-identical
whatever ran it: serially, on local
processes or on a Dask cluster, in one go or resumed after a crash.

Layout of a sweep directory ``out_dir``::

    config.toml          the sweep's configuration (resuming with a different one is an error)
    cells/<key>.parquet  one shard per finished cell, written atomically (temporary name in the
                         same directory, fsync, then ``os.replace``): a shard either exists
                         complete or not at all, even if the process is killed mid-write
    failures.jsonl       one JSON line per failed attempt: key, params, columns, exception,
                         traceback, host, time (append-only log; a re-run retries the cells)
    .lock                held (``flock``) by the running sweep: two sweeps cannot share a dir

The lock is taken *before* ``config.toml`` is checked or written, so two sweeps started
together on a new directory cannot both pass the check: the second one fails with "in use"
(it does not wait), or, once the first is done, is checked against the config it wrote.

Re-running a sweep skips the cells that have an intact shard and retries the others (failed or
never run). Every shard it would skip is verified first (:func:`simkit.shards.verify_shard`:
parquet footer readable, its ``cell`` column equal to the key, the expected number of rows, one
per estimator or per training step); a damaged one (truncated, zeroed by a careless disk) is
deleted and recomputed, and the summary names it. Shards are written by the driver process
(workers return tables), so a worker never touches the directory and a real cluster needs no
shared filesystem.

:func:`run_sweep` runs a sweep, :func:`load_results` reads its table (sorted in expansion order,
identical for every backend), :func:`load_failures` the cells whose last attempt failed and
:func:`run_config` runs every cell in memory (``simkit run``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import socket
import sys
import time
import traceback as _traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from simkit import config as _config
from simkit._validation import check_output_dir
from simkit.shards import (
    CELLS_DIR,
    SHARD_SUFFIX,
    TMP_MARKER,
    DamagedShardError,
    SweepError,
    atomic_write,
    check_shards,
    expected_rows,
    finished_keys,
    fsync_dir,
    read_shard,
    shard_path,
    verify_shard,
    write_shard,
    write_table,
)

BACKENDS = ("serial", "processes", "dask")
CONFIG_FILE = "config.toml"
FAILURES_FILE = "failures.jsonl"
LOCK_FILE = ".lock"


@dataclass(frozen=True)
class SweepSummary:
    """What :func:`run_sweep` did.

    ``total`` cells in the expansion, ``done_before`` already finished when it started, ``ran``
    finished by this run, ``failed`` failed in this run (listed in ``failed_keys``, details in
    ``failures.jsonl``), ``seconds`` wall time of this run, ``damaged`` the shards found
    damaged on resume (paths; deleted and recomputed by this run, counted in ``ran``).
    """

    out_dir: Path
    total: int
    done_before: int
    ran: int
    failed: int
    failed_keys: tuple[str, ...] = ()
    seconds: float = 0.0
    damaged: tuple[str, ...] = ()

    @property
    def done(self) -> int:
        """Cells with a shard after this run."""
        return self.done_before + self.ran

    @property
    def complete(self) -> bool:
        """True when every cell of the sweep has a shard."""
        return self.done == self.total

    def __str__(self) -> str:
        text = (
            f"{self.total} cells: {self.done_before} done before, {self.ran} ran, "
            f"{self.failed} failed in {self.seconds:.1f} s -> {self.out_dir}"
        )
        if self.damaged:
            text += f"; {len(self.damaged)} damaged shard(s) found and recomputed: " + ", ".join(
                self.damaged
            )
        if self.failed:
            text += f" (tracebacks in {self.out_dir / FAILURES_FILE}; re-run to retry)"
        return text


@dataclass(frozen=True)
class CellOutcome:
    """The result of one cell's attempt, as a worker returns it to the driver.

    ``table`` on success; ``exception`` (``"Type: message"``) and ``traceback`` on failure.
    """

    key: str
    table: pd.DataFrame | None
    exception: str | None
    traceback: str | None
    seconds: float
    host: str


def execute_cell(cell) -> CellOutcome:
    """Run one cell (:func:`simkit.config.run_cell`) and catch its exception, if any.

    Runs on the worker (a process of the pool or a Dask worker): the traceback is formatted
    where it happened. The table is checked to be a non-empty DataFrame with the cell's key.
    """
    start = time.perf_counter()
    try:
        with single_threaded_blas():
            table = _config.run_cell(cell)
        _check_table(table, cell.key)
    except Exception as exc:
        return CellOutcome(
            key=cell.key,
            table=None,
            exception=f"{type(exc).__name__}: {exc}",
            traceback=_traceback.format_exc(),
            seconds=time.perf_counter() - start,
            host=socket.gethostname(),
        )
    return CellOutcome(
        cell.key, table, None, None, time.perf_counter() - start, socket.gethostname()
    )


def single_threaded_blas():
    """A context in which BLAS (OpenBLAS, MKL…) uses one thread (``threadpoolctl``).

    Multi-threaded BLAS splits sums (e.g. the bootstrap's W @ g) differently with different
    thread counts, which changes the last bits of the results: a serial run with all cores'
    threads and a Dask worker (which ``distributed`` starts with ``OPENBLAS_NUM_THREADS=1``)
    would disagree. Every cell therefore runs single-threaded, whatever the backend; the
    parallelism is across cells. Without ``threadpoolctl`` a warning says the tables may then
    differ in the last bits between backends.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is part of the dist extra
        import warnings

        warnings.warn(
            "threadpoolctl is not installed: BLAS thread counts are not pinned, so tables may "
            "differ in the last bits between backends (pip install threadpoolctl)",
            RuntimeWarning,
            stacklevel=3,
        )
        return contextlib.nullcontext()
    return threadpool_limits(limits=1)


def _check_table(table, key: str) -> None:
    if not isinstance(table, pd.DataFrame) or table.empty:
        raise TypeError(f"run_cell must return a non-empty DataFrame, got {type(table).__name__}")
    if "cell" not in table.columns or not (table["cell"] == key).all():
        raise ValueError(f"run_cell's table must have a column 'cell' equal to the key {key!r}")


def _remove_stale_temporaries(out_dir) -> int:
    """Delete temporary shards left by a killed run (only called while holding the lock)."""
    cells = Path(out_dir) / CELLS_DIR
    removed = 0
    stale = [*cells.glob(f"*{SHARD_SUFFIX}{TMP_MARKER}*")]
    stale += Path(out_dir).glob(f"{CONFIG_FILE}{TMP_MARKER}*")
    for p in stale:
        with contextlib.suppress(OSError):
            p.unlink()
            removed += 1
    return removed


@contextlib.contextmanager
def _directory_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``out_dir/.lock`` (released by the OS if killed)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks, no protection
        yield
        return
    fd = os.open(out_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(
                f"{out_dir} is in use by another running sweep (lock {out_dir / LOCK_FILE}); "
                "wait for it to finish or choose another --out directory"
            ) from None
        yield
    finally:
        os.close(fd)


# --- configuration of a sweep directory ----------------------------------------------------------


def _as_config(config_or_path):
    """(validated config, source bytes or None) from a :class:`SweepConfig` or a TOML path.

    Every check of :func:`simkit.config.validate` (unreachable divergence targets included)
    runs here, before any work; errors are :class:`simkit.config.ConfigError` naming the file.
    """
    if isinstance(config_or_path, str | os.PathLike):
        path = Path(config_or_path)
        config = _config.load_config(path, check=False)
        try:
            _config.validate(config)
        except _config.ConfigError as exc:
            raise _config.ConfigError(f"{path}: {exc}") from None
        return config, path.read_bytes()
    if not isinstance(config_or_path, _config.SweepConfig | _config.TrainSweepConfig):
        raise TypeError(
            "config_or_path must be a SweepConfig, a TrainSweepConfig or the path of a TOML "
            f"config file, got {type(config_or_path).__name__}"
        )
    _config.validate(config_or_path)
    return config_or_path, None


def _check_memory(cells, config_or_path) -> None:
    """Refuse, before any cell runs, Monte Carlo batches that cannot fit (:mod:`simkit._memory`).

    Each experiment cell draws its reps × n × T batch at once; a training cell's batches are
    small (one rollout) and are not checked here.
    """
    from simkit._memory import MemoryLimitError, check_samples

    where = f"{config_or_path}: " if isinstance(config_or_path, str | os.PathLike) else ""
    sizes = {}
    for cell in cells:
        p = cell.params
        if "reps" in p and "n" in p:
            T = int(p.get("environment", {}).get("T", 1))
            sizes.setdefault(int(p["reps"]) * int(p["n"]) * T, (int(p["reps"]), int(p["n"]), T))
    if sizes:
        reps, n, T = sizes[max(sizes)]
        try:
            check_samples(reps, n, T)
        except MemoryLimitError as err:
            raise SweepError(f"{where}{err} (in the config: reps, n or T)") from None


def _canonical(config) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))


def _prepare_directory(out_dir: Path, config, source: bytes | None) -> None:
    """Create ``out_dir`` with ``config.toml``, or check that it holds the same config."""
    stored = out_dir / CONFIG_FILE
    if stored.exists():
        try:
            previous = _config.load_config(stored, check=False)
        except Exception as err:
            raise SweepError(
                f"{out_dir} holds a config.toml that cannot be loaded ({err}); choose another "
                "--out directory"
            ) from None
        if _canonical(previous) != _canonical(config):
            diff = _first_difference(previous.to_dict(), config.to_dict())
            raise SweepError(
                f"{out_dir} holds a sweep made with a different config ({diff}); resume it with "
                f"its own config ({stored}) or choose another --out directory"
            )
        return
    if out_dir.exists() and _foreign_entries(out_dir):
        raise SweepError(
            f"{out_dir} is not empty and has no {CONFIG_FILE}: it is not a simkit sweep "
            "directory; choose a new or empty --out directory"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    data = source if source is not None else _config.to_toml(config).encode()
    atomic_write(stored, lambda fh: fh.write(data))
    fsync_dir(out_dir)


def _foreign_entries(out_dir: Path) -> list[str]:
    """Entries of ``out_dir`` other than the lock and a config.toml being written."""
    tmp_config = f"{CONFIG_FILE}{TMP_MARKER}"
    return [
        p.name
        for p in out_dir.iterdir()
        if p.name != LOCK_FILE and not p.name.startswith(tmp_config)
    ]


def _check_not_foreign(out_dir: Path) -> None:
    """Refuse, before creating anything, a non-empty directory that is not a sweep's."""
    if out_dir.is_dir() and not (out_dir / CONFIG_FILE).exists() and _foreign_entries(out_dir):
        raise SweepError(
            f"{out_dir} is not empty and has no {CONFIG_FILE}: it is not a simkit sweep "
            "directory; choose a new or empty --out directory"
        )


def _first_difference(old, new, path: str = "") -> str:
    """A readable description of the first place where two canonical dicts differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in old:
                return f"{where} is new"
            if key not in new:
                return f"{where} was removed"
            if old[key] != new[key]:
                return _first_difference(old[key], new[key], where)
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    return f"{path or 'config'}: was {old!r}, now {new!r}"


# --- failures ----------------------------------------------------------------------------------


def _failure_record(cell, outcome: CellOutcome) -> dict:
    return {
        "key": cell.key,
        "params": cell.params,
        "columns": cell.columns,
        "exception": outcome.exception,
        "traceback": outcome.traceback,
        "host": outcome.host,
        "seconds": outcome.seconds,
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def _append_failure(out_dir: Path, record: dict) -> None:
    line = json.dumps(record, default=str, sort_keys=True) + "\n"
    with open(out_dir / FAILURES_FILE, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def read_failures(out_dir) -> list[dict]:
    """Every record of ``out_dir/failures.jsonl`` in order (a torn last line is skipped)."""
    path = Path(out_dir) / FAILURES_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # killed mid-write: the attempt counts as not recorded
            continue
    return records


def load_failures(out_dir) -> list[dict]:
    """The cells of ``out_dir`` whose last attempt failed and that have no shard yet.

    One record per cell (its latest), in the order of the log.
    """
    done = finished_keys(out_dir)
    latest: dict[str, dict] = {}
    for record in read_failures(out_dir):
        latest.pop(record["key"], None)
        latest[record["key"]] = record
    return [r for k, r in latest.items() if k not in done]


# --- execution ---------------------------------------------------------------------------------


def check_backend(backend: str, workers=None, scheduler=None) -> None:
    """Check a backend / workers / scheduler combination (``ValueError``/``TypeError`` naming
    the argument); see :func:`run_sweep`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise TypeError(f"workers must be a positive int or None, got {workers!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers is not None and backend == "serial":
        raise ValueError("workers applies to backend='processes' or 'dask', not 'serial'")
    if scheduler is not None and backend != "dask":
        raise ValueError(f"scheduler is for backend='dask' only (backend is {backend!r})")
    if scheduler is not None and workers is not None:
        raise ValueError(
            "workers sizes a LocalCluster; with a scheduler the cluster's workers are the ones "
            "started with `dask worker ADDRESS` (leave workers unset)"
        )


def run_sweep(
    config_or_path,
    out_dir,
    backend: str = "serial",
    workers: int | None = None,
    scheduler=None,
    progress: bool = True,
) -> SweepSummary:
    """Run (or resume) a sweep into ``out_dir``; return a :class:`SweepSummary`.

    Parameters
    ----------
    config_or_path : a :class:`simkit.config.SweepConfig` or
        :class:`~simkit.config.TrainSweepConfig`, or the path of its TOML file.
        Validated, and expanded into cells, before any work starts.
    out_dir : the sweep directory (module docstring). Created if needed; if it already holds a
        sweep, that sweep must have the same config (else :class:`SweepError`): finished cells
        are skipped, failed and missing ones are run.
    backend : ``"serial"`` (in this process), ``"processes"`` (a local process pool) or
        ``"dask"`` (a ``distributed`` cluster). All give identical shards.
    workers : pool size for ``"processes"`` and for the Dask ``LocalCluster`` (default
        ``os.cpu_count()``, at most the number of cells to run). Not allowed with a
        ``scheduler``: a real cluster's workers are started with ``dask worker``.
    scheduler : ``"dask"`` only: the scheduler address (``"tcp://host:8786"``) or a
        ``distributed.Client`` to use; ``None`` starts a ``LocalCluster`` (one single-threaded
        worker process per core) for the duration of the sweep.
    progress : tqdm bar (stderr) with cells done, ETA and failures.

    A cell that raises is recorded in ``failures.jsonl`` with its traceback and the sweep goes
    on; ``SweepSummary.failed`` counts them. ``KeyboardInterrupt`` stops the sweep, keeping every
    finished shard.
    """
    check_backend(backend, workers, scheduler)
    start = time.perf_counter()
    _check_out_dir(out_dir)
    config, source = _as_config(config_or_path)
    cells = _config.expand(config)
    _check_memory(cells, config_or_path)
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):  # pragma: no cover - expand() guarantees distinct keys
        raise SweepError("the expansion has repeated cell keys; the config repeats a setting")
    out_dir = Path(out_dir)
    _check_not_foreign(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # the lock first, then the config: two sweeps started together on a new directory cannot
    # both find no config.toml and write theirs (issue 13 §1)
    with _directory_lock(out_dir):
        _prepare_directory(out_dir, config, source)
        _remove_stale_temporaries(out_dir)
        (out_dir / CELLS_DIR).mkdir(exist_ok=True)
        done, damaged = check_shards(out_dir, cells)
        if damaged and progress:
            print(
                f"sweep: {len(damaged)} damaged shard(s) will be recomputed: " + ", ".join(damaged),
                file=sys.stderr,
            )
        todo = [c for c in cells if c.key not in done]
        done_before = len(cells) - len(todo)
        ran, failed = 0, []

        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(cells),
            initial=done_before,
            desc=f"sweep {getattr(config, 'name', '')}".strip(),
            unit="cell",
            disable=not progress or not todo,
            dynamic_ncols=True,
        )
        bar.set_postfix(failed=0, refresh=False)
        try:
            for cell, outcome in _execute(todo, backend, workers, scheduler):
                if outcome.table is not None:
                    write_shard(outcome.table, out_dir, cell.key)
                    ran += 1
                else:
                    _append_failure(out_dir, _failure_record(cell, outcome))
                    failed.append(cell.key)
                    bar.set_postfix(failed=len(failed), refresh=False)
                bar.update(1)
        finally:
            bar.close()
    return SweepSummary(
        out_dir=out_dir,
        total=len(cells),
        done_before=done_before,
        ran=ran,
        failed=len(failed),
        failed_keys=tuple(failed),
        seconds=time.perf_counter() - start,
        damaged=tuple(damaged),
    )


def _check_out_dir(out_dir) -> None:
    """The sweep directory must be (or be creatable as) a writable directory: before any work."""
    try:
        check_output_dir(out_dir, "out_dir")
    except ValueError as err:
        raise SweepError(str(err)) from None


def _execute(cells, backend, workers, scheduler) -> Iterator[tuple[object, CellOutcome]]:
    """Yield ``(cell, outcome)`` as cells finish (completion order) on the chosen backend."""
    if not cells:
        return
    if backend == "serial":
        for cell in cells:
            yield cell, execute_cell(cell)
    elif backend == "processes":
        yield from _execute_processes(cells, workers)
    else:
        yield from _execute_dask(cells, workers, scheduler)


def _lost(cell, exc: BaseException) -> CellOutcome:
    """Outcome of a cell whose worker died or whose result could not be brought back."""
    return CellOutcome(
        key=cell.key,
        table=None,
        exception=f"{type(exc).__name__}: {exc}",
        traceback="".join(_traceback.format_exception(exc)),
        seconds=math.nan,
        host=socket.gethostname(),
    )


def _execute_processes(cells, workers):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    n = min(workers or os.cpu_count() or 1, len(cells))
    # fork is unsafe with threads (tqdm's monitor, BLAS pools); forkserver/spawn start clean
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context(method))
    try:
        futures = {pool.submit(execute_cell, cell): cell for cell in cells}
        for future in as_completed(futures):
            cell = futures[future]
            try:
                outcome = future.result()
            except Exception as exc:  # worker killed (BrokenProcessPool), unpicklable result…
                outcome = _lost(cell, exc)
            yield cell, outcome
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _restore_environ(saved: dict) -> None:
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


def _execute_dask(cells, workers, scheduler):
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError as err:  # pragma: no cover - the dist extra is installed by make test
        raise ImportError(
            "backend='dask' needs the 'dist' extra: pip install 'simkit[dist]'"
        ) from err
    with contextlib.ExitStack() as stack:
        if isinstance(scheduler, Client):
            client = scheduler
        elif scheduler is None:
            # distributed sets OMP/MKL/OPENBLAS_NUM_THREADS=1 (and more) in *this* process's
            # environment for its workers: restore it afterwards
            stack.callback(_restore_environ, dict(os.environ))
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=min(workers or os.cpu_count() or 1, len(cells)),
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=":0",  # a free port: never clashes with another cluster
                )
            )
            client = stack.enter_context(Client(cluster))
        elif isinstance(scheduler, str):
            client = stack.enter_context(Client(scheduler))
        else:
            raise TypeError(
                "scheduler must be an address like 'tcp://host:8786', a distributed.Client or "
                f"None, got {type(scheduler).__name__}"
            )
        futures = {}
        for cell in cells:
            future = client.submit(
                execute_cell, cell, pure=False, key=f"simkit-cell-{cell.key}-{uuid.uuid4().hex[:8]}"
            )
            futures[future] = cell
        try:
            for future in as_completed(list(futures)):
                cell = futures[future]
                try:
                    outcome = future.result()
                except Exception as exc:  # KilledWorker, lost connection…
                    outcome = _lost(cell, exc)
                future.release()
                yield cell, outcome
        finally:
            client.cancel([f for f in futures if not f.done()])


# --- results -----------------------------------------------------------------------------------


def load_results(out_dir, partial: bool = False) -> pd.DataFrame:
    """The sweep's table: every shard of ``out_dir``, concatenated in expansion order.

    The cells are ordered as :func:`simkit.config.expand` lists them (rows within a cell as
    :func:`run_cell` returned them), with a fresh ``RangeIndex``: the same table whatever
    backend, worker count or sequence of interruptions produced the shards. Raises
    :class:`SweepError` if cells are missing, unless ``partial`` (then the finished cells).
    """
    out_dir = Path(out_dir)
    if not (out_dir / CONFIG_FILE).exists():
        raise SweepError(f"{out_dir} is not a simkit sweep directory (no {CONFIG_FILE})")
    cells = _config.expand(_config.load_config(out_dir / CONFIG_FILE, check=False))
    done = finished_keys(out_dir)
    missing = [c.key for c in cells if c.key not in done]
    if missing and not partial:
        failures = load_failures(out_dir)
        raise SweepError(
            f"{out_dir}: {len(missing)} of {len(cells)} cells have no results "
            f"({len(failures)} failed, see {FAILURES_FILE}); resume the sweep, or pass "
            "partial=True (simkit report --partial) for the finished cells"
        )
    frames = [read_shard(shard_path(out_dir, c.key)) for c in cells if c.key in done]
    return concat_tables(frames)


def concat_tables(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate cell tables in the given order with a fresh ``RangeIndex``."""
    if not frames:
        return pd.DataFrame()
    return pd.concat(frames, ignore_index=True)


def run_config(
    config_or_path, progress: bool = True, backend: str = "serial", workers: int | None = None
) -> pd.DataFrame:
    """Run every cell of a config in memory and return the table (``simkit run``).

    The same numbers as :func:`run_sweep` + :func:`load_results` (same cells, same seeds, same
    order), whatever the backend; nothing is written and the first failing cell raises (with
    its worker's traceback). ``backend`` ``"serial"`` runs the cells in this process,
    ``"processes"`` on a pool of ``workers`` local processes (default: all cores, at most one
    per cell): what a figure's ``compute`` uses to spread a grid of training runs over the
    cores without a sweep directory.
    """
    if backend not in ("serial", "processes"):
        raise ValueError(f"run_config backend must be 'serial' or 'processes', got {backend!r}")
    check_backend(backend, workers)
    config, _ = _as_config(config_or_path)
    cells = _config.expand(config)
    _check_memory(cells, config_or_path)
    from tqdm.auto import tqdm

    tables: dict[str, pd.DataFrame] = {}
    bar = tqdm(total=len(cells), desc="cells", unit="cell", disable=not progress)
    try:
        if backend == "serial":
            for cell in cells:
                with single_threaded_blas():
                    table = _config.run_cell(cell)
                _check_table(table, cell.key)
                tables[cell.key] = _parquet_roundtrip(table)
                bar.update(1)
        else:
            for cell, outcome in _execute_processes(cells, workers):
                if outcome.table is None:
                    raise RuntimeError(
                        f"cell {cell.key} ({cell.columns}) failed: {outcome.exception}\n"
                        f"{outcome.traceback}"
                    )
                tables[cell.key] = _parquet_roundtrip(outcome.table)
                bar.update(1)
    finally:
        bar.close()
    return concat_tables([tables[c.key] for c in cells])


def _parquet_roundtrip(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` as it reads back from a shard (same dtypes as :func:`load_results`)."""
    import io

    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False, engine="pyarrow")
    buffer.seek(0)
    return pd.read_parquet(buffer)


__all__ = [
    "BACKENDS",
    "CellOutcome",
    "DamagedShardError",
    "SweepError",
    "SweepSummary",
    "check_backend",
    "concat_tables",
    "execute_cell",
    "expected_rows",
    "finished_keys",
    "load_failures",
    "load_results",
    "read_failures",
    "read_shard",
    "run_config",
    "run_sweep",
    "shard_path",
    "single_threaded_blas",
    "verify_shard",
    "write_shard",
    "write_table",
]
