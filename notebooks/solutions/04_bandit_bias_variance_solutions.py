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
# # Solutions — 04 Bias, variance and MSE on a bandit
#
# Worked solutions to the exercises of `04_bandit_bias_variance`. Everything here is exact
# (sums over the bandit's finite support), so the checks compare numbers to 1e-12 or check
# inequalities, with no sampling tolerance.
#
# **Runtime**: about 5 s at full size and with `SIMKIT_FAST=1` (kernel start included,
# one CPU core).

# %%
import os

import numpy as np
import pandas as pd
from IPython.display import display

from simkit import divergence, experiment, mappings, shifts
from simkit.estimators import Estimator
from simkit.figures import bandit_bias_variance

FAST = os.environ.get("SIMKIT_FAST", "0") == "1"
pd.set_option("display.precision", 4)

env = bandit_bias_variance.make_bandit(arms=16, seed=0)  # the bandit of the notebook
pi, m, J = env.pi, env.means, env.J()
grad_J = env.grad_J()


def estimator(name, **hyperparameters):
    """As in the notebook: oracle advantage, Z = n (T = 1, so every aggregation coincides)."""
    label = name if not hyperparameters else f"{name}{hyperparameters}"
    return Estimator(
        mappings.get(name, **hyperparameters),
        aggregation="seq-mean-token-sum",
        advantage="oracle",
        name=label,
    )


def dial(chi2, family="logit_noise"):
    return shifts.dial(pi, chi2, divergence="chi2", family=family)


# %% [markdown]
# ## Exercise 1 — the bias of naive REINFORCE
#
# With c = 1 and the oracle advantage A = R − b, b = J(μ), one sample contributes A·(e_y − π)
# and E[A | y = a] = m_a − b, so
#
# $$\mathbb{E}\hat g = \sum_a \mu_a (m_a - b)(e_a - \pi), \qquad
#   \nabla J = \sum_a \pi_a (m_a - J)(e_a - \pi) = \sum_a \pi_a (m_a - b)(e_a - \pi)$$
#
# (any constant b: $\sum_a \pi_a (e_a - \pi) = 0$), and their difference is
# $\sum_a (\mu_a - \pi_a)(m_a - b)(e_a - \pi)$. The triangle inequality gives
#
# $$\|\mathbb{E}\hat g - \nabla J\| \le \sum_a |\mu_a - \pi_a|\,|m_a - b|\,\|e_a - \pi\|
#   \le 2\,\mathrm{TV}(\pi, \mu)\,\max_a |m_a - b|\,\max_a \|e_a - \pi\|$$
#
# since $\sum_a |\mu_a - \pi_a| = 2\,\mathrm{TV}$. The bias of ignoring the mismatch is
# controlled by TV — not by χ² — which is why naive's bias grows slowly while IS's variance
# explodes.

# %%
score = np.eye(env.K) - pi  # row a: e_a − π
cfg = bandit_bias_variance.Config(
    mapping_names=("naive",), chi2_min=0.01, n_chi2=5 if FAST else 9, reps=2, n_boot=10
)
rows = []
for target in cfg.chi2_grid:
    mu = dial(float(target), cfg.shift_family)
    b = env.J(mu)  # the oracle baseline
    constant = np.max(np.abs(m - b)) * np.max(np.linalg.norm(score, axis=1))
    terms = ((mu - pi) * (m - b))[:, None] * score  # row a: (μ_a − π_a)(m_a − b)(e_a − π)
    bias_vector = terms.sum(axis=0)
    simkit_bias = experiment.run(env, mu, [estimator("naive")], n=64, reps=2, exact=True)
    rows.append(
        {
            "chi2": float(target),
            "TV": float(divergence.tv(pi, mu)),
            "bias (formula)": np.linalg.norm(bias_vector),
            "bias (simkit)": float(simkit_bias.bias.iloc[0]),
            "Σ‖terms‖ (triangle)": np.linalg.norm(terms, axis=1).sum(),
            "bound 2·TV·max|m−b|·max‖e−π‖": 2 * divergence.tv(pi, mu) * constant,
        }
    )
