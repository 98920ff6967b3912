"""Advantages and aggregation added in issue 24 (item 3): ``maxrl`` (SkyRL a956457), TRL's
``scale_rewards="batch"`` (f2cd577), verl's optimal token baseline ``otb`` with its rollout-IS
variant (1dda039) and the ``token-sum`` aggregation (verl #7197, at 1dda039)."""

from __future__ import annotations

import numpy as np
import pytest

from simkit.envs import TokenMDP
from simkit.estimators import Estimator, advantages, aggregation_weights, otb_advantages
from simkit.experiment import run
from simkit.experiment.monte_carlo import token_score_sq


def _groups(seed=0, N=12, G=4):
    rng = np.random.default_rng(seed)
    R = rng.integers(0, 2, N).astype(float)
    R[:G] = 0.0  # a group of zeros
    R[G : 2 * G] = rng.normal(size=G)
    return R


# --- maxrl, batch scaling: against the upstream loops ---------------------------------------


def _skyrl_maxrl(scores, index, epsilon=1e-6):
    """NovaSky-AI/SkyRL@a956457, skyrl/backends/skyrl_train/utils/ppo_utils.py,
    compute_maxrl_advantage, restated: (score − group mean)/(group mean + ε)."""
    out = np.array(scores, dtype=float)
    for g in set(index):
        members = [i for i in range(len(index)) if index[i] == g]
        mean = np.mean([scores[i] for i in members]) if len(members) > 1 else 0.0
        for i in members:
            out[i] = (scores[i] - mean) / (mean + epsilon) if len(members) > 1 else scores[i]
    return out


def _trl_batch_scaled(rewards, G, eps=1e-4):
    """huggingface/trl@f2cd577, trl/trainer/grpo_trainer.py, scale_rewards == "batch",
    restated: the group mean subtracted, divided by the batch's Bessel std + 1e-4."""
    r = np.asarray(rewards, float)
    means = np.repeat(r.reshape(-1, G).mean(axis=1), G)
    std = np.sqrt(((r - r.mean()) ** 2).mean() * r.size / (r.size - 1))
    return (r - means) / (std + eps)


def test_maxrl_matches_skyrl_a956457():
    R = _groups()
    np.testing.assert_allclose(
        advantages(R, "maxrl", group_size=4), _skyrl_maxrl(R, np.repeat([0, 1, 2], 4)), rtol=1e-12
    )


def test_batch_scaling_matches_trl_f2cd577():
    R = _groups(1)
    got = advantages(R, "grpo", group_size=4, eps=1e-4, scale_rewards="batch")
    np.testing.assert_allclose(got, _trl_batch_scaled(R, 4), rtol=1e-12)
    # with leading batch axes each batch has its own std
    stacked = np.stack([R, 2 * R])
    got2 = advantages(stacked, "grpo", group_size=4, eps=1e-4, scale_rewards="batch")
    np.testing.assert_allclose(got2[1], _trl_batch_scaled(2 * R, 4), rtol=1e-12)


def test_identities_of_the_group_advantages():
    R = _groups(2)
    dr = advantages(R, "dr_grpo", group_size=4)
    means = np.repeat(R.reshape(-1, 4).mean(axis=1), 4)
    np.testing.assert_allclose(advantages(R, "maxrl", group_size=4), dr / (means + 1e-6))
    # one group: the batch std is the group std
    one = R[4:8]
    np.testing.assert_array_equal(
        advantages(one, "grpo", group_size=4, scale_rewards="batch"),
        advantages(one, "grpo", group_size=4),
    )


# --- otb ------------------------------------------------------------------------------------


