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
# # 05 — Token level or sequence level? Bias and variance as the length $T$ grows
#
# **Learning goals**
#
# - Describe LLM RLVR as a token-level MDP with an outcome reward, and compute its $J$ and
#   $\nabla J$ three ways: dynamic programming, enumeration, Monte Carlo.
# - Derive $\mathbb{E}_\mu[W^2] = (1+\chi^2)^T$ for the sequence ratio and see its Monte Carlo
#   estimate fail silently once the weights are heavy-tailed (PSIS $\hat k$ catches it).
# - Explain why token-level weighting is biased through the state distribution, with a bias
#   bounded by $O(T^2\Delta_{\max})$, and measure it exactly up to $T = 256$.
# - Recognise two length pathologies of sequence-level fixes: the length trap of sequence
#   masking and GSPO's length conflation.
# - Compute the length at which the MSE of sequence IS overtakes that of token IS.
#
# **Runtime**: about 20 s with full sizes, about 8 s with `SIMKIT_FAST=1` (one CPU core,
# kernel start included).
#
# **Prerequisites**: notebooks 02 (importance sampling, ESS, $\hat k$) and 04 (bias, variance,
# MSE; the exact path of `simkit.experiment.run`).

# %%
# %matplotlib inline
import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import display

from simkit import divergence, experiment, mappings, theory
from simkit.envs import TokenMDP
from simkit.envs.behaviour import behaviour
from simkit.estimators import Estimator
from simkit.figures import (
    gspo_length_conflation,
    length_trap,
    mse_vs_T,
    seq_variance_vs_T,
    style,
    token_bias_vs_T,
)
from simkit.notebook import Choice, LogSlider, Slider, interact

FAST = os.environ.get("SIMKIT_FAST", "0") == "1"
pd.set_option("display.precision", 4)

# %% [markdown]
# ## 1. The token MDP
#
# A response $y = (y_1, \dots, y_T)$ is generated token by token. The policy's next-token
# distribution depends on the position $t$ and on a *state* $s_t$ computed from the prefix by a
# finite automaton; the reward $R(y)$ is verifiable and read at the end. `TokenMDP` keeps the
# state space finite so that everything is exact:
#
# - $J = \mathbb{E}_\pi[R]$, the occupancies $d^\pi_t(s)$ and $\nabla_\theta J$ by dynamic
#   programming (forward/backward recursions over $(t, s)$, cost $O(T\,S\,V)$);
# - any expectation by enumerating the $V^T$ sequences while that is small;
# - Monte Carlo otherwise.
#
# `answer_correct` is "the final answer is right": $V = 2$ tokens, $R = 1$ iff the last token is
# the answer, and the policy depends on whether the previous token was correct. Its gradient
# is the score-function sum $\nabla J = \mathbb{E}_\pi\big[R \sum_t \nabla\log\pi(y_t|s_t)\big]$,
# which enumeration computes with one `accumulate` call.

# %%
env = TokenMDP.answer_correct(V=2, T=8, seed=0)
support = env.support(env.pi)  # every sequence, with its probability under π
J_enum = float(support.prob @ support.rewards)
grad_enum = env.accumulate(
    support.actions, (support.prob * support.rewards)[:, None] * support.mask
)
batch = env.sample(env.pi, 20000, np.random.default_rng(0))
J_mc, J_se = batch.rewards.mean(), batch.rewards.std(ddof=1) / np.sqrt(batch.n)
print(f"{env.n_sequences} sequences; J: DP {env.J():.6f}, enumeration {J_enum:.6f}, ", end="")
print(f"Monte Carlo {J_mc:.4f} ± {J_se:.4f}")
assert abs(env.J() - J_enum) < 1e-12 and abs(J_mc - env.J()) <= 4 * J_se
assert np.allclose(env.grad_J(), grad_enum, atol=1e-12)

