# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Solutions — 02 Importance sampling
#
# Worked solutions to the exercises of `02_importance_sampling`; Monte Carlo checks use a
# fixed seed and a tolerance of z standard errors computed from the same draws.
#
# **Runtime**: about 8 s at full size, about 5 s with `SIMKIT_FAST=1`.

# %%
import os

import numpy as np

from simkit import divergence, mappings, shifts, theory

FAST = os.environ.get("SIMKIT_FAST", "0") == "1"
Z = 4.5
rng = np.random.default_rng(11)
pi = np.array([0.35, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
mu = shifts.dial(pi, 0.5, "chi2", "logit_noise")  # the μ of the notebook's section 1

# %% [markdown]
# ## Exercise 1 — estimating one probability
#
# One term of the estimate is X = w(y)·1[y = a] with y ~ μ. E_μ[X] = π(a), and
# E_μ[X²] = μ(a)·(π(a)/μ(a))² = π(a)²/μ(a), so
#
# $$\operatorname{Var}_\mu(X) = \frac{\pi(a)^2}{\mu(a)} - \pi(a)^2 .$$
#
# On-policy (μ = π) this is π(a)(1 − π(a)). The IS variance is smaller exactly when
# π(a)²/μ(a) − π(a)² < π(a) − π(a)², i.e. when **μ(a) > π(a)**: sampling the token of
# interest *more often* than π does and down-weighting it is variance reduction — the
# original purpose of importance sampling. Sampling it less often costs variance.

# %%
n = 50_000 if FAST else 500_000
y = rng.choice(pi.size, size=n, p=mu)
w = pi[y] / mu[y]
for a in (int(np.argmin(pi)), int(np.argmax(pi))):
    x = w * (y == a)
    var_formula = pi[a] ** 2 / mu[a] - pi[a] ** 2
    on_policy = pi[a] * (1 - pi[a])
    centred = x - x.mean()
    var_hat = np.mean(centred**2)
    var_se = np.sqrt((np.mean(centred**4) - var_hat**2) / n)
    print(
        f"token {a}: π = {pi[a]:.3f}, μ = {mu[a]:.3f}; Var formula {var_formula:.5f}, "
        f"MC {var_hat:.5f} ± {var_se:.5f}; on-policy {on_policy:.5f}"
    )
    assert abs(var_hat - var_formula) <= Z * var_se
    assert (var_formula < on_policy) == (mu[a] > pi[a])

# %% [markdown]
# ## Exercise 2 — when does the ESS collapse?
#
# The limit is ESS/n = 1/(1+χ²)^T. It drops below 10 % when T·log(1.05) ≥ log 10, i.e.
# T ≥ log 10 / log 1.05 ≈ 47.2: **T = 48**. At 4T = 192 the limit is 1/1.05¹⁹² ≈ 8.5·10⁻⁵ —
# fewer than one effective sequence out of 4 000.

# %%
CHI2_TOK = 0.05
T_star = int(np.ceil(np.log(10) / np.log1p(CHI2_TOK)))
assert T_star == 48
assert theory.expected_ess(1, theory.seq_is_variance(CHI2_TOK, T_star)) < 0.1
assert theory.expected_ess(1, theory.seq_is_variance(CHI2_TOK, T_star - 1)) >= 0.1

mu_tok = shifts.dial(pi, CHI2_TOK, "chi2", "logit_noise")
log_w_tok = np.log(pi / mu_tok)
results = {}
for T in (T_star, 4 * T_star):
    log_W = log_w_tok[rng.choice(pi.size, size=(4_000, T), p=mu_tok)].sum(axis=1)
    limit = 1 / theory.seq_is_second_moment(CHI2_TOK, T)
    results[T] = (divergence.ess(log_W) / log_W.size, limit, mappings.psis_khat(log_W))
    print(
        f"T = {T:3d}: sample ESS/n = {results[T][0]:.5f}, limit {limit:.5f}, "
        f"k̂ = {results[T][2]:.2f}"
    )
frac, limit, khat = results[4 * T_star]
assert frac > 10 * limit and khat > 0.7

# %% [markdown]
# At 4T the sample ESS claims over ten times the true number of effective sequences (the
# truth is a fraction of one): it is computed from the very weights whose tail has not been
# sampled. k̂ > 0.7 is the number to trust — it says the weights' tail is too heavy for any
# moment-based summary of this sample (ESS included) to be reliable.
#
# ## Exercise 3 — where the standard error stops meaning anything
#
# The SE of the χ² estimate is the standard deviation of w² over √n, which needs
# E_μ[w⁴] = ∫π⁴/μ³ < ∞. For π = N(0,1), μ = N(0,σ²) the integrand is proportional to
# exp(−x²(2 − 3/(2σ²))), integrable iff **σ² > ¾ (σ > 0.866)**. At σ = 0.8 the χ² is
# finite (σ² > ½) but its SE is not a valid error bar; at σ = 1.2 both are fine. The
# coverage of "estimate ± 2 SE" should be about 95 %; with 200 replications its own SE is
# √(0.95·0.05/200) ≈ 0.015.


# %%
def gaussian_log_w(sigma, size):
    x = sigma * rng.standard_normal(size)
    return -0.5 * x**2 + 0.5 * (x / sigma) ** 2 + np.log(sigma)


reps = 200
coverage_se = np.sqrt(0.95 * 0.05 / reps)
coverage = {}
for sigma in (0.8, 1.2):
    truth = sigma**2 / np.sqrt(2 * sigma**2 - 1) - 1
    est = [divergence.chi2_mc(gaussian_log_w(sigma, 2_000)) for _ in range(reps)]
    values = np.array([e.value for e in est])
    ses = np.array([e.se for e in est])
    coverage[sigma] = np.mean(np.abs(values - truth) <= 2 * ses)
    print(
        f"σ = {sigma}: χ² = {truth:.4f}; spread of the estimates {values.std(ddof=1):.4f}, "
        f"median reported SE {np.median(ses):.4f}; coverage of ±2 SE: {coverage[sigma]:.1%}"
    )
assert abs(coverage[1.2] - 0.95) <= Z * coverage_se  # valid error bars
assert coverage[0.8] < 0.95 - Z * coverage_se  # error bars too short