def _verl_otb(rewards, mask, w, index, is_weights=None, eps=1e-8, zero_tail=True):
    """verl-project/verl@1dda039, verl/trainer/ppo/core_algos.py,
    compute_optimal_token_baseline_advantage, restated for a terminal reward (one row at a
    time, as loops)."""
    N, T = mask.shape
    token_rewards = np.zeros((N, T))
    for i in range(N):
        if mask[i].any():
            token_rewards[i, np.nonzero(mask[i])[0][-1]] = rewards[i]
    returns = np.flip(np.cumsum(np.flip(token_rewards * mask, 1), 1), 1)
    per = w * (1.0 if is_weights is None else is_weights**2)
    Wc = np.cumsum(per * mask, 1)
    base = np.zeros((N, T))
    for g in sorted(set(index)):
        rows = [i for i in range(N) if index[i] == g]
        if len(rows) == 1:
            continue
        num = sum(returns[i] * Wc[i] * mask[i] for i in rows)
        den = sum(Wc[i] * mask[i] for i in rows) + eps
        for i in rows:
            base[i] = num / den
        if zero_tail:
            lengths = [int(mask[i].sum()) for i in rows]
            top = sorted(lengths)
            if lengths.count(top[-1]) == 1 and top[-1] > top[-2]:
                base[rows[lengths.index(top[-1])], top[-2] :] = 0.0
    return (returns - base) * mask


