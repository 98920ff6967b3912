"""Command line entry point: ``simkit …`` (also ``python -m simkit …``).

Subcommands (each defined by an ``_add_<name>(subparsers)`` function registered in
``SUBCOMMANDS``; a new subcommand is one more function and one more entry):

- ``simkit run CONFIG [--out FILE]`` — every cell of a sweep config, serially in memory;
- ``simkit sweep CONFIG --out DIR [--backend …]`` — a resumable sweep (:mod:`simkit.sweep`);
- ``simkit report DIR`` — merged table and standard plots of a sweep directory;
- ``simkit figures [NAME …] [--out DIR] [--small]`` — regenerate figures and the gallery;
- ``simkit info`` — versions of simkit and its dependencies, installed optional extras;
- ``simkit list mappings|figures|shifts`` — what the registries contain;
- ``simkit schema [experiment|train]`` — the JSON Schema of a sweep config.

``main(argv)`` returns the exit status (0 success, 2 usage error) instead of exiting, so that it
can be called from tests and notebooks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from simkit.cli_common import (
    LAZY_HELP,
    Formatter,
    add_backend_options,
    add_command,
    check_table_file,
    run_sweep_command,
    save_table,
    sweep_errors,
    table_text,
    usage_errors,
)
from simkit.cli_errors import CLIError

PROG = "simkit"

#: core dependencies reported by ``simkit info`` (distribution names)
CORE_PACKAGES = ("numpy", "scipy", "pandas", "matplotlib", "tqdm", "arviz-stats", "pydantic")
#: optional extras: extra name -> distributions (import names are looked up by find_spec)
OPTIONAL_PACKAGES = {
    "lm": ("torch", "transformers", "gguf"),
    "dist": ("dask", "distributed", "pyarrow", "joblib"),
    "notebooks": (
        "jupyter",
        "jupytext",
        "nbclient",
        "nbformat",
        "ipykernel",
        "ipywidgets",
        "nbmake",
    ),
    "dev": ("pytest", "pytest-xdist", "hypothesis", "ruff", "import-linter", "jsonschema"),
}


# --- figures -----------------------------------------------------------------------------------


def _add_figures(subparsers) -> None:
    p = add_command(
        subparsers,
        "figures",
        help="regenerate paper-style figures (PNG + PDF) and the gallery README",
        description=(
            "Compute and draw figures, writing <out>/<name>.png and <out>/<name>.pdf\n"
            "(byte-for-byte reproducible) and regenerating <out>/README.md, the gallery.\n"
            "Without names every figure is made. --small (or SIMKIT_SMALL=1) uses reduced\n"
            "sizes: fast, for tests and quick looks. 'simkit list figures' lists the names.\n"
            "Each figure's data is cached under a hash of its config and of the code it\n"
            "imports (.simkit-cache/ or $SIMKIT_CACHE_DIR): an unchanged figure is copied from\n"
            "the cache, a changed one recomputed; --force recomputes all. Figures run in\n"
            "parallel; <out>/MANIFEST.json records what each file was made from."
        ),
        epilog=(
            "examples:\n"
            "  simkit figures --out figures              # all figures, full size\n"
            "  simkit figures kernel_shapes --small      # one figure, quick\n"
        ),
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="figure names (default: all)")
    p.add_argument(
        "--out", default="figures", metavar="DIR", help="output directory (default: %(default)s)"
    )
    p.add_argument("--small", action="store_true", help="reduced sizes (fast)")
    p.add_argument(
        "--force", action="store_true", help="ignore the cache: recompute every figure's data"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default: the CPUs available; 1: in this process)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="figure-data cache (default: $SIMKIT_CACHE_DIR or .simkit-cache)",
    )
    p.set_defaults(func=_run_figures)


def _run_figures(args) -> int:
    from simkit import figures

    names = list(dict.fromkeys(args.names)) or figures.available()
    unknown = [n for n in names if n not in figures.FIGURES]
    if unknown:
        raise CLIError(
            f"unknown figure(s) {', '.join(map(repr, unknown))}; "
            f"available figures: {', '.join(figures.available())}"
        )
    if args.jobs is not None and args.jobs < 1:
        raise CLIError(f"--jobs must be at least 1, got {args.jobs}")
    start = time.perf_counter()
    results = figures.build(
        names,
        args.out,
        small=args.small,
        force=args.force,
        jobs=args.jobs,
        cache_dir=args.cache_dir,
    )
    counts = {s: sum(r.status == s for r in results) for s in ("computed", "redrawn", "cached")}
    print(
        f"{len(results)} figure(s) in {time.perf_counter() - start:.1f} s "
        f"({counts['computed']} computed, {counts['redrawn']} redrawn from cached data, "
        f"{counts['cached']} from the cache); gallery: {Path(args.out) / 'README.md'}, "
        f"manifest: {Path(args.out) / 'MANIFEST.json'}",
        file=sys.stderr,
    )
    return 0


# --- info --------------------------------------------------------------------------------------


def _add_info(subparsers) -> None:
    p = add_command(
        subparsers,
        "info",
        help="versions of simkit and its dependencies, installed optional extras",
        description=(
            "Print the Python version, simkit's version, the versions of its core\n"
            "dependencies and which optional extras (lm, dist, notebooks, dev) are installed.\n"
            "Paste it into bug reports."
        ),
        epilog="example:\n  simkit info\n",
    )
    p.set_defaults(func=_run_info)


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, dict[str, str | None]]:
    """``{"core": {dist: version}, "<extra>": {dist: version or None}}`` without importing them."""
    import simkit

    report: dict[str, dict[str, str | None]] = {"core": {"simkit": simkit.__version__}}
    report["core"].update({d: _dist_version(d) for d in CORE_PACKAGES})
    for extra, dists in OPTIONAL_PACKAGES.items():
        report[extra] = {d: _dist_version(d) for d in dists}
    return report


def _run_info(args) -> int:
    print(f"python          {platform.python_version()} ({platform.platform()})")
    for group, versions in package_versions().items():
        title = "core" if group == "core" else f"optional [{group}]"
        print(f"{title}:")
        for dist, ver in versions.items():
            print(f"  {dist:<14}{ver if ver is not None else 'not installed'}")
    return 0


# --- list --------------------------------------------------------------------------------------


def summary(doc: str | None, width: int = 88) -> str:
    """First sentence of a docstring's first paragraph, on one line, at most ``width`` chars."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    sentence = paragraph[: end + 1] if end >= 0 else paragraph
    return textwrap.shorten(sentence, width=width, placeholder=" …")


