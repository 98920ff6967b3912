"""Exact mean and second moment of per-sample estimators with **tied** parameters, by DP at any T.

With tied parameters one table θ (P, V) is shared by every position (θ[t] = θ_tied plus any
fixed offset, so ∂/∂θ_tied = Σ_t ∂/∂θ[t]); one sample y ~ μ contributes

    h = a · A · Σ_t c_t σ_t,    σ_t = e_{p(s_t), y_t} − π_t(·|s_t) placed in row p(s_t) of (P, V),

with a = 1/Z and the coefficients c_t of :mod:`simkit.envs.token_moments` (token level
c_t = φ(r_t, sign A); product form c_t = W^α; composed c_t = g_t·Π_u κ_u). The mean is the
untied mean summed over positions (linear). The squared norm now has cross-position terms:

    ‖h‖² = a² A² [ Σ_t c_t² ‖σ_t‖² + 2 Σ_{u<t} c_u c_t ⟨σ_u, σ_t⟩ ],
    ⟨σ_u, σ_t⟩ = 1{p(s_u) = p(s_t)} ⟨e_{y_u} − π_u(·|s_u), e_{y_t} − π_t(·|s_t)⟩.

The diagonal sum is the untied second moment. The cross sum is a forward **message** that
carries the partial sum of the weighted score vectors,

    M_t(s) = E_K[1{running in state s at t} · Σ_{u<t} c_u σ_u]        (S, P, V),

under the measure of the kernel K: μ for token-level coefficients (c = φ^±, one message per
sign of A: A is a function of the final state, so the sign split is exact, and one message
when φ⁺ = φ⁻), K² = μ·r^{2α} for the product forms (c_u c_t = W^{2α} is in the kernel, no
per-token factor), μ·κ² for composed coefficients (per-token factor g^±). With H_t(s, s') =
Σ_{v ≠ eos: trans[s, v] = s'} K_t(s, v) and the forward weights F_t (F_{t+1} = H_tᵀ F_t):

    M_{t+1}(s') = Σ_s H_t(s, s') M_t(s) + Σ_{s, v ≠ eos: trans[s, v] = s'} F_t(s) K_t(s, v)
                                                                      · c_t(s, v) σ_t(s, v)
    cross       = Σ_± Σ_t Σ_{s, v} K_t(s, v) c^±_t(s, v) Q^{2±}_t(s, v) ⟨M^±_t(s), σ_t(s, v)⟩

with Q^{2±}_t(s, v) the backward values of A²·1{±} (one terminal A² for product forms) under
the same kernel; ⟨M_t(s), σ_t(s, v)⟩ reads only row p(s) of M_t(s). Then
E‖h‖² = (untied second moment) + 2a²·cross.

Propagated position by position (:func:`_per_step_sweep`, any policy classes) this is one BLAS
matmul (S × S)·(S × m·P·V) per position (m ≤ 2 messages): O(T·S²·P·V), the natural cost of the
second moment of P·V additive features of an S-state chain. When every automaton state is its
own policy class (row p(s) = s) :func:`_blocked_sweep` propagates the messages once per block
of 16 positions and reads the rows the readouts need through the block's S × S propagators
(O(T·(S²·m·P·V/16 + 16·S³ + 16·m·S·V))); both sweeps agree to rounding (tested). Forward
weights and messages share one rescaling (per step, or per position inside a block through
kernels normalised by their largest row sum), backward values keep
:class:`~simkit.envs.token_moments._Backward`'s; scales are logarithms, so T = 4096 neither
overflows nor underflows unless the moment itself exceeds the float range (inf).
Backward values are stored as their (m, S) next-state vectors per position (Q is rebuilt from
them), never as a T·S·V table.

Checked against enumeration (:func:`simkit.experiment.exact_moments` with ``params="tied"``) to
1e-10 and against a pairwise-occupancy DP at T = 64 in ``tests/test_token_moments_tied.py``;
timed at S = V = 64, T = 4096 in ``benchmarks/bench_token_dp.py``.
"""

from __future__ import annotations

import math

import numpy as np

from simkit.envs._checks import baseline_and_scale
from simkit.envs.token_moments import (
    _BLOCK,
    TokenMoments,
    _Backward,
    _composed_factors,
    _factored_moments,
    _kernels_of,
    _position_blocks,
    _product_kernels,
    _rows,
    composed_dp_applies,
    composed_legs,
    dp_applies,
    sequence_moments,
    token_level_moments,
    token_phi_tables,
)


