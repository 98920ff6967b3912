"""Exact kept fractions of a mapping on a token MDP by DP: how much of μ's data it keeps.

    kept     = E_μ[#{t valid: c_t ≠ 0}] / E_μ[#{t valid}]
    kept_seq = P_μ(some valid c_t ≠ 0)

(:func:`simkit.experiment.metrics.kept_fractions` on a support or a batch.) For every
coefficient the moment DP of :mod:`simkit.envs.token_moments` handles, c_t = g^±_t·Π_u κ_u
(token level: c_t = g_t = φ(r_t, sign A), κ ≡ 1; product forms is_seq and power: g ≡ 1,
κ = r^α; composed estimators: g the product of the per-token factors, κ that of the product
factors, on their legs π/π_old, π_old/μ or π/μ). Then c_t ≠ 0 iff g^±_t ≠ 0 and no token of
the sequence has κ_u = 0 (W^α > 0 for every drawn sequence when π, π_old > 0, so the product
forms keep everything). With μ̃ = μ·1{κ ≠ 0} (the sub-stochastic kernel of the sequences whose
product factor is non-zero), d̃ its occupancy and Q̃^± its backward values of 1{±A ≥ 0}
(A = R − b is a function of the final state, so the sign split is exact):

    E_μ[#kept] = Σ_± Σ_t Σ_{s,v} d̃_t(s) μ̃_t(v|s) 1{g^±_t(s, v) ≠ 0} Q̃^±_t(s, v)
    kept_seq   = P_μ̃(end) − Σ_± P_{μ̃·1{g^± = 0}}(end in a final state of sign ±)

(the last term: the probability of sequences all of whose coefficients are 0, by a forward
sweep restricted to zeroing tokens). The sign is that of the enumeration's atoms: A ≥ 0 is
positive (A = 0 included), and a coefficient counts as kept when it is non-zero whatever A is.
``phi`` is the exact formula (no ``max_log_ratio`` clamp), and W = Π r is not rounded: at T
where the floating product would underflow to 0 the DP still counts the sequence as kept.

Cost O(T·S·V). Checked against ``kept_fractions`` of the support's coefficients to 1e-12 in
``tests/test_token_kept.py``.
"""

from __future__ import annotations

import numpy as np

from simkit.envs._checks import baseline_and_scale
from simkit.envs.token_moments import (
    _BLOCK,
    _Backward,
    _composed_factors,
    _factor,
    _position_blocks,
    composed_legs,
)


def kept_dp_applies(env, mapping, correction=None, mode: str = "decoupled") -> str:
    """'' if :func:`kept_dp` applies to ``mapping`` (× ``correction`` in ``mode``) on ``env``,
    else why not: a token MDP and per-token or product-form factors (the coefficients of the
    moment DP; the aggregation does not enter the kept fractions)."""
    from simkit.envs.token_mdp import TokenMDP

    if not isinstance(env, TokenMDP):
        return "the kept-fraction DP is for token MDPs"
    if _factor(mapping) is None:
        return f"mapping {mapping.name!r} has no per-token or product-form coefficient"
    if correction is None:
        return ""
    if mode == "trl_vespo":
        return "mode 'trl_vespo' folds the correction into VESPO's W (no product form)"
    if mode not in ("decoupled", "bypass"):
        return f"unknown mode {mode!r}"
    if _factor(correction) is None:
        return (
            f"correction {correction.name!r} is not a per-token or product-form factor "
            "(a truncation or mask of a sequence-level ratio)"
        )
    return ""


