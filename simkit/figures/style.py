"""House style: one fixed colour, line style and marker per mapping, shared by every figure.

Families of the notation page share a hue (shades and line styles tell members apart):

=====================  ===========  ===================================================
family                 hue          members
=====================  ===========  ===================================================
reference              black        naive
classic IS             blues        is_token, is_seq, power, snis, psis, soft_shrink, gepo
clipping               oranges      ppo_clip, dual_clip, dapo, aspo, clip_cov, kl_cov,
                                    dppo_tv, dppo_kl, dro
geometric mean         greens       gspo, gmpo, geo_mask, luspo, segment_is
smooth gates           purples      sapo, luffy
truncation             browns       cispo, tis_token, tis_seq
masking                magentas     mis_token, mis_seq, icepop, opsm, token_veto, m2po, topr,
                                    kl_rs, rollout_is
VESPO                  teal         vespo
=====================  ===========  ===================================================

``color(name)``, ``linestyle(name)``, ``marker(name)`` and ``family(name)`` look a mapping up;
an unregistered name (e.g. a user's own mapping) gets a deterministic grey-ish fallback so that
figures never fail on it. ``context()`` applies the house rcParams (font sizes, grid, spines).
"""

from __future__ import annotations

import contextlib
import zlib
from typing import NamedTuple

import matplotlib as mpl


class MappingStyle(NamedTuple):
    family: str
    color: str
    linestyle: str
    marker: str


def _s(family, color, linestyle="-", marker="o"):
    return MappingStyle(family, color, linestyle, marker)


#: registry name -> style (every registered mapping)
MAPPING_STYLES: dict[str, MappingStyle] = {
    # reference
    "naive": _s("reference", "#000000", "-", "o"),
    # classic importance sampling: blues
    "is_token": _s("classic IS", "#6baed6", "--", "v"),
    "is_seq": _s("classic IS", "#08306b", "-", "s"),
    "power": _s("classic IS", "#2171b5", "-.", "^"),
    "snis": _s("classic IS", "#4292c6", ":", "D"),
    "psis": _s("classic IS", "#084594", "--", "P"),
    "soft_shrink": _s("classic IS", "#3f7fbf", (0, (5, 1, 1, 1, 1, 1)), "X"),
    "gepo": _s("classic IS", "#9ecae1", (0, (1, 1)), "h"),
    # clipping: oranges / reds
    "ppo_clip": _s("clipping", "#d94801", "-", "o"),
    "dual_clip": _s("clipping", "#f16913", "--", "s"),
    "dapo": _s("clipping", "#fd8d3c", "-.", "^"),
    "aspo": _s("clipping", "#a63603", ":", "D"),
    "clip_cov": _s("clipping", "#fdae6b", (0, (3, 1, 1, 1)), "X"),
    "kl_cov": _s("clipping", "#e6550d", (0, (1, 1)), "P"),
    "dppo_tv": _s("clipping", "#7f2704", "-", "*"),
    "dppo_kl": _s("clipping", "#7f2704", "--", "h"),
    "dro": _s("clipping", "#f03b20", "-", "d"),
    # geometric mean: greens
    "gspo": _s("geometric mean", "#238b45", "-", "o"),
    "gmpo": _s("geometric mean", "#41ab5d", "--", "s"),
    "geo_mask": _s("geometric mean", "#00441b", "-.", "^"),
    "luspo": _s("geometric mean", "#74c476", ":", "D"),
    "segment_is": _s("geometric mean", "#006d2c", (0, (3, 1, 1, 1)), "X"),
    # smooth gates: purples
    "sapo": _s("smooth gate", "#6a51a3", "-", "o"),
    "luffy": _s("smooth gate", "#9e9ac8", "--", "s"),
    # truncation: browns / golds
    "cispo": _s("truncation", "#8c6d31", "-", "o"),
    "tis_token": _s("truncation", "#bd9e39", "--", "v"),
    "tis_seq": _s("truncation", "#6b4c11", "-.", "s"),
    # masking: magentas / pinks
    "mis_token": _s("masking", "#e7298a", "--", "v"),
    "mis_seq": _s("masking", "#980043", "-", "s"),
    "icepop": _s("masking", "#df65b0", "-.", "^"),
    "opsm": _s("masking", "#c994c7", ":", "D"),
    "token_veto": _s("masking", "#dd3497", (0, (1, 1)), "x"),
    "m2po": _s("masking", "#7a0177", "--", "P"),
    "topr": _s("masking", "#ae017e", (0, (3, 1, 1, 1)), "*"),
    "kl_rs": _s("masking", "#f768a1", (0, (5, 2)), "h"),
    "rollout_is": _s("masking", "#fa9fb5", "-", "d"),
    # VESPO: teal
    "vespo": _s("VESPO", "#01665e", "-", "h"),
}

