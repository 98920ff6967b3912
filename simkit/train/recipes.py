"""Named training recipes: the policy losses of the papers as mapping × aggregation × advantage.

A trainer's "GRPO" or "VESPO" is more than a weight mapping: it is a mapping with its
hyperparameters, an aggregation (how the token terms are normalised) and an advantage. The
recipes below are the combinations the papers describe (reference sheet
``shared/reference/weight-mappings.md``, sections B–E), all with the GRPO group advantage
A = (R − mean_G)/(std_G + ε) over groups of G consecutive responses:

=========  =============================  ======================  =================================
recipe     mapping (hyperparameters)      aggregation             source
=========  =============================  ======================  =================================
grpo       ``ppo_clip`` (ε = 0.2)         seq-mean-token-mean     DeepSeekMath (Shao et al. 2024)
gspo       ``gspo`` (paper ε 3e-4/4e-4)   seq-mean-token-mean     GSPO (Zheng et al. 2025)
sapo       ``sapo`` (τ 1.0 / 1.05)        seq-mean-token-mean     SAPO (Gao et al. 2025)
vespo      ``vespo`` ((k, λ) = (2,3)/(3,2)) token-mean            VESPO (arXiv 2602.10693)
tis        ``tis_token`` (C = 2)          token-mean              Yao et al. 2025 (token TIS)
mis        ``mis_seq`` (C = 2)            token-mean              rl-collapse (seq-level MIS)
geo_mask   ``geo_mask`` ([0.5, 2])        token-mean              rl-collapse part 3 (Geo-Mask)
naive      ``naive`` (c = 1)              token-mean              no correction (REINFORCE on μ)
=========  =============================  ======================  =================================

:func:`recipe` builds the :class:`~simkit.estimators.Estimator` (named after the recipe, e.g.
``"VESPO"``); :func:`recipe_entry` gives the equivalent ``[[estimators]]`` table of a training
sweep config.
"""

from __future__ import annotations

from simkit import mappings
from simkit.estimators import Estimator

__all__ = ["RECIPES", "recipe", "recipe_entry", "recipe_label", "recipe_of"]

#: recipe -> (display label, mapping, preset or None, aggregation)
RECIPES: dict[str, tuple[str, str, str | None, str]] = {
    "grpo": ("GRPO", "ppo_clip", None, "seq-mean-token-mean"),
    "gspo": ("GSPO", "gspo", "paper", "seq-mean-token-mean"),
    "sapo": ("SAPO", "sapo", None, "seq-mean-token-mean"),
    "vespo": ("VESPO", "vespo", None, "token-mean"),
    "tis": ("token-TIS", "tis_token", None, "token-mean"),
    "mis": ("seq-MIS", "mis_seq", None, "token-mean"),
    "geo_mask": ("Geo-Mask", "geo_mask", None, "token-mean"),
    "naive": ("naive", "naive", None, "token-mean"),
}


def _check(name: str) -> tuple[str, str, str | None, str]:
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(
            f"unknown recipe {name!r}; available recipes: {', '.join(RECIPES)}"
        ) from None


def recipe_label(name: str) -> str:
    """The display label of a recipe (``"grpo"`` → ``"GRPO"``)."""
    return _check(name)[0]


def recipe(name: str, group_size: int = 8) -> Estimator:
    """The estimator of recipe ``name`` with the GRPO advantage over groups of ``group_size``.

    Its ``name`` is the recipe's label (``"GRPO"``, ``"VESPO"``, …), so that tables and legends
    read as the papers do. (In a training sweep the estimators of ``[[estimators]]`` tables get
    the registry's names, e.g. ``"ppo_clip [seq-mean-token-mean, grpo, G=8]"``;
    :func:`recipe_of` maps them back.)
    """
    label, mapping, preset, aggregation = _check(name)
    return Estimator(
        mappings.get(mapping, preset=preset),
        aggregation=aggregation,
        advantage="grpo",
        group_size=group_size,
        name=label,
    )


def recipe_entry(name: str, group_size: int = 8) -> dict:
    """The ``[[estimators]]`` table (plain dict) of recipe ``name`` in a training sweep."""
    _, mapping, preset, aggregation = _check(name)
    entry = {
        "mapping": mapping,
        "aggregations": [aggregation],
        "advantages": ["grpo"],
        "group_size": int(group_size),
    }
    if preset is not None:
        entry["preset"] = preset
    return entry


def recipe_of(mapping: str, aggregation: str) -> str | None:
    """The recipe whose mapping and aggregation these are (None if no recipe matches)."""
    for name, (_, m, _, agg) in RECIPES.items():
        if m == mapping and agg == aggregation:
            return name
    return None