def kept_dp(
    env, mu, mapping, baseline: float, correction=None, old=None, mode: str = "decoupled"
) -> dict[str, float]:
    """``{"kept": …, "kept_seq": …}`` of ``mapping`` (composed with ``correction`` on π_old =
    ``old`` in ``mode`` when given) under μ = ``mu``, exact by DP (module docstring).

    ``baseline`` b of A = R − b (only the sign of A enters, through c^±); ``old`` None: π_old
    = π. ``ValueError`` (no DP) where :func:`kept_dp_applies` says why.
    """
    why = kept_dp_applies(env, mapping, correction, mode)
    if why:
        raise ValueError(f"no kept-fraction DP: {why}")
    mu = env.check_policy(mu)
    old = env.pi if old is None else env.check_policy(old, "old")
    b, _ = baseline_and_scale(env.T, baseline, "seq-mean-token-sum", None)
    factors = _composed_factors(env, mu, old, composed_legs(mapping, correction, mode))
    pos = env.reward - b >= 0
    signs = np.stack([pos, ~pos]).astype(np.float64)  # terminals 1{A ≥ 0}, 1{A < 0}

    def kernels(t0: int, t1: int):
        """(μ̃, μ̃·1{g⁺ = 0}, μ̃·1{g⁻ = 0}, 1{g⁺ ≠ 0}, 1{g⁻ ≠ 0}), each (b, S, V)."""
        _, M, g_pos, g_neg, kappa = factors(t0, t1)
        kept_mu = M if kappa is None else np.where(kappa != 0, M, 0.0)
        nz_pos, nz_neg = g_pos != 0, g_neg != 0
        return (
            kept_mu,
            np.where(nz_pos, 0.0, kept_mu),
            np.where(nz_neg, 0.0, kept_mu),
            nz_pos,
            nz_neg,
        )

    running, final = _forward_many(env, kernels, 3)
    # numerator: backward values of the sign indicators under μ̃, against d̃ = running[0]
    back = _Backward(env, signs)
    kept_tokens = 0.0
    for t0, t1 in _position_blocks(env, env.T):
        kept_mu, _, _, nz_pos, nz_neg = kernels(t0, t1)
        for t in range(t1 - 1, t0 - 1, -1):
            i = t - t0
            Q, log_q = back.at(t)
            Y = Q * np.exp(log_q)[:, None, None]
            w = running[0, t][:, None] * kept_mu[i]
            kept_tokens += float(np.sum(w * (nz_pos[i] * Y[0] + nz_neg[i] * Y[1])))
            back.step(np.einsum("sv,msv->ms", kept_mu[i], Q), log_q)
    tokens = float(env.occupancy(mu).sum())  # E_μ|y|
    all_zero = float(final[1] @ signs[0] + final[2] @ signs[1])
    return {
        "kept": kept_tokens / tokens,
        "kept_seq": min(max(float(final[0].sum()) - all_zero, 0.0), 1.0),
    }


def _forward_many(env, kernels, k: int):
    """Forward recursions of the first ``k`` sub-stochastic kernels of ``kernels(t0, t1)``
    (each (b, S, V)) together, unscaled: ``(running (k, T, S), final (k, S))`` — running[j, t]
    the mass still running in each state at t, final[j] the mass that ended in each state
    (after EOS or the last position)."""
    S, T = env.S, env.T
    trans = env.transition.ravel()
    flat = (trans[None, :] + (np.arange(k) * S)[:, None]).ravel()
    a = np.zeros((k, S))
    a[:, env.initial_state] = 1.0
    running = np.zeros((k, T, S))
    final = np.zeros((k, S))
    for t0 in range(0, T, _BLOCK):
        t1 = min(t0 + _BLOCK, T)
        tables = kernels(t0, t1)[:k]
        for t in range(t0, t1):
            running[:, t] = a
            flow = np.stack([K[t - t0] for K in tables]) * a[:, :, None]  # (k, S, V)
            if t == T - 1:
                final += np.bincount(flat, weights=flow.ravel(), minlength=k * S).reshape(k, S)
                break
            if env.eos is not None:
                e = env.eos
                ended = np.zeros((k, S, env.V))
                ended[:, :, e] = flow[:, :, e]
                final += np.bincount(flat, weights=ended.ravel(), minlength=k * S).reshape(k, S)
                flow[:, :, e] = 0.0
            a = np.bincount(flat, weights=flow.ravel(), minlength=k * S).reshape(k, S)
    return running, final
