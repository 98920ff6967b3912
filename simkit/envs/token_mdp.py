"""Token-level MDP with a verifiable terminal reward: the LLM-RLVR environment with exact truth.

A sequence y = (y_0, …, y_{L−1}) of tokens from a vocabulary of size ``V`` is generated left to
right for at most ``T`` positions. A deterministic automaton over tokens with ``S`` states reads
the tokens (``transition[s, y]`` is the next state, starting from ``initial_state``). The policy's
next-token distribution depends on the position t and on the automaton state through a *policy
class* ``policy_index[s]`` ∈ {0, …, P−1}:

    π(y_t = v | t, s_t) = softmax(logits[t, policy_index[s_t], :])[v]

so ``logits`` of shape (T, P, V) are the parameters θ (∇ is taken w.r.t. them; the gradient
dimension is D = T·P·V, flattened in C order). If ``eos`` is set, emitting that token ends the
sequence (it is part of the sequence, and its log-probability carries gradient like any other
token); otherwise every sequence has length T. The reward is verifiable: R = ``reward[s_L]``, a
function of the automaton state after the last token.

A *policy* (π, or a behaviour μ) is an array of probabilities with the shape (T, P, V) of
``logits``; ``env.pi`` is π's.

The class is assembled from one module per idea: this one (validation, sizes, the
transfer-matrix DP: occupancy, J, ∇J; sampling delegates), :mod:`~simkit.envs.token_enumeration`
(every sequence, the exact support), :mod:`~simkit.envs.token_divergences` (χ², KL, TV per token
and per sequence) and :mod:`~simkit.envs.token_constructors` (``iid``, ``markov``,
``answer_correct``, ``at_least_k``, ``parity``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from simkit._validation import as_prob
from simkit.envs._checks import (
    baseline_and_scale,
    check_index,
    int_array,
    readonly,
    safe_log,
    softmax_readonly,
)
from simkit.envs.token_constructors import TokenMDPConstructors
from simkit.envs.token_divergences import TokenMDPDivergences
from simkit.envs.token_enumeration import SUPPORT_BUDGET, TokenMDPEnumeration, TokenSupport

__all__ = [
    "SUPPORT_BUDGET",
    "TOKEN_LEVEL_AGGREGATIONS",
    "TokenMDP",
    "TokenSupport",
    "exact_token_level_mean",
]

#: aggregations for which :func:`exact_token_level_mean` is exact, and their 1/Z per token
#: (for one sample; the n-sample mean E ĝ equals the one-sample mean for every one of them)
TOKEN_LEVEL_AGGREGATIONS = ("seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm")


# --- the environment ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TokenMDP(TokenMDPEnumeration, TokenMDPDivergences, TokenMDPConstructors):
    """Token-level MDP with automaton states and a terminal verifiable reward (module docstring).

    Parameters
    ----------
    logits : (T, P, V) array
        π's parameters θ: π(·|t, s) = softmax(logits[t, policy_index[s]]). Finite. (The
        constructors also accept (P, V) or (V,) and broadcast over positions.)
    transition : (S, V) int array
        ``transition[s, v]`` ∈ [0, S): the automaton state after reading token v in state s.
    policy_index : (S,) int array
        The policy class ∈ [0, P) used in automaton state s.
    reward : (S,) array
        R = ``reward[final automaton state]`` (finite).
    eos : int, optional
        Token in [0, V) that ends a sequence (included in it); None: every sequence has length T.
    initial_state : int
        The automaton state before the first token (default 0).
    """

    logits: np.ndarray
    transition: np.ndarray
    policy_index: np.ndarray
    reward: np.ndarray
    eos: int | None = None
    initial_state: int = 0
    _pi: np.ndarray = field(init=False, repr=False)
    _identity_classes: bool = field(init=False, repr=False)

    def __post_init__(self):
        logits = np.asarray(self.logits, dtype=np.float64)
        if logits.ndim != 3 or min(logits.shape) < 1:
            raise ValueError(
                "logits must have shape (T, P, V) with T, P, V >= 1 (use a constructor such as "
                f"TokenMDP.iid to broadcast (P, V) or (V,) logits), got shape {logits.shape}"
            )
        if not np.all(np.isfinite(logits)):
            raise ValueError("logits contains non-finite entries")
        _, P, V = logits.shape
        trans = int_array(self.transition, "transition", "(S, V)")
        if trans.ndim != 2 or trans.shape[1] != V or trans.shape[0] < 1:
            raise ValueError(
                f"transition must have shape (S, V) = (S, {V}) with S >= 1 (V from logits), "
                f"got shape {trans.shape}"
            )
        S = trans.shape[0]
        if np.any((trans < 0) | (trans >= S)):
            bad = np.argwhere((trans < 0) | (trans >= S))[0]
            raise ValueError(
                f"transition entries must be automaton states in [0, S) = [0, {S}); "
                f"transition[{bad[0]}, {bad[1]}] = {trans[bad[0], bad[1]]}"
            )
        index = int_array(self.policy_index, "policy_index", "(S,)")
        if index.shape != (S,):
            raise ValueError(f"policy_index must have shape (S,) = ({S},), got {index.shape}")
        if np.any((index < 0) | (index >= P)):
            raise ValueError(
                f"policy_index entries must be policy classes in [0, P) = [0, {P}) (P from "
                f"logits), got min {index.min()}, max {index.max()}"
            )
        reward = np.asarray(self.reward, dtype=np.float64)
        if reward.shape != (S,):
            raise ValueError(f"reward must have shape (S,) = ({S},), got {reward.shape}")
        if not np.all(np.isfinite(reward)):
            raise ValueError("reward contains non-finite entries")
        eos = None if self.eos is None else check_index(self.eos, "eos", V, "a token")
        init = check_index(self.initial_state, "initial_state", S, "an automaton state")
        object.__setattr__(self, "logits", readonly(logits))
        object.__setattr__(self, "transition", readonly(trans, np.int64))
        object.__setattr__(self, "policy_index", readonly(index, np.int64))
        object.__setattr__(self, "reward", readonly(reward))
        object.__setattr__(self, "eos", eos)
        object.__setattr__(self, "initial_state", init)
        object.__setattr__(self, "_pi", softmax_readonly(logits))
        identity = P == self.S and np.array_equal(index, np.arange(P))
        object.__setattr__(self, "_identity_classes", identity)

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def T(self) -> int:
        """Maximum sequence length."""
        return int(self.logits.shape[0])

    @property
    def P(self) -> int:
        """Number of policy classes."""
        return int(self.logits.shape[1])

    @property
    def V(self) -> int:
        """Vocabulary size."""
        return int(self.logits.shape[2])

    @property
    def S(self) -> int:
        """Number of automaton states."""
        return int(self.transition.shape[0])

    @property
    def D(self) -> int:
        """Dimension of θ = logits (T·P·V)."""
        return int(self.logits.size)

    @property
    def pi(self) -> np.ndarray:
        """Target policy π = softmax(logits) over the last axis, shape (T, P, V)."""
        return self._pi

    @property
    def fixed_length(self) -> bool:
        """True iff every sequence has length T (no EOS token)."""
        return self.eos is None

    # --- policies -------------------------------------------------------------------------------

    def check_policy(self, p, name: str = "behaviour") -> np.ndarray:
        """Validate a policy: shape (T, P, V), non-negative, each row sums to one."""
        arr = np.asarray(p, dtype=np.float64)
        if arr.shape != self.logits.shape:
            raise ValueError(
                f"{name} must have shape (T, P, V) = {self.logits.shape}, got shape {arr.shape}"
            )
        return as_prob(arr, name)

    def with_logits(self, logits) -> TokenMDP:
        """The same automaton, reward, EOS and initial state with new parameters θ = ``logits``
        (T, P, V): π becomes softmax(``logits``). Every exact method (``J``, ``grad_J``,
        divergences…) then evaluates that policy — the way a trainer evaluates its current θ.

        Only ``logits`` is validated (shape (T, P, V) of this env, finite); the automaton is
        shared (it was validated when this env was built), so this is cheap: one copy and one
        softmax of size T·P·V.
        """
        arr = np.asarray(logits, dtype=np.float64)
        if arr.shape != self.logits.shape:
            raise ValueError(
                f"logits must have shape (T, P, V) = {self.logits.shape}, got shape {arr.shape}"
            )
        if not np.all(np.isfinite(arr)):
            raise ValueError("logits contains non-finite entries")
        new = object.__new__(type(self))
        for name in self.__dataclass_fields__:
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "logits", readonly(arr))
        object.__setattr__(new, "_pi", softmax_readonly(new.logits))
        return new

    def _policy(self, policy, name: str) -> np.ndarray:
        return self.pi if policy is None else self.check_policy(policy, name)

    def _step_probs(self, policy: np.ndarray, t: int) -> np.ndarray:
        """(S, V) next-token probabilities at position t in every automaton state."""
        if self._identity_classes:
            return policy[t]
        return np.take(policy[t], self.policy_index, axis=0)

    def _class_sum(self, per_state: np.ndarray) -> np.ndarray:
        """Sum (S, V) rows into their policy classes: (P, V)."""
        if self._identity_classes:
            return per_state
        out = np.zeros((self.P, per_state.shape[-1]))
        np.add.at(out, self.policy_index, per_state)
        return out

    # --- exact dynamic programming ------------------------------------------------------------

    def _forward(self, kernel_of_t, normalise: bool = False, has_inf: bool = False):
        """Transfer-matrix recursion of a non-negative per-token kernel k_t(s, v) of shape (S, V).

        a_0 = e_{s0}; a_{t+1}[s'] = Σ_{s, v ≠ eos: trans[s, v] = s'} a_t[s]·k_t(s, v); the mass
        that ends (v = eos, or t = T − 1) goes to ``final[trans[s, v]]``. With k = π this is the
        occupancy and the law of the final state. Returns ``(a (T, S), final (S,), log_scale)``
        with the true values ``final·exp(log_scale)``; with ``normalise`` each a_t is rescaled
        to sum 1 (its own scale is lost; only ``final`` is needed then) so that products of
        T ~ 10⁴ factors neither overflow nor underflow. ``has_inf``: the kernel may hold inf
        (then 0·inf = 0 off the reachable states, and ``final`` is inf where the sum diverges).
        ``kernel_of_t`` must return a new array (it is modified).
        """
        S, T = self.S, self.T
        trans = self.transition.ravel()
        a = np.zeros(S)
        a[self.initial_state] = 1.0
        running = np.empty((T, S))
        final = np.zeros(S)
        log_scale = 0.0
        for t in range(T):
            running[t] = a
            k = kernel_of_t(t)
            if has_inf:
                with np.errstate(invalid="ignore"):
                    flow = np.where(a[:, None] > 0, a[:, None] * k, 0.0)  # 0·inf = 0 off-support
            else:
                flow = k * a[:, None]
            if t == T - 1:
                final += np.bincount(trans, weights=flow.ravel(), minlength=S)
                break
            if self.eos is not None:
                e = self.eos
                final += np.bincount(self.transition[:, e], weights=flow[:, e], minlength=S)
                flow[:, e] = 0.0
            a = np.bincount(trans, weights=flow.ravel(), minlength=S)
            if normalise:
                total = a.sum()
                if not np.isfinite(total):
                    final[:] = np.inf
                    return running, final, log_scale
                if total > 0:
                    a /= total
                    final /= total
                    log_scale += math.log(total)
        return running, final, log_scale

    def _backward(self, terminal: np.ndarray, policy: np.ndarray):
        """Values under ``policy``: V_t(s) = E[terminal(s_L) | running at t in state s].

        V_T = terminal; Q_t(s, v) = terminal[trans[s, v]] if v = eos (or t = T − 1) else
        V_{t+1}[trans[s, v]]; V_t(s) = Σ_v policy_t(v|s)·Q_t(s, v). ``terminal``: (S,).
        Yields ``(t, V_t (S,), Q_t (S, V))`` for t = T − 1, …, 0 (a generator: nothing is
        stored, so T·S·V memory is never needed).
        """
        nxt = terminal
        for t in range(self.T - 1, -1, -1):
            Q = nxt[self.transition]
            if self.eos is not None:
                Q[:, self.eos] = terminal[self.transition[:, self.eos]]
            value = np.einsum("sv,sv->s", self._step_probs(policy, t), Q)
            yield t, value, Q
            nxt = value

    def occupancy(self, policy=None) -> np.ndarray:
        """d_t(s) = P(automaton state s at position t and the sequence still running), (T, S).

        Forward recursion d_{t+1}(s') = Σ_{s, v ≠ eos: trans[s, v] = s'} d_t(s)·policy_t(v|s),
        d_0 = e_{initial_state}. ``policy`` (T, P, V) defaults to π; Σ_s d_t(s) = P(|y| > t).
        """
        p = self._policy(policy, "policy")
        running, _, _ = self._forward(lambda t: self._step_probs(p, t).copy())
        return running

    def final_state_distribution(self, policy=None) -> np.ndarray:
        """P(final automaton state = s) under ``policy`` (default π), shape (S,)."""
        p = self._policy(policy, "policy")
        return self._forward(lambda t: self._step_probs(p, t).copy())[1]

    def length_distribution(self, policy=None) -> np.ndarray:
        """P(|y| = L) for L = 1..T under ``policy`` (default π), shape (T,) (index L − 1)."""
        running = self.occupancy(policy).sum(axis=1)
        return running - np.append(running[1:], 0.0)

    def J(self, policy=None) -> float:
        """J = E[R] = Σ_s P(final state s)·reward[s] under ``policy`` (default π), exact."""
        return float(self.final_state_distribution(policy) @ self.reward)

    def grad_J(self) -> np.ndarray:
        """∇θ J(π) by the policy gradient theorem with exact values, shape (D,) (C order of θ).

        ∂J/∂logits[t, p, :] = Σ_{s: policy_index[s] = p} d_t(s)·π_t(·|s) ⊙ (Q_t(s, ·) − V_t(s))
        (softmax score e_v − π; Sutton et al. 2000, policy gradient theorem), with d the
        occupancy under π and V, Q the exact values (:meth:`_backward`).
        """
        d = self.occupancy()
        grad = np.empty(self.logits.shape)
        for t, value, Q in self._backward(self.reward, self.pi):
            probs = self._step_probs(self.pi, t)
            Q -= value[:, None]
            Q *= probs
            Q *= d[t][:, None]
            grad[t] = self._class_sum(Q)
        return grad.ravel()

    def log_ratio(self, mu) -> np.ndarray:
        """log π − log μ per (t, p, v), shape (T, P, V); +inf where μ = 0."""
        mu = self.check_policy(mu)
        return np.log(self.pi) - safe_log(mu)

    # --- sampling and gradient accumulation (simkit.envs.token_sampling) --------------------

    def sample(self, mu, n: int, rng: np.random.Generator, reps: int | None = None):
        """Draw ``reps`` batches (or one) of ``n`` sequences y ~ μ: a ``TokenBatch``
        (delegates to :func:`simkit.envs.token_sampling.sample_tokens`)."""
        from simkit.envs.token_sampling import sample_tokens

        return sample_tokens(self, mu, n, rng, reps)

    def accumulate(self, actions, token_weights, states=None) -> np.ndarray:
        """Σ_{i,t} λ_{i,t} ∇θ log π(y_{i,t} | t, s_{i,t}), shape (L..., D), for ``actions`` and
        ``token_weights`` (L..., n, T) (delegates to
        :func:`simkit.envs.token_sampling.accumulate_tokens`; ``states`` recomputed if None)."""
        from simkit.envs.token_sampling import accumulate_tokens

        return accumulate_tokens(self, actions, token_weights, states=states)

    def score_norms_sq(self, actions, token_weights, states=None) -> np.ndarray:
        """‖Σ_t λ_t ∇θ log π(y_t | t, s_t)‖² per sequence, shape (…,) for (…, T) inputs.

        Positions own disjoint parameter blocks logits[t], so the squared norm is
        Σ_t λ_t²·‖e_{y_t} − π_t(·|s_t)‖² = Σ_t λ_t²·(1 − 2π_t(y_t|s_t) + Σ_v π_t(v|s_t)²):
        no D-dimensional vector is formed. λ must be 0 on padding.
        """
        y = np.asarray(actions)
        lam = np.asarray(token_weights, dtype=np.float64)
        if lam.shape != y.shape or y.ndim < 1 or y.shape[-1] != self.T:
            raise ValueError(
                f"actions and token_weights must both have shape (..., T) with T = {self.T}, "
                f"got {y.shape} and {lam.shape}"
            )
        s = self.states_of(y) if states is None else np.asarray(states)
        cls = self.policy_index[s]
        t_idx = np.broadcast_to(np.arange(self.T), y.shape)
        p_y = self.pi[t_idx, cls, y]
        sq = np.einsum("tpv,tpv->tp", self.pi, self.pi)[t_idx, cls]
        return np.sum(lam**2 * (1.0 - 2.0 * p_y + sq), axis=-1)


# --- exact mean of token-level estimators ---------------------------------------------------


def exact_token_level_mean(
    env: TokenMDP,
    mu,
    mapping,
    baseline: float,
    aggregation: str = "seq-mean-token-sum",
    max_length: int | None = None,
) -> np.ndarray:
    """E ĝ for a token-level mapping with coefficient c_t = φ(r_t, sign A), exact by DP, (D,).

    One sample's term is g = (1/Z) Σ_t φ(r_t, sign A)·A·∇θ log π(y_t|t, s_t), A = R − b with
    b = ``baseline``, r_t = π/μ at (t, s_t, y_t), y ~ μ. Aggregations (notation page §D)
    with a deterministic per-sample Z (so E ĝ = E g for any n):

    - ``"seq-mean-token-sum"``: Z = 1 per sample (÷ n over the batch) — any length;
    - ``"token-mean"``: Z = T — fixed length only (with EOS the batch's Z is random);
    - ``"seq-mean-token-sum-norm"``: Z = L_max (``max_length``, default T) — any length.

    (``seq-mean-token-mean`` divides by the random |y_i|: use the enumeration path.) With
    d^μ the occupancy under μ and the backward values under μ of the terminal functions
    A·1{A ≥ 0} and A·1{A < 0} (A depends on the final automaton state only, so splitting on
    the sign is exact for any reward), Q^±_t(s, v) = E_μ[A·1{±} | prefix, y_t = v]:

        ∂/∂logits[t, p, :] = Σ_{s ∈ p} Σ_v d^μ_t(s) μ_t(v|s) [φ(r, +)Q⁺ + φ(r, −)Q⁻](s, v)
                              ·(e_v − π_t(·|s)).

    ``mapping`` must have ``level == "token"`` and a token ``phi`` (:class:`ScalarMapping`
    with ``ratio_kind == "token"``); phi is the exact formula (no ``max_log_ratio`` clamp).
    """
    from simkit.mappings.base import ScalarMapping

    if not isinstance(env, TokenMDP):
        raise TypeError(f"env must be a TokenMDP, got {type(env).__name__}")
    if not (
        isinstance(mapping, ScalarMapping)
        and mapping.level == "token"
        and mapping.ratio_kind == "token"
        and not mapping.batch_dependent
    ):
        raise ValueError(
            f"exact_token_level_mean needs a token-level mapping with a per-token phi, got "
            f"{getattr(mapping, 'name', type(mapping).__name__)!r} (level "
            f"{getattr(mapping, 'level', None)!r}); use the enumeration path (support) instead"
        )
    mu = env.check_policy(mu)
    if aggregation not in TOKEN_LEVEL_AGGREGATIONS:
        raise ValueError(
            f"aggregation must be one of {TOKEN_LEVEL_AGGREGATIONS} (a deterministic Z), got "
            f"{aggregation!r}"
        )
    b, inv_z = baseline_and_scale(env.T, baseline, aggregation, max_length)
    if aggregation == "token-mean" and not env.fixed_length:
        raise ValueError(
            "aggregation 'token-mean' has a random Z = total tokens when lengths vary "
            "(eos is set): its mean is not a per-sample quantity"
        )
    reach = mu > 0
    with np.errstate(divide="ignore"):
        ratio = np.where(reach, env.pi / np.where(reach, mu, 1.0), np.inf)
    c_pos = np.where(reach, mapping.phi(np.where(reach, ratio, 1.0), True), 0.0)
    c_neg = np.where(reach, mapping.phi(np.where(reach, ratio, 1.0), False), 0.0)
    adv = env.reward - b
    d = env.occupancy(mu)
    grad = np.empty(env.logits.shape)
    backward = zip(
        env._backward(np.where(adv >= 0, adv, 0.0), mu),
        env._backward(np.where(adv < 0, adv, 0.0), mu),
    )
    idx = env.policy_index
    for (t, _, q_pos), (_, _, q_neg) in backward:
        lam = d[t][:, None] * mu[t][idx] * (c_pos[t][idx] * q_pos + c_neg[t][idx] * q_neg)
        grad[t] = env._class_sum(lam - env.pi[t][idx] * lam.sum(axis=1, keepdims=True))
    return inv_z * grad.ravel()
