"""The mismatch numbers as the trainers' dashboards compute them, from the same dump.

The same name means different quantities in different trainers; computed side by side on
the dump, they let a user match their dashboard (ρ_t = π_old/μ per token, log-ratio
clamped at ±20 where the trainer clamps it; masked means over valid tokens):

verl (verl/trainer/ppo/rollout_corr_helper.py, verl/utils/debug/metrics.py at 1dda039):

- ``rollout_corr/chi2_token`` = mean_tokens ρ² − 1;
- ``rollout_corr/chi2_seq`` = mean_seq (Π_t ρ_t)² − 1, the *product* (Σ log ρ clamped ±20);
- ``rollout_corr/k3_kl`` = mean_tokens (ρ − 1 − log ρ); ``rollout_corr/kl`` = mean_tokens
  (log μ − log π_old);
- ``rollout_corr/rollout_is_eff_sample_size`` = 1 / mean_tokens (w̃²), w̃ = w/mean(w) with
  w = the token IS weights clamped to [0, ``rollout_is_threshold``] (2.0 by default): a
  *share* of tokens after the cap, not a count of sequences;
- ``training/rollout_probs_diff_{max,mean,std}``: |π_old − μ| on *probabilities*, not
  log-probabilities (std with n − 1).

TRL (trl/trainer/grpo_trainer.py at f2cd577, defaults of trl/trainer/grpo_config.py):

- ``sampling/sampling_logp_difference/{mean,max}`` = |log π_old − log μ| over valid tokens;
- ``sampling/importance_sampling_ratio/{min,mean,max}``: the ratio *after* the correction —
  with the default ``vllm_importance_sampling_mode="sequence_mask"`` and clip_max 3.0 the
  sequence ratio exp(Σ_t log ρ_t), set to 0 where above 3 (so the mean is below the raw
  mean and the max is at most 3).

ms-swift (swift/megatron/trainers/grpo_trainer.py at 3602360):

- ``chi2_token`` as verl's; ``chi2_seq`` = mean_seq exp(mean_t log ρ_t)² − 1, the
  *geometric mean* (per-token scale: much smaller than verl's product for long responses);
- ``ess`` = 1 / mean_tokens (w̃²) with the weights clamped to [1/threshold, threshold].

simkit's own (the report above): χ² by the mean of (w − 1)² (non-negative), the sequence ESS
of Kong (Σ W)²/Σ W² as a count of sequences before any cap.

numpy only.
"""

from __future__ import annotations

import numpy as np

SAFETY_BOUND = 20.0


def _mmean(x, m):
    return float(np.sum(np.where(m, x, 0.0)) / max(int(m.sum()), 1))