def _list_mappings() -> list[str]:
    from simkit import mappings

    lines = []
    for name in mappings.available():
        cls = mappings.mapping_class(name)
        lines.append(f"{name:<12} {cls.level:<9} {summary(cls.__doc__)}")
    return lines


def _list_figures() -> list[str]:
    from simkit import figures

    return [f"{name:<24} {module.TITLE}" for name, module in figures.FIGURES.items()]


def _list_shifts() -> list[str]:
    try:
        from simkit import shifts
    except ImportError as err:  # pragma: no cover - the module ships with simkit
        raise CLIError(f"simkit.shifts is not available: {err}") from None
    lines = []
    for name in shifts.available():
        lines.append(f"{name:<14} {summary(type(shifts.get(name)).__doc__)}")
    return lines


LISTERS: dict[str, Callable[[], list[str]]] = {
    "mappings": _list_mappings,
    "figures": _list_figures,
    "shifts": _list_shifts,
}


def _add_list(subparsers) -> None:
    p = add_command(
        subparsers,
        "list",
        help="list the registered mappings, figures or shift families",
        description=(
            "List a registry: 'mappings' (weight mappings: name, level, summary),\n"
            "'figures' (figure names and titles) or 'shifts' (families that move mu away\n"
            "from pi)."
        ),
        epilog="examples:\n  simkit list mappings\n  simkit list figures\n",
    )
    p.add_argument("what", choices=list(LISTERS), help="which registry")
    p.set_defaults(func=_run_list)


def _run_list(args) -> int:
    for line in LISTERS[args.what]():
        print(line)
    return 0


# --- run / sweep / report ------------------------------------------------------------------

#: columns printed by ``simkit run`` (besides the swept setting columns), when present
RUN_SUMMARY_COLUMNS = (
    "estimator",
    "bias",
    "variance",
    "mse",
    "rel_mse_scaled",
    "kept",
    "cosine",
    "ess",
    "method",
)


