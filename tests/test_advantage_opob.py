"""VCPO's off-policy optimal baseline (OPOB, arXiv 2602.17616 §3.3) as the ``opob`` advantage,
against the closed form b* = Σ w²‖g‖²R / Σ w²‖g‖² of mit-han-lab/vcpo at c7f030f (README and
``compute_opob_baseline`` in ``recipe/fully_async_policy/staleness_utils.py``, restated)."""

from __future__ import annotations

import numpy as np
import pytest

from simkit.envs import TokenMDP
from simkit.estimators import Estimator, advantages, opob_advantages
from simkit.experiment import run


def _vcpo_c7f030f(rewards, seq_ratio, grad_norm, G, eps=1e-8):
    """mit-han-lab/vcpo@c7f030f, restated: per group, weight = ‖g‖²·ratio², baseline =
    Σ weight·R / (Σ weight + ε); norm_by_std divides R and the baseline by the population std
    (torch.std(unbiased=False)) where it exceeds 1e-8."""
    out = np.empty(len(rewards))
    for start in range(0, len(rewards), G):
        sl = slice(start, start + G)
        r = np.asarray(rewards[sl], float)
        weights = [grad_norm[i] ** 2 * seq_ratio[i] ** 2 for i in range(start, start + G)]
        num = sum(float(v) * float(w) for v, w in zip(r, weights, strict=True))
        base = num / (sum(weights) + eps)
        std = float(np.sqrt(((r - r.mean()) ** 2).mean()))
        scale = 1.0 / std if std > 1e-8 else 1.0
        out[sl] = r * scale - base * scale
    return out


def _batch(seed=0, N=12, T=5):
    rng = np.random.default_rng(seed)
    R = rng.integers(0, 2, N).astype(float)
    R[4:8] = rng.normal(size=4)
    R[8:] = 1.0  # a group of identical rewards: σ = 0, no division
    mask = np.arange(T) < rng.integers(1, T + 1, N)[:, None]
    score_sq = rng.uniform(0.1, 0.9, (N, T))
    lr = 0.4 * rng.standard_normal((N, T))
    return R, mask, score_sq, lr


def test_opob_matches_vcpo_c7f030f():
    R, mask, score_sq, lr = _batch()
    ratio = np.exp(np.where(mask, lr, 0.0).sum(-1))
    norm = np.sqrt(np.where(mask, score_sq, 0.0).sum(-1))
    want = _vcpo_c7f030f(R, ratio, norm, 4)
    np.testing.assert_allclose(opob_advantages(R, mask, score_sq, lr, 4), want, rtol=1e-12)
    # without the std scaling: R − b*
    plain = opob_advantages(R, mask, score_sq, lr, 4, norm_by_std=False)
    w = ratio**2 * norm**2
    b = np.repeat(
        [(w[g] * R[g]).sum() / (w[g].sum() + 1e-8) for g in np.split(np.arange(12), 3)], 4
    )
    np.testing.assert_allclose(plain, R - b, rtol=1e-12, atol=1e-15)
    # leading batch axes: each batch on its own
    stacked = opob_advantages(
        np.stack([R, 2 * R]), *(np.stack([x, x]) for x in (mask, score_sq, lr)), 4
    )
    np.testing.assert_allclose(
        stacked[1], opob_advantages(2 * R, mask, score_sq, lr, 4), rtol=1e-12
    )


def test_opob_baseline_minimises_the_weighted_second_moment():
    """b* is the stationary point of Σ_i w_i²‖g_i‖²(R_i − b)², the group's estimate of the
    second moment of w·(R − b)·∇log π (VCPO §3.3): its derivative vanishes there."""
    R, mask, score_sq, lr = _batch(3)
    plain = opob_advantages(R, mask, score_sq, lr, 12, norm_by_std=False, eps=0.0)
    b = float(R[0] - plain[0])
    weight = np.exp(2 * np.where(mask, lr, 0.0).sum(-1)) * np.where(mask, score_sq, 0.0).sum(-1)
    assert abs(float((weight * (R - b)).sum())) < 1e-12 * float(weight.sum())
    second = [float((weight * (R - x) ** 2).sum()) for x in (b - 1e-3, b, b + 1e-3)]
    assert second[1] < min(second[0], second[2])


def test_opob_on_policy_with_equal_score_norms_is_the_group_mean():
    """w = 1 and equal ‖g‖²: b* is the group mean, A = Dr. GRPO's centred reward (÷ σ_pop)."""
    R, mask, _, _ = _batch(1)
    full = np.ones_like(mask)
    got = opob_advantages(R, full, np.full(mask.shape, 0.5), np.zeros(mask.shape), 4, eps=0.0)
    centred = advantages(R, "dr_grpo", group_size=4)
    std = np.repeat(R.reshape(3, 4).std(axis=1), 4)
    np.testing.assert_allclose(
        got, np.where(std > 1e-8, centred / np.where(std > 0, std, 1), centred), atol=1e-12
    )


def test_opob_rows_run_by_monte_carlo_with_bounds():
    env = TokenMDP.markov(V=3, T=4, seed=1, eos=2)
    rng = np.random.default_rng(0)
    mu = env.with_logits(env.logits + 0.3 * rng.standard_normal(env.logits.shape)).pi
    ests = [
        Estimator(m, "seq-mean-token-sum", advantage="opob", group_size=4)
        for m in ("is_seq", "tis_seq")
    ]
    df = run(env, mu, ests, n=8, reps=400, seed=0)
    assert (df["method"] == "monte_carlo").all() and df["why_mc"].str.contains("couples").all()
    assert df["bias_lo"].le(df["bias"]).all() and df["bias"].le(df["bias_hi"]).all()
    assert np.isfinite(df["variance"]).all()


def test_opob_bad_input_names_the_argument():
    R, mask, score_sq, lr = _batch()
    with pytest.raises(ValueError, match="opob_advantages"):
        advantages(R, "opob", group_size=4)
    with pytest.raises(ValueError, match="log_ratio"):
        opob_advantages(R, mask, score_sq, lr[:, :2], 4)
    with pytest.raises(ValueError, match="group_size"):
        opob_advantages(R, mask, score_sq, lr, 5)
    with pytest.raises(ValueError, match="group_size"):
        Estimator("naive", advantage="opob")
    est = Estimator("naive", advantage="opob", group_size=4)
    with pytest.raises(ValueError, match="score_sq"):
        est.token_weights(lr, mask, R)
