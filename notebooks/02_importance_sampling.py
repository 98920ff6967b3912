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
# # 02 — Importance sampling: variance is χ², and tails decide everything
#
# Off-policy RL estimates expectations under the target π from samples of the behaviour μ by
# reweighting each sample with w = π/μ. This notebook derives what that costs, checks every
# claim by Monte Carlo with a standard error computed from the same draws, and shows the
# diagnostics practitioners use — the effective sample size and the Pareto k̂.
#
# **Learning goals**
#
# - derive that importance sampling is unbiased and that Var_μ(π/μ) = χ²(π‖μ), and check
#   both by Monte Carlo within z·SE;
# - compute Kish's effective sample size and relate it to χ²: ESS ≈ n/(1+χ²);
# - see why sequence weights W = Π_t w_t are heavy-tailed, why the sample ESS then lies, and
#   how Pareto-smoothed importance sampling's k̂ detects it;
# - watch the weight distribution degrade as the mismatch grows (live histogram).
#
# **Runtime**: about 15 s at full size, about 8 s with `SIMKIT_FAST=1` (kernel start
# included, one CPU core).
#
# **Prerequisites**: `01_divergences` (χ², KL, the shift families).

# %%
# %matplotlib inline
import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import display

from simkit import divergence, mappings, shifts, theory
from simkit.envs import Bandit
from simkit.experiment import run
from simkit.notebook import Choice, LogSlider, Slider, interact

FAST = os.environ.get("SIMKIT_FAST", "0") == "1"
N_DRAWS = 20_000 if FAST else 200_000  # samples for single-distribution checks
N_SEQ = 4_000 if FAST else 20_000  # sequences per length in section 4
Z = 4.5  # a claim holds if |estimate − truth| ≤ Z · SE (SE from the same draws)
rng = np.random.default_rng(2024)

pi = np.array([0.35, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])  # target π over 8 tokens
reward = np.array([1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.7, 0.3])  # a function f(y) to average


def close(estimate, truth, se, z=Z):
    """Print and return whether an estimate lies within z standard errors of the truth."""
    ok = abs(estimate - truth) <= z * se
    print(
        f"estimate {estimate:.5f} ± {se:.5f} (SE), truth {truth:.5f}: "
        f"{abs(estimate - truth) / se:.2f} SE away -> {'ok' if ok else 'FAILS'}"
    )
    return ok


# %% [markdown]
# ## 1. Why importance sampling works, and what it costs
#
# For any function f and samples y ~ μ with μ(y) > 0 wherever π(y) > 0,
#
# $$\mathbb{E}_\mu\!\left[w(y) f(y)\right] = \sum_y \mu(y)\,\frac{\pi(y)}{\mu(y)}\,f(y)
#   = \mathbb{E}_\pi[f],$$
#
# so the importance-sampling (IS) estimate $\hat I = \frac1n\sum_i w(y_i) f(y_i)$ is unbiased
# for E_π f. With f ≡ 1: E_μ[w] = 1. Its cost is the variance of one term,
#
# $$\operatorname{Var}_\mu(w f) = \mathbb{E}_\mu[w^2 f^2] - (\mathbb{E}_\pi f)^2
#   = \mathbb{E}_\pi[w f^2] - (\mathbb{E}_\pi f)^2, \qquad
#   \operatorname{Var}_\mu(w) = \sum_y \frac{\pi(y)^2}{\mu(y)} - 1 = \chi^2(\pi\,\|\,\mu).$$
#
# So **the variance of the weights is exactly the χ² divergence**, and with f ≡ 1,
# Var(Î) = χ²/n. Let us check all of this on μ dialed to χ²(π‖μ) = 0.5.

# %%
CHI2 = 0.5
mu = shifts.dial(pi, CHI2, "chi2", "logit_noise")
y = rng.choice(pi.size, size=N_DRAWS, p=mu)
log_w = np.log(pi[y]) - np.log(mu[y])
w = np.exp(log_w)
print(
    f"χ²(π‖μ) = {divergence.chi2(pi, mu):.6f}, E_π f = {pi @ reward:.5f}, E_μ f = {mu @ reward:.5f}"
)

print("E_μ[w] = 1:")
assert close(w.mean(), 1.0, w.std(ddof=1) / np.sqrt(N_DRAWS))

print("IS estimate of E_π f (unbiased):")
terms = w * reward[y]
assert close(terms.mean(), pi @ reward, terms.std(ddof=1) / np.sqrt(N_DRAWS))

