"""Every scalar mapping of the catalogue: coefficient φ(ratio) for A > 0 and A < 0.

One small panel per :class:`~simkit.mappings.ScalarMapping` in registry order (default
hyperparameters), φ against the ratio it acts on — the token ratio r_t (token level), the
sequence ratio W or the geometric mean s (the mapping's ``ratio_kind``) — on
[0, w_max], with the identity φ = ratio (plain IS) dotted for reference.

Data: a tidy DataFrame with columns ``mapping``, ``family``, ``level``, ``ratio`` (symbol of the
ratio), ``advantage`` (``"A>0"``/``"A<0"``), ``w``, ``phi``, ``f``.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from simkit import mappings
from simkit.figures import _common, style

NAME = "kernel_shapes_catalogue"
TITLE = "Coefficient φ of every scalar mapping"
CAPTION = (
    "φ(ratio) for A > 0 (solid) and A < 0 (dashed) of each mapping of the catalogue whose "
    "coefficient is a function of one ratio (r_t, W or s), default hyperparameters, "
    "with φ = ratio dotted."
)

#: the mapping contract's ``ratio_kind`` -> the symbol of that ratio
RATIO_SYMBOLS = {"token": "r_t", "sequence": "W", "geometric": "s"}


@dataclass(frozen=True)
class Config:
    w_max: float = 3.0
    n_points: int = 601

    def __post_init__(self):
        _common.check_ratio_grid(self.w_max, self.n_points)


def config(small: bool = False) -> Config:
    return Config(n_points=121) if small else Config()


def ratio_symbol(mapping) -> str:
    """Symbol of the ratio a ScalarMapping's φ acts on (its ``ratio_kind``): r_t, W or s."""
    return RATIO_SYMBOLS[mapping.ratio_kind]


def scalar_mappings() -> list[str]:
    """Registry names of the mappings that expose φ of one ratio (ScalarMapping)."""
    return [
        name
        for name in mappings.available()
        if isinstance(mappings.get(name), mappings.ScalarMapping)
    ]


def compute(cfg: Config) -> pd.DataFrame:
    """φ and f of every scalar mapping on a grid of the ratio, for both advantage signs.

    The grid starts at w_max/(n_points−1) rather than 0 (some surrogates, e.g. log w of the naive
    mapping, are infinite at 0).
    """
    w = np.linspace(cfg.w_max / (cfg.n_points - 1), cfg.w_max, cfg.n_points - 1)
    frames = []
    for name in scalar_mappings():
        mapping = mappings.get(name)
        for positive, sign in ((True, "A>0"), (False, "A<0")):
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
                phi = np.broadcast_to(np.asarray(mapping.phi(w, positive), float), w.shape)
                f = np.broadcast_to(np.asarray(mapping.f(w, positive), float), w.shape)
            frames.append(
                pd.DataFrame(
                    {
                        "mapping": name,
                        "family": style.family(name),
                        "level": mapping.level,
                        "ratio": ratio_symbol(mapping),
                        "advantage": sign,
                        "w": w,
                        "phi": phi,
                        "f": f,
                    }
                )
            )
    data = pd.concat(frames, ignore_index=True)
    data.attrs["not_scalar"] = [n for n in mappings.available() if n not in scalar_mappings()]
    return data


def draw(data: pd.DataFrame):
    names = list(dict.fromkeys(data.mapping))
    columns = min(5, len(names))
    rows = math.ceil(len(names) / columns)
    fig = _common.new_figure(7.0, 1.35 * rows + 0.8)
    axes = np.atleast_2d(fig.subplots(rows, columns, sharex=True, sharey=True, squeeze=False))
    w_max = float(data.w.max())
    for ax, name in zip(axes.flat, names, strict=False):
        part = data[data.mapping == name]
        ax.plot(
            [0, w_max],
            [0, w_max],
            color=style.SERIES_COLORS["identity"],
            linestyle=":",
            linewidth=0.8,
        )
        for sign, ls, alpha in (("A>0", "-", 1.0), ("A<0", "--", 0.85)):
            line = part[part.advantage == sign]
            ax.plot(
                line.w,
                line.phi,
                color=style.color(name),
                linestyle=ls,
                alpha=alpha,
                linewidth=1.5,
                label=sign,
            )
        ratio = part.ratio.iloc[0]
        ax.set_title(f"{name}  (${ratio}$)", fontsize=8, pad=2)
        ax.set_xlim(0, w_max)
        ax.set_ylim(-0.1, 3.1)
        ax.tick_params(labelsize=7)
    used = len(names)
    for k, ax in enumerate(axes.flat):
        r, c = divmod(k, columns)
        below_unused = (r + 1) * columns + c >= used
        if k < used and (r == rows - 1 or below_unused):
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel("ratio", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel(r"$\varphi$", fontsize=8)
    handles = [
        _line(color="0.2", linestyle="-", label=r"$A > 0$"),
        _line(color="0.2", linestyle="--", label=r"$A < 0$"),
        _line(
            color=style.SERIES_COLORS["identity"], linestyle=":", label=r"$\varphi$ = ratio (IS)"
        ),
    ]
    skipped = data.attrs.get("not_scalar", [])
    note = (
        textwrap.fill("not a function of one ratio (not drawn): " + ", ".join(skipped), width=45)
        if skipped
        else ""
    )
    spare = list(axes.flat[used:])
    for ax in spare:
        ax.axis("off")
    if spare:  # legend and note in the empty cells of the last row
        spare[0].legend(handles=handles, loc="upper left", frameon=False, fontsize=8)
        if note:
            text = spare[0].text(
                0.0,
                0.25,
                note,
                transform=spare[0].transAxes,
                ha="left",
                va="top",
                fontsize=7,
                color="0.35",
            )
            text.set_in_layout(False)
    else:
        fig.legend(handles=handles, loc="outside lower center", ncol=3)
        if note:
            fig.text(
                0.99,
                0.005,
                note.replace("\n", " "),
                ha="right",
                va="bottom",
                fontsize=7,
                color="0.35",
            )
    fig.suptitle(
        r"Coefficient $\varphi$ of each scalar mapping vs its ratio "
        r"($r_t$ token, $W$ sequence, $s$ geometric mean)"
    )
    return fig


def _line(**kw) -> Line2D:
    """A legend-only line handle."""
    return Line2D([], [], linewidth=1.5, **kw)
