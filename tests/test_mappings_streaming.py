"""The streaming batch mappings (``clip_cov``, ``kl_cov``, ``m2po``: one pass over row blocks,
issue 28) against the dense implementations they replaced, kept here as slow references.

``clip_cov`` and ``kl_cov`` must agree bit for bit (same floating-point operations on the same
values; the streaming pass only decides which tokens are compared). ``m2po`` sums (log r)² in
another order, so Σ(log r)² agrees to 1e-12 relative and the coefficients agree bit for bit
whenever the removal decision is not within that rounding of τ (the inputs below keep it clear;
the test checks the margin). Inputs: masks all ones, ragged and random; ties (log-ratios on a
grid); zero advantages; log π given or not; ratios that take the fast path and the dense one;
log-ratios beyond ``max_log_ratio``; NaN and overflowing covariances.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from simkit._validation import check_batch
from simkit.mappings import get
from simkit.mappings.covariance import GROUP_ROWS

# --- slow references: the implementations before issue 28, written densely ---------------------


def _ref_inputs(log_ratio, mask, advantages, log_prob):
    lr, m, adv = check_batch(log_ratio, mask, advantages)
    lp = lr if log_prob is None else np.where(m, np.asarray(log_prob, dtype=np.float64), 0.0)
    return lr, m, adv, lp


def _ref_cov(adv, lp, m):
    n = m.sum(axis=1)
    total = int(n.sum())
    if total == 0:
        return np.full(m.shape, -np.inf)
    mean_a = float(adv @ n) / total
    mean_lp = float(np.add.reduce(lp, axis=None, where=m, initial=0.0)) / total
    with np.errstate(invalid="ignore", over="ignore"):
        cov = (adv - mean_a)[:, None] * (lp - mean_lp)
    return np.where(m, cov, -np.inf)


def _ref_top_k_first(values, k):
    n = values.size
    k = min(k, n)
    if k == 0:
        return np.zeros(0, dtype=np.intp)
    kth = np.partition(values, n - k)[n - k]
    above = np.flatnonzero(values > kth)
    ties = np.flatnonzero(values == kth)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


def ref_clip_cov(mp, log_ratio, mask, advantages, log_prob=None, seed=0):
    """(c, the detached tokens (N, T) bool)."""
    lr, m, adv, lp = _ref_inputs(log_ratio, mask, advantages, log_prob)
    pos = adv >= 0
    lo = np.where(pos, -np.inf, math.log(1 - mp.eps_low) if mp.eps_low < 1 else -np.inf)[:, None]
    hi = np.where(pos, math.log1p(mp.eps_high), np.inf)[:, None]
    c = np.exp(np.minimum(lr, mp.max_log_ratio))
    c[(lr < lo) | (lr > hi) | ~m] = 0.0
    cov = _ref_cov(adv, lp, m)
    h, low = math.log1p(mp.eps_high), math.log(1 - mp.eps_low) if mp.eps_low < 1 else -np.inf
    clipped = ((adv > 0)[:, None] & (lr > h)) | ((adv < 0)[:, None] & (lr < low))
    cand = np.flatnonzero(m & ~clipped & (cov > mp.lb) & (cov < mp.ub))
    selected = np.zeros(m.shape, dtype=bool)
    if cand.size:
        n_valid = int(np.count_nonzero(np.isfinite(cov)))
        k = max(int(mp.ratio * n_valid), 1)
        picks = np.random.default_rng(seed).choice(cand.size, size=min(k, cand.size), replace=False)
        selected.flat[cand[picks]] = True
        c[selected] = 0.0
    return c, selected


def ref_kl_cov(mp, log_ratio, mask, advantages, log_prob=None):
    """(c, the penalised tokens (N, T) bool)."""
    lr, m, adv, lp = _ref_inputs(log_ratio, mask, advantages, log_prob)
    c = np.where(m, np.exp(np.minimum(lr, mp.max_log_ratio)), 0.0)
    valid = np.flatnonzero(m)
    selected = np.zeros(m.shape, dtype=bool)
    if valid.size == 0:
        return c, selected
    k = max(1, int(valid.size * mp.ratio))
    sel = valid[_ref_top_k_first(_ref_cov(adv, lp, m).reshape(-1)[valid], k)]
    selected.flat[sel] = True
    if sel.size and mp.kappa > 0:
        a = adv[sel // lr.shape[1]]
        nz = a != 0
        c.reshape(-1)[sel[nz]] -= mp.kappa * np.sign(lr.reshape(-1)[sel[nz]]) / a[nz]
    return c, selected


def ref_m2po(mp, log_ratio, mask, advantages):
    """(c, Σ(log r)² over the candidates, their number, the margin of the removal decision)."""
    lr, m, adv = check_batch(log_ratio, mask, advantages)
    pos = adv >= 0
    cand = m & np.where(pos[:, None], lr > 0, lr < 0) if mp.trust_region_only else m.copy()
    sq = np.where(cand, np.square(lr), 0.0)
    total, n = float(np.add.reduce(sq, axis=None, where=cand, initial=0.0)), int(cand.sum())
    c = np.where(m, np.exp(np.minimum(lr, mp.max_log_ratio)), 0.0)
    if n == 0 or total <= mp.tau * n:
        return c, total, n, abs(total / max(n, 1) - mp.tau)
    values = np.sort(sq[cand])[::-1]
    rest = (total - np.cumsum(values)) / np.maximum(n - np.arange(1, n + 1), 1)
    rest[-1] = 0.0
    k = int(np.flatnonzero(rest <= mp.tau)[0]) + 1
    threshold = values[k - 1]
    removed = cand & (sq > threshold)
    ties = np.flatnonzero(cand & (sq == threshold))[: k - int(removed.sum())]
    removed.flat[ties] = True
    c[removed] = 0.0
    margin = min(abs(rest[k - 1] - mp.tau), abs(rest[k - 2] - mp.tau) if k > 1 else np.inf)
    return c, total, n, margin


# --- inputs -----------------------------------------------------------------------------------


def batch(seed, n, t, mask_kind="ones", grid=None, scale=0.05, zero_adv=False, log_prob=False):
    rng = np.random.default_rng(seed)
    lr = rng.normal(0.0, scale, size=(n, t))
    if grid is not None:  # ties: log-ratios on a grid of a few values
        lr = np.round(lr / grid) * grid
    if mask_kind == "ones":
        mask = np.ones((n, t), dtype=bool)
    elif mask_kind == "ragged":
        lengths = rng.integers(0, t + 1, size=n)
        mask = np.arange(t)[None, :] < lengths[:, None]
    else:
        mask = rng.random((n, t)) < 0.7
    adv = rng.normal(0.0, 2.0, size=n)
    if zero_adv:
        adv[::5] = 0.0
    lp = None
    if log_prob:
        lp = -rng.exponential(1.0, size=(n, t))
        if grid is not None:
            lp = np.round(lp / 0.5) * 0.5
    return lr, mask, adv, lp


CASES = [
    dict(seed=1, n=64, t=200),
    dict(seed=2, n=70, t=131, mask_kind="ragged"),
    dict(seed=3, n=50, t=257, mask_kind="random"),
    dict(seed=4, n=80, t=160, grid=0.05, zero_adv=True),
    dict(seed=5, n=66, t=190, mask_kind="ragged", grid=0.1, log_prob=True),
    dict(seed=6, n=48, t=300, mask_kind="random", log_prob=True, zero_adv=True),
    dict(seed=7, n=33, t=64, scale=40.0),  # beyond max_log_ratio
    dict(seed=8, n=3, t=1),
]

CLIP_COV = [
    {"ratio": 0.01, "lb": 0.0, "ub": 0.5},
    {"ratio": 0.2, "lb": -1.0, "ub": 2.0, "eps_high": 0.1},
    {"ratio": 1e-4, "lb": 0.05, "ub": 5.0, "eps_low": 1.0},
    {},
]
KL_COV = [{"ratio": 0.01}, {"ratio": 2e-3, "kappa": 0.3}, {"ratio": 0.3}, {"max_log_ratio": 5.0}]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c['seed']}")
@pytest.mark.parametrize("hp", CLIP_COV, ids=str)
def test_clip_cov_is_the_dense_implementation_bit_for_bit(case, hp):
    lr, mask, adv, lp = batch(**case)
    mp = get("clip_cov", **hp)
    for seed in (0, 11):
        want, selected = ref_clip_cov(mp, lr, mask, adv, lp, seed)
        np.testing.assert_array_equal(mp.coefficients(lr, mask, adv, log_prob=lp, rng=seed), want)
        np.testing.assert_array_equal(mp.selected(lr, mask, adv, log_prob=lp, rng=seed), selected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c['seed']}")
@pytest.mark.parametrize("hp", KL_COV, ids=str)
def test_kl_cov_is_the_dense_implementation_bit_for_bit(case, hp):
    lr, mask, adv, lp = batch(**case)
    mp = get("kl_cov", **hp)
    want, selected = ref_kl_cov(mp, lr, mask, adv, lp)
    np.testing.assert_array_equal(mp.coefficients(lr, mask, adv, log_prob=lp), want)
    np.testing.assert_array_equal(mp.selected(lr, mask, adv, log_prob=lp), selected)


def test_the_streaming_paths_are_the_ones_exercised():
    """The fast path of KL-Cov needs 4·k·GROUP_ROWS <= N·T and Clip-Cov candidates must exist:
    the cases above reach both (else the comparisons would only test the dense fallback)."""
    lr, mask, adv, lp = batch(**CASES[0])
    k = max(1, int(mask.sum() * KL_COV[0]["ratio"]))
    assert 4 * k * GROUP_ROWS <= mask.size
    assert get("clip_cov", **CLIP_COV[0]).selected(lr, mask, adv, log_prob=lp).sum() > 0


@pytest.mark.parametrize("ties", [True, False])
def test_kl_cov_ties_at_the_kth_value_go_to_the_first_in_row_major_order(ties):
    """Every covariance equal (on-policy log-ratios, log π absent): the first k valid tokens."""
    n, t = 64, 100
    lr = np.zeros((n, t)) if ties else np.full((n, t), 0.01)
    mask = np.ones((n, t), dtype=bool)
    adv = np.ones(n)
    mp = get("kl_cov", ratio=0.01)
    np.testing.assert_array_equal(
        np.flatnonzero(mp.selected(lr, mask, adv)), np.arange(max(1, int(n * t * 0.01)))
    )


def test_nan_and_overflowing_covariances_take_the_dense_semantics():
    """A NaN log π (every cov NaN), and log π ~ −1e300 with |A| up to 1e10 (cov overflows to
    ±inf): the streaming result is still the dense one."""
    lr, mask, adv, lp = batch(seed=9, n=64, t=120, log_prob=True)
    lp[3, 4] = np.nan
    big = np.where(np.arange(120) % 7 == 0, -1e300, -1.0)[None, :] * np.ones((64, 1))
    adv_big = np.linspace(-1e10, 1e10, 64)
    for a, p in ((adv, lp), (adv_big, big)):
        for mp in (get("clip_cov", ratio=0.01, lb=0.0, ub=0.5), get("kl_cov", ratio=0.01)):
            ref = ref_clip_cov if mp.name == "clip_cov" else ref_kl_cov
            want, selected = ref(mp, lr, mask, a, p)
            np.testing.assert_array_equal(mp.coefficients(lr, mask, a, log_prob=p), want)
            np.testing.assert_array_equal(mp.selected(lr, mask, a, log_prob=p), selected)
    # Clip-Cov draws ⌊ρ·#(valid tokens with a finite cov)⌋: 20 covariances overflow to ±inf
    lp = -np.ones((64, 120))
    lp[10:20, 5], lp[30:40, 5] = 1e307, -1e307
    adv = np.linspace(-100.0, 100.0, 64)
    mp = get("clip_cov", ratio=0.5, lb=-1e308, ub=1e308)
    want, selected = ref_clip_cov(mp, lr, mask, adv, lp)
    assert not np.isfinite(_ref_cov(adv, lp, mask)).all()
    np.testing.assert_array_equal(mp.selected(lr, mask, adv, log_prob=lp), selected)


M2PO = [{"tau": 0.0437}, {"tau": 0.0437, "trust_region_only": False}, {"tau": 0.0011}, {}]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c['seed']}")
@pytest.mark.parametrize("hp", M2PO, ids=str)
@pytest.mark.parametrize("scale", [0.05, 0.3])
def test_m2po_matches_the_dense_implementation(case, hp, scale):
    case = {**case, "scale": case.get("scale", scale), "log_prob": False}
    lr, mask, adv, _ = batch(**case)
    mp = get("m2po", **hp)
    want, total, n, margin = ref_m2po(mp, lr, mask, adv)
    got_total, got_n = mp._second_moment(*check_batch(lr, mask, adv))
    assert got_n == n
    assert got_total == pytest.approx(total, rel=1e-12, abs=1e-300)
    assert margin > 1e-9 * max(mp.tau, 1e-300)  # the decision is not at the rounding
    np.testing.assert_array_equal(mp.coefficients(lr, mask, adv), want)
    removed = mp.masked_tokens(lr, mask, adv)
    np.testing.assert_array_equal(removed, mask & (want == 0))
