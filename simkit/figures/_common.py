"""Small drawing helpers shared by the figure modules (matplotlib only, no pyplot)."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

#: symbols used in axis labels across figures
CHI2 = r"$\chi^2(\pi\,\|\,\mu)$"
W_LABEL = r"ratio $W = \pi/\mu$"


def new_figure(width: float, height: float, **kwargs) -> Figure:
    """A pyplot-free Figure of ``width`` × ``height`` inches with constrained layout."""
    return Figure(figsize=(width, height), layout="constrained", **kwargs)


def panel_label(ax, letter: str) -> None:
    """Prefix the axes title with the panel letter, e.g. ``(a) title``, left-aligned.

    Call it after ``set_title``; an axes without a title gets the letter alone.
    """
    title = ax.get_title()
    ax.set_title("")
    ax.set_title(f"({letter}) {title}".rstrip(), loc="left")


def mark_floor(ax, floor: float, text: str = "0 (unbiased)") -> None:
    """A dotted horizontal line at ``floor`` labelled ``text`` at the right edge: where a
    log-scale axis draws the value 0 (a bias that is exactly zero, clipped to ``floor``)."""
    ax.axhline(floor, color="0.5", linewidth=0.6, linestyle=":")
    ax.annotate(
        text,
        (1.0, floor),
        xycoords=("axes fraction", "data"),
        xytext=(-2, 2),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=7,
        color="0.35",
    )


def finite_positive(values) -> np.ndarray:
    """Replace non-finite or non-positive values by NaN (so log axes skip them)."""
    arr = np.asarray(values, dtype=np.float64).copy()
    arr[~np.isfinite(arr) | (arr <= 0)] = np.nan
    return arr
