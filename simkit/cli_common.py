"""What simkit's command modules share: a subcommand with the house help layout, library errors
reported as usage errors, output paths checked before any work, tables printed or written
atomically, and the sweep backend options.

Imported by :mod:`simkit.cli`, :mod:`simkit.train.cli`, :mod:`simkit.lm.cli`,
:mod:`simkit.lm.exact_cli` and :mod:`simkit.diagnose`; it imports none of them (nor anything
heavy at import time), so a command module can use it without an import cycle. Nothing below the
command line imports it (import-linter contract in ``pyproject.toml``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from simkit.cli_errors import CLIError

__all__ = [
    "BACKENDS",
    "TABLE_SUFFIXES",
    "Formatter",
    "add_backend_options",
    "add_command",
    "at_least",
    "check_output_directory",
    "check_table_file",
    "run_sweep_command",
    "save_table",
    "sweep_errors",
    "table_text",
    "usage_errors",
]

#: where the cells of a sweep run (``--backend``)
BACKENDS = ("serial", "processes", "dask")
#: the table files a command writes (``--out``, ``--table``)
TABLE_SUFFIXES = (".csv", ".parquet")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the hand-formatted descriptions and examples as written."""


#: one-line help of the subcommands whose modules are slow to import (``simkit.train`` ≈ 1 s,
#: ``simkit.diagnose`` ≈ 0.6 s), shared by their parsers and the placeholders
#: :func:`simkit.cli.build_parser` registers when another command runs (every ``simkit
#: sweep`` / ``run`` / ``report`` paid these imports before)
LAZY_HELP = {
    "train": "training dynamics: learning curves under staleness and inference mismatch",
    "diagnose": "how off-policy is a trainer's dump, and which correction and threshold to use",
}


def add_command(
    subparsers, name: str, *, help: str, description: str, epilog: str | None = None
) -> argparse.ArgumentParser:
    """Add the subcommand ``name`` with its one-line ``help``, its ``description`` and examples
    (``epilog``) laid out as written (:class:`Formatter`); returns its parser."""
    return subparsers.add_parser(
        name, help=help, formatter_class=Formatter, description=description, epilog=epilog
    )


@contextlib.contextmanager
def usage_errors(
    *errors: type[BaseException], prefix: str = "", rename: Callable[[str], str] | None = None
) -> Iterator[None]:
    """Within the block, an exception of the types ``errors`` becomes a :class:`CLIError` with
    its message (``prefix`` + message, passed through ``rename`` when given, e.g. to name
    options instead of internal fields). A ``KeyError``'s message is its first argument
    (``str(KeyError)`` would quote it)."""
    try:
        yield
    except errors as err:
        if isinstance(err, KeyError) and err.args:
            message = str(err.args[0])
        else:
            message = str(err)
        if rename is not None:
            message = rename(message)
        raise CLIError(prefix + message) from None


def at_least(value: int, option: str, low: int = 1) -> int:
    """``value`` of ``option``, or a :class:`CLIError` ``"{option} must be >= {low}, got …"``."""
    if value < low:
        raise CLIError(f"{option} must be >= {low}, got {value}")
    return value


# --- output files ------------------------------------------------------------------------------


def check_table_file(path: str, option: str) -> None:
    """Before any work: ``path`` (the value of ``option``) ends in .csv or .parquet and can be
    written (its directory exists and is writable), so that no result is lost to a bad path."""
    from simkit._validation import check_output_file

    if not path.endswith(TABLE_SUFFIXES):
        raise CLIError(f"{option} must end with .csv or .parquet, got {path!r}")
    with usage_errors(ValueError):
        check_output_file(path, option)


def check_output_directory(path, option: str) -> None:
    """Before any work: ``path`` (the value of ``option``) is, or can be created as, a writable
    directory (:func:`simkit._validation.check_output_dir`)."""
    from simkit._validation import check_output_dir

    with usage_errors(ValueError):
        check_output_dir(path, option)


def save_table(table, path, announce: str = "table written to {path}") -> Path:
    """Write ``table`` to ``path`` (.csv, else parquet) atomically — never a half-written file
    (:func:`simkit.shards.write_table`) — creating its directory, and say so on stderr
    (``announce`` with ``{path}``)."""
    from simkit.shards import write_table

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    written = write_table(table, path)
    print(announce.format(path=path), file=sys.stderr)
    return written


def table_text(table, columns=None, *, precision: int | None = None) -> str:
    """``table`` as text without its index: the ``columns`` present in it (default all); floats
    with 4 significant digits, or with ``precision`` decimals as pandas formats them."""
    import pandas as pd

    if columns is not None:
        table = table[[c for c in columns if c in table.columns]]
    if precision is None:
        return table.to_string(index=False, float_format=lambda v: f"{v:.4g}")
    with pd.option_context("display.precision", precision):
        return table.to_string(index=False)


# --- sweeps ------------------------------------------------------------------------------------


def sweep_errors() -> tuple[type[Exception], ...]:
    """The errors of a bad config or sweep directory (reported as usage errors)."""
    from simkit.config import ConfigError
    from simkit.sweep import SweepError

    return (ConfigError, SweepError)


def add_backend_options(group) -> None:
    """``--backend``, ``--workers``, ``--scheduler``: where the cells of a sweep run."""
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default="serial",
        help="where cells run (default: %(default)s)",
    )
    group.add_argument("--workers", type=int, metavar="N", help="processes / LocalCluster workers")
    group.add_argument(
        "--scheduler", metavar="ADDRESS", help="Dask scheduler, e.g. tcp://host:8786"
    )


def run_sweep_command(config, out, args):
    """:func:`simkit.sweep.run_sweep` of ``config`` into ``out`` with the backend options and
    ``--no-progress`` of ``args``, the backend and ``--out`` checked before any work; returns
    the sweep's summary."""
    from simkit import sweep

    with usage_errors(TypeError, ValueError):
        sweep.check_backend(args.backend, args.workers, args.scheduler)
    check_output_directory(out, "--out")  # run_sweep checks it too, naming it out_dir
    with usage_errors(*sweep_errors()):
        return sweep.run_sweep(
            config,
            out,
            backend=args.backend,
            workers=args.workers,
            scheduler=args.scheduler,
            progress=not args.no_progress,
        )
