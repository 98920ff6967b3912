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
# # Solutions — 01 Divergences
#
# Worked solutions to the exercises of `01_divergences`. Every derivation is followed by a
# numerical check that fails if the claim stops being true.
#
# **Runtime**: about 5 s (full size and with `SIMKIT_FAST=1`).

# %%
# %matplotlib inline
import os

import matplotlib.pyplot as plt
import numpy as np

from simkit import divergence, shifts

FAST = os.environ.get("SIMKIT_FAST", "0") == "1"
rng = np.random.default_rng(1)


def two_point(p):
    return np.array([p, 1.0 - p])


# %% [markdown]
# ## Exercise 1 — two-point distributions and the tightness of Pinsker
#
# With π = (p, 1−p), μ = (q, 1−q):
#
# $$\chi^2 = \frac{(p-q)^2}{q} + \frac{(p-q)^2}{1-q} = \frac{(p-q)^2}{q(1-q)},\qquad
# \mathrm{KL} = p\log\frac{p}{q} + (1-p)\log\frac{1-p}{1-q},\qquad
# \mathrm{TV} = |p-q|.$$
#
# (For χ²: Σ(π−μ)²/μ, and both coordinates differ by ±(p−q). For TV: ½(|p−q| + |q−p|).)

# %%
for p, q in [(0.5, 0.6), (0.9, 0.2), (0.01, 0.3), (0.3, 0.3)]:
    pi, mu = two_point(p), two_point(q)
    chi2_closed = (p - q) ** 2 / (q * (1 - q))
    kl_closed = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    assert abs(divergence.chi2(pi, mu) - chi2_closed) < 1e-12
    assert abs(divergence.kl(pi, mu) - kl_closed) < 1e-12
    assert abs(divergence.tv(pi, mu) - abs(p - q)) < 1e-12
print("closed forms agree with simkit.divergence")

# %% [markdown]
# With p = ½ and q = ½ + ε: TV² = ε² and χ² = ε²/(¼ − ε²) ≈ 4ε². Since KL = ½χ² + O(ε³)
# near π (notebook, section 2) — here, by symmetry, even O(ε⁴) — KL ≈ 2ε², so
#
# $$\frac{\mathrm{TV}^2}{\tfrac12\mathrm{KL}} \to \frac{\varepsilon^2}{\varepsilon^2} = 1 .$$
#
# Pinsker's constant ½ cannot be improved: no inequality TV² ≤ c·KL with c < ½ holds for all
# pairs.

# %%
epsilons = np.array([0.2, 0.1, 0.01, 0.001])
ratios = [
    float(
        divergence.tv(two_point(0.5), two_point(0.5 + e)) ** 2
        / (0.5 * divergence.kl(two_point(0.5), two_point(0.5 + e)))
    )
    for e in epsilons
]
for e, r in zip(epsilons, ratios):
    print(f"ε = {e:<6g} TV²/(½KL) = {r:.8f}")
assert all(r <= 1 for r in ratios)  # Pinsker
assert abs(ratios[-1] - 1) < 1e-5  # and tight as ε → 0
assert np.all(np.diff(ratios) > 0)

# %% [markdown]
# ## Exercise 2 — the mixture family: χ² grows like λ²
#
# With μ_λ = π + λ(u − π):
#
# $$\chi^2(\pi\,\|\,\mu_\lambda) = \sum_y \frac{(\pi - \mu_\lambda)^2}{\mu_\lambda}
#   = \lambda^2 \sum_y \frac{(u-\pi)^2}{\pi + \lambda(u-\pi)}
#   \;\xrightarrow[\lambda\to 0]{}\; \lambda^2\,\chi^2(u\,\|\,\pi).$$
#
# So χ² is *quadratic* in λ with constant χ²(u‖π) — note the order of the arguments: the
# *uniform* distribution is the first argument. TV is linear (λ·TV(π, u)) and χ² quadratic,
# consistent with the chain TV² ≤ ½χ² (both sides of order λ²).

