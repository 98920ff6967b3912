"""A finite set of sequences with exact probabilities and score vectors: an environment for
:func:`simkit.experiment.run` built from an enumerated language-model tree.

:func:`simkit.lm.exact.tree` enumerates every response of a top-k-truncated LM π_k (Holtzman
et al. 2020 call the truncation "top-k sampling"); each response y (a *leaf*) has

- per-token log-probabilities log π_k(y_t | x, y_<t) and log μ_k(y_t | x, y_<t) (μ_k: the
  behaviour restricted to π's top-k support and renormalised),
- a deterministic reward R(y) (the task's checker),
- per-token score vectors S_t = ∇θ log π_k(y_t | x, y_<t) for a parameter subset θ.

Responses share prefixes, so a score vector belongs to an *edge* of the tree (a node and one
of its k children): leaf l's token t has edge id ``edges[l, t]`` and score ``scores[edge]``
(``scores`` (E + 1, D), the last row zero for padding after EOS). :class:`LeafEnv` exposes the
interface of :class:`simkit.envs.TokenMDP` that :func:`simkit.experiment.run` and
:func:`simkit.experiment.exact_moments` use (``check_policy``, ``support``, ``sample``,
``accumulate``, ``score_norms_sq``, ``J``, ``grad_J``, ``divergences``), so every per-sample
estimator gets its exact mean and variance by enumeration of the leaves, and batch-dependent
ones are run by Monte Carlo over exact leaf draws.

With several prompts (drawn uniformly, as the LM studies do) the leaves of every prompt's tree
are concatenated with a prompt weight w = 1/P: π(x, y) = w·Π_t π_k(y_t|…), likewise μ; the
per-token ratios do not involve w.

Exact quantities (sums over leaves, float64): J = Σ_l π_l R_l;
∇J = Σ_l π_l (R_l − J) Σ_t S_{l,t} (the −J term is 0 in exact arithmetic: Σ π ∇log π = 0,
kept for rounding); χ²_seq = Σ π²/μ − 1, KL_seq = Σ π log(π/μ), TV_seq = ½ Σ|π − μ|; per-token
divergences are exact over the k-token support at every node, averaged over μ's visits
(node weights μ(reach node)/E_μ|y|).

numpy only (no torch): the tree is built by :mod:`simkit.lm.exact`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from simkit.envs.token_mdp import TokenSupport

#: values of one chunk of gathered (rows, T, D) score vectors in :meth:`LeafEnv.score_norms_sq`
_CHUNK_VALUES = 1 << 22
POLICIES = ("pi", "mu")


@dataclass(frozen=True)
class LeafBatch:
    """Leaves drawn from a policy (shapes (reps, n, T) or (n, T)); the fields
    :func:`simkit.experiment.run` reads: ``actions`` = edge ids (padding: the zero row),
    ``mask``, ``log_ratio`` = log π_k − log μ_k per token, ``rewards``, ``lengths``,
    ``leaves`` (the drawn leaf indices), ``J`` the exact J(π_k), ``J_mu`` the exact J(μ_k) (the
    ``oracle`` advantage's baseline); ``states`` is None."""

    actions: np.ndarray
    mask: np.ndarray
    rewards: np.ndarray
    log_ratio: np.ndarray
    lengths: np.ndarray
    leaves: np.ndarray
    J: float
    J_mu: float
    states: None = None


@dataclass(frozen=True, eq=False)
class LeafEnv:
    """The leaves of one or several enumerated trees (module docstring).

    ``edges`` (L, T) int: edge id of each token (E = the padding row after EOS); ``mask``
    (L, T) bool; ``log_pi_tok``, ``log_mu_tok`` (L, T) float64 (0 on padding); ``weight`` (L,)
    the prompt probability of each leaf; ``rewards`` (L,); ``scores`` (E + 1, D) float64 with
    a zero last row; ``node_weight_mu`` (N,) μ's probability of reaching each internal node
    (prompt weight included) and ``node_divergences`` name → (N,) exact χ², KL, TV between
    π_k and μ_k over the node's support.
    """

    edges: np.ndarray
    mask: np.ndarray
    log_pi_tok: np.ndarray
    log_mu_tok: np.ndarray
    weight: np.ndarray
    rewards: np.ndarray
    scores: np.ndarray = field(repr=False)
    node_weight_mu: np.ndarray = field(repr=False)
    node_divergences: dict = field(repr=False)

    def __post_init__(self):
        L, T = self.mask.shape
        for name in ("edges", "log_pi_tok", "log_mu_tok"):
            if getattr(self, name).shape != (L, T):
                raise ValueError(
                    f"{name} must have shape {(L, T)}, got {getattr(self, name).shape}"
                )
        for name in ("weight", "rewards"):
            if getattr(self, name).shape != (L,):
                raise ValueError(f"{name} must have shape ({L},), got {getattr(self, name).shape}")
        if self.scores.ndim != 2 or np.any(self.scores[-1] != 0):
            raise ValueError("scores must be (E + 1, D) with a zero last row (padding)")
        if self.edges.min() < 0 or self.edges.max() >= self.scores.shape[0]:
            raise ValueError("edges must index rows of scores")
        if not np.all(np.isfinite(self.rewards)):
            raise ValueError("rewards must be finite")

    # --- shape ------------------------------------------------------------------------------

    @property
    def T(self) -> int:
        return int(self.mask.shape[1])

    @property
    def D(self) -> int:
        return int(self.scores.shape[1])

    @property
    def n_sequences(self) -> int:
        return int(self.mask.shape[0])

    @property
    def fixed_length(self) -> bool:
        return bool(self.mask.all())

    def enumerable(self, budget: int | None = None) -> bool:
        """Always True: the leaves are the enumeration."""
        return True

    # --- policies ---------------------------------------------------------------------------

    def check_policy(self, p, name: str = "behaviour") -> str:
        """``"pi"`` (π_k) or ``"mu"`` (μ_k): the only two policies of a tree (None is π)."""
        if p is None:
            return "pi"
        if isinstance(p, str) and p in POLICIES:
            return p
        raise ValueError(f"{name} of a leaf environment must be one of {POLICIES}, got {p!r}")

    def token_log_prob(self, policy) -> np.ndarray:
        """(L, T) per-token log-probabilities of ``policy`` (0 on padding)."""
        return self.log_pi_tok if self.check_policy(policy) == "pi" else self.log_mu_tok

    def prob(self, policy=None) -> np.ndarray:
        """(L,) probability of each leaf under ``policy`` (prompt weight included)."""
        return self.weight * np.exp(self.token_log_prob(policy).sum(axis=1))

    def J(self, policy=None) -> float:
        return float(self.prob(policy) @ self.rewards)

    def grad_J(self) -> np.ndarray:
        """∇J = Σ_l π_l (R_l − J) Σ_t S_{l,t} (module docstring), (D,)."""
        adv = self.prob("pi") * (self.rewards - self.J())
        return self.accumulate(self.edges, np.where(self.mask, adv[:, None], 0.0))

    def log_ratio(self, mu="mu") -> np.ndarray:
        return np.where(self.mask, self.log_pi_tok - self.token_log_prob(mu), 0.0)

    def target_token_log_prob(self, actions, mask, states=None) -> np.ndarray:
        """log π of the tokens of a batch or support given by their edge ids ``actions``
        (shape of ``mask``, 0 on padding): every edge is one (node, token), so its log π is
        the ``log_pi_tok`` of any leaf through it (:func:`simkit.legs.target_log_prob`)."""
        table = np.zeros(int(self.edges.max(initial=0)) + 1)
        table[self.edges[self.mask]] = self.log_pi_tok[self.mask]
        m = np.asarray(mask, dtype=bool)
        return np.where(m, table[np.asarray(actions)], 0.0)

    # --- exact path -------------------------------------------------------------------------

    def support(self, mu, baseline: float = 0.0, budget: int | None = None) -> TokenSupport:
        """Every leaf of positive μ-probability with A = R − ``baseline`` (exact path)."""
        mu = self.check_policy(mu)
        b = float(baseline)
        if not math.isfinite(b):
            raise ValueError(f"baseline must be finite, got {baseline}")
        prob = self.prob(mu)
        keep = prob > 0
        adv = self.rewards[keep] - b
        p = prob[keep]
        return TokenSupport(
            actions=self.edges[keep],
            mask=self.mask[keep],
            states=np.zeros(self.edges[keep].shape, dtype=np.int64),
            prob=p,
            rewards=self.rewards[keep],
            log_ratio=self.log_ratio(mu)[keep],
            positive=adv >= 0,
            adv_first=p * adv,
            adv_second=p * adv**2,
        )

    def sample(self, mu, n: int, rng: np.random.Generator, reps: int | None = None) -> LeafBatch:
        """``reps`` batches (or one) of ``n`` leaves drawn i.i.d. from μ (inverse CDF)."""
        mu = self.check_policy(mu)
        prob = self.prob(mu)
        cdf = np.cumsum(prob)
        shape = (n,) if reps is None else (reps, n)
        u = rng.random(shape) * cdf[-1]
        leaves = np.minimum(np.searchsorted(cdf, u, side="right"), len(prob) - 1)
        mask = self.mask[leaves]
        return LeafBatch(
            actions=self.edges[leaves],
            mask=mask,
            rewards=self.rewards[leaves],
            log_ratio=self.log_ratio(mu)[leaves],
            lengths=mask.sum(axis=-1),
            leaves=leaves,
            J=self.J(),
            J_mu=self.J(mu),
        )

    def accumulate(self, actions, token_weights, states=None) -> np.ndarray:
        """Σ_{i,t} λ_{i,t} S[actions_{i,t}] per batch: (L..., D) for (L..., n, T) inputs
        ((D,) for (M, T) inputs: one batch). The weights are summed per edge first
        (``bincount``), then one matrix product with the edge scores."""
        a = np.asarray(actions)
        lam = np.asarray(token_weights, dtype=np.float64)
        if a.shape != lam.shape or a.ndim < 2:
            raise ValueError(
                f"actions and token_weights must share a shape (..., n, T), got {a.shape} and "
                f"{lam.shape}"
            )
        lead = a.shape[:-2]
        E1 = self.scores.shape[0]
        a2 = a.reshape(-1, a.shape[-2] * a.shape[-1])
        l2 = lam.reshape(a2.shape)
        per_edge = np.zeros((a2.shape[0], E1))
        for b in range(a2.shape[0]):
            per_edge[b] = np.bincount(a2[b], weights=l2[b], minlength=E1)
        per_edge[:, -1] = 0.0
        out = per_edge @ self.scores
        return out.reshape(*lead, self.D)

    def score_norms_sq(self, actions, token_weights, states=None) -> np.ndarray:
        """‖Σ_t λ_t S[actions_t]‖² per row, (…,) for (…, T) inputs (chunked gathers)."""
        a = np.asarray(actions)
        lam = np.asarray(token_weights, dtype=np.float64)
        if a.shape != lam.shape or a.shape[-1] != self.T:
            raise ValueError(f"actions and token_weights must be (..., {self.T}), got {a.shape}")
        flat_a = a.reshape(-1, self.T)
        flat_l = lam.reshape(-1, self.T)
        out = np.empty(flat_a.shape[0])
        rows = max(1, _CHUNK_VALUES // max(self.T * self.D, 1))
        for s in range(0, flat_a.shape[0], rows):
            vec = np.einsum("mt,mtd->md", flat_l[s : s + rows], self.scores[flat_a[s : s + rows]])
            out[s : s + rows] = np.sum(vec * vec, axis=1)
        return out.reshape(a.shape[:-1])

    # --- divergences ------------------------------------------------------------------------

    def divergences(self, mu="mu") -> dict[str, float]:
        """Exact ``chi2_tok``/``kl_tok``/``tv_tok`` (node divergences over the support, averaged
        over μ's visits) and ``chi2_seq``/``kl_seq``/``tv_seq`` over the leaves."""
        mu = self.check_policy(mu)
        if mu == "pi":
            return {
                k: 0.0 for k in ("chi2_tok", "kl_tok", "tv_tok", "chi2_seq", "kl_seq", "tv_seq")
            }
        w = self.node_weight_mu
        out = {
            f"{k}_tok": float(w @ self.node_divergences[k] / w.sum()) for k in ("chi2", "kl", "tv")
        }
        p, q = self.prob("pi"), self.prob("mu")
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out["chi2_seq"] = float(np.sum(np.where(p > 0, p * p / q, 0.0)) - 1.0)
            out["kl_seq"] = float(np.sum(np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)))
        out["tv_seq"] = float(0.5 * np.abs(p - q).sum())
        return out
