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
# # 03 — The weight-mapping zoo: f, φ, and every policy loss as a weighted SFT
#
# PPO, GRPO, DAPO, GSPO, CISPO, SAPO, VESPO, truncated and masked importance sampling… the
# policy losses of LLM reinforcement learning look different on paper. This notebook shows
# that they differ in one thing only: the **coefficient** c that each one puts in front of
# A·∇log π for every token. simkit's registry (`simkit.mappings`) implements the whole
# catalogue of the notation page behind one contract; here we walk through it, draw every
# mapping, regenerate the kernel figure of the VESPO paper, and check with torch that each
# loss is, gradient-wise, a supervised fine-tuning loss with per-token weights.
#
# **Learning goals**
#
# - read any policy loss as the weighted policy gradient
#   g = (1/Z) Σ c·A·∇log π, and derive c from a surrogate F (c = r·F′(r)) or from a
#   detached weight;
# - find your way in simkit's registry: 37 mappings, the level they act at (token, sequence,
#   batch), the ratio they read (r_t, W or s), their knobs and the presets of the libraries;
# - draw f and φ of every mapping for A > 0 and A < 0, turn their knobs with widgets, and
#   tell masks (φ drops to 0) from truncations (φ saturates) and smooth reshapings;
# - regenerate VESPO's Fig. 2 and check its closed forms (peak at c₁/c₂, saturating f);
# - verify with autograd that every loss has the gradient of a weighted SFT loss
#   −Σ λ·log π with λ = sg(c)·A/Z, and recognise SFT, rejection-sampling fine-tuning and
#   REINFORCE as special cases.
#
# **Runtime**: about 15 s at full size and with `SIMKIT_FAST=1` alike (kernel start
# included, one CPU core; most of it is importing torch and drawing the figures).
#
# **Prerequisites**: `01_divergences` and `02_importance_sampling` (the ratio w = π/μ, the
# sequence ratio W). Next: `04_bandit_bias_variance` (what each mapping costs in bias and
# variance).

# %%
# %matplotlib inline
import math
import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import display

from simkit import mappings, theory
from simkit.estimators import AGGREGATIONS, Estimator, advantages
from simkit.figures import kernel_shapes, kernel_shapes_catalogue, style
from simkit.lm import losses
from simkit.notebook import Choice, LogSlider, Slider, interact

FAST = os.environ.get("SIMKIT_FAST", "0") == "1"
N_GRID = 241 if FAST else 601  # points of the ratio grids
rng = np.random.default_rng(0)
pd.set_option("display.max_colwidth", 60)

# %% [markdown]
# ## 1. One formula for every loss
#
# Write r_t = π(y_t|s_t)/μ(y_t|s_t) for the token ratio, W = Π_t r_t for the sequence ratio
# and s = exp((1/|y|) Σ_t log r_t) for their geometric mean. Every policy loss of the
# catalogue (notation page, `docs/reference.md`) produces the gradient
#
# $$g = \frac1Z \sum_i \sum_t c_{i,t}\, A_i\, \nabla_\theta \log \pi_\theta(y_{i,t}\mid s_{i,t}),
#   \qquad y_i \sim \mu,$$
#
# with A_i the sequence advantage, Z the aggregation (token-mean, seq-mean-token-mean, …)
# and c_{i,t} the **effective coefficient**. Losses come in two forms:
#
# - a **surrogate** L = −(A/Z)·F(r) through which the gradient flows: since
#   ∂r/∂log π = r, the chain rule gives c = r·F′(r). PPO's clipped surrogate
#   F(r) = min(r, 1+ε) (for A > 0) gives c = r inside the band and 0 outside;
# - a **detached** weight L = −(A/Z)·sg(w)·log π (sg = stop-gradient), for which c = w:
#   truncated IS min(W, C), CISPO's clip(r), VESPO's φ(W).
#
# When c is a function of one ratio, φ(w) = c is the *coefficient* and f = F the
# *surrogate*, linked by φ(w) = w·f′(w) (VESPO's notation). On-policy (π = μ, every ratio 1)
# every mapping must give c = 1: plain REINFORCE.
#
# simkit's registry lists all of them. A mapping is a frozen dataclass of hyperparameters
# (its *knobs*; the `max_log_ratio` fields are numerical clamps, not knobs) with a method
# `coefficients(log_ratio, mask, advantages)` → c of shape (N, T).


# %%
def knobs(mapping):
    """The hyperparameters a user tunes: every field except the numerical clamps."""
    return {
        key: value
        for key, value in mapping.hyperparameters.items()
        if not key.startswith("max_log_ratio")
    }


def describe(value):
    return f"{value:g}" if isinstance(value, float) else str(value)


SCALAR = kernel_shapes_catalogue.scalar_mappings()  # the mappings with φ and f of one ratio
rows = []
for name in mappings.available():
    mapping = mappings.get(name)
    rows.append(
        {
            "mapping": name,
            "family": style.family(name),
            "level": mapping.level,
            "ratio": kernel_shapes_catalogue.ratio_symbol(mapping) if name in SCALAR else "—",
            "knobs (defaults)": ", ".join(f"{k}={describe(v)}" for k, v in knobs(mapping).items())
            or "—",
            "presets": ", ".join(mapping.presets) or "—",
        }
    )
registry = pd.DataFrame(rows).set_index("mapping")
display(registry)
print(f"{len(registry)} mappings, {len(SCALAR)} of them a function of one ratio")

# %% [markdown]
# The `level` says what c depends on: the token's own ratio (`token`), one value for the whole
# sequence (`sequence`: from W, from s or from the whole row), or other sequences of the
# batch (`batch`: self-normalisation, Pareto smoothing, M2PO's batch second moment). The
# `ratio` column says which ratio φ reads: r_t, W or s.
#
# The on-policy rule is a test, not a hope: with every log-ratio 0, every one of the 37
# mappings but two gives c = 1 on every valid token and 0 on padding, whatever the sign of A.
# The two exceptions are by design: LUSPO scales GSPO's loss by the length (c = |y|) and
# GEPO divides π(y) by the group's estimate of E[μ(y)] (not a ratio). DPPO reads log π
# itself (its trust region is on the probabilities), so it gets `log_prob` here.