# %% [markdown]
# ## 2. Sequence weights: $(1+\chi^2)^T$
#
# The sequence ratio is $W = \prod_t r_t$ with $r_t = \pi(y_t|s_t)/\mu(y_t|s_t)$. It is the
# exact importance weight of the whole response, so $\mathbb{E}_\mu[W] = 1$ and
# $\mathrm{Var}_\mu(W) = \chi^2_{\text{seq}}(\pi\|\mu)$. Condition on the prefix:
# $\mathbb{E}_\mu[r_t^2 \mid s_t] = 1 + \chi^2(\pi_t(\cdot|s_t)\|\mu_t(\cdot|s_t))$. If every
# state has the same per-token $\chi^2$, peeling one token at a time gives
#
# $$\mathbb{E}_\mu[W^2] = (1+\chi^2)^T, \qquad \chi^2_{\text{seq}} = (1+\chi^2)^T - 1,$$
#
# exponential in $T$ (notation page §A/§F; rl-collapse, Liu, Li et al. 2025, part 2:
# Seq-IS variance $O((1+\chi^2_{\max})^T)$). `env.chi2_seq(mu)` computes $\mathbb{E}_\mu[W^2]$
# exactly for any automaton with a transfer-matrix recursion (kernel $\pi^2/\mu$). The
# numbers quoted on the notation page (§F): $1.01^{200} \approx 7.3$, $1.05^{200} \approx 17\,293$.

# %%
assert abs(theory.seq_is_second_moment(0.01, 200) - 7.3) < 0.05
assert abs(theory.seq_is_second_moment(0.05, 200) - 17293) < 1
print("ESS fraction 1/(1+χ²_seq) at T = 200, χ² = 0.05:", theory.expected_ess(1, 17292.6))

rows = []
for chi2, T in [(0.02, 8), (0.02, 16), (0.02, 32), (0.1, 64), (0.1, 128)]:
    iid = TokenMDP.iid(V=4, T=T, seed=0)  # independent tokens, π the same at every position
    mu = behaviour(iid, chi2, "chi2", level="token", family="logit_noise")
    log_w = iid.sample(mu, 20000, np.random.default_rng(T)).log_ratio.sum(axis=-1)
    mc = divergence.chi2_mc(log_w)
    rows.append(
        {
            "chi2_tok": chi2,
            "T": T,
            "DP": iid.chi2_seq(mu),
            "closed form": theory.seq_is_variance(chi2, T),
            "MC": mc.value,
            "MC se": mc.se,
            "z": (mc.value - iid.chi2_seq(mu)) / mc.se,
            "khat": mappings.psis_khat(log_w),
        }
    )
    if iid.enumerable(budget=2**16):  # a third exact path: Σ_y μ(y) W(y)² − 1
        s = iid.support(mu)
        enum = float(s.prob @ np.exp(2 * s.log_ratio.sum(axis=1))) - 1
        assert abs(enum - iid.chi2_seq(mu)) < 1e-10
seq_var = pd.DataFrame(rows)
display(seq_var)
assert np.allclose(seq_var.DP, seq_var["closed form"], rtol=1e-10)
flagged = seq_var.khat > 0.7  # PSIS: above 0.7 the estimate is unreliable
assert flagged.tolist() == [False, False, False, True, True]  # exactly the χ² = 0.1 rows
assert np.all(np.abs(seq_var.z[~flagged]) <= 4)  # MC is fine while the tail is light...
assert seq_var.MC.iloc[-1] < 0.01 * seq_var.DP.iloc[-1]  # ...and misses 99 % of it here
assert abs(seq_var.z.iloc[-1]) > 100  # while its own standard error does not notice

# %% [markdown]
# The last two rows are the trap of notebook 02 at sequence level. At $T = 128$,
# $\chi^2_{\text{seq}} \approx 2\cdot10^5$ and $\mathbb{E}_\mu[W^2]$ is carried by sequences
# that 20 000 draws never contain: the Monte Carlo estimate misses more than 99 % of the truth
# *and its standard error does not notice* ($|z| > 100$). At $T = 64$ the estimate happens to
# land within its (enormous) standard error — luck, not reliability. The Pareto $\hat k > 0.7$
# of PSIS (Vehtari et al., JMLR 2024) flags both rows, and only those (asserted) — the
# $T = 64$ row only just ($\hat k \approx 0.70$, against $\hat k \approx 1.0$ at $T = 128$ and
# at most 0.2 on the light-tailed rows).
#
# With a state-dependent policy the product formula needs the per-state $\chi^2$ to be equal:
# on a first-order Markov MDP, dialing every state to $\chi^2 = 0.05$ keeps it exact, while
# dialing only the *average* per-token $\chi^2$ to 0.05 does not.

