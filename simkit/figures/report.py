"""Report of a finished sweep: the merged table (parquet + CSV) and the standard plots.

:func:`report` reads a sweep directory (:mod:`simkit.sweep`), writes

- ``out_dir/results.parquet`` and ``out_dir/results.csv`` — the tidy table of
  :func:`simkit.sweep.load_results` (metrics of DESIGN.md, the config's columns, the simkit
  version and the cell key), in expansion order;
- ``out_dir/report/<metric>.png`` for ``bias``, ``variance``, ``mse`` (with the MSE of ĝ ≡ 0,
  ‖∇J‖², dotted), ``cosine``, the scale-free error ``rel_mse_scaled`` (rank by it) and
  ``kept`` — the
  metric against the swept setting, one line per estimator (colours of
  :mod:`simkit.figures.style`), Monte Carlo rows with their bootstrap bounds as error bars;
  rows marked ``reliable = False`` (:mod:`simkit.reliability`) are drawn hollow, with a note.

The x axis is the first swept setting column in the order ``target``, ``T``, ``n``, then the
config's other columns; every other swept column makes one panel per value combination (at most
:data:`MAX_PANELS` per file: more give ``<metric>-2.png``, …). Nothing swept: one bar per
estimator. Log axes for bias, variance and MSE, where an exact 0 (an unbiased estimator) is
drawn on a floor line marked "0".
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from simkit import config as _config
from simkit import sweep
from simkit.figures import PNG_METADATA, _common, style

REPORT_DIR = "report"
#: metric, axis label, y scale
METRICS = (
    ("bias", r"bias $\|\mathbb{E}\hat g - \nabla J\|$", "log"),
    ("variance", r"variance $\mathbb{E}\|\hat g - \mathbb{E}\hat g\|^2$", "log"),
    ("mse", r"MSE $\mathbb{E}\|\hat g - \nabla J\|^2$", "log"),
    ("cosine", r"cosine $\cos(\mathbb{E}\hat g, \nabla J)$", "linear"),
    (
        "rel_mse_scaled",
        r"scale-free error $\min_\alpha\mathbb{E}\|\alpha\hat g-\nabla J\|^2/\|\nabla J\|^2$",
        "linear",
    ),
    ("kept", "kept share of tokens", "linear"),
)
#: the MSE of ĝ ≡ 0 (‖∇J‖²), drawn as a dotted reference on the MSE plot
ZERO_REFERENCE = {"mse": "mse_zero"}
ZERO_LABEL = "ĝ ≡ 0 (‖∇J‖²)"
#: preferred x axes, in order (then the config's other columns)
X_PRIORITY = ("target", "T", "n")
MAX_PANELS = 12
#: a column only training sweeps (``kind = "train"``) have: one row per step of each run
TRAIN_MARKER = "step"
#: learning-curve metrics of a training sweep's report: column, axis label, y scale
TRAIN_METRICS = (
    ("J", r"$J(\pi)$ (exact)", "linear"),
    ("cosine", r"cosine of the estimate to $\nabla J$", "linear"),
    ("chi2_seq", r"$\chi^2_{seq}(\pi\|\mu)$", "log"),
)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h", "*", "<", ">")
_DASHES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (1, 1)))


def setting_columns(out_dir) -> list[str]:
    """The config's setting columns of a sweep (``Cell.columns`` keys, then ``T`` and ``n``)."""
    cells = _config.expand(_config.load_config(Path(out_dir) / sweep.CONFIG_FILE, check=False))
    cols: list[str] = []
    for cell in cells:
        cols.extend(k for k in cell.columns if k not in cols)
    cols.extend(k for k in ("T", "n") if k not in cols)
    return cols


def swept_columns(table: pd.DataFrame, candidates) -> list[str]:
    """The candidate columns of ``table`` that take more than one value, x axis first.

    Order: :data:`X_PRIORITY` first, then the candidates' order.
    """
    present = [c for c in candidates if c in table.columns]
    swept = [c for c in present if table[c].nunique(dropna=False) > 1]
    first = [c for c in X_PRIORITY if c in swept]
    return first + [c for c in swept if c not in first]


