"""The ``reliable`` tail check of composed rows (three policies): the tail of the π_old‖μ leg
counts. ν = N·(E c̄²)²/E c̄⁴ of a composed estimator is computed from its composed coefficient
c_mapping(π/π_old)·c_correction(π_old/μ), so an untruncated correction on a heavy-tailed
π_old‖μ leg (an arm that the inference engine starves) is flagged unreliable, while the same
mapping alone on π/μ — what the check used before — would pass."""

import math

import numpy as np
import pytest

from simkit import experiment, mappings, reliability
from simkit.envs import Bandit
from simkit.estimators import Estimator

N_DRAWS = 800  # reps·n of the runs below


def _triple():
    """π, π_old a mild step behind, μ = π_old with arm 0 starved to 8e-4 (a toxic tail)."""
    bandit = Bandit(logits=np.array([0.0, 0.3, -0.2, 0.1]), means=np.array([0.9, 0.2, 0.5, 0.4]))
    old = bandit.pi * np.exp(np.array([0.05, -0.05, 0.02, 0.0]))
    old /= old.sum()
    mu = old.copy()
    mu[0] = 8e-4
    mu /= mu.sum()
    return bandit, old, mu


def _nu_by_hand(bandit, old, mu, phi_mapping, phi_correction):
    """ν from per-arm numbers: c(a, sign) = φ_m(π_a/π_old_a, sign)·φ_c(π_old_a/μ_a, sign) on
    the atoms (arm a, reward 1: A = 1 − J(μ) > 0) with probability μ_a·p_a and (a, reward 0:
    A = −J(μ) < 0) with μ_a·(1 − p_a) (Bernoulli rewards of mean p_a)."""
    m2 = m4 = 0.0
    for a in range(bandit.pi.size):
        for positive, p in (
            (True, mu[a] * bandit.means[a]),
            (False, mu[a] * (1 - bandit.means[a])),
        ):
            c = float(phi_mapping(np.array(bandit.pi[a] / old[a]), positive)) * float(
                phi_correction(np.array(old[a] / mu[a]), positive)
            )
            m2 += p * c**2
            m4 += p * c**4
    return N_DRAWS * min(m2**2 / m4, 1.0)


def test_tail_draws_of_a_composed_row_use_the_composed_coefficient():
    bandit, old, mu = _triple()
    # dual clip bounds c by c_dual = 3 on both signs (PPO clip alone is unbounded for A < 0)
    ppo, is_token = mappings.get("dual_clip"), mappings.get("is_token")
    est = Estimator(ppo, correction=is_token)
    b = experiment.oracle_baseline(bandit, mu, est)
    nu = reliability.tail_draws(bandit, mu, est, N_DRAWS, b, old=old)
    assert nu == pytest.approx(_nu_by_hand(bandit, old, mu, ppo.phi, is_token.phi), rel=1e-12)
    assert nu < reliability.MIN_TAIL_DRAWS
    # the mapping alone on π/μ (what the check saw before) has a light tail: ν ≥ MIN_TAIL_DRAWS
    alone = reliability.tail_draws(bandit, mu, Estimator(ppo), N_DRAWS, b)
    assert alone >= reliability.MIN_TAIL_DRAWS
    # a truncated correction (token TIS, C = 2) bounds c: light again
    tis = Estimator(ppo, correction="tis_token")
    nu_tis = reliability.tail_draws(bandit, mu, tis, N_DRAWS, b, old=old)
    assert nu_tis >= reliability.MIN_TAIL_DRAWS


def test_a_heavy_pi_old_mu_leg_is_flagged_unreliable_in_run():
    bandit, old, mu = _triple()
    ests = [
        Estimator("dual_clip", correction="is_token"),
        Estimator("dual_clip", correction="tis_token"),
    ]
    flagged = []
    for seed in range(5):
        t = experiment.run(bandit, mu, ests, n=4, reps=200, exact=False, old=old, seed=seed)
        assert t.tail_draws.iloc[0] < reliability.MIN_TAIL_DRAWS
        flagged.append(bool(t.reliable.iloc[0]))
        assert math.isfinite(t.tail_draws.iloc[1])
        assert t.tail_draws.iloc[1] >= reliability.MIN_TAIL_DRAWS
    assert flagged == [False] * 5