# %%
markov = TokenMDP.markov(V=4, T=8, seed=0)
for aggregate in ("each", "average"):
    mu = behaviour(markov, 0.05, "chi2", level="token", family="logit_noise", aggregate=aggregate)
    s = markov.support(mu)
    enum = float(s.prob @ np.exp(2 * s.log_ratio.sum(axis=1))) - 1
    closed = theory.seq_is_variance(markov.divergences_tok(mu)["chi2_tok"], markov.T)
    print(
        f"{aggregate:8s} DP {markov.chi2_seq(mu):.6f}  enumeration {enum:.6f}  "
        f"(1+χ̄²)^T − 1 = {closed:.6f}"
    )
    assert abs(enum - markov.chi2_seq(mu)) < 1e-10
    if aggregate == "each":
        assert abs(closed - markov.chi2_seq(mu)) < 1e-10
    else:
        assert abs(closed - markov.chi2_seq(mu)) > 1e-3

# %%
sv = seq_variance_vs_T.compute(seq_variance_vs_T.config(small=FAST))
with style.context():
    display(seq_variance_vs_T.draw(sv))

# %% [markdown]
# ## 3. The bias of token-level weighting grows with $T$
#
# Token IS replaces $W$ by its per-token factors: the token at step $t$ gets $r_t$ alone. That
# corrects the *action* distribution at step $t$ but not the *state* distribution — the prefix
# was still drawn from $\mu$:
#
# $$\mathbb{E}_\mu\Big[\sum_t r_t\,A\,\nabla\log\pi(y_t|s_t)\Big] = \sum_t
#   \mathbb{E}_{s\sim d^\mu_t}\big[\cdots\big] \;\ne\; \sum_t \mathbb{E}_{s\sim d^\pi_t}
#   \big[\cdots\big] = \nabla J .$$
#
# By the simulation lemma $\mathrm{TV}(d^\mu_t, d^\pi_t) \le t\,\Delta_{\max}$ with
# $\Delta_{\max}$ the largest per-state TV; summing over $t$ gives the rl-collapse bound
# $\mathrm{bias} = O(T^2\Delta_{\max})$ (Liu, Li et al. 2025, part 2;
# `theory.token_is_bias_bound_shape` — an order, not a constant). At $T = 1$ there is no
# prefix: token IS *is* sequence IS, and unbiased.
#
# The figure `token_bias_vs_T` computes the bias exactly by dynamic programming
# (`simkit.envs.exact_token_level_mean`) at every $T$ up to 256, and checks it against the
# enumeration of all sequences where $V^T$ is small, on two tasks at per-token $\chi^2 = 0.05$:
# `answer_correct` (the reward reads only the last token) and a majority vote (`at_least_k`,
# the reward reads the whole sequence).

# The figure has two rows: **untied** parameters (one logit table per position, the gradient
# w.r.t. $\theta[t, \text{state}, \text{token}]$) and **tied** ones (one table shared by every
# position, closer to a language model: the gradient is the sum of the per-position blocks).
# The advantage is the oracle $A = R - J(\mu)$, centred under $\mu$ as a group mean would be.

# %%
tb = token_bias_vs_T.compute(token_bias_vs_T.config(small=FAST))
with style.context():
    display(token_bias_vs_T.draw(tb))

