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
# # 01 — Divergences: how far is the behaviour policy μ from the target π?
#
# In LLM reinforcement learning the tokens used for a gradient step were sampled by a
# *behaviour* policy μ (an inference engine, a stale checkpoint, a replay buffer) while the
# gradient is wanted for the *target* policy π being trained. Every weight mapping that simkit
# studies is a way to live with that mismatch, and its bias and variance are governed by how
# far μ is from π. This notebook is about the three ways of measuring that distance.
#
# **Learning goals**
#
# - compute χ²(π‖μ), KL(π‖μ) and TV(π, μ) on categorical distributions, and read each one as
#   an expectation of the ratio w = π/μ under μ;
# - state, prove and check the chain TV² ≤ ½KL ≤ ½log(1+χ²) ≤ ½χ² — and know that it only
#   goes one way;
# - move μ away from π with each shift family of `simkit.shifts`, and dial a family to a
#   target divergence;
# - build behaviour policies with the same KL and χ² growing by orders of magnitude, and
#   explain why a KL trust region does not control importance-sampling variance.
#
# **Runtime**: about 10 s at full size, about 6 s with `SIMKIT_FAST=1` (kernel start
# included, one CPU core).
#
# **Prerequisites**: none (numpy and a little probability). Next: `02_importance_sampling`.

# %%
# %matplotlib inline
import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import display

from simkit import divergence, figures, shifts, theory
from simkit.notebook import Choice, Slider, interact

FAST = os.environ.get("SIMKIT_FAST", "0") == "1"
N_PAIRS = 400 if FAST else 4000  # random (π, μ) pairs per Dirichlet concentration
N_GRID = 25 if FAST else 81  # strengths per shift family
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Three divergences, one ratio
#
# Write w(y) = π(y)/μ(y) for the ratio of the two probabilities of a token y. simkit's
# convention is *target first, behaviour second*, and every divergence is an expectation
# under the behaviour μ — the distribution we actually have samples from:
#
# $$\chi^2(\pi\,\|\,\mu) = \sum_y \frac{\pi(y)^2}{\mu(y)} - 1
#   = \mathbb{E}_\mu\big[(w-1)^2\big] = \operatorname{Var}_\mu(w),$$
#
# $$\mathrm{KL}(\pi\,\|\,\mu) = \sum_y \pi(y)\log\frac{\pi(y)}{\mu(y)}
#   = \mathbb{E}_\mu[w\log w],
# \qquad
# \mathrm{TV}(\pi,\mu) = \tfrac12\sum_y \big|\pi(y)-\mu(y)\big| = \tfrac12\,\mathbb{E}_\mu|w-1|.$$
#
# The identity χ² = Var_μ(w) uses E_μ[w] = Σ_y μ(y)·π(y)/μ(y) = 1. It is the reason χ² is
# *the* divergence of importance sampling (notebook 02): the variance of importance weights
# is χ². KL is what trust regions (TRPO, PPO's KL penalty) and RL dashboards monitor. TV
# bounds the bias of simply ignoring the mismatch: for any function |f| ≤ 1,
# |E_π f − E_μ f| ≤ 2·TV, with equality for f = sign(π − μ).

