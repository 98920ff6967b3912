"""Divergences between a token MDP's π and a behaviour μ, per token and per sequence, exact.

:class:`TokenMDPDivergences` is a mixin of :class:`~simkit.envs.token_mdp.TokenMDP`: per-token
χ², KL and TV averaged over μ's occupancy (``divergences_tok``, ``divergence_profile``), and the
sequence-level χ²_seq (transfer-matrix DP with kernel π²/μ), KL_seq (chain rule), the
Bhattacharyya coefficient (kernel √(πμ)), TV_seq (by enumeration) and bounds on TV_seq valid
for any automaton (``tv_seq_bounds``). Every DP runs through the class's ``_forward``.
"""

from __future__ import annotations

import math

import numpy as np

from simkit import divergence
from simkit.envs.token_enumeration import SUPPORT_BUDGET

#: values per block of :func:`_by_position` (keeps the divergences' temporaries in cache)
_BLOCK_VALUES = 1 << 16


def _by_position(fn, pi: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """``fn(pi, mu)`` (a :mod:`simkit.divergence` function) on (T, P, V) arrays, (T, P), computed
    over blocks of positions: the same numbers, without (T, P, V)-sized temporaries."""
    T, P, V = pi.shape
    rows = max(1, _BLOCK_VALUES // (P * V))
    return np.concatenate([fn(pi[t : t + rows], mu[t : t + rows]) for t in range(0, T, rows)])


class TokenMDPDivergences:
    """Divergences of a :class:`~simkit.envs.token_mdp.TokenMDP`'s π from μ (mixin)."""

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
        reduces to 1 + χ²_seq = Π_t (1 + χ²_t) (notation page §F).
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
