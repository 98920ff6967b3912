"""Closed-form bounds and curves of the notation page (section F and the VESPO facts).

Pure numpy/scipy: every function is a formula from a paper, named after the quantity it returns,
with the paper and equation in its docstring. Arguments broadcast like numpy ufuncs unless a
docstring says otherwise.

Sources
-------
- Pinsker's inequality and Jensen: TV² ≤ ½·KL ≤ ½·log(1+χ²) ≤ ½·χ² (notation page F).
- rl-collapse: J. Liu, Y. Li, Y. Fu, J. Wang, Q. Liu, Y. Shen, "When Speed Kills Stability:
  Demystifying RL Collapse from the Training-Inference Mismatch" (blog series, 2025;
  https://richardli.xyz/rl-collapse, Part 2: "Token v.s. Sequence-level Correction").
- VESPO: G. Shen, C. Zhao, X. Cheng, L. Huang, X. Yu, "VESPO: Variational Sequence-level Soft
  Policy Optimization for Off-Policy LLM Training", arXiv 2602.10693 v3 (2026).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import xlogy

from simkit import divergence
from simkit.mappings.vespo import vespo_f, vespo_phi

__all__ = [
    "PinskerChain",
    "expected_ess",
    "length_trap_T",
    "pinsker_chain",
    "pinsker_chain_holds",
    "seq_is_second_moment",
    "seq_is_variance",
    "seq_ratio_growth",
    "seq_tis_bias_bound",
    "seq_tis_mse_bound",
    "seq_tis_optimal_c",
    "seq_tis_variance_bound",
    "token_is_bias_bound_shape",
    "vespo_K",
    "vespo_f",
    "vespo_phi",
    "vespo_phi_max",
    "vespo_second_moment_bound",
]


# --- argument checks ---------------------------------------------------------------------------


def _nonneg(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if np.any(np.isnan(arr)):
        raise ValueError(f"{name} contains NaN")
    if np.any(arr < 0):
        raise ValueError(f"{name} must be >= 0, got min {arr.min():.6g}")
    return arr


def _positive(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if np.any(np.isnan(arr)):
        raise ValueError(f"{name} contains NaN")
    if np.any(arr <= 0):
        raise ValueError(f"{name} must be > 0, got min {arr.min():.6g}")
    return arr


def _out(x: np.ndarray):
    """Return a Python float for 0-d results, the array otherwise."""
    return float(x) if np.ndim(x) == 0 else x


# --- Pinsker chain -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PinskerChain:
    """The four members of TV² ≤ ½KL ≤ ½log(1+χ²) ≤ ½χ², each of shape (…) (notation page F).

    ``tv_sq`` = TV(π,μ)², ``half_kl`` = ½KL(π‖μ), ``half_log1p_chi2`` = ½log(1+χ²(π‖μ)),
    ``half_chi2`` = ½χ²(π‖μ).
    """

    tv_sq: np.ndarray
    half_kl: np.ndarray
    half_log1p_chi2: np.ndarray
    half_chi2: np.ndarray

    def as_array(self) -> np.ndarray:
        """Stack the four members in chain order along a new last axis: shape (…, 4)."""
        return np.stack([self.tv_sq, self.half_kl, self.half_log1p_chi2, self.half_chi2], axis=-1)


def pinsker_chain(pi, mu) -> PinskerChain:
    """The Pinsker–Jensen chain TV² ≤ ½·KL ≤ ½·log(1+χ²) ≤ ½·χ² for categorical π, μ.

    - TV² ≤ ½KL is Pinsker's inequality (TV = ½Σ|π−μ|);
    - KL ≤ log(1+χ²) is Jensen: KL = E_π[log(π/μ)] ≤ log E_π[π/μ] = log(1+χ²);
    - log(1+x) ≤ x.

    Notation page (``docs/reference.md``) §F. A trust region on KL therefore does not bound χ²
    (the chain only goes one way).

    Parameters
    ----------
    pi, mu : array (…, V)
        Target and behaviour distributions (validated by :mod:`simkit.divergence`).

    Returns
    -------
    PinskerChain with four arrays of shape (…) (``inf`` where μ misses π's support).
    """
    tv = np.asarray(divergence.tv(pi, mu), dtype=np.float64)
    kl = np.asarray(divergence.kl(pi, mu), dtype=np.float64)
    chi2 = np.asarray(divergence.chi2(pi, mu), dtype=np.float64)
    return PinskerChain(
        tv_sq=tv**2,
        half_kl=0.5 * kl,
        half_log1p_chi2=0.5 * np.log1p(chi2),
        half_chi2=0.5 * chi2,
    )


def pinsker_chain_holds(
    chain: PinskerChain, rtol: float = 1e-12, atol: float = 1e-15
) -> np.ndarray:
    """Whether each link of the chain holds, within floating-point slack.

    Checks ``a ≤ b·(1 + rtol) + atol`` for the three consecutive pairs of ``chain``.

    Returns
    -------
    bool array of shape (…, 3): column j says whether member j ≤ member j+1.
    """
    if not isinstance(chain, PinskerChain):
        raise TypeError(f"chain must be a PinskerChain, got {type(chain).__name__}")
    if rtol < 0 or atol < 0:
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    members = chain.as_array()
    lower, upper = members[..., :-1], members[..., 1:]
    with np.errstate(invalid="ignore"):  # inf·(1+rtol) is fine; inf ≤ inf is True
        return lower <= upper * (1.0 + rtol) + atol


# --- sequence-level importance sampling -------------------------------------------------------


def seq_is_second_moment(chi2_tok, T):
    """E_μ[W²] = (1+χ²)^T for a sequence of T independent tokens with per-token χ²(π‖μ).

    With W = Π_t r_t and independent positions, E_μ[W²] = Π_t E_μ[r_t²] = Π_t (1+χ²_t)
    (notation page A and F; rl-collapse Part 2, Seq-IS variance O((1+χ²_max)^T)). Computed in
    log space as exp(T·log1p(χ²)). Examples (notation page F): χ²=0.01, T=200 ⇒ ≈ 7.3;
    χ²=0.05, T=200 ⇒ ≈ 17 293.

    Parameters
    ----------
    chi2_tok : float or array (…)
        Per-token χ²(π‖μ) ≥ 0.
    T : int or array (…)
        Sequence length(s) ≥ 0 (broadcast against ``chi2_tok``).

    Returns
    -------
    float or array of the broadcast shape.
    """
    chi2 = _nonneg(chi2_tok, "chi2_tok")
    length = _nonneg(T, "T")
    return _out(np.exp(length * np.log1p(chi2)))


def seq_is_variance(chi2_tok, T):
    """Var_μ(W) = (1+χ²)^T − 1 for T independent tokens (since E_μ[W] = 1).

    This is χ²_seq, the sequence-level χ²(π‖μ) (notation page F: 1+χ²_seq = Π(1+χ²_t)).
    Computed as expm1(T·log1p(χ²)), accurate for tiny values.

    Shapes as :func:`seq_is_second_moment`.
    """
    chi2 = _nonneg(chi2_tok, "chi2_tok")
    length = _nonneg(T, "T")
    return _out(np.expm1(length * np.log1p(chi2)))


def seq_ratio_growth(rho_bar, T):
    """ρ̄^T: the sequence ratio W when every token ratio equals ρ̄ (rl-collapse length trap).

    Shapes broadcast; ``rho_bar`` > 0, ``T`` ≥ 0. E.g. 1.001^1610 ≈ 5.
    """
    rho = _positive(rho_bar, "rho_bar")
    length = _nonneg(T, "T")
    return _out(np.exp(length * np.log(rho)))


def expected_ess(n, chi2):
    """Effective sample size of n importance weights: ESS ≈ n / (1 + χ²(π‖μ)).

    Notation page §F: ESS = (Σw)²/Σw² → n·E[w]²/E[w²] = n/(1+χ²) as n grows (Kong 1992).
    ``n`` > 0 and ``chi2`` ≥ 0 broadcast.
    """
    size = _positive(n, "n")
    chi2_arr = _nonneg(chi2, "chi2")
    return _out(size / (1.0 + chi2_arr))


# --- rl-collapse: truncated sequence IS and token IS ------------------------------------------


def seq_tis_bias_bound(chi2, c, K):
    """Bias bound of sequence-level truncated IS, ‖E[ĝ] − g‖ ≤ 2K(1+χ²)/C.

    rl-collapse (Liu, Li et al. 2025), Part 2, Seq-TIS with weight min(W, C): the bias is
    E_μ[(W − C)⁺ f] with ‖f‖ ≤ K, bounded through E_μ[W·1{W>C}] ≤ E_μ[W²]/C = (1+χ²)/C; the
    source states it with the factor 2 kept here.

    Parameters
    ----------
    chi2 : float or array
        Sequence-level χ²(π‖μ) ≥ 0.
    c : float or array
        Truncation level C > 0.
    K : float or array
        Bound on ‖f(y)‖ = ‖∇log π(y)·R(y)‖, K ≥ 0.
    """
    chi2_arr = _nonneg(chi2, "chi2")
    cap = _positive(c, "c")
    bound = _nonneg(K, "K")
    return _out(2.0 * bound * (1.0 + chi2_arr) / cap)


def seq_tis_variance_bound(c, K):
    """Variance (second-moment) bound of sequence-level truncated IS: K²·C².

    rl-collapse (Liu, Li et al. 2025), Part 2: min(W, C)·f is bounded by C·K, so its second
    moment (hence its variance) is at most K²C² whatever the mismatch.
    """
    cap = _positive(c, "c")
    bound = _nonneg(K, "K")
    return _out(bound**2 * cap**2)


def seq_tis_mse_bound(chi2, c, K):
    """bias_bound² + variance_bound = 4K²(1+χ²)²/C² + K²C² (rl-collapse Seq-TIS trade-off).

    Minimised over C by :func:`seq_tis_optimal_c`.
    """
    return _out(
        np.asarray(seq_tis_bias_bound(chi2, c, K)) ** 2 + np.asarray(seq_tis_variance_bound(c, K))
    )


def seq_tis_optimal_c(chi2):
    """C* = √(2(1+χ²)), the truncation level minimising 4K²(1+χ²)²/C² + K²C².

    rl-collapse (Liu, Li et al. 2025), Part 2, Seq-TIS: setting the derivative of the MSE bound
    to zero gives C⁴ = 4(1+χ²)²; K cancels. ``chi2`` is the sequence-level χ²(π‖μ) ≥ 0.
    """
    chi2_arr = _nonneg(chi2, "chi2")
    return _out(np.sqrt(2.0 * (1.0 + chi2_arr)))


def token_is_bias_bound_shape(T, delta_max, K=1.0):
    """SHAPE ONLY: K·T²·Δ_max, the growth of the token-IS / PPO-like bias in rl-collapse.

    rl-collapse (Liu, Li et al. 2025), Part 2, states the token-level IS bias as O(T²·Δ_max),
    with Δ_max the largest per-state TV(π(·|s), μ(·|s)) (simulation-lemma argument: the state
    distributions drift apart by up to t·Δ_max at step t, summed over T steps). The source gives
    the order, not a constant we could verify, so this returns the shape with unit constant times
    the bound K on ‖f‖; use it for scaling plots, not as a numerical bound.

    Parameters
    ----------
    T : int or array, ≥ 0;  delta_max : float or array in [0, 1];  K : float ≥ 0.
    """
    length = _nonneg(T, "T")
    delta = _nonneg(delta_max, "delta_max")
    if np.any(delta > 1):
        raise ValueError(f"delta_max is a total variation, must be <= 1, got max {delta.max():.6g}")
    bound = _nonneg(K, "K")
    return _out(bound * length**2 * delta)


def length_trap_T(c, rho_bar):
    """T* = log C / log ρ̄: the length at which ρ̄^T reaches a mask threshold C.

    rl-collapse (Liu, Li et al. 2025, part 3): if every token ratio is about ρ̄ > 1, then
    W ≈ ρ̄^T exceeds the sequence-mask threshold C for T > T*. Notation page §C: C = 5,
    ρ̄ = 1.001 ⇒ T* ≈ 1610.

    Which side of the ratio this concerns: ρ̄ must be the typical token ratio of sequences drawn
    from **π**, ρ̄ = exp(E_π[log r_t]) = exp(KL(π‖μ)) per token (> 1 whenever π ≠ μ). Then T*
    is where the median of W under π crosses C: beyond it the mask 1[W ≤ C] keeps less than
    about half of π's probability mass, E_μ[W·1{W ≤ C}] = P_π(W ≤ C). It is **not** a length
    beyond which μ's rollouts are rejected: under μ, E_μ[W] = 1, so P_μ(W > C) ≤ 1/C at every
    T (Markov), and log W drifts *down* (E_μ[log r_t] = −KL(μ‖π) < 0). See
    :mod:`simkit.figures.length_trap`.

    Parameters
    ----------
    c : float or array, > 1 (a mask threshold ≤ 1 rejects W = 1 already);
    rho_bar : float or array, > 1 (the per-token geometric-mean ratio under π, e^KL(π‖μ)).
    """
    cap = np.asarray(c, dtype=np.float64)
    rho = np.asarray(rho_bar, dtype=np.float64)
    if np.any(~(cap > 1)):
        raise ValueError(f"c must be > 1 (mask threshold on W), got min {np.min(cap):.6g}")
    if np.any(~(rho > 1)):
        raise ValueError(
            f"rho_bar must be > 1 (per-token ratio above 1 drives W up), got min {np.min(rho):.6g}"
        )
    return _out(np.log(cap) / np.log(rho))


# --- VESPO ----------------------------------------------------------------------------------------


def vespo_K(c1, c2):
    """K = sup_{w>0} φ(w)/w = ((c1−1)/c2)^{c1−1}·e^{c2−c1+1} for φ(W) = W^{c1}·e^{c2(1−W)}.

    VESPO (arXiv 2602.10693 v3), Prop. 3.1; the sup is attained at w = (c1−1)/c2. Requires
    c1 ≥ 1 (otherwise φ(w)/w is unbounded at 0) and c2 > 0. At c1 = 1 the sup is e^{c2}
    (at w → 0, with 0⁰ = 1). Examples: K(2, 3) = e²/3, K(3, 2) = 1.
    """
    k = np.asarray(c1, dtype=np.float64)
    lam = _positive(c2, "c2")
    if np.any(~(k >= 1)):
        raise ValueError(
            f"c1 must be >= 1 for K = sup φ(w)/w to be finite, got min {np.min(k):.6g}"
        )
    # (c1−1)·log((c1−1)/c2) with 0·log 0 = 0 (c1 = 1)
    log_k = xlogy(k - 1.0, (k - 1.0) / lam) + lam - k + 1.0
    return _out(np.exp(log_k))


def vespo_phi_max(c1, c2):
    """(sup φ, argmax) for φ(W) = W^{c1}·e^{c2(1−W)}: ((c1/c2)^{c1}·e^{c2−c1}, c1/c2).

    VESPO (arXiv 2602.10693 v3), Prop. C.1. Requires c1 > 0, c2 > 0. The paper's Fig. 2 draws
    φ/φ_max (peak-normalised). Examples: (2, 3) ⇒ ((2/3)²·e, 2/3); (3, 2) ⇒ (1.5³/e, 1.5).

    Returns
    -------
    (value, argmax), floats or arrays of the broadcast shape.
    """
    k = _positive(c1, "c1")
    lam = _positive(c2, "c2")
    argmax = k / lam
    value = np.exp(k * np.log(argmax) + lam - k)
    return _out(value), _out(np.broadcast_to(argmax, np.shape(value)).copy())


def vespo_second_moment_bound(Z, K, C):
    """E_μ[φ(W)²] ≤ Z·K·C (VESPO, arXiv 2602.10693 v3, Prop. 3.1).

    With Z = E_μ[φ(W)], K = sup φ(w)/w (:func:`vespo_K`) and C ≥ E_Q[W] under the reweighted
    proposal Q ∝ μ·φ(W) (the variational constraint E_Q[W] ≤ C):
    E_μ[φ²] = E_μ[(φ/W)·W·φ] ≤ K·E_μ[W·φ] = K·Z·E_Q[W] ≤ Z·K·C.
    All arguments ≥ 0, broadcast.
    """
    z = _nonneg(Z, "Z")
    k = _nonneg(K, "K")
    cap = _nonneg(C, "C")
    return _out(z * k * cap)
