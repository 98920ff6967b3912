"""simkit.envs.token_kept: exact kept fractions by DP against the enumerated support.

The reference is what the enumeration path does: the atoms of ``env.support(μ, b)`` (every
sequence, with A ≥ 0 counted as positive), each atom's coefficients from
``Estimator.coefficients`` (the mapping's own code, π_old's log-ratios from
:func:`simkit.experiment.exact.old_log_ratio_of`) and
:func:`simkit.experiment.metrics.kept_fractions` weighted by ``atoms.prob``. Agreement to 1e-12.
"""

import numpy as np
import pytest
from conftest import noisy_policy

from simkit import mappings
from simkit.envs import TokenMDP
from simkit.envs.token_kept import kept_dp, kept_dp_applies
from simkit.estimators import Estimator
from simkit.experiment.exact import old_log_ratio_of
from simkit.experiment.metrics import kept_fractions

TOL = 1e-12
ZEROING = ["icepop", "mis_token", "ppo_clip", "dapo", "dual_clip"]
NON_ZEROING = ["naive", "tis_token", "sapo", "is_seq", "power"]


def _envs():
    return {
        "markov-eos": TokenMDP.markov(3, 5, target=1, eos=2, seed=2, stationary=False),
        "answer_correct": TokenMDP.answer_correct(2, 8, seed=3, stationary=False),
        "at_least_k": TokenMDP.at_least_k(3, 5, k=2, hit=0, seed=4, stationary=False),
        "iid-eos": TokenMDP.iid(3, 6, eos=2, seed=1, stationary=False),
        "short-eos": TokenMDP.markov(3, 3, target=1, eos=2, seed=2, stationary=False),
    }


def _reference(env, mu, est, b, old=None):
    atoms = env.support(mu, b)
    mask = np.asarray(atoms.mask, dtype=bool)
    old_lr = old_log_ratio_of(env, old, mu, atoms)
    c = est.coefficients(atoms.log_ratio, mask, atoms.advantage_sign, old_log_ratio=old_lr)
    return kept_fractions(c, mask, atoms.prob)


def _baselines(env, mu):
    """J(μ) (no A = 0), 0 (raw: A = 0 on the failures, counted positive) and 1 (A = 0 on the
    successes, every A ≤ 0)."""
    return [env.J(mu), 0.0, 1.0]


@pytest.mark.parametrize("env_name", list(_envs()))
@pytest.mark.parametrize("name", ZEROING + NON_ZEROING)
def test_kept_dp_equals_support(name, env_name):
    env = _envs()[env_name]
    scale = 2.0 if env_name == "short-eos" else 0.9
    mu = noisy_policy(env.logits, 11, scale)
    est = Estimator(mappings.get(name))
    for b in _baselines(env, mu):
        ref = _reference(env, mu, est, b)
        dp = kept_dp(env, mu, est.mapping, b)
        assert dp["kept"] == pytest.approx(ref["kept"], abs=TOL)
        assert dp["kept_seq"] == pytest.approx(ref["kept_seq"], abs=TOL)
        if name in NON_ZEROING:
            assert dp["kept"] == pytest.approx(1.0, abs=TOL)
            assert dp["kept_seq"] == pytest.approx(1.0, abs=TOL)


@pytest.mark.parametrize("name", ["icepop", "mis_token", "ppo_clip"])
def test_masks_drop_tokens_and_whole_sequences(name):
    """The cases above are not trivial: the masks drop tokens, and on short sequences under a
    large mismatch whole sequences (kept_seq < 1)."""
    env = _envs()["short-eos"]
    mu = noisy_policy(env.logits, 11, 2.0)
    dp = kept_dp(env, mu, mappings.get(name), env.J(mu))
    assert dp["kept"] < 0.9
    assert dp["kept_seq"] < 0.95
    env = _envs()["markov-eos"]
    dp = kept_dp(env, noisy_policy(env.logits, 11, 0.9), mappings.get(name), 0.5)
    assert dp["kept"] < 0.97


COMBOS = [
    ("ppo_clip", "icepop", "decoupled"),
    ("dapo", "mis_token", "decoupled"),
    ("is_seq", "mis_token", "decoupled"),
    ("ppo_clip", "is_seq", "decoupled"),
    ("power", "icepop", "decoupled"),
    ("ppo_clip", "icepop", "bypass"),
    ("naive", "tis_token", "decoupled"),
]


@pytest.mark.parametrize("env_name", ["markov-eos", "at_least_k", "short-eos"])
@pytest.mark.parametrize(("name", "corr", "mode"), COMBOS, ids=str)
def test_composed_kept_dp_equals_support(name, corr, mode, env_name):
    env = _envs()[env_name]
    old = noisy_policy(env.logits, 5, 0.8)
    mu = noisy_policy(np.log(old), 6, 0.9)
    # the bypass row composes the one ratio on purpose
    est = Estimator(mappings.get(name), correction=corr, mode=mode, allow_same_ratio=True)
    for b in _baselines(env, mu):
        ref = _reference(env, mu, est, b, old)
        dp = kept_dp(env, mu, est.mapping, b, est.correction, old, mode)
        assert dp["kept"] == pytest.approx(ref["kept"], abs=TOL)
        assert dp["kept_seq"] == pytest.approx(ref["kept_seq"], abs=TOL)


def test_kept_dp_applies():
    env = TokenMDP.answer_correct(2, 3, eos=1)
    assert kept_dp_applies(env, mappings.get("icepop")) == ""
    assert kept_dp_applies(env, mappings.get("is_seq")) == ""
    for name in ("tis_seq", "mis_seq", "gspo", "geo_mask", "kl_rs", "vespo", "snis"):
        assert name in kept_dp_applies(env, mappings.get(name))
    assert "trl_vespo" in kept_dp_applies(
        env, mappings.get("ppo_clip"), mappings.get("tis_token"), "trl_vespo"
    )
    assert "tis_seq" in kept_dp_applies(env, mappings.get("ppo_clip"), mappings.get("tis_seq"))
    with pytest.raises(ValueError, match="no kept-fraction DP"):
        kept_dp(env, env.pi, mappings.get("kl_rs"), 0.0)
    with pytest.raises(ValueError, match="baseline"):
        kept_dp(env, env.pi, mappings.get("icepop"), float("nan"))


def test_kept_dp_at_T_4096():
    """Long sequences: fractions in [0, 1]; the product forms keep everything."""
    env = TokenMDP.answer_correct(3, 4096, seed=1, eos=2)
    mu = noisy_policy(env.logits, 3, 0.3)
    b = env.J(mu)
    ice = kept_dp(env, mu, mappings.get("icepop"), b)
    assert 0.0 < ice["kept"] < 1.0 and 0.0 <= ice["kept_seq"] <= 1.0
    seq = kept_dp(env, mu, mappings.get("is_seq"), b)
    assert seq == pytest.approx({"kept": 1.0, "kept_seq": 1.0}, abs=1e-12)