def tied_dp_applies(env, mapping, aggregation: str) -> str:
    """'' if :func:`tied_moments` applies to ``mapping`` × ``aggregation`` on ``env``, else why
    not (the same mappings and aggregations as the untied DP: token level, is_seq, power)."""
    return dp_applies(env, mapping, aggregation)


def tied_composed_dp_applies(
    env, mapping, correction, mode: str, aggregation: str, denominator: str = "valid"
) -> str:
    """'' if :func:`tied_composed_moments` applies, else why not (as the untied composed DP)."""
    return composed_dp_applies(env, mapping, correction, mode, aggregation, denominator)


def tied_moments(
    env, mu, mapping, baseline: float, aggregation="seq-mean-token-sum", max_length=None
) -> TokenMoments:
    """:class:`TokenMoments` of ``mapping`` with tied parameters by DP, exact at any T.

    ``mean`` has the tied shape (P·V,) (the untied mean summed over positions); ``second`` is
    E‖h‖² of the tied h (module docstring; inf when a sweep leaves the float range, as the
    untied DP's); ``abs_sum``, ``sq_sum``, ``mean_length`` (the ESS
    sums) do not depend on the parameterisation and equal the untied ones.
    """
    why = tied_dp_applies(env, mapping, aggregation)
    if why:
        raise ValueError(f"no tied moment DP: {why}")
    mu = env.check_policy(mu)
    b, inv_z = baseline_and_scale(env.T, baseline, aggregation, max_length)
    if mapping.level == "token":
        untied = token_level_moments(env, mu, mapping, b, inv_z)

        def tables(t0: int, t1: int):
            P, M = _rows(env, env.pi, t0, t1), _rows(env, mu, t0, t1)
            return P, M, token_phi_tables(mapping, P, M)

    else:
        untied = sequence_moments(env, mu, mapping, b, inv_z)
        alpha = 1.0 if mapping.name == "is_seq" else float(mapping.alpha)

        def tables(t0: int, t1: int):
            P, _, K2 = _product_kernels(env, mu, alpha, t0, t1)
            return P, K2, None

    return _tied(env, untied, _cross_sum(env, tables, env.reward - b), inv_z)


def tied_composed_moments(
    env,
    mu,
    old,
    mapping,
    correction,
    mode: str,
    baseline: float,
    aggregation: str = "seq-mean-token-sum",
    max_length=None,
) -> TokenMoments:
    """:class:`TokenMoments` of a composed estimator (three policies, :func:`~simkit.envs.
    token_moments.composed_moments`) with tied parameters, exact at any T.

    Kernel K² = μ·κ² and per-token factors g^± in the cross sum (module docstring); the rest as
    :func:`tied_moments`. ``old`` None: π_old = π.
    """
    why = tied_composed_dp_applies(env, mapping, correction, mode, aggregation)
    if why:
        raise ValueError(f"no tied moment DP: {why}")
    mu = env.check_policy(mu)
    old = env.pi if old is None else env.check_policy(old, "old")
    b, inv_z = baseline_and_scale(env.T, baseline, aggregation, max_length)
    factors = _composed_factors(env, mu, old, composed_legs(mapping, correction, mode))
    untied = _factored_moments(env, mu, factors, b, inv_z)

    def tables(t0: int, t1: int):
        block = factors(t0, t1)
        P, _, g_pos, g_neg, _ = block
        return P, _kernels_of(block)[1], (g_pos, g_neg)

    return _tied(env, untied, _cross_sum(env, tables, env.reward - b), inv_z)


def _exp(x: float) -> float:
    """exp(x), inf beyond the float range (math.exp raises there)."""
    return math.exp(x) if x < 709.0 else math.inf


def _tied(env, untied: TokenMoments, cross: float, inv_z: float) -> TokenMoments:
    """The tied moments from the untied ones and the a = 1 cross sum."""
    with np.errstate(over="ignore", invalid="ignore"):
        second = untied.second + 2.0 * inv_z**2 * cross
    if not math.isfinite(second):  # a sweep left the float range: the moment is not resolved
        second = math.inf
    return TokenMoments(
        mean=untied.mean.reshape(env.T, -1).sum(axis=0),
        second=float(second),
        abs_sum=untied.abs_sum,
        sq_sum=untied.sq_sum,
        mean_length=untied.mean_length,
    )


