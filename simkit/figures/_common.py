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
    """Bold panel letter, e.g. ``(a)``, in the top-left corner outside the axes."""
    ax.text(-0.02, 1.02, f"({letter})", transform=ax.transAxes, fontweight="bold",
            ha="right", va="bottom")


def finite_positive(values) -> np.ndarray:
    """Replace non-finite or non-positive values by NaN (so log axes skip them)."""
    arr = np.asarray(values, dtype=np.float64).copy()
    arr[~np.isfinite(arr) | (arr <= 0)] = np.nan
    return arr