print("Var_μ(w) = χ² (divergence.chi2_mc: mean of w² − 1 with its SE):")
chi2_hat = divergence.chi2_mc(log_w)
assert close(chi2_hat.value, CHI2, chi2_hat.se)

# the naive average under μ estimates E_μ f, not E_π f: a bias no sample size removes
naive = reward[y]
naive_se = naive.std(ddof=1) / np.sqrt(N_DRAWS)
print(
    f"naive mean {naive.mean():.5f} vs E_π f {pi @ reward:.5f}: "
    f"{abs(naive.mean() - pi @ reward) / naive_se:.1f} SE away (biased)"
)
assert abs(naive.mean() - pi @ reward) > Z * naive_se

# %% [markdown]
# The same identity seen through repeated experiments: estimate E_π[1] = 1 with batches of n
# samples, many times. The batch means scatter around 1 with variance χ²/n. The standard
# error of a sample variance s² uses the fourth moment: SE(s²) ≈ √((m₄ − s⁴)/R) over R
# batches.

# %%
n_batch, reps = 50, (2_000 if FAST else 20_000)
batch_w = np.exp(np.log(pi / mu)[rng.choice(pi.size, size=(reps, n_batch), p=mu)])
batch_means = batch_w.mean(axis=1)
centred = batch_means - batch_means.mean()
var_hat = np.mean(centred**2)
var_se = np.sqrt((np.mean(centred**4) - var_hat**2) / reps)
print(f"Var of IS batch means vs χ²/n = {CHI2 / n_batch:.5f}:")
assert close(var_hat, CHI2 / n_batch, var_se)

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.hist(batch_means, bins=60, density=True, alpha=0.7, label=f"{reps} batch means, n = {n_batch}")
grid = np.linspace(batch_means.min(), batch_means.max(), 200)
sd = np.sqrt(CHI2 / n_batch)
ax.plot(
    grid,
    np.exp(-0.5 * ((grid - 1) / sd) ** 2) / (sd * np.sqrt(2 * np.pi)),
    label=r"$\mathcal{N}(1, \chi^2/n)$",
)
ax.set(xlabel=r"$\frac{1}{n}\sum_i w_i$", title="IS estimates of E_π[1] = 1")
ax.legend()
plt.show()

# %% [markdown]
# ## 2. Effective sample size
#
# How many *unweighted* samples are n weighted ones worth? For a weighted mean
# Σ wᵢxᵢ / Σ wᵢ of independent xᵢ with variance σ², the variance is σ²·Σwᵢ²/(Σwᵢ)². Kish
# (1965) calls the denominator the effective sample size,
#
# $$\mathrm{ESS} = \frac{\left(\sum_i w_i\right)^2}{\sum_i w_i^2} \in [1, n],
# \qquad \frac{\mathrm{ESS}}{n} = \frac{(\overline{w})^2}{\overline{w^2}}
#   \;\xrightarrow[n\to\infty]{}\; \frac{(\mathbb{E}_\mu w)^2}{\mathbb{E}_\mu w^2}
#   = \frac{1}{1+\chi^2}.$$
#
# (notation page §F; Kong 1992.) `divergence.ess(log_w)` computes it in log space, and
# `theory.expected_ess(n, chi2)` is the limit n/(1+χ²). Below, μ is dialed to several χ² and
# the sample ESS/n is compared with 1/(1+χ²); its SE comes from the delta method on
# (w̄, mean w²), whose covariance is estimated from the same draws.


# %%
def ess_fraction_with_se(log_w):
    """ESS/n and its delta-method standard error from the same draws."""
    w = np.exp(log_w - log_w.max())  # ESS/n is scale free
    a, b = w.mean(), np.mean(w**2)
    grad = np.array([2 * a / b, -(a**2) / b**2])  # gradient of a²/b
    cov = np.cov(np.stack([w, w**2]))
    return divergence.ess(log_w) / log_w.size, float(np.sqrt(grad @ cov @ grad / log_w.size))


rows = []
for target in (0.05, 0.2, 0.5, 1.0, 2.0):
    mu_t = shifts.dial(pi, target, "chi2", "logit_noise")
    y_t = rng.choice(pi.size, size=N_DRAWS, p=mu_t)
    frac, se = ess_fraction_with_se(np.log(pi / mu_t)[y_t])
    expected = theory.expected_ess(1, target)
    rows.append(
        {
            "χ²": target,
            "ESS/n": frac,
            "SE": se,
            "1/(1+χ²)": expected,
            "|diff|/SE": abs(frac - expected) / se,
        }
    )
