"""The 2026 mappings (issue 24) against the formulas of the upstream files, at the commits named
in each test, and on the experiment's exact paths.

Upstream formulas are re-derived here in torch (autograd of the upstream *loss*, written from
the file's formula) and compared with :func:`simkit.lm.losses.policy_loss` and with the numpy
coefficients of :mod:`simkit.mappings` (∂loss/∂log π = −(c·A + b)/Z), float64, to 1e-10:

- verl ``verl/trainer/ppo/core_algos.py`` @ verl-project/verl 1dda039: ``dppo_tv``, ``dppo_kl``,
  ``dro``;
- prime-rl ``src/prime_rl/trainer/rl/loss.py`` (``default_loss_fn``) @ PrimeIntellect-ai/prime-rl
  559b447: DPPO-Binary-TV + kl_tau·(log r)²;
- ROLL ``roll/pipeline/agentic/agentic_actor_pg_worker.py`` (``_compute_kimi15_loss``) and
  ``roll/utils/train_infer_corrections.py`` (segment IS) @ alibaba/ROLL 8eb27cc;
- TRL ``trl/trainer/grpo_trainer.py`` (``loss_type="luspo"``) @ huggingface/trl f2cd577;
- SkyRL ``skyrl/backends/skyrl_train/utils/ppo_utils.py`` (``rollout_is_policy_loss``,
  ``dppo_policy_loss``) @ NovaSky-AI/SkyRL a956457;
- GEPO: the README of yelurebajrang/HeteroRL_GEPO @ 1d53653 (arXiv 2508.17850).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit import composition, experiment, mappings  # noqa: E402
from simkit.envs import TokenMDP  # noqa: E402
from simkit.envs.token_moments import dp_applies, moments  # noqa: E402
from simkit.estimators import AGGREGATIONS, Estimator, aggregation_weights  # noqa: E402
from simkit.lm import losses  # noqa: E402

TOL = 1e-10


def _inputs(seed=0, N=24, T=7, spread=0.5):
    """Valid log-probabilities: log μ and log π = log μ + log r with π ≤ 1, a ragged prefix mask,
    advantages of both signs (and one 0)."""
    rng = np.random.default_rng(seed)
    log_mu = np.log(rng.uniform(0.05, 0.95, (N, T)))
    lr = rng.normal(0.0, spread, (N, T))
    lr = np.minimum(lr, -log_mu - 1e-9)  # π = μ·r ≤ 1
    lengths = rng.integers(1, T + 1, N)
    lengths[0] = T
    mask = np.arange(T)[None, :] < lengths[:, None]
    adv = rng.normal(size=N)
    adv[1] = 0.0
    return log_mu, log_mu + lr, mask, adv


def _autograd(loss_fn, lp):
    x = torch.tensor(lp, requires_grad=True)
    loss_fn(x).backward()
    return x.grad.numpy()


def _simkit_grad(mapping, lp, old, mask, adv, agg="token-mean"):
    x = torch.tensor(lp, requires_grad=True)
    loss, _ = losses.policy_loss(
        mapping, x, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), agg=agg
    )
    loss.backward()
    return x.grad.numpy()


def _numpy_grad(mapping, lp, old, mask, adv, agg="token-mean"):
    kw = {"log_prob": lp} if mapping.uses_log_prob else {}
    c = mapping.coefficients(lp - old, mask, adv, **kw)
    b = mapping.additive(lp - old, mask, log_prob=lp)
    return -(c * adv[:, None] + b) * aggregation_weights(mask, agg)


def _token_mean(loss_mat, mask):
    m = torch.tensor(mask, dtype=torch.float64)
    return (loss_mat * m).sum() / m.sum()


def _check(mapping, upstream, lp, old, mask, adv, agg="token-mean", scale=1.0):
    expected = _autograd(upstream, lp) * scale
    np.testing.assert_allclose(_simkit_grad(mapping, lp, old, mask, adv, agg), expected, atol=TOL)
    np.testing.assert_allclose(_numpy_grad(mapping, lp, old, mask, adv, agg), expected, atol=TOL)


# --- verl 1dda039 -----------------------------------------------------------------------------


def _verl_dppo(old, adv, mask, divergence, eps_low, eps_high, clip_ratio_c):
    """verl compute_policy_loss_dppo_tv / _kl @1dda039: −A·sg(min(r, C))·log π·valid."""
    old_t, a = torch.tensor(old), torch.tensor(adv)[:, None]

    def loss(log_prob):
        neg_kl = torch.clamp(log_prob - old_t, min=-20.0, max=20.0)
        truncated = torch.clamp(torch.exp(neg_kl), max=clip_ratio_c).detach()
        prob, old_prob = torch.exp(log_prob), torch.exp(old_t)
        if divergence == "tv":
            pos = (prob - old_prob) <= eps_high
            neg = (prob - old_prob) >= -eps_low
        else:
            bkl = old_prob * (old_t - log_prob) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            pos = (bkl <= eps_high) | (prob <= old_prob)
            neg = (bkl <= eps_low) | (prob >= old_prob)
        valid = torch.where(a > 0, pos, neg).detach().double()
        return _token_mean(-a * truncated * log_prob * valid, mask)

    return loss


@pytest.mark.parametrize("preset, C", [("verl", 3.0), ("verl_fallback", 20.0)])
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_equals_verl_1dda039(name, preset, C):
    old, lp, mask, adv = _inputs(1, spread=0.8)
    old[0, 0], lp[0, 0], adv[0] = math.log(0.01), math.log(0.25), -1.0  # r = 25, kept at A < 0
    m = mappings.get(name, preset=preset)
    assert m.c == C
    divergence = name[-2:]
    eps = (0.2, 0.2) if divergence == "tv" else (0.02, 0.05)
    m = mappings.get(name, preset=preset, eps_low=eps[0], eps_high=eps[1])
    upstream = _verl_dppo(old, adv, mask, divergence, eps[0], eps[1], C)
    _check(m, upstream, lp, old, mask, adv)
    c = m.coefficients(lp - old, mask, adv, log_prob=lp)
    assert (c[mask] == 0).any() and (c[mask] == C).any()  # both the gate and the cap act here


def test_dro_equals_verl_1dda039_and_kimi15_of_roll_8eb27cc():
    """verl compute_policy_loss_dro: −(log π·A − ½β(log r)²); ROLL _compute_kimi15_loss:
    −A·log π + τ·½(log π − log π_old)², τ = kimi15_tau = 0.1 (β = τ)."""
    old, lp, mask, adv = _inputs(2)
    old_t, a = torch.tensor(old), torch.tensor(adv)[:, None]
    for beta in (0.1, 0.7):

        def verl(log_prob, beta=beta):
            lr = log_prob - old_t
            return _token_mean(-(log_prob * a - 0.5 * beta * lr.square()), mask)

        _check(mappings.get("dro", beta=beta), verl, lp, old, mask, adv)
    tau = mappings.get("dro", preset="kimi15").beta
    assert tau == 0.1

    def roll(log_prob):
        return _token_mean(-a * log_prob + tau * 0.5 * (log_prob - old_t).pow(2), mask)

    _check(mappings.get("dro", preset="kimi15"), roll, lp, old, mask, adv)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_dro_with_beta_zero_is_naive_exactly(agg):
    old, lp, mask, adv = _inputs(3)
    a = _simkit_grad(mappings.get("dro", beta=0.0), lp, old, mask, adv, agg)
    b = _simkit_grad(mappings.get("naive"), lp, old, mask, adv, agg)
    np.testing.assert_array_equal(a, b)
    m = mappings.get("dro", beta=0.0)
    assert not m.has_additive
    np.testing.assert_array_equal(m.coefficients(lp - old, mask, adv), mask * 1.0)


# --- prime-rl 559b447 -------------------------------------------------------------------------


def test_dppo_prime_rl_preset_equals_prime_rl_559b447_default_loss():
    """default_loss_fn: −keep·A·r + kl_tau·(log r)², summed (no normalisation): simkit's
    seq-mean-token-sum (1/N) times N. dppo_mask_low/high = 0.2, kl_tau = 1e-3, adv_tau = 1."""
    old, lp, mask, adv = _inputs(4, spread=0.9)
    old_t, a = torch.tensor(old), torch.tensor(adv)[:, None]
    m_t = torch.tensor(mask)

    def prime(log_prob):
        lr = log_prob - old_t
        diff = torch.exp(log_prob) - torch.exp(old_t)
        invalid = torch.where(a > 0, diff > 0.2, diff < -0.2)
        keep = (m_t & ~invalid).double()
        per_token = -(keep * a * torch.exp(lr)) + 1e-3 * m_t.double() * lr**2
        return per_token.sum()

    m = mappings.get("dppo_tv", preset="prime_rl")
    assert (m.c, m.beta, m.eps_low, m.eps_high) == (math.inf, 2e-3, 0.2, 0.2)
    _check(m, prime, lp, old, mask, adv, agg="seq-mean-token-sum", scale=1 / len(adv))


# --- SkyRL a956457 ----------------------------------------------------------------------------


def test_rollout_is_equals_skyrl_a956457():
    """rollout_is_policy_loss: −sg(r·1[1−ε_l < r < 1+ε_h])·A·log π, r = exp(clamp(Δ, ±20))."""
    old, lp, mask, adv = _inputs(5, spread=0.3)
    lp[2, 0] = old[2, 0] + math.log(1.2)  # r on the upper bound 1 + ε (open band: dropped)
    old_t, a = torch.tensor(old), torch.tensor(adv)[:, None]

    def skyrl(log_prob):
        ratio = torch.clamp(log_prob - old_t, -20.0, 20.0).exp()
        in_range = (ratio > 1 - 0.2) & (ratio < 1 + 0.2)
        calibrated = torch.where(in_range, ratio, torch.zeros_like(ratio))
        return _token_mean(-(calibrated.detach() * a * log_prob), mask)

    m = mappings.get("rollout_is", preset="skyrl")
    _check(m, skyrl, lp, old, mask, adv)
    c = m.coefficients(lp - old, mask, adv)
    assert (c[mask] == 0).any() and (c[mask] > 0).any()


def test_dppo_skyrl_preset_equals_skyrl_a956457():
    """dppo_policy_loss, binary_tv, δ = 0.2/0.2: −ratio·A·mask with the un-truncated ratio."""
    old, lp, mask, adv = _inputs(6, spread=0.8)
    old_t, a = torch.tensor(old), torch.tensor(adv)[:, None]

    def skyrl(log_prob):
        ratio = torch.clamp(log_prob - old_t, -20.0, 20.0).exp()
        with torch.no_grad():
            diff = torch.exp(log_prob) - torch.exp(old_t)
            keep = torch.ones_like(diff)
            keep[((a > 0) & (diff > 0.2)).expand_as(diff)] = 0.0
            keep[((a < 0) & (-diff > 0.2)).expand_as(diff)] = 0.0
        return _token_mean(-(ratio * a * keep), mask)

    _check(mappings.get("dppo_tv", preset="skyrl"), skyrl, lp, old, mask, adv)


# --- TRL f2cd577 ------------------------------------------------------------------------------


def test_luspo_equals_trl_f2cd577():
    """loss_type="luspo", importance_sampling_level="sequence": coef_1 = exp(mean log r)
    (B, 1), per_token_loss = −min(coef_1·A, clamp(coef_1, 1−ε, 1+ε)·A), loss =
    (per_token_loss·|y|).mean() — simkit's luspo with seq-mean-token-mean."""
    old, lp, mask, adv = _inputs(7, spread=0.3)
    old_t, a = torch.tensor(old), torch.tensor(adv)[:, None]
    m_t = torch.tensor(mask).double()

    def trl(log_prob):
        log_w = ((log_prob - old_t) * m_t).sum(-1) / m_t.sum(-1).clamp(min=1.0)
        coef_1 = torch.exp(log_w)[:, None]
        coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
        per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
        return (per_token_loss * m_t.sum(1, keepdim=True)).mean()

    m = mappings.get("luspo", preset="trl")
    _check(m, trl, lp, old, mask, adv, agg="seq-mean-token-mean")
    c = m.coefficients(lp - old, mask, adv)
    assert (c[mask] == 0).any()  # the band clips some rows here


