"""Building blocks for sentences that state a measured result, computed from a figure's data.

A caption or note that says "X grows, Y stays flat" must follow the numbers: the figure modules
build those sentences with these helpers from their own data, and ``tests/test_figure_claims.py``
feeds perturbed data to check that the sentence changes when the data stops supporting it.

- :func:`coefficient_unbounded`: whether a mapping's coefficient c(w) grows without bound as the
  ratio w → ∞ (for either sign of the advantage), probed on one-token sequences;
- :func:`growth`: per series, the value at the first and last x and its classification
  (``"grows"``, ``"flat"``, ``"falls"``) against a factor;
- :data:`PANELS` / :func:`panel_of`: the four families of the small multiples (classic IS;
  clipping; truncation and masking; smooth gates and VESPO).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkit.figures import style

#: panel title -> the style families drawn in it (every registered family is in one panel)
PANELS: dict[str, tuple[str, ...]] = {
    "classic IS": ("classic IS",),
    "clipping": ("clipping", "geometric mean"),
    "truncation and masking": ("truncation", "masking"),
    "smooth gates and VESPO": ("smooth gate", "VESPO"),
}
#: the series drawn as references in every panel
REFERENCES = ("naive", "is_seq")

#: ratios at which :func:`coefficient_unbounded` probes c(w)
PROBE_RATIOS = (1e4, 1e8)


def panel_of(name: str) -> str | None:
    """The :data:`PANELS` title of mapping ``name`` (None for the reference ``naive`` and for
    unregistered names, whose family is ``"other"``)."""
    fam = style.family(name)
    for title, families in PANELS.items():
        if fam in families:
            return title
    return None


def coefficient_unbounded(mapping, factor: float = 10.0) -> bool:
    """True when the coefficient grows without bound in the ratio: for A > 0 or A < 0,
    |c(10⁸)| ≥ ``factor``·|c(10⁴)| and |c(10⁸)| > ``factor``.

    Probed with ``mapping.coefficients`` on one-token sequences (T = 1: the token ratio r, the
    sequence ratio W and the geometric mean s all equal w), so it applies to token- and
    sequence-level mappings alike. c = r (token IS), W (sequence IS), W^α (power, α > 0) and
    PPO clip's A < 0 branch are unbounded; truncation, masks, dual clip, VESPO and naive are not.
    A mapping that needs log π (``requires_log_prob``) is probed at μ = e⁻²⁰ per token, so that
    π = w·μ stays a probability up to w = 10⁸.
    """
    lo, hi = PROBE_RATIOS
    log_ratio = np.log(np.array([[lo], [hi], [lo], [hi]]))
    mask = np.ones_like(log_ratio, dtype=bool)
    advantages = np.array([1.0, 1.0, -1.0, -1.0])
    kwargs = {}
    if mapping.requires_log_prob:  # DPPO, GEPO: log π itself, with μ = e^-20 so that π ≤ 1
        kwargs["log_prob"] = log_ratio - 20.0
    c = np.abs(np.asarray(mapping.coefficients(log_ratio, mask, advantages, **kwargs))[:, 0])
    for small, large in ((c[0], c[1]), (c[2], c[3])):
        if large > factor and large >= factor * small:
            return True
    return False


def growth(frame: pd.DataFrame, value: str, x: str, by: str = "mapping", factor: float = 2.0):
    """Per series ``by``: the ``value`` at the smallest and largest ``x`` and a verdict.

    Returns a DataFrame indexed by the series with ``first``, ``last``, ``ratio`` = last/first
    and ``verdict``: ``"grows"`` if ratio ≥ ``factor``, ``"falls"`` if ratio ≤ 1/``factor``,
    else ``"flat"`` (``"undefined"`` when a value is not finite or first is 0).
    """
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    rows = {}
    for name, part in frame.groupby(by, sort=False):
        part = part.sort_values(x)
        first, last = float(part[value].iloc[0]), float(part[value].iloc[-1])
        ok = math.isfinite(first) and math.isfinite(last) and first > 0
        ratio = last / first if ok else math.nan
        if not ok:
            verdict = "undefined"
        elif ratio >= factor:
            verdict = "grows"
        elif ratio <= 1 / factor:
            verdict = "falls"
        else:
            verdict = "flat"
        rows[name] = {"first": first, "last": last, "ratio": ratio, "verdict": verdict}
    return pd.DataFrame.from_dict(rows, orient="index")


def fmt(value: float) -> str:
    """A number for a sentence: 3 significant digits."""
    return f"{value:.3g}"


def name_list(names) -> str:
    """``a, b and c`` (or ``none``)."""
    names = list(names)
    if not names:
        return "none"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


#: the advantage of each estimator kind, as a formula for a sentence (simkit.estimators)
ADVANTAGE_TEXT = {
    "oracle": "A = R − J(μ), exact baseline of the behaviour",
    "oracle_pi": "A = R − J(π)",
    "grpo": "group-normalised",
    "dr_grpo": "group mean subtracted",
    "rloo": "leave-one-out baseline",
    "raw": "A = R",
}


def advantage_text(kind: str) -> str:
    """``'oracle' (A = R − J(μ), …)``: the advantage name with its formula."""
    formula = ADVANTAGE_TEXT.get(kind)
    return f"'{kind}' ({formula})" if formula else f"'{kind}'"
