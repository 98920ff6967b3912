"""The per-step records of a training run: the table's columns and the exact ones by DP.

:data:`COLUMNS` lists every column with its meaning; :func:`exact_columns` computes the exact
(dynamic-programming) columns of the policy π_s — J, ‖∇J‖, the estimator's cosine, χ²/KL
between π_s and μ per token and per sequence, entropy, expected length —, over one token MDP or
the mean over K prompts; :func:`records_table` is the typed DataFrame of a list of rows.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

#: columns of the table, in order, with their meaning
COLUMNS = {
    "step": "optimizer step s (0-based); the row describes π_s, the policy before update s",
    "rollout": "rollout index r = s // N",
    "minibatch": "mini-batch j = s % N inside the rollout",
    "staleness": "updates between μ's parameters and π_s (= policy_age_mean; older name)",
    "policy_age_min": "policy age, smallest over the mini-batch: updates between the θ that "
    "sampled a sequence and π_s, s − max(rN − L, 0) with L the lag in updates",
    "policy_age_mean": "policy age, mean over the mini-batch's sequences",
    "policy_age_max": "policy age, largest over the mini-batch (asynchronous runs: min, mean "
    "and max over the mini-batch's tokens, each token aged by the version that generated it)",
    "dropped": "samples of this rollout dropped by max_off_policy 'drop' (whole groups, "
    "refilled from the next fresh groups of the prompt stream; on the rollout's first "
    "mini-batch, 0 on the others)",
    "waited": "samples of this rollout trained at the oldest acceptable version by "
    "max_off_policy 'wait' (on the rollout's first mini-batch, 0 on the others)",
    "prompt_rows": "rows of the mini-batch per prompt, space-separated, prompt 0 first (the "
    "coverage of each prompt: with max_off_policy 'drop' slow prompts lose rows; "
    ":func:`simkit.train.prompt_rows` parses it)",
    "recorded": "True where the exact (DP) columns below were computed",
    "J": "J(π_s) = E_π[R], exact (DP)",
    "grad_J_norm": "‖∇J(π_s)‖, exact (DP)",
    "cosine": "cos(ĝ_s, ∇J(π_s)): the estimator's direction vs the true gradient",
    "chi2_tok": "χ²(π_s‖μ) per token, averaged over μ's state occupancy (DP)",
    "kl_tok": "KL(π_s‖μ) per token, averaged over μ's state occupancy (DP)",
    "chi2_seq": "χ²(π_s‖μ) between sequence distributions (DP: E_μ[W²] − 1)",
    "kl_seq": "KL(π_s‖μ) between sequence distributions (DP, chain rule)",
    "kl_seq_old": "KL(π_s‖π_old) of sequences: the staleness leg (π_old = θ at rollout start)",
    "kl_seq_old_mu": "KL(π_old‖μ) of sequences: the lag + mismatch leg",
    "entropy": "per-token entropy of π_s averaged over π_s's own occupancy, nats (DP)",
    "entropy_decision": "the same over decision states only (some token leads elsewhere; "
    "absorbing states excluded), nats (DP; NaN if π_s visits none)",
    "length": "E_π_s|y|, the expected sequence length (DP; T without EOS)",
    "grad_norm": "‖ĝ_s‖ of the estimator (before clipping)",
    "update_norm": "‖g‖ of the direction used (ĝ or ∇J, after clipping)",
    "ess": "normalised ESS of the sequence ratios W of the mini-batch, (ΣW)²/(n·ΣW²) ∈ (0, 1]",
    "max_abs_log_ratio": "largest |log π_s − log μ| over the mini-batch's tokens",
    "zero_frac": "clip/mask fraction: share of valid tokens whose coefficient c is 0",
    "coef_mean": "mean coefficient c over valid tokens",
    "reward_mean": "mean reward of the mini-batch",
    "length_mean": "mean length of the mini-batch's sequences",
    "estimator": "the estimator's name",
}

EXACT_COLUMNS = (
    "J",
    "grad_J_norm",
    "cosine",
    "chi2_tok",
    "kl_tok",
    "chi2_seq",
    "kl_seq",
    "kl_seq_old",
    "kl_seq_old_mu",
    "entropy",
    "entropy_decision",
    "length",
)


def ess_of_log_weights(log_w: np.ndarray) -> float:
    """(Σ W)² / (n Σ W²) from log W (n,), in log space."""
    if log_w.size == 0:
        return math.nan
    top = log_w.max()
    if not np.isfinite(top):
        return math.nan
    w = np.exp(log_w - top)
    return float(w.sum() ** 2 / (log_w.size * (w * w).sum()))


def decision_states(env) -> np.ndarray:
    """(S,) bool: True where the token can change the outcome, i.e. not every token leads to
    the same next state. Absorbing states (every token stays, e.g. a reached goal or a taken
    lure) and forced moves are False: the policy's entropy there does not affect J."""
    trans = np.asarray(env.transition)
    return (trans != trans[:, :1]).any(axis=1)


