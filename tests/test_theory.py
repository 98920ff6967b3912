"""simkit.theory: the closed forms of the notation page (docs/reference.md), checked against
numbers from the sources, exact enumeration and independent numerical paths."""

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, optimize

from simkit import divergence, mappings, theory

# --- sequence IS second moment -----------------------------------------------------------------


def test_seq_is_second_moment_reference_numbers():
    # docs/reference.md §F (rl-collapse): 1.01^200 ≈ 7.3 and 1.05^200 ≈ 17 293
    m1 = theory.seq_is_second_moment(0.01, 200)
    m5 = theory.seq_is_second_moment(0.05, 200)
    assert math.isclose(m1, 1.01**200, rel_tol=1e-12)
    assert round(m1, 1) == 7.3
    assert math.isclose(m5, 1.05**200, rel_tol=1e-12)
    assert round(m5) == 17293
    assert math.isclose(theory.seq_is_variance(0.05, 200), 1.05**200 - 1, rel_tol=1e-12)


def _enumerate_product(pi_tok, mu_tok):
    """All V^T sequences of independent positions: probabilities under π and μ, shape (V^T,)."""
    T, V = pi_tok.shape
    seqs = np.array(list(itertools.product(range(V), repeat=T)))
    p = np.prod(pi_tok[np.arange(T), seqs], axis=1)
    q = np.prod(mu_tok[np.arange(T), seqs], axis=1)
    return p, q


@pytest.mark.parametrize("T", [1, 3, 5])
def test_seq_is_moments_match_enumeration(T):
    rng = np.random.default_rng(1)
    V = 3
    pi = rng.dirichlet(np.ones(V))
    mu = rng.dirichlet(np.ones(V))
    chi2 = float(divergence.chi2(pi, mu))
    p, q = _enumerate_product(np.tile(pi, (T, 1)), np.tile(mu, (T, 1)))
    w = p / q
    assert math.isclose(np.sum(q * w), 1.0, rel_tol=1e-12)  # E_μ[W] = 1
    second = np.sum(q * w**2)
    assert math.isclose(theory.seq_is_second_moment(chi2, T), second, rel_tol=1e-10)
    assert math.isclose(theory.seq_is_variance(chi2, T), second - 1.0, rel_tol=1e-10)
    # the same identity is the sequence-level χ² of the product distributions
    assert math.isclose(float(divergence.chi2(p, q)), second - 1.0, rel_tol=1e-9)


def test_seq_is_broadcasts_and_validates():
    out = theory.seq_is_second_moment(np.array([0.0, 0.1]), np.array([[1], [10]]))
    assert out.shape == (2, 2)
    np.testing.assert_allclose(out, [[1.0, 1.1], [1.0, 1.1**10]], rtol=1e-13)
    assert theory.seq_is_variance(1e-12, 3) == pytest.approx(3e-12, rel=1e-9)  # no cancellation
    with pytest.raises(ValueError, match="chi2_tok"):
        theory.seq_is_second_moment(-0.1, 3)
    with pytest.raises(ValueError, match="T"):
        theory.seq_is_variance(0.1, -1)


def test_expected_ess_is_n_over_one_plus_chi2_exactly():
    rng = np.random.default_rng(2)
    pi, mu = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    w = pi / mu
    n = 64
    # n·E[w]²/E[w²], the large-n limit of (Σw)²/Σw², from the distribution itself
    ess = n * np.sum(mu * w) ** 2 / np.sum(mu * w**2)
    assert math.isclose(theory.expected_ess(n, float(divergence.chi2(pi, mu))), ess, rel_tol=1e-12)


# --- Pinsker chain -----------------------------------------------------------------------------


def test_pinsker_chain_closed_form_example():
    # π = (1, 0), μ = (½, ½): TV = ½, KL = log 2, χ² = 1 (w = 2 on π's support, so KL = log(1+χ²))
    chain = theory.pinsker_chain([1.0, 0.0], [0.5, 0.5])
    assert chain.tv_sq == pytest.approx(0.25, abs=1e-15)
    assert chain.half_kl == pytest.approx(0.5 * math.log(2), abs=1e-15)
    assert chain.half_log1p_chi2 == pytest.approx(0.5 * math.log(2), abs=1e-15)
    assert chain.half_chi2 == pytest.approx(0.5, abs=1e-15)
    assert theory.pinsker_chain_holds(chain).all()


def test_pinsker_chain_holds_on_random_pairs():
    rng = np.random.default_rng(3)
    for alpha in (0.2, 1.0, 5.0):
        pi = rng.dirichlet(np.full(8, alpha), size=200)
        mu = rng.dirichlet(np.full(8, alpha), size=200)
        chain = theory.pinsker_chain(pi, mu)
        assert chain.as_array().shape == (200, 4)
        assert theory.pinsker_chain_holds(chain).all()