naive_bias = pd.DataFrame(rows)
display(naive_bias)
assert np.allclose(naive_bias["bias (formula)"], naive_bias["bias (simkit)"], rtol=0, atol=1e-12)
assert np.all(naive_bias["bias (formula)"] <= naive_bias["Σ‖terms‖ (triangle)"])
assert np.all(naive_bias["Σ‖terms‖ (triangle)"] <= naive_bias["bound 2·TV·max|m−b|·max‖e−π‖"])
looseness = naive_bias.iloc[:, -1] / naive_bias["bias (formula)"]
bias_per_tv = naive_bias["bias (formula)"] / naive_bias["TV"]
cancellation = naive_bias["bias (formula)"] / naive_bias["Σ‖terms‖ (triangle)"]  # step 1
maxima = naive_bias["Σ‖terms‖ (triangle)"] / naive_bias.iloc[:, -1]  # step 2
print(
    f"bound / bias falls from {looseness.iloc[0]:.1f} to {looseness.iloc[-1]:.1f}; "
    f"bias / TV grows from {bias_per_tv.iloc[0]:.3f} to {bias_per_tv.iloc[-1]:.3f}; "
    f"tightness of the triangle step {cancellation.iloc[0]:.2f} → {cancellation.iloc[-1]:.2f}, "
    f"of the maxima step {maxima.iloc[0]:.2f} → {maxima.iloc[-1]:.2f}"
)
assert np.all(np.diff(looseness) < 0) and np.all(np.diff(bias_per_tv) > 0)
assert bias_per_tv.iloc[-1] > 1.5 * bias_per_tv.iloc[0]
assert np.all(np.diff(cancellation) > 0) and maxima.iloc[-1] > maxima.iloc[0]

# %% [markdown]
# The bound is loose by a factor that falls from about 6 at χ² = 0.01 to about 4 at χ² = 10
# (asserted): it is linear in TV, while the bias grows faster than TV here (bias/TV grows by
# more than half over the grid, 0.17 → 0.28, asserted). Both inequalities of the proof are
# tighter at the largest mismatch than at the smallest (asserted): the terms
# (μ_a − π_a)(m_a − b)(e_a − π) cancel less in the sum (the triangle step goes steadily from
# 0.40 to 0.51 of equality), and more of the moved mass sits on arms with a large
# |m_a − b|·‖e_a − π‖ (the maxima step from 0.43 to 0.52, peaking near 0.55 at χ² ≈ 2). So TV
# controls the bias from above, but the bias is not proportional to it. (Oracle baseline
# b = J(μ).)
#
# ## Exercise 2 — where does C* go when the batch grows?
#
# **Prediction.** MSE(C; n) = bias(C)² + v₁(C)/n. Raising C lowers the bias and raises v₁.
# A larger batch divides the variance term by n but leaves the bias untouched, so the bias
# weighs relatively more and the optimum moves towards **less truncation: C* goes up** (as
# n → ∞ it goes to max w, i.e. untruncated, unbiased IS). With a small batch the variance
# dominates and C* moves down towards 1.

# %%
c_grid = np.geomspace(1.0, 300.0, 61 if FAST else 161)
mu3 = dial(3.0)
one_sample = experiment.run(
    env, mu3, [estimator("tis_seq", c=float(c)) for c in c_grid], n=1, reps=2, exact=True
)
bias, v1 = one_sample.bias.to_numpy(), one_sample.variance.to_numpy()
c_star = {}
for n in (16, 64, 256, 1024, 4096):
    c_star[n] = float(c_grid[np.argmin(bias**2 + v1 / n)])
print("C*(n) at χ² = 3:", {n: round(c, 3) for n, c in c_star.items()})
print(f"max w = {np.max(pi / mu3):.1f}")
values = list(c_star.values())
assert np.all(np.diff(values) >= 0)  # C* never decreases with n
assert c_star[4096] > 2 * c_star[16]