both = tb[tb.bias_enum.notna()]
assert np.allclose(both.bias, both.bias_enum, atol=1e-10)  # DP == enumeration (both params)
untied = tb[tb.params == "untied"]
token_is = untied[untied.mapping == "is_token"]
assert np.all(token_is[token_is["T"] == 1].bias < 1e-12)  # T = 1: token IS is sequence IS
assert np.all(tb[tb.mapping == "is_seq"].bias < 1e-12)  # enumerated (or 0 by theory)
majority = token_is[token_is.env == "at_least_k"].sort_values("T")
assert np.all(np.diff(majority.relative_bias) > 0)  # majority: relative bias keeps growing
last = token_is[token_is["T"] == token_is["T"].max()]
assert np.all(last.bias < last.bound_shape)  # far below the T² shape matched at small T
ppo = untied[untied.mapping == "ppo_clip"].set_index(["env", "T"]).bias
tok = token_is.set_index(["env", "T"]).bias
above = (ppo >= tok)[tok.index.get_level_values("T") >= 2]
assert above.loc["answer_correct"].all()  # PPO clip above token IS at every T ≥ 2 there
print("PPO clip's bias ≥ token IS's (T ≥ 2), majority vote:", above.loc["at_least_k"].to_dict())
display(token_is.pivot_table(index="T", columns="env", values="relative_bias"))
for line in token_bias_vs_T.claims(tb):  # the growth laws, fitted from the data above
    print(line)

# %% [markdown]
# Read the figure with the bound in mind. $T^2\Delta_{\max}$ is a worst case: on
# `answer_correct` the automaton forgets its past within a few steps, so the state
# distributions stop drifting apart and the bias saturates; on the majority vote the count
# never mixes, and the bias *relative to* $\|\nabla J\|$ keeps growing with $T$ — token IS
# ends up pointing as far from $\nabla J$ as $\nabla J$ is long. Naive REINFORCE ignores the
# ratios altogether and is biased already at $T = 1$ on `answer_correct`; PPO clip inherits
# token IS's state-distribution bias and adds that of its clipped tokens on `answer_correct`
# (above token IS at every $T \ge 2$, asserted), while on the majority vote the two end up at
# about the same bias (printed above). Sequence IS is exactly unbiased at every $T$.
#
# The growth laws printed above are fitted slopes of log bias against log $T$; they come from
# the data, so read them rather than a rule of thumb. With untied parameters and the $J(\mu)$
# baseline, naive's and token IS's biases are flat in $T$ once the automaton has mixed; with
# tied parameters every position adds its block to the same table, which is how a clipped
# mapping's per-position bias can add up with $T$ (PPO clip on `answer_correct`). No measured
# curve reaches the $T^2$ growth of the bound's shape.
#
# ## 4. The length trap of sequence masking
#
# Sequence-level fixes bring their own length problems. rl-collapse (part 3) argues: if every
# token ratio is about $\bar\rho > 1$, then $W \approx \bar\rho^T$ and the one-sided sequence
# mask $W\,\mathbb{1}[W \le C]$ (sequence MIS) rejects the sequences longer than
#
# $$T^\star = \frac{\log C}{\log\bar\rho}\qquad(C = 5,\ \bar\rho = 1.001 \Rightarrow
#   T^\star \approx 1610).$$
#
# Which sequences? Token ratios exceed 1 *on average in log* only for tokens drawn from $\pi$:
# $\mathbb{E}_\pi[\log r_t] = \mathrm{KL}(\pi\|\mu) > 0$, so $\bar\rho = e^{\mathrm{KL}(\pi\|\mu)}$.
# The trainer's rollouts come from $\mu$, where $\mathbb{E}_\mu[W] = 1$: by Markov's inequality
# $P_\mu(W > C) \le 1/C$ at every $T$, so the mask keeps at least $1 - 1/C$ of the rollouts
# however long they are. What collapses beyond $T^\star$ is the share of $\pi$'s mass that the
# kept rollouts carry, $\mathbb{E}_\mu[W\,\mathbb{1}\{W \le C\}] = P_\pi(W \le C)$. A two-sided
# mask rejects $\mu$'s rollouts through its *lower* bound ($\log W$ drifts down under $\mu$),
# and Geo-Mask on the geometric mean $s = e^{\overline{\log r}}$ keeps almost everything. The
# figure computes both measures exactly (token counts) on a token MDP and checks them against
# sequences sampled from $\mu$ and $\pi$.

