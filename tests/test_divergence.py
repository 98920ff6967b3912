"""Tests of simkit.divergence: exact divergences, sequence-level closed forms, Monte Carlo."""

from __future__ import annotations

import functools
import itertools
import math
from decimal import Decimal, getcontext

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.special import rel_entr

from simkit import divergence as dv

SETTINGS = settings(max_examples=60, deadline=None)


def _softmax(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _logits(V):
    return arrays(np.float64, V, elements=st.floats(-5, 5, allow_nan=False))


@st.composite
def prob_pairs(draw, v_min=2, v_max=20):
    """Two distributions on the same V with full support (no degenerate zeros)."""
    V = draw(st.integers(v_min, v_max))
    return _softmax(draw(_logits(V))), _softmax(draw(_logits(V)))


# --- exact values -----------------------------------------------------------------------------

P = np.array([0.5, 0.3, 0.2])
Q = np.array([0.2, 0.3, 0.5])


def test_hand_computed_values():
    # χ² = .25/.2 + .09/.3 + .04/.5 − 1 = 0.63; KL = .5 ln 2.5 + .2 ln .4 = .3 ln 2.5; TV = .3
    assert dv.chi2(P, Q) == pytest.approx(0.63, rel=1e-14)
    assert dv.kl(P, Q) == pytest.approx(0.3 * math.log(2.5), rel=1e-14)
    assert dv.tv(P, Q) == pytest.approx(0.3, rel=1e-14)
    bc = 2 * math.sqrt(0.1) + 0.3
    assert dv.bhattacharyya(P, Q) == pytest.approx(bc, rel=1e-14)
    assert dv.hellinger(P, Q) == pytest.approx(math.sqrt(1 - bc), rel=1e-12)
    # D_∞ = log max π/μ = log 2.5; D_0 = −log μ(supp π) = 0; D_{1/2} = −2 log BC
    assert dv.renyi(P, Q, np.inf) == pytest.approx(math.log(2.5), rel=1e-14)
    assert dv.renyi(P, Q, 0.0) == pytest.approx(0.0, abs=1e-15)
    assert dv.renyi(P, Q, 0.5) == pytest.approx(-2 * math.log(bc), rel=1e-12)


@SETTINGS
@given(prob_pairs())
def test_match_textbook_formulas(pair):
    p, q = pair
    np.testing.assert_allclose(dv.chi2(p, q), np.sum(p * p / q) - 1, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(dv.kl(p, q), np.sum(rel_entr(p, q)), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(dv.tv(p, q), 0.5 * np.abs(p - q).sum(), rtol=1e-12)
    h2 = 0.5 * np.sum((np.sqrt(p) - np.sqrt(q)) ** 2)
    np.testing.assert_allclose(dv.hellinger(p, q) ** 2, h2, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(
        dv.hellinger(p, q) ** 2, 1 - dv.bhattacharyya(p, q), rtol=1e-9, atol=1e-14
    )
    np.testing.assert_allclose(
        dv.renyi(p, q, 3.0), np.log(np.sum(p**3 * q**-2)) / 2, rtol=1e-10, atol=1e-14
    )


@SETTINGS
@given(prob_pairs())
def test_pinsker_chain(pair):
    """TV² ≤ ½KL ≤ ½log(1+χ²) ≤ ½χ² (Pinsker; KL ≤ log(1+χ²) by Jensen; log(1+x) ≤ x)."""
    p, q = pair
    t, k, c = dv.tv(p, q), dv.kl(p, q), dv.chi2(p, q)
    slack = 1e-13
    assert t * t <= 0.5 * k + slack
    assert k <= math.log1p(c) + slack
    assert math.log1p(c) <= c + slack


@SETTINGS
@given(prob_pairs())
def test_hellinger_tv_bounds(pair):
    """H² ≤ TV ≤ H·√(2 − H²) ≤ √2·H with H² = 1 − BC (Le Cam 1973; Tsybakov 2009, Lemma 2.3)."""
    p, q = pair
    h, t = dv.hellinger(p, q), dv.tv(p, q)
    assert h * h <= t + 1e-13
    assert t <= h * math.sqrt(2 - h * h) + 1e-13
    assert 0 <= h <= 1


@SETTINGS
@given(prob_pairs())
def test_zero_iff_equal(pair):
    p, q = pair
    for fn in (dv.chi2, dv.kl, dv.tv, dv.hellinger):
        assert fn(p, p) == pytest.approx(0.0, abs=1e-15)
    assert dv.renyi(p, p, 2.0) == pytest.approx(0.0, abs=1e-14)
    if np.max(np.abs(p - q)) > 1e-6:
        for fn in (dv.chi2, dv.kl, dv.tv, dv.hellinger):
            assert fn(p, q) > 0
        assert dv.renyi(p, q, 2.0) > 0


@SETTINGS
@given(prob_pairs())
def test_renyi_orders(pair):
    """α = 2 is log(1+χ²), α → 1 is KL, and D_α is non-decreasing in α (van Erven &
    Harremoës 2014, Thm 3)."""
    p, q = pair
    c, k = dv.chi2(p, q), dv.kl(p, q)
    np.testing.assert_allclose(dv.renyi(p, q, 2.0), math.log1p(c), rtol=1e-9, atol=1e-14)
    assert dv.renyi(p, q, 1.0) == k
    for h in (1e-6, -1e-6):
        assert abs(dv.renyi(p, q, 1.0 + h) - k) <= 1e-4 * (1 + k)
    orders = [0.0, 0.3, 0.5, 0.9, 1.0, 1.5, 2.0, 4.0, np.inf]
    values = [dv.renyi(p, q, a) for a in orders]
    assert all(a <= b + 1e-12 * (1 + abs(b)) for a, b in itertools.pairwise(values))


def _decimal_divergences(mu, d):
    """High-precision (50 digits) KL and χ² of π = μ(1 + d) against μ, from the floats given."""
    getcontext().prec = 50
    mu_dec = [Decimal(float(x)) for x in mu]
    pi = [m * (1 + Decimal(float(x))) for m, x in zip(mu_dec, d)]
    kl = sum(pp * (pp / m).ln() for pp, m in zip(pi, mu_dec)) - sum(pi) + sum(mu_dec)
    chi2 = sum((pp - m) ** 2 / m for pp, m in zip(pi, mu_dec))
    return [float(pp) for pp in pi], float(kl), float(chi2)


@pytest.mark.parametrize("eps", [1e-3, 1e-6, 1e-8])
def test_tiny_divergences_are_accurate(eps):
    """A naive Σ π log(π/μ) loses ~eps/d² relative accuracy (1e-4 at d = 1e-6); the project's
    forms stay at rounding level. Reference: 50-digit decimal arithmetic."""
    rng = np.random.default_rng(7)
    mu = _softmax(rng.normal(size=12))
    d = rng.normal(size=12)
    d = eps * (d - np.sum(mu * d))  # Σ μ d = 0 so that π = μ(1 + d) sums to 1
    pi_list, kl_ref, chi2_ref = _decimal_divergences(mu, d)
    pi = np.array(pi_list)
    # π's rounding perturbs d by ~1e-16 relative: the references move by ~1e-16/eps relative
    assert dv.kl(pi, mu) == pytest.approx(kl_ref, rel=1e-7)
    assert dv.chi2(pi, mu) == pytest.approx(chi2_ref, rel=1e-7)


def test_support_mismatch_gives_inf_not_nan():
    pi = np.array([0.5, 0.5, 0.0])
    mu = np.array([1.0, 0.0, 0.0])
    assert dv.chi2(pi, mu) == np.inf
    assert dv.kl(pi, mu) == np.inf
    for alpha in (1.0, 1.5, 2.0, np.inf):
        assert dv.renyi(pi, mu, alpha) == np.inf
    # order < 1: the missing category contributes nothing; D_{1/2} = −2 log √0.5 = log 2
    assert dv.renyi(pi, mu, 0.5) == pytest.approx(math.log(2), rel=1e-14)
    assert dv.tv(pi, mu) == pytest.approx(0.5)
    assert dv.hellinger(pi, mu) ** 2 == pytest.approx(1 - math.sqrt(0.5), rel=1e-14)
    # μ covering more than π: 0·log 0 = 0, finite everywhere
    assert dv.kl(mu, pi) == pytest.approx(math.log(2), rel=1e-14)
    assert dv.chi2(mu, pi) == pytest.approx(1.0, rel=1e-14)
    batch = dv.kl(np.stack([pi, mu]), np.stack([mu, mu]))
    assert batch[0] == np.inf and batch[1] == 0.0
    assert not np.any(np.isnan(batch))


def test_broadcasting_matches_row_by_row():
    rng = np.random.default_rng(3)
    pis = _softmax(rng.normal(size=(2, 3, 5)))
    mu = _softmax(rng.normal(size=5))
    for fn in (dv.chi2, dv.kl, dv.tv, dv.hellinger, dv.bhattacharyya):
        out = fn(pis, mu)
        assert out.shape == (2, 3)
        for idx in np.ndindex(2, 3):
            assert out[idx] == pytest.approx(fn(pis[idx], mu), rel=1e-14)
    assert dv.renyi(pis, mu, 0.7).shape == (2, 3)
    assert dv.renyi(mu, pis, np.inf).shape == (2, 3)


@pytest.mark.parametrize(
    ("pi", "mu", "message"),
    [
        ([0.5, 0.6, -0.1], [0.5, 0.5, 0.0], "pi contains negative"),
        ([0.5, 0.5, 0.0], [0.4, 0.4, 0.1], "mu is not normalised"),
        ([0.5, 0.5], [0.2, 0.3, 0.5], "shape mismatch"),
        (np.full((2, 3), 1 / 3), np.full((4, 3), 1 / 3), "do not broadcast"),
        (1.0, [1.0], "pi must have a last axis"),
        ([0.5, 0.5], [np.nan, 1.0], "mu contains non-finite"),
    ],
)
def test_bad_inputs(pi, mu, message):
    for fn in (dv.chi2, dv.kl, dv.tv, dv.hellinger, dv.bhattacharyya):
        with pytest.raises(ValueError, match=message):
            fn(pi, mu)
    with pytest.raises(ValueError, match=message):
        dv.renyi(pi, mu, 2.0)


def test_renyi_rejects_bad_order():
    with pytest.raises(ValueError, match="alpha must be in"):
        dv.renyi(P, Q, -0.5)
    with pytest.raises(ValueError, match="alpha must be in"):
        dv.renyi(P, Q, float("nan"))


# --- sequence level: closed forms against enumeration of product distributions -----------------


def _product(dists):
    """Joint distribution of independent positions, flattened: (V^T,)."""
    return functools.reduce(np.multiply.outer, dists).ravel()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(2, 4), st.data())
def test_sequence_closed_forms_match_enumeration(T, V, data):
    pis = [_softmax(data.draw(_logits(V))) for _ in range(T)]
    mus = [_softmax(data.draw(_logits(V))) for _ in range(T)]
    joint_pi, joint_mu = _product(pis), _product(mus)
    chi2_t = np.array([dv.chi2(p, q) for p, q in zip(pis, mus)])
    kl_t = np.array([dv.kl(p, q) for p, q in zip(pis, mus)])
    tv_t = np.array([dv.tv(p, q) for p, q in zip(pis, mus)])
    h_t = np.array([dv.hellinger(p, q) for p, q in zip(pis, mus)])
    # the joint's products are rounded: absolute agreement at rounding level for tiny values
    tol = {"rtol": 1e-10, "atol": 1e-15}
    np.testing.assert_allclose(dv.chi2_seq(chi2_t), dv.chi2(joint_pi, joint_mu), **tol)
    np.testing.assert_allclose(dv.kl_seq(kl_t), dv.kl(joint_pi, joint_mu), **tol)
    for alpha in (0.5, 2.0, 3.0):
        r_t = np.array([dv.renyi(p, q, alpha) for p, q in zip(pis, mus)])
        np.testing.assert_allclose(
            dv.renyi_seq(r_t), dv.renyi(joint_pi, joint_mu, alpha), rtol=1e-9, atol=1e-13
        )
    np.testing.assert_allclose(
        dv.hellinger_seq(h_t), dv.hellinger(joint_pi, joint_mu), rtol=1e-9, atol=1e-13
    )
    exact_tv = dv.tv(joint_pi, joint_mu)
    for kwargs in (
        {},
        {"hellinger_tok": h_t},
        {"kl_tok": kl_t},
        {"chi2_tok": chi2_t},
        {"hellinger_tok": h_t, "kl_tok": kl_t, "chi2_tok": chi2_t},
    ):
        lo, hi = dv.tv_seq_bounds(tv_t, **kwargs)
        assert lo - 1e-12 <= exact_tv <= hi + 1e-12
    # the coupling bound 1 − Π(1 − TV_t) is an upper bound
    assert exact_tv <= 1 - np.prod(1 - tv_t) + 1e-12


def test_one_minus_product_is_not_a_lower_bound():
    """Two positions Bernoulli(0.5) vs Bernoulli(0.6): TV_t = 0.1, 1 − 0.9² = 0.19 but the
    product TV is 0.11 (|.25−.16| + |.25−.24|·2 + |.25−.36| = 0.22, halved)."""
    p, q = np.array([0.5, 0.5]), np.array([0.4, 0.6])
    exact = dv.tv(_product([p, p]), _product([q, q]))
    assert exact == pytest.approx(0.11, rel=1e-12)
    lo, hi = dv.tv_seq_bounds([0.1, 0.1])
    assert hi == pytest.approx(0.19, rel=1e-12)
    assert lo <= exact < 1 - 0.9**2


def test_sequence_functions_reduce_along_axis():
    chi2_t = np.array([[0.1, 0.2, 0.3], [0.0, 0.0, 0.5]])
    np.testing.assert_allclose(dv.chi2_seq(chi2_t), [1.1 * 1.2 * 1.3 - 1, 0.5], rtol=1e-14)
    np.testing.assert_allclose(dv.chi2_seq(chi2_t.T, axis=0), dv.chi2_seq(chi2_t), rtol=1e-15)
    np.testing.assert_allclose(dv.kl_seq(chi2_t, axis=0), [0.1, 0.2, 0.8], rtol=1e-15)
    # rl-collapse's numbers: 1.01^200 ≈ 7.3 and 1.05^200 ≈ 17 293 (docs/reference.md §F)
    assert dv.chi2_seq(np.full(200, 0.01)) + 1 == pytest.approx(1.01**200, rel=1e-12)
    assert dv.chi2_seq(np.full(200, 0.05)) + 1 == pytest.approx(17292.58, rel=1e-6)
    assert dv.chi2_seq([0.1, np.inf]) == np.inf
    assert dv.hellinger_seq([1.0, 0.2]) == 1.0
    lo, hi = dv.tv_seq_bounds(np.array([[0.1, 0.2], [0.0, 0.0]]))
    assert lo.shape == hi.shape == (2,)
    assert lo[1] == hi[1] == 0.0


@pytest.mark.parametrize(
    ("fn", "arg", "message"),
    [
        (dv.chi2_seq, [0.1, -0.2], "chi2_tok must be >= 0"),
        (dv.kl_seq, [0.1, np.nan], "kl_tok contains NaN"),
        (dv.renyi_seq, 0.3, "renyi_tok must have an axis"),
        (dv.hellinger_seq, [0.5, 1.5], "hellinger_tok must be <= 1"),
        (dv.tv_seq_bounds, [0.5, 1.5], "tv_tok must be <= 1"),
    ],
)
def test_sequence_bad_inputs(fn, arg, message):
    with pytest.raises(ValueError, match=message):
        fn(arg)


def test_tv_seq_bounds_shape_mismatch():
    with pytest.raises(ValueError, match="kl_tok has"):
        dv.tv_seq_bounds([0.1, 0.2], kl_tok=[0.1, 0.2, 0.3])


# --- Monte Carlo --------------------------------------------------------------------------------

Z = 5.0  # |estimate − truth| ≤ Z·SE, SE from the same draws


@pytest.fixture(scope="module")
def mc_setup():
    rng = np.random.default_rng(20240601)
    pi = np.array([0.6, 0.2, 0.1, 0.05, 0.03, 0.02])
    mu = np.array([0.3, 0.2, 0.2, 0.1, 0.1, 0.1])
    y = rng.choice(len(mu), size=200_000, p=mu)
    log_ratio = np.log(pi[y]) - np.log(mu[y])
    return pi, mu, log_ratio


def _within(est: dv.MCEstimate, truth: float):
    assert est.se > 0
    assert abs(est.value - truth) <= Z * est.se, (est, truth)


def test_chi2_and_tv_mc(mc_setup):
    pi, mu, lr = mc_setup
    _within(dv.chi2_mc(lr), dv.chi2(pi, mu))
    _within(dv.tv_mc(lr), dv.tv(pi, mu))


def test_kl_mc_both_directions(mc_setup):
    pi, mu, lr = mc_setup
    forward, reverse = dv.kl(pi, mu), dv.kl(mu, pi)
    # KL(π‖μ) ≈ 0.244, KL(μ‖π) ≈ 0.281: over 20 SEs apart, so a swapped direction fails
    assert abs(forward - reverse) > 0.03
    for est in ("k1", "k3"):
        _within(dv.kl_mc(lr, est, "forward"), forward)
        _within(dv.kl_mc(lr, est, "reverse"), reverse)
    # k2 is biased for the KL: it is unbiased for E_μ[½(log w)²] (reverse) and
    # E_π[½(log w)²] (forward)
    log_w = np.log(pi / mu)
    _within(dv.kl_mc(lr, "k2", "reverse"), np.sum(mu * 0.5 * log_w**2))
    _within(dv.kl_mc(lr, "k2", "forward"), np.sum(pi * 0.5 * log_w**2))
    # the default is the project's forward KL(π‖μ) with the control-variate form
    assert dv.kl_mc(lr) == dv.kl_mc(lr, "k3", "forward")
    # k3 has less variance than k1 here (Schulman 2020)
    assert dv.kl_mc(lr, "k3", "reverse").se < dv.kl_mc(lr, "k1", "reverse").se


def test_k2_agrees_with_kl_to_second_order():
    """E_μ[½(log w)²] − KL(μ‖π) = O(δ³) when π = μ(1 + δ·z) (Schulman 2020)."""
    rng = np.random.default_rng(11)
    mu = _softmax(rng.normal(size=8))
    z = rng.normal(size=8)
    z -= np.sum(mu * z)
    gaps = []
    for delta in (1e-2, 1e-3):
        pi = mu * (1 + delta * z)
        k2 = np.sum(mu * 0.5 * np.log(pi / mu) ** 2)
        gaps.append(abs(k2 - dv.kl(mu, pi)) / dv.kl(mu, pi))
    # the relative gap is O(δ): it shrinks about tenfold when δ does
    assert 0.05 * gaps[0] < gaps[1] < 0.2 * gaps[0]


def test_mc_batched_rows_and_ci(mc_setup):
    _, _, lr = mc_setup
    rows = lr[:100_000].reshape(4, 25_000)
    est = dv.chi2_mc(rows)
    assert est.value.shape == est.se.shape == (4,)
    for i in range(4):
        single = dv.chi2_mc(rows[i])
        assert est.value[i] == pytest.approx(single.value, rel=1e-12)
        assert est.se[i] == pytest.approx(single.se, rel=1e-12)
    lo, hi = dv.kl_mc(rows, "k1", "reverse").ci(z=2.0)
    assert np.all(lo < hi)
    single = dv.tv_mc(rows[0])
    assert single.ci(0.0) == (single.value, single.value)
    with pytest.raises(ValueError, match="z must be"):
        single.ci(-1.0)


def test_mc_extreme_log_ratios():
    # ratio 0 (π(y) = 0): reverse KL infinite, forward terms 0, χ² and TV finite
    lr = np.array([-np.inf, 0.1, -0.2, 0.05])
    assert dv.kl_mc(lr, "k1", "reverse").value == np.inf
    assert dv.kl_mc(lr, "k3", "reverse").value == np.inf
    assert np.isfinite(dv.kl_mc(lr, "k3", "forward").value)
    assert np.isfinite(dv.chi2_mc(lr).value) and np.isfinite(dv.tv_mc(lr).value)
    # a huge ratio: the estimate overflows to inf, never NaN
    big = np.array([800.0, 0.0, 0.0])
    assert dv.chi2_mc(big).value == np.inf
    assert dv.kl_mc(big, "k1", "forward").value == np.inf
    # large but representable: e^{2·300}/3 − 1, computed through scaling
    est = dv.chi2_mc(np.array([300.0, 0.0, 0.0]))
    assert est.value == pytest.approx(math.exp(600) / 3, rel=1e-12)


def test_ess():
    rng = np.random.default_rng(5)
    log_w = rng.normal(size=1000)
    w = np.exp(log_w)
    assert dv.ess(log_w) == pytest.approx(w.sum() ** 2 / np.sum(w * w), rel=1e-12)
    assert dv.ess_fraction(log_w) == pytest.approx(dv.ess(log_w) / 1000, rel=1e-15)
    # invariant to a constant shift, so huge log-weights are fine (a naive exp overflows)
    assert dv.ess(log_w + 5000.0) == pytest.approx(dv.ess(log_w), rel=1e-10)
    assert dv.ess(np.zeros(7)) == pytest.approx(7.0, rel=1e-14)
    assert dv.ess(np.array([0.0, -np.inf, -np.inf])) == pytest.approx(1.0, rel=1e-14)
    assert dv.ess(np.full(3, -np.inf)) == 0.0
    batch = dv.ess(log_w.reshape(10, 100))
    assert batch.shape == (10,)
    assert batch[3] == pytest.approx(dv.ess(log_w[300:400]), rel=1e-12)


@pytest.mark.parametrize(
    ("log_ratio", "message"),
    [
        (0.3, "must have a last axis"),
        ([0.3], "at least 2 samples"),
        ([0.1, np.nan], "contains NaN"),
        ([0.1, np.inf], r"contains \+inf"),
    ],
)
def test_mc_bad_inputs(log_ratio, message):
    for fn in (dv.chi2_mc, dv.kl_mc, dv.tv_mc):
        with pytest.raises(ValueError, match=message):
            fn(log_ratio)
    with pytest.raises(ValueError, match=message):
        dv.ess(log_ratio)


def test_kl_mc_bad_options():
    with pytest.raises(ValueError, match="estimator must be one of"):
        dv.kl_mc([0.1, 0.2], estimator="k4")
    with pytest.raises(ValueError, match="direction must be"):
        dv.kl_mc([0.1, 0.2], direction="backward")