def report(out_dir, partial: bool = False) -> tuple[pd.DataFrame, list[Path]]:
    """Write the merged table and the standard plots of the sweep in ``out_dir``.

    Returns ``(table, paths)``: the table of :func:`simkit.sweep.load_results` and the written
    files (results.parquet, results.csv, then the PNGs). ``partial``: report the finished cells
    of an unfinished sweep (otherwise missing cells are an error).
    """
    out = Path(out_dir)
    table = sweep.load_results(out, partial=partial)
    if table.empty:
        raise sweep.SweepError(f"{out} has no finished cells to report")
    parquet, csv = out / "results.parquet", out / "results.csv"
    sweep.write_table(table, parquet)  # atomically (issue 13): never a half-written file
    sweep.write_table(table, csv)
    paths = [parquet, csv]
    figure_dir = out / REPORT_DIR
    figure_dir.mkdir(exist_ok=True)
    swept = swept_columns(table, setting_columns(out))
    if TRAIN_MARKER in table.columns:
        return table, paths + _train_report(table, out, figure_dir, swept)
    for metric, label, scale in METRICS:
        if metric not in table.columns or not table[metric].notna().any():
            continue  # a sweep written before the column existed
        with style.context():
            figures = draw_metric(table, metric, label, scale, swept)
            for i, fig in enumerate(figures, 1):
                name = metric if len(figures) == 1 else f"{metric}-{i}"
                path = figure_dir / f"{name}.png"
                fig.savefig(path, format="png", dpi=style.DPI, metadata=PNG_METADATA)
                paths.append(path)
    return table, paths


def estimator_styles(table: pd.DataFrame) -> dict[str, dict]:
    """Plot keyword arguments per estimator: the mapping's colour, and estimators sharing a
    mapping (a hyperparameter grid) told apart by shade, line style and marker."""
    out: dict[str, dict] = {}
    names = list(dict.fromkeys(table["estimator"]))
    mapping_of = dict(zip(table["estimator"], table["mapping"]))
    siblings: dict[str, list[str]] = {}
    for name in names:
        siblings.setdefault(mapping_of[name], []).append(name)
    for mapping, members in siblings.items():
        base = style.style(mapping)
        for i, name in enumerate(members):
            shade = 0.55 * i / max(len(members) - 1, 1) if len(members) > 1 else 0.0
            out[name] = {
                "color": _lighten(base.color, shade),
                "linestyle": base.linestyle if len(members) == 1 else _DASHES[i % len(_DASHES)],
                "marker": base.marker if len(members) == 1 else _MARKERS[i % len(_MARKERS)],
                "label": name,
            }
    return out


def _lighten(hex_color: str, amount: float) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    rgb = np.array(to_rgb(hex_color))
    return tuple(float(v) for v in rgb + (1.0 - rgb) * amount)


def _floor(values: np.ndarray) -> float:
    """A log-axis floor below the smallest clearly positive value (exact zeros go there)."""
    finite = values[np.isfinite(values)]
    top = float(finite.max()) if finite.size else 1.0
    positive = finite[finite > 1e-9 * top] if top > 0 else finite[finite > 0]
    if positive.size == 0:
        return 1e-12
    return 10 ** math.floor(math.log10(float(positive.min()) / 3))


