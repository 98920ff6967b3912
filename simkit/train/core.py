"""Policy optimisation on a token MDP with the rollout/update schedule of real RL trainers.

The policy is π(·|t, s) = softmax(L(θ)[t, policy_index[s]]) on a :class:`~simkit.envs.TokenMDP`,
with the logits L(θ) of ``config.parameterization`` (:mod:`simkit.train.params`): ``"tabular"``
θ = L of shape (T, P, V) (the default), ``"tied"`` (one table for all positions) or
``"features"`` (low-rank embeddings); L(θ₀) = ``env.logits``. Gradients w.r.t. the logits
(exact ∇J, the estimator's ĝ) are pulled back to θ by the chain rule. One **rollout**:

1. the behaviour parameters θ_b are the trainer's θ at the start of the rollout ``lag``
   rollouts ago (asynchronous RL: the generator runs ``lag`` policy versions behind; the first
   rollouts use θ_0);
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
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from simkit.envs.token_mdp import TokenMDP
from simkit.envs.token_sampling import accumulate_tokens, sample_tokens
from simkit.estimator_specs import build_estimators, estimator_params
from simkit.estimators import GROUP_ADVANTAGES, Estimator, as_estimator
from simkit.train.mismatch import Mismatch, behaviour_log_probs, log_softmax
from simkit.train.optim import OPTIMIZERS, clip_grad_norm, make_optimizer
from simkit.train.params import PARAMETERIZATIONS, Parameterization, parameterization
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

#: where the update direction comes from
GRADIENTS = ("estimator", "exact")

#: columns of the table, in order, with their meaning
COLUMNS = {
    "step": "optimizer step s (0-based); the row describes π_s, the policy before update s",
    "rollout": "rollout index r = s // N",
    "minibatch": "mini-batch j = s % N inside the rollout",
    "staleness": "updates between μ's parameters and π_s: (r − max(r − lag, 0))·N + j",
    "recorded": "True where the exact (DP) columns below were computed",
    "J": "J(π_s) = E_π[R], exact (DP)",
    "grad_J_norm": "‖∇J(π_s)‖, exact (DP)",
    "cosine": "cos(ĝ_s, ∇J(π_s)): the estimator's direction vs the true gradient",
    "chi2_tok": "χ²(π_s‖μ) per token, averaged over μ's state occupancy (DP)",
    "kl_tok": "KL(π_s‖μ) per token, averaged over μ's state occupancy (DP)",
    "chi2_seq": "χ²(π_s‖μ) between sequence distributions (DP: E_μ[W²] − 1)",
    "kl_seq": "KL(π_s‖μ) between sequence distributions (DP, chain rule)",
    "kl_seq_old": "KL(π_s‖π_old) of sequences: the staleness leg (π_old = θ at rollout start)",
    "kl_seq_old_mu": "KL(π_old‖μ) of sequences: the lag + mismatch leg",
    "entropy": "per-token entropy of π_s averaged over π_s's own occupancy, nats (DP)",
    "length": "E_π_s|y|, the expected sequence length (DP; T without EOS)",
    "grad_norm": "‖ĝ_s‖ of the estimator (before clipping)",
    "update_norm": "‖g‖ of the direction used (ĝ or ∇J, after clipping)",
    "ess": "normalised ESS of the sequence ratios W of the mini-batch, (ΣW)²/(n·ΣW²) ∈ (0, 1]",
    "max_abs_log_ratio": "largest |log π_s − log μ| over the mini-batch's tokens",
    "zero_frac": "clip/mask fraction: share of valid tokens whose coefficient c is 0",
    "coef_mean": "mean coefficient c over valid tokens",
    "reward_mean": "mean reward of the mini-batch",
    "length_mean": "mean length of the mini-batch's sequences",
    "estimator": "the estimator's name",
}

_EXACT_COLUMNS = (
    "J",
    "grad_J_norm",
    "cosine",
    "chi2_tok",
    "kl_tok",
    "chi2_seq",
    "kl_seq",
    "kl_seq_old",
    "kl_seq_old_mu",
    "entropy",
    "length",
)
_FORMAT = 2  # checkpoint format version (2: the rollout's prompts)
_RUN_FILE = "run.json"
_CHECKPOINT_FILE = "checkpoint.npz"
#: the checkpoint before the last one, kept so that a damaged checkpoint costs one chunk
_PREVIOUS_CHECKPOINT_FILE = "checkpoint-previous.npz"
_CHUNKS_DIR = "chunks"


class TrainError(ValueError):
    """An output directory cannot be used as asked (another run's directory, corrupt…)."""


def _int(owner: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{owner}.{name} must be an integer >= {low}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of a training run (the environment and the seed are passed to
    :func:`train`).

    Parameters
    ----------
    estimator : :class:`~simkit.estimators.Estimator`, mapping or mapping name (coerced with
        :func:`simkit.estimators.as_estimator`; a name gives token-mean, oracle advantage).
    steps : total optimizer steps (≥ 1).
    batch : sequences per rollout (the global batch, ≥ 1).
    minibatches : N ≥ 1 updates per rollout; ``batch`` must be a multiple of N. N = 1 is
        on-policy (up to lag and mismatch).
    lag : k ≥ 0: rollouts are generated from the trainer's parameters k rollouts old.
    optimizer : ``"adam"`` or ``"sgd"``; ``lr``, ``beta1``, ``beta2``, ``adam_eps``: its
        hyperparameters (betas/eps for Adam only).
    max_grad_norm : clip the update direction to this Euclidean norm (None: no clipping).
    gradient : ``"estimator"`` (ĝ) or ``"exact"`` (∇J by DP; the estimator is still evaluated
        for the records).
    mismatch : the inference-mismatch model (:class:`~simkit.train.mismatch.Mismatch`).
    record_every : compute the exact columns every this many steps (≥ 1; also at the first and
        last step).
    parameterization : how θ gives the logits (:mod:`simkit.train.params`): ``"tabular"`` (θ is
        the (T, P, V) table), ``"tied"`` (one (P, V) table shared by all positions) or
        ``"features"`` (low-rank embeddings, d = ``features`` parameters, token-embedding
        rank ``feature_rank``, random features from ``feature_seed``). J, ∇J and the
        divergences stay exact for all three.
    """

    estimator: Estimator | str = "naive"
    steps: int = 100
    batch: int = 64
    minibatches: int = 1
    lag: int = 0
    optimizer: str = "adam"
    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float | None = None
    gradient: str = "estimator"
    mismatch: Mismatch = field(default_factory=Mismatch)
    record_every: int = 1
    parameterization: str = "tabular"
    features: int = 256
    feature_rank: int = 16
    feature_seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "estimator", as_estimator(self.estimator))
        for name, low in (
            ("steps", 1),
            ("batch", 1),
            ("minibatches", 1),
            ("lag", 0),
            ("record_every", 1),
            ("features", 1),
            ("feature_rank", 1),
            ("feature_seed", 0),
        ):
            object.__setattr__(self, name, _int("TrainConfig", name, getattr(self, name), low))
        if self.batch % self.minibatches:
            raise ValueError(
                f"TrainConfig.batch = {self.batch} must be a multiple of minibatches = "
                f"{self.minibatches} (each mini-batch has batch / minibatches sequences)"
            )
        self.estimator.check_batch_size(self.batch)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"TrainConfig.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}"
            )
        make_optimizer(self.optimizer, self.lr, self.beta1, self.beta2, self.adam_eps)
        for name in ("lr", "beta1", "beta2", "adam_eps"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.max_grad_norm is not None:
            v = self.max_grad_norm
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not (math.isfinite(v) and v > 0)
            ):
                raise ValueError(
                    f"TrainConfig.max_grad_norm must be None or a finite number > 0, got {v!r}"
                )
            object.__setattr__(self, "max_grad_norm", float(v))
        if self.gradient not in GRADIENTS:
            raise ValueError(
                f"TrainConfig.gradient must be one of {GRADIENTS}, got {self.gradient!r}"
            )
        if not isinstance(self.mismatch, Mismatch):
            raise TypeError(
                f"TrainConfig.mismatch must be a Mismatch, got {type(self.mismatch).__name__}"
            )
        if self.parameterization not in PARAMETERIZATIONS:
            raise ValueError(
                f"TrainConfig.parameterization must be one of {PARAMETERIZATIONS}, got "
                f"{self.parameterization!r}"
            )
        if self.parameterization == "features" and self.features % self.feature_rank:
            raise ValueError(
                f"TrainConfig.features = {self.features} must be a multiple of feature_rank = "
                f"{self.feature_rank} (d = m·r: m context features × r token-embedding dims)"
            )

    @property
    def minibatch_size(self) -> int:
        """Sequences per optimizer step (batch / minibatches)."""
        return self.batch // self.minibatches

    @property
    def rollouts(self) -> int:
        """Number of rollouts (the last may be cut short by ``steps``)."""
        return -(-self.steps // self.minibatches)

    def make_optimizer(self):
        return make_optimizer(self.optimizer, self.lr, self.beta1, self.beta2, self.adam_eps)

    def parameterization_of(self, env: TokenMDP) -> Parameterization:
        """The map θ ↦ logits of this config on ``env`` (:mod:`simkit.train.params`)."""
        return parameterization(
            env.logits, self.parameterization, self.features, self.feature_rank, self.feature_seed
        )

    def to_dict(self) -> dict:
        """A plain JSON-able dict describing this config completely (:func:`config_dict`)."""
        return config_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The config of a :func:`config_dict` (``TrainConfig.from_dict(config_dict(c)) ==
        c``): the estimator is rebuilt from its parameters (mapping, hyperparameters,
        aggregation, advantage, group size, name), the mismatch from its fields."""
        if not isinstance(d, dict):
            raise TypeError(f"expected a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown TrainConfig key {unknown[0]!r}; valid keys: "
                f"{', '.join(cls.__dataclass_fields__)}"
            )
        kwargs = dict(d)
        if isinstance(kwargs.get("estimator"), dict):
            kwargs["estimator"] = build_estimators([kwargs["estimator"]])[0]
        if isinstance(kwargs.get("mismatch"), dict):
            kwargs["mismatch"] = Mismatch(**kwargs["mismatch"])
        return cls(**kwargs)


def config_dict(config: TrainConfig) -> dict:
    """A plain JSON-able dict describing ``config`` completely (estimator included); the
    inverse is :meth:`TrainConfig.from_dict`."""
    out = {}
    for name in TrainConfig.__dataclass_fields__:
        value = getattr(config, name)
        if name == "estimator":
            value = estimator_params(value)
        elif name == "mismatch":
            value = value.to_dict()
        out[name] = value
    return out


def _env_fingerprint(env) -> str:
    """sha256 of the environment's arrays (initial logits, automaton, reward, EOS; every
    prompt's, in order, for :class:`~simkit.train.worlds.Prompts`)."""
    h = hashlib.sha256()
    for e in as_prompts(env):
        for arr in (e.logits, e.transition, e.policy_index, e.reward):
            a = np.ascontiguousarray(arr)
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
        h.update(repr((e.eos, e.initial_state)).encode())
    return h.hexdigest()


# --- state ------------------------------------------------------------------------------------


@dataclass
class _Rollout:
    """One rollout batch: what every mini-batch of it needs (arrays of B sequences)."""

    index: int
    actions: np.ndarray  # (B, T) int32
    states: np.ndarray  # (B, T) int32
    mask: np.ndarray  # (B, T) bool
    flat_index: np.ndarray  # (B, T) intp: (t·P + p)·V + y, the token's entry of a (T, P, V) table
    log_mu_tok: np.ndarray  # (B, T) log μ(y_t | t, s_t), 0 on padding
    rewards: np.ndarray  # (B,)
    advantages: np.ndarray  # (B,)
    log_mu: np.ndarray  # (T, P, V)
    log_old: np.ndarray  # (T, P, V) log π_old: the trainer's θ at the start of the rollout
    log_old_tok: np.ndarray  # (B, T) log π_old(y_t | t, s_t), 0 on padding
    behind: int  # rollouts between θ_b and the trainer's θ at rollout time
    prompt: np.ndarray  # (B,) int64: the prompt of each row (all 0 for one TokenMDP)

    _ARRAYS = (
        "actions",
        "states",
        "mask",
        "flat_index",
        "log_mu_tok",
        "rewards",
        "advantages",
        "log_mu",
        "log_old",
        "log_old_tok",
        "prompt",
    )


@dataclass
class _State:
    step: int
    theta: np.ndarray
    opt_state: dict
    versions: list  # θ at the start of the last lag + 1 rollouts, oldest first
    rollout: _Rollout | None
    rng_sample: np.random.Generator
    rng_mismatch: np.random.Generator


def _generators(seed) -> tuple[np.random.Generator, np.random.Generator]:
    ss = np.random.SeedSequence(seed)
    s_sample, s_mismatch = ss.spawn(2)
    return np.random.Generator(np.random.PCG64(s_sample)), np.random.Generator(
        np.random.PCG64(s_mismatch)
    )


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def policy_logits(env: TokenMDP, config: TrainConfig, theta) -> np.ndarray:
    """The logits (T, P, V) of the policy with parameters ``theta`` (what ``callback`` and
    :func:`load_checkpoint` give) under ``config.parameterization`` on ``env``."""
    return config.parameterization_of(env).logits(np.asarray(theta, dtype=np.float64))


def _initial_state(
    env: TokenMDP, config: TrainConfig, param: Parameterization, seed: int
) -> _State:
    theta = param.init()
    rng_sample, rng_mismatch = _generators(seed)
    return _State(0, theta, config.make_optimizer().init(theta), [], None, rng_sample, rng_mismatch)


# --- one rollout, one step ----------------------------------------------------------------------


def _new_rollout(
    env: TokenMDP, config: TrainConfig, param: Parameterization, state: _State, index: int
) -> _Rollout:
    state.versions.append(state.theta.copy())
    del state.versions[: max(len(state.versions) - (config.lag + 1), 0)]
    theta_b = state.versions[0]
    behind = len(state.versions) - 1
    log_mu = behaviour_log_probs(param.logits(theta_b), config.mismatch, state.rng_mismatch)
    mu = np.exp(log_mu)
    envs = as_prompts(env)
    prompt = _prompt_of_rows(config, len(envs))
    T, P, V = envs[0].logits.shape
    if len(envs) == 1:
        batch = sample_tokens(envs[0], mu, config.batch, state.rng_sample)
        actions, states, mask, rewards = batch.actions, batch.states, batch.mask, batch.rewards
        flat_index = envs[0].policy_index.astype(np.intp).take(states) * V
    else:  # each prompt's rows drawn from its own automaton, in prompt order
        actions = np.zeros((config.batch, T), dtype=np.int32)
        states = np.zeros((config.batch, T), dtype=np.int32)
        mask = np.zeros((config.batch, T), dtype=bool)
        rewards = np.zeros(config.batch)
        flat_index = np.zeros((config.batch, T), dtype=np.intp)
        for k, e in enumerate(envs):
            rows = np.flatnonzero(prompt == k)
            b = sample_tokens(e, mu, rows.size, state.rng_sample)
            actions[rows], states[rows], mask[rows], rewards[rows] = (
                b.actions,
                b.states,
                b.mask,
                b.rewards,
            )
            flat_index[rows] = e.policy_index.astype(np.intp).take(b.states) * V
    flat_index += actions
    flat_index += np.arange(T, dtype=np.intp) * (P * V)
    log_mu_tok = np.where(mask, log_mu.ravel().take(flat_index), 0.0)
    log_old = log_softmax(param.logits(state.theta))
    log_old_tok = np.where(mask, log_old.ravel().take(flat_index), 0.0)
    est = config.estimator
    if est.advantage == "oracle":  # J(μ) of the served behaviour that drew this batch
        J_base = [e.J(mu) for e in envs]
    elif est.advantage == "oracle_pi":
        J_base = [e.with_logits(param.logits(state.theta)).J() for e in envs]
    else:
        J_base = None
    if J_base is not None:  # the baseline J_k of each row's prompt (exact)
        J_base = J_base[0] if len(envs) == 1 else np.asarray(J_base).take(prompt)
    advantages = est.advantages(rewards, J=J_base)
    return _Rollout(
        index=index,
        actions=actions,
        states=states,
        mask=mask,
        flat_index=flat_index,
        log_mu_tok=log_mu_tok,
        rewards=rewards,
        advantages=advantages,
        log_mu=log_mu,
        log_old=log_old,
        log_old_tok=log_old_tok,
        behind=behind,
        prompt=prompt,
    )


def _group(config: TrainConfig) -> int:
    est = config.estimator
    return est.group_size if est.advantage in GROUP_ADVANTAGES else 1


def _prompt_of_rows(config: TrainConfig, K: int) -> np.ndarray:
    """(B,) prompt of each rollout row: group g = row // G goes to prompt g mod K."""
    return ((np.arange(config.batch) // _group(config)) % K).astype(np.int64)


def _ess(log_w: np.ndarray) -> float:
    """(Σ W)² / (n Σ W²) from log W (n,), in log space."""
    if log_w.size == 0:
        return math.nan
    top = log_w.max()
    if not np.isfinite(top):
        return math.nan
    w = np.exp(log_w - top)
    return float(w.sum() ** 2 / (log_w.size * (w * w).sum()))


def _policy_stats(env_js) -> tuple[float, float]:
    """(per-token entropy of π averaged over π's occupancy, E_π|y|), exact (DP); over K
    prompts: Σ_k (entropy mass)_k / Σ_k E|y|_k and the mean E|y|."""
    mass = length = 0.0
    for env_j in env_js:
        d = env_j.occupancy()  # (T, S)
        pi = env_j.pi[:, env_j.policy_index]  # (T, S, V)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(pi > 0, pi * np.log(pi), 0.0).sum(axis=-1)  # (T, S)
        mass += float((d * h).sum())
        length += float(d.sum())
    return mass / length, length / len(env_js)


def _exact_columns(env_js, mu, g_hat, grad_J) -> dict:
    """The exact columns of π (one env, or the mean over K prompts)."""
    norm_true = float(np.linalg.norm(grad_J))
    norm_hat = float(np.linalg.norm(g_hat))
    out = dict(
        grad_J_norm=norm_true,
        cosine=float(g_hat @ grad_J / (norm_hat * norm_true))
        if norm_hat > 0 and norm_true > 0
        else math.nan,
    )
    if len(env_js) == 1:
        env_j = env_js[0]
        div = env_j.divergences_tok(mu)
        out.update(
            J=env_j.J(),
            chi2_tok=div["chi2_tok"],
            kl_tok=div["kl_tok"],
            chi2_seq=env_j.chi2_seq(mu),
            kl_seq=env_j.kl_seq(mu),
        )
    else:  # uniform prompt law, the same under π and μ
        tokens = np.array([e.occupancy(mu).sum() for e in env_js])  # E_μ|y| per prompt
        divs = [e.divergences_tok(mu) for e in env_js]
        out.update(
            J=float(np.mean([e.J() for e in env_js])),
            chi2_tok=float(sum(t * d["chi2_tok"] for t, d in zip(tokens, divs)) / tokens.sum()),
            kl_tok=float(sum(t * d["kl_tok"] for t, d in zip(tokens, divs)) / tokens.sum()),
            chi2_seq=float(np.mean([e.chi2_seq(mu) for e in env_js])),
            kl_seq=float(np.mean([e.kl_seq(mu) for e in env_js])),
        )
    out["entropy"], out["length"] = _policy_stats(env_js)
    return out


def _step(
    env: TokenMDP,
    config: TrainConfig,
    param: Parameterization,
    state: _State,
    record: bool,
    callback,
) -> dict:
    """One optimizer step on mini-batch j of the current rollout; returns the table row."""
    ro = state.rollout
    N, m = config.minibatches, config.minibatch_size
    j = state.step % N
    rows = slice(j * m, (j + 1) * m)
    theta = state.theta
    if callback is not None:
        view = theta.view()
        view.setflags(write=False)
        callback(state.step, view)
    logits = param.logits(theta)
    env_js = [e.with_logits(logits) for e in as_prompts(env)]
    mask = ro.mask[rows]
    log_pi = log_softmax(logits).ravel()
    log_ratio = np.where(mask, log_pi.take(ro.flat_index[rows]) - ro.log_mu_tok[rows], 0.0)
    est = config.estimator
    adv = ro.advantages[rows]
    if getattr(est, "correction", None) is not None:  # a composed estimator: π/π_old × π_old/μ
        old_log_ratio = np.where(mask, ro.log_old_tok[rows] - ro.log_mu_tok[rows], 0.0)
        coef = est.coefficients(log_ratio, mask, adv, old_log_ratio=old_log_ratio)
    else:
        coef = est.coefficients(log_ratio, mask, adv)
    lam = coef * adv[:, None] * est.aggregation_weights(mask)
    if len(env_js) == 1:
        g_logits = accumulate_tokens(
            env_js[0], ro.actions[rows], lam, states=ro.states[rows], mask=mask
        )
    else:  # the per-prompt token terms of the mini-batch, summed
        g_logits = np.zeros(logits.size)
        prompt = ro.prompt[rows]
        for k, env_k in enumerate(env_js):
            sel = prompt == k
            if sel.any():
                g_logits += accumulate_tokens(
                    env_k, ro.actions[rows][sel], lam[sel], ro.states[rows][sel], mask[sel]
                )
    g_hat = param.pullback(g_logits)
    n_valid = int(mask.sum())
    row = {
        "step": state.step,
        "rollout": ro.index,
        "minibatch": j,
        "staleness": ro.behind * N + j,
        "recorded": record,
    }
    exact = dict.fromkeys(_EXACT_COLUMNS, math.nan)
    grad_J = None
    if record or config.gradient == "exact":
        if len(env_js) == 1:
            grad_J = param.pullback(env_js[0].grad_J())
        else:
            grad_J = param.pullback(sum(e.grad_J() for e in env_js) / len(env_js))
    if record:
        exact.update(_exact_columns(env_js, np.exp(ro.log_mu), g_hat, grad_J))
        old = np.exp(ro.log_old)
        exact["kl_seq_old"] = float(np.mean([e.kl_seq(old) for e in env_js]))
        exact["kl_seq_old_mu"] = float(
            np.mean([e.with_logits(ro.log_old).kl_seq(np.exp(ro.log_mu)) for e in env_js])
        )
    row.update(exact)
    direction = clip_grad_norm(
        grad_J if config.gradient == "exact" else g_hat, config.max_grad_norm
    )
    log_w = np.add.reduce(log_ratio, axis=1)
    row.update(
        grad_norm=float(np.linalg.norm(g_hat)),
        update_norm=float(np.linalg.norm(direction)),
        ess=_ess(log_w),
        max_abs_log_ratio=float(np.abs(log_ratio).max()) if log_ratio.size else 0.0,
        zero_frac=float(np.count_nonzero((coef == 0) & mask) / n_valid) if n_valid else math.nan,
        coef_mean=float(coef[mask].mean()) if n_valid else math.nan,
        reward_mean=float(ro.rewards[rows].mean()),
        length_mean=float(mask.sum(axis=1).mean()),
        estimator=est.name,
    )
    new_theta, state.opt_state = config.make_optimizer().step(
        theta, direction.reshape(theta.shape), state.opt_state
    )
    if not np.all(np.isfinite(new_theta)):
        raise FloatingPointError(
            f"step {state.step}: the update made θ non-finite (‖direction‖ = "
            f"{row['update_norm']:.3g}); lower lr or set max_grad_norm"
        )
    state.theta = new_theta
    return row


# --- checkpoints and chunks ---------------------------------------------------------------------


def _atomic_write(path: Path, write: Callable) -> None:
    """Write ``path`` through a temporary file in the same directory, fsync, ``os.replace``."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _save_checkpoint(out_dir: Path, state: _State) -> None:
    arrays = {"theta": state.theta}
    for key, value in state.opt_state.items():
        if isinstance(value, np.ndarray):
            arrays[f"opt_{key}"] = value
    if state.versions:
        arrays["versions"] = np.stack(state.versions)
    meta = {
        "format": _FORMAT,
        "step": state.step,
        "opt_scalars": {k: v for k, v in state.opt_state.items() if not isinstance(v, np.ndarray)},
        "rng_sample": state.rng_sample.bit_generator.state,
        "rng_mismatch": state.rng_mismatch.bit_generator.state,
        "rollout": None,
    }
    if state.rollout is not None:
        ro = state.rollout
        meta["rollout"] = {"index": ro.index, "behind": ro.behind}
        for name in _Rollout._ARRAYS:
            arrays[f"rollout_{name}"] = getattr(ro, name)
    arrays["meta"] = np.array(json.dumps(meta))

    def write(fh):
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        fh.write(buffer.getvalue())

    current = out_dir / _CHECKPOINT_FILE
    if current.exists():  # keep the previous one: a damaged checkpoint then costs one chunk
        os.replace(current, out_dir / _PREVIOUS_CHECKPOINT_FILE)
    _atomic_write(current, write)


def _restore_generator(state: dict) -> np.random.Generator:
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)


class DamagedCheckpointError(TrainError):
    """A checkpoint or chunk of a training directory cannot be read (torn, truncated…)."""


def _damaged(path: Path, exc: BaseException) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"{path} is damaged and cannot be read ({type(exc).__name__}: {exc}); re-run the same "
        "'simkit train … --out DIR' command (or train(…, out_dir=DIR)): it resumes from the "
        "last intact checkpoint, or restarts the run if there is none"
    )


def _load_state(out_dir: Path, name: str = _CHECKPOINT_FILE) -> _State:
    path = out_dir / name
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        meta = json.loads(str(arrays.pop("meta")))
    except Exception as exc:  # BadZipFile, EOFError, OSError, ValueError, KeyError, JSON…
        raise _damaged(path, exc) from None
    if meta.get("format") != _FORMAT:
        raise TrainError(f"{path} has checkpoint format {meta.get('format')}, expected {_FORMAT}")
    opt_state = dict(meta["opt_scalars"])
    opt_state.update({k[4:]: v for k, v in arrays.items() if k.startswith("opt_")})
    versions = list(arrays["versions"]) if "versions" in arrays else []
    rollout = None
    if meta["rollout"] is not None:
        rollout = _Rollout(
            **meta["rollout"], **{n: arrays[f"rollout_{n}"] for n in _Rollout._ARRAYS}
        )
    return _State(
        step=int(meta["step"]),
        theta=arrays["theta"],
        opt_state=opt_state,
        versions=versions,
        rollout=rollout,
        rng_sample=_restore_generator(meta["rng_sample"]),
        rng_mismatch=_restore_generator(meta["rng_mismatch"]),
    )


def _chunk_damage(out_dir: Path, before: int) -> tuple[int, Path, str] | None:
    """The first chunk starting before step ``before`` whose parquet footer cannot be read."""
    import pyarrow.parquet as pq

    for first, path in _chunk_files(out_dir):
        if first >= before:
            break
        try:
            pq.read_metadata(path)
        except Exception as exc:
            return first, path, f"{type(exc).__name__}: {exc}"
    return None


def _recover_state(out_dir: Path) -> _State | None:
    """The state to resume from: the last checkpoint whose chunks are intact (None: restart).

    A damaged checkpoint falls back to the previous one; a damaged chunk to a checkpoint
    taken before it. Every fallback is reported with a ``RuntimeWarning`` naming the file.
    """
    import warnings

    def warn(message: str) -> None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    candidates: list[tuple[str, _State]] = []
    for name in (_CHECKPOINT_FILE, _PREVIOUS_CHECKPOINT_FILE):
        if (out_dir / name).exists():
            try:
                candidates.append((name, _load_state(out_dir, name)))
            except DamagedCheckpointError as err:
                warn(str(err).split("; re-run")[0] + "; it is not used")
    for name, state in sorted(candidates, key=lambda c: -c[1].step):
        damage = _chunk_damage(out_dir, state.step)
        if damage is None:
            if name != _CHECKPOINT_FILE:
                warn(f"{out_dir}: resuming from the previous checkpoint (step {state.step})")
            return state
        warn(
            f"chunk {damage[1]} is damaged ({damage[2]}): the checkpoint of step {state.step} "
            "cannot be used"
        )
    names = (_CHECKPOINT_FILE, _PREVIOUS_CHECKPOINT_FILE)
    if _chunk_files(out_dir) or any((out_dir / n).exists() for n in names):
        warn(f"{out_dir}: no intact checkpoint, the run restarts from step 0")
    return None


def checkpoint_step(out_dir) -> int:
    """Steps completed by the run in ``out_dir`` (0 if it has no checkpoint yet)."""
    path = Path(out_dir) / _CHECKPOINT_FILE
    if not path.exists():
        return 0
    return _load_state(Path(out_dir)).step


def load_checkpoint(out_dir) -> tuple[int, np.ndarray]:
    """``(step, θ)`` of the last checkpoint of the run in ``out_dir``: θ is the policy's
    parameters *after* ``step`` updates, i.e. π_step of the table's row ``step`` (if any);
    (T, P, V) logits for the tabular parameterisation, else see :func:`policy_logits`."""
    path = Path(out_dir) / _CHECKPOINT_FILE
    if not path.exists():
        raise TrainError(f"{out_dir} has no checkpoint ({_CHECKPOINT_FILE})")
    state = _load_state(Path(out_dir))
    return state.step, state.theta


def _chunk_path(out_dir: Path, first_step: int) -> Path:
    return out_dir / _CHUNKS_DIR / f"steps-{first_step:09d}.parquet"


def _chunk_files(out_dir: Path) -> list[tuple[int, Path]]:
    folder = out_dir / _CHUNKS_DIR
    if not folder.is_dir():
        return []
    out = []
    for p in folder.glob("steps-*.parquet"):
        with contextlib.suppress(ValueError):
            out.append((int(p.stem.split("-", 1)[1]), p))
    return sorted(out)


def _write_chunk(out_dir: Path, rows: list[dict]) -> None:
    table = _table(rows)
    _atomic_write(
        _chunk_path(out_dir, int(table["step"].iloc[0])),
        lambda fh: table.to_parquet(fh, index=False, engine="pyarrow"),
    )


def _table(rows: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    return table.astype(
        {
            "step": np.int64,
            "rollout": np.int64,
            "minibatch": np.int64,
            "staleness": np.int64,
            "recorded": bool,
        }
    )


def load_run(out_dir) -> pd.DataFrame:
    """The table of the run in ``out_dir``: its chunks up to the last checkpoint, in step order
    (rows a killed run wrote after its last checkpoint are not part of it)."""
    out_dir = Path(out_dir)
    if not (out_dir / _RUN_FILE).exists():
        raise TrainError(f"{out_dir} is not a simkit training directory (no {_RUN_FILE})")
    done = checkpoint_step(out_dir)
    frames = [_read_chunk(p) for first, p in _chunk_files(out_dir) if first < done]
    if not frames:
        return _table([])
    table = pd.concat(frames, ignore_index=True)
    return table[table["step"] < done].reset_index(drop=True)


def _read_chunk(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as exc:
        raise _damaged(path, exc) from None


def _prepare(out_dir: Path, description: dict) -> bool:
    """Create ``out_dir`` with ``run.json`` or check it is this run's; True if resuming."""
    stored = out_dir / _RUN_FILE
    text = json.dumps(description, sort_keys=True, indent=1, default=str)
    if stored.exists():
        previous = json.loads(stored.read_text(encoding="utf-8"))
        if previous != json.loads(text):
            diff = sorted(
                k
                for k in set(previous) | set(description)
                if previous.get(k) != json.loads(text).get(k)
            )
            raise TrainError(
                f"{out_dir} holds another training run (different {', '.join(diff)}); resume "
                "it with its own settings or choose another output directory"
            )
        return True
    if out_dir.exists() and any(out_dir.iterdir()):
        raise TrainError(
            f"{out_dir} is not empty and has no {_RUN_FILE}: choose a new or empty directory"
        )
    (out_dir / _CHUNKS_DIR).mkdir(parents=True, exist_ok=True)
    _atomic_write(stored, lambda fh: fh.write(text.encode("utf-8")))
    return False


def _check_rollout_memory(env: TokenMDP, config: TrainConfig) -> None:
    """Refuse a rollout batch (batch × T tokens, kept for its N updates) that cannot fit."""
    from simkit._memory import check_memory, sample_bytes

    check_memory(
        sample_bytes(1, config.batch, env.T),
        f"a rollout batch of {config.batch} sequences of length T = {env.T}",
        "batch (simkit train: --N x --minibatch-size)",
    )


def _check_out_dir(out: Path) -> None:
    from simkit._validation import check_output_dir

    try:
        check_output_dir(out, "out_dir")
    except ValueError as err:
        raise TrainError(str(err)) from None


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
    seed = _check_seed(seed)
    K = len(as_prompts(env))
    if K > 1 and config.batch // _group(config) < K:
        raise ValueError(
            f"TrainConfig.batch = {config.batch} gives {config.batch // _group(config)} "
            f"group(s) per rollout for {K} prompts: every prompt needs at least one group"
        )
    chunk_steps = _int("train", "chunk_steps", chunk_steps, 1)
    end = config.steps
    if stop_after is not None:
        end = min(_int("train", "stop_after", stop_after, 1), config.steps)
    if config.mismatch.spike_prob > 0 and config.mismatch.spike_tokens >= env.V:
        raise ValueError(
            f"mismatch.spike_tokens = {config.mismatch.spike_tokens} must be < V = {env.V}"
        )
    _check_rollout_memory(env, config)

    param = config.parameterization_of(env)
    out = None if out_dir is None else Path(out_dir)
    if out is not None:
        _check_out_dir(out)
    state = None
    if out is not None:
        description = {
            "config": config_dict(config),
            "seed": seed,
            "env": _env_fingerprint(env),
            "shape": list(env.logits.shape),
        }
        if _prepare(out, description):
            state = _recover_state(out)
            resume_at = 0 if state is None else state.step
            for first, path in _chunk_files(out):  # written after the checkpoint resumed
                if first >= resume_at:
                    path.unlink()
            if state is None:
                for name in (_CHECKPOINT_FILE, _PREVIOUS_CHECKPOINT_FILE):
                    with contextlib.suppress(FileNotFoundError):
                        (out / name).unlink()
    if state is None:
        state = _initial_state(env, config, param, seed)

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
            if state.step % N == 0:
                state.rollout = _new_rollout(env, config, param, state, state.step // N)
            s = state.step
            record = s % config.record_every == 0 or s == config.steps - 1
            rows.append(_step(env, config, param, state, record, callback))
            state.step += 1
            if state.step % N == 0:
                state.rollout = None
            bar.update(1)
            if out is not None and (state.step % chunk_steps == 0 or state.step == end):
                _write_chunk(out, rows)
                _save_checkpoint(out, state)
                rows = []
    finally:
        bar.close()
    if out is not None:
        return load_run(out)
    return _table(rows)
