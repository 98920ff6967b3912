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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from simkit import divergence
from simkit._memory import check_token_mdp
from simkit._validation import as_prob, check_seed

#: default largest number of sequences :meth:`TokenMDP.support` enumerates
SUPPORT_BUDGET = 2**20
#: aggregations for which :func:`exact_token_level_mean` is exact, and their 1/Z per token
#: (for one sample; the n-sample mean E ĝ equals the one-sample mean for every one of them)
TOKEN_LEVEL_AGGREGATIONS = ("seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm")


def _readonly(a: np.ndarray, dtype=np.float64) -> np.ndarray:
    a = np.array(a, dtype=dtype, copy=True)
    a.setflags(write=False)
    return a


def _softmax_readonly(logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis, computed in place in one new array (no large temporaries)."""
    out = logits - logits.max(axis=-1, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    out.setflags(write=False)
    return out


#: values per block of :func:`_by_position` (keeps the divergences' temporaries in cache)
_BLOCK_VALUES = 1 << 16


def _by_position(fn, pi: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """``fn(pi, mu)`` (a :mod:`simkit.divergence` function) on (T, P, V) arrays, (T, P), computed
    over blocks of positions: the same numbers, without (T, P, V)-sized temporaries."""
    T, P, V = pi.shape
    rows = max(1, _BLOCK_VALUES // (P * V))
    return np.concatenate([fn(pi[t : t + rows], mu[t : t + rows]) for t in range(0, T, rows)])


def _safe_log(p: np.ndarray) -> np.ndarray:
    """log p with log 0 = −inf (no warning)."""
    with np.errstate(divide="ignore"):
        return np.log(p)


def _int_array(value, name: str, shape_doc: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        if arr.size and np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
            return arr.astype(np.int64)
        raise ValueError(f"{name} must be an integer array of shape {shape_doc}, got {arr.dtype}")
    return arr.astype(np.int64)


def _check_index(value, name: str, upper: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer {what} in [0, {upper}), got {value!r}")
    if not 0 <= value < upper:
        raise ValueError(f"{name} must be {what} in [0, {upper}), got {value}")
    return int(value)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


# --- supports -----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TokenSupport:
    """Every sequence of positive μ-probability, with its oracle quantities (exact path).

    The reward is a deterministic function of the sequence, so an *atom* is one sequence and
    its advantage A = R − b is known exactly. Shapes (M atoms, T the maximum length):

    - ``actions`` (M, T) int (0 after the end), ``mask`` (M, T) bool (valid tokens),
      ``states`` (M, T) automaton state at which each token was emitted (0 after the end);
    - ``prob`` (M,) = μ(y); ``rewards`` (M,) R(y); ``lengths`` (M,) |y|;
    - ``log_ratio`` (M, T) = log π(y_t|t, s_t) − log μ(y_t|t, s_t), 0 on padding;
    - ``positive`` (M,) bool: A ≥ 0; ``adv_first`` (M,) = μ(y)·A(y), ``adv_second`` (M,) =
      μ(y)·A(y)² (the joint partial moments of the bandit's support; Σ ``adv_first`` = E_μ[A]);
    - ``advantage_sign`` (M,) = ±1.0, a representative advantage to pass to a mapping.
    """

    actions: np.ndarray
    mask: np.ndarray
    states: np.ndarray
    prob: np.ndarray
    rewards: np.ndarray
    log_ratio: np.ndarray
    positive: np.ndarray
    adv_first: np.ndarray
    adv_second: np.ndarray

    @property
    def advantage_sign(self) -> np.ndarray:
        return np.where(self.positive, 1.0, -1.0)

    @property
    def lengths(self) -> np.ndarray:
        return self.mask.sum(axis=-1)


# --- the environment ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TokenMDP:
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
        trans = _int_array(self.transition, "transition", "(S, V)")
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
        index = _int_array(self.policy_index, "policy_index", "(S,)")
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
        eos = None if self.eos is None else _check_index(self.eos, "eos", V, "a token")
        init = _check_index(self.initial_state, "initial_state", S, "an automaton state")
        object.__setattr__(self, "logits", _readonly(logits))
        object.__setattr__(self, "transition", _readonly(trans, np.int64))
        object.__setattr__(self, "policy_index", _readonly(index, np.int64))
        object.__setattr__(self, "reward", _readonly(reward))
        object.__setattr__(self, "eos", eos)
        object.__setattr__(self, "initial_state", init)
        object.__setattr__(self, "_pi", _softmax_readonly(logits))
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

    @property
    def n_sequences(self) -> int:
        """Number of distinct token sequences: V^T, or with EOS Σ_{L<T} (V−1)^{L−1} + (V−1)^{T−1}·V
        (a sequence ends at its first EOS or at length T)."""
        V, T = self.V, self.T
        if self.eos is None:
            return V**T
        return sum((V - 1) ** (L - 1) for L in range(1, T)) + (V - 1) ** (T - 1) * V

    def enumerable(self, budget: int = SUPPORT_BUDGET) -> bool:
        """True iff :meth:`support` can enumerate every sequence within ``budget``."""
        return self.n_sequences <= budget

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
        object.__setattr__(new, "logits", _readonly(arr))
        object.__setattr__(new, "_pi", _softmax_readonly(new.logits))
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
        return np.log(self.pi) - _safe_log(mu)

    # --- divergences ------------------------------------------------------------------------

    def _per_class(self, mu) -> dict[str, np.ndarray]:
        """χ², KL, TV of π(·|t, p) from μ(·|t, p) per class: (T, P) each (simkit.divergence)."""
        return {
            "chi2": _by_position(divergence.chi2, self.pi, mu),
            "kl": _by_position(divergence.kl, self.pi, mu),
            "tv": _by_position(divergence.tv, self.pi, mu),
        }

    def divergence_profile(self, mu) -> dict[str, np.ndarray]:
        """Per-position divergences of π from μ, (T,) arrays.

        ``chi2_tok``, ``kl_tok``, ``tv_tok``: Σ_s d^μ_t(s)·D(π_t(·|s), μ_t(·|s)) / Σ_s d^μ_t(s),
        the divergence at position t averaged over μ's state distribution given that the
        sequence is still running (NaN at positions μ never reaches); ``*_max``: the largest
        over states reachable at t under μ (NaN where none). Plus ``running`` (T,) = P_μ(|y| > t).
        """
        mu = self.check_policy(mu)
        d = self.occupancy(mu)  # (T, S)
        running = d.sum(axis=1)
        out = {}
        for name, per_class in self._per_class(mu).items():
            per_state = per_class[:, self.policy_index]  # (T, S)
            reach = d > 0
            with np.errstate(invalid="ignore", divide="ignore"):
                weighted = np.where(reach, d * per_state, 0.0).sum(axis=1)
                out[f"{name}_tok"] = np.where(running > 0, weighted / running, np.nan)
            masked = np.where(reach, per_state, -np.inf)
            peak = masked.max(axis=1)
            out[f"{name}_max"] = np.where(reach.any(axis=1), peak, np.nan)
        out["running"] = running
        return out

    def divergences_tok(self, mu) -> dict[str, float]:
        """Token-level χ², KL, TV averaged over every token μ emits: Σ_{t,s} d^μ_t(s) D_t(s) /
        E_μ|y| (the per-token divergence a token drawn uniformly from μ's output meets)."""
        mu = self.check_policy(mu)
        d = self.occupancy(mu)
        total = d.sum()
        out = {}
        for name, per_class in self._per_class(mu).items():
            per_state = per_class[:, self.policy_index]
            with np.errstate(invalid="ignore"):
                out[f"{name}_tok"] = float(np.where(d > 0, d * per_state, 0.0).sum() / total)
        return out

    def _log1p_chi2_seq(self, mu) -> float:
        """log E_μ[W²] = log Σ_y π(y)²/μ(y) by the transfer-matrix DP with kernel π²/μ."""
        has_zero = not np.all(mu > 0)

        def kernel(t):
            p, q = self._step_probs(self.pi, t), self._step_probs(mu, t)
            with np.errstate(divide="ignore"):
                return p * p / q  # inf where μ = 0 (π > 0 everywhere)

        _, final, log_scale = self._forward(kernel, normalise=True, has_inf=has_zero)
        total = final.sum()
        return math.inf if not np.isfinite(total) else math.log(total) + log_scale

    def chi2_seq(self, mu) -> float:
        """χ²_seq = E_μ[W²] − 1 with W = π(y)/μ(y), exact (inf if μ misses π's support).

        E_μ[W²] = Σ_y π(y)²/μ(y) factorises over tokens, so it is the total mass of the
        transfer-matrix recursion with per-token kernel π_t(v|s)²/μ_t(v|s) (:meth:`_forward`),
        rescaled each step (log-space total). For a state-independent fixed-length policy it
        reduces to 1 + χ²_seq = Π_t (1 + χ²_t) (reference sheet §F).
        """
        mu = self.check_policy(mu)
        log_m = self._log1p_chi2_seq(mu)
        with np.errstate(over="ignore"):
            return float(max(math.expm1(log_m), 0.0)) if log_m < 709 else math.inf

    def kl_seq(self, mu) -> float:
        """KL(π_seq ‖ μ_seq) = Σ_{t,s} d^π_t(s)·KL(π_t(·|s) ‖ μ_t(·|s)) (chain rule of the KL over
        positions, Cover & Thomas Thm 2.5.3; the state is a function of the prefix)."""
        mu = self.check_policy(mu)
        d = self.occupancy()
        per_state = _by_position(divergence.kl, self.pi, mu)[:, self.policy_index]
        with np.errstate(invalid="ignore"):
            return float(np.where(d > 0, d * per_state, 0.0).sum())

    def bc_seq(self, mu) -> float:
        """Bhattacharyya coefficient Σ_y √(π(y) μ(y)) by the transfer-matrix DP (kernel √(πμ))."""
        mu = self.check_policy(mu)
        k_all = np.sqrt(self.pi * mu)
        _, final, log_scale = self._forward(lambda t: k_all[t][self.policy_index], normalise=True)
        return float(min(final.sum() * math.exp(log_scale), 1.0))

    def tv_seq(self, mu, budget: int = SUPPORT_BUDGET) -> float:
        """TV(π_seq, μ_seq) = ½ Σ_y |π(y) − μ(y)| by enumeration of every sequence (exact), NaN
        when there are more than ``budget`` sequences (then use :meth:`tv_seq_bounds`)."""
        mu = self.check_policy(mu)
        if not self.enumerable(budget):
            return math.nan
        seqs = self._enumerate(budget)
        log_pi = self._sequence_log_prob(self.pi, seqs)
        log_mu = self._sequence_log_prob(mu, seqs)
        return float(0.5 * np.abs(np.exp(log_pi) - np.exp(log_mu)).sum())

    def tv_seq_bounds(self, mu) -> tuple[float, float]:
        """Bounds (lo, hi) on TV_seq valid for any automaton (all terms exact DPs).

        lower: H²_seq = 1 − BC_seq ≤ TV (Le Cam 1973); data processing: TV of the law of the
        final automaton state, of the length, and of the first token (functions of y).
        upper: √(1 − BC_seq²) (Le Cam), √(KL_seq/2) (Pinsker), √(1 − e^{−KL_seq})
        (Bretagnolle–Huber 1979), √(1 − 1/(1 + χ²_seq)), and the coupling bound
        Σ_{t,s} d^π_t(s)·TV_t(s) (couple the two policies token by token; the sequences differ
        only if some step does: Lindvall, Lectures on the coupling method §I.2). When the policy
        is state independent with a fixed length the product bounds of
        :func:`simkit.divergence.tv_seq_bounds` are intersected too.
        """
        mu = self.check_policy(mu)
        bc = self.bc_seq(mu)
        kl = self.kl_seq(mu)
        log1p_chi2 = self._log1p_chi2_seq(mu)
        lo = max(
            1.0 - bc,
            float(divergence.tv(self.final_state_distribution(), self.final_state_distribution(mu)))
            if self.S > 1
            else 0.0,
            0.5 * float(np.abs(self.length_distribution() - self.length_distribution(mu)).sum()),
            float(
                divergence.tv(
                    self.pi[0, self.policy_index[self.initial_state]],
                    mu[0, self.policy_index[self.initial_state]],
                )
            ),
        )
        d = self.occupancy()
        tv_state = _by_position(divergence.tv, self.pi, mu)[:, self.policy_index]
        coupling = float((d * tv_state).sum())
        hi = min(
            1.0,
            math.sqrt(max(1.0 - bc**2, 0.0)),
            math.sqrt(0.5 * kl),
            math.sqrt(-math.expm1(-kl)),
            math.sqrt(-math.expm1(-log1p_chi2)),
            coupling,
        )
        if self.fixed_length and self._state_independent(mu):
            idx = self.policy_index[self.initial_state]
            lo_p, hi_p = divergence.tv_seq_bounds(
                divergence.tv(self.pi[:, idx], mu[:, idx]),
                hellinger_tok=divergence.hellinger(self.pi[:, idx], mu[:, idx]),
            )
            lo, hi = max(lo, float(lo_p)), min(hi, float(hi_p))
        return lo, max(hi, lo)

    def _state_independent(self, mu) -> bool:
        """True iff π and μ at each position do not depend on the automaton state."""
        first_pi = self.pi[:, self.policy_index[:1]]
        first_mu = mu[:, self.policy_index[:1]]
        return bool(
            np.array_equal(
                self.pi[:, self.policy_index], np.broadcast_to(first_pi, (self.T, self.S, self.V))
            )
            and np.array_equal(
                mu[:, self.policy_index], np.broadcast_to(first_mu, (self.T, self.S, self.V))
            )
        )

    def divergences(self, mu) -> dict[str, float]:
        """``chi2_tok``, ``kl_tok``, ``tv_tok`` (:meth:`divergences_tok`), ``chi2_seq``,
        ``kl_seq`` and ``tv_seq`` (exact by enumeration when there are at most
        :data:`SUPPORT_BUDGET` sequences, else NaN: see :meth:`tv_seq_bounds`)."""
        mu = self.check_policy(mu)
        return {
            **self.divergences_tok(mu),
            "chi2_seq": self.chi2_seq(mu),
            "kl_seq": self.kl_seq(mu),
            "tv_seq": self.tv_seq(mu),
        }

    # --- automaton runs, enumeration, exact support -----------------------------------------

    def states_of(self, actions) -> np.ndarray:
        """Automaton state at which each token is emitted: s_0 = initial_state,
        s_{t+1} = transition[s_t, y_t]. ``actions`` (…, T') int with T' ≤ T; returns (…, T').
        Positions after an EOS get the states the automaton would reach reading the padding
        (they are masked everywhere)."""
        y = np.asarray(actions)
        if y.ndim < 1 or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"actions must be an integer array (..., T), got {y.dtype}{y.shape}")
        if y.shape[-1] > self.T:
            raise ValueError(f"actions have {y.shape[-1]} positions, more than T = {self.T}")
        if y.size and (y.min() < 0 or y.max() >= self.V):
            raise ValueError(
                f"actions must be tokens in [0, V) = [0, {self.V}), got min {y.min()}, "
                f"max {y.max()}"
            )
        states = np.empty(y.shape, dtype=np.int64)
        s = np.full(y.shape[:-1], self.initial_state, dtype=np.int64)
        for t in range(y.shape[-1]):
            states[..., t] = s
            s = self.transition[s, y[..., t]]
        return states

    def _enumerate(self, budget: int = SUPPORT_BUDGET):
        """Every sequence: ``(actions (M, T), mask (M, T), states (M, T), final (M,))``.

        Breadth first over positions; a sequence ends at its first EOS or at length T. Raises
        ``ValueError`` with the count when there are more than ``budget`` sequences.
        """
        budget = _positive_int(budget, "budget")
        count = self.n_sequences
        if count > budget:
            raise ValueError(
                f"exact enumeration needs {count} sequences (V = {self.V}, T = {self.T}"
                f"{', with EOS' if self.eos is not None else ''}), more than the budget of "
                f"{budget}; use Monte Carlo or a smaller environment (or raise budget)"
            )
        T, V = self.T, self.V
        tokens = np.arange(V)
        acts = np.zeros((1, 0), dtype=np.int64)
        hist = np.zeros((1, 0), dtype=np.int64)
        state = np.array([self.initial_state], dtype=np.int64)
        done: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for t in range(T):
            K = state.shape[0]
            new_tok = np.tile(tokens, K)
            acts = np.concatenate([np.repeat(acts, V, axis=0), new_tok[:, None]], axis=1)
            hist = np.concatenate([np.repeat(hist, V, axis=0), np.repeat(state, V)[:, None]], 1)
            state = self.transition[np.repeat(state, V), new_tok]
            if t == T - 1:
                done.append((acts, hist, state))
                break
            if self.eos is not None:
                end = new_tok == self.eos
                done.append((acts[end], hist[end], state[end]))
                acts, hist, state = acts[~end], hist[~end], state[~end]
        actions = np.zeros((count, T), dtype=np.int64)
        states = np.zeros((count, T), dtype=np.int64)
        mask = np.zeros((count, T), dtype=bool)
        final = np.empty(count, dtype=np.int64)
        row = 0
        for a, h, f in done:
            m, L = a.shape
            actions[row : row + m, :L] = a
            states[row : row + m, :L] = h
            mask[row : row + m, :L] = True
            final[row : row + m] = f
            row += m
        return actions, mask, states, final

    def _sequence_log_prob(self, policy: np.ndarray, seqs) -> np.ndarray:
        """Σ_t log policy(y_t | t, s_t) over valid tokens for enumerated ``seqs``: (M,)."""
        return self._token_log_prob(policy, seqs[0], seqs[1], seqs[2]).sum(axis=1)

    def _token_log_prob(self, policy, actions, mask, states) -> np.ndarray:
        """log policy(y_t | t, s_t) per token (M, T), 0 on padding (−inf where it is 0)."""
        t_idx = np.broadcast_to(np.arange(self.T), actions.shape)
        p = policy[t_idx, self.policy_index[states], actions]
        return np.where(mask, _safe_log(p), 0.0)

    def support(self, mu, baseline: float = 0.0, budget: int = SUPPORT_BUDGET) -> TokenSupport:
        """Every sequence of positive μ-probability with A = R − ``baseline`` (exact path).

        Enumerates all :attr:`n_sequences` sequences (``ValueError`` naming the count and the
        budget beyond ``budget``) and keeps those with μ(y) > 0. Returns a
        :class:`TokenSupport`; with it :func:`simkit.experiment.exact_moments` computes the
        exact mean and variance of any per-sample estimator.
        """
        mu = self.check_policy(mu)
        b = float(baseline)
        if not math.isfinite(b):
            raise ValueError(f"baseline must be finite, got {baseline}")
        actions, mask, states, final = self._enumerate(budget)
        log_mu_tok = self._token_log_prob(mu, actions, mask, states)
        prob = np.exp(log_mu_tok.sum(axis=1))
        keep = prob > 0
        actions, mask, states, final = actions[keep], mask[keep], states[keep], final[keep]
        log_pi_tok = self._token_log_prob(self.pi, actions, mask, states)
        log_ratio = np.where(mask, log_pi_tok - log_mu_tok[keep], 0.0)
        rewards = self.reward[final]
        adv = rewards - b
        prob = prob[keep]
        states = np.where(mask, states, 0)
        return TokenSupport(
            actions=actions,
            mask=mask,
            states=states,
            prob=prob,
            rewards=rewards,
            log_ratio=log_ratio,
            positive=adv >= 0,
            adv_first=prob * adv,
            adv_second=prob * adv**2,
        )

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

    # --- constructors -----------------------------------------------------------------------

    @classmethod
    def _build(
        cls, *, V, T, P, transition, policy_index, reward, eos, logits, seed, scale, stationary
    ) -> TokenMDP:
        V = _positive_int(V, "V")
        T = _positive_int(T, "T")
        check_token_mdp(T, P, V, S=len(transition))  # before any (T, P, V) array is allocated
        if logits is None:
            if not (isinstance(scale, int | float) and math.isfinite(scale) and scale >= 0):
                raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
            rng = np.random.default_rng(check_seed(seed))
            shape = (1, P, V) if stationary else (T, P, V)
            logits = scale * rng.standard_normal(shape)
        logits = np.asarray(logits, dtype=np.float64)
        if logits.ndim == 1:
            logits = logits[None, None, :]
        elif logits.ndim == 2:
            logits = logits[None]
        if logits.ndim != 3 or logits.shape[-1] != V or logits.shape[1] not in (1, P):
            raise ValueError(
                f"logits must have shape (V,), (P, V) or (T, P, V) with V = {V}, P = {P}, "
                f"T = {T}; got {np.shape(logits)}"
            )
        if logits.shape[0] not in (1, T):
            raise ValueError(f"logits has {logits.shape[0]} positions, expected 1 or T = {T}")
        logits = np.broadcast_to(logits, (T, P, V))
        if eos is not None:
            eos = _check_index(eos, "eos", V, "a token")
            transition = np.array(transition)
            transition[:, eos] = np.arange(transition.shape[0])  # EOS does not move the automaton
        return cls(logits, transition, policy_index, reward, eos=eos)

    @classmethod
    def iid(
        cls,
        V: int,
        T: int,
        answer: int = 0,
        eos: int | None = None,
        logits=None,
        seed: int = 0,
        scale: float = 1.0,
        stationary: bool = True,
    ) -> TokenMDP:
        """Independent tokens: one policy class (P = 1), π(·|t) = softmax(logits[t, 0]).

        The automaton only records whether the ``answer`` token has appeared (S = 2: not yet /
        seen); R = 1 iff it appeared at least once. Random logits ``scale``·N(0, 1) from
        ``seed`` (shared by every position when ``stationary``) unless ``logits`` (V,), (1, V) or
        (T, 1, V) are given. With ``eos`` the EOS token ends the sequence.
        """
        V = _positive_int(V, "V")
        answer = _check_index(answer, "answer", V, "a token")
        if eos is not None and answer == eos:
            raise ValueError(f"answer must differ from eos (both {eos})")
        transition = np.zeros((2, V), dtype=np.int64)
        transition[0, answer] = 1
        transition[1, :] = 1
        return cls._build(
            V=V,
            T=T,
            P=1,
            transition=transition,
            policy_index=[0, 0],
            reward=[0.0, 1.0],
            eos=eos,
            logits=logits,
            seed=seed,
            scale=scale,
            stationary=stationary,
        )

    @classmethod
    def markov(
        cls,
        V: int,
        T: int,
        target: int = 0,
        eos: int | None = None,
        logits=None,
        seed: int = 0,
        scale: float = 1.0,
        stationary: bool = True,
    ) -> TokenMDP:
        """First-order Markov policy: the policy class is the previous token.

        S = V + 1 automaton states (0 = start, 1 + v = last token v), P = S,
        π(·|t, s) = softmax(logits[t, s]); R = 1 iff the last token (before EOS) is ``target``.
        Logits (V + 1, V) or (T, V + 1, V), or random as in :meth:`iid`.
        """
        V = _positive_int(V, "V")
        target = _check_index(target, "target", V, "a token")
        if eos is not None and target == eos:
            raise ValueError(f"target must differ from eos (both {eos})")
        S = V + 1
        transition = np.broadcast_to(1 + np.arange(V), (S, V))
        reward = np.zeros(S)
        reward[1 + target] = 1.0
        return cls._build(
            V=V,
            T=T,
            P=S,
            transition=transition,
            policy_index=np.arange(S),
            reward=reward,
            eos=eos,
            logits=logits,
            seed=seed,
            scale=scale,
            stationary=stationary,
        )

    @classmethod
    def answer_correct(
        cls,
        V: int,
        T: int,
        answer: int = 0,
        eos: int | None = None,
        logits=None,
        seed: int = 0,
        scale: float = 1.0,
        stationary: bool = True,
    ) -> TokenMDP:
        """ "The final answer is correct": R = 1 iff the last token (before EOS) is ``answer``.

        S = 3 automaton states (0 = nothing yet, 1 = last token correct, 2 = last token
        wrong), each its own policy class (P = 3).
        """
        V = _positive_int(V, "V")
        answer = _check_index(answer, "answer", V, "a token")
        if eos is not None and answer == eos:
            raise ValueError(f"answer must differ from eos (both {eos})")
        transition = np.full((3, V), 2, dtype=np.int64)
        transition[:, answer] = 1
        return cls._build(
            V=V,
            T=T,
            P=3,
            transition=transition,
            policy_index=np.arange(3),
            reward=[0.0, 1.0, 0.0],
            eos=eos,
            logits=logits,
            seed=seed,
            scale=scale,
            stationary=stationary,
        )

    @classmethod
    def at_least_k(
        cls,
        V: int,
        T: int,
        k: int,
        hit: int = 0,
        eos: int | None = None,
        logits=None,
        seed: int = 0,
        scale: float = 1.0,
        stationary: bool = True,
    ) -> TokenMDP:
        """R = 1 iff the ``hit`` token occurs at least ``k`` times (1 ≤ k ≤ T).

        S = k + 1 automaton states counting hits (saturating at k), each its own policy class.
        """
        V = _positive_int(V, "V")
        T = _positive_int(T, "T")
        k = _positive_int(k, "k")
        if k > T:
            raise ValueError(f"k must be <= T = {T} (otherwise R = 0 always), got {k}")
        hit = _check_index(hit, "hit", V, "a token")
        if eos is not None and hit == eos:
            raise ValueError(f"hit must differ from eos (both {eos})")
        S = k + 1
        transition = np.repeat(np.arange(S)[:, None], V, axis=1)
        transition[:, hit] = np.minimum(np.arange(S) + 1, k)
        reward = np.zeros(S)
        reward[k] = 1.0
        return cls._build(
            V=V,
            T=T,
            P=S,
            transition=transition,
            policy_index=np.arange(S),
            reward=reward,
            eos=eos,
            logits=logits,
            seed=seed,
            scale=scale,
            stationary=stationary,
        )

    @classmethod
    def parity(
        cls,
        V: int,
        T: int,
        marked=None,
        eos: int | None = None,
        logits=None,
        seed: int = 0,
        scale: float = 1.0,
        stationary: bool = True,
    ) -> TokenMDP:
        """R = 1 iff an odd number of ``marked`` tokens is emitted (default: odd token ids).

        S = 2 automaton states (parity so far), each its own policy class.
        """
        V = _positive_int(V, "V")
        marked_ids = np.arange(1, V, 2) if marked is None else np.asarray(marked, dtype=np.int64)
        if marked_ids.ndim != 1 or np.any((marked_ids < 0) | (marked_ids >= V)):
            raise ValueError(f"marked must be a list of tokens in [0, V) = [0, {V})")
        if eos is not None and eos in set(marked_ids.tolist()):
            raise ValueError(f"eos = {eos} cannot be a marked token")
        transition = np.repeat(np.arange(2)[:, None], V, axis=1)
        transition[:, marked_ids] = 1 - np.arange(2)[:, None]
        return cls._build(
            V=V,
            T=T,
            P=2,
            transition=transition,
            policy_index=np.arange(2),
            reward=[0.0, 1.0],
            eos=eos,
            logits=logits,
            seed=seed,
            scale=scale,
            stationary=stationary,
        )


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
    b = ``baseline``, r_t = π/μ at (t, s_t, y_t), y ~ μ. Aggregations (reference sheet §D)
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
    b = float(baseline)
    if not math.isfinite(b):
        raise ValueError(f"baseline must be finite, got {baseline}")
    if aggregation not in TOKEN_LEVEL_AGGREGATIONS:
        raise ValueError(
            f"aggregation must be one of {TOKEN_LEVEL_AGGREGATIONS} (a deterministic Z), got "
            f"{aggregation!r}"
        )
    if max_length is not None and aggregation != "seq-mean-token-sum-norm":
        raise ValueError("max_length applies to aggregation 'seq-mean-token-sum-norm' only")
    if aggregation == "token-mean":
        if not env.fixed_length:
            raise ValueError(
                "aggregation 'token-mean' has a random Z = total tokens when lengths vary "
                "(eos is set): its mean is not a per-sample quantity"
            )
        inv_z = 1.0 / env.T
    elif aggregation == "seq-mean-token-sum-norm":
        inv_z = 1.0 / (env.T if max_length is None else _positive_int(max_length, "max_length"))
    else:
        inv_z = 1.0
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
