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


def test_report_draws_unreliable_rows_hollow_with_a_note():
    import pandas as pd

    from simkit.figures import report

    table = pd.DataFrame(
        {
            "estimator": ["a"] * 3 + ["b"] * 3,
            "mapping": ["naive"] * 3 + ["is_seq"] * 3,
            "target": [0.1, 0.5, 1.0] * 2,
            "variance": [1.0, 2.0, 3.0, 1.5, 2.5, 3.5],
            "variance_lo": [0.9, 1.8, 2.7, 1.4, 2.4, 3.4],
            "variance_hi": [1.1, 2.2, 3.3, 1.6, 2.6, 3.6],
            "reliable": [True, True, True, True, False, False],
        }
    )
    (fig,) = report.draw_metric(table, "variance", "variance", "log", ["target"])
    ax = fig.axes[0]
    hollow = [ln for ln in ax.get_lines() if ln.get_markerfacecolor() == "white"]
    assert len(hollow) == 1
    np.testing.assert_array_equal(hollow[0].get_xdata(), [0.5, 1.0])
    assert fig.get_supxlabel() == _common.UNRELIABLE_NOTE
    table["reliable"] = True
    (fig,) = report.draw_metric(table, "variance", "variance", "log", ["target"])
    assert fig.get_supxlabel() == ""
