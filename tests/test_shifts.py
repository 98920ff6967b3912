"""Tests of simkit.shifts: the families, dial and dial_pair."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from simkit import shifts
from simkit.divergence import chi2, kl, tv

DIV = {"chi2": chi2, "kl": kl, "tv": tv}
PI = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01])
PI_WITH_ZERO = np.array([0.5, 0.0, 0.3, 0.15, 0.05])
ALL = ["temperature", "logit_noise", "mixture", "top_p", "top_k", "tail", "tilt"]


def _softmax(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@st.composite
def full_support_pi(draw, v_min=3, v_max=20):
    V = draw(st.integers(v_min, v_max))
    return _softmax(draw(arrays(np.float64, V, elements=st.floats(-4, 4, allow_nan=False))))


def _assert_rel(value, target, rtol=shifts.DIAL_RTOL):
    assert abs(value - target) <= rtol * target, (value, target)


# --- registry and hyperparameters -------------------------------------------------------------


def test_registry():
    assert shifts.available() == ALL
    assert isinstance(shifts.get("temperature", direction="sharpen"), shifts.Temperature)
    assert shifts.get("tilt", angle=0.5).label == "tilt(angle=0.5, n_tail=1)"
    with pytest.raises(KeyError, match="unknown shift family 'tempreature'"):
        shifts.get("tempreature")
    with pytest.raises(TypeError, match="has no hyperparameter"):
        shifts.get("mixture", weight=0.3)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("temperature", {"direction": "hotter"}, "direction must be"),
        ("logit_noise", {"seed": -1}, "seed must be"),
        ("logit_noise", {"seed": 1.5}, "seed must be"),
        ("top_p", {"fractional": "yes"}, "fractional must be a bool"),
        ("top_k", {"fractional": 1}, "fractional must be a bool"),
        ("tail", {"n_tokens": 0}, "n_tokens must be"),
        ("tilt", {"angle": 2.0}, "angle must be in"),
        ("tilt", {"n_tail": 0}, "n_tail must be"),
    ],
)
def test_hyperparameter_validation(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        shifts.get(name, **kwargs)


def test_families_are_frozen():
    fam = shifts.get("tail")
    with pytest.raises(AttributeError):
        fam.n_tokens = 3


# --- apply --------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(full_support_pi(), st.sampled_from(ALL), st.floats(0.0, 1.0))
def test_apply_gives_distributions_and_zero_strength_is_identity(pi, name, u):
    fam = shifts.get(name)
    np.testing.assert_allclose(fam.apply(pi, 0.0), pi, rtol=1e-12, atol=1e-15)
    s = u * min(fam.max_strength(pi), 20.0)
    mu = fam.apply(pi, s)
    assert mu.shape == pi.shape
    assert np.all(mu >= 0)
    assert mu.sum() == pytest.approx(1.0, abs=1e-12)


def test_apply_formulas():
    s = 0.7
    beta = math.exp(-s)
    expected = PI**beta / np.sum(PI**beta)
    np.testing.assert_allclose(shifts.get("temperature").apply(PI, s), expected, rtol=1e-13)
    expected = PI ** (1 / beta) / np.sum(PI ** (1 / beta))
    np.testing.assert_allclose(
        shifts.get("temperature", direction="sharpen").apply(PI, s), expected, rtol=1e-13
    )
    z = np.random.default_rng([3, shifts.NOISE_STREAM]).standard_normal(len(PI))
    expected = PI * np.exp(s * z) / np.sum(PI * np.exp(s * z))
    np.testing.assert_allclose(shifts.get("logit_noise", seed=3).apply(PI, s), expected, rtol=1e-13)
    np.testing.assert_allclose(
        shifts.get("mixture").apply(PI, 0.3), 0.7 * PI + 0.3 / len(PI), rtol=1e-15
    )
    # limits: flattening → uniform on the support, sharpening → the most likely token
    np.testing.assert_allclose(
        shifts.get("temperature").apply(PI_WITH_ZERO, 800.0),
        [0.25, 0, 0.25, 0.25, 0.25],
        atol=1e-15,
    )
    np.testing.assert_allclose(
        shifts.get("temperature", direction="sharpen").apply(PI, 800.0), np.eye(7)[0], atol=1e-15
    )


def test_logit_noise_is_deterministic():
    a = shifts.get("logit_noise", seed=1).apply(PI, 0.5)
    np.testing.assert_array_equal(a, shifts.get("logit_noise", seed=1).apply(PI, 0.5))
    assert not np.allclose(a, shifts.get("logit_noise", seed=2).apply(PI, 0.5))


def test_truncations():
    top_p = shifts.get("top_p")
    # p = 0.6: 0.4 fully, then 0.2 of the 0.25 token (fractional nucleus)
    np.testing.assert_allclose(
        top_p.apply(PI, 0.4), np.array([0.4, 0.2, 0, 0, 0, 0, 0]) / 0.6, rtol=1e-12, atol=1e-15
    )
    # the usual nucleus: the smallest set of mass >= 0.6 is {0.4, 0.25}
    np.testing.assert_allclose(
        shifts.get("top_p", fractional=False).apply(PI, 0.4),
        np.array([0.4, 0.25, 0, 0, 0, 0, 0]) / 0.65,
        rtol=1e-12,
    )
    np.testing.assert_allclose(top_p.apply(PI, 1.0), np.eye(7)[0], atol=0)
    top_k = shifts.get("top_k")
    np.testing.assert_allclose(top_k.apply(PI, 2.0), np.r_[PI[:5], 0, 0] / PI[:5].sum(), rtol=1e-13)
    half = np.r_[PI[:4], 0.5 * PI[4], 0, 0]
    np.testing.assert_allclose(top_k.apply(PI, 2.5), half / half.sum(), rtol=1e-13)
    np.testing.assert_allclose(
        shifts.get("top_k", fractional=False).apply(PI, 2.5), top_k.apply(PI, 2.0), rtol=1e-15
    )
    # zeros of π are not "tokens" to cut; ties: the higher index counts as less likely
    np.testing.assert_allclose(
        top_k.apply(PI_WITH_ZERO, 1.0), np.array([0.5, 0, 0.3, 0.15, 0]) / 0.95, rtol=1e-13
    )
    np.testing.assert_allclose(top_k.apply(np.full(4, 0.25), 3.0), np.eye(4)[0], atol=0)
    assert top_k.max_strength(PI_WITH_ZERO) == 3.0


def test_tail_closed_forms():
    """KL = m·s + log(1 − m + m e^{−s}), 1 + χ² = (1 − m + m e^{−s})(1 − m + m e^{s})."""
    for n_tokens, m in ((1, 0.01), (2, 0.04)):
        fam = shifts.get("tail", n_tokens=n_tokens)
        for s in (0.3, 2.0, 8.0):
            mu = fam.apply(PI, s)
            z_minus, z_plus = 1 - m + m * math.exp(-s), 1 - m + m * math.exp(s)
            assert kl(PI, mu) == pytest.approx(m * s + math.log(z_minus), rel=1e-12)
            assert chi2(PI, mu) == pytest.approx(z_minus * z_plus - 1, rel=1e-12)
    # same KL, far larger χ² than a temperature move: heavy-tailed ratios
    mu_tail = shifts.dial(PI, 0.05, "kl", "tail")
    mu_temp = shifts.dial(PI, 0.05, "kl", "temperature")
    assert chi2(PI, mu_tail) > 10 * chi2(PI, mu_temp)


def test_tilt_small_moves_have_unit_variance_directions():
    """For small s, KL ≈ s²/2 at both ends (û and v̂ have unit variance under π)."""
    for angle in (0.0, math.pi / 2):
        mu = shifts.get("tilt", angle=angle).apply(PI, 1e-3)
        assert kl(PI, mu) == pytest.approx(0.5e-6, rel=1e-2)


def test_apply_batches_row_by_row():
    rng = np.random.default_rng(0)
    pis = _softmax(rng.normal(size=(2, 3, 6)))
    strengths = rng.uniform(0.1, 0.9, size=(2, 3))
    for name in ALL:
        fam = shifts.get(name)
        mu = fam.apply(pis, strengths)
        assert mu.shape == pis.shape
        for idx in np.ndindex(2, 3):
            np.testing.assert_allclose(
                mu[idx], fam.apply(pis[idx], strengths[idx]), rtol=1e-13, atol=1e-16
            )
        np.testing.assert_allclose(
            fam.apply(pis, 0.5)[1, 2], fam.apply(pis[1, 2], 0.5), rtol=1e-13, atol=1e-16
        )


@pytest.mark.parametrize(
    ("name", "pi", "strength", "message"),
    [
        ("mixture", PI, 1.5, r"must be in \[0, 1\]"),
        ("top_k", PI, 6.5, r"must be in \[0, 6\]"),
        ("temperature", PI, -0.1, "must be finite and >= 0"),
        ("temperature", PI, np.nan, "must be finite and >= 0"),
        ("temperature", PI, [0.1, 0.2], "strength must be a scalar or of pi's batch shape"),
        ("tail", [1.0, 0.0, 0.0], 1.0, "n_tokens = 1 needs pi to have more than 1"),
        ("tilt", [1.0, 0.0], 1.0, "n_tail = 1 needs pi to have more than 1"),
        ("mixture", [0.5, 0.6], 0.1, "pi is not normalised"),
    ],
)
def test_apply_bad_inputs(name, pi, strength, message):
    with pytest.raises(ValueError, match=message):
        shifts.get(name).apply(pi, strength)


# --- dial ---------------------------------------------------------------------------------------

ROUND_TRIPS = [
    (name, kwargs, divergence, target)
    for name, kwargs in [
        ("temperature", {}),
        ("temperature", {"direction": "sharpen"}),
        ("logit_noise", {"seed": 4}),
        ("mixture", {}),
        ("tail", {}),
        ("tail", {"n_tokens": 3}),
        ("tilt", {"angle": 0.0}),
        ("tilt", {"angle": 0.8}),
        ("tilt", {"angle": math.pi / 2}),
    ]
    for divergence, target in [
        ("chi2", 1e-6),
        ("chi2", 0.3),
        ("kl", 0.02),
        ("kl", 0.2),
        ("tv", 0.005),
        ("tv", 0.008),
    ]
] + [
    (name, kwargs, "tv", target)
    for name, kwargs in [("top_p", {}), ("top_k", {})]
    for target in (1e-4, 0.01, 0.2, 0.55)
]


@pytest.mark.parametrize(("name", "kwargs", "divergence", "target"), ROUND_TRIPS)
def test_dial_round_trip(name, kwargs, divergence, target):
    mu, strength = shifts.dial(PI, target, divergence, name, return_strength=True, **kwargs)
    _assert_rel(DIV[divergence](PI, mu), target)
    np.testing.assert_allclose(mu, shifts.get(name, **kwargs).apply(PI, strength), rtol=1e-15)
    assert strength > 0
    # the simple call returns μ alone
    np.testing.assert_array_equal(shifts.dial(PI, target, divergence, name, **kwargs), mu)


@pytest.mark.parametrize("name", ["temperature", "mixture", "tail", "logit_noise", "tilt"])
@pytest.mark.parametrize("divergence", ["chi2", "kl", "tv"])
def test_dial_keeps_zeros_of_pi(name, divergence):
    target = 0.003
    mu = shifts.dial(PI_WITH_ZERO, target, divergence, name)
    _assert_rel(DIV[divergence](PI_WITH_ZERO, mu), target)
    if name != "mixture":  # every family but the uniform mixture keeps π's support
        assert mu[1] == 0.0


@settings(max_examples=25, deadline=None)
@given(full_support_pi(), st.floats(0.05, 0.95), st.sampled_from(["chi2", "kl", "tv"]))
def test_dial_round_trip_random_pi(pi, fraction, divergence):
    """Flattening and mixing both end at the uniform distribution: every value below
    D(π‖uniform) is reachable."""
    uniform = np.full_like(pi, 1 / len(pi))
    largest = DIV[divergence](pi, uniform)
    assume(largest > 1e-6)  # a nearly uniform π leaves only rounding-level targets
    target = fraction * largest
    for name in ("temperature", "mixture"):
        _assert_rel(DIV[divergence](pi, shifts.dial(pi, target, divergence, name)), target)


@settings(max_examples=25, deadline=None)
@given(full_support_pi(), st.floats(0.01, 3.0))
def test_dial_unbounded_families_random_pi(pi, target):
    for name in ("tail", "logit_noise"):
        _assert_rel(chi2(pi, shifts.dial(pi, target, "chi2", name)), target)
    _assert_rel(kl(pi, shifts.dial(pi, target / 10, "kl", "tilt", angle=0.3)), target / 10)


def test_dial_batches():
    rng = np.random.default_rng(1)
    pis = _softmax(rng.normal(size=(2, 3, 5)))
    targets = rng.uniform(0.005, 0.02, size=(2, 3))
    mu, strength = shifts.dial(pis, targets, "kl", "mixture", return_strength=True)
    assert mu.shape == pis.shape and strength.shape == (2, 3)
    np.testing.assert_allclose(kl(pis, mu), targets, rtol=shifts.DIAL_RTOL)
    mu = shifts.dial(pis, 0.05, "tv", "temperature")
    np.testing.assert_allclose(tv(pis, mu), 0.05, rtol=shifts.DIAL_RTOL)
    # a zero target gives π itself, row by row
    zero = targets <= np.median(targets)
    mu = shifts.dial(pis, np.where(zero, 0.0, targets), "chi2", "tail")
    np.testing.assert_allclose(chi2(pis, mu)[~zero], targets[~zero], rtol=shifts.DIAL_RTOL)
    np.testing.assert_array_equal(mu[zero], pis[zero])


def test_dial_accepts_a_family_instance():
    fam = shifts.get("tilt", angle=0.4)
    _assert_rel(kl(PI, shifts.dial(PI, 0.1, "kl", fam)), 0.1)
    with pytest.raises(TypeError, match="were given with a family instance"):
        shifts.dial(PI, 0.1, "kl", fam, angle=0.2)


@pytest.mark.parametrize(
    ("name", "divergence", "target", "largest"),
    [
        ("mixture", "chi2", 50.0, chi2(PI, np.full(7, 1 / 7))),
        ("mixture", "kl", 5.0, kl(PI, np.full(7, 1 / 7))),
        ("temperature", "chi2", 50.0, chi2(PI, np.full(7, 1 / 7))),
        ("temperature", "tv", 0.9, tv(PI, np.full(7, 1 / 7))),
        ("top_p", "tv", 0.9, 1 - PI.max()),
        ("top_k", "tv", 0.9, 1 - PI.max()),
        ("tail", "tv", 0.5, PI.min()),
    ],
)
def test_dial_unreachable_names_the_largest_value(name, divergence, target, largest):
    with pytest.raises(ValueError, match="is not reachable") as info:
        shifts.dial(PI, target, divergence, name)
    assert f"{largest:.6g}" in str(info.value)
    assert f"{name}" in str(info.value)


@pytest.mark.parametrize("name", ["top_p", "top_k"])
@pytest.mark.parametrize("divergence", ["chi2", "kl"])
def test_dial_truncations_refuse_chi2_and_kl(name, divergence):
    with pytest.raises(ValueError, match=r"cuts π's support.*infinite.*only 'tv'"):
        shifts.dial(PI, 0.1, divergence, name)


@pytest.mark.parametrize("name", ["top_p", "top_k"])
def test_dial_discrete_truncation_reports_the_jump(name):
    # TV of the usual nucleus / top-k jumps from 0.2 (cut 0.1+0.06+0.03+0.01) to 0.35
    with pytest.raises(ValueError, match=r"jumps from 0\.2 to 0\.35"):
        shifts.dial(PI, 0.22, "tv", name, fractional=False)
    _assert_rel(tv(PI, shifts.dial(PI, 0.2, "tv", name, fractional=False)), 0.2)


def test_dial_bad_inputs():
    with pytest.raises(ValueError, match="divergence must be one of"):
        shifts.dial(PI, 0.1, "hellinger")
    with pytest.raises(ValueError, match="target must be finite and >= 0"):
        shifts.dial(PI, -0.1)
    with pytest.raises(ValueError, match="target must be a scalar or of pi's batch shape"):
        shifts.dial(PI, [0.1, 0.2])
    with pytest.raises(ValueError, match="pi must have a last axis"):
        shifts.dial(0.5, 0.1)
    with pytest.raises(KeyError, match="unknown shift family"):
        shifts.dial(PI, 0.1, "kl", "nope")
    np.testing.assert_array_equal(shifts.dial(PI, 0.0, "kl"), PI)


# --- dial_pair ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kl_target", "chi2_target"), [(0.05, 0.1), (0.05, 3.0), (0.2, 0.5), (0.2, 5.0), (0.01, 0.025)]
)
def test_dial_pair_round_trip(kl_target, chi2_target):
    mu, angle, strength = shifts.dial_pair(PI, kl=kl_target, chi2=chi2_target, return_params=True)
    _assert_rel(kl(PI, mu), kl_target)
    _assert_rel(chi2(PI, mu), chi2_target)
    assert 0 <= angle <= math.pi / 2 and strength > 0
    np.testing.assert_allclose(mu, shifts.get("tilt", angle=angle).apply(PI, strength), rtol=1e-13)


def test_dial_pair_same_kl_arbitrarily_large_chi2_with_a_rare_token():
    """The notation page's point (docs/reference.md §F): a KL trust region does not bound χ².
    With a token of probability 1e-4, KL = 0.05 comes with χ² = 0.12 or with χ² = 1000."""
    pi = np.array([0.5, 0.3, 0.1999, 1e-4])
    for c in (0.12, 1000.0):
        mu = shifts.dial_pair(pi, kl=0.05, chi2=c)
        _assert_rel(kl(pi, mu), 0.05)
        _assert_rel(chi2(pi, mu), c)


@settings(max_examples=10, deadline=None)
@given(full_support_pi(), st.floats(0.005, 0.5), st.floats(0.1, 0.9))
def test_dial_pair_random_pi(pi, kl_target, u):
    """Any χ² between the tilt's two ends at this KL is reached (intermediate values)."""
    # the flattening direction û (−log π) and the starving one v̂ (−1 on the rarest token),
    # both standardised under π, must not be opposite: when π takes two values they are, and
    # the angles between reach no intermediate χ²
    assume(np.ptp(np.log(pi)) > 1e-3)  # a uniform π has no flattening direction
    u_dir = -np.log(pi)
    u_dir = (u_dir - pi @ u_dir) / np.sqrt(pi @ (u_dir - pi @ u_dir) ** 2)
    rare = len(pi) - 1 - np.argmin(pi[::-1])  # ties: the higher index is the rarest
    m = pi[rare]
    v_dir = (m - (np.arange(len(pi)) == rare)) / np.sqrt(m * (1 - m))
    assume(pi @ (u_dir * v_dir) > -0.999)
    # a rarest token of mass >= 2e-3 lets KL reach 0.5 before μ underflows (starving end)
    assume(pi.min() >= 2e-3)
    ends = [chi2(pi, shifts.dial(pi, kl_target, "kl", "tilt", angle=a)) for a in (0.0, math.pi / 2)]
    lo, hi = min(ends), max(ends)
    assume(hi > lo * (1 + 1e-6))
    c = lo * (hi / lo) ** u
    mu = shifts.dial_pair(pi, kl=kl_target, chi2=c)
    _assert_rel(kl(pi, mu), kl_target)
    _assert_rel(chi2(pi, mu), c)


