"""Policy parameterisations: how the trainer's parameters θ become the logits of a token MDP.

Every exact quantity of :class:`~simkit.envs.TokenMDP` (J, ∇J, occupancies, divergences) is a
function of the logits table L of shape (T, P, V). A parameterisation is a fixed **affine** map

    L(θ) = L₀ + A·θ      (tabular: L(θ) = θ)

so that J(θ) = J_tab(L(θ)) stays exact (the DP over the induced per-state distributions) and
the chain rule gives ∇θ J = Aᵀ ∇_L J_tab exactly; an estimator's ĝ (accumulated in logit space
by :func:`simkit.envs.accumulate_tokens`) is pulled back the same way, ĝ_θ = Aᵀ ĝ_L. L₀ =
``env.logits`` and θ₀ = 0 (tabular: θ₀ = L₀), so every parameterisation starts from the
environment's policy π₀ and only the *geometry of the updates* differs:

``"tabular"``
    θ = L, shape (T, P, V), D = T·P·V: an update touches only the rows of the visited
    (position, state) pairs — no interference, no generalisation (the historical trainer, bit
    for bit).
``"tied"``
    θ of shape (P, V), L[t] = L₀[t] + θ for every position t (one table shared by all
    positions, as a transformer shares its weights over positions), D = P·V;
    ∂J/∂θ = Σ_t ∂J/∂L[t].
``"features"``
    low-rank embeddings: L[t, p, :] = L₀[t, p, :] + x(t, p)ᵀ W Eᵀ, θ = W of shape (m, r),
    D = d = m·r, with fixed random **context features** X ∈ ℝ^{(T·P)×m} (rows x(t, p),
    entries i.i.d. N(0, 1/m)) and **token embeddings** E ∈ ℝ^{V×r} (entries i.i.d. N(0, 1)),
    drawn from ``numpy.random.default_rng(feature_seed)`` (X first, then E). As a linear map
    L = L₀ + Φθ its feature of (t, p, v) is φ(t, p, v) = x(t, p) ⊗ e_v ∈ ℝ^d: a language model's
    frozen context representation times an unembedding, with the bilinear readout trained. An
    update on visited (t, p) moves every other context through the shared W (interference and
    generalisation), and the reachable policies are limited to logit offsets of rank ≤ min(m, r).
    ∂J/∂W = Xᵀ G E with G = ∂J/∂L reshaped (T·P, V). Cost O(T·P·(m·r + V·r)) per map.

:func:`parameterization` builds the map of an environment and a
:class:`~simkit.train.TrainConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PARAMETERIZATIONS", "Parameterization", "parameterization"]

#: the parameterisations of :class:`~simkit.train.TrainConfig` (module docstring)
PARAMETERIZATIONS = ("tabular", "tied", "features")


@dataclass(frozen=True, eq=False)
class Parameterization:
    """The affine map θ ↦ L(θ) of one environment (module docstring).

    ``kind`` one of :data:`PARAMETERIZATIONS`; ``base`` L₀ (T, P, V); ``context`` X (T·P, m)
    and ``tokens`` E (V, r) for ``"features"`` (None otherwise).
    """

    kind: str
    base: np.ndarray
    context: np.ndarray | None = None
    tokens: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of θ."""
        T, P, V = self.base.shape
        if self.kind == "tabular":
            return (T, P, V)
        if self.kind == "tied":
            return (P, V)
        return (self.context.shape[1], self.tokens.shape[1])

    @property
    def dim(self) -> int:
        """D, the number of parameters."""
        return int(np.prod(self.shape))

    def init(self) -> np.ndarray:
        """θ₀: L₀ (C order) for tabular, zeros otherwise, so that L(θ₀) = L₀."""
        if self.kind == "tabular":
            # C order: an env built by broadcasting has (T, P, V) logits laid out with T
            # fastest, and reductions over V then sum in another order than on a C-order copy
            return np.array(self.base, dtype=np.float64, order="C")
        return np.zeros(self.shape)

    def logits(self, theta: np.ndarray) -> np.ndarray:
        """L(θ), (T, P, V), C order."""
        if self.kind == "tabular":
            return theta
        if self.kind == "tied":
            return self.base + theta[None]
        T, P, V = self.base.shape
        delta = (self.context @ theta) @ self.tokens.T  # (T·P, V)
        return self.base + delta.reshape(T, P, V)

    def pullback(self, grad_logits: np.ndarray) -> np.ndarray:
        """Aᵀ g: a gradient w.r.t. the logits (D_L = T·P·V, flat or (T, P, V)) as a flat
        gradient w.r.t. θ (the chain rule; identity for tabular)."""
        if self.kind == "tabular":
            return grad_logits
        T, P, V = self.base.shape
        g = np.asarray(grad_logits).reshape(T, P, V)
        if self.kind == "tied":
            return g.sum(axis=0).ravel()
        return (self.context.T @ g.reshape(T * P, V) @ self.tokens).ravel()


def parameterization(
    base, kind: str = "tabular", features: int = 256, feature_rank: int = 16, feature_seed: int = 0
) -> Parameterization:
    """The map of logits L₀ = ``base`` (T, P, V) (module docstring). ``features`` = d and
    ``feature_rank`` = r (m = d / r context features) are used by ``"features"`` only."""
    if kind not in PARAMETERIZATIONS:
        raise ValueError(f"parameterization must be one of {PARAMETERIZATIONS}, got {kind!r}")
    base = np.array(base, dtype=np.float64, order="C")
    if base.ndim != 3:
        raise ValueError(f"logits must have shape (T, P, V), got shape {base.shape}")
    if kind != "features":
        return Parameterization(kind, base)
    if features % feature_rank:
        raise ValueError(
            f"features = {features} must be a multiple of feature_rank = {feature_rank} "
            "(d = m·r with m context features)"
        )
    T, P, V = base.shape
    m = features // feature_rank
    rng = np.random.default_rng(feature_seed)
    context = rng.standard_normal((T * P, m)) / np.sqrt(m)
    tokens = rng.standard_normal((V, feature_rank))
    return Parameterization(kind, base, context, tokens)
