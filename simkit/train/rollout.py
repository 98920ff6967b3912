"""The rollout/update schedule of a training run: its state, one rollout, one optimizer step.

:func:`new_rollout` draws a rollout batch from μ (θ lagged by ``lag`` rollouts, through the
inference-mismatch model) and computes its rewards and advantages once; :func:`optimizer_step`
takes the update on mini-batch j of it with π_j against μ (the staleness N), records the row
and moves θ. :class:`TrainState` is everything a checkpoint stores. The schedule and the three
policies (μ, π_old, π) are described in :mod:`simkit.train.core`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simkit.envs.token_mdp import TokenMDP
from simkit.envs.token_sampling import accumulate_tokens, sample_tokens
from simkit.envs.versions import loglinear_alpha
from simkit.estimators import GROUP_ADVANTAGES
from simkit.train.hyperparameters import TrainConfig
from simkit.train.mismatch import behaviour_log_probs, log_softmax
from simkit.train.optim import clip_grad_norm
from simkit.train.params import Parameterization
from simkit.train.records import EXACT_COLUMNS, ess_of_log_weights, exact_columns
from simkit.train.versioned import draw_versioned, prompt_starts
from simkit.train.worlds import as_prompts

# --- state ------------------------------------------------------------------------------------


@dataclass
class Rollout:
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
    behind: int  # optimizer updates between θ_b and the trainer's θ at rollout time
    prompt: np.ndarray  # (B,) int64: the prompt of each row (all 0 for one TokenMDP)
    # asynchronous runs only (TrainConfig.asynchronous): each token's version age at rollout
    # start (B, T), and the rows the trainer's max_off_policy filter dropped / waited for
    token_age: np.ndarray | None = None
    recorded_age: np.ndarray | None = None  # age of the version whose log μ is recorded
    dropped: int = 0
    waited: int = 0

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
    _OPTIONAL_ARRAYS = ("token_age", "recorded_age")


@dataclass
class TrainState:
    """Everything a checkpoint stores: the step, θ, the optimizer state, the past θ that
    later rollouts will be sampled from (:func:`keep_version`), the in-flight rollout and the
    two random generators."""

    step: int
    theta: np.ndarray
    opt_state: dict
    versions: list  # θ_s at the steps s of version_steps, oldest first
    rollout: Rollout | None
    rng_sample: np.random.Generator
    rng_mismatch: np.random.Generator
    version_steps: list = None  # the step s of each entry of versions

    def __post_init__(self):
        if self.version_steps is None:
            self.version_steps = []


def _generators(seed) -> tuple[np.random.Generator, np.random.Generator]:
    """(sampling, mismatch) generators: the two children of ``SeedSequence(seed)``."""
    ss = np.random.SeedSequence(seed)
    s_sample, s_mismatch = ss.spawn(2)
    return np.random.Generator(np.random.PCG64(s_sample)), np.random.Generator(
        np.random.PCG64(s_mismatch)
    )


def policy_logits(env: TokenMDP, config: TrainConfig, theta) -> np.ndarray:
    """The logits (T, P, V) of the policy with parameters ``theta`` (what ``callback`` and
    :func:`load_checkpoint` give) under ``config.parameterization`` on ``env``."""
    return config.parameterization_of(env).logits(np.asarray(theta, dtype=np.float64))


def initial_state(
    env: TokenMDP, config: TrainConfig, param: Parameterization, seed: int
) -> TrainState:
    """The state before step 0: θ₀ = ``param.init()``, a fresh optimizer state, the generators
    of ``SeedSequence(seed)``."""
    theta = param.init()
    rng_sample, rng_mismatch = _generators(seed)
    return TrainState(
        0, theta, config.make_optimizer().init(theta), [], None, rng_sample, rng_mismatch
    )


# --- one rollout, one step ----------------------------------------------------------------------


def behaviour_step(rollout: int, N: int, lag_updates: int) -> int:
    """The step b = max(rN − L, 0) whose parameters θ_b generate rollout r (N mini-batches
    per rollout, lag L in optimizer updates)."""
    return max(rollout * N - lag_updates, 0)


def policy_age(step: int, N: int, lag_updates: int) -> int:
    """Optimizer updates between the policy that sampled the mini-batch of ``step`` and the
    policy π_step being updated on it: s − max(⌊s/N⌋·N − L, 0) (= j at lag 0, L + j once the
    rollout starts at or after step L)."""
    return step - behaviour_step(step // N, N, lag_updates)


def keep_version(state: TrainState, config: TrainConfig) -> None:
    """Before the update of ``state.step``: keep θ_s if a later rollout will be sampled from
    it (s = max(r'N − L, 0) for some rollout r'), so that the lag costs one θ per rollout in
    flight, not one per update."""
    s, N, L = state.step, config.minibatches, config.lag_in_updates
    needed = s == 0 or ((s + L) % N == 0 and s + L >= N)
    if needed and (not state.version_steps or state.version_steps[-1] != s):
        state.versions.append(state.theta.copy())
        state.version_steps.append(s)


def new_rollout(
    env: TokenMDP, config: TrainConfig, param: Parameterization, state: TrainState, index: int
) -> Rollout:
    """Rollout ``index``: θ_b = θ of step b = max(rN − L, 0) (:func:`behaviour_step`, L the
    lag in updates), μ = the engine's policy of θ_b (through ``config.mismatch``),
    ``config.batch`` sequences y ~ μ (each prompt's rows from its own automaton), their rewards
    and advantages (the ``oracle`` baselines exact), and log μ and log π_old of every drawn
    token. Drops the kept versions older than θ_b (:func:`keep_version` keeps them)."""
    N, L = config.minibatches, config.lag_in_updates
    b = behaviour_step(index, N, L)
    keep_version(state, config)
    oldest = behaviour_step(index - config.lag_rollouts_max, N, L)  # the lag distribution's
    drop = sum(1 for v in state.version_steps if v < oldest)
    del state.versions[:drop], state.version_steps[:drop]
    if not state.version_steps or state.version_steps[0] != oldest:
        raise RuntimeError(
            f"rollout {index}: θ of step {oldest} was not kept (kept: {state.version_steps})"
        )
    behind = index * N - b
    envs = as_prompts(env)
    prompt = _prompt_of_rows(config, len(envs))
    T, P, V = envs[0].logits.shape
    draw = None
    if config.asynchronous:  # versions up to K rollouts further back, newest first
        steps, starts = prompt_starts(config, index, lambda r: behaviour_step(r, N, L), len(envs))
        log_mus = [
            behaviour_log_probs(
                param.logits(_version_at(state, s)), config.mismatch, state.rng_mismatch
            )
            for s in steps
        ]
        log_mu = log_mus[0]
        ages = [index * N - s for s in steps]
        draw = draw_versioned(
            envs, prompt, config, log_mus, ages, starts, state.rng_sample, group_size_of(config)
        )
        prompt = draw.prompt
    else:
        theta_b = _version_at(state, b)
        log_mu = behaviour_log_probs(param.logits(theta_b), config.mismatch, state.rng_mismatch)
    mu = np.exp(log_mu)
    if draw is not None:  # drawn above, version by version
        actions, states, mask, rewards = draw.actions, draw.states, draw.mask, draw.rewards
        flat_index = draw.flat_index
    elif len(envs) == 1:
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
    if draw is None:
        flat_index += actions
        flat_index += np.arange(T, dtype=np.intp) * (P * V)
        log_mu_tok = np.where(mask, log_mu.ravel().take(flat_index), 0.0)
    else:  # each token's log μ is its generating version's
        log_mu_tok = draw.log_mu_tok
    log_old = log_softmax(param.logits(state.theta))
    log_old_tok = np.where(mask, log_old.ravel().take(flat_index), 0.0)
    est = config.estimator
    if est.advantage == "oracle" and draw is not None:  # J of the versioned batch's law
        J_base = [b.J(e) for b, e in zip(draw.behaviours, envs, strict=True)]
    elif est.advantage == "oracle":  # J(μ) of the served behaviour that drew this batch
        J_base = [e.J(mu) for e in envs]
    elif est.advantage == "oracle_pi":
        J_base = [e.with_logits(param.logits(state.theta)).J() for e in envs]
    else:
        J_base = None
    if J_base is not None:  # the baseline J_k of each row's prompt (exact)
        J_base = J_base[0] if len(envs) == 1 else np.asarray(J_base).take(prompt)
    advantages = est.advantages(rewards, J=J_base)
    return Rollout(
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
        token_age=None if draw is None else draw.token_age,
        recorded_age=None if draw is None else draw.recorded_age,
        dropped=0 if draw is None else draw.dropped,
        waited=0 if draw is None else draw.waited,
    )


def old_log_ratio_of(config: TrainConfig, ro: Rollout, rows, j: int, log_ratio, mask):
    """o = log π_old − log μ on the tokens of mini-batch j (``rows``) of a composed estimator.

    ``config.old_logp = "recompute"``: π_old = θ at the rollout's start (the trainer's
    recomputation). ``"loglinear"``: AReaL's approximation
    (:func:`simkit.envs.versions.loglinear_alpha` with π_prox = π_old, ``theta_lead`` 1), o = α·ℓ
    with α = a/(a + j + 1) for a token whose recorded version (``config.record_logp``) is a
    updates older than π_old (the rollout's lag for a synchronous run) — no forward pass of
    π_old."""
    if config.old_logp == "recompute":
        return np.where(mask, ro.log_old_tok[rows] - ro.log_mu_tok[rows], 0.0)
    if ro.recorded_age is not None:
        age = ro.recorded_age[rows]
    elif ro.token_age is not None:
        age = ro.token_age[rows]
    else:
        age = np.full(mask.shape, ro.behind)
    alpha = loglinear_alpha(age + j, proximal_age=j, theta_lead=1)
    return np.where(mask, alpha * log_ratio, 0.0)


def _version_at(state: TrainState, step: int) -> np.ndarray:
    """The kept θ of ``step`` (:func:`keep_version`)."""
    try:
        return state.versions[state.version_steps.index(step)]
    except ValueError:
        raise RuntimeError(f"θ of step {step} was not kept (kept: {state.version_steps})") from None


def group_size_of(config: TrainConfig) -> int:
    """Rows per group of the rollout: the estimator's G for a group advantage, else 1."""
    est = config.estimator
    return est.group_size if est.advantage in GROUP_ADVANTAGES else 1


def _prompt_of_rows(config: TrainConfig, K: int) -> np.ndarray:
    """(B,) prompt of each rollout row: group g = row // G goes to prompt g mod K."""
    return ((np.arange(config.batch) // group_size_of(config)) % K).astype(np.int64)


def optimizer_step(
    env: TokenMDP,
    config: TrainConfig,
    param: Parameterization,
    state: TrainState,
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
    # log π of the drawn tokens, for the mappings that need it (DPPO, GEPO; clip_cov and kl_cov
    # keep their log-ratio stand-in, as on the experiment's paths)
    lp = None
    if est.mapping.requires_log_prob:
        lp = np.where(mask, log_pi.take(ro.flat_index[rows]), 0.0)
    if getattr(est, "correction", None) is not None:  # a composed estimator: π/π_old × π_old/μ
        old_log_ratio = old_log_ratio_of(config, ro, rows, j, log_ratio, mask)
        coef = est.coefficients(log_ratio, mask, adv, old_log_ratio=old_log_ratio, log_prob=lp)
    else:
        coef = est.coefficients(log_ratio, mask, adv, log_prob=lp)
    weights = est.aggregation_weights(mask)
    lam = coef * adv[:, None] * weights
    additive = est.additive_terms(log_ratio, mask, lp)  # dro: λ = (c·A + b)/Z
    if additive is not None:
        lam = lam + additive * weights
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
        "staleness": ro.behind + j,
        "policy_age_min": ro.behind + j,
        "policy_age_mean": float(ro.behind + j),
        "policy_age_max": ro.behind + j,
        "dropped": ro.dropped if j == 0 else 0,
        "waited": ro.waited if j == 0 else 0,
        "prompt_rows": " ".join(map(str, np.bincount(ro.prompt[rows], minlength=len(env_js)))),
        "recorded": record,
    }
    if ro.token_age is not None and mask.any():  # per-token versions: ages of the tokens
        ages = ro.token_age[rows][mask] + j
        row.update(
            policy_age_min=int(ages.min()),
            policy_age_mean=float(ages.mean()),
            policy_age_max=int(ages.max()),
        )
    exact = dict.fromkeys(EXACT_COLUMNS, math.nan)
    grad_J = None
    if record or config.gradient == "exact":
        if len(env_js) == 1:
            grad_J = param.pullback(env_js[0].grad_J())
        else:
            grad_J = param.pullback(sum(e.grad_J() for e in env_js) / len(env_js))
    if record:
        exact.update(exact_columns(env_js, np.exp(ro.log_mu), g_hat, grad_J))
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
        ess=ess_of_log_weights(log_w),
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
