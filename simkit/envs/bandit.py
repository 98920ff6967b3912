"""The T = 1 environment: a K-armed bandit with a softmax policy and oracle quantities.

The policy is π = softmax(θ) with θ = ``logits`` (the parameters the gradient is taken with
respect to, D = K), the reward of arm k is Bernoulli(m_k) or Normal(m_k, s_k²). Everything is
exact:

- J(π) = Σ_k π_k m_k and ∇θ J = π ⊙ (m − J) (softmax policy gradient theorem: ∂π_k/∂θ_j =
  π_k(δ_kj − π_j));
- ∇θ log π(y) = e_y − π, so a weighted sum of score functions is
  Σ_i λ_i (e_{y_i} − π) = bincount(y, λ) − π·Σ_i λ_i (:meth:`Bandit.accumulate`);
- the support of one draw under the behaviour μ is finite once the advantage is reduced to its
  sign (:meth:`Bandit.support`), which is what makes the exact path of
  :func:`simkit.experiment.run` exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from scipy.special import ndtr

from simkit import divergence
from simkit._validation import as_prob, positive_int
from simkit.envs._checks import readonly, safe_log

REWARD_KINDS = ("bernoulli", "gaussian")
_SQRT_2PI = math.sqrt(2.0 * math.pi)


@dataclass(frozen=True, eq=False)
class BanditBatch:
    """One or ``reps`` batches of ``n`` bandit draws y ~ μ, with the oracle quantities.

    Shapes (``L`` = ``()`` for one batch, ``(reps,)`` for vectorised draws):

    - ``actions`` (L..., n) int, ``rewards`` (L..., n) float;
    - ``log_ratio`` (L..., n, 1) = log π(y) − log μ(y), ``mask`` (L..., n, 1) all True (T = 1);
    - ``pi``, ``mu`` (K,), ``J`` scalar J(π), ``grad_J`` (K,) ∇θ J(π), ``J_mu`` scalar J(μ)
      (the baseline of the ``oracle`` advantage; NaN if the batch was built without it).
    """

    actions: np.ndarray
    rewards: np.ndarray
    log_ratio: np.ndarray
    mask: np.ndarray
    pi: np.ndarray
    mu: np.ndarray
    J: float
    grad_J: np.ndarray
    J_mu: float = math.nan

    @property
    def n(self) -> int:
        """Samples per batch."""
        return int(self.actions.shape[-1])

    @property
    def reps(self) -> int | None:
        """Number of independent batches (``None`` for a single unbatched draw)."""
        return int(self.actions.shape[0]) if self.actions.ndim == 2 else None

    @property
    def T(self) -> int:
        return 1


@dataclass(frozen=True, eq=False)
class BanditSupport:
    """The finite support of one draw (y, sign A) under μ, for the exact path.

    With the advantage A = R − b (``baseline`` b), an *atom* is an arm y together with the sign
    of A (``positive`` means A ≥ 0, the mapping convention). Only atoms of positive probability
    are kept. Shapes (M atoms):

    - ``actions`` (M,), ``positive`` (M,) bool;
    - ``prob`` (M,) = P_μ(atom) = μ_y·P(sign | y);
    - ``adv_first`` (M,) = E_μ[A·1{atom}], ``adv_second`` (M,) = E_μ[A²·1{atom}] (joint partial
      moments: they already include μ_y, so Σ ``adv_first`` = E_μ[A]);
    - ``log_ratio`` (M, 1) = log π(y) − log μ(y), ``mask`` (M, 1) all True;
    - ``advantage_sign`` (M,) = +1.0 / −1.0, a representative advantage to pass to a mapping
      (whose coefficient depends on A only through its sign).
    """

    actions: np.ndarray
    positive: np.ndarray
    prob: np.ndarray
    adv_first: np.ndarray
    adv_second: np.ndarray
    log_ratio: np.ndarray
    mask: np.ndarray

    @property
    def advantage_sign(self) -> np.ndarray:
        return np.where(self.positive, 1.0, -1.0)


@dataclass(frozen=True, eq=False)
class Bandit:
    """K-armed bandit, π = softmax(``logits``), rewards Bernoulli(``means``) or Gaussian.

    Parameters
    ----------
    logits : (K,) array
        The policy parameters θ (finite). The gradient dimension is D = K.
    means : (K,) array
        Reward means m_k; in [0, 1] for Bernoulli rewards.
    reward : ``"bernoulli"`` | ``"gaussian"``
        Reward distribution of each arm.
    reward_std : float or (K,) array, optional
        Standard deviations s_k of Gaussian rewards (> 0, default 1); must be left unset for
        Bernoulli rewards.
    """

    logits: np.ndarray
    means: np.ndarray
    reward: str = "bernoulli"
    reward_std: float | np.ndarray | None = None
    _pi: np.ndarray = field(init=False, repr=False)

    T: ClassVar[int] = 1

    def __post_init__(self):
        logits = np.asarray(self.logits, dtype=np.float64)
        if logits.ndim != 1 or logits.shape[0] < 1:
            raise ValueError(f"logits must have shape (K,) with K >= 1, got shape {logits.shape}")
        if not np.all(np.isfinite(logits)):
            raise ValueError("logits contains non-finite entries")
        K = logits.shape[0]
        means = np.asarray(self.means, dtype=np.float64)
        if means.shape != (K,):
            raise ValueError(f"means must have shape (K,) = ({K},) like logits, got {means.shape}")
        if not np.all(np.isfinite(means)):
            raise ValueError("means contains non-finite entries")
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"reward must be one of {REWARD_KINDS}, got {self.reward!r}")
        std = None
        if self.reward == "bernoulli":
            if np.any((means < 0) | (means > 1)):
                raise ValueError(
                    f"Bernoulli reward means must lie in [0, 1], got min {means.min():.3g}, "
                    f"max {means.max():.3g}"
                )
            if self.reward_std is not None:
                raise ValueError(
                    "reward_std applies to Gaussian rewards only; leave it unset for Bernoulli "
                    "(the variance is m(1 - m))"
                )
        else:
            std = np.asarray(1.0 if self.reward_std is None else self.reward_std, dtype=np.float64)
            if std.ndim == 0:
                std = np.full(K, float(std))
            if std.shape != (K,):
                raise ValueError(
                    f"reward_std must be a scalar or have shape (K,) = ({K},), got {std.shape}"
                )
            if not np.all(np.isfinite(std)) or np.any(std <= 0):
                raise ValueError("reward_std must be finite and > 0 for every arm")
            std = readonly(std)
        shifted = np.exp(logits - logits.max())
        object.__setattr__(self, "logits", readonly(logits))
        object.__setattr__(self, "means", readonly(means))
        object.__setattr__(self, "reward_std", std)
        object.__setattr__(self, "_pi", readonly(shifted / shifted.sum()))

    # --- oracle quantities ---------------------------------------------------------------

    @property
    def K(self) -> int:
        """Number of arms (also the gradient dimension D)."""
        return int(self.logits.shape[0])

    @property
    def D(self) -> int:
        """Dimension of the parameter θ (= K)."""
        return self.K

    @property
    def pi(self) -> np.ndarray:
        """Target policy π = softmax(θ), shape (K,)."""
        return self._pi

    @property
    def reward_variance(self) -> np.ndarray:
        """Var(R | y = k), shape (K,): m(1 − m) (Bernoulli) or s² (Gaussian)."""
        if self.reward == "bernoulli":
            return self.means * (1.0 - self.means)
        return self.reward_std**2

    def check_policy(self, p, name: str = "behaviour") -> np.ndarray:
        """Validate a policy over the K arms: shape (K,), non-negative, sums to one."""
        arr = as_prob(p, name)
        if arr.shape != (self.K,):
            raise ValueError(f"{name} must have shape (K,) = ({self.K},), got shape {arr.shape}")
        return arr

    def J(self, pi=None) -> float:
        """Expected reward J(π) = Σ_k π_k m_k (π defaults to the target softmax(θ))."""
        p = self.pi if pi is None else self.check_policy(pi, "pi")
        return float(p @ self.means)

    def grad_J(self) -> np.ndarray:
        """∇θ J(softmax θ) = π ⊙ (m − J(π)), shape (K,)."""
        return self.pi * (self.means - self.J())

    def log_ratio(self, mu) -> np.ndarray:
        """log π_k − log μ_k per arm, shape (K,); +inf where μ_k = 0."""
        mu = self.check_policy(mu)
        return np.log(self.pi) - safe_log(mu)

    def divergences(self, mu) -> dict[str, float]:
        """χ², KL, TV of π from μ (``simkit.divergence``); with T = 1 token = sequence level.

        Returns ``{"chi2_tok", "kl_tok", "tv_tok", "chi2_seq", "kl_seq", "tv_seq"}``.
        """
        mu = self.check_policy(mu)
        out = {
            "chi2": float(divergence.chi2(self.pi, mu)),
            "kl": float(divergence.kl(self.pi, mu)),
            "tv": float(divergence.tv(self.pi, mu)),
        }
        return {f"{k}_{level}": v for level in ("tok", "seq") for k, v in out.items()}

    # --- gradient accumulation -------------------------------------------------------------

    def accumulate(self, actions, token_weights) -> np.ndarray:
        """Σ_i λ_i ∇θ log π(y_i) = bincount(y, λ) − π·Σ_i λ_i, without per-sample gradients.

        ``actions`` (L..., n) integer arms; ``token_weights`` λ of shape (L..., n, 1) (T = 1, as
        returned by :meth:`simkit.estimators.Estimator.token_weights`) or (L..., n). Leading
        axes L are independent batches. Returns (L..., K).
        """
        y = np.asarray(actions)
        if y.ndim < 1:
            raise ValueError("actions must have shape (..., n), got a scalar")
        if not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"actions must be integer arm indices, got dtype {y.dtype}")
        lam = np.asarray(token_weights, dtype=np.float64)
        if lam.shape == (*y.shape, 1):
            lam = lam[..., 0]
        elif lam.shape != y.shape:
            raise ValueError(
                f"token_weights must have shape actions.shape + (1,) = {(*y.shape, 1)} "
                f"(or {y.shape}), got {lam.shape}"
            )
        if y.size and (y.min() < 0 or y.max() >= self.K):
            raise ValueError(
                f"actions must lie in [0, K) = [0, {self.K}), got min {y.min()}, max {y.max()}"
            )
        lead = y.shape[:-1]
        B = int(np.prod(lead, dtype=np.int64))
        n = y.shape[-1]
        flat = (np.arange(B)[:, None] * self.K + y.reshape(B, n)).ravel()
        counts = np.bincount(flat, weights=lam.reshape(B * n), minlength=B * self.K)
        grad = counts.reshape(B, self.K) - lam.reshape(B, n).sum(axis=1)[:, None] * self.pi
        return grad.reshape((*lead, self.K))

    # --- sampling -------------------------------------------------------------------------

    def sample(self, mu, n: int, rng: np.random.Generator, reps: int | None = None) -> BanditBatch:
        """Draw ``reps`` independent batches (or one if ``reps`` is None) of ``n`` arms y ~ μ.

        Rewards R | y ~ Bernoulli(m_y) or Normal(m_y, s_y²). All draws are made at once
        (shape (reps, n)) from ``rng``. Returns a :class:`BanditBatch`.
        """
        mu = self.check_policy(mu)
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
        n = positive_int(n, "n")
        shape = (n,) if reps is None else (positive_int(reps, "reps"), n)
        actions = rng.choice(self.K, size=shape, p=mu)
        if self.reward == "bernoulli":
            rewards = (rng.random(shape) < self.means[actions]).astype(np.float64)
        else:
            rewards = self.means[actions] + self.reward_std[actions] * rng.standard_normal(shape)
        log_ratio = self.log_ratio(mu)[actions][..., None]
        return BanditBatch(
            actions=actions,
            rewards=rewards,
            log_ratio=log_ratio,
            mask=np.ones((*shape, 1), dtype=bool),
            pi=self.pi,
            mu=mu,
            J=self.J(),
            grad_J=self.grad_J(),
            J_mu=self.J(mu),
        )

    # --- exact support ---------------------------------------------------------------------

    def support(self, mu, baseline: float = 0.0) -> BanditSupport:
        """Atoms (y, sign A) of one draw under μ with A = R − ``baseline``, and their moments.

        Bernoulli: the atoms are (y, R ∈ {0, 1}) (2K at most) with A = R − b exactly.
        Gaussian: R = m_y + s_y·Z; with z₀ = (b − m_y)/s_y, δ = m_y − b, Q = P(Z ≥ z₀), φ the
        standard normal density (normal partial expectations):

            E[A·1{A≥0} | y]  = δ·Q + s·φ(z₀),     E[A²·1{A≥0} | y] = (δ² + s²)·Q + δ·s·φ(z₀)
            E[A·1{A<0} | y]  = δ·(1−Q) − s·φ(z₀), E[A²·1{A<0} | y] = (δ² + s²)·(1−Q) − δ·s·φ(z₀)

        Atoms of probability zero (μ_y = 0, or a Bernoulli outcome of probability 0) are
        dropped. Returns a :class:`BanditSupport`.
        """
        mu = self.check_policy(mu)
        b = float(baseline)
        if not math.isfinite(b):
            raise ValueError(f"baseline must be finite, got {baseline}")
        arms = np.arange(self.K)
        if self.reward == "bernoulli":
            p_pos, p_neg = self.means, 1.0 - self.means
            a_pos, a_neg = np.full(self.K, 1.0 - b), np.full(self.K, -b)
            first_pos, first_neg = p_pos * a_pos, p_neg * a_neg
            second_pos, second_neg = p_pos * a_pos**2, p_neg * a_neg**2
            positive_pos, positive_neg = a_pos >= 0, a_neg >= 0
        else:
            s = self.reward_std
            delta = self.means - b
            z0 = -delta / s
            p_pos, p_neg = ndtr(-z0), ndtr(z0)
            dens = np.exp(-0.5 * z0**2) / _SQRT_2PI
            first_pos = delta * p_pos + s * dens
            first_neg = delta * p_neg - s * dens
            second_pos = (delta**2 + s**2) * p_pos + delta * s * dens
            second_neg = (delta**2 + s**2) * p_neg - delta * s * dens
            positive_pos, positive_neg = np.ones(self.K, bool), np.zeros(self.K, bool)
        actions = np.concatenate([arms, arms])
        prob = np.concatenate([mu * p_pos, mu * p_neg])
        keep = prob > 0
        actions = actions[keep]
        log_ratio = np.log(self.pi[actions]) - np.log(mu[actions])
        return BanditSupport(
            actions=actions,
            positive=np.concatenate([positive_pos, positive_neg])[keep],
            prob=prob[keep],
            adv_first=(np.concatenate([mu * first_pos, mu * first_neg]))[keep],
            adv_second=(np.concatenate([mu * second_pos, mu * second_neg]))[keep],
            log_ratio=log_ratio[:, None],
            mask=np.ones((actions.shape[0], 1), dtype=bool),
        )