def _add_run(subparsers) -> None:
    p = add_command(
        subparsers,
        "run",
        help="run every cell of a sweep config serially, in memory, and print the table",
        description=(
            "Run all the cells of a sweep configuration (TOML) one after the other in this\n"
            "process, with nothing written but --out: the quick way to try a config before\n"
            "a long 'simkit sweep'. Prints a summary (estimator, the swept settings, bias,\n"
            "variance, MSE, the scale-free error rel_mse_scaled (rank by it), kept, cosine,\n"
            "ESS, method); --out writes the full tidy table as CSV or\n"
            "parquet (by extension). The numbers are those 'simkit sweep' gives for the\n"
            "same config. The config is validated first (unknown keys, types, unreachable\n"
            "divergence targets...)."
        ),
        epilog=(
            "examples:\n"
            "  simkit run configs/quick.toml\n"
            "  simkit run configs/quick.toml --out quick.csv --all-columns\n"
        ),
    )
    p.add_argument("config", metavar="CONFIG", help="sweep configuration file (TOML)")
    p.add_argument("--out", metavar="FILE", help="write the full table to FILE (.csv or .parquet)")
    p.add_argument("--all-columns", action="store_true", help="print every column")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_run)


def _run_run(args) -> int:
    from simkit import sweep

    if args.out is not None:
        check_table_file(args.out, "--out")
    with usage_errors(*sweep_errors()):
        table = sweep.run_config(args.config, progress=not args.no_progress)
    if args.out is not None:
        save_table(table, args.out)
    print(_summary_table(table, args.all_columns))
    return 0


def _summary_table(table, all_columns: bool = False) -> str:
    """The table as text: every column, or the estimator, swept settings and main metrics."""
    if all_columns:
        return table_text(table)
    setting = ("env", "family", "divergence", "div_level", "target", "T", "n")
    swept = tuple(c for c in setting if c in table and table[c].nunique(dropna=False) > 1)
    return table_text(table, RUN_SUMMARY_COLUMNS[:1] + swept + RUN_SUMMARY_COLUMNS[1:])


def _add_sweep(subparsers) -> None:
    p = add_command(
        subparsers,
        "sweep",
        help="run a sweep into a directory: parallel or on Dask, crash-safe, resumable",
        description=(
            "Expand a sweep configuration (TOML) into cells and run them, writing one\n"
            "parquet shard per finished cell under DIR/cells/ (atomically: a killed run never\n"
            "leaves a half-written shard). Running the same command again resumes: finished\n"
            "cells are skipped, failed ones retried. A cell that raises is recorded with its\n"
            "traceback in DIR/failures.jsonl and the sweep goes on (exit status 1 if any\n"
            "failed). Every cell's random stream comes from (seed, cell key), so serial,\n"
            "processes and dask give identical tables. Then run 'simkit report DIR'.\n"
            "\n"
            "backends:\n"
            "  serial     one cell after the other in this process\n"
            "  processes  a pool of --workers local processes (default: all cores)\n"
            "  dask       a Dask cluster: --scheduler tcp://HOST:8786 (started with\n"
            "             'dask scheduler' and 'dask worker tcp://HOST:8786' on the machines,\n"
            "             each with simkit installed), or without --scheduler a LocalCluster\n"
            "             of --workers processes"
        ),
        epilog=(
            "examples:\n"
            "  simkit sweep configs/quick.toml --out runs/quick\n"
            "  simkit sweep configs/quick.toml --out runs/quick --backend processes --workers 4\n"
            "  simkit sweep big.toml --out runs/big --backend dask --scheduler tcp://10.0.0.1:8786\n"
            "  simkit report runs/quick\n"
        ),
    )
    p.add_argument("config", metavar="CONFIG", help="sweep configuration file (TOML)")
    p.add_argument("--out", required=True, metavar="DIR", help="sweep directory (created/resumed)")
    add_backend_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_sweep)


def _run_sweep(args) -> int:
    summary = run_sweep_command(args.config, args.out, args)
    print(f"sweep: {summary}", file=sys.stderr)
    if summary.complete:
        print(f"next: simkit report {args.out}", file=sys.stderr)
    return 0 if summary.failed == 0 else 1


