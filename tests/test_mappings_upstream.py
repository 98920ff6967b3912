"""Closed-form checks of the mappings added from the verl / TRL / VESPO comparison (issue 15):
kl_rs, clip_cov, kl_cov, batch-normalised TIS, the new presets and the ``kept`` tokens.

Each coefficient is checked on hand-built batches whose answer is written down in closed form.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from simkit.mappings import get
from simkit.mappings.rejection import KL_RS_CRITERIA


def test_kl_rs_token_k2_keeps_exactly_the_tokens_with_half_square_below_u():
    # ½x² ≤ 0.5 ⇔ |x| ≤ 1
    lr = np.array([[0.0, 0.99, -0.99, 1.01, -1.01, 3.0]])
    mask = np.ones(lr.shape, bool)
    c = get("kl_rs", criteria="token_k2", u=0.5).coefficients(lr, mask, np.ones(1))
    np.testing.assert_array_equal(c, [[1, 1, 1, 0, 0, 0]])


def test_kl_rs_sequence_criteria_in_closed_form():
    x = 0.3
    k3 = math.expm1(x) - x  # 0.04986…
    lr = np.array([[x, x, 0.0], [x, 0.0, 0.0]])
    mask = np.array([[True, True, True], [True, True, False]])
    adv = np.array([1.0, -1.0])
    cases = {
        # row sums 2·k3 and k3; means 2k3/3 and k3/2; max k3 and k3
        ("seq_sum_k3", 1.5 * k3): [0, 1],
        ("seq_mean_k3", 0.6 * k3): [0, 1],
        ("seq_mean_k3", 0.7 * k3): [1, 1],
        ("seq_max_k3", 0.99 * k3): [0, 0],
        ("seq_max_k2", 0.5 * x * x): [1, 1],
        ("seq_sum_k2", 0.5 * x * x * 1.5): [0, 1],
    }
    for (crit, u), rows in cases.items():
        c = get("kl_rs", criteria=crit, u=u).coefficients(lr, mask, adv)
        np.testing.assert_array_equal(c, mask * np.array(rows)[:, None], err_msg=crit)


def test_kl_rs_chains_criteria_with_and():
    rng = np.random.default_rng(3)
    lr = rng.normal(0, 0.4, (20, 7))
    mask = rng.random((20, 7)) < 0.8
    adv = rng.normal(size=20)
    a = get("kl_rs", criteria="token_k3", u=0.05).coefficients(lr, mask, adv)
    b = get("kl_rs", criteria="seq_mean_k2", u=0.04).coefficients(lr, mask, adv)
    both = get("kl_rs", criteria=("token_k3", "seq_mean_k2"), u=(0.05, 0.04))
    np.testing.assert_array_equal(both.coefficients(lr, mask, adv), a * b)
    assert 0 < (a * b).sum() < a.sum()  # the AND is informative here


def test_kl_rs_bad_input_names_the_option():
    with pytest.raises(ValueError, match="valid criteria: " + ", ".join(KL_RS_CRITERIA)):
        get("kl_rs", criteria="seq_mean_k1")
    with pytest.raises(ValueError, match="u must be in"):
        get("kl_rs", u=0.0)
    with pytest.raises(ValueError, match="u must be in"):
        get("kl_rs", u=-1.0)
    with pytest.raises(ValueError, match="one per criterion"):
        get("kl_rs", criteria=("token_k2", "token_k3"), u=(0.1, 0.2, 0.3))


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("rho", [0.0, -0.1, 1.0001, math.inf])
def test_covariance_ratio_outside_zero_one_is_rejected(name, rho):
    with pytest.raises(ValueError, match="ratio must be"):
        get(name, ratio=rho)


def test_tis_token_batch_normalised_is_min_r_c_over_its_batch_mean():
    lr = np.log(np.array([[0.5, 1.0, 4.0], [2.0, 1.0, 9.0]]))
    mask = np.array([[True, True, True], [True, True, False]])
    base = np.array([[0.5, 1.0, 2.0], [2.0, 1.0, 0.0]])
    c = get("tis_token", batch_normalize=True).coefficients(lr, mask, np.ones(2))
    np.testing.assert_allclose(c, base / (6.5 / 5), rtol=1e-14)
    m = get("tis_token", batch_normalize=True)
    assert m.batch_dependent and m.level == "batch"
    assert not get("tis_token").batch_dependent


def test_tis_seq_batch_normalised_is_min_w_c_over_the_mean_of_nonempty_rows():
    lr = np.log(np.array([[2.0, 2.0], [0.5, 1.0], [7.0, 7.0]]))
    mask = np.array([[True, True], [True, True], [False, False]])  # last row empty
    c = get("tis_seq", c=3.0, batch_normalize=True).coefficients(lr, mask, np.ones(3))
    w = np.array([3.0, 0.5])  # min(4, 3), min(0.5, 3)
    np.testing.assert_allclose(c[:2], np.repeat((w / w.mean())[:, None], 2, 1), rtol=1e-14)
    np.testing.assert_array_equal(c[2], 0.0)


def test_clip_cov_with_ratio_one_detaches_every_candidate():
    # A = (+1, −1): mean A = 0 (equal lengths), cov_t = A_i·(log r_t − mean log r)
    lr = np.array([[0.1, -0.1, 0.05], [0.1, -0.1, -0.05]])
    mask = np.ones(lr.shape, bool)
    adv = np.array([1.0, -1.0])
    m = get("clip_cov", ratio=1.0, lb=0.0, ub=1.0)
    cov = adv[:, None] * (lr - lr.mean())
    r = np.exp(lr)
    expected = np.where(cov > 0, 0.0, r)  # every token is inside PPO's band
    np.testing.assert_allclose(m.coefficients(lr, mask, adv), expected, rtol=1e-14)
    np.testing.assert_array_equal(m.selected(lr, mask, adv), cov > 0)


def test_clip_cov_draws_its_subset_from_the_generator():
    rng = np.random.default_rng(0)
    lr = rng.normal(0, 0.3, (50, 8))
    mask = np.ones(lr.shape, bool)
    adv = rng.normal(size=50) * 5
    m = get("clip_cov", ratio=0.02, lb=0.0, ub=10.0)
    a = m.selected(lr, mask, adv, rng=np.random.default_rng(1))
    b = m.selected(lr, mask, adv, rng=np.random.default_rng(1))
    d = m.selected(lr, mask, adv, rng=np.random.default_rng(2))
    np.testing.assert_array_equal(a, b)
    assert a.sum() == d.sum() == max(int(0.02 * 400), 1) and not np.array_equal(a, d)


def test_kl_cov_coefficient_on_the_selected_token_is_r_minus_kappa_sign_over_a():
    lr = np.array([[0.2, -0.1], [0.0, 0.3]])
    mask = np.ones(lr.shape, bool)
    adv = np.array([2.0, -1.0])
    m = get("kl_cov", ratio=0.25, kappa=0.5)  # k = 1 token
    cov = (adv - adv.mean())[:, None] * (lr - lr.mean())
    top = np.unravel_index(np.argmax(cov), cov.shape)
    expected = np.exp(lr)
    expected[top] -= 0.5 * np.sign(lr[top]) / adv[top[0]]
    np.testing.assert_allclose(m.coefficients(lr, mask, adv), expected, rtol=1e-14)


def test_presets_from_the_upstream_comparison():
    d = get("dapo", preset="verl")
    assert (d.eps_low, d.eps_high, d.c_dual, d.max_log_ratio) == (0.2, 0.28, 3.0, 20.0)
    assert get("dapo").c_dual == math.inf
    # dual clip for A < 0: r = 4 > 3 is zeroed, r = 2 kept
    c = d.coefficients(np.log([[4.0, 2.0]]), np.ones((1, 2), bool), np.array([-1.0]))
    np.testing.assert_allclose(c, [[0.0, 2.0]], rtol=1e-14)
    g = get("geo_mask", preset="verl_head")
    assert (g.c_low, g.c_high) == (1 / 1.001, 1 / 0.999)
    v = get("vespo", preset="trl")
    assert v.min_log_ratio_seq == math.log(1e-8)
    # log W = −19 is clamped to log 1e-8: φ = W^k e^{λ(1−W)} at W = 1e-8
    lr = np.array([[-19.0]])
    c = v.coefficients(lr, np.ones((1, 1), bool), np.ones(1))
    np.testing.assert_allclose(c, [[1e-16 * math.exp(3 * (1 - 1e-8))]], rtol=1e-12)


def test_kept_mask_of_rejections():
    lr = np.log(np.array([[1.0, 6.0, 0.4], [1.1, 1.0, 1.0]]))
    mask = np.array([[True, True, True], [True, True, False]])
    adv = np.ones(2)
    kept = get("mis_token").kept_mask(lr, mask, adv)
    np.testing.assert_array_equal(kept, [[True, False, False], [True, True, False]])
    np.testing.assert_array_equal(get("ppo_clip").kept_mask(lr, mask, adv), mask)
    rs = get("kl_rs", criteria="token_k2", u=0.1)
    np.testing.assert_array_equal(rs.kept_mask(lr, mask, adv), rs.coefficients(lr, mask, adv) > 0)


def test_gspo_verl_preset_zeroes_the_gradient_above_log_s_10():
    # verl clamps log s at 10 with torch.clamp: derivative 0 above — for A < 0 rows too
    g = get("gspo", preset="verl")
    lr = np.array([[9.0, 9.0], [11.0, 11.0], [0.1, 0.1]])
    mask = np.ones(lr.shape, bool)
    c = g.coefficients(lr, mask, np.array([-1.0, -1.0, 1.0]))
    np.testing.assert_allclose(c, [[math.exp(9)] * 2, [0.0, 0.0], [math.exp(0.1)] * 2])
    assert get("gspo", preset="libraries").coefficients(lr, mask, -np.ones(3))[1, 0] > 0