#: family -> representative colour (for family legends)
FAMILY_COLORS: dict[str, str] = {
    "reference": "#000000",
    "classic IS": "#2171b5",
    "clipping": "#d94801",
    "geometric mean": "#238b45",
    "smooth gate": "#6a51a3",
    "truncation": "#8c6d31",
    "masking": "#ae017e",
    "VESPO": "#01665e",
}

_FALLBACK_COLORS = ("#737373", "#525252", "#969696", "#8da0cb", "#a6761d", "#666666")
_FALLBACK_STYLES = ("-", "--", "-.", ":")
_FALLBACK_MARKERS = ("o", "s", "^", "D", "v", "P")

#: colours for non-mapping series (divergences, reference lines)
SERIES_COLORS: dict[str, str] = {
    "tv_sq": "#1b9e77",
    "half_kl": "#d95f02",
    "half_log1p_chi2": "#7570b3",
    "half_chi2": "#e7298a",
    "identity": "#7f7f7f",
}


def style(name: str) -> MappingStyle:
    """The :class:`MappingStyle` of mapping ``name`` (deterministic fallback if unregistered)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a mapping registry name (str), got {type(name).__name__}")
    if name in MAPPING_STYLES:
        return MAPPING_STYLES[name]
    h = zlib.crc32(name.encode())
    return MappingStyle(
        "other",
        _FALLBACK_COLORS[h % len(_FALLBACK_COLORS)],
        _FALLBACK_STYLES[(h // 7) % len(_FALLBACK_STYLES)],
        _FALLBACK_MARKERS[(h // 31) % len(_FALLBACK_MARKERS)],
    )


def color(name: str) -> str:
    """Hex colour of mapping ``name`` (the same in every figure)."""
    return style(name).color


def linestyle(name: str):
    """Matplotlib line style of mapping ``name``."""
    return style(name).linestyle


def marker(name: str) -> str:
    """Matplotlib marker of mapping ``name``."""
    return style(name).marker


def family(name: str) -> str:
    """Family of mapping ``name`` (``"other"`` if unregistered)."""
    return style(name).family


def line_kwargs(name: str, **overrides) -> dict:
    """``color``/``linestyle``/``label`` keyword arguments for ``Axes.plot`` of mapping ``name``."""
    kw = {"color": color(name), "linestyle": linestyle(name), "label": name}
    kw.update(overrides)
    return kw


#: house rcParams: readable at paper size (single column ≈ 3.4 in, double ≈ 7 in)
RC: dict = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 7.5,
    "legend.frameon": False,
    "figure.titlesize": 11,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.linewidth": 0.8,
    "lines.linewidth": 1.4,
    "lines.markersize": 4,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.05,
    "pdf.fonttype": 42,  # TrueType in PDF: editable text, no Type-3 fonts
    "mathtext.fontset": "dejavusans",
    "svg.hashsalt": "simkit",
}

#: fixed resolution of the PNGs written by ``simkit.figures.render``
DPI = 150


@contextlib.contextmanager
def context():
    """Apply the house style inside a ``with`` block (Agg-safe; no pyplot state)."""
    with mpl.rc_context(RC):
        yield
