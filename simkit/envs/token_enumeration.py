"""Exact support of a token MDP by enumeration: every sequence with its oracle quantities.

:class:`TokenMDPEnumeration` is a mixin of :class:`~simkit.envs.token_mdp.TokenMDP` (it uses
the automaton ``transition``, ``policy_index``, ``reward``, ``eos``, ``initial_state`` and the
policy ``pi`` of the class): the number of sequences, the automaton run of a batch of token
sequences (``states_of``), the enumeration of every sequence breadth first over positions, and
:meth:`~TokenMDPEnumeration.support` (the atoms of :func:`simkit.experiment.exact_moments`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simkit.envs._checks import positive_int, safe_log

#: default largest number of sequences :meth:`TokenMDP.support` enumerates
SUPPORT_BUDGET = 2**20


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


class TokenMDPEnumeration:
    """Enumeration and exact support of a :class:`~simkit.envs.token_mdp.TokenMDP` (mixin)."""

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
        budget = positive_int(budget, "budget")
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
        return np.where(mask, safe_log(p), 0.0)

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