# --- ROLL 8eb27cc: segment IS -----------------------------------------------------------------


def test_segment_is_equals_roll_8eb27cc_on_multi_segment_masks():
    """compute_segment_masked_mean: each run of consecutive 1s of the mask gets the mean of its
    log-ratios; is_weight = clamp(exp(·), 0, upper_bound = 1.2), detached."""
    rng = np.random.default_rng(8)
    lr = rng.normal(0, 0.3, (5, 9))
    mask = np.array(
        [
            [1, 1, 0, 0, 1, 1, 1, 0, 1],
            [0, 1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 1, 0, 1, 0, 1],
        ],
        dtype=bool,
    )
    expected = np.zeros(lr.shape)
    for i in range(lr.shape[0]):
        t = 0
        while t < lr.shape[1]:
            if not mask[i, t]:
                t += 1
                continue
            end = t
            while end < lr.shape[1] and mask[i, end]:
                end += 1
            expected[i, t:end] = min(math.exp(lr[i, t:end].mean()), 1.2)
            t = end
    m = mappings.get("segment_is", preset="roll")
    adv = rng.normal(size=5)
    np.testing.assert_allclose(m.coefficients(lr, mask, adv), expected, rtol=1e-12)
    old = np.log(rng.uniform(0.1, 0.9, lr.shape))
    grad = _simkit_grad(m, old + lr, old, mask, adv)
    np.testing.assert_allclose(
        grad, -expected * adv[:, None] * aggregation_weights(mask, "token-mean")
    )