ess_table = pd.DataFrame(rows)
display(ess_table.round(4))
assert np.all(ess_table["|diff|/SE"] <= Z)

# %% [markdown]
# simkit's experiment tables report the population version of the same quantity for every
# estimator, ESS = n·(E|c|)²/E[c²] of its effective coefficients c; for sequence IS (c = W)
# that is exactly n/(1+χ²). On a bandit (T = 1) it is computed exactly, by enumeration:

# %%
env = Bandit(logits=np.log(pi), means=reward)
table = run(env, mu, ["naive", "is_seq"], n=64, reps=200, seed=0)
display(table[["estimator", "exact", "chi2_seq", "ess", "bias", "variance"]])
ess_is = table.loc[table.mapping == "is_seq", "ess"].iloc[0]
assert abs(ess_is - 64 / (1 + CHI2)) < 1e-9
assert table.loc[table.mapping == "is_seq", "bias"].iloc[0] < 1e-12  # IS is unbiased

# %% [markdown]
# ## 3. Sequences: weights multiply, tails grow
#
# An LLM response is a sequence of T tokens, and the sequence ratio is a product,
# W = Π_t w_t. With independent tokens (each with the same χ² and KL),
#
# $$\mathbb{E}_\mu[W] = 1,\qquad \mathbb{E}_\mu[W^2] = \prod_t \mathbb{E}_\mu[w_t^2]
#   = (1+\chi^2)^T,\qquad \mathbb{E}_\mu[\log W] = -T\cdot\mathrm{KL}(\mu\,\|\,\pi).$$
#
# The mean stays 1 while the *typical* weight e^{E log W} shrinks exponentially: the mean is
# carried by rarer and rarer, larger and larger weights. log W is a sum of T terms, so W is
# roughly log-normal — heavy-tailed. (`theory.seq_is_second_moment` gives (1+χ²)^T; with
# χ² = 0.05 and T = 200 it is ≈ 17 293, notation page §F.)

# %%
CHI2_TOK = 0.05
mu_tok = shifts.dial(pi, CHI2_TOK, "chi2", "logit_noise")
log_w_tok = np.log(pi / mu_tok)
kl_reverse = float(divergence.kl(mu_tok, pi))  # KL(μ‖π) = −E_μ[log w]
assert abs(theory.seq_is_second_moment(0.05, 200) - 17293) < 1

lengths = (1, 4, 16, 64, 256)
rows, log_W_by_T = [], {}
for T in lengths:
    tokens = rng.choice(pi.size, size=(N_SEQ, T), p=mu_tok)
    log_W = log_w_tok[tokens].sum(axis=1)
    log_W_by_T[T] = log_W
    frac, se = ess_fraction_with_se(log_W)
    rows.append(
        {
            "T": T,
            "E W² = (1+χ²)^T": theory.seq_is_second_moment(CHI2_TOK, T),
            "ESS/n (sample)": frac,
            "SE": se,
            "1/(1+χ²)^T": 1 / theory.seq_is_second_moment(CHI2_TOK, T),
            "sample / truth": frac * theory.seq_is_second_moment(CHI2_TOK, T),
            "k̂": mappings.psis_khat(log_W),
            "median W": float(np.exp(np.median(log_W))),
            "mean log W": log_W.mean(),
            "−T·KL(μ‖π)": -T * kl_reverse,
        }
    )
seq_table = pd.DataFrame(rows)
display(seq_table.round(4))

# E log W = −T·KL(μ‖π): within z·SE at every length
for T, log_W in log_W_by_T.items():
    assert abs(log_W.mean() + T * kl_reverse) <= Z * log_W.std(ddof=1) / np.sqrt(N_SEQ), T
short = seq_table[seq_table["T"] <= 16]
assert np.all(np.abs(short["ESS/n (sample)"] - short["1/(1+χ²)^T"]) <= Z * short["SE"])
assert np.all(short["k̂"] < 0.5)  # light tails, and k̂ says so
long = seq_table.iloc[-1]  # T = 256
assert long["sample / truth"] > 10  # the sample ESS is far too optimistic
assert long["SE"] < 0.5 * long["ESS/n (sample)"]  # while its own SE claims it is precise
assert long["k̂"] > 0.7  # and k̂ says so

