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


def finite_positive(values) -> np.ndarray:
    """Replace non-finite or non-positive values by NaN (so log axes skip them)."""
    arr = np.asarray(values, dtype=np.float64).copy()
    arr[~np.isfinite(arr) | (arr <= 0)] = np.nan
    return arr