def _add_report(subparsers) -> None:
    p = add_command(
        subparsers,
        "report",
        help="merged table (parquet + CSV) and standard plots of a sweep directory",
        description=(
            "Merge the shards of a sweep directory into DIR/results.parquet and\n"
            "DIR/results.csv (one tidy table: metrics, the config's columns, simkit version,\n"
            "cell key) and draw bias, variance, MSE and cosine against the swept setting,\n"
            "one line per estimator, as DIR/report/<metric>.png. An unfinished sweep is an\n"
            "error unless --partial."
        ),
        epilog="examples:\n  simkit report runs/quick\n  simkit report runs/big --partial\n",
    )
    p.add_argument("dir", metavar="DIR", help="sweep directory (simkit sweep --out DIR)")
    p.add_argument("--partial", action="store_true", help="report the finished cells only")
    p.set_defaults(func=_run_report)


def _run_report(args) -> int:
    from simkit.figures.report import report

    with usage_errors(*sweep_errors()):
        table, paths = report(args.dir, partial=args.partial)
    print(f"{len(table)} rows, {table['cell'].nunique()} cells", file=sys.stderr)
    for path in paths:
        print(path)
    return 0


# --- schema ------------------------------------------------------------------------------------


def _add_schema(subparsers) -> None:
    p = add_command(
        subparsers,
        "schema",
        help="the JSON Schema of a sweep config (for editors and validators)",
        description=(
            "Print the JSON Schema of a TOML sweep configuration: 'experiment' (simkit run /\n"
            "sweep) or 'train' (simkit train CONFIG). Point an editor's TOML extension at the\n"
            "saved file to complete keys and check values as you type (README: editor setup)."
        ),
        epilog=(
            "examples:\n"
            "  simkit schema experiment > simkit-experiment.schema.json\n"
            "  simkit schema train > simkit-train.schema.json\n"
        ),
    )
    p.add_argument(
        "kind", nargs="?", default="experiment", choices=("experiment", "train"),
        help="config kind (default: experiment)",
    )  # fmt: skip
    p.set_defaults(func=_run_schema)


def _run_schema(args) -> int:
    import json

    from simkit.config import json_schema

    print(json.dumps(json_schema(args.kind), indent=2))
    return 0


# --- parser ------------------------------------------------------------------------------------


def _add_train(subparsers) -> None:
    from simkit.train.cli import register

    register(subparsers)


def _add_lm(subparsers) -> None:
    # torch is imported only when an lm subcommand runs
    from simkit.lm.cli import register

    register(subparsers)


def _add_diagnose(subparsers) -> None:
    from simkit.diagnose import register

    register(subparsers)


#: subcommand name -> function adding it to the subparsers (in help order)
SUBCOMMANDS: dict[str, Callable] = {
    "run": _add_run,
    "sweep": _add_sweep,
    "report": _add_report,
    "train": _add_train,
    "lm": _add_lm,
    "diagnose": _add_diagnose,
    "figures": _add_figures,
    "info": _add_info,
    "list": _add_list,
    "schema": _add_schema,
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of ``SUBCOMMANDS``. With ``argv``, the
    subcommand it selects (its first word) is known, and the slow-to-import ones
    (``cli_common.LAZY_HELP``) are registered in full only when selected."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=Formatter,
        description=(
            "simkit: bias and variance of importance-sampling weight mappings in LLM RL\n"
            "(GRPO, PPO clip, GSPO, SAPO, CISPO, TIS/MIS, VESPO, ...), exactly and by\n"
            "simulation. Run 'simkit COMMAND --help' for a command's options and examples."
        ),
        epilog=(
            "examples:\n"
            "  simkit list mappings\n"
            "  simkit run configs/quick.toml\n"
            "  simkit sweep configs/quick.toml --out runs/quick --backend processes\n"
            "  simkit report runs/quick\n"
            "  simkit figures kernel_shapes --out figures\n"
            "  simkit info\n"
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    command = _command_of(argv)
    for name, add in SUBCOMMANDS.items():
        if name in LAZY_HELP and command not in (None, name):
            # another command runs: a placeholder with the same one-line help for --help,
            # without importing the command's slow modules (cli_common.LAZY_HELP)
            subparsers.add_parser(name, help=LAZY_HELP[name], add_help=False)
        else:
            add(subparsers)
    return parser


def _command_of(argv: list[str] | None) -> str | None:
    """The subcommand ``argv`` runs (its first word not starting with '-'), or None (unknown:
    every subcommand is registered in full)."""
    if argv is None:
        return None
    words = [a for a in argv if not a.startswith("-")]
    return words[0] if words else None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 2 usage error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return int(exc.code or 0)
    try:
        return int(args.func(args))
    except CLIError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `simkit list mappings | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
