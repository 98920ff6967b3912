"""simkit.envs.token_moments.composed_moments: exact moments of composed estimators (three
policies: π, π_old, μ) by DP, against enumeration (:func:`simkit.experiment.exact_moments` with
``old``, an independent computation through ``Estimator.coefficients`` on every sequence) to
1e-10, and exact beyond enumeration (T = 64) through :func:`simkit.experiment.run`."""

import numpy as np
import pytest
from conftest import noisy_policy

from simkit import experiment, mappings
from simkit.envs import TokenMDP
from simkit.envs.token_moments import composed_dp_applies, composed_moments, moments
from simkit.estimators import Estimator

TOL = 1e-10


def _tilt(env, seed, scale, base=None):
    """softmax of π's logits (or of log ``base``) plus scale·N(0, 1) noise."""
    return noisy_policy(env.logits if base is None else np.log(base), seed, scale)


def _envs():
    return {
        "answer_correct-T8": TokenMDP.answer_correct(2, 8, seed=3, stationary=False),
        "markov-eos": TokenMDP.markov(3, 5, target=1, eos=2, seed=2, stationary=False),
        "at_least_k": TokenMDP.at_least_k(3, 5, k=2, hit=0, seed=4, stationary=False),
    }


#: (mapping, correction, mode): every factor kind crossed (token × token, token × product,
#: product × token, product × product, bypass, and a power product)
COMBOS = [
    ("ppo_clip", "tis_token", "decoupled"),
    ("ppo_clip", "mis_token", "decoupled"),
    ("dapo", "icepop", "decoupled"),
    ("is_token", "is_token", "decoupled"),
    ("ppo_clip", "is_seq", "decoupled"),
    ("is_seq", "tis_token", "decoupled"),
    ("is_seq", "is_seq", "decoupled"),
    ("power", "power", "decoupled"),
    ("naive", "tis_token", "decoupled"),
    ("ppo_clip", "tis_token", "bypass"),
    ("is_seq", "icepop", "bypass"),
]
AGGS = ("seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("env_name", list(_envs()))
@pytest.mark.parametrize(("name", "corr", "mode"), COMBOS, ids=lambda x: str(x))
def test_composed_dp_equals_enumeration(name, corr, mode, env_name):
    env = _envs()[env_name]
    old = _tilt(env, 5, 0.4)  # π_old: the staleness leg
    mu = _tilt(env, 6, 0.5, base=old)  # μ: π_old under a mismatch
    n = 3
    for agg in AGGS:
        if agg == "token-mean" and not env.fixed_length:
            continue
        for advantage in ("oracle", "raw"):
            est = Estimator(
                mappings.get(name),
                aggregation=agg,
                advantage=advantage,
                correction=corr,
                mode=mode,
                allow_same_ratio=True,  # the DP must hold for the double count too
            )
            b = experiment.oracle_baseline(env, mu, est)
            dp = composed_moments(env, mu, old, est.mapping, est.correction, mode, b, agg)
            ref = experiment.exact_moments(env, mu, est, n, old=old)
            scale = max(1.0, float(np.abs(ref.mean).max()))
            np.testing.assert_allclose(dp.mean, ref.mean, rtol=0, atol=TOL * scale)
            assert dp.variance(n) == pytest.approx(ref.variance, rel=TOL, abs=TOL)
            assert dp.ess(n) == pytest.approx(ref.ess, rel=1e-9)


def test_without_old_and_without_correction_it_is_the_single_ratio_dp():
    env = _envs()["at_least_k"]
    mu = _tilt(env, 6, 0.5)
    for name in ("ppo_clip", "is_seq"):
        single = moments(env, mu, mappings.get(name), 0.1)
        comp = composed_moments(env, mu, None, mappings.get(name), None, "decoupled", 0.1)
        np.testing.assert_allclose(comp.mean, single.mean, rtol=0, atol=1e-13)
        assert comp.second == pytest.approx(single.second, rel=1e-12)


def test_decoupled_sequence_is_on_both_legs_is_unbiased_at_T_4096():
    """W(π/π_old)·W(π_old/μ) = W(π/μ): E h = ∇J for the oracle advantage, at any T (the
    rescaled sweeps neither overflow nor underflow)."""
    env = TokenMDP.answer_correct(4, 4096, seed=1)
    old = _tilt(env, 3, 0.03)
    mu = _tilt(env, 4, 0.03, base=old)
    is_seq = mappings.get("is_seq")
    dp = composed_moments(env, mu, old, is_seq, is_seq, "decoupled", env.J(mu))
    assert np.isfinite(dp.second) and dp.second > 0
    np.testing.assert_allclose(dp.mean, env.grad_J(), rtol=0, atol=1e-10)


def test_composed_dp_applies_names_the_obstacle():
    env = TokenMDP.answer_correct(2, 3)
    ppo, vespo = mappings.get("ppo_clip"), mappings.get("vespo")
    tis_token = mappings.get("tis_token")
    agg = "seq-mean-token-sum"
    assert composed_dp_applies(env, ppo, tis_token, "decoupled", agg) == ""
    assert "trl_vespo" in composed_dp_applies(env, vespo, tis_token, "trl_vespo", agg)
    assert "kept" in composed_dp_applies(env, ppo, tis_token, "decoupled", agg, "kept")
    assert "'mis_seq'" in composed_dp_applies(env, ppo, mappings.get("mis_seq"), "decoupled", agg)
    assert "product-form" in composed_dp_applies(
        env, mappings.get("gspo"), tis_token, "bypass", agg
    )
    with pytest.raises(ValueError, match="no moment DP"):
        composed_moments(env, env.pi, env.pi, ppo, mappings.get("tis_seq"), "decoupled", 0.0)


def test_experiment_run_with_old_is_exact_at_T_64_by_dp():
    """Beyond enumeration (2^64 sequences) experiment.run(old=…) uses the composed DP: exact =
    True; sequence IS on both legs is unbiased; the exact variance and MSE lie inside the Monte
    Carlo 99 % bootstrap intervals (4000 batches)."""
    env = TokenMDP.answer_correct(2, 64, seed=0)
    old = _tilt(env, 5, 0.06)
    mu = _tilt(env, 6, 0.06, base=old)
    agg = "seq-mean-token-sum"
    ests = [
        Estimator("ppo_clip", aggregation=agg, correction="tis_token"),
        Estimator("is_token", aggregation=agg, correction="mis_token"),
        Estimator("is_seq", aggregation=agg, correction="is_seq"),
        Estimator(
            "ppo_clip", aggregation=agg, correction="icepop", mode="bypass", allow_same_ratio=True
        ),
        Estimator("ppo_clip", aggregation=agg),  # no correction: one ratio π/μ
    ]
    ex = experiment.run(env, mu, ests, n=4, reps=2, exact=True, old=old, progress=False)
    assert ex.exact.all()
    assert ex.bias.iloc[2] < 1e-10  # is_seq × is_seq
    mc = experiment.run(env, mu, ests, n=4, reps=4000, exact=False, old=old, seed=7, level=0.99)
    for col in ("variance", "mse"):
        inside = (mc[f"{col}_lo"] <= ex[col]) & (ex[col] <= mc[f"{col}_hi"])
        assert inside.all(), (col, ex[col].tolist(), mc[[f"{col}_lo", f"{col}_hi"]])
    # without a factorised form: Monte Carlo under "auto", a clear refusal under exact=True
    seq_mask = Estimator("ppo_clip", aggregation=agg, correction="mis_seq")
    auto = experiment.run(env, mu, [seq_mask], n=4, reps=20, old=old, progress=False)
    assert not auto.exact.iloc[0]
    with pytest.raises(ValueError, match="'mis_seq' is not a per-token or product-form"):
        experiment.run(env, mu, [seq_mask], n=4, reps=5, exact=True, old=old)
