"""The figure registry and deterministic rendering: :data:`FIGURES`, :func:`figure_module`,
:func:`make`, :func:`render`, :func:`save`, :func:`write_gallery`.

Re-exported by :mod:`simkit.figures` (import them from there; its ``__all__`` lists the
public names); a module of its own so that :mod:`simkit.figures.runner` (cache, workers,
progress) uses the registry without importing the package that calls it back (no import
cycle).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from types import ModuleType

from simkit.figures import (
    async_tolerance,
    bandit_bias_variance,
    bias_variance_frontier,
    collapse_map,
    collapse_regimes,
    divergence_inequalities,
    ess_khat_vs_T,
    gspo_length_conflation,
    kernel_shapes,
    kernel_shapes_catalogue,
    kl_penalty_bias,
    length_trap,
    lm_staleness_curves,
    lm_vs_sim,
    mismatch_curves,
    mse_vs_T,
    same_kl_different_chi2,
    seq_tis_optimal_c,
    seq_variance_vs_T,
    staleness_curves,
    style,
    token_bias_vs_T,
    vespo_bound,
)

#: figure name -> module, in gallery order
FIGURES: dict[str, ModuleType] = {
    m.NAME: m
    for m in (
        kernel_shapes,
        kernel_shapes_catalogue,
        divergence_inequalities,
        bandit_bias_variance,
        bias_variance_frontier,
        seq_variance_vs_T,
        length_trap,
        gspo_length_conflation,
        vespo_bound,
        ess_khat_vs_T,
        seq_tis_optimal_c,
        same_kl_different_chi2,
        token_bias_vs_T,
        kl_penalty_bias,
        mse_vs_T,
        lm_vs_sim,
        staleness_curves,
        mismatch_curves,
        collapse_map,
        collapse_regimes,
        lm_staleness_curves,
        async_tolerance,
    )
}

#: metadata that would otherwise make the files differ between runs
PNG_METADATA = {"Software": None}
PDF_METADATA = {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None}


def available() -> list[str]:
    """Registered figure names, in gallery order."""
    return list(FIGURES)


def figure_module(name: str) -> ModuleType:
    """The module of figure ``name``; unknown names raise ``KeyError`` listing the figures."""
    try:
        return FIGURES[name]
    except KeyError:
        raise KeyError(
            f"unknown figure {name!r}; available figures: {', '.join(FIGURES)}"
        ) from None


def small_from_env() -> bool:
    """True when the environment variable ``SIMKIT_SMALL`` is set to 1/true/yes."""
    return os.environ.get("SIMKIT_SMALL", "").strip().lower() in {"1", "true", "yes"}


def make(name: str, small: bool = False):
    """Compute and draw figure ``name``: returns ``(data, Figure)`` (nothing written)."""
    module = figure_module(name)
    data = module.compute(module.config(small=small or small_from_env()))
    with style.context():
        fig = module.draw(data)
    return data, fig


def render(name: str, out_dir, small: bool = False) -> list[Path]:
    """Compute figure ``name`` and write ``<out_dir>/<name>.png`` and ``.pdf``; return the paths.

    No cache: :func:`simkit.figures.build` (what ``simkit figures`` runs) adds the data cache,
    parallel workers, progress and the manifest. ``small`` (or ``SIMKIT_SMALL=1``) selects the
    reduced configuration.
    """
    module = figure_module(name)
    data = module.compute(module.config(small=small or small_from_env()))
    return save(name, data, out_dir)


def save(name: str, data, out_dir) -> list[Path]:
    """Draw figure ``name`` from its computed ``data`` into ``<out_dir>/<name>.png|pdf``.

    Deterministic: the same data give the same bytes with the same matplotlib version — PNG at
    ``style.DPI`` without the Software stamp, PDF without creation date, producer or creator
    (and matplotlib's PDF writer adds no random IDs), the layout rounded to 1e-9 of the figure
    by :class:`simkit.figures._common.RoundedConstrainedLayout` (kiwisolver's last-bit noise
    otherwise reaches the PDF's printed coordinates). Files are written to a temporary name and
    renamed, so an interrupted run never leaves a truncated figure.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module = figure_module(name)
    with style.context():
        fig = module.draw(data)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    with style.context(), _quiet_font_subsetting():
        for path, fmt, meta in zip(paths, ("png", "pdf"), (PNG_METADATA, PDF_METADATA)):
            tmp = path.with_name(f".{path.name}.tmp")
            kwargs = {"dpi": style.DPI} if fmt == "png" else {}
            fig.savefig(tmp, format=fmt, metadata=meta, **kwargs)
            os.replace(tmp, path)
    return paths


@contextlib.contextmanager
def _quiet_font_subsetting():
    """Silence fontTools' harmless "timestamp seems very low" warnings while embedding fonts."""
    logger = logging.getLogger("fontTools")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def write_gallery(out_dir) -> Path:
    """(Re)write ``<out_dir>/README.md``: one line per figure whose PNG is in ``out_dir``.

    Each line gives the title, what the figure shows, a link to the PDF and the image.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# simkit figure gallery",
        "",
        "Regenerated by `make figures` (`python -m simkit figures --out figures`); each figure is",
        "computed by `simkit.figures.<name>.compute` and drawn by `draw`. Do not edit by hand.",
        "",
    ]
    for name, module in FIGURES.items():
        if not (out / f"{name}.png").exists():
            continue
        lines.append(
            f"- **{module.TITLE}** (`{name}`, [PDF]({name}.pdf)) — {module.CAPTION}"
            f"<br>![{module.TITLE}]({name}.png)"
        )
    lines.append("")
    path = out / "README.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
