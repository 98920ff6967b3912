"""Environments with oracle quantities (exact π, J, ∇J) that sample batches for the estimators.

An environment provides sampling (``sample``), the log-ratios of its samples, the exact policy
gradient ``grad_J`` and gradient accumulation ``accumulate(actions, token_weights)`` =
Σ_{i,t} λ_{i,t} ∇θ log π(y_{i,t}|s_{i,t}); the estimators (:mod:`simkit.estimators`) provide the
per-token weights λ.
"""

from simkit.envs.bandit import Bandit, BanditBatch, BanditSupport
from simkit.envs.behaviour import BehaviourSpec, concentrated, toxic_tail
from simkit.envs.token_mdp import TokenMDP, TokenSupport, exact_token_level_mean
from simkit.envs.token_sampling import TokenBatch, accumulate_tokens, sample_tokens

__all__ = [
    "Bandit",
    "BanditBatch",
    "BanditSupport",
    "BehaviourSpec",
    "TokenBatch",
    "TokenMDP",
    "TokenSupport",
    "accumulate_tokens",
    "concentrated",
    "exact_token_level_mean",
    "sample_tokens",
    "toxic_tail",
]
