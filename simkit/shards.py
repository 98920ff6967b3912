"""Shards of a sweep directory: atomic writes, verification on resume, reading back.

A shard ``cells/<key>.parquet`` is one finished cell's table (:mod:`simkit.sweep`). It is
written atomically (:func:`write_shard`: temporary name in the same directory, fsync,
``os.replace``, fsync of the directory), so a killed process leaves a complete shard or none;
a careless disk can still tear one, so a resume verifies every shard it would skip
(:func:`verify_shard`: parquet footer readable, ``cell`` column equal to the key, the expected
number of rows) and :func:`check_shards` deletes the damaged ones for recomputation.
:func:`read_shard` turns an unreadable shard into a :class:`DamagedShardError` naming the file
and what to do; :func:`write_table` writes any table file (``simkit run --out``, reports) the
same atomic way, through :func:`atomic_write` (also used for a sweep's ``config.toml`` and a
training run's checkpoints and chunks).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pandas as pd

CELLS_DIR = "cells"
SHARD_SUFFIX = ".parquet"
#: temporary files are ``<name>.tmp-<random>``: never matched by ``*.parquet``
TMP_MARKER = ".tmp-"


class SweepError(ValueError):
    """A sweep directory cannot be used as asked (different config, busy, not a sweep dir…)."""


class DamagedShardError(SweepError):
    """A shard of a sweep directory cannot be read (torn, truncated or not the cell's)."""


def shard_path(out_dir, key: str) -> Path:
    """``out_dir/cells/<key>.parquet``."""
    return Path(out_dir) / CELLS_DIR / f"{key}{SHARD_SUFFIX}"


def finished_keys(out_dir) -> set[str]:
    """Keys of the cells of ``out_dir`` that have a shard (temporary files are not shards)."""
    cells = Path(out_dir) / CELLS_DIR
    if not cells.is_dir():
        return set()
    return {p.name[: -len(SHARD_SUFFIX)] for p in cells.glob(f"*{SHARD_SUFFIX}") if p.is_file()}


def verify_shard(path, key: str, rows: int | None = None) -> str | None:
    """Why the shard ``path`` of cell ``key`` is damaged, or None if it is intact.

    Reads the parquet footer and the ``cell`` column only (cheap): a truncated or zeroed file
    has no footer ("magic bytes not found"); a shard whose rows are not all the cell's, that
    has no row, or (``rows`` given) not the expected number of rows, is not the cell's result.
    """
    import pyarrow.parquet as pq

    try:
        column = pq.read_table(path, columns=["cell"]).column("cell").to_pylist()
    except Exception as exc:  # ArrowInvalid, OSError, KeyError (no 'cell' column)…
        return f"{type(exc).__name__}: {exc}"
    if not column:
        return "it has no rows"
    if any(v != key for v in column):
        return f"its 'cell' column is not the key {key!r}"
    if rows is not None and len(column) != rows:
        return f"it has {len(column)} rows, expected {rows}"
    return None


def expected_rows(cell) -> int | None:
    """Rows of a finished cell's table: one per estimator (experiment), one per step (training
    run); None if the cell's parameters do not say."""
    params = cell.params
    train = params.get("train")
    if isinstance(train, dict) and isinstance(train.get("steps"), int):
        return train["steps"]
    if isinstance(params.get("estimators"), list) and params["estimators"]:
        return len(params["estimators"])
    return None


def read_shard(path, key: str | None = None) -> pd.DataFrame:
    """Read one shard; :class:`DamagedShardError` naming the file and what to do if it cannot."""
    try:
        return pd.read_parquet(path)
    except Exception as exc:
        raise DamagedShardError(
            f"shard {path} is damaged and cannot be read ({type(exc).__name__}: {exc}); "
            "re-run the same 'simkit sweep CONFIG --out DIR' (or 'simkit train CONFIG --out "
            "DIR') command: it checks every shard and recomputes the damaged ones"
        ) from None


def atomic_write(path, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``path`` atomically: ``write(fh)`` into ``<name>.tmp-<random>`` in the same
    directory, flush, fsync, then ``os.replace`` (atomic on POSIX and Windows); the temporary
    file is removed if anything fails. A reader, or a resume after a crash, sees the previous
    file or the complete new one, never a part. Returns ``path``."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TMP_MARKER}{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def write_shard(table: pd.DataFrame, out_dir, key: str) -> Path:
    """Write ``table`` as ``cells/<key>.parquet`` atomically; return the path.

    The bytes go to ``<key>.parquet.tmp-<random>`` in the same directory, are flushed and
    fsynced, then ``os.replace`` renames the file (atomic on POSIX and Windows): a reader, or a
    resume after a crash, sees either the complete shard or none.
    """
    final = shard_path(out_dir, key)
    final.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(final, lambda fh: table.to_parquet(fh, index=False, engine="pyarrow"))
    fsync_dir(final.parent)
    return final


def write_table(table: pd.DataFrame, path) -> Path:
    """Write ``table`` to ``path`` (``.csv``, else parquet) atomically, as :func:`write_shard`
    does: a killed process leaves the previous file or the complete new one, never a part."""
    path = Path(path)

    def write(fh):
        if path.suffix == ".csv":
            fh.write(table.to_csv(index=False).encode("utf-8"))
        else:
            table.to_parquet(fh, index=False, engine="pyarrow")

    return atomic_write(path, write)


def fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_shards(out_dir: Path, cells) -> tuple[set[str], list[str]]:
    """(keys with an intact shard, paths of the damaged shards, which are deleted)."""
    done, damaged = set(), []
    present = finished_keys(out_dir)
    for cell in cells:
        key = cell.key
        if key not in present:
            continue
        path = shard_path(out_dir, key)
        if verify_shard(path, key, expected_rows(cell)) is None:
            done.add(key)
        else:
            damaged.append(str(path))
            with contextlib.suppress(OSError):
                path.unlink()
    return done, damaged


__all__ = [
    "CELLS_DIR",
    "SHARD_SUFFIX",
    "TMP_MARKER",
    "DamagedShardError",
    "SweepError",
    "check_shards",
    "expected_rows",
    "finished_keys",
    "fsync_dir",
    "read_shard",
    "shard_path",
    "verify_shard",
    "write_shard",
    "write_table",
]