# %% [markdown]
# ## Exercise 3 — dual clip
#
# PPO clip keeps c = r for A < 0 whenever r ≥ 1 − ε, with no upper limit. The variance is
# carried by the atoms (arm a, A < 0) with a large ratio π_a/μ_a: arms that μ starved but π
# likes, sampled rarely and then multiplied by a big r. Their share of E‖h‖² (with
# h = φ·A·(e_y − π)) is computed below. Dual clip zeroes exactly those terms (c = 0 when
# A < 0 and r > c_dual).

# %%
mu10 = dial(10.0)
w10 = pi / mu10
ppo = mappings.get("ppo_clip")
b10 = env.J(mu10)  # the oracle baseline J(μ): A = 1 − b or −b
second_moment_neg = mu10 * (1 - m) * b10**2 * ppo.phi(w10, positive=False) ** 2 * (score**2).sum(1)
second_moment_pos = mu10 * m * (1 - b10) ** 2 * ppo.phi(w10, positive=True) ** 2 * (score**2).sum(1)
total = second_moment_neg.sum() + second_moment_pos.sum()
large = w10 > 3.0
share = second_moment_neg[large].sum() / total
print(
    f"atoms (A < 0, w > 3): {large.sum()} arms, {share:.1%} of ppo_clip's E‖h‖² "
    f"(arms {np.flatnonzero(large).tolist()})"
)
assert share > 0.5

comparison = experiment.run(
    env, mu10, [estimator("ppo_clip"), estimator("dual_clip")], n=64, reps=2, exact=True
).set_index("estimator")[["bias", "variance", "mse"]]
display(comparison)
assert comparison.loc["dual_clip", "variance"] < comparison.loc["ppo_clip", "variance"]

c_dual_grid = np.geomspace(1.05, 1000.0, 41 if FAST else 121)
sweep = experiment.run(
    env,
    mu10,
    [estimator("dual_clip", c_dual=float(c)) for c in c_dual_grid],
    n=64,
    reps=2,
    exact=True,
)
best = int(np.argmin(sweep.mse))
print(
    f"MSE-optimal c_dual at χ² = 10, n = 64: {c_dual_grid[best]:.3g} "
    f"(MSE {sweep.mse.iloc[best]:.5f}; c_dual = 3: {comparison.loc['dual_clip', 'mse']:.5f}; "
    f"ppo_clip {comparison.loc['ppo_clip', 'mse']:.5f})"
)
display(
    sweep.set_index(np.round(c_dual_grid, 3))[["bias", "variance", "mse"]].iloc[
        :: len(c_dual_grid) // 10
    ]
)
assert best == 0  # the optimum sits at the bottom of the range, c_dual → 1⁺
assert sweep.bias.iloc[0] < comparison.loc["dual_clip", "bias"] < comparison.loc["ppo_clip", "bias"]
assert comparison.loc["dual_clip", "mse"] < 0.55 * comparison.loc["ppo_clip", "mse"]
# c_dual beyond every ratio gives back PPO clip
assert abs(sweep.mse.iloc[-1] - comparison.loc["ppo_clip", "mse"]) < 1e-12

# %% [markdown]
# Dual clip at its default c_dual = 3 already cuts PPO clip's MSE by a factor of about 2 here
# (1.9 with the oracle baseline J(μ); asserted: more than 1.8),
# and — perhaps surprisingly — it lowers the **bias** too, and lowers it further as c_dual
# comes down to 1 (not monotonically: the ratios of the 16 arms are discrete steps). The
# reason is the asymmetry of PPO's band. For an arm with a large ratio r, PPO clip already
# zeroes its A > 0 samples (r > 1 + ε) but keeps its A < 0 samples at full weight r: the arm's
# contribution is a one-sided push *against* the arm, which π likes (that is why r is large).
# Dual clip with a small c_dual drops those too, so the arm simply leaves the estimate: less
# bias and far less variance. The MSE-optimal c_dual on this bandit is therefore the smallest
# allowed (c_dual → 1⁺), a "drop any token whose ratio left the band, whatever the sign of A"
# rule — the two-sided masks of the catalogue (`mis_token`, IcePop) make the same choice.