# %%
assert abs(theory.length_trap_T(5.0, 1.001) - 1610) < 1
lt = length_trap.compute(length_trap.config(small=FAST))
with style.context():
    display(length_trap.draw(lt))

kept = lt.kept
one = kept[(kept["mask"] == "mis_seq_one_sided") & (kept.method == "exact")]
mu_kept = one[one.measure == "mu_samples"].set_index("T").fraction
pi_kept = one[one.measure == "pi_mass"].set_index("T").fraction
assert (mu_kept >= lt.markov_floor - 1e-12).all()  # Markov: at every T
assert pi_kept.iloc[-1] < mu_kept.iloc[-1]  # the mass, not the rollouts, is what is lost
for note in lt.notes:
    print(note)

# %% [markdown]
# ## 5. GSPO's length conflation
#
# GSPO (Zheng et al. 2025) avoids the exponential by using the geometric mean
# $s = \exp\big(\tfrac1T\sum_t \log r_t\big)$ as the sequence weight. The price (VESPO, Shen et
# al. 2026, Prop. E.1): two sequences with the same mean log-ratio $m$ get the same weight
# $e^m$ whatever their lengths, while their true ratios $W = e^{Tm}$ differ by the factor
# $e^{|m|\,(T_2 - T_1)}$ — orders of magnitude for long responses (at $m = 0.01$, lengths 1 and
# 2048 differ by $e^{20.5} \approx 8\cdot10^8$). $s$ is not an importance weight —
# $\mathbb{E}_\mu[s\,g] \ne \mathbb{E}_\pi[g]$ — so GSPO trades the variance of $W$ for a bias.

# %%
gl = gspo_length_conflation.compute(gspo_length_conflation.config(small=FAST))
with style.context():
    display(gspo_length_conflation.draw(gl))

lines = gl["lines"]
assert np.allclose(lines.gspo, np.exp(lines.mean_log_ratio), rtol=1e-9)  # s = e^m at every T
assert np.allclose(lines.is_seq, lines.w_exact, rtol=1e-9)  # W = e^{T m}
spread = lines.groupby("mean_log_ratio").is_seq.agg(lambda w: w.max() / w.min())
print("max W / min W over lengths, per mean log-ratio m:", spread.round(1).to_dict())
span = lines.groupby("mean_log_ratio")["T"].agg(lambda t: t.max() - t.min())
assert np.allclose(spread, np.exp(np.abs(spread.index) * span), rtol=1e-9)

# %% [markdown]
# The bias shows up on the token MDP: with the library clip band ($\varepsilon = 0.2$, so $s$ is
# rarely clipped) GSPO's exact bias stays far from 0 at every $T > 1$, between that of sequence
# IS (0) and that of naive REINFORCE. (At $T = 1$, $s = W$: GSPO is plain clipped IS there.)

# %%
gspo = mappings.get("gspo", preset="libraries")
rows = []
for T in (1, 2, 4, 8) if FAST else (1, 2, 4, 8, 12):
    task = TokenMDP.answer_correct(V=2, T=T, seed=0)
    mu = mse_vs_T.dialed_behaviour(task, 0.05, "logit_noise")
    ests = [
        Estimator(m, aggregation="seq-mean-token-sum", name=name)
        for name, m in (("gspo", gspo), ("is_seq", "is_seq"), ("naive", "naive"))
    ]
    tab = experiment.run(task, mu, ests, n=16, reps=2, exact=True).set_index("estimator")
    rows.append({"T": T, **tab.bias.to_dict()})
gspo_bias = pd.DataFrame(rows).set_index("T")
display(gspo_bias)
longer = gspo_bias.loc[gspo_bias.index > 1]
assert np.all(longer.gspo > 0.01) and np.all(longer.gspo < longer.naive)
assert np.all(gspo_bias.is_seq < 1e-12)