def draw_metric(table: pd.DataFrame, metric: str, label: str, scale: str, swept: list[str]):
    """Figures of ``metric`` against the first of ``swept`` (panels: the others); see module."""
    styles = estimator_styles(table)
    values = table[metric].to_numpy(dtype=float)
    floor = _floor(values) if scale == "log" else None
    if not swept:
        return [_bar_figure(table, metric, label, scale, styles, floor)]
    x_col, facets = swept[0], swept[1:]
    groups = list(table.groupby(facets, sort=False, dropna=False)) if facets else [((), table)]
    figures = []
    for start in range(0, len(groups), MAX_PANELS):
        chunk = groups[start : start + MAX_PANELS]
        ncols = min(3, len(chunk))
        nrows = math.ceil(len(chunk) / ncols)
        fig = _common.new_figure(2.9 * ncols + 1.6, 2.4 * nrows + 0.4)
        axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
        for ax, (values_of_facets, part) in zip(axes, chunk):
            _draw_panel(ax, part, metric, scale, x_col, styles, floor)
            if facets:
                vals = (
                    values_of_facets if isinstance(values_of_facets, tuple) else (values_of_facets,)
                )
                ax.set_title(", ".join(f"{c} = {_fmt(v)}" for c, v in zip(facets, vals)))
            ax.set_xlabel(_x_label(table, x_col))
            ax.set_ylabel(label)
        for ax in axes[len(chunk) :]:
            ax.set_visible(False)
        handles, labels = axes[0].get_legend_handles_labels()
        by_label = dict(zip(labels, handles))
        order = [n for n in (*styles, ZERO_LABEL) if n in by_label]
        fig.legend(
            [by_label[n] for n in order],
            order,
            loc="outside right center",
            fontsize=6.5,
            title="estimator",
            title_fontsize=7.5,
        )
        fig.suptitle(f"{metric} vs {x_col}")
        _note_unreliable(fig, table)
        figures.append(fig)
    return figures


def _draw_panel(ax, part, metric, scale, x_col, styles, floor) -> None:
    x_raw = part[x_col]
    numeric = pd.api.types.is_numeric_dtype(x_raw) and not pd.api.types.is_bool_dtype(x_raw)
    categories = list(dict.fromkeys(x_raw)) if not numeric else None
    for name in styles:
        rows = part[part["estimator"] == name]
        if rows.empty:
            continue
        if numeric:
            rows = rows.sort_values(x_col, kind="stable")
            x = rows[x_col].to_numpy(dtype=float)
        else:
            x = np.array([categories.index(v) for v in rows[x_col]], dtype=float)
        y = rows[metric].to_numpy(dtype=float)
        kw = {**styles[name], "linewidth": 1.2, "markersize": 3}
        if floor is not None:
            y = np.where(y <= floor, floor, y)
        lo_col, hi_col = f"{metric}_lo", f"{metric}_hi"
        if lo_col in rows and np.isfinite(rows[lo_col].to_numpy(dtype=float)).any():
            lo = rows[lo_col].to_numpy(dtype=float)
            hi = rows[hi_col].to_numpy(dtype=float)
            if floor is not None:
                lo = np.maximum(lo, floor)
            below = np.nan_to_num(np.maximum(y - lo, 0.0))
            above = np.nan_to_num(np.maximum(hi - y, 0.0), posinf=0.0)
            ax.errorbar(x, y, yerr=[below, above], capsize=1.5, elinewidth=0.7, **kw)
        else:
            ax.plot(x, y, **kw)
        if "reliable" in rows:  # Monte Carlo rows whose intervals cannot be trusted: hollow
            _common.mark_unreliable(
                ax, x, y, rows["reliable"].to_numpy(), kw.get("color"), kw.get("marker", "o"), 4
            )
    if numeric:
        xs = part[x_col].to_numpy(dtype=float)
        xs = xs[np.isfinite(xs)]
        if xs.size and xs.min() > 0 and xs.max() / xs.min() >= 20:
            ax.set_xscale("log")
    else:
        ax.set_xticks(range(len(categories)), [_fmt(v) for v in categories])
    ref = ZERO_REFERENCE.get(metric)
    if ref in part and part[ref].notna().any():
        rows = part.drop_duplicates(x_col).sort_values(x_col, kind="stable") if numeric else part
        if numeric:
            ax.plot(
                rows[x_col].to_numpy(dtype=float),
                rows[ref].to_numpy(dtype=float),
                ls=":",
                color="0.2",
                lw=1.0,
                label=ZERO_LABEL,
            )
        else:
            ax.axhline(float(rows[ref].iloc[0]), ls=":", color="0.2", lw=1.0, label=ZERO_LABEL)
    ax.set_yscale(scale)
    if floor is not None:
        _common.mark_floor(ax, floor, "0")


def _note_unreliable(fig, table: pd.DataFrame) -> None:
    """A footnote when some rows are marked ``reliable = False`` (drawn hollow)."""
    if "reliable" in table and (table["reliable"] == False).any():  # noqa: E712 (NaN-safe)
        fig.supxlabel(_common.UNRELIABLE_NOTE, x=0.01, ha="left", fontsize=6, color="0.3")


