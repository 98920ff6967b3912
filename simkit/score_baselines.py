"""Baselines weighted by the squared norm of the score ‖∇θ log π‖²: verl's optimal token
baseline (OTB, one advantage per token) and VCPO's off-policy optimal baseline (OPOB, one per
sequence, with the squared sequence IS ratio). Both couple the samples of a group (Monte Carlo
with bounds in :mod:`simkit.experiment`); :class:`simkit.estimators.Estimator` selects them as
the advantages ``otb`` and ``opob``.

Shapes as in :mod:`simkit.estimators`: ``rewards`` (L..., N), per-token arrays (L..., N, T).
"""

from __future__ import annotations

import numpy as np

from simkit._validation import int_at_least

#: verl's ε in the OTB baseline's denominator
OTB_EPS = 1e-8
#: ε in the denominator of VCPO's OPOB weighted mean, and the group std below which it does not
#: divide (mit-han-lab/vcpo ``staleness_utils.py`` at c7f030f)
OPOB_EPS = 1e-8


def otb_advantages(
    rewards,
    mask,
    score_sq,
    group_size: int,
    is_weights=None,
    penalty=None,
    eps: float = OTB_EPS,
    handle_zero_tail: bool = True,
) -> np.ndarray:
    """Per-token advantages A_{i,t} = G_{i,t} − B_t of verl's optimal token baseline (OTB),
    shape (L..., N, T), 0 on padding.

    verl ``compute_optimal_token_baseline_advantage`` (``verl/trainer/ppo/core_algos.py`` at
    verl-project/verl 1dda039; arXiv 2602.07078): in each group of G consecutive samples,

        B_t = Σ_i G_{i,t}·W_{i,t}·m_{i,t} / (Σ_i W_{i,t}·m_{i,t} + ε),
        W_{i,t} = Σ_{j≤t} w_{i,j}·m_{i,j}

    with w_{i,j} = ‖∇log π(y_j|s_j)‖² = 1 − 2π(y_j|s_j) + Σ_v π(v|s_j)² (``score_sq``, the
    squared norm of the softmax score, verl's path-variance proxy from π_old's probabilities),
    G_{i,t} = the reward-to-go (R_i for a terminal reward; with a KL penalty in the reward,
    R_i − Σ_{t'≥t} ``penalty``_{i,t'}). The rollout-IS variant multiplies w by ρ̄² (``is_weights``
    ρ̄_{i,t}, verl's precomputed truncated rollout IS weights). ``handle_zero_tail``: where the
    longest sequence of a group is the only one of its length, its baselines beyond the second
    longest length are 0 (verl's default). ε = 1e-8 (verl). A group of one has B = 0.
    """
    R = np.asarray(rewards, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    w = np.asarray(score_sq, dtype=np.float64)
    if m.shape != (*R.shape, m.shape[-1]) or w.shape != m.shape:
        raise ValueError(
            f"mask and score_sq must have shape rewards.shape + (T,); got rewards {R.shape}, "
            f"mask {m.shape}, score_sq {w.shape}"
        )
    G = _group_size(group_size, "otb")
    N, T = m.shape[-2:]
    if N % G:
        raise ValueError(
            f"the number of samples N = {N} is not divisible by group_size G = {G} "
            "(advantage 'otb' needs whole groups)"
        )
    mf = m.astype(np.float64)
    returns = R[..., None] * mf
    if penalty is not None:
        pen = np.asarray(penalty, dtype=np.float64) * mf
        returns = returns - np.flip(np.cumsum(np.flip(pen, -1), -1), -1) * mf
    if is_weights is not None:
        w = w * np.asarray(is_weights, dtype=np.float64) ** 2
    W = np.cumsum(w * mf, axis=-1)
    shape = (*R.shape[:-1], N // G, G, T)
    g_ret, g_W, g_m = returns.reshape(shape), W.reshape(shape), mf.reshape(shape)
    base = (g_ret * g_W * g_m).sum(axis=-2, keepdims=True) / (
        (g_W * g_m).sum(axis=-2, keepdims=True) + eps
    )
    base = np.broadcast_to(base, shape).copy()
    if handle_zero_tail and G > 1:
        lengths = g_m.sum(axis=-1)  # (..., groups, G)
        top = np.sort(lengths, axis=-1)
        longest, second = top[..., -1], top[..., -2]
        unique = ((lengths == longest[..., None]).sum(axis=-1) == 1) & (longest > second)
        owner = lengths == longest[..., None]  # the one longest row where ``unique``
        tail = np.arange(T) >= second[..., None, None]  # positions beyond the second longest
        base = np.where(unique[..., None, None] & owner[..., None] & tail, 0.0, base)
    return ((g_ret - base) * g_m).reshape(m.shape)


def opob_advantages(
    rewards,
    mask,
    score_sq,
    log_ratio,
    group_size: int,
    norm_by_std: bool = True,
    eps: float = OPOB_EPS,
) -> np.ndarray:
    """Sequence advantages A_i = (R_i − b*)/σ_G of VCPO's off-policy optimal baseline (OPOB),
    shape (L..., N).

    VCPO (Huang et al. 2026, "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs",
    arXiv 2602.17616, §3.3; README and ``compute_opob_baseline`` in
    ``recipe/fully_async_policy/staleness_utils.py`` at mit-han-lab/vcpo c7f030f): in each group
    of G consecutive samples,

        b* = Σ_i w_i²·‖∇θ log π(y_i)‖²·R_i / (Σ_i w_i²·‖∇θ log π(y_i)‖² + ε),

    the minimiser over a constant b of the second moment of the off-policy REINFORCE term
    w·(R − b)·∇log π, estimated in the group (sample i included), with w_i = π(y_i)/μ(y_i) =
    exp Σ_t ``log_ratio`` the *unclipped* sequence IS ratio (VCPO's default
    ``use_clipped_is_ratios=False``). ‖∇θ log π(y_i)‖² is Σ_t ``score_sq`` (the squared softmax
    score norms 1 − 2π(y_t|s_t) + Σ_v π(v|s_t)² of the valid tokens): exact for parameters with
    one block per position (untied), the per-position part of the norm for tied ones.
    ``norm_by_std`` (VCPO's shipped recipes): divide by the group's population std σ_G (ddof 0,
    as there) where σ_G > ε, else leave R − b* unscaled. ε = 1e-8 as upstream.
    """
    R = np.asarray(rewards, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    w2g = np.asarray(score_sq, dtype=np.float64)
    lr = np.asarray(log_ratio, dtype=np.float64)
    if m.shape != (*R.shape, m.shape[-1]) or w2g.shape != m.shape or lr.shape != m.shape:
        raise ValueError(
            "mask, score_sq and log_ratio must have shape rewards.shape + (T,); got rewards "
            f"{R.shape}, mask {m.shape}, score_sq {w2g.shape}, log_ratio {lr.shape}"
        )
    G = _group_size(group_size, "opob")
    N = R.shape[-1]
    if N % G:
        raise ValueError(
            f"the number of samples N = {N} is not divisible by group_size G = {G} "
            "(advantage 'opob' needs whole groups)"
        )
    log_w = np.where(m, lr, 0.0).sum(axis=-1)
    weight = np.exp(2.0 * log_w) * np.where(m, w2g, 0.0).sum(axis=-1)
    shape = (*R.shape[:-1], N // G, G)
    gR, gW = R.reshape(shape), weight.reshape(shape)
    b = (gW * gR).sum(axis=-1, keepdims=True) / (gW.sum(axis=-1, keepdims=True) + eps)
    out = gR - b
    if norm_by_std:
        std = gR.std(axis=-1, keepdims=True)
        out = np.where(std > eps, out / np.where(std > eps, std, 1.0), out)
    return out.reshape(R.shape)


def _group_size(group_size, kind: str) -> int:
    if group_size is None:
        raise ValueError(f"advantage {kind!r} needs a group_size G (>= 2)")
    return int_at_least(group_size, "group_size", 2)