# %% [markdown]
# ## 6. Where the token and sequence MSE curves cross
#
# Token IS: a bias that grows (then saturates here) with $T$ and a variance that grows slowly.
# Sequence IS: no bias, variance that grows like $(1+\chi^2)^T$. For short responses sequence IS
# wins, for long ones token IS does; the crossing length is the practical answer to "token or
# sequence?". The figure `mse_vs_T` computes every MSE exactly — by enumeration
# ($V^T \le 2^{16}$) and beyond by the moment dynamic programme (mean and variance of every
# token-level mapping and of sequence IS, `simkit.envs.token_moments`) — and by Monte Carlo only
# for the mappings without a DP, on `answer_correct` at per-token $\chi^2 = 0.05$, $n = 16$,
# oracle advantage $A = R - J(\mu)$.

# %%
mse_cfg = mse_vs_T.Config(
    exact_lengths=tuple(range(1, 11 if FAST else 13)),
    dp_lengths=() if FAST else (16, 24, 32),
    mc_lengths=(),
    mapping_names=("naive", "is_token", "ppo_clip", "tis_seq", "is_seq"),
    chi2_tok=0.05,
    n=16,
    reps=2,
    mc_reps=400,
    n_boot=100,
)
curves = mse_vs_T.compute(mse_cfg)
with style.context():
    display(mse_vs_T.draw(curves))


def crossing_T(table, token="is_token", sequence="is_seq"):
    """First T at which sequence's exact MSE exceeds token's, and a log-linear interpolation."""
    exact = table[table.exact]
    tok = exact[exact.mapping == token].set_index("T").mse
    seq = exact[exact.mapping == sequence].set_index("T").mse
    gap = np.log(seq) - np.log(tok)  # > 0 once sequence IS is worse
    after = gap.index[gap > 0]
    if len(after) == 0:
        return None, None
    t1 = int(after[0])
    t0 = int(gap.index[gap.index < t1].max())
    interp = t0 + (t1 - t0) * (-gap[t0]) / (gap[t1] - gap[t0])
    return t1, interp


t_cross, t_interp = crossing_T(curves)
print(f"sequence IS overtakes token IS at T = {t_cross} (interpolated {t_interp:.2f})")
assert t_cross == 4
by_T = curves[curves.exact].pivot_table(index="T", columns="mapping", values="mse")
assert np.all((by_T.is_seq > by_T.is_token)[by_T.index >= t_cross])  # and stays above
assert np.all(by_T.tis_seq.dropna() <= by_T.is_seq[by_T.tis_seq.notna()] + 1e-12)
assert np.all((by_T.tis_seq > by_T.is_token)[by_T.index >= 5])  # …but not below token IS
assert (by_T.idxmin(axis=1) == "naive").all()  # naive has the smallest MSE of the five here
print(f"naive's MSE / token IS's: {(by_T.naive / by_T.is_token).round(3).to_dict()}")
# ...but MSE also rewards doing nothing: ĝ ≡ 0 has MSE ‖∇J‖² (the `mse_zero` column)
zero = curves[curves.exact].groupby("T").mse_zero.first()
zero_wins = by_T.min(axis=1) > zero  # ĝ ≡ 0 below every mapping's MSE
t_zero = int(zero_wins.index[zero_wins][0]) if zero_wins.any() else None
if t_zero is None:
    print("ĝ ≡ 0 never has a lower MSE than all five here")
else:
    print(f"from T = {t_zero}, ĝ ≡ 0 has a lower MSE than all five (MSE ranks gradient size)")
# the scale-free error ranks what a tuned step size achieves: 1 = no better than ĝ ≡ 0
rel = curves[curves.exact].pivot_table(index="T", columns="mapping", values="rel_mse_scaled")
assert ((rel >= 0) & (rel <= 1 + 1e-12)).all().all()
print("lowest rel_mse_scaled per T:", rel.idxmin(axis=1).to_dict())
print("rel_mse_scaled of naive / is_token / is_seq at the longest T:",
      rel.iloc[-1][["naive", "is_token", "is_seq"]].round(4).to_dict())  # fmt: skip

