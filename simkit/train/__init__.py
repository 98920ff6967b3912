"""Training dynamics: policy optimisation on a token MDP under staleness, lag and mismatch.

Bias and variance of one gradient are the cause; what users see is training that collapses or
not. :func:`train` runs a policy — tabular (logits over the token MDP's positions × states ×
vocabulary), tied over positions, or low-rank features (:mod:`~simkit.train.params`) — with
the rollout/update schedule of real trainers — a rollout batch from μ split
into N mini-batches updated in sequence (staleness N), an optional asynchronous lag of k policy
versions, an inference-mismatch model (:class:`Mismatch`: logit noise, bf16/fp16 rounding,
toxic-tail spikes) — with any mapping × aggregation × advantage of the registry, and records
per step the exact J, ∇J and the estimator's cosine to it, the χ²/KL between π and μ, ESS,
clip/mask fraction and gradient norms (:data:`COLUMNS`).

>>> from simkit.envs import TokenMDP
>>> from simkit.estimators import Estimator
>>> from simkit.train import TrainConfig, train
>>> env = TokenMDP.at_least_k(V=4, T=8, k=3, seed=0)
>>> cfg = TrainConfig(Estimator("ppo_clip", advantage="grpo", group_size=4),
...                   steps=40, batch=32, minibatches=4)
>>> table = train(env, cfg, seed=0)

Grids of runs go through the sweep machinery (:class:`simkit.config.TrainSweepConfig`,
``kind = "train"`` TOML files, :func:`simkit.sweep.run_sweep`, ``simkit train CONFIG``).

Modules: :mod:`~simkit.train.core` (the run), :mod:`~simkit.train.hyperparameters`
(:class:`TrainConfig`), :mod:`~simkit.train.rollout` (one rollout, one optimizer step),
:mod:`~simkit.train.records` (the columns, exact by DP), :mod:`~simkit.train.checkpoints`
(chunks, checkpoints, resume), :mod:`~simkit.train.mismatch`
(the inference-engine model), :mod:`~simkit.train.optim` (SGD, Adam), :mod:`~simkit.train.recipes`
(the papers' losses: GRPO, GSPO, SAPO, VESPO, token-TIS, seq-MIS, Geo-Mask),
:mod:`~simkit.train.params` (tabular / tied / features parameterisations),
:mod:`~simkit.train.worlds` (prompt distributions, sparse rewards, distractors),
:mod:`~simkit.train.analysis` (J*, per-run summaries, failure labels, bands over seeds) and
:mod:`~simkit.train.cli` (``simkit train``).
"""

from simkit.train.core import (
    COLUMNS,
    GRADIENTS,
    TrainConfig,
    TrainError,
    checkpoint_step,
    config_dict,
    load_checkpoint,
    load_run,
    policy_logits,
    train,
)
from simkit.train.mismatch import (
    PRECISIONS,
    Mismatch,
    behaviour_log_probs,
    log_softmax,
    round_bf16,
    round_fp16,
    round_logits,
)
from simkit.train.optim import OPTIMIZERS, SGD, Adam, clip_grad_norm, make_optimizer
from simkit.train.params import PARAMETERIZATIONS, Parameterization, parameterization
from simkit.train.recipes import RECIPES, recipe
from simkit.train.records import prompt_rows
from simkit.train.worlds import (
    Prompts,
    difficulty_prompts,
    distractor,
    prompt_set,
    sparse_pattern,
)

__all__ = [
    "COLUMNS",
    "GRADIENTS",
    "OPTIMIZERS",
    "PARAMETERIZATIONS",
    "PRECISIONS",
    "RECIPES",
    "SGD",
    "Adam",
    "Mismatch",
    "Parameterization",
    "Prompts",
    "TrainConfig",
    "TrainError",
    "behaviour_log_probs",
    "checkpoint_step",
    "clip_grad_norm",
    "config_dict",
    "difficulty_prompts",
    "distractor",
    "load_checkpoint",
    "load_run",
    "log_softmax",
    "make_optimizer",
    "parameterization",
    "policy_logits",
    "prompt_rows",
    "prompt_set",
    "recipe",
    "round_bf16",
    "round_fp16",
    "round_logits",
    "sparse_pattern",
    "train",
]
