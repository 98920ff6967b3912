"""simkit.lm.losses.selection: the block-summary selections of clip_cov and kl_cov equal a full
scan (numpy ``flatnonzero`` and :func:`simkit.mappings.covariance.top_k_first`), exactly, and
the losses that use them equal the numpy registry on batches large enough to take the block
path (the other tests of the losses use small batches, where the full scan is taken).
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit import mappings  # noqa: E402
from simkit.estimators import aggregation_weights  # noqa: E402
from simkit.lm import losses  # noqa: E402
from simkit.lm.losses import selection  # noqa: E402
from simkit.mappings.covariance import top_k_first as numpy_top_k_first  # noqa: E402

B = selection.BLOCK
SIZES = [1, B - 1, B, B + 1, 7 * B, 40 * B + 17, 5000]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("density", [0.002, 0.1, 0.9, 1.0])
def test_nth_flagged_equals_flatnonzero(n, density):
    rng = np.random.default_rng(n + int(1000 * density))
    flags = rng.random(n) < density
    flags[rng.integers(n)] = True  # at least one flagged entry
    idx = np.flatnonzero(flags)
    ranks = rng.choice(idx.size, size=min(idx.size, 25), replace=False)
    ranks = np.concatenate([ranks, [0, idx.size - 1]])  # the first and the last
    flat = torch.tensor(flags, dtype=torch.float32)
    counts, running = selection.flagged_counts(flat)
    assert int(running[-1]) == idx.size
    assert counts.shape == (math.ceil(n / B),)
    got = selection.nth_flagged(flat, counts, running, ranks)
    np.testing.assert_array_equal(got.numpy(), idx[ranks])


@pytest.fixture
def block_path(monkeypatch):
    """Counts the calls of the block path of ``top_k_first`` (its gather of the chosen blocks),
    so that a test observes which path ran instead of restating the size rule."""
    calls = []
    gather = selection._gather_blocks

    def spy(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    monkeypatch.setattr(selection, "_gather_blocks", spy)
    return calls


@pytest.mark.parametrize("n", [40 * B, 40 * B + 17, 20000])
@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("kind", ["continuous", "ties", "minus_inf", "sorted"])
def test_top_k_first_equals_numpy(n, k, kind, block_path):
    """The block path (4·k·BLOCK <= n; the spy checks that it ran) against numpy's full
    partition: ties at the k-th value that reach beyond the top k (few enough blocks that the
    block path, not the many-ties fallback, handles them), −inf entries (padding) and
    increasing data (the top k in the short last block)."""
    rng = np.random.default_rng(n + k)
    if kind == "continuous":
        values = rng.normal(size=n)
    elif kind == "ties":  # k + 2 equal maxima in at most k + 2 blocks: ties beyond the top k
        values = rng.normal(size=n)
        values[rng.choice(n, k + 2, replace=False)] = 5.0
    elif kind == "minus_inf":  # half padding, and a tie at the k-th value as above
        values = np.where(rng.random(n) < 0.5, -np.inf, rng.normal(size=n))
        values[rng.choice(n, k + 2, replace=False)] = 5.0
    else:
        values = np.arange(n, dtype=float)
    expected = numpy_top_k_first(values, k)
    got = selection.top_k_first(torch.tensor(values), k)
    np.testing.assert_array_equal(got.numpy(), expected)
    assert block_path, "the block path must have run (else this tests the full scan only)"
    if kind == "ties":  # the test has ties at the k-th value beyond the top k
        assert (values == values[expected].min()).sum() > np.sum(
            values[expected] == values[expected].min()
        )


@pytest.mark.parametrize("kind", ["nan", "all_equal", "large_k"])
def test_top_k_first_falls_back_to_the_full_scan(kind):
    """A NaN, ties at the threshold in most blocks, or k close to the size: the full scan
    (:func:`selection.top_k_full`) is the answer."""
    rng = np.random.default_rng(3)
    n, k = 50 * B, 5
    values = rng.normal(size=n)
    if kind == "nan":
        values[[7, 900]] = np.nan
    elif kind == "all_equal":
        values[:] = 1.0
    else:
        k = n // (2 * B)
    t = torch.tensor(values)
    np.testing.assert_array_equal(
        selection.top_k_first(t, k).numpy(), selection.top_k_full(t, k).numpy()
    )
    if kind != "nan":
        np.testing.assert_array_equal(
            selection.top_k_first(t, k).numpy(), numpy_top_k_first(values, k)
        )


def _large_batch(seed, full=False, N=37, T=301):
    """float64 inputs large enough for the block path (N·T = 11137, not a multiple of
    BLOCK): log π ~ −Exp(1) with discrete values (covariance ties), ragged rows (every row
    full with ``full``)."""
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, (N, T))
    lp = np.round(old + rng.normal(0.0, 0.3, (N, T)), 1)
    lengths = rng.integers(T // 2, T + 1, N)
    lengths[0] = T
    mask = np.arange(T)[None, :] < lengths[:, None]
    adv = rng.choice([-1.0, 0.5, 2.0], N)
    if full:
        mask[:] = True
    return old, lp, mask, adv


def _torch_grad(m, lp, old, mask, adv, **kw):
    x = torch.tensor(lp, requires_grad=True)
    loss, metrics = losses.policy_loss(
        m, x, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), **kw
    )
    loss.backward()
    return x.grad.numpy(), metrics


def _assert_grad_is_the_registrys(m, lp, old, mask, adv, seed=None, rtol=1e-10, atol=1e-14):
    """The torch gradient of ``m``'s loss equals the registry's −c·A·w (token-mean weights);
    ``seed``: a fresh ``default_rng(seed)`` for each side (Clip-Cov's draw). Returns the torch
    metrics."""
    kw = (lambda: {}) if seed is None else (lambda: {"rng": np.random.default_rng(seed)})
    c = m.coefficients(lp - old, mask, adv, log_prob=lp, **kw())
    expected = -c * adv[:, None] * aggregation_weights(mask, "token-mean")
    grad, metrics = _torch_grad(m, lp, old, mask, adv, **kw())
    np.testing.assert_allclose(grad, expected, rtol=rtol, atol=atol)
    return metrics


@pytest.mark.parametrize("k", [1, 10])
def test_top_k_first_with_ties_in_most_blocks_scans_everything(k, block_path):
    """Integer values 0–4: the k-th largest value ties in most blocks, so the selection falls
    back to the full scan (the spy sees no block gather) and still equals numpy's."""
    values = np.random.default_rng(k).integers(0, 5, 40 * B).astype(float)
    got = selection.top_k_first(torch.tensor(values), k)
    np.testing.assert_array_equal(got.numpy(), numpy_top_k_first(values, k))
    assert not block_path


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("ratio", [0.001, 0.003])
def test_kl_cov_on_a_large_batch_equals_the_registry(full, ratio, block_path):
    old, lp, mask, adv = _large_batch(5, full)
    m = mappings.get("kl_cov", ratio=ratio)
    metrics = _assert_grad_is_the_registrys(m, lp, old, mask, adv)
    assert block_path, "kl_cov's selection must take the block path on this batch"
    sel = m.selected(lp - old, mask, adv, log_prob=lp)
    assert metrics["clip_frac"] == np.count_nonzero((lp - old)[sel]) / mask.sum()


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_clip_cov_on_a_large_batch_equals_the_registry(full, seed):
    old, lp, mask, adv = _large_batch(6, full)
    m = mappings.get("clip_cov", ratio=0.01, lb=0.2, ub=3.0)
    sel = m.selected(lp - old, mask, adv, log_prob=lp, rng=np.random.default_rng(seed))
    assert sel.sum() == int(0.01 * mask.sum())  # many candidates: the full draw
    _assert_grad_is_the_registrys(m, lp, old, mask, adv, seed)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_clip_cov_candidates_at_the_exact_clip_boundaries(seed):
    """Log-ratios exactly at log(1 + ε_high) and log(1 − ε_low) (unclipped: the band is
    closed) and 1e-9 beyond (clipped), in rows with A > 0, A < 0 and A = 0: the candidate set,
    hence the drawn subset, is numpy's (float64, log μ = 0 so that log r = log π). (One float
    beyond would test PPO's band instead, which the torch loss decides on r = exp(log r): at
    log r = nextafter(log 1.2), r rounds to 1.2, inside; numpy decides on log r.)"""
    eps = 0.2
    at_hi, at_lo = math.log1p(eps), math.log(1.0 - eps)
    row = [at_hi, at_hi + 1e-9, at_lo, at_lo - 1e-9, 0.01, -0.01]
    lp = np.array([row, row, row, row[::-1], row[::-1], row[::-1]])
    old = np.zeros_like(lp)
    mask = np.ones(lp.shape, bool)
    adv = np.array([1.0, -1.0, 0.0, 2.0, -0.5, 0.0])
    m = mappings.get("clip_cov", ratio=0.3, lb=-10.0, ub=10.0)  # every unclipped token
    _assert_grad_is_the_registrys(m, lp, old, mask, adv, seed, rtol=1e-12, atol=1e-15)
    # the boundary tokens are candidates (only unclipped tokens are)
    sel = m.selected(lp - old, mask, adv, log_prob=lp, rng=np.random.default_rng(seed))
    assert sel.sum() == int(0.3 * mask.sum())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("max_log_ratio", [80.0, 0.05])
def test_clip_cov_shares_the_metrics_expm1(dtype, full, max_log_ratio):
    """Without padding and below the cap clip_cov computes r from the batch's expm1 and takes
    the metrics' token sums from it before reusing its buffer (else r = exp, and the metrics
    their own expm1): its χ²/k3 equal those the metrics compute themselves (naive on the same
    batch) exactly (the same sums of the same expm1 values: no tolerance), and its loss and
    gradient do not depend on ``compute_metrics``."""
    old, lp, mask, adv = _large_batch(7, full)
    args = (torch.tensor(old, dtype=dtype), torch.tensor(adv, dtype=dtype), torch.tensor(mask))
    m = mappings.get("clip_cov", ratio=0.01, max_log_ratio=max_log_ratio)
    assert (max_log_ratio < (lp - old)[mask].max()) == (max_log_ratio < 1)
    out = {}
    for name, metrics in ((m, True), (m, False), ("naive", True)):
        x = torch.tensor(lp, dtype=dtype, requires_grad=True)
        loss, met = losses.policy_loss(name, x, *args, compute_metrics=metrics, rng=3)
        loss.backward()
        out[name if isinstance(name, str) else metrics] = (loss.item(), x.grad, met)
    assert out[True][0] == out[False][0]
    assert torch.equal(out[True][1], out[False][1])
    for key in ("chi2_tok", "kl_k3"):
        assert out[True][2][key] == out["naive"][2][key], key