def test_otb_matches_verl_1dda039_with_and_without_is_weights():
    rng = np.random.default_rng(0)
    N, T, G = 12, 6, 4
    lengths = rng.integers(1, T + 1, N)
    lengths[:4] = [2, 3, 6, 3]  # a unique longest row: its zero tail
    mask = np.arange(T)[None] < lengths[:, None]
    R = rng.normal(size=N)
    w = rng.uniform(0.1, 1.5, (N, T)) * mask
    rho = np.minimum(np.exp(rng.normal(0, 0.5, (N, T))), 2.0)
    index = np.repeat(np.arange(N // G), G)
    for is_w in (None, rho):
        got = otb_advantages(R, mask, w, G, is_weights=is_w)
        np.testing.assert_allclose(got, _verl_otb(R, mask, w, index, is_w), rtol=1e-12, atol=1e-15)
    got = otb_advantages(R, mask, w, G, handle_zero_tail=False)
    np.testing.assert_allclose(got, _verl_otb(R, mask, w, index, zero_tail=False), rtol=1e-12)


def test_otb_with_equal_path_variances_is_the_group_mean_baseline():
    # fixed length and the same w on every row: B_t = Σ_i R_i W_t / Σ_i W_t = mean_G R
    rng = np.random.default_rng(3)
    R = rng.normal(size=8)
    mask = np.ones((8, 5), bool)
    w = np.broadcast_to(rng.uniform(0.2, 1.0, 5), (8, 5))
    A = otb_advantages(R, mask, w, 4, eps=0.0)
    np.testing.assert_allclose(A, np.repeat(advantages(R, "dr_grpo", group_size=4)[:, None], 5, 1))


def test_token_score_sq_is_the_squared_norm_of_the_score():
    env = TokenMDP.markov(V=3, T=3, seed=2, eos=2)
    batch = env.sample(env.pi, 5, np.random.default_rng(0))
    sq = token_score_sq(env, batch)
    # ‖Σ_t λ_t ∇log π‖² with λ = one-hot on a token is that token's squared score norm
    for i in range(5):
        for t in range(3):
            lam = np.zeros((1, 3))
            if not batch.mask[i, t]:
                assert sq[i, t] == 0.0
                continue
            lam[0, t] = 1.0
            g = env.accumulate(batch.actions[i : i + 1], lam)
            assert sq[i, t] == pytest.approx(float(g @ g), rel=1e-12)


def test_otb_rows_run_by_monte_carlo_with_bounds():
    env = TokenMDP.markov(V=3, T=4, seed=1, eos=2)
    rng = np.random.default_rng(0)
    mu = env.with_logits(env.logits + 0.3 * rng.standard_normal(env.logits.shape)).pi
    ests = [
        Estimator("is_token", "seq-mean-token-sum", advantage=a, group_size=4, **kw)
        for a, kw in (("rloo", {}), ("otb", {}), ("otb", {"otb_is_cap": 2.0}), ("maxrl", {}))
    ]
    df = run(env, mu, ests, n=8, reps=400, seed=0)
    assert (df["method"] == "monte_carlo").all() and df["why_mc"].str.contains("couples").all()
    assert df["bias_lo"].le(df["bias"]).all() and df["bias"].le(df["bias_hi"]).all()


# --- token-sum ------------------------------------------------------------------------------


def test_token_sum_weights_and_exact_path():
    mask = np.array([[True, True, False], [True, False, False]])
    np.testing.assert_array_equal(aggregation_weights(mask, "token-sum"), mask * 1.0)
    env = TokenMDP.markov(V=3, T=3, seed=1, eos=2)
    rng = np.random.default_rng(4)
    mu = env.with_logits(env.logits + 0.3 * rng.standard_normal(env.logits.shape)).pi
    ests = [Estimator("ppo_clip", a, name=a) for a in ("token-sum", "seq-mean-token-sum")]
    n = 8
    ex = run(env, mu, ests, n=n, reps=2, seed=0).set_index("estimator")
    assert (ex["method"] == "enumeration").all()
    assert ex.loc["token-sum", "variance"] == pytest.approx(
        n**2 * ex.loc["seq-mean-token-sum", "variance"], rel=1e-12
    )
    mc = run(env, mu, ests, n=n, reps=4000, seed=2, exact=False).set_index("estimator")
    for metric in ("bias", "variance", "cosine"):
        lo, hi = mc.loc["token-sum", f"{metric}_lo"], mc.loc["token-sum", f"{metric}_hi"]
        assert lo <= ex.loc["token-sum", metric] <= hi, metric
    # beyond enumeration the moment DP serves it too (n times the seq-mean-token-sum twin)
    big = TokenMDP.markov(V=3, T=14, seed=1)
    rows = run(big, big.pi, ests, n=n, reps=2, seed=0).set_index("estimator")
    assert (rows["method"] == "dp").all()
    assert rows.loc["token-sum", "variance"] == pytest.approx(
        n**2 * rows.loc["seq-mean-token-sum", "variance"], rel=1e-12
    )


# --- bad input ------------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="scale_rewards='batch' applies to advantage 'grpo'"):
        Estimator("naive", advantage="rloo", group_size=4, scale_rewards="batch")
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        advantages(np.zeros(4), "grpo", group_size=2, scale_rewards="prompt")
    with pytest.raises(ValueError, match="otb_is_cap applies to advantage 'otb' only"):
        Estimator("naive", otb_is_cap=2.0)
    with pytest.raises(ValueError, match="not batch dependent"):
        Estimator("snis", advantage="otb", group_size=4)
    with pytest.raises(ValueError, match="one value per token"):
        advantages(np.zeros(4), "otb", group_size=2)
    est = Estimator("naive", advantage="otb", group_size=2)
    with pytest.raises(ValueError, match="needs score_sq"):
        est.token_weights(np.zeros((2, 3)), np.ones((2, 3), bool), np.zeros(2))


def test_new_fields_round_trip_through_the_estimator_spec():
    from simkit.estimator_specs import build_estimators, estimator_params
    from simkit.kl import KLPenalty

    ests = [
        Estimator("ppo_clip", advantage="grpo", group_size=4, scale_rewards="batch"),
        Estimator("is_token", "token-sum", advantage="otb", group_size=2, otb_is_cap=2.0),
        Estimator("naive", kl=KLPenalty(0.05, "k3+", "reward", "is")),
    ]
    assert build_estimators([estimator_params(e) for e in ests]) == ests
    plain = Estimator("naive")
    assert set(estimator_params(plain)) == {
        "name",
        "mapping",
        "hyperparameters",
        "aggregation",
        "advantage",
        "group_size",
        "adv_eps",
        "max_length",
    }


def test_sweep_config_keys_for_the_new_advantages():
    from simkit.config.schema import EstimatorConfig

    entry = {
        "mapping": "is_token",
        "advantages": ["grpo", "otb", "maxrl"],
        "group_size": 4,
        "scale_rewards": "batch",
        "otb_is_cap": 2.0,
        "aggregations": ["token-sum"],
    }
    cfg = EstimatorConfig.model_validate(entry)
    built = cfg.build()
    assert [e.scale_rewards for e in built] == ["batch", "group", "group"]
    assert [e.otb_is_cap for e in built] == [None, 2.0, None]
    assert EstimatorConfig.model_validate(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="applies to advantage 'grpo' only"):
        EstimatorConfig.model_validate({**entry, "advantages": ["rloo"]})
    with pytest.raises(ValueError, match="applies to advantage 'otb' only"):
        EstimatorConfig.model_validate({**entry, "advantages": ["grpo"]})