# %%
N, T = 6, 5
on_policy = np.zeros((N, T))
mask = np.arange(T) < np.array([5, 3, 1, 5, 4, 2])[:, None]  # ragged lengths
signs = np.array([1.0, -1.0, 0.5, -2.0, 0.0, 3.0])
log_prob = np.log(0.3) + on_policy  # any log π works: on-policy log μ = log π
not_one = []
for name in mappings.available():
    mapping = mappings.get(name)
    kw = {"log_prob": log_prob} if mapping.requires_log_prob else {}
    c = mapping.coefficients(on_policy, mask, signs, **kw)
    if not mapping.on_policy_identity:
        not_one.append(name)
        continue
    assert np.array_equal(c, mask.astype(float)), name
assert not_one == ["luspo", "gepo"]
assert len(mappings.available()) == 37 and len(SCALAR) == 23  # the counts of the prose
paper_luffy = mappings.get("luffy", preset="paper")
print(
    f"{len(mappings.available()) - len(not_one)} of {len(mappings.available())} give c = 1 "
    f"on-policy (not {', '.join(not_one)}); the preset exception by design is "
    "LUFFY's un-normalised "
    f"'paper' preset: c(1) = γ/(1+γ)² = {paper_luffy.phi(1.0):.4f}"
)
assert abs(paper_luffy.phi(1.0) - 0.1 / 1.1**2) < 1e-15

# %% [markdown]
# ## 2. f and φ of every scalar mapping
#
# Two checks tie the registry to the formula above, for each of the 23 scalar mappings and
# both signs of A:
#
# 1. **φ = w·f′(w)**, i.e. φ is the derivative of f with respect to log w. We compare φ
#    with a central finite difference of f in log w at 400 random ratios in [0.05, 5].
# 2. **`coefficients` is φ of the right ratio**: on a random ragged batch, the (N, T)
#    coefficients equal φ(r_t) token by token, φ(W) or φ(s) for the whole row, with the
#    sign of each row's advantage choosing the A > 0 or A < 0 branch.

# %%
log_w = rng.uniform(math.log(0.05), math.log(5.0), 400)
h = 1e-6
for name in SCALAR:
    mapping = mappings.get(name)
    for positive in (True, False):
        df_dlogw = (
            mapping.f(np.exp(log_w + h), positive) - mapping.f(np.exp(log_w - h), positive)
        ) / (2 * h)
        assert np.allclose(df_dlogw, mapping.phi(np.exp(log_w), positive), atol=1e-6), name

N, T = 64, 8
log_ratio = rng.normal(0.0, 0.3, (N, T))
mask = np.arange(T) < rng.integers(1, T + 1, N)[:, None]
adv = rng.choice([-1.0, 1.0], N)
row_sum = np.where(mask, log_ratio, 0.0).sum(axis=1, keepdims=True)
ratio_of_kind = {
    "token": np.exp(log_ratio),
    "sequence": np.broadcast_to(np.exp(row_sum), (N, T)),
    "geometric": np.broadcast_to(np.exp(row_sum / mask.sum(axis=1, keepdims=True)), (N, T)),
}
for name in SCALAR:
    mapping = mappings.get(name)
    ratio = ratio_of_kind[mapping.ratio_kind]
    phi = np.where(adv[:, None] >= 0, mapping.phi(ratio, True), mapping.phi(ratio, False))
    assert np.allclose(mapping.coefficients(log_ratio, mask, adv), phi * mask, rtol=1e-12), name
print(f"φ = w·f′(w) and coefficients = φ(ratio) hold for all {len(SCALAR)} scalar mappings")

# %% [markdown]
# The figure `kernel_shapes_catalogue` draws φ of every scalar mapping at its defaults, for
# A > 0 (solid) and A < 0 (dashed), against plain importance sampling φ = w (dotted).

# %%
catalogue = kernel_shapes_catalogue.compute(kernel_shapes_catalogue.Config(n_points=N_GRID))
with style.context():
    display(kernel_shapes_catalogue.draw(catalogue))

# %% [markdown]
# Read the zoo by what happens to a large ratio — that is what decides the variance — and
# to a small one:
#
# - **identity**, φ = w (`is_token`, `is_seq`): a token far from 1 keeps its full weight —
#   unbiased (`is_seq`), unbounded variance;
# - **constant** (`naive`; `opsm` and `topr` for A > 0; `geo_mask` inside its band): treated
#   as on-policy, no correction at all;
# - **hard clip**, φ = w in a band that depends on the sign of A, else 0 (`ppo_clip`, `dapo`,
#   `dual_clip`, `gspo`, `aspo`): **no gradient** for a token on the side that would profit;
# - **mask**, φ = w in a band, else 0, for both signs (`mis_token`, `icepop`, `mis_seq`,
#   `geo_mask`; `opsm` for A < 0): the token or sequence is **dropped**;
# - **truncation**, φ = min(w, C), never 0 (`cispo`, `tis_token`, `tis_seq`; `topr` for
#   A < 0): a **bounded** gradient is kept;
# - **smooth reshaping** (`power` w^α, `soft_shrink`, `sapo`'s bump at 1, `luffy`, `vespo`):
#   large (and, for SAPO and VESPO, small) ratios are damped continuously.
#
# The distinction between masks and truncations matters: a masked token teaches nothing, a
# truncated one still pushes in the right direction with a capped step. The clipping family
# is asymmetric on purpose (PPO's "pessimistic" bound): it stops the gradient only when the
# ratio has already moved in the direction the advantage asks for.
#
# f is drawn less often than φ, but it is the function a trainer actually differentiates
# for the surrogate losses. Where φ vanishes, f is flat; where φ saturates at C, f keeps
# growing like C·log w; VESPO's and SAPO's f saturate (bounded surrogates). A surrogate is
# only defined up to an additive constant (the constant has no gradient), so the grid below
# draws every f shifted to pass through f(1) = 1, like plain IS's f = w.

