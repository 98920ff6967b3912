"""What the figure modules share: small drawing helpers (matplotlib only, no pyplot), checks of
their configurations and the mapping sets they draw."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.transforms import Bbox

from simkit import mappings
from simkit.estimators import Estimator

#: symbols used in axis labels across figures
CHI2 = r"$\chi^2(\pi\,\|\,\mu)$"
W_LABEL = r"ratio $W = \pi/\mu$"


#: decimals (of the figure's or subfigure's size) that layout positions are rounded to
LAYOUT_DECIMALS = 9


class RoundedConstrainedLayout(ConstrainedLayoutEngine):
    """Matplotlib's constrained layout with its result rounded to :data:`LAYOUT_DECIMALS`
    decimals, so that the same figure is laid out to the same bits every time.

    Why: kiwisolver (1.5.1, under matplotlib 3.11's constrained layout) does not return the
    same bits for the same constraints and suggested values: drawing ``collapse_map`` ten
    times in one process from identical data gave axes positions that differ by one ulp
    (≈ 5e-16 of the figure) in 4 of 10 draws, the first difference at a solve whose suggested
    values were all identical. The PNG does not see it, but the PDF writes coordinates to
    1e-6 pt, so a coordinate on a rounding boundary printed differently (``402.704385`` vs
    ``402.704386``): 12 saves of the full-size figure gave two different PDFs (same PNG);
    with the rounding, 30 of 30 were identical. Rounded to 1e-9 of the figure (≈ 5e-7 pt on
    a 7-inch figure), the ulp noise can change a position only when it lies within ≈ 1e-16
    of a rounding midpoint; against the unrounded layout the PNGs differ by at most 3/255 in
    at most 0.1 % of the pixels (antialiased edges; 5 of 21 figures at small size).

    Rounds, after every layout, the relative box of every subfigure and the (original)
    position of every axes that takes part in the layout (a colour bar's locator derives its
    drawn box from that position).
    """

    def execute(self, fig):
        result = super().execute(fig)
        _round_subfigures(fig)
        for ax in fig.axes:
            if ax.get_in_layout():
                box = ax.get_position(original=True).get_points()
                ax.set_position(Bbox(np.round(box, LAYOUT_DECIMALS)), which="both")
                ax.set_in_layout(True)  # set_position takes an axes out of the layout
        return result


def _round_subfigures(fig) -> None:
    for sub in fig.subfigs:
        sub.bbox_relative.set_points(np.round(sub.bbox_relative.get_points(), LAYOUT_DECIMALS))
        _round_subfigures(sub)


def new_figure(width: float, height: float, **kwargs) -> Figure:
    """A pyplot-free Figure of ``width`` × ``height`` inches with constrained layout
    (:class:`RoundedConstrainedLayout`: the same data give the same PDF bytes)."""
    return Figure(figsize=(width, height), layout=RoundedConstrainedLayout(), **kwargs)


def panel_label(ax, letter: str) -> None:
    """Prefix the axes title with the panel letter, e.g. ``(a) title``, left-aligned.

    Call it after ``set_title``; an axes without a title gets the letter alone.
    """
    title = ax.get_title()
    ax.set_title("")
    ax.set_title(f"({letter}) {title}".rstrip(), loc="left")


def mark_floor(
    ax,
    floor: float,
    text: str | None = "0 (unbiased)",
    *,
    linewidth: float = 0.6,
    linestyle: str = ":",
    fontsize: float = 7,
) -> None:
    """A dotted horizontal line at ``floor`` labelled ``text`` at the right edge (no label when
    ``text`` is None): where a log-scale axis draws the value 0 (a bias that is exactly zero,
    clipped to ``floor``), or any reference level such as 1/N."""
    ax.axhline(floor, color="0.5", linewidth=linewidth, linestyle=linestyle)
    if text is None:
        return
    ax.annotate(
        text,
        (1.0, floor),
        xycoords=("axes fraction", "data"),
        xytext=(-2, 2),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=fontsize,
        color="0.35",
    )


def mark_x(
    ax,
    x: float,
    text: str,
    y: float,
    offset: tuple[float, float],
    *,
    linestyle: str = ":",
    linewidth: float = 0.6,
    line_color: str = "0.5",
    **text_kwargs,
) -> None:
    """A vertical line at data ``x`` labelled ``text`` at height ``y`` (axes fraction), moved
    by ``offset`` points; ``text_kwargs`` go to ``Axes.annotate`` (fontsize, color, ha, va,
    rotation). The vertical counterpart of :func:`mark_floor`: a threshold such as the last T
    enumerated, an optimal clip C*, or where a log axis draws the value 0."""
    ax.axvline(x, color=line_color, linewidth=linewidth, linestyle=linestyle)
    ax.annotate(
        text,
        (x, y),
        xycoords=("data", "axes fraction"),
        xytext=offset,
        textcoords="offset points",
        **text_kwargs,
    )


def annotated_heatmap(
    ax,
    values,
    texts,
    text_colors,
    xticklabels,
    yticklabels,
    *,
    cmap,
    vmin: float,
    vmax: float,
    fontsize: float,
    tick_fontsize: float | None = None,
):
    """A grid of cells coloured by ``values`` (rows × columns, row 0 at the top) with
    ``texts[i][j]`` written in each cell in ``text_colors[i][j]``, the columns and rows
    labelled ``xticklabels`` and ``yticklabels``, no grid lines. Returns the image (for a
    colour bar)."""
    image = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    for i, (row_texts, row_colors) in enumerate(zip(texts, text_colors, strict=True)):
        for j, (text, color) in enumerate(zip(row_texts, row_colors, strict=True)):
            ax.text(j, i, text, ha="center", va="center", fontsize=fontsize, color=color)
    tick_kw = {} if tick_fontsize is None else {"fontsize": tick_fontsize}
    ax.set_xticks(range(len(xticklabels)), xticklabels, **tick_kw)
    ax.set_yticks(range(len(yticklabels)), yticklabels, **tick_kw)
    ax.grid(False)
    return image


def check_token_grid(V: int, chi2_toks=None, **lengths) -> None:
    """Validate the grid of a token-level figure's Config: ``V`` ≥ 2 tokens, ``chi2_toks``
    (unless None) a non-empty tuple of positive per-token χ², and every length grid named in
    ``lengths`` (name=values) non-empty positive integers. Raises ValueError naming the field."""
    if V < 2:
        raise ValueError(f"V must be >= 2, got {V}")
    if chi2_toks is not None and (not chi2_toks or any(not c > 0 for c in chi2_toks)):
        raise ValueError(f"chi2_toks must be positive, got {chi2_toks}")
    for name, values in lengths.items():
        if not values or min(values) < 1:
            raise ValueError(f"{name} must be positive integers, got {values}")


def check_ratio_grid(w_max: float, n_points: int) -> None:
    """Validate the ratio grid of a kernel-shape figure's Config: ``w_max`` > 1 (so that the
    grid from 0 to ``w_max`` shows the ratio 1) and ``n_points`` ≥ 3. Raises ValueError naming
    the field."""
    if not w_max > 1:
        raise ValueError(f"w_max must be > 1 to show the ratio 1, got {w_max}")
    if n_points < 3:
        raise ValueError(f"n_points must be >= 3, got {n_points}")


#: the mappings of the small configurations of the exact token-level figures (``mse_vs_T``,
#: ``same_kl_different_chi2``): one of each kind, every one with an exact per-sample path
SMALL_EXACT_MAPPINGS = ("naive", "is_token", "is_seq", "ppo_clip", "tis_seq", "vespo")


def figure_mappings() -> list[str]:
    """The registered mappings the "every mapping" figures draw: all of them."""
    return list(mappings.available())


def per_sample_mappings() -> list[str]:
    """Mappings of :func:`figure_mappings` with an exact per-sample path (not batch
    dependent)."""
    return [n for n in figure_mappings() if not mappings.mapping_class(n).batch_dependent]


def chosen_mappings(names, default=None) -> list[str]:
    """A figure's ``mapping_names`` setting as a list: ``names``, or when it is None the list
    ``default`` (None: :func:`figure_mappings`)."""
    if names is not None:
        return list(names)
    return figure_mappings() if default is None else list(default)


def oracle_estimators(names) -> list[Estimator]:
    """One estimator per mapping name (its default hyperparameters), named by it:
    seq-mean-token-sum aggregation, oracle advantage R − J(π) — the estimators of the exact
    bandit and token-MDP figures."""
    return [
        Estimator(
            mappings.get(name), aggregation="seq-mean-token-sum", advantage="oracle", name=name
        )
        for name in names
    ]


def finite_positive(values) -> np.ndarray:
    """Replace non-finite or non-positive values by NaN (so log axes skip them)."""
    arr = np.asarray(values, dtype=np.float64).copy()
    arr[~np.isfinite(arr) | (arr <= 0)] = np.nan
    return arr


#: note added to a legend or caption when some Monte Carlo points are drawn hollow
UNRELIABLE_NOTE = (
    "hollow markers: Monte Carlo rows marked unreliable (column ``reliable``, "
    "simkit.experiment.reliability: the interval cannot be trusted)"
)


def mark_unreliable(ax, x, y, reliable, color=None, marker="o", markersize=4.5, label=None):
    """Draw the points of (x, y) whose ``reliable`` flag is False as hollow markers.

    ``x``, ``y``, ``reliable``: 1-D arrays of one length (``reliable`` boolean; NaN/None count as
    reliable, as exact rows are). Draw the line (or filled markers) as usual and call this on
    top: the unreliable points get a white face and an edge in ``color``, so they read as
    "measured but not trusted". Returns the number of hollow points (0: nothing drawn), so
    that a caller can add :data:`UNRELIABLE_NOTE` to its caption only when it applies.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    flags = np.asarray(reliable, dtype=object)
    if not (x.shape == y.shape == flags.shape and x.ndim == 1):
        raise ValueError(
            f"x, y and reliable must be 1-D arrays of one length, got {x.shape}, {y.shape}, "
            f"{flags.shape}"
        )
    bad = np.array([f is not None and f == f and not bool(f) for f in flags], dtype=bool)
    if not bad.any():
        return 0
    ax.plot(
        x[bad],
        y[bad],
        linestyle="none",
        marker=marker,
        markersize=markersize,
        markerfacecolor="white",
        markeredgecolor=color,
        markeredgewidth=1.0,
        zorder=5,
        label=label,
    )
    return int(bad.sum())