# %%
pi = np.array([0.35, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
u = np.full(pi.size, 1 / pi.size)
lams = np.geomspace(1e-6, 1e-1, 11)
mixture = shifts.get("mixture")
chi2_lam = np.array([divergence.chi2(pi, mixture.apply(pi, lam)) for lam in lams])
slope = np.polyfit(np.log(lams[:3]), np.log(chi2_lam[:3]), 1)[0]
constant = chi2_lam[0] / lams[0] ** 2
print(
    f"log–log slope {slope:.4f} (predicted 2); χ²/λ² at λ = 1e-6: {constant:.5f}, "
    f"χ²(u‖π) = {divergence.chi2(u, pi):.5f}"
)
assert abs(slope - 2) < 1e-4
assert abs(constant / divergence.chi2(u, pi) - 1) < 1e-4
# the approximation degrades as λ grows (the next term is of order λ³)
print("χ²/λ² along λ:", np.round(chi2_lam / lams**2, 4))

# %% [markdown]
# ## Exercise 3 — TV ≤ ½√χ² by Cauchy–Schwarz
#
# $$\mathrm{TV} = \tfrac12\,\mathbb{E}_\mu|w-1| \le \tfrac12\sqrt{\mathbb{E}_\mu(w-1)^2}
#   = \tfrac12\sqrt{\chi^2}.$$
#
# The chain gives TV ≤ √(½·log(1+χ²)) ≤ √(χ²/2). Against the last member, Cauchy–Schwarz
# wins by a factor √2 everywhere. Against the middle member it depends on χ²:
# ¼χ² ≤ ½log(1+χ²) iff χ² ≤ 2·log(1+χ²), i.e. χ² ≲ 2.51 — for larger χ² the log wins.

# %%
n_pairs = 500 if FAST else 5000
p = rng.dirichlet(np.full(10, 0.5), size=n_pairs)
q = rng.dirichlet(np.full(10, 0.5), size=n_pairs)
chi2, tv = divergence.chi2(p, q), divergence.tv(p, q)
cauchy_schwarz = 0.5 * np.sqrt(chi2)
via_log = np.sqrt(0.5 * np.log1p(chi2))
assert np.all(tv <= cauchy_schwarz * (1 + 1e-12))
assert np.all(tv <= via_log * (1 + 1e-12))
crossover = 2.512862417252339  # root of x = 2 log(1 + x), x > 0
assert abs(crossover - 2 * np.log1p(crossover)) < 1e-12
assert np.all((cauchy_schwarz <= via_log) == (chi2 <= crossover))
print(
    f"Cauchy–Schwarz is the tighter bound on {np.mean(cauchy_schwarz < via_log):.0%} of the "
    "pairs (those with χ² < 2.51)"
)

fig, ax = plt.subplots(figsize=(5.5, 3.6))
ax.scatter(chi2, tv, s=3, alpha=0.3, label="random pairs")
grid = np.geomspace(chi2.min(), chi2.max(), 200)
ax.plot(grid, 0.5 * np.sqrt(grid), label=r"$\frac{1}{2}\sqrt{\chi^2}$ (Cauchy–Schwarz)")
ax.plot(grid, np.sqrt(0.5 * np.log1p(grid)), label=r"$\sqrt{\frac{1}{2}\log(1+\chi^2)}$")
ax.axvline(crossover, color="0.6", linestyle=":")
ax.set(xscale="log", yscale="log", xlabel=r"$\chi^2$", ylabel="TV")
ax.legend()
plt.show()

# %% [markdown]
# ## Exercise 4 — how far χ² can go at a fixed KL
#
# At angle π/2 the tilt family only moves the rarest token: it is the `tail` family, whose
# divergences have closed forms in the starved mass m and the log-factor s (see
# `shifts.Tail`): KL = m·s + log(1 − m + m·e^{−s}) and
# 1 + χ² = (1 − m + m·e^{−s})(1 − m + m·e^{s}).
# For small m, holding KL fixed needs s ≈ 1 + KL/m, hence χ² ≈ m·e^{s} ≈ m·e^{1+KL/m}:
# **the rarer the rarest token, the (exponentially) larger the χ² at the same KL**. Decay
# 0.3 is out of reach numerically: μ underflows (m·e^{−s} < 1e-308) before the KL gets to
# 0.05, which `shifts.dial` reports with the largest reachable KL.

# %%
KL_FIXED = 0.05
rows = []
for decay in (0.5, 0.6, 0.7, 0.8):
    pi_geo = decay ** np.arange(10)
    pi_geo /= pi_geo.sum()
    mu = shifts.dial(pi_geo, KL_FIXED, "kl", shifts.get("tilt", angle=np.pi / 2))
    m = pi_geo[-1]
    # the closed forms of the tail family, with s recovered from the starved ratio
    s = np.log((pi_geo[-1] / mu[-1]) / (pi_geo[0] / mu[0]))
    z = 1 - m + m * np.exp(-s)
    assert abs(m * s + np.log(z) - KL_FIXED) < 1e-9
    chi2_closed = z * (1 - m + m * np.exp(s)) - 1
    chi2_dialed = float(divergence.chi2(pi_geo, mu))
    assert abs(chi2_dialed / chi2_closed - 1) < 1e-6
    rows.append((decay, m, chi2_dialed, m * np.exp(1 + KL_FIXED / m)))
    print(
        f"decay {decay}: rarest π = {m:.2e}, largest χ² at KL = {KL_FIXED}: "
        f"{chi2_dialed:.3g} (approximation m·e^(1+KL/m) = {rows[-1][3]:.3g})"
    )
chi2_max = [r[2] for r in rows]
assert np.all(np.diff(chi2_max) < 0)  # a rarer token (smaller decay) gives a larger χ²

try:
    pi_03 = 0.3 ** np.arange(10)
    shifts.dial(pi_03 / pi_03.sum(), KL_FIXED, "kl", shifts.get("tilt", angle=np.pi / 2))
except ValueError as err:
    print("decay 0.3:", err)
else:
    raise AssertionError("expected KL = 0.05 to be out of numerical reach for decay 0.3")

# the other end, angle 0 (flattening), gives the smallest χ² of the family at this KL; no μ at
# all can go below Jensen's floor e^KL − 1
chi2_flat = float(divergence.chi2(pi_geo, shifts.dial(pi_geo, KL_FIXED, "kl", "tilt")))
print(f"decay {decay}: χ² at angle 0 = {chi2_flat:.4f}, Jensen's floor {np.expm1(KL_FIXED):.4f}")
assert np.expm1(KL_FIXED) < chi2_flat < chi2_max[-1]