def test_pinsker_chain_holds_detects_a_violation():
    broken = theory.PinskerChain(
        tv_sq=np.array(0.3),
        half_kl=np.array(0.2),
        half_log1p_chi2=np.array(0.25),
        half_chi2=np.array(0.1),
    )
    np.testing.assert_array_equal(theory.pinsker_chain_holds(broken), [False, True, False])
    with pytest.raises(TypeError, match="PinskerChain"):
        theory.pinsker_chain_holds((0.1, 0.2, 0.3, 0.4))


def test_pinsker_chain_infinite_when_support_missing():
    chain = theory.pinsker_chain([0.5, 0.5], [1.0, 0.0])
    assert np.isinf(chain.half_chi2) and np.isinf(chain.half_kl)
    assert theory.pinsker_chain_holds(chain).all()


# --- rl-collapse: Seq-TIS ----------------------------------------------------------------------


def test_seq_tis_formulas():
    # rl-collapse Part 2: bias ≤ 2K(1+χ²)/C, Var ≤ K²C², C* = √(2(1+χ²))
    assert theory.seq_tis_bias_bound(0.5, 2.0, 3.0) == pytest.approx(2 * 3 * 1.5 / 2, abs=1e-14)
    assert theory.seq_tis_variance_bound(2.0, 3.0) == pytest.approx(36.0, abs=1e-12)
    assert theory.seq_tis_optimal_c(1.0) == pytest.approx(2.0, abs=1e-14)