# %% [markdown]
# ## Exercise 4 — same χ², different shape (`tail`)
#
# The `tail` family starves π's rarest arm only: at the same χ² = 3 it has a far smaller KL
# and TV than `logit_noise`, and a far larger max w. Almost every arm has w ≈ 1 and one arm
# has a huge ratio.

# %%
names = ["naive", "is_seq", "power", "ppo_clip", "sapo", "cispo", "tis_seq", "mis_seq", "vespo"]
tables = {}
for family in ("logit_noise", "tail"):
    mu = dial(3.0, family)
    tab = experiment.run(env, mu, [estimator(k) for k in names], n=64, reps=2, exact=True)
    tables[family] = tab.set_index("estimator")
    print(
        f"{family:12s} KL = {divergence.kl(pi, mu):.4f}  TV = {divergence.tv(pi, mu):.4f}  "
        f"max w = {np.max(pi / mu):.1f}  arms with |w − 1| > 0.1: "
        f"{int(np.sum(np.abs(pi / mu - 1) > 0.1))}"
    )
relative = pd.DataFrame(
    {f"MSE / naive ({f})": t.mse / t.loc["naive", "mse"] for f, t in tables.items()}
)
display(relative)
tail = tables["tail"]
truncations = ["tis_seq", "mis_seq", "cispo", "sapo", "vespo"]
assert np.allclose(tail.loc[truncations, "mse"], tail.loc["naive", "mse"], rtol=0.05)
assert tail.loc["is_seq", "mse"] > 3 * tail.loc["naive", "mse"]
assert tail.loc["ppo_clip", "mse"] > 2 * tail.loc["naive", "mse"]
noise = tables["logit_noise"]
assert np.all(noise.loc[truncations[:4], "mse"] < 0.4 * noise.loc["naive", "mse"])
assert noise.loc["vespo", "mse"] < 0.8 * noise.loc["naive", "mse"]
assert noise.loc["is_seq", "mse"] > noise.loc["naive", "mse"]
assert noise.loc["ppo_clip", "mse"] < noise.loc["naive", "mse"]  # ppo_clip changes side

# %% [markdown]
# With `tail` the mismatch lives on one arm that μ almost never samples (w ≈ 534 there,
# w ≈ 1 on the 15 others). Every mapping that caps, drops or damps large ratios — the
# truncations `tis_seq`, `mis_seq`, `cispo`, SAPO's gate and VESPO's kernel (φ(534) ≈ 0) —
# removes that arm's weight and leaves the others alone, so they all collapse onto naive
# REINFORCE (within 5 %, asserted): they keep naive's small bias, which is TV-sized
# (exercise 1: TV = 0.006 here). That is why they all look alike. Under the broad
# `logit_noise` mismatch (TV = 0.31, every arm's ratio off by more than 10 %) the same
# mappings are far from naive: `tis_seq`, `mis_seq`, `cispo` and SAPO cut its MSE by a factor
# of 2.7 to 3.0 (below 0.4 times naive, asserted) and VESPO by about 1.35 (below 0.8 times,
# asserted), because naive's bias is now large (oracle baseline J(μ)). Two mappings pay for
# the rare arm of `tail`: sequence IS (the whole χ² = 3 in variance) and PPO clip, whose
# A < 0 side keeps r unbounded (exercise 3).
# PPO clip changes rank the most: slightly better than naive under `logit_noise` (0.90 times
# its MSE), 2.6 times worse under `tail` (both asserted). The lesson: at a fixed χ² the
# *shape* of the mismatch decides the ranking — a few huge ratios (small TV and KL) favour
# any cap, while a broad mismatch (large TV) is where the knobs differ.