# %% [markdown]
# Read the table from top to bottom. For short sequences (T ≤ 16) the sample ESS agrees with
# n/(1+χ²)^T within its standard error, and k̂ < 0.5. At T = 256 the truth is
# 1/(1+χ²)^T ≈ 4·10⁻⁶ — less than one effective sequence in the whole sample — yet the sample
# ESS is hundreds of times larger, and its "standard error" claims a precision of 15–30 %
# (asserted: more than 10 times the truth, SE below half the estimate): the few huge weights
# that make E W² large have simply not been drawn yet, so the sample underestimates χ² and
# everything computed from it. T = 64 is the transition: k̂ is above 0.5 and the sample ESS
# is already off, in a direction that depends on whether one of the rare large weights
# happened to be drawn (column "sample / truth": 1.6 in the full-size run, 0.3 with
# `SIMKIT_FAST=1`). The weights themselves do not tell you that they are lying... except
# through the shape of their tail, which is what k̂ measures.
#
# ## 4. Heavy tails and the Pareto k̂
#
# Pareto-smoothed importance sampling (PSIS; Vehtari, Simpson, Gelman, Yao & Gabry, JMLR
# 2024) fits a generalised Pareto distribution to the largest weights. Its shape k describes
# the tail, P(w > t) ∼ t^{−1/k}: moments of order below 1/k exist, so **the variance is
# finite iff k < ½**. The rule of thumb: k̂ < 0.5 fine, 0.5–0.7 usable with smoothing,
# > 0.7 unreliable (notation page §A). simkit wraps the arviz-stats implementation as
# `mappings.psis_khat(log_w)` and `mappings.psis_smooth(log_w)` (the `psis` mapping uses it).
#
# A case where the truth is known in closed form: π = N(0, 1), μ = N(0, σ²) with σ < 1 (the
# behaviour is too narrow). Then w(x) = σ·exp(x²(σ⁻² − 1)/2) grows with |x|; for x ~ μ,
# x²/σ² is χ²₁-distributed and P(w > t) = P(x²/σ² > 2 log(t/σ)/(1 − σ²)) ∼ t^{−1/(1−σ²)}
# up to log factors, so
#
# $$k = 1 - \sigma^2,\qquad 1 + \chi^2 = \frac{\sigma^2}{\sqrt{2\sigma^2 - 1}}
#   \text{ for } \sigma^2 > \tfrac12, \quad \chi^2 = \infty \text{ otherwise.}$$
#
# (E_μ[w²] = ∫π²/μ is a Gaussian integral that converges iff 1 − 1/(2σ²) > 0.) Below, k̂ is
# averaged over replicated samples and compared with the true k.


# %%
def gaussian_log_w(sigma, size, rng):
    """Draws x ~ N(0, σ²) and log w = log N(x; 0, 1) − log N(x; 0, σ²)."""
    x = sigma * rng.standard_normal(size)
    return x, -0.5 * x**2 + 0.5 * (x / sigma) ** 2 + np.log(sigma)


S, R = (1_000, 10) if FAST else (4_000, 40)
sigmas = np.array([0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95])
khat = np.array(
    [[mappings.psis_khat(gaussian_log_w(s, S, rng)[1]) for _ in range(R)] for s in sigmas]
)
k_mean, k_se = khat.mean(axis=1), khat.std(axis=1, ddof=1) / np.sqrt(R)

fig, ax = plt.subplots(figsize=(6, 3.6))
ax.errorbar(sigmas, k_mean, yerr=2 * k_se, fmt="o", label=f"mean k̂ ± 2 SE ({R} × {S} draws)")
grid = np.linspace(0.25, 1.0, 100)
ax.plot(grid, 1 - grid**2, "k-", label="true k = 1 − σ²")
for level, text in ((0.5, "infinite variance above"), (0.7, "unreliable above")):
    ax.axhline(level, color="0.6", linestyle=":")
    ax.text(0.26, level + 0.02, text, fontsize=8, color="0.4")
ax.set(xlabel="σ (behaviour N(0, σ²), target N(0, 1))", ylabel="Pareto shape")
ax.legend()
plt.show()

# k̂ flags the infinite-variance regime (σ² < ½) and passes the light tails
assert k_mean[sigmas == 0.3][0] > 0.7 and k_mean[sigmas == 0.5][0] > 0.5
assert np.all(k_mean[sigmas >= 0.8] < 0.5)

# %% [markdown]
# The χ² closed form checks the Monte Carlo χ² where it is finite — and shows what goes wrong
# where it is not: at σ = 0.6 (χ² = ∞) the sample χ² is finite, its standard error looks
# respectable, and both keep growing with the sample size instead of converging.


# %%
def gaussian_chi2(sigma):
    return sigma**2 / np.sqrt(2 * sigma**2 - 1) - 1 if sigma**2 > 0.5 else np.inf


