"""The two legs of a dump and the divergence numbers of each.

π_old‖μ (trainer at rollout time vs rollout engine: the mismatch) and π‖π_old (trainer at
update time vs at rollout time: the staleness, when the dump has it); the mappings that act on
each (:data:`LEGS`), and :func:`leg_metrics`, the per-leg χ², KL, ESS, k̂, profile and tails
with the refusal rule (ESS < 30 or k̂ > 0.7). numpy only.
"""

from __future__ import annotations

import numpy as np

from simkit.diagnose.readers import LoadedRollouts

THRESHOLDS = (0.1, 0.5, 1.0, 2.0, 5.0)

#: corrections that act on the trainer–engine leg π_old‖μ (detached weights on π_old/μ)
MISMATCH_CORRECTIONS = (
    "naive",
    "is_token",
    "is_seq",
    "tis_token",
    "tis_seq",
    "mis_token",
    "mis_seq",
    "icepop",
    "geo_mask",
    "kl_rs",
)
#: surrogates that act on the ratio π/π_old (ranked only when the dump has π at update time)
STALENESS_SURROGATES = (
    "naive",
    "is_token",
    "is_seq",
    "ppo_clip",
    "dual_clip",
    "dapo",
    "gspo",
    "gmpo",
    "sapo",
    "cispo",
    "aspo",
    "luffy",
    "topr",
    "vespo",
    "m2po",
    "token_veto",
    "opsm",
    "clip_cov",
    "kl_cov",
)
#: the legs: key → (title, numerator / denominator roles, mappings that act on it)
LEGS = {
    "mismatch": ("π_old‖μ: trainer vs rollout engine", MISMATCH_CORRECTIONS),
    "staleness": ("π‖π_old: policy at update vs at rollout (staleness)", STALENESS_SURROGATES),
}
#: below this ESS of the sequence weights, or above this k̂, a leg is not ranked
MIN_ESS, MAX_KHAT = 30.0, 0.7


def leg_arrays(ro: LoadedRollouts) -> dict:
    """leg key → (log numerator, log denominator) per-token arrays, for the legs present."""
    legs = {"mismatch": (ro.log_pi, ro.log_mu)}
    if ro.log_pi_update is not None:
        legs["staleness"] = (ro.log_pi_update, ro.log_pi)
    return legs


