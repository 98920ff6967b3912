"""Named training recipes: the policy losses of the papers as trainers run them.

A trainer's "GRPO" or "VESPO" is more than a weight mapping: it is a mapping with its
hyperparameters, an aggregation (how the token terms are normalised), an advantage and a
**mode** — which policies the ratio compares:

- ``"bypass"``: π_old := μ, one ratio π/μ (verl's ``bypass_mode``, TRL's AsyncGRPO): the
  mapping acts on the ratio of the trainer's π to the engine's μ;
- ``"decoupled"``: the trainer recomputes π_old (θ at the start of the rollout) and the loss is
  the mapping on π/π_old times a detached correction on π_old/μ (Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"; verl's decoupled
  presets).

All use the GRPO group advantage A = (R − mean_G)/(std_G + ε) over groups of G consecutive
responses:

========  ====================================  ==========  =========  =======================
recipe    mapping [× correction]                aggregation  mode       source
========  ====================================  ==========  =========  =======================
grpo      ``ppo_clip`` (ε = 0.2)                seq-mean    bypass     DeepSeekMath 2024
gspo      ``gspo`` (paper ε 3e-4/4e-4)          seq-mean    bypass     GSPO (Zheng 2025)
sapo      ``sapo`` (τ 1.0 / 1.05)               seq-mean    bypass     SAPO (Gao 2025)
vespo     ``vespo`` ((k, λ) = (2,3)/(3,2))      token-mean  bypass     VESPO (2602.10693)
tis       ``ppo_clip`` × ``tis_token`` (C = 2)  token-mean  decoupled  Yao et al. 2025
mis       ``mis_seq`` (C = 2)                   token-mean  bypass     rl-collapse (seq MIS)
geo_mask  ``geo_mask`` ([0.5, 2])               token-mean  bypass     rl-collapse (Geo-Mask)
naive     ``naive`` (c = 1)                     token-mean  bypass     REINFORCE on μ
ppo_tis   ``dual_clip`` (verl) × ``tis_token``  seq-mean    decoupled  verl vanilla PPO
========  ====================================  ==========  =========  =======================

(seq-mean: seq-mean-token-mean.)

``tis`` is Yao et al.'s decoupled PPO × token TIS (PPO clip ε = 0.2 on π/π_old, min(π_old/μ, 2)
on the engine leg), not REINFORCE × min(π/μ, 2); ``ppo_tis`` is verl's: its vanilla PPO loss
always applies the dual clip ``clip_ratio_c`` = 3 to A < 0 tokens (``dual_clip`` preset
``verl``). A single-ratio recipe in bypass mode has no correction (a PPO clip × TIS on the one
ratio π/μ would count it twice and is refused: :func:`simkit.composition.check_correction`).

:func:`recipe` builds the :class:`~simkit.estimators.Estimator` (named after the recipe, e.g.
``"VESPO"``); :func:`recipe_entry` gives the equivalent ``[[estimators]]`` table of a training
sweep config; :func:`recipe_label` the legend label, with the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from simkit import mappings
from simkit.estimators import Estimator

__all__ = [
    "COMPOSED_RECIPES",
    "MODES",
    "RECIPES",
    "Recipe",
    "composed_available",
    "recipe",
    "recipe_entry",
    "recipe_label",
    "recipe_of",
]

#: the two ways a recipe compares policies (module docstring)
MODES = ("bypass", "decoupled")


@dataclass(frozen=True)
class Recipe:
    """A paper's loss as a trainer runs it: display ``label``, ``mapping`` (with ``preset``),
    ``aggregation``, ``mode`` (:data:`MODES`) and, in decoupled mode, the ``correction`` on
    π_old/μ (with ``correction_preset``)."""

    label: str
    mapping: str
    preset: str | None
    aggregation: str
    mode: str = "bypass"
    correction: str | None = None
    correction_preset: str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Recipe.mode must be one of {MODES}, got {self.mode!r}")
        if (self.mode == "decoupled") != (self.correction is not None):
            raise ValueError("a decoupled recipe has a correction; a bypass recipe has none")


RECIPES: dict[str, Recipe] = {
    "grpo": Recipe("GRPO", "ppo_clip", None, "seq-mean-token-mean"),
    "gspo": Recipe("GSPO", "gspo", "paper", "seq-mean-token-mean"),
    "sapo": Recipe("SAPO", "sapo", None, "seq-mean-token-mean"),
    "vespo": Recipe("VESPO", "vespo", None, "token-mean"),
    "tis": Recipe("token-TIS", "ppo_clip", None, "token-mean", "decoupled", "tis_token"),
    "mis": Recipe("seq-MIS", "mis_seq", None, "token-mean"),
    "geo_mask": Recipe("Geo-Mask", "geo_mask", None, "token-mean"),
    "naive": Recipe("naive", "naive", None, "token-mean"),
    "ppo_tis": Recipe(
        "dual-clip PPO × TIS", "dual_clip", "verl", "seq-mean-token-mean", "decoupled", "tis_token"
    ),
}

#: the recipes with a correction on π_old/μ (decoupled mode)
COMPOSED_RECIPES = tuple(name for name, r in RECIPES.items() if r.correction is not None)


def composed_available() -> bool:
    """True when :class:`~simkit.estimators.Estimator` takes a ``correction`` (issue 15)."""
    return "correction" in getattr(Estimator, "__dataclass_fields__", {})


def _check(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        available = ", ".join(RECIPES)
        raise KeyError(f"unknown recipe {name!r}; available recipes: {available}") from None


def recipe_label(name: str, mode: bool = True) -> str:
    """The display label of a recipe with its mode (``"grpo"`` → ``"GRPO (bypass)"``; without
    the mode when ``mode=False``)."""
    r = _check(name)
    return f"{r.label} ({r.mode})" if mode else r.label


def recipe(name: str, group_size: int = 8) -> Estimator:
    """The estimator of recipe ``name`` with the GRPO advantage over groups of ``group_size``.

    Its ``name`` is the recipe's label without the mode (``"GRPO"``, ``"VESPO"``, …), so that
    tables read as the papers do. (In a training sweep the estimators of ``[[estimators]]``
    tables get the registry's names, e.g. ``"ppo_clip [seq-mean-token-mean, grpo, G=8]"``;
    :func:`recipe_of` maps them back.)
    """
    r = _check(name)
    correction = None
    if r.correction is not None:
        correction = mappings.get(r.correction, preset=r.correction_preset)
    return Estimator(
        mappings.get(r.mapping, preset=r.preset),
        correction=correction,
        aggregation=r.aggregation,
        advantage="grpo",
        group_size=group_size,
        name=r.label,
    )


def recipe_entry(name: str, group_size: int = 8) -> dict:
    """The ``[[estimators]]`` table (plain dict) of recipe ``name`` in a training sweep; a
    decoupled recipe's table names its ``correction`` and ``mode``."""
    r = _check(name)
    entry = {
        "mapping": r.mapping,
        "aggregations": [r.aggregation],
        "advantages": ["grpo"],
        "group_size": int(group_size),
    }
    if r.preset is not None:
        entry["preset"] = r.preset
    if r.correction is not None:
        entry["correction"] = r.correction
        entry["mode"] = r.mode
        if r.correction_preset is not None:
            entry["correction_preset"] = r.correction_preset
    return entry


def recipe_of(mapping: str, aggregation: str, correction: str | None = None) -> str | None:
    """The recipe whose mapping, aggregation and ``correction`` (None: a bypass recipe) these
    are (None if no recipe matches)."""
    for name, r in RECIPES.items():
        if (r.mapping, r.aggregation, r.correction) == (mapping, aggregation, correction):
            return name
    return None
