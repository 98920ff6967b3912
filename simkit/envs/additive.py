"""Exact value and gradient of an *additive per-token* objective E_π[Σ_t g(t, s_t, y_t)].

The token MDP's DP (:mod:`simkit.envs.token_mdp`) computes J = E_π[R(s_L)] and ∇J for a
terminal reward. A KL penalty to a reference policy is additive instead: KL_seq(π‖π_ref) =
E_π[Σ_t log π(y_t|s_t)/π_ref(y_t|s_t)] (chain rule of the KL over the autoregressive
factorisation). This module extends the DP to a per-token table g of shape (T, P, V) (the
environment's θ layout; the bandit: (K,)):

- :func:`additive_expectation`: E_p[Σ_t g(t, s_t, y_t)] = Σ_t Σ_s d^p_t(s) Σ_v p_t(v|s) g(t, s, v)
  under any policy p (occupancy d^p, forward DP);
- :func:`additive_value_and_grad`: V = E_π[Σ_t g] and its gradient w.r.t. π's logits *holding g
  fixed*, by the policy-gradient theorem with the exact token-level values
  Q_t(s, v) = g(t, s, v) + V_{t+1}(trans[s, v]) (0 after EOS or at t = T − 1),
  V_t(s) = Σ_v π_t(v|s) Q_t(s, v), and
  ∂V/∂logits[t, p, v] = Σ_{s: class(s) = p} d_t(s)·π_t(v|s)·(Q_t(s, v) − V_t(s)).

For g = log π − log π_ref the gradient holding g fixed *is* ∇KL_seq: the term that g's own
dependence on θ adds, E_π[Σ_t ∇log π(y_t|s_t)], is zero (each score has mean zero given the
prefix). :func:`simkit.kl.kl_seq_and_grad` relies on this; its tests compare with finite
differences of the exact KL.
"""

from __future__ import annotations

import numpy as np

__all__ = ["additive_expectation", "additive_value_and_grad"]


def _is_bandit(env) -> bool:
    return not hasattr(env, "transition")


def _check_table(env, table, name: str) -> np.ndarray:
    g = np.asarray(table, dtype=np.float64)
    shape = (env.K,) if _is_bandit(env) else env.logits.shape
    if g.shape != shape:
        raise ValueError(f"{name} must have the shape of the policy {shape}, got {g.shape}")
    return g


def additive_expectation(env, table, policy=None) -> float:
    """E_p[Σ_t g(t, s_t, y_t)] under ``policy`` p (default π) for the per-token table g.

    ``table`` has the shape of the policy ((K,) bandit, (T, P, V) token MDP). Entries of g
    where p puts no mass do not count (0·inf = 0 there); an infinite g where p > 0 gives ±inf.
    """
    g = _check_table(env, table, "table")
    if _is_bandit(env):
        p = env.pi if policy is None else env.check_policy(policy, "policy")
        with np.errstate(invalid="ignore"):
            return float(np.sum(np.where(p > 0, p * g, 0.0)))
    p = env.pi if policy is None else env.check_policy(policy, "policy")
    d = env.occupancy(p)  # (T, S)
    total = 0.0
    for t in range(env.T):
        probs = env._step_probs(p, t)
        with np.errstate(invalid="ignore"):
            per = np.where(probs > 0, probs * env._step_probs(g, t), 0.0).sum(axis=1)
            total += float(np.sum(np.where(d[t] > 0, d[t] * per, 0.0)))
    return total


def additive_value_and_grad(env, table) -> tuple[float, np.ndarray]:
    """(V, ∇V) with V = E_π[Σ_t g(t, s_t, y_t)] and ∇ w.r.t. π's logits holding g fixed.

    Bandit: V = Σ_k π_k g_k, ∇V = π ⊙ (g − V) (shape (K,)). Token MDP: the backward DP of the
    module docstring; the gradient has the environment's D = T·P·V entries (C order of θ).
    ``table`` must be finite.
    """
    g = _check_table(env, table, "table")
    if not np.all(np.isfinite(g)):
        raise ValueError("table must be finite (an infinite per-token value has no gradient)")
    if _is_bandit(env):
        value = float(env.pi @ g)
        return value, env.pi * (g - value)
    d = env.occupancy()
    grad = np.empty(env.logits.shape)
    nxt = None
    for t in range(env.T - 1, -1, -1):
        Q = env._step_probs(g, t).copy()  # (S, V)
        if nxt is not None:
            future = nxt[env.transition]
            if env.eos is not None:
                future[:, env.eos] = 0.0  # nothing follows EOS
            Q += future
        probs = env._step_probs(env.pi, t)
        value = np.einsum("sv,sv->s", probs, Q)
        grad[t] = env._class_sum(d[t][:, None] * probs * (Q - value[:, None]))
        nxt = value
    return float(nxt[env.initial_state]), grad.ravel()