def _cross_sum(env, tables, adv: np.ndarray, blocked: bool | None = None) -> float:
    """Σ_{u<t} E_K[g(final)·c_u c_t ⟨σ_u, σ_t⟩] summed over the terminal rows (a = 1).

    ``tables(t0, t1) -> (π rows, K, factors)`` for positions t0..t1 − 1, each (b, S, V):
    ``factors`` None (no per-token factor; one terminal A²) or ``(c⁺, c⁻)`` (terminals
    A²·1{A ≥ 0} and A²·1{A < 0}, rows that are 0 on every state dropped). ``blocked``: the
    sweep of :func:`_blocked_sweep` (default: when every automaton state is its own policy
    class) or of :func:`_per_step_sweep`; both give the same sum.
    """
    T = env.T
    _, _, probe = tables(0, 1)
    if probe is None:
        terms, which = [adv**2], [None]
    else:
        pos = adv >= 0
        terms, which = [], []
        for j, row in enumerate((np.where(pos, adv**2, 0.0), np.where(pos, 0.0, adv**2))):
            if np.any(row != 0):
                terms.append(row)
                which.append(j)
    if not terms:  # A = 0 on every final state
        return 0.0
    m = len(terms)

    # backward values of the terminals under K; their snapshots per position
    back = _Backward(env, np.stack(terms))
    snaps: list = [None] * T
    same = True  # c⁺ = c⁻ everywhere: one message serves both terminals
    for t0, t1 in _position_blocks(env, T):
        _, K, fac = tables(t0, t1)
        if m == 2 and same:
            same = np.array_equal(fac[0], fac[1])
        for t in range(t1 - 1, t0 - 1, -1):
            snaps[t] = back.snapshot()
            Q, log_q = back.at(t)
            back.step(np.einsum("sv,msv->ms", K[t - t0], Q), log_q)

    n_msg = 1 if m == 1 or same else m
    msg_factor = [which[0]] if n_msg == 1 else which  # the factor each message carries
    plan = (back, snaps, which, n_msg, msg_factor)
    if blocked is None:
        blocked = bool(env._identity_classes)
    if blocked:
        return _blocked_sweep(env, tables, plan)
    return _per_step_sweep(env, tables, plan)


def _per_step_sweep(env, tables, plan) -> float:
    """The cross sum by one propagation of the messages per position (any policy classes)."""
    S, V, Pn, T = env.S, env.V, env.P, env.T
    back, snaps, which, n_msg, msg_factor = plan
    m = len(which)
    trans = env.transition
    pidx = env.policy_index
    states = np.arange(S)
    h_index = (states[:, None] * S + trans).ravel()  # H[s, trans[s, v]]
    z_index = (trans * S + states[:, None]).ravel()  # Z[trans[s, v], s]
    width = Pn * V
    # e-part of the source: message j, state trans[s, v], row p(s), column v
    e_index = [
        (((trans * n_msg + j) * Pn + pidx[:, None]) * V + np.arange(V)).ravel()
        for j in range(n_msg)
    ]
    unique_targets = np.unique(e_index[0]).size == e_index[0].size
    identity = bool(env._identity_classes)

    msg = np.zeros((S, n_msg * width))
    buffer = np.empty((S, Pn, V)) if identity else None
    F = np.zeros(S)
    F[env.initial_state] = 1.0
    log_F = 0.0
    cross = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for t0 in range(0, T, _BLOCK):
            t1 = min(t0 + _BLOCK, T)
            Pb, Kb, fac = tables(t0, t1)
            for t in range(t0, t1):
                i = t - t0
                P_t, K_t = Pb[i], Kb[i]
                Q, log_q = back.q_of(snaps[t])
                # readout: ⟨M_t(s), σ_t(s, v)⟩ = D(s, v) − ⟨D(s), π_t(·|s)⟩, D(s) = row p(s)
                if t > 0:
                    D = msg.reshape(S, n_msg, Pn, V)[states, :, pidx, :]  # (S, n_msg, V)
                    D_pi = np.einsum("sjv,sv->sj", D, P_t)
                    for r in range(m):
                        j = 0 if n_msg == 1 else r
                        w = K_t * Q[r]
                        if which[r] is not None:
                            w = w * fac[which[r]][i]
                        value = float(np.einsum("sv,sv->", w, D[:, j])) - float(
                            w.sum(axis=1) @ D_pi[:, j]
                        )
                        if value != 0.0:
                            cross += _exp(log_F + log_q[r]) * value
                if t == T - 1:
                    break
                # propagation: M_{t+1} = Hᵀ M_t + sources, F_{t+1} = Hᵀ F_t, all divided by
                # max F_{t+1} (folded into H and F: no extra pass over the message)
                K_run = K_t.copy()
                if env.eos is not None:
                    K_run[:, env.eos] = 0.0
                H = np.bincount(h_index, weights=K_run.ravel(), minlength=S * S).reshape(S, S)
                new_F = H.T @ F
                top = new_F.max()
                if not top > 0:  # every sequence has ended: no later pair
                    return cross
                H /= top
                F /= top
                log_F += math.log(top)
                new = H.T @ msg
                flat = new.reshape(-1)
                new4 = new.reshape(S, n_msg, Pn, V)
                for j in range(n_msg):
                    w = K_run * F[:, None]
                    if msg_factor[j] is not None:
                        w *= fac[msg_factor[j]][i]
                    if unique_targets:
                        flat[e_index[j]] += w.ravel()
                    else:
                        np.add.at(flat, e_index[j], w.ravel())
                    Z = np.bincount(z_index, weights=w.ravel(), minlength=S * S).reshape(S, S)
                    if identity:  # row p(s) = s: Z[s', s]·π_t(·|s)
                        np.multiply(Z[:, :, None], P_t[None], out=buffer)
                        new4[:, j] -= buffer
                    else:
                        rows = np.zeros((S, Pn, V))
                        rows[states, pidx, :] = P_t
                        new4[:, j] -= (Z @ rows.reshape(S, width)).reshape(S, Pn, V)
                msg = new
                F = new_F / top
    return cross