def _bar_figure(table, metric, label, scale, styles, floor):
    names = list(styles)
    fig = _common.new_figure(max(3.5, 0.45 * len(names) + 1.5), 3.2)
    ax = fig.subplots()
    means = table.groupby("estimator", sort=False)[metric].mean()
    y = np.array([means.get(n, math.nan) for n in names], dtype=float)
    if floor is not None:
        y = np.where(y <= floor, floor, y)
    ax.bar(range(len(names)), y, color=[styles[n]["color"] for n in names])
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=6.5)
    ref = ZERO_REFERENCE.get(metric)
    if ref in table and table[ref].notna().any():
        ax.axhline(float(table[ref].mean()), ls=":", color="0.2", lw=1.0, label=ZERO_LABEL)
        ax.legend(fontsize=6.5)
    ax.set_yscale(scale)
    if floor is not None:
        _common.mark_floor(ax, floor, "0")
    ax.set_ylabel(label)
    fig.suptitle(f"{metric} per estimator")
    return fig


def _x_label(table: pd.DataFrame, x_col: str) -> str:
    if x_col == "target" and "divergence" in table and table["divergence"].nunique() == 1:
        return f"target {table['divergence'].iloc[0]}"
    return x_col


def _fmt(value) -> str:
    if isinstance(value, float | np.floating):
        return f"{value:.4g}"
    return str(value)


# --- training sweeps -------------------------------------------------------------------------


def _train_report(table: pd.DataFrame, out: Path, figure_dir: Path, swept: list[str]) -> list:
    """A training sweep's report: ``summary.csv`` (one row per run,
    :func:`simkit.train.analysis.run_summary`) and learning curves ``report/<metric>.png`` of
    :data:`TRAIN_METRICS` against the step, one line per estimator (mean over seeds, shaded
    min–max band), one panel per value of the other swept settings."""
    from simkit.train import analysis

    settings = [c for c in swept if c not in ("seed", "estimator", TRAIN_MARKER)]
    run_keys = [c for c in ("estimator", *settings, "seed") if c in table.columns]
    summary = analysis.run_summary(table, run_keys)
    summary_path = out / "summary.csv"
    summary.to_csv(summary_path, index=False)
    paths: list[Path] = [summary_path]
    styles = estimator_styles(table)
    for metric, label, scale in TRAIN_METRICS:
        if metric not in table.columns or not table[metric].notna().any():
            continue
        curves = analysis.band(table, ["estimator", *settings], y=metric)
        groups = list(curves.groupby(settings, sort=False)) if settings else [((), curves)]
        for start in range(0, len(groups), MAX_PANELS):
            chunk = groups[start : start + MAX_PANELS]
            with style.context():
                fig = _train_figure(chunk, settings, metric, label, scale, styles)
                index = start // MAX_PANELS + 1
                name = metric if len(groups) <= MAX_PANELS else f"{metric}-{index}"
                path = figure_dir / f"{name}.png"
                fig.savefig(path, format="png", dpi=style.DPI, metadata=PNG_METADATA)
                paths.append(path)
    return paths


def _train_figure(chunk, settings, metric, label, scale, styles):
    ncols = min(3, len(chunk))
    nrows = math.ceil(len(chunk) / ncols)
    fig = _common.new_figure(2.9 * ncols + 1.6, 2.4 * nrows + 0.4)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    for ax, (values, part) in zip(axes, chunk):
        for name, curve in part.groupby("estimator", sort=False):
            kw = styles.get(name, {})
            color = kw.get("color")
            ax.plot(curve["step"], curve["mean"], label=name, color=color, lw=1.2)
            ax.fill_between(curve["step"], curve["lo"], curve["hi"], color=color, alpha=0.2, lw=0)
        if settings:
            vals = values if isinstance(values, tuple) else (values,)
            ax.set_title(", ".join(f"{c} = {_fmt(v)}" for c, v in zip(settings, vals)))
        ax.set_yscale(scale)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
    for ax in axes[len(chunk) :]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=6.5, title="estimator")
    fig.suptitle(f"{metric} vs step (mean over seeds, band: min–max)")
    return fig
