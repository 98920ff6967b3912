"""Dashboard definitions of verl, TRL and ms-swift side by side, checked against closed forms
on a two-response example (simkit.diagnose.dashboards)."""

import math

import numpy as np
import pytest

from simkit.diagnose.dashboards import dashboards

# response 0: tokens with ρ = 2, 1/2; response 1: one token with ρ = 4 (then padding)
LOG_MU = np.log(np.array([[0.25, 0.5], [0.1, 0.3]]))
LOG_PI = LOG_MU + np.log(np.array([[2.0, 0.5], [4.0, 1.0]]))
MASK = np.array([[True, True], [True, False]])


def _values(**kw):
    return {(r["tool"], r["metric"]): r["value"] for r in dashboards(LOG_PI, LOG_MU, MASK, **kw)}


def test_definitions_match_closed_forms():
    v = _values()
    rho = np.array([2.0, 0.5, 4.0])
    assert v["verl", "rollout_corr/chi2_token"] == pytest.approx(np.mean(rho**2) - 1, abs=1e-12)
    # product vs geometric mean: W = (1, 4); geometric means (1, 4)
    assert v["verl", "rollout_corr/chi2_seq"] == pytest.approx((1 + 16) / 2 - 1, abs=1e-12)
    assert v["ms-swift", "chi2_seq"] == pytest.approx((1 + 16) / 2 - 1, abs=1e-12)
    assert v["verl", "rollout_corr/k3_kl"] == pytest.approx(
        np.mean(rho - 1 - np.log(rho)), abs=1e-12
    )
    w = np.minimum(rho, 2.0)  # verl clamps at its threshold before the ESS
    assert v["verl", "rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        1 / np.mean((w / (w.mean() + 1e-8)) ** 2), abs=1e-9
    )
    ws = np.clip(rho, 0.5, 2.0)
    assert v["ms-swift", "ess"] == pytest.approx(1 / np.mean((ws / (ws.mean() + 1e-8)) ** 2))
    p_pi, p_mu = np.array([0.5, 0.25, 0.4]), np.array([0.25, 0.5, 0.1])
    d = np.abs(p_pi - p_mu)
    assert v["verl", "training/rollout_probs_diff_mean"] == pytest.approx(d.mean(), abs=1e-12)
    assert v["verl", "training/rollout_probs_diff_std"] == pytest.approx(d.std(ddof=1), abs=1e-12)
    assert v["TRL", "sampling/sampling_logp_difference/max"] == pytest.approx(math.log(4))
    # TRL default: sequence ratios (1, 4), masked to 0 above 3 → (1, 0)
    assert v["TRL", "sampling/importance_sampling_ratio/mean"] == pytest.approx(0.5)
    assert v["TRL", "sampling/importance_sampling_ratio/max"] == pytest.approx(1.0)
    t = _values(trl_mode="token_truncate", trl_clip_max=3.0)
    assert t["TRL", "sampling/importance_sampling_ratio/mean"] == pytest.approx((2 + 0.5 + 3) / 3)


def test_long_responses_separate_product_from_geometric_mean():
    lr = np.full((2, 50), 0.05)  # ρ = e^0.05 on 50 tokens
    v = {
        (r["tool"], r["metric"]): r["value"]
        for r in dashboards(lr, np.zeros_like(lr), np.ones_like(lr, bool))
    }
    assert v["verl", "rollout_corr/chi2_seq"] == pytest.approx(math.exp(5.0) - 1)
    assert v["ms-swift", "chi2_seq"] == pytest.approx(math.exp(0.1) - 1)


def test_bad_trl_mode():
    with pytest.raises(ValueError, match="trl_mode 'seq' is not a TRL"):
        dashboards(LOG_PI, LOG_MU, MASK, trl_mode="seq")


def test_markdown_rows_keep_four_cells():
    import re

    from simkit.diagnose.dashboards import lines

    for line in lines(dashboards(LOG_PI, LOG_MU, MASK))[2:-1]:
        assert len(re.findall(r"(?<!\\)\|", line)) == 5, line  # |π − μ| is escaped