# --- GEPO (HeteroRL_GEPO README @ 1d53653) ----------------------------------------------------


def test_gepo_weight_equals_the_readme_formula():
    """normalized_q = μ(y)/Σμ(y); coef_1 = π(y)/Σ(normalized_q·μ(y)), one group per prompt."""
    old, lp, mask, adv = _inputs(9, N=12, T=3, spread=0.3)
    lp_seq = np.where(mask, lp, 0.0).sum(1)
    mu_seq = np.exp(np.where(mask, old, 0.0).sum(1))
    for G in (None, 4):
        groups = [slice(0, 12)] if G is None else [slice(g, g + G) for g in range(0, 12, G)]
        expected = np.empty(12)
        for sl in groups:
            q = mu_seq[sl] / mu_seq[sl].sum()
            expected[sl] = np.exp(lp_seq[sl]) / (q * mu_seq[sl]).sum()
        m = mappings.get("gepo", group_size=G)
        c = m.coefficients(lp - old, mask, adv, log_prob=lp)
        np.testing.assert_allclose(c, expected[:, None] * mask, rtol=1e-12)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        mappings.get("gepo", group_size=5).coefficients(lp - old, mask, adv, log_prob=lp)


# --- interface ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "gepo"])
def test_mappings_that_need_log_prob_say_so(name):
    m = mappings.get(name)
    assert m.requires_log_prob
    with pytest.raises(ValueError, match="needs log_prob"):
        m.coefficients(np.zeros((2, 3)), np.ones((2, 3), bool), np.ones(2))