# %% [markdown]
# At $\chi^2 = 0.05$ per token and $n = 16$ the curves cross at $T = 4$ (asserted): from there
# on token IS has the smaller MSE, and the exact DP values beyond the enumeration (full size)
# show the gap widening. Truncated sequence IS (`tis_seq`, $\min(W, 2)$) stays below sequence
# IS at every length but above token IS from $T = 5$ (asserted). With the $J(\mu)$ baseline
# naive REINFORCE has the smallest MSE *of the five* at every $T$ here (asserted) — but MSE
# also rewards doing nothing: the estimator $\hat g \equiv 0$ has MSE $\|\nabla J\|^2$, and the
# lines printed above say from which $T$ it beats all five (there the MSE ranks gradient
# magnitude, not quality). The scale-free error `rel_mse_scaled`, the error after the best step
# size divided by $\|\nabla J\|^2$ (printed; between 0 and 1, asserted), ranks them by what a
# tuned learning rate would achieve — on this one instance. The crossing is not a constant of
# nature: it moves with the mismatch and with the
# batch size (exercise 2). Try it:


# %%
def crossing_explorer(chi2=0.05, n=16, T_max=12):
    cfg = mse_vs_T.Config(
        exact_lengths=tuple(range(1, T_max + 1)),
        dp_lengths=(),
        mc_lengths=(),
        mapping_names=("is_token", "is_seq", "tis_seq"),
        chi2_tok=chi2,
        n=n,
        reps=2,
    )
    table = mse_vs_T.compute(cfg)
    t_cross, t_interp = crossing_T(table)
    ax = plt.figure(figsize=(6, 3.4)).add_subplot()
    for name in cfg.mapping_names:
        part = table[table.mapping == name]
        ax.plot(part["T"], part.mse, marker="o", markersize=3, **style.line_kwargs(name))
    if t_cross is not None:
        ax.axvline(t_interp, color="0.5", linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("exact MSE")
    ax.set_title(f"χ² = {chi2:.3g} per token, n = {n}: crossing at T = {t_cross}")
    ax.legend()
    plt.show()


explorer = interact(
    crossing_explorer,
    chi2=LogSlider(0.01, 0.3, 0.05),
    n=Choice([4, 16, 64, 256], value=16),
    T_max=Slider(4, 14, 1, 12),
)

# %% [markdown]
# ## Exercises
#
# 1. **Derive the product formula.** Prove $\mathbb{E}_\mu[W^2] = \prod_t (1+\chi^2_t)$ for
#    independent tokens whose distributions change with the position. Check it on
#    `TokenMDP.iid(V=3, T=10, stationary=False)` with a $\mu$ dialed to a *different* $\chi^2$
#    at every position (`behaviour` accepts one target per row), against `env.chi2_seq`.
# 2. **Predict, then check: the crossing.** Before computing, say whether the crossing length
#    of section 6 moves up or down when (a) the batch grows from $n = 16$ to $n = 64$, (b) the
#    per-token $\chi^2$ doubles to 0.1. Justify with $\mathrm{MSE} = \mathrm{bias}^2 +
#    \mathrm{Var}/n$ and the growth rates of each term, then compute both crossings.
# 3. **The length trap at $T^\star$.** For $C = 5$, $\bar\rho = 1.002$, $\sigma = 0.02$:
#    compute $T^\star$, predict the fraction of sequences *drawn from π* (token log-ratios
#    $\mathcal N(\log\bar\rho, \sigma^2)$ under π) that `mis_seq` keeps at $T = T^\star$ (hint:
#    the closed form at $T^\star$), and check it by applying the registered mapping to sampled
#    log-ratios. Up to which length does it keep 99 %? Why is this not the fraction of μ's
#    rollouts kept?
# 4. **GSPO and repetition.** Take a sequence of log-ratios and concatenate it with itself.
#    What happens to $W$ and to GSPO's $s$? Check with the registered `gspo` and `is_seq`
#    mappings, and explain why this invariance is a variance *and* a bias statement.
#
# Worked solutions: `solutions/05_token_vs_sequence_solutions.ipynb`.