def dashboards(
    log_pi,
    log_mu,
    mask,
    *,
    verl_threshold: float = 2.0,
    trl_mode: str = "sequence_mask",
    trl_clip_min: float | None = None,
    trl_clip_max: float | None = 3.0,
    swift_threshold: float = 2.0,
) -> list[dict]:
    """Rows (``tool``, ``metric``, ``definition``, ``value``) of the dashboard numbers
    (module docstring) for per-token log π_old, log μ and the mask, arrays (N, T)."""
    if trl_mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        raise ValueError(f"trl_mode {trl_mode!r} is not a TRL vllm_importance_sampling_mode")
    m = np.asarray(mask, bool)
    lr = np.where(m, np.asarray(log_pi, float) - np.asarray(log_mu, float), 0.0)
    rho = np.exp(np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND))
    rows = []

    def add(tool, metric, definition, value):
        rows.append({"tool": tool, "metric": metric, "definition": definition, "value": value})

    chi2_token = _mmean(rho**2, m) - 1.0
    seq_sum = np.clip(lr.sum(1), -SAFETY_BOUND, SAFETY_BOUND)
    add("verl", "rollout_corr/chi2_token", "mean_tok ρ² − 1", chi2_token)
    add(
        "verl",
        "rollout_corr/chi2_seq",
        "mean_seq (Π ρ_t)² − 1 (product)",
        float(np.mean(np.exp(2.0 * seq_sum)) - 1.0),
    )
    add("verl", "rollout_corr/k3_kl", "mean_tok ρ − 1 − log ρ", _mmean(rho - 1.0 - lr, m))
    add("verl", "rollout_corr/kl", "mean_tok log μ − log π_old", _mmean(-lr, m))
    w = np.clip(rho, 0.0, verl_threshold)
    wn = w / (_mmean(w, m) + 1e-8)
    add(
        "verl",
        "rollout_corr/rollout_is_eff_sample_size",
        f"1 / mean_tok w̃², token w clamped to [0, {verl_threshold:g}] (a share)",
        1.0 / _mmean(wn**2, m),
    )
    diff = np.abs(np.exp(np.asarray(log_pi, float)) - np.exp(np.asarray(log_mu, float)))[m]
    add(
        "verl",
        "training/rollout_probs_diff_mean",
        "mean |π_old − μ| (probabilities)",
        float(diff.mean()),
    )
    add(
        "verl",
        "training/rollout_probs_diff_max",
        "max |π_old − μ| (probabilities)",
        float(diff.max()),
    )
    add(
        "verl",
        "training/rollout_probs_diff_std",
        "std |π_old − μ| (n − 1)",
        float(diff.std(ddof=1)) if diff.size > 1 else float("nan"),
    )
    absd = np.abs(lr[m])
    add(
        "TRL",
        "sampling/sampling_logp_difference/mean",
        "mean |log π_old − log μ|",
        float(absd.mean()),
    )
    add(
        "TRL", "sampling/sampling_logp_difference/max", "max |log π_old − log μ|", float(absd.max())
    )
    if trl_mode.startswith("sequence"):
        ratio = np.exp(lr.sum(1))
    else:
        ratio = np.exp(lr)[m]
    lo = -np.inf if trl_clip_min is None else trl_clip_min
    hi = np.inf if trl_clip_max is None else trl_clip_max
    if trl_mode.endswith("truncate"):
        ratio = np.clip(ratio, lo, hi)
    else:
        ratio = np.where((ratio < lo) | (ratio > hi), 0.0, ratio)
    label = f"{trl_mode}, clip [{trl_clip_min}, {trl_clip_max}], after the correction"
    for stat, f in (("min", np.min), ("mean", np.mean), ("max", np.max)):
        add("TRL", f"sampling/importance_sampling_ratio/{stat}", label, float(f(ratio)))
    add("ms-swift", "chi2_token", "mean_tok ρ² − 1", chi2_token)
    tokens = np.maximum(m.sum(1), 1)
    geo = np.clip(lr.sum(1) / tokens, -SAFETY_BOUND, SAFETY_BOUND)
    add(
        "ms-swift",
        "chi2_seq",
        "mean_seq exp(mean_t log ρ_t)² − 1 (geometric mean)",
        float(np.mean(np.exp(2.0 * geo)) - 1.0),
    )
    ws = np.clip(rho, 1.0 / swift_threshold, swift_threshold)
    wsn = ws / (_mmean(ws, m) + 1e-8)
    add(
        "ms-swift",
        "ess",
        f"1 / mean_tok w̃², w clamped to [1/{swift_threshold:g}, {swift_threshold:g}] (a share)",
        1.0 / max(_mmean(wsn**2, m), 1e-10),
    )
    return rows


def lines(rows: list[dict]) -> list[str]:
    """Markdown table of :func:`dashboards` rows."""
    out = ["| tool | metric | definition | value |", "|---|---|---|---|"]
    for r in rows:
        definition = r["definition"].replace("|", "\\|")  # a pipe would split the cell
        out.append(f"| {r['tool']} | `{r['metric']}` | {definition} | {r['value']:.5g} |")
    return [*out, ""]
