"""The distribution-matched (replay) twin fitted from logged rollouts (simkit.lm.twin_dist)."""

import numpy as np
import pytest

from simkit import experiment as E
from simkit.estimators import Estimator
from simkit.lm import twin_dist


def _logs(N=200, T=5, seed=0, shift=0.3):
    rng = np.random.default_rng(seed)
    lq = np.log(rng.uniform(0.2, 0.9, size=(N, T)))
    lp = np.minimum(lq + shift * rng.standard_normal((N, T)), 0.0)
    mask = np.ones((N, T), dtype=bool)
    mask[: N // 4, 3:] = False
    rewards = (rng.random(N) < 0.4).astype(float)
    return twin_dist.Rollouts(lp, lq, mask, rewards)


def ests(names):
    return [
        Estimator(m, aggregation="seq-mean-token-sum", advantage="oracle_pi", name=m) for m in names
    ]


def test_twin_probabilities_and_unbiased_sequence_is():
    ro = _logs()
    env = twin_dist.replay_twin(ro)
    assert env.prob("mu").sum() == pytest.approx(1.0) and env.prob("pi").sum() == pytest.approx(1.0)
    w = np.exp(ro.log_ratio.sum(1))
    np.testing.assert_allclose(env.prob("pi"), w / w.sum(), rtol=1e-10)
    table = E.run(env, "mu", ests(["naive", "is_seq"]), n=4, reps=2)
    grad = np.linalg.norm(env.grad_J())
    assert grad > 0 and table.set_index("mapping").loc["is_seq", "bias"] < 1e-8 * grad


def test_on_policy_logs_predict_every_mapping_equal_to_naive():
    ro = _logs(shift=0.0)
    pred = twin_dist.predict(ro, ests(["naive", "is_token", "ppo_clip", "tis_seq", "gspo"]), 8)
    for key in ("variance", "mse"):
        np.testing.assert_allclose(pred[f"rel_{key}"], 1.0, rtol=1e-9)
    assert (pred.bias < 1e-12).all() and pred.rel_bias.isna().all()  # 0 / 0: no bias to rank


def test_intervals_bracket_the_point_values():
    ro = _logs()
    pred = twin_dist.predict_with_intervals(
        ro, ests(["naive", "is_token", "tis_token"]), 8, n_boot=8
    )
    for key in ("variance", "mse"):
        lo, hi = pred[f"rel_{key}_lo"], pred[f"rel_{key}_hi"]
        assert (lo <= hi).all() and np.isfinite(lo).all()


def test_bootstrap_refits_use_the_settings_of_the_point_prediction(monkeypatch):
    # the refits once dropped prob_bins (always the default): every fit must get all three
    seen = []
    fit = twin_dist.replay_twin

    def spy(rollouts, **kwargs):
        seen.append(kwargs)
        return fit(rollouts, **kwargs)

    monkeypatch.setattr(twin_dist, "replay_twin", spy)
    settings = dict(bins=3, segments=2, prob_bins=3)
    twin_dist.predict_with_intervals(
        _logs(N=60), ests(["naive", "is_token"]), 4, n_boot=2, reps=4, **settings
    )
    assert seen == [settings] * 3


@pytest.mark.parametrize(
    "change,match",
    [
        (
            lambda a: a.__setitem__("log_pi", np.full((4, 3), np.nan)),
            "log_pi is not finite at row 0",
        ),
        (lambda a: a.__setitem__("log_mu", np.full((4, 3), 0.5)), "positive log-probabilities"),
        (lambda a: a.__setitem__("mask", np.zeros((4, 3), bool)), "no valid token"),
        (lambda a: a.__setitem__("rewards", np.zeros(3)), r"rewards must have shape \(4,\)"),
        (lambda a: a.__setitem__("log_mu", np.zeros((4, 2))), "must share a shape"),
    ],
)
def test_bad_rollouts_are_clear_errors(change, match):
    args = {
        "log_pi": np.full((4, 3), -1.0),
        "log_mu": np.full((4, 3), -1.0),
        "mask": np.ones((4, 3), bool),
        "rewards": np.zeros(4),
    }
    change(args)
    with pytest.raises(ValueError, match=match):
        twin_dist.Rollouts(**args)


def _discrete_logs(N=600, T=6, seed=3):
    """Logs of a discrete support: a few (log π, log μ) pairs repeat across tokens, as on a
    token MDP, so the quantile edges fall on repeated values."""
    rng = np.random.default_rng(seed)
    lq_vals = np.log(np.array([0.15, 0.25, 0.6, 0.9]))
    lp_vals = np.log(np.array([0.2, 0.2, 0.5, 0.95]))
    k = rng.integers(0, 4, size=(N, T))
    mask = np.ones((N, T), dtype=bool)
    rewards = (k[:, 0] + k[:, -1] > 3).astype(float)
    return lp_vals[k], lq_vals[k], mask, rewards


@pytest.mark.parametrize("logging", ["one ulp", "float32"])
def test_the_twin_is_a_function_of_the_values_not_of_their_last_bits(logging):
    """Log-probabilities logged one ulp apart (another CPU's ``log``) or rounded to float32
    (what trainers store) give the same atoms and the same predictions: equal values are
    snapped together before the quantile edges are taken (one ulp used to move whole groups of
    tokens between atoms and turn a validation case's ρ from 0.71 to −0.12)."""
    lp, lq, mask, rewards = _discrete_logs()
    if logging == "one ulp":
        d = np.random.default_rng(7).integers(-1, 2, size=lp.shape)
        lp2 = np.minimum(np.where(d > 0, np.nextafter(lp, 1), np.nextafter(lp, -1)), 0.0)
        lp2 = np.where(d == 0, lp, lp2)
        lq2 = lq
    else:
        lp2 = lp.astype(np.float32).astype(np.float64)
        lq2 = lq.astype(np.float32).astype(np.float64)
    a = twin_dist.Rollouts(lp, lq, mask, rewards)
    b = twin_dist.Rollouts(lp2, lq2, mask, rewards)
    ea, eb = twin_dist.replay_twin(a), twin_dist.replay_twin(b)
    np.testing.assert_array_equal(ea.edges, eb.edges)
    names = ["naive", "is_token", "tis_token", "is_seq", "icepop"]
    pa = twin_dist.predict(a, ests(names), 8, reps=4).set_index("estimator")
    pb = twin_dist.predict(b, ests(names), 8, reps=4).set_index("estimator")
    np.testing.assert_allclose(
        pa.loc[names, "rel_mse_scaled"], pb.loc[names, "rel_mse_scaled"], rtol=1e-5
    )


def test_snapping_merges_only_values_within_the_tolerance():
    x = np.array([[0.0, 1e-9, 0.5, 0.5 + 1e-4, -2.0, -2.0 - 1e-7]])
    mask = np.ones_like(x, dtype=bool)
    mask[0, 3] = False  # padding is left alone
    out = twin_dist._snap(x, mask)
    np.testing.assert_array_equal(out, [[0.0, 0.0, 0.5, 0.5 + 1e-4, -2.0 - 1e-7, -2.0 - 1e-7]])