def test_compositions_the_interface_cannot_express_are_refused():
    with pytest.raises(ValueError, match="additive per-token term"):
        Estimator("dro", correction="tis_token")
    with pytest.raises(ValueError, match="requires_log_prob"):
        Estimator("naive", correction="gepo")
    Estimator("dro", name="x")  # alone: fine
    Estimator(mappings.get("dppo_tv"), correction="tis_token")  # DPPO on π/π_old × TIS: fine
    assert composition.carries_ratio(mappings.get("dppo_tv"))


# --- the experiment's exact paths --------------------------------------------------------------


def _small_env():
    return TokenMDP.answer_correct(2, 5, seed=3, stationary=False)


def _mu(env, seed=11, scale=0.8):
    from conftest import noisy_policy

    return noisy_policy(env.logits, seed, scale)


def test_planner_treats_per_sample_mappings_as_exact():
    env = _small_env()
    big = TokenMDP.answer_correct(2, 40, seed=0)
    agg = "seq-mean-token-sum"
    for name in ("dro", "dppo_tv", "dppo_kl", "luspo", "rollout_is", "segment_is"):
        est = Estimator(mappings.get(name), aggregation=agg)
        assert experiment.plan(est, env).method == "enumeration", name
    for name in ("dppo_tv", "dppo_kl", "rollout_is"):  # per-token: the moment DP at any T
        assert experiment.plan(Estimator(mappings.get(name), aggregation=agg), big).method == "dp"
    for params in ("untied", "tied"):
        assert experiment.plan(Estimator("dppo_tv", aggregation=agg), big, params).exact
    prime = Estimator(mappings.get("dppo_tv", preset="prime_rl"), aggregation=agg)
    assert "additive" in dp_applies(big, prime.mapping, agg)  # the plain DP refuses b
    # the additive moment DP carries b (untied parameters; tests/test_token_moments_additive.py)
    assert experiment.plan(prime, big).method == "dp"
    assert experiment.plan(Estimator("dro", aggregation=agg), big).method == "dp"
    assert "untied parameters only" in experiment.plan(prime, big, "tied").why_mc
    assert experiment.plan(Estimator("gepo", aggregation=agg), env).method == "monte_carlo"


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("params", ["untied", "tied"])
def test_dppo_moment_dp_equals_enumeration(name, params):
    env = _small_env()
    mu = _mu(env)
    m = mappings.get(name, eps_low=0.05, eps_high=0.05, c=1.5)
    n = 3
    for agg in ("seq-mean-token-sum", "token-mean"):
        est = Estimator(m, aggregation=agg)
        ref = experiment.exact_moments(env, mu, est, n, params=params)
        assert ref.method == "enumeration"
        if params == "untied":
            b = experiment.oracle_baseline(env, mu, est)
            dp = moments(env, mu, m, b, agg)
            np.testing.assert_allclose(dp.mean, ref.mean, rtol=0, atol=TOL)
            assert dp.variance(n) == pytest.approx(ref.variance, rel=TOL, abs=TOL)
        else:
            from simkit.envs.token_moments_tied import tied_moments

            b = experiment.oracle_baseline(env, mu, est)
            dp = tied_moments(env, mu, m, b, agg)
            np.testing.assert_allclose(dp.mean, ref.mean, rtol=0, atol=TOL)
            assert dp.variance(n) == pytest.approx(ref.variance, rel=TOL, abs=TOL)
    # the gate acts on this μ (the test is not the REINFORCE one)
    plain = experiment.exact_moments(env, mu, Estimator("naive", aggregation=agg), n, params=params)
    assert np.abs(plain.mean - ref.mean).max() > 1e-3


