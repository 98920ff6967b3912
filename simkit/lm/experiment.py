"""Gradient study on a real language model, and its comparison with the token-MDP simulation.

The import path of the first version, kept so that old code runs: the study is split by idea
into :mod:`simkit.lm.behaviour` (μ), :mod:`simkit.lm.sampling` (drawing responses),
:mod:`simkit.lm.scores` (per-token scores and per-sample gradients), :mod:`simkit.lm.metrics`
(bias and variance against an estimated ∇J), :mod:`simkit.lm.study` (:func:`gradient_study`)
and :mod:`simkit.lm.twin` (the simulation twin and the comparison); resolving a behaviour
argument is :func:`simkit.lm.mismatch.resolve_behaviour`. New code imports those modules.
"""

from __future__ import annotations

from simkit.lm.behaviour import (
    Behaviour,
)
from simkit.lm.metrics import (
    bias_statistics,
    gradient_metrics,
)
from simkit.lm.mismatch import (
    as_behaviour,
    resolve_behaviour,
    temperature_behaviour,
)
from simkit.lm.sampling import (
    response_log_probs,
    sample_group,
    token_divergences,
)
from simkit.lm.scores import (
    GRAD_METHODS,
    LOSS_PATHS,
    PARAMETER_PRESETS,
    final_hidden_and_logits,
    head_parameter_names,
    head_scores,
    parameter_dim,
    per_sample_gradients,
    per_token_scores,
    resolve_grad_method,
    select_parameters,
)
from simkit.lm.study import (
    MAX_STORED_VALUES,
    StudyResult,
    default_estimators,
    estimator_token_weights,
    gradient_study,
    model_fingerprint,
)
from simkit.lm.twin import (
    compare,
    hazards_from_running,
    predict,
    rank_agreement,
    relative_metrics,
    simulation_twin,
)

__all__ = [
    "GRAD_METHODS",
    "LOSS_PATHS",
    "MAX_STORED_VALUES",
    "PARAMETER_PRESETS",
    "Behaviour",
    "StudyResult",
    "as_behaviour",
    "bias_statistics",
    "compare",
    "default_estimators",
    "estimator_token_weights",
    "final_hidden_and_logits",
    "gradient_metrics",
    "gradient_study",
    "hazards_from_running",
    "head_parameter_names",
    "head_scores",
    "model_fingerprint",
    "parameter_dim",
    "per_sample_gradients",
    "per_token_scores",
    "predict",
    "rank_agreement",
    "relative_metrics",
    "resolve_behaviour",
    "resolve_grad_method",
    "response_log_probs",
    "sample_group",
    "select_parameters",
    "simulation_twin",
    "temperature_behaviour",
    "token_divergences",
]
