"""PDF byte-determinism: the same data drawn twice give the same PDF bytes.

``collapse_map.pdf`` came out with different bytes from identical data (issue 18's closing
note): kiwisolver, under matplotlib's constrained layout, returns positions that differ in the
last bit from one solve of the same constraints to the next, and the PDF writer prints
coordinates to 1e-6 pt, so a coordinate on a rounding boundary printed differently. Measured
on the full-size collapse_map data: 2 of 12 saves in one process gave a second PDF (same
PNG). :class:`simkit.figures._common.RoundedConstrainedLayout` rounds the layout to 1e-9 of
the figure. The solver's noise cannot be provoked on demand, so the tests inject it: every
layout is shifted by ±1e-12 of the figure (far above the solver's ~5e-16, far below the 1e-9
grid) and the positions and the PDF bytes must not move. Without the rounding the positions
differ (the test fails).
"""

import io
import itertools

import numpy as np
import pandas as pd
import pytest
from matplotlib import layout_engine
from matplotlib.transforms import Bbox

from simkit import figures
from simkit.figures import _common, collapse_map, style

#: the shift injected into every layout, as a fraction of the (sub)figure
NOISE = 1e-12


def full_size_collapse_map() -> collapse_map.Data:
    """collapse_map's data at full size (6 recipes × 4 N × 3 T: the layout that failed) with
    made-up gains: :func:`collapse_map.draw` reads only ``config``, ``grid`` and ``notes``."""
    cfg = collapse_map.Config()
    rng = np.random.default_rng(0)
    rows = [
        {
            "recipe": r,
            "N": N,
            "T": T,
            "gain": rng.uniform(-0.2, 1.0),
            "J_final": 0.5,
            "collapsed": int(rng.uniform() < 0.2),
            "runs": 2,
            "gain_se": 0.05,
        }
        for r, N, T in itertools.product(cfg.recipes, cfg.staleness, cfg.T)
    ]
    grid = pd.DataFrame(rows)
    return collapse_map.Data(
        config=cfg,
        table=pd.DataFrame(),
        runs=pd.DataFrame(),
        grid=grid,
        J_star={},
        J_start={},
        notes=tuple(collapse_map.paper_verdict(grid)),
    )


def _shift_layout(fig, delta: float) -> None:
    for sub in fig.subfigs:
        sub.bbox_relative.set_points(sub.bbox_relative.get_points() + delta)
        _shift_layout(sub, delta)


def noisy_solver(monkeypatch, delta: float) -> None:
    """Make every constrained layout land ``delta`` (fraction of the figure) off its solution,
    as kiwisolver's last-bit noise does, before the engine's rounding sees it."""
    real = layout_engine.do_constrained_layout

    def solve(fig, **kwargs):
        out = real(fig, **kwargs)
        _shift_layout(fig, delta)
        for ax in fig.axes:
            if ax.get_in_layout():
                box = ax.get_position(original=True).get_points() + delta
                ax.set_position(Bbox(box), which="both")
                ax.set_in_layout(True)
        return out

    monkeypatch.setattr(layout_engine, "do_constrained_layout", solve)


def pdf_and_positions(data) -> tuple[bytes, list]:
    """The PDF bytes of collapse_map drawn from ``data`` (PNG first, as ``figures.save``
    does) and every axes' position as the PDF's layout left it (``original``: a colour bar's
    drawn box is derived from it)."""
    with style.context():
        fig = collapse_map.draw(data)
        fig.savefig(io.BytesIO(), format="png", dpi=style.DPI, metadata=figures.PNG_METADATA)
        buf = io.BytesIO()
        fig.savefig(buf, format="pdf", metadata=figures.PDF_METADATA)
    return buf.getvalue(), [ax.get_position(original=True).get_points().copy() for ax in fig.axes]


@pytest.fixture(scope="module")
def data():
    return full_size_collapse_map()


def test_collapse_map_pdf_bytes_do_not_follow_solver_noise(data, monkeypatch):
    noisy_solver(monkeypatch, +NOISE)
    pdf_up, pos_up = pdf_and_positions(data)
    noisy_solver(monkeypatch, -NOISE)
    pdf_down, pos_down = pdf_and_positions(data)
    assert len(pos_up) == 7  # 6 heat maps and the colour bar
    for a, b in zip(pos_up, pos_down, strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit, though the solves differ by 2e-12
    assert pdf_up == pdf_down


def test_layout_is_on_the_rounding_grid(data):
    _, positions = pdf_and_positions(data)
    for box in positions:
        np.testing.assert_array_equal(box, np.round(box, _common.LAYOUT_DECIMALS))


def test_collapse_map_saved_twice_gives_the_same_bytes(data, tmp_path):
    a = figures.save("collapse_map", data, tmp_path / "a")
    b = figures.save("collapse_map", data, tmp_path / "b")
    for pa, pb in zip(a, b, strict=True):
        assert pa.read_bytes() == pb.read_bytes()
    assert a[1].read_bytes()[:5] == b"%PDF-"