def test_exact_moments_with_the_additive_term_match_monte_carlo():
    """dro's exact row (enumeration, E h and E‖h‖² with the cross term) lies inside the Monte
    Carlo 99 % bootstrap intervals of 4000 batches; β = 0 equals naive to 1e-12."""
    env = _small_env()
    mu = _mu(env)
    ests = [
        Estimator(mappings.get("dro", beta=2.0), aggregation="seq-mean-token-sum", name="dro"),
        Estimator("naive", aggregation="seq-mean-token-sum", name="naive"),
        Estimator(mappings.get("dro", beta=0.0), aggregation="seq-mean-token-sum", name="dro0"),
    ]
    ex = experiment.run(env, mu, ests, n=4, reps=2, exact=True, progress=False)
    assert ex.exact.all()
    rows = ex.set_index("estimator")
    for col in ("bias", "variance"):
        assert rows.loc["dro0", col] == pytest.approx(rows.loc["naive", col], rel=1e-12, abs=1e-15)
    assert abs(rows.loc["dro", "bias"] - rows.loc["naive", "bias"]) > 1e-3  # the term matters
    mc = experiment.run(
        env, mu, ests[:1], n=4, reps=4000, exact=False, progress=False, seed=5, level=0.99
    )
    for col in ("bias", "variance", "mse"):
        lo, hi = mc.loc[0, f"{col}_lo"], mc.loc[0, f"{col}_hi"]
        assert lo <= rows.loc["dro", col] <= hi, (col, lo, rows.loc["dro", col], hi)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_decoupled_dppo_acts_on_pi_and_pi_old_in_numpy_and_torch(name):
    """verl's decoupled mode: DPPO on π/π_old (its gate on π − π_old) × the rollout correction
    on π_old/μ; numpy (Estimator) and torch (policy_loss with rollout_log_prob) agree."""
    log_old, lp, mask, adv = _inputs(10, spread=0.8)
    rng = np.random.default_rng(3)
    log_mu = log_old + np.minimum(rng.normal(0, 0.3, lp.shape), 0.0)  # μ ≤ π_old: a valid law
    m = mappings.get(name, eps_low=0.1, eps_high=0.1)
    est = Estimator(m, correction="tis_token")
    c = est.coefficients(lp - log_mu, mask, adv, old_log_ratio=log_old - log_mu, log_prob=lp)
    stale = m.coefficients(lp - log_old, mask, adv, log_prob=lp)
    infer = mappings.get("tis_token").coefficients(log_old - log_mu, mask, adv)
    np.testing.assert_allclose(c, stale * infer, rtol=1e-14)
    assert (stale[mask] == 0).any()
    x = torch.tensor(lp, requires_grad=True)
    loss, _ = losses.policy_loss(
        m,
        x,
        torch.tensor(log_old),
        torch.tensor(adv),
        torch.tensor(mask),
        correction="tis_token",
        rollout_log_prob=torch.tensor(log_mu),
    )
    loss.backward()
    expected = -c * adv[:, None] * aggregation_weights(mask, "token-mean")
    np.testing.assert_allclose(x.grad.numpy(), expected, atol=TOL)
