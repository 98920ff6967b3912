"""Named training recipes: the policy losses of the papers as mapping × aggregation × advantage.

A trainer's "GRPO" or "VESPO" is more than a weight mapping: it is a mapping with its
hyperparameters, an aggregation (how the token terms are normalised) and an advantage. The
recipes below are the combinations the papers describe (notation page
``docs/reference.md``, sections B–E), all with the GRPO group advantage
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

**Composed recipes** (:data:`COMPOSED_RECIPES`, three policies: a mapping on π/π_old times a
correction on π_old/μ, the composed estimators of issue 15): ``ppo_tis`` = verl's decoupled
PPO (ε = 0.2) × token TIS (C = 2), seq-mean-token-mean. They need
``Estimator(mapping, correction=…, mode=…)``; :func:`composed_available` says whether this
build has it, and :func:`recipe` raises a clear error otherwise.
"""

from __future__ import annotations

from simkit import mappings
from simkit.estimators import Estimator

__all__ = [
    "COMPOSED_RECIPES",
    "RECIPES",
    "composed_available",
    "recipe",
    "recipe_entry",
    "recipe_label",
    "recipe_of",
]

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


#: composed recipe -> (display label, mapping on π/π_old, correction on π_old/μ, mode, aggregation)
COMPOSED_RECIPES: dict[str, tuple[str, str, str, str, str]] = {
    "ppo_tis": ("dec. PPO + TIS", "ppo_clip", "tis_token", "decoupled", "seq-mean-token-mean"),
}


def composed_available() -> bool:
    """True when :class:`~simkit.estimators.Estimator` takes a ``correction`` (issue 15)."""
    return "correction" in getattr(Estimator, "__dataclass_fields__", {})


def _check(name: str) -> tuple[str, str, str | None, str]:
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(
            f"unknown recipe {name!r}; available recipes: "
            f"{', '.join([*RECIPES, *COMPOSED_RECIPES])}"
        ) from None


def recipe_label(name: str) -> str:
    """The display label of a recipe (``"grpo"`` → ``"GRPO"``)."""
    if name in COMPOSED_RECIPES:
        return COMPOSED_RECIPES[name][0]
    return _check(name)[0]


def recipe(name: str, group_size: int = 8) -> Estimator:
    """The estimator of recipe ``name`` with the GRPO advantage over groups of ``group_size``.

    Its ``name`` is the recipe's label (``"GRPO"``, ``"VESPO"``, …), so that tables and legends
    read as the papers do. (In a training sweep the estimators of ``[[estimators]]`` tables get
    the registry's names, e.g. ``"ppo_clip [seq-mean-token-mean, grpo, G=8]"``;
    :func:`recipe_of` maps them back.)
    """
    if name in COMPOSED_RECIPES:
        label, mapping, correction, mode, aggregation = COMPOSED_RECIPES[name]
        if not composed_available():
            raise ValueError(
                f"recipe {name!r} ({label}) needs composed estimators (Estimator(mapping, "
                "correction=..., mode=...), issue 15), which this build does not have"
            )
        return Estimator(
            mappings.get(mapping),
            correction=correction,
            mode=mode,
            aggregation=aggregation,
            advantage="grpo",
            group_size=group_size,
            name=label,
        )
    label, mapping, preset, aggregation = _check(name)
    return Estimator(
        mappings.get(mapping, preset=preset),
        aggregation=aggregation,
        advantage="grpo",
        group_size=group_size,
        name=label,
    )


def recipe_entry(name: str, group_size: int = 8) -> dict:
    """The ``[[estimators]]`` table (plain dict) of recipe ``name`` in a training sweep; a
    composed recipe's table names its ``correction`` and ``mode`` (composed estimators in
    :class:`simkit.config.schema.EstimatorConfig`, issue 15)."""
    if name in COMPOSED_RECIPES:
        _, mapping, correction, mode, aggregation = COMPOSED_RECIPES[name]
        return {
            "mapping": mapping,
            "aggregations": [aggregation],
            "advantages": ["grpo"],
            "group_size": int(group_size),
            "correction": correction,
            "mode": mode,
        }
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


def recipe_of(mapping: str, aggregation: str, correction: str | None = None) -> str | None:
    """The recipe whose mapping, aggregation and ``correction`` (None: a plain recipe) these
    are (None if no recipe matches)."""
    if correction is not None:
        for name, (_, m, corr, _, agg) in COMPOSED_RECIPES.items():
            if (m, corr, agg) == (mapping, correction, aggregation):
                return name
        return None
    for name, (_, m, _, agg) in RECIPES.items():
        if m == mapping and agg == aggregation:
            return name
    return None
