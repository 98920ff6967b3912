"""simkit.figures._common.mark_unreliable: hollow markers for unreliable Monte Carlo points."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from simkit.figures import _common


def test_mark_unreliable_draws_only_the_unreliable_points():
    fig = _common.new_figure(3, 3)
    ax = fig.subplots()
    n = _common.mark_unreliable(
        ax, [1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0], [True, False, np.nan, False], color="C1"
    )
    assert n == 2
    (line,) = ax.get_lines()
    np.testing.assert_array_equal(line.get_xdata(), [2, 4])
    assert line.get_markerfacecolor() == "white"
    assert _common.mark_unreliable(ax, [1], [1], [True]) == 0
    assert len(ax.get_lines()) == 1
    with pytest.raises(ValueError, match="one length"):
        _common.mark_unreliable(ax, [1, 2], [1], [True])