#: positions per block of :func:`_blocked_sweep` (balances its per-block message matmul against
#: its b² in-block propagators)
_TIED_BLOCK = 16


def _blocked_sweep(env, tables, plan, block: int = _TIED_BLOCK) -> float:
    """The cross sum with the messages propagated once per block of b positions (identity
    policy classes: row p(s) = s).

    Inside a block [t0, t1) the kernels are normalised per position (K̃_τ = K_τ/h_τ, h_τ the
    largest row sum, log h kept), so every propagator B[τ, k] = H̃_k ⋯ H̃_{τ−1} has entries ≤ 1.
    The row p(s) = s of the message at τ, the only part a readout reads, is

        D_τ(s, v) = Σ_{s0} B[τ, 0](s0, s) M_{t0}(s0)[s, v]
                    + Σ_{t0 ≤ u < τ} ( B[τ, u+1](trans[s, v], s) w_u(s, v)
                                       − Σ_{s''} B[τ, u+1](s'', s) Z_u(s'', s) · π_u(v|s) )

    (w_u = F_u K_u c_u the source weights, Z_u(s'', s) = Σ_{v: trans[s, v] = s''} w_u(s, v)),
    and the message at the block's end is one (S × S)·(S × m·S·V) matmul of M_{t0} plus the
    block's sources pushed through B[b, u+1] (grouped by target state: small matmuls). Cost
    O(T·(S²·m·P·V/b + b·S³ + b·m·S·V)) instead of O(T·S²·m·P·V).
    """
    S, V, T = env.S, env.V, env.T
    back, snaps, which, n_msg, msg_factor = plan
    m = len(which)
    trans = env.transition
    states = np.arange(S)
    eye = np.eye(S)
    row_index = (states[:, None] * S + trans).ravel()  # (s, trans[s, v]) in a flat (S, S)
    targets = trans.ravel()  # column (q, v) = q·V + v goes to state trans[q, v]
    order = np.argsort(targets, kind="stable")
    counts = np.bincount(targets, minlength=S)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.empty(S * V, dtype=np.int64)
    slot[order] = np.arange(S * V) - np.repeat(starts, counts)
    pad = np.full((S, max(int(counts.max()), 1)), S * V)  # S·V: a zero column
    pad[targets[order], slot[order]] = order
    msg = np.zeros((S, n_msg, S, V))
    F = np.zeros(S)
    F[env.initial_state] = 1.0
    ell = 0.0  # true F and M = scaled · exp(ell) at the block's start
    cross = 0.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for t0 in range(0, T, block):
            t1 = min(t0 + block, T)
            b = t1 - t0
            Pb, Kb, fac = tables(t0, t1)
            h = Kb.sum(axis=2).max(axis=1)
            h = np.where(h > 0, h, 1.0)
            Kt = Kb / h[:, None, None]
            Kr = Kt.copy()
            if env.eos is not None:
                Kr[:, :, env.eos] = 0.0
            h_index = ((np.arange(b)[:, None, None] * S + states[:, None]) * S + trans).ravel()
            H = np.bincount(h_index, weights=Kr.ravel(), minlength=b * S * S).reshape(b, S, S)
            log_c = np.concatenate([[0.0], np.cumsum(np.log(h))])  # (b + 1,)
            Fb = np.empty((b + 1, S))
            Fb[0] = F
            for i in range(b):
                Fb[i + 1] = Fb[i] @ H[i]
            # propagators, transposed so that the entries a readout needs, B(trans[s, v], s) =
            # Bᵀ(s, trans[s, v]), are read along rows: A[τ] = (H̃_0 ⋯ H̃_{τ−1})ᵀ from the block's
            # start, Bs[τ, u] = (H̃_{u+1} ⋯ H̃_{τ−1})ᵀ from the source at u < τ (0 for u ≥ τ)
            A = np.empty((b + 1, S, S))
            A[0] = eye
            Bs = np.zeros((b + 1, b, S, S))
            for tau in range(1, b + 1):
                A[tau] = H[tau - 1].T @ A[tau - 1]
                Bs[tau, : tau - 1] = H[tau - 1].T @ Bs[tau - 1, : tau - 1]
                Bs[tau, tau - 1] = eye
            # the block's sources: w[u, j] (S, V) and Z[u, j] (S'', S)
            w = np.empty((b, n_msg, S, V))
            for j in range(n_msg):
                w[:, j] = Fb[:b, :, None] * Kr
                if msg_factor[j] is not None:
                    w[:, j] *= fac[msg_factor[j]]
            z_index = (np.arange(b * n_msg)[:, None] * (S * S) + row_index).ravel()
            Zt = np.bincount(z_index, weights=w.ravel(), minlength=b * n_msg * S * S)
            Zt = Zt.reshape(b, n_msg, S, S)  # Zt[u, j](s, s'') = Z_u(s'', s)
            # rows p(s) = s of the messages at every position of the block: D (b, n_msg, S, V)
            start = np.matmul(
                A[:b].transpose(1, 0, 2), msg.transpose(2, 0, 1, 3).reshape(S, S, n_msg * V)
            )  # (s, τ, n_msg·V)
            D = start.reshape(S, b, n_msg, V).transpose(1, 2, 0, 3)
            inner = Bs[:b]  # (τ, u, S, S): zero for u ≥ τ
            reach = inner.reshape(b, b, S * S).take(row_index, axis=2)  # (τ, u, S·V)
            D += np.einsum("tux,ujx->tjx", reach, w.reshape(b, n_msg, S * V)).reshape(D.shape)
            g = np.einsum("tusa,ujsa->tjsu", inner, Zt, optimize=True)  # (τ, j, s, u)
            pi_rows = np.matmul(
                g.transpose(2, 0, 1, 3).reshape(S, b * n_msg, b), Pb.transpose(1, 0, 2)
            )  # (s, τ·j, v)
            D -= pi_rows.reshape(S, b, n_msg, V).transpose(1, 2, 0, 3)
            for tau in range(b):
                t = t0 + tau
                if t == 0:
                    continue
                Q, log_q = back.q_of(snaps[t])
                D_pi = np.einsum("jsv,sv->js", D[tau], Pb[tau])
                for r in range(m):
                    j = 0 if n_msg == 1 else r
                    rt = Kt[tau] * Q[r]
                    if which[r] is not None:
                        rt = rt * fac[which[r]][tau]
                    value = float(np.einsum("sv,sv->", rt, D[tau, j])) - float(
                        rt.sum(axis=1) @ D_pi[j]
                    )
                    if value != 0.0:
                        cross += _exp(ell + log_c[tau + 1] + log_q[r]) * value
            if t1 == T:
                break
            # the messages at t1: M_{t0} through B[b, 0], the block's sources through B[b, u+1]
            Ct = Bs[b]  # (u, x, s''): the block's sources pushed to its end
            new = (A[b] @ msg.reshape(S, -1)).reshape(S, n_msg, S * V)
            wide = np.concatenate([w.reshape(b, n_msg, S * V), np.zeros((b, n_msg, 1))], axis=2)
            grouped = wide[:, :, pad]  # (u, j, s'', slot)
            R = np.matmul(
                Ct.transpose(2, 1, 0), grouped.transpose(2, 0, 1, 3).reshape(S, b, -1)
            ).reshape(S, S, n_msg, pad.shape[1])  # (s'', x, j, slot)
            new += R[targets, :, :, slot].transpose(1, 2, 0)
            Y = np.matmul(Ct[:, None], Zt.transpose(0, 1, 3, 2))  # (u, j, x, q)
            pi_part = np.matmul(
                Y.transpose(3, 2, 1, 0).reshape(S, S * n_msg, b), Pb.transpose(1, 0, 2)
            )  # (q, x·j, v)
            new -= pi_part.reshape(S, S, n_msg, V).transpose(1, 2, 0, 3).reshape(S, n_msg, -1)
            top = Fb[b].max()
            if not top > 0:  # every sequence has ended: no later pair
                return cross
            msg = new.reshape(S, n_msg, S, V) / top
            F = Fb[b] / top
            ell += log_c[b] + math.log(top)
    return cross
