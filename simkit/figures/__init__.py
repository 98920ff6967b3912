"""Paper-style figures: one module per figure, a registry, deterministic rendering, a gallery.

Every figure module exposes

- ``NAME`` (registry name), ``TITLE`` (one line), ``CAPTION`` (what the figure shows);
- ``Config`` — a frozen dataclass of its settings, and ``config(small=False) -> Config`` (``small``
  selects sizes for tests and quick looks);
- ``compute(config) -> data`` — pure numpy/pandas, deterministic (seeded), tested;
- ``draw(data) -> matplotlib.figure.Figure`` — thin, no computation, no pyplot state.

``render(name, out_dir, small=False)`` computes and writes ``<name>.png`` and ``<name>.pdf``
(``save(name, data, out_dir)`` draws given data) byte-for-byte reproducibly (fixed dpi, no
creation date / software stamp, Agg canvas), and ``write_gallery(out_dir)`` regenerates
``out_dir/README.md`` with one line per figure. ``build(names, out_dir)`` — what
``simkit figures`` / ``make figures`` run — adds a content-addressed cache of each figure's
data (:mod:`simkit.figures.cache`), parallel workers, progress and ``MANIFEST.json``
(:mod:`simkit.figures.runner`). The environment variable ``SIMKIT_SMALL=1`` forces small sizes.
"""

from __future__ import annotations

from simkit.figures import style
from simkit.figures.registry import (
    FIGURES,
    PDF_METADATA,
    PNG_METADATA,
    available,
    figure_module,
    make,
    render,
    save,
    small_from_env,
    write_gallery,
)

__all__ = [
    "FIGURES",
    "PDF_METADATA",
    "PNG_METADATA",
    "available",
    "build",
    "figure_module",
    "make",
    "render",
    "save",
    "small_from_env",
    "style",
    "write_gallery",
]


def build(names=None, out_dir="figures", **options):
    """Make figures with the cache, in parallel, with progress: :func:`runner.build`."""
    from simkit.figures import runner

    return runner.build(names, out_dir, **options)
