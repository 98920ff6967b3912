"""Mismatch that grows with the policy (issue 16 §3): relative and sharpness noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simkit.train import Mismatch, behaviour_log_probs, log_softmax
from simkit.train.mismatch import row_entropy


def test_relative_noise_is_its_formula():
    theta = np.random.default_rng(0).normal(size=(3, 2, 5))
    m = Mismatch(logit_noise=0.1, relative_noise=0.05)
    got = behaviour_log_probs(theta, m, np.random.default_rng(7))
    rng = np.random.default_rng(7)
    noisy = theta + 0.1 * rng.standard_normal(theta.shape)
    spread = np.abs(theta - theta.mean(axis=-1, keepdims=True))
    noisy = noisy + 0.05 * spread * rng.standard_normal(theta.shape)
    np.testing.assert_array_equal(got, log_softmax(noisy))


def test_sharpness_noise_is_its_formula_and_zero_on_uniform_rows():
    theta = np.random.default_rng(1).normal(size=(2, 3, 4))
    theta[0, 0] = 0.0  # a uniform row: no noise there
    m = Mismatch(sharpness_noise=0.3)
    got = behaviour_log_probs(theta, m, np.random.default_rng(3))
    scale = 0.3 * (1 - row_entropy(theta) / math.log(4))
    noisy = theta + scale[..., None] * np.random.default_rng(3).standard_normal(theta.shape)
    np.testing.assert_array_equal(got, log_softmax(noisy))
    np.testing.assert_array_equal(got[0, 0], log_softmax(theta)[0, 0])


def mean_kl(m, sharp):
    theta = sharp * np.random.default_rng(2).normal(size=(20, 4, 8))
    log_pi = log_softmax(theta)
    log_mu = behaviour_log_probs(theta, m, np.random.default_rng(0))
    return float((np.exp(log_pi) * (log_pi - log_mu)).sum(axis=-1).mean())


@pytest.mark.parametrize("m", [Mismatch(relative_noise=0.1), Mismatch(sharpness_noise=0.5)])
def test_growing_mismatch_grows_as_the_policy_sharpens(m):
    kls = [mean_kl(m, sharp) for sharp in (0.25, 1.0, 2.0)]
    assert kls[0] < kls[1] < kls[2]
    assert m.stochastic and not m.none and "noise" in m.label
    # the stationary logit noise does the opposite: its KL shrinks as the policy sharpens
    kls = [mean_kl(Mismatch(logit_noise=0.5), sharp) for sharp in (0.25, 1.0, 2.0)]
    assert kls[0] > kls[1] > kls[2]


def test_growing_mismatch_errors():
    with pytest.raises(ValueError, match="relative_noise"):
        Mismatch(relative_noise=-1)
    with pytest.raises(ValueError, match="sharpness_noise"):
        Mismatch(sharpness_noise=math.inf)