_, lw = gaussian_log_w(1.3, N_DRAWS, rng)
est = divergence.chi2_mc(lw)
print("σ = 1.3 (finite fourth moment): sample χ² vs closed form")
assert close(est.value, gaussian_chi2(1.3), est.se)

print("σ = 0.6 (χ² = ∞): the sample χ² at growing n")
for n in (10**3, 10**4, 10**5, 10**6 if not FAST else 3 * 10**5):
    est = divergence.chi2_mc(gaussian_log_w(0.6, n, rng)[1])
    print(f"  n = {n:>8}: χ² ≈ {est.value:8.2f} ± {est.se:.2f}")

# %% [markdown]
# Beyond the diagnostic, `mappings.psis_smooth(log_w)` returns the smoothed, normalised
# log-weights: the largest weights are replaced by quantiles of the fitted Pareto tail, which
# trades a little bias for a large cut in variance when 0.5 < k̂ < 0.7 (Vehtari et al. 2024).
# The `psis` weight mapping applies it to each batch of sequence weights; notebook 04
# measures its bias and variance exactly against the other mappings.

# %% [markdown]
# ## 5. Live: the weight histogram as the mismatch grows
#
# Sequences of T independent tokens, each drawn from μ dialed to a per-token χ² with the
# chosen shift family. The histogram shows log₁₀ W for 4 000 sequences; the title gives the
# exact sequence χ² = (1+χ²)^T − 1, the sample ESS against its limit, and k̂. Try: fix χ² and
# increase T; compare `tail` (one starved token: a few enormous weights) with `logit_noise`
# at the same χ². (Headless, the cell draws the defaults once.)


# %%
def show_weights(chi2_tok=0.05, T=16, family="logit_noise", n=4_000):
    try:
        mu_w = shifts.dial(pi, chi2_tok, "chi2", family)
    except ValueError as err:  # e.g. a family that cannot reach this χ²
        print(err)
        return None
    tokens = np.random.default_rng(0).choice(pi.size, size=(n, T), p=mu_w)
    log_W = np.log(pi / mu_w)[tokens].sum(axis=1)
    chi2_seq = theory.seq_is_variance(chi2_tok, T)
    ess = divergence.ess(log_W)
    k = mappings.psis_khat(log_W)
    _, ax = plt.subplots(figsize=(7, 3.4))
    ax.hist(log_W / np.log(10), bins=80, color="C0", alpha=0.8)
    ax.axvline(0, color="k", linestyle=":", label="W = 1")
    ax.set(xlabel=r"$\log_{10} W$", ylabel="sequences")
    ax.set_title(
        f"{family}, χ²_tok = {chi2_tok:.3g}, T = {T}: χ²_seq = {chi2_seq:.3g}, "
        f"ESS/n = {ess / n:.3f} (limit {1 / (1 + chi2_seq):.3f}), k̂ = {k:.2f}",
        fontsize=9,
    )
    ax.legend()
    plt.show()
    return {"chi2_seq": chi2_seq, "ess_fraction": ess / n, "khat": k}


weights_widget = interact(
    show_weights,
    chi2_tok=LogSlider(0.001, 1.0, 0.05),
    T=Slider(1, 256, 1, 16),
    family=Choice(["logit_noise", "tail", "temperature"]),
)

# %% [markdown]
# ## Exercises
#
# Solutions: `solutions/02_importance_sampling_solutions.py`.
#
# 1. **Estimating one probability.** With f = 1[y = a], the IS estimate of π(a) is the
#    average of w·1[y = a]. Derive the variance of one term, and show it can be *larger or
#    smaller* than the variance π(a)(1 − π(a)) of the on-policy estimate depending on μ(a).
#    Check your formula by Monte Carlo for the rarest token and the most likely one.
# 2. **Predict, then check: when does the ESS collapse?** With a per-token χ² of 0.05, at
#    which length T does the expected ESS of sequence IS drop below 10 % of n? Derive T from
#    (1+χ²)^T, then simulate 4 000 sequences at that T and at 4T: compare the sample ESS with
#    its limit, and report k̂. Which of the two numbers would you trust at 4T, and why?
# 3. **Where the standard error stops meaning anything.** In the Gaussian example the χ² is
#    finite for σ² > ½, but the standard error of its Monte Carlo estimate needs E_μ[w⁴] < ∞.
#    For which σ is that? Verify by repeating `divergence.chi2_mc` on 200 independent samples
#    of size 2 000 for σ = 0.8 and σ = 1.2, and comparing the average reported SE with the
#    actual spread of the estimates.