def test_dial_pair_infeasible_pair():
    with pytest.raises(ValueError, match=r"infeasible.*KL < log\(1 \+ χ²\)") as info:
        shifts.dial_pair(PI, kl=0.5, chi2=0.1)
    assert f"{math.expm1(0.5):.6g}" in str(info.value)
    with pytest.raises(ValueError, match="infeasible"):
        shifts.dial_pair(PI, kl=0.0, chi2=0.1)


def test_dial_pair_outside_the_family_region():
    with pytest.raises(ValueError, match="is not reachable with family 'tilt'") as info:
        shifts.dial_pair(PI, kl=0.05, chi2=1e4)
    message = str(info.value)
    lo, hi = (float(x) for x in re.search(r"χ² from (\S+) to (\S+) \(angles", message).groups())
    assert math.expm1(0.05) < lo < hi < 1e4
    # the quoted range is reachable
    for c in (lo * 1.001, math.sqrt(lo * hi), hi * 0.999):
        _assert_rel(chi2(PI, shifts.dial_pair(PI, kl=0.05, chi2=c)), c)


def test_dial_pair_batches_and_zero():
    pis = np.stack([PI, PI[::-1]])
    mu = shifts.dial_pair(pis, kl=[0.05, 0.1], chi2=[0.5, 0.3])
    np.testing.assert_allclose(kl(pis, mu), [0.05, 0.1], rtol=shifts.DIAL_RTOL)
    np.testing.assert_allclose(chi2(pis, mu), [0.5, 0.3], rtol=shifts.DIAL_RTOL)
    np.testing.assert_array_equal(shifts.dial_pair(PI, kl=0.0, chi2=0.0), PI)


def test_dial_pair_bad_inputs():
    with pytest.raises(ValueError, match="kl must be finite and >= 0"):
        shifts.dial_pair(PI, kl=-0.1, chi2=0.5)
    with pytest.raises(ValueError, match="n_tail = 7 needs pi"):
        shifts.dial_pair(PI, kl=0.1, chi2=0.5, n_tail=7)


def test_logit_noise_direction_is_not_the_logits_drawn_from_the_same_seed():
    # Regression: with z = default_rng(seed).standard_normal(V), a bandit whose logits were drawn
    # as default_rng(0).normal(size=V) made logit_noise(seed=0) an exact sharpening temperature.
    V = 16
    logits = np.random.default_rng(0).normal(0.0, 1.0, V)
    pi = np.exp(logits - logits.max())
    pi /= pi.sum()
    mu = shifts.dial(pi, 1.0, divergence="chi2", family="logit_noise")
    mu_temp = shifts.dial(
        pi, 1.0, divergence="chi2", family=shifts.get("temperature", direction="sharpen")
    )
    assert np.max(np.abs(mu - mu_temp)) > 1e-3
    z = shifts.get("logit_noise").direction(V)
    assert abs(np.corrcoef(z, logits)[0, 1]) < 0.9