def _boot_ratio(num, den, rng, n_boot=500, level=0.95):
    """Σnum/Σden with a percentile bootstrap interval over responses (rows)."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    idx = rng.integers(0, len(num), size=(n_boot, len(num)))
    b = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-300)
    tail = (1 - level) / 2
    lo, hi = np.quantile(b, [tail, 1 - tail])
    return float(num.sum() / den.sum()), float(lo), float(hi)


def leg_metrics(log_num, log_den, mask, seed: int = 0, rewards=None) -> dict:
    """The divergence numbers of one leg, w = exp(log_num − log_den) per valid token.

    ``chi2_tok``: the mean of (w − 1)², non-negative and unbiased for the per-token χ² when
    E[w | h] = 1 (full support: E[(w−1)²] = E[w²] − 1); ``chi2_tok_w2``: the mean of w² − 1
    (unbiased too, but can be negative at small χ²); ``mean_w``: the mean of w (1 up to noise
    without truncation); ``kl_k1``, ``kl_k3`` (KL of the denominator from the numerator's
    policy, Schulman 2020), ``kl_pi_mu`` (w log w); ``chi2_seq`` = mean of (W − 1)², W = Π_t w_t
    (non-negative), ESS (Kong 1992) and N/(1 + χ²), PSIS k̂ of W (Vehtari et al. 2024), the
    length profile, per-position χ², heavy-tail shares and quantiles of log w. Intervals: 95%
    percentile bootstrap over responses. ``rankable`` / ``refusal``: ESS ≥ 30 and k̂ ≤ 0.7, and
    (when ``rewards`` (N,) are given) not every logged reward equal: then the twin's ∇J is 0
    and no estimator has a scale-free error to rank."""
    from simkit.experiment import khat_of_weights

    rng = np.random.default_rng(seed)
    m = mask
    r = np.where(m, log_num - log_den, 0.0)
    tokens = m.sum(1).astype(float)
    with np.errstate(over="ignore"):
        w = np.exp(np.minimum(r, 700.0))
    out = {"N": int(m.shape[0]), "T": int(m.shape[1]), "tokens": int(tokens.sum())}
    per = {
        "chi2_tok": np.where(m, (w - 1.0) ** 2, 0.0).sum(1),
        "chi2_tok_w2": np.where(m, w * w - 1.0, 0.0).sum(1),
        "mean_w": np.where(m, w, 0.0).sum(1),
        "kl_k1": np.where(m, -r, 0.0).sum(1),
        "kl_k3": np.where(m, (w - 1.0) - r, 0.0).sum(1),
        "kl_pi_mu": np.where(m, w * r, 0.0).sum(1),
    }
    for key, num in per.items():
        v, lo, hi = _boot_ratio(num, tokens, rng)
        out[key] = {"value": v, "lo": lo, "hi": hi}
    logW = r.sum(1)
    with np.errstate(over="ignore"):
        W = np.exp(np.minimum(logW, 700.0))
    N = len(W)
    idx = rng.integers(0, N, size=(500, N))
    sq = (W - 1.0) ** 2
    chi2_b = sq[idx].mean(1)
    out["chi2_seq"] = {
        "value": float(np.mean(sq)),
        "lo": float(np.quantile(chi2_b, 0.025)),
        "hi": float(np.quantile(chi2_b, 0.975)),
    }
    out["ess_kong"] = float(W.sum() ** 2 / np.sum(W * W)) if np.sum(W * W) > 0 else 0.0
    out["ess_chi2"] = float(N / (1.0 + out["chi2_seq"]["value"]))
    out["khat_seq"] = float(khat_of_weights(W))
    out["mean_length"] = float(tokens.mean())
    running = m.mean(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        chi2_pos = np.where(
            m.sum(0) > 0, np.where(m, (w - 1.0) ** 2, 0.0).sum(0) / m.sum(0), np.nan
        )
    out["profile"] = {
        "running": [float(x) for x in running],
        "chi2_tok": [None if not np.isfinite(x) else float(x) for x in chi2_pos],
    }
    absr = np.abs(r[m])
    out["tail_share"] = {f"{t:g}": float(np.mean(absr > t)) for t in THRESHOLDS}
    out["tail_count"] = {f"{t:g}": int(np.sum(absr > t)) for t in THRESHOLDS}
    out["log_ratio_quantiles"] = {
        f"{q:g}": float(np.quantile(r[m], q)) for q in (0.001, 0.01, 0.5, 0.99, 0.999)
    }
    reasons = []
    if not np.any(r[m]):
        reasons.append(
            "the two log-prob columns are identical on every token (verl's bypass mode "
            "copies rollout_log_probs into old_log_probs): there is no second policy to compare"
        )
    if rewards is not None and np.ptp(np.asarray(rewards, dtype=float)) == 0:
        reasons.append(
            f"every logged reward is {float(np.asarray(rewards)[0]):g}: the twin's ∇J is 0, so "
            "no correction has an error relative to it (log a batch with some reward variance)"
        )
    if out["ess_kong"] < MIN_ESS:
        reasons.append(f"ESS of the sequence weights {out['ess_kong']:.1f} < {MIN_ESS:g}")
    if out["khat_seq"] > MAX_KHAT:  # NaN (no Pareto tail: repeated atoms) is not a refusal
        reasons.append(f"PSIS k̂ {out['khat_seq']:.2f} > {MAX_KHAT:g}")
    out["rankable"] = not reasons
    out["refusal"] = (
        None
        if not reasons
        else "not ranked: "
        + " and ".join(reasons)
        + (
            " (the twin's π is a self-normalised IS estimate: too few effective sequences, or "
            "sequence weights too heavy-tailed for their variance to be estimated)"
            if np.any(r[m])
            else ""
        )
    )
    return out