# %%
names = list(dict.fromkeys(catalogue.mapping))
columns = 6
fig, axes = plt.subplots(
    math.ceil(len(names) / columns), columns, figsize=(12, 7), sharex=True, sharey=True
)
for ax, name in zip(axes.flat, names):
    part = catalogue[catalogue.mapping == name]
    mapping = mappings.get(name)
    for sign, linestyle in (("A>0", "-"), ("A<0", "--")):
        line = part[part.advantage == sign]
        f_at_1 = float(mapping.f(1.0, sign == "A>0"))
        ax.plot(line.w, line.f - f_at_1 + 1, linestyle, color=style.color(name), label=sign)
    ax.plot(line.w, line.w, ":", color="0.5", linewidth=0.8)
    ax.set_title(f"{name} (${part.ratio.iloc[0]}$)", fontsize=9)
    ax.set_ylim(-1.0, 4.0)
for ax in axes.flat[len(names) :]:
    ax.axis("off")
for ax in axes[-1]:
    ax.set_xlabel("ratio")
axes.flat[0].legend(fontsize=7)
fig.suptitle("Surrogate f(ratio) − f(1) + 1 of every scalar mapping (dotted: plain IS, f = ratio)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Turn the knobs
#
# Pick a mapping; its knobs appear as sliders (clip ε, truncation C, temperatures τ,
# VESPO's (k, λ), …). The table `KNOBS` covers every knob of every scalar mapping (checked
# below), so the explorer reaches the whole registry. Things to try: push PPO's ε_high up
# until it becomes token IS on [0, 1+ε]; set CISPO's ε_low to 0.2 to get a two-sided
# clamp; lower SAPO's τ to widen the bump; move VESPO's λ and watch the peak move to k/λ.

# %%
EPS = {"eps_low": Slider(0.0, 1.0, 0.01, 0.2), "eps_high": Slider(0.0, 2.0, 0.01, 0.2)}
KNOBS = {
    "naive": {},
    "is_token": {},
    "is_seq": {},
    "power": {"alpha": Slider(0.0, 1.0, 0.05, 0.5)},
    "soft_shrink": {"lam": Slider(0.0, 1.0, 0.02, 0.1)},
    "ppo_clip": EPS,
    "dual_clip": {**EPS, "c_dual": Slider(1.1, 10.0, 0.1, 3.0)},
    "dapo": {**EPS, "eps_high": Slider(0.0, 2.0, 0.01, 0.28)},
    "gspo": {"eps_low": LogSlider(1e-4, 1.0, 3e-4), "eps_high": LogSlider(1e-4, 1.0, 4e-4)},
    "sapo": {"tau_pos": LogSlider(0.1, 20.0, 1.0), "tau_neg": LogSlider(0.1, 20.0, 1.05)},
    "luffy": {"gamma": LogSlider(0.01, 10.0, 0.1), "normalize": Choice([True, False])},
    "aspo": {**EPS, "c_dual": Slider(1.1, 10.0, 0.1, 3.0)},
    "cispo": {"eps_low": Slider(0.0, 1.0, 0.01, 1.0), "eps_high": LogSlider(0.01, 10.0, 0.2)},
    "tis_token": {"c_low": Slider(0.0, 1.0, 0.05, 0.0), "c_high": Slider(1.0, 10.0, 0.1, 2.0)},
    "tis_seq": {"c": Slider(1.0, 10.0, 0.1, 2.0)},
    "mis_token": {"c_low": Slider(0.0, 1.0, 0.05, 0.5), "c_high": Slider(1.0, 10.0, 0.1, 5.0)},
    "mis_seq": {"c_low": Slider(0.0, 1.0, 0.05, 0.0), "c_high": Slider(1.0, 10.0, 0.1, 2.0)},
    "icepop": {"c_low": Slider(0.0, 1.0, 0.05, 0.5), "c_high": Slider(1.0, 10.0, 0.1, 5.0)},
    "geo_mask": {"c_low": Slider(0.05, 1.0, 0.05, 0.5), "c_high": Slider(1.0, 5.0, 0.1, 2.0)},
    "opsm": {"delta": LogSlider(1e-4, 1.0, 1e-4)},
    "topr": {},
    "vespo": {
        "k_pos": Slider(1.0, 6.0, 0.1, 2.0),
        "lambda_pos": Slider(0.5, 6.0, 0.1, 3.0),
        "k_neg": Slider(1.0, 6.0, 0.1, 3.0),
        "lambda_neg": Slider(0.5, 6.0, 0.1, 2.0),
    },
    "rollout_is": {
        "eps_low": Slider(0.05, 1.0, 0.01, 0.2),
        "eps_high": Slider(0.05, 2.0, 0.01, 0.2),
    },
}
# every knob of every scalar mapping has a control (geo_mask's TIS base is not scalar)
NOT_SCALAR_KNOBS = {"geo_mask": {"base", "tis_c"}}
assert list(KNOBS) == SCALAR
for name in SCALAR:
    expected = set(knobs(mappings.get(name))) - NOT_SCALAR_KNOBS.get(name, set())
    assert set(KNOBS[name]) == expected, (name, expected)
    defaults = {k: control.value for k, control in KNOBS[name].items()}
    start, default = mappings.get(name, **defaults), mappings.get(name)
    for positive in (True, False):  # the sliders start at the defaults (cispo: ε_low = 1 ≡ ∞)
        w = np.exp(log_w)
        assert np.array_equal(start.phi(w, positive), default.phi(w, positive)), name
    for knob, control in KNOBS[name].items():  # every end of every slider is a valid mapping
        for end in ("min", "max") if hasattr(control, "min") else ():
            mappings.get(name, **{**defaults, knob: getattr(control, end)})


def show_kernel(name, w_max=3.0, **hyperparameters):
    """φ and f of mapping ``name`` with ``hyperparameters``, both signs of A."""
    mapping = mappings.get(name, **hyperparameters)
    ratio = kernel_shapes_catalogue.ratio_symbol(mapping)
    w = np.linspace(w_max / N_GRID, w_max, N_GRID)
    _, (ax_phi, ax_f) = plt.subplots(1, 2, figsize=(10, 3.4))
    for positive, linestyle, label in ((True, "-", "A > 0"), (False, "--", "A < 0")):
        ax_phi.plot(w, mapping.phi(w, positive), linestyle, color=style.color(name), label=label)
        f_shifted = mapping.f(w, positive) - mapping.f(1.0, positive) + 1
        ax_f.plot(w, f_shifted, linestyle, color=style.color(name), label=label)
    for ax, what in ((ax_phi, "coefficient φ"), (ax_f, "surrogate f − f(1) + 1")):
        ax.plot(w, w, ":", color="0.5", label="plain IS")
        ax.axvline(1.0, color="0.8", linewidth=0.8)
        ax.set(xlabel=f"ratio ${ratio}$", title=f"{what} of {mapping.label}")
        ax.legend(fontsize=8)
    ax_phi.set_ylim(-0.05, max(1.5, 1.05 * float(np.max(mapping.phi(w, True)))))
    ax_f.set_ylim(-1.0, 1.05 * w_max)
    plt.show()
    grid = np.array([0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 5.0])
    table = pd.DataFrame(
        {"A > 0": mapping.phi(grid, True), "A < 0": mapping.phi(grid, False)},
        index=pd.Index(grid, name=ratio),
    ).T
    display(table.round(4))


def explore(name="ppo_clip"):
    """Sliders for the knobs of ``name`` (nested: they change with the chosen mapping)."""

    def redraw(**hyperparameters):
        show_kernel(name, **hyperparameters)

    interact(redraw, **KNOBS[name])  # displays itself; returning it would show it twice


explorer = interact(explore, name=Choice(SCALAR, value="ppo_clip"))

# %% [markdown]
# ## 4. The mappings that are not a function of one ratio
#
# Five mappings have no φ because their coefficient reads more than one number. They are
# shown on small batches, each with its defining property checked.
#
# **Self-normalised IS** (`snis`): c_i = N·W_i / Σ_j W_j. The coefficients always sum to N,
# so a sequence's weight depends on the others: as a function of its own W_i (the others
# fixed, S = Σ_{j≠i} W_j) it is N·W_i/(W_i + S), which saturates at N — a truncation whose
# level is set by the batch.

# %%
N = 8
log_w_batch = rng.normal(0.0, 0.8, N)  # log W of 8 sequences (one token each is enough)
snis = mappings.get("snis")
c_snis = snis.coefficients(log_w_batch[:, None], np.ones((N, 1), bool), np.ones(N))[:, 0]
assert abs(c_snis.sum() - N) < 1e-12
assert np.allclose(c_snis, N * np.exp(log_w_batch) / np.exp(log_w_batch).sum(), rtol=1e-12)

others = np.exp(log_w_batch[1:]).sum()
w_own = np.geomspace(1e-2, 1e3, 200)
batch = np.column_stack([np.log(w_own), np.broadcast_to(log_w_batch[1:], (200, N - 1))])
c_own = np.array(
    [snis.coefficients(row[:, None], np.ones((N, 1), bool), np.ones(N))[0, 0] for row in batch]
)
assert np.allclose(c_own, N * w_own / (w_own + others), rtol=1e-12)

# %% [markdown]
# **Pareto-smoothed IS** (`psis`, Vehtari et al., JMLR 2024): the ⌊3√N⌋ largest weights of
# the batch are replaced by the expected order statistics of a generalised Pareto
# distribution fitted to them, then everything is self-normalised like SNIS. The smoothing
# removes the jagged, noisy steps of the raw tail rather than cutting it down; the fitted
# shape k̂ is the diagnostic: k̂ < 0.5 finite variance, 0.5–0.7 usable, > 0.7 unreliable.
# On a batch of heavy-tailed (log-normal) sequence weights:

# %%
N_PSIS = 400
log_w_heavy = rng.normal(0.0, 1.5, N_PSIS)  # log-normal W: heavy tailed
psis = mappings.get("psis")
ones = np.ones((N_PSIS, 1), bool)
c_psis = psis.coefficients(log_w_heavy[:, None], ones, np.ones(N_PSIS))[:, 0]
c_raw = snis.coefficients(log_w_heavy[:, None], ones, np.ones(N_PSIS))[:, 0]
khat = psis.khat(log_w_heavy[:, None], ones)
assert abs(c_psis.sum() - N_PSIS) < 1e-9 and abs(khat - mappings.psis_khat(log_w_heavy)) < 1e-12
tail = np.argsort(c_raw)[-int(3 * math.sqrt(N_PSIS)) :]  # the ⌊3√N⌋ smoothed weights
body = np.setdiff1d(np.arange(N_PSIS), tail)
assert np.allclose(c_psis[body] / c_raw[body], c_psis[body][0] / c_raw[body][0], rtol=1e-9)
print(
    f"k̂ = {khat:.2f}; the {len(tail)} largest coefficients are replaced by Pareto quantiles "
    f"(largest: {c_raw.max():.1f} → {c_psis.max():.1f}); the other {len(body)} are only rescaled"
)

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
left.plot(w_own, c_own, color=style.color("snis"), label="snis, 7 others fixed")
left.axhline(N, color="0.5", linestyle=":", label="N (saturation)")
left.plot(w_own, w_own, ":", color="0.3", label="is_seq (c = W)")
left.set(xscale="log", ylim=(0, 1.3 * N), xlabel="own sequence ratio W", ylabel="c")
left.set_title("SNIS: c of one sequence vs its own W")
left.legend(fontsize=8)
order = np.argsort(c_raw)[::-1]
right.plot(np.arange(1, N_PSIS + 1), c_raw[order], color=style.color("snis"), label="snis")
right.plot(np.arange(1, N_PSIS + 1), c_psis[order], color=style.color("psis"), label="psis")
right.set(xscale="log", yscale="log", xlabel="rank of W in the batch", ylabel="c")
right.set(xlim=(0.9, 2 * len(tail)), ylim=(0.5 * c_raw[order][2 * len(tail)], 2 * c_raw.max()))
right.set_title(f"PSIS smooths the tail (k̂ = {khat:.2f}, N = {N_PSIS})")
right.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# **GMPO** (Zhao et al. 2025): each log r_t is clipped on the pessimistic side to [−ε, ε]
# (A > 0: from above), R = exp(mean of the clipped log-ratios), and c_t = R for the tokens
# that were not clipped, 0 for those that were. One token's ratio therefore moves the
# coefficient of every other token of its sequence. **Token veto**: a sequence is dropped
# (c = 0) as soon as one of its tokens has r_t < τ. **M2PO** (Zheng et al. 2025): mask the
# tokens with the largest (log r_t)² until the mean (log r)² of the remaining candidates is
# at most τ = 0.04; c = r_t on the kept tokens.

# %%
gmpo = mappings.get("gmpo")  # ε = 0.4 in log space
T = 4
sweep = np.log(np.geomspace(0.3, 3.0, 121))  # log r_1 varies, the other three are fixed
rest = np.array([0.1, -0.2, 0.05])
rows_gmpo = np.column_stack([sweep, np.broadcast_to(rest, (len(sweep), T - 1))])
c_gmpo = gmpo.coefficients(rows_gmpo, np.ones_like(rows_gmpo, bool), np.ones(len(sweep)))
clipped_sum = np.minimum(rows_gmpo, 0.4).sum(axis=1)  # A > 0: clip from above at ε
R = np.exp(clipped_sum / T)
assert np.allclose(c_gmpo[:, 1], R, rtol=1e-12)  # an unclipped token gets R
assert np.allclose(c_gmpo[:, 0], np.where(sweep > 0.4, 0.0, R), rtol=1e-12)

veto = mappings.get("token_veto")  # τ = 1e-4
veto_batch = np.log(np.array([[1.0, 0.9, 1.1], [1.2, 5e-5, 1.0], [2.0, 1.5, 3.0]]))
c_veto = veto.coefficients(veto_batch, np.ones((3, 3), bool), np.ones(3))
assert np.array_equal(c_veto, np.array([[1.0] * 3, [0.0] * 3, [1.0] * 3]))

m2po = mappings.get("m2po")  # τ = 0.04, trust-region candidates only
m2_lr = rng.normal(0.0, 0.3, (32, 16))
m2_mask = np.ones_like(m2_lr, bool)
m2_adv = rng.choice([-1.0, 1.0], 32)
removed = m2po.masked_tokens(m2_lr, m2_mask, m2_adv)
candidate = np.where(m2_adv[:, None] >= 0, m2_lr > 0, m2_lr < 0)
kept = candidate & ~removed
assert np.mean(m2_lr[kept] ** 2) <= 0.04 < np.mean(m2_lr[candidate] ** 2)
smallest_removed = np.min(m2_lr[removed] ** 2)
assert smallest_removed >= np.max(m2_lr[kept] ** 2)  # the largest ones go first…
back = (np.sum(m2_lr[kept] ** 2) + smallest_removed) / (kept.sum() + 1)
assert back > 0.04  # …and no fewer would do
assert np.allclose(
    m2po.coefficients(m2_lr, m2_mask, m2_adv), np.where(removed, 0.0, np.exp(m2_lr)), rtol=1e-12
)
print(
    f"GMPO: token 1 clipped above r = e^0.4 = {math.exp(0.4):.3f}; token veto drops row 1; "
    f"M2PO masks {removed.sum()} of {candidate.sum()} candidate tokens "
    f"(mean (log r)² {np.mean(m2_lr[candidate] ** 2):.3f} → {np.mean(m2_lr[kept] ** 2):.3f})"
)

fig, ax = plt.subplots(figsize=(5.5, 3.2))
ax.plot(np.exp(sweep), c_gmpo[:, 0], color=style.color("gmpo"), label="c₁ (the token that moves)")
ax.plot(np.exp(sweep), c_gmpo[:, 1], "--", color=style.color("gmpo"), label="c₂ (a fixed token)")
ax.axvline(math.exp(0.4), color="0.6", linestyle=":")
ax.set(xlabel="r₁", ylabel="c", title="GMPO, A > 0: one token moves the others")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 5. VESPO's Fig. 2, regenerated
#
# VESPO (Shen et al., arXiv 2602.10693) derives its sequence-level weight from a variational
# problem (notebook 06): the proposal Q* ∝ μ·W^α·e^{−λW} gives the detached coefficient
#
# $$\varphi(W) = W^{c_1} e^{c_2 (1 - W)}, \qquad
#   f(W) = e^{c_2} c_2^{-c_1}\,\gamma(c_1, c_2 W),$$
#
# with (c₁, c₂) = (k, λ) = (2, 3) for A ≥ 0 and (3, 2) for A < 0, and γ the lower incomplete
# gamma function. φ(1) = 1; φ peaks at W = c₁/c₂ with value (c₁/c₂)^{c₁}·e^{c₂−c₁}
# (Prop. C.1) and vanishes at 0 and ∞; f saturates at e^{c₂}c₂^{−c₁}Γ(c₁) — a bounded
# surrogate. The paper's Fig. 2 compares it with SAPO's soft gate and the hard clip
# (ε = 0.2), drawing VESPO peak-normalised (φ/φ_max and f/φ_max, so that W·f′ = φ still
# holds for the drawn pair). The figure module `kernel_shapes` regenerates it.

# %%
fig2_config = kernel_shapes.config(small=FAST)
fig2 = kernel_shapes.compute(fig2_config)
with style.context():
    display(kernel_shapes.draw(fig2))


def curve(data, name, sign, quantity):
    part = data[(data.curve == name) & (data.advantage == sign) & (data.quantity == quantity)]
    return part.w.to_numpy(), part.value.to_numpy()


rows = []
step = fig2_config.w_max / (fig2_config.n_points - 1)
for sign, (k, lam) in (("A>0", (2.0, 3.0)), ("A<0", (3.0, 2.0))):
    phi_max, argmax = theory.vespo_phi_max(k, lam)
    saturation = math.exp(lam) * lam**-k * math.gamma(k)
    w, phi_drawn = curve(fig2, "VESPO (peak-normalised)", sign, "phi")
    assert abs(w[np.argmax(phi_drawn)] - argmax) <= step  # the drawn peak is at c1/c2
    assert (
        phi_drawn.max() <= 1 + 1e-12 and abs(mappings.vespo_phi(argmax, k, lam) - phi_max) < 1e-12
    )
    assert abs(mappings.vespo_f(1e3, k, lam) - saturation) < 1e-12 * saturation
    grid = np.linspace(1e-3, 10, 200001)  # Prop. C.1 against a brute-force maximum
    assert abs(mappings.vespo_phi(grid, k, lam).max() - phi_max) < 1e-8
    rows.append(
        {
            "A": sign,
            "(c1, c2)": (k, lam),
            "argmax c1/c2": argmax,
            "φ_max (Prop. C.1)": phi_max,
            "φ(1)": float(mappings.vespo_phi(1.0, k, lam)),
            "f(∞)": saturation,
            "K = sup φ/W (Prop. 3.1)": theory.vespo_K(k, lam),
        }
    )
display(pd.DataFrame(rows).set_index("A").round(4))

_, clip_pos = curve(fig2, "hard clip", "A>0", "phi")
w, clip_neg = curve(fig2, "hard clip", "A<0", "phi")
assert np.all(clip_pos[w > 1.2 + 1e-9] == 0) and np.all(clip_neg[w < 0.8 - 1e-9] == 0)
_, sapo_pos = curve(fig2, "SAPO", "A>0", "phi")
assert np.all(sapo_pos[w > 0] > 0) and abs(sapo_pos[np.argmin(np.abs(w - 1))] - 1) < 1e-12

# %% [markdown]
# Reading the figure:
#
# - **Hard clip** (panels c, d): φ = W inside the trust region, then a cliff to 0 — for
#   A > 0 above 1 + ε, for A < 0 below 1 − ε. Its f is flat beyond the cliff: no gradient.
# - **SAPO**: a smooth bump 4σ(1−σ)·W that equals 1 at W = 1 and decays on both sides but
#   never reaches 0; its f is a sigmoid, bounded.
# - **VESPO**: a smooth bump too, but placed asymmetrically — for A > 0 its peak is at
#   2/3 (it favours responses that π already finds *less* likely than μ did), for A < 0 at
#   3/2 — and it decays on *both* sides for both signs, at a rate set by (c₁, c₂), with no
#   trust-region band to tune. Its slope at W = 1 is φ′(1) = c₁ − c₂ = −1 for A > 0 where a
#   ratio has slope +1: the property behind its bias at small mismatch (notebook 04).
#
# Move VESPO's (k, λ), the clip ε and SAPO's τ, and the figure is recomputed by
# `kernel_shapes.compute` with your configuration:


# %%
def vespo_figure(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, clip_eps=0.2, sapo_tau=1.0):
    config = kernel_shapes.Config(
        n_points=N_GRID,
        clip_eps=clip_eps,
        sapo_tau_pos=sapo_tau,
        sapo_tau_neg=1.05 * sapo_tau,
        vespo_k_pos=k_pos,
        vespo_lambda_pos=lambda_pos,
        vespo_k_neg=k_neg,
        vespo_lambda_neg=lambda_neg,
    )
    with style.context():
        display(kernel_shapes.draw(kernel_shapes.compute(config)))
    print(f"VESPO peaks: A>0 at W = {k_pos / lambda_pos:.3g}, A<0 at W = {k_neg / lambda_neg:.3g}")


vespo_widget = interact(
    vespo_figure,
    k_pos=Slider(1.0, 6.0, 0.1, 2.0),
    lambda_pos=Slider(0.5, 6.0, 0.1, 3.0),
    k_neg=Slider(1.0, 6.0, 0.1, 3.0),
    lambda_neg=Slider(0.5, 6.0, 0.1, 2.0),
    clip_eps=Slider(0.05, 0.5, 0.01, 0.2),
    sapo_tau=LogSlider(0.2, 10.0, 1.0),
)

# %% [markdown]
# ## 6. Every policy loss is a weighted SFT loss
#
# Supervised fine-tuning (SFT) on tokens y with per-token weights λ minimises
# L_SFT(θ) = −Σ_{i,t} λ_{i,t} log π_θ(y_{i,t}|s_{i,t}), whose gradient is
# −Σ λ ∇log π. Compare with the policy gradient of section 1: with
#
# $$\lambda_{i,t} = \operatorname{sg}\!\big(c_{i,t}\big)\,\frac{A_i}{Z_i},$$
#
# **every** loss of the catalogue has, at the current θ, exactly the gradient of a weighted
# SFT loss on the sampled responses. RL with verifiable rewards is SFT on its own samples,
# with weights: responses with A > 0 are imitated, responses with A < 0 get negative weights
# ("un-imitated"), and the weight mapping only decides *how much* each token counts. Two
# classic methods are special cases:
#
# - **SFT**: c = 1, A = 1, token-mean: λ = 1/(number of tokens) — the mean cross-entropy;
# - **rejection-sampling fine-tuning** (RAFT, Dong et al. 2023; STaR, Zelikman et al. 2022;
#   RFT, Yuan et al. 2023): c = 1 and A = R ∈ {0, 1} without baseline: SFT on the correct
#   responses only. Adding a baseline (A = R − b, GRPO's group normalisation) is what makes
#   it REINFORCE, with negative weights on the failures.
#
# The identity is about gradients only: the loss *values* differ (PPO's surrogate is about
# Σ r·A, the SFT loss Σ λ·(−log π)), and so do their second derivatives — a surrogate's
# weights change when θ moves within an update, the frozen λ do not (exercise 4).
#
# We check it with torch on a small tabular policy (one softmax per position,
# π_θ(·|t) = softmax(θ_t)): for each of the 28 mappings with a c·A gradient and each of the 4
# aggregations (clip_cov and kl_cov read log π itself and kl_cov's penalty is not ∝ A: the
# numpy estimator, which sees log-ratios only, cannot reproduce them; `tests/test_lm_losses.py`
# checks them against `simkit.mappings` given log π),
# the gradient of `simkit.lm.losses.policy_loss` (the torch losses, surrogate or detached as
# the libraries write them) equals the gradient of the weighted SFT loss whose λ come from
# the *numpy* estimator `Estimator(...).token_weights` — two independent implementations.

# %%
V, T, N, G = 6, 8, 16, 4  # vocabulary, max length, batch, GRPO group size
theta_np = rng.normal(0.0, 1.0, (T, V))  # the trained policy π_θ
mu_logits = theta_np + 0.4 * rng.normal(size=(T, V))  # a stale / mismatched behaviour μ


def log_softmax_np(logits):
    """log softmax along the last axis (numpy)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def sample_batch(mu_logits, n, rng):
    """Sequences from the tabular μ: tokens (n, T), ragged mask (n, T), binary rewards (n,)."""
    mu = np.exp(log_softmax_np(mu_logits))
    u = rng.random((n, T, 1))
    tokens = (u > np.cumsum(mu, axis=-1)[None]).sum(-1).clip(max=V - 1)
    mask = np.arange(T) < rng.integers(3, T + 1, n)[:, None]
    rewards = ((tokens == 0) & mask).any(axis=1).astype(float)  # "token 0 appears"
    return tokens, mask, rewards


tokens, mask, rewards = sample_batch(mu_logits, N, rng)
positions = np.arange(T)[None, :]
old_log_prob = log_softmax_np(mu_logits)[positions, tokens]  # log μ(y_t), (N, T)
adv = advantages(rewards, "grpo", group_size=G)
print(f"rewards {rewards.astype(int)}; GRPO advantages {np.round(adv, 2)}")


def log_prob_of(theta):
    """log π_θ(y_{i,t}) of the batch's tokens, (N, T), differentiable in θ."""
    return torch.log_softmax(theta, dim=-1)[torch.arange(T)[None, :], torch.as_tensor(tokens)]


def gradients(name, aggregation):
    """(∇θ policy loss, ∇θ weighted SFT loss, loss value, SFT value) for one mapping."""
    theta = torch.tensor(theta_np, requires_grad=True)
    log_prob = log_prob_of(theta)
    loss, _ = losses.policy_loss(
        name,
        log_prob,
        torch.as_tensor(old_log_prob),
        torch.as_tensor(adv),
        torch.as_tensor(mask),
        agg=aggregation,
        compute_metrics=False,
    )
    (grad_loss,) = torch.autograd.grad(loss, theta, retain_graph=True)
    log_ratio = log_prob.detach().numpy() - old_log_prob
    lam = Estimator(name, aggregation=aggregation, advantage="grpo", group_size=G).token_weights(
        log_ratio, mask, rewards
    )
    sft = -(torch.as_tensor(lam) * log_prob).sum()
    (grad_sft,) = torch.autograd.grad(sft, theta)
    return grad_loss.numpy(), grad_sft.numpy(), loss.item(), sft.item()


rows = []
for aggregation in AGGREGATIONS:
    for name in [n for n in losses.available() if not mappings.mapping_class(n).uses_log_prob]:
        g_loss, g_sft, loss_value, sft_value = gradients(name, aggregation)
        error = np.max(np.abs(g_loss - g_sft)) / max(np.max(np.abs(g_sft)), 1e-300)
        rows.append(
            {
                "mapping": name,
                "aggregation": aggregation,
                "form": losses.loss_form(name),
                "loss value": loss_value,
                "SFT loss value": sft_value,
                "‖∇θ‖∞": np.max(np.abs(g_sft)),
                "relative gradient difference": error,
            }
        )
sft_check = pd.DataFrame(rows)
assert np.all(sft_check["relative gradient difference"] < 1e-12)
assert np.all(sft_check["‖∇θ‖∞"] > 0)
detached = sft_check[sft_check.form == "detached"]  # these losses are weighted SFT losses
assert np.allclose(detached["loss value"], detached["SFT loss value"], rtol=1e-12, atol=0)
print(
    f"{len(sft_check)} (mapping, aggregation) pairs: largest relative gradient difference "
    f"{sft_check['relative gradient difference'].max():.1e}"
)
display(
    sft_check[sft_check.aggregation == "seq-mean-token-mean"]
    .set_index("mapping")
    .drop(columns="aggregation")
    .round({"loss value": 4, "SFT loss value": 4, "‖∇θ‖∞": 4})
)

# %% [markdown]
# Same gradients to rounding error for the 112 pairs. The detached losses *are* weighted SFT
# losses (same value too); the surrogate ones have other values — PPO's is about −Σ r·A/Z,
# near 0 when advantages are centred — so the "loss" curve a trainer logs is not comparable
# across mappings: only its gradient means something.
#
# The special cases, checked against torch's own cross-entropy:

# %%
theta = torch.tensor(theta_np, requires_grad=True)
log_prob = log_prob_of(theta)
flat_mask = torch.as_tensor(mask)
targets = torch.as_tensor(tokens)
logits = theta[None].expand(N, T, V)


def cross_entropy_gradient(rows):
    """∇θ of the mean cross-entropy over the valid tokens of ``rows`` (plain SFT)."""
    keep = flat_mask & torch.as_tensor(rows)[:, None]
    ce = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    return torch.autograd.grad(ce, theta, retain_graph=True)[0].numpy()


def weighted_sft_gradient(name, advantage, rewards_used):
    lam = Estimator(name, aggregation="token-mean", advantage=advantage).token_weights(
        log_prob.detach().numpy() - old_log_prob, mask, rewards_used
    )
    sft = -(torch.as_tensor(lam) * log_prob).sum()
    return torch.autograd.grad(sft, theta, retain_graph=True)[0].numpy()


everyone = np.ones(N, bool)
correct = rewards == 1
# SFT: naive, A = 1 (raw advantage of a constant reward 1), token-mean
assert np.allclose(
    weighted_sft_gradient("naive", "raw", np.ones(N)), cross_entropy_gradient(everyone), atol=1e-14
)
# rejection sampling: naive, A = R ∈ {0, 1}: SFT on the correct responses, scaled by their share
share = mask[correct].sum() / mask.sum()
assert np.allclose(
    weighted_sft_gradient("naive", "raw", rewards),
    share * cross_entropy_gradient(correct),
    atol=1e-14,
)
print(
    f"naive + A = 1 is SFT; naive + A = R is SFT on the {correct.sum()} correct responses "
    f"(× {share:.3f}, their share of the tokens)"
)

# %% [markdown]
# What the mappings change is the map of weights λ. Each row below is a response of the
# batch, each column a token; red pushes the token's probability up, blue down. Under
# `naive` all tokens of a response share one weight (its advantage / Z). Token-level
# mappings (`ppo_clip`, `cispo`) change single tokens; sequence-level ones (`tis_seq`,
# `vespo`, `gspo`) rescale whole responses. Grey rows are groups of G = 4 responses that all
# got the same reward: GRPO gives them A = 0, no signal whatever the mapping. Choose the
# mapping, the aggregation and the size of the mismatch between π and μ:


# %%
def weight_map(name="ppo_clip", aggregation="seq-mean-token-mean", mismatch=0.4, compare="naive"):
    behaviour_logits = theta_np + mismatch * np.random.default_rng(1).normal(size=(T, V))
    toks, msk, rew = sample_batch(behaviour_logits, N, np.random.default_rng(2))
    log_ratio = (
        log_softmax_np(theta_np)[positions, toks]
        - log_softmax_np(behaviour_logits)[positions, toks]
    )
    lams = {
        which: Estimator(
            which, aggregation=aggregation, advantage="grpo", group_size=G
        ).token_weights(log_ratio, msk, rew)
        for which in (compare, name)
    }
    scale = max(np.max(np.abs(lam)) for lam in lams.values()) or 1.0
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, (which, lam) in zip(axes, lams.items()):
        image = ax.imshow(
            np.where(msk, lam, np.nan), cmap="RdBu_r", vmin=-scale, vmax=scale, aspect="auto"
        )
        ax.set(title=f"λ = c·A/Z: {which}", xlabel="token t")
    axes[0].set_ylabel("response i")
    fig.colorbar(image, ax=axes, shrink=0.8)
    plt.show()
    changed = np.abs(lams[name] - lams[compare]) > 1e-12 * np.max(np.abs(lams[compare]))
    print(f"{name} changes {changed[msk].mean():.0%} of the valid tokens' weights vs {compare}")


weights_widget = interact(
    weight_map,
    name=Choice(losses.available(), value="ppo_clip"),
    aggregation=Choice(list(AGGREGATIONS), value="seq-mean-token-mean"),
    mismatch=Slider(0.0, 2.0, 0.05, 0.4),
    compare=Choice(["naive", "is_seq", "is_token"], value="naive"),
)

# %% [markdown]
# ## Exercises
#
# Solutions: `solutions/03_weight_mapping_zoo_solutions.py` (try first!).
#
# 1. **From a surrogate to a coefficient.** LUFFY's policy shaping uses F(r) = r/(r + γ).
#    Derive c = r·F′(r), find the ratio where it is largest and its value there, and check
#    against `mappings.get("luffy", preset="paper").phi`. Does LUFFY up-weight tokens that π
#    finds unlikely relative to μ (r < 1) or likely (r > 1)?
# 2. **Write your own mapping.** Implement a "log-normal gate"
#    φ(w) = w·exp(−(log w)²/(2σ²)) (σ = 0.5) as a `mappings.ScalarMapping` subclass with
#    `phi`, `f` and `coefficients` (token level), register it with `mappings.register`, and
#    check it against the contract of section 2: c = 1 on-policy, φ = w·f′(w),
#    `coefficients` = φ(r_t). Hint: f(w) = ∫₀^w φ(u)/u du has a closed form with the normal
#    CDF. Is it a mask, a truncation or a smooth reshaping?
# 3. **VESPO's constants.** Prove Prop. C.1 (sup φ = (c₁/c₂)^{c₁}·e^{c₂−c₁} at W = c₁/c₂)
#    and the constant K = sup φ(W)/W = ((c₁−1)/c₂)^{c₁−1}·e^{c₂−c₁+1} of Prop. 3.1. Check
#    both against `theory.vespo_phi_max` and `theory.vespo_K` by a brute-force maximum for a
#    few (c₁, c₂). What happens to K for c₁ < 1?
# 4. **Predict, then check: several epochs.** PPO-style trainers take several gradient steps
#    on the same batch. On a fresh on-policy batch of the tabular policy of section 6 (μ = π
#    at the start, as in PPO's first epoch), take 6 steps of gradient descent (step size 5)
#    with `ppo_clip` as (a) the surrogate loss, recomputed at every step, and (b) the
#    weighted SFT loss with λ frozen at the first step. Before running it, predict which one
#    moves the ratios r further from 1. Then compare the largest |log r| and the fraction of
#    clipped tokens after each step.
# 5. **Masks vs truncations.** Classify the 23 scalar mappings with their φ on a grid of
#    ratios: which can give c = 0 (for which sign of A), which are bounded above, which are
#    continuous? Compare with the table of section 2.