@pytest.mark.parametrize("chi2", [0.0, 0.3, 4.0, 100.0])
def test_seq_tis_optimal_c_minimises_the_mse_bound(chi2):
    res = optimize.minimize_scalar(
        lambda c: theory.seq_tis_mse_bound(chi2, c, 1.7),
        bounds=(1e-3, 1e3),
        method="bounded",
        options={"xatol": 1e-10},
    )
    assert res.x == pytest.approx(theory.seq_tis_optimal_c(chi2), rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_seq_tis_bounds_hold_by_enumeration(seed):
    rng = np.random.default_rng(seed)
    M = 40  # sequences (the whole support)
    pi = rng.dirichlet(np.full(M, 0.5))
    mu = rng.dirichlet(np.full(M, 0.5))
    K = 2.0
    f = rng.uniform(-K, K, size=M)  # scalar f(y) with |f| ≤ K
    chi2 = float(divergence.chi2(pi, mu))
    for C in (1.0, 2.0, theory.seq_tis_optimal_c(chi2), 10.0):
        weight = np.minimum(pi / mu, C)
        mean = np.sum(mu * weight * f)
        bias = abs(mean - np.sum(pi * f))
        variance = np.sum(mu * (weight * f) ** 2) - mean**2
        assert bias <= theory.seq_tis_bias_bound(chi2, C, K)
        assert variance <= theory.seq_tis_variance_bound(C, K)


def test_token_is_bias_bound_is_quadratic_in_T():
    assert theory.token_is_bias_bound_shape(10, 0.01) == pytest.approx(1.0, abs=1e-14)
    assert theory.token_is_bias_bound_shape(20, 0.01, K=2.0) == pytest.approx(8.0, abs=1e-13)
    with pytest.raises(ValueError, match="delta_max"):
        theory.token_is_bias_bound_shape(10, 1.5)


def test_seq_tis_validation():
    with pytest.raises(ValueError, match="c must be > 0"):
        theory.seq_tis_bias_bound(0.1, 0.0, 1.0)
    with pytest.raises(ValueError, match="K"):
        theory.seq_tis_variance_bound(2.0, -1.0)
    with pytest.raises(ValueError, match="chi2"):
        theory.seq_tis_optimal_c(-1.0)


# --- length trap -------------------------------------------------------------------------------


def test_length_trap_reference_number():
    # docs/reference.md, Mappings (rl-collapse): C = 5, ρ̄ = 1.001 ⇒ T* ≈ 1610
    t_star = theory.length_trap_T(5, 1.001)
    assert abs(t_star - 1610) < 0.5
    assert theory.seq_ratio_growth(1.001, t_star) == pytest.approx(5.0, rel=1e-12)
    assert (
        theory.seq_ratio_growth(1.001, math.floor(t_star))
        < 5
        < theory.seq_ratio_growth(1.001, math.ceil(t_star))
    )


def test_length_trap_validation():
    with pytest.raises(ValueError, match="c must be > 1"):
        theory.length_trap_T(1.0, 1.001)
    with pytest.raises(ValueError, match="rho_bar must be > 1"):
        theory.length_trap_T(5.0, 0.999)


# --- VESPO -------------------------------------------------------------------------------------


def test_vespo_reference_numbers():
    # VESPO arXiv 2602.10693 v3, Prop. 3.1: K = ((c1−1)/c2)^{c1−1}·e^{c2−c1+1}
    assert theory.vespo_K(2, 3) == pytest.approx(math.e**2 / 3, rel=1e-14)
    assert theory.vespo_K(3, 2) == pytest.approx(1.0, rel=1e-14)
    assert theory.vespo_K(1, 2) == pytest.approx(math.e**2, rel=1e-14)  # c1 = 1: sup at w → 0
    # Prop. C.1: sup φ = (c1/c2)^{c1}·e^{c2−c1} at W = c1/c2
    value, argmax = theory.vespo_phi_max(2, 3)
    assert argmax == pytest.approx(2 / 3, rel=1e-15)
    assert value == pytest.approx((2 / 3) ** 2 * math.e, rel=1e-14)
    value, argmax = theory.vespo_phi_max(3, 2)
    assert argmax == pytest.approx(1.5, rel=1e-15)
    assert value == pytest.approx(1.5**3 / math.e, rel=1e-14)


@pytest.mark.parametrize("positive, c1, c2", [(True, 2.0, 3.0), (False, 3.0, 2.0)])
def test_vespo_K_and_phi_max_against_the_mapping_on_a_grid(positive, c1, c2):
    # independent path: the registered mapping's φ (default (k, λ) = (2, 3) for A ≥ 0,
    # (3, 2) for A < 0 — docs/reference.md, Mappings), maximised on a fine grid
    vespo = mappings.get("vespo")
    h = 1e-5
    w = np.arange(h, 6.0, h)
    phi = np.asarray(vespo.phi(w, positive), dtype=np.float64)
    value, argmax = theory.vespo_phi_max(c1, c2)
    i = int(np.argmax(phi))
    # grid error of a smooth maximum: ½|φ''|h² ≲ 1e-9
    assert abs(phi[i] - value) < 1e-9
    assert abs(w[i] - argmax) <= h
    ratio = phi / w
    j = int(np.argmax(ratio))
    assert abs(ratio[j] - theory.vespo_K(c1, c2)) < 1e-9


@pytest.mark.parametrize("k, lam", [(2.0, 3.0), (3.0, 2.0), (1.0, 1.5), (4.5, 0.7)])
def test_vespo_f_is_the_antiderivative_of_phi_over_w(k, lam):
    # w·f'(w) = φ(w)  ⇔  f(b) − f(a) = ∫_a^b φ(u)/u du  (quadrature to 1e-12)
    for a, b in [(0.0, 0.5), (0.3, 1.0), (1.0, 3.0), (0.5, 7.0)]:
        integral, err = integrate.quad(
            lambda u: (
                theory.vespo_phi(u, k, lam) / u
                if u > 0
                else (1.0 if k == 1 else 0.0) * math.exp(lam)
            ),
            a,
            b,
            epsabs=1e-13,
            epsrel=1e-13,
        )
        diff = theory.vespo_f(b, k, lam) - theory.vespo_f(a, k, lam)
        assert abs(diff - integral) < 1e-10 + 10 * err
    # and pointwise by central differences: truncation h²|f'''|/6 ≈ 1e-11, rounding ε/h ≈ 1e-11
    w = np.linspace(0.05, 3.0, 60)
    h = 1e-5
    deriv = (theory.vespo_f(w + h, k, lam) - theory.vespo_f(w - h, k, lam)) / (2 * h)
    np.testing.assert_allclose(w * deriv, theory.vespo_phi(w, k, lam), rtol=1e-8, atol=1e-9)


def test_vespo_second_moment_bound_holds():
    # Prop. 3.1 on random discrete μ and W: E_μ[φ²] ≤ Z·K·C with Z = E_μ[φ], C = E_Q[W], Q ∝ μφ
    rng = np.random.default_rng(7)
    for c1, c2 in [(2.0, 3.0), (3.0, 2.0)]:
        K = theory.vespo_K(c1, c2)
        for _ in range(20):
            mu = rng.dirichlet(np.ones(30))
            w = rng.lognormal(0.0, 1.0, size=30)
            phi = theory.vespo_phi(w, c1, c2)
            Z = np.sum(mu * phi)
            C = np.sum(mu * phi * w) / Z
            assert np.sum(mu * phi**2) <= theory.vespo_second_moment_bound(Z, K, C) * (1 + 1e-12)
    assert theory.vespo_second_moment_bound(2.0, 3.0, 4.0) == pytest.approx(24.0, abs=1e-13)


def test_vespo_validation():
    with pytest.raises(ValueError, match="c1 must be >= 1"):
        theory.vespo_K(0.5, 2.0)
    with pytest.raises(ValueError, match="c2"):
        theory.vespo_phi_max(2.0, 0.0)
    with pytest.raises(ValueError, match="Z"):
        theory.vespo_second_moment_bound(-1.0, 1.0, 1.0)