def _policy_stats(env_js) -> tuple[float, float, float]:
    """(per-token entropy of π averaged over π's occupancy, the same over the decision states
    only (:func:`decision_states`; NaN if π visits none), E_π|y|), exact (DP); over K prompts:
    Σ_k (entropy mass)_k / Σ_k (occupancy mass)_k and the mean E|y|."""
    mass = length = decision_mass = decision_length = 0.0
    for env_j in env_js:
        d = env_j.occupancy()  # (T, S)
        pi = env_j.pi[:, env_j.policy_index]  # (T, S, V)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(pi > 0, pi * np.log(pi), 0.0).sum(axis=-1)  # (T, S)
        mass += float((d * h).sum())
        length += float(d.sum())
        decides = decision_states(env_j)
        decision_mass += float((d[:, decides] * h[:, decides]).sum())
        decision_length += float(d[:, decides].sum())
    decision = decision_mass / decision_length if decision_length > 0 else math.nan
    return mass / length, decision, length / len(env_js)


def exact_columns(env_js, mu, g_hat, grad_J) -> dict:
    """The exact columns of π (one env, or the mean over K prompts)."""
    norm_true = float(np.linalg.norm(grad_J))
    norm_hat = float(np.linalg.norm(g_hat))
    out = dict(
        grad_J_norm=norm_true,
        cosine=float(g_hat @ grad_J / (norm_hat * norm_true))
        if norm_hat > 0 and norm_true > 0
        else math.nan,
    )
    if len(env_js) == 1:
        env_j = env_js[0]
        div = env_j.divergences_tok(mu)
        out.update(
            J=env_j.J(),
            chi2_tok=div["chi2_tok"],
            kl_tok=div["kl_tok"],
            chi2_seq=env_j.chi2_seq(mu),
            kl_seq=env_j.kl_seq(mu),
        )
    else:  # uniform prompt law, the same under π and μ
        tokens = np.array([e.occupancy(mu).sum() for e in env_js])  # E_μ|y| per prompt
        divs = [e.divergences_tok(mu) for e in env_js]
        out.update(
            J=float(np.mean([e.J() for e in env_js])),
            chi2_tok=float(sum(t * d["chi2_tok"] for t, d in zip(tokens, divs)) / tokens.sum()),
            kl_tok=float(sum(t * d["kl_tok"] for t, d in zip(tokens, divs)) / tokens.sum()),
            chi2_seq=float(np.mean([e.chi2_seq(mu) for e in env_js])),
            kl_seq=float(np.mean([e.kl_seq(mu) for e in env_js])),
        )
    out["entropy"], out["entropy_decision"], out["length"] = _policy_stats(env_js)
    return out


def records_table(rows: list[dict]) -> pd.DataFrame:
    """The rows as a DataFrame with the columns of :data:`COLUMNS`, integer and bool typed."""
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    return table.astype(
        {
            "step": np.int64,
            "rollout": np.int64,
            "minibatch": np.int64,
            "staleness": np.int64,
            "policy_age_min": np.int64,
            "policy_age_mean": np.float64,
            "policy_age_max": np.int64,
            "dropped": np.int64,
            "waited": np.int64,
            "prompt_rows": str,
            "recorded": bool,
        }
    )


def prompt_rows(table: pd.DataFrame) -> np.ndarray:
    """(steps, K) int64: the ``prompt_rows`` column of a training table as counts, row s the
    rows of mini-batch s per prompt (sum over a rollout's mini-batches: its trained batch)."""
    if "prompt_rows" not in table:
        raise ValueError("table has no 'prompt_rows' column (recorded before issue 26)")
    return np.array([[int(x) for x in s.split()] for s in table["prompt_rows"]], dtype=np.int64)