# %%
pi = np.array([0.35, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
mu = np.array([0.30, 0.25, 0.15, 0.12, 0.06, 0.06, 0.05, 0.01])
w = pi / mu

chi2, kl, tv = divergence.chi2(pi, mu), divergence.kl(pi, mu), divergence.tv(pi, mu)
print(f"χ²(π‖μ) = {chi2:.6f}   KL(π‖μ) = {kl:.6f}   TV(π, μ) = {tv:.6f}")

# the same numbers as expectations of the ratio under μ
assert abs(chi2 - np.sum(mu * (w - 1) ** 2)) < 1e-12
assert abs(chi2 - (np.sum(mu * w**2) - np.sum(mu * w) ** 2)) < 1e-12  # Var_μ(w)
assert abs(kl - np.sum(mu * w * np.log(w))) < 1e-12
assert abs(tv - 0.5 * np.sum(mu * np.abs(w - 1))) < 1e-12

# χ² and KL are not symmetric, TV is
print(f"χ²(μ‖π) = {divergence.chi2(mu, pi):.6f}   KL(μ‖π) = {divergence.kl(mu, pi):.6f}")
assert divergence.chi2(mu, pi) != chi2 and divergence.tv(mu, pi) == tv

# TV is the largest bias of ignoring the mismatch over functions bounded by 1
f_worst = np.sign(pi - mu)
assert abs((pi @ f_worst - mu @ f_worst) - 2 * tv) < 1e-12

# %% [markdown]
# **When μ misses part of π's support** (μ(y) = 0 < π(y)), the ratio is infinite there: χ²
# and KL are infinite, while TV stays finite. This is not a corner case: an inference engine
# that samples with top-k or top-p truncation has μ = 0 on the cut tokens. simkit returns
# `inf`, never NaN. Cutting the tokens of total mass m and renormalising gives TV = m exactly
# (the cut tokens lose m, the kept ones gain m between them).

# %%
mu_top6 = shifts.get("top_k").apply(pi, 2)  # drop the two least likely tokens
cut_mass = pi[-2:].sum()
print("top-k μ:", np.round(mu_top6, 4))
print(
    f"χ² = {divergence.chi2(pi, mu_top6)}, KL = {divergence.kl(pi, mu_top6)}, "
    f"TV = {divergence.tv(pi, mu_top6):.4f} (cut mass {cut_mass:.4f})"
)
assert np.isinf(divergence.chi2(pi, mu_top6)) and np.isinf(divergence.kl(pi, mu_top6))
assert abs(divergence.tv(pi, mu_top6) - cut_mass) < 1e-12

# %% [markdown]
# ## 2. The Pinsker chain
#
# For every pair of distributions (notation page §F, `docs/reference.md`):
#
# $$\mathrm{TV}^2 \;\le\; \tfrac12\,\mathrm{KL} \;\le\; \tfrac12\log(1+\chi^2)
#   \;\le\; \tfrac12\,\chi^2 .$$
#
# - **TV² ≤ ½KL** is Pinsker's inequality (Pinsker 1964; the constant ½ is due to Csiszár
#   1967 and Kemperman 1969).
# - **KL ≤ log(1+χ²)** is Jensen's inequality for the concave log, under π:
#   KL = E_π[log w] ≤ log E_π[w] = log Σ_y π(y)²/μ(y) = log(1+χ²).
# - **log(1+x) ≤ x** for x ≥ 0.
#
# The chain goes *one way*: a small χ² forces a small KL and a small TV, but a small KL says
# nothing about χ² (section 4). Let us check it on random pairs: π and μ drawn independently
# from Dirichlet distributions of several concentrations (small concentration = spiky,
# far-apart pairs), plus pairs close to each other, μ ∝ π·exp(σ·z) with z ~ N(0, I).

# %%
V = 10
concentrations = (0.3, 1.0, 3.0, 10.0)
pi_pairs, mu_pairs, kinds = [], [], []
for a in concentrations:
    pi_pairs.append(rng.dirichlet(np.full(V, a), size=N_PAIRS))
    mu_pairs.append(rng.dirichlet(np.full(V, a), size=N_PAIRS))
    kinds += [f"Dirichlet({a:g})"] * N_PAIRS
for sigma in (0.01, 0.1, 0.5):
    p = rng.dirichlet(np.ones(V), size=N_PAIRS)
    q = p * np.exp(sigma * rng.standard_normal((N_PAIRS, V)))
    pi_pairs.append(p)
    mu_pairs.append(q / q.sum(axis=1, keepdims=True))
    kinds += [f"perturbed σ={sigma:g}"] * N_PAIRS
pi_pairs, mu_pairs = np.concatenate(pi_pairs), np.concatenate(mu_pairs)

chain = theory.pinsker_chain(pi_pairs, mu_pairs)  # four arrays of shape (pairs,)
holds = theory.pinsker_chain_holds(chain)  # (pairs, 3): one column per link
print(f"{len(pi_pairs)} pairs; every link holds on every pair: {bool(holds.all())}")
assert holds.all()

pairs = pd.DataFrame(
    {
        "kind": kinds,
        "chi2": 2 * chain.half_chi2,
        "TV²/(½KL)": chain.tv_sq / chain.half_kl,
        "KL/log(1+χ²)": chain.half_kl / chain.half_log1p_chi2,
    }
)
summary = pairs.groupby("kind", sort=False).agg(
    median_chi2=("chi2", "median"),
    max_tv2_over_half_kl=("TV²/(½KL)", "max"),
    min_kl_over_log1p_chi2=("KL/log(1+χ²)", "min"),
    max_kl_over_log1p_chi2=("KL/log(1+χ²)", "max"),
)
display(summary.round(4))

# %%
fig, ax = plt.subplots(figsize=(6.5, 4.2))
x = 2 * chain.half_chi2
order = np.argsort(x)
ax.scatter(x, chain.tv_sq, s=3, alpha=0.4, label=r"$\mathrm{TV}^2$")
ax.scatter(x, chain.half_kl, s=3, alpha=0.4, label=r"$\frac{1}{2}\mathrm{KL}$")
ax.plot(x[order], chain.half_log1p_chi2[order], color="k", label=r"$\frac{1}{2}\log(1+\chi^2)$")
ax.plot(x[order], chain.half_chi2[order], "k--", label=r"$\frac{1}{2}\chi^2$")
ax.set(xscale="log", yscale="log", xlabel=r"$\chi^2(\pi\|\mu)$", ylim=(1e-9, None))
ax.set_title("Each member of the chain against χ² (random pairs)")
ax.legend(markerscale=4)
plt.show()

# %% [markdown]
# Two things to read off the table and the plot.
#
# *Near π the chain is nearly tight in its middle.* Expanding w = 1 + d with E_μ[d] = 0,
# w log w = d + d²/2 − d³/6 + …, so KL = ½E_μ[d²] + O(d³) = ½χ² + O(d³): for close pairs
# KL ≈ ½χ², i.e. KL/log(1+χ²) → ½. The "perturbed σ=0.01" rows show exactly that.
#
# *Far from π the links come apart*: TV² can be much smaller than ½KL, and KL much smaller
# than log(1+χ²). The last gap is the one that matters for variance.

# %%
close = pairs[pairs.kind == "perturbed σ=0.01"]
print(
    f"KL/log(1+χ²) for σ = 0.01: between {close['KL/log(1+χ²)'].min():.4f} and "
    f"{close['KL/log(1+χ²)'].max():.4f}"
)
assert np.all(np.abs(close["KL/log(1+χ²)"] - 0.5) < 0.02)

# %% [markdown]
# ## 3. Moving μ away from π: the shift families
#
# `simkit.shifts` has families that move μ away from π continuously, each with a `strength`
# (0 gives μ = π). They model where mismatch comes from in practice:
#
# | family | μ | models |
# |---|---|---|
# | `temperature` | ∝ π^β | sampling temperature ≠ 1 |
# | `logit_noise` | ∝ π·exp(s·z), z ~ N(0, I) | numerical noise of an inference engine |
# | `mixture` | (1 − λ)π + λ/V | ε-greedy exploration |
# | `top_p`, `top_k` | π truncated and renormalised | nucleus / top-k sampling (support cut) |
# | `tail` | rarest tokens multiplied by e^{−s} | starved rare tokens (heavy-tailed ratios) |
# | `tilt` | ∝ π·exp(s(cos θ·û + sin θ·v̂)) | two parameters: sets KL and χ² separately |
#
# The plot sweeps the strength of each family (default hyperparameters) and shows that all
# three divergences move together — but at very different relative speeds.

# %%
STRENGTH_CAP = {"temperature": 3.0, "logit_noise": 3.0, "tail": 8.0, "tilt": 3.0}


def strength_range(family, pi):
    """Largest strength shown for a family: its own maximum, or a cap for unbounded ones."""
    upper = family.max_strength(pi)
    return upper if np.isfinite(upper) else STRENGTH_CAP.get(family.name, 3.0)


def family_sweep(name, pi, n_points):
    """Strengths, the μ they give (n_points, V) and the three divergences along the sweep."""
    family = shifts.get(name)
    s = np.linspace(0.0, strength_range(family, pi), n_points)
    mus = family.apply(np.broadcast_to(pi, (n_points, pi.size)), s)
    return (
        s,
        mus,
        {
            "χ²": divergence.chi2(pi, mus),
            "KL": divergence.kl(pi, mus),
            "TV": divergence.tv(pi, mus),
        },
    )


names = shifts.available()
fig, axes = plt.subplots(2, 4, figsize=(11, 5), sharey=True)
for ax, name in zip(axes.flat, names):
    s, _, divs = family_sweep(name, pi, N_GRID)
    for label, values in divs.items():
        ax.plot(s, np.where(np.isfinite(values), values, np.nan), label=label)
    ax.set(title=name, xlabel="strength", yscale="log", ylim=(1e-5, 1e2))
    # a family that cuts the support: χ² and KL are infinite as soon as a token is cut
    if np.isinf(divs["χ²"][1:]).any():
        ax.text(
            0.5,
            0.9,
            "χ², KL = ∞ once a token is cut",
            transform=ax.transAxes,
            ha="center",
            fontsize=8,
        )
axes.flat[0].legend()
for ax in axes.flat[len(names) :]:
    ax.axis("off")
fig.suptitle("Every shift family moves χ², KL and TV away from 0")
fig.tight_layout()
plt.show()

# the documented monotonicity: KL increases with the strength of these families
for name in ("temperature", "logit_noise", "mixture", "tail", "tilt"):
    _, _, divs = family_sweep(name, pi, N_GRID)
    assert np.all(np.diff(divs["KL"]) > 0), name
# the mixture moves TV linearly: TV(π, (1−λ)π + λu) = λ·TV(π, u)
s, _, divs = family_sweep("mixture", pi, N_GRID)
assert np.allclose(divs["TV"], s * divergence.tv(pi, np.full(pi.size, 1 / pi.size)), atol=1e-14)

# %% [markdown]
# ### Try it: dial μ away from π
#
# Choose a family and move the slider (the fraction of the strength range shown above). The
# left panel compares π and μ token by token; the right one marks where you are on the
# three divergence curves. Run headless (CI, `SIMKIT_FAST=1`), the cell draws the default
# setting once.


# %%
def show_shift(family="temperature", amount=0.3):
    s, mus, divs = family_sweep(family, pi, 101)
    k = round(amount * 100)
    _, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    tokens = np.arange(pi.size)
    left.bar(tokens - 0.2, pi, width=0.4, label="π (target)")
    left.bar(tokens + 0.2, mus[k], width=0.4, label="μ (behaviour)")
    left.set(xlabel="token", ylabel="probability", title=f"{family}, strength {s[k]:.3g}")
    left.legend()
    for label, values in divs.items():
        right.plot(s, np.where(np.isfinite(values), values, np.nan), label=label)
    right.axvline(s[k], color="0.5", linestyle=":")
    right.set(xlabel="strength", yscale="log", ylim=(1e-5, 1e2), title="divergences")
    right.legend()
    plt.show()
    values = {label: float(v[k]) for label, v in divs.items()}
    print("   ".join(f"{label} = {v:.4g}" for label, v in values.items()))
    return values


shift_widget = interact(
    show_shift, family=Choice(shifts.available()), amount=Slider(0.0, 1.0, 0.01, 0.3)
)

# %% [markdown]
# ### Same TV, very different χ²
#
# `shifts.dial(pi, target, divergence, family)` solves for the strength that hits a target
# divergence (to 1e-8 relative). Dial every family to the *same* TV = 0.05 and compare the
# other two divergences. Where the moved mass goes decides χ²: moving mass *away from rare
# tokens* (tail starvation, truncation) makes π/μ large on them, and χ² = E_μ[(w−1)²] weighs
# large ratios quadratically. (The largest ratio is exp of the Rényi divergence of order ∞,
# `divergence.renyi(pi, mu, np.inf)` = log max π/μ.)

# %%
TV_TARGET = 0.05
family_kwargs = {"tail": {"n_tokens": 3}}  # the 3 rarest tokens: enough mass to reach the TV
rows = []
for name in shifts.available():
    mu_tv = shifts.dial(pi, TV_TARGET, "tv", name, **family_kwargs.get(name, {}))
    rows.append(
        {
            "family": name,
            "TV": float(divergence.tv(pi, mu_tv)),
            "KL": float(divergence.kl(pi, mu_tv)),
            "χ²": float(divergence.chi2(pi, mu_tv)),
            "max π/μ": float(np.exp(divergence.renyi(pi, mu_tv, np.inf))),
        }
    )
same_tv = pd.DataFrame(rows).set_index("family")
display(same_tv.round(5))
assert np.allclose(same_tv["TV"], TV_TARGET, rtol=1e-8)
assert same_tv.loc["tail", "χ²"] > 2 * same_tv.loc["temperature", "χ²"]
assert np.isinf(same_tv.loc["top_k", "χ²"]) and np.isinf(same_tv.loc["top_p", "χ²"])

# %% [markdown]
# ## 4. Same KL, χ² growing by orders of magnitude
#
# Because KL ≤ log(1+χ²) only bounds KL by χ² and not the reverse, a behaviour policy can sit
# *inside* a KL trust region and still have an enormous χ². `shifts.dial_pair(pi, kl=…,
# chi2=…)` builds such policies from the two-parameter `tilt` family: at angle 0 it flattens π
# (light-tailed ratios, the smallest χ² for a KL), at angle π/2 it starves π's rarest token
# (one huge ratio). The only hard constraint is Jensen's: χ² > e^KL − 1.
#
# A target with a rare token makes the effect large: take π_k ∝ 2^{−k}, k = 0…9, whose
# rarest token has probability ≈ 0.001.

# %%
pi_geo = 0.5 ** np.arange(10)
pi_geo /= pi_geo.sum()
KL_FIXED = 0.05
chi2_targets = np.geomspace(0.1, 300.0, 4 if FAST else 8)
rows, mus_same_kl = [], []
for target in chi2_targets:
    mu_pair, angle, strength = shifts.dial_pair(
        pi_geo, kl=KL_FIXED, chi2=target, return_params=True
    )
    mus_same_kl.append(mu_pair)
    rows.append(
        {
            "χ² target": target,
            "KL": float(divergence.kl(pi_geo, mu_pair)),
            "χ²": float(divergence.chi2(pi_geo, mu_pair)),
            "TV": float(divergence.tv(pi_geo, mu_pair)),
            "angle θ": angle,
            "max π/μ": float(np.exp(divergence.renyi(pi_geo, mu_pair, np.inf))),
        }
    )
same_kl = pd.DataFrame(rows)
display(same_kl.round(4))
assert np.allclose(same_kl["KL"], KL_FIXED, rtol=1e-8)
assert np.allclose(same_kl["χ²"], chi2_targets, rtol=1e-8)
assert same_kl["χ²"].iloc[-1] > 1000 * same_kl["χ²"].iloc[0]  # same KL, 3000× the χ²
assert np.all(same_kl["χ²"] > np.expm1(KL_FIXED))  # Jensen's floor

fig, ax = plt.subplots(figsize=(6.5, 3.4))
tokens = np.arange(pi_geo.size)
for mu_pair, target in ((mus_same_kl[0], chi2_targets[0]), (mus_same_kl[-1], chi2_targets[-1])):
    ax.plot(tokens, pi_geo / mu_pair, marker="o", label=f"χ² = {target:.3g}")
ax.set(yscale="log", xlabel="token k (π_k ∝ 2^−k)", ylabel="ratio w = π/μ")
ax.set_title(f"Two behaviour policies with KL(π‖μ) = {KL_FIXED}")
ax.legend()
plt.show()

# %% [markdown]
# Both policies are equally close to π in KL (and nearly in TV), but the second one has
# starved the rarest token: whenever μ samples it, its ratio is ~3·10⁵. Such a sample is rare
# under μ, but it makes Var_μ(w) = χ² huge — and with T tokens per sequence, sequence-level
# importance weights have variance (1+χ²)^T − 1 (notebooks 02 and 05).
#
# The figure `same_kl_different_chi2` (computed by `simkit.figures`) puts this to work on a
# token MDP: at fixed per-token KL, the exact gradient variance of importance-weighted
# estimators follows χ², not KL. (With `SIMKIT_FAST=1` it uses its small configuration.)

# %%
data, fig = figures.make("same_kl_different_chi2", small=FAST)
display(fig)
plt.close(fig)
assert np.allclose(data["kl_tok"], data["kl_tok"].iloc[0], rtol=1e-6)  # KL really fixed
for name in ("is_token", "is_seq"):
    variance = data[data.mapping == name].sort_values("chi2_tok")["variance"].to_numpy()
    assert np.all(np.diff(variance) > 0), name  # variance grows with χ² at fixed KL
print(data.pivot_table(index="mapping", columns="target_chi2", values="variance").round(4))

# %% [markdown]
# ## Exercises
#
# Solutions: `solutions/01_divergences_solutions.py` (try first!).
#
# 1. **Two-point distributions and the tightness of Pinsker.** For π = (p, 1−p) and
#    μ = (q, 1−q), derive closed forms of χ², KL and TV. Check them against
#    `simkit.divergence` for a few (p, q). Then take p = ½, q = ½ + ε and compute the limit
#    of TV² / (½KL) as ε → 0: is Pinsker's constant improvable?
# 2. **Predict, then check: the mixture family.** TV grows *linearly* with the mixing weight
#    λ of μ_λ = (1−λ)π + λ·u (u uniform; section 3). Predict how χ²(π‖μ_λ) grows for small
#    λ — write μ_λ = π + λ(u − π) — and give the constant. Check the exponent with a
#    log–log slope and the constant with `divergence.chi2`.
# 3. **A tighter TV bound.** Prove TV ≤ ½√χ² with Cauchy–Schwarz applied to
#    TV = ½E_μ|w − 1|. Compare it with the √(χ²/2) that the chain gives, and check it on the
#    random pairs of section 2. Which bound is better, and by what factor?
# 4. **How far can χ² go at a fixed KL?** In section 4, χ² at KL = 0.05 went up to 300 for
#    π_k ∝ 2^{−k}. Find the largest χ² the tilt family reaches at KL = 0.05 (dial the `tilt`
#    family at angle π/2 to the KL with `shifts.dial(..., "kl", shifts.get("tilt",
#    angle=np.pi / 2))`) for decay rates 0.3, 0.5 and 0.7 instead of 0.5, and explain the
#    trend with the probability of the rarest token.
