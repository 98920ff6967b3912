"""Policy optimisation on a token MDP with the rollout/update schedule of real RL trainers.

The policy is π(·|t, s) = softmax(L(θ)[t, policy_index[s]]) on a :class:`~simkit.envs.TokenMDP`,
with the logits L(θ) of ``config.parameterization`` (:mod:`simkit.train.params`): ``"tabular"``
θ = L of shape (T, P, V) (the default), ``"tied"`` (one table for all positions) or
``"features"`` (low-rank embeddings); L(θ₀) = ``env.logits``. Gradients w.r.t. the logits
(exact ∇J, the estimator's ĝ) are pulled back to θ by the chain rule. One **rollout**:

1. the behaviour parameters θ_b are the trainer's θ ``lag_updates`` = L optimizer updates
   before the rollout starts, θ_{max(rN − L, 0)} (asynchronous RL, lag counted in updates; the
   first rollouts use θ_0; the older ``lag`` = k counts rollouts, L = kN). Every row records
   ``policy_age`` (min/mean/max over the mini-batch; one behaviour per rollout here, so the
   three agree): the updates between θ_b and the θ being updated, rN + j − max(rN − L, 0);
2. the inference engine serves μ = :func:`~simkit.train.mismatch.behaviour_log_probs` (θ_b,
   ``mismatch``): μ = π_b without mismatch, else noisy / rounded / spiked;
3. ``batch`` sequences y ~ μ are drawn (:func:`simkit.envs.sample_tokens`, vectorised), their
   rewards and advantages computed once for the whole batch (as verl/TRL do; the ``oracle``
   baseline is the exact J(μ) of the behaviour that produced the batch — what a group or batch
   mean estimates —, ``oracle_pi`` the exact J of the trainer's θ at that moment);
4. the batch is split into ``minibatches`` = N consecutive mini-batches of B/N sequences and
   the trainer takes one optimizer step on each, in order: mini-batch j is scored with π_j =
   softmax(θ after j updates of this rollout) against the μ that generated it — the staleness
   N = global batch / mini batch of PPO-style trainers (VESPO, arXiv 2602.10693, §5).

**Three policies.** The trainer holds μ (the inference engine's policy: θ lagged by ``lag``
rollouts, through the ``mismatch``), π_old (θ at the start of the current rollout: the
trainer's own recompute of the rollout's log-probabilities, as verl and TRL do before the
mini-batch loop) and π = π_j (the current θ). Staleness separates π from π_old; lag and
mismatch separate π_old from μ. The exact columns ``kl_seq_old`` (π‖π_old) and
``kl_seq_old_mu`` (π_old‖μ) measure the two legs.

Each optimizer step uses the estimator (mapping × aggregation × advantage of the registry,
:class:`simkit.estimators.Estimator`):

    ĝ = Σ_{i,t} c_{i,t}·A_i/Z_i · ∇θ log π_j(y_{i,t} | t, s_{i,t}),
    c = mapping.coefficients(log π_j − log μ, mask, A)

An estimator with a ``correction`` (a composed estimator: decoupled PPO × token TIS, bypass
mode, TRL's PPO × vLLM IS) gets the second leg too: ``estimator.coefficients(log π_j − log μ,
mask, A, old_log_ratio=log π_old − log μ)`` — the interface of ``simkit.estimators`` with
composed estimators; a plain estimator sees only π/μ.

accumulated by :func:`simkit.envs.accumulate_tokens` (softmax score e_y − π, no per-sequence
vectors), or the exact ∇J(π_j) (``gradient="exact"``, DP), optionally norm-clipped, then SGD or
Adam (:mod:`simkit.train.optim`) ascends J.

Log-probabilities of π and μ are both :func:`~simkit.train.mismatch.log_softmax` of their
logits, so with N = 1, ``lag = 0`` and no mismatch every log-ratio is exactly 0.0 and every
mapping with ``on_policy_identity`` gives c = 1.0: the run is on-policy REINFORCE bit for bit.

**Records** (one row per optimizer step s, the policy π_s *before* update s): see
:data:`COLUMNS`. The exact columns (J, ∇J, cosine, divergences) are computed by dynamic
programming every ``record_every`` steps (and at the first and last step), NaN in between;
the batch columns (ESS, zero-coefficient fraction, gradient norm, rewards) every step.

**Reproducibility and resume**: all randomness comes from ``numpy.random.SeedSequence(seed)``
(one child stream for sampling, one for the mismatch). With ``out_dir`` the table is written in
parquet chunks of ``chunk_steps`` rows and a checkpoint (θ, optimizer state, RNG states, the
policy versions kept for the lag, the in-flight rollout) is saved atomically after each chunk;
running the same call again resumes from the checkpoint and produces bit for bit the table of an
uninterrupted run. The previous checkpoint is kept: a damaged checkpoint or chunk (a careless
disk) is named in a ``RuntimeWarning`` and the run resumes from the last intact one, or restarts.

The code is split by idea: :mod:`~simkit.train.hyperparameters` (:class:`TrainConfig`),
:mod:`~simkit.train.rollout` (the schedule: one rollout, one optimizer step),
:mod:`~simkit.train.records` (the columns, the exact ones by DP) and
:mod:`~simkit.train.checkpoints` (the directory of a run: chunks, checkpoints, resume); this
module runs them (:func:`train`) and re-exports their public names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from simkit._validation import int_at_least, nonnegative_int
from simkit.envs.token_mdp import TokenMDP
from simkit.train.checkpoints import (
    CHECKPOINT_FILE,
    PREVIOUS_CHECKPOINT_FILE,
    DamagedCheckpointError,
    TrainError,
    check_out_dir,
    checkpoint_step,
    chunk_files,
    env_fingerprint,
    load_checkpoint,
    load_run,
    prepare_run_dir,
    recover_state,
    save_checkpoint,
    write_chunk,
)
from simkit.train.hyperparameters import GRADIENTS, TrainConfig, config_dict
from simkit.train.records import COLUMNS, records_table
from simkit.train.rollout import (
    group_size_of,
    initial_state,
    keep_version,
    new_rollout,
    optimizer_step,
    policy_logits,
)
from simkit.train.worlds import Prompts, as_prompts

__all__ = [
    "COLUMNS",
    "GRADIENTS",
    "DamagedCheckpointError",
    "TrainConfig",
    "TrainError",
    "checkpoint_step",
    "config_dict",
    "load_checkpoint",
    "load_run",
    "policy_logits",
    "train",
]


def _check_rollout_memory(env: TokenMDP, config: TrainConfig) -> None:
    """Refuse a rollout batch (batch × T tokens, kept for its N updates) that cannot fit."""
    from simkit._memory import check_memory, sample_bytes

    check_memory(
        sample_bytes(1, config.batch, env.T),
        f"a rollout batch of {config.batch} sequences of length T = {env.T}",
        "batch (simkit train: --N x --minibatch-size)",
    )


# --- the run ------------------------------------------------------------------------------------


def train(
    env: TokenMDP,
    config: TrainConfig,
    seed: int = 0,
    *,
    out_dir=None,
    chunk_steps: int = 100,
    stop_after: int | None = None,
    callback: Callable[[int, np.ndarray], None] | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Train a policy on ``env`` (module docstring); return the per-step table.

    Parameters
    ----------
    env : the :class:`~simkit.envs.TokenMDP`, or :class:`~simkit.train.worlds.Prompts` (K
        prompts sharing the policy: J and ∇J are the prompt means, the rollout's groups go
        round-robin over the prompts); θ starts at ``env.logits``.
    config : the :class:`TrainConfig`.
    seed : root of every random stream (``SeedSequence(seed)``); same seed ⇒ same table.
    out_dir : None (in memory) or a directory: the table is written in parquet chunks of
        ``chunk_steps`` steps with a checkpoint after each; if ``out_dir`` already holds this
        run (same env, config and seed, else :class:`TrainError`) it is resumed from its last
        checkpoint. The returned table is then read back from the chunks (:func:`load_run`).
    stop_after : stop once this many steps (in total) are done — a checkpointed, resumable
        partial run (with ``out_dir``). None: run all ``config.steps``.
    callback : ``callback(step, theta)`` before each update with the (read-only) parameters θ
        of π_step (the logits for ``"tabular"``; :func:`policy_logits` maps them otherwise).
    progress : show a tqdm bar.

    Returns a DataFrame with the columns of :data:`COLUMNS`, one row per step done.
    """
    if not isinstance(env, TokenMDP | Prompts):
        raise TypeError(f"env must be a TokenMDP or Prompts, got {type(env).__name__}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    seed = nonnegative_int(seed, "seed")
    K = len(as_prompts(env))
    if K > 1 and config.batch // group_size_of(config) < K:
        raise ValueError(
            f"TrainConfig.batch = {config.batch} gives {config.batch // group_size_of(config)} "
            f"group(s) per rollout for {K} prompts: every prompt needs at least one group"
        )
    chunk_steps = int_at_least(chunk_steps, "train.chunk_steps", 1)
    end = config.steps
    if stop_after is not None:
        end = min(int_at_least(stop_after, "train.stop_after", 1), config.steps)
    if config.mismatch.spike_prob > 0 and config.mismatch.spike_tokens >= env.V:
        raise ValueError(
            f"mismatch.spike_tokens = {config.mismatch.spike_tokens} must be < V = {env.V}"
        )
    _check_rollout_memory(env, config)

    param = config.parameterization_of(env)
    out = None if out_dir is None else Path(out_dir)
    if out is not None:
        check_out_dir(out)
    state = None
    if out is not None:
        description = {
            "config": config_dict(config),
            "seed": seed,
            "env": env_fingerprint(env),
            "shape": list(env.logits.shape),
        }
        if prepare_run_dir(out, description):
            state = recover_state(out)
            resume_at = 0 if state is None else state.step
            for first, path in chunk_files(out):  # written after the checkpoint resumed
                if first >= resume_at:
                    path.unlink()
            if state is None:
                for name in (CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE):
                    with contextlib.suppress(FileNotFoundError):
                        (out / name).unlink()
    if state is None:
        state = initial_state(env, config, param, seed)

    from tqdm.auto import tqdm

    bar = tqdm(
        total=end,
        initial=state.step,
        disable=not progress,
        unit="step",
        desc=f"train {config.estimator.name}",
        dynamic_ncols=True,
    )
    rows: list[dict] = []
    N = config.minibatches
    try:
        while state.step < end:
            keep_version(state, config)
            if state.step % N == 0:
                state.rollout = new_rollout(env, config, param, state, state.step // N)
            s = state.step
            record = s % config.record_every == 0 or s == config.steps - 1
            rows.append(optimizer_step(env, config, param, state, record, callback))
            state.step += 1
            if state.step % N == 0:
                state.rollout = None
            bar.update(1)
            if out is not None and (state.step % chunk_steps == 0 or state.step == end):
                write_chunk(out, rows)
                save_checkpoint(out, state)
                rows = []
    finally:
        bar.close()
    if out is not None:
        return load_run(out)
    return records_table(rows)
