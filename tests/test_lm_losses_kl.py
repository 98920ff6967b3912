"""The torch loss's KL penalty (``policy_loss(..., ref_log_prob=, kl=)``) against the numpy
estimator (issue 24): ∂loss/∂log π = −λ of ``Estimator(..., kl=...)``, every aggregation."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit.estimators import AGGREGATIONS, Estimator  # noqa: E402
from simkit.kl import KL_ESTIMATORS, KLPenalty  # noqa: E402
from simkit.lm import losses  # noqa: E402

MAPPINGS = ("naive", "is_token", "ppo_clip", "is_seq", "gspo", "tis_token")
PENALTIES = [(e, w, c) for e in KL_ESTIMATORS for w in ("loss", "reward") for c in (None, "is")]


def _inputs(seed=0, N=24, T=7):
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, (N, T)) - 0.05
    lr = rng.normal(0.0, 0.4, (N, T))
    lr[rng.random((N, T)) < 0.1] *= 6.0
    lp = old + lr
    x = rng.normal(0.0, 0.6, (N, T))
    x[rng.random((N, T)) < 0.05] = 0.0  # abs's kink
    ref = lp - x
    lengths = rng.integers(1, T + 1, N)
    lengths[0], lengths[1] = 0, T
    mask = np.arange(T)[None, :] < lengths[:, None]
    # padding holds garbage, as trainers' buffers may
    lp, ref = np.where(mask, lp, -np.inf), np.where(mask, ref, np.nan)
    adv = rng.normal(size=N)
    return old, lp, ref, mask, adv


def _torch_grad(mapping, lp, old, ref, mask, adv, agg, kl):
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    loss, _ = losses.policy_loss(
        mapping,
        x,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        agg=agg,
        ref_log_prob=torch.tensor(ref),
        kl=kl,
    )
    loss.backward()
    return x.grad.numpy()


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}")
def test_torch_gradient_equals_the_estimators_weights(penalty, agg):
    old, lp, ref, mask, adv = _inputs()
    kl = KLPenalty(0.3, *penalty)
    mapping = MAPPINGS[(KL_ESTIMATORS.index(penalty[0]) + AGGREGATIONS.index(agg)) % 6]
    est = Estimator(mapping, aggregation=agg, advantage="raw", kl=kl)
    lr = np.where(mask, lp - old, 0.0)
    x = np.where(mask, lp - ref, 0.0)
    lam = est.token_weights(lr, mask, adv, ref_log_ratio=x)
    grad = _torch_grad(mapping, lp, old, ref, mask, adv, agg, kl)
    np.testing.assert_allclose(grad, -lam, rtol=1e-10, atol=1e-13, err_msg=mapping)


def test_loss_penalty_value_is_verls_agg_loss_of_kld():
    # verl 1dda039 losses.py: policy_loss += agg_loss(kld, mask, mode) * kl_loss_coef; with
    # A = 0 the policy part is 0 and the loss is that term alone
    old, lp, ref, mask, _ = _inputs(1)
    adv = np.zeros(mask.shape[0])
    kl = KLPenalty(0.2, "low_var_kl")
    x = torch.tensor(lp, requires_grad=True)
    loss, _ = losses.policy_loss(
        "ppo_clip",
        x,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        agg="token-mean",
        ref_log_prob=torch.tensor(ref),
        kl=kl,
    )
    u = np.clip(np.where(mask, ref - lp, 0.0), -20, 20)
    kld = np.clip(np.exp(u) - u - 1, -10, 10) * mask
    assert float(loss.detach()) == pytest.approx(0.2 * kld.sum() / mask.sum(), rel=1e-12)


def test_bad_input_names_the_argument():
    old, lp, ref, mask, adv = _inputs()
    args = (torch.tensor(lp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    with pytest.raises(ValueError, match="kl needs ref_log_prob"):
        losses.policy_loss("naive", *args, kl=KLPenalty(0.1))
    with pytest.raises(ValueError, match="ref_log_prob was given without kl"):
        losses.policy_loss("naive", *args, ref_log_prob=torch.tensor(ref))
    with pytest.raises(TypeError, match=r"kl must be a simkit\.kl\.KLPenalty"):
        losses.policy_loss("naive", *args, ref_log_prob=torch.tensor(ref), kl="k3")
    with pytest.raises(ValueError, match="ref_log_prob has"):
        losses.policy_loss("naive", *args, ref_log_prob=torch.zeros(2, 2), kl=KLPenalty(0.1))
    bad = ref.copy()
    bad[1, 0] = -np.inf
    with pytest.raises(ValueError, match="not finite on a valid token"):
        losses.policy_loss("naive", *args, ref_log_prob=torch.tensor(bad), kl=KLPenalty(0.1))
